"""Structured attention inputs for tests and benchmarks.

Random Gaussian q/k give a flat attention map: nothing to skip and nothing to learn about selection. These
generators build inputs whose attention has the structure of real models, reproducibly from a seed:

* :func:`video_like_qkv`: tokens on a (T, H, W) grid (row-major, W fastest) whose q/k mix a spatially
  smooth content field with a 3-D rotary positional term. The positional amplitude falls from the first
  head to the last, so heads range from local to broad: at the CogVideoX and Flux workloads' full sizes the
  first head gives 20-29% of a visual query's attention to the tokens within one grid step of it, the last
  10-14% (and 32-41% within four steps; "global" before session 99 overstated it).
* :func:`llm_like_qkv`: causal-LM-like q/k with an attention sink on token 0, a rotary local window and a
  few scattered "vertical" key stripes that every query attends to, with grouped-query heads. The sink's and
  the stripes' strengths are logits (``sink_logit``, ``stripe_logit``). The defaults (1.0 and 0.75), which the
  built-in ``llama32k`` workload and every LLM-like benchmark result before session 99 use, make them mild:
  in ``llama32k`` the sink takes at most 0.04% of a late query's attention (the last 64 queries, 32 heads),
  as its logit of 1 sits within the spread of per-key logits that q's mean offset adds.
  ``workloads.EXTRA["llama32k_sink"]`` takes 12 and 6: there the sink takes 1.6-99% (median 16%).
  ``tests/test_structured_inputs.py`` checks both at the workloads' small sizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kernels._inputs import TensorLayout, _is_number, check_layout, check_positive_int


def _check_sizes(heads: int, kv_heads: int, **sizes: int) -> None:
    """ValueError unless every size is a positive int and ``kv_heads`` divides ``heads``: a q with fewer heads
    than k once came back with none (``heads // kv_heads`` = 0), and kv_heads=0 was read as "as many as q"."""
    for name, value in dict(sizes, heads=heads, kv_heads=kv_heads).items():
        check_positive_int(value, name)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")


def _check_real(value: object, name: str, *, positive: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite int or float (not a bool; > 0 where ``positive``):
    a NaN or negative locality reached torch.logspace and came back as NaN inputs."""
    if not _is_number(value) or not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite {'positive ' if positive else ''}number, got {value!r}")


def _rotary_features(positions: torch.Tensor, pairs: int, min_wavelength: float, max_wavelength: float
                     ) -> torch.Tensor:
    """[N, 2*pairs] cos/sin features; their dot product is sum_i cos(w_i * delta), peaked at delta = 0."""
    wavelengths = torch.logspace(math.log10(min_wavelength), math.log10(max_wavelength), pairs,
                                 device=positions.device)
    angles = positions.float()[:, None] * (2 * math.pi / wavelengths)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _finish(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, layout: TensorLayout):
    out = []
    for t in (q, k, v):
        t = t.to(dtype)
        out.append(t if layout == "HND" else t.transpose(1, 2).contiguous())
    return tuple(out)


def video_like_qkv(
    grid: tuple[int, int, int],
    *,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 64,
    kv_heads: int | None = None,
    text_tokens: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    tensor_layout: TensorLayout = "HND",
    locality: tuple[float, float] = (14.0, 3.0),
    mean_q: float = 1.5,
    mean_k: float = 1.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v for ``text_tokens`` text tokens followed by T*H*W visual tokens.

    Args:
        grid: (T, H, W) of the visual tokens.
        locality: (first head, last head) strength of the positional term, spaced geometrically across the
            k/v heads; larger means more local attention. The positional term's logit (after the 1/sqrt(D)
            scale) between a token and itself is half of it: 7 and 1.5 at the default.
        mean_q, mean_k: norm of the per-head mean offset of q and k, relative to the mean token norm.
    Returns:
        (q, k, v) in ``tensor_layout``; k and v have ``kv_heads`` heads (default ``heads``).
    """
    check_layout(tensor_layout)
    kv_heads = heads if kv_heads is None else kv_heads
    if not isinstance(grid, (tuple, list)) or len(grid) != 3:
        raise ValueError(f"grid must be (T, H, W), got {grid!r}")
    T, Hh, W = grid
    _check_sizes(heads, kv_heads, T=T, H=Hh, W=W, batch=batch, head_dim=head_dim)
    if not isinstance(locality, (tuple, list)) or len(locality) != 2:
        raise ValueError(f"locality must be (first head, last head), got {locality!r}")
    for value, name in ((locality[0], "locality[0]"), (locality[1], "locality[1]")):
        _check_real(value, name, positive=True)
    _check_real(mean_q, "mean_q")
    _check_real(mean_k, "mean_k")
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be an int >= 0, got {text_tokens!r}")
    n_vis = T * Hh * W
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = torch.device(device)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    pos_dim = head_dim // 2
    pairs = [pos_dim // 6, pos_dim // 6, pos_dim // 2 - 2 * (pos_dim // 6)]  # t, y, x
    t, y, x = torch.meshgrid(torch.arange(T, device=dev), torch.arange(Hh, device=dev),
                             torch.arange(W, device=dev), indexing="ij")
    pos = torch.cat([_rotary_features(c.flatten(), n, 4.0, 4.0 * max(T, Hh, W))
                     for c, n in zip((t, y, x), pairs)], dim=-1)  # [N, pos_dim rounded down to even]
    content_dim = head_dim - pos.shape[1]  # the rest: an odd pos_dim (head_dim 6, 10) left one channel unfilled
    peak = torch.logspace(math.log10(locality[0]), math.log10(locality[1]), kv_heads, device=dev)
    # a^2 * pos_i . pos_i / sqrt(D) = a^2 * (pos.shape[1] / 2) / sqrt(D) = peak / 2: the logit at zero offset
    amp_pos = (peak * math.sqrt(head_dim) / pos.shape[1]).sqrt()

    channels = 16
    qs, ks, vs = [], [], []
    for _ in range(batch):
        low = randn(1, channels, T // 4 + 2, Hh // 8 + 2, W // 8 + 2)
        field = F.interpolate(low, size=(T, Hh, W), mode="trilinear", align_corners=True)[0]
        field = field.reshape(channels, n_vis).T
        # [N, C], smooth in space-time (one token: no spread to divide by, and std(0) of one row is NaN)
        spread = field.std(0).clamp(min=1e-6) if field.shape[0] > 1 else torch.ones_like(field[0])
        field = (field - field.mean(0)) / spread
        w_qk = randn(kv_heads, channels, content_dim) / math.sqrt(channels)
        w_v = randn(kv_heads, channels, head_dim) / math.sqrt(channels)
        content = field[None] @ w_qk  # [Hkv, N, content_dim]
        k_vis = torch.cat([amp_pos[:, None, None] * pos[None].expand(kv_heads, -1, -1), content], dim=-1)
        k_vis = k_vis + 0.3 * randn(kv_heads, n_vis, head_dim)
        v_vis = field[None] @ w_v + 0.5 * randn(kv_heads, n_vis, head_dim)
        group = heads // kv_heads
        q_vis = k_vis.repeat_interleave(group, 0) + 0.3 * randn(heads, n_vis, head_dim)
        # Real projections have a large mean component. On k it changes no attention weight (it adds the
        # same logit to a whole row) but raises block self-similarity; on q it adds a mild global bias.
        token_norm = k_vis.norm(dim=-1).mean()
        k_vis = k_vis + mean_k * token_norm * F.normalize(randn(kv_heads, 1, head_dim), dim=-1)
        q_vis = q_vis + mean_q * token_norm * F.normalize(randn(heads, 1, head_dim), dim=-1)
        if text_tokens:
            k_txt, v_txt = randn(kv_heads, text_tokens, head_dim), randn(kv_heads, text_tokens, head_dim)
            q_txt = randn(heads, text_tokens, head_dim)
            q_vis = torch.cat([q_txt, q_vis], 1)
            k_vis = torch.cat([k_txt, k_vis], 1)
            v_vis = torch.cat([v_txt, v_vis], 1)
        qs.append(q_vis)
        ks.append(k_vis)
        vs.append(v_vis)
    return _finish(torch.stack(qs), torch.stack(ks), torch.stack(vs), dtype, tensor_layout)


def llm_like_qkv(
    seq_len: int,
    *,
    batch: int = 1,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    tensor_layout: TensorLayout = "HND",
    stripes_per_1k: float = 1.0,
    sink_logit: float = 1.0,
    stripe_logit: float = 0.75,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal-LM-like q, k, v: attention sink, rotary local window and scattered vertical stripes.

    Args:
        stripes_per_1k: key stripes per 1000 tokens (at least one; drawn after the sink, repeats possible).
        sink_logit: the logit (after the 1/sqrt(D) scale) that the sink's shared direction adds to every query's
            score of token 0, and ``stripe_logit`` likewise for each stripe key. Other terms move each score by
            about one logit: q's mean offset, the content dims' noise and the stripe direction's overlap with
            the sink's. The defaults give a mild sink (see the module's docstring). The q-side term also meets
            every other key's content noise, which adds a per-key logit shared by all queries, of standard
            deviation about sink_logit / 8 (stripe_logit / 6 for the stripes' term): at 12 and 6 the shared
            per-key logits spread by 1.9-2.1 (std over keys, 2048 tokens), against 0.55-0.89 at the defaults,
            where q's mean offset gives most of it. As in :func:`video_like_qkv` at its defaults, q and k each
            get a per-head mean offset of norm 1.5 times the mean norm of k's tokens.
    Returns:
        (q, k, v) in ``tensor_layout``; k and v have ``kv_heads`` heads. The local window's positional logit
        at zero offset falls geometrically from 6 (first k/v head) to 2 (last).
    """
    check_layout(tensor_layout)
    _check_sizes(heads, kv_heads, seq_len=seq_len, batch=batch, head_dim=head_dim)
    _check_real(stripes_per_1k, "stripes_per_1k")
    if stripes_per_1k < 0:
        raise ValueError(f"stripes_per_1k must be >= 0, got {stripes_per_1k!r}")
    _check_real(sink_logit, "sink_logit")
    _check_real(stripe_logit, "stripe_logit")
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = torch.device(device)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    group = heads // kv_heads
    pos = _rotary_features(torch.arange(seq_len, device=dev), head_dim // 4, 4.0, 4.0 * seq_len)
    pos_dim = pos.shape[1]  # head_dim // 2 rounded down to even; the content dims take the rest
    window = torch.logspace(math.log10(12.0), math.log10(4.0), kv_heads, device=dev)  # twice the zero-offset logit
    amp = (window * math.sqrt(head_dim) / pos_dim).sqrt()
    content_dim = head_dim - pos_dim
    n_stripes = max(1, int(stripes_per_1k * seq_len / 1000))
    qs, ks, vs = [], [], []
    for _ in range(batch):
        k = torch.cat([amp[:, None, None] * pos[None].expand(kv_heads, -1, -1),
                       0.5 * randn(kv_heads, seq_len, content_dim)], -1)
        q = k.repeat_interleave(group, 0) + 0.5 * randn(heads, seq_len, head_dim)
        # Sink and stripes: a shared direction in the content dims that every query carries.
        sink_dir = F.normalize(randn(kv_heads, content_dim), dim=-1)
        stripe_dir = F.normalize(randn(kv_heads, content_dim), dim=-1)
        scale = math.sqrt(head_dim)
        k[:, 0, pos_dim:] += 4.0 * sink_dir
        if seq_len > 1:  # stripes sit after the sink (a one-token sequence has none: randint(1, 1) raises)
            stripes = torch.randint(1, seq_len, (n_stripes,), generator=gen, device=dev)
            k[:, stripes, pos_dim:] += 3.0 * stripe_dir[:, None, :]
        # with the q term's scale / 10 below: sink 4 * 2.5 * sink_logit / 10 = sink_logit, stripes 3 * (10 / 3) / 10
        # (2.5 and 10 / 3 * 0.75 = 2.5, the coefficients before session 99: the default inputs are unchanged)
        q_dirs = (sink_logit * 2.5) * sink_dir + (stripe_logit * 10 / 3) * stripe_dir
        q[:, :, pos_dim:] += q_dirs.repeat_interleave(group, 0)[:, None, :] * (scale / 10)
        norm = k.norm(dim=-1).mean()
        k = k + 1.5 * norm * F.normalize(randn(kv_heads, 1, head_dim), dim=-1)  # mean offsets, as above
        q = q + 1.5 * norm * F.normalize(randn(heads, 1, head_dim), dim=-1)
        qs.append(q)
        ks.append(k)
        vs.append(randn(kv_heads, seq_len, head_dim))
    return _finish(torch.stack(qs), torch.stack(ks), torch.stack(vs), dtype, tensor_layout)
