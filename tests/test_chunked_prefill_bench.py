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
