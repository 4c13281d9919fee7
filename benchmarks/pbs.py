"""PBS-Attn's segmented key permutation against keys in order, for causal LLM prefill, one run on one GPU.

Inputs: sparge_diffusers.testing.llm_like_qkv at Llama-3.1-8B's attention shape (32 query heads, 8 K/V heads,
D = 128), which has the attention sink, local windows and scattered "vertical" key stripes that PBS-Attn
targets (the sink and the stripes mild at the generator's defaults, which this script takes unless given
--sink-logit, --stripe-logit or --stripes-per-1k: see its docstring). For each length and TopCdf threshold
(tau), with keys in order (``sparge_attention``) and with keys sorted within segments (``llm.pbs_sparge_attention``):
- block density (computed Q.K^T blocks / those of dense causal attention) and the relative L1 against exact
  float32 attention (sampled rows);
- the whole call's ms (PBS: importance, sort and K/V gather included), and that overhead alone;
- ``block_sparse_attention`` with the same mask, compacted once, against FlexAttention given the same blocks
  (its mask_mod compares original key positions for PBS) and against cuDNN SDPA's dense causal attention.
Both orders run where ``sparge_attention`` sends them (the Hopper kernel at D = 128 on an H100, reading the
keys' original positions in its masked stages for PBS), and again on the Triton kernel ("(T)" columns).

Usage: python benchmarks/pbs.py [--lengths 32768,65536] [--taus 0.9,0.98] [--segments 256] [--out r.json]
       [--sink-logit 12 --stripe-logit 6 --stripes-per-1k 1] [--attention-sink]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402
from attention import bench_rounds, flex_fn  # noqa: E402

from sparge_diffusers import block_sparse_attention, compact_block_mask  # noqa: E402
from sparge_diffusers import predict_block_mask, sparge_attention  # noqa: E402
from sparge_diffusers.kernels import PermutedKeys, attention_hopper  # noqa: E402
from sparge_diffusers.kernels._inputs import check_attention_inputs  # noqa: E402
from sparge_diffusers.kernels.stats import dense_block_count  # noqa: E402
from sparge_diffusers.llm import pbs_sparge_attention  # noqa: E402
from sparge_diffusers.permutations import gather_keys, last_block_key_importance, segmented_key_order  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import cudnn_attention_fn, sampled_relative_l1  # noqa: E402


def on_triton(fn):
    """``fn`` with the Hopper kernel forbidden (the Triton kernel then runs every attention launch)."""
    def run():
        attention_hopper.OVERRIDE = False
        try:
            return fn()
        finally:
            attention_hopper.OVERRIDE = None
    return run


def run_length(n, taus, segments, with_flex, log, inputs=None, attention_sink=False):
    q, k, v = llm_like_qkv(n, heads=32, kv_heads=8, head_dim=128, device="cuda", seed=0, **(inputs or {}))
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=True)
    dense_blocks = dense_block_count(shape, True) * shape.batch * shape.heads
    row = {"cudnn_ms": bench_rounds({"cudnn": cudnn_attention_fn(q, k, v, True)})[0]["cudnn"], "cells": []}
    log(f"N={n}: cuDNN causal {row['cudnn_ms']:.3f} ms")
    importance = last_block_key_importance(q, k)
    orders = {s: segmented_key_order(importance, s) for s in segments}

    def overhead(s):  # what pbs_sparge_attention adds to sparge_attention: ranking, sort, K and V gathers
        order = segmented_key_order(last_block_key_importance(q, k), s)
        return gather_keys(k, order), gather_keys(v, order), order.to(torch.int32)

    parts = {"importance": lambda: last_block_key_importance(q, k)}
    for s in segments:
        parts[f"sort{s}"] = lambda s=s: segmented_key_order(importance, s)
        parts[f"gather{s}"] = lambda s=s: (gather_keys(k, orders[s]), gather_keys(v, orders[s]))
        parts[f"pbs{s}"] = lambda s=s: overhead(s)
    times = bench_rounds(parts)[0]
    row["pbs_overhead_ms"] = {f"pbs{s}": times.pop(f"pbs{s}") for s in segments}
    row["pbs_overhead_parts_ms"] = times
    for tau in taus:
        for method in ["in_order"] + [f"pbs{s}" for s in segments]:
            settings = dict(cdfthreshd=tau, attention_sink=attention_sink)
            if method == "in_order":
                kk, vv, pk = k, v, None
                whole = {"whole": lambda: sparge_attention(q, k, v, is_causal=True, **settings)}
            else:
                s = int(method[3:])
                kk, vv = gather_keys(k, orders[s]), gather_keys(v, orders[s])
                pk = PermutedKeys(orders[s].to(torch.int32), s)
                whole = {"whole": lambda s=s: pbs_sparge_attention(q, k, v, segment=s, **settings)}
            mask = predict_block_mask(q, kk, is_causal=True, permuted_keys=pk, **settings)
            cm = compact_block_mask(mask, q, kk, is_causal=True, permuted_keys=pk)
            density = float(cm.count.sum()) / dense_blocks
            out = whole["whole"]()
            l1 = sampled_relative_l1(out, q, k, v, True)
            fns = dict(whole)
            fns["prebuilt"] = lambda: block_sparse_attention(q, kk, vv, cm, is_causal=True, permuted_keys=pk)
            fns["whole_triton"] = on_triton(whole["whole"])
            fns["prebuilt_triton"] = on_triton(fns["prebuilt"])
            if with_flex:
                try:
                    fns["flex"] = (flex_fn(q, kk, vv, mask, True, shape) if pk is None else
                                   flex_fn(q, kk, vv, mask, True, shape, pk.positions, pk.segment))
                    fns["flex"]()  # compile outside the timed rounds
                except Exception as e:  # report, never hide
                    fns.pop("flex", None)
                    log(f"  flex failed: {type(e).__name__}: {str(e)[:300]}")
            times, spread = bench_rounds(fns)
            cell = {"tau": tau, "method": method, "density": density, "relative_l1": l1,
                    **{f"{name}_ms": t for name, t in times.items()},
                    "spread": spread, "cudnn_vs_whole": row["cudnn_ms"] / times["whole"],
                    "flex_vs_prebuilt": times.get("flex", float("nan")) / times["prebuilt"]}
            row["cells"].append(cell)
            log(f"  tau {tau} {method}: density {density:.3f} L1 {l1:.4f} " +
                " ".join(f"{name} {t:.3f}" for name, t in times.items()))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32768,65536")
    ap.add_argument("--taus", default="0.9,0.98")
    ap.add_argument("--segments", default="256")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", default=None)
    for name in ("sink-logit", "stripe-logit", "stripes-per-1k"):  # llm_like_qkv's strengths; its defaults if unset
        ap.add_argument(f"--{name}", type=float, default=None)
    ap.add_argument("--attention-sink", action="store_true", help="keep every query's first key block (both orders)")
    args = ap.parse_args(argv)
    inputs = {key: value for key in ("sink_logit", "stripe_logit", "stripes_per_1k")
              if (value := getattr(args, key)) is not None}
    if not torch.cuda.is_available():
        sys.exit("benchmarks/pbs.py needs a CUDA GPU")
    import triton

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "inputs": inputs, "attention_sink": args.attention_sink,
               "lengths": {}}
    taus = [float(x) for x in args.taus.split(",")]
    segments = [int(x) for x in args.segments.split(",")]
    for n in map(int, args.lengths.split(",")):
        results["lengths"][n] = run_length(n, taus, segments, not args.no_flex, lambda m: print(m, flush=True),
                                           inputs, args.attention_sink)
    lines = [f"GPU: {results['gpu']} (torch {results['torch']}, Triton {results['triton']}); llm_like_qkv, 32 q / "
             f"8 kv heads, D = 128, bf16, causal; ms = fastest of 3 rounds of CUDA-graph medians" +
             "".join(f"; {key} {value}" for key, value in inputs.items()) +
             ("; attention_sink=True" if args.attention_sink else ""),
             f"{'N':>6} {'tau':>5} {'keys':>8} {'density':>7} {'L1':>7} {'whole ms':>9} {'cuDNN/wh':>8} "
             f"{'pre ms':>8} {'flex ms':>8} {'flex/pre':>8} {'wh(T) ms':>8} {'pre(T)':>7}"]
    for n, r in results["lengths"].items():
        for c in r["cells"]:
            lines.append(f"{n:6d} {c['tau']:5.2f} {c['method']:>8} {c['density']:7.3f} {c['relative_l1']:7.4f} "
                         f"{c['whole_ms']:9.3f} {c['cudnn_vs_whole']:8.2f} {c['prebuilt_ms']:8.3f} "
                         f"{c.get('flex_ms', float('nan')):8.3f} {c['flex_vs_prebuilt']:8.2f} "
                         f"{c.get('whole_triton_ms', float('nan')):8.3f} "
                         f"{c.get('prebuilt_triton_ms', float('nan')):7.3f}")
        lines.append(f"{n:6d} cuDNN causal {r['cudnn_ms']:.3f} ms; PBS overhead (importance + sort + K/V gather) " +
                     ", ".join(f"{m} {t:.3f} ms" for m, t in r["pbs_overhead_ms"].items()) + " (" +
                     ", ".join(f"{m} {t:.3f}" for m, t in r["pbs_overhead_parts_ms"].items()) + ")")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
