"""Causal masking with unequal query and key lengths (``causal_variant``): the lower-right alignment of
FlashAttention and chunked prefill, and SDPA's upper-left one. Triton kernels run in the interpreter against the
float32 reference, and the reference against an element-wise mask written independently here."""

import math

import pytest
import torch

from sparge_diffusers import (BLOCK_K, BLOCK_Q, PermutedKeys, block_sparse_attention, compact_block_mask,
                              predict_block_mask, relative_l1, s2o_attention, select_key_blocks,
                              selected_block_attention, sparge_attention, sparge_attention_op)
from sparge_diffusers.kernels._inputs import check_attention_inputs
from sparge_diffusers.kernels.attention import dense_block_n
from sparge_diffusers.kernels.reference import reference_prediction_details
from sparge_diffusers.kernels.stats import dense_block_count
from sparge_diffusers.testing import llm_like_qkv
from test_kernels import L1_TOL, make_qkv
from test_s2o import order_for

# Nq, Nkv, variant: offsets that are not multiples of a block (the diagonal then straddles three 64-key blocks),
# a query block shorter than one block, more queries than keys both ways (lower-right: rows with no key)
CASES = [
    (77, 300, "lower_right"),
    (200, 333, "lower_right"),
    (64, 1000, "lower_right"),
    (130, 500, "upper_left"),
    (300, 130, "lower_right"),
    (300, 130, "upper_left"),
]


def offset_of(nq, nkv, variant):
    return nkv - nq if variant == "lower_right" else 0


def element_mask(nq, nkv, variant):
    """(Nq, Nkv) bool: query i sees key j, written from the variants' definitions (not from the package)."""
    if variant == "lower_right":
        return torch.ones(nq, nkv, dtype=torch.bool).tril(diagonal=nkv - nq)
    return torch.ones(nq, nkv, dtype=torch.bool).tril()


def masked_sdpa(q, k, v, allowed, layout="HND"):
    """Float32 attention under an element mask; rows that see no key are zero."""
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    out = p @ v
    return out if layout == "HND" else out.transpose(1, 2)


@pytest.mark.parametrize("Nq,Nkv,variant", CASES)
def test_reference_equals_attention_under_the_element_mask(Nq, Nkv, variant):
    q, k, v = make_qkv(1, 4, 2, Nq, Nkv, 64, torch.float32, "HND", seed=Nq + Nkv)
    expected = masked_sdpa(q, k, v, element_mask(Nq, Nkv, variant))
    full = torch.ones(1, 1, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K), dtype=torch.bool)
    for mask in (None, full):
        out = block_sparse_attention(q, k, v, mask, is_causal=True, causal_variant=variant, backend="reference")
        assert relative_l1(out, expected) < 1e-5
    out = sparge_attention(q, k, v, is_causal=True, causal_variant=variant, cdfthreshd=1.0, pvthreshd=None)
    assert relative_l1(out, expected) < 1e-5
    if variant == "lower_right" and Nq > Nkv:
        assert (out[:, :, :Nq - Nkv] == 0).all(), "rows before the first key see nothing: zeros, not NaN"


@pytest.mark.parametrize("Nq,Nkv,variant", CASES)
@pytest.mark.parametrize("D", [64, 128])  # 128: mask walks pair blocks into 128-key tiles, the dense walk too
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_reference(Nq, Nkv, variant, D, layout, dtype):
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, D, dtype, layout, seed=Nq * 3 + Nkv + D)
    g = torch.Generator().manual_seed(Nq)
    mask = torch.rand(2, 4, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K), generator=g) < 0.6
    kw = dict(is_causal=True, causal_variant=variant, tensor_layout=layout, return_sparsity=True)
    for block_mask in (mask, None):
        for pvthreshd in ((None, 4.0) if block_mask is not None else (None,)):
            out, stats = block_sparse_attention(q, k, v, block_mask, pvthreshd=pvthreshd, backend="triton",
                                                out=torch.full_like(q, float("nan")), **kw)
            ref, ref_stats = block_sparse_attention(q, k, v, block_mask, pvthreshd=pvthreshd, backend="reference",
                                                    **kw)
            assert not torch.isnan(out).any(), "every output element must be written, and never NaN"
            assert relative_l1(out, ref) < L1_TOL[dtype], (block_mask is None, pvthreshd)
            torch.testing.assert_close(stats.qk_skipped, ref_stats.qk_skipped)
            torch.testing.assert_close(stats.pv_skipped, ref_stats.pv_skipped)
    dense = block_sparse_attention(q, k, v, None, is_causal=True, causal_variant=variant, tensor_layout=layout)
    expected = masked_sdpa(q, k, v, element_mask(Nq, Nkv, variant), layout)
    assert relative_l1(dense, expected) < L1_TOL[dtype]


