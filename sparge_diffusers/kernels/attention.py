"""Stage 2 of SpargeAttn in Triton: block-sparse FlashAttention with the sparse online softmax.

One program per (128-row query block, batch*head). It visits the key blocks of its row of M_g through a
compacted index list (ascending, built by ``_block_mask_to_index_kernel``), so skipped blocks cost
nothing, and splits that walk in two loops: tiles that need no element masking first, then the few that
do (the key tail and, under causal masking, the diagonal), so the hot loop carries no masking. At D > 64
without the stage-2 test, the mask-free blocks go two at a time as one 128-key tile (``PAIR_TILES``).

The sparse online softmax (paper Sec. 3.4) skips a tile's P.V product when
max over the tile's rows of (m_local - m_new) <= -pvthreshd in the log2-scaled score domain.
Departure from the paper: the test covers the whole 128-row tile instead of one warp's rows (Triton has no
per-warp branches); this skips less often than the per-warp test but never more.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import attention_hopper
from ._inputs import BLOCK_K, BLOCK_Q, AttentionShape, device_capability, wide_offsets
from .._launch import cdiv, interpreting, launch, next_power_of_2, tensor_descriptor

LOG2E = 1.4426950408889634


@triton.jit
def _key_block_flags(first_q, cols, valid, KV_LEN, Q_OFFSET, LAST_ROW, WINDOW, IS_CAUSAL: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, KEY_SEGMENT: tl.constexpr):
    """(visible, needs_masking, diagonal) of key blocks ``cols`` for the query block(s) starting at row ``first_q``
    (shapes broadcast): visible = ``valid`` and, under causal masking, not wholly in the future; diagonal = under
    causal masking, blocks some of whose keys lie after the block's first query; needs element masking = those
    and the ragged last block. Query row r sits at causal position r + Q_OFFSET (``AttentionShape.
    causal_offset``), and the last row at LAST_ROW (``AttentionShape.last_row_position``, not capped at the last
    key). With keys permuted within segments of KEY_SEGMENT positions (``_inputs.PermutedKeys``; BLOCK_K = keys in
    order), a block's keys may come from anywhere in its segment, so the rule applies to the segment's extent
    (``_inputs.causal_block_visible`` and ``_inputs.key_blocks_needing_masking`` restate it for the reference;
    change them together). A sliding window of WINDOW keys (``AttentionShape.window_arg``; keys in order) also hides
    blocks wholly before the block's first query's window, and element-masks blocks that start before its last
    query's window."""
    needs_masking = (cols * BLOCK_K + BLOCK_K) > KV_LEN
    visible = valid
    diagonal = cols < 0  # all False, in the shape of cols
    if IS_CAUSAL:
        if KEY_SEGMENT == BLOCK_K:
            first_k = cols * BLOCK_K
        else:
            first_k = cols * BLOCK_K // KEY_SEGMENT * KEY_SEGMENT
        first_position = first_q + Q_OFFSET
        last_position = tl.minimum(first_position + BLOCK_Q - 1, LAST_ROW)
        visible = visible & (first_k <= last_position)
        diagonal = (first_k + KEY_SEGMENT - 1) > first_position
        # the query at position p sees keys p - WINDOW + 1 .. p (no-ops at NO_WINDOW). The last row's own position
        # decides the masking: an upper-left call with more queries than keys has rows past the last key, whose
        # windows start later than the last key's (a position capped there left such blocks unmasked). A block's
        # last key is the last that exists: the padded end of a ragged last block let such rows' windows "see" it
        # (a tile walked fully masked, and counted in the statistics' dense blocks)
        last_k = tl.minimum(first_k + KEY_SEGMENT - 1, KV_LEN - 1)
        visible = visible & (last_k > first_position - WINDOW)
        needs_masking = needs_masking | diagonal | (first_k <= last_position - WINDOW)
    return visible, needs_masking, diagonal


def tail_kernel_args(tail: attention_hopper.TailSchedule | None, placeholder: torch.Tensor) -> tuple:
    """(sizes, tiles, start, width) arguments of a compaction kernel that fills ``tail``; placeholders without."""
    return (tail.sizes, tail.tiles, tail.start, tail.width) if tail is not None else (placeholder, placeholder, 0, 0)


