"""Random calls of the public API on a GPU, each against the float32 reference.

The grids of test_kernels.py and test_attention_hopper.py vary one axis at a time on a few shapes. Each seed here
draws one call that combines them: odd lengths up to several waves of the Hopper kernel's schedule, either layout,
bf16 or fp16, a GQA group, the Hopper kernel's head dims and the Triton kernel's others, causal or not, N_q != N_kv
(causal too, under either causal variant), a sliding window on about two in five causal calls, logit soft-capping on
about one call in three and learned sink logits on about one in four, a mask of random density (broadcast over batch
or heads, some rows empty) given as a bool tensor, as a prebuilt CompactBlockMask, or not at all (dense), or the
whole method on structured inputs, the stage-2 test on or off, a non-contiguous q, and an output buffer poisoned
with NaN that is longer than the call's rows. Every check is the same: no NaN, the rows past the call untouched,
relative L1 against the reference under the dtype's tolerance. The same for S2O (its order walked by the kernel and
by the reference, or built by the kernels and visited in full against exact attention) and for PBS-Attn's whole path
(importance, segment sort, key gather, stage 1 and the walk on permuted keys). And, as in test_random_calls.py, with
``return_sparsity=True``, a drawn scale and per-head stage-2 thresholds: the statistics against the blocks the
element-wise definition makes the call compute; the same for PBS-Attn's calls, and S2O's dense blocks (since
session 80).

``SPARGE_GPU_RANDOM_CALLS`` sets the number of seeds per test (default 40), ``SPARGE_GPU_RANDOM_FIRST`` the first
(default 0).
"""

import math
import os
import random

import pytest
import torch

from sparge_diffusers import (
    BLOCK_K,
    BLOCK_Q,
    PermutedKeys,
    block_sparse_attention,
    compact_block_mask,
    predict_block_mask,
    relative_l1,
    sparge_attention,
)
from sparge_diffusers.permutations import gather_keys, last_block_key_importance, segmented_key_order
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv

from test_kernels import L1_TOL, assert_stage1_agrees
from test_sliding_window import blocks_seen, window_mask

CALLS = int(os.environ.get("SPARGE_GPU_RANDOM_CALLS", "40"))
FIRST = int(os.environ.get("SPARGE_GPU_RANDOM_FIRST", "0"))


def draw_call(seed: int) -> dict:
    """One call's settings, a pure function of ``seed``."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2, 3, 4])
    causal = rng.random() < 0.35
    q_len = rng.randint(1, 5000)
    return dict(
        entry=rng.choice(["mask", "compact", "dense", "whole"]),
        **_draw_shape(rng, kv_heads, causal, q_len, head_groups=[1, 1, 2, 4, 7]),
        density=rng.choice([0.02, 0.1, 0.3, 0.7, 1.0]),
        mask_batch=rng.choice([1, None]),  # None: one mask per batch element
        mask_heads=rng.choice([1, None]),
        empty_rows=rng.random() < 0.3,
        pvthreshd=rng.choice([None, None, 50.0, 20.0]),
        strided_q=rng.random() < 0.25,
        seed=seed,
    ) | _causal_variant(rng, causal, q_len) | _sliding_window(rng, causal) | _score_extras(rng)


def stage1_defaults(call: dict) -> dict:
    """``assert_stage1_agrees``' arguments for a drawn call's stage 1 at the default thresholds (θ 0.6, τ 0.98)."""
    heads = call["heads"]
    return dict(theta=torch.full((heads,), 0.6), tau=torch.full((heads,), 0.98), causal=call["causal"],
                layout=call["layout"], causal_variant=call["causal_variant"], sliding_window=call["sliding_window"],
                softcap=call["softcap"])


def _score_extras(rng: random.Random) -> dict:
    """Logit soft-capping (a cap that bends these scores, of std ~1, or a loose one) on about one call in three, and
    learned sink logits (one per query head, large ones included) on about one in four; drawn after every other
    field, so that the earlier fields' draws stay as they were."""
    softcap = rng.choice([None, None, None, None, 1.5, 20.0])
    sinks = [rng.gauss(0.0, 3.0) for _ in range(64)] if rng.random() < 0.25 else None
    return {"softcap": softcap, "sinks": sinks}