# (200, 327): an offset of 127, so that a key block ends exactly at a query block's first position (seen whole, not
# in part: the reference's rule for blocks to keep had to say so too)
@pytest.mark.parametrize("Nq,Nkv,variant", CASES + [(200, 327, "lower_right")])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_predicted_mask_matches_reference_and_keeps_the_diagonal(Nq, Nkv, variant, layout):
    q, k, _ = make_qkv(1, 4, 2, Nq, Nkv, 64, torch.float16, layout, seed=Nq + 5 * Nkv)
    q, k = q + 1.0, k + 1.5  # a shared mean: self-similar blocks, so TopCdf selects
    theta, tau = torch.linspace(-0.5, 0.5, 4), torch.linspace(0.3, 0.9, 4)
    kw = dict(is_causal=True, causal_variant=variant, simthreshd1=theta, cdfthreshd=tau, tensor_layout=layout)
    mask = predict_block_mask(q, k, backend="triton", **kw)
    offset = offset_of(Nq, Nkv, variant)
    details = reference_prediction_details(q, k, scale=64 ** -0.5, simthreshd1=theta, cdfthreshd=tau,
                                           attention_sink=False, is_causal=True, tensor_layout=layout,
                                           causal_offset=offset)
    borderline = (details["mass"] - tau.view(1, 4, 1, 1)).abs() < 1e-4
    assert ((mask != details["mask"]) & ~borderline).sum() == 0
    # independent of the package: the blocks some query of the block sees, and those it sees only in part
    seen = element_mask(Nq, Nkv, variant)
    nq, nk = mask.shape[-2:]
    visible = torch.zeros(nq, nk, dtype=torch.bool)
    partly = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            tile = seen[i * BLOCK_Q:(i + 1) * BLOCK_Q, j * BLOCK_K:(j + 1) * BLOCK_K]
            visible[i, j], partly[i, j] = tile.any(), tile.any() and not tile.all()
    assert not (mask & ~visible).any(), "no block that no query of the block sees"
    assert (mask | ~partly).all(), "the diagonal blocks (seen in part) are always kept"
    assert (mask.any(-1) == visible.any(-1)).all(), "every query block that sees a key keeps a block"


# (191, 256): the last query block is partial and its last row (position 190) sits two positions before a key block
# (a last-row position two too far walked that block, fully masked, and counted it)
@pytest.mark.parametrize("Nq,Nkv,variant", CASES + [(191, 256, "upper_left")])
def test_statistics_count_the_blocks_dense_attention_computes(Nq, Nkv, variant):
    q, k, v = make_qkv(1, 2, 2, Nq, Nkv, 64, torch.float16, "HND", seed=1)
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=True, causal_variant=variant)
    assert shape.causal_offset == offset_of(Nq, Nkv, variant)
    seen = element_mask(Nq, Nkv, variant)
    nq, nk = math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K)
    padded = torch.zeros(nq * BLOCK_Q, nk * BLOCK_K, dtype=torch.bool)
    padded[:Nq, :Nkv] = seen
    assert dense_block_count(shape, True) == int(padded.view(nq, BLOCK_Q, nk, BLOCK_K).any(3).any(1).sum())
    _, stats = block_sparse_attention(q, k, v, None, is_causal=True, causal_variant=variant, return_sparsity=True,
                                      backend="triton")
    assert float(stats.sparsity) == 0.0, "the dense walk skips nothing that dense attention computes"


