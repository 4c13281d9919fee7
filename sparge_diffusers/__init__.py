"""sparge-diffusers: training-free sparse attention (SpargeAttn) in Triton for diffusion transformers."""

from . import kernels
from .kernels import *  # noqa: F401,F403  (the public API is the kernels' one for now)

__version__ = "0.1.0"
__all__ = list(kernels.__all__) + ["apply", "tune"]


def apply(pipe_or_transformer, settings=None, **options):
    """Make a diffusers pipeline or transformer use SpargeAttn; see :func:`sparge_diffusers.pipelines.apply`."""
    from .pipelines import apply as _apply  # imports diffusers only when asked

    return _apply(pipe_or_transformer, settings, **options)


def tune(pipe_or_transformer, calibration, **options):
    """Tune SpargeAttn's thresholds per layer of a diffusers model; see :func:`sparge_diffusers.tuning.tune`."""
    from .tuning.pipeline import tune as _tune

    return _tune(pipe_or_transformer, calibration, **options)