def _sliding_window(rng: random.Random, causal: bool) -> dict:
    """A causal call's sliding window (drawn last, so that the earlier fields' draws stay as they were): about two in
    five causal calls have one, from a single key to wider than most calls."""
    window = rng.choice([None, None, 1, 64, 100, 129, 500, 2000, 8000, None, None, None, None, None, None, None,
                         None, None])
    return {"sliding_window": window if causal else None}


def _draw_shape(rng: random.Random, kv_heads: int, causal: bool, q_len: int, head_groups: list[int]) -> dict:
    """A call's batch, heads, head dim, lengths, layout and dtype, drawn in this order (which the seeds' calls
    depend on); ``head_groups`` are the query heads per K/V head to choose from."""
    return dict(
        batch=rng.choice([1, 1, 2]),
        kv_heads=kv_heads,
        heads=kv_heads * rng.choice(head_groups),
        head_dim=rng.choice([64, 128, 128, 64, 96, 32]),
        causal=causal,
        q_len=q_len,
        kv_len=q_len if causal else rng.randint(1, 5000),
        layout=rng.choice(["HND", "NHD"]),
        dtype=rng.choice([torch.bfloat16, torch.float16]),
    )


def _causal_variant(rng: random.Random, causal: bool, q_len: int) -> dict:
    """A causal call's variant and key length (drawn after the other fields, so that adding it left the draws of
    the earlier fields as they were): a third of causal calls have unequal lengths under either variant."""
    variant = rng.choice(["lower_right", "upper_left", None, None, None, None])
    kv_len = rng.randint(1, 5000)
    return dict(causal_variant=variant, kv_len=kv_len) if causal and variant else {"causal_variant": None}


def _seq_slice(x: torch.Tensor, layout: str, start: int, length: int) -> torch.Tensor:
    return x.narrow(2 if layout == "HND" else 1, start, length)


