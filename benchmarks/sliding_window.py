"""Causal attention with a sliding window (Mistral's 4096 keys, Gemma 3's local layers' 1024) at Llama-3.1-8B's
head shape (32 query heads, 8 K/V heads, D = 128, bf16, one sequence; ``--heads 16:8:256`` for Gemma-3-12B's), every
figure from one run on one GPU.

Per (length, window):
  * SDPA under transformers' boolean sliding mask (PyTorch's default dispatch): what sparge_diffusers.llm handed
    such layers before session 51, and what transformers' SDPA path runs;
  * cuDNN SDPA, plain causal (no window): what the whole causal attention costs, for scale;
  * compiled FlexAttention with the sliding window as its mask_mod (its BlockMask built once, outside the timing);
  * ours, every block in the window (``block_sparse_attention(..., None, sliding_window=W)``);
  * ours, the whole method at default thresholds (``sparge_attention(..., sliding_window=W)``) on the LLM-like
    structured inputs (``sparge_diffusers.testing.llm_like_qkv``: local window, mild sink and stripes), with its
    sparsity against the blocks the window leaves.
Every method runs on the same inputs; relative L1 against float32 attention under the window on 1024 sampled query
rows. Times: kernel ms from CUDA-graph replays (median), fastest of 3 interleaved rounds.

Usage: python benchmarks/sliding_window.py [--cases 32768:4096,32768:1024,8192:1024] [--heads 32:8:128]
                                          [--out results.json]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import cases_arguments, exact_causal_rows, fastest_graph_ms, sampled_rows, save_report  # noqa: E402

from sparge_diffusers import block_sparse_attention, relative_l1, sparge_attention  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import cudnn_attention_fn  # noqa: E402


def main(argv=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    args = cases_arguments(__doc__, "32768:4096,32768:1024,8192:1024", argv, default_heads="32:8:128")
    heads, kv_heads, head_dim = args.heads
    # at D = 256 Flex's other settings took 1.2-5.4x longer than 8 warps and 2 stages (kernel-variants-H100.txt (pp)):
    # the setting of benchmarks/attention.py's flex_fn there
    flex_options = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2} if head_dim > 128 else None
    flex = torch.compile(flex_attention)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "cases": []}
    lines = [f"{results['gpu']}, {heads} q heads / {kv_heads} kv heads, D = {head_dim}, bf16; ms (ratio = that "
             f"method's ms / ours)",
             f"{'N':>6} {'window':>6} {'SDPA+mask':>10} {'cuDNN causal':>12} {'Flex':>8} {'ours all':>9} "
             f"{'ours def':>9} {'mask/all':>9} {'flex/all':>9} {'flex/def':>9} {'sparsity':>9} {'L1 all':>8} "
             f"{'L1 def':>8} {'L1 flex':>8}"]
    for case in args.cases.split(","):
        n, window = (int(x) for x in case.split(":"))
        q, k, v = llm_like_qkv(n, heads=heads, kv_heads=kv_heads, head_dim=head_dim, device="cuda", seed=n + window)
        keys = torch.arange(n, device="cuda")
        mask = (keys[None, :] <= keys[:, None]) & (keys[None, :] > keys[:, None] - window)  # (N, N) bool

        def sliding(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

        block_mask = create_block_mask(sliding, None, None, n, n, device="cuda")
        # K/V repeated to the query heads, as transformers' SDPA path does under a mask
        kx, vx = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))

        calls = {
            "sdpa_mask": lambda: F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask),
            "cudnn_causal": cudnn_attention_fn(q, k, v, causal=True),
            "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=flex_options),
            "ours_all": lambda: block_sparse_attention(q, k, v, None, is_causal=True, sliding_window=window),
            "ours_default": lambda: sparge_attention(q, k, v, is_causal=True, sliding_window=window),
        }
        times = fastest_graph_ms(calls)
        rows = sampled_rows(n)
        ref = exact_causal_rows(q, k, v, rows, window=window)
        _, stats = sparge_attention(q, k, v, is_causal=True, sliding_window=window, return_sparsity=True)
        l1 = {name: relative_l1(calls[name]()[:, :, rows].float(), ref)
              for name in ("ours_all", "ours_default", "flex")}
        entry = {"n": n, "window": window, "ms": times, "sparsity": stats.sparsity, "relative_l1": l1,
                 "dense_blocks": stats.dense_blocks,
                 "ratios": {"sdpa_mask_over_ours_all": times["sdpa_mask"] / times["ours_all"],
                            "flex_over_ours_all": times["flex"] / times["ours_all"],
                            "flex_over_ours_default": times["flex"] / times["ours_default"],
                            "cudnn_causal_over_ours_all": times["cudnn_causal"] / times["ours_all"]}}
        results["cases"].append(entry)
        r = entry["ratios"]
        lines.append(f"{n:>6} {window:>6} {times['sdpa_mask']:>10.3f} {times['cudnn_causal']:>12.3f} "
                     f"{times['flex']:>8.3f} {times['ours_all']:>9.3f} {times['ours_default']:>9.3f} "
                     f"{r['sdpa_mask_over_ours_all']:>9.2f} {r['flex_over_ours_all']:>9.2f} "
                     f"{r['flex_over_ours_default']:>9.2f} {stats.sparsity:>9.3f} {l1['ours_all']:>8.4f} "
                     f"{l1['ours_default']:>8.4f} {l1['flex']:>8.4f}")
        del mask, block_mask, kx, vx
        torch.cuda.empty_cache()
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
