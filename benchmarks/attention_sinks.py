"""Causal attention with learned sinks (gpt-oss's ``sinks``, transformers' ``s_aux``) at gpt-oss-20b's head shape
(64 query heads, 8 K/V heads, D = 64, bf16, one sequence), every figure from one run on one GPU.

Kernel level, per (length, window; window 0 = full causal, gpt-oss's other layers use 128):
  * compiled FlexAttention under the causal (sliding) block mask, with the sinks applied as transformers' flex path
    does: the output renormalised by its log-sum-exp (``return_lse``) against the sink;
  * cuDNN SDPA, plain causal, without sinks or window (no SDPA backend takes sinks): for scale only;
  * ours, every block (``block_sparse_attention(..., None, sink_logits=...)``), and the same without sinks (what the
    sinks cost the kernel);
  * ours, the whole method at default thresholds (``sparge_attention(..., sink_logits=...)``) on the LLM-like
    structured inputs (``sparge_diffusers.testing.llm_like_qkv``), and its sparsity.
Every method runs on the same inputs and sink logits (drawn N(0, 2)); relative L1 against float32 attention with the
sinks on 1024 sampled query rows. Times: kernel ms from CUDA-graph replays (median), fastest of 3 interleaved rounds.

Model level (``--model-lengths``): a prefill through ``--layers`` gpt-oss-20b-shaped layers (hidden 2880, 32 experts,
4 per token; sliding-window and global layers alternating), random weights built on the GPU in bf16, with
transformers' eager attention (gpt-oss's reference path: the only built-in one that computes the sinks without the
kernels hub) and with ``sparge_diffusers.llm`` at default thresholds (before session 52 it raised on ``s_aux``; its
sliding layers, 128 keys, keep every block in the window: ``min_predicted_window``), both against float32 attention
with the sinks (the function's fallback, ``llm.eager_attention``, on float32 copies of q, k and v).

Usage: python benchmarks/attention_sinks.py [--cases 32768:0,32768:128,8192:0] [--model-lengths 8192] [--layers 2]
       [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import exact_causal_rows, fastest_graph_ms, sampled_rows, save_report, timed  # noqa: E402

from sparge_diffusers import block_sparse_attention, relative_l1, sparge_attention  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import cudnn_attention_fn  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64


def kernel_case(n: int, window: int, flex) -> tuple[dict, str]:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = llm_like_qkv(n, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device="cuda", seed=n + window)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(n)).mul(2.0).to("cuda", torch.bfloat16)
    win = window or None

    def visible(b, h, q_idx, kv_idx):
        if window:
            return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
        return kv_idx <= q_idx

    block_mask = create_block_mask(visible, None, None, n, n, device="cuda")
    def flex_sinks():
        # transformers' flex path: renormalise by the log-sum-exp against the sink
        out, lse = flex(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        sink = sinks.float().view(1, -1, 1)
        return (out.float() * torch.sigmoid(lse - sink)[..., None]).to(q.dtype)

    calls = {
        "flex_sinks": flex_sinks,
        "cudnn_causal_no_sinks": cudnn_attention_fn(q, k, v, causal=True),
        "ours_all": lambda: block_sparse_attention(q, k, v, None, is_causal=True, sliding_window=win,
                                                   sink_logits=sinks),
        "ours_all_no_sinks": lambda: block_sparse_attention(q, k, v, None, is_causal=True, sliding_window=win),
        "ours_default": lambda: sparge_attention(q, k, v, is_causal=True, sliding_window=win, sink_logits=sinks),
    }
    times = fastest_graph_ms(calls)
    rows = sampled_rows(n)
    ref = exact_causal_rows(q, k, v, rows, window=window, sinks=sinks)
    _, stats = sparge_attention(q, k, v, is_causal=True, sliding_window=win, sink_logits=sinks, return_sparsity=True)
    l1 = {name: relative_l1(calls[name]()[:, :, rows].float(), ref)
          for name in ("flex_sinks", "ours_all", "ours_all_no_sinks", "ours_default")}
    entry = {"n": n, "window": window, "ms": times, "sparsity": stats.sparsity, "relative_l1": l1,
             "ratios": {"flex_over_ours_all": times["flex_sinks"] / times["ours_all"],
                        "flex_over_ours_default": times["flex_sinks"] / times["ours_default"],
                        "sinks_cost": times["ours_all"] / times["ours_all_no_sinks"] - 1}}
    r = entry["ratios"]
    line = (f"{n:>6} {window:>6} {times['flex_sinks']:>9.3f} {times['cudnn_causal_no_sinks']:>9.3f} "
            f"{times['ours_all']:>9.3f} {times['ours_all_no_sinks']:>9.3f} {times['ours_default']:>9.3f} "
            f"{r['flex_over_ours_all']:>9.2f} {r['flex_over_ours_default']:>9.2f} {100 * r['sinks_cost']:>+8.1f}% "
            f"{stats.sparsity:>9.3f} {l1['flex_sinks']:>8.4f} {l1['ours_all']:>8.4f} {l1['ours_all_no_sinks']:>8.4f} "
            f"{l1['ours_default']:>8.4f}")
    return entry, line


def register_float32_reference(name: str) -> None:
    """Register, as a transformers attention implementation, float32 attention with the sinks: the sinks' exact
    fallback (``llm.eager_attention``) on float32 copies of q, k and v (the accuracy reference for eager
    attention, whose softmax runs in bf16, and for ours)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from sparge_diffusers.llm import eager_attention

    def float32_sinks(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = eager_attention(query.float(), key.float(), value.float(), attention_mask, sinks=kwargs["s_aux"],
                              scale=scaling, is_causal=True)
        return out.to(query.dtype), None

    AttentionInterface.register(name, float32_sinks)
    AttentionMaskInterface.register(name, sdpa_mask)


def model_case(n: int, layers: int) -> tuple[dict, str]:
    import transformers

    from sparge_diffusers.llm import register

    config = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=2880, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_hidden_layers=layers, vocab_size=1024, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    ids = torch.randint(0, 1024, (1, n), device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
    attention = register("sparge_bench_sinks", collect_stats=True, strict=True)
    register_float32_reference("float32_sinks")

    def prefill():
        with torch.no_grad():
            return model.model(input_ids=ids).last_hidden_state

    model.set_attn_implementation("float32_sinks")
    exact = prefill().float()
    model.set_attn_implementation("eager")
    eager = prefill().float()
    eager_ms = timed(prefill, reps=3, warmup=1)
    model.set_attn_implementation("sparge_bench_sinks")
    attention.stats.clear()
    ours = prefill().float()
    sparsity = sum(s.sparsity for s in attention.stats) / len(attention.stats)
    attention.collect_stats = False
    ours_ms = timed(prefill, reps=3, warmup=1)
    entry = {"n": n, "layers": layers, "eager_ms": eager_ms, "ours_ms": ours_ms, "speedup": eager_ms / ours_ms,
             "sparsity": sparsity, "relative_l1_vs_eager": relative_l1(ours, eager),
             "relative_l1_vs_exact": {"ours": relative_l1(ours, exact), "eager": relative_l1(eager, exact)}}
    line = (f"{n:>6} {layers:>6} {eager_ms:>9.1f} {ours_ms:>9.1f} {eager_ms / ours_ms:>8.2f} {sparsity:>9.3f} "
            f"{entry['relative_l1_vs_eager']:>8.4f} {entry['relative_l1_vs_exact']['ours']:>9.4f} "
            f"{entry['relative_l1_vs_exact']['eager']:>9.4f}")
    del model
    torch.cuda.empty_cache()
    return entry, line


def main(argv=None):
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="32768:0,32768:128,8192:0")
    ap.add_argument("--model-lengths", default="8192", help="prompt lengths of the model-level prefill ('' for none)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    flex = torch.compile(flex_attention)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "cases": [], "model": []}
    lines = [f"{results['gpu']}, {HEADS} q heads / {KV_HEADS} kv heads, D = {HEAD_DIM}, bf16, sink logits N(0, 2); "
             f"kernel ms (window 0: full causal; ratios: Flex's ms / ours)",
             f"{'N':>6} {'window':>6} {'Flex+sink':>9} {'cuDNN*':>9} {'ours all':>9} {'no sinks':>9} {'ours def':>9} "
             f"{'flex/all':>9} {'flex/def':>9} {'sinks':>9} {'sparsity':>9} {'L1 flex':>8} {'L1 all':>8} "
             f"{'L1 nosink':>8} {'L1 def':>8}"]
    for case in filter(None, args.cases.split(",")):
        n, window = (int(x) for x in case.split(":"))
        entry, line = kernel_case(n, window, flex)
        results["cases"].append(entry)
        lines.append(line)
        torch.cuda.empty_cache()
    lines.append("(cuDNN*: plain causal SDPA without sinks or window, for scale; 'sinks': ours all with sinks against "
                 "without)")
    if args.model_lengths:
        lines.append("model: gpt-oss-20b-shaped layers, random weights; prefill ms (eager attention / ours at "
                     "default thresholds); rel. L1 of the last hidden states, ours against eager, and ours and eager "
                     "against float32 attention with the sinks (exact)")
        lines.append(f"{'N':>6} {'layers':>6} {'eager':>9} {'ours':>9} {'speedup':>8} {'sparsity':>9} {'L1 eager':>8} "
                     f"{'L1o exact':>9} {'L1e exact':>9}")
        for n in (int(x) for x in args.model_lengths.split(",")):
            entry, line = model_case(n, args.layers)
            results["model"].append(entry)
            lines.append(line)
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
