"""DOVER video quality (VQA-technical, VQA-aesthetic), the video metric of the SpargeAttn paper.

DOVER (Wu et al., "Exploring Video Quality Assessment on User Generated Contents from Aesthetic and
Technical Perspectives", ICCV 2023) scores a video from two views: a *technical* view of 7x7 spatial
fragments (32x32 crops, one per grid cell, spliced into 224x224 frames) over 3 temporal chunks of 32 frames
taken every 2nd frame, through a Swin-3D; and an *aesthetic* view of 32 frames spread over the video,
resized to 224x224, through a ConvNeXt-3D. Its model code is not on PyPI, so this module builds the views
and the score fusion itself and takes the network from DOVER's own package:

    pip install git+https://github.com/VQAssessment/DOVER.git   (and its requirements: timm, einops,
                                                                 decord, opencv-python, scikit-video)
    weights: https://huggingface.co/teowu/DOVER/resolve/main/DOVER.pth   (~ 230 MB)

Departures from DOVER's own sampler, for a fair dense-vs-sparse comparison: the random parts (the temporal
offset of a chunk when the video is long, the crop offset inside each grid cell) are drawn from a seeded
generator, so two videos of the same size are sampled at the same places; frames come from the generated
tensor, not from a decoded file.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from ._images import check_unit_images

DOVER_WEIGHTS_URL = "https://huggingface.co/teowu/DOVER/resolve/main/DOVER.pth"
DOVER_INSTALL = "pip install git+https://github.com/VQAssessment/DOVER.git"

# DOVER's model options (its dover.yml): Swin-3D tiny with fragment biases for the technical view,
# ConvNeXt-3D tiny for the aesthetic view, one regression head per view.
MODEL_ARGS: dict[str, Any] = {
    "backbone": {"technical": {"type": "swin_tiny_grpb", "checkpoint": True, "pretrained": None},
                 "aesthetic": {"type": "conv_tiny"}},
    "backbone_preserve_keys": "technical,aesthetic",
    "divide_head": True,
    "vqa_head": {"in_channels": 768, "hidden_channels": 64},
}
# ImageNet mean and std on the 0-255 scale, as DOVER normalises its views.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)
# Score-level fusion of DOVER's inference script: each raw score standardised by its spread over DOVER's
# training sets, weighted, and squashed to (0, 1).
FUSION = {"technical": (-0.1107, 0.07355, 0.6104), "aesthetic": (0.08285, 0.03774, 0.3896)}

FRAGMENTS, FRAGMENT_SIZE, CLIP_LEN, FRAME_INTERVAL, TECHNICAL_CHUNKS = 7, 32, 32, 2, 3
AESTHETIC_SIZE = 224


def chunk_frame_indices(num_frames: int, chunk_len: int, chunks: int, interval: int,
                        generator: torch.Generator) -> torch.Tensor:
    """DOVER's temporal sampler: the video split into ``chunks`` equal spans, ``chunk_len`` frames every
    ``interval`` frames from a random offset inside each span (0 when the span is too short), indices wrapped
    modulo the length (short videos repeat frames, as in DOVER)."""
    if num_frames < 1:
        raise ValueError("a video needs at least one frame")
    span = num_frames // chunks
    starts = torch.arange(chunks) * span
    reach = chunk_len * interval
    offsets = (torch.randint(0, span - reach, (chunks,), generator=generator) if span > reach
               else torch.zeros(chunks, dtype=torch.long))
    idx = torch.arange(chunk_len)[None, :] * interval + (starts + offsets)[:, None]
    return idx.flatten() % num_frames


def technical_view(video: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(C, T, H, W) 0-255 video -> (C, T, 224, 224) of 7x7 fragments of 32x32 (T a multiple of 32).

    Each fragment is a 32x32 crop at a random offset inside its cell of a 7x7 grid over the frame, the same
    offset for the 32 frames of a chunk; a frame smaller than 224 on a side is first upscaled (bilinear) until
    both sides reach 224, as DOVER does.
    """
    c, t, h, w = video.shape
    size = FRAGMENTS * FRAGMENT_SIZE
    ratio = min(h / size, w / size)
    if ratio < 1:
        video = F.interpolate(video, scale_factor=1 / ratio, mode="bilinear")
        h, w = video.shape[-2:]
    cell_h, cell_w = h // FRAGMENTS, w // FRAGMENTS
    chunks = t // CLIP_LEN
    out = video.new_zeros(c, t, size, size)
    for i in range(FRAGMENTS):
        top = min(cell_h * i, h - FRAGMENT_SIZE)
        for j in range(FRAGMENTS):
            left = min(cell_w * j, w - FRAGMENT_SIZE)
            for k in range(chunks):
                dh = int(torch.randint(0, cell_h - FRAGMENT_SIZE, (), generator=generator)) \
                    if cell_h > FRAGMENT_SIZE else 0
                dw = int(torch.randint(0, cell_w - FRAGMENT_SIZE, (), generator=generator)) \
                    if cell_w > FRAGMENT_SIZE else 0
                frames = slice(k * CLIP_LEN, (k + 1) * CLIP_LEN)
                rows = slice(i * FRAGMENT_SIZE, (i + 1) * FRAGMENT_SIZE)
                cols = slice(j * FRAGMENT_SIZE, (j + 1) * FRAGMENT_SIZE)
                out[:, frames, rows, cols] = video[:, frames, top + dh:top + dh + FRAGMENT_SIZE,
                                                   left + dw:left + dw + FRAGMENT_SIZE]
    return out


