"""Chunked prefill: a chunk of C queries against a KV cache of N keys under the lower-right causal mask
(``causal_variant="lower_right"``), at Llama-3.1-8B's attention shape (32 query heads, 8 K/V heads, D = 128,
bf16), every figure from one run on one GPU.

Per (N, C):
  * dense: our dense mode against SDPA given ``causal_lower_right`` (PyTorch dispatches it to its flash kernel),
    cuDNN SDPA given the (C, N) boolean mask that transformers builds for such a chunk, and compiled
    FlexAttention with the lower-right mask_mod on its own dense block mask;
  * random block masks at densities 0.5 / 0.25 / 0.1 of the visible blocks (diagonal kept): ours given a prebuilt
    CompactBlockMask against FlexAttention given the same blocks, and the speedup over our dense mode against
    the ideal 1 / density;
  * the whole method at default thresholds with the sink block kept (as the LLM attention function runs it) on
    ``llm_like_qkv`` inputs (the chunk = the last C tokens of an N-token
    prompt): sparsity, relative L1 against exact float32 attention on 1024 sampled query rows, time against cuDNN
    and SDPA's lower-right flash; the same for PBS-Attn's key order (``pbs_segment=256``: the chunk's last queries
    rank the cache's keys, which are sorted within segments and gathered every call, then SpargeAttn at the same
    thresholds) and for the LLM function's other methods at their defaults: S2O (tau 0.0005, segment 2048, sink
    kept) and FSA (top_k 16 blocks of 64 keys per query token; its sparsity counts (query, key) pairs).
Times: the fastest of 3 interleaved rounds of medians over CUDA-graph replays (benchmarks/attention.py's timer).

Usage: python benchmarks/chunked_prefill.py [--cases 32768:2048,32768:8192] [--out results.json]
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
from attention import bench_rounds, flex_fn, random_block_mask  # noqa: E402

from sparge_diffusers import (block_sparse_attention, compact_block_mask, s2o_attention,  # noqa: E402
                              select_key_blocks, selected_block_attention, selection_sparsity, sparge_attention)
from sparge_diffusers.kernels._inputs import check_attention_inputs  # noqa: E402
from sparge_diffusers.kernels.stats import dense_block_count  # noqa: E402
from sparge_diffusers.llm import pbs_sparge_attention  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import exact_attention_rows  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DENSITIES = (0.5, 0.25, 0.1)
FSA_TOP_K = 16  # the LLM function's default: 16 blocks of 64 keys per query token
PBS_SEGMENT = 256  # PBS-Attn's segment
LOWER_RIGHT = dict(is_causal=True, causal_variant="lower_right")


def sdpa_lower_right(q, k, v):
    """SDPA with PyTorch's lower-right causal bias (its dispatcher sends it to the flash kernel)."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[2], k.shape[2])
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


