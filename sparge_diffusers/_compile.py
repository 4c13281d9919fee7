"""What the diffusers and transformers seams need to run inside torch.compile."""

from __future__ import annotations

import warnings

import torch


def compiling() -> bool:
    """Whether torch.compile is tracing this call: then attention goes through the custom operator
    (kernels/library.py) and nothing may depend on values read from tensors or on Python counters."""
    return torch.compiler.is_compiling()


def warn_once(message: str, seen: set[str], stacklevel: int) -> None:
    """Warn once per ``seen`` set (one per processor or attention function); while torch.compile traces, once
    per compilation instead (the set cannot be read there without guarding on it)."""
    if compiling():
        _warn_while_tracing(message)
    elif message not in seen:
        seen.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)


@torch.compiler.assume_constant_result
def _warn_while_tracing(message: str) -> bool:
    """Run by torch.compile while tracing, its result kept as a constant: the warning shows once per
    compilation, and the compiled graph holds no call to it (a warning call inside would break the graph at
    every layer)."""
    warnings.warn(message, stacklevel=2)
    return True
