"""Weight-free video quality indicators.

The SpargeAttn paper reports DOVER's aesthetic and technical scores (VQA-a, VQA-t): see eval/dover.py, which
needs DOVER's package and weights. These indicators need neither and are always reported: they compare a
sparse video with its dense twin (a sparse video that flickers more or is blurrier shows it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._images import check_unit_images

_LAPLACIAN = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]).view(1, 1, 3, 3)


def _luma(frames: torch.Tensor) -> torch.Tensor:
    w = torch.tensor([0.299, 0.587, 0.114], dtype=frames.dtype).view(1, 3, 1, 1)
    return (frames * w).sum(1, keepdim=True)


def temporal_flicker(frames: torch.Tensor) -> float:
    """Mean absolute luma change between consecutive frames (0 for a still video; lower is steadier)."""
    check_unit_images(frames, "frames")
    if len(frames) < 2:
        raise ValueError("temporal_flicker needs at least two frames")
    y = _luma(frames.float())
    return float((y[1:] - y[:-1]).abs().mean())


def sharpness(frames: torch.Tensor) -> float:
    """Variance of the luma Laplacian, averaged over frames (0 for flat frames; blur lowers it)."""
    check_unit_images(frames, "frames")
    if (frames.shape[-2] - 2) * (frames.shape[-1] - 2) < 2:  # var() of fewer than two values is NaN
        raise ValueError(f"sharpness needs frames of at least 3 x 4 or 4 x 3 pixels, got {tuple(frames.shape[-2:])}")
    lap = F.conv2d(_luma(frames.float()), _LAPLACIAN)
    return float(lap.flatten(1).var(1).mean())
