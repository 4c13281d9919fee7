"""S2O selection (ranked key blocks + early stopping) against TopCdf: accuracy, overhead and time.

1. Trade-off on structured inputs (video-like CogVideoX shape, non-causal; LLM-like Llama-3.1-8B causal 32K):
   sweeps of TopCdf's cdfthreshd and of S2O's tau (simthreshd1 = 0.6, stage 2 off for both); sparsity,
   relative L1 and MSE against exact float32 attention on 2048 sampled query rows. Then S2O's error over
   TopCdf's at matched sparsity and the sparsity of each at matched L1 (linear interpolation along each sweep).
2. Overhead decomposition with no skipping (S2O appendix B): A our dense mode as a call gets it (on Hopper at
   D = 128 the Gluon kernel of attention_hopper, elsewhere the Triton kernel), At the Triton kernel's dense mode
   (128-key tiles at D > 64), the code the Triton S2O walk is built on, and A64 the same contiguous walk in the
   mask's 64-key tiles, which that walk uses; B the Triton S2O walk over every block in ascending order through
   the index (indexed loads), C the same in ranked order, D with the early-stop check on (tau = 0, never stops;
   every 16 ranked tiles, the default, and every tile, every 4 and every 64 tiles for comparison). Each as a
   share of the previous variant; B/A64 isolates the indexed loads from the tile width and from the Gluon
   kernel. Then the walk as s2o_attention runs it (on Hopper the Gluon walk of s2o_hopper, "G"): GB, GC, GD as
   B, C, D (and GD4, every 4 tiles); GD/A is what a user sees. Kernel times: medians of CUDA-graph replays.
3. Time at the default tau (0.0005, tested every 16 ranked tiles) against the TopCdf path (default
   settings) and cuDNN SDPA, with sparsity and L1, at the core benchmark shapes, the walk as called and the
   Triton walk; and the time to build the visiting order (block statistics, compressed scores, sort), per call
   and in CUDA-graph replays.

Usage: python benchmarks/s2o.py [--out results.json] [--parts overhead,timing] [--shapes flux,llama32k]
       [--tradeoff llama32k,llama32k_sink]   (needs a GPU; any workload of workloads.FULL and EXTRA)
With --parts, --shapes or --tradeoff, the other parts and shapes are kept from an existing --out file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch

from sparge_diffusers import BLOCK_K, BLOCK_Q, block_sparse_attention, s2o_attention, s2o_visit_order, sparge_attention
from sparge_diffusers._json import write_json
from sparge_diffusers.kernels import attention, attention_hopper, s2o_hopper
from sparge_diffusers.kernels._inputs import check_attention_inputs
from sparge_diffusers.kernels.predict import block_statistics_triton
from sparge_diffusers.kernels.s2o import VisitOrder
from sparge_diffusers.workloads import EXTRA, FULL, cudnn_attention_fn, sampled_errors

from _report import save_report

TRADEOFF = ("cogvideox", "llama32k")  # part 1's workloads by default (--tradeoff: any of FULL and EXTRA)
CDF = (0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
TAU = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def bench_graph(fn) -> float:
    """Kernel time without host time: median of CUDA-graph replays (the decomposition is about the kernel;
    at Flux's size the Python path before a launch is otherwise part of the measured time)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median"))


def interpolate(xs, ys, x):
    """y at x along a sweep (sorted by x); None outside the sweep's range."""
    order = np.argsort(xs)
    xs, ys = np.asarray(xs)[order], np.asarray(ys)[order]
    if x < xs[0] or x > xs[-1]:
        return None
    return float(np.interp(x, xs, ys))


def tradeoff(name, w):
    q, k, v = w.make("cuda", 0)
    rows = {"topcdf": [], "s2o": []}
    for c in CDF:
        out, st = sparge_attention(q, k, v, is_causal=w.causal, cdfthreshd=c, pvthreshd=None, return_sparsity=True)
        l1, mse = sampled_errors(out, q, k, v, w.causal)
        rows["topcdf"].append({"cdfthreshd": c, "sparsity": st.sparsity, "l1": l1, "mse": mse})
    for tau in TAU:
        out, st = s2o_attention(q, k, v, is_causal=w.causal, tau=tau, return_sparsity=True)
        l1, mse = sampled_errors(out, q, k, v, w.causal)
        rows["s2o"].append({"tau": tau, "sparsity": st.sparsity, "l1": l1, "mse": mse})
    t, s = rows["topcdf"], rows["s2o"]
    matched = []
    for r in s:  # at each S2O point: TopCdf's error at the same sparsity
        l1_t = interpolate([x["sparsity"] for x in t], [x["l1"] for x in t], r["sparsity"])
        mse_t = interpolate([x["sparsity"] for x in t], [x["mse"] for x in t], r["sparsity"])
        if l1_t is not None:
            matched.append({"sparsity": r["sparsity"], "tau": r["tau"], "s2o_l1": r["l1"], "topcdf_l1": l1_t,
                            "s2o_mse": r["mse"], "topcdf_mse": mse_t, "l1_ratio_topcdf_over_s2o": l1_t / r["l1"],
                            "mse_ratio_topcdf_over_s2o": mse_t / r["mse"]})
    at_l1 = []
    for target in (0.005, 0.01, 0.02, 0.05):
        at_l1.append({"l1": target,
                      "topcdf_sparsity": interpolate([x["l1"] for x in t], [x["sparsity"] for x in t], target),
                      "s2o_sparsity": interpolate([x["l1"] for x in s], [x["sparsity"] for x in s], target)})
    return {"sweeps": rows, "matched_sparsity": matched, "matched_l1": at_l1}


def ranked_ascending(order: VisitOrder) -> VisitOrder:
    """The same blocks with the ranked part in ascending block order (variant B)."""
    index, n_unmasked, n_forced, count = order
    pos = torch.arange(index.shape[-1], device=index.device)
    big = index.shape[-1] * 4
    key = torch.where(pos < n_forced[..., None], pos - big, torch.where(pos < count[..., None], index, big + pos))
    return VisitOrder((torch.gather(index, -1, key.argsort(-1)).contiguous(), n_unmasked, n_forced, count),
                      order.shape, order.is_causal)  # the record of its call: s2o_attention then reads nothing back


@contextlib.contextmanager
def triton_dense_mode(key_tile: int | None = None):
    """Our dense mode on the Triton kernel (the Hopper Gluon kernel forbidden), in ``key_tile``-key tiles if
    given (the S2O kernel walks the mask's 64; the dense mode takes 128 at D > 64)."""
    saved = attention.dense_block_n, attention_hopper.OVERRIDE
    attention_hopper.OVERRIDE = False
    if key_tile is not None:
        attention.dense_block_n = lambda head_dim: key_tile
    try:
        yield
    finally:
        attention.dense_block_n, attention_hopper.OVERRIDE = saved


@contextlib.contextmanager
def triton_walk():
    """S2O's walk on the Triton kernel (the Hopper Gluon walk forbidden)."""
    saved = s2o_hopper.OVERRIDE
    s2o_hopper.OVERRIDE = False
    try:
        yield
    finally:
        s2o_hopper.OVERRIDE = saved


def walk_kernel(q, k, v, causal: bool, check_every: int = 16) -> str:
    """Which kernel runs s2o_attention's walk for these inputs: "gluon" (s2o_hopper) or "triton"."""
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal)
    return "gluon" if s2o_hopper.usable(q, k, v, q, shape, pv_test=False, early_stop=True,
                                        check_every=check_every) else "triton"


