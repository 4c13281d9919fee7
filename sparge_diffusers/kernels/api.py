"""Public entry points: one function per stage and one for the whole method.

Each function takes q, k, v in either layout, checks them, and runs the Triton kernels on CUDA tensors or
the float32 reference on CPU tensors (``backend="auto"``). None of them allocates O(N^2) memory: the block
mask and its index list are O((N/128) * (N/64)).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, overload

import torch

from ._inputs import (
    BLOCK_K,
    BLOCK_Q,
    Backend,
    CausalVariant,
    PerHead,
    PermutedKeys,
    TensorLayout,
    check_attention_inputs,
    check_flag,
    check_positive_int,
    check_permuted_keys,
    check_kernel_dtype,
    check_sink_logits,
    check_softcap,
    pick_backend,
    per_head,
    resolve_scale,
    to_hnd,
    AttentionShape,
    _is_number,
    _python_per_head,
)
from . import attention_hopper
from .attention import block_mask_to_index, sparse_attention_triton
from .compact import CompactBlockMask, check_block_mask, from_kernel_walk
from .predict import predict_block_mask_triton, qk_block_statistics_triton
from .reference import (
    reference_block_sparse_attention,
    reference_block_statistics,
    reference_ordered_attention,
    reference_predict_block_mask,
)
from .s2o import CHECK_EVERY, VisitOrder, check_visit_order, ordered_attention_triton, visit_order_of_checked
from .stats import SparsityStats, sparsity_stats


def _thresholds(shape: AttentionShape, device: torch.device, simthreshd1: PerHead, cdfthreshd: PerHead
                ) -> tuple[torch.Tensor, torch.Tensor]:
    theta = per_head(simthreshd1, shape.heads, "simthreshd1", device, low=-1.0, high=1.0)
    tau = per_head(cdfthreshd, shape.heads, "cdfthreshd", device, low=0.0, high=1.0)
    return theta, tau


# A tile whose every row max lies >= 24 (log2 units) below the running max adds less than 2^-24 of the
# largest term to each row's float32 accumulator: under float32 rounding, so skipping it cannot change a
# float16/bfloat16 output. At such thresholds the Triton kernel leaves the stage-2 test out, because the
# test itself costs more than it saves (H100, Mochi shape: 86.7 ms with the test vs 47.1 ms without).
PV_TEST_LIMIT = 24.0


def _pv_thresholds(pvthreshd: PerHead | None, shape: AttentionShape, device: torch.device, backend: str
                   ) -> torch.Tensor | None:
    if pvthreshd is None:
        return None
    values: tuple[float, ...]
    if _is_number(pvthreshd):
        values = (float(pvthreshd),)
    elif isinstance(pvthreshd, (list, tuple)) and all(_is_number(x) for x in pvthreshd):
        values = tuple(float(x) for x in pvthreshd)
    else:
        values = tuple(per_head(pvthreshd, shape.heads, "pvthreshd", "cpu", low=0.0).tolist())
    return _stage2_thresholds(values, shape.heads, str(device), backend)


@functools.lru_cache(maxsize=256)
def _stage2_thresholds(values: tuple[float, ...], heads: int, device: str, backend: str) -> torch.Tensor | None:
    """Checked once per distinct value (no tensor op per call: host time matters at Flux-size calls)."""
    per_head_values = _python_per_head(values, heads, "pvthreshd", "cpu", 0.0, math.inf)
    values = tuple(per_head_values.tolist())
    if any(x <= 0 for x in values):
        raise ValueError("pvthreshd must be positive (or None / math.inf to turn stage 2 off)")
    if all(math.isinf(x) for x in values) or (backend == "triton" and all(x >= PV_TEST_LIMIT for x in values)):
        return None
    return _python_per_head(values, heads, "pvthreshd", device, 0.0, math.inf)


def _predict(q, k, *, is_causal, scale, simthreshd1, cdfthreshd, attention_sink, tensor_layout, backend,
             permuted_keys=None, causal_variant=None, sliding_window=None, softcap=None) -> CompactBlockMask:
    """Stage 1 with its input checks; the kernel walk is None on the reference path."""
    check_flag(attention_sink, "attention_sink")
    shape = check_attention_inputs(q, k, None, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant, sliding_window=sliding_window)
    key_segment = check_permuted_keys(permuted_keys, shape, q.device, is_causal)
    return _predict_checked(q, k, shape, is_causal=is_causal, scale=resolve_scale(scale, shape.head_dim),
                            simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, attention_sink=attention_sink,
                            tensor_layout=tensor_layout, chosen=pick_backend(backend, q.device, q.shape[-1]),
                            key_segment=key_segment, softcap=check_softcap(softcap))[0]


def _predict_checked(q, k, shape: AttentionShape, *, is_causal, scale, simthreshd1, cdfthreshd, attention_sink,
                     tensor_layout, chosen, with_ticket: bool = False, key_segment: int = BLOCK_K,
                     softcap: float | None = None) -> tuple[CompactBlockMask, torch.Tensor | None]:
    """Stage 1 on checked inputs. With ``with_ticket`` (one sparse call follows) also returns the Hopper kernel's
    zeroed ticket counter, taken from the allocation that holds the tail order's buckets (no memset of its own);
    None where no Hopper launch will read it. ``key_segment``: that of the call's ``PermutedKeys``."""
    theta, tau = _thresholds(shape, q.device, simthreshd1, cdfthreshd)
    if chosen == "reference":
        mask = reference_predict_block_mask(q, k, is_causal=is_causal, scale=scale, simthreshd1=theta,
                                            cdfthreshd=tau, attention_sink=attention_sink,
                                            tensor_layout=tensor_layout, key_segment=key_segment,
                                            causal_offset=shape.causal_offset, sliding_window=shape.sliding_window,
                                            softcap=softcap)
        return from_kernel_walk(mask, None, shape, is_causal, key_segment=key_segment), None
    check_kernel_dtype(q.dtype)
    # the Hopper kernel's tail order, filled by the same stage-1 kernel
    tail, ticket = (attention_hopper.new_tail_schedule(shape, q.device, with_counter=with_ticket)
                    if attention_hopper.wants_tail_schedule(shape, q.device) else (None, None))
    mask, walk = predict_block_mask_triton(to_hnd(q, tensor_layout), to_hnd(k, tensor_layout), shape,
                                           is_causal=is_causal, scale=scale, simthreshd1=theta, cdfthreshd=tau,
                                           attention_sink=attention_sink, tail=tail, key_segment=key_segment,
                                           softcap=softcap)
    return from_kernel_walk(mask, walk, shape, is_causal, tail, key_segment), ticket


