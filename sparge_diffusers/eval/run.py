"""Generate with each attention mode for the same prompts and seeds, score the outputs, write the report.

Outputs in ``out_dir``: ``report.json`` (settings, GPU, per-mode means, per-sample metrics, sparsity per
layer), ``metrics.csv`` (one row per mode and prompt), ``grid_<i>.png`` (modes side by side; for videos one
row of frames per mode) and ``grid_<i>.gif`` for videos, and ``quality_vs_time.png``.

``report.json`` is strict JSON: the PSNR of an output identical to dense's (infinite; always so for the
``dense`` mode itself) is written as null there, and ``identical_to_dense`` (per sample true or false, per
mode the fraction of prompts) says which. ``metrics.csv`` and the returned report keep ``inf``.
"""

from __future__ import annotations

import csv
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from .._json import write_json
from ..generation import default_steps, device_name, run_pipeline, to_uint8
from ..kernels._inputs import check_flag
from ..pipelines.call_arguments import check_pipe_kwargs, pipeline_progress_off, prompt_list
from ._images import check_unit_images
from .clip import ClipModel, clip_score, clip_temp, clipsim
from .distribution import fid
from .fidelity import LPIPS, psnr, ssim
from .dover import DoverScorer
from .video import sharpness, temporal_flicker


@dataclass(frozen=True)
class AttentionMode:
    """One way of running the model's attention: dense (native) or SpargeAttn, optionally with a settings file.
    The mode named ``"dense"`` is the reference of the fidelity metrics, so it must be the dense one."""

    name: str
    sparse: bool
    settings_file: str | None = None

    def __post_init__(self):
        check_flag(self.sparse, "sparse")  # "False" was read as True: a mode meant dense ran sparse
        if self.name == "dense" and self.sparse:  # its sparse outputs would be every mode's "exact" reference
            raise ValueError("the mode named 'dense' is the fidelity reference: it cannot be sparse")
        if self.settings_file and not self.sparse:
            raise ValueError(f"mode {self.name!r}: a settings file applies to sparse modes only")


def parse_modes(text: str) -> list[AttentionMode]:
    """``"dense,sparge,sparge:settings.json"`` -> modes (names are unique: ``sparge:<file stem>``)."""
    modes = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, path = item.partition(":")
        if kind == "dense" and not path:
            modes.append(AttentionMode("dense", False))
        elif kind == "sparge":
            if path and not Path(path).is_file():
                raise FileNotFoundError(f"settings file {path} (from --attention {item}) not found")
            modes.append(AttentionMode(f"sparge:{Path(path).stem}" if path else "sparge", True, path or None))
        else:
            raise ValueError(f"attention mode {item!r}: use dense, sparge or sparge:SETTINGS.json")
    if not modes or len({m.name for m in modes}) != len(modes):
        raise ValueError(f"--attention {text!r}: give one or more distinct modes")
    return modes


def requested_metrics_problem(n_prompts: int, mode_names: Sequence[str], *, lpips: bool, fid: bool, real: bool,
                              spelled: dict[str, str] | None = None) -> str | None:
    """Why a metric asked of :func:`evaluate` could not be computed (None if each can): checked before generating.
    ``spelled``: how the message names the lpips / fid / real arguments (the command line's options)."""
    name = {"lpips": "lpips", "fid": "fid_feature or inception_weights", "real": "real_images", **(spelled or {})}
    if real and not fid:
        return f"{name['real']} is for FID: give {name['fid']} too"
    if fid and n_prompts < 2:
        return f"FID ({name['fid']}) compares sets of images: it needs at least two prompts, got {n_prompts}"
    if lpips and "dense" not in mode_names:
        return f"LPIPS ({name['lpips']}) is measured against the 'dense' mode's outputs: list 'dense' among the modes"
    return None


def load_images(folder: str | os.PathLike, size: tuple[int, int]) -> torch.Tensor:
    """Every .png/.jpg/.jpeg/.webp image of a folder as (N, 3, H, W) in [0, 1], resized to ``size`` (H, W)."""
    from PIL import Image

    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
    if len(files) < 2:
        raise ValueError(f"{folder} must hold at least two images (.png/.jpg/.jpeg/.webp) for FID")
    out = []
    for f in files:
        img = Image.open(f).convert("RGB").resize((size[1], size[0]), Image.Resampling.BICUBIC)
        out.append(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size[0], size[1], 3))
    return torch.stack(out).permute(0, 3, 1, 2).float() / 255


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    if not finite:
        return None
    return math.inf if any(math.isinf(v) for v in finite) else sum(finite) / len(finite)