# Each overhead ratio (a share over the previous variant): name -> (numerator, denominator), minus 1.
RATIOS = {
    "B_over_A64": ("B_indexed_ascending", "A64_dense_64key_tiles"),
    "A64_over_A_triton": ("A64_dense_64key_tiles", "A_triton_dense"),
    "B_over_A_triton": ("B_indexed_ascending", "A_triton_dense"),
    "B_over_A": ("B_indexed_ascending", "A_dense"),
    "C_over_B": ("C_indexed_ranked", "B_indexed_ascending"),
    "D_over_C": ("D_ranked_with_check", "C_indexed_ranked"),
    "D_over_A": ("D_ranked_with_check", "A_dense"),
    "D1_over_C": ("D1_check_every_tile", "C_indexed_ranked"),
    "D4_over_C": ("D4_check_every_4", "C_indexed_ranked"),
    "D64_over_C": ("D64_check_every_64", "C_indexed_ranked"),
    "GB_over_A": ("GB_indexed_ascending", "A_dense"),
    "GC_over_GB": ("GC_indexed_ranked", "GB_indexed_ascending"),
    "GD_over_GC": ("GD_ranked_with_check", "GC_indexed_ranked"),
    "GD4_over_GC": ("GD4_check_every_4", "GC_indexed_ranked"),
    "GD_over_A": ("GD_ranked_with_check", "A_dense"),
    "GD_over_D": ("GD_ranked_with_check", "D_ranked_with_check"),
}


