"""CLIP-based metrics: CLIP score (text-image), CLIPSIM (mean frame-text similarity) and CLIP-Temp (mean
similarity of consecutive frames), with open-clip-torch or transformers' CLIP.

A model is named by a spec string:

* ``open_clip:ARCH:WEIGHTS`` - an open_clip architecture (e.g. ``ViT-B-32``) with a local weights file or an
  open_clip pretrained tag (``openai``, ``laion2b_s34b_b79k``; those download unless cached);
* ``transformers:PATH_OR_ID`` - ``CLIPModel.from_pretrained`` (e.g. ``openai/clip-vit-base-patch32``).

Preprocessing is done here in torch (resize the short side, centre crop, normalise), the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..kernels._inputs import check_positive_int
from ._images import check_unit_images

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ClipModel:
    """Image and text encoders of one CLIP model, returning unit-norm embeddings."""

    encode_image_fn: Callable[[torch.Tensor], torch.Tensor]
    encode_text_fn: Callable[[list[str]], torch.Tensor]
    image_size: int
    mean: tuple[float, float, float] = OPENAI_MEAN
    std: tuple[float, float, float] = OPENAI_STD
    device: torch.device = torch.device("cpu")
    name: str = ""

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [0, 1] -> the model's input: short side resized, centre-cropped, normalised."""
        check_unit_images(images)
        h, w = images.shape[-2:]
        # the long side floors, as in torchvision's Resize (OpenAI's and open_clip's preprocessing) and in
        # transformers' CLIPImageProcessor; rounding it made a 70x33 image 68x32 where both make it 67x32
        long = int(self.image_size * max(h, w) / min(h, w))
        size = (self.image_size, long) if h <= w else (long, self.image_size)
        x = F.interpolate(images.float(), size=size, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
        top, left = (x.shape[-2] - self.image_size) // 2, (x.shape[-1] - self.image_size) // 2
        x = x[..., top:top + self.image_size, left:left + self.image_size]
        mean = torch.tensor(self.mean).view(1, 3, 1, 1)
        std = torch.tensor(self.std).view(1, 3, 1, 1)
        return ((x - mean) / std).to(self.device)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, batch: int = 32) -> torch.Tensor:
        """(N, 3, H, W) images in [0, 1] -> (N, E) unit-norm float32 embeddings on the CPU, ``batch`` at a time."""
        check_positive_int(batch, "batch")
        parts = [self.encode_image_fn(self.preprocess(images[i:i + batch])).float().cpu()
                 for i in range(0, len(images), batch)]
        return F.normalize(torch.cat(parts), dim=-1)

    @torch.no_grad()
    def encode_texts(self, texts: list[str]) -> torch.Tensor:
        """Texts -> (N, E) unit-norm float32 embeddings on the CPU."""
        return F.normalize(self.encode_text_fn(list(texts)).float().cpu(), dim=-1)


def clip_score(images: torch.Tensor, prompts: list[str], model: ClipModel) -> float:
    """Mean over images of 100 * max(cos(image, its prompt), 0): Hessel et al.'s CLIP-S with w = 100.

    torchmetrics' ``clip_score`` clamps the mean instead of each cosine; the two agree whenever every cosine is
    positive, and equal each other image by image.
    """
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        # a str would be read as one prompt per character (five images against "a cat")
        raise ValueError("clip_score takes a list of prompts, one str per image")
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    cos = (model.encode_images(images) * model.encode_texts(prompts)).sum(-1)
    return float((100 * cos.clamp(min=0)).mean())


def clipsim(frames: torch.Tensor, prompt: str, model: ClipModel) -> float:
    """CLIPSIM: the mean cosine similarity of each frame with the prompt."""
    if not isinstance(prompt, str):
        raise ValueError(f"clipsim takes one prompt (a str) for the video's frames, got {type(prompt).__name__}")
    return float((model.encode_images(frames) @ model.encode_texts([prompt])[0]).mean())


