"""Per-query block selection with FSA's loop order: key blocks outside, the queries that chose them inside.

In Native Sparse Attention's selection branch every query token attends to its own ``top_k`` key blocks of
``block_size`` keys (NSA shares one selection across the query heads of a GQA group). A FlashAttention-style
kernel that walks queries outside and their blocks inside (vanilla NSA) must batch the few heads of a group
into one tile, padding them to the 16 rows a tensor-core product needs. FSA (Yan et al., "FSA: An Alternative
Efficient Implementation of Native Sparse Attention Kernel", Sec. 3) swaps the loops: a program loads one key
block once and computes every query that selected it, in tiles of ``BLOCK_M`` such queries gathered through
an index list; each (query, block) pair leaves a partial result, and a second kernel merges a query's
partials. Here:

1. :func:`build_selection_index` (PyTorch, on the device, no host sync) turns the per-query selection into
   per-block query lists (one stable sort by block: queries stay ascending inside a block, so gathers stay
   near-contiguous and causal masking touches only the rows near the diagonal), each pair's slot in those lists,
   and a work list of chunks of at most ``QUERY_CHUNK`` queries of one block.
2. ``_kv_outer_kernel``: one program per chunk and KV head loads its key/value block once and, for each tile of
   ``BLOCK_M`` listed queries and each query head of the group, computes the tile's softmax over the block and
   writes the normalised partial output and its log-sum-exp to the pair's slot.
3. ``_merge_kernel``: one program per ``BLOCK_R`` queries and query head merges the partials of each query by
   their log-sum-exps and writes the output row (every row, including rows that see no key: zero).

Departures from the paper, each for a reason:
* One online-softmax pass, not two: FSA precomputes each query's statistics with a separate Q.K^T kernel so that
  partials can be summed; storing each partial normalised with its own log-sum-exp needs no second Q.K^T pass,
  and the merge weights them exactly (the partial is rounded to the input dtype before the merge, like the
  kernel's P in the P.V product).
* A program serves all query heads of its KV head's group (the key/value block is loaded once for the group;
  FSA's program holds one query head).
* Selections are deduplicated and, under causal masking, blocks wholly after the query are dropped before the
  kernel runs (they add nothing); NSA's compression and sliding-window branches and its gates are not here:
  this is the selection branch, over any selection
  (:func:`~sparge_diffusers.kernels.block_selection.select_key_blocks` gives one from block means).

Memory: the partial buffer holds one output row per (query, selected block, query head) in the input dtype,
``top_k`` times the output (FSA, Appendix D, has the same bound); the index is O(N * top_k) int32. Above
``max_partial_bytes`` (4 GiB by default) a call runs in query chunks, each with its own index and buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2
from .api import _check_out, new_output
from .attention import LOG2E, _add_sink
from .stats import SparsityStats
from ._inputs import (
    AttentionShape,
    Backend,
    CausalVariant,
    TensorLayout,
    causal_offset,
    check_attention_inputs,
    check_flag,
    check_kernel_dtype,
    check_positive_int,
    check_sink_logits,
    pick_backend,
    resolve_scale,
    to_hnd,
)

# Key-block sizes the kernel takes (a tile of the block is one tensor-core product's N dimension).
SELECT_BLOCK_SIZES = (32, 64, 128)
# Queries per work item: a program loads its key block once for up to this many queries of that block.
QUERY_CHUNK = 256
# Query rows per tensor-core product in the KV-outer kernel, and queries per program in the merge.
BLOCK_M = 64
BLOCK_R = 32
# Default cap on the partial buffers of one launch: a call whose partials would exceed it runs in query chunks.
MAX_PARTIAL_BYTES = 4 * 2 ** 30
# Launch options of the KV-outer kernel; None = the defaults in selected_attention_triton (sweeps set this).
KV_OUTER_LAUNCH: dict | None = None
MERGE_LAUNCH = {"num_warps": 4, "num_stages": 2}


@dataclass(frozen=True, eq=False)
class SelectionIndex:
    """Per-block query lists of a selection, for the KV-outer kernel (from :func:`build_selection_index`).

    Attributes (BH = batch * KV heads, P = query length * top_k, NB = key blocks, C = work items):
        query_list: (BH, P) int32: the queries of block 0 (ascending), then those of block 1, ...; the tail past
            ``block_start[:, NB]`` is unused.
        block_start: (BH, NB + 1) int32: where each block's queries begin in ``query_list``.
        slot: (BH, n, top_k) int32: the place in ``query_list`` (and in the partial buffers) of each kept
            (query, selection) pair of queries ``q_start .. q_start + n - 1``; -1 for an empty, repeated or
            (causal) wholly hidden selection.
        chunk_block, chunk_begin: (BH, C) int32: work item c covers ``query_list[chunk_begin : chunk_begin +
            QUERY_CHUNK]`` clipped to block ``chunk_block``'s list; -1 marks an unused item (C is an upper bound,
            ceil(P / QUERY_CHUNK) + NB, so the grid needs no host sync).
        batch, kv_heads: B and H_kv of the selection it was built from (None: not recorded), which a call checks:
            BH alone let an index of 2 batch rows x 1 KV head drive a call of 1 x 2, each row's picks another's.
    """

    query_list: torch.Tensor
    block_start: torch.Tensor
    slot: torch.Tensor
    chunk_block: torch.Tensor
    chunk_begin: torch.Tensor
    block_size: int
    is_causal: bool
    q_start: int = 0
    causal_offset: int = 0
    batch: int | None = None
    kv_heads: int | None = None


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size not in SELECT_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SELECT_BLOCK_SIZES}, got {block_size!r}")


def _check_selection_tensor(block_indices: torch.Tensor, expected: tuple[int, ...] | None = None) -> None:
    """A (B, H_kv, Nq, top_k) integer tensor (with ``expected`` = (B, H_kv, Nq) where the call fixes those): float
    indices were truncated toward zero, block 0.7 read as block 0."""
    if not isinstance(block_indices, torch.Tensor):
        raise ValueError(f"block_indices must be a torch.Tensor, got {type(block_indices).__name__}")
    if block_indices.dim() != 4 or block_indices.shape[3] == 0 or (
            expected is not None and tuple(block_indices.shape[:3]) != expected):
        want = "" if expected is None else f" = ({expected[0]}, {expected[1]}, {expected[2]}, top_k >= 1)"
        raise ValueError(f"block_indices must have shape (B, H_kv, Nq, top_k){want}, got {tuple(block_indices.shape)}")
    if block_indices.dtype not in (torch.int16, torch.int32, torch.int64):
        raise ValueError(f"block_indices must be an integer tensor (int16/int32/int64), got {block_indices.dtype}")


def check_block_indices(block_indices: torch.Tensor, shape: AttentionShape, block_size: int, device: torch.device,
                        *, validate: bool) -> None:
    """Shape, dtype and device of a selection; with ``validate`` also its range (reads it back: a device sync)."""
    _check_selection_tensor(block_indices, (shape.batch, shape.kv_heads, shape.q_len))
    if block_indices.device != device:
        raise ValueError(f"block_indices is on {block_indices.device}, q on {device}")
    if validate:
        n_blocks = math.ceil(shape.kv_len / block_size)
        if bool((block_indices >= n_blocks).any()):
            raise ValueError(f"block_indices holds a block index >= {n_blocks} (the number of {block_size}-key "
                             f"blocks of {shape.kv_len} keys); use -1 for 'no block'")


def build_selection_index(block_indices: torch.Tensor, *, q_len: int, kv_len: int, block_size: int,
                          is_causal: bool, q_start: int = 0, causal_offset: int = 0) -> SelectionIndex:
    """Invert a per-query selection into per-block query lists (device ops only, no host sync).

    Args:
        block_indices: (B, H_kv, n, top_k) integer key-block indices of queries ``q_start .. q_start + n - 1`` (all
            ``q_len`` queries by default); negative = none, repeats count once, indices >= the number of blocks
            count as none (:func:`selected_block_attention` rejects them first).
        is_causal: drop blocks whose first key comes after the query (the kernel would mask all of them).
        causal_offset: query row i sits at key position i + causal_offset under causal masking (lower-right
            alignment of fewer queries than keys: Nkv - Nq; see ``_inputs.causal_offset``).
    """
    _check_selection_tensor(block_indices)
    _check_block_size(block_size)
    check_flag(is_causal, "is_causal")
    check_positive_int(q_len, "q_len")
    check_positive_int(kv_len, "kv_len")
    Nq = block_indices.shape[2]
    if isinstance(q_start, bool) or not isinstance(q_start, int) or not 0 <= q_start or q_start + Nq > q_len:
        raise ValueError(f"queries {q_start}..{q_start + Nq - 1} of the selection lie outside the {q_len} queries")
    return _selection_index_of_checked(block_indices, kv_len=kv_len, block_size=block_size, is_causal=is_causal,
                                       q_start=q_start, causal_offset=causal_offset)


def _selection_index_of_checked(block_indices: torch.Tensor, *, kv_len: int, block_size: int, is_causal: bool,
                                q_start: int, causal_offset: int) -> SelectionIndex:
    """:func:`build_selection_index` on arguments already checked (``selected_block_attention``'s query chunks,
    whose selection and sizes its own checks covered: no second check per chunk)."""
    B, HK, Nq, T = block_indices.shape
    device = block_indices.device
    n_blocks = math.ceil(kv_len / block_size)
    none = n_blocks  # sorts after every real block
    x = block_indices.reshape(B * HK, Nq, T)
    x = torch.where((x >= 0) & (x < n_blocks), x, none).to(torch.int32)  # range test before the cast: no wrap-around
    if is_causal:
        query = torch.arange(q_start, q_start + Nq, device=device, dtype=torch.int32).view(1, Nq, 1) + causal_offset
        x = torch.where(x * block_size <= query, x, none)
    x = x.sort(dim=-1).values
    repeated = torch.zeros_like(x, dtype=torch.bool)
    repeated[..., 1:] = x[..., 1:] == x[..., :-1]
    x = torch.where(repeated, none, x).reshape(B * HK, Nq * T)

    # stable: pairs are laid out query-major, so each block's queries come out ascending; 16-bit keys halve the
    # radix sort's passes where the block count allows
    narrow = x.to(torch.int16) if n_blocks < 2 ** 15 else x
    order = torch.sort(narrow, dim=-1, stable=True).indices
    pairs = Nq * T
    query_list = (order // T + q_start).to(torch.int32)
    counts = torch.zeros(B * HK, n_blocks + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, x.long(), torch.ones_like(x))
    counts = counts[:, :n_blocks]
    block_start = torch.zeros(B * HK, n_blocks + 1, dtype=torch.int32, device=device)
    block_start[:, 1:] = counts.cumsum(-1)
    slot = torch.empty(B * HK, pairs, dtype=torch.int32, device=device)
    slot.scatter_(1, order, torch.arange(pairs, device=device, dtype=torch.int32).expand(B * HK, pairs))
    slot = torch.where(x == none, -1, slot).reshape(B * HK, Nq, T)

    # work items: block j has ceil(count_j / QUERY_CHUNK) of them; sum <= P / QUERY_CHUNK + NB bounds the grid
    n_chunks = (counts.long() + QUERY_CHUNK - 1) // QUERY_CHUNK
    chunk_end = n_chunks.cumsum(-1)
    items = cdiv(pairs, QUERY_CHUNK) + n_blocks
    c = torch.arange(items, device=device).expand(B * HK, items).contiguous()
    block = torch.searchsorted(chunk_end, c, right=True)  # (BH, C) in [0, NB]; NB = past the last item
    safe = block.clamp(max=n_blocks - 1)
    first_item = (chunk_end - n_chunks).gather(1, safe)
    chunk_begin = block_start.gather(1, safe) + (c - first_item) * QUERY_CHUNK
    chunk_block = torch.where(block < n_blocks, safe, -1).to(torch.int32)
    return SelectionIndex(query_list.contiguous(), block_start, slot.contiguous(), chunk_block.contiguous(),
                          chunk_begin.to(torch.int32).contiguous(), block_size, is_causal, q_start,
                          causal_offset if is_causal else 0, B, HK)


@triton.jit
def _kv_outer_kernel(
    Q, K, V, QUERY_LIST, BLOCK_START, CHUNK_BLOCK, CHUNK_BEGIN, O_PART, LSE_PART,
    qk_scale, HK, GROUP, kv_len, n_items, pairs, n_blocks, causal_offset,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QUERY_CHUNK: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    item = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    block = tl.load(CHUNK_BLOCK + bh * n_items + item)
    if block < 0:
        return
    begin = tl.load(CHUNK_BEGIN + bh * n_items + item)
    end = tl.minimum(begin + QUERY_CHUNK, tl.load(BLOCK_START + bh * (n_blocks + 1) + block + 1))
    b = bh // HK
    hk = bh % HK
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_valid = offs_n < kv_len
    # the block's keys and values, loaded once for every query (and query head) that selected it
    kv_mask = key_valid[:, None] & d_mask[None, :]
    kv_rows = offs_n[:, None].to(tl.int64)  # once per program: int64 costs nothing here (_inputs.wide_offsets)
    k = tl.load(K + b * stride_kb + hk * stride_kh + kv_rows * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + kv_rows * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    for start in range(begin, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_valid = rows < end
        query = tl.load(QUERY_LIST + bh * pairs + rows, mask=row_valid, other=0)
        visible = key_valid[None, :] & row_valid[:, None]
        if IS_CAUSAL:
            visible = visible & (offs_n[None, :] <= query[:, None] + causal_offset)
        q_rows = Q + b * stride_qb + query[:, None].to(tl.int64) * stride_qn + offs_d[None, :] * stride_qd
        part_row = (bh * pairs + rows) * GROUP  # (pair, head) rows of the partial buffers
        for g in range(GROUP):
            h = hk * GROUP + g
            q = tl.load(q_rows + h * stride_qh, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain
            s = tl.where(visible, s, float("-inf"))
            m = tl.max(s, 1)
            # every listed query sees a key of its block (hidden blocks were dropped), but its scores may all be
            # -inf (an inf in q or k); padding rows see none
            m = tl.where(m == float("-inf"), 0.0, m)
            p = tl.math.exp2(s - m[:, None])
            l = tl.sum(p, 1)
            l_safe = tl.where(l == 0.0, 1.0, l)  # a NaN sum (NaN in q or k) stays NaN
            o = tl.dot(p.to(v.dtype), v) / l_safe[:, None]
            # A block without a finite score for the row adds nothing: its lse is -inf, not log2(1) = 0, which
            # weighed it in the merge as one key scoring 0 (until session 77: where the row's other scores are far
            # below 0 its output came out near zero)
            lse = tl.where(l == 0.0, float("-inf"), m + tl.math.log2(l_safe))
            tl.store(O_PART + (part_row + g)[:, None] * HEAD_DIM + offs_d[None, :], o.to(O_PART.dtype.element_ty),
                     mask=row_valid[:, None] & d_mask[None, :])
            tl.store(LSE_PART + part_row + g, lse, mask=row_valid)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, SLOT, OUT, SINKS,
    H, GROUP, n_rows, q_start, pairs, TOP_K,
    stride_ob, stride_oh, stride_on, stride_od,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    tile = tl.program_id(0)
    bhq = tl.program_id(1).to(tl.int64)
    b = bhq // H
    h = bhq % H
    HK = H // GROUP
    bh = b * HK + h // GROUP
    g = h % GROUP
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_valid = rows < n_rows
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    for t in range(TOP_K):
        slot = tl.load(SLOT + (bh * n_rows + rows) * TOP_K + t, mask=row_valid, other=-1)
        kept = slot >= 0
        part_row = (bh * pairs + slot) * GROUP + g
        lse = tl.load(LSE_PART + part_row, mask=kept, other=float("-inf"))
        o = tl.load(O_PART + part_row[:, None] * HEAD_DIM + offs_d[None, :], mask=kept[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no partial yet
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse - m_use)
        acc = acc * alpha[:, None] + w[:, None] * o
        den = den * alpha + w
        m = m_new
    if HAS_SINKS:  # the learned sink joins the merged normaliser (m and the partials' lse are in log2 units)
        acc, den = _add_sink(acc, den, m, SINKS, h)
    # a row with no partial or no finite score (den == 0) gets zeros, as in SDPA; a NaN denominator stays NaN
    out = tl.where(den[:, None] == 0.0, 0.0, acc / tl.where(den == 0.0, 1.0, den)[:, None])
    out_rows = OUT + b * stride_ob + h * stride_oh + (q_start + rows[:, None]).to(tl.int64) * stride_on
    tl.store(out_rows + offs_d[None, :] * stride_od, out.to(OUT.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])


def selected_attention_triton(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, out_h: torch.Tensor,
                              shape: AttentionShape, index: SelectionIndex, *, scale: float,
                              sink_logits: torch.Tensor | None = None) -> None:
    """Launch the KV-outer kernel and the merge on (B, H, N, D) views; writes every element of the rows of
    ``out_h`` that the index covers. ``sink_logits``: (H,) learned sink logits with unit stride, added by the merge."""
    BH = shape.batch * shape.kv_heads
    group = shape.heads // shape.kv_heads
    pairs = index.query_list.shape[1]
    n_items = index.chunk_block.shape[1]
    n_blocks = index.block_start.shape[1] - 1
    d_pad = next_power_of_2(shape.head_dim)
    o_part = torch.empty(BH, pairs, group, shape.head_dim, device=qh.device, dtype=qh.dtype)
    lse_part = torch.empty(BH, pairs, group, device=qh.device, dtype=torch.float32)
    # H100, Llama-3.1-8B's 32K prefill shape (benchmarks/fsa.py's inputs), prebuilt index: 4 warps against 8 took
    # 4.79 / 6.95 ms at block 64, top_k 16 (with 3 stages) and 3.02 / 4.30 ms at block 128, top_k 8 (2 stages);
    # the other stage count was 5.04 and 3.53 ms
    config = KV_OUTER_LAUNCH if KV_OUTER_LAUNCH is not None else {
        "num_warps": 4, "num_stages": 3 if index.block_size <= 64 else 2}
    launch(_kv_outer_kernel, (n_items, BH),
           qh, kh, vh, index.query_list, index.block_start, index.chunk_block, index.chunk_begin, o_part, lse_part,
           scale * LOG2E, shape.kv_heads, group, shape.kv_len, n_items, pairs, n_blocks, index.causal_offset,
           *qh.stride(), *kh.stride(), *vh.stride(),
           HEAD_DIM=shape.head_dim, D_PAD=d_pad, BLOCK_M=BLOCK_M, BLOCK_N=index.block_size,
           QUERY_CHUNK=QUERY_CHUNK, IS_CAUSAL=index.is_causal, **config)
    n_rows = index.slot.shape[1]
    launch(_merge_kernel, (cdiv(n_rows, BLOCK_R), shape.batch * shape.heads),
           o_part, lse_part, index.slot, out_h, sink_logits if sink_logits is not None else lse_part, shape.heads,
           group, n_rows, index.q_start, pairs, index.slot.shape[-1], *out_h.stride(), HEAD_DIM=shape.head_dim,
           D_PAD=d_pad, BLOCK_R=BLOCK_R, HAS_SINKS=sink_logits is not None, **MERGE_LAUNCH)


def selected_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor | SelectionIndex,
    *,
    block_size: int = 64,
    is_causal: bool = True,
    scale: float | None = None,
    tensor_layout: TensorLayout = "HND",
    backend: Backend = "auto",
    validate: bool = True,
    out: torch.Tensor | None = None,
    max_partial_bytes: int = MAX_PARTIAL_BYTES,
    causal_variant: CausalVariant | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query token over its own selected key blocks (NSA's selection branch), FSA's way.

    Args:
        q: (B, H, Nq, D) for ``tensor_layout="HND"`` or (B, Nq, H, D) for ``"NHD"``; fp16/bf16 (fp32 on CPU).
        k, v: the same layout with H_kv heads (H_kv divides H) and Nkv tokens.
        block_indices: (B, H_kv, Nq, top_k) integer indices of ``block_size``-key blocks, one list per query
            token, shared by the query heads of a KV head's group (as NSA shares them); -1 = none, repeats count
            once, the order does not matter. Or a :class:`SelectionIndex` from :func:`build_selection_index`
            (built with this call's block size, causality and causal offset), to reuse one across calls.
        block_size: keys per block: 32, 64 or 128.
        is_causal: a query at position i sees keys at positions <= i; a selected block wholly after the query adds
            nothing. With Nq != Nkv pass ``causal_variant``.
        causal_variant: "lower_right" (query i sits at key position i + Nkv - Nq: a chunk of queries against a
            KV cache) or "upper_left" (query i at position i); needed by causal calls with Nq != Nkv, as for
            :func:`~sparge_diffusers.sparge_attention`. Rows that see no key get zeros.
        validate: check that no index is >= the number of blocks (reads the indices back: a device sync on CUDA,
            which CUDA-graph capture does not allow; benchmarks turn it off). Unchecked, such an index counts as
            none.
        backend: "auto" (Triton on CUDA, the float32 reference on CPU), "triton" or "reference". The reference
            builds a dense (Nq, Nkv) mask per KV head: for tests and small inputs.
        out: optional output buffer with q's shape, dtype and device (written in full).
        max_partial_bytes: the partial outputs take ``top_k * H * (D * 2 + 4)`` bytes per query; above this cap the
            call runs in equal query chunks (each builds its own index), which bounds the extra memory. A
            prebuilt ``SelectionIndex`` runs in one piece.
        sink_logits: learned attention sinks, as in :func:`~sparge_diffusers.block_sparse_attention` (one logit per
            query head joining each query's softmax with no value vector); the merge adds them. They change no
            selection.
    Returns:
        The output in q's layout and dtype; a query whose selection holds no visible key gets a zero row.

    Inside ``torch.compile``d code call :func:`~sparge_diffusers.kernels.library.selected_block_attention_op`
    (the same call as one custom-operator node).
    """
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant)
    _check_block_size(block_size)
    scale = resolve_scale(scale, shape.head_dim)
    chosen = pick_backend(backend, q.device, q.shape[-1])
    _check_out(out, q, k, v)
    sink_logits = check_sink_logits(sink_logits, shape, q.device)
    check_positive_int(max_partial_bytes, "max_partial_bytes")
    check_flag(validate, "validate")
    index: SelectionIndex | None
    if isinstance(block_indices, SelectionIndex):
        index = block_indices
        if chosen == "reference":
            raise ValueError("a SelectionIndex runs on the Triton backend only; pass block_indices to the reference")
        if index.q_start != 0:
            raise ValueError("a SelectionIndex of a query chunk (q_start > 0) covers only part of the output")
        if (index.block_size, index.is_causal, index.causal_offset) != (block_size, is_causal, shape.causal_offset) \
                or index.slot.shape != (shape.batch * shape.kv_heads, shape.q_len, index.slot.shape[-1]) \
                or (index.batch is not None and (index.batch, index.kv_heads) != (shape.batch, shape.kv_heads)) \
                or index.slot.device != q.device:
            raise ValueError(f"the SelectionIndex was built for block_size={index.block_size}, "
                             f"is_causal={index.is_causal}, causal_offset={index.causal_offset}, (B, H_kv) = "
                             f"({index.batch}, {index.kv_heads}), slot shape {tuple(index.slot.shape)} on "
                             f"{index.slot.device}; this call has block_size={block_size}, is_causal={is_causal}, "
                             f"causal_offset={shape.causal_offset}, (B, H_kv) = ({shape.batch}, {shape.kv_heads}), "
                             f"(B*H_kv, Nq) = ({shape.batch * shape.kv_heads}, {shape.q_len}) on {q.device}")
        if index.block_start.shape[1] - 1 != math.ceil(shape.kv_len / block_size):
            raise ValueError("the SelectionIndex was built for a different key length")
    else:
        check_block_indices(block_indices, shape, block_size, q.device, validate=validate or chosen == "reference")
        index = None
    if chosen == "reference":
        from .reference import reference_selected_block_attention

        assert isinstance(block_indices, torch.Tensor)  # a SelectionIndex was refused above

        result = reference_selected_block_attention(q, k, v, block_indices, shape=shape, block_size=block_size,
                                                    is_causal=is_causal, scale=scale, tensor_layout=tensor_layout,
                                                    causal_offset=shape.causal_offset, sink_logits=sink_logits)
        if out is not None:
            out.copy_(result)
            return out
        return result
    check_kernel_dtype(q.dtype)
    if out is None:
        out = new_output(q)
    qh, kh, vh, out_h = (to_hnd(t, tensor_layout) for t in (q, k, v, out))
    if index is not None:
        selected_attention_triton(qh, kh, vh, out_h, shape, index, scale=scale, sink_logits=sink_logits)
        return out
    assert isinstance(block_indices, torch.Tensor)
    top_k = block_indices.shape[-1]
    per_query = top_k * shape.heads * (shape.head_dim * q.element_size() + 4)
    pieces = math.ceil(shape.q_len * per_query / max_partial_bytes)
    rows = math.ceil(shape.q_len / pieces)
    for start in range(0, shape.q_len, rows):
        index = _selection_index_of_checked(block_indices[:, :, start:start + rows], kv_len=shape.kv_len,
                                            block_size=block_size, is_causal=is_causal, q_start=start,
                                            causal_offset=shape.causal_offset)
        selected_attention_triton(qh, kh, vh, out_h, shape, index, scale=scale, sink_logits=sink_logits)
    return out


