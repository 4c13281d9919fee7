"""PBS-Attn's segmented key permutation: the order, the kernels' causal test on original key positions
(Triton in the interpreter against the float32 reference), and the LLM path's composition."""

import math

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import BLOCK_K, BLOCK_Q, block_sparse_attention, predict_block_mask, relative_l1
from sparge_diffusers import compact_block_mask, sparge_attention
from sparge_diffusers.kernels import PermutedKeys
from sparge_diffusers.kernels._inputs import check_attention_inputs
from sparge_diffusers.llm import pbs_sparge_attention, pbs_sparge_attention_op
from sparge_diffusers.permutations import gather_keys, last_block_key_importance, segmented_key_order
from sparge_diffusers.permutations import segmented as segmented_module
from sparge_diffusers.testing import llm_like_qkv
from test_kernels import L1_TOL, assert_stage1_agrees


def make_qkv(B, H, HK, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, N, D, generator=g).to(dtype) for h in (H, HK, HK))


def random_segment_order(B, HK, N, segment, seed):
    """Keys shuffled at random within each segment (the harshest order for the causal test)."""
    g = torch.Generator().manual_seed(seed)
    return segmented_key_order(torch.rand(B, HK, N, generator=g), segment)


def causal_sdpa(q, k, v, variant=None):
    """Causal attention in float32; fewer queries than keys with the given variant's alignment."""
    g = q.shape[1] // k.shape[1]
    offset = k.shape[2] - q.shape[2] if variant == "lower_right" else 0
    visible = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None] + offset
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                          v.float().repeat_interleave(g, 1), attn_mask=visible)


def to_layout(t, layout):
    return t if layout == "HND" else t.transpose(1, 2)