def predict_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1: PerHead = 0.6,
    cdfthreshd: PerHead = 0.98,
    attention_sink: bool = False,
    tensor_layout: TensorLayout = "HND",
    backend: Backend = "auto",
    permuted_keys: PermutedKeys | None = None,
    causal_variant: CausalVariant | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Stage 1 of SpargeAttn: predict which (128-query, 64-key) blocks of the attention map to compute.

    Args:
        q: (B, H, Nq, D) for ``tensor_layout="HND"`` or (B, Nq, H, D) for ``"NHD"``; fp16/bf16 (fp32 on CPU).
        k: the same layout with H_kv heads (H_kv divides H) and Nkv tokens.
        is_causal: drop key blocks that no query of the block may see; diagonal blocks are always kept.
        scale: softmax scale, default 1/sqrt(D).
        simthreshd1: theta, per head or one for all. A block whose mean pairwise cosine similarity is not
            above theta is not summarised by its mean: its row (query) or column (key) is kept in full.
        cdfthreshd: tau. Each query block keeps its most probable key blocks, under the softmax of the
            compressed scores, until their cumulative probability reaches tau (TopCdf).
        attention_sink: always keep the first key block. Off by default, as upstream; pass True for causal LLM
            attention, whose sink token's logit a block mean dilutes (the README has measured errors).
        backend: "auto" (Triton on CUDA, reference on CPU), "triton" or "reference".
        permuted_keys: with ``is_causal``, k is stored permuted within segments (:class:`PermutedKeys`,
            PBS-Attn): the causal rule and the always-kept diagonal follow the segments.
        causal_variant: where the causal mask sits when Nq != Nkv: "lower_right" (query i sees keys
            0..i + Nkv - Nq, as FlashAttention aligns it and chunked prefill against a KV cache needs) or
            "upper_left" (keys 0..i, as SDPA's ``is_causal``). Required for causal calls with unequal lengths
            (None raises there), ignored at equal lengths, and only with ``is_causal``.
        sliding_window: with ``is_causal``, each query sees only its ``sliding_window`` most recent keys, itself
            included (the query at causal position p sees keys p - W + 1 .. p: transformers' ``sliding_window``,
            FlashAttention's ``window_size=(W - 1, 0)``). Blocks wholly before every query's window are hidden
            (not kept, and left out of TopCdf's softmax). Not with ``permuted_keys``.
        softcap: logit soft-capping c (Gemma 2's ``attn_logit_softcapping``, FlashAttention's ``softcap``): the
            compressed scores become c * tanh(s / c), as the attention scores do.
    Returns:
        (B, H, ceil(Nq/128), ceil(Nkv/64)) bool mask; every query block keeps at least one key block.
    """
    return _predict(q, k, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd,
                    attention_sink=attention_sink, tensor_layout=tensor_layout, backend=backend,
                    permuted_keys=permuted_keys, causal_variant=causal_variant, sliding_window=sliding_window,
                    softcap=softcap).mask


def new_output(q: torch.Tensor) -> torch.Tensor:
    """An output buffer with q's memory layout where q's last dim is contiguous, else a contiguous one.

    Diffusers passes (B, H, N, D) views of (B, N, H, D) projections and reads the output back through the
    opposite transpose: like SDPA's, an output laid out as q is makes that a free view, where a contiguous
    (B, H, N, D) output costs a copy of it per layer (28 MB at the Flux shape)."""
    if q.stride(-1) == 1:
        return torch.empty_like(q)  # preserve_format: q's strides when q is dense and non-overlapping
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _check_out(out: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``out`` must match q and be safe to write while the kernels run: its elements distinct (no zero strides)
    and its memory apart from q's, k's and v's, which the kernels' programs read while others write their rows
    (out=k would be a race on the GPU, yet right on the CPU, where the reference copies its result in). About
    1.3 us of host time where ``out`` is given (the custom operators always give one)."""
    if out is None:
        return
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q: shape {tuple(q.shape)}, {q.dtype} on {q.device}; got "
                         f"{tuple(out.shape)}, {out.dtype} on {out.device}")
    if 0 in out.stride() and any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise ValueError(f"out has a zero stride (an expanded tensor, strides {out.stride()}): its elements must be "
                         f"distinct")
    storage = out.untyped_storage().data_ptr()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.untyped_storage().data_ptr() == storage and _address_ranges_meet(out, t):
            raise ValueError(f"out overlaps {name} in memory: the kernels read {name} while writing out; pass a "
                             f"separate buffer")


def _address_ranges_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the address ranges two views of one storage span intersect (conservative: interleaved views that
    share no element count too)."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@overload
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           block_mask: torch.Tensor | CompactBlockMask | None, *, is_causal: bool = ...,
                           scale: float | None = ..., pvthreshd: PerHead | None = ...,
                           tensor_layout: TensorLayout = ..., return_sparsity: Literal[False] = ...,
                           backend: Backend = ..., out: torch.Tensor | None = ...,
                           permuted_keys: PermutedKeys | None = ..., causal_variant: CausalVariant | None = ...,
                           sliding_window: int | None = ..., sink_logits: torch.Tensor | None = ...,
                           softcap: float | None = ...) -> torch.Tensor: ...


@overload
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           block_mask: torch.Tensor | CompactBlockMask | None, *, is_causal: bool = ...,
                           scale: float | None = ..., pvthreshd: PerHead | None = ...,
                           tensor_layout: TensorLayout = ..., return_sparsity: Literal[True], backend: Backend = ...,
                           out: torch.Tensor | None = ..., permuted_keys: PermutedKeys | None = ...,
                           causal_variant: CausalVariant | None = ..., sliding_window: int | None = ...,
                           sink_logits: torch.Tensor | None = ...,
                           softcap: float | None = ...) -> tuple[torch.Tensor, SparsityStats]: ...


