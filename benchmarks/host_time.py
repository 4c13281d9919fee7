"""Host (CPU) time to enqueue one eager call, at the Flux shape: what a call costs the Python thread while the GPU
runs behind it. CUDA-graph timings (benchmarks/attention.py) leave it out; an eager pipeline pays it on every
attention layer, and where it exceeds the GPU time of the layer the GPU waits.

Each entry: 20 warm-up calls, then 5 rounds of 40 calls issued while the GPU sleeps (``torch.cuda._sleep``), so
the host never waits on the GPU; per-call time = round time / 40; min and median of the rounds.

Usage: python benchmarks/host_time.py [--out benchmarks/results/host-time-H100.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402

from sparge_diffusers import block_sparse_attention, compact_block_mask, predict_block_mask, sparge_attention  # noqa: E402

WARMUP, ROUNDS, CALLS = 20, 5, 40
GPU_SLEEP_CYCLES = 200_000_000  # ~0.1 s at H100 clocks: longer than a round's enqueueing


def entry_points(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    compact = compact_block_mask(predict_block_mask(q, k), q, k)
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "sparge_attention": lambda: sparge_attention(q, k, v),
        "sparge_attention(stats)": lambda: sparge_attention(q, k, v, return_sparsity=True),
        "predict_block_mask": lambda: predict_block_mask(q, k),
        "block_sparse(prebuilt)": lambda: block_sparse_attention(q, k, v, compact),
        "block_sparse(dense)": lambda: block_sparse_attention(q, k, v, None),
    }


def host_times(fns: dict, rounds: int = ROUNDS, calls: int = CALLS, warmup: int = WARMUP) -> dict:
    """{name: {"min_us", "median_us"}} of the per-call enqueue time; on CUDA the GPU sleeps during each round."""
    cuda = torch.cuda.is_available()
    results = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        per_call = []
        for _ in range(rounds):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(GPU_SLEEP_CYCLES)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
        per_call.sort()
        results[name] = {"min_us": per_call[0], "median_us": per_call[len(per_call) // 2]}
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    q, k, v = (torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    times = host_times(entry_points(q, k, v))
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [1, 24, 4608, 128],
               "host_us": times}
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); Flux shape (1, 24, 4608, 128) bf16, HND; "
             f"host us per eager call, {ROUNDS} rounds of {CALLS} calls"]
    lines += [f"  {name:24} min {t['min_us']:7.1f}  median {t['median_us']:7.1f}" for name, t in times.items()]
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
