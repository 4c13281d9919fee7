"""S2O-style selection: visit key blocks by predicted importance and stop once the normaliser stops growing.

S2O (Zhang et al., "Early Stopping for Sparse Attention via Online Permutation") does not move tensors: it
builds index arrays and lets the attention kernel load tiles through them, most important first, and stops
a query tile once the last tile's gain in the softmax normaliser l falls below tau * l. Here that is a
second selection policy beside TopCdf, for one query block (128 rows) at a time:

1. Order (:func:`s2o_visit_order` on the stage-1 statistics, shared by the kernel and the reference; on a
   GPU one Triton sort per query block, on a CPU PyTorch). Forced blocks come first, in ascending order:
   every key block of a query block that stage 1 does not trust (non-self-similar query or key block,
   SpargeAttn Eq. 5), the first key block with ``attention_sink``, the ragged last key block, and under
   causal masking every visible key block of the query block's own segment of ``segment`` tokens (S2O's
   dense intra-segment pass, Algorithm 2 / 4 lines 7-12) and the diagonal. The remaining visible key blocks
   follow in descending compressed score q_mean . k_mean (stage 1's map, the same for both masks). With
   unequal lengths (``causal_variant``, e.g. a chunk of queries against a KV cache) a query row sits at
   position row + ``AttentionShape.causal_offset``, and its segment is that position's.
2. Walk (``_ordered_attention_kernel``; on Hopper, where it can, the Gluon walk of ``s2o_hopper`` instead, which
   stops at the same tiles): forced blocks unconditionally, then the ranked blocks while the
   last tile's relative gain, mean over the tile's valid rows of (l_new - l_old) / l_old (both at the new
   running max), is at least ``tau`` (the paper's deferred check, Algorithm 4 lines 14-20), tested every
   ``check_every`` ranked tiles. A row's gain is infinite where the tile brought its first finite score, and
   zero where it has none yet (no visible key, or -inf on every one) or a NaN normaliser (NaN or inf in q or a
   key it saw): such a row has no gain to offer, and the block's walk is judged by its other rows. (Until
   session 77 a row without a finite score, or whose normaliser was NaN before the tile, counted infinite and
   kept its block walking to the end; one whose tile brought the NaN made the mean NaN and stopped the block.)
   The PV skip of stage 2 applies to every tile. Rows that see no key (a lower-right chunk with more queries
   than keys) are zeros.

Departures from the paper, each for a reason:
* Granularity is the 64-key block, not the token: S2O ranks individual keys (KV_perm) and gathers them; our
  kernel keeps contiguous 64-key tiles, so index arrays stay O((N/128)(N/64)) and loads stay block loads.
* One order per query block (its own q_mean) instead of one per segment (the segment's q_mean), and no
  query reordering inside a segment (the paper's Algorithm 4 also omits it).
* The stop test is the mean of the rows' relative gains (a tile has 128 rows, the paper states the rule
  per query); the tile whose gain triggers the stop is kept, since it is computed already (Algorithm 4
  discards it, which costs a copy of the state and loses accuracy); and it runs every ``check_every``
  (default 16) ranked tiles instead of after each, so the walk stays a software-pipelined for loop.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import triton
import triton.language as tl

from ._inputs import (BLOCK_K, BLOCK_Q, NO_WINDOW, AttentionShape, Backend, causal_block_visible, check_flag,
                      pick_backend, wide_offsets)
from .._launch import launch, next_power_of_2
from . import attention, s2o_hopper
from .attention import (LOG2E, _add_sink, _attend_tile, _empty_softmax_state, _key_block_flags, _query_tile,
                        _store_output, _walk_blocks)
from .predict import compressed_scores_triton

_NO_WINDOW: tl.constexpr = tl.constexpr(NO_WINDOW)  # S2O's walks take no sliding window

# Default number of ranked tiles between two stop tests (see the kernel's comment).
CHECK_EVERY = 16


@triton.jit
def _ordered_attention_kernel(
    Q, K, V, O, INDEX, N_UNMASKED, N_FORCED, COUNT, TAU, PV_THRESHOLD, VISITED, PV_COUNT, SINKS,
    qk_scale, H, GROUP, q_len, kv_len, NK, q_offset,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, PV_SKIP: tl.constexpr, EARLY_STOP: tl.constexpr, RETURN_COUNTS: tl.constexpr,
    CHECK_EVERY: tl.constexpr, WIDE: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    b, h, row, offs_m, offs_d, d_mask, row_valid, q, K_base, V_base = _query_tile(
        Q, K, V, H, GROUP, q_len, stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_vb,
        stride_vh, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_M=BLOCK_M, WIDE=WIDE)
    offs_n = tl.arange(0, BLOCK_N)

    m_i, l_i, acc, pv_count, pv_threshold = _empty_softmax_state(PV_THRESHOLD, h, BLOCK_M=BLOCK_M, D_PAD=D_PAD,
                                                                 PV_SKIP=PV_SKIP)
    q_pos = offs_m + q_offset  # causal positions of the rows (AttentionShape.causal_offset)
    index = INDEX + row * NK
    n_unmasked = tl.load(N_UNMASKED + row)
    n_forced = tl.load(N_FORCED + row)
    count = tl.load(COUNT + row)

    # The next key block's index is loaded one iteration ahead (as in attention.py), across all three loops.
    j_next = tl.load(index, mask=count > 0, other=0)
    # forced blocks: those needing no element masking, then the diagonal / ragged ones
    acc, l_i, m_i, pv_count, j_next = _walk_blocks(
        acc, l_i, m_i, pv_count, j_next, 0, n_unmasked, index, count, q, offs_n, K_base, V_base, K_base,
        stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len, pv_threshold,
        qk_scale, 0, BLOCK_N=BLOCK_N, MASKED=False, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP, USE_INDEX=True, WIDE=WIDE)
    acc, l_i, m_i, pv_count, j_next = _walk_blocks(
        acc, l_i, m_i, pv_count, j_next, n_unmasked, n_forced, index, count, q, offs_n, K_base, V_base, K_base,
        stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len, pv_threshold,
        qk_scale, 0, BLOCK_N=BLOCK_N, MASKED=True, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP, USE_INDEX=True, WIDE=WIDE)

    # Ranked blocks, most important first (fully visible whole tiles: no masking), in chunks of CHECK_EVERY
    # tiles: the inner loop is an ordinary, software-pipelined for loop, and the stop test runs between
    # chunks on the last tile's gain. The chunks are a for loop too: once the walk stops, the remaining
    # chunks are empty (a Triton while loop around the chunks, or an ``if`` around a chunk's loop, cost
    # Mochi / Llama-32K +11-15% over the walk without the test on an H100; this form +9-10%, and +6% at
    # CogVideoX / Flux). A test after every tile needs a while loop around each tile, which Triton does not
    # pipeline (+50-80%).
    visited = n_forced
    tau = 0.0
    chunk = tl.maximum(count - n_forced, 1)  # without the test: the whole ranked walk is one chunk
    if EARLY_STOP:
        tau = tl.load(TAU + h)
        chunk = CHECK_EVERY
    # Rows before key 0 (a lower-right chunk with more queries than keys) need no exclusion from the mean: their
    # block's first position is negative, so every block it sees is on its diagonal, forced, and never tested.
    n_valid = tl.sum(row_valid.to(tl.float32), axis=0)
    m_old = m_i
    l_old = l_i
    go = n_forced < count
    for c in range(0, tl.cdiv(count - n_forced, chunk)):
        start = n_forced + c * chunk
        end = tl.where(go, tl.minimum(start + chunk, count), start)
        for it in range(start, end):
            j = j_next
            j_next = tl.load(index + tl.minimum(it + 1, count - 1))
            if EARLY_STOP:
                last = it == end - 1
                m_old = tl.where(last, m_i, m_old)
                l_old = tl.where(last, l_i, l_old)
            acc, l_i, m_i, pv_count = _attend_tile(
                acc, l_i, m_i, pv_count, q, j * BLOCK_N + offs_n, K_base, V_base, K_base,
                stride_kn, stride_kd, stride_vn, stride_vd, q_pos, offs_d, d_mask, row_valid, kv_len,
                pv_threshold, qk_scale, 0, MASKED=False, IS_CAUSAL=IS_CAUSAL, PV_SKIP=PV_SKIP, WIDE=WIDE)
        visited = tl.where(go, end, visited)
        if EARLY_STOP:
            before = l_old * tl.exp2(m_old - m_i)  # the normaliser before the last tile, at the new max
            gain = tl.where(before > 0.0, (l_i - before) / tl.where(before > 0.0, before, 1.0),
                            tl.where(l_i > 0.0, float("inf"), 0.0))
            gain = tl.where(row_valid & (l_i == l_i), gain, 0.0)  # a NaN normaliser counts zero (module notes)
            go = go & (visited < count) & (tl.sum(gain, axis=0) / n_valid >= tau)

    if HAS_SINKS:  # after the stop test, which weighs the keys' normaliser only
        acc, l_i = _add_sink(acc, l_i, m_i, SINKS, h)
    _store_output(O, b, h, acc, l_i, offs_m, offs_d, d_mask, row_valid, stride_ob, stride_oh, stride_on, stride_od,
                  WIDE=WIDE)
    if RETURN_COUNTS:
        tl.store(VISITED + row, visited)
        tl.store(PV_COUNT + row, pv_count)
    elif EARLY_STOP:
        # Never stores (visited >= 0), but keeps ``visited``, and through it the stop flag, alive: Triton 3.6's
        # layout pass prunes loop-carried values that only a nested loop's bounds read (triton-lang/triton
        # PR 9036), which replaced ``go`` by its initial value and silently disabled the stop.
        tl.store(VISITED + row, visited, mask=visited < 0)


class VisitOrder(tuple):
    """(index (B, H, nq, nk) int32, n_unmasked, n_forced, count (B, H, nq) int32): per query block, the key
    blocks in visiting order; the first n_forced are always visited (the first n_unmasked of those need no
    element masking); entries past count are unused (invisible under causal masking).

    ``shape`` and ``is_causal`` record the call :func:`s2o_visit_order` built it for (None for an order assembled
    by hand), which :func:`~sparge_diffusers.s2o_attention` checks before the kernel loads key blocks through it.
    """

    shape: AttentionShape | None
    is_causal: bool | None

    def __new__(cls, tensors: Iterable[torch.Tensor], shape: AttentionShape | None = None,
                is_causal: bool | None = None) -> "VisitOrder":
        order = super().__new__(cls, tensors)
        order.shape, order.is_causal = shape, is_causal
        return order

    def to(self, device: str | torch.device) -> "VisitOrder":
        """The same order with its tensors on ``device``."""
        return VisitOrder((t.to(device) for t in self), self.shape, self.is_causal)


def check_visit_order(order: Any, shape: AttentionShape, is_causal: bool, device: torch.device) -> None:
    """Raise ValueError unless ``order`` can drive this call's walk, which loads key blocks through its indices
    unchecked (an order of another shape read outside the keys on a GPU). An order that records its call must
    record this one: built without causal masking, its unmasked blocks would let queries see later keys. One
    assembled by hand is checked for range, with one read-back (a device sync)."""
    if not isinstance(order, tuple) or len(order) != 4 or not all(isinstance(t, torch.Tensor) for t in order):
        raise ValueError("order must be a VisitOrder from s2o_visit_order: (index, n_unmasked, n_forced, count)")
    index, counts = order[0], order[1:]
    rows = (shape.batch, shape.heads, shape.q_blocks)
    if tuple(index.shape) != rows + (shape.k_blocks,) or any(tuple(t.shape) != rows for t in counts):
        raise ValueError(f"order has shapes {[tuple(t.shape) for t in order]}; this call needs index "
                         f"{rows + (shape.k_blocks,)} and counts {rows} (B, H, query blocks[, key blocks])")
    if any(t.dtype != torch.int32 or t.device != device for t in order):
        raise ValueError(f"order's tensors must be int32 on {device}, got {[(t.dtype, str(t.device)) for t in order]}")
    built, built_causal = getattr(order, "shape", None), getattr(order, "is_causal", None)
    if built is not None:
        if built != shape or built_causal != is_causal:
            raise ValueError(f"order was built for {built} with is_causal={built_causal}; this call is {shape} "
                             f"with is_causal={is_causal}")
        return
    n_unmasked, n_forced, count = counts
    bad = ((index < 0) | (index >= shape.k_blocks)).any() | (n_unmasked < 0).any() | (n_unmasked > n_forced).any() \
        | (n_forced > count).any() | (count > shape.k_blocks).any()
    if bool(bad):
        raise ValueError(f"order holds a block index outside 0..{shape.k_blocks - 1} or counts not ordered as "
                         f"0 <= n_unmasked <= n_forced <= count <= {shape.k_blocks}")


# Visiting orders are sorted in one Triton program per row up to this many key blocks (N = 1M tokens); longer
# rows take the PyTorch path (a register-resident sort of more keys would spill).
MAX_SORTED_BLOCKS = 16384
# Sort-key layout (int64, sorted descending): group in bits 61-62, a 32-bit within-group key in bits 29-60, and
# (2^29 - 1 - column) in bits 0-28 so that equal keys keep ascending column order, as a stable sort does.
_COLUMN_BITS = 29


@triton.jit
def _visit_order_kernel(
    SCORES, QSIM, KSIM, THETA, INDEX, N_UNMASKED, N_FORCED, COUNT, H, GROUP, NQ, NK, KV_LEN, Q_OFFSET,
    LAST_ROW, SEGMENT, NK_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, SINK: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, COLUMN_BITS: tl.constexpr,
):
    """One query block's visiting order: the same groups and order as :func:`_visit_order_torch`, by one
    descending sort of packed int64 keys (Triton sorts values, not key-value pairs)."""
    i = tl.program_id(0)
    pid_bh = tl.program_id(1)
    h = pid_bh % H
    bhk = (pid_bh // H) * (H // GROUP) + h // GROUP
    row = pid_bh.to(tl.int64) * NQ + i
    cols = tl.arange(0, NK_PAD)
    cvalid = cols < NK
    theta = tl.load(THETA + h)
    score = tl.load(SCORES + row * NK + cols, mask=cvalid, other=0.0)
    # non-self-similar query block or key block: (q_sim <= theta) | (k_sim <= theta)
    forced = tl.minimum(tl.load(KSIM + bhk.to(tl.int64) * NK + cols, mask=cvalid, other=1.0),
                        tl.load(QSIM + row)) <= theta
    first_q = i * BLOCK_Q
    visible, needs_masking, _ = _key_block_flags(first_q, cols, cvalid, KV_LEN, Q_OFFSET, LAST_ROW, _NO_WINDOW,
                                                 IS_CAUSAL=IS_CAUSAL, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
                                                 KEY_SEGMENT=BLOCK_K)
    forced = forced | needs_masking  # the ragged last block and the causal diagonal
    if SINK:
        forced = forced | (cols == 0)
    if IS_CAUSAL:
        # the dense intra-segment pass: the segment of the block's first causal position (a block starting before
        # key 0, which a lower-right chunk with more queries than keys has, sees only diagonal blocks anyway)
        segment_start = tl.maximum(first_q + Q_OFFSET, 0) // SEGMENT * SEGMENT
        forced = forced | (cols * BLOCK_K >= segment_start)
    forced = forced & visible
    group = tl.where(visible, tl.where(forced, tl.where(needs_masking, 2, 3), 1), 0).to(tl.int64)
    # Within a group: forced blocks by ascending column, the others by descending score, through the float's
    # order-preserving 32-bit pattern (negative floats: bits inverted; others: sign bit set).
    one = tl.full([NK_PAD], 1, tl.int64)  # 64-bit constants built by shifts (literals past int32 are unsigned)
    cols64 = cols.to(tl.int64)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0, as in a float sort
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    ordered_score = tl.where(bits < 0, -1 - bits, bits + (one << 31))
    within = tl.where(forced, (one << 32) - 1 - cols64, ordered_score)
    low = (one << COLUMN_BITS) - 1
    key = (group << 61) | (within << COLUMN_BITS) | (low - cols64)
    key = tl.where(cvalid, key, -1)  # padding sorts last
    order = low - (tl.sort(key, descending=True) & low)
    tl.store(INDEX + row * NK + cols, order.to(tl.int32), mask=cvalid)
    tl.store(COUNT + row, tl.sum(visible.to(tl.int32), axis=0))
    tl.store(N_FORCED + row, tl.sum(forced.to(tl.int32), axis=0))
    tl.store(N_UNMASKED + row, tl.sum((forced & ~needs_masking).to(tl.int32), axis=0))


def s2o_visit_order(q_means: torch.Tensor, k_means: torch.Tensor, q_sim: torch.Tensor, k_sim: torch.Tensor,
                    shape: AttentionShape, *, is_causal: bool, scale: float, simthreshd1: torch.Tensor,
                    segment: int, attention_sink: bool, backend: Backend = "auto") -> VisitOrder:
    """Build the visiting order from stage 1's block statistics (means (B, H|H_kv, n, D), similarities).

    ``backend`` "triton" (or "auto" on CUDA tensors) computes the compressed scores and sorts each row in
    Triton: three launches instead of about forty PyTorch ops (the host time that dominated S2O at Flux's
    size); "reference" (or "auto" on CPU tensors) uses PyTorch. Both give the same order from the same scores;
    the Triton scores (tf32x3 products, scaled by log2 e) may break near-ties differently.

    ``shape`` sizes everything the kernels read, so the statistics must match it (ValueError otherwise): the
    Triton passes read past smaller tensors and, given a strided view of the means, read other elements.
    """
    _check_block_statistics(q_means, k_means, q_sim, k_sim, simthreshd1, shape)
    check_flag(is_causal, "is_causal")
    check_flag(attention_sink, "attention_sink")
    backend = pick_backend(backend, q_means.device)  # ("bogus" ran the PyTorch path)
    return visit_order_of_checked(q_means, k_means, q_sim, k_sim, shape, is_causal=is_causal, scale=scale,
                                  simthreshd1=simthreshd1, segment=segment, attention_sink=attention_sink,
                                  backend=backend)


def visit_order_of_checked(q_means: torch.Tensor, k_means: torch.Tensor, q_sim: torch.Tensor, k_sim: torch.Tensor,
                           shape: AttentionShape, *, is_causal: bool, scale: float, simthreshd1: torch.Tensor,
                           segment: int, attention_sink: bool, backend: str = "auto") -> VisitOrder:
    """:func:`s2o_visit_order` on statistics known to match ``shape`` (``s2o_attention``'s own, of its checked
    inputs): the check costs ~7 us of host time per call, which S2O's calls do not repeat."""
    use_triton = backend == "triton" or (backend == "auto" and q_means.is_cuda)
    if not use_triton or next_power_of_2(shape.k_blocks) > MAX_SORTED_BLOCKS:
        group = shape.heads // shape.kv_heads
        km = k_means.repeat_interleave(group, dim=1) if group > 1 else k_means
        scores = (q_means.float() @ km.float().transpose(-1, -2)) * scale  # (B, H, nq, nk)
        return _visit_order_torch(scores, q_sim, k_sim, shape, is_causal=is_causal, simthreshd1=simthreshd1,
                                  segment=segment, attention_sink=attention_sink)
    # the scores' kernel reads the means as contiguous (a no-op for s2o_attention's own)
    scores = compressed_scores_triton(q_means.contiguous(), k_means.contiguous(), shape, scale)
    return _visit_order_triton(scores, q_sim, k_sim, shape, is_causal=is_causal, simthreshd1=simthreshd1,
                               segment=segment, attention_sink=attention_sink)


