"""One denoising step of each diffusers transformer at full size (random weights, built on the GPU), native
SDPA against SpargeProcessor, in one run on one GPU.

Reports per model: step time dense and sparse (default thresholds, and an aggressive setting; eager steps timed
in rounds that interleave dense and the settings, each reported as its fastest round), the attention share of the
dense step (SDPA calls of the step, timed alone), sparsity, and the relative L1 of the step's output against the
dense step. Also the GPU time of one step (its kernels' summed durations, torch.profiler):
where it falls well short of the step's wall time, the step waits on the host (Python and kernel launches),
and attention that is cheaper on the GPU cannot shorten it; the models named by --graphs are also timed as
CUDA-graph replays, which take the host out, and those named by --compile as torch.compile'd models (inductor,
default mode, fullgraph: SpargeProcessor's attention is one custom-operator node), each setting compiled anew.
Random weights give little attention structure: sparsity here says little about real checkpoints; the timings
show what a given sparsity buys.

Usage: python benchmarks/pipelines.py [--models flux,sd3,cogvideox,mochi] [--graphs flux,sd3] [--compile flux,sd3]
                                     [--eager-rounds 3] [--out results.json]
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import diffusers
from sparge_diffusers import relative_l1
from sparge_diffusers._json import write_json
from sparge_diffusers.pipelines import SpargeSettings, apply

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import timed  # noqa: E402

DTYPE = torch.bfloat16


def flux():
    m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                         pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    H = W = 64  # 1024 px: 128x128 latents packed 2x2
    ids = torch.stack(torch.meshgrid(torch.zeros(1).float(), torch.arange(H).float(), torch.arange(W).float(),
                                     indexing="ij"), -1).reshape(-1, 3).cuda()
    x = dict(hidden_states=torch.randn(1, H * W, 64), encoder_hidden_states=torch.randn(1, 512, 4096),
             pooled_projections=torch.randn(1, 768), timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
             img_ids=ids, txt_ids=torch.zeros(512, 3).cuda())
    return m, x, "1024x1024"


def sd3():
    m = diffusers.SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=38,
                                        attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                                        caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
                                        pos_embed_max_size=192, qk_norm="rms_norm")
    x = dict(hidden_states=torch.randn(1, 16, 128, 128), encoder_hidden_states=torch.randn(1, 333, 4096),
             pooled_projections=torch.randn(1, 2048), timestep=torch.tensor([500.0]))
    return m, x, "1024x1024 (SD3.5-large)"


def cogvideox():
    m = diffusers.CogVideoXTransformer3DModel(num_attention_heads=30, attention_head_dim=64, in_channels=16,
                                              out_channels=16, text_embed_dim=4096, num_layers=30, sample_width=90,
                                              sample_height=60, sample_frames=49, patch_size=2, time_embed_dim=512,
                                              temporal_compression_ratio=4, max_text_seq_length=226)
    x = dict(hidden_states=torch.randn(1, 13, 16, 60, 90), encoder_hidden_states=torch.randn(1, 226, 4096),
             timestep=torch.tensor([500]))
    return m, x, "49 frames 480x720 (CogVideoX-2B)"


def mochi():
    m = diffusers.MochiTransformer3DModel(patch_size=2, num_attention_heads=24, attention_head_dim=128,
                                          num_layers=48, pooled_projection_dim=1536, in_channels=12,
                                          text_embed_dim=4096, time_embed_dim=256, max_sequence_length=256)
    x = dict(hidden_states=torch.randn(1, 12, 28, 60, 106), encoder_hidden_states=torch.randn(1, 256, 4096),
             timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 256, dtype=torch.bool))
    return m, x, "163 frames 848x480"


MODELS = {"flux": flux, "sd3": sd3, "cogvideox": cogvideox, "mochi": mochi}


class RecordSDPA(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []
        self.device = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            qkv = list(args[:3]) + [kwargs[n] for n in ("query", "key", "value") if n in kwargs]
            self.calls.append(tuple(t.shape for t in qkv))
            self.device = qkv[0].device
        return func(*args, **kwargs)


def kernel_ms(fn) -> float:
    """GPU time of one call of ``fn``: the summed durations of its CUDA kernels (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def graphed(step):
    """``step`` captured in a CUDA graph over its static inputs, after two warm-up calls on a side stream (as
    torch.cuda.graph's documentation asks): a replay costs no Python and no per-kernel launch on the host, so
    it times what the GPU needs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--graphs", default="flux,sd3",
                    help="models whose steps are also timed as CUDA-graph replays (the host-bound ones)")
    ap.add_argument("--eager-rounds", type=int, default=EAGER_ROUNDS,
                    help="rounds of eager steps interleaving dense and the settings (each reports its fastest; 1 for "
                         "the video models, whose GPU-bound steps do not swing, saves minutes)")
    ap.add_argument("--compile", default="",
                    help="models whose steps are also timed compiled with torch.compile (minutes of compilation each)")
    args = ap.parse_args(argv)
    if args.eager_rounds < 1:
        ap.error("--eager-rounds must be at least 1")
    graphs = set(filter(None, args.graphs.split(",")))
    compiled = set(filter(None, args.compile.split(",")))
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
               "eager_rounds": args.eager_rounds, "models": {}}
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "pipelines-H100.json")
    for name in args.models.split(","):
        try:
            results["models"][name] = run_model(name, graph=name in graphs, compiled=name in compiled,
                                                 rounds=args.eager_rounds)
        except Exception as e:  # report and go on to the next model
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()
        write_json(out, results)  # after every model: a run stopped by a time limit keeps the models it measured
    print_table(results)


def compiled_ms(model, inputs) -> tuple[float, float]:
    """(step ms, compile s) of ``model`` under torch.compile (fresh compilation, fullgraph)."""
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True)
    start = time.perf_counter()
    fn(**inputs, return_dict=False)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    return timed(lambda: fn(**inputs, return_dict=False)[0]), compile_s


def build_on_gpu(name):
    """(model, inputs, resolution) of a full-size transformer with random weights, built in bf16 on the GPU."""
    torch.manual_seed(0)
    torch.set_default_dtype(DTYPE)  # build in bf16 on the GPU: Flux in float32 alone would take 48 GB
    with torch.device("cuda"):
        model, inputs, res = MODELS[name]()
    torch.set_default_dtype(torch.float32)
    inputs = {k: (v.to(DTYPE) if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v).cuda()
              for k, v in inputs.items()}
    return model.eval(), inputs, res


SETTINGS = {"default": SpargeSettings(), "aggressive": SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.9)}
# Eager steps at 1024^2 are host-bound, and the H100 host's speed moves in phases of ~10 steps (pipelines-H100.txt,
# session 25): timed one setting after another, a slow phase lands on one setting only (SD3's aggressive step read
# 0.68x in one run, 1.02x in another). Each setting's eager step is therefore timed in rounds that interleave the
# settings, and reported as its fastest round's median, as benchmarks/attention.py does for kernels.
EAGER_ROUNDS = 3


def run_model(name, graph=False, compiled=False, rounds=EAGER_ROUNDS):
    model, inputs, res = build_on_gpu(name)
    step = lambda: model(**inputs, return_dict=False)[0]  # noqa: E731
    with torch.no_grad():
        rec = RecordSDPA()
        with rec:
            dense_out = step()
        dense_kernel_ms = kernel_ms(step)
        attn_ms = 0.0
        for shape in set(rec.calls):
            q = torch.randn(shape[0], device=rec.device, dtype=DTYPE)
            k = torch.randn(shape[1], device=rec.device, dtype=DTYPE)
            one = timed(lambda: F.scaled_dot_product_attention(q, k, k), reps=5)
            attn_ms += one * rec.calls.count(shape)
        largest = max(rec.calls, key=lambda c: c[0].numel())[0]
        row = {"resolution": res, "attention_calls": len(rec.calls), "attention_shape": list(largest),
               "dense_step_kernel_ms": dense_kernel_ms, "attention_ms_in_dense_step": attn_ms, "settings": {}}
        if graph:
            g, _ = graphed(step)
            row["dense_graph_ms"] = timed(g.replay)
            del g
        if compiled:
            row["dense_compiled_ms"], row["dense_compile_s"] = compiled_ms(model, inputs)
        eager_outputs = {}
        for label, settings in SETTINGS.items():
            processor = apply(model, settings, collect_stats=True)  # sparsity from this first step
            out = eager_outputs[label] = step()
            processor.collect_stats = False  # timed as users run it (the default)
            sp = [s["sparsity"] for s in processor.stats]
            row["settings"][label] = {"step_kernel_ms": kernel_ms(step), "sparsity": sum(sp) / len(sp),
                                      "relative_l1_vs_dense_step": relative_l1(out, dense_out)}
            if graph:
                g, g_out = graphed(step)
                ms = timed(g.replay)
                row["settings"][label].update(graph_ms=ms, graph_speedup=row["dense_graph_ms"] / ms,
                                              graph_l1_vs_eager=relative_l1(g_out, out))
                del g, g_out
            if compiled:
                ms, compile_s = compiled_ms(model, inputs)
                row["settings"][label].update(compiled_ms=ms, compiled_speedup=row["dense_compiled_ms"] / ms,
                                              compile_s=compile_s)
            processor.detach(model)  # one SpargeProcessor per model: the next setting installs its own
        times = eager_rounds(model, step, rounds)
        row["dense_step_ms"] = min(times["dense"])
        row["dense_step_ms_rounds"] = times["dense"]
        row["attention_share"] = attn_ms / row["dense_step_ms"]
        for label in SETTINGS:
            ms = min(times[label])
            row["settings"][label].update(step_ms=ms, step_ms_rounds=times[label],
                                          speedup=row["dense_step_ms"] / ms)
        print(name, json.dumps(row), flush=True)
    return row


def eager_rounds(model, step, rounds: int) -> dict[str, list[float]]:
    """Median eager step ms of dense and of each setting, in ``rounds`` rounds that take them in turn (each
    setting's processor installed for its turn and detached after it)."""
    times = {"dense": [], **{label: [] for label in SETTINGS}}
    for _ in range(rounds):
        times["dense"].append(timed(step))
        for label, settings in SETTINGS.items():
            processor = apply(model, settings)
            times[label].append(timed(step))
            processor.detach(model)
    return times


def print_table(results):
    print(f"\nGPU: {results['gpu']}; bf16, random weights; one denoising step (eager: median of 5 after 3 warm-up "
          f"steps, fastest of {results['eager_rounds']} rounds interleaving the settings); 'gpu': the step's summed "
          "kernel time")
    print(f"{'model':10} {'tokens':>7} {'dense ms':>9} {'gpu':>7} {'attn %':>7} {'default ms':>10} {'gpu':>7} {'x':>5} "
          f"{'spars':>6} {'aggr ms':>8} {'gpu':>7} {'x':>5} {'spars':>6} {'L1':>6}")
    for name, r in results["models"].items():
        d, a = r["settings"]["default"], r["settings"]["aggressive"]
        print(f"{name:10} {r['attention_shape'][2]:7d} {r['dense_step_ms']:9.1f} {r['dense_step_kernel_ms']:7.1f} "
              f"{100 * r['attention_share']:7.1f} {d['step_ms']:10.1f} {d['step_kernel_ms']:7.1f} {d['speedup']:5.2f} "
              f"{d['sparsity']:6.3f} {a['step_ms']:8.1f} {a['step_kernel_ms']:7.1f} {a['speedup']:5.2f} "
              f"{a['sparsity']:6.3f} {a['relative_l1_vs_dense_step']:6.3f}")
    graphed_models = {n: r for n, r in results["models"].items() if "dense_graph_ms" in r}
    if graphed_models:
        print("\nThe same steps as CUDA-graph replays (no host time per kernel; median of 5 replays)")
        print(f"{'model':10} {'dense ms':>9} {'default ms':>10} {'x':>5} {'aggr ms':>8} {'x':>5}")
        for name, r in graphed_models.items():
            d, a = r["settings"]["default"], r["settings"]["aggressive"]
            print(f"{name:10} {r['dense_graph_ms']:9.1f} {d['graph_ms']:10.1f} {d['graph_speedup']:5.2f} "
                  f"{a['graph_ms']:8.1f} {a['graph_speedup']:5.2f}")
    compiled_models = {n: r for n, r in results["models"].items() if "dense_compiled_ms" in r}
    if compiled_models:
        print("\nThe same steps under torch.compile (inductor, default mode, fullgraph; median of 5 after 3 warm-up"
              " steps; compile s = first call)")
        print(f"{'model':10} {'dense ms':>9} {'default ms':>10} {'x':>5} {'aggr ms':>8} {'x':>5} {'compile s':>22}")
        for name, r in compiled_models.items():
            d, a = r["settings"]["default"], r["settings"]["aggressive"]
            secs = f"{r['dense_compile_s']:.0f}/{d['compile_s']:.0f}/{a['compile_s']:.0f}"
            print(f"{name:10} {r['dense_compiled_ms']:9.1f} {d['compiled_ms']:10.1f} {d['compiled_speedup']:5.2f} "
                  f"{a['compiled_ms']:8.1f} {a['compiled_speedup']:5.2f} {secs:>22}")


if __name__ == "__main__":
    main()