def overhead(name, w):
    q, k, v = w.make("cuda", 0)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=w.causal)
    (qm, qs), (km, ks) = block_statistics_triton(q, BLOCK_Q), block_statistics_triton(k, BLOCK_K)
    theta = torch.full((shape.heads,), -1.0, device="cuda")  # every block trusted: nothing forced by stage 1
    order = s2o_visit_order(qm, km, qs, ks, shape, is_causal=w.causal, scale=shape.head_dim ** -0.5,
                            simthreshd1=theta, segment=128, attention_sink=False)  # smallest dense window
    ascending = ranked_ascending(order)
    kw = dict(is_causal=w.causal, segment=128)
    fns = {"A_dense": lambda: block_sparse_attention(q, k, v, None, is_causal=w.causal),
           "B_indexed_ascending": lambda: s2o_attention(q, k, v, tau=None, order=ascending, **kw),
           "C_indexed_ranked": lambda: s2o_attention(q, k, v, tau=None, order=order, **kw),
           "D_ranked_with_check": lambda: s2o_attention(q, k, v, tau=0.0, order=order, **kw),
           **{key: (lambda every=every: s2o_attention(q, k, v, tau=0.0, order=order, check_every=every, **kw))
              for key, every in (("D1_check_every_tile", 1), ("D4_check_every_4", 4), ("D64_check_every_64", 64))}}
    walk = {"GB_indexed_ascending": lambda: s2o_attention(q, k, v, tau=None, order=ascending, **kw),
            "GC_indexed_ranked": lambda: s2o_attention(q, k, v, tau=None, order=order, **kw),
            "GD_ranked_with_check": lambda: s2o_attention(q, k, v, tau=0.0, order=order, **kw),
            "GD4_check_every_4": lambda: s2o_attention(q, k, v, tau=0.0, order=order, check_every=4, **kw)}
    t = {"walk_kernel": walk_kernel(q, k, v, w.causal)}
    for _ in range(3):  # interleaved rounds, fastest kept: single medians drift by 2-3% between variants
        t["A_dense"] = min(t.get("A_dense", float("inf")), bench_graph(fns["A_dense"]))
        with triton_walk():
            for key, fn in fns.items():
                if key != "A_dense":
                    t[key] = min(t.get(key, float("inf")), bench_graph(fn))
        for key, fn in walk.items():
            t[key] = min(t.get(key, float("inf")), bench_graph(fn))
        for key, tile in (("A_triton_dense", None), ("A64_dense_64key_tiles", BLOCK_K)):
            with triton_dense_mode(tile):
                t[key] = min(t.get(key, float("inf")), bench_graph(
                    lambda: block_sparse_attention(q, k, v, None, is_causal=w.causal)))
    for name, (numerator, denominator) in RATIOS.items():
        t[name] = t[numerator] / t[denominator] - 1
    # the issue's measure: what the check adds, as a share of the kernel's dense time
    t["D_minus_C_over_A"] = (t["D_ranked_with_check"] - t["C_indexed_ranked"]) / t["A_dense"]
    return t


