"""S2O's ordered walk (``s2o.py``) on the warp-specialised Gluon kernel of ``attention_hopper`` (Hopper, sm90).

Why: the Triton walk at head dim 128 on an H100 takes 42-48% longer than our dense mode when it skips nothing
(benchmarks/results/s2o-H100.txt), mostly because the dense mode there is this Gluon kernel and the Triton
kernel's dense mode is 14-24% slower; with it S2O lost to cuDNN at its default tau on Flux and Llama-32K (0.62x,
0.71x). This walk takes 6-13% longer than the dense mode (Flux 0.84x, Llama-32K 0.93x cuDNN at the default tau).

The walk is the one ``s2o._ordered_attention_kernel`` and the reference define: a query block visits its forced
blocks, then its ranked blocks, and after every ``check_every`` ranked 64-key tiles tests the last tile's
relative gain in the normaliser, mean over the tile's valid rows of (l_new - l_before) / l_before, against tau.
Arranged for this kernel's 128-key stages:

* Stages pair positions of the visiting order: forced positions from 0 (an odd forced count ends on a stage
  whose second block repeats its first, masked off), ranked positions from ``n_forced`` (an odd ranked count
  likewise). With ``check_every`` even, every stop test then falls between two stages. A stage that holds a
  block needing element masking (the diagonal, the ragged tail) is masked whole, as in the mask walk.
* The last tile's gain comes from the stage's probabilities: at the stage's new row max, l_before =
  l_new - (sum of the second block's probabilities), the reference's l_old * 2^(m_old - m_new) in exact
  arithmetic (float32 rounding may move a borderline stop, as between the Triton walk and the reference).
* The two consumer partitions (64 rows each) write their row sums of gains to shared memory and arrive on a
  barrier; both, and the loader, read the two sums and take the same verdict. The loader issues the stage
  after a check stage without waiting (as the ring allows), then waits for the verdict before issuing more;
  after a stop the consumers release that one stage unread. The wait should cost the loader little: the next
  stage's buffer frees when the consumers finish the check stage, about when the verdict lands. Hence
  ``check_every`` >= 4 (two stages per chunk), so that the barrier's phase is never two ahead of the loader;
  other values (and stage 2's P.V test, which this kernel lacks) run the Triton walk. What a stop test costs,
  and four rearrangements of it that were measured and not kept: kernel-variants-H100.txt (ii).

Gluon kernels do not run under TRITON_INTERPRET: the tests check this walk on a GPU against the Triton walk and
the float32 reference, and on CPU that it compiles for sm90.
"""

from __future__ import annotations

import torch

