"""What dense warm-up steps cost a torch.compile'd model (GPU; full-size transformer, random weights, bf16).

With ``dense_steps > 0`` a compiled SpargeProcessor counts steps inside the graph (CPU tensors) and calls the
switching operator ``sparge_diffusers::sparge_attention_or_exact``, which inductor keeps out of CUDA graphs under
``mode="reduce-overhead"``. This times one sparse step (aggressive settings, simthreshd1=-1, cdfthreshd=0.9) of the
compiled model with dense_steps=0 (the plain operator) and dense_steps=1 (after the warm-up: the same timestep
repeats, so the count says sparse), per mode, and the compiled output's relative L1 against the eager one.

Usage: python benchmarks/compile_dense_steps.py [cogvideox|flux|sd3|mochi] [MODE:DENSE_STEPS,...]
       (default configs: default:0,default:1,reduce-overhead:0,reduce-overhead:1; writes
       $OUT or . / compile-dense-steps-<model>.json)
"""
import os
import sys
import time

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import timed  # noqa: E402
from pipelines import build_on_gpu  # noqa: E402

from sparge_diffusers._json import write_json  # noqa: E402
from sparge_diffusers.pipelines import SpargeSettings, apply  # noqa: E402


CONFIGS = "default:0,default:1,reduce-overhead:0,reduce-overhead:1"


def relative_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else "cogvideox"
    configs = [c.split(":") for c in (argv[1] if len(argv) > 1 else CONFIGS).split(",")]
    model, inputs, _ = build_on_gpu(name)
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": name, "rows": []}
    with torch.no_grad():
        eager_dense = model(**inputs, return_dict=False)[0].clone()
        for mode, dense_steps in configs:
            dense_steps = int(dense_steps)
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
    out = os.path.join(os.environ.get("OUT", "."), f"compile-dense-steps-{name}.json")
    write_json(out, results)
    print(f"{results['gpu']}, {name}")
    print(f"{'mode':16} {'dense_steps':>11} {'step ms':>8} {'compile s':>9} {'L1 vs eager':>11} {'partitions':>10}")
    for r in results["rows"]:
        print(f"{r['mode']:16} {r['dense_steps']:11d} {r['step_ms']:8.1f} {r['compile_s']:9.0f} "
              f"{r['l1_vs_eager_sparse']:11.4f} {r['cudagraph_partitions']:10}")


if __name__ == "__main__":
    main()
