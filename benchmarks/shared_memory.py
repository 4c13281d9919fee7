"""Shared memory per block that each of our Triton kernels runs with on other GPUs, compiled here without one.

Our launch settings are the H100's (227 KB of shared memory per block). For each compute capability this makes the
public calls (``public_calls``: every kernel family, head dims 64 and 128, GQA, odd lengths) on CPU tensors with
every launch compiled by Triton for that target instead of run. A launch whose kernel needs more than the target
has is refused as Triton's launcher refuses it (``OutOfResources``), and ``_launch.launch_fitting`` tries it again
with fewer pipeline stages, as it would on that GPU. The table lists, per kernel, the stages asked and run and the
bytes of the kernel that runs; "refused" rows are the settings that did not fit. The sm90-only Gluon kernels are
left out (the Triton kernels run in their place, as on every other GPU), and so are the TMA variants, which need a
GPU to build their descriptors. Each capability runs in a process of its own (Triton's driver is replaced there).

Usage: python benchmarks/shared_memory.py [--capabilities 80,86,89,90,100,120] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import save_report  # noqa: E402

# Shared memory per block (opt-in maximum, bytes) by compute capability, from CUDA's programming guide.
SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
                    100: 227 * 1024, 120: 99 * 1024}


def public_calls(device: str, backend: str, head_dims: tuple[int, ...] = (64, 128)) -> dict:
    """name -> zero-argument call, over every kernel family at ``head_dims`` (GQA, odd lengths)."""
    from sparge_diffusers import (block_sparse_attention, s2o_attention, select_key_blocks, selected_block_attention,
                                  sparge_attention)
    from sparge_diffusers.testing import llm_like_qkv, video_like_qkv

    calls = {}
    b = dict(backend=backend)
    for d in head_dims:
        q, k, v = (t.to(torch.bfloat16) for t in video_like_qkv((3, 10, 13), heads=4, head_dim=d, text_tokens=11,
                                                                  device=device, seed=1))
        lq, lk, lv = (t.to(torch.bfloat16) for t in llm_like_qkv(613, heads=4, kv_heads=2, head_dim=d, device=device,
                                                                   seed=2))
        mask = torch.rand(1, 4, 4, 7, generator=torch.Generator().manual_seed(3)).to(device) < 0.4
        blocks = select_key_blocks(lq, lk, top_k=3, backend="reference")  # (no launch: the same on every side)
        calls.update({
            f"sparge D={d}": lambda q=q, k=k, v=v: sparge_attention(q, k, v, **b),
            f"sparge stage 2 D={d}": lambda q=q, k=k, v=v: sparge_attention(q, k, v, pvthreshd=8, **b),
            f"sparge causal GQA D={d}": lambda q=lq, k=lk, v=lv: sparge_attention(q, k, v, is_causal=True, **b),
            f"mask D={d}": lambda q=q, k=k, v=v, m=mask: block_sparse_attention(q, k, v, m, **b),
            f"dense D={d}": lambda q=q, k=k, v=v: block_sparse_attention(q, k, v, None, **b),
            f"s2o causal GQA D={d}": lambda q=lq, k=lk, v=lv: s2o_attention(q, k, v, is_causal=True, **b),
            f"selection D={d}": lambda q=lq, k=lk: select_key_blocks(q, k, top_k=3, **b),
            f"selected D={d}": lambda q=lq, k=lk, v=lv, i=blocks: selected_block_attention(q, k, v, i, **b),
        })
    return calls


def compile_calls_for(capability: int, head_dims: tuple[int, ...] = (64, 128)) -> None:
    """Make the public calls on CPU tensors with every launch compiled for ``capability`` instead of run; print
    the attempts as JSON after "ATTEMPTS": [kernel, head dim (None if it has no HEAD_DIM), num_stages, shared
    bytes], in launch order, a refused attempt followed by its retry. Run without TRITON_INTERPRET, in a process
    of its own: it replaces Triton's driver."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit
    from triton.runtime.driver import driver

    from sparge_diffusers import _launch
    from sparge_diffusers.kernels import attention_hopper, s2o_hopper

    class TargetOnly:
        """The parts of Triton's driver that a compile-only launch reads."""

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def is_active(self):
            return True

    driver.set_active(TargetOnly())
    compile_then_launch = jit.JITFunction.run
    attempts = []
    limit = SHARED_PER_BLOCK[capability]

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = compile_then_launch(self, *args, grid=grid, warmup=True, **kwargs)
        attempts.append((self.fn.__name__, kwargs.get("HEAD_DIM"), kernel.metadata.num_stages, kernel.metadata.shared))
        if kernel.metadata.shared > limit:  # CompiledKernel._init_handles's test before a launch
            raise _launch.OutOfResources(kernel.metadata.shared, limit, "shared memory")

    jit.JITFunction.run = compile_only
    _launch.ENABLED = False  # nothing is launched, so nothing can be recorded
    attention_hopper.OVERRIDE = s2o_hopper.OVERRIDE = False
    with torch.no_grad():
        for call in public_calls("cpu", backend="triton", head_dims=head_dims).values():
            call()
    print("ATTEMPTS" + json.dumps(attempts))