def test_segmented_key_order_sorts_within_segments_only():
    importance = torch.tensor([[[0.1, 0.9, 0.5, 0.3, 0.8, 0.2, 0.7]]])
    order = segmented_key_order(importance, 3)
    assert order.tolist() == [[[1, 2, 0, 4, 3, 5, 6]]]  # segments [0, 3), [3, 6), [6, 7)
    big = random_segment_order(2, 3, 1000, 256, seed=0)
    PermutedKeys(big.int(), 256).verify()
    assert ((big // 256) == (torch.arange(1000) // 256)).all()
    with pytest.raises(ValueError, match="segment"):
        segmented_key_order(importance, 0)


def _scores_with_ties(shape, seed):
    """Random scores with repeated values, negatives, -0.0 next to 0.0 and -inf: every tie rule matters."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, shape, generator=g).float() / 4  # many ties, 0.0 among them
    x[torch.rand(shape, generator=g) < 0.1] = -0.0
    x[torch.rand(shape, generator=g) < 0.05] = -math.inf
    return x + torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.5)


@pytest.mark.parametrize("segment,n", [(3, 7), (64, 200), (192, 500), (256, 256), (256, 1000)])
def test_segment_argsort_kernel_equals_the_torch_sort(segment, n):
    """The Triton segment sort (interpreter; CUDA's path) gives torch.sort's stable order: descending, ties lower
    position first, -0.0 equal to 0.0, -inf real keys before the padding; segments that are not a power of two,
    a short last segment; every output written (poisoned)."""
    import triton

    scores = _scores_with_ties((2, 3, n), seed=segment + n)
    expected = segmented_key_order(scores, segment)  # the CPU (torch.sort) path
    order = torch.full((2, 3, n), -1, dtype=torch.int64)
    segmented_module._segment_argsort_kernel[(triton.cdiv(n, segment), 6)](
        scores, order, n, SEGMENT=segment, SEGMENT_PAD=triton.next_power_of_2(segment))
    assert torch.equal(order, expected)


def test_last_block_key_importance_matches_the_softmax_it_averages(monkeypatch):
    q, k, _ = make_qkv(2, 4, 2, 300, 32, torch.float32, seed=1)
    monkeypatch.setattr(segmented_module, "_KEY_CHUNK", 64)  # several key chunks, a ragged last one
    got = last_block_key_importance(q, k, queries=128)
    scores = (q[:, :, -128:] @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    rows, cols = torch.arange(300 - 128, 300), torch.arange(300)
    probs = scores.masked_fill(cols[None, :] > rows[:, None], -math.inf).softmax(-1)  # (B, H, 128, N)
    expected = probs.mean(-2).view(2, 2, 2, 300).mean(2)  # mean over the queries, then over the group
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 2))
    assert last_block_key_importance(q[:, :, :50], k[:, :, :50]).shape == (2, 2, 50)  # shorter than a block
    with pytest.raises(ValueError, match="H_kv"):
        last_block_key_importance(q, torch.randn(2, 3, 300, 32))  # 3 key heads for 4 query heads
    for bad_q, bad_k in [(q[0], k), (q, k[0]), (q[:1], k), (q[..., :16], k), (q[:, :, :0], k), (q, k[:, :0])]:
        with pytest.raises(ValueError, match=r"q \(B, H, Nq, D\) and k \(B, H_kv, Nkv, D\) with H_kv dividing H"):
            last_block_key_importance(bad_q, bad_k)


def test_importance_of_a_chunk_ranks_by_its_last_queries_at_their_positions():
    """Fewer queries than keys: the last queries sit at their causal positions (lower right: the chunk's end is
    the keys' end, so a prompt's last chunk ranks its keys as the whole prompt does; upper left: the first
    positions, later keys unseen); unequal lengths without a variant, and more queries than keys, raise."""
    q, k, _ = make_qkv(2, 4, 2, 300, 32, torch.float32, seed=11)
    whole = last_block_key_importance(q, k)
    assert torch.equal(last_block_key_importance(q[:, :, 150:], k, causal_variant="lower_right"), whole)
    got = last_block_key_importance(q[:, :, :100], k, causal_variant="upper_left", queries=64)  # rows 36..99
    scores = (q[:, :, 36:100] @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    rows, cols = torch.arange(36, 100), torch.arange(300)
    expected = scores.masked_fill(cols[None, :] > rows[:, None], -math.inf).softmax(-1).mean(-2).view(2, 2, 2, 300)
    torch.testing.assert_close(got, expected.mean(2), atol=1e-6, rtol=1e-5)
    assert (got[..., 100:] == 0).all()
    short = last_block_key_importance(q[:, :, -40:], k, causal_variant="lower_right")  # 40 queries, all ranked
    scores = (q[:, :, -40:] @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    rows = torch.arange(260, 300)
    expected = scores.masked_fill(cols[None, :] > rows[:, None], -math.inf).softmax(-1).mean(-2).view(2, 2, 2, 300)
    torch.testing.assert_close(short, expected.mean(2), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="causal_variant='lower_right'"):
        last_block_key_importance(q[:, :, 150:], k)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        last_block_key_importance(q, k[:, :, :200], causal_variant="lower_right")
    with pytest.raises(ValueError, match="causal_variant must be"):
        last_block_key_importance(q[:, :, 150:], k, causal_variant="bottom")


def test_importance_arguments_that_gave_nan_or_a_reversed_ranking_raise():
    """queries=0 averaged over no rows (NaN importance for every key), a NaN scale gave NaN, and a scale <= 0 ranked
    the keys by reversed scores (the Triton passes also take the raw scores' max for the scaled one, which only a
    positive scale keeps). A single query ranks by its own softmax."""
    q, k, _ = make_qkv(1, 2, 2, 100, 32, torch.float32, seed=5)
    for queries in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=f"queries must be a positive int, got {queries!r}"):
            last_block_key_importance(q, k, queries=queries)
    for scale in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            last_block_key_importance(q, k, scale=scale)
    got = last_block_key_importance(q, k, queries=1, scale=0.5)
    expected = (0.5 * q[:, :, -1:] @ k.transpose(-1, -2)).softmax(-1)[:, :, 0]  # the last row sees every key
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("B,H,HK,NQ,N,D,dtype,variant", [
    (1, 4, 2, 300, 300, 64, torch.float16, None), (2, 2, 1, 1500, 1500, 32, torch.bfloat16, None),
    (1, 3, 3, 70, 70, 128, torch.float16, None),
    (1, 4, 2, 200, 1300, 64, torch.bfloat16, "lower_right"),  # a chunk against a cache of several key chunks
    (2, 2, 2, 90, 300, 32, torch.float16, "upper_left"),
    # the last block's first row at position 126: key 127, the end of a key tile of either pass, is hidden from it
    # alone (a tile counted as seen by every row one key too early passed every other case)
    (1, 2, 1, 254, 254, 32, torch.float16, None),
])
@pytest.mark.parametrize("key_chunk", [4096, 256])
def test_importance_kernels_match_the_pytorch_path(B, H, HK, NQ, N, D, dtype, variant, key_chunk, monkeypatch):
    """The two Triton passes (interpreter) against the float32 PyTorch path: GQA, one key chunk per pass-1 row
    tile and several (a chunk boundary inside the causal part of the scores, and in the keys every row sees),
    fewer than 128 queries, ragged key blocks, fewer queries than keys in both causal variants."""
    monkeypatch.setattr(segmented_module, "IMPORTANCE_KEY_CHUNK", key_chunk)
    q, k, _ = make_qkv(B, H, HK, N, D, dtype, seed=N)
    q = q[:, :, N - NQ:]
    got = last_block_key_importance(q, k, backend="triton", causal_variant=variant)
    expected = last_block_key_importance(q, k, backend="torch", causal_variant=variant)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-3)
    torch.testing.assert_close(got.sum(-1), torch.ones(B, HK), atol=1e-4, rtol=0)


def test_importance_kernels_keep_scores_past_float32s_exponent_range_finite():
    """Scores of a few hundred (in log2 units) match the PyTorch path: the passes subtract each row's max before
    exponentiating (2^s alone overflows float32 from s = 128)."""
    q, k, _ = make_qkv(1, 2, 1, 300, 32, torch.float16, seed=8)
    q = q * 40  # log2-scaled scores of up to about 500
    got = last_block_key_importance(q, k, backend="triton")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, last_block_key_importance(q, k, backend="torch"), atol=2e-6, rtol=2e-3)


def test_importance_kernels_take_power_of_two_head_dims_from_16_with_unit_stride():
    """D = 16 runs the Triton passes; 8, 24 and a strided last dim are refused there (backend="auto" takes the
    PyTorch path for them, on the CPU always)."""
    q, k, _ = make_qkv(1, 2, 1, 70, 16, torch.float16, seed=3)
    torch.testing.assert_close(last_block_key_importance(q, k, backend="triton"),
                               last_block_key_importance(q, k, backend="torch"), atol=2e-6, rtol=2e-3)
    wide = make_qkv(1, 2, 1, 70, 32, torch.float16, seed=4)
    for q, k in [make_qkv(1, 2, 1, 70, D, torch.float16, seed=D)[:2] for D in (8, 24)] + [
            (wide[0][..., ::2], wide[1][..., ::2]), (wide[0][..., :16], wide[1][..., ::2])]:
        with pytest.raises(ValueError, match="power-of-two head dim >= 16 with unit stride"):
            last_block_key_importance(q, k, backend="triton")
        torch.testing.assert_close(last_block_key_importance(q, k), last_block_key_importance(q, k, backend="torch"))


def test_gather_keys_checks_the_order_it_is_given():
    """gather_keys is public: an order of the wrong shape or dtype, on another device, or with positions outside
    [0, N) raises (the Triton gather reads wherever an index points); a batch-1 order serves every batch row."""
    x = torch.randn(2, 3, 50, 16)
    order = random_segment_order(2, 3, 50, 16, seed=1)
    assert torch.equal(gather_keys(x, order), torch.gather(x, 2, order[..., None].expand(x.shape)))
    assert torch.equal(gather_keys(x, order[:1]), torch.gather(x, 2, order[:1, ..., None].expand(x.shape)))
    cases = [(order[..., :40], r"order \(B or 1, H_kv, N\) expected, got \(2, 3, 50, 16\) and \(2, 3, 40\)"),
             (order[None], "expected"), (order[:, :2], "expected"),
             (order.float(), "integer positions, got torch.float32"),
             (order.bool(), "integer positions"), (order.to("meta"), "order is on meta, x on cpu"),
             (order + 1, r"positions from 1 to 50, outside \[0, 50\)"), (order - 1, "from -1 to 48")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            gather_keys(x, bad)


def test_permuted_keys_are_checked():
    q, k, v = make_qkv(1, 2, 2, 300, 64, torch.float32, seed=2)
    order = random_segment_order(1, 2, 300, 128, seed=3)
    for segment in (100, 0, -64, True, 128.0):
        with pytest.raises(ValueError, match="multiple of 64"):
            PermutedKeys(order, segment)
    past_the_end = order.clone()
    past_the_end[..., -1] = 300  # in the last slot's segment (256-383) but past the 300 keys
    with pytest.raises(ValueError, match=r"out of its segment .*\[0, 300\)"):
        PermutedKeys(past_the_end, 128).verify()
    with pytest.raises(ValueError, match="3-D"):
        PermutedKeys(order[0], 128)
    with pytest.raises(ValueError, match="is_causal=True"):
        block_sparse_attention(q, k, v, None, permuted_keys=PermutedKeys(order, 128))
    with pytest.raises(ValueError, match="shape"):
        sparge_attention(q, k, v, is_causal=True, permuted_keys=PermutedKeys(order[..., :200], 128))
    crossing = order.clone()
    crossing[..., [0, 200]] = crossing[..., [200, 0]]  # two keys swapped across segments
    with pytest.raises(ValueError, match="out of its segment"):
        sparge_attention(q, k, v, is_causal=True, permuted_keys=PermutedKeys(crossing, 128))
    repeated = order.clone()
    repeated[..., 1] = repeated[..., 0]
    with pytest.raises(ValueError, match="repeats"):
        predict_block_mask(q, k, is_causal=True, permuted_keys=PermutedKeys(repeated, 128))
    cm = compact_block_mask(torch.ones(1, 1, 3, 5, dtype=torch.bool), q, k, is_causal=True)
    with pytest.raises(ValueError, match="segments of 64"):
        block_sparse_attention(q, k, v, cm, is_causal=True, permuted_keys=PermutedKeys(order, 128))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("NQ,N,segment,variant", [(300, 300, 128, None), (700, 700, 256, None), (90, 90, 256, None),
                                                  (170, 700, 256, "lower_right"), (300, 450, 128, "upper_left")])
def test_dense_walk_on_permuted_keys_equals_causal_attention(layout, backend, NQ, N, segment, variant):
    """Every block kept: causal attention over the keys' original positions, whatever their order in a segment
    (random shuffles; odd lengths; a sequence shorter than one segment; fewer queries than keys, a lower-right
    chunk whose queries start inside a segment and an upper-left one)."""
    dtype = torch.float16
    q, k, v = make_qkv(2, 4, 2, N, 64, dtype, seed=N)
    q = q[:, :, N - NQ:]
    order = random_segment_order(2, 2, N, segment, seed=N + 1)
    kp, vp = gather_keys(k, order), gather_keys(v, order)
    pk = PermutedKeys(order.int(), segment)
    out = block_sparse_attention(*(to_layout(t, layout) for t in (q, kp, vp)), None, is_causal=True,
                                 permuted_keys=pk, tensor_layout=layout, backend=backend, causal_variant=variant,
                                 out=to_layout(torch.full_like(q, math.nan), layout))
    assert relative_l1(to_layout(out, layout).float(), causal_sdpa(q, k, v, variant)) < L1_TOL[dtype]


def test_permuted_keys_positions_of_any_integer_dtype_and_stride_give_the_same_output():
    """The kernel reads int32 positions with a unit last stride: int64 positions (as segmented_key_order returns
    them) and a strided view are converted first. Before session 84 no CPU test passed either to the Triton
    path, so dropping the conversion of a strided view (the kernel then reads other slots' positions) passed."""
    q, k, v = make_qkv(2, 4, 2, 300, 64, torch.float16, seed=5)
    order = random_segment_order(2, 2, 300, 128, seed=6)
    kp, vp = gather_keys(k, order), gather_keys(v, order)
    strided = torch.stack([order.int(), torch.zeros_like(order, dtype=torch.int32)], -1)[..., 0]
    assert strided.stride(-1) == 2
    transposed = order.int().transpose(1, 2).contiguous().transpose(1, 2)  # unit stride on the heads, not the keys
    assert transposed.stride(-1) == 2 and transposed.stride(-2) == 1
    expected = block_sparse_attention(q, kp, vp, None, is_causal=True, permuted_keys=PermutedKeys(order.int(), 128),
                                      backend="triton")
    assert relative_l1(expected.float(), causal_sdpa(q, k, v)) < L1_TOL[torch.float16]
    for positions in (order, strided, transposed):
        out = block_sparse_attention(q, kp, vp, None, is_causal=True, permuted_keys=PermutedKeys(positions, 128),
                                     backend="triton", out=torch.full_like(q, math.nan))
        assert torch.equal(out, expected), positions.dtype


PBS_CASES = [
    # B, H, HK, NQ, N, D, segment, causal variant
    (2, 4, 2, 300, 300, 64, 128, None),  # GQA, ragged last block and segment
    (1, 2, 1, 650, 650, 128, 256, None),  # D = 128: paired unmasked tiles before the masked diagonal segments
    (1, 2, 2, 1000, 1000, 64, 192, None),  # a segment that is not a multiple of the query block
    (1, 4, 2, 300, 1000, 64, 256, "lower_right"),  # a chunk against a cache, starting inside a segment
    (1, 2, 1, 200, 650, 128, 128, "upper_left"),
]


@pytest.mark.parametrize("B,H,HK,NQ,N,D,segment,variant", PBS_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pvthreshd", [None, 4.0])
def test_block_sparse_attention_on_permuted_keys_matches_reference(B, H, HK, NQ, N, D, segment, variant, dtype,
                                                                   pvthreshd):
    q, k, v = make_qkv(B, H, HK, N, D, dtype, seed=N + D)
    q = q[:, :, N - NQ:]
    order = random_segment_order(B, HK, N, segment, seed=N)
    kp, vp = gather_keys(k, order), gather_keys(v, order)
    pk = PermutedKeys(order.int(), segment)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(B, H, math.ceil(NQ / BLOCK_Q), math.ceil(N / BLOCK_K), generator=g) < 0.5
    kw = dict(is_causal=True, pvthreshd=pvthreshd, return_sparsity=True, permuted_keys=pk, causal_variant=variant)
    out, stats = block_sparse_attention(q, kp, vp, mask, backend="triton", out=torch.full_like(q, math.nan), **kw)
    ref, ref_stats = block_sparse_attention(q, kp, vp, mask, backend="reference", **kw)
    assert not torch.isnan(out).any(), "every output element must be written, and never NaN"
    assert relative_l1(out, ref) < L1_TOL[dtype]
    torch.testing.assert_close(stats.qk_skipped, ref_stats.qk_skipped)
    torch.testing.assert_close(stats.pv_skipped, ref_stats.pv_skipped)
    # the same mask compacted once
    cm = compact_block_mask(mask, q, kp, is_causal=True, permuted_keys=pk, causal_variant=variant)
    again = block_sparse_attention(q, kp, vp, cm, backend="triton", is_causal=True, pvthreshd=pvthreshd,
                                   permuted_keys=pk, causal_variant=variant)
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("segment", [128, 256])
def test_stage_one_on_permuted_keys_matches_reference(dtype, segment):
    q, k, v = llm_like_qkv(700, heads=4, kv_heads=2, head_dim=64, dtype=dtype, seed=5)
    order = segmented_key_order(last_block_key_importance(q, k), segment)
    pk = PermutedKeys(order.int(), segment)
    kp = gather_keys(k, order)
    kw = dict(is_causal=True, cdfthreshd=0.6, permuted_keys=pk)
    mask = predict_block_mask(q, kp, backend="triton", **kw)
    assert_stage1_agrees(mask, q, kp, theta=torch.full((4,), 0.6), tau=torch.full((4,), 0.6), causal=True,
                         layout="HND", key_segment=segment)  # the reference's mask off every threshold
    # every block of the segments a query block overlaps is kept (the diagonal of PBS-Attn)
    for i in range(mask.shape[2]):
        first, last = i * BLOCK_Q, min(i * BLOCK_Q + BLOCK_Q, 700) - 1
        segs = range(first // segment * segment // BLOCK_K, min(math.ceil((last // segment + 1) * segment / BLOCK_K),
                                                                  mask.shape[3]))
        assert mask[:, :, i, list(segs)].all()
        hidden = (torch.arange(mask.shape[3]) * BLOCK_K // segment * segment) > last
        assert not mask[:, :, i, hidden].any()


def test_pbs_sparge_attention_keeping_every_block_equals_causal_attention():
    q, k, v = llm_like_qkv(500, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, seed=7)
    out = pbs_sparge_attention(q, k, v, segment=256, cdfthreshd=1.0, pvthreshd=None)
    assert relative_l1(out, causal_sdpa(q, k, v)) < 1e-5
    with pytest.raises(ValueError, match="always causal"):
        pbs_sparge_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pbs_sparge_attention_triton_matches_reference(dtype):
    q, k, v = llm_like_qkv(600, heads=4, kv_heads=2, head_dim=64, dtype=dtype, seed=8)
    kw = dict(segment=256, cdfthreshd=0.7, pvthreshd=8, return_sparsity=True)
    out, stats = pbs_sparge_attention(q, k, v, backend="triton", **kw)
    ref, ref_stats = pbs_sparge_attention(q, k, v, backend="reference", **kw)
    assert not torch.isnan(out).any()
    assert relative_l1(out, ref) < L1_TOL[dtype]
    assert stats.sparsity > 0


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pbs_on_a_prompts_last_chunk_reproduces_the_prompts_rows(backend):
    """A chunk against its cache (lower right) ranks the keys by its last 128 queries, the prompt's: the last chunk,
    starting on a query-block boundary, sorts the keys, predicts the rows of the mask and computes them as the
    whole prompt's call does (bitwise), while the blocks it skips change the result (against keys in order)."""
    dtype = torch.float16
    q, k, v = llm_like_qkv(700, heads=4, kv_heads=2, head_dim=64, dtype=dtype, seed=3)
    kw = dict(segment=128, cdfthreshd=0.7, pvthreshd=8, backend=backend)
    whole = pbs_sparge_attention(q, k, v, **kw)
    out = torch.full_like(q[:, :, 256:], math.nan)
    chunk, stats = pbs_sparge_attention(q[:, :, 256:], k, v, causal_variant="lower_right", return_sparsity=True,
                                        out=out, **kw)
    assert chunk.data_ptr() == out.data_ptr() and torch.equal(chunk, whole[:, :, 256:])
    assert stats.sparsity > 0
    in_order = sparge_attention(q[:, :, 256:], k, v, is_causal=True, causal_variant="lower_right",
                                **{key: val for key, val in kw.items() if key != "segment"})
    assert not torch.equal(chunk, in_order)
    keep_all = pbs_sparge_attention(q[:, :, 300:], k, v, causal_variant="lower_right", segment=256, cdfthreshd=1.0,
                                    pvthreshd=None, backend=backend)  # a chunk starting inside a segment
    assert relative_l1(keep_all.float(), causal_sdpa(q[:, :, 300:], k, v, "lower_right")) < L1_TOL[dtype]
    with pytest.raises(ValueError, match="causal_variant='lower_right'"):
        pbs_sparge_attention(q[:, :, 300:], k, v)


@pytest.mark.parametrize("variant, start", [(None, 0), ("lower_right", 300)])
def test_pbs_operator_matches_pbs_sparge_attention_and_passes_opcheck(variant, start):
    """pbs_sparge_attention_op: the eager function's output through torch.ops.sparge_diffusers.pbs_sparge_attention,
    the operator checked by opcheck, one graph under torch.compile (whole prompt and a lower-right chunk)."""
    q, k, v = llm_like_qkv(700, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, seed=4)
    q = q[:, :, start:]
    kw = dict(segment=128, cdfthreshd=[0.7, 0.8, 0.9, 0.6], pvthreshd=6.0, simthreshd1=-1.0, attention_sink=True,
              causal_variant=variant)
    expected, stats = pbs_sparge_attention(q, k, v, return_sparsity=True, **kw)
    assert stats.sparsity > 0
    assert torch.equal(pbs_sparge_attention_op(q, k, v, **kw), expected)
    args = (q, k, v, 128, 0.125, [-1.0], [0.7, 0.8, 0.9, 0.6], [6.0], True, variant)
    torch.library.opcheck(torch.ops.sparge_diffusers.pbs_sparge_attention.default, args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: pbs_sparge_attention_op(q, k, v, **kw), backend="aot_eager",
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), expected)
    with pytest.raises(ValueError, match="multiple of 64"):
        pbs_sparge_attention_op(q, k, v, segment=100, causal_variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("start", [0, 3000])
def test_gpu_importance_and_key_gather(D, start):
    """The compiled importance kernels against the float32 PyTorch path (three pass-1 key chunks, GQA, a
    lower-right chunk), and the Triton key gather against torch.gather, on NaN-free fresh inputs."""
    q, k, v = llm_like_qkv(9000, heads=8, kv_heads=2, head_dim=D, device="cuda", seed=D + start)
    q = q[:, :, start:]
    variant = "lower_right" if start else None
    got = last_block_key_importance(q, k, causal_variant=variant)
    expected = last_block_key_importance(q, k, backend="torch", causal_variant=variant)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-3)
    order = segmented_key_order(got, 256)
    assert torch.equal(order.cpu(), segmented_key_order(got.cpu(), 256))  # the Triton sort against torch.sort
    ties = _scores_with_ties((2, 3, 1000), seed=D + start).cuda()
    for segment in (64, 192, 256, 1000, 1024):
        assert torch.equal(segmented_key_order(ties, segment).cpu(), segmented_key_order(ties.cpu(), segment))
    for x in (k, v):
        assert torch.equal(gather_keys(x, order), torch.gather(x, 2, order.unsqueeze(-1).expand(x.shape)))
    with pytest.raises(ValueError, match=f"positions from 1 to {k.shape[2]}, outside"):  # read back on the GPU
        gather_keys(k, order + 1)


@pytest.mark.gpu
def test_gpu_auto_backends_take_triton_where_it_runs_and_pytorch_elsewhere(monkeypatch):
    """On CUDA, backend="auto" ranks keys with the Triton passes for power-of-two head dims >= 16 with dense last
    dims, and with PyTorch otherwise; the Triton sort takes float32 scores in segments of up to 1024 positions. Each
    path gives the other's result."""
    launched = []
    real_launch = segmented_module.launch
    monkeypatch.setattr(segmented_module, "launch", lambda kernel, *a, **k: (launched.append(kernel.__name__),
                                                                              real_launch(kernel, *a, **k))[1])
    for D, strided, triton_expected in ((64, False, True), (24, False, False), (16, False, True), (64, True, False)):
        q, k, _ = make_qkv(1, 4, 2, 300, 2 * D if strided else D, torch.float16, seed=D)
        q, k = (t.cuda()[..., ::2] if strided else t.cuda() for t in (q, k))
        launched.clear()
        got = last_block_key_importance(q, k)
        assert ("_key_importance_kernel" in launched) == triton_expected, (D, strided)
        torch.testing.assert_close(got, last_block_key_importance(q, k, backend="torch"), atol=2e-6, rtol=2e-3)
    scores = torch.rand(2, 3, 3000, device="cuda")
    for segment, dtype, sorted_by_triton in ((1024, torch.float32, True), (1025, torch.float32, False),
                                             (256, torch.float64, False), (256, torch.float16, False)):
        launched.clear()
        order = segmented_key_order(scores.to(dtype), segment)
        assert ("_segment_argsort_kernel" in launched) == sorted_by_triton, (segment, dtype)
        assert torch.equal(order.cpu(), segmented_key_order(scores.to(dtype).cpu(), segment))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pvthreshd", [8, None])  # None: the Hopper kernel on an sm90 GPU, else the Triton kernel
@pytest.mark.parametrize("start", [0, 1024])  # 1024: the last 1976 queries as a lower-right chunk
def test_gpu_pbs_matches_reference(dtype, D, pvthreshd, start):
    from sparge_diffusers.kernels import attention_hopper

    # Two sequences with orders of their own: each (batch, K/V head) reads its own row of key positions
    q, k, v = llm_like_qkv(3000, batch=2, heads=8, kv_heads=2, head_dim=D, dtype=dtype, device="cuda", seed=2)
    q = q[:, :, start:]
    variant = "lower_right" if start else None
    order = segmented_key_order(last_block_key_importance(q, k, causal_variant=variant), 256)
    pk = PermutedKeys(order.int(), 256)
    kp, vp = gather_keys(k, order), gather_keys(v, order)
    shape = check_attention_inputs(q, kp, vp, tensor_layout="HND", is_causal=True, causal_variant=variant)
    on_hopper = attention_hopper.usable(q, kp, vp, q, shape, pv_test=pvthreshd is not None)
    assert on_hopper == (pvthreshd is None and torch.cuda.get_device_capability() == (9, 0))
    kw = dict(is_causal=True, permuted_keys=pk, causal_variant=variant)
    mask = predict_block_mask(q, kp, cdfthreshd=0.9, **kw)
    out, stats = sparge_attention(q, kp, vp, pvthreshd=pvthreshd, return_sparsity=True, cdfthreshd=0.9,
                                  out=torch.full_like(q, math.nan), **kw)
    cpu_kw = dict(kw, permuted_keys=PermutedKeys(pk.positions.cpu(), 256))
    ref, ref_stats = block_sparse_attention(q.cpu(), kp.cpu(), vp.cpu(), mask.cpu(), pvthreshd=pvthreshd,
                                            return_sparsity=True, backend="reference", **cpu_kw)
    assert not torch.isnan(out).any()
    assert relative_l1(out.cpu(), ref) < L1_TOL[dtype]
    torch.testing.assert_close(stats.qk_skipped.cpu(), ref_stats.qk_skipped)
    # the same mask compacted once (on an sm90 GPU with the Hopper kernel's tail order): the same output
    cm = compact_block_mask(mask, q, kp, **kw)
    again = block_sparse_attention(q, kp, vp, cm, pvthreshd=pvthreshd, **kw)
    assert torch.equal(again, out)
    dense = block_sparse_attention(q, kp, vp, None, **kw)
    assert relative_l1(dense.float().cpu(), causal_sdpa(q.cpu(), k.cpu(), v.cpu(), variant)) < L1_TOL[dtype]
    if start:  # the prompt's last chunk, on a query-block boundary: the whole prompt's rows, bitwise
        q_all = llm_like_qkv(3000, batch=2, heads=8, kv_heads=2, head_dim=D, dtype=dtype, device="cuda",
                             seed=2)[0]
        settings = dict(segment=256, cdfthreshd=0.9, pvthreshd=pvthreshd)
        whole = pbs_sparge_attention(q_all, k, v, **settings)
        assert torch.equal(pbs_sparge_attention(q, k, v, causal_variant=variant, **settings), whole[:, :, start:])