def _check_block_statistics(q_means: torch.Tensor, k_means: torch.Tensor, q_sim: torch.Tensor, k_sim: torch.Tensor,
                            simthreshd1: torch.Tensor, shape: AttentionShape) -> None:
    q_rows = (shape.batch, shape.heads, shape.q_blocks)
    k_rows = (shape.batch, shape.kv_heads, shape.k_blocks)
    expected = {"q_means": q_rows + (shape.head_dim,), "k_means": k_rows + (shape.head_dim,), "q_sim": q_rows,
                "k_sim": k_rows, "simthreshd1": (shape.heads,)}
    given = {"q_means": q_means, "k_means": k_means, "q_sim": q_sim, "k_sim": k_sim, "simthreshd1": simthreshd1}
    device = q_means.device if isinstance(q_means, torch.Tensor) else None
    for name, t in given.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected[name] or not t.is_floating_point() \
                or t.device != device:
            what = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"s2o_visit_order: {name} must be a float tensor of shape {expected[name]} on one "
                             f"device with the others, for this shape; got {what}")


def _visit_order_triton(scores: torch.Tensor, q_sim: torch.Tensor, k_sim: torch.Tensor, shape: AttentionShape, *,
                        is_causal: bool, simthreshd1: torch.Tensor, segment: int, attention_sink: bool
                        ) -> VisitOrder:
    B, H, nq, nk = shape.batch, shape.heads, shape.q_blocks, shape.k_blocks
    index = torch.empty(B, H, nq, nk, device=scores.device, dtype=torch.int32)
    n_unmasked, n_forced, count = (torch.empty(B, H, nq, device=scores.device, dtype=torch.int32) for _ in range(3))
    nk_pad = max(next_power_of_2(nk), 16)
    launch(_visit_order_kernel, (nq, B * H),
        scores.contiguous(), q_sim.contiguous(), k_sim.contiguous(), simthreshd1, index, n_unmasked, n_forced,
        count, H, H // shape.kv_heads, nq, nk, shape.kv_len, shape.causal_offset, shape.last_row_position, segment,
        NK_PAD=nk_pad, IS_CAUSAL=is_causal, SINK=attention_sink, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,
        COLUMN_BITS=_COLUMN_BITS, num_warps=4 if nk_pad <= 2048 else 8)
    return VisitOrder((index, n_unmasked, n_forced, count), shape, is_causal)


