"""Try launch settings (num_warps, num_stages) of the attention kernel, dense and at density 0.25.

Usage: python benchmarks/launch_sweep.py   (prints one line per setting; writes nothing)
"""

import torch
import triton.testing

from sparge_diffusers import block_sparse_attention
from sparge_diffusers.kernels import attention as attention_module

for N, H, D in ((44776, 24, 128), (17776, 30, 64)):
    q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(1, H, -(-N // 128), -(-N // 64), device="cuda") < 0.25
    flops = 4 * H * N * N * D
    for warps in (4, 8):
        for stages in (2, 3, 4):
            attention_module.LAUNCH_OVERRIDE = {"num_warps": warps, "num_stages": stages}
            try:
                dense = triton.testing.do_bench(lambda: block_sparse_attention(q, k, v, None), return_mode="median")
                sparse = triton.testing.do_bench(lambda: block_sparse_attention(q, k, v, mask), return_mode="median")
                print(f"N={N} D={D} warps={warps} stages={stages}: dense {dense:.2f} ms "
                      f"({flops / dense / 1e9:.0f} TFLOP/s), density 0.25 {sparse:.2f} ms", flush=True)
            except Exception as e:
                print(f"N={N} D={D} warps={warps} stages={stages}: failed {type(e).__name__}: {e}", flush=True)
    attention_module.LAUNCH_OVERRIDE = None
