"""diffusers integration: attention processors that compute attention with SpargeAttn."""

from .processor import SpargeProcessor, SpargeSettings, apply

__all__ = ["SpargeProcessor", "SpargeSettings", "apply"]
