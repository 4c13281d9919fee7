"""PBS-Attn's segmented key permutation for causal attention (Wang et al. 2025, arXiv 2510.21270, Sec. 3).

Causal attention is not invariant to any reordering of the keys, but it is to one that stays within aligned
segments of S positions, provided the keys keep their original positions for the causal test of the segments
on the diagonal: keys of earlier segments are wholly visible to a query and keys of later ones wholly hidden,
whatever their order inside a segment. PBS-Attn sorts each segment's keys by an estimate of how much attention
they receive overall, so that the few keys that many queries attend to (the "vertical lines" of LLM attention
maps) share a few key blocks, and a block mask can skip more of the others.

Knows nothing of the kernels: this module computes the order; ``kernels.PermutedKeys`` tells the kernels about it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._launch import launch

# Queries of the last block: PBS-Attn's proxy for every query's attention.
IMPORTANCE_QUERIES = 128
_KEY_CHUNK = 8192  # keys per chunk of the PyTorch path (bounds its float32 scratch to H x 128 x chunk)
_LOG2E = 1.4426950408889634


@triton.jit
def _last_rows(q_ptr, b, hk, r0, nq, q_offset, rows, GROUP, stride_qb, stride_qh, stride_qn,
               D: tl.constexpr, ROWS_TILE: tl.constexpr):
    """A tile of the stacked last-block queries of K/V head ``hk``: stacked row r is query head hk*GROUP + r //
    rows, query row nq - rows + r % rows, at causal position that row + q_offset. Returns (q tile, positions,
    valid)."""
    r = r0 + tl.arange(0, ROWS_TILE)
    valid = r < GROUP * rows
    head = hk * GROUP + r // rows
    row = nq - rows + r % rows
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + head[:, None].to(tl.int64) * stride_qh + row[:, None].to(tl.int64) * stride_qn
                + offs_d[None, :], mask=valid[:, None], other=0.0)
    return q, row + q_offset, valid


@triton.jit
def _last_rows_lse_kernel(Q, K, M_OUT, L_OUT, n, nq, q_offset, rows, GROUP, HK, n_rows_pad, chunk, qk_scale,
                          stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                          D: tl.constexpr, ROWS_TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 1: per stacked row, the max and the sum of 2^(s - max) of its log2-scaled scores over this program's
    chunk of keys (combined over chunks on the host)."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = (pid_bh % HK).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k_base = K + b * stride_kb + hk * stride_kh
    for r0 in range(0, GROUP * rows, ROWS_TILE):
        q, pos, valid = _last_rows(Q, b, hk, r0, nq, q_offset, rows, GROUP, stride_qb, stride_qh, stride_qn, D,
                                   ROWS_TILE)
        m = tl.full([ROWS_TILE], float("-inf"), tl.float32)
        l = tl.zeros([ROWS_TILE], tl.float32)
        for start in range(pid_c * chunk, tl.minimum(pid_c * chunk + chunk, n), BLOCK_N):
            cols = start + offs_n
            k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=(cols < n)[:, None],
                        other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where((cols[None, :] <= pos[:, None]) & (cols < n)[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp2(m - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), axis=1)
            m = m_new
        out = (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_c) * n_rows_pad + r0 + tl.arange(0, ROWS_TILE)
        tl.store(M_OUT + out, m)
        tl.store(L_OUT + out, l)


@triton.jit
def _key_importance_kernel(Q, K, LSE, OUT, n, nq, q_offset, rows, GROUP, HK, n_rows_pad, qk_scale,
                           stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                           D: tl.constexpr, ROWS_TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 2: each key's mean over the stacked rows of 2^(s - lse_row), i.e. its mean attention probability."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = (pid_bh % HK).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=(cols < n)[:, None], other=0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, GROUP * rows, ROWS_TILE):
        q, pos, valid = _last_rows(Q, b, hk, r0, nq, q_offset, rows, GROUP, stride_qb, stride_qh, stride_qn, D,
                                   ROWS_TILE)
        lse = tl.load(LSE + pid_bh.to(tl.int64) * n_rows_pad + r0 + tl.arange(0, ROWS_TILE))
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = valid[:, None] & (cols[None, :] <= pos[:, None])
        total += tl.sum(tl.where(visible, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    tl.store(OUT + pid_bh.to(tl.int64) * n + cols, total / (GROUP * rows), mask=cols < n)


def _importance_triton(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int, q_offset: int) -> torch.Tensor:
    B, H, NQ, D = q.shape
    HK, N = k.shape[1], k.shape[2]
    if D & (D - 1) or D < 16 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"the Triton importance kernels take a power-of-two head dim >= 16 with unit stride along "
                         f"it, got D = {D} (use backend='torch')")
    rows_tile, block_n, chunk = 64, 64, 1024
    n_rows = (H // HK) * rows
    n_rows_pad = triton.cdiv(n_rows, rows_tile) * rows_tile
    n_chunks = triton.cdiv(N, chunk)
    qk_scale = scale * _LOG2E
    m = torch.empty(B * HK, n_chunks, n_rows_pad, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    common = (N, NQ, q_offset, rows, H // HK, HK)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    launch(_last_rows_lse_kernel, (n_chunks, B * HK), q, k, m, l, *common, n_rows_pad, chunk, qk_scale, *strides,
           D=D, ROWS_TILE=rows_tile, BLOCK_N=block_n, num_warps=4)
    m_max = m.amax(dim=1, keepdim=True)
    m_use = torch.where(torch.isinf(m_max), 0.0, m_max)
    lse = (m_use + torch.log2((l * torch.exp2(m - m_use)).sum(dim=1, keepdim=True))).squeeze(1).contiguous()
    out = torch.empty(B, HK, N, device=q.device, dtype=torch.float32)
    launch(_key_importance_kernel, (triton.cdiv(N, block_n), B * HK), q, k, lse, out, *common, n_rows_pad, qk_scale,
           *strides, D=D, ROWS_TILE=rows_tile, BLOCK_N=block_n, num_warps=4)
    return out


def _importance_torch(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int, q_offset: int) -> torch.Tensor:
    """The float32 PyTorch path (CPU; the Triton kernels' reference in the tests)."""
    B, H, NQ, D = q.shape
    HK, N = k.shape[1], k.shape[2]
    # (B, H_kv, group * rows, D): the last block's queries of every head sharing a key head, side by side
    q_last = q[:, :, NQ - rows:].float().reshape(B, HK, (H // HK) * rows, D) * scale
    q_pos = torch.arange(NQ - rows, NQ, device=q.device).repeat(H // HK) + q_offset  # each stacked row's position

    def chunk_scores(start: int, stop: int) -> torch.Tensor:
        s = q_last @ k[:, :, start:stop].float().transpose(-1, -2)
        k_pos = torch.arange(start, stop, device=q.device)
        return s.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)

    chunks = [(i, min(i + _KEY_CHUNK, N)) for i in range(0, N, _KEY_CHUNK)]
    lse = torch.stack([torch.logsumexp(chunk_scores(a, b), dim=-1) for a, b in chunks], dim=-1).logsumexp(-1)
    return torch.cat([torch.exp(chunk_scores(a, b) - lse[..., None]).mean(dim=-2) for a, b in chunks], dim=-1)


def _importance_query_offset(q_len: int, kv_len: int, causal_variant: str | None) -> int:
    """The causal position of query row 0 for :func:`last_block_key_importance` (the kernels' rule, restated here
    since this package knows nothing of the kernels): 0 for equal lengths and "upper_left", kv_len - q_len for
    "lower_right" (a chunk of queries at the end of its keys). Raises ValueError for unequal lengths without a
    variant, and for more queries than keys (the last queries would see no key to rank)."""
    if causal_variant not in (None, "upper_left", "lower_right"):
        raise ValueError(f"causal_variant must be 'upper_left', 'lower_right' or None, got {causal_variant!r}")
    if q_len > kv_len:
        raise ValueError(f"key importance needs at least as many keys as queries, got {q_len} queries and "
                         f"{kv_len} keys")
    if q_len == kv_len:
        return 0
    if causal_variant is None:
        raise ValueError(f"{q_len} queries and {kv_len} keys: pass causal_variant='lower_right' (a chunk of queries "
                         f"at the end of its keys, as against a KV cache) or 'upper_left'")
    return kv_len - q_len if causal_variant == "lower_right" else 0


def last_block_key_importance(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                              queries: int = IMPORTANCE_QUERIES, backend: str = "auto",
                              causal_variant: str | None = None) -> torch.Tensor:
    """PBS-Attn's query-aware key importance: the mean attention probability each key receives from the last
    ``queries`` queries (causal), averaged over the query heads that share the key head.

    Args:
        q: (B, H, Nq, D) queries; k: (B, H_kv, Nkv, D) keys (H_kv divides H, Nq <= Nkv).
        scale: softmax scale, default 1/sqrt(D).
        backend: "auto" (Triton on CUDA where the head dim is a power of two >= 16 and the last dims are dense,
            PyTorch float32 elsewhere), "triton" or "torch".
        causal_variant: where the queries sit when Nq < Nkv: "lower_right" (the last Nq positions: a chunk of a
            prompt against its KV cache, whose last queries are then the prompt's so far) or "upper_left" (the
            first Nq). Needed only when the lengths differ (:func:`_importance_query_offset`).
    Returns:
        (B, H_kv, Nkv) float32 importance (each (b, h_kv) row sums to 1).

    Memory stays O(N). The Triton path makes two passes over the keys (row log-sum-exps, then each key's mean
    probability) with float32 accumulation; the PyTorch path computes the scores in key chunks, twice.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] == 0 \
            or q.shape[1] % k.shape[1] or q.shape[2] == 0:
        raise ValueError(f"q (B, H, Nq, D) and k (B, H_kv, Nkv, D) with H_kv dividing H expected, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    q_offset = _importance_query_offset(q.shape[2], k.shape[2], causal_variant)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    rows = min(queries, q.shape[2])
    d = q.shape[-1]
    if backend == "triton" or (backend == "auto" and q.is_cuda and d >= 16 and not d & (d - 1)
                               and q.stride(-1) == 1 and k.stride(-1) == 1):
        return _importance_triton(q, k, scale, rows, q_offset)
    return _importance_torch(q, k, scale, rows, q_offset)


def segmented_key_order(importance: torch.Tensor, segment: int) -> torch.Tensor:
    """Within each aligned segment of ``segment`` positions (the last may be shorter), the key positions by
    descending importance (ties: lower position first).

    Args:
        importance: (..., N) scores, e.g. from :func:`last_block_key_importance`.
        segment: positions per segment, > 0.
    Returns:
        (..., N) int64 ``order``: slot r holds the key at original position ``order[..., r]``, always a
        position of slot r's own segment. Gather k and v with it; it is also ``kernels.PermutedKeys.positions``.
    """
    if not isinstance(segment, int) or isinstance(segment, bool) or segment <= 0:
        raise ValueError(f"segment must be a positive int, got {segment!r}")
    n = importance.shape[-1]
    pad = -n % segment
    padded = torch.nn.functional.pad(importance.float(), (0, pad), value=-math.inf)  # padding sorts last
    groups = padded.reshape(*importance.shape[:-1], -1, segment)
    local = torch.sort(groups, dim=-1, descending=True, stable=True).indices
    starts = torch.arange(0, n + pad, segment, device=importance.device)[:, None]
    return (local + starts).flatten(-2)[..., :n]


def gather_keys(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x (B, H_kv, N, D) with its tokens reordered per head: out[b, h, r] = x[b, h, order[b, h, r]]."""
    return torch.gather(x, 2, order.unsqueeze(-1).expand(*order.shape, x.shape[-1]))
