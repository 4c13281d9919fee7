"""Llama 4's chunked attention (its local layers: causal attention restarted every ``attention_chunk_size`` = 8192
positions) at Llama-4-Scout's head shape (40 query heads, 8 K/V heads, D = 128, bf16, one sequence), through the
transformers attention function (``sparge_diffusers.llm.SpargeLLMAttention``) as a model's layer calls it: with
transformers' boolean chunked mask, which the function reads once per mask tensor (once per forward) and runs as
one causal call per chunk. Every figure from one run on one GPU.

Per (length, chunk):
  * SDPA under the boolean mask (PyTorch's default dispatch, K/V repeated to the query heads): what transformers'
    SDPA path runs, and what the function handed such layers before;
  * cuDNN SDPA, causal, one call per chunk (the dense computation the mask asks for, split by hand);
  * compiled FlexAttention with the chunked causal mask_mod (its BlockMask built once, outside the timing);
  * ours, every block of each chunk (cdfthreshd = 1: no stage 1) and at default thresholds, on the LLM-like
    structured inputs (``sparge_diffusers.testing.llm_like_qkv``), with the mask already read;
  * the mask's reading alone (:func:`sparge_diffusers.llm.read_causal_mask`), which a forward pays once.
Relative L1 against float32 chunked attention on 1024 sampled query rows. Times: kernel ms from CUDA-graph replays
(median), fastest of 3 interleaved rounds.

``--segments`` (wall ms, host time included, as a model's forward pays it): N = 8192 as packed sequences of 3/4 S
and 5/4 S tokens in turn (unequal, so one call each), SDPA under the mask against the function's one call per
sequence: where the per-call host work outweighs what a call saves (``SpargeLLMAttention.min_segment_queries``).

Usage: python benchmarks/chunked_attention.py [--cases 32768:8192,20000:8192] [--segments 512,1024,1536,2048,3072]
       [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import exact_causal_rows, fastest_graph_ms, sampled_rows, save_report, timed  # noqa: E402

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.llm import SpargeLLMAttention, read_causal_mask  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import cudnn_attention_fn  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 40, 8, 128
MODULE = types.SimpleNamespace(is_causal=True)  # what the function reads off a transformers attention module


def chunked_mask(n: int, chunk: int) -> torch.Tensor:
    """transformers' (1, 1, N, N) boolean mask of a chunked-attention layer (True = attend)."""
    keys = torch.arange(n, device="cuda")
    return ((keys[None, :] <= keys[:, None]) & (keys[None, :] // chunk == keys[:, None] // chunk))[None, None]


def function_call(attention: SpargeLLMAttention, q, k, v, mask):
    """The attention function as a layer calls it: (B, N, H, D) out."""
    return lambda: attention(MODULE, q, k, v, mask)[0]


def case_row(n: int, chunk: int, flex) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = llm_like_qkv(n, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cuda", seed=n + chunk)
    mask = chunked_mask(n, chunk)
    block_mask = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (ki // chunk == qi // chunk), None, None, n, n,
                                   device="cuda")
    kx, vx = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    every = SpargeLLMAttention(cdfthreshd=1.0, pvthreshd=None, strict=True)
    default = SpargeLLMAttention(strict=True)
    cudnn = [cudnn_attention_fn(q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], causal=True)
             for s in range(0, n, chunk)]
    calls = {
        "sdpa_mask": lambda: F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask),
        "cudnn_chunks": lambda: [run() for run in cudnn],
        "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True),
        "ours_all": function_call(every, q, k, v, mask),
        "ours_default": function_call(default, q, k, v, mask),
    }
    for fn in (calls["ours_all"], calls["ours_default"]):
        fn()  # the mask's one reading, outside the graphs (it reads back)
    read_ms = min(timed(lambda: read_causal_mask(mask, n, n)) for _ in range(3))
    times = fastest_graph_ms(calls)
    rows = sampled_rows(n)
    ref = exact_causal_rows(q, k, v, rows, chunk=chunk)
    l1 = {name: relative_l1(calls[name]()[:, rows].transpose(1, 2).float(), ref)  # (B, N, H, D) outputs
          for name in ("ours_all", "ours_default")}
    l1.update({name: relative_l1(calls[name]()[:, :, rows].float(), ref) for name in ("flex", "sdpa_mask")})
    counted = SpargeLLMAttention(strict=True, collect_stats=True)  # the same calls, their statistics kept
    counted(MODULE, q, k, v, mask)
    sparsity = counted.stats[-1].sparsity
    assert every.sparse_calls > 0 and default.sparse_calls > 0
    return {"n": n, "chunk": chunk, "ms": times, "mask_read_wall_ms": read_ms, "sparsity": sparsity,
            "relative_l1": l1,
            "ratios": {"sdpa_mask_over_ours_all": times["sdpa_mask"] / times["ours_all"],
                       "sdpa_mask_over_ours_default": times["sdpa_mask"] / times["ours_default"],
                       "cudnn_chunks_over_ours_all": times["cudnn_chunks"] / times["ours_all"],
                       "cudnn_chunks_over_ours_default": times["cudnn_chunks"] / times["ours_default"],
                       "flex_over_ours_all": times["flex"] / times["ours_all"],
                       "flex_over_ours_default": times["flex"] / times["ours_default"]}}


def packed_mask(n: int, segment: int) -> tuple[torch.Tensor, int]:
    """The (1, 1, N, N) boolean mask of sequences packed in one row, of 3/4 and 5/4 ``segment`` tokens in turn
    (unequal, so that each is a call of its own), and the number of sequences."""
    starts, start, i = [], 0, 0
    while start < n:
        starts.append(start)
        start += segment * 3 // 4 if i % 2 == 0 else segment * 5 // 4
        i += 1
    keys = torch.arange(n, device="cuda")
    sequence = torch.bucketize(keys, torch.tensor(starts[1:], device="cuda"), right=True)
    return ((keys[None, :] <= keys[:, None]) & (sequence[None, :] == sequence[:, None]))[None, None], len(starts)


def segment_row(n: int, segment: int) -> dict:
    """Wall ms of one call at N = n with the queries in packed sequences averaging ``segment`` tokens."""
    q, k, v = llm_like_qkv(n, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cuda", seed=segment)
    mask, sequences = packed_mask(n, segment)
    kx, vx = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    ours = SpargeLLMAttention(strict=True, min_segment_queries=0)
    calls = {"sdpa_mask": lambda: F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask),
             "ours_default": function_call(ours, q, k, v, mask)}
    calls["ours_default"]()  # the mask read once, as a forward's first layer does
    ms = {name: min(timed(fn, reps=9) for _ in range(3)) for name, fn in calls.items()}
    return {"n": n, "segment": segment, "calls": sequences, "wall_ms": ms,
            "sdpa_mask_over_ours": ms["sdpa_mask"] / ms["ours_default"]}


def main(argv=None):
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="32768:8192,20000:8192")
    ap.add_argument("--segments", default="512,1024,1536,2048,3072")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    flex = torch.compile(flex_attention)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "cases": [], "segments": []}
    lines = [f"{results['gpu']}, {HEADS} q heads / {KV_HEADS} kv heads, D = {HEAD_DIM}, bf16; kernel ms (ratio = "
             f"that method's ms / ours)",
             f"{'N':>6} {'chunk':>5} {'SDPA+mask':>10} {'cuDNN/chunk':>11} {'Flex':>8} {'ours all':>9} "
             f"{'ours def':>9} {'mask/def':>9} {'cuDNN/all':>9} {'cuDNN/def':>9} {'flex/all':>9} {'flex/def':>9} "
             f"{'sparsity':>9} {'L1 all':>7} {'L1 def':>7} {'L1 flex':>7} {'read ms':>8}"]
    for case in filter(None, args.cases.split(",")):
        n, chunk = (int(x) for x in case.split(":"))
        e = case_row(n, chunk, flex)
        results["cases"].append(e)
        t, r, l1 = e["ms"], e["ratios"], e["relative_l1"]
        lines.append(f"{n:>6} {chunk:>5} {t['sdpa_mask']:>10.3f} {t['cudnn_chunks']:>11.3f} {t['flex']:>8.3f} "
                     f"{t['ours_all']:>9.3f} {t['ours_default']:>9.3f} {r['sdpa_mask_over_ours_default']:>9.2f} "
                     f"{r['cudnn_chunks_over_ours_all']:>9.2f} {r['cudnn_chunks_over_ours_default']:>9.2f} "
                     f"{r['flex_over_ours_all']:>9.2f} {r['flex_over_ours_default']:>9.2f} {e['sparsity']:>9.3f} "
                     f"{l1['ours_all']:>7.4f} {l1['ours_default']:>7.4f} {l1['flex']:>7.4f} "
                     f"{e['mask_read_wall_ms']:>8.3f}")
        torch.cuda.empty_cache()
    if args.segments:
        lines.append("N = 8192 in packed sequences averaging S tokens, wall ms (host time included), default "
                     "thresholds")
        lines.append(f"{'S':>6} {'calls':>5} {'SDPA+mask':>10} {'ours':>8} {'SDPA/ours':>9}")
    for segment in (int(s) for s in filter(None, args.segments.split(","))):
        e = segment_row(8192, segment)
        results["segments"].append(e)
        lines.append(f"{segment:>6} {e['calls']:>5} {e['wall_ms']['sdpa_mask']:>10.3f} "
                     f"{e['wall_ms']['ours_default']:>8.3f} {e['sdpa_mask_over_ours']:>9.2f}")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
