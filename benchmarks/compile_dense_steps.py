"""What dense warm-up steps cost a torch.compile'd model (GPU; full-size transformer, random weights, bf16).

With ``dense_steps > 0`` a compiled SpargeProcessor counts steps inside the graph (CPU tensors) and calls the
switching operator ``sparge_diffusers::sparge_attention_or_exact``, which inductor keeps out of CUDA graphs under
``mode="reduce-overhead"``. This times one sparse step (aggressive settings, simthreshd1=-1, cdfthreshd=0.9) of the
compiled model with dense_steps=0 (the plain operator) and dense_steps=1 (after the warm-up: the same timestep
repeats, so the count says sparse), per mode, and the compiled output's relative L1 against the eager one.

Usage: python benchmarks/compile_dense_steps.py [cogvideox|flux|sd3|mochi] [MODE:DENSE_STEPS,...] [--out FILE]
       (default configs: default:0,default:1,reduce-overhead:0,reduce-overhead:1; writes --out, else
       $OUT or . / compile-dense-steps-<model>.json)
"""
import argparse
import os
import sys
import time

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import timed  # noqa: E402
from pipelines import MODELS, build_on_gpu  # noqa: E402

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers._json import write_json  # noqa: E402
from sparge_diffusers.pipelines import SpargeSettings, apply  # noqa: E402


CONFIGS = "default:0,default:1,reduce-overhead:0,reduce-overhead:1"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="cogvideox", choices=sorted(MODELS))
    ap.add_argument("configs", nargs="?", default=CONFIGS, help="MODE:DENSE_STEPS,... (MODE: a torch.compile mode)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        args.configs = [(mode, int(steps)) for mode, steps in (c.split(":") for c in args.configs.split(","))]
    except ValueError:
        ap.error(f"configs must be MODE:DENSE_STEPS,... (e.g. {CONFIGS}), got {args.configs!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    name, configs = args.model, args.configs
    model, inputs, _ = build_on_gpu(name)
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": name, "rows": []}
    with torch.no_grad():
        eager_dense = model(**inputs, return_dict=False)[0].clone()
        for mode, dense_steps in configs:
            processor = apply(model, SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.9), dense_steps=dense_steps)
            for _ in range(dense_steps + 1):  # eager steps past the warm-up: the last one is sparse
                eager_sparse = model(**inputs, return_dict=False)[0].clone()
            torch._dynamo.reset()
            counters.clear()
            fn = torch.compile(model, fullgraph=True, mode=None if mode == "default" else mode)
            start = time.perf_counter()
            fn(**inputs, return_dict=False)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            ms = timed(lambda: fn(**inputs, return_dict=False)[0], reps=7, warmup=3)
            out = fn(**inputs, return_dict=False)[0].clone()
            row = {"mode": mode, "dense_steps": dense_steps, "step_ms": ms, "compile_s": compile_s,
                   "l1_vs_eager_sparse": relative_l1(out, eager_sparse),
                   "l1_vs_eager_dense": relative_l1(out, eager_dense),
                   "cudagraph_partitions": counters["inductor"].get("cudagraph_partitions", 0),
                   "cudagraph_skips": dict(counters["inductor"].get("cudagraph_skips", {}) or {})}
            results["rows"].append(row)
            print(row, flush=True)
            processor.detach(model)
            del fn
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"compile-dense-steps-{name}.json")
    write_json(out, results)
    print(f"{results['gpu']}, {name}")
    print(f"{'mode':16} {'dense_steps':>11} {'step ms':>8} {'compile s':>9} {'L1 vs eager':>11} {'partitions':>10}")
    for r in results["rows"]:
        print(f"{r['mode']:16} {r['dense_steps']:11d} {r['step_ms']:8.1f} {r['compile_s']:9.0f} "
              f"{r['l1_vs_eager_sparse']:11.4f} {r['cudagraph_partitions']:10}")


if __name__ == "__main__":
    main()
