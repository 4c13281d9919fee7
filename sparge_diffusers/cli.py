"""The ``sparge-diffusers`` command line.

    sparge-diffusers bench [--workloads cogvideox,mochi,flux,llama32k] [--json out.json]
    sparge-diffusers generate --model ID_OR_PATH --prompt TEXT [--prompt ...] --out DIR [--attention sparge ...]
    sparge-diffusers tune --model ID_OR_PATH --prompts FILE --out settings.json [--l1 0.05 --l2 0.06 ...]
    sparge-diffusers eval --model ID_OR_PATH --prompts FILE --attention dense,sparge[:settings.json] --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from . import __version__, sparge_attention
from ._json import write_json
from .pipelines.call_arguments import check_pipe_kwargs
from .workloads import EXTRA, FULL, SMALL, SMALL_EXTRA, cudnn_attention_fn, sampled_relative_l1


def _time_ms(fn, repeats: int = 10) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, repeats), return_mode="median"))


def bench(args: argparse.Namespace) -> int:
    gpu = torch.cuda.is_available() and not args.cpu
    device = "cuda" if gpu else "cpu"
    table = {**FULL, **EXTRA} if gpu else {**SMALL, **SMALL_EXTRA}
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"unknown workload(s) {unknown}; choose from {list(table)}", file=sys.stderr)
        return 2
    if args.json:
        try:  # the file is written after every workload has run
            _prepare_output_file(args.json, "--json")
        except (ValueError, OSError) as e:
            print(e, file=sys.stderr)
            return 2
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name()} - full-size workloads, Triton kernels vs cuDNN SDPA")
    else:
        print("No GPU: running the float32 reference on small versions of the workloads (no timings).")
    rows = []
    for name in tqdm(names, desc="workloads", unit="workload", disable=args.quiet):
        w = table[name]
        q, k, v = w.make(device, args.seed)
        out, stats = sparge_attention(q, k, v, is_causal=w.causal, return_sparsity=True)
        row = {"workload": name, "B": w.batch, "H": w.heads, "H_kv": w.kv_heads, "N": w.seq_len, "D": w.head_dim,
               "causal": w.causal, "sparsity": stats.sparsity, "qk_skipped": float(stats.qk_skipped.mean()),
               "relative_l1": sampled_relative_l1(out, q, k, v, w.causal)}
        if gpu:
            row["sparge_ms"] = _time_ms(lambda: sparge_attention(q, k, v, is_causal=w.causal))
            row["cudnn_ms"] = _time_ms(cudnn_attention_fn(q, k, v, w.causal))
            row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["sparge_ms"]
        rows.append(row)
        del q, k, v, out
    header = f"{'workload':10} {'shape (B,H,N,D)':22} {'sparsity':>8} {'rel L1':>8}"
    if gpu:
        header += f" {'sparge ms':>9} {'cuDNN ms':>9} {'speedup':>8}"
    print(header)
    for r in rows:
        line = (f"{r['workload']:10} {str((r['B'], r['H'], r['N'], r['D'])):22} {r['sparsity']:8.3f} "
                f"{r['relative_l1']:8.4f}")
        if gpu:
            line += f" {r['sparge_ms']:9.2f} {r['cudnn_ms']:9.2f} {r['speedup_vs_cudnn']:8.2f}"
        print(line)
    if args.json:
        write_json(args.json, {"device": torch.cuda.get_device_name() if gpu else "cpu (reference, small sizes)",
                               "date": time.strftime("%Y-%m-%d"), "version": __version__, "workloads": rows})
        print(f"wrote {args.json}")
    return 0


def _pipe_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _int_at_least(low: int):
    """An argparse type: an int >= ``low`` (counts are checked when parsed, not after the model has loaded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _modes_or_none(text: str):
    """The attention modes of ``--attention`` with their settings files read (their contents checked), or None after
    printing why not: before the model loads, which can take minutes."""
    from .eval.run import parse_modes
    from .pipelines import LayerSettingsFile

    try:
        modes = parse_modes(text)
        for mode in modes:
            if mode.settings_file:
                LayerSettingsFile.load(mode.settings_file)
    except (ValueError, OSError) as e:
        print(e, file=sys.stderr)
        return None
    return modes


def _device(device: str | None) -> str:
    """--device, by default CUDA if present, else the CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_pipeline(model: str, device: str | None, dtype: str | None):
    """``DiffusionPipeline.from_pretrained`` on the chosen device (CUDA if present) and dtype."""
    from diffusers import DiffusionPipeline

    device = _device(device)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    torch_dtype = dtypes[dtype or ("bf16" if device.startswith("cuda") else "fp32")]
    pipe = DiffusionPipeline.from_pretrained(model, dtype=torch_dtype)
    return pipe.to(device)


def pipeline_kwargs(args: argparse.Namespace) -> dict:
    kw = {"num_inference_steps": args.steps} if args.steps is not None else {}
    for name in ("height", "width", "num_frames", "guidance_scale"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    kw.update(dict(args.pipe_arg or []))
    return kw


def read_prompts(path: str) -> list[str]:
    """The non-empty lines of a prompts file; prints why and returns [] when there are none (or no such file)."""
    try:
        with open(path) as f:
            prompts = [line.strip() for line in f if line.strip()]
    except OSError as e:
        print(f"cannot read the prompts file: {e}", file=sys.stderr)
        return []
    if not prompts:
        print(f"{path} holds no prompts (one per line)", file=sys.stderr)
    return prompts


def tune_command(args: argparse.Namespace) -> int:
    from .tuning import ThresholdGrid, ThresholdSearch
    from .tuning.pipeline import tune

    prompts = read_prompts(args.prompts)
    if not prompts:
        return 2
    try:  # what would otherwise fail only after the model has loaded, or after the whole calibration
        ThresholdSearch(l1=args.l1, l2=args.l2, aggregate=args.aggregate)
        check_pipe_kwargs(pipeline_kwargs(args), reserved=("prompt", "generator"))
        _prepare_output_file(args.out)
    except (ValueError, OSError) as e:
        print(e, file=sys.stderr)
        return 2
    pipe = load_pipeline(args.model, args.device, args.dtype)

    grid = ThresholdGrid(pvthreshd=(50.0,)) if args.no_stage2 else None
    tuned = tune(pipe, prompts, l1=args.l1, l2=args.l2, grid=grid, per_head=not args.per_layer,
                 aggregate=args.aggregate, permutation=args.permutation, pipe_kwargs=pipeline_kwargs(args),
                 seed=args.seed, progress=not args.quiet)
    tuned.save(args.out)
    print(f"{'layer':45} {'sparsity':>8} {'L1':>8}")
    for name, m in tuned.measured.items():
        print(f"{name:45} {m['sparsity']:8.3f} {m['l1']:8.4f}" + ("" if m["within_budget"] else "  (over budget)"))
    mean = sum(m["sparsity"] for m in tuned.measured.values()) / max(1, len(tuned.measured))
    print(f"{len(tuned.measured)} layers, mean sparsity {mean:.3f} on the calibration prompts; wrote {args.out}")
    return 0


def _prepare_output_file(path: str, option: str = "--out") -> None:
    """Make the folder a result file goes to, and refuse a path that is a folder: the file is written at the end."""
    from pathlib import Path

    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file's path (e.g. {out / 'results.json'})")
    out.parent.mkdir(parents=True, exist_ok=True)


def _prepare_output_folder(path: str) -> bool:
    """Make the output folder before the model loads; False after printing why it cannot be made."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        print(f"--out {path}: cannot make the output folder ({e})", file=sys.stderr)
        return False
    return True


def _settings(args: argparse.Namespace):
    from .pipelines import SpargeSettings

    given = {k: getattr(args, k) for k in ("simthreshd1", "cdfthreshd", "pvthreshd", "permutation")
             if getattr(args, k) is not None}
    return SpargeSettings(**given) if given else None


def generate_command(args: argparse.Namespace) -> int:
    from .generation import generate

    # argparse requires --prompt or --prompts; an empty or unreadable prompts file: read_prompts said why
    prompts = list(args.prompt or []) or read_prompts(args.prompts)
    if not prompts:
        return 2
    modes = _modes_or_none(args.attention)
    if modes is None:
        return 2
    if len(modes) != 1:
        print(f"--attention {args.attention!r}: generate runs one mode ('sparge-diffusers eval' compares several)",
              file=sys.stderr)
        return 2
    mode = modes[0]
    # set, not truthy: --simthreshd1 0 with --attention dense was ignored without a word
    sparse_only = [f"--{k.replace('_', '-')}" for k, unset in (("simthreshd1", None), ("cdfthreshd", None),
                   ("pvthreshd", None), ("permutation", None), ("dense_steps", 0), ("strict", False))
                   if getattr(args, k) != unset]
    if not mode.sparse and sparse_only:
        print(f"{', '.join(sparse_only)} apply to sparge attention, not --attention dense", file=sys.stderr)
        return 2
    try:
        settings = _settings(args)  # before loading the model
        check_pipe_kwargs(pipeline_kwargs(args))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if not _prepare_output_folder(args.out):
        return 2
    pipe = load_pipeline(args.model, args.device, args.dtype)
    report = generate(pipe, prompts, args.out, sparse=mode.sparse, settings=settings,
                      layer_settings=mode.settings_file, dense_steps=args.dense_steps, strict=args.strict,
                      seed=args.seed, pipe_kwargs=pipeline_kwargs(args), fps=args.fps, compile=args.compile,
                      warmup=args.warmup, progress=not args.quiet)
    print(f"{report['model_class']} on {report['device']}, attention {mode.name}"
          + (", compiled" if args.compile else ""))
    print(f"{'#':>3} {'seconds':>9} {'s/step':>8} {'sparsity':>8}  file")
    for r in report["outputs"]:
        sparsity = f"{r['sparsity']:8.3f}" if r.get("sparsity") is not None else f"{'-':>8}"
        per_step = f"{r['seconds_per_step']:8.3f}" if "seconds_per_step" in r else f"{'-':>8}"
        more = f" (+{len(r['files']) - 1} more)" if len(r["files"]) > 1 else ""
        print(f"{r['prompt_index']:3d} {r['seconds']:9.2f} {per_step} {sparsity}  {r['files'][0]}{more}")
    for note in report["notes"]:
        print(note)
    print(f"wrote {args.out}/generate.json")
    return 0


def eval_command(args: argparse.Namespace) -> int:
    from .eval import LPIPS, DoverScorer, evaluate, load_clip

    prompts = read_prompts(args.prompts)
    if not prompts:
        return 2
    modes = _modes_or_none(args.attention)
    if modes is None:
        return 2
    try:
        check_pipe_kwargs(pipeline_kwargs(args))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    from .eval.run import requested_metrics_problem

    problem = requested_metrics_problem(len(prompts), [m.name for m in modes], lpips=bool(args.lpips_weights),
                                        fid=bool(args.fid_weights), real=bool(args.fid_real),
                                        spelled={"lpips": "--lpips-weights", "fid": "--fid-weights",
                                                 "real": "--fid-real"})
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.fid_real and not os.path.isdir(args.fid_real):
        print(f"--fid-real {args.fid_real}: no such folder", file=sys.stderr)
        return 2
    if not _prepare_output_folder(args.out):
        return 2
    try:  # metric models and real images first: a bad spec, missing weights file or image fails before the
        # pipeline loads (minutes)
        lpips = LPIPS.from_files(args.lpips_weights) if args.lpips_weights else None
        dover = DoverScorer(args.dover_weights) if args.dover_weights else None
        clip = load_clip(args.clip, _device(args.device)) if args.clip else None
        real = None
        if args.fid_real:
            from .eval.run import load_images

            real = load_images(args.fid_real, (args.height or 1024, args.width or 1024))
    except (ValueError, OSError, ImportError) as e:
        print(e, file=sys.stderr)
        return 2
    pipe = load_pipeline(args.model, args.device, args.dtype)
    if dover is not None:
        dover.to(pipe.device)
    report = evaluate(pipe, prompts, modes, args.out, seed=args.seed, pipe_kwargs=pipeline_kwargs(args), clip=clip,
                      lpips=lpips, inception_weights=args.fid_weights, real_images=real, dover=dover,
                      progress=not args.quiet)
    keys = [k for k in ("sparsity", "seconds_per_step", "psnr", "ssim", "lpips", "clip_score", "clipsim",
                        "clip_temp", "dover_technical", "dover_aesthetic", "dover_overall", "fid_vs_dense",
                        "fid_vs_real") if any(k in s for s in report["summary"].values())]
    print(f"{report['model_class']} on {report['device']}, {len(prompts)} prompt(s)")
    print(f"{'mode':24}" + "".join(f" {k:>16}" for k in keys))
    for name, s in report["summary"].items():
        print(f"{name:24}" + "".join(f" {s[k]:16.4f}" if s.get(k) is not None else f" {'-':>16}" for k in keys))
    print(f"wrote {args.out}/report.json, metrics.csv, grids and quality_vs_time.png")
    return 0


def _add_generation_args(p: argparse.ArgumentParser, prompt_text: bool = False, steps: int | None = 10) -> None:
    p.add_argument("--model", required=True, help="hub id or local directory of a diffusers pipeline")
    if prompt_text:
        given = p.add_mutually_exclusive_group(required=True)
        given.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
        given.add_argument("--prompts", help="text file with one prompt per line")
    else:
        p.add_argument("--prompts", required=True, help="text file with one prompt per line")
    p.add_argument("--steps", type=_int_at_least(1), default=steps, help="denoising steps per prompt (default "
                   + (f"{steps})" if steps else "the pipeline's)"))
    p.add_argument("--height", type=_int_at_least(1), help="output height in pixels (default: the pipeline's)")
    p.add_argument("--width", type=_int_at_least(1), help="output width in pixels (default: the pipeline's)")
    p.add_argument("--num-frames", type=_int_at_least(1), dest="num_frames",
                   help="frames per video, for video pipelines (default: the pipeline's)")
    p.add_argument("--guidance-scale", type=float, dest="guidance_scale",
                   help="classifier-free guidance scale (default: the pipeline's)")
    p.add_argument("--pipe-arg", type=_pipe_arg, action="append", metavar="KEY=VALUE",
                   help="any other pipeline call argument (value parsed as JSON when it can be)")
    p.add_argument("--device", help="default: cuda if present, else cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the first prompt (prompt i uses seed + i)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_subcommand(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                    summary: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is listed by ``sparge-diffusers --help`` and heads its own ``--help``."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: each subcommand with its options and the function that runs it."""
    parser = argparse.ArgumentParser(prog="sparge-diffusers", description="Sparse attention for diffusion "
                                     "transformers and long-context prefill (SpargeAttn in Triton).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    b = _add_subcommand(sub, "bench", "run the whole method on built-in structured workloads: per workload, "
                        "sparsity, relative L1 against exact attention and, on a GPU, time against cuDNN SDPA")
    b.add_argument("--workloads", default=",".join(FULL),
                   help="comma-separated, from: " + ", ".join({**FULL, **EXTRA}) + " (default: the first four)")
    b.add_argument("--json", help="also write the results to this JSON file")
    b.add_argument("--seed", type=int, default=0, help="seed of the workloads' random inputs (default 0)")
    b.add_argument("--cpu", action="store_true", help="use the CPU reference even when a GPU is present")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=bench)
    t = _add_subcommand(sub, "tune", "choose thresholds per attention layer on calibration prompts (section 3.6)")
    _add_generation_args(t)
    t.add_argument("--out", required=True, help="settings file to write (JSON)")
    t.add_argument("--l1", type=_positive_float, default=0.05, help="relative L1 budget of (simthreshd1, cdfthreshd)")
    t.add_argument("--l2", type=_positive_float, default=0.06, help="relative L1 budget with pvthreshd")
    t.add_argument("--no-stage2", action="store_true",
                   help="leave pvthreshd off (50): faster kernels, less sparsity (see the README's tuning table)")
    t.add_argument("--per-layer", action="store_true", help="one setting per layer instead of one per head")
    t.add_argument("--aggregate", choices=["max", "mean"], default="max",
                   help="the budget holds on every calibration call (max) or on average (mean)")
    t.add_argument("--permutation", choices=["hilbert", "rowmajor", "colmajor", "timemajor", "random"],
                   help="token order used while tuning and stored with the settings")
    t.set_defaults(func=tune_command)
    g = _add_subcommand(sub, "generate", "generate images or videos with SpargeAttn (or dense) attention and save them")
    _add_generation_args(g, prompt_text=True, steps=None)
    g.add_argument("--out", required=True, help="output folder (prompt_<i>.png or .gif/.mp4, prompt_<i>_<j> for "
                   "several outputs of one prompt, generate.json)")
    g.add_argument("--attention", default="sparge", help="sparge (default), sparge:SETTINGS.json (from tune) or dense")
    g.add_argument("--simthreshd1", type=float, help="theta for every layer a settings file does not cover (0.6)")
    g.add_argument("--cdfthreshd", type=float, help="tau (TopCdf) likewise (default 0.98)")
    g.add_argument("--pvthreshd", type=float, help="stage 2's threshold likewise (default 50)")
    g.add_argument("--permutation", choices=["hilbert", "rowmajor", "colmajor", "timemajor", "random"],
                   help="reorder visual tokens before attention (likewise)")
    g.add_argument("--dense-steps", type=_int_at_least(0), default=0, dest="dense_steps",
                   help="the first K denoising steps of every output stay dense")
    g.add_argument("--strict", action="store_true", help="fail where a call cannot run sparse (no dense fallback)")
    g.add_argument("--compile", action="store_true", help="torch.compile the transformer (use with --warmup)")
    g.add_argument("--warmup", action="store_true",
                   help="one untimed call first (the dense steps and one sparse step), so timings exclude kernel "
                   "(and model) compilation")
    g.add_argument("--fps", type=_int_at_least(1), default=8, help="frame rate of saved videos (default 8)")
    g.set_defaults(func=generate_command)
    e = _add_subcommand(sub, "eval", "generate with each attention mode for the same seeds and score the outputs")
    _add_generation_args(e)
    e.add_argument("--attention", default="dense,sparge",
                   help="comma-separated modes: dense, sparge, sparge:SETTINGS.json (default dense,sparge)")
    e.add_argument("--out", required=True, help="output folder (report.json, metrics.csv, grids, plot)")
    e.add_argument("--clip", help="CLIP model for CLIP score / CLIPSIM / CLIP-Temp: open_clip:ARCH:WEIGHTS or "
                   "transformers:PATH_OR_ID")
    e.add_argument("--lpips-weights", help="torchvision's alexnet-owt-7be5be79.pth, for LPIPS against dense")
    e.add_argument("--fid-weights", help="the FID Inception weights file (needs torch-fidelity), for FID vs dense")
    e.add_argument("--dover-weights", help="DOVER.pth, for DOVER's technical/aesthetic video scores (needs "
                   "DOVER's package: pip install git+https://github.com/VQAssessment/DOVER.git)")
    e.add_argument("--fid-real", help="folder of real images (e.g. the COCO images of the captions) for FID")
    e.set_defaults(func=eval_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