@overload
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           block_mask: torch.Tensor | CompactBlockMask | None, *, is_causal: bool = ...,
                           scale: float | None = ..., pvthreshd: PerHead | None = ...,
                           tensor_layout: TensorLayout = ..., return_sparsity: bool = ..., backend: Backend = ...,
                           out: torch.Tensor | None = ..., permuted_keys: PermutedKeys | None = ...,
                           causal_variant: CausalVariant | None = ..., sliding_window: int | None = ...,
                           sink_logits: torch.Tensor | None = ...,
                           softcap: float | None = ...) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]: ...


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor | CompactBlockMask | None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    pvthreshd: PerHead | None = None,
    tensor_layout: TensorLayout = "HND",
    return_sparsity: bool = False,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
    permuted_keys: PermutedKeys | None = None,
    causal_variant: CausalVariant | None = None,
    sliding_window: int | None = None,
    sink_logits: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]:
    """Block-sparse attention for any block mask (stage 2 of SpargeAttn, usable alone).

    Args:
        q, k, v: as in :func:`predict_block_mask`; v has k's shape.
        block_mask: (B or 1, H or 1, ceil(Nq/128), ceil(Nkv/64)) bool/int; nonzero = compute that block.
            Or a :class:`CompactBlockMask` from :func:`compact_block_mask`, which skips the per-call
            compaction (one small kernel) when a mask is reused. None runs the dense mode of the same kernel
            (every block, contiguous loads).
        is_causal: causal masking inside the kernel; hidden blocks are skipped. With Nq != Nkv it needs
            ``causal_variant`` (see :func:`predict_block_mask`).
        pvthreshd: stage 2 threshold, per head or one for all; None or math.inf turns it off. The P.V product
            of a tile is skipped when, for every row, rowmax(S_tile) is at least pvthreshd below the running
            max in log2 units of the scaled scores (the paper's lambda = -pvthreshd * ln 2). The Triton
            kernel leaves the test out when every head's pvthreshd >= 24: what it could skip is below
            float32 rounding, and the test costs more than it saves (see ``PV_TEST_LIMIT``); the statistics
            then count no stage-2 skips.
        return_sparsity: also return a :class:`SparsityStats`.
        out: optional output buffer with q's shape, dtype and device (written in full).
        permuted_keys: with ``is_causal``, k and v are stored permuted within segments (:class:`PermutedKeys`,
            PBS-Attn's segmented permutation; queries stay in order): a query at position i sees the key in
            slot r when ``permuted_keys.positions[..., r] <= i``. A dense call (``block_mask=None``) then walks
            an all-ones mask.
        causal_variant: "lower_right" or "upper_left", as in :func:`predict_block_mask`.
        sliding_window: with ``is_causal``, the query at causal position p sees keys p - W + 1 .. p only (see
            :func:`predict_block_mask`); blocks wholly outside the window are skipped whatever the mask says, and
            those it cuts are masked element by element. A dense call (``block_mask=None``) then walks an
            all-ones mask. A :class:`CompactBlockMask` must be built with the same window.
        sink_logits: learned attention sinks, a (H,) tensor of one logit per query head on q's device (gpt-oss's
            ``sinks``, which transformers passes as ``s_aux``): each row's softmax takes one more term,
            exp(sink_logits[h]), that has no value vector, so the row's weights sum to less than 1. In the units of
            the scaled scores (``scale * q . k``); -inf is no sink. It changes no block decision.
        softcap: logit soft-capping c: the scores become c * tanh(s / c) before the softmax (Gemma 2's 50, Grok's
            30; FlashAttention's ``softcap``). None: none.
    Returns:
        The output in q's layout and dtype, with q's strides where q's last dim is contiguous (as SDPA's
        output has), else contiguous; query rows that see no key (an empty mask row, or rows before the first
        key under the lower-right variant with Nq > Nkv) are zero.
    """
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant, sliding_window=sliding_window)
    key_segment = check_permuted_keys(permuted_keys, shape, q.device, is_causal)
    check_flag(return_sparsity, "return_sparsity")  # "False" would return a tuple where a tensor was expected
    if isinstance(block_mask, CompactBlockMask):
        block_mask.check_matches(shape, is_causal, q.device, key_segment)
    elif block_mask is not None:
        check_block_mask(block_mask, shape, q.device)
    chosen = pick_backend(backend, q.device, q.shape[-1])
    _check_out(out, q, k, v)
    return _block_sparse_checked(q, k, v, block_mask, shape, is_causal=is_causal,
                                 scale=resolve_scale(scale, shape.head_dim),
                                 thr=_pv_thresholds(pvthreshd, shape, q.device, chosen), tensor_layout=tensor_layout,
                                 return_sparsity=return_sparsity, chosen=chosen, out=out, permuted_keys=permuted_keys,
                                 sink_logits=check_sink_logits(sink_logits, shape, q.device),
                                 softcap=check_softcap(softcap))


