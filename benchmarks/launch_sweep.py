"""Launch settings (num_warps, num_stages) of the Triton attention kernel: dense, at density 0.25, and at
density 0.25 with the stage-2 test (pvthreshd 20).

On an H100 the Triton kernel runs every call the Hopper kernel does not take (the stage-2 test, head dims
other than 64 and 128, the non-causal dense mode at D = 64, GPUs other than sm90); this script forbids the Hopper kernel
(``attention_hopper.OVERRIDE = False``) so that every call here is the Triton kernel's.
``attention._launch_config`` holds the settings it picks. Timing as in benchmarks/attention.py.

Usage: python benchmarks/launch_sweep.py [--out benchmarks/results/launch-sweep-H100.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402
from attention import bench_rounds  # noqa: E402

from sparge_diffusers import block_sparse_attention  # noqa: E402
from sparge_diffusers.kernels import attention as attention_module  # noqa: E402
from sparge_diffusers.kernels import attention_hopper  # noqa: E402

SHAPES = {"mochi": (44776, 24, 128), "cogvideox": (17776, 30, 64)}  # N, H, D (B = 1)
SETTINGS = [(w, s) for w in (4, 8) for s in (2, 3, 4)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    attention_hopper.OVERRIDE = False
    default = attention_module._launch_config(128)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "default": default, "shapes": {}}
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); the Triton kernel, ms, fastest of 3 rounds of "
             f"CUDA-graph medians; * = the setting it uses",
             f"{'shape':10} {'warps':>5} {'stages':>6} {'dense':>9} {'TFLOP/s':>8} {'0.25':>9} {'0.25+pv':>9}"]
    for name, (N, H, D) in SHAPES.items():
        q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = torch.rand(1, H, -(-N // 128), -(-N // 64), device="cuda") < 0.25
        flops = 4 * H * N * N * D
        rows = {}
        for warps, stages in SETTINGS:
            attention_module.LAUNCH_OVERRIDE = {"num_warps": warps, "num_stages": stages}
            fns = {"dense": lambda: block_sparse_attention(q, k, v, None),
                   "0.25": lambda: block_sparse_attention(q, k, v, mask),
                   "0.25+pv": lambda: block_sparse_attention(q, k, v, mask, pvthreshd=20.0)}
            try:
                best, _ = bench_rounds(fns)
            except Exception as e:  # a setting the compiler cannot fit (shared memory): report, go on
                best = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows[f"w{warps}s{stages}"] = best
            mark = "*" if {"num_warps": warps, "num_stages": stages} == default else " "
            if "error" in best:
                lines.append(f"{name:10} {warps:5} {stages:5}{mark} failed: {best['error']}")
            else:
                lines.append(f"{name:10} {warps:5} {stages:5}{mark} {best['dense']:9.3f} "
                             f"{flops / best['dense'] / 1e9:8.0f} {best['0.25']:9.3f} {best['0.25+pv']:9.3f}")
        attention_module.LAUNCH_OVERRIDE = None
        results["shapes"][name] = rows
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
