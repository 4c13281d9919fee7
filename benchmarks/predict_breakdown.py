"""Time each launch of stage 1 (block statistics, compressed scores, TopCdf) separately.

Usage: python benchmarks/predict_breakdown.py  (prints one line per shape and part)
"""

import torch
import triton
import triton.testing

from sparge_diffusers import predict_block_mask
from sparge_diffusers.kernels import predict as P
from sparge_diffusers.kernels._inputs import BLOCK_K, BLOCK_Q, check_attention_inputs


def bench(fn):
    return triton.testing.do_bench(fn, return_mode="median")


for name, (B, H, HK, N, D, causal) in {"cogvideox": (2, 30, 30, 17776, 64, False),
                                        "mochi": (1, 24, 24, 44776, 128, False),
                                        "llama32k": (1, 32, 8, 32768, 128, True)}.items():
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HK, N, D, device="cuda", dtype=torch.bfloat16) + 1
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=causal)
    nq, nk = shape.q_blocks, shape.k_blocks
    qm, qs = P.block_statistics_triton(q, BLOCK_Q)
    km, ks = P.block_statistics_triton(k, BLOCK_K)
    scores = torch.empty(B, H, nq, nk, device="cuda")
    theta = torch.full((H,), 0.6, device="cuda")
    tau = torch.full((H,), 0.98, device="cuda")
    parts = {
        "total": lambda: predict_block_mask(q, k, is_causal=causal),
        "stats_q": lambda: P.block_statistics_triton(q, BLOCK_Q),
        "stats_k": lambda: P.block_statistics_triton(k, BLOCK_K),
        "matmul_torch": lambda: torch.matmul(qm, km.repeat_interleave(H // HK, 1).transpose(-1, -2)),
    }
    for prec in ("ieee", "tf32"):
        for tile in (32, 64):
            def scores_fn(prec=prec, tile=tile):
                P._compressed_scores_kernel[(triton.cdiv(nq, tile), triton.cdiv(nk, tile), B * H)](
                    qm, km, scores, H, H // HK, nq, nk, 0.1, HEAD_DIM=D, D_PAD=D, TILE=tile, PRECISION=prec,
                    num_warps=4)
            parts[f"scores_{prec}_{tile}"] = scores_fn
    nk_pad = max(triton.next_power_of_2(nk), 16)
    for rows in (1, 4, 16):
        for warps in (4, 8):
            mask = torch.empty(B, H, nq, nk, device="cuda", dtype=torch.int8)
            index = torch.empty(B, H, nq, nk, device="cuda", dtype=torch.int32)
            count = torch.empty(B, H, nq, device="cuda", dtype=torch.int32)
            nfull = torch.empty_like(count)

            def topcdf(rows=rows, warps=warps, mask=mask, index=index, count=count, nfull=nfull):
                P._topcdf_block_mask_kernel[(triton.cdiv(nq, rows), B * H)](
                    scores, qs, ks, theta, tau, mask, index, count, nfull, H, H // HK, nq, nk, N,
                    ROWS=rows, NK_PAD=nk_pad, IS_CAUSAL=causal, SINK=False, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
                    BITS_ABOVE_ONE=P._BITS_ABOVE_ONE, num_warps=warps)
            parts[f"topcdf_rows{rows}_w{warps}"] = topcdf
    for part, fn in parts.items():
        print(f"{name:10} {part:22} {bench(fn):8.3f} ms", flush=True)
