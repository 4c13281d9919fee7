"""NSA-style per-query key-block selection from block-mean keys: one fused Triton kernel, its launcher, the API.

Each query token scores the key blocks by ``softmax_j(scale * q . mean(K_j))`` over the blocks it may see,
summed over the query heads of its KV head's group (NSA, Eq. 9-10: a group shares one selection), and keeps
the ``top_k`` best, always including the first ``sink_blocks`` blocks and, under causal masking, its own block
and the ``local_blocks - 1`` before it (NSA's fixed initial and local blocks). The result feeds
:func:`~sparge_diffusers.kernels.selected.selected_block_attention`.

Departure from NSA: it scores with learned compressed keys; the block means (SpargeAttn's compression) need no
training.

The kernel (``_select_key_blocks_kernel``): one program per ``BLOCK_Q`` query tokens and KV head holds the
``BLOCK_Q x group`` query rows of its group and walks the block means twice:

1. in chunks of ``SELECT_CHUNK`` blocks, the softmax statistics (running row maximum and sum, base 2, per query
   head), as in FlashAttention;
2. in chunks of ``K_PAD`` blocks (``top_k`` rounded up to a power of two, at least 16), the normalised
   probabilities, summed over the group's heads into each token's block importance, and merged into a running
   top-``K_PAD``: the running best sorted descending and the chunk sorted ascending have as elementwise maxima
   the top ``K_PAD`` of both (a bitonic sequence), which the last stages of a bitonic sort order again. Per chunk
   one bitonic sort and one merge, no serial rounds (``top_k`` rounds of a row maximum were 2-14x slower).

An importance and its block number travel as one integer key: the float32's bits above (non-negative floats
order as their bits), ``2^b - 1 - block`` in the low ``b`` bits (ties go to the lower block, keys are distinct).
With ``b = ceil(log2(n_blocks))`` bits of block number an int32 key keeps the importance to ``23 - b`` mantissa
bits (14 at 512 blocks); past ``KEY32_MAX_BLOCKS`` blocks the key is int64 and the importance exact. On the H100
int32 keys made the whole call 1.5-1.8x faster than int64 ones.

Under causal masking a program stops at the last block any of its tokens sees (on average half the blocks).
At Llama-3.1-8B's 32K prefill shape a call takes 0.63-1.16 ms on an H100 (block 128 x top_k 8 / 64 x 16), 4.5-8.3%
of dense cuDNN attention; the variants measured on the way are in benchmarks/results/select-variants-H100.txt.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2
from ._inputs import (Backend, CausalVariant, TensorLayout, check_attention_inputs, check_kernel_dtype, pick_backend,
                      resolve_scale, to_hnd)
from .attention import LOG2E
from .selected import _check_block_size

# Query rows (tokens x group heads) per program, and block means per chunk of the statistics pass. H100, 32K
# (benchmarks/fsa.py's inputs, int32 keys): 64 and 128 rows within 4% of each other, 32 rows 1.5x slower.
SELECT_ROWS = 64
SELECT_CHUNK = 64
# Launch options; None = the defaults in select_key_blocks_triton (sweeps set this).
SELECT_LAUNCH: dict | None = None
# Up to this many key blocks the keys are int32 (block number in the low bits), above it int64.
KEY32_MAX_BLOCKS = 1 << 16
# The importance of forced blocks: above any sum of group probabilities (<= group), in every key width.
FORCED_IMPORTANCE = 1.0e30


@triton.jit
def _compare_swap(x, ascending, i: tl.constexpr):
    """One bitonic step along the last axis of x ([R, K], K a power of two): each pair 2**i apart is ordered,
    ascending where ``ascending`` (x's shape, equal within a pair) is true. tl.max / tl.min over an axis of
    two (Triton's own sort reduces with a custom combine, which the interpreter runs element by element)."""
    shape: tl.constexpr = [x.numel // (2 * 2 ** i), 2, 2 ** i]
    y = tl.reshape(x, shape)
    low = tl.min(y, 1, keep_dims=True)
    high = tl.max(y, 1, keep_dims=True)
    first = (tl.arange(0, 2) == 0)[None, :, None]
    return tl.reshape(tl.where(first == tl.reshape(ascending, shape), low, high), x.shape)


@triton.jit
def _bitonic_sort(x, LOG_K: tl.constexpr, DESCENDING: tl.constexpr):
    """Sort each row of x ([R, 2**LOG_K]): runs of 2**stage alternate in direction until the last stage."""
    pos = tl.zeros(x.shape, tl.int32) + tl.arange(0, 2 ** LOG_K)[None, :]
    for stage in tl.static_range(1, LOG_K + 1):
        ascending = (((pos >> stage) & 1) == 0) != DESCENDING
        for step in tl.static_range(0, stage):
            x = _compare_swap(x, ascending, stage - 1 - step)
    return x


@triton.jit
def _bitonic_merge_descending(x, LOG_K: tl.constexpr):
    """Sort each row of x ([R, 2**LOG_K]) that is a bitonic sequence, descending: the last stage of a sort."""
    descending = tl.zeros(x.shape, tl.int1)
    for step in tl.static_range(0, LOG_K):
        x = _compare_swap(x, descending, LOG_K - 1 - step)
    return x


@triton.jit
def _block_scores(q, means_base, stride_mn, blocks, offs_d, d_mask, n_blocks, row_position, scale_log2,
                  BLOCK_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Base-2 scores of q's rows against the means of ``blocks``; -inf where a row's token (at key position
    ``row_position``) cannot see a block."""
    means = tl.load(means_base + blocks[:, None].to(tl.int64) * stride_mn + offs_d[None, :],
                    mask=(blocks < n_blocks)[:, None] & d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(means)) * scale_log2
    visible = (blocks < n_blocks)[None, :]
    if IS_CAUSAL:
        visible = visible & (blocks[None, :] * BLOCK_SIZE <= row_position[:, None])
    return tl.where(visible, s, -float("inf"))


@triton.jit
def _select_key_blocks_kernel(
    Q, MEANS, OUT,
    scale_log2, q_len, kv_heads, group, n_blocks, top_k, sink_blocks, local_blocks, causal_offset,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_mb, stride_mh, stride_mn,
    stride_ob, stride_oh, stride_on,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    CHUNK: tl.constexpr, K_PAD: tl.constexpr, LOG_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr,
    KEY32: tl.constexpr, IDX_BITS: tl.constexpr, FORCED: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // kv_heads
    hk = bh % kv_heads
    q0 = tile * BLOCK_Q

    # row r = (token q0 + r // GROUP_PAD, query head hk * group + r % GROUP_PAD): a token's heads are adjacent,
    # so the importance is a sum over the middle axis of a [BLOCK_Q, GROUP_PAD, K_PAD] reshape
    rows = tl.arange(0, ROWS)
    row_token = q0 + rows // GROUP_PAD
    row_position = row_token + causal_offset  # the token's key position under causal masking
    row_head = rows % GROUP_PAD
    row_valid = (row_token < q_len) & (row_head < group)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = Q + b * stride_qb + (hk * group + row_head)[:, None].to(tl.int64) * stride_qh \
        + row_token[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_rows, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    means_base = MEANS + b * stride_mb + hk * stride_mh
    offs_c = tl.arange(0, CHUNK)

    if IS_CAUSAL:  # blocks past the tile's last token are hidden from all of its tokens
        walk_end = tl.minimum(n_blocks, tl.maximum(q0 + BLOCK_Q - 1 + causal_offset, 0) // BLOCK_SIZE + 1)
    else:
        walk_end = n_blocks

    # pass 1: each row's maximum and sum of exp2 over its visible blocks
    m = tl.full([ROWS], -float("inf"), tl.float32)
    den = tl.zeros([ROWS], tl.float32)
    for c0 in range(0, walk_end, CHUNK):
        s = _block_scores(q, means_base, stride_mn, c0 + offs_c, offs_d, d_mask, n_blocks, row_position,
                          scale_log2, BLOCK_SIZE, IS_CAUSAL)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
        den = den * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m = m_new
    # padded heads and rows weigh nothing, and so do rows that see no block (a lower-right row before the keys)
    weight = tl.where(row_valid & (den > 0), 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)

    # pass 2: importance per (token, block) as packed keys, merged chunk by chunk into the running top-K_PAD
    # (best, descending): max(best, chunk ascending) is the top K_PAD of both, a bitonic sequence, sorted again
    tokens = q0 + tl.arange(0, BLOCK_Q)
    # each token's key position and own block; a row before the keys (lower right, Nq > Nkv) sees no block, and
    # ``seen`` below drops whatever its (truncated) own block would force
    positions = tokens + causal_offset
    own = (positions // BLOCK_SIZE)[:, None]
    cols = tl.arange(0, K_PAD)
    best = tl.full([BLOCK_Q, K_PAD], -1, tl.int32 if KEY32 else tl.int64)
    offs_m = tl.arange(0, K_PAD)
    for c0 in range(0, walk_end, K_PAD):
        blocks = c0 + offs_m
        s = _block_scores(q, means_base, stride_mn, blocks, offs_d, d_mask, n_blocks, row_position, scale_log2,
                          BLOCK_SIZE, IS_CAUSAL)
        p = tl.exp2(s - m_safe[:, None]) * weight[:, None]  # hidden blocks: exp2(-inf) = 0
        importance = tl.sum(tl.reshape(p, [BLOCK_Q, GROUP_PAD, K_PAD]), 1)  # in [0, group]
        seen = (blocks < n_blocks)[None, :] & (tokens < q_len)[:, None]
        forced = (blocks < sink_blocks)[None, :]
        if IS_CAUSAL:
            seen = seen & (blocks[None, :] * BLOCK_SIZE <= positions[:, None])
            forced = forced | ((blocks[None, :] <= own) & (blocks[None, :] > own - local_blocks))
        importance = tl.where(forced, FORCED, importance)
        bits = importance.to(tl.int32, bitcast=True)
        if KEY32:
            keys = ((bits >> IDX_BITS) << IDX_BITS) | ((1 << IDX_BITS) - 1 - blocks)[None, :]
        else:
            keys = (bits.to(tl.int64) << 32) | (2147483647 - blocks)[None, :]
        keys = tl.where(seen, keys, -1)
        best = _bitonic_merge_descending(tl.maximum(best, _bitonic_sort(keys, LOG_K, False)), LOG_K)

    if KEY32:
        block_of = (1 << IDX_BITS) - 1 - (best & ((1 << IDX_BITS) - 1))
    else:
        block_of = 2147483647 - (best - ((best >> 32) << 32))
    result = tl.where(best >= 0, block_of, -1).to(tl.int32)
    out_rows = OUT + b * stride_ob + hk * stride_oh + tokens[:, None].to(tl.int64) * stride_on
    tl.store(out_rows + cols[None, :], result, mask=(tokens < q_len)[:, None] & (cols < top_k)[None, :])


def block_mean_keys(kh: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, H_kv, ceil(N / block_size), D) float32 means of each block of ``block_size`` keys (the last one over
    its own keys), from a (B, H_kv, N, D) view, without a float32 copy of the keys."""
    n = kh.shape[2]
    full = n // block_size
    parts = [kh[:, :, :full * block_size].unflatten(2, (full, block_size)).sum(3, dtype=torch.float32) / block_size]
    if n % block_size:
        parts.append(kh[:, :, full * block_size:].sum(2, keepdim=True, dtype=torch.float32) / (n % block_size))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def select_key_blocks_triton(qh: torch.Tensor, kh: torch.Tensor, out: torch.Tensor, *, block_size: int,
                             is_causal: bool, scale: float, sink_blocks: int, local_blocks: int,
                             causal_offset: int = 0) -> None:
    """Launch the selection kernel on (B, H, Nq, D) / (B, H_kv, Nkv, D) views; writes every element of ``out``
    ((B, H_kv, Nq, top_k) int32, last dim contiguous)."""
    B, H, Nq, D = qh.shape
    HK = kh.shape[1]
    group = H // HK
    top_k = out.shape[-1]
    means = block_mean_keys(kh, block_size).to(qh.dtype)  # the scores are a tensor-core product, as on the GPU
    n_blocks = means.shape[2]
    group_pad = next_power_of_2(group)
    block_q = max(1, SELECT_ROWS // group_pad)
    k_pad = max(16, next_power_of_2(top_k))
    config = SELECT_LAUNCH if SELECT_LAUNCH is not None else {"num_warps": 4, "num_stages": 2}
    launch(_select_key_blocks_kernel, (cdiv(Nq, block_q), B * HK),
           qh, means, out, scale * LOG2E, Nq, HK, group, n_blocks, top_k, sink_blocks, local_blocks, causal_offset,
           *qh.stride(), *means.stride()[:3], *out.stride()[:3],
           HEAD_DIM=D, D_PAD=max(16, next_power_of_2(D)), GROUP_PAD=group_pad, BLOCK_Q=block_q,
           CHUNK=SELECT_CHUNK, K_PAD=k_pad, LOG_K=k_pad.bit_length() - 1, BLOCK_SIZE=block_size,
           IS_CAUSAL=is_causal, KEY32=n_blocks <= KEY32_MAX_BLOCKS,
           IDX_BITS=max(1, (n_blocks - 1).bit_length()), FORCED=FORCED_IMPORTANCE, **config)


def select_key_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    top_k: int,
    block_size: int = 64,
    is_causal: bool = True,
    scale: float | None = None,
    sink_blocks: int = 1,
    local_blocks: int = 1,
    tensor_layout: TensorLayout = "HND",
    backend: Backend = "auto",
    query_chunk: int = 2048,
    causal_variant: CausalVariant | None = None,
) -> torch.Tensor:
    """A per-query selection of ``top_k`` key blocks, NSA-style, from block-mean keys.

    Each query token scores the key blocks by the softmax of ``scale * q . mean(K_block)`` over the blocks it may
    see, summed over the query heads of its KV head's group (NSA, Eq. 9-10, shares one selection per group), and
    keeps the ``top_k`` best, always including the first ``sink_blocks`` blocks and, under causal masking, its own
    block and the ``local_blocks - 1`` before it (NSA's fixed initial and local blocks). Departure: NSA scores
    with its learned compressed keys; block means (SpargeAttn's compression) need no training.

    Args:
        q, k: as for :func:`~sparge_diffusers.kernels.selected.selected_block_attention` (fp16/bf16 on the
            Triton backend; the reference takes any float dtype).
        backend: "auto" (the fused Triton kernel on CUDA, the float32 reference on CPU), "triton" or
            "reference". The kernel scores in the inputs' precision (block means rounded to it, float32
            accumulation), so blocks whose importances tie to that precision may be picked differently.
        query_chunk: query tokens per step of the reference (bounds its (tokens, blocks) score buffers).
        causal_variant: for causal calls with Nq != Nkv, as for
            :func:`~sparge_diffusers.kernels.selected.selected_block_attention`: "lower_right" puts query i at key
            position i + Nkv - Nq (its own block and visibility follow that position), "upper_left" at i.
    Returns:
        (B, H_kv, Nq, top_k) int32 block indices, best first (ties: the lower block); -1 where fewer than
        ``top_k`` blocks are visible.

    Inside ``torch.compile``d code call :func:`~sparge_diffusers.kernels.library.select_key_blocks_op` (the same
    call as one custom-operator node).
    """
    shape = check_attention_inputs(q, k, None, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant)
    _check_block_size(block_size)
    scale = resolve_scale(scale, shape.head_dim)
    for name, value, low in (("top_k", top_k, 1), ("sink_blocks", sink_blocks, 0), ("local_blocks", local_blocks, 0),
                             ("query_chunk", query_chunk, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    kwargs: dict[str, Any] = dict(block_size=block_size, is_causal=is_causal, scale=scale, sink_blocks=sink_blocks,
                                  local_blocks=local_blocks, causal_offset=shape.causal_offset)
    if pick_backend(backend, q.device, q.shape[-1]) == "reference":
        from .reference import reference_select_key_blocks

        return reference_select_key_blocks(q, k, top_k=top_k, tensor_layout=tensor_layout,
                                           query_chunk=query_chunk, **kwargs)
    check_kernel_dtype(q.dtype)
    out = torch.empty(shape.batch, shape.kv_heads, shape.q_len, top_k, dtype=torch.int32, device=q.device)
    # no query sees more than the key blocks there are: the kernel sorts min(top_k, blocks) columns (its sort width,
    # a compile-time constant, follows top_k: top_k = 10_000 compiled a 16384-wide sort, once per block count) and
    # the rest are -1, as they would be
    picked = min(top_k, cdiv(shape.kv_len, block_size))
    if picked < top_k:
        out[..., picked:] = -1
    select_key_blocks_triton(to_hnd(q, tensor_layout), to_hnd(k, tensor_layout), out[..., :picked], **kwargs)
    return out
