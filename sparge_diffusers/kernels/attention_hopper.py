"""Stage 2's mask walk as a persistent, warp-specialised Gluon kernel for Hopper (sm90).

The same computation as ``attention.py``'s Triton kernel without the stage-2 test (every kept block's P.V
product is computed), arranged the way FlashAttention-3 arranges dense attention:

* one program per SM; tiles (128 query rows of one head) are handed out by an atomic ticket counter, so a
  program that drew short rows of the mask takes more tiles (a static round-robin split measured 5-10%
  slower at density 0.1: with ~7 random-length rows per program the longest program sets the time); with
  a mask the last two waves of tickets take their tiles longest first (``TailSchedule``);
* a one-warp loader partition issues TMA loads: the Q tile of the next tile into one of two Q buffers and
  the kept K/V blocks, two 64-key mask blocks per 128-key stage, into a ring of stages, each guarded by
  ready/empty mbarriers, so the loads of the next tile run during this tile's last products and output;
* two consumer partitions of one warpgroup (4 warps) each take 64 rows of the tile: QK^T and P.V on wgmma,
  the online softmax in registers, the output written through shared memory by an asynchronous TMA
  store. As separate partitions they synchronise only through the stage barriers, so one warpgroup's
  softmax runs while the other's products hold the tensor cores (FA3's "ping-pong", here left to the warp
  scheduler). Against one 8-warp consumer partition, whose two warpgroups ran in lockstep: Mochi dense
  47.3 -> 40.0 ms, Flux 0.534 -> 0.475 ms, CogVideoX 12.7 -> 11.2. Enforcing FA3's turns (two mbarriers,
  with or without FA3's order of P.V(p-1) issued with QK^T(p)) measured slower everywhere: Flux dense
  +5% / +16%, Llama-32K dense +10% / +12% (kernel-variants (x)).

Measured against the Triton kernel on an H100 (benchmarks/results/kernel-variants-H100.txt (m), (n)):
faster dense and at every density at D = 128, faster on masks at D = 64 and in the causal dense mode there;
the non-causal dense mode at D = 64 measured the same on both and stays on the Triton kernel
(``prefer_triton``). Tried and not kept: FA3's intra-warpgroup overlap
(the next stage's QK^T issued before this stage's P.V: slower in dense mode, Flux 0.573 vs 0.527 ms with
one consumer partition) and a one-block K/V stage in the loader for an odd last block (every dense mode 4-7%
slower).

An odd count of kept blocks (mask walks only) ends on a 64-key stage: the loader still loads the last block
twice (one barrier protocol for every stage) but the consumers' product, softmax and P.V take only its first
64 keys. Tiles that keep a single block are the exception: there the 64-key stage, as the tile's only stage
after a pair loop of no trip, gave wrong rows and, at D = 64, illegal addresses in every version written
(kernel-variants-H100.txt (p)-(s); cause not found), so they take the masked pair stage.

Gluon kernels do not run under TRITON_INTERPRET; the tests check this path on a GPU against the float32
reference and the Triton kernel, and on CPU only that it compiles for sm90 (where the installed Triton can
compile offline).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._inputs import BLOCK_K, BLOCK_Q, AttentionShape, device_capability
from .._launch import interpreting, launch, tensor_descriptor

try:  # Gluon is experimental: its module layout and names move between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_IMPORT_ERROR: str | None = None
except Exception as e:  # pragma: no cover - depends on the installed Triton
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
# Columns per TMA copy: with the 128-byte swizzle a (rows, 128) bf16 tile is stored as two 64-column panels,
# so a row range of the tile is contiguous only within one panel.
PANEL = 64

if GLUON_IMPORT_ERROR is None:
    # Triton 3.6 names these async_copy_global_to_shared / async_copy_shared_to_global / _reinterpret;
    # later releases async_load / async_store / reinterpret.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _REINTERPRET_IS_PUBLIC = hasattr(gl.shared_memory_descriptor, "reinterpret")
    # some Gluon releases name it thread_barrier, others barrier
    _partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def _tile_of(t, NQ, H, GROUP):
        """Tile t -> (row of the per-tile arrays, batch, head, K/V head, query block). Heads one after
        another, so a wave of tiles shares one head's K/V in L2; within a head the late query blocks first
        (the long rows under causal masking)."""
        bh = t // NQ
        m = NQ - 1 - t % NQ
        h = bh % H
        return bh * NQ + m, bh // H, h, h // GROUP, m

    @gluon.jit
    def _add_i32(a, b):
        return a + b

    @gluon.jit
    def _ticket_tile(TAIL_SIZES, TAIL_TILES, ticket, tail_start, n_tiles, USE_TAIL: gl.constexpr,
                     BUCKETS: gl.constexpr):
        """Ticket -> tile. With ``USE_TAIL`` the tickets from tail_start on take the tiles of a ``TailSchedule``
        (its buckets of tiles, most kept blocks first): j-th tail ticket -> the bucket where the running total
        of bucket sizes first exceeds j, at position j - (sizes of the buckets before it). The schedule then ends
        on its shortest tiles (longest-processing-time first over the last waves), so the programs finish
        closer together. The loader calls it a tile ahead of use, between a tile's first and second stage.

        Only tail tickets do the lookup (two dependent loads). Against doing it for every ticket and discarding
        the result before the tail (kernel-variants-H100.txt (w), three A/B runs): the Flux shape 0-2% faster
        in 12 of 14 cells (the others -4.8% and +0.1%), Llama-32K within -1.1..+1.3%; outputs bitwise equal."""
        tile = ticket
        if USE_TAIL:
            if (ticket >= tail_start) & (ticket < n_tiles):
                j = ticket - tail_start
                layout: gl.constexpr = gl.BlockedLayout([BUCKETS // 32], [32], [1], [0])
                ends = gl.associative_scan(gl.load(TAIL_SIZES + gl.arange(0, BUCKETS, layout=layout)), 0, _add_i32)
                before = ends <= j
                bucket = gl.minimum(gl.sum(before.to(gl.int32), axis=0), BUCKETS - 1)
                start = gl.max(gl.where(before, ends, 0), axis=0)
                tile = gl.load(TAIL_TILES + bucket * (n_tiles - tail_start) + (j - start))
        return tile

    @gluon.jit
    def _row_extent(COUNT, NFULL, row, m, kv_len, NK, q_offset, last_position, USE_INDEX: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
        """(kept key blocks, of which the first n_full need no element masking) of one tile. Without an index,
        the dense walk's extent by the Triton kernel's rule (``attention._dense_row_extent``, restated here: a
        gluon.jit function cannot call a triton.jit one; change both together)."""
        if USE_INDEX:
            count = gl.load(COUNT + row)
            n_full = gl.load(NFULL + row)
        else:
            count = NK
            n_full = kv_len // BLOCK_K
            if IS_CAUSAL:
                first_position = m * BLOCK_M + q_offset
                last = gl.maximum(gl.minimum(first_position + BLOCK_M - 1, last_position), -1)
                count = (last + BLOCK_K) // BLOCK_K
                n_full = gl.minimum(n_full, gl.maximum(first_position + 1, 0) // BLOCK_K)
        return count, n_full

    @gluon.jit
    def _softmax_step(qk, m_i, l_i, acc, qk_scale, rows_o: gl.constexpr):
        """One online-softmax step over a stage's unscaled scores ``qk`` (m_i, l_i in the layout of its rows):
        returns the probabilities, the new row max and sum, and the accumulator rescaled to the new max."""
        # the scale (with log2 e) enters the row max and the exponent's FMA
        m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows without a finite score yet (attention.py)
        alpha = gl.exp2(m_i - m_use)
        probs = gl.exp2(qk * qk_scale - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(probs, axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
        return probs, m_new, l_i, acc

    @gluon.jit
    def _mask_scores(qk, cols, cols_kept, q_rows, IS_CAUSAL: gl.constexpr, window=0, WINDOWED: gl.constexpr = False):
        """Scores with -inf where a key column is not kept (``cols_kept`` False: past the keys, or the masked
        copy of an odd last block) or, under causal masking, lies after the query row (or, with WINDOWED,
        ``window`` or more positions before it). cols: the stage's key positions, q_rows: the consumer's query
        positions (in the layouts of qk's columns and rows)."""
        visible = gl.expand_dims(cols_kept, 0)
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(q_rows, 1))
            if WINDOWED:
                visible = visible & (gl.expand_dims(cols, 0) > gl.expand_dims(q_rows, 1) - window)
        return gl.where(visible, qk, float("-inf"))

    @gluon.jit
    def _stage_blocks(INDEX, row, NK, p, count, USE_INDEX: gl.constexpr):
        """Key blocks of stage p: kept blocks 2p and 2p+1, the last one twice when the count is odd (its
        second copy is masked off; loading it keeps stale or uninitialised shared memory out of P.V)."""
        first = gl.minimum(2 * p, NK - 1)
        second = gl.maximum(gl.minimum(2 * p + 1, count - 1), 0)
        if USE_INDEX:
            base = INDEX + row.to(gl.int64) * NK
            j0 = gl.load(base + first)
            j1 = gl.load(base + gl.minimum(second, NK - 1))
        else:
            j0 = first
            j1 = second
        return j0, j1

    if _REINTERPRET_IS_PUBLIC:
        @gluon.jit
        def _as_boxes(buf, desc, BOXES: gl.constexpr):
            return buf.reinterpret(desc.dtype, [BOXES] + desc.block_type.shape, desc.layout)
    else:
        @gluon.jit
        def _as_boxes(buf, desc, BOXES: gl.constexpr):
            return buf._reinterpret(desc.dtype, [BOXES] + desc.block_type.shape, desc.layout)

    @gluon.jit
    def _box(buf, desc, row0: gl.constexpr, c: gl.constexpr):
        """Rows row0.. of column panel c of ``buf`` (rows, D), as ``desc``'s [1, 1, ROWS, COLS] box. The 128-byte
        swizzle stores the tile as its D / COLS panels one after another, each a run of swizzled ROWS-row boxes
        (ROWS a multiple of the swizzle's 8 rows), so the whole buffer is read as a row of such boxes and indexed.
        Reinterpreting the sliced buffer instead, as before, Triton 3.8 refuses (no reinterpreted subviews)."""
        ROWS: gl.constexpr = desc.block_type.shape[2]
        COLS: gl.constexpr = desc.block_type.shape[3]
        GROUPS: gl.constexpr = buf.type.shape[0] // ROWS
        PANELS: gl.constexpr = buf.type.shape[1] // COLS
        gl.static_assert(row0 % ROWS == 0 and buf.type.shape[0] % ROWS == 0 and buf.type.shape[1] % COLS == 0)
        return _as_boxes(buf, desc, PANELS * GROUPS).index(c * GROUPS + row0 // ROWS)

    @gluon.jit
    def _load_rows(desc, b, h, first_row, bar, buf, row0: gl.constexpr):
        """TMA-load rows first_row.. of head (b, h) into rows row0.. of ``buf`` (rows, D), one panel per copy."""
        COLS: gl.constexpr = desc.block_type.shape[3]
        D: gl.constexpr = buf.type.shape[1]
        for c in gl.static_range(D // COLS):
            _tma_load(desc, [b, h, first_row, c * COLS], bar, _box(buf, desc, row0, c))

    @gluon.jit
    def _publish_tile(tile_ids, qb, t):
        """Write tile number t into slot qb; the consumer reads it once the slot's q_ready phase completes
        (the loader's arrive on q_ready releases this store)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        tile_ids.index(qb).store(gl.full([1], t, gl.int32, layout))
        # Every lane stores; one lane's arrive releases only its own stores, so the warp's stores are ordered
        # before it here. Triton 3.9 inserts this barrier itself; 3.6 leaves it out before mbarrier.expect.
        _partition_barrier()

    @gluon.jit
    def _read_tile(tile_ids, q_ready, i, NUM_WARPS: gl.constexpr):
        qb = i % 2
        mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        return gl.max(tile_ids.index(qb).load(layout), axis=0)

    @gluon.jit
    def _next_tile_meta(INDEX, COUNT, NFULL, t, NQ, H, GROUP, NK, kv_len, q_offset, last_position, n_tiles,
                        USE_INDEX: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_K: gl.constexpr):
        """(count, first two kept block numbers) of tile t, for the loader to hold a tile ahead. t is clamped
        into range: for the out-of-range tile that ends the schedule the loads read valid memory, unused."""
        row, b, h, hk, m = _tile_of(gl.minimum(t, n_tiles - 1), NQ, H, GROUP)
        count, n_full = _row_extent(COUNT, NFULL, row, m, kv_len, NK, q_offset, last_position, USE_INDEX,
                                    IS_CAUSAL, BLOCK_M, BLOCK_K)
        if USE_INDEX:
            base = INDEX + row.to(gl.int64) * NK
            first = gl.load(base)
            second = gl.load(base + gl.minimum(1, NK - 1))
        else:
            first = 0
            second = 1
        return count, first, second

    @gluon.jit
    def _issue_stage(k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, kv_c, b, hk, j0, j1, STAGES: gl.constexpr):
        """TMA-load key blocks j0 and j1 of K and V into stage kv_c of the ring once the consumers free it."""
        BLOCK_K: gl.constexpr = k_desc.block_type.shape[2]
        KV_BYTES: gl.constexpr = 2 * k_bufs.type.shape[1] * k_bufs.type.shape[2] * k_desc.dtype.primitive_bitwidth // 8
        s = kv_c % STAGES
        mbarrier.wait(kv_empty.index(s), ((kv_c // STAGES) & 1) ^ 1)
        bar = kv_ready.index(s)
        mbarrier.expect(bar, KV_BYTES)
        _load_rows(k_desc, b, hk, j0 * BLOCK_K, bar, k_bufs.index(s), 0)
        _load_rows(k_desc, b, hk, j1 * BLOCK_K, bar, k_bufs.index(s), BLOCK_K)
        _load_rows(v_desc, b, hk, j0 * BLOCK_K, bar, v_bufs.index(s), 0)
        _load_rows(v_desc, b, hk, j1 * BLOCK_K, bar, v_bufs.index(s), BLOCK_K)

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, tile_ids, q_ready, q_empty, kv_ready, kv_empty,
                INDEX, COUNT, NFULL, TICKET, TAIL_SIZES, TAIL_TILES, tail_start, H, GROUP, NQ, NK, kv_len, q_offset,
                last_position, n_tiles, STAGES: gl.constexpr, USE_INDEX: gl.constexpr, IS_CAUSAL: gl.constexpr,
                USE_TAIL: gl.constexpr, BUCKETS: gl.constexpr):
        """Issues each tile's Q and K/V stages. A tile's count and first two block numbers are loaded during
        the tile before it, so at a tile's start its Q and first stage go out with no global round trip ahead
        of them (a ticket, the tail order, the count and the index were up to four dependent loads). Measured
        on an H100 (kernel-variants (u)): the consumers' first-stage wait per program 2.83 -> 2.25 us at Flux
        density 0.1, the kernel 2-2.6% faster at Flux densities 0.5-0.1, Llama-32K within +-1%."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_K: gl.constexpr = k_desc.block_type.shape[2]
        Q_BYTES: gl.constexpr = q_bufs.type.shape[1] * q_bufs.type.shape[2] * q_desc.dtype.primitive_bitwidth // 8
        n_prog = gl.num_programs(0)
        kv_c = 0
        i = 0
        t = _ticket_tile(TAIL_SIZES, TAIL_TILES, gl.program_id(0), tail_start, n_tiles, USE_TAIL, BUCKETS)
        count, first, second = _next_tile_meta(INDEX, COUNT, NFULL, t, NQ, H, GROUP, NK, kv_len, q_offset,
                                               last_position, n_tiles, USE_INDEX, IS_CAUSAL, BLOCK_M, BLOCK_K)
        while t < n_tiles:
            row, b, h, hk, m = _tile_of(t, NQ, H, GROUP)
            qb = i % 2
            mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
            _publish_tile(tile_ids, qb, t)
            mbarrier.expect(q_ready.index(qb), Q_BYTES)
            _load_rows(q_desc, b, h, m * BLOCK_M, q_ready.index(qb), q_bufs.index(qb), 0)
            t_next = n_prog + gl.atomic_add(TICKET, 1)  # its round trip overlaps stage 0's wait below
            n_stages = (count + 1) // 2
            j0, j1 = _stage_blocks(INDEX, row, NK, 1, count, USE_INDEX)  # stage 1's, read before stage 0's wait
            if n_stages > 0:
                # stage 0: block `first`, then `second` or, for a count of 1, `first` again (as _stage_blocks)
                _issue_stage(k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, kv_c, b, hk, first,
                             gl.where(count >= 2, second, first), STAGES)
                kv_c += 1
            t = _ticket_tile(TAIL_SIZES, TAIL_TILES, t_next, tail_start, n_tiles, USE_TAIL, BUCKETS)
            count_next, first, second = _next_tile_meta(INDEX, COUNT, NFULL, t, NQ, H, GROUP, NK, kv_len, q_offset,
                                                        last_position, n_tiles, USE_INDEX, IS_CAUSAL, BLOCK_M, BLOCK_K)
            for p in range(1, n_stages):
                n0, n1 = _stage_blocks(INDEX, row, NK, p + 1, count, USE_INDEX)  # read before the wait below
                _issue_stage(k_desc, v_desc, k_bufs, v_bufs, kv_ready, kv_empty, kv_c, b, hk, j0, j1, STAGES)
                kv_c += 1
                j0 = n0
                j1 = n1
            count = count_next
            i += 1
        # no tile left: hand the consumer an out-of-range tile number through the next Q slot
        qb = i % 2
        mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
        _publish_tile(tile_ids, qb, t)
        mbarrier.arrive(q_ready.index(qb))

    @gluon.jit
    def _stage_scores(q_s, k_bufs, kv_ready, kv_c, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      s_layout: gl.constexpr):
        """A consumer's unscaled scores Q K^T over ring stage kv_c (BLOCK_N keys), once its loads have landed."""
        s = kv_c % STAGES
        mbarrier.wait(kv_ready.index(s), (kv_c // STAGES) & 1)
        qk = warpgroup_mma(q_s, k_bufs.index(s).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))

    @gluon.jit
    def _stage_pv(p_operand, v_bufs, acc, kv_empty, kv_c, STAGES: gl.constexpr):
        """acc + P V over ring stage kv_c (``p_operand``: the probabilities as the product's A operand), then this
        consumer's release of the stage."""
        s = kv_c % STAGES
        acc = warpgroup_mma(p_operand, v_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(s))
        return acc

    @gluon.jit
    def _soft_cap(scores, cap_in, cap_out):
        """attention._soft_cap's FAST form (this kernel runs only compiled, on sm90): cap_out * tanh(scores * cap_in)
        by tanh.approx.f32."""
        return cap_out * gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [scores * cap_in],
                                                   dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _add_sink(acc, l_i, m_i, SINKS, h, rows_o: gl.constexpr):
        """attention._add_sink in this kernel's layouts: head h's learned sink logit (natural units) joins the
        normaliser, acc and l_i rescaled to the larger of the row max and the sink."""
        sink = gl.load(SINKS + h).to(gl.float32) * 1.4426950408889634
        top = gl.maximum(m_i, sink)
        top = gl.where(top == float("-inf"), 0.0, top)  # no key and a -inf sink: nothing to rescale
        alpha = gl.exp2(m_i - top)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
        return acc, l_i * alpha + gl.exp2(sink - top)

    @gluon.jit
    def _store_output_rows(o_desc, o_smem, acc, l_i, b, h, first_row, rows_o: gl.constexpr):
        """Normalise a consumer's rows and write them at rows first_row.. of head (b, h) through ``o_smem`` by an
        asynchronous TMA store (waiting first for the previous tile's store to leave ``o_smem``)."""
        O_COLS: gl.constexpr = o_desc.block_type.shape[3]
        D: gl.constexpr = o_smem.type.shape[1]
        l_o = gl.convert_layout(l_i, rows_o)
        # a query row without a finite score (l == 0) gets a zero output; a NaN normaliser (NaN or inf in q or k)
        # stays NaN, as in SDPA. One reciprocal per row, not one division per element: 3-5% faster at
        # every density on an H100 (kernel-variants (t)), outputs bitwise equal on the GPU check cases
        inv_l = gl.where(l_o == 0.0, 0.0, 1.0 / l_o)
        out = acc * gl.expand_dims(inv_l, 1)
        tma.store_wait(pendings=0)
        o_smem.store(out.to(o_desc.dtype))
        fence_async_shared()
        for c in gl.static_range(D // O_COLS):
            _tma_store(o_desc, [b, h, first_row, c * O_COLS], _box(o_smem, o_desc, 0, c))

    @gluon.jit
    def _consumer(o_desc, q_bufs, k_bufs, v_bufs, o_smem, tile_ids, q_ready, q_empty, kv_ready, kv_empty,
                  INDEX, COUNT, NFULL, KPOS, stride_pb, stride_ph, SINKS, qk_scale, cap_in, cap_out, H, GROUP, NQ,
                  NK, kv_len, q_offset, last_position, window, n_tiles, STAGES: gl.constexpr, USE_INDEX: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, PERMUTED_KEYS: gl.constexpr, WINDOWED: gl.constexpr,
                  HAS_SINKS: gl.constexpr, SOFTCAP: gl.constexpr, NUM_WARPS: gl.constexpr, HALF: gl.constexpr):
        """Rows HALF * 64 .. HALF * 64 + 63 of each tile: both consumers wait on the same stage barriers and
        each releases every stage and Q buffer once (the empty barriers count two arrivals). With PERMUTED_KEYS
        (keys permuted within segments, always with an index), the causal test of a masked stage compares the
        keys' original positions (KPOS) with the rows, as the Triton kernel's ``_attend_tile`` does."""
        BLOCK_M: gl.constexpr = o_desc.block_type.shape[2]  # this consumer's rows: half ``HALF`` of the tile
        D: gl.constexpr = o_smem.type.shape[1]
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = BLOCK_N // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        h_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_K, 16])  # a 64-key stage
        rows_h: gl.constexpr = gl.SliceLayout(1, h_layout)
        offs_h = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, h_layout))
        offs_rh = gl.arange(0, BLOCK_M, layout=rows_h)

        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        first_half = offs_n < BLOCK_K
        offs_r = gl.arange(0, BLOCK_M, layout=rows_s)
        kv_c = 0
        i = 0
        t = _read_tile(tile_ids, q_ready, 0, NUM_WARPS)
        while t < n_tiles:
            row, b, h, hk, m = _tile_of(t, NQ, H, GROUP)
            count, n_full = _row_extent(COUNT, NFULL, row, m, kv_len, NK, q_offset, last_position, USE_INDEX,
                                        IS_CAUSAL, 2 * BLOCK_M, BLOCK_K)
            q_s = q_bufs.index(i % 2).slice(HALF * BLOCK_M, BLOCK_M)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, rows_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
            if USE_INDEX:  # an odd count >= 3 leaves its last block to the 64-key stage below
                half_stage = (count % 2 == 1) & (count >= 3)
                n_pairs = (count + 1) // 2 - half_stage.to(gl.int32)
            else:
                n_pairs = (count + 1) // 2
            for p in range(n_pairs):
                qk = _stage_scores(q_s, k_bufs, kv_ready, kv_c, STAGES, BLOCK_M, BLOCK_N, s_layout)
                if SOFTCAP:  # before any masking (qk_scale is then log2 e alone)
                    qk = _soft_cap(qk, cap_in, cap_out)
                if 2 * p + 2 > n_full:
                    # a stage holding the ragged last block, a causal diagonal block or a repeated odd block
                    j0, j1 = _stage_blocks(INDEX, row, NK, p, count, USE_INDEX)
                    cols = gl.where(first_half, j0 * BLOCK_K, j1 * BLOCK_K - BLOCK_K) + offs_n
                    key_pos = cols
                    if PERMUTED_KEYS:
                        key_pos = gl.load(KPOS + b * stride_pb + hk * stride_ph + cols, mask=cols < kv_len, other=0)
                    qk = _mask_scores(qk, key_pos, (cols < kv_len) & (first_half | (2 * p + 1 < count)),
                                      (2 * m + HALF) * BLOCK_M + q_offset + offs_r, IS_CAUSAL, window, WINDOWED)
                probs, m_i, l_i, acc = _softmax_step(qk, m_i, l_i, acc, qk_scale, rows_o)
                acc = _stage_pv(gl.convert_layout(probs.to(o_desc.dtype), p_layout), v_bufs, acc, kv_empty, kv_c,
                                STAGES)
                kv_c += 1
            if USE_INDEX:
                if half_stage:
                    # Half of a masked pair stage's work for the odd last block: measured on an H100 (kernel-
                    # variants (t)) 4% faster at Flux density 0.1 and 2% at Llama-32K causal 0.1, outputs bitwise
                    # equal to the masked pair stage's on the GPU check cases.
                    s = kv_c % STAGES
                    j0, j1 = _stage_blocks(INDEX, row, NK, count // 2, count, USE_INDEX)
                    mbarrier.wait(kv_ready.index(s), (kv_c // STAGES) & 1)
                    qk = warpgroup_mma(q_s, k_bufs.index(s).slice(0, BLOCK_K).permute((1, 0)),
                                       gl.zeros([BLOCK_M, BLOCK_K], gl.float32, h_layout), use_acc=False,
                                       is_async=True)
                    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
                    if SOFTCAP:
                        qk = _soft_cap(qk, cap_in, cap_out)
                    cols = j0 * BLOCK_K + offs_h
                    key_pos = cols
                    if PERMUTED_KEYS:
                        key_pos = gl.load(KPOS + b * stride_pb + hk * stride_ph + cols, mask=cols < kv_len, other=0)
                    qk = _mask_scores(qk, key_pos, cols < kv_len, (2 * m + HALF) * BLOCK_M + q_offset + offs_rh,
                                      IS_CAUSAL, window, WINDOWED)
                    probs, m_h, l_h, acc = _softmax_step(qk, gl.convert_layout(m_i, rows_h),
                                                         gl.convert_layout(l_i, rows_h), acc, qk_scale, rows_o)
                    m_i = gl.convert_layout(m_h, rows_s)
                    l_i = gl.convert_layout(l_h, rows_s)
                    acc = warpgroup_mma(gl.convert_layout(probs.to(o_desc.dtype), p_layout),
                                        v_bufs.index(s).slice(0, BLOCK_K), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    mbarrier.arrive(kv_empty.index(s))
                    kv_c += 1
            mbarrier.arrive(q_empty.index(i % 2))
            if HAS_SINKS:
                acc, l_i = _add_sink(acc, l_i, m_i, SINKS, h, rows_o)
            _store_output_rows(o_desc, o_smem, acc, l_i, b, h, (2 * m + HALF) * BLOCK_M, rows_o)
            i += 1
            t = _read_tile(tile_ids, q_ready, i, NUM_WARPS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _allocate_ring(q_desc, k_desc, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
        """Shared memory and barriers of the warp-specialised walk (this kernel's and ``s2o_hopper``'s): two Q
        buffers, a ring of STAGES 128-key K/V stages, each consumer's output buffer, the tile number handed to
        the consumers per Q buffer, and the ready/empty barriers of Q and of the stages."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_K: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], tile_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_K, HEAD_DIM], tile_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_K, HEAD_DIM], tile_layout)
        o_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, HEAD_DIM], tile_layout)
        tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):  # ready: the loader's expect + TMA bytes; empty: one arrive per consumer
            mbarrier.init(q_ready.index(j), count=1)
            mbarrier.init(q_empty.index(j), count=2)
        for j in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(j), count=1)
            mbarrier.init(kv_empty.index(j), count=2)
        return q_bufs, k_bufs, v_bufs, o_bufs, tile_ids, q_ready, q_empty, kv_ready, kv_empty

    @gluon.jit
    def _hopper_attention_kernel(q_desc, k_desc, v_desc, o_desc, INDEX, COUNT, NFULL, TICKET, TAIL_SIZES, TAIL_TILES,
                                 KPOS, stride_pb, stride_ph, SINKS, tail_start, qk_scale, cap_in, cap_out, H, GROUP,
                                 NQ, NK, kv_len, q_offset, last_position, window, n_tiles, HEAD_DIM: gl.constexpr,
                                 STAGES: gl.constexpr, USE_INDEX: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                 PERMUTED_KEYS: gl.constexpr, WINDOWED: gl.constexpr, HAS_SINKS: gl.constexpr,
                                 SOFTCAP: gl.constexpr, USE_TAIL: gl.constexpr,
                                 BUCKETS: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        q_bufs, k_bufs, v_bufs, o_bufs, tile_ids, q_ready, q_empty, kv_ready, kv_empty = _allocate_ring(
            q_desc, k_desc, HEAD_DIM, STAGES)
        gl.warp_specialize([
            (_consumer, (o_desc, q_bufs, k_bufs, v_bufs, o_bufs.index(0), tile_ids, q_ready, q_empty, kv_ready,
                         kv_empty, INDEX, COUNT, NFULL, KPOS, stride_pb, stride_ph, SINKS, qk_scale, cap_in, cap_out,
                         H, GROUP, NQ, NK, kv_len, q_offset, last_position, window, n_tiles, STAGES, USE_INDEX,
                         IS_CAUSAL, PERMUTED_KEYS, WINDOWED, HAS_SINKS, SOFTCAP, NUM_WARPS, 0)),
            (_consumer, (o_desc, q_bufs, k_bufs, v_bufs, o_bufs.index(1), tile_ids, q_ready, q_empty, kv_ready,
                         kv_empty, INDEX, COUNT, NFULL, KPOS, stride_pb, stride_ph, SINKS, qk_scale, cap_in, cap_out,
                         H, GROUP, NQ, NK, kv_len, q_offset, last_position, window, n_tiles, STAGES, USE_INDEX,
                         IS_CAUSAL, PERMUTED_KEYS, WINDOWED, HAS_SINKS, SOFTCAP, NUM_WARPS, 1)),
            (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, tile_ids, q_ready, q_empty, kv_ready,
                       kv_empty, INDEX, COUNT, NFULL, TICKET, TAIL_SIZES, TAIL_TILES, tail_start, H, GROUP, NQ, NK,
                       kv_len, q_offset, last_position, n_tiles, STAGES, USE_INDEX, IS_CAUSAL, USE_TAIL, BUCKETS)),
        ], [NUM_WARPS, 1], [CONSUMER_REGS, 24])

    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

# Launch settings, measured on an H100: two 4-warp consumer partitions + 1 loader warp (padded to a 4-warp
# group); 168 registers per thread overall leave each consumer 240 after the loader takes 24; two K/V stages
# (at D = 128: Q 2 x 32 KB, K/V 2 x 64 KB, output 2 x 16 KB = 224 KB of shared memory; 4 stages at D = 64
# measured the same as 2).
NUM_WARPS = 4
CONSUMER_REGS = 240
MAXNREG = 168
STAGES = 2

# Tests and benchmarks set this to force (True) or forbid (False) this path; None decides by ``usable``.
OVERRIDE: bool | None = None


def softcap_args(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """(qk_scale, cap_in, cap_out) for the kernels (here, not in attention.py, which imports this module: the Triton
    launchers and stage 1 share it): without soft-capping the scale and log2(e) in qk_scale; with it
    the scale inside cap_in (the scores c * tanh(s * scale / c)) and log2(e) alone in qk_scale."""
    if softcap is None:
        return scale * LOG2E, 1.0, 1.0
    return LOG2E, scale / softcap, softcap


def why_not_usable(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out_h: torch.Tensor,
                   shape: AttentionShape, pv_test: bool) -> str | None:
    """None if this kernel can run the call, else the reason it cannot.

    Needs: Gluon importable, an sm90 GPU (wgmma and this use of TMA are Hopper's), head dim 64 or 128, no
    stage-2 test, bf16/fp16, and TMA-compatible (B, H, N, D) views: unit stride along D, 16-byte aligned
    base and other strides (true of contiguous tensors in either layout).
    """
    reason = _why_not_on(qh.device)
    if reason is not None:
        return reason
    if pv_test:
        return "the stage-2 test runs in the Triton kernel"
    if shape.head_dim not in HEAD_DIMS:
        return f"head dim {shape.head_dim} (this kernel: {HEAD_DIMS})"
    if qh.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {qh.dtype}"
    size = qh.element_size()
    for t in (qh, kh, vh, out_h):
        if t.data_ptr() % 16 or not _tma_strides(t.stride(), size):
            return "a view that TMA cannot address (unit D stride and 16-byte alignment needed)"
    return None


@functools.lru_cache(maxsize=256)
def _tma_strides(strides: tuple[int, ...], element_size: int) -> bool:
    """Unit stride along D and 16-byte multiples elsewhere (cached: checked for four tensors per call)."""
    return strides[-1] == 1 and all(st * element_size % 16 == 0 for st in strides[:-1])


def _why_not_on(device: torch.device) -> str | None:
    """The device-level part of ``why_not_usable``: None where this kernel can run at all."""
    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon unavailable ({GLUON_IMPORT_ERROR})"
    if interpreting():
        return "TRITON_INTERPRET is set (Gluon kernels do not run in the interpreter)"
    if device.type != "cuda" or device_capability(device.index) != (9, 0):
        return "needs an sm90 (Hopper) GPU"
    return None


def runs_on(device: torch.device) -> bool:
    """Whether this kernel can run on ``device`` at all: Gluon importable, an sm90 GPU, no interpreter."""
    return _why_not_on(device) is None


def wants_tail_schedule(shape: AttentionShape, device: torch.device) -> bool:
    """Whether a mask compacted for ``shape`` on ``device`` should carry a :class:`TailSchedule`: only where this
    kernel can run it (``runs_on`` and a head dim it takes); elsewhere filling one would be a memset and one
    atomic per tail row that no kernel reads."""
    return shape.head_dim in HEAD_DIMS and runs_on(device)


def prefer_triton(shape: AttentionShape, dense: bool, is_causal: bool = False) -> bool:
    """Where both kernels can run and the Triton kernel is not slower: the non-causal dense mode at D = 64.

    H100 (kernel-variants (mm)), dense mode at D = 64, Triton / this kernel, ms: CogVideoX 10.69 / 10.70, SD3
    0.484 / 0.469; causal: gpt-oss-20b heads at 32K 23.84 / 19.56, at 8K 1.661 / 1.343, 32 / 8 heads at 16K 3.16 /
    2.64 (this kernel 16-20% faster causal; before session 52 every dense call at D = 64 ran the Triton kernel, from
    a CogVideoX measurement of an earlier version of this kernel, 10.8 vs 11.2 ms). On masks this kernel is faster
    (1.28 vs 1.37 ms at density 0.1)."""
    return dense and shape.head_dim == 64 and not is_causal


def usable(qh, kh, vh, out_h, shape: AttentionShape, pv_test: bool, dense: bool = False, is_causal: bool = False
           ) -> bool:
    """Whether ``sparse_attention_triton`` hands the call to this kernel: it can run it (``why_not_usable``)
    and the Triton kernel is not the faster one there (``prefer_triton``). ``OVERRIDE`` True forces it
    (raising if it cannot run), False forbids it."""
    if OVERRIDE is False:
        return False
    reason = why_not_usable(qh, kh, vh, out_h, shape, pv_test)
    if OVERRIDE is True:
        if reason is not None:
            raise RuntimeError(f"the Hopper kernel was forced but cannot run: {reason}")
        return True
    return reason is None and not prefer_triton(shape, dense, is_causal)


@functools.lru_cache(maxsize=16)
def _shared_layout(rows: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a [1, 1, rows, PANEL] box, built once (Gluon's layout objects cost
    ~10 us of host time each to build, four per call)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, PANEL], _GL_DTYPES[dtype])


def _descriptor(t: torch.Tensor, rows: int):
    """A [1, 1, rows, PANEL]-box descriptor of ``t`` (from cached fields: ``_launch.tensor_descriptor``; the
    alignment it leaves to its callers is ``why_not_usable``'s check, which every launch passes first)."""
    box = (1, 1, rows, PANEL)
    return tensor_descriptor(TensorDescriptor, t, box, lambda: TensorDescriptor(
        t, list(t.shape), list(t.stride()), list(box), _shared_layout(rows, t.dtype)))


@functools.lru_cache(maxsize=8)
def _sm_count_of_index(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (``cuda`` without an index: the current one)."""
    return _sm_count_of_index(device.index if device.index is not None else torch.cuda.current_device())


TAIL_BUCKETS = 64  # count buckets of the tail order; at Flux's 72 key blocks a row, about one count each


@dataclass(frozen=True, eq=False)
class TailSchedule:
    """The end of this kernel's ticket order for one mask: the tiles of the last ``width`` tickets in
    ``TAIL_BUCKETS`` buckets by kept blocks, most first, filled by the kernel that compacts the mask as it counts
    each row (``attention.block_mask_to_index``, stage 1's mask kernel): no sort and no extra launch, so a
    mask built per call gets it too.

    Why: the atomic tickets hand tiles out head by head; with random row lengths the programs then finish up
    to a tile's time apart. Ending the schedule on its shortest tiles (longest-processing-time first over the
    last waves) evens that out. Measured on an H100 (kernel-variants-H100.txt): at the Flux shape the exact order
    (a sort, prebuilt masks only) 3-5% faster at densities 0.5 and 0.25, 4-9% at 0.1 ((q)); these buckets on a
    mask compacted per call 0.7-1.5% faster at 0.5, 1.7-2.8% at 0.25 and 0.1 ((v)). Against the sorted order on
    prebuilt masks they are 0-0.3% slower at 0.1 but 1.5% (Flux) and 2.9% (Mochi) slower at 0.5 ((v)).

    Attributes:
        sizes: (TAIL_BUCKETS,) int32 tiles per bucket, zero until the compaction kernel runs.
        tiles: (TAIL_BUCKETS, width) int32; bucket b holds its tiles in its first sizes[b] slots, as tickets
            (``_tile_of``'s numbering), in no set order within a bucket (atomics; each tile's output is the
            same whichever program computes it).
        start: the first ticket of the tail, n_tiles - width.
    """

    sizes: torch.Tensor
    tiles: torch.Tensor
    start: int

    @property
    def width(self) -> int:
        return self.tiles.shape[1]


def new_tail_schedule(shape: AttentionShape, device: torch.device, width: int | None = None,
                      with_counter: bool = False) -> tuple[TailSchedule, torch.Tensor | None]:
    """An empty :class:`TailSchedule` for a compaction kernel to fill. ``width`` defaults to two waves (twice
    the SM count). With ``with_counter`` the same zeroed allocation also holds a ticket counter for one call
    of :func:`hopper_block_sparse_attention` (one memset per call instead of two)."""
    n_tiles = shape.batch * shape.heads * shape.q_blocks
    if width is None:
        width = 2 * (_sm_count(device) if device.type == "cuda" else 132)
    width = max(1, min(width, n_tiles))
    zeroed = torch.zeros(1 + TAIL_BUCKETS, device=device, dtype=torch.int32)
    tiles = torch.empty(TAIL_BUCKETS, width, device=device, dtype=torch.int32)
    return TailSchedule(zeroed[1:], tiles, n_tiles - width), (zeroed[:1] if with_counter else None)


def tail_tickets(schedule: TailSchedule) -> list[int]:
    """The tiles the tail's tickets take, in ticket order: the kernel's ``_ticket_tile`` restated on the host
    (for tests)."""
    sizes = schedule.sizes.cpu().tolist()
    tiles = schedule.tiles.cpu()
    return [t for bucket, size in enumerate(sizes) for t in tiles[bucket, :size].tolist()]


def hopper_block_sparse_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out_h: torch.Tensor,
                                  shape: AttentionShape, *, is_causal: bool, scale: float,
                                  index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                                  tail: TailSchedule | None = None, ticket: torch.Tensor | None = None,
                                  key_positions: torch.Tensor | None = None,
                                  sink_logits: torch.Tensor | None = None, softcap: float | None = None) -> None:
    """Write ``out_h`` (B, H, N, D views) = attention over the kept blocks of ``index`` (index, count, n_full
    from ``block_mask_to_index``), or over every visible block when ``index`` is None (the dense mode).
    ``tail`` (filled with the same index) reorders the last tickets; the result is the same. ``ticket``: a
    zeroed int32 counter for this call (``new_tail_schedule(with_counter=True)``); by default one is made.
    ``key_positions``: (B, H_kv, N) int32 with unit last stride, the original positions of keys permuted within
    segments (causal calls with an index compacted for that segment; see ``attention.sparse_attention_triton``).
    ``sink_logits``: (H,) learned sink logits with unit stride, added to each row's normaliser. ``softcap``: logit
    soft-capping c (scores c * tanh(s / c)), or None."""
    if key_positions is not None and (index is None or not is_causal):
        raise ValueError("key_positions needs a causal call with an index compacted for its key segment")
    if shape.sliding_window is not None and (index is None or not is_causal):
        raise ValueError("a sliding window needs a causal call with an index compacted for it")
    n_tiles = shape.batch * shape.heads * shape.q_blocks
    if tail is not None and tail.start + tail.width != n_tiles:
        raise ValueError(f"the tail schedule covers tickets {tail.start}..{tail.start + tail.width - 1}, this call "
                         f"has {n_tiles} tiles: it was built for another shape")
    # A fresh zeroed counter per call (one small memset) rather than a cached one the kernel resets: safe under
    # CUDA-graph replay and for calls on concurrent streams.
    if ticket is None:
        ticket = torch.zeros(1, device=qh.device, dtype=torch.int32)
    idx, count, n_full = index if index is not None else (ticket, ticket, ticket)  # the dense mode reads none
    if tail is not None and index is not None:
        use_tail, sizes, tiles, tail_start = True, tail.sizes, tail.tiles, tail.start
    else:
        use_tail, sizes, tiles, tail_start = False, ticket, ticket, n_tiles
    grid = (min(_sm_count(qh.device), n_tiles),)
    kpos = key_positions if key_positions is not None else ticket
    kpos_strides = (kpos.stride(0), kpos.stride(1)) if key_positions is not None else (0, 0)
    launch(_hopper_attention_kernel, grid,
        _descriptor(qh, BLOCK_Q), _descriptor(kh, BLOCK_K), _descriptor(vh, BLOCK_K), _descriptor(out_h, BLOCK_Q // 2),
        idx, count, n_full, ticket, sizes, tiles, kpos, *kpos_strides,
        sink_logits if sink_logits is not None else ticket, tail_start, *softcap_args(scale, softcap), shape.heads,
        shape.heads // shape.kv_heads, shape.q_blocks, shape.k_blocks, shape.kv_len, shape.causal_offset,
        shape.last_query_position, shape.window_arg, n_tiles,
        HEAD_DIM=shape.head_dim, STAGES=STAGES, USE_INDEX=index is not None, IS_CAUSAL=is_causal,
        PERMUTED_KEYS=key_positions is not None, WINDOWED=shape.sliding_window is not None,
        HAS_SINKS=sink_logits is not None, SOFTCAP=softcap is not None, USE_TAIL=use_tail,
        BUCKETS=TAIL_BUCKETS, NUM_WARPS=NUM_WARPS,
        CONSUMER_REGS=CONSUMER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)
