"""mask_row_extents: each row's first and last True column and count of Trues, the Triton kernel (in the
interpreter) against the PyTorch formulation and both against a per-row definition."""

import pytest
import torch

from sparge_diffusers.kernels.mask_rows import _row_extents_triton, mask_row_extents, mask_row_extents_reference


def by_definition(mask):
    """The extents row by row, in Python."""
    batch, rows, cols = mask.shape
    first = torch.full((batch, rows), cols, dtype=torch.int32)
    last = torch.full((batch, rows), -1, dtype=torch.int32)
    count = torch.zeros(batch, rows, dtype=torch.int32)
    for b in range(batch):
        for r in range(rows):
            seen = mask[b, r].nonzero().flatten()
            if len(seen):
                first[b, r], last[b, r], count[b, r] = seen[0], seen[-1], len(seen)
    return first, last, count


def random_mask(batch, rows, cols, seed, density=0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, rows, cols, generator=g) < density
    mask[:, 0] = False  # a row without any True
    if rows > 1:
        mask[:, 1] = True  # a full row
    if rows > 2 and cols > 3:
        mask[:, 2] = False
        mask[:, 2, cols - 1] = True  # only the last column
    return mask


@pytest.mark.parametrize("batch, rows, cols", [(1, 1, 1), (1, 3, 5), (2, 7, 1025), (3, 13, 2100), (1, 9, 3000)])
def test_kernel_and_reference_match_the_definition(batch, rows, cols):
    mask = random_mask(batch, rows, cols, seed=rows * cols)
    expected = by_definition(mask)
    for got in (_row_extents_triton(mask), mask_row_extents_reference(mask), mask_row_extents_reference(mask, 50)):
        for g, e in zip(got, expected):
            assert g.dtype == torch.int32 and torch.equal(g, e)


def test_every_output_element_is_written(monkeypatch):
    """The kernel's outputs allocated poisoned (-7): every row gets its three values."""
    import sparge_diffusers.kernels.mask_rows as mask_rows

    empty = torch.empty
    monkeypatch.setattr(mask_rows.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))
    mask = random_mask(2, 11, 1300, seed=5)
    for got, expected in zip(_row_extents_triton(mask), by_definition(mask)):
        assert torch.equal(got, expected)


def test_views_of_other_strides():
    """A mask cut to its first columns, an expanded batch and transposed or strided (non-contiguous last dim) ones:
    every last dim with a stride other than 1 is copied first, two columns (a transposed pair of rows) and a
    stride of 2 among them."""
    mask = random_mask(1, 11, 1500, seed=1)
    for view in (mask[:, :, :1100], mask.expand(3, 11, 1500), mask[:, :, :40].transpose(1, 2),
                 mask[:, 1:9:2, 7:1300], mask[:, :2].transpose(1, 2), mask[:, :, ::2]):
        expected = by_definition(view.contiguous())
        for got in (_row_extents_triton(view), mask_row_extents(view)):
            for g, e in zip(got, expected):
                assert torch.equal(g, e)


def test_empty_shapes_and_bad_inputs():
    for shape in ((1, 0, 5), (0, 3, 5), (2, 3, 0)):
        mask = torch.zeros(shape, dtype=torch.bool)
        for got in (_row_extents_triton(mask), mask_row_extents(mask)):
            assert [t.shape for t in got] == [shape[:2]] * 3
    for first, last, count in (mask_row_extents(torch.zeros(2, 3, 0, dtype=torch.bool)),
                               _row_extents_triton(torch.zeros(2, 3, 0, dtype=torch.bool))):
        assert (first == 0).all() and (last == -1).all() and (count == 0).all()
    with pytest.raises(ValueError, match="boolean"):
        mask_row_extents(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="boolean"):
        mask_row_extents(torch.zeros(2, 3, dtype=torch.bool))


@pytest.mark.gpu
def test_kernel_on_gpu_matches_the_reference():
    for batch, rows, cols in ((1, 4099, 4099), (2, 333, 5000), (1, 2, 70000)):
        mask = random_mask(batch, rows, cols, seed=cols, density=0.01).cuda()
        mask[:, -1] = torch.arange(cols, device="cuda") >= cols // 2  # one long run
        for g, e in zip(mask_row_extents(mask), mask_row_extents_reference(mask.cpu())):
            assert torch.equal(g.cpu(), e)
    mask = torch.ones(1, 1, 300, 300, dtype=torch.bool, device="cuda").tril()[:, 0]
    first, last, count = mask_row_extents(mask.expand(3, 300, 300))
    assert (first == 0).all() and torch.equal(last[0].cpu(), torch.arange(300, dtype=torch.int32))