def _dense_walk_at_a_tile_edge(D, edge, device):
    """(q, k, v, row, key, seen) in fp16 HND: a lower-right call whose offset puts query block 0's last row (row 127)
    on the first key of a key tile of the dense walk (offset 1: key 128, which the row must see), or its first row
    (row 0) one key before a tile's last key (offset = tile width - 2: that key is in the row's future). Key ``key``
    is made to dominate row ``row``'s scores, so whether the row attends it changes the row whole."""
    width = dense_block_n(D)
    offset = 1 if edge == "last_row_on_a_tile_start" else width - 2
    row, key, seen = (127, 128, True) if offset == 1 else (0, width - 1, False)
    g = torch.Generator().manual_seed(5 + offset)
    q, k, v = (torch.randn(1, 2, n, D, generator=g) for n in (200, 200 + offset, 200 + offset))
    k[:, :, key] = q[:, :, row] * 4.0  # a score of ~4 |q|^2 / sqrt(D) ~ 4 sqrt(D): weight ~1 where seen
    return *(t.half().to(device) for t in (q, k, v)), row, key, seen


def _assert_tile_edge_key(out, q, k, v, row, key, seen):
    out, q, k, v = (t.float().cpu() for t in (out, q, k, v))
    expected = masked_sdpa(q, k, v, element_mask(q.shape[2], k.shape[2], "lower_right"))
    assert (out - expected).abs().max() < 2e-2
    assert ((out[:, :, row] - v[:, :, key]).abs().max() < 0.1) == seen, "the row attends the key iff it sees it"


# The dense causal walk's tile extent (``attention._dense_row_extent``, restated by the Hopper kernel's
# ``_row_extent``): a last row one key into a tile (a walk ending a key early drops that tile), and a first row one key
# short of a tile's end (a rule one key generous takes that tile without element masking). No CASES offset is 1 or
# a tile width - 2 (modulo 64 and 128), and a relative L1 over all rows hides one key of one row
@pytest.mark.parametrize("edge", ["last_row_on_a_tile_start", "first_row_before_a_tile_end"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_dense_causal_walk_takes_a_tile_edge_key_exactly_when_the_row_sees_it(backend, D, edge):
    q, k, v, row, key, seen = _dense_walk_at_a_tile_edge(D, edge, "cpu")
    out = block_sparse_attention(q, k, v, None, is_causal=True, causal_variant="lower_right", backend=backend,
                                 out=torch.full_like(q, float("nan")))
    _assert_tile_edge_key(out, q, k, v, row, key, seen)


def test_lower_right_chunks_reproduce_the_causal_prompt():
    """Chunked prefill: each chunk of queries against every key so far (lower-right) gives the rows of one causal
    call over the whole prompt; keeping every block, in the interpreter."""
    N, chunk = 700, 256
    q, k, v = make_qkv(1, 4, 2, N, N, 128, torch.float16, "HND", seed=3)
    whole = sparge_attention(q, k, v, is_causal=True, cdfthreshd=1.0, pvthreshd=None, backend="triton")
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        part = sparge_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], is_causal=True,
                                causal_variant="lower_right", cdfthreshd=1.0, pvthreshd=None, backend="triton")
        assert relative_l1(part, whole[:, :, start:stop]) < 2e-3, start


def test_custom_operator_takes_the_variant():
    q, k, v = make_qkv(1, 2, 1, 90, 260, 64, torch.float32, "HND", seed=2)
    kw = dict(is_causal=True, causal_variant="lower_right", simthreshd1=-1.0, cdfthreshd=0.7)
    assert torch.equal(sparge_attention_op(q, k, v, **kw), sparge_attention(q, k, v, **kw))
    compiled = torch.compile(lambda q, k, v: sparge_attention_op(q, k, v, **kw), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), sparge_attention(q, k, v, **kw))


