"""The ``sparge-diffusers`` command line.

    sparge-diffusers bench [--workloads cogvideox,mochi,flux,llama32k] [--json out.json]

Later releases add ``generate``, ``tune`` and ``eval`` to the same command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tqdm import tqdm

from . import __version__, sparge_attention
from .workloads import FULL, SMALL, sampled_relative_l1


def _time_ms(fn, repeats: int = 10) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, repeats), return_mode="median"))


def _cudnn(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(group, 1) if group > 1 else t for t in (k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)

    return run


def bench(args: argparse.Namespace) -> int:
    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    table = FULL if gpu else SMALL
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"unknown workload(s) {unknown}; choose from {list(table)}", file=sys.stderr)
        return 2
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name()} - full-size workloads, Triton kernels vs cuDNN SDPA")
    else:
        print("No GPU: running the float32 reference on small versions of the workloads (no timings).")
    rows = []
    for name in tqdm(names, desc="workloads", unit="workload", disable=args.quiet):
        w = table[name]
        q, k, v = w.make(device, args.seed)
        out, stats = sparge_attention(q, k, v, is_causal=w.causal, return_sparsity=True)
        row = {"workload": name, "B": w.batch, "H": w.heads, "H_kv": w.kv_heads, "N": w.seq_len, "D": w.head_dim,
               "causal": w.causal, "sparsity": stats.sparsity, "qk_skipped": float(stats.qk_skipped.mean()),
               "relative_l1": sampled_relative_l1(out, q, k, v, w.causal)}
        if gpu:
            row["sparge_ms"] = _time_ms(lambda: sparge_attention(q, k, v, is_causal=w.causal))
            row["cudnn_ms"] = _time_ms(_cudnn(q, k, v, w.causal))
            row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["sparge_ms"]
        rows.append(row)
        del q, k, v, out
    header = f"{'workload':10} {'shape (B,H,N,D)':22} {'sparsity':>8} {'rel L1':>8}"
    if gpu:
        header += f" {'sparge ms':>9} {'cuDNN ms':>9} {'speedup':>8}"
    print(header)
    for r in rows:
        line = (f"{r['workload']:10} {str((r['B'], r['H'], r['N'], r['D'])):22} {r['sparsity']:8.3f} "
                f"{r['relative_l1']:8.4f}")
        if gpu:
            line += f" {r['sparge_ms']:9.2f} {r['cudnn_ms']:9.2f} {r['speedup_vs_cudnn']:8.2f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu (reference, small sizes)",
                       "date": time.strftime("%Y-%m-%d"), "version": __version__, "workloads": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparge-diffusers", description="Sparse attention for diffusion "
                                     "transformers and long-context prefill (SpargeAttn in Triton).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="run the whole method on built-in structured workloads")
    b.add_argument("--workloads", default=",".join(FULL), help="comma-separated, from: " + ", ".join(FULL))
    b.add_argument("--json", help="also write the results to this JSON file")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--cpu", action="store_true", help="use the CPU reference even when a GPU is present")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
