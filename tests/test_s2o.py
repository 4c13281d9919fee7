"""S2O selection (ranked key blocks, early stopping): the visiting order, the Triton walk (interpreter) against
its float32 reference on the same order, and the contracts of s2o_attention."""

import pytest
import torch

from sparge_diffusers import BLOCK_K, BLOCK_Q, s2o_attention, s2o_visit_order
from sparge_diffusers.kernels._inputs import AttentionShape, causal_block_visible, check_attention_inputs
from sparge_diffusers.kernels.reference import reference_block_statistics, reference_ordered_attention
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv
from test_kernels import L1_TOL, dense_reference, poisoned_like, relative_l1


def order_for(q, k, causal, theta=0.6, segment=256, sink=False, layout="HND", backend="reference",
              causal_variant=None):
    """(shape, visiting order, stage-1 statistics) of q and k, the statistics from the float32 reference."""
    shape = check_attention_inputs(q, k, None, tensor_layout=layout, is_causal=causal, causal_variant=causal_variant)
    qh, kh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k))
    D = qh.shape[-1]
    (qm, qs), (km, ks) = reference_block_statistics(qh, BLOCK_Q), reference_block_statistics(kh, BLOCK_K)
    theta = torch.full((shape.heads,), float(theta), device=q.device)
    return shape, s2o_visit_order(qm, km, qs, ks, shape, is_causal=causal, scale=D ** -0.5, simthreshd1=theta,
                                  segment=segment, attention_sink=sink, backend=backend), (qm, km, qs, ks)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_visit_order(causal, backend):
    q, k, _ = video_like_qkv((2, 16, 20), heads=2, head_dim=32, text_tokens=7) if not causal else \
        llm_like_qkv(700, heads=4, kv_heads=2, head_dim=32)
    shape, (index, n_unmasked, n_forced, count), (qm, km, qs, ks) = order_for(q, k, causal, theta=0.5,
                                                                              backend=backend)
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
                # the Triton scores (tf32x3 products) may order near-ties differently from this float32 product
                slack = 0.0 if backend == "reference" or not len(s) else 1e-5 * float(s.abs().max())
                assert (s[:-1] >= s[1:] - slack).all(), "ranked blocks by descending compressed score"
                for j in ranked:  # a ranked block is trusted by stage 1 and outside the forced sets
                    assert ks[b, h, j] > 0.5 and qs[b, h, i] > 0.5
                    assert (j + 1) * BLOCK_K <= shape.kv_len
                    if causal:
                        assert j * BLOCK_K < (i * BLOCK_Q // 256) * 256, "own segment is forced"
                if causal:
                    diagonal = [j for j in range(nk) if visible[i, j] and j * BLOCK_K + BLOCK_K - 1 > i * BLOCK_Q]
                    assert set(diagonal) <= set(forced[u:])


@pytest.mark.parametrize("causal,sink,N,H,HK,segment,cached", [
    (False, False, 333, 2, 2, 256, 0), (False, True, 90, 3, 3, 256, 0), (True, False, 700, 4, 2, 256, 0),
    (True, True, 1111, 2, 1, 128, 0), (False, False, 640, 2, 2, 256, 0), (True, False, 768, 2, 1, 256, 0),
    # lower right after cached keys: a key block ends on a query block's first position (63) or just before (62)
    (True, False, 700, 2, 1, 256, 63), (True, True, 500, 2, 2, 128, 62)])
def test_triton_visit_order_equals_torch_on_the_same_scores(causal, sink, N, H, HK, segment, cached):
    """The sort kernel packs (group, score, column) into int64 keys; it must give PyTorch's two stable sorts
    exactly, ties (scores rounded to a few values), negative scores and invisible blocks included; whole key
    blocks only, and key blocks that end where a query block starts, need no masking."""
    from sparge_diffusers.kernels.s2o import _visit_order_torch, _visit_order_triton

    g = torch.Generator().manual_seed(N)
    shape = AttentionShape(2, H, HK, N, N + cached, 64, causal_offset=cached)
    nq, nk = shape.q_blocks, shape.k_blocks
    scores = (torch.randn(2, H, nq, nk, generator=g) * 4).round() / 4  # many exact ties, both signs
    q_sim = torch.rand(2, H, nq, generator=g)
    k_sim = torch.rand(2, HK, nk, generator=g)
    q_sim[..., ::3], k_sim[..., ::4] = 0.2, 0.2  # exactly theta: forced (similar means above theta), as in stage 1
    theta = torch.full((H,), 0.2)
    kw = dict(is_causal=causal, simthreshd1=theta, segment=segment, attention_sink=sink)
    expected = _visit_order_torch(scores, q_sim, k_sim, shape, **kw)
    got = _visit_order_triton(scores, q_sim, k_sim, shape, **kw)
    for name, a, b in zip(("index", "n_unmasked", "n_forced", "count"), got, expected):
        assert torch.equal(a, b), name


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
    ref_out, ref_stats = s2o_attention(q, k, v, backend="reference", out=poisoned_like(q), **kw)
    assert torch.equal(ref_out, ref.to(dtype)), "the reference backend's output, in the call's layout"
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


def one_dominant_key_block(n_key_blocks, heads=2, head_dim=64, q_len=200, seed=0, dtype=torch.bfloat16):
    """(q, k, v), HND, whose every query scores key block 0 about 230 log2 units above each other key block: exp2 of
    the others' scores underflows to exactly 0 in float32, so once block 0 is in, each later tile adds exactly 0 to
    a row's normaliser (a relative gain of exactly 0). Block 0 ranks first in S2O's order; with simthreshd1=-1 no
    block is forced (the keys of a block point one way: similarity near 1)."""
    g = torch.Generator().manual_seed(seed)
    axis = torch.zeros(head_dim)
    axis[0] = (80 * head_dim ** 0.5) ** 0.5  # scores of +-80 (natural units) on blocks 0 and the rest
    n_keys = n_key_blocks * BLOCK_K
    sign = torch.where(torch.arange(n_keys) < BLOCK_K, 1.0, -1.0)
    q = axis + 0.1 * torch.randn(1, heads, q_len, head_dim, generator=g)
    k = sign[:, None] * axis + 0.1 * torch.randn(1, heads, n_keys, head_dim, generator=g)
    v = torch.randn(1, heads, n_keys, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("n_key_blocks,tau,check_every,skipped", [(8, 0.0, 2, 0.0), (6, 0.01, 4, 2 / 6),
                                                                  (8, 100.0, 1, 6 / 8)])
def test_stop_test_where_later_tiles_add_exactly_nothing(n_key_blocks, tau, check_every, skipped, backend):
    """tau = 0 visits every block (as documented) also where the later tiles add exactly 0: the walk goes on while
    the mean gain is >= tau (with ``>`` it stopped there: the same output, blocks counted as skipped). Six ranked
    blocks with the test after four stop there, two blocks left: on Hopper that check falls on the second of three
    128-key stages, one before the last (the GPU form is in test_s2o_hopper.py). And the first tile that gives a
    row a finite score is an infinite gain, no stop even at tau = 100 (taken as its l, about 36 here, it stopped)."""
    q, k, v = one_dominant_key_block(n_key_blocks)
    out, stats = s2o_attention(q, k, v, tau=tau, check_every=check_every, simthreshd1=-1.0, return_sparsity=True,
                               backend=backend, out=poisoned_like(q))
    torch.testing.assert_close(stats.qk_skipped, torch.full((2,), skipped), rtol=0, atol=1e-6)
    assert relative_l1(out, dense_reference(q, k, v, False, "HND")) < L1_TOL[torch.bfloat16]


def a_late_key_outscores_every_earlier_one(late_score=160.0, heads=2, head_dim=64, q_len=200, seed=0):
    """(q, k, v), HND, six key blocks: blocks 0-2 score 0 (natural units) for every query; block 3 has one key
    scoring ``late_score`` and 63 scoring -10 (block mean below -7: S2O ranks it fourth); blocks 4-5 score -20. At
    160, exp2 of every earlier score underflows to 0 in float32 at block 3's new max, so the normaliser before that
    tile is exactly 0 and the tile's gain infinite, as for a row's first finite score; at 14 that normaliser is
    192 e^-14, about 1.6e-4, and the gain about 6300. Nothing is forced with simthreshd1=-1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(1, heads, q_len, head_dim)
    q[..., 0] = head_dim ** 0.5  # q . k * scale = k[0]
    k = torch.randn(1, heads, 6 * BLOCK_K, head_dim, generator=g)
    k[..., 0] = 0.0
    k[:, :, 3 * BLOCK_K:4 * BLOCK_K, 0] = -10.0
    k[:, :, 3 * BLOCK_K, 0] = late_score
    k[:, :, 4 * BLOCK_K:, 0] = -20.0
    return q.bfloat16(), k.bfloat16(), torch.randn(1, heads, 6 * BLOCK_K, head_dim, generator=g).bfloat16()


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("late_score", [160.0, 14.0])
def test_a_late_tile_that_outscores_every_earlier_one_is_a_large_gain(late_score, backend):
    """With check_every=4 the test after block 3 sees a normaliser before the tile of exactly 0 (an infinite gain)
    or about 1.6e-4 (a gain about 6300), so the walk goes on at tau = 100. It stopped with two blocks left where
    the gain was taken as the tile's own l (about 1): for a normaliser of 0 (``before >= 0`` for ``> 0``), or below
    1 (the divisor clamped at 1 instead of 1e-30). On Hopper that check falls on the second block of a 128-key stage
    (the GPU form is in test_s2o_hopper.py)."""
    q, k, v = a_late_key_outscores_every_earlier_one(late_score)
    _, (index, _, n_forced, _), _ = order_for(q, k, False, theta=-1.0)
    assert (n_forced == 0).all() and (index[..., 3] == 3).all() and (index[..., :3].sort(-1).values
                                                                       == torch.arange(3)).all(), "the premise"
    out, stats = s2o_attention(q, k, v, tau=100.0, check_every=4, simthreshd1=-1.0, return_sparsity=True,
                               backend=backend, out=poisoned_like(q))
    torch.testing.assert_close(stats.qk_skipped, torch.zeros(2), rtol=0, atol=0)
    assert relative_l1(out, dense_reference(q, k, v, False, "HND")) < L1_TOL[torch.bfloat16]


def future_keys_outscore_the_past(n, heads=2, head_dim=64, seed=0):
    """(q, k, v), HND, one K/V head: key j scores j (natural units, bf16-rounded) for every query, so under causal
    masking each key a row must not see outscores every key it may: a diagonal block walked without its mask hands
    the row a future key's value."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(1, heads, n, head_dim)
    q[..., 0] = head_dim ** 0.5
    k = torch.zeros(1, 1, n, head_dim)
    k[..., 0] = torch.arange(n)
    return q.bfloat16(), k.bfloat16(), torch.randn(1, 1, n, head_dim, generator=g).bfloat16()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_walk_with_a_sink_masks_the_diagonal(backend):
    """With attention_sink, segment=128 and nothing forced by similarity, a query block m >= 1 has three forced
    blocks: the sink (block 0, seen whole) and its two diagonal blocks. The Gluon walk pairs the sink with the
    first diagonal block in one stage, which must be masked (the GPU form is in test_s2o_hopper.py); here the
    Triton walk and the reference on the same call."""
    q, k, v = future_keys_outscore_the_past(1000)
    _, (_, n_unmasked, n_forced, _), _ = order_for(q, k, True, theta=-1.0, segment=128, sink=True)
    assert (n_unmasked[..., 1:] == 1).all() and (n_forced[..., 1:] == 3).all()
    out = s2o_attention(q, k, v, is_causal=True, attention_sink=True, segment=128, simthreshd1=-1.0, tau=None,
                        backend=backend, out=poisoned_like(q))
    assert relative_l1(out, dense_reference(q, k, v, True, "HND")) < L1_TOL[torch.bfloat16]


def test_visit_order_backend_picks_its_path(monkeypatch):
    """backend "triton" sorts in Triton, "reference" (and "auto" on CPU tensors) in PyTorch, and rows whose padded
    key-block count exceeds MAX_SORTED_BLOCKS take PyTorch whatever the backend. Both paths give the same order
    (test_visit_order), so only which one runs tells them apart."""
    from sparge_diffusers.kernels import s2o as s2o_module
    calls = []
    for name in ("_visit_order_torch", "_visit_order_triton"):
        original = getattr(s2o_module, name)
        monkeypatch.setattr(s2o_module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    q, k, _ = video_like_qkv((1, 8, 40), heads=2, head_dim=32)  # 320 tokens: 5 key blocks, 8 padded
    for limit, backend, expected in ((None, "triton", "_visit_order_triton"), (None, "reference", "_visit_order_torch"),
                                     (None, "auto", "_visit_order_torch"), (8, "triton", "_visit_order_triton"),
                                     (4, "triton", "_visit_order_torch")):
        if limit is not None:
            monkeypatch.setattr(s2o_module, "MAX_SORTED_BLOCKS", limit)
        calls.clear()
        order_for(q, k, False, backend=backend)
        assert calls == [expected], (limit, backend)


def test_tau_none_visits_everything_without_the_check():
    q, k, v = video_like_qkv((1, 8, 40), heads=2, head_dim=64)
    out, stats = s2o_attention(q, k, v, tau=None, return_sparsity=True, backend="triton")
    assert stats.sparsity == 0
    assert relative_l1(out, dense_reference(q, k, v, False, "HND")) < L1_TOL[torch.bfloat16]


def test_s2o_errors():
    q, k, v = video_like_qkv((1, 8, 16), heads=2, head_dim=64)
    for segment in (100, 0, -128):
        with pytest.raises(ValueError, match="segment must be a positive multiple of 128"):
            s2o_attention(q, k, v, segment=segment)
    for theta in (1.5, -1.5):  # a cosine similarity's range
        with pytest.raises(ValueError, match="simthreshd1"):
            s2o_attention(q, k, v, simthreshd1=theta)
    with pytest.raises(ValueError, match="tau"):
        s2o_attention(q, k, v, tau=-0.1)
    with pytest.raises(ValueError, match="tau"):
        s2o_attention(q, k, v, tau=float("nan"))
    for check_every in (0, True, 2.0):  # True was taken as 1
        with pytest.raises(ValueError, match="check_every"):
            s2o_attention(q, k, v, check_every=check_every)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        s2o_attention(q.float(), k.float(), v.float(), backend="triton")


def test_visit_order_checks_the_statistics_against_the_shape():
    """s2o_visit_order sized its Triton passes by ``shape`` alone: statistics of other sizes were read past their end,
    and strided means (a view) were read as contiguous. Now they raise, and views are copied first."""
    q, k, _ = llm_like_qkv(300, heads=2, kv_heads=1, head_dim=32)
    shape, want, (qm, km, qs, ks) = order_for(q, k, True, backend="triton")
    theta = torch.full((2,), 0.6)
    kw = dict(is_causal=True, scale=32 ** -0.5, simthreshd1=theta, segment=256, attention_sink=False, backend="triton")
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (qm, km)]
    assert not strided[0].is_contiguous()
    got = s2o_visit_order(*strided, qs, ks, shape, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for i, name in enumerate(("q_means", "k_means", "q_sim", "k_sim")):
        for bad in ((qm, km, qs, ks)[i][..., :-1], (qm, km, qs, ks)[i].long(), (qm, km, qs, ks)[i].tolist()):
            args = [qm, km, qs, ks]
            args[i] = bad
            with pytest.raises(ValueError, match=f"{name} must be a float tensor of shape"):
                s2o_visit_order(*args, shape, **kw)
    with pytest.raises(ValueError, match="simthreshd1 must be a float tensor of shape \\(2,\\)"):
        s2o_visit_order(qm, km, qs, ks, shape, **dict(kw, simthreshd1=theta[:1]))
    for flag in ("is_causal", "attention_sink"):  # "False" was read as True
        for bad in ("False", 0, None):
            with pytest.raises(ValueError, match=f"{flag} must be True or False"):
                s2o_visit_order(qm, km, qs, ks, shape, **dict(kw, **{flag: bad}))


def test_a_reused_order_is_checked_against_the_call():
    """s2o_attention loaded key blocks through any order it was given: one built without causal masking let a
    causal call's queries see later keys (its ranked blocks are unmasked), and one of another shape or out of range
    read outside the keys on a GPU."""
    import copy

    q, k, v = llm_like_qkv(300, heads=2, kv_heads=1, head_dim=32)
    _, causal_order, _ = order_for(q, k, True)
    _, plain_order, _ = order_for(q, k, False)
    kw = dict(is_causal=True, segment=256, backend="reference")
    want = s2o_attention(q, k, v, **kw)
    assert torch.equal(s2o_attention(q, k, v, order=causal_order, **kw), want)
    assert torch.equal(s2o_attention(q, k, v, order=tuple(causal_order), **kw), want)  # by hand: range-checked
    with pytest.raises(ValueError, match="built for .* is_causal=False"):
        s2o_attention(q, k, v, order=plain_order, **kw)
    with pytest.raises(ValueError, match="built for"):
        s2o_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), order=plain_order, **dict(kw, backend="triton"))
    with pytest.raises(ValueError, match="order has shapes"):
        s2o_attention(q[:, :, :200], k[:, :, :200], v[:, :, :200], order=causal_order, **kw)
    index, n_unmasked, n_forced, count = causal_order
    past_the_end = index.clone()
    past_the_end[0, 0, 0, 0] = index.shape[-1]
    for bad, match in (((index.long(), n_unmasked, n_forced, count), "int32"),
                       ((index, n_unmasked[..., :-1], n_forced, count), "order has shapes"),
                       ((past_the_end, n_unmasked, n_forced, count), r"outside 0\.\.4 "),  # 5 key blocks
                       ((index + 100, n_unmasked, n_forced, count), "outside"),
                       ((index - 1, n_unmasked, n_forced, count), "outside"),
                       ((index, n_unmasked, count + 1, count), "n_forced <= count"),
                       ((index, n_forced + 1, n_forced, count), "n_unmasked <= n_forced"),
                       ((index, n_unmasked, n_forced, count + 100), "count <= 5$"),
                       ((index, n_unmasked, n_forced), "VisitOrder"),
                       ([index, n_unmasked, n_forced, count], "VisitOrder")):
        with pytest.raises(ValueError, match=match):
            s2o_attention(q, k, v, order=bad, **kw)
    # whole blocks only (256 keys): every forced block is unmasked, n_unmasked == n_forced, a valid order
    q, k, v = q[:, :, :256], k[:, :, :256], v[:, :, :256]
    _, whole_blocks, _ = order_for(q, k, False, theta=1.0)
    assert torch.equal(whole_blocks[1], whole_blocks[2])
    kw = dict(segment=256, simthreshd1=1.0, backend="reference")  # the order s2o_attention builds itself
    assert torch.equal(s2o_attention(q, k, v, order=tuple(whole_blocks), **kw), s2o_attention(q, k, v, **kw))
    for moved in (causal_order.to("cpu"), copy.deepcopy(causal_order)):  # keep the record of their call
        assert (moved.shape, moved.is_causal) == (causal_order.shape, True)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_custom_op_matches_s2o_attention_and_passes_opcheck(layout):
    """s2o_attention_op: s2o_attention's output through torch.ops.sparge_diffusers.s2o_attention (q's layout and
    strides), the operator checked by opcheck, one graph under torch.compile, with a causal variant."""
    from sparge_diffusers import s2o_attention_op

    q, k, v = llm_like_qkv(700, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, seed=3, tensor_layout=layout)
    q = q[:, :, 300:] if layout == "HND" else q[:, 300:]  # the last 400 queries: a lower-right chunk
    kw = dict(is_causal=True, causal_variant="lower_right", tau=[0.2, 0.0, 0.1, 0.3], segment=128, check_every=2,
              simthreshd1=-1.0, pvthreshd=6.0, attention_sink=True, tensor_layout=layout)
    out = s2o_attention_op(q, k, v, **kw)
    expected, stats = s2o_attention(q, k, v, return_sparsity=True, **kw)
    assert out.shape == q.shape and torch.equal(out, expected) and stats.sparsity > 0
    args = (q, k, v, True, 0.125, [0.2, 0.0, 0.1, 0.3], 128, 2, [-1.0], [6.0], True, layout, "lower_right")
    torch.library.opcheck(torch.ops.sparge_diffusers.s2o_attention.default, args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: s2o_attention_op(q, k, v, **kw), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), expected)


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


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_s2o_reference_backend_on_cuda_inputs(causal):
    """backend="reference" on CUDA tensors gives the CPU call's result on the GPU (its walk once mixed devices)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v = structured(1, 4, 2, 700, 64, causal, torch.bfloat16, "NHD", seed=11)
    kw = dict(is_causal=causal, tau=0.1, segment=128, check_every=1, tensor_layout="NHD", backend="reference",
              return_sparsity=True)
    out, stats = s2o_attention(q.cuda(), k.cuda(), v.cuda(), **kw)
    expected, expected_stats = s2o_attention(q, k, v, **kw)
    assert out.is_cuda and stats.qk_skipped.is_cuda
    # the walk runs on the CPU either way; the block statistics that rank the blocks are summed on the GPU
    assert relative_l1(out.cpu(), expected) < 1e-2
    assert expected_stats.sparsity > 0.2 and abs(stats.sparsity - expected_stats.sparsity) < 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal,nk", [(False, 700), (True, 512), (False, 3000)])
def test_visit_order_kernel_on_gpu_equals_torch(causal, nk):
    """The compiled sort (1024 and 4096 keys per row) against PyTorch's sorts on the same scores."""
    from sparge_diffusers.kernels.s2o import _visit_order_torch, _visit_order_triton

    g = torch.Generator(device="cuda").manual_seed(nk)
    shape = AttentionShape(1, 4, 2, nk * BLOCK_K - 17, nk * BLOCK_K - 17, 128)
    nq = shape.q_blocks
    scores = torch.randn(1, 4, nq, shape.k_blocks, generator=g, device="cuda")
    q_sim, k_sim = torch.rand(1, 4, nq, generator=g, device="cuda"), torch.rand(1, 2, nk, generator=g, device="cuda")
    kw = dict(is_causal=causal, simthreshd1=torch.full((4,), 0.1, device="cuda"), segment=2048, attention_sink=True)
    for a, b in zip(_visit_order_triton(scores, q_sim, k_sim, shape, **kw),
                    _visit_order_torch(scores, q_sim, k_sim, shape, **kw)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,D", [(False, 128), (False, 64), (True, 128)])
@pytest.mark.parametrize("walk", ["triton", "gluon"])
def test_s2o_on_gpu_stops_alike_with_and_without_counts(causal, D, walk, monkeypatch):
    """The compiled walk without the statistics outputs must stop where the one with them does: Triton 3.6
    once compiled the stop flag away when the visited counts were not stored (see the kernel's comment). Each
    walk: the Triton one, and on Hopper the Gluon one (``s2o_hopper``)."""
    from sparge_diffusers.kernels import attention_hopper, s2o_hopper

    if walk == "gluon" and not attention_hopper.runs_on(torch.device("cuda")):
        pytest.skip("the Gluon walk needs an sm90 GPU")
    monkeypatch.setattr(s2o_hopper, "OVERRIDE", walk == "gluon")
    q, k, v = structured(1, 4, 2 if causal else 4, 4000, D, causal, torch.bfloat16, "HND", seed=5)
    q, k, v = (t.cuda() for t in (q, k, v))
    kw = dict(is_causal=causal, tau=0.01, segment=512, check_every=4)
    out, stats = s2o_attention(q, k, v, return_sparsity=True, **kw)
    assert stats.sparsity > 0.1  # the walk does stop early, over several chunks
    assert torch.equal(s2o_attention(q, k, v, **kw), out)
    assert not torch.equal(s2o_attention(q, k, v, **{**kw, "tau": 0.0}), out)