def _block_sparse_checked(q, k, v, block_mask, shape: AttentionShape, *, is_causal, scale, thr, tensor_layout,
                          return_sparsity, chosen, out, ticket: torch.Tensor | None = None,
                          permuted_keys: PermutedKeys | None = None, sink_logits: torch.Tensor | None = None,
                          softcap: float | None = None):
    """:func:`block_sparse_attention` on checked inputs (``block_mask``, ``permuted_keys`` and ``sink_logits``
    checked against them). ``ticket``: a zeroed counter for a Hopper launch (from ``_predict_checked``), saving the
    launch its own memset."""
    compact = None
    if isinstance(block_mask, CompactBlockMask):
        compact, block_mask = block_mask, block_mask.mask
    key_segment = permuted_keys.segment if permuted_keys is not None else BLOCK_K
    if block_mask is None and (chosen == "reference" or permuted_keys is not None or shape.sliding_window is not None):
        # the reference walks a mask; with permuted keys or a sliding window so does the kernel (its dense mode's
        # contiguous walk follows plain causal extents)
        block_mask = torch.ones(1, 1, shape.q_blocks, shape.k_blocks, dtype=torch.bool, device=q.device)
    if chosen == "reference":
        result, stats = reference_block_sparse_attention(
            q, k, v, block_mask, shape=shape, is_causal=is_causal, scale=scale, pvthreshd=thr,
            tensor_layout=tensor_layout, key_positions=None if permuted_keys is None else permuted_keys.positions,
            key_segment=key_segment, sink_logits=sink_logits, softcap=softcap)
        if out is not None:
            result = out.copy_(result)
        return (result, stats) if return_sparsity else result
    check_kernel_dtype(q.dtype)
    qh, kh, vh = (to_hnd(t, tensor_layout) for t in (q, k, v))
    qh, kh, vh = (t if t.stride(-1) == 1 else t.contiguous() for t in (qh, kh, vh))
    if out is None:
        out = new_output(q)
    out_h = to_hnd(out, tensor_layout)
    index = compact.kernel_walk if compact is not None else None
    tail = compact.tail if compact is not None else None
    key_positions = None
    if permuted_keys is not None:
        key_positions = permuted_keys.positions
        if key_positions.dtype != torch.int32 or key_positions.stride(-1) != 1:
            key_positions = key_positions.to(torch.int32).contiguous()
        key_positions = key_positions.expand(shape.batch, shape.kv_heads, shape.kv_len)  # stride 0 where broadcast
    on_hopper = attention_hopper.usable(qh, kh, vh, out_h, shape, pv_test=thr is not None, dense=block_mask is None,
                                        is_causal=is_causal)
    if index is None and block_mask is not None:
        if on_hopper:
            # the same compaction kernel fills the Hopper kernel's tail order; one zeroed allocation serves
            # its buckets and the kernel's ticket counter
            tail, ticket = attention_hopper.new_tail_schedule(shape, q.device, with_counter=True)
        index = block_mask_to_index(block_mask, shape, is_causal, tail=tail, key_segment=key_segment)
    pv_count = sparse_attention_triton(qh, kh, vh, out_h, shape, is_causal=is_causal, scale=scale, index=index,
                                       pvthreshd=thr, return_counts=return_sparsity, tail=tail, ticket=ticket,
                                       on_hopper=on_hopper, key_positions=key_positions, sink_logits=sink_logits,
                                       softcap=softcap)
    if not return_sparsity:
        return out
    if index is not None:
        qk_count = index[1]
    else:
        full = torch.ones(1, 1, shape.q_blocks, shape.k_blocks, dtype=torch.bool, device=q.device)
        qk_count = block_mask_to_index(full, shape, is_causal, key_segment=key_segment)[1]
    if pv_count is None:  # no stage-2 test: every visited block's P.V product computed
        pv_count = qk_count
    return out, sparsity_stats(qk_count, pv_count, shape, is_causal)