def attempts_for(capability: int, head_dims: tuple[int, ...] = (64, 128)) -> list:
    """``compile_calls_for(capability, head_dims)``'s attempts, from a fresh process."""
    return json_from_fresh_process(f"import shared_memory; shared_memory.compile_calls_for({capability}, {head_dims})",
                                   "ATTEMPTS", os.path.dirname(os.path.abspath(__file__)))


def json_from_fresh_process(code: str, prefix: str, module_dir: str) -> list:
    """Run ``code`` in a fresh Python without TRITON_INTERPRET that imports from ``module_dir`` and this
    package's checkout; return the JSON of its last output line starting with ``prefix``."""
    import sparge_diffusers

    root = os.path.dirname(os.path.dirname(os.path.abspath(sparge_diffusers.__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path[:0] = [{module_dir!r}, {here!r}, {root!r}]; {code}"
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="0"),
                         capture_output=True, text=True, timeout=1800)
    lines = [line for line in run.stdout.splitlines() if line.startswith(prefix)]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"{code} failed:\n{run.stderr[-3000:]}")
    return json.loads(lines[-1][len(prefix):])


def summarise(attempts: list, limit: int) -> list[dict]:
    """One row per distinct (kernel, head dim, stages, bytes), in first-seen order, marked refused or run."""
    rows = {}
    for name, head_dim, stages, shared in attempts:
        rows.setdefault((name, head_dim, stages, shared), dict(kernel=name, head_dim=head_dim, stages=stages,
                                                               shared=shared, refused=shared > limit))
    return list(rows.values())


def format_table(results: dict) -> str:
    lines = [f"Shared memory per block of each kernel as run, compiled offline (Triton {results['triton']}); "
             "refused = the setting did not fit and ran with fewer stages"]
    for capability, r in results["targets"].items():
        lines.append(f"sm{capability} (limit {r['limit']} bytes): {r['refused']} of {r['launches']} launch "
                     "attempts refused")
        for row in sorted(r["rows"], key=lambda x: (x["kernel"], x["head_dim"] or 0, -x["stages"])):
            lines.append(f"  {row['kernel']:30} D={row['head_dim'] or '-':<4} stages {row['stages']}  "
                         f"{row['shared']:>7}  {'refused' if row['refused'] else 'runs'}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capabilities", default="80,86,89,90,100,120")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import triton

    results = {"torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
               "targets": {}}
    for capability in (int(c) for c in args.capabilities.split(",")):
        limit = SHARED_PER_BLOCK[capability]
        attempts = attempts_for(capability)
        results["targets"][capability] = dict(limit=limit, launches=len(attempts),
                                              refused=sum(a[3] > limit for a in attempts),
                                              rows=summarise(attempts, limit))
        print(f"sm{capability} done", flush=True)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "shared-memory.json")
    save_report(results, format_table(results), out)


if __name__ == "__main__":
    main()
