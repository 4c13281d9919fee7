"""What SpargeLLMAttention's SDPA fallback pays for its contiguous K/V copy (one run on one GPU).

Under an explicit mask, with more than one query and one K/V head for several query heads, transformers' SDPA
function hands SDPA K/V views of head stride 0, which torch 2.11's memory-efficient kernel misreads at some shapes
(pytorch/pytorch#191937); the fallback (``sparge_diffusers.llm._sdpa_function``) hands it contiguous copies instead.
This script times both on the calls that take that branch: left-padded batches of two prompts below
``min_padded_tokens`` (which the fallback answers) with the heads of one-K/V-head models, and the misread case itself
(65 queries on 185 keys under a window). Each case runs under PyTorch's default dispatch and with cuDNN's SDPA kernel
turned off (then the memory-efficient kernel runs the masked call). Per case and dispatch:

- views: transformers' ``sdpa_attention_forward`` (what ``attn_implementation="sdpa"`` runs);
- copy: our fallback on the same call;
- Flex: compiled FlexAttention with the same causal and padding mask (``enable_gqa``, block mask built outside the
  timing), for scale;
- wall ms per eager call (synchronised after each, host time included: the fallback runs eagerly), median of 20
  after 5 warm-up calls, fastest of 3 interleaved rounds; kernel ms from CUDA-graph replays (fastest of 3 rounds);
- relative L1 of views and copy against float32 attention under the mask on up to 512 sampled real query rows.

Usage: python benchmarks/sdpa_fallback.py [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import fastest_graph_ms, save_report, timed  # noqa: E402

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.llm import _sdpa_function  # noqa: E402

# (name, batch, query heads, head dim, queries, keys, window): one K/V head; window 0 = causal with left padding
CASES = (("Gemma-3-1B 2x1024", 2, 4, 256, 1024, 1024, 0), ("Gemma-3-1B 2x4000", 2, 4, 256, 4000, 4000, 0),
         ("Gemma-2B 2x1024", 2, 8, 256, 1024, 1024, 0), ("Gemma-2B 2x4000", 2, 8, 256, 4000, 4000, 0),
         ("Falcon-7B 2x1024", 2, 71, 64, 1024, 1024, 0), ("Falcon-7B 2x4000", 2, 71, 64, 4000, 4000, 0),
         ("misread 65 on 185", 1, 2, 64, 65, 185, 50))


def fallback_call(batch: int, heads: int, head_dim: int, queries: int, keys: int, window: int, device,
                  generator: torch.Generator):
    """(module, q, k, v, mask, real): one K/V head for ``heads`` query heads, bf16, and transformers' boolean
    (B, 1, Nq, Nkv) mask. window 0: causal, prompt b left-padded by b * keys // 8 positions; otherwise every query
    (at the last positions) sees the ``window`` keys up to its own. ``real``: (B, Nq), the query rows that see a key."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads
    q = torch.randn(batch, heads, queries, head_dim, device=device, generator=generator).bfloat16()
    k, v = (torch.randn(batch, 1, keys, head_dim, device=device, generator=generator).bfloat16() for _ in range(2))
    positions = torch.arange(keys - queries, keys, device=device)[:, None]
    key_index = torch.arange(keys, device=device)[None, :]
    allowed = key_index <= positions
    if window:
        allowed = allowed & (key_index > positions - window)
    padding = torch.arange(batch, device=device) * (0 if window else keys // 8)
    mask = allowed[None, None] & (key_index[None] >= padding[:, None, None])[:, None]
    return module, q, k, v, mask, mask[:, 0].any(-1)


def exact_rows(q, k, v, mask, real, count: int = 512, seed: int = 0):
    """float32 attention under ``mask`` for up to ``count`` sampled real query rows: ((B, H, R, D) output, rows)."""
    candidates = real.all(0).nonzero().flatten()  # rows real in every prompt, so one row set serves the batch
    order = torch.randperm(candidates.numel(), generator=torch.Generator().manual_seed(seed)).to(candidates.device)
    rows = candidates[order[:count]].sort().values
    scores = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, :, rows], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float(), rows