def _keeps_every_block(cdfthreshd: PerHead) -> bool:
    """Whether ``cdfthreshd`` is at least 1 for every head, read from Python numbers only (a tensor would cost a
    read-back to tell: such calls run stage 1)."""
    if _is_number(cdfthreshd):
        return float(cdfthreshd) >= 1.0
    if isinstance(cdfthreshd, (list, tuple)) and cdfthreshd and all(_is_number(x) for x in cdfthreshd):
        return all(float(x) >= 1.0 for x in cdfthreshd)
    return False


@overload
def sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = ...,
                     scale: float | None = ..., simthreshd1: PerHead = ..., cdfthreshd: PerHead = ...,
                     pvthreshd: PerHead | None = ..., attention_sink: bool = ..., tensor_layout: TensorLayout = ...,
                     return_sparsity: Literal[False] = ..., backend: Backend = ..., out: torch.Tensor | None = ...,
                     permuted_keys: PermutedKeys | None = ..., causal_variant: CausalVariant | None = ...,
                     sliding_window: int | None = ..., sink_logits: torch.Tensor | None = ...,
                     softcap: float | None = ...) -> torch.Tensor: ...


@overload
def sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = ...,
                     scale: float | None = ..., simthreshd1: PerHead = ..., cdfthreshd: PerHead = ...,
                     pvthreshd: PerHead | None = ..., attention_sink: bool = ..., tensor_layout: TensorLayout = ...,
                     return_sparsity: Literal[True], backend: Backend = ..., out: torch.Tensor | None = ...,
                     permuted_keys: PermutedKeys | None = ..., causal_variant: CausalVariant | None = ...,
                     sliding_window: int | None = ..., sink_logits: torch.Tensor | None = ...,
                     softcap: float | None = ...) -> tuple[torch.Tensor, SparsityStats]: ...