def aesthetic_view(video: torch.Tensor) -> torch.Tensor:
    """(C, T, H, W) 0-255 video -> (C, T, 224, 224), resized without keeping the aspect ratio (as DOVER)."""
    frames = video.transpose(0, 1)  # resize frame by frame
    frames = F.interpolate(frames, size=(AESTHETIC_SIZE, AESTHETIC_SIZE), mode="bilinear", antialias=True,
                           align_corners=False)
    return frames.transpose(0, 1)


def dover_views(frames: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """The two normalised views DOVER's network takes, from (F, C, H, W) frames in [0, 1].

    Returns {"technical": (3, C, 32, 224, 224), "aesthetic": (1, C, 32, 224, 224)} (clips first), float32.
    """
    check_unit_images(frames, "DOVER's frames")
    g = torch.Generator().manual_seed(seed)
    video = frames.detach().float().cpu().clamp(0, 1).mul(255.0).transpose(0, 1)  # (C, T, H, W)
    n = video.shape[1]
    tech_idx = chunk_frame_indices(n, CLIP_LEN, TECHNICAL_CHUNKS, FRAME_INTERVAL, g)
    aes_idx = chunk_frame_indices(n, 1, CLIP_LEN, FRAME_INTERVAL, g)
    views = {"technical": (technical_view(video[:, tech_idx], g), TECHNICAL_CHUNKS),
             "aesthetic": (aesthetic_view(video[:, aes_idx]), 1)}
    mean, std = torch.tensor(MEAN).view(3, 1, 1, 1), torch.tensor(STD).view(3, 1, 1, 1)
    out = {}
    for name, (v, clips) in views.items():
        v = (v - mean) / std
        out[name] = v.reshape(3, clips, -1, *v.shape[-2:]).transpose(0, 1).contiguous()
    return out


def fuse_dover_scores(technical: float, aesthetic: float) -> float:
    """DOVER's overall score in (0, 1) from the two raw scores (its inference script's fusion)."""
    x = sum((score + shift) / spread * weight
            for score, (shift, spread, weight) in zip((technical, aesthetic), FUSION.values()))
    # the logistic written so that exp() never overflows: 1 / (1 + exp(-x)) raised OverflowError below x = -709
    z = math.exp(-abs(x))
    return 1.0 / (1.0 + z) if x >= 0 else z / (1.0 + z)


def _import_dover():
    try:
        from dover.models import DOVER, conv_backbone, evaluator  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError(f"DOVER's model code is not installed ({e}); install it with `{DOVER_INSTALL}` "
                          "(it is not on PyPI) to get VQA-technical / VQA-aesthetic scores") from e
    return DOVER, conv_backbone, evaluator


@contextlib.contextmanager
def _without_imagenet_download(conv_backbone, evaluator):
    """DOVER's constructor fetches ImageNet ConvNeXt weights from the network, which DOVER.pth then
    overwrites entirely: build the ConvNeXt without them (works offline)."""
    original = evaluator.convnext_3d_tiny

    def convnext_3d_tiny(pretrained=False, **kwargs):
        return conv_backbone.convnext_3d_tiny(pretrained=False, **kwargs)

    evaluator.convnext_3d_tiny = convnext_3d_tiny
    try:
        yield
    finally:
        evaluator.convnext_3d_tiny = original


class DoverScorer:
    """DOVER's technical, aesthetic and fused scores of generated videos.

    Args:
        weights: path to DOVER.pth (from ``DOVER_WEIGHTS_URL``).
        device: where the network runs.
        seed: seeds the fragment and frame sampling (the same places for every video of one size).
    Raises:
        FileNotFoundError: ``weights`` missing, naming where to download it.
        ImportError: DOVER's package missing, naming the install command.
    """

    def __init__(self, weights: str | os.PathLike, device: str | torch.device = "cpu", seed: int = 0):
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"DOVER weights not found at {weights!r}: download DOVER.pth from "
                                    f"{DOVER_WEIGHTS_URL} and pass its path")
        DOVER, conv_backbone, evaluator = _import_dover()
        with _without_imagenet_download(conv_backbone, evaluator):
            model = DOVER(**MODEL_ARGS)
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.seed = seed

    def to(self, device: str | torch.device) -> "DoverScorer":
        """Move the network to ``device``, where the views are then built and scored; returns self."""
        self.model.to(device)
        self.device = torch.device(device)
        return self

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor) -> dict[str, float]:
        """Scores of one video, (F, C, H, W) in [0, 1]: dover_technical and dover_aesthetic (raw network
        outputs, higher is better) and dover_overall (the fused score in (0, 1))."""
        views = {k: v.to(self.device) for k, v in dover_views(frames, self.seed).items()}
        technical, aesthetic = (float(s.mean()) for s in self.model(views))
        return {"dover_technical": technical, "dover_aesthetic": aesthetic,
                "dover_overall": fuse_dover_scores(technical, aesthetic)}
