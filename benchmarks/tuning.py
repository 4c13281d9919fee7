"""Per-layer tuning (SpargeAttn section 3.6) on structured inputs, checked on held-out seeds.

Six synthetic "layers" at the CogVideoX-2B shape (B=1, H=30, 13x30x45 visual + 226 text tokens, D=64), each
a different setting of the structured generator (local to global heads, weak to strong mean components).
Calibration: seeds 0-2; held out: seeds 100-102 (same generator, other weights and content). Each layer is
tuned with :class:`ThresholdSearch` (the search ``tune`` runs per layer; GPU kernels and their statistics):

* ``tuned``: the paper's budget for video models, l1 = 0.05, l2 = 0.06, per head;
* ``matched``: one setting per layer whose mean calibration L1 is at most the default setting's on that
  layer (l1 = l2 = the default's mean calibration L1, ``per_head=False``, ``aggregate="mean"``). The default
  point (0.6, 0.98, 50) is in the grid, so on the calibration data this is the default or a sparser point at
  equal or lower error; the held-out columns show whether that carries over;
* ``*-nopv``: the same (simthreshd1, cdfthreshd) with stage 2 off (our kernel's PV test costs more time
  than it saves; see kernels.api.PV_TEST_LIMIT).

Held-out figures per layer: sparsity, relative L1 against SDPA (bf16, as the paper uses FlashAttention's
output), and time of the whole method against cuDNN SDPA in the same run.

Usage: python benchmarks/tuning.py [--out results.json]   (a CPU runs a small grid, no timings)
"""

import argparse
import time

import torch
import torch.nn.functional as F

from sparge_diffusers import sparge_attention
from sparge_diffusers.testing import video_like_qkv
from sparge_diffusers.tuning import ThresholdSearch

from _report import save_report

LAYERS = {  # name: (locality of first and last head, mean_q, mean_k)
    "local": ((20.0, 8.0), 1.5, 1.5),
    "mixed": ((14.0, 3.0), 1.5, 1.5),
    "global": ((6.0, 1.5), 1.5, 1.5),
    "weak-mean": ((14.0, 3.0), 0.5, 0.5),
    "strong-mean": ((14.0, 3.0), 3.0, 3.0),
    "very-local": ((30.0, 12.0), 1.5, 1.5),
}
CALIBRATION, HELD_OUT = (0, 1, 2), (100, 101, 102)
DEFAULT = dict(simthreshd1=0.6, cdfthreshd=0.98, pvthreshd=50)


def make(layer, seed, gpu):
    locality, mq, mk = LAYERS[layer]
    shape = dict(grid=(13, 30, 45), heads=30, text=226) if gpu else dict(grid=(2, 16, 16), heads=4, text=16)
    return video_like_qkv(shape["grid"], heads=shape["heads"], head_dim=64, text_tokens=shape["text"],
                          locality=locality, mean_q=mq, mean_k=mk, seed=seed, device="cuda" if gpu else "cpu")


