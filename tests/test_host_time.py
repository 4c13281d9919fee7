"""benchmarks/host_time.py: its entry points run and its timer reports every one (CPU: the reference path; the
figures themselves need a GPU)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import host_time  # noqa: E402  (a broken import must fail here, not skip)


def test_every_entry_point_runs_and_is_timed():
    q, k, v = (torch.randn(1, 2, 200, 64, dtype=torch.float32) for _ in range(3))
    fns = host_time.entry_points(q, k, v)
    assert set(fns) >= {"sdpa", "sparge_attention", "predict_block_mask", "block_sparse(prebuilt)"}
    times = host_time.host_times(fns, rounds=3, calls=2, warmup=1)
    assert set(times) == set(fns)
    assert all(0 < t["min_us"] <= t["median_us"] for t in times.values())


def test_launch_paths_are_timed_alternately_and_the_default_restored(monkeypatch):
    from sparge_diffusers import _launch

    seen = []
    fns = {"probe": lambda: seen.append(_launch.ENABLED)}
    result = host_time.launch_path_ab(fns, repeats=2, rounds=1, calls=1, warmup=0)
    assert set(result) == {"direct", "triton"} and set(result["direct"]) == {"probe"}
    assert seen == [True, False, True, False]
    assert _launch.ENABLED is True


def test_the_parts_of_a_call_run_and_are_timed():
    from sparge_diffusers.workloads import SMALL

    q, k, _ = SMALL["flux"].make("cpu")  # the launchers run in the Triton interpreter here
    parts = host_time.part_entry_points(q, k)
    assert {name.strip() for name in parts} >= {"stage 1: statistics", "stage 1: scores", "stage 1: topcdf",
                                                "tail schedule", "empty Triton launch"}
    mask, (index, count, n_full) = parts["  stage 1: topcdf"]()
    assert mask.shape == count.shape + (index.shape[-1],) and bool((count > 0).all())
    times = host_time.host_times(parts, rounds=2, calls=1, warmup=1)
    assert all(0 < t["min_us"] <= t["median_us"] for t in times.values())
