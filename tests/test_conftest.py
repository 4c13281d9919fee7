"""The test setup's choice between Triton's interpreter and compiled kernels, and its threads (see conftest.py)."""

import os

import pytest
import torch

import triton
import triton.language as tl

from conftest import (available_cpus, cudnn_sdpa_wanted, interpreter_wanted, runs_in_interpreter,
                      share_threads_among_workers, threads_per_worker)


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + rm[:, None] * K + rk[None, :])
    b = tl.load(B + rk[:, None] * N + rn[None, :])
    tl.store(C + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@pytest.mark.parametrize(
    ("cuda", "markexpr", "interpret"),
    [
        (False, "", True),  # CI: no GPU, every kernel test in the interpreter
        (False, "gpu", True),  # nothing to compile for; the GPU tests skip
        (True, "", True),  # a GPU machine running everything: the CPU tests need the interpreter
        (True, "not gpu", True),
        (True, "gpu and slow", True),  # not the GPU tests alone: kept to the interpreter, the GPU tests skip
        (True, "gpu", False),  # `pytest -m gpu` on a GPU: compiled kernels
        (True, " gpu ", False),
    ],
)
def test_interpreter_is_chosen_unless_the_gpu_tests_alone_run_on_a_gpu(cuda, markexpr, interpret):
    assert interpreter_wanted(cuda, markexpr) is interpret


def test_this_run_without_a_gpu_uses_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("checks a run on a machine without CUDA")
    assert runs_in_interpreter()


class _Item:
    """What ``pytest_collection_modifyitems`` reads of a test item."""

    def __init__(self, *marks: str):
        self.keywords = {name: True for name in marks}
        self.added: list = []

    def add_marker(self, marker) -> None:
        self.added.append(marker)


@pytest.mark.parametrize(
    ("cuda", "interpret", "reason"),
    [(False, "1", "needs a CUDA GPU"), (True, "1", "pytest -m gpu"), (True, "0", None)],
)
def test_gpu_tests_skip_with_a_reason_where_they_cannot_run(monkeypatch, cuda, interpret, reason):
    import conftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    gpu_test, cpu_test = _Item("gpu"), _Item()
    conftest.pytest_collection_modifyitems(None, [gpu_test, cpu_test])
    assert cpu_test.added == []
    if reason is None:
        assert gpu_test.added == []
    else:
        (marker,) = gpu_test.added
        assert marker.name == "skip" and reason in marker.kwargs["reason"]


def test_the_interpreter_setting_is_read_as_the_package_reads_it(monkeypatch):
    from sparge_diffusers import _launch

    for value in ("", "0", "1", "true", "TRUE", "yes", "false", "off", "2"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert runs_in_interpreter() is _launch.interpreting()


@pytest.mark.parametrize(("cpus", "workers", "threads"), [(2, 2, 1), (16, 6, 2), (64, 8, 8), (1, 2, 1), (3, 1, 3)])
def test_xdist_workers_share_the_cpus(cpus, workers, threads):
    assert threads_per_worker(cpus, workers) == threads


@pytest.mark.parametrize(
    ("workers", "environ", "threads"),
    [
        (2, {}, str(threads_per_worker(available_cpus(), 2))),  # the controller, before it starts two workers
        (None, {}, None),  # no xdist: torch and BLAS keep their defaults
        (0, {}, None),  # -n 0
        (2, {"OMP_NUM_THREADS": "3"}, "3"),  # an explicit count is kept
        (2, {"PYTEST_XDIST_WORKER": "gw0"}, None),  # a worker leaves it to the controller
    ],
)
def test_the_controller_sets_each_workers_threads(workers, environ, threads):
    share_threads_among_workers(workers, environ)
    assert environ.get("OMP_NUM_THREADS") == threads


def test_this_run_gives_each_xdist_worker_its_share_of_threads():
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("checks a pytest-xdist worker")
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


@pytest.mark.parametrize(("environ", "wanted"), [({}, True), ({"SPARGE_TEST_CUDNN_SDPA": "1"}, True),
                                                 ({"SPARGE_TEST_CUDNN_SDPA": "0"}, False)])
def test_cudnn_sdpa_is_turned_off_only_when_asked(environ, wanted):
    assert cudnn_sdpa_wanted(environ) is wanted


def test_this_run_leaves_cudnn_sdpa_as_the_environment_asks():
    assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_sdpa_wanted(os.environ)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_interpreters_dot_multiplies_bf16_values_and_gives_a_row_the_same_result_wherever_it_sits(dtype):
    """conftest's patch of tl.dot: bf16 operands as their values (not their bits), float32 accumulation, and each
    row's result independent of its place in the tile (a query gathered into another row of FSA's tiles), as on a
    GPU. Without the patch, 60 of these 63 shifts changed some output on an AMD EPYC (OpenBLAS 0.3.31)."""
    if not runs_in_interpreter():
        pytest.skip("checks the interpreter")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=g).to(dtype), torch.randn(128, 64, generator=g).to(dtype)

    def dot(x):
        out = torch.empty(64, 64)
        _dot_kernel[(1,)](x.contiguous(), b, out, M=64, K=128, N=64)
        return out

    once = dot(a)
    torch.testing.assert_close(once, a.float() @ b.float(), rtol=1e-5, atol=1e-4)
    for shift in range(1, 64):
        assert torch.equal(dot(a.roll(shift, 0)), once.roll(shift, 0)), shift