def cudnn_with_mask(q, k, v):
    """cuDNN SDPA given the chunk's (C, N) boolean mask, as transformers' SDPA function passes it (K/V heads
    repeated: cuDNN's GQA support varies by version)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    C, N = q.shape[2], k.shape[2]
    mask = torch.ones(C, N, dtype=torch.bool, device=q.device).tril(diagonal=N - C)
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)

    return run


def sampled_chunk_l1(out, q_full, k, v, rows=1024, seed=0):
    """Relative L1 of a chunk's output (its C queries are the last C of ``q_full``) against exact float32
    attention on a sample of its rows."""
    C, N = out.shape[2], k.shape[2]
    g = torch.Generator(device=out.device).manual_seed(seed)
    idx = torch.randperm(C, generator=g, device=out.device)[:rows].sort().values
    exact = exact_attention_rows(q_full, k, v, idx + (N - C), causal=True)
    diff = out[:, :, idx].float() - exact
    return float(diff.abs().sum() / exact.abs().sum())


def run_case(N, C, log):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, HEADS, C, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, KV_HEADS, N, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=True, causal_variant="lower_right")
    fns = {"ours": lambda: block_sparse_attention(q, k, v, None, **LOWER_RIGHT),
           "sdpa_lower_right": sdpa_lower_right(q, k, v)}
    try:
        fns["cudnn_mask"] = cudnn_with_mask(q, k, v)
        fns["cudnn_mask"]()
    except Exception as e:  # report, never hide
        fns.pop("cudnn_mask")
        log(f"  cuDNN with a mask failed: {type(e).__name__}: {str(e)[:200]}")
    full = torch.ones(1, 1, shape.q_blocks, shape.k_blocks, dtype=torch.bool, device="cuda")
    fns["flex"] = flex_fn(q, k, v, full, True, shape)
    fns["flex"]()  # compile outside the timed rounds
    t, spread = bench_rounds(fns)
    ours_dense = t["ours"]
    res = {"N": N, "C": C, "dense": {**{f"{name}_ms": ms for name, ms in t.items()}, "round_spread": spread}}
    out = block_sparse_attention(q, k, v, None, **LOWER_RIGHT)
    ref = fns["sdpa_lower_right"]()
    res["dense"]["relative_l1_vs_sdpa"] = float((out - ref).float().abs().sum() / ref.float().abs().sum())
    log(f"N {N} C {C}: dense ours {ours_dense:.3f} ms, SDPA lower-right {t['sdpa_lower_right']:.3f}, "
        f"cuDNN+mask {t.get('cudnn_mask', float('nan')):.3f}, flex {t['flex']:.3f}")

    res["sparse"] = []
    for density in DENSITIES:
        mask = random_block_mask(1, HEADS, shape.q_blocks, shape.k_blocks, density, True, N, "cuda",
                                 q_len=C, causal_offset=shape.causal_offset)
        compact = compact_block_mask(mask, q, k, **LOWER_RIGHT)
        fns = {"per_call": lambda: block_sparse_attention(q, k, v, mask, **LOWER_RIGHT),
               "prebuilt": lambda: block_sparse_attention(q, k, v, compact, **LOWER_RIGHT),
               "flex": flex_fn(q, k, v, mask, True, shape)}
        fns["flex"]()
        t, spread = bench_rounds(fns)
        actual = float(mask.sum()) / (HEADS * dense_block_count(shape, True))
        res["sparse"].append({"density": density, "actual_density": actual, "ours_ms": t["per_call"],
                              "ours_prebuilt_ms": t["prebuilt"], "flex_ms": t["flex"],
                              "flex_vs_prebuilt": t["flex"] / t["prebuilt"],
                              "prebuilt_speedup_over_ideal": ours_dense / t["prebuilt"] * actual,
                              "per_call_speedup_over_ideal": ours_dense / t["per_call"] * actual,
                              "round_spread": spread})
        log(f"  density {actual:.3f}: prebuilt {t['prebuilt']:.3f} ms, per call {t['per_call']:.3f}, "
            f"flex {t['flex']:.3f}")
    del q, k, v
    torch.cuda.empty_cache()

    qf, k, v = llm_like_qkv(N, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cuda", seed=0)
    q = qf[:, :, N - C:]
    # the LLM attention function's settings (sparge_diffusers.llm: attention_sink=True), thresholds at their defaults
    out, stats = sparge_attention(q, k, v, return_sparsity=True, attention_sink=True, **LOWER_RIGHT)
    l1 = sampled_chunk_l1(out, qf, k, v)
    l1_sdpa = sampled_chunk_l1(sdpa_lower_right(q, k, v)(), qf, k, v)
    s2o_out, s2o_stats = s2o_attention(q, k, v, return_sparsity=True, attention_sink=True, **LOWER_RIGHT)
    pbs_out, pbs_stats = pbs_sparge_attention(q, k, v, segment=PBS_SEGMENT, return_sparsity=True,
                                              attention_sink=True, causal_variant="lower_right")

    def fsa():
        selection = select_key_blocks(q, k, top_k=FSA_TOP_K, **LOWER_RIGHT)
        return selected_block_attention(q, k, v, selection, validate=False, **LOWER_RIGHT), selection

    fsa_out, selection = fsa()
    fsa_stats = selection_sparsity(selection, heads=HEADS, kv_len=N, **LOWER_RIGHT)
    fns = {"whole": lambda: sparge_attention(q, k, v, attention_sink=True, **LOWER_RIGHT),
           "pbs": lambda: pbs_sparge_attention(q, k, v, segment=PBS_SEGMENT, attention_sink=True,
                                               causal_variant="lower_right"),
           "s2o": lambda: s2o_attention(q, k, v, attention_sink=True, **LOWER_RIGHT),
           "fsa": lambda: fsa()[0],
           "sdpa_lower_right": sdpa_lower_right(q, k, v)}
    if "cudnn_mask_ms" in res["dense"]:
        fns["cudnn_mask"] = cudnn_with_mask(q, k, v)
    t, spread = bench_rounds(fns)
    res["structured_default"] = {"sparsity": stats.sparsity, "relative_l1": l1, "relative_l1_sdpa_bf16": l1_sdpa,
                                 **{f"{name}_ms": ms for name, ms in t.items()}, "round_spread": spread,
                                 "pbs": {"sparsity": pbs_stats.sparsity, "ms": t["pbs"], "segment": PBS_SEGMENT,
                                         "relative_l1": sampled_chunk_l1(pbs_out, qf, k, v)},
                                 "s2o": {"sparsity": s2o_stats.sparsity, "ms": t["s2o"],
                                         "relative_l1": sampled_chunk_l1(s2o_out, qf, k, v)},
                                 "fsa": {"sparsity": fsa_stats.sparsity, "ms": t["fsa"], "top_k": FSA_TOP_K,
                                         "relative_l1": sampled_chunk_l1(fsa_out, qf, k, v)}}
    log(f"  structured: sparsity {stats.sparsity:.3f}, L1 {l1:.4f}, {t['whole']:.3f} ms; pbs {t['pbs']:.3f} ms, "
        f"s2o {t['s2o']:.3f} ms, fsa {t['fsa']:.3f} ms")
    del qf, q, k, v, out
    torch.cuda.empty_cache()
    return res


def table(results) -> str:
    lines = [f"GPU: {results['gpu']}  (torch {results['torch']}, triton {results['triton']}); bf16; "
             f"{HEADS} q heads, {KV_HEADS} K/V heads, D {HEAD_DIM}; {results['date']}; ms, fastest of 3 rounds of "
             "CUDA-graph medians",
             "dense: C queries against N keys, lower-right causal",
             f"{'N':>6} {'C':>6} {'ours':>8} {'SDPA-LR':>8} {'cuDNN+m':>8} {'flex':>8} {'SDPA/ours':>9} "
             f"{'cuDNN/ours':>10} {'flex/ours':>9}"]
    for r in results["cases"]:
        d = r["dense"]
        cu = d.get("cudnn_mask_ms", float("nan"))
        lines.append(f"{r['N']:6} {r['C']:6} {d['ours_ms']:8.3f} {d['sdpa_lower_right_ms']:8.3f} {cu:8.3f} "
                     f"{d['flex_ms']:8.3f} {d['sdpa_lower_right_ms'] / d['ours_ms']:9.2f} {cu / d['ours_ms']:10.2f} "
                     f"{d['flex_ms'] / d['ours_ms']:9.2f}")
    lines += ["(SDPA-LR: SDPA with causal_lower_right, PyTorch's flash kernel; cuDNN+m: cuDNN SDPA given the (C, N) "
              "bool mask; flex: FlexAttention's lower-right mask_mod)",
              "random block masks, ours prebuilt vs FlexAttention given the same blocks",
              f"{'N':>6} {'C':>6} {'density':>7} {'pre ms':>8} {'call ms':>8} {'flex ms':>8} {'flex/pre':>8} "
              f"{'pre x/id':>8} {'call x/id':>9}"]
    for r in results["cases"]:
        for s in r["sparse"]:
            lines.append(f"{r['N']:6} {r['C']:6} {s['actual_density']:7.3f} {s['ours_prebuilt_ms']:8.3f} "
                         f"{s['ours_ms']:8.3f} {s['flex_ms']:8.3f} {s['flex_vs_prebuilt']:8.2f} "
                         f"{s['prebuilt_speedup_over_ideal']:8.2f} {s['per_call_speedup_over_ideal']:9.2f}")
    lines += ["whole method at default thresholds, attention_sink=True, llm_like_qkv (chunk = the last C of N tokens)",
              f"{'N':>6} {'C':>6} {'sparsity':>8} {'rel L1':>8} {'L1 SDPA':>8} {'ms':>8} {'SDPA-LR':>8} "
              f"{'cuDNN+m':>8} {'x SDPA':>7} {'x cuDNN':>7}"]
    for r in results["cases"]:
        s = r["structured_default"]
        cu = s.get("cudnn_mask_ms", float("nan"))
        lines.append(f"{r['N']:6} {r['C']:6} {s['sparsity']:8.3f} {s['relative_l1']:8.4f} "
                     f"{s['relative_l1_sdpa_bf16']:8.4f} {s['whole_ms']:8.3f} {s['sdpa_lower_right_ms']:8.3f} "
                     f"{cu:8.3f} {s['sdpa_lower_right_ms'] / s['whole_ms']:7.2f} {cu / s['whole_ms']:7.2f}")
    if all("s2o" in r["structured_default"] for r in results["cases"]):
        lines += ["the LLM function's other methods on the same chunks, defaults (pbs: SpargeAttn on keys in PBS's "
                  "order; FSA's sparsity: (query, key) pairs)",
                  f"{'N':>6} {'C':>6} {'method':>6} {'sparsity':>8} {'rel L1':>8} {'ms':>8} {'x SDPA':>7} "
                  f"{'x sparge':>8}"]
        for r in results["cases"]:
            s = r["structured_default"]
            for name in (m for m in ("pbs", "s2o", "fsa") if m in s):  # pbs: results since session 33
                m = s[name]
                lines.append(f"{r['N']:6} {r['C']:6} {name:>6} {m['sparsity']:8.3f} {m['relative_l1']:8.4f} "
                             f"{m['ms']:8.3f} {s['sdpa_lower_right_ms'] / m['ms']:7.2f} {s['whole_ms'] / m['ms']:8.2f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="32768:2048,32768:8192", help="N:C pairs (keys : chunk queries)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/chunked_prefill.py needs a CUDA GPU")
    import triton

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "cases": []}
    for case in args.cases.split(","):
        N, C = map(int, case.split(":"))
        results["cases"].append(run_case(N, C, lambda m: print(m, flush=True)))
    save_report(results, table(results), args.out)


if __name__ == "__main__":
    main()
