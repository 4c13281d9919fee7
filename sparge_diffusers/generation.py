"""Generate images or videos with a diffusers pipeline, with SpargeAttn or dense attention, and save them.

This is what ``sparge-diffusers generate`` runs: prompt *i* with seed ``seed + i``, one denoising-step progress
bar over all prompts, each output saved under ``out_dir`` (``prompt_<i>.png`` for images, ``prompt_<i>.gif``
plus ``prompt_<i>.mp4`` when imageio-ffmpeg is installed for videos; ``prompt_<i>_<j>`` for the j-th of several
outputs of one call, e.g. with ``num_images_per_prompt``) and ``generate.json`` with the seconds,
sparsity per layer and settings of every output. :func:`run_pipeline` (one call, timed) is shared with the
evaluation runner.
"""

from __future__ import annotations

import importlib.util
import inspect
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from ._json import write_json
from .kernels._inputs import check_flag
from .pipelines.call_arguments import check_pipe_kwargs, pipeline_progress_off, prompt_list

__all__ = ["generate", "run_pipeline", "save_output"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _call_parameters(pipe: Any) -> dict:
    try:
        return dict(inspect.signature(pipe.__call__).parameters)
    except (TypeError, ValueError):
        return {}


def _takes_step_callback(pipe: Any) -> bool:
    return "callback_on_step_end" in _call_parameters(pipe)


def default_steps(pipe: Any) -> int | None:
    """The pipeline's default ``num_inference_steps`` (from its call signature), if it has one."""
    p = _call_parameters(pipe).get("num_inference_steps")
    return p.default if p is not None and isinstance(p.default, int) else None


def run_pipeline(pipe: Any, prompt: str, seed: int, pipe_kwargs: dict,
                 on_step: Callable[[], None] | None = None, *, all_outputs: bool = False
                 ) -> tuple[torch.Tensor, float]:
    """One pipeline call: the output as float frames (F, 3, H, W) in [0, 1] on the CPU (F = 1 for an image;
    the first image or video when the call makes several, e.g. with ``num_images_per_prompt``; with
    ``all_outputs`` every one of them, (n, F, 3, H, W)) and its seconds (CUDA synchronised on both ends).

    ``on_step`` is called after every denoising step where the pipeline takes ``callback_on_step_end`` (the four
    supported pipelines do); elsewhere it is not called.
    """
    device = getattr(pipe, "device", torch.device("cpu"))
    generator = torch.Generator(device=device).manual_seed(seed)
    check_pipe_kwargs(pipe_kwargs)
    kwargs = dict(pipe_kwargs)
    if on_step is not None and _takes_step_callback(pipe) and "callback_on_step_end" not in kwargs:
        def step_end(_pipe, _step, _timestep, callback_kwargs):
            on_step()
            return callback_kwargs

        kwargs["callback_on_step_end"] = step_end
    _sync()
    start = time.perf_counter()
    result = pipe(prompt=prompt, generator=generator, output_type="pt", **kwargs)
    _sync()
    seconds = time.perf_counter() - start
    out = result.images if hasattr(result, "images") else result.frames
    out = out if out.dim() == 5 else out[:, None]  # videos (n, F, C, H, W); images (n, C, H, W) -> (n, 1, C, H, W)
    out = out.float().cpu().clamp(0, 1)
    return (out if all_outputs else out[0]), seconds


def device_name(pipe: Any) -> str:
    """Where a pipeline runs, for reports: the GPU's name on CUDA, else the device type ("cpu")."""
    device = torch.device(getattr(pipe, "device", "cpu"))
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def to_uint8(x: torch.Tensor):
    """(3, H, W) in [0, 1] -> (H, W, 3) uint8 numpy array."""
    return (x.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()


def save_output(frames: torch.Tensor, stem: str | Path, fps: int = 8) -> tuple[list[Path], str | None]:
    """Save (F, 3, H, W) frames: a PNG when F = 1, else a GIF and, where imageio and imageio-ffmpeg are
    installed, an MP4 (diffusers' ``export_to_video``). Returns the files written and, when the MP4 was not
    written, why."""
    from PIL import Image

    stem = Path(stem)
    if frames.shape[0] == 1:
        path = stem.with_suffix(".png")
        Image.fromarray(to_uint8(frames[0])).save(path)
        return [path], None
    images = [Image.fromarray(to_uint8(f)) for f in frames]
    gif = stem.with_suffix(".gif")
    images[0].save(gif, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    if not all(importlib.util.find_spec(m) for m in ("imageio", "imageio_ffmpeg")):
        return [gif], "MP4 not written: it needs imageio and imageio-ffmpeg (pip install imageio imageio-ffmpeg)"
    from diffusers.utils import export_to_video

    mp4 = stem.with_suffix(".mp4")
    export_to_video([f.permute(1, 2, 0).numpy() for f in frames], str(mp4), fps=fps)
    return [gif, mp4], None


def generate(pipe: Any, prompts: str | Sequence[str], out_dir: str | Path, *, sparse: bool = True,
             settings: Any = None, layer_settings: str | Path | dict | None = None, dense_steps: int = 0,
             strict: bool = False, seed: int = 0, pipe_kwargs: dict | None = None, fps: int = 8,
             compile: bool = False, warmup: bool = False, progress: bool = True) -> dict:
    """Generate every prompt (prompt *i* with seed ``seed + i``), save the outputs, write ``generate.json``.

    Args:
        pipe: a diffusers pipeline (Flux, SD3, CogVideoX or Mochi for the sparse path).
        prompts: one pipeline call per prompt (one output, or several with ``num_images_per_prompt``); a str is
            one prompt.
        out_dir: created if missing.
        sparse: run SpargeAttn (:func:`sparge_diffusers.apply`), or the model's own dense attention.
        settings: a :class:`~sparge_diffusers.pipelines.SpargeSettings` for every layer (layers a settings file
            does not cover); None for the defaults.
        layer_settings: a settings file written by ``tune`` (or a dict of per-layer settings).
        dense_steps: the first k denoising steps of every output stay dense.
        strict: raise where a call cannot run sparse, instead of falling back to the native attention.
        seed: seed of the first prompt.
        pipe_kwargs: other pipeline call arguments (``num_inference_steps``, ``height``, ...).
        fps: frame rate of saved videos.
        compile: wrap the transformer in ``torch.compile`` (after SpargeAttn is set, as the README's
            torch.compile section does) for these calls; the pipeline gets its transformer back afterwards.
            Compiled calls record no sparsity; ``dense_steps`` still apply (the graph counts the steps).
        warmup: first make one untimed call with ``dense_steps + 1`` denoising steps (one sparse step), so the
            timings exclude Triton's compilation and (under ``torch.compile``) the model's.
        progress: show a progress bar of denoising steps.

    Returns the report also written to ``generate.json``: per prompt the seed, seconds, files, number of outputs,
    and with ``sparse`` the number of attention calls that ran sparse and the mean sparsity over layers and per layer
    (recorded during the timed call: its seconds include that, 0.02-0.08 ms of host time per attention call).
    """
    from .pipelines import apply, installed_processor

    prompts = prompt_list(prompts, "generate")
    check_pipe_kwargs(pipe_kwargs)
    # sparse="False" (a string from a config) was read as True: sparse outputs where dense ones were meant
    for name, flag in (("sparse", sparse), ("strict", strict), ("compile", compile), ("warmup", warmup),
                       ("progress", progress)):
        check_flag(flag, name)
    sparse_only = {"settings": settings is not None, "layer_settings": layer_settings is not None,
                   "dense_steps": dense_steps != 0, "strict": strict}
    if not sparse and any(sparse_only.values()):  # they would be ignored: the dense run installs nothing
        raise ValueError(f"{', '.join(k for k, given in sparse_only.items() if given)} apply to sparse=True only")
    if installed_processor(pipe) is not None:  # its dense runs would run it, its sparse runs would nest in it
        raise ValueError("the pipeline already runs a SpargeProcessor: detach it first (processor.detach("
                         "pipe.transformer)); generate applies its own from its arguments")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipe_kwargs = dict(pipe_kwargs or {})
    processor = None
    if sparse:
        options = {"layer_settings": layer_settings} if layer_settings is not None else {}
        # statistics for the report's sparsity columns (compiled calls record none)
        processor = apply(pipe, settings, dense_steps=dense_steps, strict=strict, collect_stats=not compile,
                          **options)
    transformer = getattr(pipe, "transformer", None)
    if compile:
        if transformer is None:
            raise ValueError(f"{type(pipe).__name__} has no transformer to compile")
        pipe.transformer = torch.compile(transformer)
    rows, notes = [], []
    restore_progress = pipeline_progress_off(pipe)  # one bar over all prompts instead of one per call
    try:
        if warmup:
            # one sparse step at least, so the sparse kernels are compiled too (dense steps come first)
            warmup_steps = dense_steps + 1 if processor is not None else 1
            run_pipeline(pipe, prompts[0], seed, {**pipe_kwargs, "num_inference_steps": warmup_steps})
            if processor is not None:
                processor.reset_stats()
        steps = pipe_kwargs.get("num_inference_steps", default_steps(pipe))
        bar = tqdm(total=len(prompts) * steps if steps else len(prompts), desc="generate",
                   unit="step" if steps else "output", disable=not progress)
        with bar:
            for i, prompt in enumerate(prompts):
                stepped = []

                def on_step():
                    stepped.append(1)
                    bar.update()

                outputs, seconds = run_pipeline(pipe, prompt, seed + i, pipe_kwargs, on_step if steps else None,
                                                all_outputs=True)
                bar.update(max(0, (steps or 1) - len(stepped)))  # pipelines without step callbacks: the whole call
                files = []
                for j, frames in enumerate(outputs):  # several per prompt (num_images_per_prompt): prompt_<i>_<j>
                    saved, note = save_output(frames, out_dir / (f"prompt_{i}" if len(outputs) == 1 else
                                                                 f"prompt_{i}_{j}"), fps)
                    files += saved
                    if note and note not in notes:
                        notes.append(note)
                row = {"prompt_index": i, "prompt": prompt, "seed": seed + i, "seconds": seconds,
                       "files": [str(f) for f in files], "outputs": len(outputs), "frames": outputs.shape[1],
                       "height": outputs.shape[-2], "width": outputs.shape[-1]}
                if steps:
                    row["seconds_per_step"] = seconds / steps
                if processor is not None and not compile:  # compiled calls record no statistics
                    layers = processor.sparsity_by_layer()
                    row["sparse_calls"] = processor.recorded_calls  # attention calls that ran sparse
                    row["sparsity"] = sum(layers.values()) / len(layers) if layers else None
                    row["sparsity_by_layer"] = layers
                    processor.reset_stats()
                rows.append(row)
    finally:
        restore_progress()
        if compile:
            pipe.transformer = transformer
        if processor is not None:
            processor.detach(getattr(pipe, "transformer", pipe))

    settings_out = None
    if processor is not None:
        settings_out = {"settings": vars(processor.settings), "dense_steps": dense_steps,
                        "layer_settings": str(layer_settings) if isinstance(layer_settings, (str, Path)) else
                        (sorted(layer_settings) if layer_settings else None)}
    report = {"device": device_name(pipe),
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "model_class": type(getattr(pipe, "transformer", pipe)).__name__,
              "attention": "sparge" if sparse else "dense", "sparge": settings_out, "compile": compile,
              "warmup": warmup,
              "pipe_kwargs": {k: v for k, v in pipe_kwargs.items() if isinstance(v, (int, float, str, bool))},
              "notes": notes, "outputs": rows}
    write_json(out_dir / "generate.json", report, other_types_as_null=True)
    return report