def timing(name, w):
    q, k, v = w.make("cuda", 0)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=w.causal)
    theta = torch.full((shape.heads,), 0.6, device="cuda")

    def visit_order():  # stage-1 statistics and the visiting order, as s2o_attention builds them
        (qm, qs), (km, ks) = block_statistics_triton(q, BLOCK_Q), block_statistics_triton(k, BLOCK_K)
        return s2o_visit_order(qm, km, qs, ks, shape, is_causal=w.causal, scale=shape.head_dim ** -0.5,
                               simthreshd1=theta, segment=2048, attention_sink=False)

    with triton_walk():
        triton_ms = bench(lambda: s2o_attention(q, k, v, is_causal=w.causal))
    r = {"walk_kernel": walk_kernel(q, k, v, w.causal), "s2o_triton_walk_ms": triton_ms,
         "cudnn_ms": bench(cudnn_attention_fn(q, k, v, w.causal)),
         "topcdf_ms": bench(lambda: sparge_attention(q, k, v, is_causal=w.causal)),
         "s2o_ms": bench(lambda: s2o_attention(q, k, v, is_causal=w.causal)),
         "s2o_order_ms": bench(visit_order), "s2o_order_graph_ms": bench_graph(visit_order)}
    out, st = sparge_attention(q, k, v, is_causal=w.causal, return_sparsity=True)
    r["topcdf_sparsity"], r["topcdf_l1"] = st.sparsity, sampled_errors(out, q, k, v, w.causal)[0]
    out, st = s2o_attention(q, k, v, is_causal=w.causal, return_sparsity=True)
    r["s2o_sparsity"], r["s2o_l1"] = st.sparsity, sampled_errors(out, q, k, v, w.causal)[0]
    r["s2o_vs_cudnn"] = r["cudnn_ms"] / r["s2o_ms"]
    r["s2o_triton_walk_vs_cudnn"] = r["cudnn_ms"] / r["s2o_triton_walk_ms"]
    r["topcdf_vs_cudnn"] = r["cudnn_ms"] / r["topcdf_ms"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="tradeoff,overhead,timing")
    ap.add_argument("--shapes", default=",".join(FULL), help="overhead/timing shapes, e.g. mochi,flux")
    ap.add_argument("--tradeoff", default=",".join(TRADEOFF), help="trade-off workloads, from: "
                    + ", ".join({**FULL, **EXTRA}))
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    results = {"tradeoff": {}, "overhead": {}, "timing": {}}
    partial = (parts != {"tradeoff", "overhead", "timing"} or set(args.shapes.split(",")) != set(FULL)
               or args.tradeoff.split(",") != list(TRADEOFF))
    workloads = {**FULL, **EXTRA}
    if partial and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results.update({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__})
    if "tradeoff" in parts:
        for name in args.tradeoff.split(","):
            results["tradeoff"][name] = tradeoff(name, workloads[name])
            print(name, "tradeoff done", flush=True)
            checkpoint(results, args.out)
    for name in args.shapes.split(","):
        w = workloads[name]
        if "overhead" in parts:
            results["overhead"][name] = overhead(name, w)
        if "timing" in parts:
            results["timing"][name] = timing(name, w)
        print(name, "overhead/timing done", flush=True)
        checkpoint(results, args.out)
    save_report(results, report_table(results), args.out)


def checkpoint(results: dict, out: str | None) -> None:
    """The results so far, written after each shape: a run stopped by a time limit keeps what it measured (a
    later ``--parts``/``--shapes`` run on the same ``--out`` adds the rest)."""
    if out:
        write_json(out, results)


