"""Where the time goes at low density: kernel time against the number of kept key blocks per query block.

Every query block keeps exactly ``c`` key blocks at random positions (c = 1, 2, 4, ..., all). For our kernel
(given a prebuilt CompactBlockMask) and compiled FlexAttention (given the same mask as a prebuilt BlockMask)
it reports the time per c, a least-squares line ``ms = fixed + per_block * c`` over the even c (an odd c
ends our kernel's rows on a partly used stage: c = 1 on a half-masked 128-key stage, larger odd c on a 64-key
stage), and the speedup over the same method's dense run as a fraction of the ideal 1/density. Beside them,
from the same run: cuDNN SDPA and our dense mode, and the HBM floor: the bytes of Q, K, V and O each moved
once, over the bandwidth of a device-to-device copy measured here. A kernel whose ``fixed`` is large next to
``per_block * c`` cannot reach 1/density at small c however fast its inner loop is.

At c = 8 (``LAYOUT_C``) it also times two other layouts of the same count: ``shared`` (every query block of a
head keeps the same c key blocks, so only c/nk of each head's K/V comes from HBM) and ``band`` (each query
block keeps the c key blocks around its own position, a local window: every K/V block is touched, by
neighbouring query blocks). Against the random layout they separate the cost of K/V traffic from the
fixed costs.

Beside each c it times dense attention on the equal-work problem (``equal_work_shape``): the same query rows
and head dim, each row attending to 64 c keys, so the same FLOPs, the same bytes of Q and O and, at the HBM
floor, of K and V, and the same tiles of 128 rows by c / 2 stages of 128 keys as our kernel's walk of a random
c-block mask, but with contiguous keys and no mask. cuDNN SDPA's and our dense mode's x/ideal there (against
their own times on the full shape, ideal = the FLOP ratio) say how much of 1/density dense kernels keep when a
tile holds only c / 2 stages: a bound that has nothing to do with the mask.

Usage: python benchmarks/tile_cost.py [--shapes flux,mochi] [--out benchmarks/results/tile-cost-H100.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402
from attention import bench_rounds, flex_fn, sdpa_fn  # noqa: E402

from sparge_diffusers import block_sparse_attention, compact_block_mask  # noqa: E402
from sparge_diffusers.kernels._inputs import check_attention_inputs  # noqa: E402
from sparge_diffusers.workloads import FULL  # noqa: E402


def exact_block_mask(B, H, nq, nk, c, device, seed=0):
    """(B, H, nq, nk) bool mask keeping exactly c random key blocks in every query block."""
    g = torch.Generator(device=device).manual_seed(seed)
    score = torch.rand(B, H, nq, nk, generator=g, device=device)
    return score >= score.topk(c, dim=-1).values[..., -1:]


LAYOUT_C = 8


def layout_block_masks(B, H, nq, nk, c, device, seed=1) -> dict[str, torch.Tensor]:
    """(B, H, nq, nk) bool masks keeping exactly c key blocks in every query block: ``shared`` (one random set
    per head, the same for every query block) and ``band`` (the c blocks around query block i's position
    i * nk / nq, clamped into the row)."""
    g = torch.Generator(device=device).manual_seed(seed)
    score = torch.rand(B, H, 1, nk, generator=g, device=device)
    shared = (score >= score.topk(c, dim=-1).values[..., -1:]).expand(B, H, nq, nk).contiguous()
    first = (torch.arange(nq, device=device) * nk // nq - c // 2).clamp(0, nk - c)
    cols = torch.arange(nk, device=device)
    band = (cols[None, :] >= first[:, None]) & (cols[None, :] < first[:, None] + c)
    return {"shared": shared, "band": band.expand(B, H, nq, nk).contiguous()}


def time_mask(q, k, v, mask, shape, log, label):
    """Fastest-round ms of ours (prebuilt CompactBlockMask) and compiled Flex (prebuilt BlockMask) on one mask."""
    compact = compact_block_mask(mask, q, k)
    fns = {"ours": lambda: block_sparse_attention(q, k, v, compact)}
    try:
        fns["flex"] = flex_fn(q, k, v, mask, False, shape)
        fns["flex"]()  # compile outside the timed rounds
    except Exception as e:  # report, never hide
        log(f"  flex failed at {label}: {type(e).__name__}: {e}")
    t, spread = bench_rounds(fns)
    return t["ours"], t.get("flex", float("nan")), spread


def equal_work_shape(B, H, N, c) -> tuple[int, int]:
    """(heads, keys) of the dense problem doing the work of a c-block walk at (B, H, N): N' = 64 c keys per
    query row and (about) the same B * H * N query rows, in one batch of H' = B * H * N / N' heads."""
    keys = 64 * c
    return max(1, round(B * H * N / keys)), keys


def time_equal_work(B, H, N, D, c, device):
    """Fastest-round ms of cuDNN SDPA and our dense mode on ``equal_work_shape`` (as many K/V heads as query
    heads: the shapes run here have no GQA) and the FLOP ratio to the full (B, H, N) problem."""
    heads, keys = equal_work_shape(B, H, N, c)
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(1, heads, keys, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    t, _ = bench_rounds({"cudnn": sdpa_fn(q, k, v, False, "cudnn"),
                         "ours": lambda: block_sparse_attention(q, k, v, None)})
    return t["cudnn"], t["ours"], heads * keys * keys / (B * H * N * N), heads, keys


def copy_bandwidth(nbytes: int, device) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_rounds({"copy": lambda: dst.copy_(src)})[0]["copy"]
    return 2 * nbytes / (ms * 1e-3)


def fit_line(cs, ms):
    """Least squares ms = fixed + per_block * c."""
    n = len(cs)
    mc, mm = sum(cs) / n, sum(ms) / n
    slope = sum((c - mc) * (m - mm) for c, m in zip(cs, ms)) / sum((c - mc) ** 2 for c in cs)
    return mm - slope * mc, slope


def run_shape(w, device, log):
    B, H, HK, N, D = w.batch, w.heads, w.kv_heads, w.seq_len, w.head_dim
    if w.causal:
        raise SystemExit(f"{w.name}: tile_cost.py takes non-causal shapes (exact c per query block)")
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, h, N, D, device=device, dtype=torch.bfloat16, generator=g) for h in (H, HK, HK))
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=False)
    nq, nk = shape.q_blocks, shape.k_blocks
    t, _ = bench_rounds({"cudnn": sdpa_fn(q, k, v, False, "cudnn"),
                         "ours_dense": lambda: block_sparse_attention(q, k, v, None)})
    tensor_bytes = q.numel() * q.element_size()
    bandwidth = copy_bandwidth(tensor_bytes, device)
    floor_ms = (2 * tensor_bytes + 2 * k.numel() * k.element_size()) / bandwidth * 1e3  # Q, O, K, V once
    res = {"shape": {"B": B, "H": H, "H_kv": HK, "N": N, "D": D, "q_blocks": nq, "k_blocks": nk},
           "cudnn_ms": t["cudnn"], "ours_dense_ms": t["ours_dense"], "copy_TBps": bandwidth / 1e12,
           "hbm_floor_ms": floor_ms, "rows": []}
    cs = sorted({1, 2, 4, 8, 16, nk // 4 * 2, nk})  # nk // 4 * 2: about half the blocks, an even count
    for c in cs:
        ours, flex, spread = time_mask(q, k, v, exact_block_mask(B, H, nq, nk, c, device), shape, log, f"c={c}")
        eq_cudnn, eq_ours, eq_flops, eq_heads, eq_keys = time_equal_work(B, H, N, D, c, device)
        res["rows"].append({"c": c, "density": c / nk, "ours_ms": ours, "flex_ms": flex, "round_spread": spread,
                            "equal_work": {"heads": eq_heads, "keys": eq_keys, "flop_ratio": eq_flops,
                                           "cudnn_ms": eq_cudnn, "ours_dense_ms": eq_ours,
                                           "cudnn_x_ideal": t["cudnn"] / eq_cudnn * eq_flops,
                                           "ours_dense_x_ideal": t["ours_dense"] / eq_ours * eq_flops}})
        log(f"{w.name} c={c}: ours {ours * 1e3:.1f} us, flex {flex * 1e3:.1f} us; equal work (H={eq_heads}, "
            f"N={eq_keys}) cuDNN {eq_cudnn * 1e3:.1f} us, ours dense {eq_ours * 1e3:.1f} us")
    res["layouts"] = []
    if LAYOUT_C < nk:
        for layout, mask in layout_block_masks(B, H, nq, nk, LAYOUT_C, device).items():
            ours, flex, spread = time_mask(q, k, v, mask, shape, log, layout)
            res["layouts"].append({"layout": layout, "c": LAYOUT_C, "density": LAYOUT_C / nk, "ours_ms": ours,
                                   "flex_ms": flex, "round_spread": spread})
            log(f"{w.name} {layout} c={LAYOUT_C}: ours {ours * 1e3:.1f} us, flex {flex * 1e3:.1f} us")
    even = [r for r in res["rows"] if r["c"] % 2 == 0]
    for method in ("ours", "flex"):
        fixed, per_block = fit_line([r["c"] for r in even], [r[f"{method}_ms"] for r in even])
        res[f"{method}_fit"] = {"fixed_ms": fixed, "per_block_ms": per_block}
    dense = {"ours": t["ours_dense"], "flex": res["rows"][-1]["flex_ms"]}  # Flex keeping every block
    for r in res["rows"] + res["layouts"]:
        for method in ("ours", "flex"):
            r[f"{method}_x_ideal"] = dense[method] / r[f"{method}_ms"] * r["density"]
    del q, k, v
    torch.cuda.empty_cache()
    return res


def format_table(results) -> str:
    lines = [f"GPU: {results['gpu']}  (torch {results['torch']}, triton {results['triton']}); bf16; "
             f"{results['date']};",
             "each time the fastest of 3 interleaved rounds of medians over CUDA-graph replays "
             "(benchmarks/attention.py's",
             "timer); c = kept key blocks (64 keys) per query block (128 rows), at random positions; ours given a "
             "prebuilt",
             "CompactBlockMask, Flex a prebuilt BlockMask of the same mask; x/ideal = (that method's dense ms / ms) "
             "x density,",
             "Flex's dense = Flex keeping every block. eq: dense attention on the equal-work problem (H' heads of",
             "N' = 64 c keys, the same query rows: same FLOPs, bytes and tiles, no mask), x/ideal against the method's",
             "own time on the full shape with ideal = the FLOP ratio."]
    for name, r in results["shapes"].items():
        s = r["shape"]
        lines += ["", f"{name} (B={s['B']}, H={s['H']}, N={s['N']}, D={s['D']}; {s['q_blocks']} x {s['k_blocks']} "
                  f"blocks): cuDNN {r['cudnn_ms']:.3f} ms, ours dense {r['ours_dense_ms']:.3f} ms; "
                  f"HBM floor {r['hbm_floor_ms']:.3f} ms "
                  f"(Q, K, V, O once at {r['copy_TBps']:.2f} TB/s copy bandwidth)",
                  f"{'c':>4} {'density':>8} {'ours us':>8} {'flex us':>8} {'flex/ours':>9} {'ours x/id':>9} "
                  f"{'flex x/id':>9} | {'eq H x N':>11} {'cuDNN us':>8} {'dense us':>8} {'cuDNN x/id':>10} "
                  f"{'dense x/id':>10}"]
        for row in r["rows"]:
            eq = row["equal_work"]
            lines.append(f"{row['c']:4d} {row['density']:8.3f} {row['ours_ms'] * 1e3:8.1f} {row['flex_ms'] * 1e3:8.1f} "
                         f"{row['flex_ms'] / row['ours_ms']:9.2f} {row['ours_x_ideal']:9.2f} {row['flex_x_ideal']:9.2f}"
                         f" | {eq['heads']:>5} x {eq['keys']:<5d} {eq['cudnn_ms'] * 1e3:8.1f} "
                         f"{eq['ours_dense_ms'] * 1e3:8.1f} {eq['cudnn_x_ideal']:10.2f} "
                         f"{eq['ours_dense_x_ideal']:10.2f}")
        if r["layouts"]:
            lines += [f"c = {r['layouts'][0]['c']} by layout (random: the row above; shared: the same blocks for "
                      "every query block of a head; band: a local window)",
                      f"{'layout':>8} {'ours us':>8} {'flex us':>8} {'flex/ours':>9} {'ours x/id':>9} {'flex x/id':>9}"]
            for row in r["layouts"]:
                lines.append(f"{row['layout']:>8} {row['ours_ms'] * 1e3:8.1f} {row['flex_ms'] * 1e3:8.1f} "
                             f"{row['flex_ms'] / row['ours_ms']:9.2f} {row['ours_x_ideal']:9.2f} "
                             f"{row['flex_x_ideal']:9.2f}")
        for method in ("ours", "flex"):
            f = r[f"{method}_fit"]
            lines.append(f"{method:5} fit over even c: fixed {f['fixed_ms'] * 1e3:.1f} us + "
                         f"{f['per_block_ms'] * 1e3:.2f} us per kept block per query block")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="flux")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tile_cost.py needs a CUDA GPU")
    import triton

    gpu = torch.cuda.get_device_name()
    results = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    for name in args.shapes.split(","):
        results["shapes"][name] = run_shape(FULL[name], "cuda", lambda m: print(m, flush=True))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"tile-cost-{gpu.replace(' ', '_')}.json")
    save_report(results, format_table(results), out)


if __name__ == "__main__":
    main()