@triton.jit
def _record_tail_tiles(TAIL_SIZES, TAIL_TILES, tail_start, tail_width, pid_bh, q_block, count, NQ, NK, record,
                       BUCKETS: tl.constexpr):
    """Drop each row (one or a vector of them) that the Hopper kernel takes in its tail into the bucket of its
    kept-block count, most first: one atomic per row (``attention_hopper.TailSchedule``)."""
    ticket = pid_bh * NQ + (NQ - 1 - q_block)  # the inverse of attention_hopper._tile_of
    bucket = BUCKETS - 1 - tl.minimum(count * BUCKETS // (NK + 1), BUCKETS - 1)
    record = record & (ticket >= tail_start)
    slot = tl.atomic_add(TAIL_SIZES + bucket, 1, mask=record)
    tl.store(TAIL_TILES + bucket * tail_width + slot, ticket, mask=record)


@triton.jit
def _walk_positions(keep, needs_masking, axis: tl.constexpr):
    """(position in the walk of each kept block, count of blocks needing no element masking) along ``axis``: those
    blocks first, then the masked ones, each in ascending order. Without a sliding window the masked blocks (the
    ragged last block, the causal diagonal) already come last; a window's masked blocks come first by position.
    Departure from SpargeAttn's Algorithm 1 (blocks in ascending order): under a window, stage 2 judges the edge
    blocks after the inside ones, against the running maximum those set (the reference walks in the same order)."""
    full = keep & ~needs_masking
    n_full = tl.sum(full.to(tl.int32), axis=axis)
    masked_first = n_full
    if axis == 1:  # rows of a 2-D block: one count per row
        masked_first = tl.expand_dims(n_full, 1)
    position = tl.where(full, tl.cumsum(full.to(tl.int32), axis=axis) - 1,
                        masked_first + tl.cumsum((keep & needs_masking).to(tl.int32), axis=axis) - 1)
    return position, n_full


@triton.jit
def _block_mask_to_index_kernel(
    MASK, INDEX, COUNT, NFULL, TAIL_SIZES, TAIL_TILES, tail_start, tail_width, H, NQ, NK, KV_LEN, Q_OFFSET,
    LAST_ROW, WINDOW, stride_mb, stride_mh, stride_mq, stride_mk,
    NK_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    KEY_SEGMENT: tl.constexpr, RECORD_TAIL: tl.constexpr, BUCKETS: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    cols = tl.arange(0, NK_PAD)
    cvalid = cols < NK
    keep = tl.load(MASK + b * stride_mb + h * stride_mh + pid_q * stride_mq + cols * stride_mk,
                   mask=cvalid, other=0) != 0
    keep, needs_masking, _ = _key_block_flags(pid_q * BLOCK_Q, cols, keep & cvalid, KV_LEN, Q_OFFSET, LAST_ROW,
                                              WINDOW, IS_CAUSAL=IS_CAUSAL, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
                                              KEY_SEGMENT=KEY_SEGMENT)
    position, n_full = _walk_positions(keep, needs_masking, axis=0)
    row = pid_bh.to(tl.int64) * NQ + pid_q
    count = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(INDEX + row * NK + position, cols, mask=keep)
    tl.store(COUNT + row, count)
    tl.store(NFULL + row, n_full)
    if RECORD_TAIL:
        _record_tail_tiles(TAIL_SIZES, TAIL_TILES, tail_start, tail_width, pid_bh, pid_q, count, NQ, NK, True,
                           BUCKETS=BUCKETS)


@triton.jit
def _dense_row_extent(first_q, kv_len, NK, q_offset, last_position, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """(tiles, of which the first n_full need no element masking) of the dense walk of the query block starting
    at row ``first_q``: every key tile, or under causal masking those up to the block's last position (none for
    a block whose rows all sit before key 0, as a lower-right variant with more queries than keys has)."""
    count = NK
    n_full = kv_len // BLOCK_N
    if IS_CAUSAL:
        first_position = first_q + q_offset
        last = tl.maximum(tl.minimum(first_position + BLOCK_M - 1, last_position), -1)
        count = (last + BLOCK_N) // BLOCK_N  # numerator >= BLOCK_N - 1: no rounding of negatives
        n_full = tl.minimum(n_full, tl.maximum(first_position + 1, 0) // BLOCK_N)
    return count, n_full


# SOFTCAP values of the attention kernel (``softcap_mode``): no cap, the exp2 form, tanh.approx.f32.
SOFTCAP_EXACT = tl.constexpr(1)
SOFTCAP_FAST = tl.constexpr(2)


def softcap_mode(softcap: float | None, device: torch.device) -> int:
    """The attention kernel's SOFTCAP: 0 without a cap; ``SOFTCAP_FAST`` where the kernel compiles for an NVIDIA GPU
    with ``tanh.approx.f32`` (sm75 and newer, not under TRITON_INTERPRET, which runs no inline PTX); else
    ``SOFTCAP_EXACT``."""
    if softcap is None:
        return 0
    if device.type == "cuda" and torch.version.hip is None and not interpreting() \
            and device_capability(device.index) >= (7, 5):
        return SOFTCAP_FAST.value
    return SOFTCAP_EXACT.value


@triton.jit
def _soft_cap(scores, cap_in, cap_out, FAST: tl.constexpr = False):
    """cap_out * tanh(scores * cap_in) (logit soft-capping: cap_in = scale / c, cap_out = c).

    Without FAST, tanh from exp2: exact at +-inf (+-1), within float32 rounding of c elsewhere, and the same in the
    interpreter and on every GPU (stage 1 and the interpreted kernels use it). FAST (compiled CUDA kernels,
    ``softcap_mode``): the ``tanh.approx.f32`` instruction, one special-function op per score where the exp2 form
    takes two plus a division's fix-up. On an H100 at Gemma-2-27B's heads a capped call took 45-58% longer than an
    uncapped one with the exp2 form, 23-31% with this one (benchmarks/results/softcap-H100.txt); its error there was
    at most 3.9e-4 of c * tanh at c = 50 (float64 reference). FlashAttention-2/3 use the same instruction for the
    cap."""
    if FAST:
        return cap_out * tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [scores * cap_in],
                                                   dtype=tl.float32, is_pure=True, pack=1)
    return cap_out * (1.0 - 2.0 / (tl.exp2(scores * (cap_in * 2.8853900817779268)) + 1.0))


@triton.jit
def _attend_tile(
    acc, l_i, m_i, pv_count, q, cols, K_base, V_base, KPOS_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    q_pos, offs_d, d_mask, row_valid, kv_len, pv_threshold, qk_scale, window,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, PERMUTED_KEYS: tl.constexpr = False,
    WIDE: tl.constexpr = False, WINDOWED: tl.constexpr = False, cap_in=1.0, cap_out=1.0,
    SOFTCAP: tl.constexpr = False,
):
    """One key tile (the keys in slots ``cols``) folded into the online-softmax state. ``q_pos``: the rows'
    causal positions (row + ``AttentionShape.causal_offset``). With PERMUTED_KEYS the causal test of a masked
    tile compares each slot's original position (``KPOS_base[cols]``) with the row's; with WINDOWED it also
    hides keys ``window`` or more positions before the row's. ``WIDE``: K/V row offsets in int64
    (``_inputs.wide_offsets``). With SOFTCAP the scores are capped (``_soft_cap``) before any masking; qk_scale is
    then log2(e) alone, the softmax scale being inside cap_in."""
    kv_mask = d_mask[None, :]
    if MASKED:
        kv_mask = kv_mask & (cols < kv_len)[:, None]
    kv_rows = cols
    if WIDE:
        kv_rows = cols.to(tl.int64)
    k = tl.load(K_base + kv_rows[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        qk = _soft_cap(qk, cap_in, cap_out, FAST=SOFTCAP == SOFTCAP_FAST)
    if MASKED:
        visible = (cols < kv_len)[None, :]
        if IS_CAUSAL:
            if PERMUTED_KEYS:
                key_pos = tl.load(KPOS_base + cols, mask=cols < kv_len, other=0)
            else:
                key_pos = cols
            visible = visible & (key_pos[None, :] <= q_pos[:, None])
            if WINDOWED:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    # Scores stay unscaled; the scale (with log2 e) enters the row max and, fused as one FMA, the exponent.
    m_local = tl.max(qk, axis=1) * qk_scale
    m_new = tl.maximum(m_i, m_local)
    # Rows without a finite score yet: no visible key, or -inf on every one (an inf in q or k). Unmasked tiles need
    # the guard too: without it a tile of -inf scores made the row NaN even when later tiles brought finite
    # scores (until session 77); with it such a tile adds nothing and a row with no finite score at all gets
    # zeros, as SDPA (torch's safe softmax, FlashAttention) gives.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    # V is loaded whether or not its product is skipped: a load inside the branch cannot be software-
    # pipelined, which cost more than the bandwidth it saves (attention here is compute-bound).
    v = tl.load(V_base + kv_rows[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if PV_SKIP:
        gap = tl.where(row_valid & (m_local > float("-inf")), m_local - m_new, float("-inf"))
        if tl.max(gap, axis=0) > -pv_threshold:
            acc = tl.dot(p.to(v.dtype), v, acc)
            pv_count += 1
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
        pv_count += 1
    return acc, l_i, m_new, pv_count


@triton.jit
def _walk_blocks(
    acc, l_i, m_i, pv_count, j_next, start, end, index, count, q, offs_n, K_base, V_base, KPOS_base,
    stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len, pv_threshold, qk_scale,
    window, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr,
    USE_INDEX: tl.constexpr, PERMUTED_KEYS: tl.constexpr = False, WIDE: tl.constexpr = False,
    WINDOWED: tl.constexpr = False, cap_in=1.0, cap_out=1.0, SOFTCAP: tl.constexpr = False,
):
    """Tiles start .. end-1 of a row's walk: key block index[it], whose index the caller loaded one step ahead
    into ``j_next`` (returned one step further), or key block ``it`` itself without an index."""
    for it in range(start, end):
        j = j_next if USE_INDEX else it
        if USE_INDEX:
            j_next = tl.load(index + tl.minimum(it + 1, count - 1))
        acc, l_i, m_i, pv_count = _attend_tile(
            acc, l_i, m_i, pv_count, q, j * BLOCK_N + offs_n, K_base, V_base, KPOS_base,
            stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len,
            pv_threshold, qk_scale, window, MASKED=MASKED, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP,
            PERMUTED_KEYS=PERMUTED_KEYS, WIDE=WIDE, WINDOWED=WINDOWED, cap_in=cap_in, cap_out=cap_out,
            SOFTCAP=SOFTCAP)
    return acc, l_i, m_i, pv_count, j_next


@triton.jit
def _query_tile(
    Q, K, V, H, GROUP, q_len,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TMA_IO: tl.constexpr = False,
    WIDE: tl.constexpr = False,
):
    """This program's (query block, batch*head): its Q tile and the K/V base pointers of its K/V head.
    With ``TMA_IO``, ``Q`` is a (B, H, N, D) tensor descriptor (rows past N read as zeros). ``WIDE``: row
    offsets in int64."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    row_valid = offs_m < q_len
    if TMA_IO:
        q = Q.load([b.to(tl.int32), h.to(tl.int32), pid_m * BLOCK_M, 0]).reshape(BLOCK_M, D_PAD)
    else:
        q_rows = offs_m
        if WIDE:
            q_rows = offs_m.to(tl.int64)
        q = tl.load(Q + b * stride_qb + h * stride_qh + q_rows[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                    mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    K_base = K + b * stride_kb + hk * stride_kh
    V_base = V + b * stride_vb + hk * stride_vh
    row = pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m  # this tile's row of the (B*H*nq) per-tile arrays
    return b, h, row, offs_m, offs_d, d_mask, row_valid, q, K_base, V_base


@triton.jit
def _empty_softmax_state(PV_THRESHOLD, h, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, PV_SKIP: tl.constexpr):
    """Online-softmax state before the first key (running max, normaliser, accumulator, P.V count) and
    this head's stage-2 threshold."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    pv_threshold = 0.0
    if PV_SKIP:
        pv_threshold = tl.load(PV_THRESHOLD + h)
    return m_i, l_i, acc, 0, pv_threshold


@triton.jit
def _add_sink(acc, l_i, m_i, SINKS, h):
    """The online-softmax state after one more term that has no value vector: head h's learned sink logit
    (natural units, as gpt-oss's ``sinks``; m_i is in log2 units). acc and l_i are rescaled to the larger of m_i and
    the sink, which keeps a sink far above every score from overflowing; a row that saw no key keeps acc = 0."""
    sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m_i, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key and a -inf sink: nothing to rescale
    alpha = tl.exp2(m_i - top)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - top)


@triton.jit
def _store_output(O, b, h, acc, l_i, offs_m, offs_d, d_mask, row_valid,
                  stride_ob, stride_oh, stride_on, stride_od,
                  TMA_IO: tl.constexpr = False, OUT_DTYPE: tl.constexpr = None, WIDE: tl.constexpr = False):
    """Normalise and store one query tile; with ``TMA_IO``, ``O`` is a (B, H, N, D) tensor descriptor of
    element type ``OUT_DTYPE`` (rows past N are not written). ``WIDE``: row offsets in int64."""
    # A query row without a finite score (l == 0: it saw no key, or -inf on every key) gets a zero output, as in
    # SDPA; a NaN normaliser (NaN or inf in q or k) stays NaN in the output, as in SDPA, rather than turning into
    # zeros.
    unseen = l_i == 0.0
    out = tl.where(unseen[:, None], 0.0, acc / tl.where(unseen, 1.0, l_i)[:, None])
    if TMA_IO:
        BLOCK_M: tl.constexpr = acc.shape[0]
        D_PAD: tl.constexpr = acc.shape[1]
        O.store([b.to(tl.int32), h.to(tl.int32), tl.program_id(0) * BLOCK_M, 0],
                out.to(OUT_DTYPE).reshape(1, 1, BLOCK_M, D_PAD))
    else:
        o_rows = offs_m
        if WIDE:
            o_rows = offs_m.to(tl.int64)
        tl.store(O + b * stride_ob + h * stride_oh + o_rows[:, None] * stride_on + offs_d[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


@triton.jit
def _sparse_attention_kernel(
    Q, K, V, O, INDEX, COUNT, NFULL, PV_THRESHOLD, PV_COUNT, KPOS, SINKS,
    qk_scale, cap_in, cap_out, H, GROUP, q_len, kv_len, NK, q_offset, last_position, window, stride_pb, stride_ph,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, USE_INDEX: tl.constexpr, PV_SKIP: tl.constexpr, RETURN_COUNTS: tl.constexpr,
    PAIR_TILES: tl.constexpr, TMA_IO: tl.constexpr, PERMUTED_KEYS: tl.constexpr, WIDE: tl.constexpr,
    WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b, h, row, offs_m, offs_d, d_mask, row_valid, q, K_base, V_base = _query_tile(
        Q, K, V, H, GROUP, q_len, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_vb,
        stride_vh, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_M=BLOCK_M, TMA_IO=TMA_IO, WIDE=WIDE)
    offs_n = tl.arange(0, BLOCK_N)
    # original key positions of this K/V head (PERMUTED_KEYS; always walked through an index, whose
    # compaction put every block of the segments this query block overlaps among the masked tiles)
    KPOS_base = KPOS + b * stride_pb + (h // GROUP) * stride_ph

    m_i, l_i, acc, pv_count, pv_threshold = _empty_softmax_state(PV_THRESHOLD, h, BLOCK_M=BLOCK_M, D_PAD=D_PAD,
                                                                 PV_SKIP=PV_SKIP)
    q_pos = offs_m + q_offset  # causal positions of the rows (AttentionShape.causal_offset)
    index = INDEX + row * NK
    if USE_INDEX:
        count = tl.load(COUNT + row)
        n_full = tl.load(NFULL + row)
    else:
        count, n_full = _dense_row_extent(tl.program_id(0) * BLOCK_M, kv_len, NK, q_offset, last_position,
                                          IS_CAUSAL=IS_CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)

    # The next key block's index is loaded one iteration ahead, so the K/V address of a tile never waits on
    # a load issued in the same iteration (2-3% faster at densities 0.25 and 0.1 on an H100).
    j_next = 0
    if USE_INDEX:
        j_next = tl.load(index, mask=count > 0, other=0)
    first_single = 0
    if PAIR_TILES:
        # Kept blocks two at a time as one 2*BLOCK_N-key tile whose rows are gathered from both blocks (the
        # loads stay row loads, contiguous along D): half the softmax rescales per key, and the tile width
        # of the dense mode at D > 64. Only without the stage-2 test, whose skip unit is one mask block.
        offs_pair = tl.arange(0, 2 * BLOCK_N)
        first_half = offs_pair < BLOCK_N
        n_pairs = n_full // 2
        j_second = tl.load(index + 1, mask=n_pairs > 0, other=0)
        for p in range(0, n_pairs):
            cols = tl.where(first_half, j_next * BLOCK_N, j_second * BLOCK_N - BLOCK_N) + offs_pair
            j_next = tl.load(index + tl.minimum(2 * p + 2, count - 1))
            j_second = tl.load(index + tl.minimum(2 * p + 3, count - 1))
            acc, l_i, m_i, pv_count = _attend_tile(
                acc, l_i, m_i, pv_count, q, cols, K_base, V_base, KPOS_base,
                stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len,
                pv_threshold, qk_scale, window, MASKED=False, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP, WIDE=WIDE,
                cap_in=cap_in, cap_out=cap_out, SOFTCAP=SOFTCAP)
        first_single = 2 * n_pairs
    acc, l_i, m_i, pv_count, j_next = _walk_blocks(
        acc, l_i, m_i, pv_count, j_next, first_single, n_full, index, count, q, offs_n, K_base, V_base, KPOS_base,
        stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len, pv_threshold,
        qk_scale, window, BLOCK_N=BLOCK_N, MASKED=False, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP, USE_INDEX=USE_INDEX,
        WIDE=WIDE, cap_in=cap_in, cap_out=cap_out, SOFTCAP=SOFTCAP)
    acc, l_i, m_i, pv_count, j_next = _walk_blocks(
        acc, l_i, m_i, pv_count, j_next, n_full, count, index, count, q, offs_n, K_base, V_base, KPOS_base,
        stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len, pv_threshold,
        qk_scale, window, BLOCK_N=BLOCK_N, MASKED=True, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP, USE_INDEX=USE_INDEX,
        PERMUTED_KEYS=PERMUTED_KEYS, WIDE=WIDE, WINDOWED=WINDOWED, cap_in=cap_in, cap_out=cap_out, SOFTCAP=SOFTCAP)

    if HAS_SINKS:
        acc, l_i = _add_sink(acc, l_i, m_i, SINKS, h)
    _store_output(O, b, h, acc, l_i, offs_m, offs_d, d_mask, row_valid, stride_ob, stride_oh, stride_on, stride_od,
                  TMA_IO=TMA_IO, OUT_DTYPE=q.dtype, WIDE=WIDE)
    if RETURN_COUNTS:
        tl.store(PV_COUNT + row, pv_count)


def block_mask_to_index(block_mask: torch.Tensor, shape: AttentionShape, is_causal: bool,
                        tail: attention_hopper.TailSchedule | None = None, key_segment: int = BLOCK_K
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact each row of a (B|1, H|1, nq, nk) mask into ascending key-block indices.

    Returns (index (B, H, nq, nk) int32, count (B, H, nq) int32, n_full (B, H, nq) int32), where the first
    n_full indices of a row need no element masking. Blocks that causal masking hides are dropped (for keys
    permuted within segments of ``key_segment`` positions, by the segments' extents: ``_key_block_flags``). With
    ``tail`` (an empty ``attention_hopper.new_tail_schedule``) the same kernel also fills the Hopper
    kernel's tail order.
    """
    B, H, nq, nk = shape.batch, shape.heads, shape.q_blocks, shape.k_blocks
    m = block_mask if block_mask.dtype != torch.bool else block_mask.view(torch.uint8)
    m = m.expand(B, H, nq, nk)
    index = torch.empty(B, H, nq, nk, device=m.device, dtype=torch.int32)
    count = torch.empty(B, H, nq, device=m.device, dtype=torch.int32)
    n_full = torch.empty_like(count)
    launch(_block_mask_to_index_kernel, (nq, B * H),
        m, index, count, n_full, *tail_kernel_args(tail, count), H, nq, nk, shape.kv_len, shape.causal_offset,
        shape.last_row_position, shape.window_arg, *m.stride(),
        NK_PAD=max(next_power_of_2(nk), 16), IS_CAUSAL=is_causal, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
        KEY_SEGMENT=key_segment, RECORD_TAIL=tail is not None, BUCKETS=attention_hopper.TAIL_BUCKETS, num_warps=4,
    )
    return index, count, n_full


# Benchmarks may set this to try other launch settings, e.g. {"num_warps": 4, "num_stages": 2}.
LAUNCH_OVERRIDE: dict | None = None


def _launch_config(head_dim: int) -> dict:
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    # H100 (benchmarks/results/launch-sweep-H100.txt): 8 warps and 3 stages are fastest, or within 2.5% of the
    # fastest setting, dense, at density 0.25, and at 0.25 with the stage-2 test, at D = 64 and 128; 4 stages
    # do not fit in shared memory at D = 128. Where 3 do not fit either (GPUs with 99 KB per block at D > 64),
    # _launch.launch_fitting runs fewer (benchmarks/results/shared-memory.txt). At D > 128 two stages of 64 keys:
    # Gemma-3-12B heads (16 / 8, D = 256), causal, the dense mode 16.3 ms at 32K against 20.6 with one stage, 27.9 with
    # one stage of 128 keys, 56.7 with 4 warps (cuDNN SDPA 13.6; benchmarks/results/kernel-variants-H100.txt (pp)).
    if head_dim > 128:
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 8, "num_stages": 3}


def dense_block_n(head_dim: int) -> int:
    """Key-tile width of the dense mode without stage 2, which follows no mask: 128 keys at 64 < D <= 128 (H100,
    8 warps, 3 stages: Llama-32K causal 16.5 vs 18.5 ms, Mochi 45.9 vs 50.2 ms, Flux 0.54 vs 0.56 ms), the
    mask's 64 at D <= 64 (CogVideoX: 11.9 vs 10.8 ms) and at D > 128 (see ``_launch_config``)."""
    return 128 if 64 < head_dim <= 128 else BLOCK_K


def pair_tiles(head_dim: int, index_given: bool, pv_skip: bool) -> bool:
    """Whether the walk over a mask takes kept blocks two at a time as one 128-key tile: where the dense mode
    uses 128-key tiles (D > 64) and no stage-2 test needs one decision per mask block."""
    return index_given and not pv_skip and dense_block_n(head_dim) == 2 * BLOCK_K


# Tests set this to run the tensor-descriptor path in the interpreter; None decides by ``use_tma_io``'s rule.
TMA_IO_OVERRIDE: bool | None = None


def use_tma_io(qh: torch.Tensor, out_h: torch.Tensor, shape: AttentionShape, is_causal: bool) -> bool:
    """Whether the kernel loads its Q tile and stores its output tile through TMA tensor descriptors
    instead of per-thread loads and stores.

    Measured on an H100 (benchmarks/results/kernel-variants-H100.txt (j)): the per-tile Q read and output
    write are a fixed cost that weighs most at low density; with TMA, Flux dense 0.554 -> 0.533 ms and at
    density 0.1 0.100 -> 0.097 ms, Mochi at 0.1 5.45 -> 5.31 ms, CogVideoX unchanged, outputs bitwise
    equal; Llama-32K causal got 1-4% slower, so it is used without causal masking only. Needs Hopper or
    newer (sm90), a power-of-two head dim, and 16-byte aligned Q/O bases and strides (true of contiguous
    tensors and of NHD views of them); otherwise the pointer path runs.
    """
    if TMA_IO_OVERRIDE is not None:
        return TMA_IO_OVERRIDE
    if is_causal or not qh.is_cuda or device_capability(qh.device.index) < (9, 0):
        return False
    if shape.head_dim != next_power_of_2(shape.head_dim):
        return False
    size = qh.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(st * size % 16 == 0 for st in t.stride()[:-1])
               for t in (qh, out_h))


def _tma_descriptor(t: torch.Tensor):
    """A (B, H, N, D) tensor descriptor whose box is one query tile of one head (from cached fields:
    ``_launch.tensor_descriptor``; ``use_tma_io`` checked the alignment)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = (1, 1, BLOCK_Q, t.shape[-1])
    return tensor_descriptor(TensorDescriptor, t, box,
                             lambda: TensorDescriptor(t, list(t.shape), list(t.stride()), list(box)))


@functools.lru_cache(maxsize=16)
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Stands in for pointer arguments a kernel variant never reads (cached: no allocation per call)."""
    return torch.zeros(1, device=device, dtype=dtype)


def sparse_attention_triton(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out_h: torch.Tensor, shape: AttentionShape, *,
    is_causal: bool, scale: float, index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    pvthreshd: torch.Tensor | None, return_counts: bool, tail: attention_hopper.TailSchedule | None = None,
    ticket: torch.Tensor | None = None, on_hopper: bool | None = None, key_positions: torch.Tensor | None = None,
    sink_logits: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor | None:
    """Launch the attention kernel on (B, H, N, D) views, writing ``out_h``.

    ``index`` None runs the dense mode (every visible key block, contiguous walk). Returns the per-(b, h,
    query block) count of P.V products computed when ``return_counts`` and stage 2 is on (``pvthreshd``
    given), else None: without the stage-2 test every visited block's P.V product is computed.

    On an H100-class GPU (sm90) at head dim 64 or 128 without the stage-2 test, the call goes to the warp-
    specialised Gluon kernel of ``attention_hopper`` (see its ``usable`` for the exact rule); ``tail`` (filled
    with this index) then reorders the end of its schedule, and ``ticket`` (zeroed, from the same allocation)
    saves it a memset. The Triton kernel reads neither. ``on_hopper``: that rule's answer if the caller already
    has it (None: decided here).

    ``key_positions``: (B, H_kv, N) int32 (stride 0 where broadcast, unit last stride) original positions of
    keys permuted within segments (``_inputs.PermutedKeys``; causal calls with an index compacted for that
    segment only); both kernels read them in their masked tiles.

    ``sink_logits``: (H,) learned sink logits with unit stride (``_inputs.check_sink_logits``), added to each row's
    normaliser before the output is written. ``softcap``: logit soft-capping c (scores c * tanh(s / c)), or None.
    """
    if key_positions is not None and (index is None or not is_causal):
        raise ValueError("key_positions needs a causal call with an index compacted for its key segment")
    if shape.sliding_window is not None and (index is None or not is_causal):
        raise ValueError("a sliding window needs a causal call with an index compacted for it")
    if on_hopper is None:
        on_hopper = attention_hopper.usable(qh, kh, vh, out_h, shape, pv_test=pvthreshd is not None,
                                            dense=index is None, is_causal=is_causal)
    if on_hopper:
        attention_hopper.hopper_block_sparse_attention(qh, kh, vh, out_h, shape, is_causal=is_causal, scale=scale,
                                                       index=index, tail=tail, ticket=ticket,
                                                       key_positions=key_positions, sink_logits=sink_logits,
                                                       softcap=softcap)
        return None
    B, H = shape.batch, shape.heads
    nq = shape.q_blocks
    block_n = dense_block_n(shape.head_dim) if index is None and pvthreshd is None else BLOCK_K
    nk = cdiv(shape.kv_len, block_n)
    return_counts = return_counts and pvthreshd is not None
    unused = _placeholder(qh.device, torch.int32)
    pv_count = torch.empty(B, H, nq, device=qh.device, dtype=torch.int32) if return_counts else unused
    idx, count, n_full = index if index is not None else (unused, unused, unused)
    pv_thr = pvthreshd if pvthreshd is not None else _placeholder(qh.device, torch.float32)
    tma_io = use_tma_io(qh, out_h, shape, is_causal)
    q_arg, out_arg = (_tma_descriptor(qh), _tma_descriptor(out_h)) if tma_io else (qh, out_h)
    kpos = key_positions if key_positions is not None else unused
    kpos_strides = (kpos.stride(0), kpos.stride(1)) if key_positions is not None else (0, 0)
    launch(_sparse_attention_kernel, (nq, B * H),
        q_arg, kh, vh, out_arg, idx, count, n_full, pv_thr, pv_count, kpos,
        sink_logits if sink_logits is not None else pv_thr, *attention_hopper.softcap_args(scale, softcap), H,
        H // shape.kv_heads, shape.q_len, shape.kv_len, nk, shape.causal_offset,
        shape.last_query_position, shape.window_arg, *kpos_strides,
        *qh.stride(), *kh.stride(), *vh.stride(), *out_h.stride(),
        HEAD_DIM=shape.head_dim, D_PAD=next_power_of_2(shape.head_dim), BLOCK_M=BLOCK_Q, BLOCK_N=block_n,
        IS_CAUSAL=is_causal, USE_INDEX=index is not None, PV_SKIP=pvthreshd is not None,
        RETURN_COUNTS=return_counts, PAIR_TILES=pair_tiles(shape.head_dim, index is not None, pvthreshd is not None),
        TMA_IO=tma_io, PERMUTED_KEYS=key_positions is not None, WIDE=wide_offsets(qh, kh, vh, out_h),
        WINDOWED=shape.sliding_window is not None, HAS_SINKS=sink_logits is not None,
        SOFTCAP=softcap_mode(softcap, qh.device), **_launch_config(shape.head_dim),
    )
    return pv_count if return_counts else None
