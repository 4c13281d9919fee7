"""Attention kernel benchmark: every figure from one run on one GPU.

For each shape (CogVideoX-2B, Mochi, Flux 1024px, Llama-3.1-8B causal 32K; on request Gemma-3-12B causal 32K, head dim
256, workloads.EXTRA):
  * dense mode of our kernel vs SDPA (cuDNN backend, flash backend);
  * block_sparse_attention vs compiled FlexAttention given the same block mask, densities 0.5/0.25/0.1:
    ours given the bool mask (compacted on every call) and given a prebuilt CompactBlockMask (as Flex is
    given its prebuilt BlockMask);
  * stage-1 prediction time as a share of cuDNN dense time;
  * the whole method at default settings on structured inputs: sparsity, relative L1 against exact float32
    attention (on a sample of query rows), time against cuDNN.
Each time is the fastest of 3 interleaved rounds of medians (see bench_rounds), each median over calls
replayed from a CUDA graph (--timer graph, the default: kernel time without Python and launch overhead,
for every method alike) or over plain calls (--timer eager).

Usage: python benchmarks/attention.py [--shapes mochi,flux] [--out results.json] [--timer graph|eager]
Writes JSON (default benchmarks/results/attention-<gpu>.json) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from sparge_diffusers import BLOCK_K, BLOCK_Q, block_sparse_attention, predict_block_mask, sparge_attention
from sparge_diffusers import compact_block_mask
from sparge_diffusers._json import write_json
from sparge_diffusers.kernels.attention import block_mask_to_index
from sparge_diffusers.kernels._inputs import check_attention_inputs
from sparge_diffusers.kernels.stats import dense_block_count
from sparge_diffusers.workloads import EXTRA, FULL, sampled_relative_l1

DENSITIES = (0.5, 0.25, 0.1)


# "graph": each call replayed from a CUDA graph (kernel time, no Python or launch overhead, which at the Flux
# shape was large and noisy enough to move one median by 40% within a run); "eager": plain calls (do_bench).
TIMER = "graph"
GRAPH_FALLBACKS: list[str] = []  # calls that could not be captured and were timed eagerly instead


def bench(fn, warmup_ms=50, rep_ms=300, graph_rep_ms=100, name="") -> float:
    """Median ms of ``fn``: eager calls over ``rep_ms``, or (TIMER "graph") 10 replays of a CUDA graph of
    about ``graph_rep_ms`` of calls (at 300 ms the four shapes took over 10 minutes on an H100, at 100 ms 4)."""
    import triton.testing

    if TIMER == "graph":
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=graph_rep_ms, return_mode="median"))
        except Exception as e:  # report, never hide: the JSON lists every eager fallback
            GRAPH_FALLBACKS.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


ROUNDS = 3


def bench_rounds(fns: dict, rounds: int = ROUNDS, graph_rep_ms: int = 100) -> tuple[dict, dict]:
    """Each fn's median per round, the rounds interleaved, then each fn's fastest round, and the spread
    (slowest / fastest round - 1). On the lent H100 one variant's median moved by up to 15% within a run
    (2026-11-22: the same kernel on the same mask, 24.2 vs 27.7 ms), so single medians cannot rank variants."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn, graph_rep_ms=graph_rep_ms, name=name))
    return ({name: min(t) for name, t in times.items()},
            {name: max(t) / min(t) - 1 for name, t in times.items()})


def attention_flops(B, H, N, D, causal) -> float:
    return 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def sdpa_fn(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(group, 1) if group > 1 else t for t in (k, v))
    if backend == "default":  # PyTorch's own choice, as a model calling SDPA gets it
        return lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)

    return run


def random_block_mask(B, H, nq, nk, density, causal, N, device, seed=0, q_len=None, causal_offset=0):
    """Random mask with the given fraction of the (causally visible) blocks; diagonal / first block kept.
    ``N``: the key length; ``q_len`` (default N) and ``causal_offset``: as ``AttentionShape``'s."""
    g = torch.Generator(device=device).manual_seed(seed)
    from sparge_diffusers.kernels._inputs import causal_block_straddles, causal_block_visible

    score = torch.rand(B, H, nq, nk, generator=g, device=device)
    where = dict(q_len=q_len, causal_offset=causal_offset)
    visible = causal_block_visible(nq, nk, N, device, **where) if causal else torch.ones(nq, nk, dtype=torch.bool,
                                                                                           device=device)
    mask = (score < density) & visible
    if causal:
        mask |= causal_block_straddles(nq, nk, N, device, **where)
    else:
        mask[..., 0] = True
    return mask


