"""Row gather along the sequence dimension in Triton: out[b, h, i] = x[b, h, index[i]] (either layout), or with
one index per head, out[b, h, i] = x[b, h, index[b, h, i]].

torch.index_select on the sequence dimension of a (B, H, N, D) tensor ran at about 1.3 TB/s on an H100, and
torch.gather with a per-head index expanded along D at 111 us for a 67 MB Llama-32K K (a copy takes 46 us);
each token's row is one contiguous run of D elements, which this kernel copies with wide loads (48 us there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2

# Devices whose tensors take the Triton copy. The tests add "cpu" under TRITON_INTERPRET to run the dispatch below
# (layouts, index strides, the fallbacks) without a GPU.
_COPY_DEVICES: tuple[str, ...] = ("cuda",)


@triton.jit
def _gather_rows_kernel(X, INDEX, OUT, N, H,
                        stride_xb, stride_xh, stride_xn, stride_ob, stride_oh, stride_on,
                        D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr,
                        stride_ib=0, stride_ih=0):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    valid = rows < N
    src = tl.load(INDEX + b * stride_ib + h * stride_ih + rows, mask=valid, other=0).to(tl.int64)
    m = valid[:, None] & (cols < D)[None, :]
    x = tl.load(X + b * stride_xb + h * stride_xh + src[:, None] * stride_xn + cols[None, :], mask=m)
    tl.store(OUT + b * stride_ob + h * stride_oh + rows[:, None].to(tl.int64) * stride_on + cols[None, :], x, mask=m)


def gather_rows(x: torch.Tensor, index: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """``x.index_select(seq_dim, index)`` for a 4-D tensor whose sequence dim is 1 or 2 and last dim is dense.

    On CUDA the result has x's strides where x is dense (diffusers' (B, H, N, D) views of (B, N, H*D) projections
    stay so, and the caller's transpose back is free, as with SDPA's output), else it is contiguous. Where autograd
    records through x, torch's gather runs instead (the Triton copy has no backward pass)."""
    if not _copy_applies(x, index):
        return x.index_select(seq_dim, index)
    xh = x if seq_dim == 2 else x.transpose(1, 2)
    out = torch.empty_like(x)  # preserve_format: x's strides when x is dense and non-overlapping
    _launch_gather(xh, index, out if seq_dim == 2 else out.transpose(1, 2), (0, 0))
    return out


def gather_rows_per_head(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[b, h, i] = x[b, h, index[b, h, i]]`` for x (B, H, N, D) and an integer index (B or 1, H, N) of
    positions in [0, N) (not checked: the caller builds it), i.e. ``torch.gather`` along N with the index
    expanded over D. On CUDA (last dims dense, not compiling, no autograd through x) one Triton launch; elsewhere
    ``torch.gather``."""
    if not _copy_applies(x, index):
        return torch.gather(x, 2, index.expand(x.shape[0], *index.shape[1:]).unsqueeze(-1).expand(x.shape))
    out = torch.empty_like(x)
    _launch_gather(x, index, out, (index.stride(0) if index.shape[0] > 1 else 0, index.stride(1)))
    return out


def _copy_applies(x: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether the Triton copy may run: the kernel reads x's rows and the index as dense runs, and has no backward
    pass (compiled, inductor generates its own gather)."""
    return (x.device.type in _COPY_DEVICES and x.stride(-1) == 1 and index.stride(-1) == 1
            and not torch.compiler.is_compiling() and not (x.requires_grad and torch.is_grad_enabled()))


def _launch_gather(xh: torch.Tensor, index: torch.Tensor, oh: torch.Tensor, index_strides: tuple[int, int]) -> None:
    """One launch over (B, H, N, D) views ``xh`` and ``oh``; ``index_strides`` = (0, 0) for one index of all heads."""
    B, H, N, D = xh.shape
    rows = max(1, min(64, 8192 // next_power_of_2(D)))
    launch(_gather_rows_kernel, (cdiv(N, rows), B * H),
        xh, index, oh, N, H, xh.stride(0), xh.stride(1), xh.stride(2), oh.stride(0), oh.stride(1), oh.stride(2),
        D=D, D_PAD=next_power_of_2(D), ROWS=rows, stride_ib=index_strides[0], stride_ih=index_strides[1],
        num_warps=4)
