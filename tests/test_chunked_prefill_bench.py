"""The helpers of benchmarks/chunked_prefill.py that decide its figures (CPU; the timing itself needs a GPU)."""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import attention as attention_bench  # noqa: E402  (a broken import must fail here, not skip)
import chunked_prefill  # noqa: E402

from sparge_diffusers import BLOCK_K, BLOCK_Q  # noqa: E402
from sparge_diffusers.kernels._inputs import check_attention_inputs  # noqa: E402


def test_sampled_chunk_l1_measures_against_the_lower_right_rows_of_the_prompt():
    g = torch.Generator().manual_seed(0)
    N, C = 300, 70
    qf, k, v = (torch.randn(1, 2, N, 32, generator=g) for _ in range(3))
    full = torch.softmax((qf @ k.transpose(-1, -2) / math.sqrt(32)).masked_fill(
        torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf), -1) @ v
    chunk = full[:, :, N - C:]
    assert chunked_prefill.sampled_chunk_l1(chunk, qf, k, v, rows=50) < 1e-5
    assert chunked_prefill.sampled_chunk_l1(full[:, :, :C], qf, k, v, rows=50) > 0.1  # the wrong rows


def test_random_mask_follows_the_lower_right_visibility():
    q, k = torch.zeros(1, 1, 200, 64), torch.zeros(1, 1, 1000, 64)
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=True, causal_variant="lower_right")
    mask = attention_bench.random_block_mask(1, 2, shape.q_blocks, shape.k_blocks, 0.3, True, 1000, "cpu",
                                             q_len=200, causal_offset=shape.causal_offset)
    for i in range(shape.q_blocks):
        last = min(i * BLOCK_Q + BLOCK_Q - 1, 199) + 800
        first = i * BLOCK_Q + 800
        for j in range(shape.k_blocks):
            if j * BLOCK_K > last:
                assert not mask[..., i, j].any()  # hidden
            elif j * BLOCK_K + BLOCK_K - 1 > first:
                assert mask[..., i, j].all()  # the diagonal, kept


def test_table_prints_every_method_row():
    """The printed table from a results dict of the benchmark's shape (the PBS / S2O / FSA rows included)."""
    dense = {"ours_ms": 1.0, "sdpa_lower_right_ms": 2.0, "cudnn_mask_ms": 3.0, "flex_ms": 1.5}
    sparse = [{"actual_density": 0.1, "ours_prebuilt_ms": 0.12, "ours_ms": 0.13, "flex_ms": 0.2,
               "flex_vs_prebuilt": 1.6, "prebuilt_speedup_over_ideal": 0.83, "per_call_speedup_over_ideal": 0.77}]
    structured = {"sparsity": 0.07, "relative_l1": 0.05, "relative_l1_sdpa_bf16": 0.002, "whole_ms": 0.9,
                  "sdpa_lower_right_ms": 2.0, "cudnn_mask_ms": 3.0,
                  "pbs": {"sparsity": 0.1, "relative_l1": 0.04, "ms": 1.0, "segment": 256},
                  "s2o": {"sparsity": 0.2, "relative_l1": 0.01, "ms": 0.8},
                  "fsa": {"sparsity": 0.9, "relative_l1": 0.9, "ms": 0.5, "top_k": 16}}
    results = {"gpu": "GPU", "torch": "t", "triton": "tr", "date": "d",
               "cases": [{"N": 4096, "C": 512, "dense": dense, "sparse": sparse, "structured_default": structured}]}
    lines = chunked_prefill.table(results).splitlines()
    s2o = [line for line in lines if " s2o " in line]
    fsa = [line for line in lines if " fsa " in line]
    assert len(s2o) == 1 and s2o[0].split()[-2:] == ["2.50", "1.12"]  # x SDPA, x sparge
    assert len(fsa) == 1 and fsa[0].split()[-2:] == ["4.00", "1.80"]
    pbs = [line for line in lines if " pbs " in line]
    assert len(pbs) == 1 and pbs[0].split()[-2:] == ["2.00", "0.90"]
    del structured["pbs"]  # results of earlier sessions have no PBS row
    assert not [line for line in chunked_prefill.table(results).splitlines() if " pbs " in line]
