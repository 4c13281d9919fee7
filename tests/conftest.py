"""Test setup: Triton kernels run in the interpreter on CPU tensors (no GPU in CI).

TRITON_INTERPRET must be set before triton.jit decorates our kernels, hence before any import of them.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def _patch_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.6-3.9) keeps bf16 as raw uint16 bits and tl.dot multiplies those bits.

    Convert bf16 operands to float32 first, which is what the GPU's tensor cores compute (exact products,
    float32 accumulation). Only the interpreter is patched; the kernels are unchanged.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
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


_patch_interpreter_bf16_dot()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
