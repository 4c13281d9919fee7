"""SDPA calls under a key-padding mask, as diffusers' HunyuanVideo and QwenImage make them (their prompts' text
padding, a boolean (B, 1, 1, N) mask), answered by SpargeProcessor's seam, every figure from one run on one GPU.

Per shape: SDPA under the mask (PyTorch's default dispatch, which is what the model's native processor runs), cuDNN
SDPA forced under the same mask, compiled FlexAttention with the padding as a mask_mod (its BlockMask built once,
outside the timing), and the seam's answer at default thresholds: the mask read back once per call, the kept keys
cut (padding at the end, HunyuanVideo's [video, text] order) or gathered (QwenImage's [text, image] order), then
sparge_attention on them. Before session 50 the seam handed every masked call to SDPA under the mask (the first
column). Random Q/K/V: the default thresholds keep every block, so the figures compare the kernels on the kept
keys, not skipped blocks. Times: wall ms per call with a device sync after each (the seam's read-back rules out CUDA
graphs), median of 20 after 5 warm-up calls, fastest of 3 interleaved rounds. Relative L1 against float32 attention
under the mask on 1024 sampled query rows.

Usage: python benchmarks/key_padding.py [--out results.json]
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
from sparge_diffusers.pipelines import SpargeProcessor, SpargeSettings  # noqa: E402

# (name, heads, image/video tokens, text tokens, of which kept, text first)
SHAPES = [("HunyuanVideo 544x960x61", 24, 16 * 34 * 60, 256, 60, False),
          ("QwenImage 1328x1328", 24, 83 * 83, 256, 60, True)]


def main(argv=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    processor = SpargeProcessor()
    settings = SpargeSettings()
    flex = torch.compile(flex_attention)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "shapes": {}}
    for name, heads, visual, text, kept, text_first in SHAPES:
        n = visual + text
        q, k, v = (torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool, device="cuda")
        first_padding = kept if text_first else visual + kept
        mask[..., first_padding:first_padding + text - kept] = False
        keep = mask[0, 0, 0]

        def keep_mod(b, h, q_idx, kv_idx):
            return keep[kv_idx]

        block_mask = create_block_mask(keep_mod, 1, 1, n, n, device="cuda")

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        variants = {
            "sdpa_masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "cudnn_masked": cudnn,
            "flex": lambda: flex(q, k, v, block_mask=block_mask),
            "ours": lambda: processor._attention("layer", settings, F.scaled_dot_product_attention, q, k, v,
                                                 attn_mask=mask),
        }
        rows = torch.randperm(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))[:1024]
        scores = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) / 128 ** 0.5
        exact = scores.masked_fill(~mask[0], float("-inf")).softmax(-1) @ v.float()  # float32, 1024 sampled rows
        del scores
        row = {"tokens": n, "text": text, "kept_text": kept, "text_first": text_first, "ms": {}, "relative_l1": {}}
        for key, fn in list(variants.items()):
            try:
                row["relative_l1"][key] = relative_l1(fn()[:, :, rows].float(), exact)
            except RuntimeError as e:  # e.g. no cuDNN kernel for this mask
                row["ms"][key] = None
                row["relative_l1"][key] = f"{type(e).__name__}: {str(e)[:80]}"
                del variants[key]
        for _ in range(3):
            for key, fn in variants.items():
                ms = timed(fn, reps=20, warmup=5)
                row["ms"][key] = min(ms, row["ms"].get(key) or ms)
        results["shapes"][name] = row
        print(name, row, flush=True)
    lines = [f"GPU: {results['gpu']} (torch {torch.__version__}); bf16, B 1, D 128, key-padding mask (B, 1, 1, N); "
             "wall ms per call (sync after each), median of 20, fastest of 3 rounds",
             f"{'shape':>26} {'N':>6} {'SDPA+m':>8} {'cuDNN+m':>8} {'flex':>8} {'ours':>8} {'SDPA/ours':>9} "
             f"{'cuDNN/ours':>10} {'flex/ours':>9} {'rel L1 ours':>11}"]
    for name, r in results["shapes"].items():
        ms = r["ms"]

        def cell(key):
            return f"{ms[key]:8.3f}" if ms.get(key) else f"{'-':>8}"

        def ratio(key, width):
            return f"{ms[key] / ms['ours']:{width}.2f}" if ms.get(key) else f"{'-':>{width}}"

        lines.append(f"{name:>26} {r['tokens']:6d} {cell('sdpa_masked')} {cell('cudnn_masked')} {cell('flex')} "
                     f"{cell('ours')} {ratio('sdpa_masked', 9)} {ratio('cudnn_masked', 10)} {ratio('flex', 9)} "
                     f"{r['relative_l1']['ours']:11.4f}")
    lines.append("ours: SpargeProcessor's seam at default thresholds on the kept keys (cut for HunyuanVideo, gathered "
                 "for QwenImage), one mask read-back per call; SDPA+m: what such calls ran before")
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