def selection_sparsity(block_indices: torch.Tensor, *, heads: int, kv_len: int, block_size: int = 64,
                       is_causal: bool = True, causal_variant: CausalVariant | None = None) -> SparsityStats:
    """How much of dense attention a per-query selection leaves out, as :class:`SparsityStats`.

    The unit is the (query, key) pair, not the block product of SpargeAttn's stats: per query head, the fraction of
    the pairs dense attention computes (under causal masking those with key <= the query's position;
    ``causal_variant`` as for :func:`selected_block_attention`) that the selection does not cover. Repeated,
    negative, out-of-range and (causal) wholly hidden picks cover nothing, a block partly after the query covers
    its visible keys. No P.V product is skipped on its own, so ``pv_skipped`` equals ``qk_skipped`` and
    ``dense_blocks`` holds the dense pair count.
    Elementwise device ops over the selection (a sort along top_k), no host sync.

    Args:
        block_indices: (B, H_kv, Nq, top_k) as for :func:`selected_block_attention`.
        heads: query heads (a multiple of H_kv; each KV head's figures hold for its group).
    """
    # each gave a figure: kv_len=0 NaN, a negative kv_len or block size fractions of 1 to 3, float sizes and
    # float indices fractions of blocks that no kernel computes
    _check_selection_tensor(block_indices)
    check_flag(is_causal, "is_causal")
    for value, name in ((heads, "heads"), (kv_len, "kv_len"), (block_size, "block_size")):
        check_positive_int(value, name)
    B, HK, Nq, T = block_indices.shape
    if heads % HK:
        raise ValueError(f"heads ({heads}) must be a multiple of the selection's KV heads ({HK})")
    offset = causal_offset(Nq, kv_len, is_causal, causal_variant)
    n_blocks = math.ceil(kv_len / block_size)
    x = block_indices.long()
    x = torch.where((x >= 0) & (x < n_blocks), x, n_blocks).sort(dim=-1).values
    x = torch.where(torch.cat([torch.zeros_like(x[..., :1], dtype=torch.bool), x[..., 1:] == x[..., :-1]], -1),
                    n_blocks, x)  # repeats cover nothing
    first_key = x * block_size
    keys = (kv_len - first_key).clamp(min=0, max=block_size)  # the last block may be short; "none" has 0
    if is_causal:
        query = torch.arange(Nq, device=x.device).view(1, 1, Nq, 1) + offset  # each row's key position
        keys = torch.minimum(keys, (query - first_key + 1).clamp(min=0))
    covered = keys.sum(dim=(2, 3), dtype=torch.float64).repeat_interleave(heads // HK, dim=1)  # [B, H]
    if is_causal:  # keys 0..position of each row, at most all of them (counted on the CPU: no device sync)
        dense = int(torch.arange(offset + 1, offset + 1 + Nq).clamp(0, kv_len).sum())
    else:
        dense = Nq * kv_len
    return SparsityStats(covered, covered, dense)
