"""sparge_attention, s2o_attention, selected_block_attention and select_key_blocks as PyTorch custom operators
(``torch.ops.sparge_diffusers.*``).

torch.compile cannot trace :func:`sparge_attention` itself: it checks its inputs in Python, picks kernels by
shape, launches Triton and Gluon kernels and caches tensors by value. Behind a custom operator the whole call is
one opaque node of the compiled graph, whose output shape the fake implementation below gives without running
it, so a compiled model keeps a single graph around every attention call. Eager callers should keep calling
:func:`sparge_attention`: dispatching through the operator adds host time and returns no statistics.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch

from ._inputs import (CausalVariant, PerHead, TensorLayout, _is_number, check_attention_inputs, check_flag,
                      check_sink_logits, check_softcap, resolve_scale, to_hnd)
from .api import new_output, s2o_attention, sparge_attention
from .block_selection import select_key_blocks
from .s2o import CHECK_EVERY
from .selected import MAX_PARTIAL_BYTES, _check_block_size, selected_block_attention


def _typed(tensor_layout: str, causal_variant: str | None) -> tuple[TensorLayout, CausalVariant | None]:
    """An operator schema's plain strings as the entry points' types (the entry points check the values)."""
    return cast(TensorLayout, tensor_layout), cast("CausalVariant | None", causal_variant)


@torch.library.custom_op("sparge_diffusers::sparge_attention", mutates_args=())
def _sparge_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                         simthreshd1: list[float], cdfthreshd: list[float], pvthreshd: list[float] | None,
                         attention_sink: bool, tensor_layout: str, causal_variant: str | None = None,
                         sliding_window: int | None = None, sink_logits: torch.Tensor | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    # an operator's output must have the strides its fake gives: written into the same kind of buffer (the
    # reference path returns a fresh tensor of its own layout, which sparge_attention copies into ``out``)
    layout, variant = _typed(tensor_layout, causal_variant)
    return sparge_attention(
        q, k, v, is_causal=is_causal, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, pvthreshd=pvthreshd,
        attention_sink=attention_sink, tensor_layout=layout, out=new_output(q), causal_variant=variant,
        sliding_window=sliding_window, sink_logits=sink_logits, softcap=softcap)


@_sparge_attention_op.register_fake
def _(q, k, v, is_causal, scale, simthreshd1, cdfthreshd, pvthreshd, attention_sink, tensor_layout,
      causal_variant=None, sliding_window=None, sink_logits=None, softcap=None):
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant, sliding_window=sliding_window)  # errors at trace time
    check_sink_logits(sink_logits, shape, q.device)
    check_softcap(softcap)
    return new_output(q)


# A graph that switches between exact and sparse attention at run time cannot be replayed as a CUDA graph (a
# replay repeats the recorded path), hence the tag: inductor keeps this operator out of CUDA graphs.
CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _check_dense_flag(dense: torch.Tensor) -> None:
    if dense.device.type != "cpu" or dense.numel() != 1 or dense.dtype != torch.bool:
        raise ValueError(f"dense must be a one-element bool tensor on the CPU (read at every call without a device "
                         f"sync), got {dense.dtype} of shape {tuple(dense.shape)} on {dense.device}")


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
                    tensor_layout: TensorLayout, causal_variant: CausalVariant | None = None) -> torch.Tensor:
    """SDPA on sparge_attention's inputs (layouts, grouped-query heads, causal variants), written into an output
    laid out as sparge_attention's (:func:`~sparge_diffusers.kernels.api.new_output`). The inputs are checked as
    sparge_attention checks them: a causal call with Nq != Nkv and no variant, or a misspelt one, ran SDPA's
    upper-left mask here where the sparse step raised."""
    check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal, causal_variant=causal_variant)
    qh, kh, vh = (to_hnd(x, tensor_layout) for x in (q, k, v))
    out = new_output(q)
    oh = to_hnd(out, tensor_layout)
    mask, causal, n_q, n_kv = None, is_causal, qh.shape[2], kh.shape[2]
    if is_causal and causal_variant == "lower_right" and n_q > n_kv:
        # the first n_q - n_kv rows see no key: zeros, as the kernels write (SDPA's lower-right bias gives NaN)
        oh[:, :, :n_q - n_kv].zero_()
        qh, oh = qh[:, :, n_q - n_kv:], oh[:, :, n_q - n_kv:]
    elif is_causal and causal_variant == "lower_right" and n_q < n_kv:
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(n_q, n_kv), False
    oh.copy_(torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1]))
    return out


@torch.library.custom_op("sparge_diffusers::sparge_attention_or_exact", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _sparge_attention_or_exact_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: torch.Tensor,
                                  is_causal: bool, scale: float, simthreshd1: list[float], cdfthreshd: list[float],
                                  pvthreshd: list[float] | None, attention_sink: bool, tensor_layout: str,
                                  causal_variant: str | None = None) -> torch.Tensor:
    _check_dense_flag(dense)
    if bool(dense):
        layout, variant = _typed(tensor_layout, causal_variant)
        return exact_attention(q, k, v, is_causal=is_causal, scale=scale, tensor_layout=layout, causal_variant=variant)
    return _sparge_attention_op(q, k, v, is_causal, scale, simthreshd1, cdfthreshd, pvthreshd, attention_sink,
                                tensor_layout, causal_variant)


@_sparge_attention_or_exact_op.register_fake
def _(q, k, v, dense, is_causal, scale, simthreshd1, cdfthreshd, pvthreshd, attention_sink, tensor_layout,
      causal_variant=None):
    _check_dense_flag(dense)
    check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal, causal_variant=causal_variant)
    return new_output(q)


def _as_int(value: Any, name: str) -> int:
    """An int argument as the operator's schema takes it (NumPy ints and 0-dim integer tensors convert). A float
    or bool raises: int() truncated 2.5 to 2 (segment=2048.5, top_k=2.7) where the eager function refuses it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name} must be an int, got {value!r}")


