"""Checks on the extra pipeline call arguments (``pipe_kwargs``) that generate, evaluate and tune pass through."""

from __future__ import annotations

from typing import Sequence

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
