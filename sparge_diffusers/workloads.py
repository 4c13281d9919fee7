"""Built-in attention workloads: the benchmark shapes of real models, with structured inputs.

Shared by ``sparge-diffusers bench`` and ``benchmarks/attention.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .kernels._inputs import check_positive_int
from .testing import llm_like_qkv, video_like_qkv


@dataclass(frozen=True)
class Workload:
    """One attention call of a model: sizes plus a maker of structured q, k, v of those sizes."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    causal: bool
    make: Callable[[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (device, seed) -> q, k, v


def _video(name, grid, text, batch, heads, head_dim):
    T, H, W = grid

    def make(device, seed=0):
        return video_like_qkv(grid, batch=batch, heads=heads, head_dim=head_dim, text_tokens=text, device=device,
                              seed=seed)

    return Workload(name, batch, heads, heads, T * H * W + text, head_dim, False, make)


def _llm(name, seq_len, heads, kv_heads, head_dim, **options):
    def make(device, seed=0):
        return llm_like_qkv(seq_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, device=device, seed=seed,
                            **options)

    return Workload(name, 1, heads, kv_heads, seq_len, head_dim, True, make)


# Full sizes: CogVideoX-2B at 49 frames (13x30x45 latents + 226 text tokens), Mochi at 163 frames
# (28x30x53 + 256), Flux at 1024px (64x64 + 512), Llama-3.1-8B prefill at 32K (32 q heads, 8 k/v heads).
FULL = {
    "cogvideox": _video("cogvideox", (13, 30, 45), 226, 2, 30, 64),
    "mochi": _video("mochi", (28, 30, 53), 256, 1, 24, 128),
    "flux": _video("flux", (1, 64, 64), 512, 1, 24, 128),
    "llama32k": _llm("llama32k", 32768, 32, 8, 128),
}

# Shapes taken by name (benchmarks/attention.py --shapes, sparge-diffusers bench --workloads) outside the issue's
# four, which run by default: Gemma-3-12B's prefill at 32K (16 q heads, 8 k/v heads, head dim 256, which the Triton
# kernel runs; the Hopper kernel takes 64 and 128), and llama32k's shape with a strong attention sink and stripes
# (llama32k's own are mild), which also spread the per-key logits that all queries share (see llm_like_qkv).
STRONG_SINK = {"sink_logit": 12.0, "stripe_logit": 6.0}
EXTRA = {
    "gemma3_32k": _llm("gemma3_32k", 32768, 16, 8, 256),
    "llama32k_sink": _llm("llama32k_sink", 32768, 32, 8, 128, **STRONG_SINK),
}

# Small versions that the float32 reference finishes in seconds on a CPU.
SMALL = {
    "cogvideox": _video("cogvideox", (4, 12, 16), 32, 1, 2, 64),
    "mochi": _video("mochi", (4, 12, 16), 32, 1, 2, 128),
    "flux": _video("flux", (1, 24, 32), 64, 1, 2, 128),
    "llama32k": _llm("llama32k", 1024, 4, 1, 128),
}
SMALL_EXTRA = {
    "gemma3_32k": _llm("gemma3_32k", 1024, 4, 2, 256),
    "llama32k_sink": _llm("llama32k_sink", 1024, 4, 1, 128, **STRONG_SINK),
}


def cudnn_attention_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       causal: bool) -> Callable[[], torch.Tensor]:
    """A no-argument callable running SDPA with the cuDNN backend on HND inputs (k/v heads repeated for GQA),
    the baseline every timing is compared with."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(group, 1) if group > 1 else t for t in (k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)

    return run


def exact_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, causal: bool,
                         heads_per_chunk: int = 4) -> torch.Tensor:
    """Float32 attention of the query rows ``rows`` (HND), computed in head chunks: O(len(rows) * N) memory."""
    check_positive_int(heads_per_chunk, "heads_per_chunk")
    N = k.shape[2]
    group = q.shape[1] // k.shape[1]
    out = []
    for h0 in range(0, q.shape[1], heads_per_chunk):
        heads = torch.arange(h0, min(h0 + heads_per_chunk, q.shape[1]), device=q.device)
        qs = q[:, heads][:, :, rows].float()
        ks = k.index_select(1, heads // group).float()  # the k/v head of each q head (GQA)
        vs = v.index_select(1, heads // group).float()
        s = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill(torch.arange(N, device=q.device)[None, :] > rows[:, None], -math.inf)
        out.append(torch.softmax(s, -1) @ vs)
    return torch.cat(out, 1)


def sampled_errors(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   rows: int = 2048, seed: int = 0) -> tuple[float, float]:
    """(relative L1, MSE) of ``out`` against exact float32 attention, on a random sample of query rows (HND).

    Exact attention of every row would need O(N^2) memory at the benchmark sizes; 2048 rows of every head
    estimate the metrics with a spread well below the differences we report.
    """
    if out.shape != q.shape[:3] + v.shape[3:]:  # an NHD output would be indexed along its heads
        raise ValueError(f"out must be (B, H, N, D) like q, got {tuple(out.shape)} for q {tuple(q.shape)}")
    check_positive_int(rows, "rows")  # (0 gave NaN; -5 sampled all rows but 5, True one row)
    N = q.shape[2]
    g = torch.Generator(device=q.device).manual_seed(seed)
    idx = torch.randperm(N, generator=g, device=q.device)[:rows].sort().values
    exact = exact_attention_rows(q, k, v, idx, causal)
    diff = out[:, :, idx].float() - exact
    return float(diff.abs().sum() / exact.abs().sum()), float((diff ** 2).mean())


def sampled_relative_l1(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        rows: int = 2048, seed: int = 0) -> float:
    """The paper's relative L1 of ``out`` against exact float32 attention, on a sample of query rows."""
    return sampled_errors(out, q, k, v, causal, rows, seed)[0]
