"""``tune``: search SpargeAttn's thresholds per attention layer of a diffusers model on calibration inputs."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from ..kernels._inputs import check_flag
from ..pipelines.call_arguments import check_pipe_kwargs, pipeline_progress_off
from ..pipelines.processor import SpargeProcessor, SpargeSettings, install
from ..pipelines.settings_file import LayerSettingsFile
from .search import Aggregate, ThresholdGrid, ThresholdSearch


@dataclass
class _CalibrationProcessor(SpargeProcessor):
    """Runs the model densely (its outputs are the native ones, so calibration follows the dense trajectory)
    and feeds every attention call's q, k, v and dense output to that layer's ThresholdSearch."""

    searches: dict[str, ThresholdSearch] = field(default_factory=dict)
    make_search: Callable[[], ThresholdSearch] | None = None
    collect_stats: bool = False
    phase: int = 1

    def _attention(self, layer, settings, sdpa, query, key, value, attn_mask=None, dropout_p=0.0,
                   is_causal=False, scale=None, enable_gqa=False):
        dense = sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, enable_gqa=enable_gqa)
        reason = self.fallback_reason(query, key, value, attn_mask, dropout_p, is_causal)
        if reason:  # the layer will fall back at inference too: nothing to tune there
            self._warn_once(f"{reason}; such calls are not tuned")
            return dense
        search = self.searches.get(layer)
        if search is None:
            search = self.searches[layer] = self.make_search()
        if search.phase == self.phase:
            search.observe(query, key, value, dense, is_causal=is_causal, scale=scale,
                           attention=self.sparse_attention_fn(settings, query, key=key))
        return dense


def _calibration_runs(model: Any, calibration: Sequence[Any] | Callable, pipe_kwargs: dict, seed: int
                      ) -> list[Callable[[], Any]]:
    """One closure per calibration input: a prompt (pipeline call), a dict of transformer forward kwargs
    (pre-made latents), or a callable taking the model."""
    if callable(calibration):
        return [lambda: calibration(model)]
    if isinstance(calibration, (str, bytes)) or not isinstance(calibration, Sequence) or not calibration:
        raise ValueError("calibration must be a non-empty list of prompts or of transformer input dicts, "
                         "or a callable that runs the model")
    runs: list[Callable[[], Any]] = []
    transformer = getattr(model, "transformer", model)
    for i, item in enumerate(calibration):
        if isinstance(item, str):
            if transformer is model:
                raise ValueError("prompts need a pipeline; pass the pipeline, or transformer input dicts")
            device = getattr(model, "device", torch.device("cpu"))
            runs.append(functools.partial(_run_prompt, model, item, seed + i, device, pipe_kwargs))
        elif isinstance(item, dict):
            runs.append(functools.partial(transformer, **item))
        else:
            raise ValueError(f"calibration item {i} is a {type(item).__name__}: use prompts (str) or dicts of "
                             "transformer inputs")
    return runs


def _run_prompt(pipe: Any, prompt: str, seed: int, device: torch.device, pipe_kwargs: dict) -> Any:
    generator = torch.Generator(device=device).manual_seed(seed)
    return pipe(prompt=prompt, generator=generator, **pipe_kwargs)


def _returns_latents_when_asked(model: Any) -> bool:
    """Whether ``model`` is a diffusers pipeline whose call takes ``output_type`` (diffusers' pipelines return their
    latents for ``output_type="latent"``); other callables are called as given."""
    try:
        from diffusers import DiffusionPipeline
    except ImportError:
        return False
    call = getattr(model, "__call__", None)  # a pipeline's own; DiffusionPipeline declares none
    if not isinstance(model, DiffusionPipeline) or call is None:
        return False
    try:
        return "output_type" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


def tune(
    pipe_or_transformer: Any,
    calibration: Sequence[str] | Sequence[dict] | Callable[[Any], Any],
    *,
    l1: float = 0.05,
    l2: float = 0.06,
    grid: ThresholdGrid | None = None,
    per_head: bool = True,
    aggregate: Aggregate = "max",
    permutation: str | None = None,
    pipe_kwargs: dict | None = None,
    seed: int = 0,
    progress: bool = True,
) -> LayerSettingsFile:
    """Choose SpargeAttn's thresholds for every attention layer (SpargeAttn section 3.6).

    The model runs each calibration input twice, densely (so every layer sees the inputs of a dense
    generation): the first pass searches (simthreshd1, cdfthreshd) for the highest sparsity with relative
    L1 below ``l1``, the second searches pvthreshd with that pair fixed for the highest sparsity below
    ``l2``. Each attention call is evaluated at every grid point with the Triton kernels (the reference on
    CPU) when it happens, and only per-head tallies are kept, so memory does not grow with the calibration
    set. Two passes cost twice the calibration time but keep no q/k/v between calls.

    Args:
        pipe_or_transformer: a diffusers pipeline or transformer (Flux, SD3, CogVideoX, Mochi).
        calibration: prompts (with a pipeline; the paper uses five), dicts of transformer forward kwargs
            (pre-made latents), or a callable that runs the model.
        l1, l2: error budgets of the two phases (paper: 0.05/0.06 for video models, 0.07/0.08 for images).
        grid: candidate thresholds (:class:`ThresholdGrid`).
        per_head: one threshold per head (default, as upstream) or one per layer.
        aggregate: "max": the budget holds on every calibration call; "mean": on average.
        permutation: a token order applied during tuning and stored with the settings ("hilbert", ...).
        pipe_kwargs: extra pipeline call arguments (num_inference_steps, height, width, num_frames, ...).
        seed: generator seed of the first prompt (prompt i uses seed + i).
    Returns:
        A :class:`LayerSettingsFile`; ``.save(path)`` writes it, ``apply(pipe, layer_settings=path)`` uses it.
    """
    transformer = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    check_pipe_kwargs(pipe_kwargs, reserved=("prompt", "generator"))
    check_flag(progress, "progress")
    if pipe_kwargs and not hasattr(pipe_or_transformer, "transformer"):
        raise ValueError("pipe_kwargs are pipeline call arguments; pass the pipeline")
    call_kwargs = dict(pipe_kwargs or {})
    if _returns_latents_when_asked(pipe_or_transformer):
        # only the transformer's calls matter: latents skip the VAE's decoding (seconds per video) unless asked for
        call_kwargs = {"output_type": "latent", **call_kwargs}
    runs = _calibration_runs(pipe_or_transformer, calibration, call_kwargs, seed)
    make_search = lambda: ThresholdSearch(l1=l1, l2=l2, grid=grid, per_head=per_head, aggregate=aggregate)  # noqa: E731
    make_search()  # checks the budget and aggregate before any model call
    processor = _CalibrationProcessor(settings=SpargeSettings(permutation=permutation), make_search=make_search)
    install(transformer, processor)
    restore_progress = pipeline_progress_off(pipe_or_transformer)  # one bar over all runs instead of one per call
    try:
        with torch.no_grad(), tqdm(total=2 * len(runs), desc="tune", unit="run", disable=not progress) as bar:
            for phase in (1, 2):
                processor.phase = phase
                bar.set_postfix_str("simthreshd1, cdfthreshd" if phase == 1 else "pvthreshd")
                for run in runs:
                    run()
                    bar.update()
                if phase == 1:
                    if not processor.searches:
                        raise ValueError("no attention call could run sparse during calibration (see the "
                                         "warnings); nothing to tune")
                    for search in processor.searches.values():
                        search.finish_stage1()
    finally:
        restore_progress()
        processor.detach(transformer)
    return _settings_file(transformer, processor.searches, l1, l2, per_head, aggregate, permutation, grid,
                          len(runs), pipe_kwargs)


def _settings_file(transformer, searches, l1, l2, per_head, aggregate, permutation, grid, runs, pipe_kwargs
                   ) -> LayerSettingsFile:
    import diffusers

    layers, measured = {}, {}
    for name, search in searches.items():
        if search.phase != 2 or not search.calls:  # a layer that ran only in one pass: leave it untuned
            continue
        choice = search.result()
        one = (lambda xs: xs) if per_head else (lambda xs: xs[0])
        layers[name] = SpargeSettings(simthreshd1=one(choice.simthreshd1), cdfthreshd=one(choice.cdfthreshd),
                                      pvthreshd=one(choice.pvthreshd), permutation=permutation)
        measured[name] = choice.as_dict()
    grid = grid or ThresholdGrid()
    calibration = {"runs": runs, "pipe_kwargs": {k: v for k, v in (pipe_kwargs or {}).items()
                                                 if isinstance(v, (int, float, str, bool))},
                   "grid": {"simthreshd1": list(grid.simthreshd1), "cdfthreshd": list(grid.cdfthreshd),
                            "pvthreshd": list(grid.pvthreshd)}}
    return LayerSettingsFile(model_class=type(transformer).__name__, layers=layers,
                             diffusers_version=diffusers.__version__,
                             budget={"l1": l1, "l2": l2, "aggregate": aggregate, "per_head": per_head},
                             measured=measured, calibration=calibration)
