"""sparge-diffusers: training-free sparse attention (SpargeAttn) in Triton for diffusion transformers."""

from . import kernels
from .kernels import *  # noqa: F401,F403  (the public API is the kernels' one for now)

__version__ = "0.1.0"
__all__ = list(kernels.__all__)
