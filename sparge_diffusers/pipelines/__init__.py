"""diffusers integration: attention processors that compute attention with SpargeAttn."""

from .processor import SpargeProcessor, SpargeSettings, apply, install, installed_processor
from .settings_file import LayerSettingsFile

__all__ = ["SpargeProcessor", "SpargeSettings", "LayerSettingsFile", "apply", "install", "installed_processor"]