def variants(module, q, k, v, mask) -> dict:
    """The two answers to the call, each returning (B, Nq, H, D): transformers' function and our fallback."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return {"views": lambda: sdpa_attention_forward(module, q, k, v, mask, is_causal=None)[0],
            "copy": lambda: _sdpa_function(module, q, k, v, mask, 0.0, None, None, {})[0]}


def dispatch(name: str):
    """A context for one dispatch setting: "default" (PyTorch chooses) or "no_cudnn" (cuDNN's SDPA kernel off)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def main(argv=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    flex = torch.compile(flex_attention)
    generator = torch.Generator("cuda").manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "cases": []}
    for name, batch, heads, head_dim, queries, keys, window in CASES:
        module, q, k, v, mask, real = fallback_call(batch, heads, head_dim, queries, keys, window, "cuda", generator)
        exact, rows = exact_rows(q, k, v, mask, real)

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, 0, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, batch, None, queries, keys, device="cuda")
        calls = variants(module, q, k, v, mask)
        calls["flex"] = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)
        for setting in ("default", "no_cudnn"):
            row = {"case": name, "dispatch": setting, "batch": batch, "heads": heads, "head_dim": head_dim,
                   "queries": queries, "keys": keys, "window": window, "relative_l1": {}, "wall_ms": {}}
            with dispatch(setting):
                for key, fn in list(calls.items()):
                    try:
                        row["relative_l1"][key] = relative_l1(fn()[:, rows].transpose(1, 2).float(), exact)
                    except Exception as e:  # e.g. FlexAttention without a kernel for this head dim here
                        if key != "flex":
                            raise
                        row["relative_l1"][key] = f"{type(e).__name__}: {str(e)[:80]}"
                        del calls[key]
                for _ in range(3):
                    for key, fn in calls.items():
                        ms = timed(fn, reps=20, warmup=5)
                        row["wall_ms"][key] = min(ms, row["wall_ms"].get(key, ms))
                row["kernel_ms"] = fastest_graph_ms(calls)
            for unit in ("wall_ms", "kernel_ms"):
                row[f"copy_over_views_{unit}"] = row[unit]["copy"] / row[unit]["views"]
                row[f"copy_over_flex_{unit}"] = row[unit]["copy"] / row[unit]["flex"] if "flex" in row[unit] else None
            results["cases"].append(row)
            print(row, flush=True)
        del q, k, v, mask, block_mask, calls
        torch.cuda.empty_cache()
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); bf16, one K/V head, boolean mask; wall: eager ms per "
             "call (sync after each), kernel: CUDA-graph ms; fastest of 3 rounds",
             f"{'case':>18} {'dispatch':>8} {'views':>7} {'copy':>7} {'flex':>7} {'copy/views':>10} "
             f"{'views k':>8} {'copy k':>8} {'flex k':>8} {'copy/views k':>12} {'L1 views':>8} {'L1 copy':>8}"]
    for r in results["cases"]:
        w, g, e = r["wall_ms"], r["kernel_ms"], r["relative_l1"]
        flex_wall = f"{w['flex']:7.3f}" if "flex" in w else f"{'-':>7}"
        flex_kernel = f"{g['flex']:8.4f}" if "flex" in g else f"{'-':>8}"
        lines.append(f"{r['case']:>18} {r['dispatch']:>8} {w['views']:7.3f} {w['copy']:7.3f} {flex_wall} "
                     f"{r['copy_over_views_wall_ms']:10.3f} {g['views']:8.4f} {g['copy']:8.4f} {flex_kernel} "
                     f"{r['copy_over_views_kernel_ms']:12.3f} {e['views']:8.4f} {e['copy']:8.4f}")
    lines.append("views: transformers' SDPA function (K/V views of head stride 0); copy: SpargeLLMAttention's fallback "
                 "(contiguous copies); no_cudnn: cuDNN's SDPA kernel off")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
