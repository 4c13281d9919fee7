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


@pytest.mark.parametrize("nq,nk,c", [(36, 72, 8), (5, 6, 4), (7, 7, 1)])
def test_layout_masks_keep_c_blocks_shared_per_head_or_around_the_diagonal(nq, nk, c):
    masks = tile_cost.layout_block_masks(2, 3, nq, nk, c, "cpu")
    for mask in masks.values():
        assert mask.dtype == torch.bool and mask.shape == (2, 3, nq, nk)
        assert (mask.sum(-1) == c).all()
    shared = masks["shared"]
    assert (shared == shared[:, :, :1]).all()  # one set of blocks per head
    assert len({tuple(row.tolist()) for row in shared[:, :, 0].reshape(6, nk)}) > 1  # drawn per head
    band = masks["band"]
    cols = torch.arange(nk)
    for i in range(nq):
        kept = cols[band[0, 0, i]]
        assert kept.max() - kept.min() == c - 1  # contiguous
        assert kept.min() <= i * nk // nq <= kept.max()  # around its own position, clamped into the row
    assert (band == band[:1, :1]).all()


@pytest.mark.parametrize("B,H,N,c,expected", [(1, 24, 4608, 8, (216, 512)), (1, 24, 4608, 16, (108, 1024)),
                                              (1, 24, 4608, 72, (24, 4608)), (2, 30, 17776, 8, (2083, 512))])
def test_equal_work_shape_keeps_the_query_rows_and_gives_each_row_64_c_keys(B, H, N, c, expected):
    heads, keys = tile_cost.equal_work_shape(B, H, N, c)
    assert (heads, keys) == expected
    assert heads * keys == pytest.approx(B * H * N, rel=1e-3)  # the same query rows, Q and O bytes
    # the same FLOPs as the c-block walk: heads * keys^2 against B * H * N * (64 c)
    assert heads * keys * keys == pytest.approx(B * H * N * 64 * c, rel=1e-3)
