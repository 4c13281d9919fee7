"""Fidelity of a sparse output against the dense output of the same seed: PSNR, SSIM and LPIPS.

Images are float tensors (N, 3, H, W) in [0, 1]; a video is its frames (F, 3, H, W). Video figures average
over frames (PSNR from the mean squared error of the whole clip).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels._inputs import check_positive_int
from ._images import check_unit_images


def _check_pair(x: torch.Tensor, ref: torch.Tensor) -> None:
    check_unit_images(x)
    check_unit_images(ref, "reference")
    if x.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs reference {tuple(ref.shape)}")


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB for data in [0, 1]; ``inf`` for identical inputs."""
    _check_pair(x, ref)
    mse = float(((x.double() - ref.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Structural similarity (Gaussian window 11, sigma 1.5; torchmetrics), mean over images/frames. Images need 6 px
    or more a side."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    _check_pair(x, ref)
    if min(x.shape[-2:]) < 6:  # torchmetrics reflect-pads by half the window: torch's padding error, unexplained
        raise ValueError(f"ssim needs images of at least 6 px a side (its 11-px window is reflect-padded by 5), "
                         f"got {tuple(x.shape[-2:])}")
    return float(cast(torch.Tensor, structural_similarity_index_measure(x.float(), ref.float(), data_range=1.0)))


# LPIPS (Zhang et al. 2018) on AlexNet: unit-normalise the activations of the five ReLUs along channels, square
# their difference, weight channels by learned non-negative 1x1 convolutions, average over space, sum layers.
_TAPS = (1, 4, 7, 9, 11)  # indices of relu1..relu5 in torchvision's alexnet.features
_MIN_SIDE = 31  # the shortest side AlexNet reaches relu5 from (at 30 px the second pooling gets a 2 x 2 map)
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)
ALEXNET_FILE = "alexnet-owt-7be5be79.pth"  # torchvision's ImageNet AlexNet weights


def _alexnet_features() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))


class LPIPS(nn.Module):
    """LPIPS distance with an AlexNet backbone (0 for identical images; lower is closer).

    Build it with :meth:`from_files` for the real metric; the constructor alone gives random weights (tests).
    Images shorter than 31 px on a side, which LPIPS's AlexNet cannot take, are upsampled (bilinear) to 31 first.
    """

    shift: torch.Tensor  # buffers, registered below
    scale: torch.Tensor

    def __init__(self):
        super().__init__()
        self.features = _alexnet_features()
        self.lins = nn.ParameterList([nn.Parameter(torch.rand(1, c, 1, 1)) for c in (64, 192, 384, 256, 256)])
        self.register_buffer("shift", torch.tensor(_SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(_SCALE).view(1, 3, 1, 1))
        self.eval().requires_grad_(False)

    @classmethod
    def from_files(cls, alexnet: str | os.PathLike, lin: str | os.PathLike | None = None) -> "LPIPS":
        """Load the backbone from torchvision's AlexNet file and the layer weights from LPIPS's ``alex.pth``
        (by default the copy that torchmetrics ships)."""
        alexnet = Path(alexnet)
        if not alexnet.is_file():
            raise FileNotFoundError(
                f"LPIPS needs torchvision's ImageNet AlexNet weights, {ALEXNET_FILE}, and {alexnet} is not a file. "
                f"On a machine with network: `python -c \"import torchvision; torchvision.models.alexnet("
                f"weights='IMAGENET1K_V1')\"` saves it to ~/.cache/torch/hub/checkpoints/{ALEXNET_FILE}; copy it "
                "here and pass its path (--lpips-weights).")
        if lin is None:
            import torchmetrics

            lin = Path(torchmetrics.__file__).parent / "functional" / "image" / "lpips_models" / "alex.pth"
        lin = Path(lin)
        if not lin.is_file():
            raise FileNotFoundError(f"LPIPS layer weights {lin} not found (the 'alex.pth' of LPIPS v0.1)")
        model = cls()
        state = torch.load(alexnet, map_location="cpu", weights_only=True)
        model.features.load_state_dict({k[len("features."):]: v for k, v in state.items()
                                        if k.startswith("features.")})
        lins = torch.load(lin, map_location="cpu", weights_only=True)
        for i, p in enumerate(model.lins):
            p.data.copy_(lins[f"lin{i}.model.1.weight"])
        return model

    def _activations(self, x: torch.Tensor) -> list[torch.Tensor]:
        if min(x.shape[-2:]) < _MIN_SIDE:  # departs from LPIPS, which fails there: upsample (bilinear) to fit
            s = _MIN_SIDE / min(x.shape[-2:])
            x = F.interpolate(x, size=(round(x.shape[-2] * s), round(x.shape[-1] * s)), mode="bilinear",
                              align_corners=False)
        x = ((x * 2 - 1) - self.shift) / self.scale  # [0, 1] -> LPIPS's input scaling
        out = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in _TAPS:
                out.append(x / (x.pow(2).sum(1, keepdim=True).sqrt() + 1e-10))
            if i == _TAPS[-1]:
                break
        return out

    @torch.no_grad()
    def forward(self, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """(N,) distances between images in [0, 1]."""
        _check_pair(x, ref)
        return self._distances(x, ref)

    def _distances(self, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        p = next(self.parameters())
        fx, fr = self._activations(x.to(p)), self._activations(ref.to(p))
        return torch.stack([F.conv2d((a - b) ** 2, w).mean((2, 3)).flatten()
                            for a, b, w in zip(fx, fr, self.lins)]).sum(0)

    def distance(self, x: torch.Tensor, ref: torch.Tensor, batch: int = 16) -> float:
        """Mean distance over images/frames, ``batch`` at a time."""
        # range() with a negative step visits nothing: the mean became 0.0, a perfect score
        check_positive_int(batch, "batch")
        _check_pair(x, ref)  # once for the whole pair (an empty one has no mean), not per batch
        total = sum(float(self._distances(x[i:i + batch], ref[i:i + batch]).sum()) for i in range(0, len(x), batch))
        return total / len(x)
