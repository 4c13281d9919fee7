"""FID between two sets of images (torchmetrics' ``FrechetInceptionDistance``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ._images import check_unit_images

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's FID Inception weights


def fid(real: torch.Tensor, fake: torch.Tensor, *, feature: torch.nn.Module | None = None,
        inception_weights: str | os.PathLike | None = None) -> float:
    """Frechet distance between the feature statistics of two image sets ((N, 3, H, W) in [0, 1]).

    Args:
        feature: a custom feature extractor taking float images in [0, 1] (tests, or another backbone).
        inception_weights: the FID Inception-v3 weights file for the standard metric (needs torch-fidelity).
    """
    from torchmetrics.image.fid import FrechetInceptionDistance

    check_unit_images(real, "real images")
    check_unit_images(fake, "generated images")
    if len(real) < 2 or len(fake) < 2:
        raise ValueError(f"FID needs at least two images per set, got {len(real)} and {len(fake)}")
    if feature is None:
        if inception_weights is None or not Path(inception_weights).is_file():
            raise FileNotFoundError(
                f"FID needs the Inception-v3 FID weights, {INCEPTION_FILE} (a torch-fidelity release asset), and "
                f"{inception_weights!r} is not a file. Download it on a machine with network (torch-fidelity "
                "fetches it on first use into ~/.cache/torch/hub/checkpoints/), copy it here, pass --fid-weights")
        metric = FrechetInceptionDistance(feature=2048, normalize=True,
                                          feature_extractor_weights_path=str(inception_weights))
    else:
        metric = FrechetInceptionDistance(feature=feature, normalize=True)
    metric.update(real.float(), real=True)
    metric.update(fake.float(), real=False)
    return float(metric.compute())