@overload
def sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = ...,
                     scale: float | None = ..., simthreshd1: PerHead = ..., cdfthreshd: PerHead = ...,
                     pvthreshd: PerHead | None = ..., attention_sink: bool = ..., tensor_layout: TensorLayout = ...,
                     return_sparsity: bool = ..., backend: Backend = ..., out: torch.Tensor | None = ...,
                     permuted_keys: PermutedKeys | None = ..., causal_variant: CausalVariant | None = ...,
                     sliding_window: int | None = ..., sink_logits: torch.Tensor | None = ...,
                     softcap: float | None = ...) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]: ...


def sparge_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    simthreshd1: PerHead = 0.6,
    cdfthreshd: PerHead = 0.98,
    pvthreshd: PerHead | None = 50,
    attention_sink: bool = False,
    tensor_layout: TensorLayout = "HND",
    return_sparsity: bool = False,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
    permuted_keys: PermutedKeys | None = None,
    causal_variant: CausalVariant | None = None,
    sliding_window: int | None = None,
    sink_logits: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]:
    """SpargeAttn: predict a block mask (stage 1) and run sparse attention with the PV filter (stage 2).

    Defaults and names follow upstream SpargeAttn: ``simthreshd1`` is the paper's theta, ``cdfthreshd`` its
    tau and ``pvthreshd`` its lambda as -pvthreshd in log2 units (50 skips almost nothing; 5-20 skips
    more). See :func:`predict_block_mask` and :func:`block_sparse_attention` for each argument
    (``permuted_keys``: PBS-Attn's keys permuted within segments for causal prefill; ``sparge_diffusers.llm.
    pbs_sparge_attention`` builds them; ``causal_variant``: the causal mask's alignment when Nq != Nkv, e.g.
    "lower_right" for a chunk of queries against a KV cache; ``sliding_window``: each query sees its W most
    recent keys, as a Mistral or Gemma local layer does; ``sink_logits``: gpt-oss's learned attention sinks, one
    logit per query head joining each row's softmax with no value vector; ``softcap``: Gemma 2's logit
    soft-capping, applied to stage 1's compressed scores as to the attention scores). Stage 1 ignores the sink
    logits: TopCdf
    ranks the key blocks by their share of the keys' mass, which a sink scales alike for every block of a row.
    With ``cdfthreshd`` >= 1 for every head (given as numbers) TopCdf keeps every visible block, so stage 1 is
    skipped and the dense walk computes them (the same blocks and statistics, without stage 1's cost).

    Example:
        >>> out = sparge_attention(q, k, v, tensor_layout="NHD")                # (B, N, H, D) bf16 on CUDA
        >>> out, stats = sparge_attention(q, k, v, return_sparsity=True)
        >>> stats.sparsity, stats.qk_skipped                                     # overall, per head
    """
    # Checked once here and handed down: each check and each small allocation is host time that every layer
    # of an eager pipeline pays (benchmarks/host_time.py).
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant, sliding_window=sliding_window)
    key_segment = check_permuted_keys(permuted_keys, shape, q.device, is_causal)
    scale = resolve_scale(scale, shape.head_dim)
    chosen = pick_backend(backend, q.device, q.shape[-1])
    thr = _pv_thresholds(pvthreshd, shape, q.device, chosen)
    sink_logits = check_sink_logits(sink_logits, shape, q.device)
    softcap = check_softcap(softcap)
    check_flag(attention_sink, "attention_sink")
    check_flag(return_sparsity, "return_sparsity")
    _check_out(out, q, k, v)
    if _keeps_every_block(cdfthreshd):
        # TopCdf at tau >= 1 keeps every visible block whatever theta forces: the dense walk computes the same
        # blocks without stage 1 (its cost saved; the statistics count the same blocks)
        _thresholds(shape, q.device, simthreshd1, cdfthreshd)  # still checked
        compact, ticket = None, None
    else:
        compact, ticket = _predict_checked(q, k, shape, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1,
                                           cdfthreshd=cdfthreshd, attention_sink=attention_sink,
                                           tensor_layout=tensor_layout, chosen=chosen, with_ticket=True,
                                           key_segment=key_segment, softcap=softcap)
    return _block_sparse_checked(q, k, v, compact, shape, is_causal=is_causal, scale=scale, thr=thr,
                                 tensor_layout=tensor_layout, return_sparsity=return_sparsity, chosen=chosen, out=out,
                                 ticket=ticket, permuted_keys=permuted_keys, sink_logits=sink_logits, softcap=softcap)


