"""Per-query block selection (NSA's selection branch) with FSA's KV-outer loop, one run on one GPU.

Inputs: sparge_diffusers.testing.llm_like_qkv (local windows, a mild sink and mild vertical key stripes at its
defaults: see its docstring), 32 query heads,
D = 128, bf16, causal, with 32, 8 or 4 K/V heads (GQA groups of 1, 4, 8: FSA's subject is small groups). The
selection is ``select_key_blocks`` (top_k blocks per query token from block-mean keys, sink and own block
forced; its fused Triton kernel, timed against its float32 PyTorch reference on the same GPU, with the share of
rows whose selected set equals the reference's), at FSA's two settings (block 64, top_k 16) and (block 128,
top_k 8). Rows:
- ours: ``selected_block_attention`` whole (index build + KV-outer kernel + merge; in query chunks where the
  partials exceed the default 4 GiB cap, and once more in one piece), prebuilt (the index built once, as a model
  reusing one selection across layers would), and the index build alone;
- query-outer: the vanilla NSA loop order (one program per query token and K/V head, the group's heads padded to
  16 rows, its blocks in the inner loop), a Triton kernel defined here as the paper's baseline;
- FlexAttention with the same selection (mask_mod looks up each query's blocks; its block mask is the union of
  the selections of each 128-query block, so it computes every tile some query of the block chose);
- cuDNN SDPA, dense causal.
Accuracy: relative L1 of our output against exact float32 attention (sampled rows; the selection's error) and
against FlexAttention's and the query-outer kernel's outputs (the same computation: rounding only).

Usage: python benchmarks/fsa.py [--lengths 32768] [--kv-heads 32,8,4] [--settings 64x16,128x8] [--out r.json]
       (--settings 64x64 etc.: larger selections, to see the selection's error fall with density)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402
from attention import bench_rounds  # noqa: E402

from sparge_diffusers import build_selection_index, relative_l1, select_key_blocks  # noqa: E402
from sparge_diffusers import selected_block_attention  # noqa: E402
from sparge_diffusers.testing import llm_like_qkv  # noqa: E402
from sparge_diffusers.workloads import cudnn_attention_fn, sampled_relative_l1  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _query_outer_kernel(Q, K, V, IDX, O, qk_scale, GROUP, HK, q_len, kv_len, top_k,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                        HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Vanilla NSA order: query token outside, its selected blocks inside; the group's heads are the rows."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, hk = bh // HK, bh % HK
    rows = tl.arange(0, G_PAD)
    row_valid = rows < GROUP
    heads = hk * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + n * stride_qn + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    for t in range(top_k):
        block = tl.load(IDX + (bh * q_len + n) * top_k + t)
        if (block >= 0) & (block * BLOCK_N <= n):  # causal; the selection holds no repeats
            keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
            k = tl.load(K + b * stride_kb + hk * stride_kh + keys[:, None] * stride_kn + offs_d[None, :],
                        mask=(keys < kv_len)[:, None], other=0.0)
            v = tl.load(V + b * stride_vb + hk * stride_vh + keys[:, None] * stride_vn + offs_d[None, :],
                        mask=(keys < kv_len)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where((keys <= n)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.math.exp2(m - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + n * stride_on + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=row_valid[:, None])


def query_outer_fn(q, k, v, sel, block):
    B, H, N, D = q.shape
    HK = k.shape[1]
    out = torch.empty_like(q)
    grid = (N, B * HK)
    group = H // HK

    def run():
        _query_outer_kernel[grid](q, k, v, sel, out, D ** -0.5 * LOG2E, group, HK, N, N, sel.shape[-1],
                                  q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                  v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                  HEAD_DIM=D, G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block,
                                  num_warps=4, num_stages=2)
        return out
    return run


def flex_selection_fn(q, k, v, sel, block):
    """FlexAttention computing exactly the selection: tiles = union of the selections of each 128-query block."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    B, H, N, _ = q.shape
    HK = k.shape[1]
    group = H // HK
    n_blocks = triton.cdiv(N, block)
    chosen = torch.zeros(B, HK, N, n_blocks + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(sel >= 0, sel, n_blocks).long(), True)
    chosen = chosen[..., :n_blocks].contiguous()
    nq = triton.cdiv(N, 128)
    padded = torch.nn.functional.pad(chosen, (0, 0, 0, nq * 128 - N))
    union = padded.view(B, HK, nq, 128, n_blocks).any(3).repeat_interleave(group, 1)  # (B, H, nq, NB)
    count = union.sum(-1).to(torch.int32)
    index = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).to(torch.int32)

    def selection_mod(b, h, q_idx, kv_idx):
        return chosen[b, h // group, q_idx, kv_idx // block] & (q_idx >= kv_idx)

    block_mask = BlockMask.from_kv_blocks(count.contiguous(), index.contiguous(), BLOCK_SIZE=(128, block),
                                          mask_mod=selection_mod, seq_lengths=(N, N))
    compiled = torch.compile(flex_attention, dynamic=False)
    options = {"BLOCK_M": 128, "BLOCK_N": 64}
    tiles = float(union.sum()) / (B * H)
    return (lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=group > 1, kernel_options=options)), tiles


