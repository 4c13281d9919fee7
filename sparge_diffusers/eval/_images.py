"""The one input check of every metric: (N, 3, H, W) float images, or (F, 3, H, W) frames, in [0, 1].

The metrics scale by a fixed data range (PSNR, SSIM), normalise for a network (CLIP, LPIPS, Inception, DOVER) or
clamp to [0, 1] on the way in, so uint8 images or [-1, 1] decoder outputs give plausible-looking wrong numbers
instead of failing; this check makes them fail.
"""

from __future__ import annotations

import torch

RANGE_TOLERANCE = 0.01  # a decoder output a hair outside [0, 1] passes; [-1, 1] or [0, 255] data does not


def check_unit_images(x: torch.Tensor, what: str = "images") -> None:
    """Raise ValueError unless ``x`` is a (N, 3, H, W) float tensor of at least one image, with values in [0, 1]
    (NaN left to the metric, which then returns NaN)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: expected (N, 3, H, W) images or (F, 3, H, W) frames in [0, 1], got {shape}")
    if not x.numel():  # PSNR and sharpness gave NaN, LPIPS divided by zero, SSIM failed inside torchmetrics
        raise ValueError(f"{what}: no pixels to measure, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected float values in [0, 1], got {x.dtype} (uint8 images: x.float() / 255)")
    lo, hi = (float(v) for v in torch.aminmax(x.detach()))
    if lo < -RANGE_TOLERANCE or hi > 1 + RANGE_TOLERANCE:
        raise ValueError(f"{what}: values span [{lo:.4g}, {hi:.4g}], not [0, 1] (data in [-1, 1]: (x + 1) / 2; "
                         "in [0, 255]: x / 255)")
