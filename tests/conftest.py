"""Test setup: Triton kernels run in the interpreter on CPU tensors (no GPU in CI), compiled under ``-m gpu``.

TRITON_INTERPRET must be set before triton.jit decorates our kernels, hence before any import of them:
``pytest_configure`` runs before the test modules are imported. One process cannot run both: the interpreter
cannot launch on CUDA tensors, and compiled kernels cannot run on CPU tensors. So the GPU tests run the compiled
kernels when they alone are selected (``pytest -m gpu``) on a machine with CUDA, and any other selection runs
the interpreter and skips them, saying how to run them. An explicit TRITON_INTERPRET is left as it is.
"""

import os

import numpy as np
import pytest
import torch

GPU_ONLY_MARK_EXPRESSION = "gpu"


def interpreter_wanted(cuda_available: bool, markexpr: str) -> bool:
    """Whether this test run should set TRITON_INTERPRET=1 (when the user did not set it): always, unless CUDA is
    present and the run selects the GPU tests alone (``-m gpu``), which need the compiled kernels."""
    return not (cuda_available and markexpr.replace(" ", "") == GPU_ONLY_MARK_EXPRESSION)


def runs_in_interpreter() -> bool:
    """TRITON_INTERPRET read as ``sparge_diffusers._launch.interpreting`` reads it (not imported here: importing the
    package decorates the kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.6-3.9) keeps bf16 as raw uint16 bits and tl.dot multiplies those bits.

    Convert bf16 operands to float32 first, which is what the GPU's tensor cores compute (exact products,
    float32 accumulation). Only the interpreter is patched; the kernels are unchanged.
    """
    if not runs_in_interpreter():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "_sparge_bf16_fix", False):
        return

    def create_dot(self, a, b, d, *args, **kwargs):
        def as_f32(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x

        return original(self, as_f32(a), as_f32(b), d, *args, **kwargs)

    create_dot._sparge_bf16_fix = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def pytest_configure(config):
    if "TRITON_INTERPRET" not in os.environ:
        interpret = interpreter_wanted(torch.cuda.is_available(), config.getoption("markexpr") or "")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"  # xdist's workers inherit it
    _patch_interpreter_bf16_dot()


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
    elif runs_in_interpreter():
        skip = pytest.mark.skip(reason="GPU tests run the compiled kernels, not the interpreter: select them alone "
                                "(pytest -m gpu) or set TRITON_INTERPRET=0")
    else:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