def _visit_order_torch(scores: torch.Tensor, q_sim: torch.Tensor, k_sim: torch.Tensor, shape: AttentionShape, *,
                       is_causal: bool, simthreshd1: torch.Tensor, segment: int, attention_sink: bool
                       ) -> VisitOrder:
    """The visiting order in PyTorch from (B, H, nq, nk) compressed scores (k_sim per K/V head)."""
    B, H, nq, nk = shape.batch, shape.heads, shape.q_blocks, shape.k_blocks
    group = H // shape.kv_heads
    k_sim = k_sim.repeat_interleave(group, dim=1) if group > 1 else k_sim
    device = scores.device
    theta = simthreshd1.view(1, H, 1)
    cols = torch.arange(nk, device=device)
    forced = (q_sim <= theta)[..., None] | (k_sim <= theta)[:, :, None, :]
    ragged = (cols * BLOCK_K + BLOCK_K) > shape.kv_len
    needs_masking = ragged[None, :].expand(nq, nk)
    forced = forced | ragged
    if attention_sink:
        forced = forced | (cols == 0)
    visible = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if is_causal:
        visible = causal_block_visible(nq, nk, shape.kv_len, device, q_len=shape.q_len,
                                       causal_offset=shape.causal_offset)
        first_position = torch.arange(nq, device=device) * BLOCK_Q + shape.causal_offset
        segment_start = first_position.clamp(min=0) // segment * segment
        forced = forced | (cols[None, :] * BLOCK_K >= segment_start[:, None])  # S2O's dense intra-segment pass
        needs_masking = needs_masking | ((cols * BLOCK_K + BLOCK_K - 1)[None, :] > first_position[:, None])
    forced = (forced | needs_masking) & visible
    # group: 3 forced without masking, 2 forced with masking, 1 ranked, 0 invisible; inside a group forced
    # blocks go in ascending order and ranked ones by descending score (two stable sorts)
    group_id = torch.where(forced, torch.where(needs_masking, 2, 3), 1) * visible
    within = torch.where(forced, -cols.to(scores.dtype).expand_as(scores), scores)
    order = torch.sort(within, dim=-1, descending=True, stable=True).indices
    order = torch.gather(order, -1, torch.sort(torch.gather(group_id, -1, order), dim=-1, descending=True,
                                               stable=True).indices)
    count = visible.sum(-1).to(torch.int32).expand(B, H, nq)
    n_forced = forced.sum(-1).to(torch.int32)
    n_unmasked = (forced & ~needs_masking).sum(-1).to(torch.int32)
    return VisitOrder((order.to(torch.int32).contiguous(), n_unmasked.contiguous(), n_forced.contiguous(),
                       count.contiguous()), shape, is_causal)


