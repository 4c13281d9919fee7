"""Prefill of a Llama-3.1-8B-shaped model (32 query heads, 8 K/V heads, D = 128; fewer layers to keep the
build short) with transformers' SDPA attention against sparge_diffusers.llm's attention function, one run on
one GPU, random weights built on the GPU in bf16.

Reports per prompt length: prefill ms with SDPA, with FlexAttention (transformers' ``flex_attention``
implementation: compiled flex_attention on the BlockMask transformers builds from the same mask, which skips the
key blocks that mask hides; its compilation outside the timing, its BlockMask built inside it, as each forward
builds it), with SpargeAttn at default thresholds and at an aggressive setting (simthreshd1=-1, cdfthreshd=0.9),
with the S2O and FSA methods at their defaults, sparsity, and the relative L1 of the last layer's hidden states
against SDPA's. ``--no-flex`` leaves FlexAttention out. Random weights attend broadly and are not
self-similar, so the default finds nothing to skip: that row shows our overhead; the aggressive row shows what a
given sparsity buys.

Then one left-padded batch (``--padded``: prompt lengths, padded on the left to the longest, with the attention mask
a tokenizer gives): SDPA computes the padded batch under transformers' boolean mask; our function runs each prompt
without its padding. Relative L1 over the real positions only. ``--right-padded``: the same for a batch padded on the
right (each prompt one causal call on its keys, its padding queries by SDPA over them, as transformers' mask has
them attend; before session 55 such a batch went to SDPA under the mask). ``--static-right-padded LENGTHS:SLOTS``: a
right-padded batch's first prefill into a static cache of SLOTS positions, whose mask also hides the empty slots
(before session 60 such a batch went to SDPA under the mask).

With ``--static FILLED:CHUNK:SLOTS,...``, a chunk against a static cache (``StaticCache``, as
``cache_implementation="static"`` and compiled generation use): the cache holds SLOTS positions, the first FILLED -
CHUNK filled by an SDPA prefill, and the timed forward is the next CHUNK tokens. transformers hands such a chunk a
boolean (CHUNK, SLOTS) mask that also hides the empty slots: SDPA computes under it; our function reads it as the
lower-right causal mask over the FILLED keys and runs on those (before session 50 it fell back to SDPA under the mask).

With ``--window W``, every layer has a sliding window of W keys (Mistral's architecture, which is Llama's with a
window, at the same shapes): transformers hands each layer its boolean sliding mask, under which SDPA computes (and
under which our function ran SDPA before session 51); our function reads the mask and runs the kernels with the
window. S2O and FSA, which take no window, are left out of such a run; "predicted" is the default thresholds with
stage 1 in every window (``min_predicted_window=0``: what "default" ran before session 52, when windows under 4096 keys
started to keep every block in them), and "aggressive" predicts in every window too.

With ``--llama4``, the layers are Llama-4-Scout's text layers instead (40 query heads, 8 K/V heads, D = 128; every
fourth layer global without rotary embeddings, the others attending within chunks of 8192 positions; dense MLPs of
16384 in place of its 16 experts, which transformers' Llama 4 runs on every token, 16 GB at 32K tokens): past one
chunk transformers hands the chunked layers a boolean mask that restarts causal attention at each chunk, under
which SDPA computes all N² scores; our function reads it and runs one causal call per chunk (before session 53 those
layers went to SDPA under the mask). Settings: default and aggressive only.

With ``--gemma3``, the layers are Gemma-3-12B's text layers (16 query heads, 8 K/V heads, head dim 256; three of
every four layers under a sliding window of 1024 keys, the fourth global; Gemma 3 has five local layers to each global
one): transformers hands the local layers a boolean sliding mask, under which SDPA computes all N² scores; our function
reads it and runs the window (before session 54 head dim 256 went to SDPA in every layer). Settings: default and
aggressive only.

With ``--compiled``, the padded batch also runs through ``torch.compile(model.model, fullgraph=True)`` (inductor,
default mode) with SDPA and with the default settings, whose masked calls go through the
``sparge_diffusers::llm_masked_prefill`` operator (the mask read at run time, each prompt its own call).

Usage: python benchmarks/llm_prefill.py [--lengths 8192,32768] [--padded 16384,12288,8192,4096]
       [--right-padded 16384,12288,8192,4096] [--static-right-padded 16384,12288,8192,4096:20480] [--layers 4]
       [--static 32768:2048:40960,32768:8192:40960] [--window 4096 | --llama4 | --gemma3] [--compiled]
       [--no-flex] [--out results.json]
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

FLEX_L1_BOUND = 0.05  # bf16 through these layers gives 0.007-0.013; a wrong mask gives 0.07 and up
SETTINGS = {"default": {}, "aggressive": {"simthreshd1": -1.0, "cdfthreshd": 0.9},
            "s2o": {"method": "s2o"},                       # S2O's default tau (0.0005), segment 2048
            "fsa": {"method": "fsa", "top_k": 16, "block_size": 64}}  # 1024 keys per query token


def main(argv=None):
    import transformers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--padded", default="16384,12288,8192,4096", help="prompt lengths of one left-padded batch "
                    "('' for none)")
    ap.add_argument("--right-padded", default="", help="prompt lengths of one right-padded batch ('' for none)")
    ap.add_argument("--static-right-padded", default="", help="LENGTHS:SLOTS, a right-padded batch's first prefill "
                    "into a static cache of SLOTS positions, e.g. 16384,12288,8192,4096:20480 ('' for none)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--static", default="", help="FILLED:CHUNK:SLOTS,... chunks against a static cache ('' for none)")
    ap.add_argument("--compiled", action="store_true", help="also time the padded batch compiled (SDPA and default)")
    ap.add_argument("--window", type=int, default=None, help="a sliding window of W keys on every layer")
    ap.add_argument("--llama4", action="store_true", help="Llama-4-Scout's text layers (chunked attention)")
    ap.add_argument("--gemma3", action="store_true", help="Gemma-3-12B's text layers (head dim 256, windows of 1024)")
    ap.add_argument("--no-flex", dest="flex", action="store_false", help="leave FlexAttention out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                  rope_theta=500000.0)
    if args.window:
        config, architecture = transformers.MistralConfig(sliding_window=args.window, **shapes), "MistralForCausalLM"
    elif args.llama4:
        config = transformers.Llama4TextConfig(
            vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
            num_hidden_layers=args.layers, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
            moe_layers=[], attention_chunk_size=8192, max_position_embeddings=262144, rope_theta=500000.0)
        architecture = "Llama4ForCausalLM"
    elif args.gemma3:
        config = transformers.Gemma3TextConfig(
            vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=args.layers,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
            layer_types=[("full" if (i + 1) % 4 == 0 else "sliding") + "_attention" for i in range(args.layers)],
            max_position_embeddings=131072)
        architecture = "Gemma3ForCausalLM"
    else:
        config, architecture = transformers.LlamaConfig(**shapes), "LlamaForCausalLM"
    settings = dict(SETTINGS)
    if args.llama4 or args.gemma3:
        settings = {name: SETTINGS[name] for name in ("default", "aggressive")}
    if args.window:  # stage 1 inside windows under min_predicted_window only where asked (0: always)
        settings = {"default": {}, "predicted": {"min_predicted_window": 0},
                    "aggressive": {**SETTINGS["aggressive"], "min_predicted_window": 0}}
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = getattr(transformers, architecture)(config).eval()
    torch.set_default_dtype(torch.float32)
    functions = {name: register(f"sparge_bench_{name}", collect_stats=True, **kw) for name, kw in settings.items()}
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
               "window": args.window, "date": time.strftime("%Y-%m-%d"), "lengths": {}}
    for n in [int(n) for n in args.lengths.split(",") if n]:
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))
        results["lengths"][n] = row = compare(model, functions, ids, flex=args.flex)
        print(n, row, flush=True)
    statics = [tuple(int(x) for x in case.split(":")) for case in args.static.split(",") if case]
    for filled, chunk, slots in statics:
        results.setdefault("static", {})[f"{filled}:{chunk}:{slots}"] = row = static_chunk_compare(
            model, functions, filled, chunk, slots, flex=args.flex)
        print("static", (filled, chunk, slots), row, flush=True)
    padded = [int(n) for n in args.padded.split(",") if n]
    if padded:
        ids, mask = padded_batch(config, padded, "left")
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        results["padded"] = row = compare(model, functions, ids, attention_mask=mask, position_ids=positions,
                                         flex=args.flex)
        row["prompt_lengths"] = padded
        print("padded", padded, row, flush=True)
        if args.compiled:
            results["padded_compiled"] = compiled_row = compiled_compare(
                model, ids, attention_mask=mask, position_ids=positions)
            print("padded, compiled", compiled_row, flush=True)
    right_padded = [int(n) for n in args.right_padded.split(",") if n]
    if right_padded:
        ids, mask = padded_batch(config, right_padded, "right")
        results["right_padded"] = row = compare(model, functions, ids, attention_mask=mask, flex=args.flex)
        row["prompt_lengths"] = right_padded
        print("right padded", right_padded, row, flush=True)
    static_right = None
    if args.static_right_padded:
        lengths_text, slots_text = args.static_right_padded.split(":")
        static_right = [int(n) for n in lengths_text.split(",")], int(slots_text)
        results["static_right_padded"] = row = static_right_padded_compare(model, functions, config, *static_right,
                                                                          flex=args.flex)
        row["prompt_lengths"], row["slots"] = static_right
        print("right padded, static cache", static_right, row, flush=True)
    model_name = "Llama-4-Scout" if args.llama4 else "Gemma-3-12B" if args.gemma3 else "Llama-3.1-8B"
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}, transformers {transformers.__version__}); "
             f"{model_name} shapes, {args.layers} layers, bf16, random "
             f"weights; prefill ms (median of 5); "
             f"settings: {settings}" + (f"; a sliding window of {args.window} keys on every layer (Mistral)"
                                         if args.window else "")
             + ("; chunks of 8192, every fourth layer global, dense MLPs" if args.llama4 else "")
             + ("; windows of 1024 keys, every fourth layer global" if args.gemma3 else ""),
             f"{'tokens':>8} {'sdpa ms':>9} {'flex ms':>9} {'setting':>10} {'ms':>8} {'x sdpa':>6} {'x flex':>6} "
             f"{'spars':>6} {'rel L1':>7}"]
    rows = list(results["lengths"].items()) + ([("padded", results["padded"])] if padded else []) \
        + ([("right", results["right_padded"])] if right_padded else []) \
        + ([("st-right", results["static_right_padded"])] if static_right else []) \
        + [(f"static{i}", r) for i, r in enumerate(results.get("static", {}).values())]
    for n, r in rows:
        for name in settings:
            e = r[name]
            sparsity = f"{e['sparsity']:6.3f}" if e["sparsity"] is not None else f"{'-':>6}"
            flex_ms, x_flex = (f"{r['flex_ms']:9.1f}", f"{e['x_flex']:6.2f}") if "flex_ms" in r else (
                f"{'-':>9}", f"{'-':>6}")
            lines.append(f"{n:>8} {r['sdpa_ms']:9.1f} {flex_ms} {name:>10} {e['ms']:8.1f} {e['speedup']:6.2f} {x_flex} "
                         f"{sparsity} {e['relative_l1']:7.4f}")
    flex_l1 = [(n, r["flex_relative_l1"]) for n, r in rows if "flex_relative_l1" in r]
    if flex_l1:  # FlexAttention's own error, so that a flex time for a different result is seen as one
        lines.append("FlexAttention's rel. L1 against SDPA: " + ", ".join(
            f"{n} {l1:.4f}" + (" (NOT the same result: its time does not compare)" if not l1 <= FLEX_L1_BOUND else "")
            for n, l1 in flex_l1))
    if "padded_compiled" in results:
        c = results["padded_compiled"]
        lines.append(f"{'padded':>7} compiled: sdpa {c['sdpa_ms']:.1f} ms, default {c['default_ms']:.1f} ms "
                     f"({c['sdpa_ms'] / c['default_ms']:.2f}x), rel L1 {c['relative_l1']:.4f} (inductor, default mode)")
    for i, case in enumerate(results.get("static", {})):
        filled, chunk, slots = case.split(":")
        lines.append(f"static{i}: a chunk of {chunk} tokens against a static cache of {slots} slots, {filled} filled "
                     f"after it; SDPA under transformers' (chunk, slots) mask, ours on the filled keys")
    if padded:
        lines.append(f"padded: a left-padded batch of {len(padded)} prompts ({', '.join(map(str, padded))} tokens, "
                     f"padded to {max(padded)}); SDPA under the mask, ours per prompt; L1 over real positions")
    if right_padded:
        lines.append(f"right: the same for a right-padded batch of {len(right_padded)} prompts "
                     f"({', '.join(map(str, right_padded))} tokens); ours per prompt, its padding queries by SDPA")
    if static_right:
        lines.append(f"st-right: that right-padded batch's first prefill into a static cache of {static_right[1]} "
                     f"slots ({', '.join(map(str, static_right[0]))} tokens); SDPA under transformers' (batch, "
                     f"slots) mask, ours per prompt on its keys (before session 60: SDPA under the mask)")
    save_report(results, "\n".join(lines), args.out)


def padded_batch(config, lengths: list[int], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids of prompts of ``lengths``, padded on ``side`` ("left" or "right") to the longest, and the
    attention mask a tokenizer gives them (1 = real token)."""
    longest = max(lengths)
    ids = torch.randint(0, config.vocab_size, (len(lengths), longest), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, slice(longest - n, None) if side == "left" else slice(0, n)] = 1
    return ids, mask