def evaluate(pipe: Any, prompts: str | Sequence[str], modes: Sequence[AttentionMode], out_dir: str | os.PathLike, *,
             seed: int = 0, pipe_kwargs: dict | None = None, clip: ClipModel | None = None,
             lpips: LPIPS | None = None, fid_feature: torch.nn.Module | None = None,
             inception_weights: str | None = None, real_images: torch.Tensor | None = None,
             dover: DoverScorer | None = None, progress: bool = True) -> dict:
    """Generate every prompt with every mode (prompt i with seed + i in every mode), score, write the report.

    Fidelity (PSNR/SSIM/LPIPS) is measured against the ``dense`` mode's output of the same seed, so list
    ``dense`` among the modes to get it. CLIP metrics need ``clip``; LPIPS needs ``lpips``; FID (images, at
    least two prompts) needs ``fid_feature`` or ``inception_weights`` and compares each mode's set with the
    dense set and, when ``real_images`` (N, 3, H, W) are given (the paper: COCO images of the captions used
    as prompts), with those. DOVER's technical / aesthetic / fused scores of each video need ``dover``.
    """
    from ..pipelines import SpargeProcessor, install, installed_processor

    names = [m.name for m in modes]
    if not names or len(set(names)) != len(names):  # outputs are kept by name: a repeat would overwrite
        raise ValueError(f"evaluate needs one or more modes with distinct names, got {names}")
    prompts = prompt_list(prompts, "evaluate")
    check_pipe_kwargs(pipe_kwargs)
    check_flag(progress, "progress")
    if installed_processor(pipe) is not None:  # the dense mode would run it
        raise ValueError("the pipeline already runs a SpargeProcessor: detach it first (processor.detach("
                         "pipe.transformer)); evaluate applies each mode's own")
    if real_images is not None:
        check_unit_images(real_images, "real_images")  # before any generation, not after it
    problem = requested_metrics_problem(len(prompts), names, lpips=lpips is not None,
                                        fid=bool(fid_feature or inception_weights), real=real_images is not None)
    if problem:  # a metric asked for would have been left out of the report without a word
        raise ValueError(problem)
    # every mode's processor made and checked against the model first: a settings file for another model failed
    # only when its mode came, after the modes before it had run (their coverage warnings come at installation)
    processors = {mode.name: SpargeProcessor(layer_settings=mode.settings_file or {}, collect_stats=True)
                  for mode in modes if mode.sparse}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for processor in processors.values():
            processor.check_model(getattr(pipe, "transformer", pipe))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe_kwargs = dict(pipe_kwargs or {})
    steps = pipe_kwargs.get("num_inference_steps", default_steps(pipe))  # for seconds per step, as generate
    outputs: dict[str, list[torch.Tensor]] = {}
    seconds: dict[str, list[float]] = {}
    sparsity: dict[str, dict[str, float]] = {}
    restore_progress = pipeline_progress_off(pipe)  # one bar over all samples instead of one per call
    try:
        with tqdm(total=len(modes) * len(prompts), desc="eval", unit="sample", disable=not progress) as bar:
            for mode in modes:
                installed = install(pipe, processors[mode.name]) if mode.sparse else None
                try:
                    outputs[mode.name], seconds[mode.name] = [], []
                    for i, prompt in enumerate(prompts):
                        bar.set_postfix_str(mode.name)
                        frames, s = run_pipeline(pipe, prompt, seed + i, pipe_kwargs)
                        outputs[mode.name].append(frames)
                        seconds[mode.name].append(s)
                        bar.update()
                    if installed is not None:
                        sparsity[mode.name] = installed.sparsity_by_layer()
                finally:
                    if installed is not None:
                        installed.detach(getattr(pipe, "transformer", pipe))
    finally:
        restore_progress()

    is_video = outputs[modes[0].name][0].shape[0] > 1
    samples = []
    for mode in modes:
        for i, prompt in enumerate(prompts):
            x = outputs[mode.name][i]
            row: dict[str, Any] = {"mode": mode.name, "prompt_index": i, "prompt": prompt, "seed": seed + i,
                                   "seconds": seconds[mode.name][i]}
            if steps:
                row["seconds_per_step"] = seconds[mode.name][i] / steps
            if "dense" in outputs:
                ref = outputs["dense"][i]
                row["psnr"], row["ssim"] = psnr(x, ref), ssim(x, ref)
                row["identical_to_dense"] = math.isinf(row["psnr"])  # report.json writes that PSNR as null
                if lpips is not None:
                    row["lpips"] = lpips.distance(x, ref)
            if clip is not None:
                if is_video:
                    row["clipsim"], row["clip_temp"] = clipsim(x, prompt, clip), clip_temp(x, clip)
                else:
                    row["clip_score"] = clip_score(x, [prompt], clip)
            if is_video:
                row["temporal_flicker"], row["sharpness"] = temporal_flicker(x), sharpness(x)
                if dover is not None:
                    row.update(dover(x))
            samples.append(row)

    skipped = [what for what, asked in (("FID (an image metric)", is_video and (fid_feature or inception_weights)),
                                        ("DOVER (a video metric)", not is_video and dover is not None)) if asked]
    for what in skipped:
        warnings.warn(f"evaluate: {what} skipped for these {'videos' if is_video else 'images'}", stacklevel=2)
    metric_names = [k for k in samples[0] if k not in ("mode", "prompt_index", "prompt", "seed")]
    summary = {}
    for mode in modes:
        rows = [r for r in samples if r["mode"] == mode.name]
        summary[mode.name] = {k: _mean([r.get(k) for r in rows]) for k in metric_names}
        layers = sparsity.get(mode.name)
        if layers:
            summary[mode.name]["sparsity"] = sum(layers.values()) / len(layers)
        if not is_video and len(prompts) >= 2 and (fid_feature or inception_weights):
            fake = torch.cat(outputs[mode.name])
            if "dense" in outputs:
                summary[mode.name]["fid_vs_dense"] = fid(torch.cat(outputs["dense"]), fake, feature=fid_feature,
                                                         inception_weights=inception_weights)
            if real_images is not None:
                summary[mode.name]["fid_vs_real"] = fid(real_images, fake, feature=fid_feature,
                                                        inception_weights=inception_weights)

    report = {"device": device_name(pipe),
              "date": time.strftime("%Y-%m-%d %H:%M"), "model_class": type(getattr(pipe, "transformer", pipe)).__name__,
              "kind": "video" if is_video else "image", "prompts": list(prompts), "seed": seed,
              "pipe_kwargs": {k: v for k, v in pipe_kwargs.items() if isinstance(v, (int, float, str, bool))},
              "modes": [vars(m) for m in modes], "clip_model": clip.name if clip else None,
              "lpips": lpips is not None, "dover": dover is not None, "summary": summary, "samples": samples,
              "sparsity_by_layer": sparsity}
    _write(out_dir, report, outputs, modes, is_video, metric_names)
    return report


