"""Shared by the benchmark scripts: print the table, write the JSON results and the table beside them."""

import time

from sparge_diffusers._json import write_json


def save_report(results: dict, table: str, out: str | None) -> None:
    """Print ``table``; with ``out`` (a .json path) write ``results`` there and the table to the .txt beside it."""
    print(table)
    if out:
        write_json(out, results)
        with open(out.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(table + "\n")


def timed(fn, reps: int = 5, warmup: int = 3) -> float:
    """Median wall ms of ``fn`` on CUDA (synchronised around each call) after ``warmup`` calls.

    Whole diffusers steps settle over their first calls (H100, SD3's sparse step: 114, 111, 107, then 104 ms),
    so one warm-up call and a median of 3 had left run-to-run swings of 126-185 ms in the pipelines table."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]