def _as_list(value: PerHead | None, name: str) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().flatten().tolist()
    if _is_number(value):
        return [float(value)]
    try:
        if isinstance(value, str) or any(isinstance(x, bool) for x in value):  # (True was taken as 1.0, as the
            raise TypeError  # eager call's per_head did)
        return [float(x) for x in value]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or a sequence of numbers (one per head), got {value!r}") from None


def sparge_attention_op(
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
    causal_variant: CausalVariant | None = None,
    dense: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sink_logits: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`sparge_attention` through its custom operator: the same arguments and output (in q's layout, with
    q's strides where its last dim is contiguous), no statistics. For code compiled with ``torch.compile``;
    thresholds become lists of floats (one, or one per head), which the compiled graph holds as constants.

    ``dense``: a one-element bool tensor on the CPU, read at every call: while it holds True the call computes
    exact attention (SDPA) instead. A compiled model switches between dense warm-up steps and sparse ones this
    way without recompiling (the flag is a graph input, not a constant). Such calls go through the operator
    ``sparge_diffusers::sparge_attention_or_exact``, which is tagged ``cudagraph_unsafe``: under
    ``mode="reduce-overhead"`` inductor keeps it out of CUDA graphs, since a replay would repeat one path.
    ``sliding_window``, ``sink_logits`` and ``softcap`` (see :func:`sparge_attention`) are not taken with ``dense``,
    whose exact path has none of them."""
    scale = resolve_scale(scale, q.shape[-1])
    thresholds = (_as_list(simthreshd1, "simthreshd1"), _as_list(cdfthreshd, "cdfthreshd"),
                  _as_list(pvthreshd, "pvthreshd"))
    causal, sink = check_flag(is_causal, "is_causal"), check_flag(attention_sink, "attention_sink")
    if dense is not None:
        for name, value in (("sliding_window", sliding_window), ("sink_logits", sink_logits), ("softcap", softcap)):
            if value is not None:
                raise ValueError(f"sparge_attention_op takes dense or {name}, not both (the exact path that dense "
                                 f"switches to has no {name.replace('_', ' ')})")
        return torch.ops.sparge_diffusers.sparge_attention_or_exact(
            q, k, v, dense, causal, scale, *thresholds, sink, tensor_layout, causal_variant)
    return torch.ops.sparge_diffusers.sparge_attention(
        q, k, v, causal, scale, *thresholds, sink, tensor_layout, causal_variant, sliding_window, sink_logits,
        None if softcap is None else float(softcap))


@torch.library.custom_op("sparge_diffusers::s2o_attention", mutates_args=())
def _s2o_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float,
                      tau: list[float] | None, segment: int, check_every: int, simthreshd1: list[float],
                      pvthreshd: list[float] | None, attention_sink: bool, tensor_layout: str,
                      causal_variant: str | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    layout, variant = _typed(tensor_layout, causal_variant)
    return s2o_attention(
        q, k, v, is_causal=is_causal, scale=scale, tau=tau, segment=segment, check_every=check_every,
        simthreshd1=simthreshd1, pvthreshd=pvthreshd, attention_sink=attention_sink, tensor_layout=layout,
        out=new_output(q), causal_variant=variant, sink_logits=sink_logits)


@_s2o_attention_op.register_fake
def _(q, k, v, is_causal, scale, tau, segment, check_every, simthreshd1, pvthreshd, attention_sink, tensor_layout,
      causal_variant=None, sink_logits=None):
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant)  # errors at trace time
    check_sink_logits(sink_logits, shape, q.device)
    return new_output(q)


def s2o_attention_op(
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
    causal_variant: CausalVariant | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~sparge_diffusers.kernels.api.s2o_attention` through its custom operator, for code compiled with
    ``torch.compile``: the same arguments (backend "auto"; no prebuilt ``order``) and output, no statistics;
    thresholds become lists of floats, which the compiled graph holds as constants."""
    scale = resolve_scale(scale, q.shape[-1])
    return torch.ops.sparge_diffusers.s2o_attention(
        q, k, v, check_flag(is_causal, "is_causal"), scale, _as_list(tau, "tau"), _as_int(segment, "segment"),
        _as_int(check_every, "check_every"),
        _as_list(simthreshd1, "simthreshd1"), _as_list(pvthreshd, "pvthreshd"),
        check_flag(attention_sink, "attention_sink"), tensor_layout, causal_variant, sink_logits)


@torch.library.custom_op("sparge_diffusers::selected_block_attention", mutates_args=())
def _selected_block_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                                 block_size: int, is_causal: bool, scale: float, tensor_layout: str, validate: bool,
                                 max_partial_bytes: int, causal_variant: str | None = None,
                                 sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    layout, variant = _typed(tensor_layout, causal_variant)
    return selected_block_attention(q, k, v, block_indices, block_size=block_size, is_causal=is_causal, scale=scale,
                                    tensor_layout=layout, validate=validate, out=new_output(q),
                                    max_partial_bytes=max_partial_bytes, causal_variant=variant,
                                    sink_logits=sink_logits)


@_selected_block_attention_op.register_fake
def _(q, k, v, block_indices, block_size, is_causal, scale, tensor_layout, validate, max_partial_bytes,
      causal_variant=None, sink_logits=None):
    shape = check_attention_inputs(q, k, v, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant)  # errors at trace time
    _check_block_size(block_size)
    check_sink_logits(sink_logits, shape, q.device)
    return new_output(q)


def selected_block_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    block_size: int = 64,
    is_causal: bool = True,
    scale: float | None = None,
    tensor_layout: TensorLayout = "HND",
    validate: bool = True,
    max_partial_bytes: int = MAX_PARTIAL_BYTES,
    causal_variant: CausalVariant | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~sparge_diffusers.kernels.selected.selected_block_attention` through its custom operator, for code
    compiled with ``torch.compile``: the same arguments (a per-query ``block_indices`` tensor; a prebuilt
    ``SelectionIndex`` is not an operator argument) and output. Under CUDA graphs (``mode="reduce-overhead"``) pass
    ``validate=False``: the range check reads the indices back."""
    scale = resolve_scale(scale, q.shape[-1])
    return torch.ops.sparge_diffusers.selected_block_attention(
        q, k, v, block_indices, _as_int(block_size, "block_size"), check_flag(is_causal, "is_causal"), scale,
        tensor_layout, check_flag(validate, "validate"), _as_int(max_partial_bytes, "max_partial_bytes"),
        causal_variant, sink_logits)


@torch.library.custom_op("sparge_diffusers::select_key_blocks", mutates_args=())
def _select_key_blocks_op(q: torch.Tensor, k: torch.Tensor, top_k: int, block_size: int, is_causal: bool,
                          scale: float, sink_blocks: int, local_blocks: int, tensor_layout: str,
                          causal_variant: str | None = None) -> torch.Tensor:
    layout, variant = _typed(tensor_layout, causal_variant)
    return select_key_blocks(q, k, top_k=top_k, block_size=block_size, is_causal=is_causal, scale=scale,
                             sink_blocks=sink_blocks, local_blocks=local_blocks, tensor_layout=layout,
                             causal_variant=variant)


@_select_key_blocks_op.register_fake
def _(q, k, top_k, block_size, is_causal, scale, sink_blocks, local_blocks, tensor_layout, causal_variant=None):
    shape = check_attention_inputs(q, k, None, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant)
    _check_block_size(block_size)
    return q.new_empty((shape.batch, shape.kv_heads, shape.q_len, top_k), dtype=torch.int32)


def select_key_blocks_op(
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
    causal_variant: CausalVariant | None = None,
) -> torch.Tensor:
    """:func:`~sparge_diffusers.kernels.block_selection.select_key_blocks` through its custom operator, for code
    compiled with ``torch.compile``: the same arguments (backend "auto") and output."""
    scale = resolve_scale(scale, q.shape[-1])
    return torch.ops.sparge_diffusers.select_key_blocks(
        q, k, _as_int(top_k, "top_k"), _as_int(block_size, "block_size"), check_flag(is_causal, "is_causal"), scale,
        _as_int(sink_blocks, "sink_blocks"), _as_int(local_blocks, "local_blocks"), tensor_layout, causal_variant)