@overload
def s2o_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = ...,
                  scale: float | None = ..., tau: PerHead | None = ..., segment: int = ..., check_every: int = ...,
                  simthreshd1: PerHead = ..., pvthreshd: PerHead | None = ..., attention_sink: bool = ...,
                  tensor_layout: TensorLayout = ..., return_sparsity: Literal[False] = ..., backend: Backend = ...,
                  out: torch.Tensor | None = ..., order: VisitOrder | None = ...,
                  causal_variant: CausalVariant | None = ...,
                  sink_logits: torch.Tensor | None = ...) -> torch.Tensor: ...


@overload
def s2o_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = ...,
                  scale: float | None = ..., tau: PerHead | None = ..., segment: int = ..., check_every: int = ...,
                  simthreshd1: PerHead = ..., pvthreshd: PerHead | None = ..., attention_sink: bool = ...,
                  tensor_layout: TensorLayout = ..., return_sparsity: Literal[True], backend: Backend = ...,
                  out: torch.Tensor | None = ..., order: VisitOrder | None = ...,
                  causal_variant: CausalVariant | None = ...,
                  sink_logits: torch.Tensor | None = ...) -> tuple[torch.Tensor, SparsityStats]: ...


@overload
def s2o_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = ...,
                  scale: float | None = ..., tau: PerHead | None = ..., segment: int = ..., check_every: int = ...,
                  simthreshd1: PerHead = ..., pvthreshd: PerHead | None = ..., attention_sink: bool = ...,
                  tensor_layout: TensorLayout = ..., return_sparsity: bool = ..., backend: Backend = ...,
                  out: torch.Tensor | None = ..., order: VisitOrder | None = ...,
                  causal_variant: CausalVariant | None = ...,
                  sink_logits: torch.Tensor | None = ...) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]: ...