def flex_fn(q, k, v, mask, causal, shape, key_positions=None, key_segment=BLOCK_K):
    """Compiled FlexAttention over the same blocks: kept blocks that need no masking are 'full' blocks.
    ``key_positions`` / ``key_segment``: keys permuted within segments (``PermutedKeys``); the mask_mod then
    tests each key's original position. ``shape.causal_offset``: query i sits at key position i + offset."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    index, count, n_full = block_mask_to_index(mask, shape, causal, key_segment=key_segment)
    nk = index.shape[-1]
    positions = (torch.arange(nk, device=q.device) + n_full[..., None]).clamp(max=nk - 1)
    partial_index = torch.gather(index, -1, positions.long())

    offset = shape.causal_offset
    if key_positions is None:
        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
    else:
        group, pos = q.shape[1] // k.shape[1], key_positions.long()

        def causal_mod(b, h, q_idx, kv_idx):  # permuted keys: their original positions
            return pos[b, h // group, kv_idx] <= q_idx

    def noop_mod(b, h, q_idx, kv_idx):
        return q_idx >= 0

    block_mask = BlockMask.from_kv_blocks(
        (count - n_full).contiguous(), partial_index.contiguous(), n_full.contiguous(), index.contiguous(),
        BLOCK_SIZE=(BLOCK_Q, BLOCK_K), mask_mod=causal_mod if causal else noop_mod,
        seq_lengths=(q.shape[2], k.shape[2]))
    compiled = torch.compile(flex_attention, dynamic=False)
    gqa = q.shape[1] != k.shape[1]
    # FlexAttention's own tile must divide the mask's 128 x 64 blocks; its default for D = 64 does not.
    options = {"BLOCK_M": BLOCK_Q, "BLOCK_N": BLOCK_K}
    if q.shape[-1] > 128:
        # at D = 256 three stages of that tile do not fit an H100's shared memory (nor ours), and Flex's default 4
        # warps are slow: Gemma-3-12B heads, 32K causal, density 0.25, H100, Flex 16.2 ms with 4 warps and 2 stages,
        # 5.0 with 8 warps, 6.0-7.1 with 64-row or 32-key tiles or its own default (ours 4.7; kernel-variants (pp))
        options.update(num_stages=2, num_warps=8)
    return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)


def run_shape(w, densities, device, log):
    name, B, H, HK, N, D, causal = w.name, w.batch, w.heads, w.kv_heads, w.seq_len, w.head_dim, w.causal
    dtype = torch.bfloat16
    flops = attention_flops(B, H, N, D, causal)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, N, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, HK, N, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, HK, N, D, device=device, dtype=dtype, generator=g)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal)
    res = {"shape": {"B": B, "H": H, "H_kv": HK, "N": N, "D": D, "causal": causal, "dtype": "bf16"}}

    t, spread = bench_rounds({
        "cudnn": sdpa_fn(q, k, v, causal, "cudnn"),
        "flash": sdpa_fn(q, k, v, causal, "flash"),
        # what a model calling SDPA gets (on the H100 with torch 2.11 it picks cuDNN's kernel and times alike)
        "sdpa": sdpa_fn(q, k, v, causal, "default"),
        "ours": lambda: block_sparse_attention(q, k, v, None, is_causal=causal),
        # the same dense walk with the stage-2 test compiled in (pvthreshd=50 skips nothing on random inputs)
        "ours_pv": lambda: block_sparse_attention(q, k, v, None, is_causal=causal, pvthreshd=50)})
    cudnn, flash, ours_dense, ours_dense_pv = t["cudnn"], t["flash"], t["ours"], t["ours_pv"]
    res["dense"] = {"cudnn_ms": cudnn, "flash_ms": flash, "ours_ms": ours_dense, "ours_pv_test_ms": ours_dense_pv,
                    "round_spread": spread,
                    "ours_vs_cudnn": cudnn / ours_dense, "ours_vs_flash": flash / ours_dense,
                    "ours_tflops": flops / ours_dense / 1e9, "cudnn_tflops": flops / cudnn / 1e9,
                    "sdpa_default_ms": t["sdpa"], "ours_vs_sdpa_default": t["sdpa"] / ours_dense}
    # The same (B, H, N, D) values stored as (B, N, H, D), as diffusers and transformers models hand them over
    # (views of their projections): cuDNN's time depends on the storage (H100, Flux: 399 vs 444-455 us).
    qn, kn, vn = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    t, _ = bench_rounds({"cudnn": sdpa_fn(qn, kn, vn, causal, "cudnn"),
                         "ours": lambda: block_sparse_attention(qn, kn, vn, None, is_causal=causal)})
    res["dense"].update(cudnn_nhd_stored_ms=t["cudnn"], ours_nhd_stored_ms=t["ours"],
                        ours_vs_cudnn_nhd_stored=t["cudnn"] / t["ours"])
    del qn, kn, vn
    log(f"{name}: dense ours {ours_dense:.2f} ms, cuDNN {cudnn:.2f} ms, flash {flash:.2f} ms")

    res["sparse"] = []
    for density in densities:
        mask = random_block_mask(B, H, shape.q_blocks, shape.k_blocks, density, causal, N, device)
        dense_blocks = (mask.sum() / (B * H)).item()
        compact = compact_block_mask(mask, q, k, is_causal=causal)
        fns = {"ours": lambda: block_sparse_attention(q, k, v, mask, is_causal=causal),
               "prebuilt": lambda: block_sparse_attention(q, k, v, compact, is_causal=causal)}
        try:
            fns["flex"] = flex_fn(q, k, v, mask, causal, shape)
            fns["flex"]()  # compile outside the timed rounds
        except Exception as e:  # report, never hide
            fns.pop("flex", None)
            log(f"  flex failed: {type(e).__name__}: {e}")
        t, spread = bench_rounds(fns)
        ours, prebuilt, flex = t["ours"], t["prebuilt"], t.get("flex", float("nan"))
        actual = float(mask.sum()) / (B * H * dense_block_count(shape, causal))
        entry = {"density": density, "actual_density": actual, "kept_blocks_per_head": dense_blocks,
                 "ours_ms": ours, "ours_prebuilt_ms": prebuilt, "flex_ms": flex, "ours_vs_flex": flex / ours,
                 "prebuilt_vs_flex": flex / prebuilt,
                 "speedup_vs_own_dense": ours_dense / ours, "ideal_speedup": 1 / actual,
                 "speedup_over_ideal": ours_dense / ours * actual,
                 "prebuilt_speedup_over_ideal": ours_dense / prebuilt * actual, "round_spread": spread}
        res["sparse"].append(entry)
        log(f"  density {density}: ours {ours:.2f} ms (prebuilt {prebuilt:.2f}), flex {flex:.2f} ms, "
            f"vs own dense x{ours_dense / ours:.2f}")

    predict = bench_rounds({"p": lambda: predict_block_mask(q, k, is_causal=causal)})[0]["p"]
    res["predict"] = {"ms": predict, "share_of_cudnn": predict / cudnn}
    del q, k, v
    torch.cuda.empty_cache()

    qs, ks, vs = w.make(device, 0)
    out, stats = sparge_attention(qs, ks, vs, is_causal=causal, return_sparsity=True)
    l1 = sampled_relative_l1(out, qs, ks, vs, causal)
    t, spread = bench_rounds({"whole": lambda: sparge_attention(qs, ks, vs, is_causal=causal),
                              "stage1_only": lambda: sparge_attention(qs, ks, vs, is_causal=causal, pvthreshd=None),
                              "cudnn": sdpa_fn(qs, ks, vs, causal, "cudnn"),
                              "sdpa": sdpa_fn(qs, ks, vs, causal, "default")})
    whole, stage1_only, cudnn_s = t["whole"], t["stage1_only"], t["cudnn"]
    l1_cudnn = sampled_relative_l1(sdpa_fn(qs, ks, vs, causal, "cudnn")(), qs, ks, vs, causal)
    res["structured_default"] = {"sparsity": stats.sparsity, "qk_skipped": float(stats.qk_skipped.mean()),
                                 "pv_skipped_stage2": float(stats.pv_skipped_stage2.mean()),
                                 "relative_l1": l1, "relative_l1_cudnn_bf16": l1_cudnn, "ms": whole,
                                 "stage1_only_ms": stage1_only,
                                 "cudnn_ms": cudnn_s, "speedup_vs_cudnn": cudnn_s / whole, "round_spread": spread,
                                 "sdpa_default_ms": t["sdpa"], "speedup_vs_sdpa_default": t["sdpa"] / whole}
    log(f"  structured: sparsity {stats.sparsity:.3f}, L1 {l1:.4f}, {whole:.2f} ms vs cuDNN {cudnn_s:.2f} ms")
    del qs, ks, vs, out
    torch.cuda.empty_cache()
    return res


def print_table(results):
    print(f"\nGPU: {results['gpu']}  (torch {results['torch']}, triton {results['triton']}); bf16; ms are medians, "
          f"timer {results.get('timer', 'eager')}")
    for fallback in results.get("graph_fallbacks", []):
        print(f"  timed eagerly (no CUDA graph): {fallback}")
    print(f"{'shape':10} {'cuDNN':>8} {'flash':>8} {'SDPA':>8} {'ours':>8} {'ours+pv':>8} {'cuDNN/ours':>10} "
          f"{'SDPA/ours':>9} {'pred %':>7}")
    for name, r in results["shapes"].items():
        d = r["dense"]
        print(f"{name:10} {d['cudnn_ms']:8.2f} {d['flash_ms']:8.2f} {d.get('sdpa_default_ms', float('nan')):8.2f} "
              f"{d['ours_ms']:8.2f} {d['ours_pv_test_ms']:8.2f} {d['ours_vs_cudnn']:10.2f} "
              f"{d.get('ours_vs_sdpa_default', float('nan')):9.2f} {100 * r['predict']['share_of_cudnn']:7.2f}")
    print("(cuDNN, flash: forced with sdpa_kernel; SDPA: PyTorch's default dispatch)")
    stored = {n: r["dense"] for n, r in results["shapes"].items() if "cudnn_nhd_stored_ms" in r["dense"]}
    if stored:
        print("\nDense, the same values stored (B, N, H, D) (as models pass them) instead of (B, H, N, D)")
        print(f"{'shape':10} {'cuDNN':>8} {'ours':>8} {'cuDNN/ours':>10}")
        for name, d in stored.items():
            print(f"{name:10} {d['cudnn_nhd_stored_ms']:8.2f} {d['ours_nhd_stored_ms']:8.2f} "
                  f"{d['ours_vs_cudnn_nhd_stored']:10.2f}")
    print("\nours: bool mask compacted per call; pre: prebuilt CompactBlockMask (Flex: prebuilt BlockMask)")
    print(f"{'shape':10} {'density':>7} {'ours ms':>8} {'pre ms':>8} {'flex ms':>8} {'flex/ours':>9} "
          f"{'flex/pre':>8} {'x dense':>8} {'x/ideal':>8} {'pre x/id':>8}")
    for name, r in results["shapes"].items():
        for s in r["sparse"]:
            print(f"{name:10} {s['actual_density']:7.3f} {s['ours_ms']:8.3f} {s['ours_prebuilt_ms']:8.3f} "
                  f"{s['flex_ms']:8.3f} {s['ours_vs_flex']:9.2f} {s['prebuilt_vs_flex']:8.2f} "
                  f"{s['speedup_vs_own_dense']:8.2f} {s['speedup_over_ideal']:8.2f} "
                  f"{s['prebuilt_speedup_over_ideal']:8.2f}")
    print(f"\n{'shape':10} {'sparsity':>8} {'rel L1':>8} {'L1 cuDNN':>8} {'ms':>8} {'no-pv ms':>8} {'cuDNN ms':>8} "
          f"{'speedup':>8} {'SDPA ms':>8} {'vs SDPA':>8}")
    for name, r in results["shapes"].items():
        s = r["structured_default"]
        print(f"{name:10} {s['sparsity']:8.3f} {s['relative_l1']:8.4f} {s['relative_l1_cudnn_bf16']:8.4f} "
              f"{s['ms']:8.2f} {s['stage1_only_ms']:8.2f} {s['cudnn_ms']:8.2f} {s['speedup_vs_cudnn']:8.2f} "
              f"{s.get('sdpa_default_ms', float('nan')):8.2f} {s.get('speedup_vs_sdpa_default', float('nan')):8.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(FULL), help="comma-separated, from: " + ", ".join({**FULL, **EXTRA}))
    ap.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    ap.add_argument("--out", default=None)
    ap.add_argument("--timer", choices=("graph", "eager"), default="graph",
                    help="graph: kernel time from CUDA-graph replays (default); eager: plain calls")
    args = ap.parse_args(argv)
    global TIMER
    TIMER = args.timer
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    import triton

    device = "cuda"
    gpu = torch.cuda.get_device_name()
    results = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "timer": TIMER, "graph_fallbacks": GRAPH_FALLBACKS,
               "shapes": {}}
    densities = [float(x) for x in args.densities.split(",") if x]  # "" times the dense modes only
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"attention-{gpu.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for name in args.shapes.split(","):
        results["shapes"][name] = run_shape({**FULL, **EXTRA}[name], densities, device, lambda m: print(m, flush=True))
        write_json(out, results)  # after every shape, so a later failure keeps what was measured
    print_table(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
