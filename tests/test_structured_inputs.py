"""The structured generators (``sparge_diffusers.testing``) and the benchmark workloads built from them
(``sparge_diffusers.workloads``): what their docstrings promise.

Most checks replace ``torch.randn`` by zeros (``quiet_draws``): every term of q and k but the positional one, the
sink's and the stripes' is then exactly zero, so each documented logit shows alone and exactly. Until session 99
``video_like_qkv``'s docstring gave ``locality`` as the peak positional logit (it is twice that), and nothing
checked that ``llm_like_qkv``'s sink was a sink: at its strength of one logit it takes at most 0.04% of a late
query's attention in the ``llama32k`` workload.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import workloads
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv
from sparge_diffusers.workloads import (EXTRA, FULL, SMALL, SMALL_EXTRA, cudnn_attention_fn, exact_attention_rows,
                                        sampled_errors)


@pytest.fixture
def quiet_draws(monkeypatch):
    """``torch.randn`` returns zeros, except (a) a 2-D draw (``llm_like_qkv``'s sink and stripe directions,
    (kv_heads, content_dim)), which gets the first or the second basis vector in turn, so the two directions are
    orthogonal, and (b) with ``quiet_draws.offsets = True``, a (heads, 1, head_dim) draw (the per-head mean
    offsets), which gets ones."""
    state = {"basis": 0}

    def randn(*shape, generator=None, device=None):
        out = torch.zeros(*shape, device=device)
        if len(shape) == 2:
            out[:, state["basis"] % 2] = 1.0  # each call draws the sink's, then the stripes' direction
            state["basis"] += 1
        elif quiet_draws.offsets and len(shape) == 3 and shape[1] == 1:
            out += 1.0
        return out

    quiet_draws.offsets = False
    monkeypatch.setattr(torch, "randn", randn)
    return quiet_draws


def grid_offsets(grid):
    """[N, N, 3] (dt, dy, dx) between the tokens of a row-major (T, H, W) grid, W fastest."""
    T, H, W = grid
    t, y, x = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    coords = torch.stack([t.flatten(), y.flatten(), x.flatten()], -1)
    return coords[None, :, :] - coords[:, None, :]


def logits(q, k, channels=slice(None)):
    """q k^T / sqrt(D) in float32 over the given channels, k/v heads repeated for GQA: [B, H, Nq, Nk]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return q[..., channels].float() @ k[..., channels].float().transpose(-1, -2) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize("head_dim", [64, 128, 10])
def test_video_positional_logit_at_zero_offset_is_half_the_locality_spaced_geometrically(quiet_draws, head_dim):
    q, k, v = video_like_qkv((2, 3, 5), heads=6, kv_heads=3, head_dim=head_dim, locality=(12.0, 3.0),
                             dtype=torch.float32)
    assert not v.any(), "every draw is zero here"
    diagonal = logits(q, k)[0].diagonal(dim1=-2, dim2=-1)  # [heads, N]
    per_kv_head = torch.tensor([12.0, 6.0, 3.0]) / 2  # 12 to 3, geometric over three k/v heads
    expected = per_kv_head.repeat_interleave(2)[:, None].expand_as(diagonal)
    torch.testing.assert_close(diagonal, expected, rtol=1e-5, atol=1e-5)


def test_video_default_locality_gives_positional_logits_of_7_and_1_5(quiet_draws):
    q, k, _ = video_like_qkv((1, 2, 3), heads=3, head_dim=64, dtype=torch.float32)
    diagonal = logits(q, k)[0].diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(diagonal[[0, 2]], torch.tensor([[7.0], [1.5]]).expand(2, 6))


def test_video_positional_logit_depends_on_the_grid_offset_alone_and_falls_away_from_zero(quiet_draws):
    """Tokens are row-major on (T, H, W), W fastest, after the text tokens; the rotary term makes each logit a
    function of the offset alone, largest at zero."""
    grid, text = (3, 4, 5), 3
    q, k, _ = video_like_qkv(grid, heads=2, head_dim=64, text_tokens=text, dtype=torch.float32)
    assert not q[:, :, :text].any() and not k[:, :, :text].any(), "text tokens come first (random: zero here)"
    assert (q[:, :, text:].norm(dim=-1) > 0).all()
    s = logits(q, k)[0, :, text:, text:]  # [heads, N, N]
    offsets = grid_offsets(grid)
    _, group = torch.unique(offsets.reshape(-1, 3), dim=0, return_inverse=True)
    for h in range(2):
        flat = s[h].reshape(-1)
        high = torch.full((int(group.max()) + 1,), -math.inf).scatter_reduce(0, group, flat, "amax")
        low = torch.full_like(high, math.inf).scatter_reduce(0, group, flat, "amin")
        assert (high - low).max() < 1e-4, "equal offsets must give equal logits"
        zero = s[h].diagonal()[0]
        for axis in range(3):
            step = torch.zeros(3, dtype=torch.long)
            step[axis] = 1
            one_step = s[h][(offsets == step).all(-1)]
            assert one_step.numel() and (one_step < zero - 1e-3).all(), f"a step along axis {axis}"