def clip_temp(frames: torch.Tensor, model: ClipModel) -> float:
    """CLIP-Temp: the mean cosine similarity of consecutive frames (1 for a still video)."""
    if len(frames) < 2:
        raise ValueError("CLIP-Temp needs at least two frames")
    e = model.encode_images(frames)
    return float((e[1:] * e[:-1]).sum(-1).mean())


def _open_clip(arch: str, weights: str, device: torch.device) -> ClipModel:
    if ("/" in weights or weights.endswith((".bin", ".pt", ".pth", ".safetensors"))) and not Path(weights).is_file():
        raise FileNotFoundError(
            f"open_clip weights {weights} not found. Download the checkpoint for {arch} (e.g. "
            f"open_clip_pytorch_model.bin of the matching laion/* repository on the Hugging Face hub) on a machine "
            f"with network, copy it here and pass open_clip:{arch}:/path/to/that/file")
    try:
        import open_clip
    except ImportError as e:  # open_clip also needs torchvision
        raise ImportError(f"open_clip models need open-clip-torch and torchvision: {e}") from None
    model = open_clip.create_model(arch, pretrained=weights or None, device=device).eval()
    return from_open_clip(model, open_clip.get_tokenizer(arch), name=f"open_clip:{arch}:{weights}")


def from_open_clip(model: Any, tokenizer: Callable, name: str = "open_clip") -> ClipModel:
    """Wrap an open_clip ``CLIP`` module and its tokenizer."""
    device = next(model.parameters()).device
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    return ClipModel(encode_image_fn=model.encode_image,
                     encode_text_fn=lambda texts: model.encode_text(tokenizer(texts).to(device)),
                     image_size=int(size), mean=tuple(getattr(model.visual, "image_mean", None) or OPENAI_MEAN),
                     std=tuple(getattr(model.visual, "image_std", None) or OPENAI_STD), device=device, name=name)


def _transformers(path: str, device: torch.device) -> ClipModel:
    from transformers import AutoTokenizer, CLIPModel

    if (path.startswith((".", "/")) or Path(path).exists()) and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds no CLIP model (no config.json). Save one with CLIPModel.save_pretrained and the "
            "tokenizer's save_pretrained into that folder, or pass a hub id such as openai/clip-vit-base-patch32")
    model: Any = CLIPModel.from_pretrained(path)  # (transformers types .to as taking a model)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def projected(output):  # transformers 5 returns a model output whose pooler_output is the projection
        return output if isinstance(output, torch.Tensor) else output.pooler_output

    def encode_text(texts):
        tokens = tokenizer(texts, padding=True, truncation=True,
                           max_length=model.config.text_config.max_position_embeddings, return_tensors="pt")
        return projected(model.get_text_features(**{k: v.to(device) for k, v in tokens.items()
                                                    if k in ("input_ids", "attention_mask")}))

    return ClipModel(encode_image_fn=lambda x: projected(model.get_image_features(pixel_values=x)),
                     encode_text_fn=encode_text,
                     image_size=model.config.vision_config.image_size, device=device, name=f"transformers:{path}")


def _open_clip_spec(rest: str, device: torch.device) -> ClipModel:
    name, _, pretrained = rest.partition(":")
    return _open_clip(name, pretrained, device)


_BACKENDS = {"open_clip": _open_clip_spec, "transformers": _transformers}


def load_clip(spec: str, device: str | torch.device = "cpu") -> ClipModel:
    """A :class:`ClipModel` from ``open_clip:ARCH:WEIGHTS`` or ``transformers:PATH_OR_ID``."""
    backend, sep, rest = spec.partition(":")
    if not sep or backend not in _BACKENDS or not rest:
        raise ValueError(f"CLIP model spec {spec!r}: use open_clip:ARCH:WEIGHTS or transformers:PATH_OR_ID")
    return _BACKENDS[backend](rest, torch.device(device))