def s2o_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    tau: PerHead | None = 0.0005,
    segment: int = 2048,
    check_every: int = CHECK_EVERY,
    simthreshd1: PerHead = 0.6,
    pvthreshd: PerHead | None = None,
    attention_sink: bool = False,
    tensor_layout: TensorLayout = "HND",
    return_sparsity: bool = False,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
    order: VisitOrder | None = None,
    causal_variant: CausalVariant | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]:
    """Sparse attention with S2O's selection: ranked key blocks and early stopping (see kernels/s2o.py).

    Each 128-row query block visits its forced key blocks (stage 1's non-self-similar blocks, the sink, the
    ragged tail, and under causal masking its own ``segment``), then the other visible key blocks in
    descending compressed score, and stops after the first ranked tile whose relative gain in the softmax
    normaliser (mean over the tile's rows of delta_l / l) falls below ``tau``.

    Speed: on Hopper at head dim 64 or 128 the walk runs on the warp-specialised Gluon kernel of the mask walk
    (``kernels/s2o_hopper.py``) when stage 2 is off and ``check_every`` is even and at least 4; a walk that skips
    nothing then takes 6-13% longer than the dense mode (H100, benchmarks/results/s2o-H100.txt). Elsewhere it
    runs the Triton walk, 42-48% longer than the dense mode at head dim 128 on Hopper (12% at 64). S2O gains
    time only where it skips more than that.

    Args:
        tau: the early-stop threshold, per head or one for all. 0 visits every block (dense up to rounding);
            None visits every block without evaluating the test. The default, 0.0005, is lower than S2O's
            0.005 because our test averages the gains of a 128-row tile; it gives about TopCdf's default
            error on the video workload (benchmarks/s2o.py sweeps tau; the right value differs by model).
        segment: tokens per causal segment whose key blocks are computed densely (a multiple of 128).
        check_every: ranked tiles between two stop tests (1 = after every tile; larger is faster).
        simthreshd1, attention_sink, pvthreshd: as in :func:`sparge_attention` (pvthreshd off by default).
        order: a visiting order from :func:`s2o_visit_order` to reuse (tests, benchmarks), built for the same
            shape, causality and causal variant (checked: ValueError otherwise). An order assembled by hand is
            checked for range only, with one read-back; its first ``n_unmasked`` blocks must be whole visible
            blocks, as :func:`s2o_visit_order` lists them.
        causal_variant: as in :func:`sparge_attention` (a chunk of queries against a KV cache: "lower_right").
            The causal segment is then the one of each query block's first position (row + Nkv - Nq).
        sink_logits: learned attention sinks, as in :func:`block_sparse_attention`; added to each row's normaliser
            after the walk (the stop test weighs the keys' normaliser, as S2O defines it).
        Others as in :func:`sparge_attention`. Statistics count the key blocks not visited as skipped.
    """
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant)
    scale = resolve_scale(scale, shape.head_dim)
    if not isinstance(segment, int) or segment <= 0 or segment % 128:
        raise ValueError(f"segment must be a positive multiple of 128 tokens, got {segment!r}")
    check_positive_int(check_every, "check_every")
    check_flag(attention_sink, "attention_sink")
    check_flag(return_sparsity, "return_sparsity")
    chosen = pick_backend(backend, q.device, q.shape[-1])
    theta = per_head(simthreshd1, shape.heads, "simthreshd1", q.device, low=-1.0, high=1.0)
    tau_t = None if tau is None else per_head(tau, shape.heads, "tau", q.device, low=0.0)
    thr = _pv_thresholds(pvthreshd, shape, q.device, chosen)
    sink_logits = check_sink_logits(sink_logits, shape, q.device)
    _check_out(out, q, k, v)
    if chosen == "triton":
        check_kernel_dtype(q.dtype)
    qh, kh, vh = (to_hnd(t, tensor_layout) for t in (q, k, v))
    if order is not None:
        check_visit_order(order, shape, is_causal, q.device)
    else:
        if chosen == "reference":
            q_stats, k_stats = reference_block_statistics(qh, BLOCK_Q), reference_block_statistics(kh, BLOCK_K)
        else:
            q_stats, k_stats = qk_block_statistics_triton(qh, kh)
        (q_means, q_sim), (k_means, k_sim) = q_stats, k_stats
        order = visit_order_of_checked(q_means, k_means, q_sim, k_sim, shape, is_causal=is_causal, scale=scale,
                                       simthreshd1=theta, segment=segment, attention_sink=attention_sink,
                                       backend=chosen)
    if chosen == "reference":
        result, visited, pv_count = reference_ordered_attention(qh, kh, vh, order, shape=shape, is_causal=is_causal,
                                                                scale=scale, tau=tau_t, pvthreshd=thr,
                                                                check_every=check_every, sink_logits=sink_logits)
        result = result.to(q.dtype)
        result = result if tensor_layout == "HND" else result.transpose(1, 2)
        if out is not None:
            result = out.copy_(result)
    else:
        qh, kh, vh = (t if t.stride(-1) == 1 else t.contiguous() for t in (qh, kh, vh))
        result = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
        counts = ordered_attention_triton(qh, kh, vh, to_hnd(result, tensor_layout), shape, order,
                                          is_causal=is_causal, scale=scale, tau=tau_t, pvthreshd=thr,
                                          return_counts=return_sparsity, check_every=check_every,
                                          sink_logits=sink_logits)
        if counts is not None:  # asked for (return_sparsity)
            visited, pv_count = counts
    if not return_sparsity:
        return result
    return result, sparsity_stats(visited.to(q.device), pv_count.to(q.device), shape, is_causal)


def relative_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The paper's accuracy metric: sum|O - O'| / sum|O'|, in float64; 0 for two all-zero tensors, inf for a
    non-zero ``out`` against an all-zero ``ref``. The shapes must be equal: broadcasting (an HND output against
    an NHD reference with one head, say) would compare the wrong elements."""
    if out.shape != ref.shape:
        raise ValueError(f"relative_l1 needs equal shapes, got {tuple(out.shape)} and {tuple(ref.shape)}")
    o, r = out.double(), ref.double()
    err, denom = float((o - r).abs().sum()), float(r.abs().sum())
    if denom > 0:
        return err / denom
    return 0.0 if err == 0 else (math.nan if math.isnan(err) else math.inf)
