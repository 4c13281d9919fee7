"""Small calls of the GPU kernel families, one process per run, for checkers that watch a whole process:
Triton's ConSan (``TRITON_INSTRUMENTATION_MODE=consan``, ``tests/test_sanitizers.py``) and compute-sanitizer's
memcheck, racecheck, synccheck and initcheck (docs/testing.md, "Sanitizers on the GPU").

    python tests/sanitize_calls.py mask_128 s2o_128     # prints "ok <case> ..." per case; exits 1 on a wrong output

A case is ``<call>_<head dim>``: ``dense`` (every block, no stage 2), ``densecausal``, ``mask`` (a random block
mask, each row keeping its first key block), ``whole`` (the whole method, causal, with the sink kept), ``s2o``,
``pbs`` (PBS-Attn's permuted keys, causal) and ``fsa`` (NSA's per-query selection over FSA's KV-outer loop). Each
call has odd lengths (333 tokens), GQA (4 query heads, 2 K/V heads), bf16, and writes into an output poisoned with
NaN where the call takes one; its output is checked for NaN and against the float32 reference.
"""

from __future__ import annotations

import os
import sys

import torch

from sparge_diffusers import (block_sparse_attention, relative_l1, s2o_attention, select_key_blocks,
                              selected_block_attention, sparge_attention)
from sparge_diffusers.llm import pbs_sparge_attention

from test_kernels import L1_TOL, dense_reference

TOKENS, HEADS, KV_HEADS = 333, 4, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU every call runs the reference (a dry run)


def run_case(case: str) -> tuple[int, float]:
    """(NaN count, relative L1 against the float32 reference) of one case's output."""
    call, head_dim = case.rsplit("_", 1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(1, h, TOKENS, int(head_dim), device=DEVICE, dtype=torch.bfloat16, generator=gen)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    out = torch.full_like(q, float("nan"))
    if call in ("dense", "densecausal"):
        causal = call == "densecausal"
        o = sparge_attention(q, k, v, is_causal=causal, cdfthreshd=1.0, pvthreshd=None, out=out)
        ref = dense_reference(q, k, v, causal, "HND")
    elif call == "mask":
        mask = torch.rand(1, HEADS, 3, 6, device=DEVICE, generator=gen) < 0.5
        mask[..., 0] = True
        o = block_sparse_attention(q, k, v, mask, out=out)
        ref = block_sparse_attention(q, k, v, mask, backend="reference")
    elif call == "whole":
        o = sparge_attention(q, k, v, is_causal=True, attention_sink=True, out=out)
        ref = dense_reference(q, k, v, True, "HND")
    elif call == "s2o":
        o = s2o_attention(q, k, v, out=out)
        ref = dense_reference(q, k, v, False, "HND")
    elif call == "pbs":
        o = pbs_sparge_attention(q, k, v, segment=128)
        ref = dense_reference(q, k, v, True, "HND")
    elif call == "fsa":
        indices = select_key_blocks(q, k, top_k=3)
        o = selected_block_attention(q, k, v, indices, out=out)
        ref = selected_block_attention(q, k, v, indices, backend="reference")
    else:
        raise ValueError(f"unknown case {case!r}")
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return int(o.isnan().sum()), relative_l1(o.float(), ref.float())


def main(cases: list[str]) -> int:
    if os.environ.get("TRITON_INSTRUMENTATION_MODE"):
        import triton  # ConSan's instrumented kernels ask for global scratch memory

        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    failed = 0
    for case in cases:
        nans, l1 = run_case(case)
        good = nans == 0 and l1 < L1_TOL[torch.bfloat16]
        failed += not good
        print(f"{'ok' if good else 'WRONG'} {case}: NaN {nans}, relative L1 {l1:.4g}", flush=True)
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
