"""S2O selection (ranked key blocks, early stopping): the visiting order, the Triton walk (interpreter) against
its float32 reference on the same order, and the contracts of s2o_attention."""

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import BLOCK_K, BLOCK_Q, s2o_attention, s2o_visit_order
from sparge_diffusers.kernels._inputs import AttentionShape, causal_block_visible
from sparge_diffusers.kernels.reference import reference_block_statistics, reference_ordered_attention
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv
from test_kernels import L1_TOL, dense_reference, poisoned_like, relative_l1


def order_for(q, k, causal, theta=0.6, segment=256, sink=False, layout="HND"):
    qh, kh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k))
    B, H, Nq, D = qh.shape
    shape = AttentionShape(B, H, kh.shape[1], Nq, kh.shape[2], D)
    (qm, qs), (km, ks) = reference_block_statistics(qh, BLOCK_Q), reference_block_statistics(kh, BLOCK_K)
    theta = torch.full((H,), float(theta))
    return shape, s2o_visit_order(qm, km, qs, ks, shape, is_causal=causal, scale=D ** -0.5, simthreshd1=theta,
                                  segment=segment, attention_sink=sink), (qm, km, qs, ks)


@pytest.mark.parametrize("causal", [False, True])
def test_visit_order(causal):
    q, k, _ = video_like_qkv((2, 16, 20), heads=2, head_dim=32, text_tokens=7) if not causal else \
        llm_like_qkv(700, heads=4, kv_heads=2, head_dim=32)
    shape, (index, n_unmasked, n_forced, count), (qm, km, qs, ks) = order_for(q, k, causal, theta=0.5)
    nq, nk = shape.q_blocks, shape.k_blocks
    visible = causal_block_visible(nq, nk, shape.kv_len, "cpu") if causal else torch.ones(nq, nk, dtype=torch.bool)
    group = shape.heads // shape.kv_heads
    km, ks = km.repeat_interleave(group, 1), ks.repeat_interleave(group, 1)
    scores = qm @ km.transpose(-1, -2)
    for b in range(shape.batch):
        for h in range(shape.heads):
            for i in range(nq):
                c, f, u = int(count[b, h, i]), int(n_forced[b, h, i]), int(n_unmasked[b, h, i])
                walk = index[b, h, i, :c].tolist()
                assert sorted(walk) == torch.nonzero(visible[i]).flatten().tolist(), "each visible block once"
                forced, ranked = walk[:f], walk[f:]
                assert forced[:u] == sorted(forced[:u]) and forced[u:] == sorted(forced[u:])
                s = scores[b, h, i, ranked]
                assert (s[:-1] >= s[1:]).all(), "ranked blocks by descending compressed score"
                for j in ranked:  # a ranked block is trusted by stage 1 and outside the forced sets
                    assert ks[b, h, j] > 0.5 and qs[b, h, i] > 0.5
                    assert (j + 1) * BLOCK_K <= shape.kv_len
                    if causal:
                        assert j * BLOCK_K < (i * BLOCK_Q // 256) * 256, "own segment is forced"
                if causal:
                    diagonal = [j for j in range(nk) if visible[i, j] and j * BLOCK_K + BLOCK_K - 1 > i * BLOCK_Q]
                    assert set(diagonal) <= set(forced[u:])


CASES = [
    # B, H, HK, N, D, causal, segment
    (1, 2, 2, 333, 64, False, 256),
    (2, 4, 2, 520, 64, True, 256),  # GQA, odd length, two segments
    (1, 2, 1, 700, 128, True, 128),
    (1, 3, 3, 90, 64, False, 256),  # shorter than one block
]


def structured(B, H, HK, N, D, causal, dtype, layout, seed):
    if causal:
        q, k, v = llm_like_qkv(N, batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=dtype, seed=seed,
                               tensor_layout=layout)
    else:
        q, k, v = video_like_qkv((1, 1, N), batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=dtype, seed=seed,
                                 tensor_layout=layout)
    return q, k, v


@pytest.mark.parametrize("B,H,HK,N,D,causal,segment", CASES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tau,pvthreshd,check_every", [(0.0, None, 16), (0.02, None, 1), (0.1, 4.0, 3)])
def test_triton_walk_matches_reference(B, H, HK, N, D, causal, segment, layout, dtype, tau, pvthreshd, check_every):
    q, k, v = structured(B, H, HK, N, D, causal, dtype, layout, seed=N + D)
    shape, order, _ = order_for(q, k, causal, theta=0.3, segment=segment, layout=layout)
    out = poisoned_like(q)
    kw = dict(is_causal=causal, tau=tau, segment=segment, pvthreshd=pvthreshd, check_every=check_every,
              tensor_layout=layout, return_sparsity=True, order=order)
    result, stats = s2o_attention(q, k, v, backend="triton", out=out, **kw)
    assert result is out and not torch.isnan(out).any(), "every element written"
    qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
    ref, visited, pv_count = reference_ordered_attention(
        qh, kh, vh, order, shape=shape, is_causal=causal, scale=D ** -0.5, tau=torch.full((H,), tau),
        pvthreshd=None if pvthreshd is None else torch.full((H,), pvthreshd), check_every=check_every)
    ref = ref if layout == "HND" else ref.transpose(1, 2)
    assert relative_l1(out, ref) < L1_TOL[dtype]
    ref_stats = s2o_attention(q, k, v, backend="reference", **kw)[1]
    torch.testing.assert_close(stats.qk_skipped, ref_stats.qk_skipped)
    torch.testing.assert_close(stats.pv_skipped, ref_stats.pv_skipped)
    if tau == 0:
        assert float(stats.qk_skipped.max()) == 0.0
        assert relative_l1(out, dense_reference(q, k, v, causal, layout)) < L1_TOL[dtype]


def test_early_stopping_trades_blocks_for_error():
    q, k, v = video_like_qkv((2, 16, 24), heads=4, head_dim=64)
    exact = dense_reference(q, k, v, False, "HND")
    sparsity, error = [], []
    for tau in [0.0, 0.002, 0.02, 0.2]:
        out, stats = s2o_attention(q, k, v, tau=tau, check_every=2, return_sparsity=True)
        sparsity.append(stats.sparsity)
        error.append(relative_l1(out, exact))
    assert sparsity[0] == 0 and sparsity == sorted(sparsity) and sparsity[-1] > 0.3
    assert error == sorted(error) and error[0] < 5e-3


def test_tau_none_visits_everything_without_the_check():
    q, k, v = video_like_qkv((1, 8, 40), heads=2, head_dim=64)
    out, stats = s2o_attention(q, k, v, tau=None, return_sparsity=True, backend="triton")
    assert stats.sparsity == 0
    assert relative_l1(out, dense_reference(q, k, v, False, "HND")) < L1_TOL[torch.bfloat16]


def test_s2o_errors():
    q, k, v = video_like_qkv((1, 8, 16), heads=2, head_dim=64)
    with pytest.raises(ValueError, match="segment"):
        s2o_attention(q, k, v, segment=100)
    with pytest.raises(ValueError, match="tau"):
        s2o_attention(q, k, v, tau=-0.1)
    with pytest.raises(ValueError, match="tau"):
        s2o_attention(q, k, v, tau=float("nan"))
    with pytest.raises(ValueError, match="check_every"):
        s2o_attention(q, k, v, check_every=0)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        s2o_attention(q.float(), k.float(), v.float(), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_s2o_on_gpu_matches_reference(causal):
    q, k, v = structured(1, 4, 2 if causal else 4, 1500, 128, causal, torch.bfloat16, "HND", seed=3)
    q, k, v = (t.cuda() for t in (q, k, v))
    shape, order, _ = order_for(q.cpu(), k.cpu(), causal, segment=512)
    order = type(order)(t.cuda() for t in order)
    out, stats = s2o_attention(q, k, v, is_causal=causal, tau=0.01, segment=512, order=order, return_sparsity=True)
    ref, stats_ref = s2o_attention(q.cpu(), k.cpu(), v.cpu(), is_causal=causal, tau=0.01, segment=512,
                                   order=type(order)(t.cpu() for t in order), return_sparsity=True)
    assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16]
    assert abs(stats.sparsity - stats_ref.sparsity) < 0.02  # a borderline stop may differ in rounding
