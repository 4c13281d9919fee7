"""Attention of left-padded prompt batches (Llama-3.1-8B heads: 32 query heads, 8 K/V heads, D = 128, bf16) through
sparge_diffusers.llm's attention function, against what transformers and PyTorch offer for the same batch, one run
on one GPU:

- ours: SpargeLLMAttention at default thresholds with min_padded_tokens=0 (each prompt its own call, padding cut);
- SDPA+mask: transformers' SDPA function under the (B, 1, N, N) boolean mask (attn_implementation="sdpa");
- SDPA/prompt: PyTorch's SDPA (is_causal, cuDNN/flash) on each prompt without its padding, one call per prompt;
- Flex: compiled FlexAttention, one call, with a causal and padding mask_mod (its block mask skips the padding).

Times are eager wall ms per call (synchronised), host time included, since the per-prompt calls are what a
padded batch adds: median of 10 calls, fastest of 3 interleaved rounds. Random Q/K/V keep every block at the
default thresholds, so "ours" is the dense work of the prompts plus our per-call cost; relative L1 is against
SDPA+mask over the real rows. The crossover sets SpargeLLMAttention.min_padded_tokens.

Usage: python benchmarks/padded_batch.py [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report, timed  # noqa: E402

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.llm import SpargeLLMAttention  # noqa: E402

# (prompts, longest, shortest): lengths spread evenly between the two, padded on the left to the longest
BATCHES = ((64, 512, 256), (16, 2048, 1024), (32, 2048, 1536), (16, 3072, 2048), (16, 4096, 3072),
           (8, 8192, 7000), (4, 16384, 4096))
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def padded_batch(prompts: int, longest: int, shortest: int, generator: torch.Generator):
    lengths = torch.linspace(longest, shortest, prompts).long().tolist()
    q = torch.randn(prompts, HEADS, longest, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(prompts, KV_HEADS, longest, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                        generator=generator) for _ in range(2))
    padding = torch.tensor([longest - n for n in lengths], device="cuda")
    keys = torch.arange(longest, device="cuda")
    mask = (keys[None, :] <= keys[:, None])[None, None] & (keys >= padding[:, None])[:, None, None, :]
    return lengths, q, k, v, padding, mask


def main(argv=None):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, HEADS // KV_HEADS
    flex = torch.compile(flex_attention)
    ours = SpargeLLMAttention(min_padded_tokens=0)
    generator = torch.Generator("cuda").manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "heads": [HEADS, KV_HEADS, HEAD_DIM], "batches": []}
    for prompts, longest, shortest in BATCHES:
        lengths, q, k, v, padding, mask = padded_batch(prompts, longest, shortest, generator)

        def padding_causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= padding[b])

        block_mask = create_block_mask(padding_causal, prompts, None, longest, longest, device="cuda")
        fns = {
            "ours": lambda: ours(module, q, k, v, mask)[0],
            "sdpa_mask": lambda: sdpa_attention_forward(module, q, k, v, mask, is_causal=None)[0],
            "sdpa_per_prompt": lambda: [F.scaled_dot_product_attention(
                q[b:b + 1, :, longest - n:], k[b:b + 1, :, longest - n:], v[b:b + 1, :, longest - n:],
                is_causal=True, enable_gqa=True) for b, n in enumerate(lengths)],
            "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2),
        }
        real = torch.arange(longest, device="cuda")[None, :] >= padding[:, None]  # (B, N) rows that are prompts
        reference = fns["sdpa_mask"]()[real].float()
        errors = {name: relative_l1(fns[name]()[real].float(), reference) for name in ("ours", "flex")}
        times = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                times[name].append(timed(fn, reps=10, warmup=3))
        ms = {name: min(t) for name, t in times.items()}
        row = {"prompts": prompts, "longest": longest, "shortest": shortest, "ms": ms, "relative_l1": errors,
               "sdpa_mask_over_ours": ms["sdpa_mask"] / ms["ours"], "flex_over_ours": ms["flex"] / ms["ours"],
               "sdpa_per_prompt_over_ours": ms["sdpa_per_prompt"] / ms["ours"]}
        results["batches"].append(row)
        print(row, flush=True)
        del q, k, v, mask, block_mask
        torch.cuda.empty_cache()
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); left-padded batches, heads {HEADS}/{KV_HEADS}, "
             f"D {HEAD_DIM}, bf16; eager wall ms per call (host time included), fastest of 3 rounds of medians",
             f"{'prompts':>7} {'tokens':>11} {'ours':>8} {'SDPA+mask':>9} {'SDPA/prompt':>11} {'flex':>8} "
             f"{'mask/ours':>9} {'flex/ours':>9} {'prompt/ours':>11} {'L1 ours':>8}"]
    for r in results["batches"]:
        m = r["ms"]
        lines.append(f"{r['prompts']:7d} {r['shortest']:>5}-{r['longest']:<5} {m['ours']:8.2f} {m['sdpa_mask']:9.2f} "
                     f"{m['sdpa_per_prompt']:11.2f} {m['flex']:8.2f} {r['sdpa_mask_over_ours']:9.2f} "
                     f"{r['flex_over_ours']:9.2f} {r['sdpa_per_prompt_over_ours']:11.2f} "
                     f"{r['relative_l1']['ours']:8.4f}")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
