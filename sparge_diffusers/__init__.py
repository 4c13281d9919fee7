"""sparge-diffusers: training-free sparse attention (SpargeAttn) in Triton for diffusion transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import kernels
from .kernels import *  # noqa: F401,F403  (the public API is the kernels' one for now)

if TYPE_CHECKING:  # for the annotations only: importing pipelines here would import diffusers with the package
    from .pipelines import LayerSettingsFile, SpargeProcessor, SpargeSettings

__version__ = "0.1.0"
__all__ = list(kernels.__all__) + ["apply", "tune"]


def apply(pipe_or_transformer: Any, settings: SpargeSettings | None = None, **options: Any) -> SpargeProcessor:
    """Make a diffusers pipeline or transformer use SpargeAttn; see :func:`sparge_diffusers.pipelines.apply`."""
    from .pipelines import apply as _apply  # imports diffusers only when asked

    return _apply(pipe_or_transformer, settings, **options)


def tune(pipe_or_transformer: Any, calibration: Any, **options: Any) -> LayerSettingsFile:
    """Tune SpargeAttn's thresholds per layer of a diffusers model; see :func:`sparge_diffusers.tuning.tune`."""
    from .tuning.pipeline import tune as _tune

    return _tune(pipe_or_transformer, calibration, **options)
