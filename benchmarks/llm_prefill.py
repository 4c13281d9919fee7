"""Prefill of a Llama-3.1-8B-shaped model (32 query heads, 8 K/V heads, D = 128; fewer layers to keep the
build short) with transformers' SDPA attention against sparge_diffusers.llm's attention function, one run on
one GPU, random weights built on the GPU in bf16.

Reports per prompt length: prefill ms with SDPA, with SpargeAttn at default thresholds and at an aggressive
setting (simthreshd1=-1, cdfthreshd=0.9), sparsity, and the relative L1 of the last layer's hidden states
against SDPA's. Random weights attend broadly and are not self-similar, so the default finds nothing to skip:
that row shows our overhead; the aggressive row shows what a given sparsity buys.

Usage: python benchmarks/llm_prefill.py [--lengths 8192,32768] [--layers 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report, timed  # noqa: E402

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.llm import register  # noqa: E402

SETTINGS = {"default": {}, "aggressive": {"simthreshd1": -1.0, "cdfthreshd": 0.9}}


def main(argv=None):
    import transformers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=131072, rope_theta=500000.0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    functions = {name: register(f"sparge_bench_{name}", collect_stats=True, **kw) for name, kw in SETTINGS.items()}
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
               "date": time.strftime("%Y-%m-%d"), "lengths": {}}
    for n in map(int, args.lengths.split(",")):
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

        def prefill():
            with torch.no_grad():
                return model.model(input_ids=ids).last_hidden_state

        model.set_attn_implementation("sdpa")
        dense = prefill()
        row = {"sdpa_ms": timed(prefill)}
        for name, fn in functions.items():
            model.set_attn_implementation(f"sparge_bench_{name}")
            fn.stats.clear()
            out = prefill()
            sparsity = sum(s.sparsity for s in fn.stats) / len(fn.stats)
            fn.collect_stats = False
            ms = timed(prefill)
            fn.collect_stats = True
            row[name] = {"ms": ms, "speedup": row["sdpa_ms"] / ms, "sparsity": sparsity,
                         "relative_l1": relative_l1(out.float(), dense.float())}
        results["lengths"][n] = row
        print(n, row, flush=True)
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}, transformers {transformers.__version__}); "
             f"Llama-3.1-8B shapes, {args.layers} layers, bf16, random weights; prefill ms (median of 5)",
             f"{'tokens':>7} {'sdpa ms':>9} {'default ms':>10} {'x':>5} {'spars':>6} {'aggr ms':>8} {'x':>5} "
             f"{'spars':>6} {'L1':>6}"]
    for n, r in results["lengths"].items():
        d, a = r["default"], r["aggressive"]
        lines.append(f"{n:7d} {r['sdpa_ms']:9.1f} {d['ms']:10.1f} {d['speedup']:5.2f} {d['sparsity']:6.3f} "
                     f"{a['ms']:8.1f} {a['speedup']:5.2f} {a['sparsity']:6.3f} {a['relative_l1']:6.3f}")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