def _inputs(call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, HK, D = call["batch"], call["heads"], call["kv_heads"], call["head_dim"]
    layout, dtype = call["layout"], call["dtype"]
    if call["entry"] == "whole":  # stage 1 needs structure to select anything
        if call["causal"]:
            # one sequence of the longer length: the queries are its last q_len rows (lower right: the keys'
            # last rows too) or its first ones
            q_len, kv_len = call["q_len"], call["kv_len"]
            q, k, v = llm_like_qkv(max(q_len, kv_len), batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=dtype,
                                   device="cuda", seed=call["seed"], tensor_layout=layout)
            n = q.shape[2 if layout == "HND" else 1]
            lower_right = call["causal_variant"] == "lower_right"
            q = _seq_slice(q, layout, n - q_len if lower_right else 0, q_len)
            k, v = (_seq_slice(t, layout, n - kv_len if lower_right else 0, kv_len) for t in (k, v))
            return q, k, v
        side = max(1, round(math.sqrt(call["q_len"] / 2)))
        return video_like_qkv((2, side, side), batch=B, heads=H, kv_heads=HK, head_dim=D,
                              text_tokens=call["seed"] % 100, dtype=dtype, device="cuda", seed=call["seed"],
                              tensor_layout=layout)
    g = torch.Generator(device="cuda").manual_seed(call["seed"])

    def rnd(h, n, width=D):
        shape = (B, h, n, width) if layout == "HND" else (B, n, h, width)
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    q = rnd(H, call["q_len"], 2 * D)[..., ::2] if call["strided_q"] else rnd(H, call["q_len"])
    return q, rnd(HK, call["kv_len"]), rnd(HK, call["kv_len"])


def _mask(call: dict, q_len: int, kv_len: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(call["seed"] + 1)
    shape = (call["mask_batch"] or call["batch"], call["mask_heads"] or call["heads"],
             math.ceil(q_len / BLOCK_Q), math.ceil(kv_len / BLOCK_K))
    mask = torch.rand(shape, generator=g, device="cuda") < call["density"]
    if call["empty_rows"]:
        mask[..., ::3, :] = False  # query blocks with no kept key block: zeros, never NaN
    return mask


def _call_arguments(call: dict) -> tuple[dict, dict, torch.Tensor | None]:
    """A drawn call's keyword arguments: those of every entry point (``common``), the same with its soft cap
    (``capped``), and its sink logits on the GPU (or None)."""
    common = dict(is_causal=call["causal"], tensor_layout=call["layout"], causal_variant=call["causal_variant"],
                  sliding_window=call["sliding_window"])
    sinks = None if call["sinks"] is None else torch.tensor(call["sinks"][:call["heads"]], device="cuda")
    return common, dict(common, softcap=call["softcap"]), sinks


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(FIRST, FIRST + CALLS))
def test_gpu_random_call_matches_reference(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    call = draw_call(seed)
    q, k, v = _inputs(call)
    layout, pv = call["layout"], call["pvthreshd"]
    seq_dim = 2 if layout == "HND" else 1
    q_len, kv_len = q.shape[seq_dim], k.shape[seq_dim]
    big_shape = list(q.shape)
    big_shape[seq_dim] += 7
    big = torch.full(big_shape, float("nan"), dtype=q.dtype, device="cuda")
    out = big.narrow(seq_dim, 0, q_len)
    common, capped, sinks = _call_arguments(call)
    common_attention = dict(capped, sink_logits=sinks)

    if call["entry"] == "whole":
        result = sparge_attention(q, k, v, pvthreshd=pv, out=out, **common_attention)
        mask = predict_block_mask(q, k, **capped)
        # the tf32x3 compressed scores may tip a block lying on a threshold, no other
        assert_stage1_agrees(mask, q, k, **stage1_defaults(call))
    else:
        mask = None if call["entry"] == "dense" else _mask(call, q_len, kv_len)
        given = compact_block_mask(mask, q, k, **common) if call["entry"] == "compact" else mask
        result = block_sparse_attention(q, k, v, given, pvthreshd=pv, out=out, **common_attention)
    # the float32 reference, on the GPU for speed (TF32 off: torch's default for float32 matmuls)
    assert not torch.backends.cuda.matmul.allow_tf32
    ref = block_sparse_attention(q, k, v, mask, pvthreshd=pv, backend="reference", **common_attention)

    assert result.data_ptr() == out.data_ptr(), call
    assert not torch.isnan(result).any(), call
    assert torch.isnan(big.narrow(seq_dim, q_len, 7)).all(), ("rows past the call were written", call)
    if call["causal_variant"] == "lower_right" and q_len > kv_len:  # rows before the first key see none
        assert (result.narrow(seq_dim, 0, q_len - kv_len) == 0).all(), call
    _assert_close_to(result, ref, call)


def draw_statistics_extras(seed: int, heads: int, pvthreshd: float | None) -> dict:
    """A seed's scale and stage-2 thresholds for the statistics tests (here and in test_random_calls.py): a stream
    apart from ``draw_call``'s, so the call is otherwise the one that seed draws elsewhere. Where the call has the
    stage-2 test, half the draws give each head its own threshold (inf: off for that head)."""
    rng = random.Random(seed + 2 * 10**9)
    scale = rng.choice([None, 0.05, 0.3])
    if pvthreshd is not None and rng.random() < 0.5:
        pvthreshd = [rng.choice([5.0, 20.0, math.inf]) for _ in range(heads)]
    return dict(scale=scale, pvthreshd=pvthreshd)


def allowed_pairs(call: dict, q_len: int, kv_len: int) -> torch.Tensor:
    """(Nq, Nkv) bool: the (query, key) pairs a drawn call's causal variant and window (if any) let a query see, from
    their element-wise definitions (not from the package's block rule)."""
    if not call["causal"]:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    return window_mask(q_len, kv_len, call["causal_variant"], call.get("sliding_window") or q_len + kv_len)


def assert_statistics_count(stats, ref_stats, dense: int, computed: torch.Tensor, pv_off: bool, what,
                            name: str = "kernels", pv_atol: float = 0.0) -> None:
    """Both statistics count ``dense`` blocks and skip the Q.K^T products that ``computed`` ((B, H, q blocks,
    k blocks) bool) leaves out; the two skip the same P.V products per head, up to ``pv_atol`` or one block of a
    (batch, head) row, whichever is more, where ``pv_atol`` > 0; with stage 2 off (``pv_off``) P.V skips are Q.K^T's."""
    want_qk = (1 - computed.sum((-1, -2)).double() / max(dense, 1)).mean(0)
    for who, s in ((name, stats), ("reference", ref_stats)):
        assert s.dense_blocks == dense, (who, s.dense_blocks, dense, what)
        torch.testing.assert_close(s.qk_skipped.double(), want_qk, msg=lambda m: f"{who} {what}: {m}")
    atol = max(pv_atol, 1 / max(dense, 1)) if pv_atol else 0.0
    torch.testing.assert_close(stats.pv_skipped, ref_stats.pv_skipped, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")
    if pv_off:
        torch.testing.assert_close(stats.pv_skipped, stats.qk_skipped)


def check_call_statistics(call: dict, extras: dict, q, k, v, mask: torch.Tensor | None, arguments: tuple,
                          backend: str = "auto", pv_atol: float = 0.0) -> None:
    """Run a drawn call with ``return_sparsity=True`` on ``backend`` (given ``mask`` compacted when the call's entry
    is "compact") and on the float32 reference. Both statistics must count the dense blocks and the skipped Q.K^T
    products that the element-wise definition gives (a kept block counts where some query of it sees some key of
    it), as :func:`assert_statistics_count` checks, and the outputs must agree. ``arguments``: the call's
    ``_call_arguments``."""
    common, capped, sinks = arguments
    given = compact_block_mask(mask, q, k, **common) if call["entry"] == "compact" else mask
    kw = dict(sink_logits=sinks, return_sparsity=True, **extras, **capped)
    result, stats = block_sparse_attention(q, k, v, given, backend=backend, **kw)
    ref, ref_stats = block_sparse_attention(q, k, v, mask, backend="reference", **kw)
    seq_dim = 2 if call["layout"] == "HND" else 1
    seen = blocks_seen(allowed_pairs(call, q.shape[seq_dim], k.shape[seq_dim])).to(q.device)
    kept = (seen if mask is None else mask.bool() & seen).expand(call["batch"], call["heads"], *seen.shape)
    assert_statistics_count(stats, ref_stats, int(seen.sum()), kept, extras["pvthreshd"] is None, (call, extras),
                            name=backend, pv_atol=pv_atol)
    assert not torch.isnan(result).any(), (call, extras)
    _assert_close_to(result, ref, call)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(FIRST, FIRST + CALLS))
def test_gpu_random_call_statistics_count_the_blocks_computed(seed):
    """test_random_calls.py's statistics test on a GPU's larger calls: a drawn call with ``return_sparsity=True``, a
    drawn ``scale`` and per-head stage-2 thresholds; the statistics of the kernels and of the float32 reference
    against the element-wise definition's blocks, and the outputs against each other. Stage 2's decision on a tile
    whose row maxima lie on its threshold may fall either way under the kernel's rounding, so P.V skips may differ
    by 2% (or one block of a row)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    call = draw_call(seed)
    extras = draw_statistics_extras(seed, call["heads"], call["pvthreshd"])
    q, k, v = _inputs(call)
    arguments = _call_arguments(call)
    if call["entry"] == "whole":
        mask = predict_block_mask(q, k, scale=extras["scale"], **arguments[1])
    else:
        seq_dim = 2 if call["layout"] == "HND" else 1
        mask = None if call["entry"] == "dense" else _mask(call, q.shape[seq_dim], k.shape[seq_dim])
    check_call_statistics(call, extras, q, k, v, mask, arguments, pv_atol=0.02)


def _assert_close_to(result: torch.Tensor, ref: torch.Tensor, call: dict) -> None:
    if ref.abs().sum() == 0:  # every kept row empty: an all-zero output, which relative L1 cannot measure
        assert (result == 0).all(), call
    else:
        assert relative_l1(result, ref) < L1_TOL[call["dtype"]], call


def draw_s2o_call(seed: int) -> dict:
    """One S2O call's settings: shapes and layouts as :func:`draw_call`'s, S2O's own knobs (tau, the stop test's
    spacing, the causal segment, the sink), and whether the call builds its order itself ("whole") or walks an
    order given to it ("order")."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2, 3, 4])
    causal = rng.random() < 0.5
    q_len = rng.randint(1, 5000)
    call = dict(
        entry=rng.choice(["order", "order", "whole"]),
        **_draw_shape(rng, kv_heads, causal, q_len, head_groups=[1, 2, 4, 7]),
        tau=rng.choice([0.0, None, 0.001, 0.01, 0.2]),
        check_every=rng.choice([1, 4, 16]),
        segment=rng.choice([128, 256, 512, 2048]),
        attention_sink=rng.random() < 0.3,
        simthreshd1=rng.choice([0.6, 0.6, -1.0, 0.95]),
        pvthreshd=rng.choice([None, None, 8.0, 30.0]),
        strided_q=rng.random() < 0.25,
        seed=seed,
    )
    return call | _causal_variant(rng, causal, q_len)


def _structured_inputs(call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs with structure for the call's lengths (S2O's stop test needs some): causal calls as in
    :func:`_inputs`, others the first rows of one video-like sequence of the longer length; q strided on request."""
    B, H, HK, D, layout = call["batch"], call["heads"], call["kv_heads"], call["head_dim"], call["layout"]
    if call["causal"]:
        q, k, v = _inputs(dict(call, entry="whole"))
    else:
        n = max(call["q_len"], call["kv_len"])
        side = max(1, math.ceil(math.sqrt(n / 2)))
        q, k, v = video_like_qkv((2, side, side), batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=call["dtype"],
                                 device="cuda", seed=call["seed"], tensor_layout=layout)
        q = _seq_slice(q, layout, 0, call["q_len"])
        k, v = (_seq_slice(t, layout, 0, call["kv_len"]) for t in (k, v))
    if call["strided_q"]:  # the same values through a non-contiguous view (rows padded to twice their width)
        wide = torch.empty(*q.shape[:-1], 2 * D, dtype=q.dtype, device="cuda")
        wide[..., :D] = q
        q = wide[..., :D]
    return q, k, v


def s2o_dense_blocks(call: dict, q: torch.Tensor, k: torch.Tensor) -> int:
    """The blocks dense attention computes for a drawn S2O call, from the element-wise definition of its causal
    mask (here and in test_random_calls.py)."""
    seq_dim = 2 if call["layout"] == "HND" else 1
    return int(blocks_seen(allowed_pairs(call, q.shape[seq_dim], k.shape[seq_dim])).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(FIRST, FIRST + CALLS))
def test_gpu_random_s2o_call_matches_reference(seed):
    """S2O on the GPU against its float32 reference walking the same order ("order"), or, building its own order
    from the Triton statistics and visiting every block (tau 0 or None), against exact attention ("whole")."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sparge_diffusers import s2o_attention
    from test_s2o import order_for

    call = draw_s2o_call(seed)
    q, k, v = _structured_inputs(call)
    layout, seq_dim = call["layout"], 2 if call["layout"] == "HND" else 1
    q_len, kv_len = q.shape[seq_dim], k.shape[seq_dim]
    big_shape = list(q.shape)
    big_shape[seq_dim] += 7
    big = torch.full(big_shape, float("nan"), dtype=q.dtype, device="cuda")
    out = big.narrow(seq_dim, 0, q_len)
    common = dict(is_causal=call["causal"], tensor_layout=layout, causal_variant=call["causal_variant"])
    knobs = dict(segment=call["segment"], check_every=call["check_every"], simthreshd1=call["simthreshd1"],
                 attention_sink=call["attention_sink"], pvthreshd=call["pvthreshd"])
    if call["entry"] == "order":
        order = order_for(q, k, call["causal"], theta=call["simthreshd1"], segment=call["segment"],
                          sink=call["attention_sink"], layout=layout, backend="triton",
                          causal_variant=call["causal_variant"])[1]
        result, stats = s2o_attention(q, k, v, tau=call["tau"], order=order, out=out, return_sparsity=True,
                                      **knobs, **common)
        ref, ref_stats = s2o_attention(q, k, v, tau=call["tau"], order=order, backend="reference",
                                       return_sparsity=True, **knobs, **common)
        # a stop test lying on its threshold may fall either way under the kernel's rounding
        assert (stats.qk_skipped - ref_stats.qk_skipped).abs().max() <= 0.02, call
        assert ref_stats.dense_blocks == s2o_dense_blocks(call, q, k), call
    else:
        tau = call["tau"] if call["tau"] in (0.0, None) else 0.0
        knobs["pvthreshd"] = None  # exact only without the stage-2 test
        result, stats = s2o_attention(q, k, v, tau=tau, out=out, return_sparsity=True, **knobs, **common)
        ref = block_sparse_attention(q, k, v, None, backend="reference", **common)
        if tau is None:  # no stop test: every visible block visited
            assert (stats.qk_skipped == 0).all() and (stats.pv_skipped == 0).all(), call
    assert stats.dense_blocks == s2o_dense_blocks(call, q, k), call
    assert result.data_ptr() == out.data_ptr(), call
    assert not torch.isnan(result).any(), call
    assert torch.isnan(big.narrow(seq_dim, q_len, 7)).all(), ("rows past the call were written", call)
    if call["causal_variant"] == "lower_right" and q_len > kv_len:
        assert (result.narrow(seq_dim, 0, q_len - kv_len) == 0).all(), call
    _assert_close_to(result, ref, call)


def draw_pbs_call(seed: int) -> dict:
    """One PBS-Attn call (causal, HND, N_q <= N_kv): the whole prompt or a lower-right chunk of it."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2, 4])
    kv_len = rng.randint(1, 6000)
    call = dict(
        batch=rng.choice([1, 1, 2]),
        kv_heads=kv_heads,
        heads=kv_heads * rng.choice([1, 2, 4]),
        head_dim=rng.choice([64, 128, 128, 32]),
        kv_len=kv_len,
        q_len=kv_len if rng.random() < 0.5 else rng.randint(1, kv_len),
        segment=rng.choice([64, 128, 256, 256, 512, 1024, 2048]),
        dtype=rng.choice([torch.bfloat16, torch.float16]),
        cdfthreshd=rng.choice([0.9, 0.98, 1.0]),
        simthreshd1=rng.choice([0.6, -1.0, 1.0]),  # 1.0: no block summarised, every block kept
        pvthreshd=rng.choice([None, None, 8.0]),
        seed=seed,
    )
    return call | dict(causal=True, layout="HND", entry="whole",
                       causal_variant="lower_right" if call["q_len"] < call["kv_len"] else None)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(FIRST, FIRST + CALLS))
def test_gpu_random_pbs_call_matches_reference(seed):
    """pbs_sparge_attention end to end (importance, segment sort, key gather, stage 1 on the permuted keys, the
    kernel's causal test on original positions) against the float32 reference given the same permuted keys and
    mask; with every block kept (simthreshd1 1) and no stage-2 test, also against exact causal attention."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sparge_diffusers.llm import pbs_sparge_attention

    call = draw_pbs_call(seed)
    q, k, v = _inputs(call)
    variant = call["causal_variant"]
    out = torch.full_like(q, float("nan"))
    thresholds = dict(cdfthreshd=call["cdfthreshd"], simthreshd1=call["simthreshd1"], pvthreshd=call["pvthreshd"])
    result = pbs_sparge_attention(q, k, v, segment=call["segment"], causal_variant=variant, out=out, **thresholds)
    assert result.data_ptr() == out.data_ptr() and not torch.isnan(result).any(), call

    kp, vp, kw, mask = pbs_permuted_call(call, q, k, v)
    ref = block_sparse_attention(q, kp, vp, mask, pvthreshd=call["pvthreshd"], backend="reference", **kw)
    _assert_close_to(result, ref, call)
    if call["simthreshd1"] == 1.0 and call["pvthreshd"] is None:
        exact = block_sparse_attention(q, k, v, None, backend="reference", is_causal=True, causal_variant=variant)
        _assert_close_to(result, exact, call)


def pbs_permuted_call(call: dict, q, k, v, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, dict,
                                                                            torch.Tensor]:
    """What pbs_sparge_attention computes for a drawn call, step by step (here and in test_random_calls.py): the keys
    and values in its segmented order, the keyword arguments that give the kernels the keys' original positions, and
    stage 1's mask on those keys (predicted by ``backend``)."""
    order = segmented_key_order(last_block_key_importance(q, k, causal_variant=call["causal_variant"]),
                                call["segment"])
    kw = dict(is_causal=True, permuted_keys=PermutedKeys(order.to(torch.int32), call["segment"]),
              causal_variant=call["causal_variant"])
    kp = gather_keys(k, order)
    mask = predict_block_mask(q, kp, cdfthreshd=call["cdfthreshd"], simthreshd1=call["simthreshd1"],
                              backend=backend, **kw)
    return kp, gather_keys(v, order), kw, mask


def check_pbs_call_statistics(call: dict, q, k, v, backend: str = "auto", pv_atol: float = 0.0) -> None:
    """A drawn PBS-Attn call (its permuted keys and stage 1's mask on them) with ``return_sparsity=True`` on
    ``backend`` and on the float32 reference: both count as dense the blocks of plain causal attention on keys in
    order, and as computed the kept blocks whose key segment holds a key that some query of the block sees (keys move
    within segments only, and a permuted block is walked whole where its segment is visible); P.V skips as
    :func:`assert_statistics_count` allows; the outputs agree."""
    kp, vp, kw, mask = pbs_permuted_call(call, q, k, v, backend=backend)
    kw.update(pvthreshd=call["pvthreshd"], return_sparsity=True)
    result, stats = block_sparse_attention(q, kp, vp, mask, backend=backend, **kw)
    ref, ref_stats = block_sparse_attention(q, kp, vp, mask, backend="reference", **kw)
    allowed = allowed_pairs(call, q.shape[2], k.shape[2])
    segment_of_block = torch.arange(mask.shape[-1]) * BLOCK_K // call["segment"]
    computed = mask & blocks_seen(allowed, key_block=call["segment"])[:, segment_of_block].to(mask.device)
    assert_statistics_count(stats, ref_stats, int(blocks_seen(allowed).sum()), computed, call["pvthreshd"] is None,
                            call, name=backend, pv_atol=pv_atol)
    assert not torch.isnan(result).any(), call
    _assert_close_to(result, ref, call)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(FIRST, FIRST + CALLS))
def test_gpu_random_pbs_call_statistics_count_the_blocks_computed(seed):
    """test_random_calls.py's PBS-Attn statistics test on the GPU's larger PBS calls (prompts up to 6000 tokens,
    segments up to 2048): P.V skips may differ by 2% (or one block of a row), as in the statistics test above."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    call = draw_pbs_call(seed)
    check_pbs_call_statistics(call, *_inputs(call), pv_atol=0.02)