from ._inputs import BLOCK_K, BLOCK_Q, AttentionShape
from .._launch import launch
from . import attention_hopper
from .attention_hopper import GLUON_IMPORT_ERROR, LOG2E

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    from triton.experimental.gluon.language.nvidia.hopper import tma

    from .attention_hopper import (_add_sink, _allocate_ring, _issue_stage, _load_rows, _mask_scores,
                                   _partition_barrier, _publish_tile, _read_tile, _softmax_step, _stage_pv,
                                   _stage_scores, _store_output_rows, _tile_of)

    @gluon.jit
    def _walk_extent(N_FORCED, COUNT, row):
        """(visible blocks, forced blocks, forced stages, stages) of one query block's walk."""
        count = gl.load(COUNT + row)
        n_forced = gl.load(N_FORCED + row)
        forced_stages = (n_forced + 1) // 2
        return count, n_forced, forced_stages, forced_stages + (count - n_forced + 1) // 2

    @gluon.jit
    def _stage_positions(p, n_forced, forced_stages, count):
        """Positions in the visiting order of stage p's two blocks (the second repeats the first where its
        group has an odd count; ``second_real`` is then False)."""
        in_forced = p < forced_stages
        first = gl.where(in_forced, 2 * p, n_forced + 2 * (p - forced_stages))
        last = gl.where(in_forced, n_forced - 1, count - 1)
        second = gl.minimum(first + 1, last)
        return first, second, second != first

    @gluon.jit
    def _is_check_stage(p, forced_stages, n_stages, CHECK_STAGES: gl.constexpr):
        """Whether stage p ends a chunk of ranked stages with a stage after it (where the stop test runs)."""
        r = p - forced_stages
        return (r >= 0) & ((r + 1) % CHECK_STAGES == 0) & (p + 1 < n_stages)

    @gluon.jit
    def _verdict(gains, gain_ready, n_check, tau_rows, layout: gl.constexpr):
        """Whether the walk goes on after stop test number n_check: once both consumers have written their rows'
        sums of gains, their total against tau times the tile's valid rows (the same floats and operations in
        every partition, hence the same verdict)."""
        par = n_check % 2
        mbarrier.wait(gain_ready.index(par), (n_check // 2) & 1)
        total = (gl.max(gains.index(2 * par).load(layout), axis=0)
                 + gl.max(gains.index(2 * par + 1).load(layout), axis=0))
        return total >= tau_rows

    @gluon.jit
    def _stage_blocks(base, p, n_forced, forced_stages, count, NK):
        """Key blocks of stage p (``base``: the tile's row of the visiting order); for a stage past the walk's
        end (the loader reads a stage ahead) any valid entry."""
        first, second, second_real = _stage_positions(p, n_forced, forced_stages, count)
        j0 = gl.load(base + gl.minimum(gl.maximum(first, 0), NK - 1))
        j1 = gl.load(base + gl.minimum(gl.maximum(second, 0), NK - 1))
        return j0, j1

    @gluon.jit
    def _ordered_loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, tile_ids, q_ready, q_empty, kv_ready,
                        kv_empty, gains, gain_ready, INDEX, N_FORCED, COUNT, TAU, TICKET, H, GROUP, NQ, NK, q_len,
                        n_tiles, STAGES: gl.constexpr, EARLY_STOP: gl.constexpr, CHECK_STAGES: gl.constexpr):
        """Issues each tile's Q and the stages of its walk; after the stage that follows a check stage it waits
        for that check's verdict and stops issuing on a stop."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        Q_BYTES: gl.constexpr = q_bufs.type.shape[1] * q_bufs.type.shape[2] * q_desc.dtype.primitive_bitwidth // 8
        gain_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        n_prog = gl.num_programs(0)
        kv_c = 0
        i = 0
        n_checks = 0
        t = gl.program_id(0)
        while t < n_tiles:
            row, b, h, hk, m = _tile_of(t, NQ, H, GROUP)
            qb = i % 2
            mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
            _publish_tile(tile_ids, qb, t)
            mbarrier.expect(q_ready.index(qb), Q_BYTES)
            _load_rows(q_desc, b, h, m * BLOCK_M, q_ready.index(qb), q_bufs.index(qb), 0)
            t_next = n_prog + gl.atomic_add(TICKET, 1)
            count, n_forced, forced_stages, n_stages = _walk_extent(N_FORCED, COUNT, row)
            base = INDEX + row.to(gl.int64) * NK
            if EARLY_STOP:
                tau_rows = gl.load(TAU + h) * gl.minimum(q_len - m * BLOCK_M, BLOCK_M).to(gl.float32)
            j0, j1 = _stage_blocks(base, 0, n_forced, forced_stages, count, NK)
            p = 0
            while p < n_stages:
                n0, n1 = _stage_blocks(base, p + 1, n_forced, forced_stages, count, NK)  # read before the wait below
                _issue_stage(k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, kv_c, b, hk, j0, j1, STAGES)
                kv_c += 1
                j0 = n0
                j1 = n1
                if EARLY_STOP:
                    if _is_check_stage(p - 1, forced_stages, n_stages, CHECK_STAGES):
                        go = _verdict(gains, gain_ready, n_checks, tau_rows, gain_layout)
                        n_checks += 1
                        p = gl.where(go, p, n_stages)
                p += 1
            t = t_next
            i += 1
        # no tile left: hand the consumers an out-of-range tile number through the next Q slot
        qb = i % 2
        mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
        _publish_tile(tile_ids, qb, t)
        mbarrier.arrive(q_ready.index(qb))

    @gluon.jit
    def _ordered_consumer(o_desc, q_bufs, k_bufs, v_bufs, o_smem, tile_ids, q_ready, q_empty, kv_ready, kv_empty,
                          gains, gain_ready, INDEX, N_UNMASKED, N_FORCED, COUNT, TAU, VISITED, SINKS, qk_scale, H,
                          GROUP, NQ, NK, q_len, kv_len, q_offset, n_tiles, STAGES: gl.constexpr,
                          IS_CAUSAL: gl.constexpr, EARLY_STOP: gl.constexpr, CHECK_STAGES: gl.constexpr,
                          RETURN_COUNTS: gl.constexpr, HAS_SINKS: gl.constexpr, NUM_WARPS: gl.constexpr,
                          HALF: gl.constexpr):
        """Rows HALF * 64 .. HALF * 64 + 63 of each tile, over the stages of its walk (see the module's notes)."""
        BLOCK_M: gl.constexpr = o_desc.block_type.shape[2]
        D: gl.constexpr = o_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        HALF_N: gl.constexpr = BLOCK_N // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        gain_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        first_half = offs_n < HALF_N
        offs_r = gl.arange(0, BLOCK_M, layout=rows_s)
        kv_c = 0
        i = 0
        n_checks = 0
        t = _read_tile(tile_ids, q_ready, 0, NUM_WARPS)
        while t < n_tiles:
            row, b, h, hk, m = _tile_of(t, NQ, H, GROUP)
            count, n_forced, forced_stages, n_stages = _walk_extent(N_FORCED, COUNT, row)
            n_unmasked = gl.load(N_UNMASKED + row)
            base = INDEX + row.to(gl.int64) * NK
            first_row = (2 * m + HALF) * BLOCK_M
            q_s = q_bufs.index(i % 2).slice(HALF * BLOCK_M, BLOCK_M)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, rows_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            if EARLY_STOP:
                tau_rows = gl.load(TAU + h) * gl.minimum(q_len - 2 * m * BLOCK_M, 2 * BLOCK_M).to(gl.float32)
            end = n_stages
            p = 0
            while p < end:
                first, second, second_real = _stage_positions(p, n_forced, forced_stages, count)
                qk = _stage_scores(q_s, k_bufs, kv_ready, kv_c, STAGES, BLOCK_M, BLOCK_N, s_layout)
                if ((first + 1 >= n_unmasked) & (first < n_forced)) | (second == first):
                    # a stage holding a forced block that needs element masking, or a repeated block
                    j0 = gl.load(base + first)
                    j1 = gl.load(base + second)
                    cols = gl.where(first_half, j0 * HALF_N, j1 * HALF_N - HALF_N) + offs_n
                    qk = _mask_scores(qk, cols, (cols < kv_len) & (first_half | second_real),
                                      first_row + q_offset + offs_r, IS_CAUSAL)
                probs, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, qk_scale, rows_o)
                if EARLY_STOP:
                    check = _is_check_stage(p, forced_stages, n_stages, CHECK_STAGES)
                    if check:
                        # the chunk's last tile is the stage's second block: its gain at the new max
                        last = gl.sum(gl.where(gl.expand_dims(first_half, 0), 0.0, probs), axis=1)
                        before = l_i - last
                        gain = gl.where(before > 0.0, last / gl.where(before > 0.0, before, 1.0),
                                        gl.where(l_i > 0.0, float("inf"), 0.0))
                        # as s2o.py's walk: a NaN normaliser counts zero
                        gain = gl.where((first_row + offs_r < q_len) & (l_i == l_i), gain, 0.0)
                        gains.index(2 * (n_checks % 2) + HALF).store(
                            gl.full([1], gl.sum(gain, axis=0), gl.float32, gain_layout))
                        _partition_barrier()  # every thread's store lands before the partition's one arrival
                        mbarrier.arrive(gain_ready.index(n_checks % 2))
                acc = _stage_pv(gl.convert_layout(probs.to(o_desc.dtype), p_layout), v_bufs, acc, kv_empty, kv_c,
                                STAGES)
                kv_c += 1
                if EARLY_STOP:
                    if check:
                        # the verdict, read after this stage's P.V (kept either way): the other partition's sum
                        # arrives meanwhile
                        go = _verdict(gains, gain_ready, n_checks, tau_rows, gain_layout)
                        n_checks += 1
                        end = gl.where(go, end, p + 1)
                p += 1
            if end < n_stages:  # stopped: the loader had issued one more stage; release it unread
                s = kv_c % STAGES
                mbarrier.wait(kv_ready.index(s), (kv_c // STAGES) & 1)
                mbarrier.arrive(kv_empty.index(s))
                kv_c += 1
            mbarrier.arrive(q_empty.index(i % 2))
            if RETURN_COUNTS:
                if HALF == 0:
                    visited = gl.where(end == n_stages, count, n_forced + 2 * (end - forced_stages))
                    gl.store(VISITED + row, visited)
            if HAS_SINKS:  # after the stop test, which weighs the keys' normaliser only
                acc, l_i = _add_sink(acc, l_i, m_i, SINKS, h, rows_o)
            _store_output_rows(o_desc, o_smem, acc, l_i, b, h, first_row, rows_o)
            i += 1
            t = _read_tile(tile_ids, q_ready, i, NUM_WARPS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _hopper_ordered_kernel(q_desc, k_desc, v_desc, o_desc, INDEX, N_UNMASKED, N_FORCED, COUNT, TAU, VISITED, TICKET,
                               SINKS, qk_scale, H, GROUP, NQ, NK, q_len, kv_len, q_offset, n_tiles,
                               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                               EARLY_STOP: gl.constexpr, CHECK_STAGES: gl.constexpr, RETURN_COUNTS: gl.constexpr,
                               HAS_SINKS: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        q_bufs, k_bufs, v_bufs, o_bufs, tile_ids, q_ready, q_empty, kv_ready, kv_empty = _allocate_ring(
            q_desc, k_desc, HEAD_DIM, STAGES)
        # the stop test's row sums of gains, [check parity * 2 + consumer], and their barriers (one arrival per
        # consumer partition)
        gains = gl.allocate_shared_memory(gl.float32, [4, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gain_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            mbarrier.init(gain_ready.index(j), count=2)
        gl.warp_specialize([
            (_ordered_consumer, (o_desc, q_bufs, k_bufs, v_bufs, o_bufs.index(0), tile_ids, q_ready, q_empty, kv_ready,
                                 kv_empty, gains, gain_ready, INDEX, N_UNMASKED, N_FORCED, COUNT, TAU, VISITED, SINKS,
                                 qk_scale, H, GROUP, NQ, NK, q_len, kv_len, q_offset, n_tiles, STAGES, IS_CAUSAL,
                                 EARLY_STOP, CHECK_STAGES, RETURN_COUNTS, HAS_SINKS, NUM_WARPS, 0)),
            (_ordered_consumer, (o_desc, q_bufs, k_bufs, v_bufs, o_bufs.index(1), tile_ids, q_ready, q_empty, kv_ready,
                                 kv_empty, gains, gain_ready, INDEX, N_UNMASKED, N_FORCED, COUNT, TAU, VISITED, SINKS,
                                 qk_scale, H, GROUP, NQ, NK, q_len, kv_len, q_offset, n_tiles, STAGES, IS_CAUSAL,
                                 EARLY_STOP, CHECK_STAGES, RETURN_COUNTS, HAS_SINKS, NUM_WARPS, 1)),
            (_ordered_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, tile_ids, q_ready, q_empty, kv_ready,
                               kv_empty, gains, gain_ready, INDEX, N_FORCED, COUNT, TAU, TICKET, H, GROUP, NQ, NK,
                               q_len, n_tiles, STAGES, EARLY_STOP, CHECK_STAGES)),
        ], [NUM_WARPS, 1], [CONSUMER_REGS, 24])


def why_not_usable(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out_h: torch.Tensor, shape: AttentionShape,
                   *, pv_test: bool, early_stop: bool, check_every: int) -> str | None:
    """None if this walk can run the call, else the reason: ``attention_hopper.why_not_usable``'s conditions,
    and with the stop test an even ``check_every`` of at least 4 (see the module's notes)."""
    reason = attention_hopper.why_not_usable(qh, kh, vh, out_h, shape, pv_test)
    if reason is None and early_stop and (check_every < 4 or check_every % 2):
        reason = f"check_every={check_every} (this walk tests between 128-key stages: an even value >= 4)"
    return reason


# Tests and benchmarks set this to force (True) or forbid (False) this walk; None decides by ``why_not_usable``.
OVERRIDE: bool | None = None


def usable(qh, kh, vh, out_h, shape: AttentionShape, *, pv_test: bool, early_stop: bool, check_every: int) -> bool:
    """Whether ``s2o_attention`` hands the walk to this kernel (``OVERRIDE`` True forces it, raising if it cannot
    run; False forbids it)."""
    if OVERRIDE is False:
        return False
    reason = why_not_usable(qh, kh, vh, out_h, shape, pv_test=pv_test, early_stop=early_stop,
                            check_every=check_every)
    if OVERRIDE is True and reason is not None:
        raise RuntimeError(f"the Hopper S2O walk was forced but cannot run: {reason}")
    return reason is None


def hopper_ordered_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out_h: torch.Tensor,
                             shape: AttentionShape, order: tuple[torch.Tensor, ...], *, is_causal: bool, scale: float,
                             tau: torch.Tensor | None, return_counts: bool, check_every: int,
                             sink_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Write ``out_h`` (B, H, N, D views) = S2O's ordered walk over ``order`` (``s2o.VisitOrder``); ``tau`` (per
    head, float32) None visits every block without the test. Returns (visited, P.V products) per (b, h, query
    block) when ``return_counts`` (equal: this walk has no stage-2 test). ``sink_logits``: (H,) learned sink logits
    with unit stride, added to each row's normaliser after the walk."""
    index, n_unmasked, n_forced, count = order
    n_tiles = shape.batch * shape.heads * shape.q_blocks
    ticket = torch.zeros(1, device=qh.device, dtype=torch.int32)
    visited = (torch.empty(shape.batch, shape.heads, shape.q_blocks, device=qh.device, dtype=torch.int32)
               if return_counts else ticket)
    descriptor, sm_count = attention_hopper._descriptor, attention_hopper._sm_count
    launch(_hopper_ordered_kernel, (min(sm_count(qh.device), n_tiles),),
        descriptor(qh, BLOCK_Q), descriptor(kh, BLOCK_K), descriptor(vh, BLOCK_K), descriptor(out_h, BLOCK_Q // 2),
        index, n_unmasked, n_forced, count, tau if tau is not None else ticket, visited, ticket,
        sink_logits if sink_logits is not None else ticket, scale * LOG2E,
        shape.heads, shape.heads // shape.kv_heads, shape.q_blocks, shape.k_blocks, shape.q_len, shape.kv_len,
        shape.causal_offset, n_tiles,
        HEAD_DIM=shape.head_dim, STAGES=attention_hopper.STAGES, IS_CAUSAL=is_causal, EARLY_STOP=tau is not None,
        CHECK_STAGES=max(check_every // 2, 1), RETURN_COUNTS=return_counts, HAS_SINKS=sink_logits is not None,
        NUM_WARPS=attention_hopper.NUM_WARPS,
        CONSUMER_REGS=attention_hopper.CONSUMER_REGS, num_warps=attention_hopper.NUM_WARPS,
        maxnreg=attention_hopper.MAXNREG)
    return (visited, visited) if return_counts else None