def test_video_heads_run_from_local_to_broad():
    """With real draws: the first head gives a visual query's grid neighbours (one step or less) over 40% of its
    attention, more than 1.5 times what the last head gives them (0.56 and 0.25 measured at this size)."""
    grid = (4, 12, 16)
    q, k, _ = video_like_qkv(grid, heads=4, head_dim=64, dtype=torch.float32)
    near = grid_offsets(grid).abs().amax(-1) <= 1
    weight = logits(q, k)[0].softmax(-1)
    share = (weight * near).sum(-1).mean(-1)
    assert share[0] > 0.4 and share[0] > 1.5 * share[-1]


@pytest.mark.parametrize("make", ["video", "llm"])
def test_each_q_head_is_built_on_its_own_kv_head(quiet_draws, make):
    """GQA: q head h carries k/v head h // (heads // kv_heads)'s positional term, as SDPA's enable_gqa pairs them."""
    if make == "video":
        q, k, _ = video_like_qkv((2, 3, 4), heads=6, kv_heads=2, head_dim=64, dtype=torch.float32)
        channels = slice(None)
    else:
        q, k, _ = llm_like_qkv(90, heads=6, kv_heads=2, head_dim=64, dtype=torch.float32)
        channels = slice(0, 32)  # the positional half; the content half carries the sink and stripe directions
    for h in range(6):
        assert torch.equal(q[:, h, :, channels], k[:, h // 3, :, channels])
    assert not torch.equal(k[:, 0], k[:, 1]), "the k/v heads differ (their locality)"


def test_video_mean_offsets_have_the_documented_norms(quiet_draws):
    """mean_q and mean_k: the norm of the per-head offset added to every visual token of q and of k, relative to
    the mean norm of k's visual tokens before it; text tokens get none."""
    for means in ({"mean_q": 0.7, "mean_k": 2.0}, {}):  # 1.5 and 1.5 by default
        quiet_draws.offsets = False
        kwargs = dict(heads=4, kv_heads=2, head_dim=64, text_tokens=2, dtype=torch.float32, **means)
        q0, k0, _ = video_like_qkv((2, 3, 4), **kwargs)
        quiet_draws.offsets = True
        q1, k1, _ = video_like_qkv((2, 3, 4), **kwargs)
        token_norm = k0[:, :, 2:].norm(dim=-1).mean()
        for before, after, mean in ((q0, q1, means.get("mean_q", 1.5)), (k0, k1, means.get("mean_k", 1.5))):
            offset = after - before
            assert not offset[:, :, :2].any()
            torch.testing.assert_close(offset[:, :, 2:].norm(dim=-1), torch.full(offset.shape[:2] + (24,),
                                       float(mean * token_norm)), rtol=1e-5, atol=1e-5)


def test_llm_mean_offsets_are_one_and_a_half_mean_token_norms(quiet_draws):
    q0, k0, _ = llm_like_qkv(70, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32)
    quiet_draws.offsets = True
    q1, k1, _ = llm_like_qkv(70, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32)
    token_norm = k0.norm(dim=-1).mean()
    for offset in (q1 - q0, k1 - k0):
        torch.testing.assert_close(offset.norm(dim=-1), torch.full(offset.shape[:3], float(1.5 * token_norm)))


@pytest.mark.parametrize("make", [lambda **kw: video_like_qkv((2, 3, 4), text_tokens=3, kv_heads=2, **kw),
                                  lambda **kw: llm_like_qkv(50, kv_heads=2, **kw)])
def test_nhd_layout_is_the_hnd_inputs_transposed(make):
    hnd = make(heads=4, head_dim=16, seed=3)
    nhd = make(heads=4, head_dim=16, seed=3, tensor_layout="NHD")
    for a, b in zip(hnd, nhd):
        assert b.is_contiguous() and torch.equal(b, a.transpose(1, 2))


def test_llm_sink_and_stripe_logits_are_what_their_arguments_say(quiet_draws):
    """Every query's score of token 0 gains sink_logit, and of each stripe key stripe_logit, in the content dims;
    the positional half gives the local window, whose logit at zero offset falls from 6 to 2 over the k/v heads."""
    n, per_1k = 2000, 2.5
    q, k, _ = llm_like_qkv(n, heads=4, kv_heads=2, head_dim=64, stripes_per_1k=per_1k, sink_logit=9.0,
                           stripe_logit=4.0, dtype=torch.float32)
    content = logits(q, k, slice(32, 64))[0]  # [heads, N, N], the same row for every query
    assert (content == content[:, :1]).all()
    row = content[:, 0]
    torch.testing.assert_close(row[:, 0], torch.full((4,), 9.0))
    stripes = (row[0] - 4.0).abs() < 1e-4
    assert int(stripes.sum()) == int(per_1k * n / 1000) and not stripes[0]
    torch.testing.assert_close(row[:, stripes], torch.full((4, 5), 4.0))
    assert not row[:, 1:][:, ~stripes[1:]].any()
    positional = logits(q, k, slice(0, 32))[0].diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(positional, torch.tensor([6.0, 6.0, 2.0, 2.0])[:, None].expand(4, n))


def test_llm_places_at_least_one_stripe_after_the_sink(quiet_draws):
    """One stripe per 1000 tokens by default, rounded down, and at least one."""
    for n, per_1k, stripes in ((50, 1.0, 1), (50, 0.0, 1), (2, 1.0, 1), (1998, 1.0, 1), (3000, None, 3)):
        options = {} if per_1k is None else {"stripes_per_1k": per_1k}
        q, k, _ = llm_like_qkv(n, heads=2, kv_heads=1, head_dim=64, dtype=torch.float32, **options)
        row = logits(q, k, slice(32, 64))[0, 0, -1]
        assert int(((row[1:] - 0.75).abs() < 1e-5).sum()) == stripes, (n, per_1k)


def sink_share(workload, rows=64):
    """Attention weight of token 0, per head, averaged over the last ``rows`` queries (float32, causal)."""
    q, k, _ = workload.make("cpu", 0)
    n = workload.seq_len
    last = torch.arange(n - rows, n)
    s = logits(q[:, :, last], k)
    s = s.masked_fill(torch.arange(n)[None, :] > last[:, None], -math.inf)
    return s.softmax(-1)[0, :, :, 0].mean(-1)


def test_llama_workloads_default_sink_is_mild_and_the_sink_workload_s_is_strong():
    """What the module docstring says, at the workloads' small sizes (1024 tokens): the default sink takes under
    1% of a late query's attention in every head (0.02-0.45% measured), llama32k_sink's over 25% (30-72%)."""
    assert sink_share(SMALL["llama32k"]).max() < 0.01
    assert sink_share(SMALL_EXTRA["llama32k_sink"]).min() > 0.25


def test_strong_sink_and_stripes_also_spread_the_per_key_logits_all_queries_share():
    """The docstring's side effect: the q-side sink and stripe terms meet every key's content noise. Shared per-key
    logit (mean over the last 1024 queries, keys 1-999): std over keys 0.55-0.89 at the defaults, 1.9-2.1 at 12
    and 6 (measured, 2048 tokens)."""
    spreads = []
    for options in ({}, {"sink_logit": 12.0, "stripe_logit": 6.0}):
        q, k, _ = llm_like_qkv(2048, heads=8, kv_heads=2, head_dim=128, dtype=torch.float32, **options)
        shared = logits(q[:, :, 1024:], k[:, :, 1:1000]).mean(-2)[0]  # [heads, keys]
        spreads.append(shared.std(-1))
    assert spreads[0].max() < 1.0 and spreads[1].min() > 1.7


def test_a_strong_sink_needs_its_block_kept():
    """The README's advice for causal LLM attention on bare tensors: on llama32k_sink's small version (float32
    reference) the defaults drop the sink's block for some query blocks (relative L1 0.256 measured), and
    attention_sink=True keeps it (0.0015)."""
    from sparge_diffusers import sparge_attention

    q, k, v = SMALL_EXTRA["llama32k_sink"].make("cpu", 0)
    errors = []
    for attention_sink in (False, True):
        out = sparge_attention(q, k, v, is_causal=True, attention_sink=attention_sink, backend="reference")
        errors.append(workloads.sampled_relative_l1(out, q, k, v, True, rows=1024))
    assert errors[0] > 0.1 and errors[1] < 0.01


def test_generators_refuse_strengths_they_cannot_use():
    cases = [
        (lambda: video_like_qkv((1, 4, 4), locality=(0.0, 3.0)), r"locality\[0\] must be a finite positive"),
        (lambda: video_like_qkv((1, 4, 4), locality=(14.0, math.nan)), r"locality\[1\] must be"),
        (lambda: video_like_qkv((1, 4, 4), locality=(14.0, -3.0)), r"locality\[1\] must be"),
        (lambda: video_like_qkv((1, 4, 4), locality=(14.0,)), "locality must be"),
        (lambda: video_like_qkv((1, 4, 4), locality=(True, 3.0)), r"locality\[0\] must be"),
        (lambda: video_like_qkv((1, 4, 4), mean_q=math.inf), "mean_q must be a finite number"),
        (lambda: video_like_qkv((1, 4, 4), mean_k="1"), "mean_k must be a finite number"),
        (lambda: llm_like_qkv(16, stripes_per_1k=-1.0), "stripes_per_1k must be >= 0"),
        (lambda: llm_like_qkv(16, stripes_per_1k=math.nan), "stripes_per_1k must be a finite"),
        (lambda: llm_like_qkv(16, sink_logit=None), "sink_logit must be a finite number"),
        (lambda: llm_like_qkv(16, stripe_logit=math.inf), "stripe_logit must be a finite number"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    llm_like_qkv(16, sink_logit=-2, stripe_logit=0)  # any finite logit, an int too
    video_like_qkv((1, 4, 4), locality=(0.5, 1), mean_q=0, mean_k=-1.0)  # any positive locality, any finite mean


def test_full_workloads_are_the_issue_s_shapes():
    shapes = {name: (w.batch, w.heads, w.kv_heads, w.seq_len, w.head_dim, w.causal) for name, w in
              {**FULL, **EXTRA}.items()}
    assert shapes == {
        "cogvideox": (2, 30, 30, 17776, 64, False),
        "mochi": (1, 24, 24, 44776, 128, False),
        "flux": (1, 24, 24, 4608, 128, False),
        "llama32k": (1, 32, 8, 32768, 128, True),
        "gemma3_32k": (1, 16, 8, 32768, 256, True),
        "llama32k_sink": (1, 32, 8, 32768, 128, True),
    }
    assert list(FULL) == ["cogvideox", "mochi", "flux", "llama32k"], "the four that run by default"
    assert set(SMALL) == set(FULL) and set(SMALL_EXTRA) == set(EXTRA)
    for name, small in {**SMALL, **SMALL_EXTRA}.items():  # smaller grids, sequences and head counts, nothing else
        full = {**FULL, **EXTRA}[name]
        assert small.name == full.name == name
        assert (small.head_dim, small.causal, small.heads > small.kv_heads) == (
            full.head_dim, full.causal, full.heads > full.kv_heads)


def test_full_workloads_hand_their_sizes_to_the_generators(monkeypatch):
    """The full sizes are too large to build on a CPU: the generators are recorded in their place."""
    calls = []
    monkeypatch.setattr(workloads, "video_like_qkv", lambda *a, **kw: calls.append(("video", a, kw)))
    monkeypatch.setattr(workloads, "llm_like_qkv", lambda *a, **kw: calls.append(("llm", a, kw)))
    grids = {"cogvideox": ((13, 30, 45), 226), "mochi": ((28, 30, 53), 256), "flux": ((1, 64, 64), 512)}
    for name, w in {**FULL, **EXTRA}.items():
        calls.clear()
        w.make("meta", 5)
        (kind, args, kw), = calls
        assert kw["device"] == "meta" and kw["seed"] == 5 and kw["heads"] == w.heads and kw["head_dim"] == w.head_dim
        if kind == "video":
            grid, text = grids[name]
            assert args == (grid,) and kw["text_tokens"] == text and kw["batch"] == w.batch
            assert math.prod(grid) + text == w.seq_len and not w.causal
        else:
            assert args == (w.seq_len,) and kw["kv_heads"] == w.kv_heads and w.causal and w.batch == 1
            strong = name == "llama32k_sink"
            assert (kw.get("sink_logit"), kw.get("stripe_logit")) == ((12.0, 6.0) if strong else (None, None))


@pytest.mark.parametrize("name", [*SMALL, *SMALL_EXTRA])
def test_small_workloads_build_inputs_of_their_sizes(name):
    w = {**SMALL, **SMALL_EXTRA}[name]
    q, k, v = w.make("cpu", 1)
    assert q.shape == (w.batch, w.heads, w.seq_len, w.head_dim)
    assert k.shape == v.shape == (w.batch, w.kv_heads, w.seq_len, w.head_dim)
    assert q.dtype == torch.bfloat16 and all(torch.isfinite(t).all() for t in (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_per_chunk", [1, 4, 8])
def test_exact_attention_rows_is_sdpa_on_those_rows(causal, heads_per_chunk):
    """GQA heads, a chunk that does not divide the heads, rows out of order, and the causal mask by position."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 50, 16, generator=g, dtype=torch.float64).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 50, 16, generator=g, dtype=torch.float64).to(torch.bfloat16) for _ in range(2))
    rows = torch.tensor([49, 0, 7, 23])
    out = exact_attention_rows(q, k, v, rows, causal, heads_per_chunk=heads_per_chunk)
    full = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                          v.double().repeat_interleave(3, 1), is_causal=causal)
    assert out.dtype == torch.float32 and out.shape == (2, 6, 4, 16)
    torch.testing.assert_close(out.double(), full[:, :, rows], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="heads_per_chunk must be a positive int"):
        exact_attention_rows(q, k, v, rows, causal, heads_per_chunk=0)


def test_sampled_errors_give_the_mse_and_draw_the_rows_from_the_seed():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    out = exact + 0.01 * torch.randn(exact.shape, generator=g, dtype=torch.float64)
    l1, mse = sampled_errors(out.float(), q, k, v, True, rows=40)
    assert l1 == pytest.approx(float((out - exact).abs().sum() / exact.abs().sum()), rel=1e-4)
    assert mse == pytest.approx(float(((out.float().double() - exact) ** 2).mean()), rel=1e-4)
    wrong = out.clone()
    wrong[:, :, 5] += 1.0  # one row off: a sample of 10 rows finds it or not, by the seed
    found = {sampled_errors(wrong.float(), q, k, v, True, rows=10, seed=s)[1] > 0.01 for s in range(20)}
    assert found == {True, False}
    assert sampled_errors(wrong.float(), q, k, v, True, rows=10, seed=3) == sampled_errors(
        wrong.float(), q, k, v, True, rows=10, seed=3)


def test_sampled_metrics_take_2048_distinct_rows_by_default(monkeypatch):
    """The 2048 sampled query rows that the README's error figures name, drawn once for both metrics."""
    drawn = []

    def exact_rows(q, k, v, rows, causal, heads_per_chunk=4):
        drawn.append(rows)
        return torch.zeros(q.shape[0], q.shape[1], len(rows), v.shape[-1])

    monkeypatch.setattr(workloads, "exact_attention_rows", exact_rows)
    q = torch.randn(1, 1, 3000, 8)
    out = torch.ones(1, 1, 3000, 8)
    assert sampled_errors(out, q, q, q, True) == (math.inf, 1.0)
    assert workloads.sampled_relative_l1(out, q, q, q, True) == math.inf
    assert len(drawn[0]) == 2048 and torch.equal(drawn[0], drawn[0].unique()) and torch.equal(drawn[0], drawn[1])


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_baseline_runs_sdpa_under_the_cudnn_backend_with_repeated_kv_heads(monkeypatch, causal):
    """On the CPU, with the backend context recorded in place of torch's (which has no cuDNN kernel here)."""
    import contextlib

    import torch.nn.attention as attention

    backends = []

    @contextlib.contextmanager
    def record(backend):
        backends.append(backend)
        yield

    monkeypatch.setattr(attention, "sdpa_kernel", record)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 30, 16, generator=g)
    k, v = (torch.randn(1, 2, 30, 16, generator=g) for _ in range(2))
    run = cudnn_attention_fn(q, k, v, causal)
    out = run()
    assert backends == [attention.SDPBackend.CUDNN_ATTENTION]
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=causal)
    torch.testing.assert_close(out, expected)
    assert torch.equal(cudnn_attention_fn(q, q, q, causal)(), F.scaled_dot_product_attention(q, q, q,
                                                                                          is_causal=causal))


@pytest.mark.gpu
def test_gpu_cudnn_baseline_matches_exact_attention():
    q, k, v = llm_like_qkv(3000, heads=8, kv_heads=2, head_dim=128, device="cuda", seed=2)
    out = cudnn_attention_fn(q, k, v, True)()
    rows = torch.arange(0, 3000, 7, device="cuda")
    exact = exact_attention_rows(q, k, v, rows, True)
    diff = (out[:, :, rows].float() - exact).abs().sum() / exact.abs().sum()
    assert out.shape == q.shape and diff < 0.01