def dense(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def relative_l1(out, ref):
    return float((out.float() - ref.float()).abs().sum() / ref.float().abs().sum())


def evaluate(layer, settings, gpu):
    """Mean held-out sparsity and relative L1 (and worst L1) of one setting on one layer."""
    sp, l1 = [], []
    for seed in HELD_OUT:
        q, k, v = make(layer, seed, gpu)
        out, stats = sparge_attention(q, k, v, return_sparsity=True, **settings)
        sp.append(stats.sparsity)
        l1.append(relative_l1(out, dense(q, k, v)))
    return {"sparsity": sum(sp) / len(sp), "l1": sum(l1) / len(l1), "l1_max": max(l1)}


def settings_of(choice, pv=True):
    return dict(simthreshd1=choice.simthreshd1, cdfthreshd=choice.cdfthreshd,
                pvthreshd=choice.pvthreshd if pv else 50)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    results = {"device": torch.cuda.get_device_name() if gpu else "cpu (reference, small grid)",
               "date": time.strftime("%Y-%m-%d"), "shape": "B=1, H=30, N=17776, D=64" if gpu else "small",
               "calibration_seeds": CALIBRATION, "held_out_seeds": HELD_OUT, "layers": {}}
    for layer in LAYERS:
        t0 = time.time()
        tuned = ThresholdSearch(l1=0.05, l2=0.06)
        default_l1 = []
        for seed in CALIBRATION:  # pass 1: the tuned search's phase 1, and the default's calibration error
            q, k, v = make(layer, seed, gpu)
            ref = dense(q, k, v)
            default_l1.append(relative_l1(sparge_attention(q, k, v, **DEFAULT), ref))
            tuned.observe(q, k, v, ref)
        tuned.finish_stage1()
        budget = sum(default_l1) / len(default_l1) * (1 + 1e-9)  # "L1 < budget" admits the default itself
        matched = ThresholdSearch(l1=budget, l2=budget, per_head=False, aggregate="mean")
        for seed in CALIBRATION:  # pass 2: tuned's phase 2, matched's phase 1
            q, k, v = make(layer, seed, gpu)
            ref = dense(q, k, v)
            tuned.observe(q, k, v, ref)
            matched.observe(q, k, v, ref)
        matched.finish_stage1()
        for seed in CALIBRATION:
            q, k, v = make(layer, seed, gpu)
            matched.observe(q, k, v, dense(q, k, v))
        choices = {"tuned": tuned.result(), "matched": matched.result()}
        configs = {"default": DEFAULT, "tuned": settings_of(choices["tuned"]),
                   "tuned-nopv": settings_of(choices["tuned"], pv=False), "matched": settings_of(choices["matched"]),
                   "matched-nopv": settings_of(choices["matched"], pv=False)}
        row = {"matched_budget": budget, "calibration": {k: c.as_dict() for k, c in choices.items()},
               "settings": configs, "held_out": {name: evaluate(layer, s, gpu) for name, s in configs.items()},
               "tuning_s": time.time() - t0}
        if gpu:
            import triton.testing
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q, k, v = make(layer, HELD_OUT[0], gpu)

            def bench(fn):
                return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v)

            row["cudnn_ms"] = bench(cudnn)
            for name, s in configs.items():
                row["held_out"][name]["ms"] = bench(lambda: sparge_attention(q, k, v, **s))
                row["held_out"][name]["speedup_vs_cudnn"] = row["cudnn_ms"] / row["held_out"][name]["ms"]
        results["layers"][layer] = row
        print(layer, {n: {k: round(x, 4) for k, x in r.items()} for n, r in row["held_out"].items()}, flush=True)

    configs = list(next(iter(results["layers"].values()))["held_out"])
    results["mean"] = {c: {key: sum(r["held_out"][c][key] for r in results["layers"].values()) / len(LAYERS)
                           for key in next(iter(results["layers"].values()))["held_out"][c]} for c in configs}
    lines = [f"# {results['device']}, {results['shape']}; held-out seeds {HELD_OUT}, calibration {CALIBRATION}",
             f"{'layer':12} {'config':13} {'sparsity':>8} {'L1 mean':>8} {'L1 max':>8}" +
             (f" {'ms':>7} {'vs cuDNN':>8}" if gpu else "")]
    for layer, row in list(results["layers"].items()) + [("MEAN", {"held_out": results["mean"]})]:
        for c in configs:
            r = row["held_out"][c]
            line = f"{layer:12} {c:13} {r['sparsity']:8.3f} {r['l1']:8.4f} {r['l1_max']:8.4f}"
            if gpu:
                line += f" {r['ms']:7.2f} {r['speedup_vs_cudnn']:8.2f}"
            lines.append(line)
        if "matched_budget" in row:
            lines.append(f"{'':12} matched budget (default's mean calibration L1) = {row['matched_budget']:.4f}"
                         + (f"; cuDNN {row['cudnn_ms']:.2f} ms" if gpu else ""))
    save_report(results, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
