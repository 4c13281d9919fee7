"""Row extents of a boolean mask: each row's first and last True column and its count of Trues.

Why a kernel: a caller that must recognise the pattern of an element mask (``sparge_diffusers.llm`` reads
transformers' (B, 1, Nq, Nkv) attention masks, 1 GB at 32K tokens, once per forward) needs only these three
numbers per row. In PyTorch they take a sum, two argmax reductions and a reversed copy of the mask; this kernel
reads the mask once (CUDA). On CPU the PyTorch formulation runs, which the tests also use as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch

ROWS_PER_PROGRAM = 4
BLOCK_COLUMNS = 1024


@triton.jit
def _row_extents_kernel(MASK, FIRST, LAST, COUNT, rows_per_batch, n_rows, n_cols, stride_b, stride_r,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < n_rows
    b, i = r // rows_per_batch, r % rows_per_batch
    base = MASK + b.to(tl.int64) * stride_b + i.to(tl.int64) * stride_r
    first = tl.full([ROWS], n_cols, tl.int32)
    last = tl.full([ROWS], -1, tl.int32)
    count = tl.zeros([ROWS], tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        seen = tl.load(base[:, None] + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < n_cols), other=0) != 0
        count += tl.sum(seen.to(tl.int32), 1)
        first = tl.minimum(first, tl.min(tl.where(seen, cols[None, :], n_cols), 1))
        last = tl.maximum(last, tl.max(tl.where(seen, cols[None, :], -1), 1))
    tl.store(FIRST + r, first, mask=row_ok)
    tl.store(LAST + r, last, mask=row_ok)
    tl.store(COUNT + r, count, mask=row_ok)


def mask_row_extents(mask: torch.Tensor, max_elements: int = 1 << 26
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a boolean (B, R, C) mask: (first, last, count), each (B, R) int32 on the mask's device: the
    first and last column holding True (C and -1 in a row without any) and the number of Trues.

    Any strides (an expanded batch, a view cut to its first columns); a last dimension that is not contiguous is
    copied first. CUDA: one Triton kernel. CPU: PyTorch reductions over chunks of at most ``max_elements``
    entries (:func:`mask_row_extents_reference`)."""
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise ValueError(f"mask_row_extents takes a boolean (B, R, C) mask, got {mask.dtype} of shape "
                         f"{tuple(mask.shape)}")
    if mask.device.type != "cuda":
        return mask_row_extents_reference(mask, max_elements)
    return _row_extents_triton(mask)


def _row_extents_triton(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's launch (also run by the tests in the interpreter, on CPU tensors)."""
    batch, rows, cols = mask.shape
    if cols > 1 and mask.stride(2) != 1:
        mask = mask.contiguous()
    first, last, count = (torch.empty(batch, rows, dtype=torch.int32, device=mask.device) for _ in range(3))
    if batch * rows == 0:
        return first, last, count
    launch(_row_extents_kernel, (cdiv(batch * rows, ROWS_PER_PROGRAM),), mask.view(torch.uint8), first, last,
           count, rows, batch * rows, cols, mask.stride(0), mask.stride(1), ROWS=ROWS_PER_PROGRAM,
           BLOCK=BLOCK_COLUMNS, num_warps=4)
    return first, last, count


def mask_row_extents_reference(mask: torch.Tensor, max_elements: int = 1 << 26
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mask_row_extents` in PyTorch, over row chunks of at most ``max_elements`` entries: argmax finds a
    row's first maximum, so the first True of a row, and of the reversed row its last."""
    batch, rows, cols = mask.shape
    step = max(1, max_elements // max(cols * batch, 1))
    firsts, lasts, counts = [], [], []
    for start in range(0, rows, step):
        part = mask[:, start:start + step].to(torch.uint8)
        count = part.sum(-1, dtype=torch.int32)
        seen = count > 0
        if cols == 0:
            first, last = torch.zeros_like(count), torch.zeros_like(count)
        else:
            first, last = part.argmax(-1).int(), (cols - 1 - part.flip(-1).argmax(-1)).int()
        firsts.append(torch.where(seen, first, cols))
        lasts.append(torch.where(seen, last, -1))
        counts.append(count)
    first, last, count = (torch.cat(t, 1) if t else torch.empty(batch, 0, dtype=torch.int32, device=mask.device)
                          for t in (firsts, lasts, counts))
    return first, last, count