def run_cell(n, kv_heads, block, top_k, log):
    q, k, v = llm_like_qkv(n, heads=32, kv_heads=kv_heads, head_dim=128, device="cuda", seed=0)
    sel = select_key_blocks(q, k, top_k=top_k, block_size=block)
    index = build_selection_index(sel, q_len=n, kv_len=n, block_size=block, is_causal=True)
    pairs = int((index.slot >= 0).sum())
    causal_pairs = n * (n + 1) / 2 * q.shape[0] * kv_heads
    fns = {
        "cudnn": cudnn_attention_fn(q, k, v, True),
        "select": lambda: select_key_blocks(q, k, top_k=top_k, block_size=block),
        "select_reference": lambda: select_key_blocks(q, k, top_k=top_k, block_size=block, backend="reference"),
        "index": lambda: build_selection_index(sel, q_len=n, kv_len=n, block_size=block, is_causal=True),
        "whole": lambda: selected_block_attention(q, k, v, sel, block_size=block, validate=False),
        "whole_one_piece": lambda: selected_block_attention(q, k, v, sel, block_size=block, validate=False,
                                                            max_partial_bytes=1 << 50),
        "prebuilt": lambda: selected_block_attention(q, k, v, index, block_size=block),
        "query_outer": query_outer_fn(q, k, v, sel, block),
    }
    cell = {"N": n, "heads": 32, "kv_heads": kv_heads, "group": 32 // kv_heads, "block": block, "top_k": top_k}
    ref_sel = fns["select_reference"]()
    cell["select_same_set_rows"] = float((sel.sort(-1).values == ref_sel.sort(-1).values).all(-1).float().mean())
    del ref_sel
    try:
        fns["flex"], tiles = flex_selection_fn(q, k, v, sel, block)
        fns["flex"]()  # compile outside the timed rounds
        cell["flex_tile_density"] = tiles / (triton.cdiv(n, 128) * triton.cdiv(n, block) / 2)
    except Exception as e:  # report, never hide
        fns.pop("flex", None)
        log(f"  flex failed: {type(e).__name__}: {str(e)[:300]}")
    ours = fns["whole"]().float()
    cell["token_density"] = pairs * block / causal_pairs  # upper bound: a selected block's keys, all visible
    cell["relative_l1_vs_exact"] = sampled_relative_l1(fns["whole"](), q, k, v, True)
    cell["relative_l1_vs_query_outer"] = relative_l1(ours, fns["query_outer"]().float())
    if "flex" in fns:
        cell["relative_l1_vs_flex"] = relative_l1(ours, fns["flex"]().float())
    del ours
    times, spread = bench_rounds(fns)
    cell.update({f"{name}_ms": t for name, t in times.items()})
    cell["spread"] = spread
    cell["select_reference_vs_select"] = times["select_reference"] / times["select"]
    cell["select_share_of_cudnn"] = times["select"] / times["cudnn"]
    for name in ("cudnn", "flex", "query_outer"):
        if name in times:
            cell[f"{name}_vs_prebuilt"] = times[name] / times["prebuilt"]
            cell[f"{name}_vs_whole"] = times[name] / times["whole"]
    log(f"N={n} kv_heads={kv_heads} block={block} top_k={top_k}: " +
        " ".join(f"{name} {t:.3f}" for name, t in times.items()) +
        f" L1 exact {cell['relative_l1_vs_exact']:.4f} vs flex {cell.get('relative_l1_vs_flex', float('nan')):.2e}"
        f" vs query-outer {cell['relative_l1_vs_query_outer']:.2e}")
    return cell


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--kv-heads", default="32,8,4")
    ap.add_argument("--settings", default="64x16,128x8", help="block x top_k pairs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fsa.py needs a CUDA GPU")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "cells": []}
    for n in map(int, args.lengths.split(",")):
        for kv in map(int, args.kv_heads.split(",")):
            for setting in args.settings.split(","):
                block, top_k = map(int, setting.split("x"))
                results["cells"].append(run_cell(n, kv, block, top_k, lambda m: print(m, flush=True)))
    nan = float("nan")
    lines = [f"GPU: {results['gpu']} (torch {results['torch']}, Triton {results['triton']}); llm_like_qkv, 32 q heads, "
             "D = 128, bf16, causal; ms = fastest of 3 rounds of CUDA-graph medians; x = other / ours (prebuilt)",
             f"{'N':>6} {'g':>2} {'blk':>4} {'k':>3} {'tok dens':>8} {'flex tiles':>10} {'L1':>6} {'select':>7} "
             f"{'sel ref':>7} {'same':>6} "
             f"{'index':>6} {'whole':>7} {'1 piece':>7} {'prebuilt':>8} {'q-outer':>7} {'x':>5} {'flex':>7} {'x':>5} "
             f"{'cuDNN':>7} {'x':>5}"]
    for c in results["cells"]:
        lines.append(f"{c['N']:6d} {c['group']:2d} {c['block']:4d} {c['top_k']:3d} {c['token_density']:8.3f} "
                     f"{c.get('flex_tile_density', nan):10.3f} {c['relative_l1_vs_exact']:6.3f} {c['select_ms']:7.3f} "
                     f"{c['select_reference_ms']:7.2f} {c['select_same_set_rows']:6.4f} {c['index_ms']:6.3f} "
                     f"{c['whole_ms']:7.3f} {c['whole_one_piece_ms']:7.3f} {c['prebuilt_ms']:8.3f} "
                     f"{c['query_outer_ms']:7.3f} {c['query_outer_vs_prebuilt']:5.2f} {c.get('flex_ms', nan):7.3f} "
                     f"{c.get('flex_vs_prebuilt', nan):5.2f} {c['cudnn_ms']:7.3f} {c['cudnn_vs_prebuilt']:5.2f}")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
