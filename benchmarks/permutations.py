"""Token permutations: the columns of the SpargeAttn paper's Table 9 (appendix A.1) and their cost.

For structured inputs shaped like CogVideoX and Mochi, and each order (random, rowmajor, colmajor,
timemajor, hilbert), at the default thresholds: Sim-q (128-token blocks), Sim-k (64-token blocks), relative
L1 against exact float32 attention (2048 sampled query rows) and sparsity. On the GPU also the time of the
permutation (q, k, v) plus the inverse (output) against cuDNN SDPA at the Mochi shape, in the same run.

Usage: python benchmarks/permutations.py [--out results.json]   (a CPU runs small grids, no timings)
"""

import argparse
import os
import time

import torch

from sparge_diffusers import sparge_attention
from sparge_diffusers._json import write_json
from sparge_diffusers.permutations import block_self_similarity, permuted, visual_token_permutation
from sparge_diffusers.testing import video_like_qkv
from sparge_diffusers.workloads import sampled_relative_l1

ORDER_LIST = ["random", "rowmajor", "colmajor", "timemajor", "hilbert"]
FULL = {"cogvideox": ((13, 30, 45), 226, 2, 30, 64), "mochi": ((28, 30, 53), 256, 1, 24, 128)}
SMALL = {"cogvideox": ((4, 12, 16), 32, 1, 2, 64), "mochi": ((4, 12, 16), 32, 1, 2, 128)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    results = {"device": torch.cuda.get_device_name() if gpu else "cpu (reference, small grids)",
               "date": time.strftime("%Y-%m-%d"), "thresholds": "defaults (0.6, 0.98, 50)", "workloads": {}}
    for name, (grid, text, batch, heads, dim) in (FULL if gpu else SMALL).items():
        q, k, v = video_like_qkv(grid, batch=batch, heads=heads, head_dim=dim, text_tokens=text, device=device)
        rows = {}
        for order in ORDER_LIST:
            p = visual_token_permutation(grid, order, text_before=text, device=device)
            out, stats = permuted(sparge_attention, p)(q, k, v, return_sparsity=True)
            rows[order] = {"sim_q": float(block_self_similarity(p.apply(q), 128).mean()),
                           "sim_k": float(block_self_similarity(p.apply(k), 64).mean()),
                           "relative_l1": sampled_relative_l1(out, q, k, v, False),
                           "sparsity": stats.sparsity}
            print(name, order, {k_: round(v_, 4) for k_, v_ in rows[order].items()}, flush=True)
        results["workloads"][name] = {"shape": [batch, heads, q.shape[2], dim], "grid": grid, "orders": rows}
        if gpu and name == "mochi":
            import triton.testing
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            p = visual_token_permutation(grid, "hilbert", text_before=text, device=device)
            out = torch.empty_like(q)

            def permute_and_restore():
                p.apply(q), p.apply(k), p.apply(v)
                p.restore(out)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v)

            t_perm = triton.testing.do_bench(permute_and_restore, return_mode="median")
            t_cudnn = triton.testing.do_bench(cudnn, return_mode="median")
            results["permutation_cost"] = {"shape": "mochi", "permute_and_restore_ms": t_perm,
                                           "cudnn_ms": t_cudnn, "share": t_perm / t_cudnn}
        del q, k, v
    print(f"\n{results['device']}; thresholds {results['thresholds']}")
    print(f"{'workload':10} {'order':10} {'Sim-q':>7} {'Sim-k':>7} {'L1':>7} {'sparsity':>8}")
    for name, w in results["workloads"].items():
        for order, r in w["orders"].items():
            print(f"{name:10} {order:10} {r['sim_q']:7.3f} {r['sim_k']:7.3f} {r['relative_l1']:7.4f} "
                  f"{r['sparsity']:8.3f}")
    if "permutation_cost" in results:
        c = results["permutation_cost"]
        print(f"\npermute q,k,v + restore output at the Mochi shape: {c['permute_and_restore_ms']:.3f} ms = "
              f"{100 * c['share']:.2f}% of cuDNN SDPA ({c['cudnn_ms']:.2f} ms)")
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   "permutations-" + results["device"].split(" (")[0].replace(" ", "_") + ".json")
    write_json(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
