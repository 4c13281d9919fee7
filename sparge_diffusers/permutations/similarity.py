"""Block self-similarity: the paper's Sim-q / Sim-k (Table 4 and Table 9)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .orders import _whole


def block_self_similarity(x: torch.Tensor, block_size: int, tensor_layout: str = "HND") -> torch.Tensor:
    """Mean pairwise cosine similarity of the tokens inside each block, per head.

    Args:
        x: (B, H, N, D) for "HND" or (B, N, H, D) for "NHD".
        block_size: tokens per block (128 for queries, 64 for keys in SpargeAttn); the last block may be short.
    Returns:
        (B, H, ceil(N / block_size)) float32, each value mean_{a,b} cos(x_a, x_b) over the block's ordered
        pairs (diagonal included), computed as |sum_a x_a/|x_a||^2 / n^2.
    """
    if tensor_layout not in ("HND", "NHD"):
        raise ValueError(f"tensor_layout must be 'HND' or 'NHD', got {tensor_layout!r}")
    size = _whole(block_size)  # True read as 1, 64.0 failed inside F.pad
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or size is None or size < 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expected a 4-D tensor and an int block_size >= 1, got shape {shape}, {block_size!r}")
    block_size = size
    xh = x if tensor_layout == "HND" else x.transpose(1, 2)
    if not xh.shape[2] or not xh.shape[3]:  # no tokens: an IndexError; no channels: a similarity of 0
        raise ValueError(f"block_self_similarity needs tokens with channels, got shape {tuple(x.shape)}")
    B, H, N, D = xh.shape
    nb = math.ceil(N / block_size)
    unit = F.normalize(xh.float(), dim=-1)
    unit = F.pad(unit, (0, 0, 0, nb * block_size - N)).view(B, H, nb, block_size, D)
    counts = torch.full((nb,), float(block_size), device=x.device)
    counts[-1] = N - (nb - 1) * block_size
    summed = unit.sum(dim=3)
    return (summed * summed).sum(-1) / counts**2
