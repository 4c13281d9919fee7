"""NaN in q, k or v reaches the output as it does in SDPA, never zeros or finite values in its place.

A NaN score makes the row's softmax normaliser NaN. The kernels once took "normaliser > 0" to mean "this row saw
a key" and wrote zeros otherwise, so a NaN in q or k (an fp16 overflow upstream, say) came out as a plausible
finite output. Now only a zero normaliser gives zeros. Stage 1 keeps NaN visible too: a block holding a NaN has
a NaN self-similarity, which is not above the threshold, so its row or column is forced on.

A product that the method skips (a block outside the mask, a P.V dropped by stage 2) never uses its values, so a
NaN there cannot show (the same holds for FlexAttention and any block-sparse kernel). The cases below therefore
place each NaN where the method must use it.

The rows that SDPA leaves finite must stay right as well: a row whose scores hold NaN or inf must not make stage 2
take a tile's P.V for negligible on behalf of the other rows of its query block (the float32 reference did until
session 76). A row whose every score is -inf gets zeros, as in SDPA, and a tile of -inf scores adds nothing (the
Triton and FSA kernels got these wrong until session 77), and in S2O a NaN row counts no gain in the stop test.
"""

import pytest
import torch

from sparge_diffusers import relative_l1
from sparge_diffusers.kernels import (attention_hopper, block_sparse_attention, s2o_attention, s2o_hopper,
                                      select_key_blocks, selected_block_attention, sparge_attention)
from sparge_diffusers.llm import pbs_sparge_attention
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv
from test_kernels import L1_TOL, dense_reference

CPU_BACKENDS = ["reference", "triton"]


def _non_finite_rows(out: torch.Tensor) -> torch.Tensor:
    """(B, H, N) bool: rows of an HND output holding any NaN or inf."""
    return ~torch.isfinite(out.float()).all(-1)


def _sdpa_non_finite_rows(q, k, v, is_causal: bool) -> torch.Tensor:
    return _non_finite_rows(dense_reference(q, k, v, is_causal, "HND"))


