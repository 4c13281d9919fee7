"""Stage 1 of SpargeAttn in Triton: predict the block mask M_g from compressed Q and K.

Three launches (SpargeAttn Sec. 3.2, Algorithm 1 lines 4-6):
1. ``_qk_block_statistics_kernel``: per block of Q (128 rows) and of K (64 rows), the mean token and
   the mean pairwise cosine similarity, both tensors in one launch. The similarity uses
   sum_{a,b} cos(x_a, x_b) = |sum_a x_a/|x_a||^2, which is O(b*D) instead of the Gram matrix's O(b^2*D).
2. ``_compressed_scores_kernel``: the compressed scores q_i.k_j * scale as tiled float32 products.
   (Computing them inside the TopCdf launch instead, from the means, made that launch 15 us slower at Flux
   against the 4.3 us it saved, so they keep their own tensor-core launch.)
3. ``_topcdf_block_mask_kernel``: for a group of query blocks, softmax over the key blocks (non-self-similar
   key blocks excluded), TopCdf, and the forced rows/columns.
   TopCdf is computed without a sort: entry j is kept iff the probability mass of all entries >= p_j is at
   most tau; the smallest such p is found by bisection over the bit patterns of positive floats (which
   order like the floats), 30 steps, exactly, so the result equals the sort-based rule up to ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._inputs import BLOCK_K, BLOCK_Q, AttentionShape, wide_offsets
from .._launch import cdiv, launch, next_power_of_2
from . import attention_hopper
from .attention import _key_block_flags, _record_tail_tiles, _soft_cap, _walk_positions, tail_kernel_args

_BITS_ABOVE_ONE = 0x3F800001  # int32 bit pattern of the float right after 1.0


STATS_CHUNK = 64  # rows a statistics program holds at a time: a 128-row Q block is read as two chunks


@triton.jit
def _block_mean_similarity(X, MEANS, SIM, out_row, block, N, stride_xn, stride_xd,
                           HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                           WIDE: tl.constexpr = False):
    """Mean token and mean pairwise cosine similarity of rows [block * BLOCK, ...) of X (already offset to one
    head), stored at row ``out_row`` of MEANS (rows of HEAD_DIM) and SIM. Q's 128-row blocks are summed in
    64-row chunks, so Q's programs hold no more registers than K's (H100: Q's statistics at Flux 14.9 -> 13.5
    us, at Llama-32K 104 -> 96 us; kernel-variants-H100.txt (bb)). ``WIDE``: row offsets in int64."""
    cols = tl.arange(0, D_PAD)
    cmask = cols < HEAD_DIM
    total = tl.zeros([D_PAD], dtype=tl.float32)
    unit_sum = tl.zeros([D_PAD], dtype=tl.float32)
    for c in tl.static_range(BLOCK // CHUNK):
        rows = block * BLOCK + c * CHUNK + tl.arange(0, CHUNK)
        x_rows = rows
        if WIDE:
            x_rows = rows.to(tl.int64)
        x = tl.load(X + x_rows[:, None] * stride_xn + cols[None, :] * stride_xd,
                    mask=(rows < N)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        total += tl.sum(x, axis=0)
        norm = tl.sqrt(tl.sum(x * x, axis=1))
        unit_sum += tl.sum(x / tl.maximum(norm, 1e-12)[:, None], axis=0)
    n = tl.minimum(N - block * BLOCK, BLOCK).to(tl.float32)
    tl.store(MEANS + out_row * HEAD_DIM + cols, total / n, mask=cmask)
    tl.store(SIM + out_row, tl.sum(unit_sum * unit_sum, axis=0) / (n * n))


@triton.jit
def _block_mean_similarity_kernel(
    X, MEANS, SIM, N, H, stride_xb, stride_xh, stride_xn, stride_xd,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, WIDE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    base = X + (pid_bh // H).to(tl.int64) * stride_xb + (pid_bh % H).to(tl.int64) * stride_xh
    _block_mean_similarity(base, MEANS, SIM, pid_bh.to(tl.int64) * tl.num_programs(0) + pid_n, pid_n, N,
                           stride_xn, stride_xd, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK=BLOCK, CHUNK=CHUNK, WIDE=WIDE)


@triton.jit
def _qk_block_statistics_kernel(
    Q, K, Q_MEANS, Q_SIM, K_MEANS, K_SIM, NQ_LEN, NKV_LEN, H, H_KV, NQ, NK, q_programs,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, WIDE: tl.constexpr,
):
    """Both tensors' statistics in one launch: programs [0, q_programs) take Q's blocks, the rest K's.
    The launch takes as long as the two it replaces (both read at HBM speed), but stage 1 makes one launch
    fewer: with the 64-row chunks, 54 -> 44 us at Flux on an H100, where stage 1 was 12% of cuDNN's dense time
    (benchmarks/results/predict-breakdown-H100.txt)."""
    pid = tl.program_id(0)
    if pid < q_programs:
        bh = pid // NQ
        base = Q + (bh // H).to(tl.int64) * stride_qb + (bh % H).to(tl.int64) * stride_qh
        _block_mean_similarity(base, Q_MEANS, Q_SIM, pid.to(tl.int64), pid % NQ, NQ_LEN, stride_qn, stride_qd,
                               HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK=BLOCK_Q, CHUNK=CHUNK, WIDE=WIDE)
    else:
        pid = pid - q_programs
        bh = pid // NK
        base = K + (bh // H_KV).to(tl.int64) * stride_kb + (bh % H_KV).to(tl.int64) * stride_kh
        _block_mean_similarity(base, K_MEANS, K_SIM, pid.to(tl.int64), pid % NK, NKV_LEN, stride_kn, stride_kd,
                               HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK=BLOCK_K, CHUNK=CHUNK, WIDE=WIDE)


@triton.jit
def _compressed_scores_kernel(QMEAN, KMEAN, S, H, GROUP, NQ, NK, scale_log2, cap_in, cap_out,
                              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr,
                              PRECISION: tl.constexpr = "tf32x3", SOFTCAP: tl.constexpr = False):
    """S[b, h] = (mean(Q_i) . mean(K_j)) * scale * log2(e), float32, one TILE x TILE tile per program; with SOFTCAP
    the dot product is soft-capped first (``attention._soft_cap``; scale_log2 is then log2(e) alone).

    tf32x3 (three tf32 tensor-core products) keeps float32 accuracy; an "ieee" 64 x 64 tile spills and
    took 2.5 ms at the Mochi shape on an H100 against 0.03 ms (benchmarks/predict_breakdown.py).
    """
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_bh = tl.program_id(2)
    bhk = (pid_bh // H) * (H // GROUP) + (pid_bh % H) // GROUP
    rq = pid_q * TILE + tl.arange(0, TILE)
    rk = pid_k * TILE + tl.arange(0, TILE)
    d = tl.arange(0, D_PAD)
    dm = d < HEAD_DIM
    qm = tl.load(QMEAN + (pid_bh.to(tl.int64) * NQ + rq[:, None]) * HEAD_DIM + d[None, :],
                 mask=(rq < NQ)[:, None] & dm[None, :], other=0.0)
    km = tl.load(KMEAN + (bhk.to(tl.int64) * NK + rk[:, None]) * HEAD_DIM + d[None, :],
                 mask=(rk < NK)[:, None] & dm[None, :], other=0.0)
    s = tl.dot(qm, tl.trans(km), input_precision=PRECISION)
    if SOFTCAP:
        s = _soft_cap(s, cap_in, cap_out)
    s = s * scale_log2
    tl.store(S + (pid_bh.to(tl.int64) * NQ + rq[:, None]) * NK + rk[None, :], s,
             mask=(rq < NQ)[:, None] & (rk < NK)[None, :])


@triton.jit
def _topcdf_block_mask_kernel(
    SCORES, QSIM, KSIM, THETA, TAU, MASK, INDEX, COUNT, NFULL, TAIL_SIZES, TAIL_TILES, tail_start, tail_width,
    H, GROUP, NQ, NK, KV_LEN, Q_OFFSET, LAST_ROW, WINDOW,
    ROWS: tl.constexpr, NK_PAD: tl.constexpr,
    IS_CAUSAL: tl.constexpr, SINK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    KEY_SEGMENT: tl.constexpr, BITS_ABOVE_ONE: tl.constexpr, RECORD_TAIL: tl.constexpr, BUCKETS: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    bhk = b * (H // GROUP) + h // GROUP
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, NK_PAD)
    rvalid = rows < NQ
    cvalid = cols < NK

    row_offset = (pid_bh.to(tl.int64) * NQ + rows) * NK
    s = tl.load(SCORES + row_offset[:, None] + cols[None, :], mask=rvalid[:, None] & cvalid[None, :], other=0.0)

    theta = tl.load(THETA + h)
    tau = tl.load(TAU + h)
    q_similar = tl.load(QSIM + pid_bh * NQ + rows, mask=rvalid, other=1.0) > theta
    k_similar = tl.load(KSIM + bhk * NK + cols, mask=cvalid, other=1.0) > theta
    valid, needs_masking, diagonal = _key_block_flags(
        (rows * BLOCK_Q)[:, None], cols[None, :], rvalid[:, None] & cvalid[None, :], KV_LEN, Q_OFFSET, LAST_ROW,
        WINDOW, IS_CAUSAL=IS_CAUSAL, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, KEY_SEGMENT=KEY_SEGMENT)
    live = valid & k_similar[None, :]
    s = tl.where(live, s, float("-inf"))
    row_max = tl.max(s, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    p = tl.exp2(s - row_max[:, None])  # unnormalised softmax; exactly 1.0 at the row's argmax
    target = tau * tl.sum(p, axis=1)

    # Bisection for the smallest t with mass(p >= t) <= tau * total.
    lo = tl.zeros([ROWS], dtype=tl.int32)
    hi = tl.zeros([ROWS], dtype=tl.int32) + tl.where(tau >= 1.0, 0, BITS_ABOVE_ONE)
    for _ in range(30):
        mid = lo + (hi - lo) // 2
        t = mid.to(tl.float32, bitcast=True)
        mass = tl.sum(tl.where(p >= t[:, None], p, 0.0), axis=1)
        ok = mass <= target
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    threshold = hi.to(tl.float32, bitcast=True)
    keep = live & ((p >= threshold[:, None]) | (p == 1.0))  # p == 1: a row keeps at least its argmax
    keep = keep | (~q_similar)[:, None] | (~k_similar)[None, :]
    if SINK:
        keep = keep | (cols == 0)[None, :]
    if IS_CAUSAL:
        # the diagonal (with permuted keys, the segments the query block overlaps); not the ragged last block,
        # which a query block after the last key (upper-left variant, Nq > Nkv) sees whole
        keep = keep | diagonal
    keep = keep & valid
    tl.store(MASK + row_offset[:, None] + cols[None, :], keep.to(tl.int8), mask=rvalid[:, None] & cvalid[None, :])

    # The attention kernel's compacted walk, built here while the row is in registers (same layout as
    # attention._block_mask_to_index_kernel): kept key blocks needing no masking first, each kind ascending.
    position, n_full = _walk_positions(keep, needs_masking, axis=1)
    tl.store(INDEX + row_offset[:, None] + position, cols[None, :] + 0 * position, mask=keep)
    row_ids = pid_bh * NQ + rows
    count = tl.sum(keep.to(tl.int32), axis=1)
    tl.store(COUNT + row_ids, count, mask=rvalid)
    tl.store(NFULL + row_ids, n_full, mask=rvalid)
    if RECORD_TAIL:
        _record_tail_tiles(TAIL_SIZES, TAIL_TILES, tail_start, tail_width, pid_bh, rows, count, NQ, NK, rvalid,
                           BUCKETS=BUCKETS)


STATS_NUM_WARPS = 2  # block_statistics_triton's default (see its docstring)


def _chunk(block_size: int) -> int:
    if block_size % min(STATS_CHUNK, block_size):
        raise ValueError(f"block_size must be a multiple of {STATS_CHUNK} or below it, got {block_size}")
    return min(STATS_CHUNK, block_size)


def block_statistics_triton(x: torch.Tensor, block_size: int, num_warps: int = STATS_NUM_WARPS
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block means (B, H, nb, D) and mean pairwise cosine similarities (B, H, nb), both float32.

    ``num_warps``: 2 is fastest on an H100 for every block shape we use, or within 2% (predict-breakdown-H100.txt).
    """
    B, H, N, D = x.shape
    nb = cdiv(N, block_size)
    means = torch.empty(B, H, nb, D, device=x.device, dtype=torch.float32)
    sim = torch.empty(B, H, nb, device=x.device, dtype=torch.float32)
    launch(_block_mean_similarity_kernel, (nb, B * H),
        x, means, sim, N, H, *x.stride(),
        HEAD_DIM=D, D_PAD=next_power_of_2(D), BLOCK=block_size, CHUNK=_chunk(block_size),
        WIDE=wide_offsets(x), num_warps=num_warps,
    )
    return means, sim


