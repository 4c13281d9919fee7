"""The helpers of benchmarks/tile_cost.py that decide its figures (CPU; the timing itself needs a GPU)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import tile_cost  # noqa: E402  (a broken import must fail here, not skip)


@pytest.mark.parametrize("c", [1, 3, 8, 10])
def test_exact_block_mask_keeps_c_blocks_in_every_query_block(c):
    mask = tile_cost.exact_block_mask(2, 3, 5, 10, c, "cpu", seed=c)
    assert mask.dtype == torch.bool and mask.shape == (2, 3, 5, 10)
    assert (mask.sum(-1) == c).all()


def test_fit_line_recovers_fixed_and_per_block_cost():
    cs = [2, 4, 8, 16, 36, 72]
    fixed, per_block = tile_cost.fit_line(cs, [0.023 + 0.00623 * c for c in cs])
    assert fixed == pytest.approx(0.023) and per_block == pytest.approx(0.00623)