def _write(out_dir: Path, report: dict, outputs: dict, modes, is_video: bool, metric_names: list[str]) -> None:
    write_json(out_dir / "report.json", report, other_types_as_null=True)
    with open(out_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["mode", "prompt_index", "prompt", "seed"] + metric_names)
        writer.writeheader()
        writer.writerows(report["samples"])
    for i in range(len(report["prompts"])):
        _grid(out_dir, i, [outputs[m.name][i] for m in modes], is_video)
    _plot(out_dir / "quality_vs_time.png", report)


def _grid(out_dir: Path, index: int, per_mode: list[torch.Tensor], is_video: bool) -> None:
    """Modes side by side (images), or one row of up to 8 evenly spaced frames per mode plus an animated GIF
    of the modes side by side (videos)."""
    from PIL import Image

    if not is_video:
        Image.fromarray(to_uint8(torch.cat([x[0] for x in per_mode], dim=-1))).save(out_dir / f"grid_{index}.png")
        return
    frames = per_mode[0].shape[0]
    picks = sorted({round(j * (frames - 1) / 7) for j in range(8)}) if frames > 8 else list(range(frames))
    rows = [torch.cat([x[j] for j in picks], dim=-1) for x in per_mode]
    Image.fromarray(to_uint8(torch.cat(rows, dim=-2))).save(out_dir / f"grid_{index}.png")
    side_by_side = [Image.fromarray(to_uint8(torch.cat([x[j] for x in per_mode], dim=-1))) for j in range(frames)]
    side_by_side[0].save(out_dir / f"grid_{index}.gif", save_all=True, append_images=side_by_side[1:],
                         duration=125, loop=0)


def _plot(path: Path, report: dict) -> None:
    """Quality (PSNR against dense, else CLIP score / CLIPSIM) against time per step (or per sample), per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    x_key = "seconds_per_step" if any(s.get("seconds_per_step") for s in summary.values()) else "seconds"
    # the first metric some mode can be drawn by; PSNR also where every mode is identical to dense (drawn at 100),
    # dense's own excepted (its line marks the reference)
    y_key = next((k for k in ("psnr", "clip_score", "clipsim")
                  if any(s.get(k) is not None and not math.isnan(s[k]) for name, s in summary.items()
                         if not (k == "psnr" and name == "dense"))), None)
    fig, ax = plt.subplots(figsize=(5, 4))
    for name, s in summary.items():
        if name == "dense" and y_key == "psnr":  # the reference itself: a vertical line at its time
            ax.axvline(s[x_key], color="gray", linestyle="--")
            ax.annotate("dense", (s[x_key], 0.02), xycoords=("data", "axes fraction"), fontsize=8, color="gray")
            continue
        y = s.get(y_key) if y_key else None
        label = name + (f" (sparsity {s['sparsity']:.2f})" if s.get("sparsity") is not None else "")
        if y is None:
            y = 0.0
        elif math.isinf(y):  # identical to dense
            y, label = 100.0, label + ", identical to dense"
        ax.scatter(s[x_key], y)
        ax.annotate(label, (s[x_key], y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("seconds per denoising step" if x_key == "seconds_per_step" else "seconds per sample")
    ax.set_ylabel({"psnr": "PSNR vs dense, dB (identical drawn at 100)", "clip_score": "CLIP score",
                   "clipsim": "CLIPSIM"}.get(y_key or "", "(no quality metric)"))
    ax.set_title(f"{report['model_class']} on {report['device']}", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
