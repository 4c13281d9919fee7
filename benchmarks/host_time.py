"""Host (CPU) time to enqueue one eager call, at the Flux shape: what a call costs the Python thread while the GPU
runs behind it. CUDA-graph timings (benchmarks/attention.py) leave it out; an eager pipeline pays it on every
attention layer, and where it exceeds the GPU time of the layer the GPU waits.

Each entry: 20 warm-up calls, then 5 rounds of 40 calls issued while the GPU sleeps (``torch.cuda._sleep``), so
the host never waits on the GPU; per-call time = round time / 40; min and median of the rounds. Every entry is
timed with our kernels launched directly (``sparge_diffusers._launch``, the default) and through Triton's
``kernel[grid](...)`` path, alternately (``AB_REPEATS`` times each, min of the mins and median of the medians):
the host's speed swings between runs, so only figures of one run compare.

The second part of the table splits one call: stage 1's launches with their allocations, the tail order's zeroed
buffer, and the cost of one allocation and of one empty launch on this host.

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
from predict_breakdown import stage_one_inputs  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sparge_diffusers import (  # noqa: E402
    block_sparse_attention, compact_block_mask, predict_block_mask, sparge_attention)
from sparge_diffusers import _launch  # noqa: E402
from sparge_diffusers.kernels import attention_hopper, predict  # noqa: E402

WARMUP, ROUNDS, CALLS = 20, 5, 40
AB_REPEATS = 3
LAUNCH_PATHS = {"direct": True, "triton": False}  # label: _launch.ENABLED
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


@triton.jit
def _empty_kernel(x, n, BLOCK: tl.constexpr):
    pass


def part_entry_points(q: torch.Tensor, k: torch.Tensor) -> dict:
    """What one sparge_attention call is made of, each timed alone: stage 1's three launches with their output
    allocations, the Hopper kernel's zeroed tail-order buffer, and the yardsticks a call pays per allocation and
    per launch (``torch.empty``, ``torch.zeros``, a Triton kernel that does nothing, launched as ours are)."""
    shape, scale, (q_means, q_sim), (k_means, k_sim), scores, topcdf = stage_one_inputs(q, k, causal=False)
    return {
        "  stage 1: statistics": lambda: predict.qk_block_statistics_triton(q, k),
        "  stage 1: scores": lambda: predict.compressed_scores_triton(q_means, k_means, shape, scale),
        "  stage 1: topcdf": lambda: predict.topcdf_block_mask_triton(scores, q_sim, k_sim, shape, **topcdf),
        "  tail schedule": lambda: attention_hopper.new_tail_schedule(shape, q.device, with_counter=True),
        "  torch.empty": lambda: torch.empty(shape.batch, shape.heads, shape.q_blocks, shape.head_dim,
                                             device=q.device, dtype=torch.float32),
        "  torch.zeros(65)": lambda: torch.zeros(65, device=q.device, dtype=torch.int32),
        "  empty Triton launch": lambda: _launch.launch(_empty_kernel, (1,), q, 5, BLOCK=16),
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


def launch_path_ab(fns: dict, repeats: int = AB_REPEATS, **timer) -> dict:
    """{path: {name: {"min_us", "median_us"}}} for each launch path of ``LAUNCH_PATHS``, timed alternately."""
    runs = {path: [] for path in LAUNCH_PATHS}
    try:
        for _ in range(repeats):
            for path, enabled in LAUNCH_PATHS.items():
                _launch.ENABLED = enabled
                runs[path].append(host_times(fns, **timer))
    finally:
        _launch.ENABLED = True
    return {path: {name: {"min_us": min(r[name]["min_us"] for r in rs),
                          "median_us": sorted(r[name]["median_us"] for r in rs)[len(rs) // 2]}
                   for name in fns}
            for path, rs in runs.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    q, k, v = (torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    by_path = launch_path_ab({**entry_points(q, k, v), **part_entry_points(q, k)})
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [1, 24, 4608, 128],
               "host_us": by_path["direct"], "host_us_triton_launch": by_path["triton"]}
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); Flux shape (1, 24, 4608, 128) bf16, HND; "
             f"host us per eager call, {ROUNDS} rounds of {CALLS} calls, launch paths alternated {AB_REPEATS} times",
             f"  {'':24} {'direct launch':>22}   {'Triton launch path':>22}",
             f"  {'':24} {'min':>10} {'median':>11}   {'min':>10} {'median':>11}"]
    for name, t in by_path["direct"].items():
        u = by_path["triton"][name]
        lines.append(f"  {name:24} {t['min_us']:10.1f} {t['median_us']:11.1f}   "
                     f"{u['min_us']:10.1f} {u['median_us']:11.1f}")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