def compare(model, functions, ids, after_each=None, flex: bool = True, **inputs) -> dict:
    """Prefill ms with SDPA, with FlexAttention (``flex``) and with each registered function; sparsity and relative
    L1 against SDPA's last hidden states (at the real positions where an attention mask marks padding).
    ``after_each``: called after every forward (timed with it)."""
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones_like(ids, dtype=torch.bool)

    def prefill():
        with torch.no_grad():
            out = model.model(input_ids=ids, **inputs).last_hidden_state
        if after_each is not None:
            after_each()
        return out

    model.set_attn_implementation("sdpa")
    dense = prefill()[real].float()
    row = {"sdpa_ms": timed(prefill)}
    if flex:
        model.set_attn_implementation("flex_attention")
        try:
            out = prefill()[real].float()  # compiles flex_attention for this shape: outside the timing
            row["flex_ms"] = timed(prefill)
            row["flex_relative_l1"] = relative_l1(out, dense)
        except Exception as error:  # e.g. a head dim whose tiles do not fit the GPU's shared memory: said, not timed
            row["flex_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print("FlexAttention failed:", row["flex_error"], flush=True)
            flex = False
    for name, fn in functions.items():
        model.set_attn_implementation(f"sparge_bench_{name}")
        fn.stats.clear()
        calls = fn.sparse_calls
        out = prefill()[real].float()
        if fn.sparse_calls - calls != model.config.num_hidden_layers:
            raise RuntimeError(f"{name}: {fn.sparse_calls - calls} of {model.config.num_hidden_layers} layers ran "
                               "sparse")
        sparsity = sum(s.sparsity for s in fn.stats) / len(fn.stats) if fn.stats else None
        fn.collect_stats = False
        ms = timed(prefill)
        fn.collect_stats = True
        row[name] = {"ms": ms, "speedup": row["sdpa_ms"] / ms, "sparsity": sparsity,
                     "relative_l1": relative_l1(out, dense)}
        if flex:
            row[name]["x_flex"] = row["flex_ms"] / ms
    return row


def static_cache(model, slots: int, batch: int = 1, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """An empty StaticCache of ``slots`` positions and the name of the models' cache argument (``device`` and
    ``dtype``: where transformers before 4.56 allocates it up front; later versions take the first keys').

    Its query offset is handed to the mask builders as a copy. transformers 5.x (5.17, 5.18 and 5.24) passes a filled
    StaticCache's live write counter to ``flex_attention_mask``, whose ``mask_mod`` keeps it; each layer's cache
    update moves that counter on before attention, so FlexAttention evaluates its partial blocks as if the queries
    sat that many positions later, and every forward after the cache's first (the timed ones here, which rewind or
    reset it) gets wrong rows: rel. L1 0.07-0.27 against SDPA on the H100 before this copy, 0.45-0.75 on tiny
    models. The SDPA and eager masks are built at once and unaffected; so are ours."""
    import inspect

    import transformers

    try:
        cache = transformers.StaticCache(config=model.config, max_cache_len=slots)
    except TypeError:  # transformers before 4.56 sizes it up front
        cache = transformers.StaticCache(config=model.config, max_batch_size=batch, max_cache_len=slots,
                                         device=device, dtype=dtype)
    for method in ("get_query_offset", "get_seq_length"):  # 5.x asks the first, which asks the second; 4.x the second
        if hasattr(cache, method):
            setattr(cache, method, _copying(getattr(cache, method)))
    name = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
    return cache, name


def _copying(method):
    """``method`` with a tensor result cloned, so that the caller holds no reference to the cache's live state."""
    def copied(*args, **kwargs):
        result = method(*args, **kwargs)
        return result.clone() if isinstance(result, torch.Tensor) else result
    return copied


def rewinder(cache, tokens: int):
    """A function that moves the static cache's write position back by ``tokens``, so that the next timed forward
    writes the same slots again: transformers 5.x's static layers count what they hold (5.24 has crop(-n) for it,
    5.17 not); 4.x writes at the positions given."""
    def rewind():
        for layer in cache.layers:
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.sub_(tokens)
            elif isinstance(getattr(layer, "cumulative_length", None), int):
                layer.cumulative_length -= tokens
    return rewind


def static_chunk_compare(model, functions, filled: int, chunk: int, slots: int, flex: bool = True) -> dict:
    """:func:`compare` for the forward of tokens filled - chunk .. filled - 1 against a static cache of ``slots``
    positions whose first filled - chunk hold an SDPA prefill of the tokens before (one cache for every function, so
    only the chunk differs; each timed forward rewrites the chunk's own slots with the same values)."""
    ids = torch.randint(0, model.config.vocab_size, (1, filled), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(3))
    cache, name = static_cache(model, slots)
    prefix = filled - chunk
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model.model(input_ids=ids[:, :prefix], use_cache=True, cache_position=torch.arange(prefix, device="cuda"),
                    **{name: cache})
    positions = torch.arange(prefix, filled, device="cuda")
    return compare(model, functions, ids[:, prefix:], after_each=rewinder(cache, chunk), flex=flex, use_cache=True,
                   position_ids=positions[None], cache_position=positions, **{name: cache})


def static_right_padded_compare(model, functions, config, lengths: list[int], slots: int, flex: bool = True) -> dict:
    """:func:`compare` for the first prefill of a right-padded batch (:func:`padded_batch`) into a static cache of
    ``slots`` positions, as ``generate(..., cache_implementation="static")`` runs it: transformers' mask hides each
    prompt's padding keys and the empty slots after the batch's last position."""
    ids, mask = padded_batch(config, lengths, "right")
    cache, name = static_cache(model, slots, batch=len(lengths))
    longest = ids.shape[1]
    return compare(model, functions, ids, after_each=rewinder(cache, longest), flex=flex, attention_mask=mask,
                   use_cache=True, cache_position=torch.arange(longest, device="cuda"), **{name: cache})


def compiled_compare(model, ids, **inputs) -> dict:
    """Prefill ms of ``torch.compile(model.model, fullgraph=True)`` with SDPA and with the default settings (each
    compiled once, outside the timing), and the relative L1 between their last hidden states at the real positions."""
    real = inputs["attention_mask"].bool()
    row, outs = {}, {}
    for name, implementation in (("sdpa", "sdpa"), ("default", "sparge_bench_default")):
        model.set_attn_implementation(implementation)
        torch._dynamo.reset()
        body = torch.compile(model.model, fullgraph=True)

        def prefill():
            with torch.no_grad():
                return body(input_ids=ids, **inputs).last_hidden_state

        outs[name] = prefill()[real].float()
        row[f"{name}_ms"] = timed(prefill)
    row["relative_l1"] = relative_l1(outs["default"], outs["sdpa"])
    torch._dynamo.reset()
    return row


if __name__ == "__main__":
    main()