def report_table(results: dict) -> str:
    names = {*results["tradeoff"], *results["overhead"], *results["timing"]}
    table = "FULL" if names <= set(FULL) else "FULL and EXTRA"
    lines = [f"# {results['device']}, torch {results['torch']}; structured inputs (sparge_diffusers.workloads.{table})"]
    for name, r in results["tradeoff"].items():
        lines.append(f"## {name}: sweeps (sparsity / rel. L1 / MSE)")
        for key, rows in r["sweeps"].items():
            param = "cdfthreshd" if key == "topcdf" else "tau"
            lines.append(f"{key:7} " + "  ".join(f"{x[param]}:{x['sparsity']:.3f}/{x['l1']:.4f}/{x['mse']:.2e}"
                                                 for x in rows))
        lines.append(f"{'sparsity':>8} {'S2O L1':>8} {'TopCdf L1':>9} {'ratio':>6} {'S2O MSE':>9} {'TopCdf MSE':>10} "
                     f"{'ratio':>6}")
        for m in r["matched_sparsity"]:
            lines.append(f"{m['sparsity']:8.3f} {m['s2o_l1']:8.4f} {m['topcdf_l1']:9.4f} "
                         f"{m['l1_ratio_topcdf_over_s2o']:6.2f} {m['s2o_mse']:9.2e} {m['topcdf_mse']:10.2e} "
                         f"{m['mse_ratio_topcdf_over_s2o']:6.2f}")
        for m in r["matched_l1"]:
            f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            lines.append(f"at L1 {m['l1']}: sparsity TopCdf {f(m['topcdf_sparsity'])}, S2O {f(m['s2o_sparsity'])}")
    lines.append("## overhead with no skipping (kernel ms from CUDA-graph replays; share over the previous variant;")
    lines.append("## A = dense mode as called, At = the Triton kernel's dense mode, A64 = At in 64-key tiles;")
    lines.append("## B, C, D = the Triton walk)")
    lines.append(f"{'shape':10} {'A dense':>8} {'At':>8} {'A64':>8} {'B idx':>8} {'C ranked':>8} {'D check':>8} "
                 f"{'B/A':>6} {'B/At':>6} {'B/A64':>6} {'C/B':>6} {'D/C':>6} {'D-C/A':>6} {'D/A':>6} {'D1/C':>6} "
                 f"{'D4/C':>6} {'D64/C':>6}")
    nan = float("nan")
    for name, t in results["overhead"].items():
        lines.append(f"{name:10} {t['A_dense']:8.2f} {t.get('A_triton_dense', nan):8.2f} "
                     f"{t['A64_dense_64key_tiles']:8.2f} {t['B_indexed_ascending']:8.2f} {t['C_indexed_ranked']:8.2f} "
                     f"{t['D_ranked_with_check']:8.2f} {t['B_over_A']:+6.1%} {t.get('B_over_A_triton', nan):+6.1%} "
                     f"{t['B_over_A64']:+6.1%} {t['C_over_B']:+6.1%} {t['D_over_C']:+6.1%} "
                     f"{t.get('D_minus_C_over_A', nan):+6.1%} {t['D_over_A']:+6.1%} {t['D1_over_C']:+6.1%} "
                     f"{t['D4_over_C']:+6.1%} {t['D64_over_C']:+6.1%}")
    if any("GD_ranked_with_check" in t for t in results["overhead"].values()):
        lines.append("## the walk as s2o_attention runs it (G; kernel named), same rounds")
        lines.append(f"{'shape':10} {'kernel':>6} {'GB idx':>8} {'GC ranked':>9} {'GD check':>8} {'GB/A':>6} "
                     f"{'GC/GB':>6} {'GD/GC':>6} {'GD4/GC':>6} {'GD/A':>6} {'GD/D':>6}")
        for name, t in results["overhead"].items():
            if "GD_ranked_with_check" in t:
                lines.append(f"{name:10} {t['walk_kernel']:>6} {t['GB_indexed_ascending']:8.2f} "
                             f"{t['GC_indexed_ranked']:9.2f} {t['GD_ranked_with_check']:8.2f} {t['GB_over_A']:+6.1%} "
                             f"{t['GC_over_GB']:+6.1%} {t['GD_over_GC']:+6.1%} {t['GD4_over_GC']:+6.1%} "
                             f"{t['GD_over_A']:+6.1%} {t['GD_over_D']:+6.1%}")
    lines.append("## default settings: TopCdf (0.6, 0.98) vs S2O (tau 0.0005, check every 16) vs cuDNN")
    lines.append(f"{'shape':10} {'cuDNN ms':>8} {'TopCdf ms':>9} {'sp':>5} {'L1':>7} {'x':>5} {'S2O ms':>7} {'sp':>5} "
                 f"{'L1':>7} {'x':>5} {'order ms':>8} {'(graph)':>7} {'Triton walk ms':>14} {'x':>5}")
    nan = float("nan")
    for name, r in results["timing"].items():
        lines.append(f"{name:10} {r['cudnn_ms']:8.2f} {r['topcdf_ms']:9.2f} {r['topcdf_sparsity']:5.3f} "
                     f"{r['topcdf_l1']:7.4f} {r['topcdf_vs_cudnn']:5.2f} {r['s2o_ms']:7.2f} {r['s2o_sparsity']:5.3f} "
                     f"{r['s2o_l1']:7.4f} {r['s2o_vs_cudnn']:5.2f} {r.get('s2o_order_ms', nan):8.3f} "
                     f"{r.get('s2o_order_graph_ms', nan):7.3f} {r.get('s2o_triton_walk_ms', nan):14.2f} "
                     f"{r.get('s2o_triton_walk_vs_cudnn', nan):5.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
