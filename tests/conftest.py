"""Test setup: Triton kernels run in the interpreter on CPU tensors (no GPU in CI), compiled under ``-m gpu``.

TRITON_INTERPRET must be set before triton.jit decorates our kernels, hence before any import of them:
``pytest_configure`` runs before the test modules are imported. One process cannot run both: the interpreter
cannot launch on CUDA tensors, and compiled kernels cannot run on CPU tensors. So the GPU tests run the compiled
kernels when they alone are selected (``pytest -m gpu``) on a machine with CUDA, and any other selection runs
the interpreter and skips them, saying how to run them. An explicit TRITON_INTERPRET is left as it is.

Under pytest-xdist (the test command's ``-n 2``) each worker gets an equal share of the CPUs for its threads.
"""

import os
from collections.abc import MutableMapping

import numpy as np
import pytest
import torch

GPU_ONLY_MARK_EXPRESSION = "gpu"


def interpreter_wanted(cuda_available: bool, markexpr: str) -> bool:
    """Whether this test run should set TRITON_INTERPRET=1 (when the user did not set it): always, unless CUDA is
    present and the run selects the GPU tests alone (``-m gpu``), which need the compiled kernels."""
    return not (cuda_available and markexpr.replace(" ", "") == GPU_ONLY_MARK_EXPRESSION)


def threads_per_worker(cpus: int, workers: int) -> int:
    """The threads (torch's and BLAS's) for each of ``workers`` pytest-xdist workers sharing ``cpus`` CPUs: an equal
    share, at least one. Their default, every CPU in every worker, oversubscribes the machine and the threads then
    spin against each other (eight GPU-test workers of 16 threads each ran 33 tests in 570 s)."""
    return max(1, cpus // workers)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, which ``nproc`` reports), not every CPU of the host."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def share_threads_among_workers(workers: int | None, environ: MutableMapping[str, str]) -> None:
    """Before pytest-xdist starts its ``workers`` (``-n``, already resolved to a count), set OMP_NUM_THREADS in
    ``environ`` to their share of the CPUs, unless it is set. The workers inherit it, so torch and numpy's BLAS start
    with that many threads: left to their defaults, each worker's BLAS threads spin against the other's, and two
    workers on two CPUs ran ``test_softcap.py`` in 78 s against 61 s for one process (39-58 s with this)."""
    if workers and "PYTEST_XDIST_WORKER" not in environ and "OMP_NUM_THREADS" not in environ:
        environ["OMP_NUM_THREADS"] = str(threads_per_worker(available_cpus(), workers))


def runs_in_interpreter() -> bool:
    """TRITON_INTERPRET read as Triton and ``sparge_diffusers._launch.interpreting`` read it (the package is not
    imported here: importing it decorates the kernels)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _patch_interpreter_dot() -> None:
    """Two fixes to tl.dot in Triton's interpreter (3.6-3.9); only the interpreter is patched, the kernels are
    unchanged.

    bf16: the interpreter keeps bf16 as raw uint16 bits and multiplies those bits. Convert bf16 operands to float32
    first, which is what the GPU's tensor cores compute (exact products, float32 accumulation).

    Rows: the interpreter's one float32 matmul goes to the CPU's BLAS, whose sgemm may round a row differently by
    its position in the tile (OpenBLAS 0.3.31's Haswell kernels on an AMD EPYC: 60 of 63 row shifts of a 64-row
    tile changed some output). A GPU's MMA gives a row the same result wherever it sits, and tests check that
    (FSA's query pieces and prebuilt index gather each query into another tile row: ``torch.equal`` failed on that
    CPU). So each row is multiplied on its own: the same BLAS call for every row, wherever it sits (about 2x the
    matmul's time, small beside the interpreter's own).
    """
    if not runs_in_interpreter():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "_sparge_dot_fix", False):
        return

    def create_dot(self, a, b, d, *args, **kwargs):
        def as_f32(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x

        a, b = as_f32(a), as_f32(b)
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own path
            return original(self, a, b, d, *args, **kwargs)
        # (..., M, 1, K) @ (..., 1, K, N): one (1, K) x (K, N) product per row
        rows = np.matmul(a.data[..., :, None, :], b.data[..., None, :, :], dtype=d.data.dtype)[..., 0, :]
        return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)

    create_dot._sparge_dot_fix = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def cudnn_sdpa_wanted(environ: MutableMapping[str, str]) -> bool:
    """Whether torch may choose cuDNN's SDPA kernel in this run: yes, unless ``SPARGE_TEST_CUDNN_SDPA=0``. Under
    compute-sanitizer memcheck, cuDNN's kernel (torch 2.11, cuDNN 9.19, H200) reads 2 bytes past an attention mask
    of an odd key count (an LLM decode step's fallback to SDPA, say) and memcheck then stops the process; turned
    off, a sanitizer run of the random-draw streams goes on past those calls, on the flash and memory-efficient
    kernels torch picks wherever it does not choose cuDNN (docs/testing.md, "Sanitizers on the GPU"). The tests
    that ask for cuDNN by name fail in such a run."""
    return environ.get("SPARGE_TEST_CUDNN_SDPA", "1") != "0"


def pytest_configure(config):
    if not cudnn_sdpa_wanted(os.environ):
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "TRITON_INTERPRET" not in os.environ:
        interpret = interpreter_wanted(torch.cuda.is_available(), config.getoption("markexpr") or "")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"  # xdist's workers inherit it
    share_threads_among_workers(getattr(config.option, "numprocesses", None), os.environ)
    _patch_interpreter_dot()


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
