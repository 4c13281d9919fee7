"""Evaluation: image and video quality metrics, fidelity against dense attention, and the eval runner.

Needs the ``eval`` extra (torchmetrics, matplotlib; open-clip-torch for open_clip models).
"""

from .clip import ClipModel, clip_score, clip_temp, clipsim, from_open_clip, load_clip
from .distribution import fid
from .dover import DoverScorer, dover_views, fuse_dover_scores
from .fidelity import LPIPS, psnr, ssim
from .run import AttentionMode, evaluate, parse_modes
from .video import sharpness, temporal_flicker

__all__ = ["ClipModel", "clip_score", "clip_temp", "clipsim", "from_open_clip", "load_clip", "fid", "LPIPS", "psnr",
           "ssim", "AttentionMode", "evaluate", "parse_modes", "sharpness", "temporal_flicker", "DoverScorer",
           "dover_views", "fuse_dover_scores"]
