"""Checks on what generate, evaluate and tune pass to pipeline calls: the prompts and the extra call arguments
(``pipe_kwargs``)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

# Pipeline call arguments that generation.run_pipeline sets itself: from pipe_kwargs they would clash ("got multiple
# values") or change what it reads back (return_dict=False returns a tuple), after the model has loaded.
RUN_PIPELINE_ARGUMENTS = ("prompt", "generator", "output_type", "return_dict")


def check_pipe_kwargs(pipe_kwargs: dict | None, reserved: Sequence[str] = RUN_PIPELINE_ARGUMENTS) -> None:
    """Raise ValueError if ``pipe_kwargs`` sets an argument the caller sets itself (``reserved``)."""
    if pipe_kwargs is not None and not isinstance(pipe_kwargs, dict):
        raise ValueError(f"pipe_kwargs must be a dict of pipeline call arguments, got {type(pipe_kwargs).__name__}")
    clash = sorted(set(pipe_kwargs or {}) & set(reserved))
    if clash:
        raise ValueError(f"pipe_kwargs sets {', '.join(clash)}, which this call sets itself (the prompts and seeds "
                         f"are arguments of their own; outputs are read as tensors)")


def prompt_list(prompts: str | Sequence[str], caller: str) -> list[str]:
    """``prompts`` as a non-empty list of strings; one string is one prompt (iterated, it would have been one prompt
    per character)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
        raise ValueError(f"{caller} takes a list of prompts (or one prompt as a str), got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"{caller} needs at least one prompt")
    wrong = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if wrong:
        raise ValueError(f"{caller}: prompts must be strings; item {wrong[0]} is a {type(prompts[wrong[0]]).__name__}")
    return prompts


def pipeline_progress_off(pipe: Any) -> Callable[[], None]:
    """Turn off a diffusers pipeline's own progress bar, one per call (generate, evaluate and tune show one bar over
    all their calls instead). Returns the function that gives the pipeline back the configuration it had."""
    if not hasattr(pipe, "set_progress_bar_config"):
        return lambda: None
    # diffusers keeps set_progress_bar_config's arguments there; none set is the same as {}
    saved = dict(getattr(pipe, "_progress_bar_config", None) or {})
    pipe.set_progress_bar_config(disable=True)
    return lambda: pipe.set_progress_bar_config(**saved)
