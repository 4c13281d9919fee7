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

from .._launch import cdiv, launch, next_power_of_2, triton_launch_reason
from .gather import gather_rows_per_head

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
def _lse_step(q, k_base, start, offs_n, offs_d, n, pos, m, l, qk_scale, stride_kn, MASKED: tl.constexpr):
    """One key tile of pass 1: (m, l) of the row tile updated with keys [start, start + BLOCK_N). The scale is
    applied inside the exponent's FMA (the raw scores' max is the scaled scores' max: qk_scale > 0)."""
    cols = start + offs_n
    if MASKED:
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=(cols < n)[:, None],
                    other=0.0)
    else:
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :])
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where((cols[None, :] <= pos[:, None]) & (cols < n)[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    l = l * tl.exp2(m - m_use) + tl.sum(tl.exp2(s * qk_scale - m_use[:, None]), axis=1)
    return m_new, l


@triton.jit
def _last_rows_lse_kernel(Q, K, M_OUT, L_OUT, n, nq, q_offset, rows, GROUP, HK, n_rows_pad, chunk, qk_scale,
                          stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                          D: tl.constexpr, ROWS_TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 1: per stacked row of this program's row tile, the max and the sum of 2^(s - max) of its log2-scaled
    scores over this program's chunk of keys (combined over chunks by _combine_lse_kernel). Keys up to the first row's
    position are visible to every row and skip the causal test."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS_TILE
    b = (pid_bh // HK).to(tl.int64)
    hk = (pid_bh % HK).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k_base = K + b * stride_kb + hk * stride_kh
    q, pos, valid = _last_rows(Q, b, hk, r0, nq, q_offset, rows, GROUP, stride_qb, stride_qh, stride_qn, D,
                               ROWS_TILE)
    m = tl.full([ROWS_TILE], float("-inf"), tl.float32)
    l = tl.zeros([ROWS_TILE], tl.float32)
    c0 = pid_c * chunk
    c1 = tl.minimum(c0 + chunk, n)
    every_row = (nq - rows + q_offset + 1) // BLOCK_N * BLOCK_N  # whole tiles of keys every row sees
    mid = tl.maximum(tl.minimum(c1, every_row), c0)
    for start in range(c0, mid, BLOCK_N):
        m, l = _lse_step(q, k_base, start, offs_n, offs_d, n, pos, m, l, qk_scale, stride_kn, False)
    for start in range(mid, c1, BLOCK_N):
        m, l = _lse_step(q, k_base, start, offs_n, offs_d, n, pos, m, l, qk_scale, stride_kn, True)
    out = (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_c) * n_rows_pad + r0 + tl.arange(0, ROWS_TILE)
    tl.store(M_OUT + out, m)
    tl.store(L_OUT + out, l)


@triton.jit
def _key_importance_kernel(Q, K, LSE, OUT, n, nq, q_offset, rows, GROUP, HK, n_rows_pad, qk_scale,
                           stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                           D: tl.constexpr, ROWS_TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 2: each key's mean over the stacked rows of 2^(s - lse_row), i.e. its mean attention probability.
    The scores are computed transposed (keys x rows: the key tile is the product's A operand, held for every
    row tile)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = (pid_bh % HK).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=(cols < n)[:, None], other=0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    causal = (pid_n + 1) * BLOCK_N > nq - rows + q_offset + 1  # else every row sees every key of the tile
    for r0 in range(0, GROUP * rows, ROWS_TILE):
        q, pos, valid = _last_rows(Q, b, hk, r0, nq, q_offset, rows, GROUP, stride_qb, stride_qh, stride_qn, D,
                                   ROWS_TILE)
        lse = tl.load(LSE + pid_bh.to(tl.int64) * n_rows_pad + r0 + tl.arange(0, ROWS_TILE))
        st = tl.dot(k, tl.trans(q))  # (BLOCK_N, ROWS_TILE)
        p = tl.exp2(st * qk_scale - lse[None, :])
        if causal:
            p = tl.where(valid[None, :] & (cols[:, None] <= pos[None, :]), p, 0.0)
        else:
            p = tl.where(valid[None, :], p, 0.0)
        total += tl.sum(p, axis=1)
    tl.store(OUT + pid_bh.to(tl.int64) * n + cols, total / (GROUP * rows), mask=cols < n)


@triton.jit
def _combine_lse_kernel(M_IN, L_IN, LSE, n_chunks, n_rows_pad, BLOCK: tl.constexpr):
    """Between the passes: each stacked row's log2-sum-exp from pass 1's per-chunk (max, sum). Padding rows (no
    query, all chunks -inf or empty) get a finite value; pass 2 masks them."""
    pid_bh = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = r < n_rows_pad
    base = pid_bh * n_chunks * n_rows_pad + r
    m_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for c in range(n_chunks):
        m_max = tl.maximum(m_max, tl.load(M_IN + base + c * n_rows_pad, mask=valid, other=float("-inf")))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK], tl.float32)
    for c in range(n_chunks):
        off = base + c * n_rows_pad
        m = tl.load(M_IN + off, mask=valid, other=0.0)
        total += tl.load(L_IN + off, mask=valid, other=0.0) * tl.exp2(m - m_max)
    tl.store(LSE + pid_bh * n_rows_pad + r, m_max + tl.log2(tl.where(total > 0, total, 1.0)), mask=valid)


# Tile settings, from a sweep on an H100 at Llama-3.1-8B's heads and 32K keys (benchmarks/results/pbs-H100.txt):
# pass 1 takes 128 rows x 64 keys per step over chunks of 4096 keys, pass 2 128 keys x 32 rows.
_PASS1_ROWS, _PASS1_KEYS, _PASS1_WARPS = 128, 64, 8
_PASS2_ROWS, _PASS2_KEYS, _PASS2_WARPS = 32, 128, 4
IMPORTANCE_KEY_CHUNK = 4096  # keys per pass-1 program (module level: tests shrink it to cover several chunks)


def _importance_triton(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int, q_offset: int) -> torch.Tensor:
    B, H, NQ, D = q.shape
    HK, N = k.shape[1], k.shape[2]
    if D & (D - 1) or D < 16 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"the Triton importance kernels take a power-of-two head dim >= 16 with unit stride along "
                         f"it, got D = {D} (use backend='torch')")
    chunk = IMPORTANCE_KEY_CHUNK
    n_rows = (H // HK) * rows
    n_rows_pad = cdiv(n_rows, _PASS1_ROWS) * _PASS1_ROWS  # (a multiple of _PASS2_ROWS too)
    n_chunks = cdiv(N, chunk)
    qk_scale = scale * _LOG2E
    m = torch.empty(B * HK, n_chunks, n_rows_pad, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    common = (N, NQ, q_offset, rows, H // HK, HK)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    launch(_last_rows_lse_kernel, (n_chunks, B * HK, n_rows_pad // _PASS1_ROWS), q, k, m, l, *common, n_rows_pad,
           chunk, qk_scale, *strides, D=D, ROWS_TILE=_PASS1_ROWS, BLOCK_N=_PASS1_KEYS, num_warps=_PASS1_WARPS)
    lse = torch.empty(B * HK, n_rows_pad, device=q.device, dtype=torch.float32)
    launch(_combine_lse_kernel, (cdiv(n_rows_pad, 256), B * HK), m, l, lse, n_chunks, n_rows_pad, BLOCK=256,
           num_warps=4)
    out = torch.empty(B, HK, N, device=q.device, dtype=torch.float32)
    launch(_key_importance_kernel, (cdiv(N, _PASS2_KEYS), B * HK), q, k, lse, out, *common, n_rows_pad,
           qk_scale, *strides, D=D, ROWS_TILE=_PASS2_ROWS, BLOCK_N=_PASS2_KEYS, num_warps=_PASS2_WARPS)
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
        scale: softmax scale, positive and finite; default 1/sqrt(D).
        queries: how many of the last queries rank the keys, a positive int (all of them where there are fewer).
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
    reason = triton_launch_reason(q.device) if backend == "triton" else None
    if reason is not None:
        raise ValueError(f"backend='triton': {reason}; use backend='torch' or 'auto'")
    if not isinstance(queries, int) or isinstance(queries, bool) or queries <= 0:  # 0: a mean over no rows, NaN
        raise ValueError(f"queries must be a positive int, got {queries!r}")
    q_offset = _importance_query_offset(q.shape[2], k.shape[2], causal_variant)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:  # <= 0 reverses the ranking; the Triton passes also assume > 0
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    rows = min(queries, q.shape[2])
    d = q.shape[-1]
    if backend == "triton" or (backend == "auto" and q.is_cuda and d >= 16 and not d & (d - 1)
                               and q.stride(-1) == 1 and k.stride(-1) == 1):
        return _importance_triton(q, k, scale, rows, q_offset)
    return _importance_torch(q, k, scale, rows, q_offset)


@triton.jit
def _segment_argsort_kernel(SCORES, ORDER, n, SEGMENT: tl.constexpr, SEGMENT_PAD: tl.constexpr):
    """One segment of one row per program: its positions by descending score, ties lower position first.

    Each score becomes one int64 sort key: the float's bits mapped to an order-preserving int32 (negative floats'
    magnitude bits flipped; -0.0 first turned into +0.0, which torch.sort ranks equal) in the high half, and the
    flipped local position in the low half, so that one descending bitonic sort (tl.sort) orders by score and
    then by position. Padding (past the row's end, or past a segment that is not a power of two) scores -inf and
    sorts after every real key, -inf ones included."""
    seg = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, SEGMENT_PAD)
    pos = seg * SEGMENT + i
    real = (i < SEGMENT) & (pos < n)
    x = tl.load(SCORES + row * n + pos, mask=real, other=float("-inf")) + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ranked = tl.sort((key.to(tl.int64) << 32) | (SEGMENT_PAD - 1 - i).to(tl.int64), descending=True)
    local = SEGMENT_PAD - 1 - (ranked & 0xFFFFFFFF)
    tl.store(ORDER + row * n + seg * SEGMENT + i, seg * SEGMENT + local, mask=real)


def segmented_key_order(importance: torch.Tensor, segment: int) -> torch.Tensor:
    """Within each aligned segment of ``segment`` positions (the last may be shorter), the key positions by
    descending importance (ties: lower position first).

    Args:
        importance: (..., N) scores, e.g. from :func:`last_block_key_importance`.
        segment: positions per segment, > 0.
    Returns:
        (..., N) int64 ``order``: slot r holds the key at original position ``order[..., r]``, always a
        position of slot r's own segment. Gather k and v with it; it is also ``kernels.PermutedKeys.positions``.

    On CUDA (float32 scores, segments of at most 1024 positions, fewer than 65536 rows, not compiling) one Triton
    launch sorts every segment; else ``torch.sort`` (stable) on padded segments. Both give the same order for
    NaN-free scores.
    """
    if not isinstance(segment, int) or isinstance(segment, bool) or segment <= 0:
        raise ValueError(f"segment must be a positive int, got {segment!r}")
    n = importance.shape[-1]
    if (importance.is_cuda and importance.dtype == torch.float32 and segment <= 1024 and n > 0
            and 0 < importance.numel() // n < 65536 and not torch.compiler.is_compiling()):
        scores = importance.contiguous()
        order = torch.empty(importance.shape, device=importance.device, dtype=torch.int64)
        launch(_segment_argsort_kernel, (cdiv(n, segment), scores.numel() // n), scores, order, n,
               SEGMENT=segment, SEGMENT_PAD=next_power_of_2(segment), num_warps=4)
        return order
    pad = -n % segment
    padded = torch.nn.functional.pad(importance.float(), (0, pad), value=-math.inf)  # padding sorts last
    groups = padded.reshape(*importance.shape[:-1], -1, segment)
    local = torch.sort(groups, dim=-1, descending=True, stable=True).indices
    starts = torch.arange(0, n + pad, segment, device=importance.device)[:, None]
    return (local + starts).flatten(-2)[..., :n]


def gather_keys(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x (B, H_kv, N, D) with its tokens reordered per head: out[b, h, r] = x[b, h, order[b, h, r]] (``order``
    (B or 1, H_kv, N) of positions in [0, N), from :func:`segmented_key_order`; one Triton row gather on CUDA).

    Checks its arguments, the positions' range included (one read-back of their min and max): the Triton gather
    reads wherever an index points. ``pbs_sparge_attention`` gathers with :func:`segmented_key_order`'s own order
    and skips the read-back."""
    if (x.dim() != 4 or order.dim() != 3 or order.shape[0] not in (1, x.shape[0])
            or tuple(order.shape[1:]) != tuple(x.shape[1:3])):
        raise ValueError(f"x (B, H_kv, N, D) and order (B or 1, H_kv, N) expected, got {tuple(x.shape)} and "
                         f"{tuple(order.shape)}")
    if order.dtype.is_floating_point or order.dtype.is_complex or order.dtype == torch.bool:
        raise ValueError(f"order must hold integer positions, got {order.dtype}")
    if order.device != x.device:
        raise ValueError(f"order is on {order.device}, x on {x.device}")
    if order.numel():
        low, high = torch.stack(torch.aminmax(order)).tolist()
        if low < 0 or high >= x.shape[2]:
            raise ValueError(f"order holds positions from {low} to {high}, outside [0, {x.shape[2]})")
    return gather_rows_per_head(x, order)