def qk_block_statistics_triton(qh: torch.Tensor, kh: torch.Tensor, num_warps: int = STATS_NUM_WARPS
                               ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`block_statistics_triton` of Q (128-row blocks) and of K (64-row blocks) in one launch.

    Returns ((q_means, q_sim), (k_means, k_sim)) as the two separate calls would, within float32 rounding.
    """
    B, H, N_q, D = qh.shape
    H_kv, N_kv = kh.shape[1], kh.shape[2]
    nq, nk = cdiv(N_q, BLOCK_Q), cdiv(N_kv, BLOCK_K)
    q_means = torch.empty(B, H, nq, D, device=qh.device, dtype=torch.float32)
    q_sim = torch.empty(B, H, nq, device=qh.device, dtype=torch.float32)
    k_means = torch.empty(B, H_kv, nk, D, device=qh.device, dtype=torch.float32)
    k_sim = torch.empty(B, H_kv, nk, device=qh.device, dtype=torch.float32)
    q_programs = B * H * nq
    launch(_qk_block_statistics_kernel, (q_programs + B * H_kv * nk,),
        qh, kh, q_means, q_sim, k_means, k_sim, N_q, N_kv, H, H_kv, nq, nk, q_programs, *qh.stride(), *kh.stride(),
        HEAD_DIM=D, D_PAD=next_power_of_2(D), BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
        CHUNK=min(_chunk(BLOCK_Q), _chunk(BLOCK_K)), WIDE=wide_offsets(qh, kh), num_warps=num_warps,
    )
    return (q_means, q_sim), (k_means, k_sim)


def compressed_scores_triton(q_means: torch.Tensor, k_means: torch.Tensor, shape: AttentionShape,
                             scale: float, softcap: float | None = None) -> torch.Tensor:
    """(B, H, nq, nk) float32 compressed scores (mean(Q_i) . mean(K_j)) * scale * log2(e) from contiguous block
    means (B, H, nq, D) and (B, H_kv, nk, D); with ``softcap`` c the scores c * tanh(s / c), as attention sees them."""
    nq, nk = shape.q_blocks, shape.k_blocks
    scores = torch.empty(shape.batch, shape.heads, nq, nk, device=q_means.device, dtype=torch.float32)
    tile = 64
    launch(_compressed_scores_kernel, (cdiv(nq, tile), cdiv(nk, tile), shape.batch * shape.heads),
        q_means, k_means, scores, shape.heads, shape.heads // shape.kv_heads, nq, nk,
        *attention_hopper.softcap_args(scale, softcap),
        HEAD_DIM=shape.head_dim, D_PAD=next_power_of_2(shape.head_dim), TILE=tile, SOFTCAP=softcap is not None,
        num_warps=4)
    return scores


TOPCDF_NUM_WARPS = 4  # topcdf_block_mask_triton's default


def topcdf_width(nk: int) -> int:
    """Key blocks one TopCdf program row holds: nk padded to a power of two, at least 16."""
    return max(next_power_of_2(nk), 16)


def topcdf_rows(nk: int) -> int:
    """Query blocks per TopCdf program. H100 (benchmarks/results/predict-breakdown-H100.txt): 1 is fastest at
    Flux (nk 72, padded width 128: 9.2 against 11.4 us) and Mochi (nk 700, width 1024), 4 at Llama-32K (nk 512,
    width 512); CogVideoX (nk 278, also width 512) would be 17 us (0.15% of cuDNN's dense time) faster at 2, so
    no rule of the width alone picks the best at all four shapes."""
    return 1 if topcdf_width(nk) <= 128 or topcdf_width(nk) >= 1024 else 4


def topcdf_block_mask_triton(
    scores: torch.Tensor, q_sim: torch.Tensor, k_sim: torch.Tensor, shape: AttentionShape, *, is_causal: bool,
    simthreshd1: torch.Tensor, cdfthreshd: torch.Tensor, attention_sink: bool,
    tail: attention_hopper.TailSchedule | None = None, rows: int | None = None, key_segment: int = BLOCK_K,
    num_warps: int = TOPCDF_NUM_WARPS,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """TopCdf over (B, H, nq, nk) compressed scores with the block similarities' forced rows and columns.

    Returns the int8 block mask and its compacted walk (index, count, n_full); fills ``tail`` if given.
    ``rows`` (query blocks per program) and ``num_warps``: launch settings, None picks the measured default.
    """
    nq, nk = shape.q_blocks, shape.k_blocks
    mask = torch.empty(shape.batch, shape.heads, nq, nk, device=scores.device, dtype=torch.int8)
    index = torch.empty(shape.batch, shape.heads, nq, nk, device=scores.device, dtype=torch.int32)
    count = torch.empty(shape.batch, shape.heads, nq, device=scores.device, dtype=torch.int32)
    n_full = torch.empty_like(count)
    nk_pad = topcdf_width(nk)
    rows = topcdf_rows(nk) if rows is None else rows
    grid = (cdiv(nq, rows), shape.batch * shape.heads)
    launch(_topcdf_block_mask_kernel, grid,
        scores, q_sim, k_sim, simthreshd1, cdfthreshd, mask, index, count, n_full, *tail_kernel_args(tail, count),
        shape.heads, shape.heads // shape.kv_heads, nq, nk, shape.kv_len, shape.causal_offset,
        shape.last_row_position, shape.window_arg, ROWS=rows, NK_PAD=nk_pad, IS_CAUSAL=is_causal, SINK=attention_sink,
        BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, KEY_SEGMENT=key_segment, BITS_ABOVE_ONE=_BITS_ABOVE_ONE,
        RECORD_TAIL=tail is not None, BUCKETS=attention_hopper.TAIL_BUCKETS, num_warps=num_warps,
    )
    return mask, (index, count, n_full)


def predict_block_mask_triton(
    qh: torch.Tensor, kh: torch.Tensor, shape: AttentionShape, *, is_causal: bool, scale: float,
    simthreshd1: torch.Tensor, cdfthreshd: torch.Tensor, attention_sink: bool,
    tail: attention_hopper.TailSchedule | None = None, key_segment: int = BLOCK_K, softcap: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Launch stage 1 on (B, H, N, D) views (``key_segment``: see ``_inputs.PermutedKeys``; ``softcap``: the
    compressed scores soft-capped as the attention scores are).

    Returns the (B, H, nq, nk) bool block mask and its compacted form (index, count, n_full) as
    :func:`attention.block_mask_to_index` builds it, so the attention kernel needs no extra pass; fills
    ``tail`` (an empty ``attention_hopper.new_tail_schedule``) as that function does.
    """
    (q_means, q_sim), (k_means, k_sim) = qk_block_statistics_triton(qh, kh)
    scores = compressed_scores_triton(q_means, k_means, shape, scale, softcap)
    mask, walk = topcdf_block_mask_triton(scores, q_sim, k_sim, shape, is_causal=is_causal, simthreshd1=simthreshd1,
                                          cdfthreshd=cdfthreshd, attention_sink=attention_sink, tail=tail,
                                          key_segment=key_segment)
    return mask.view(torch.bool), walk