def test_errors_name_the_problem():
    q, k, v = make_qkv(1, 2, 2, 100, 300, 64, torch.float16, "HND", seed=0)
    cases = [
        (lambda: sparge_attention(q, k, v, is_causal=True), "causal_variant='lower_right'"),
        (lambda: sparge_attention(q, k, v, causal_variant="lower_right"), "needs is_causal=True"),
        (lambda: sparge_attention(q, k, v, is_causal=True, causal_variant="bottom_right"), "must be 'upper_left'"),
        # S2O and FSA take the variants too, so they ask for one, as sparge_attention does
        (lambda: s2o_attention(q, k, v, is_causal=True), "causal_variant='lower_right'"),
        (lambda: select_key_blocks(q, k, top_k=2, is_causal=True), "causal_variant='lower_right'"),
        (lambda: selected_block_attention(q, k, v, torch.zeros(1, 2, 100, 1, dtype=torch.int32), is_causal=True),
         "causal_variant='lower_right'"),
        # permuted keys cover the keys, not the queries
        (lambda: sparge_attention(q, k, v, is_causal=True, causal_variant="lower_right",
                                  permuted_keys=PermutedKeys(torch.arange(100).view(1, 1, -1), 64)),
         r"positions has shape \(1, 1, 100\), expected \(1, 2 or 1, 300\)"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    for backend in ("triton", "reference"):
        mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
        cm = compact_block_mask(mask, q, k, is_causal=True, causal_variant="lower_right", backend=backend)
        block_sparse_attention(q, k, v, cm, is_causal=True, causal_variant="lower_right", backend=backend)
        with pytest.raises(ValueError, match="causal offset"):
            block_sparse_attention(q, k, v, cm, is_causal=True, causal_variant="upper_left", backend=backend)
    # equal lengths: both variants are plain causal attention, and the same mask serves both
    qe, ke, ve = make_qkv(1, 2, 2, 200, 200, 64, torch.float16, "HND", seed=1)
    cm = compact_block_mask(torch.ones(1, 1, 2, 4, dtype=torch.bool), qe, ke, is_causal=True)
    base = block_sparse_attention(qe, ke, ve, cm, is_causal=True)
    for variant in ("lower_right", "upper_left"):
        assert torch.equal(block_sparse_attention(qe, ke, ve, cm, is_causal=True, causal_variant=variant), base)


@pytest.mark.parametrize("Nq,Nkv,variant", CASES)
@pytest.mark.parametrize("segment", [128, 256])
def test_s2o_visit_order_with_variants(Nq, Nkv, variant, segment):
    """Each block some query of the block sees is visited once; the blocks it sees in part, and those of the
    segment of its first position, come first; the Triton order equals PyTorch's on the same scores."""
    from sparge_diffusers.kernels.s2o import _visit_order_torch, _visit_order_triton

    q, k, _ = make_qkv(1, 4, 2, Nq, Nkv, 64, torch.float32, "HND", seed=Nq + 7 * Nkv)
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=True, causal_variant=variant)
    index, n_unmasked, n_forced, count = order_for(q, k, True, theta=0.3, segment=segment, causal_variant=variant)[1]
    seen = element_mask(Nq, Nkv, variant)
    offset = offset_of(Nq, Nkv, variant)
    for h in range(4):
        for i in range(math.ceil(Nq / BLOCK_Q)):
            tiles = [seen[i * BLOCK_Q:(i + 1) * BLOCK_Q, j * BLOCK_K:(j + 1) * BLOCK_K]
                     for j in range(math.ceil(Nkv / BLOCK_K))]
            visible = [j for j, t in enumerate(tiles) if t.any()]
            c, f, u = int(count[0, h, i]), int(n_forced[0, h, i]), int(n_unmasked[0, h, i])
            walk = index[0, h, i, :c].tolist()
            assert sorted(walk) == visible, "each visible block once"
            partly = [j for j in visible if not tiles[j][:, :min(BLOCK_K, Nkv - j * BLOCK_K)].all()]
            assert set(partly) <= set(walk[u:f]), "blocks seen in part: forced, with element masking"
            start = max(i * BLOCK_Q + offset, 0) // segment * segment
            assert {j for j in visible if j * BLOCK_K >= start} <= set(walk[:f]), "own segment forced"
    g = torch.Generator().manual_seed(Nq)
    scores = (torch.randn(1, 4, shape.q_blocks, shape.k_blocks, generator=g) * 4).round() / 4
    q_sim, k_sim = torch.rand(1, 4, shape.q_blocks, generator=g), torch.rand(1, 2, shape.k_blocks, generator=g)
    kw = dict(is_causal=True, simthreshd1=torch.full((4,), 0.2), segment=segment, attention_sink=True)
    for name, a, b in zip(("index", "n_unmasked", "n_forced", "count"),
                          _visit_order_triton(scores, q_sim, k_sim, shape, **kw),
                          _visit_order_torch(scores, q_sim, k_sim, shape, **kw)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("Nq,Nkv,variant", CASES)
def test_s2o_reference_visiting_everything_is_attention_under_the_element_mask(Nq, Nkv, variant):
    q, k, v = make_qkv(1, 4, 2, Nq, Nkv, 64, torch.float32, "HND", seed=Nq + Nkv)
    expected = masked_sdpa(q, k, v, element_mask(Nq, Nkv, variant))
    for tau in (0.0, None):
        out, stats = s2o_attention(q, k, v, is_causal=True, causal_variant=variant, tau=tau, segment=128,
                                   return_sparsity=True)
        assert relative_l1(out, expected) < 1e-5
        assert float(stats.sparsity) == 0.0, "visits exactly the blocks dense causal attention computes"
    if variant == "lower_right" and Nq > Nkv:
        assert (out[:, :, :Nq - Nkv] == 0).all()


@pytest.mark.parametrize("Nq,Nkv,variant", CASES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_s2o_triton_matches_reference(Nq, Nkv, variant, layout, dtype):
    """The ordered walk in the interpreter against its reference on the same order: visiting everything, and
    stopping early, with stage 2's PV skip; rows before the first key are zeros."""
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, 64, dtype, layout, seed=Nq * 5 + Nkv)
    q = q + 0.5  # a shared direction: self-similar blocks, so blocks are ranked (and stops can happen)
    order = order_for(q, k, True, theta=-1.0, segment=128, sink=True, layout=layout, causal_variant=variant)[1]
    for tau, pvthreshd, check_every in ((0.0, None, 16), (0.3, None, 1), (0.2, 4.0, 2)):
        kw = dict(is_causal=True, causal_variant=variant, tau=tau, pvthreshd=pvthreshd, check_every=check_every,
                  segment=128, tensor_layout=layout, return_sparsity=True, order=order)
        out, stats = s2o_attention(q, k, v, backend="triton", out=torch.full_like(q, float("nan")), **kw)
        ref, ref_stats = s2o_attention(q, k, v, backend="reference", **kw)
        assert not torch.isnan(out).any(), "every output element must be written, and never NaN"
        assert relative_l1(out, ref) < L1_TOL[dtype], (tau, pvthreshd)
        torch.testing.assert_close(stats.qk_skipped, ref_stats.qk_skipped)
        torch.testing.assert_close(stats.pv_skipped, ref_stats.pv_skipped)
        if variant == "lower_right" and Nq > Nkv:
            rows = out[:, :, :Nq - Nkv] if layout == "HND" else out[:, :Nq - Nkv]
            assert (rows == 0).all()


def test_s2o_stops_alike_with_a_query_block_before_the_first_key():
    """A lower-right chunk with one query block more than keys: that block sees nothing (zeros), and every other
    block sits at the same positions as in the plain causal call, so the early stops visit the same tiles."""
    q, k, v = llm_like_qkv(1024, heads=2, kv_heads=2, head_dim=64, dtype=torch.float32, seed=4)
    kw = dict(is_causal=True, tau=0.05, check_every=1, segment=128, simthreshd1=-1.0, return_sparsity=True)
    _, whole = s2o_attention(q, k, v, **kw)
    padded_q = torch.cat([torch.randn(1, 2, 128, 64), q], dim=2)  # one more query block, all before key 0
    out, padded = s2o_attention(padded_q, k, v, causal_variant="lower_right", **kw)
    assert (out[:, :, :128] == 0).all()
    assert float(whole.sparsity) > 0.1, "the test needs early stops"
    assert float(padded._qk.sum()) == float(whole._qk.sum()), "the same tiles visited"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_s2o_lower_right_chunks_reproduce_the_causal_prompt(backend):
    N, chunk = 700, 256
    q, k, v = make_qkv(1, 4, 2, N, N, 64, torch.float16, "HND", seed=8)
    kw = dict(is_causal=True, tau=0.0, segment=256, backend=backend)
    whole = s2o_attention(q, k, v, **kw)
    for start in range(0, N, chunk):
        stop = min(start + chunk, N)
        part = s2o_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], causal_variant="lower_right", **kw)
        assert relative_l1(part, whole[:, :, start:stop]) < 2e-3, start


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_kernels_match_reference(D):
    """Both GPU kernels (the Hopper kernel where it runs: D 64/128 mask walks, D 128 dense) against the
    reference, per call and prebuilt, dense and masked, bf16."""
    for Nq, Nkv, variant in CASES + [(1000, 3000, "lower_right"), (2048, 4100, "lower_right"),
                                     (3000, 1000, "lower_right"), (700, 2000, "upper_left")]:
        q, k, v = (t.cuda() for t in make_qkv(1, 8, 2, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + Nkv))
        g = torch.Generator().manual_seed(Nkv)
        mask = (torch.rand(1, 8, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K), generator=g) < 0.4).cuda()
        kw = dict(is_causal=True, causal_variant=variant)
        cm = compact_block_mask(mask, q, k, **kw)
        for block_mask in (None, mask, cm):
            out = block_sparse_attention(q, k, v, block_mask, out=torch.full_like(q, float("nan")), **kw)
            ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), None if block_mask is None else mask.cpu(),
                                         backend="reference", **kw)
            assert not torch.isnan(out).any()
            assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16], (Nq, Nkv, variant, type(block_mask))
        out = sparge_attention(q, k, v, out=torch.full_like(q, float("nan")), **kw)
        assert not torch.isnan(out).any()
        predicted = predict_block_mask(q, k, **kw)
        ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), predicted.cpu(), backend="reference", **kw)
        assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16]
        if variant == "lower_right" and Nq > Nkv:
            assert (out[:, :, :Nq - Nkv] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("edge", ["last_row_on_a_tile_start", "first_row_before_a_tile_end"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_dense_causal_walk_takes_a_tile_edge_key_exactly_when_the_row_sees_it(D, edge, monkeypatch):
    """The CPU test's two edges on a GPU: the kernel as chosen (the Hopper kernel where it runs, whose 64-key
    stages the offsets 1 and 62 / 126 also put at an edge), then the Triton kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sparge_diffusers.kernels import attention_hopper

    q, k, v, row, key, seen = _dense_walk_at_a_tile_edge(D, edge, "cuda")
    for forced in (None, False):
        monkeypatch.setattr(attention_hopper, "OVERRIDE", forced)
        out = block_sparse_attention(q, k, v, None, is_causal=True, causal_variant="lower_right",
                                     out=torch.full_like(q, float("nan")))
        _assert_tile_edge_key(out, q, k, v, row, key, seen)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_s2o_matches_reference(D):
    """S2O's order (Triton sort) and ordered walk on the GPU with causal variants, against the reference walk on
    the same order, visiting everything and stopping early (bf16)."""
    for Nq, Nkv, variant in CASES + [(1000, 3000, "lower_right"), (2048, 4100, "lower_right"),
                                     (3000, 1000, "lower_right"), (700, 2000, "upper_left")]:
        q, k, v = (t.cuda() for t in make_qkv(1, 8, 2, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + Nkv))
        q = q + 0.5
        order = order_for(q, k, True, theta=-1.0, segment=256, sink=True, backend="triton", causal_variant=variant)[1]
        for tau, check_every in ((0.0, 16), (0.2, 1)):
            kw = dict(is_causal=True, causal_variant=variant, tau=tau, check_every=check_every, segment=256,
                      return_sparsity=True)
            out, stats = s2o_attention(q, k, v, order=order, out=torch.full_like(q, float("nan")), **kw)
            ref, ref_stats = s2o_attention(q.cpu(), k.cpu(), v.cpu(), order=tuple(t.cpu() for t in order),
                                           backend="reference", **kw)
            assert not torch.isnan(out).any()
            assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16], (Nq, Nkv, variant, tau)
            torch.testing.assert_close(stats.qk_skipped.cpu(), ref_stats.qk_skipped)
            if variant == "lower_right" and Nq > Nkv:
                assert (out[:, :, :Nq - Nkv] == 0).all()
