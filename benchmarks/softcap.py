"""Logit soft-capping (``softcap=c``: scores c * tanh(s / c), Gemma 2's ``attn_logit_softcapping``) at Gemma-2-27B's
head shape (32 query heads, 16 K/V heads, D = 128, bf16, one sequence, c = 50), every figure from one run on one GPU.

Per (length, window; window 0 = full causal, Gemma 2's other layers use 4096):
  * ours, every block, without and with the cap (what the cap costs the kernel);
  * ours, the whole method at default thresholds with the cap (stage 1's compressed scores capped too), on the
    LLM-like structured inputs (``sparge_diffusers.testing.llm_like_qkv``);
  * compiled FlexAttention with the cap as its score_mod under the causal (sliding) block mask;
  * cuDNN SDPA, plain causal without the cap or window (no SDPA backend takes a cap): for scale only.
Relative L1 against float32 attention with the cap on 1024 sampled query rows. Times: kernel ms from CUDA-graph
replays (median), fastest of 3 interleaved rounds.

Usage: python benchmarks/softcap.py [--cases 8192:0,8192:4096,32768:0] [--out results.json]
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import cases_arguments, exact_causal_rows, fastest_graph_ms, sampled_rows, save_report  # noqa: E402

from sparge_diffusers import block_sparse_attention, relative_l1, sparge_attention  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import cudnn_attention_fn  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CAP = 32, 16, 128, 50.0


def main(argv=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    args = cases_arguments(__doc__, "8192:0,8192:4096,32768:0", argv)
    flex = torch.compile(flex_attention)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "cap": CAP, "cases": []}
    lines = [f"{results['gpu']}, {HEADS} q heads / {KV_HEADS} kv heads, D = {HEAD_DIM}, bf16, cap {CAP:g}; kernel ms "
             f"(window 0: full causal)",
             f"{'N':>6} {'window':>6} {'cuDNN*':>8} {'ours all':>9} {'all+cap':>9} {'def+cap':>9} {'Flex+cap':>9} "
             f"{'cap cost':>9} {'flex/all+cap':>12} {'flex/def+cap':>12} {'L1 all+cap':>10} {'L1 def+cap':>10} "
             f"{'L1 Flex':>8}"]
    for case in args.cases.split(","):
        n, window = (int(x) for x in case.split(":"))
        win = window or None
        q, k, v = llm_like_qkv(n, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cuda", seed=n)

        def visible(b, h, q_idx, kv_idx):
            if window:
                return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
            return kv_idx <= q_idx

        def capped(score, b, h, q_idx, kv_idx):
            return CAP * torch.tanh(score / CAP)

        block_mask = create_block_mask(visible, None, None, n, n, device="cuda")
        calls = {
            "cudnn_causal_no_cap": cudnn_attention_fn(q, k, v, causal=True),
            "ours_all": lambda: block_sparse_attention(q, k, v, None, is_causal=True, sliding_window=win),
            "ours_all_cap": lambda: block_sparse_attention(q, k, v, None, is_causal=True, sliding_window=win,
                                                           softcap=CAP),
            "ours_default_cap": lambda: sparge_attention(q, k, v, is_causal=True, sliding_window=win, softcap=CAP),
            "flex_cap": lambda: flex(q, k, v, score_mod=capped, block_mask=block_mask, enable_gqa=True),
        }
        times = fastest_graph_ms(calls)
        rows = sampled_rows(n)
        ref = exact_causal_rows(q, k, v, rows, window=window, softcap=CAP)
        l1 = {name: relative_l1(calls[name]()[:, :, rows].float(), ref)
              for name in ("ours_all_cap", "ours_default_cap", "flex_cap")}
        entry = {"n": n, "window": window, "ms": times, "relative_l1": l1,
                 "ratios": {"cap_cost": times["ours_all_cap"] / times["ours_all"] - 1,
                            "flex_over_ours_all_cap": times["flex_cap"] / times["ours_all_cap"],
                            "flex_over_ours_default_cap": times["flex_cap"] / times["ours_default_cap"]}}
        results["cases"].append(entry)
        r = entry["ratios"]
        lines.append(f"{n:>6} {window:>6} {times['cudnn_causal_no_cap']:>8.3f} {times['ours_all']:>9.3f} "
                     f"{times['ours_all_cap']:>9.3f} {times['ours_default_cap']:>9.3f} {times['flex_cap']:>9.3f} "
                     f"{100 * r['cap_cost']:>+8.1f}% {r['flex_over_ours_all_cap']:>12.2f} "
                     f"{r['flex_over_ours_default_cap']:>12.2f} {l1['ours_all_cap']:>10.4f} "
                     f"{l1['ours_default_cap']:>10.4f} {l1['flex_cap']:>8.4f}")
        torch.cuda.empty_cache()
    lines.append("(cuDNN*: plain causal SDPA without the cap or window, for scale; L1 against float32 attention with "
                 "the cap on 1024 sampled rows)")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
