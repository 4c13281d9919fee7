"""Time stage 1 (predict_block_mask) as a whole and launch by launch, with the launch settings it picks and
their neighbours, on the structured inputs of ``sparge_diffusers.workloads.FULL``.

Parts: ``api`` = predict_block_mask (input checks, allocations, the Hopper kernel's tail schedule included);
``separate`` = the same work as four launches (Q statistics, K statistics, scores, TopCdf), with no tail schedule;
``stats_qk`` = the block means and self-similarities of Q (128-row blocks) and K (64-row blocks) in one launch,
as stage 1 makes it, ``stats_q`` / ``stats_k`` = each alone; ``scores`` = the compressed scores; ``topcdf`` =
TopCdf, the forced rows and columns and the compacted walk. Each with ``@w<warps>`` or ``@r<rows>w<warps>`` is
the same launch with other settings (the defaults carry a ``*``). Timing as in benchmarks/attention.py: medians
over CUDA-graph replays, fastest of 3 interleaved rounds.

Usage: python benchmarks/predict_breakdown.py [--shapes flux,mochi]
       [--out benchmarks/results/predict-breakdown-H100.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402
import attention  # noqa: E402

from sparge_diffusers import predict_block_mask  # noqa: E402
from sparge_diffusers.kernels import predict as P  # noqa: E402
from sparge_diffusers.kernels._inputs import BLOCK_K, BLOCK_Q, check_attention_inputs, resolve_scale  # noqa: E402
from sparge_diffusers.workloads import FULL  # noqa: E402

STATS_WARPS = (2, 4)  # around predict.STATS_NUM_WARPS
TOPCDF_SETTINGS = ((1, 4), (2, 4), (4, 4), (4, 8))  # (rows, warps) around the defaults
# each part takes 0.005-0.2 ms, so a 20 ms graph still holds 100+ calls; with attention.py's 100 ms graphs the
# first H100 run did not finish one shape's 45 timings in 150 s
GRAPH_REP_MS = 20


def stage_one_inputs(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """(shape, scale, Q's block means and similarities, K's, the compressed scores, TopCdf's keyword arguments at
    the default thresholds): what each of stage 1's launchers takes, made once by the launchers before it."""
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=causal)
    scale = resolve_scale(None, shape.head_dim)
    theta = torch.full((shape.heads,), 0.6, device=q.device)
    tau = torch.full((shape.heads,), 0.98, device=q.device)
    q_stats, k_stats = P.qk_block_statistics_triton(q, k)
    scores = P.compressed_scores_triton(q_stats[0], k_stats[0], shape, scale)
    topcdf = dict(is_causal=causal, simthreshd1=theta, cdfthreshd=tau, attention_sink=False)
    return shape, scale, q_stats, k_stats, scores, topcdf


def stage_one_parts(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple[dict, list[str]]:
    """The callables to time, and the names of the launches stage 1 makes (its default settings), in order."""
    shape, scale, (q_means, q_sim), (k_means, k_sim), scores, topcdf = stage_one_inputs(q, k, causal)

    def separate():
        (qm, qs), (km, ks) = P.block_statistics_triton(q, BLOCK_Q), P.block_statistics_triton(k, BLOCK_K)
        return P.topcdf_block_mask_triton(P.compressed_scores_triton(qm, km, shape, scale), qs, ks, shape,
                                          **topcdf)

    parts = {"api": lambda: predict_block_mask(q, k, is_causal=causal), "separate": separate}
    for w in STATS_WARPS:
        parts[f"stats_qk@w{w}"] = lambda w=w: P.qk_block_statistics_triton(q, k, num_warps=w)
        parts[f"stats_q@w{w}"] = lambda w=w: P.block_statistics_triton(q, BLOCK_Q, num_warps=w)
        parts[f"stats_k@w{w}"] = lambda w=w: P.block_statistics_triton(k, BLOCK_K, num_warps=w)
    parts["scores"] = lambda: P.compressed_scores_triton(q_means, k_means, shape, scale)
    nk_pad = P.topcdf_width(shape.k_blocks)
    for rows, warps in TOPCDF_SETTINGS:
        if rows * nk_pad > 8192:  # one program's scores would not fit in registers
            continue
        parts[f"topcdf@r{rows}w{warps}"] = lambda rows=rows, warps=warps: P.topcdf_block_mask_triton(
            scores, q_sim, k_sim, shape, rows=rows, num_warps=warps, **topcdf)
    return parts, [f"stats_qk@w{P.STATS_NUM_WARPS}", "scores",
                   f"topcdf@r{P.topcdf_rows(shape.k_blocks)}w{P.TOPCDF_NUM_WARPS}"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(FULL))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); ms, fastest of 3 rounds of CUDA-graph medians; "
             f"* = the setting stage 1 uses"]
    for name in args.shapes.split(","):
        first = len(lines)
        w = FULL[name]
        q, k, _ = w.make("cuda")
        parts, used = stage_one_parts(q, k, w.causal)
        best, spread = attention.bench_rounds(parts, graph_rep_ms=GRAPH_REP_MS)
        chosen = best["api"]
        results["shapes"][name] = {"ms": best, "spread": spread, "used": used}
        lines.append(f"{name}: api {chosen:.4f} ms (four separate launches {best['separate']:.4f}); launches as "
                     "used: " + ", ".join(f"{part} {best[part]:.4f}" for part in used))
        for part, ms in best.items():
            mark = "*" if part in used else " "
            lines.append(f"  {part:22}{mark} {ms:8.4f}  (spread {100 * spread[part]:.1f}%)")
        print("\n".join(lines[first:]), flush=True)  # progress: the report at the end prints them again
    results["graph_fallbacks"] = attention.GRAPH_FALLBACKS
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
