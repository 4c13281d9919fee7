"""Race checks of the warp-specialised Gluon kernels with Triton's ConSan, and the driver of the sanitizer runs.

compute-sanitizer's racecheck flags two places in the Hopper kernels, ordered in ways it does not follow: the tile
number a loader hands its consumers (a warp barrier orders every lane's store of it before the loader's mbarrier
arrive, which the consumers wait on) and the bytes by which Triton's warp specialisation dispatches its partitions
(a CTA barrier); docs/testing.md, "Sanitizers on the GPU", has the hazards and the PTX. ConSan
(``TRITON_INSTRUMENTATION_MODE=consan``) models Gluon's mbarriers, TMA copies and partitions, so it is the check
these kernels must pass: on an sm90 GPU the mask walk and S2O's ordered walk run under it, and a planted race (a
consumer reading the tile number before waiting for it) must make it stop the kernel.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sanitize_calls
from test_attention_hopper import _on_hopper

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(sanitize_calls.__file__)
KERNEL = ROOT / "sparge_diffusers" / "kernels" / "attention_hopper.py"
CONSAN_CASES = ["mask_128", "s2o_128"]  # the two Gluon walks, at the head dim they run
EVERY_CASE = [f"{call}_{head_dim}" for call in ("dense", "densecausal", "mask", "whole", "s2o", "pbs", "fsa")
              for head_dim in (64, 128)]

# _read_tile as written, and the planted race: the tile number read before the q_ready wait that publishes it
WAIT_THEN_READ = """        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        return gl.max(tile_ids.index(qb).load(layout), axis=0)"""
READ_THEN_WAIT = """        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        tile = gl.max(tile_ids.index(qb).load(layout), axis=0)
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        return tile"""


def test_driver_runs_every_case_against_its_reference():
    """On a CPU each call runs the reference path: the driver's calls, arguments and checks, as a dry run."""
    assert sanitize_calls.main(EVERY_CASE) == 0
    with pytest.raises(ValueError, match="unknown case"):
        sanitize_calls.run_case("sparse_128")


def test_consumers_read_the_tile_number_after_waiting_for_it():
    """The handoff the planted race below breaks, as the kernel has it (and so the GPU test's patch applies)."""
    assert KERNEL.read_text().count(WAIT_THEN_READ) == 1


def _run_driver(tmp_path: Path, cases: list[str], package_root: Path) -> subprocess.CompletedProcess:
    """The driver in a fresh process under ConSan, importing ``sparge_diffusers`` from ``package_root``."""
    env = dict(os.environ, TRITON_INSTRUMENTATION_MODE="consan", CUDA_LAUNCH_BLOCKING="1", TRITON_INTERPRET="0",
               TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))  # instrumented binaries kept apart
    code = ("import runpy, sys; sys.path[:0] = [sys.argv[1], sys.argv[2].rpartition('/')[0]]; import sparge_diffusers; "
            "print('package', sparge_diffusers.__file__, flush=True); sys.argv = sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, str(package_root), str(DRIVER), *cases], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.gpu
def test_gpu_hopper_walks_pass_consan(tmp_path):
    _on_hopper()
    run = _run_driver(tmp_path, CONSAN_CASES, ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for case in CONSAN_CASES:
        assert f"ok {case}" in run.stdout, run.stdout


@pytest.mark.gpu
def test_gpu_consan_stops_a_consumer_reading_the_tile_number_before_its_wait(tmp_path):
    """The control: without it a clean pass above could mean ConSan was not watching."""
    _on_hopper()
    copy = tmp_path / "planted"
    shutil.copytree(ROOT / "sparge_diffusers", copy / "sparge_diffusers")
    planted = copy / "sparge_diffusers" / "kernels" / "attention_hopper.py"
    planted.write_text(KERNEL.read_text().replace(WAIT_THEN_READ, READ_THEN_WAIT))
    run = _run_driver(tmp_path, ["mask_128"], copy)
    assert f"package {copy}" in run.stdout, run.stdout  # the planted copy ran, not the installed package
    # ConSan stops the kernel (a trap: "illegal instruction", or a device-side assert) before any output is checked
    assert run.returncode != 0 and "mask_128" not in run.stdout, run.stdout
    assert any(sign in run.stderr for sign in ("illegal instruction", "device-side assert", "unspecified launch")), \
        run.stderr[-3000:]