def _launch_config(head_dim: int) -> dict:
    if attention.LAUNCH_OVERRIDE is not None:
        return attention.LAUNCH_OVERRIDE
    # H100 sweep of the walk with the stop test (tau = 0): at D = 64, 4 warps take 11.8 ms against 17.4 ms
    # with 8 at the CogVideoX shape (the checkless walk is 11.4 ms either way); at D = 128, 8 warps and 3
    # stages stay best (Llama-32K causal: 21.0 ms against 22.8-33.8 ms). At D > 128 the mask walk's setting (two
    # stages: three do not fit in an H100's shared memory; attention._launch_config).
    if head_dim > 128:
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 4 if head_dim <= 64 else 8, "num_stages": 3}


def ordered_attention_triton(qh, kh, vh, out_h, shape: AttentionShape, order: VisitOrder, *, is_causal: bool,
                             scale: float, tau: torch.Tensor | None, pvthreshd: torch.Tensor | None,
                             return_counts: bool, check_every: int = CHECK_EVERY,
                             sink_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Launch the ordered walk on (B, H, N, D) views; ``tau`` None visits every block without the check.
    Returns (visited, pv_count) per (b, h, query block) when ``return_counts``. ``sink_logits``: (H,) learned sink
    logits with unit stride, added to each row's normaliser after the walk."""
    if s2o_hopper.usable(qh, kh, vh, out_h, shape, pv_test=pvthreshd is not None, early_stop=tau is not None,
                         check_every=check_every):
        return s2o_hopper.hopper_ordered_attention(qh, kh, vh, out_h, shape, order, is_causal=is_causal, scale=scale,
                                                   tau=tau, return_counts=return_counts, check_every=check_every,
                                                   sink_logits=sink_logits)
    B, H, nq, nk = shape.batch, shape.heads, shape.q_blocks, shape.k_blocks
    unused = attention._placeholder(qh.device, torch.int32)
    unused_f = attention._placeholder(qh.device, torch.float32)
    visited = torch.empty(B, H, nq, device=qh.device, dtype=torch.int32) if return_counts else unused
    pv_count = torch.empty_like(visited) if return_counts else unused
    index, n_unmasked, n_forced, count = order
    launch(_ordered_attention_kernel, (nq, B * H),
        qh, kh, vh, out_h, index, n_unmasked, n_forced, count,
        tau if tau is not None else unused_f, pvthreshd if pvthreshd is not None else unused_f,
        visited, pv_count, sink_logits if sink_logits is not None else unused_f, scale * LOG2E, H,
        H // shape.kv_heads, shape.q_len, shape.kv_len, nk, shape.causal_offset,
        *qh.stride(), *kh.stride(), *vh.stride(), *out_h.stride(),
        HEAD_DIM=shape.head_dim, D_PAD=next_power_of_2(shape.head_dim), BLOCK_M=BLOCK_Q, BLOCK_N=BLOCK_K,
        IS_CAUSAL=is_causal, PV_SKIP=pvthreshd is not None, EARLY_STOP=tau is not None,
        RETURN_COUNTS=return_counts, CHECK_EVERY=check_every, WIDE=wide_offsets(qh, kh, vh, out_h),
        HAS_SINKS=sink_logits is not None, **_launch_config(shape.head_dim),
    )
    return (visited, pv_count) if return_counts else None