def _assert_matches_on_finite_rows(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """out is non-finite on exactly the rows where expected is, and within the dtype's relative L1 elsewhere."""
    out, expected = out.float(), expected.float()
    finite = torch.isfinite(expected).all(-1)
    assert torch.equal(_non_finite_rows(out), ~finite), f"{what}: non-finite rows differ from the expected ones"
    l1 = relative_l1(out[finite], expected[finite])
    assert l1 < L1_TOL[dtype], f"{what}: relative L1 {l1:.3g} on the finite rows"


def _with_nan(t: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    t = t.clone()
    t[index] = float("nan")
    return t


def _video(dtype, device, head_dim=64):
    # 3 text + 4 x 12 x 12 visual tokens: 5 query blocks and 10 key blocks, none of them full-length at the end
    return video_like_qkv((4, 12, 12), heads=2, head_dim=head_dim, text_tokens=3, dtype=dtype, device=device, seed=3)


def _check_video_sparge(backend, dtype, device, head_dim=64):
    q, k, v = _video(dtype, device, head_dim)
    _, stats = sparge_attention(q, k, v, return_sparsity=True, backend=backend)
    assert stats.sparsity > 0.1, "stage 1 must skip blocks here, or the test proves nothing about it"
    for name, nan_q, nan_k in [("q", _with_nan(q, (0, 1, 200, 5)), k), ("k", q, _with_nan(k, (0, 0, 300, 7)))]:
        out = sparge_attention(nan_q, nan_k, v, backend=backend)
        expected = _sdpa_non_finite_rows(nan_q, nan_k, v, False)
        assert expected.any(), name
        assert torch.equal(_non_finite_rows(out), expected), f"NaN in {name}: rows differ from SDPA's"


def _check_causal_entries(backend, dtype, device):
    """Causal GQA with NaN in a key, a value and a query: every entry point that reads them."""
    q, k, v = llm_like_qkv(300, heads=4, kv_heads=2, head_dim=64, dtype=dtype, device=device, seed=1)
    n_blocks = (300 + 63) // 64
    every_block = torch.arange(n_blocks, device=device).expand(1, 2, 300, n_blocks)
    dense_mask = torch.ones(1, 1, 3, 5, dtype=torch.bool, device=device)
    entries = {
        "block_sparse": lambda a, b, c: block_sparse_attention(a, b, c, dense_mask, is_causal=True, pvthreshd=None,
                                                               backend=backend),
        "s2o": lambda a, b, c: s2o_attention(a, b, c, is_causal=True, tau=None, backend=backend),
        "selected": lambda a, b, c: selected_block_attention(a, b, c, every_block, backend=backend),
        "sparge": lambda a, b, c: sparge_attention(a, b, c, is_causal=True, backend=backend),
    }
    cases = [("q", _with_nan(q, (0, 3, 150, 9)), k, v), ("k", q, _with_nan(k, (0, 1, 170, 2)), v),
             ("v", q, k, _with_nan(v, (0, 0, 240, 0)))]
    # NaN in v at key 240 of KV head 0: the rows that see it must be NaN. Rows of the same query tile that the
    # causal mask hides from it may be NaN as well (0 x NaN in the tile's P.V product, as in SDPA's math and
    # FlashAttention kernels); KV head 1's query heads never are.
    v_must = torch.zeros(1, 4, 300, dtype=torch.bool, device=device)
    v_must[0, :2, 240:] = True
    for entry, attend in entries.items():
        for name, a, b, c in cases:
            if entry == "sparge" and name == "v":
                continue  # stage 1 does not look at v: a block it skips may hold the NaN (see the module doc)
            got = _non_finite_rows(attend(a, b, c))
            if name == "v":
                assert got[v_must].all() and not got[0, 2:].any(), f"{entry}, NaN in v"
                continue
            expected = _sdpa_non_finite_rows(a, b, c, True)
            assert expected.any() and not expected.all(), name  # the causal mask hides it from earlier rows
            assert torch.equal(got, expected), f"{entry}, NaN in {name}: {int(got.sum())} NaN rows, " \
                                               f"SDPA {int(expected.sum())}"


def _check_stage_2_spares_the_other_rows(backend, dtype, device):
    """Stage 2 skips a tile's P.V when the largest row-max gap over the tile's rows is below -pvthreshd. A row whose
    scores hold NaN (NaN in its query, or in a key it sees) or inf has no meaningful gap: it must not make the tile
    look negligible to the other rows of its query block. The float32 reference once let it (a NaN gap compares
    False, so the tile's P.V was dropped): with a NaN in one query row, the other 127 rows of its block came out
    finite and wrong. Every block is kept here and pvthreshd=20 drops only weights below 2^-20, so each finite row
    must match SDPA. (At 24 or more the Triton kernel leaves the test out, ``api.PV_TEST_LIMIT``: until session 77
    this check used 50, which tested the reference's stage 2 alone.)"""
    q, k, v = llm_like_qkv(300, heads=4, kv_heads=2, head_dim=64, dtype=dtype, device=device, seed=1)
    every_block = torch.ones(1, 1, 3, 5, dtype=torch.bool, device=device)
    entries = {
        "block_sparse": lambda a, b, c, causal: block_sparse_attention(a, b, c, every_block, is_causal=causal,
                                                                       pvthreshd=20, backend=backend),
        "s2o": lambda a, b, c, causal: s2o_attention(a, b, c, is_causal=causal, tau=None, pvthreshd=20,
                                                     backend=backend),
        "pbs": lambda a, b, c, causal: pbs_sparge_attention(a, b, c, segment=128, cdfthreshd=1.0, pvthreshd=20,
                                                            backend=backend),
    }
    inf_q = q.clone()
    inf_q[0, 3, 150, 9] = float("inf")
    # every query of KV head 1 scores +inf on key 290, in the last tile, which then has only rows without a finite
    # max: stage 2 skips its P.V, and the rows must still come out NaN (the reference once gave zeros: it rescaled a
    # +inf running max to 0, as it does a row that has seen no key, so the normaliser was inf, not NaN)
    positive_q = q.clone()
    positive_q[:, 2:, :, 9] = positive_q[:, 2:, :, 9].abs() + 0.1
    inf_k = k.clone()
    inf_k[0, 1, 290, 9] = float("inf")
    cases = [("NaN in q", _with_nan(q, (0, 3, 150, 9)), k, False), ("NaN in q", _with_nan(q, (0, 3, 150, 9)), k, True),
             ("inf in q", inf_q, k, False), ("NaN in k", q, _with_nan(k, (0, 1, 170, 2)), True),
             ("+inf scores", positive_q, inf_k, False)]
    for entry, attend in entries.items():
        for name, a, b, causal in cases:
            if entry == "pbs" and not causal:
                continue  # PBS-Attn is causal only
            _assert_matches_on_finite_rows(attend(a, b, v, causal), dense_reference(a, b, v, causal, "HND"), dtype,
                                           f"{entry}, {name}, causal={causal}")


def _check_stage_2_decides_as_the_reference(dtype, device):
    """With NaN in q or k and a threshold at which stage 2 skips tiles, the Triton kernel and the float32 reference
    skip the same P.V products and give the same rows: both take a row's max over its non-NaN scores (the kernel's
    tl.max ignores NaN) and leave rows without a finite max out of the tile's test. On a GPU a decision on the
    threshold may flip with the order of the float32 sums, so there the rows are compared by relative L1 alone."""
    q, k, v = _video(dtype, device)
    _, clean = block_sparse_attention(q, k, v, None, pvthreshd=1, return_sparsity=True, backend="reference")
    assert clean.pv_skipped.min() > 0.05, "stage 2 must skip tiles here, or the test proves nothing about it"
    for name, a, b in [("q", _with_nan(q, (0, 1, 200, 5)), k), ("k", q, _with_nan(k, (0, 0, 300, 7)))]:
        runs = {backend: block_sparse_attention(a, b, v, None, pvthreshd=1, return_sparsity=True, backend=backend)
                for backend in ("reference", "triton" if device == "cpu" else "auto")}
        (expected, expected_stats), (out, stats) = runs.values()
        if device == "cpu":
            assert torch.equal(stats.pv_skipped, expected_stats.pv_skipped), f"NaN in {name}: P.V products skipped"
        _assert_matches_on_finite_rows(out, expected, dtype, f"NaN in {name} (against the reference)")


def _check_selection_keeps_nan_blocks(backend, dtype, device):
    """FSA's per-query selection (``select_key_blocks``) with ``top_k`` as large as the visible blocks selects them
    all, NaN or not, so every row matches SDPA: NaN where SDPA's is, exact elsewhere. A NaN importance (NaN in one
    query head, or in a key the token sees) must count as kept; the reference once turned it into -1 (no block):
    with NaN in key 170, 216 of SDPA's 260 NaN rows came out finite, and the group's other query head lost a block
    for the token whose query held the NaN."""
    q, k, v = llm_like_qkv(300, heads=4, kv_heads=2, head_dim=64, dtype=dtype, device=device, seed=1)
    for name, a, b in [("q", _with_nan(q, (0, 0, 150, 9)), k), ("k", q, _with_nan(k, (0, 0, 170, 2)))]:
        chosen = select_key_blocks(a, b, top_k=5, backend=backend)  # 300 keys: 5 blocks of 64
        _assert_matches_on_finite_rows(selected_block_attention(a, b, v, chosen, backend=backend),
                                       dense_reference(a, b, v, True, "HND"), dtype, f"NaN in {name} (against SDPA)")


def _all_negative_inf_cases(q, k):
    """Inputs under which some rows score -inf on every key of a tile. "inf in q": rows 5 and 150 of head 3 hold
    +inf in dim 9 and every key of their KV head a negative dim 9, so the rows score -inf on every key. Row 5 sees
    only its diagonal tile under causal masking, a tile that needs element masking. "-inf keys": keys 0-63 of KV
    head 1 hold -inf in dim 9 and its queries a positive dim 9, so those rows score -inf on the first key block
    and finite scores elsewhere (under causal masking rows 0-63 see nothing else). A negative offset in dim 10 (q
    1, k -60 on every token: a constant per row, which the softmax does not see) makes every finite score small,
    so a block that wrongly adds weight to the normaliser shows."""
    q, k = q.clone(), k.clone()
    q[..., 10], k[..., 10] = 1.0, -60.0
    inf_q, negative_k = q.clone(), k.clone()
    inf_q[0, 3, [5, 150], 9] = float("inf")
    negative_k[0, 1, :, 9] = -(negative_k[0, 1, :, 9].abs() + 0.1)
    positive_q, inf_k = q.clone(), k.clone()
    positive_q[0, 2:, :, 9] = positive_q[0, 2:, :, 9].abs() + 0.1
    inf_k[0, 1, :64, 9] = float("-inf")
    return [("inf in q", inf_q, negative_k), ("-inf keys", positive_q, inf_k)]


def _check_rows_without_a_finite_score(backend, dtype, device):
    """A row whose every visible score is -inf gets zeros, as in SDPA (torch's safe softmax; FlashAttention's
    kernels do the same), like a row that sees no key; a tile of -inf scores adds nothing to a row. Until
    session 77: the Triton kernel gave NaN where such a tile needed no element masking, even when later tiles
    brought finite scores (here 600 of 1200 rows NaN with the -inf keys); FSA's KV-outer kernel weighed such a
    block as one key scoring 0, which the small scores here make show (relative L1 0.13-0.17); FSA's reference
    gave NaN (a plain softmax)."""
    q, k, v = llm_like_qkv(300, heads=4, kv_heads=2, head_dim=64, dtype=dtype, device=device, seed=1)
    every_block = torch.ones(1, 1, 3, 5, dtype=torch.bool, device=device)
    every_key_block = torch.arange(5, device=device).expand(1, 2, 300, 5)
    entries = {
        "block_sparse": lambda a, b, c, causal: block_sparse_attention(a, b, c, every_block, is_causal=causal,
                                                                       pvthreshd=None, backend=backend),
        "stage_2": lambda a, b, c, causal: block_sparse_attention(a, b, c, every_block, is_causal=causal,
                                                                  pvthreshd=20, backend=backend),
        "s2o": lambda a, b, c, causal: s2o_attention(a, b, c, is_causal=causal, tau=None, backend=backend),
        "pbs": lambda a, b, c, causal: pbs_sparge_attention(a, b, c, segment=128, cdfthreshd=1.0, backend=backend),
        "selected": lambda a, b, c, causal: selected_block_attention(a, b, c, every_key_block, is_causal=causal,
                                                                     backend=backend),
    }
    for name, a, b in _all_negative_inf_cases(q, k):
        for causal in (False, True):
            # torch's SDPA on the CPU: its safe softmax gives zeros for a row of -inf scores
            expected = dense_reference(a.cpu(), b.cpu(), v.cpu(), causal, "HND")
            assert torch.isfinite(expected).all(), (name, causal)
            zero = (expected == 0).all(-1)
            if name == "inf in q" or causal:
                assert zero.any(), (name, causal)
            for entry, attend in entries.items():
                if entry == "pbs" and not causal:
                    continue  # PBS-Attn is causal only
                out = attend(a, b, v, causal).float().cpu()
                where = f"{entry}, {name}, causal={causal}"
                assert not _non_finite_rows(out).any(), f"{where}: {int(_non_finite_rows(out).sum())} rows not finite"
                assert (out[zero] == 0).all(), f"{where}: rows without a finite score are not zero"
                l1 = relative_l1(out, expected)
                assert l1 < L1_TOL[dtype], f"{where}: relative L1 {l1:.3g}"


def _check_s2o_stop_test_ignores_nan_rows(backend, dtype, device):
    """S2O stops a query block's walk once the mean over its rows of the last tile's relative gain in the
    normaliser falls below tau. A row whose normaliser is NaN has no gain to offer: it counts zero, so a NaN in one
    query row leaves the walk as it is without it (here: the same share of blocks skipped in each head, 0.22 and
    0.26 on the CPU). Until session 77 such a row counted infinite (its block never stopped); one whose NaN came
    with the tested tile made the mean NaN and stopped its block at that test."""
    q, k, v = _video(dtype, device)
    walk = dict(tau=0.05, check_every=2, return_sparsity=True, backend=backend)
    _, clean = s2o_attention(q, k, v, **walk)
    assert clean.qk_skipped.max() > 0.1, "the walk must stop early here, or the test proves nothing about it"
    nan_q = _with_nan(q, (0, 1, 200, 5))
    out, stats = s2o_attention(nan_q, k, v, **walk)
    assert torch.equal(stats.qk_skipped, clean.qk_skipped), \
        f"{stats.qk_skipped.tolist()} of the blocks skipped, {clean.qk_skipped.tolist()} without the NaN"
    assert torch.equal(_non_finite_rows(out), _sdpa_non_finite_rows(nan_q, k, v, False))


def _check_s2o_stop_test_counts_a_row_without_a_finite_score_as_no_gain(backend, dtype, device):
    """A row whose scores are -inf on every key (+inf in its q against keys negative in that dim) has a zero
    normaliser before and after each tile: no gain, as a NaN row has. So the walk decides as with a NaN in the same
    row. An infinite gain for it (``l >= 0`` for ``l > 0`` in the gain's last branch) keeps its query block from
    ever stopping. ``check_every`` 4: on an H100 with ``auto`` the Gluon walk runs this (it takes even intervals
    from 4)."""
    q, k, v = _video(dtype, device)
    k = k.clone()
    k[0, 1, :, 9] = -(k[0, 1, :, 9].abs() + 0.1)
    walk = dict(tau=0.05, check_every=4, return_sparsity=True, backend=backend)
    _, clean = s2o_attention(q, k, v, **walk)
    assert clean.qk_skipped.max() > 0.1, "the walk must stop early here, or the test proves nothing about it"
    _, nan_row = s2o_attention(_with_nan(q, (0, 1, 200, 5)), k, v, **walk)
    inf_q = q.clone()
    inf_q[0, 1, 200, 9] = float("inf")
    out, stats = s2o_attention(inf_q, k, v, **walk)
    assert (out[0, 1, 200] == 0).all(), "a row without a finite score gets zeros, as in SDPA"
    assert torch.equal(stats.qk_skipped, nan_row.qk_skipped), \
        f"{stats.qk_skipped.tolist()} of the blocks skipped, {nan_row.qk_skipped.tolist()} with a NaN in that row"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_in_q_or_k_reaches_the_output_through_stage_1(backend, dtype):
    _check_video_sparge(backend, dtype, "cpu")


def test_stage_2_skips_the_same_tiles_as_the_reference_with_nan_inputs():
    _check_stage_2_decides_as_the_reference(torch.float16, "cpu")


# The checks that take a backend, on the CPU: the Triton kernels in the interpreter, and the float32 reference.
CPU_CHECKS = {
    "nan_reaches_every_causal_entry_point": _check_causal_entries,
    "a_nan_or_inf_row_does_not_make_stage_2_skip_the_other_rows": _check_stage_2_spares_the_other_rows,
    "fsa_selection_keeps_the_blocks_whose_importance_is_nan": _check_selection_keeps_nan_blocks,
    "a_row_of_negative_inf_scores_gets_zeros_and_a_negative_inf_tile_adds_nothing": _check_rows_without_a_finite_score,
    "s2o_stop_test_counts_a_nan_row_as_no_gain": _check_s2o_stop_test_ignores_nan_rows,
    "s2o_stop_test_counts_a_row_without_a_finite_score_as_no_gain":
        _check_s2o_stop_test_counts_a_row_without_a_finite_score_as_no_gain,
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("check", list(CPU_CHECKS))
def test_non_finite_inputs(check, backend):
    CPU_CHECKS[check](backend, torch.float16, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("hopper", [False, None], ids=["triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_without_a_finite_score_and_s2o_nan_rows_on_gpu(dtype, hopper, monkeypatch):
    """On an H100 "auto" runs the Hopper kernels where they can (block_sparse, s2o, pbs), "triton" never."""
    monkeypatch.setattr(attention_hopper, "OVERRIDE", hopper)
    monkeypatch.setattr(s2o_hopper, "OVERRIDE", hopper)
    _check_rows_without_a_finite_score("auto", dtype, "cuda")
    _check_s2o_stop_test_ignores_nan_rows("auto", dtype, "cuda")
    _check_s2o_stop_test_counts_a_row_without_a_finite_score_as_no_gain("auto", dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])  # 128 runs the Hopper kernel on an H100
def test_nan_reaches_the_output_on_gpu(dtype, head_dim):
    _check_video_sparge("auto", dtype, "cuda", head_dim)
    if head_dim == 64:
        _check_stage_2_decides_as_the_reference(dtype, "cuda")
        _check_causal_entries("auto", dtype, "cuda")
        _check_stage_2_spares_the_other_rows("auto", dtype, "cuda")
        _check_selection_keeps_nan_blocks("auto", dtype, "cuda")
