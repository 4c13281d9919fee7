"""SpargeAttn for causal LLM prefill in Hugging Face transformers: an attention function for
``AttentionInterface``.

    from sparge_diffusers.llm import register
    register("sparge", cdfthreshd=0.98)                      # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sparge", torch_dtype=torch.bfloat16)

The prefill of a causal model runs :func:`sparge_attention` with ``is_causal=True`` and grouped-query heads as they
come (no repeat of K/V): a whole prompt, chunked prefill against a KV cache (fewer queries than keys, with the
lower-right causal mask transformers builds for it; ``causal_variant="lower_right"``; against a static cache only
its filled slots), left- and right-padded batches (each prompt its own call without its padding; a right-padded
prompt's padding queries by exact attention over its keys, as SDPA's mask has them), Llama 4's chunked attention
and packed sequences (each chunk or sequence its own call on its keys), layers with a sliding window
(Mistral, Gemma 3's local layers: the kernels take ``sliding_window``) and models with learned attention sinks
(gpt-oss's ``s_aux``: the kernels take ``sink_logits``) or logit soft-capping (Gemma 2's ``softcap``); calls with
either that cannot run sparse go to :func:`eager_attention`, not to SDPA's function, which would drop the sinks and
raises on softcap. Everything else is left to transformers' own SDPA function, the one
``attn_implementation="sdpa"`` uses: decode steps (one query), and, with one warning per reason, explicit masks of
other patterns, dropout, sliding windows that hide keys under a method that takes none (S2O, FSA, PBS's
permuted keys), position biases, non-causal modules, unsupported dtypes or head dims and shapes the kernels refuse
(a value head dim unlike the query's); for a model with one K/V head, a prefill call under a mask gets contiguous K/V
copies rather than the function's views of head stride 0, which torch 2.11's memory-efficient kernel misreads
(:func:`_sdpa_function`). ``strict=True`` raises instead of falling back. Calls that neither the
kernels nor SDPA compute raise ValueError whatever ``strict`` says (per-token sinks, key indices chosen by the
model: :func:`check_call_arguments`). Packed sequences given only as flash-attention's ``cu_seq_lens`` run sparse
(eagerly), one call per sequence (:func:`packed_segments`). Composes the kernels
(SpargeAttn by default; S2O's ranked walk or FSA's per-token block selection with ``method=``, a small registry:
:data:`PREFILL_METHODS`) and the segmented key permutation of PBS-Attn (``pbs_segment``, see
:func:`pbs_sparge_attention` and its operator); knows nothing of diffusers.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, cast, overload

import torch

from ._compile import compiling, warn_once
from .kernels import (PermutedKeys, SparsityStats, s2o_attention, s2o_attention_op, select_key_blocks,
                      select_key_blocks_op, selected_block_attention, selected_block_attention_op, selection_sparsity,
                      sparge_attention, sparge_attention_op)
from .kernels._inputs import (THRESHOLD_RANGES, CausalVariant, PerHead, check_attention_inputs, check_flag,
                              check_no_grad, check_positive_int, check_sink_logits, check_softcap,
                              check_threshold_values, pick_backend, resolve_scale, unsupported_reason)
from .kernels.api import new_output
from .kernels.mask_rows import mask_row_extents
from .kernels.library import CUDAGRAPH_UNSAFE, _as_int, _as_list
from .permutations import last_block_key_importance, segmented_key_order
from .permutations.gather import gather_rows_per_head


class ScoreTerms(NamedTuple):
    """What a layer adds to its attention scores beyond causal masking and a window: learned sink logits (``s_aux``,
    one per query head: gpt-oss) and logit soft-capping (``softcap``: Gemma 2). None: none of that kind."""

    sinks: torch.Tensor | None = None
    softcap: float | None = None

    def any(self) -> bool:
        """Whether the layer adds anything, i.e. whether a call must pass sinks or a cap to the kernels."""
        return self.sinks is not None or self.softcap is not None


NO_TERMS = ScoreTerms()


@overload
def pbs_sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment: int = ...,
                         scale: float | None = ..., return_sparsity: Literal[False] = ...,
                         causal_variant: CausalVariant | None = ..., **sparge_settings: Any) -> torch.Tensor: ...


@overload
def pbs_sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment: int = ...,
                         scale: float | None = ..., return_sparsity: Literal[True],
                         causal_variant: CausalVariant | None = ...,
                         **sparge_settings: Any) -> tuple[torch.Tensor, SparsityStats]: ...


@overload
def pbs_sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment: int = ...,
                         scale: float | None = ..., return_sparsity: bool = ...,
                         causal_variant: CausalVariant | None = ...,
                         **sparge_settings: Any) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]: ...


def pbs_sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment: int = 256,
                         scale: float | None = None, return_sparsity: bool = False,
                         causal_variant: CausalVariant | None = None, **sparge_settings: Any
                         ) -> torch.Tensor | tuple[torch.Tensor, SparsityStats]:
    """Causal SpargeAttn on keys in PBS-Attn's segmented order (permuted block-sparse attention, arXiv 2510.21270).

    Each K/V head's keys are sorted, within aligned segments of ``segment`` positions, by the attention the last
    128 queries give them (:func:`permutations.last_block_key_importance`); stage 1 then predicts its block mask
    on the permuted keys, and the kernels apply the causal test to the keys' original positions. Queries stay in
    order, so the output needs no inverse permutation (as PBS-Attn does for grouped-query models). The result is
    causal attention over the same keys: only the block selection differs from :func:`sparge_attention`'s.

    Departures from PBS-Attn: the block selector is SpargeAttn's stage 1 (the paper pairs the permutation with
    mean pooling, XAttention or FlexPrefill selection); every block of the segments a query block overlaps is
    computed (PBS-Attn computes its diagonal segment densely as well).

    A chunk of a prompt against its KV cache (Nq < Nkv, ``causal_variant="lower_right"``) ranks the cache's keys
    and its own by the chunk's last 128 queries, which are the prompt's last so far; the last chunk of a prompt
    thus sorts the keys as the whole prompt's call does, and computes the same rows where the chunks start on
    query-block boundaries (tested). PBS-Attn describes whole-prompt prefill only; chunks are our extension.

    Args:
        q: (B, H, Nq, D); k, v: (B, H_kv, Nkv, D), HND layout (transformers' attention functions get these),
            Nq <= Nkv.
        segment: positions per segment, a positive multiple of 64; larger sorts more keys together but makes
            the always-computed diagonal segment wider. PBS-Attn uses 256.
        causal_variant: the causal mask's alignment when Nq != Nkv (see :func:`sparge_attention`).
        sparge_settings: :func:`sparge_attention`'s thresholds (simthreshd1, cdfthreshd, pvthreshd,
            attention_sink), backend, ``out``, ``sink_logits`` (learned sinks: the key order does not matter to
            them) and ``softcap`` (the key ranking ignores it).
    """
    if sparge_settings.get("tensor_layout", "HND") != "HND" or "is_causal" in sparge_settings:
        raise ValueError("pbs_sparge_attention takes HND inputs and is always causal")
    check_no_grad(q, k, v)  # before ranking and gathering the keys (the gathered copies would raise only later)
    check_flag(return_sparsity, "return_sparsity")
    # an unsupported GPU raises before the ranking; backend="reference" ranks in PyTorch too
    chosen = pick_backend(sparge_settings.get("backend", "auto"), q.device, q.shape[-1])
    importance = last_block_key_importance(q, k, scale=scale, causal_variant=causal_variant,
                                           backend="auto" if chosen == "triton" else "torch")
    order = segmented_key_order(importance, segment)
    positions = order.to(torch.int32)
    # gather_keys without its range check (a read-back): the order is segmented_key_order's own
    k, v = gather_rows_per_head(k, order), gather_rows_per_head(v, order)
    return sparge_attention(q, k, v, is_causal=True, scale=scale,
                            permuted_keys=PermutedKeys(positions, segment), return_sparsity=return_sparsity,
                            causal_variant=causal_variant, **sparge_settings)


@torch.library.custom_op("sparge_diffusers::pbs_sparge_attention", mutates_args=())
def _pbs_sparge_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment: int, scale: float,
                             simthreshd1: list[float], cdfthreshd: list[float], pvthreshd: list[float] | None,
                             attention_sink: bool, causal_variant: str | None = None,
                             sink_logits: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    # written into the buffer the fake describes (as the kernels' operators do)
    return pbs_sparge_attention(
        q, k, v, segment=segment, scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, pvthreshd=pvthreshd,
        attention_sink=attention_sink, causal_variant=cast("CausalVariant | None", causal_variant), out=new_output(q),
        sink_logits=sink_logits, softcap=softcap)


@_pbs_sparge_attention_op.register_fake
def _(q, k, v, segment, scale, simthreshd1, cdfthreshd, pvthreshd, attention_sink, causal_variant=None,
      sink_logits=None, softcap=None):
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=True, causal_variant=causal_variant)
    check_sink_logits(sink_logits, shape, q.device)
    check_softcap(softcap)
    PermutedKeys(k.new_empty(1, 1, k.shape[2], dtype=torch.int32), segment)  # a bad segment fails while tracing
    return new_output(q)


def pbs_sparge_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment: int = 256,
                            scale: float | None = None, simthreshd1: PerHead = 0.6, cdfthreshd: PerHead = 0.98,
                            pvthreshd: PerHead | None = 50, attention_sink: bool = False,
                            causal_variant: CausalVariant | None = None, sink_logits: torch.Tensor | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """:func:`pbs_sparge_attention` through its custom operator (``torch.ops.sparge_diffusers.pbs_sparge_attention``),
    for code compiled with ``torch.compile``: the key ranking, the permutation and the sparse call are one opaque
    node. The same arguments (backend "auto") and output, no statistics; thresholds become lists of floats, which
    the compiled graph holds as constants. Free of device syncs on CUDA (the permutation is not read back), so it
    may sit inside a CUDA graph."""
    return torch.ops.sparge_diffusers.pbs_sparge_attention(
        q, k, v, _as_int(segment, "segment"), resolve_scale(scale, q.shape[-1]), _as_list(simthreshd1, "simthreshd1"),
        _as_list(cdfthreshd, "cdfthreshd"), _as_list(pvthreshd, "pvthreshd"),
        check_flag(attention_sink, "attention_sink"), causal_variant, sink_logits,
        None if softcap is None else float(softcap))


def _causal_variant(q: torch.Tensor, k: torch.Tensor, variant: str | None) -> str | None:
    """The call's causal variant where its lengths differ (None for equal lengths, where both variants agree)."""
    return variant if q.shape[2] != k.shape[2] else None


def _sparge_settings(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, scale: float | None,
                     variant: str | None, window: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None) -> dict[str, Any]:
    """sparge_attention's keyword arguments for one causal call, eager or through its operator (``window``: a
    sliding window that hides keys from some query, else None; ``sinks``, ``softcap``: the layer's
    :class:`ScoreTerms`)."""
    settings: dict[str, Any] = dict(
        is_causal=True, scale=scale, simthreshd1=attention.simthreshd1, cdfthreshd=attention.cdfthreshd,
        pvthreshd=attention.pvthreshd, attention_sink=attention.attention_sink,
        causal_variant=_causal_variant(q, k, variant))
    if window is not None:
        settings["sliding_window"] = window
        if window < attention.min_predicted_window:
            settings["cdfthreshd"] = 1.0  # every block in the window, without stage 1 (see min_predicted_window)
    if sinks is not None:
        settings["sink_logits"] = sinks
    if softcap is not None:
        settings["softcap"] = softcap
    return settings


def _pbs_segment(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor) -> int | None:
    """The segment of PBS's permuted keys where a call runs on them (else None): with ``pbs_segment`` set, where it
    has no fewer keys than queries.
    A lower-right call with fewer (its first queries see no key) runs on the keys in order instead, the same
    attention with stage 1's blocks chosen on unpermuted keys: the ranking needs the last queries' own keys.
    transformers builds no such mask, but a mask can read as one (a random mask draw, session 57, raised)."""
    return attention.pbs_segment if q.shape[2] <= k.shape[2] else None


def _sparge_prefill(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None, variant: str | None, stats: bool, window: int | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None):
    """SpargeAttn (stage 1's TopCdf mask, then the block-sparse kernel); PBS's key order where asked."""
    settings = _sparge_settings(attention, q, k, scale, variant, window, sinks, softcap)
    segment = _pbs_segment(attention, q, k)
    if segment is not None:
        del settings["is_causal"]  # pbs_sparge_attention is always causal
        return pbs_sparge_attention(q, k, v, segment=segment, return_sparsity=stats, **settings)
    return sparge_attention(q, k, v, return_sparsity=stats, **settings)


def _sparge_compiled(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None, variant: str | None, window: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    settings = _sparge_settings(attention, q, k, scale, variant, window, sinks, softcap)
    segment = _pbs_segment(attention, q, k)
    if segment is not None:
        del settings["is_causal"]
        return pbs_sparge_attention_op(q, k, v, segment=segment, **settings)
    return sparge_attention_op(q, k, v, **settings)


def _s2o_settings(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, scale: float | None,
                  variant: str | None, sinks: torch.Tensor | None = None) -> dict[str, Any]:
    """s2o_attention's keyword arguments for one causal call, eager or through its operator."""
    settings: dict[str, Any] = dict(is_causal=True, scale=scale, tau=attention.tau, segment=attention.s2o_segment,
                    simthreshd1=attention.simthreshd1, pvthreshd=attention.pvthreshd,
                    attention_sink=attention.attention_sink, causal_variant=_causal_variant(q, k, variant))
    if sinks is not None:
        settings["sink_logits"] = sinks
    return settings


def _s2o_prefill(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None, variant: str | None, stats: bool, sinks: torch.Tensor | None = None):
    """S2O's selection: key blocks visited by compressed score, stopped once the normaliser stops growing."""
    return s2o_attention(q, k, v, return_sparsity=stats, **_s2o_settings(attention, q, k, scale, variant, sinks))


def _s2o_compiled(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None, variant: str | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return s2o_attention_op(q, k, v, **_s2o_settings(attention, q, k, scale, variant, sinks))


def _fsa_top_k(attention: SpargeLLMAttention, k: torch.Tensor) -> int:
    """``top_k``, at most the call's key blocks: the selection's further columns would all be -1, and the index and
    the partial outputs grow with its width (a short segment of a long top_k made them as wide as top_k)."""
    return min(attention.top_k, -(-k.shape[2] // attention.block_size))


def _fsa_prefill(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None, variant: str | None, stats: bool, sinks: torch.Tensor | None = None):
    """NSA-style selection of ``top_k`` key blocks per query token, computed by FSA's KV-outer kernel."""
    settings: dict[str, Any] = dict(block_size=attention.block_size, is_causal=True,
                                    causal_variant=_causal_variant(q, k, variant))
    selection = select_key_blocks(q, k, top_k=_fsa_top_k(attention, k), scale=scale, **settings)
    out = selected_block_attention(q, k, v, selection, scale=scale, validate=False,  # the selector's are in range
                                   sink_logits=sinks, **settings)
    if not stats:
        return out
    return out, selection_sparsity(selection, heads=q.shape[1], kv_len=k.shape[2], **settings)


def _fsa_compiled(attention: SpargeLLMAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None, variant: str | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    settings: dict[str, Any] = dict(block_size=attention.block_size, is_causal=True,
                                    causal_variant=_causal_variant(q, k, variant))
    selection = select_key_blocks_op(q, k, top_k=_fsa_top_k(attention, k), scale=scale, **settings)
    return selected_block_attention_op(q, k, v, selection, scale=scale, validate=False, sink_logits=sinks,
                                       **settings)


# Keyword arguments of transformers' attention calls (transformers 5.x models) that change the result. A call
# carrying one of the first kind goes to transformers' SDPA function, which computes it; one of the second kind
# raises, because neither the kernels nor that function compute it (it would drop the argument silently: on a tiny
# random gpt-oss, ignoring its sinks moved the logits by a relative L1 of 0.033 against eager attention, 0.005 once
# the sinks were set to -1e4). Learned sinks (``s_aux``: gpt-oss and others) and logit soft-capping (``softcap``: Gemma
# 2) are computed by the kernels and, where a call cannot run sparse, by :func:`eager_attention` instead of SDPA's
# function, which drops the sinks and raises on softcap (:class:`ScoreTerms`).
SDPA_COMPUTED_ARGUMENTS: dict[str, str] = {
    "sliding_window": "a sliding window",  # only where it hides keys (see SpargeLLMAttention.route)
    "position_bias": "a position bias (ALiBi or relative positions)",
}
UNCOMPUTED_ARGUMENTS: dict[str, str] = {
    "sinks": "per-token attention sinks (sinks)",
    "indices": "key indices chosen by the model (indices, e.g. DeepSeek sparse attention)",
    "block_indices": "key blocks chosen by the model (block_indices)",
}


@functools.cache
def _sdpa_function_parameters() -> frozenset[str]:
    """The named parameters of transformers' SDPA attention function (position_bias since transformers 5.x)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return frozenset(inspect.signature(sdpa_attention_forward).parameters)


def check_call_arguments(attention_mask: torch.Tensor | None, kwargs: dict) -> None:
    """Raise ValueError for an attention call that neither the kernels nor transformers' SDPA function compute
    correctly: one carrying an :data:`UNCOMPUTED_ARGUMENTS` entry, or a position bias together with sinks or a cap
    (or one this transformers version's SDPA function drops). Packed sequences given only by flash-attention's
    ``cu_seq_lens_q``/``cu_seq_lens_k`` are read by :func:`packed_segments` instead."""
    for name, what in UNCOMPUTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"SpargeLLMAttention: the model passes {what}, which neither the sparse kernels nor "
                             "transformers' SDPA function compute; load it with an attention implementation that "
                             "does (e.g. attn_implementation='eager')")
    if kwargs.get("position_bias") is not None and _score_terms(kwargs).any():
        raise ValueError("SpargeLLMAttention: the model passes a position bias together with attention sinks (s_aux) "
                         "or softcapping, which neither the sparse kernels nor the exact fallback compute; use "
                         "attn_implementation='eager'")
    if kwargs.get("position_bias") is not None and "position_bias" not in _sdpa_function_parameters():
        raise ValueError("SpargeLLMAttention: the model passes a position bias (position_bias), which this "
                         "transformers version's SDPA function (the fallback) does not add; upgrade transformers or "
                         "use attn_implementation='eager'")


def _packed_given(attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether the call describes packed sequences only by flash-attention's ``cu_seq_lens_q``/``cu_seq_lens_k``
    (more than one sequence and no mask; transformers' SDPA function, given no mask, would attend across them)."""
    return attention_mask is None and any(isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].numel() > 2
                                          for name in ("cu_seq_lens_q", "cu_seq_lens_k"))


def packed_segments(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> list[tuple[int, int, int]]:
    """The causal segments (:class:`CausalMaskLayout`'s, for the one batch row) of packed sequences given by
    ``cu_seq_lens_q``/``cu_seq_lens_k`` (cumulative lengths, one read-back): sequence s attends causally to itself,
    queries and keys cu[s]..cu[s + 1]. Raises ValueError where that is not what the arguments say (several batch
    rows, the two differing, fewer queries than keys, lengths that do not end at the sequence's) and under
    torch.compile (the lengths are tensors the graph would have to read)."""
    if compiling():
        raise ValueError("SpargeLLMAttention: packed sequences given only by cu_seq_lens_q/k (no mask) are read on the "
                         "host, which a compiled graph cannot do; pass position_ids without a cache (transformers "
                         "then builds the packed mask, read at run time) or run eagerly")
    lengths_q: Any = kwargs.get("cu_seq_lens_q")  # at least one of the two is a tensor (_packed_given)
    lengths_k: Any = kwargs.get("cu_seq_lens_k")
    lengths_k = lengths_q if lengths_k is None else lengths_k
    lengths_q = lengths_k if lengths_q is None else lengths_q
    n = query.shape[2]
    cumulative = lengths_q.flatten().tolist()
    if query.shape[0] != 1 or key.shape[2] != n or lengths_k.flatten().tolist() != cumulative \
            or cumulative[0] != 0 or cumulative[-1] != n or any(b <= a for a, b in zip(cumulative, cumulative[1:])):
        raise ValueError(f"SpargeLLMAttention: packed sequences given by cu_seq_lens_q/k must be one batch row of "
                         f"increasing offsets from 0 to its {n} queries and keys, the same for both (got "
                         f"cu_seq_lens_q={cumulative}, cu_seq_lens_k={lengths_k.flatten().tolist()}, batch "
                         f"{query.shape[0]}, {key.shape[2]} keys)")
    return [(start, end, start) for start, end in zip(cumulative, cumulative[1:])]


_MASKED_SCORE = torch.finfo(torch.float32).min  # the score of a key a boolean mask hides in eager_attention


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                    *, sinks: torch.Tensor | None = None, softcap: float | None = None, scale: float | None = None,
                    is_causal: bool = False, dropout: float = 0.0, max_scores: int = 1 << 26) -> torch.Tensor:
    """Exact attention with a layer's :class:`ScoreTerms` where a call does not run sparse (decode steps, masks the
    kernels do not take), as transformers' eager attention of gpt-oss and Gemma 2 computes it: the scores soft-capped
    (``softcap`` c: c * tanh(s / c)) before the mask, and each row's softmax taking one more logit, ``sinks[h]``, whose
    weight is dropped. transformers' SDPA function would drop the sinks and raises on softcap.

    query (B, H, Nq, D), key/value (B, H_kv, Nkv, D); ``attention_mask``: transformers' (B|1, 1, Nq, >= Nkv) mask,
    boolean (True = attend) or additive, or None (then causal, upper left, if ``is_causal`` and Nq > 1, as
    transformers' SDPA function decides). The products run in the inputs' dtype, as eager attention's do (no float32
    copy of the cache at each decode step), the softmax in float32; grouped-query heads as they come (no repeat of
    K/V); queries in chunks whose scores hold at most ``max_scores`` elements (not O(Nq * Nkv) at once). Autograd
    records through it. Returns (B, Nq, H, D) in query's dtype, as transformers' attention functions do.

    A boolean mask hides a key by the float32 minimum, not -inf, as eager attention's additive mask (the dtype's
    minimum) does: a query that sees no key (the padding queries of a left-padded batch, say) then gets the mean of
    the values (or, with a sink, zero) as under eager attention. With -inf such a row was NaN, and in the next layer
    0 x NaN in P.V made every real row NaN too (a tiny Gemma 2 on a left-padded batch of 300 tokens, session 55)."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"eager_attention: the query's {heads} heads must be a multiple of the key's {kv_heads}")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"eager_attention: sinks must hold one logit per query head, shape ({heads},), got "
                         f"{tuple(sinks.shape)}")
    # as the kernels take them: softcap 0 made every score 0 (uniform weights), a NaN one NaN rows
    softcap = check_softcap(softcap)
    group = heads // kv_heads
    scale = resolve_scale(scale, head_dim)
    grouped = query.reshape(batch, kv_heads, group, q_len, head_dim)
    keys_t, values = key[:, :, None].transpose(-1, -2), value[:, :, None]  # broadcast over each group's heads
    sink = None if sinks is None else sinks.float().view(1, kv_heads, group, 1, 1).to(query.device)
    rows = max(1, max_scores // max(batch * heads * kv_len, 1))
    parts = []
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        scores = (grouped[:, :, :, start:stop] @ keys_t).float() * scale  # (B, H_kv, group, rows, Nkv)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if attention_mask is not None:
            mask = attention_mask[:, :, start:stop, :kv_len][:, :, None]
            scores = scores.masked_fill(~mask, _MASKED_SCORE) if mask.dtype == torch.bool else scores + mask.float()
        elif is_causal and q_len > 1:
            positions = torch.arange(start, stop, device=query.device)
            scores = scores.masked_fill(torch.arange(kv_len, device=query.device)[None, :] > positions[:, None],
                                        -math.inf)
        if sink is not None:
            scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :kv_len]
        if dropout:
            probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
        parts.append(probs.to(value.dtype) @ values)
    # value's head dim, which may differ from the query's (MLA: DeepSeek's 128 against 192); reshaping to the
    # query's failed there
    out = torch.cat(parts, dim=3).reshape(batch, heads, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class PrefillMethod:
    """One way :class:`SpargeLLMAttention` computes a causal prefill call.

    ``eager(attention, q, k, v, scale, variant, stats)`` returns the (B, H, Nq, D) output, or ``(output,
    SparsityStats | None)`` when ``stats``; ``compiled(attention, q, k, v, scale, variant)`` is its form inside
    torch.compile (custom operators only, no statistics). Both take whole prompts and lower-right chunks against a
    cache (``variant``). ``takes_window``: both also take a sliding window (``window=W``) that hides keys;
    ``takes_sinks``: both also take learned sink logits (``sinks=``, one per query head); ``takes_softcap``: logit
    soft-capping (``softcap=``)."""

    eager: Callable[..., Any]
    compiled: Callable[..., torch.Tensor]
    takes_window: bool = False
    takes_sinks: bool = False
    takes_softcap: bool = False


PREFILL_METHODS: dict[str, PrefillMethod] = {
    "sparge": PrefillMethod(_sparge_prefill, _sparge_compiled, takes_window=True, takes_sinks=True, takes_softcap=True),
    "s2o": PrefillMethod(_s2o_prefill, _s2o_compiled, takes_sinks=True),
    "fsa": PrefillMethod(_fsa_prefill, _fsa_compiled, takes_sinks=True),
}


_FLAGS = ("attention_sink", "strict", "collect_stats")
_CHECKED_OPTIONS = ("method", "pbs_segment", "s2o_segment", "min_padded_tokens", "min_predicted_window",
                    "min_segment_queries", "top_k", "block_size", "tau", *THRESHOLD_RANGES, *_FLAGS)


@dataclass
class SpargeLLMAttention:
    """A transformers attention function (``AttentionInterface``) computing causal prefill sparsely (SpargeAttn by
    default, or S2O or FSA: ``method``).

    Which calls run sparse (the rest go to transformers' SDPA function):

    - no mask and more than one query: causal attention as SDPA's ``is_causal`` computes it, so with fewer queries
      than keys (a static cache's prefill, where transformers leaves the mask out) the upper-left variant;
    - an explicit boolean mask that is exactly the lower-right causal mask (query i sees keys 0..i + Nkv - Nq):
      chunked prefill against a KV cache (``generate(..., prefill_chunk_size=...)``, a prompt continued on a
      cache). Against a static cache (``cache_implementation="static"``, ``StaticCache``) the mask also hides the
      slots not filled yet from every query; the call then attends to the filled ones only (L keys, lower right;
      transformers 4.x masks a static cache's first prefill so too). The mask is compared with the pattern once
      per mask tensor (transformers hands every layer of a forward the same one): one pass over it on its device
      and one read-back (a device sync per forward); :func:`read_causal_mask`.
    - the same mask with each prompt's first keys hidden: a left-padded batch (``tokenizer(..., padding=True)``
      with ``padding_side="left"``, as ``generate`` wants), whole or chunked, of at least ``min_padded_tokens``
      keys. Each prompt then runs as its own call without its padding (rows of padding queries get zeros, as
      from SDPA), and its stats are joined over the batch (:meth:`SparsityStats.concat`).
    - the same mask with each prompt's keys from its length on hidden from every query: a right-padded batch
      (``padding_side="right"``, or ``padding="max_length"``), of at least ``min_padded_tokens`` keys, whole or
      chunked, against a static cache too (its empty slots never read). Each prompt's real queries run as one causal
      call on its keys; its padding queries, which see all of them under this mask (under a sliding window those
      still in their window), by exact attention (SDPA, or :func:`eager_attention` with sinks or a cap), so that the
      output equals SDPA's at every position whose query sees a key (those past a window's reach get zeros, as left
      padding's do).
    - a mask that restarts causal attention within a prompt, each query seeing one run of keys that ends at its
      causal end: Llama 4's chunked-attention layers (chunks of ``attention_chunk_size`` positions, counted from
      each prompt's first real token; whole, padded on either side or against a cache) and sequences packed in one
      row. Each chunk or sequence runs as its own lower-right causal call on its keys (a one-prompt batch's full
      chunks as one call, the chunks as its batch), where they average at least ``min_segment_queries`` queries per
      call; a right-padded batch's padding queries, which see their chunk's real keys or none, get exact attention
      over them or zeros. Packed sequences given without a mask, by flash-attention's ``cu_seq_lens_q``/
      ``cu_seq_lens_k`` only, run so too (eagerly; :func:`packed_segments`), whatever their length: SDPA's function
      would attend across them.

    A layer with a sliding window (``sliding_window``: Mistral, Gemma 3's local layers, ...) runs sparse too. Where
    the window hides no key (no query sees more keys than it holds: without a mask the query count, with one the
    mask's keys in use) the call is plain causal attention; where it does, transformers' sliding mask is read with
    the window (:func:`read_causal_mask`) and the kernels take it (``sparge_attention(..., sliding_window=W)``:
    blocks outside every query's window skipped, those it cuts masked element by element). The ``"s2o"`` and
    ``"fsa"`` methods and ``pbs_segment`` take no window: such calls go to SDPA under the mask, with a warning.
    Windows shorter than ``min_predicted_window`` keys keep every block in them (no stage 1).

    Learned attention sinks (``s_aux``, one logit per query head: gpt-oss and others) reach the kernels as
    ``sink_logits``, under every method; logit soft-capping (``softcap``: Gemma 2) as ``softcap``, under "sparge"
    (with or without ``pbs_segment``). Where a call with either cannot run sparse (decode steps, other masks, S2O or
    FSA with softcap) it goes to :func:`eager_attention` instead of SDPA's function.

    Under torch.compile a call without a mask is one node per kernel operator; a call with a mask is one node of the
    operator ``sparge_diffusers::llm_masked_prefill``, which reads the mask at run time and routes the call as above
    (a device sync, so it stays out of CUDA graphs: ``mode="reduce-overhead"`` splits the graph around it). Compiled
    calls record statistics and ``sparse_calls`` only with ``collect_stats=True``: unmasked calls then go through the
    operator ``sparge_diffusers::llm_prefill``, which runs the call as an eager one and records it when it runs (kept
    out of CUDA graphs too, whose replays would skip the recording).

    Args:
        method: how a sparse call selects its keys (:data:`PREFILL_METHODS`): ``"sparge"`` (SpargeAttn: stage 1's
            TopCdf block mask), ``"s2o"`` (S2O: key blocks ranked by compressed score, stopped once the softmax
            normaliser stops growing; :func:`s2o_attention`) or ``"fsa"`` (NSA's selection of ``top_k`` key blocks
            per query token, computed by FSA's KV-outer kernel; :func:`selected_block_attention`). Each takes whole
            prompts, chunks against a cache and calls under torch.compile (through its custom operators).
            ``"fsa"``'s statistics count (query, key) pairs (:func:`selection_sparsity`), not block products.
        simthreshd1, cdfthreshd, pvthreshd, attention_sink: as in :func:`sparge_attention` (upstream names;
            ``attention_sink`` keeps the first key block of every query block, as LLMs' sink token needs);
            ``"s2o"`` takes all but cdfthreshd, ``"fsa"`` none (it always keeps the first block).
        min_padded_tokens: a left-padded batch runs one call per prompt only from this many keys (its padded length)
            on; shorter ones go to SDPA under the mask, with a warning. Each call costs 0.3-0.5 ms of host time, which
            short prompts do not repay (H100, one attention call of Llama-3.1-8B's heads, benchmarks/padded_batch.py:
            64 prompts of 256-512 tokens 25.1 ms against 2.0 ms under the mask; 16 of 3-4K 5.5 against 15.4 ms; 4 of
            4-16K 7.7 against 62.3 ms). 0: every left-padded batch runs per prompt.
        min_segment_queries: a chunked or packed mask (above) runs one call per segment only where its calls average
            at least this many queries; shorter ones go to SDPA under the mask, with a warning. Each call costs host
            time: on an H100, 8192 tokens of Llama-4-Scout's heads packed as unequal sequences averaging 512 tokens
            took 5.00-5.71 ms against SDPA's 4.21-4.24 (wall time, two runs), at 1024 tokens 2.64-2.77 against
            4.21-4.23 (benchmarks/chunked_attention.py). 0: every such mask runs per segment.
        min_predicted_window: a sliding window shorter than this many keys (Gemma 3's local layers, gpt-oss's 128)
            runs every block in the window, without stage 1 (``cdfthreshd=1.0`` for that call). On an H100 stage 1
            costs more than it saves there and its error grows as the window narrows: 32K tokens, Llama-3.1-8B
            heads, a 1024-key window 1.16 ms every block against 1.26 ms at default thresholds (relative L1 0.002
            against 0.064); gpt-oss-20b heads, 128 keys, 0.75 against 0.87 ms (0.002 against 0.17); at Mistral's
            4096 stage 1 pays (3.37 against 3.44 ms). Method "sparge" only; 0 predicts in every window.
        tau, s2o_segment: :func:`s2o_attention`'s ``tau`` (early-stop threshold) and ``segment`` (the causal
            segment of dense key blocks), for ``method="s2o"``.
        top_k, block_size: key blocks each query token keeps, and keys per block (32, 64 or 128), for
            ``method="fsa"`` (:func:`select_key_blocks`).
        strict: raise instead of falling back to SDPA for a call that cannot run sparse (decode steps always
            use SDPA: that is where a sparse prefill kernel does not apply).
        collect_stats: keep each sparse call's :class:`SparsityStats` in ``stats`` (on the device until read), also
            under torch.compile (see above).
        pbs_segment: sort keys within segments of this many positions first (PBS-Attn,
            :func:`pbs_sparge_attention`); None: keys in order. Whole prompts and chunks against a cache (ranked
            by the chunk's last queries), eager and under torch.compile (:func:`pbs_sparge_attention_op`).
    """

    simthreshd1: PerHead = 0.6
    cdfthreshd: PerHead = 0.98
    pvthreshd: PerHead | None = 50
    attention_sink: bool = True
    pbs_segment: int | None = None
    min_padded_tokens: int = 4096
    min_predicted_window: int = 4096
    min_segment_queries: int = 1024
    method: str = "sparge"
    tau: PerHead | None = 0.0005
    s2o_segment: int = 2048
    top_k: int = 16
    block_size: int = 64
    strict: bool = False
    collect_stats: bool = False
    sparse_calls: int = 0  # calls answered by sparge_attention (the rest went to SDPA); a padded batch counts one

    def __post_init__(self):
        self._check_options(self._options())  # here, not at the model's first prefill
        self._warned: set[str] = set()
        self.stats: list[SparsityStats] = []
        # the last two masks read: [(weakref to a mask, (its version, Nq, Nkv, window), its layout)], latest last
        self._mask_verdicts: list[tuple] = []
        # the last cu_seq_lens read: (weakrefs to cu_seq_lens_q / _k or None, their versions and the call's sizes,
        # its layout)
        self._packed_verdict: tuple | None = None
        self._handle = next(_HANDLES)  # how the masked-prefill operator finds this function at run time
        _LIVE_FUNCTIONS[self._handle] = self

    def _options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _CHECKED_OPTIONS}

    def __setattr__(self, name: str, value: Any) -> None:
        # an option set later is checked too (attention.method = "bogus" failed inside the model's forward)
        if name in _CHECKED_OPTIONS and "_handle" in self.__dict__:  # (during __init__: __post_init__ checks)
            self._check_options({**self._options(), name: value})
        object.__setattr__(self, name, value)

    @staticmethod
    def _check_options(options: dict[str, Any]) -> None:
        method, pbs_segment, s2o_segment = options["method"], options["pbs_segment"], options["s2o_segment"]
        if method not in PREFILL_METHODS:
            raise ValueError(f"method must be one of {sorted(PREFILL_METHODS)}, got {method!r}")
        if pbs_segment is not None and (not isinstance(pbs_segment, int) or pbs_segment <= 0 or pbs_segment % 64):
            raise ValueError(f"pbs_segment must be None or a positive multiple of 64, got {pbs_segment!r}")
        if pbs_segment is not None and method != "sparge":
            raise ValueError(f"pbs_segment pairs the key permutation with SpargeAttn's stage 1 (method='sparge'), "
                             f"not method={method!r}")
        if not isinstance(s2o_segment, int) or s2o_segment <= 0 or s2o_segment % 128:
            raise ValueError(f"s2o_segment must be a positive multiple of 128, got {s2o_segment!r}")
        for name in ("min_padded_tokens", "min_predicted_window", "min_segment_queries"):
            if not isinstance(options[name], int) or isinstance(options[name], bool) or options[name] < 0:
                raise ValueError(f"{name} must be an int >= 0, got {options[name]!r}")
        check_positive_int(options["top_k"], "top_k")  # (True was read as 1)
        if not isinstance(options["block_size"], int) or options["block_size"] not in (32, 64, 128):  # (64.0 passed)
            raise ValueError(f"block_size must be 32, 64 or 128, got {options['block_size']!r}")
        for name in (*THRESHOLD_RANGES, "tau"):  # (tau was first checked inside the model's forward)
            check_threshold_values(name, options[name])
        for name in _FLAGS:  # (attention_sink="False" was read by its truth)
            check_flag(options[name], name)

    def route(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float, is_causal: bool | None, kwargs: dict
              ) -> tuple[str | None, str | None, CausalMaskLayout | None, int | None]:
        """(why this call cannot run sparse: None when it can, "" for the expected SDPA case of a decode step;
        the causal variant it runs with: "upper_left" without a mask, "lower_right" with a lower-right mask, None
        for a mask under torch.compile, whose contents decide at run time (:meth:`_masked_call`); the mask's
        :class:`CausalMaskLayout` (keys in use, left padding) where there is one, else None; the sliding window it
        runs with where the window hides keys from some query, else None)."""
        check_call_arguments(attention_mask, kwargs)  # before the decode step, which SDPA would get wrong as well
        if query.shape[2] == 1:
            return "", None, None, None  # decode step
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            return "a non-causal attention module", None, None, None
        if dropout:
            return "dropout", None, None, None
        for name, what in SDPA_COMPUTED_ARGUMENTS.items():
            if name != "sliding_window" and kwargs.get(name) is not None:
                return what, None, None, None
        reason = unsupported_reason(query, key, value, is_causal=True, causal_variant="upper_left")  # shapes only
        if reason is not None:
            return reason, None, None, None
        window = kwargs.get("sliding_window")
        verdict: tuple[str | None, str | None, CausalMaskLayout | None]
        if _packed_given(attention_mask, kwargs):
            layout = self._packed_layout(query, key, kwargs)  # each sequence attends to itself only
            verdict = None, "lower_right", layout
            assert layout.segments is not None  # (a packed layout's runs)
            span = max(end - first for first, end, _ in layout.segments[0])
        elif attention_mask is None:
            verdict = None, "upper_left", None  # SDPA's is_causal, which transformers' SDPA function would use here
            span = query.shape[2]  # query i sees keys 0..i
        elif compiling():
            verdict = None, None, None  # the mask is read at run time, inside an operator
            span = key.shape[2]  # so any key may be seen
        else:
            verdict = self._mask_route(attention_mask, query.shape[2], key.shape[2], window)
            span = _layout_span(verdict[2], query.shape[2], key.shape[2])
        reason, window = self._window_route(window, span)
        if reason is None:
            reason = self._terms_reason(_score_terms(kwargs))
        return (reason, None, None, None) if reason is not None else (*verdict, window)

    def _terms_reason(self, terms: ScoreTerms) -> str | None:
        """Why a call with these :class:`ScoreTerms` cannot run sparse, None when it can."""
        method = PREFILL_METHODS[self.method]
        for present, taken, what in ((terms.sinks is not None, method.takes_sinks, "attention sinks (s_aux)"),
                                     (terms.softcap is not None, method.takes_softcap, "softcapping")):
            if present and not taken:
                return f"{what}, which the {self.method!r} method does not take"
        return None

    def _window_route(self, window: int | None, span: int) -> tuple[str | None, int | None]:
        """(why a call whose queries see up to ``span`` keys cannot run sparse under its sliding window, None when
        it can; the window it runs with, None where the window hides no key)."""
        if window is None or span <= window:
            # query q sees key k only if q - k < window (transformers' sliding_window_overlay): a call whose queries
            # see at most `window` keys back is plain causal attention (Mistral's 4096-key window, Gemma 3's local
            # layers on short prompts)
            return None, None
        # PBS's permuted keys take no window: its edge cuts through the permuted segments
        if not PREFILL_METHODS[self.method].takes_window or self.pbs_segment is not None:
            method = f"{self.method!r}" + (" (with pbs_segment)" if self.pbs_segment is not None else "")
            return (f"a sliding window ({window} keys) shorter than the keys this call sees ({span}), which the "
                    f"{method} method does not take"), None
        return None, window

    def _mask_route(self, mask: torch.Tensor, q_len: int, kv_len: int, window: int | None = None
                    ) -> tuple[str | None, str | None, CausalMaskLayout | None]:
        """:meth:`route`'s verdict on an explicit mask, from its contents (one read-back per mask tensor); with the
        call's ``window`` the mask may also hide keys outside it."""
        layout = self._mask_layout(mask, q_len, kv_len, window)
        if layout is None:
            return "an explicit attention mask (a per-query or custom mask)", None, None
        if layout.segments is not None:
            groups = {tuple(row) for row in layout.segments}  # rows sharing their segments run together
            rows = mask.shape[0] if len(groups) == 1 else 1
            offset = layout.keys - q_len if layout.query_start is None else layout.query_start
            calls = sum(len(_stacked_segments(list(row), offset, rows)) for row in groups)
            queries = sum(end - first for row in groups for first, end, _ in row)
            if queries < calls * self.min_segment_queries:
                return (f"a mask of causal segments (chunked attention or packed sequences) averaging fewer than "
                        f"min_segment_queries={self.min_segment_queries} queries per call ({calls} calls, which "
                        f"would cost more than SDPA under the mask)"), None, None
        # a left-padded mask of segments is held to min_segment_queries alone (as before session 60); a right-padded
        # one, whose padding rows cost calls of their own, to min_padded_tokens as well
        padded = layout.ends is not None or (any(layout.padding) and layout.segments is None)
        if padded and layout.keys < self.min_padded_tokens:
            side = "left" if layout.ends is None else "right"
            return (f"a {side}-padded batch of fewer than min_padded_tokens={self.min_padded_tokens} keys (one call "
                    "per prompt would cost more than SDPA under the mask)"), None, None
        return None, "lower_right", layout

    def _mask_layout(self, mask: torch.Tensor, q_len: int, kv_len: int, window: int | None = None
                     ) -> CausalMaskLayout | None:
        """:func:`read_causal_mask` of the mask, remembered for the mask tensor (while it lives, unmodified):
        transformers hands every layer of a forward the same one, or, in a model that alternates sliding-window and
        global layers (Gemma 3), one to each kind; the last two are kept, so each is read once per forward."""
        key = (mask._version, q_len, kv_len, window)
        for held, held_key, layout in self._mask_verdicts:
            if held() is mask and held_key == key:
                return layout
        result = read_causal_mask(mask, q_len, kv_len, sliding_window=window)
        self._mask_verdicts = self._mask_verdicts[-1:] + [(weakref.ref(mask), key, result)]
        return result

    def _packed_layout(self, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> CausalMaskLayout:
        """:func:`packed_segments` as a layout, remembered for the ``cu_seq_lens_q/k`` tensors (while they live,
        unmodified): transformers hands every layer of a forward the same ones, so they are read back once per
        forward, not once per layer (each read-back a device sync)."""
        given = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k")]
        stamp = ([t._version if isinstance(t, torch.Tensor) else t for t in given], query.shape[0], query.shape[2],
                 key.shape[2])
        held = self._packed_verdict
        if held is not None and not compiling() and held[1] == stamp \
                and all((ref() if ref is not None else None) is t for ref, t in zip(held[0], given)):
            return held[2]
        layout = CausalMaskLayout(key.shape[2], [0], [packed_segments(query, key, kwargs)])
        refs = [weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in given]
        self._packed_verdict = (refs, stamp, layout)
        return layout

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """query (B, H, N, D), key/value (B, H_kv, N, D) -> ((B, N, H, D), None), as transformers' SDPA function."""
        reason, variant, layout, window = self.route(module, query, key, value, attention_mask, dropout, is_causal,
                                                     kwargs)
        terms = _score_terms(kwargs)
        if reason is not None and _packed_given(attention_mask, kwargs) and query.shape[2] > 1:
            raise ValueError(f"SpargeLLMAttention: packed sequences given only by cu_seq_lens_q/k, which only the "
                             f"sparse path reads, and {reason}, which it does not take: transformers' SDPA function "
                             f"would attend across the sequences; use attn_implementation='flash_attention_2'")
        if reason is not None:
            if reason:
                self._warn(reason, terms)
            if terms.any():  # transformers' SDPA function would drop the sinks, and raises on softcap
                causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
                return eager_attention(query, key, value, attention_mask, sinks=terms.sinks, softcap=terms.softcap,
                                       scale=scaling, is_causal=causal, dropout=dropout), None
            return _sdpa_function(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        if variant == "upper_left" and key.shape[2] > query.shape[2]:
            # a static cache's first prefill: query i sees keys 0..i, so the slots past the prompt are never read
            key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
        if compiling():
            # one node of the compiled graph per operator (see kernels/library.py); statistics and the call count are
            # recorded by the llm operators when they run (a Python counter updated while tracing would be a guard
            # that recompiles at every call)
            if attention_mask is not None:
                window = kwargs.get("sliding_window")  # whether it hides keys depends on the mask: decided there
                return torch.ops.sparge_diffusers.llm_masked_prefill(query, key, value, attention_mask, scaling,
                                                                     self._handle, window, *terms), None
            if self.collect_stats:
                return torch.ops.sparge_diffusers.llm_prefill(query, key, value, scaling, variant, self._handle,
                                                              window, *terms), None
            compiled = PREFILL_METHODS[self.method].compiled
            out = compiled(self, query, key, value, scaling, variant, **_method_extras(window, terms))
            return out.transpose(1, 2).contiguous(), None
        out, stats = self._sparse_call(query, key, value, scaling, variant, layout, window, terms)
        self._record(stats)
        return out, None

    def _sparse_call(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                     variant: str | None, layout: CausalMaskLayout | None, window: int | None = None,
                     terms: ScoreTerms = NO_TERMS) -> tuple[torch.Tensor, SparsityStats | None]:
        """A routed sparse call, eager or inside an operator: the (B, Nq, H, D) output and its stats when collected.
        With a mask's layout, only the keys in use are attended (a static cache's empty slots are left out: views,
        no copy). ``window``: a sliding window that hides keys from some query (None: none that does); ``terms``: the
        layer's :class:`ScoreTerms`."""
        if layout is not None and layout.ends is not None:
            return self._right_padded_prefill(query, key, value, layout, scale, window, terms)
        if layout is not None and layout.keys < key.shape[2]:
            key, value = key[:, :, :layout.keys], value[:, :, :layout.keys]
        if layout is not None and (layout.segments is not None or any(layout.padding)):
            segments = layout.segments if layout.segments is not None else \
                _padding_segments(layout.padding, query.shape[2], key.shape[2])
            return self._segmented_prefill(query, key, value, segments, scale, window, terms)
        out, stats = self._prefill(query, key, value, scale, variant, window, terms)
        return out.transpose(1, 2).contiguous(), stats

    def _record(self, stats: SparsityStats | None) -> None:
        """Count a sparse call and keep its stats (None: not collected)."""
        if stats is not None:
            self.stats.append(stats)
        self.sparse_calls += 1

    def _masked_call(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float | None, window: int | None = None, terms: ScoreTerms = NO_TERMS) -> torch.Tensor:
        """A call with an explicit mask under torch.compile, run eagerly inside the ``llm_masked_prefill`` operator:
        the mask's contents route it as :meth:`__call__` routes an eager call (sparse for the lower-right and
        left-padded masks, also cut by the layer's sliding ``window`` if any, else SDPA under the mask, with one
        warning); a sparse call is counted and its statistics kept with ``collect_stats``. Returns (B, Nq, H, D)."""
        reason, variant, layout = self._mask_route(mask, query.shape[2], key.shape[2], window)
        if reason is None:
            reason, window = self._window_route(window, _layout_span(layout, query.shape[2], key.shape[2]))
        if reason is None:
            reason = self._terms_reason(terms)
        if reason is not None:
            self._warn(reason, terms)
            return _exact_attention(query, key, value, scale, terms, mask[:, :, :, :key.shape[2]]).contiguous()
        out, stats = self._sparse_call(query, key, value, scale, variant, layout, window, terms)
        if self.collect_stats:
            self._record(stats)
        return out

    def _compiled_call(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                       variant: str | None, window: int | None = None, terms: ScoreTerms = NO_TERMS
                       ) -> torch.Tensor:
        """A call without a mask under torch.compile with ``collect_stats``, run eagerly inside the ``llm_prefill``
        operator: counted, its statistics kept. Returns (B, Nq, H, D)."""
        out, stats = self._sparse_call(query, key, value, scale, variant, None, window, terms)
        self._record(stats)
        return out

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                 variant: str | None, window: int | None = None, terms: ScoreTerms = NO_TERMS
                 ) -> tuple[torch.Tensor, SparsityStats | None]:
        """One causal call without padding, by the configured method: (B, H, Nq, D) output, its stats when
        collected."""
        out = PREFILL_METHODS[self.method].eager(self, query, key, value, scale, variant, self.collect_stats,
                                                 **_method_extras(window, terms))
        return out if self.collect_stats else (out, None)

    def _segmented_prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           segments: list[list[tuple[int, int, int]]], scale: float | None, window: int | None = None,
                           terms: ScoreTerms = NO_TERMS) -> tuple[torch.Tensor, SparsityStats | None]:
        """Queries in causal segments (:class:`CausalMaskLayout`'s ``segments``, one list per batch row or one for
        the whole batch): each segment runs as its own lower-right causal call on its keys, as if alone. This runs
        left-padded prompts without their padding, and Llama 4's attention chunks and packed sequences each on
        their own keys. Rows that share their segments run as one batch. Rows of queries in no segment (padding
        queries, which see no key) stay zero, as SDPA's math backend gives them (its GPU kernels under a mask
        give such rows other finite values; they feed no real token). Returns the (B, Nq, H, D) output and, when
        collected, the calls' stats joined (:meth:`SparsityStats.concat`)."""
        batch, q_len = query.shape[0], query.shape[2]
        offset = key.shape[2] - q_len  # positions of the keys before the first query (the cache)
        out = query.new_zeros(batch, q_len, query.shape[1], query.shape[3])
        if all(row == segments[0] for row in segments):
            groups = [(slice(0, batch), segments[0])]
        else:
            groups = [(slice(b, b + 1), row) for b, row in enumerate(segments)]
        parts = []
        for rows, row_segments in groups:
            for first, end, first_key, count in _stacked_segments(row_segments, offset, rows.stop - rows.start):
                # `count` equal segments back to back, each on its own keys (Llama 4's full chunks): one call, the
                # segments as its batch (views; the query row holds one prompt)
                n, n_kv = (end - first) // count, (end + offset - first_key) // count
                q = query[rows, :, first:end].unflatten(2, (count, n)).movedim(2, 1).flatten(0, 1)
                k, v = (t[rows, :, first_key:end + offset].unflatten(2, (count, n_kv)).movedim(2, 1).flatten(0, 1)
                        for t in (key, value))
                o, s = self._prefill(q, k, v, scale, "lower_right", window, terms)
                out[rows, first:end] = o.unflatten(0, (-1, count)).movedim(1, 2).flatten(2, 3).transpose(1, 2)
                if s is not None:
                    parts.append(s)
        return out, (SparsityStats.concat(parts) if parts else None)

    def _right_padded_prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              layout: CausalMaskLayout, scale: float | None, window: int | None = None,
                              terms: ScoreTerms = NO_TERMS) -> tuple[torch.Tensor, SparsityStats | None]:
        """A right-padded batch (:class:`CausalMaskLayout` with ``ends``; its first query at position
        ``query_start``; a static cache's slots past the last query's position are never read): each prompt's real
        queries as one lower-right causal call on its keys 0..ends[b] - 1 (under the sliding ``window`` if one hides
        keys), or, where the layout restarts causal attention (``segments``: Llama 4's chunks, packed sequences),
        one call per segment (:meth:`_segmented_prefill`); rows alike run as one batch. Its padding queries see all
        of those keys (or those still in their window, or from their chunk's or sequence's first key on:
        ``padding_runs``) and get exact attention over them (SDPA, or :func:`eager_attention` with sinks or a cap),
        so that every row is what SDPA under the mask gives; padding queries that see no key (past their window's
        reach, or in a chunk after the prompt's) get zeros, as left padding's do. Padding queries feed no real
        token's output in any layer (every query's mask hides their keys), so their rows are computed exactly rather
        than sparsely only to match SDPA's output everywhere. Returns (B, Nq, H, D) and the calls' stats when
        collected."""
        batch, heads, q_len, head_dim = query.shape
        ends, offset = layout.ends, layout.query_start
        assert ends is not None and offset is not None  # (a right-padded layout)
        per_row = len(ends) == batch  # (else one mask row for the whole batch)

        def row_layout(b: int) -> tuple:
            b = b if per_row else 0
            return (ends[b], None if layout.segments is None else layout.segments[b],
                    None if layout.padding_runs is None else layout.padding_runs[b])

        out = query.new_empty(batch, q_len, heads, head_dim)
        parts = []
        start = 0
        for b in range(1, batch + 1):
            if b < batch and row_layout(b) == row_layout(start):
                continue
            (end, segments, padding_runs), rows = row_layout(start), slice(start, b)
            start = b
            real = min(q_len, max(0, end - offset))  # queries at positions before `end`: the real tokens
            k, v = key[rows, :, :end], value[rows, :, :end]
            stats = None
            if real and segments is not None:
                out[rows, :real], stats = self._segmented_prefill(query[rows, :, :real], k, v, [segments], scale,
                                                                  None, terms)
            elif real:
                # the window where it hides a key from these queries (the batch's may hide keys only from padding
                # queries: see _layout_span), so that a prompt shorter than it runs as without one
                hides = window if window is not None and end > window else None
                o, stats = self._prefill(query[rows, :, :real], k, v, scale, "lower_right", hides, terms)
                out[rows, :real] = o.transpose(1, 2)
            if stats is not None:
                parts.append(stats)
            out[rows, real:] = 0  # padding queries that see no key keep these zeros, as left padding's do
            if padding_runs is not None:  # each run sees keys first key..end - 1
                for first, stop, first_key in padding_runs:
                    out[rows, first:stop] = _exact_attention(query[rows, :, first:stop], k[:, :, first_key:],
                                                             v[:, :, first_key:], scale, terms)
                continue
            # padding queries up to `reach` see keys (with a window: those from p - window + 1 on); those after see
            # none (all of them where the prompt shows no key: end = 0)
            reach = 0 if end == 0 else q_len if window is None else min(q_len, max(real, end + window - 1 - offset))
            if real < reach:
                mask = None
                if window is not None:
                    positions = torch.arange(offset + real, offset + reach, device=query.device)[:, None]
                    mask = (torch.arange(end, device=query.device)[None, :] > positions - window)[None, None]
                out[rows, real:reach] = _exact_attention(query[rows, :, real:reach], k, v, scale, terms, mask)
        return out, (SparsityStats.concat(parts) if parts else None)

    def _warn(self, reason: str, terms: ScoreTerms = NO_TERMS) -> None:
        """Raise under ``strict``, else warn once per reason, naming where the call goes: SDPA, or with sinks or a
        cap (``terms``) the exact :func:`eager_attention`."""
        target = "exact attention (llm.eager_attention)" if terms.any() else "SDPA"
        if self.strict:
            raise ValueError(f"SpargeLLMAttention: {reason}; strict=True forbids falling back to {target}")
        warn_once(f"SpargeLLMAttention: falling back to {target}: {reason}", self._warned, stacklevel=3)


# SpargeLLMAttention functions by handle, for the operator below (a compiled graph holds the handle, an int; handles
# are never reused, so a graph that outlives its function fails instead of finding another one)
_LIVE_FUNCTIONS: weakref.WeakValueDictionary[int, SpargeLLMAttention] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _score_terms(kwargs: dict) -> ScoreTerms:
    """The :class:`ScoreTerms` of a transformers attention call's keyword arguments."""
    softcap = kwargs.get("softcap")
    return ScoreTerms(kwargs.get("s_aux"), None if softcap is None else float(softcap))


def _method_extras(window: int | None, terms: ScoreTerms) -> dict[str, Any]:
    """A prefill method's optional keyword arguments for one call: only those it has (:class:`PrefillMethod`)."""
    extras: dict[str, Any] = {}
    if window is not None:
        extras["window"] = window
    if terms.sinks is not None:
        extras["sinks"] = terms.sinks
    if terms.softcap is not None:
        extras["softcap"] = terms.softcap
    return extras


def _sdpa_function(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
                   kwargs: dict) -> tuple[torch.Tensor, None]:
    """The fallback: transformers' SDPA function, as ``attn_implementation="sdpa"`` calls it, but for one call.

    Under a mask, a query count above one and one K/V head for several query heads, that function's ``repeat_kv``
    hands SDPA views of K and V whose head stride is 0, and torch 2.11's memory-efficient kernel misreads them
    (pytorch/pytorch#191937, fixed after 2.11): relative L1 0.023-0.029 on an H200 with cuDNN's SDPA off, against
    0.001-0.002 on contiguous copies (docs/testing.md, "Sanitizers on the GPU"). That call gets contiguous copies
    here, as ``repeat_kv`` gives every model with more K/V heads, and otherwise the SDPA call the function makes
    (a mask and more than one query: not causal; no position bias, which stays with the function). Decode steps keep
    the function's path: one query was not misread in the cases measured, and a copy of the cache per step would
    cost more. The CPU takes the same path, so that the tests run it."""
    group = query.shape[1]
    if (attention_mask is not None and query.shape[2] > 1 and key.shape[1] == 1 < group
            and getattr(module, "num_key_value_groups", 1) == group and kwargs.get("position_bias") is None
            and query.device.type in ("cuda", "cpu")):
        key, value = (x.expand(-1, group, -1, -1).contiguous() for x in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                     terms: ScoreTerms, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention under ``mask`` alone (no causal mask of its own): SDPA (grouped-query heads as they come), or
    with sinks or a cap :func:`eager_attention`. query (B, H, Nq, D), key/value (B, H_kv, Nkv, D); ``mask``: None
    (every query sees every key) or transformers' (B|1, 1, Nq, Nkv) mask, boolean (True = attend) or additive.
    Returns (B, Nq, H, D)."""
    if terms.any():
        return eager_attention(query, key, value, mask, sinks=terms.sinks, softcap=terms.softcap, scale=scale)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def _stacked_segments(segments: list[tuple[int, int, int]], offset: int, batch: int
                      ) -> list[tuple[int, int, int, int]]:
    """``segments`` (first query, end query, first key) as calls (first query, end query, first key, count): runs of
    segments of one length, back to back, each on the keys at its own positions (first key = first query +
    ``offset``), join one call of ``count`` segments where the batch holds one row (more rows would not stay a
    view); the rest are calls of one segment. The last query of a segment sees its causal end."""
    calls: list[tuple[int, int, int, int]] = []
    for first, end, first_key in segments:
        if batch == 1 and calls and first_key == first + offset:
            start, stop, start_key, count = calls[-1]
            if stop == first and start_key == start + offset and end - first == (stop - start) // count:
                calls[-1] = (start, end, start_key, count + 1)
                continue
        calls.append((first, end, first_key, 1))
    return calls


def _padding_segments(padding: list[int], q_len: int, kv_len: int) -> list[list[tuple[int, int, int]]]:
    """The causal segments of a left-padded mask (:class:`CausalMaskLayout`'s ``padding``, per mask row): prompt
    b's queries from its first real one on, on its keys from padding[b] on (none where every query is padding)."""
    offset = kv_len - q_len
    return [[(max(0, pad - offset), q_len, pad)] if pad - offset < q_len else [] for pad in padding]


def _live_function(handle: int, operator: str) -> SpargeLLMAttention:
    attention = _LIVE_FUNCTIONS.get(handle)
    if attention is None:
        raise RuntimeError(f"sparge_diffusers::{operator}: the SpargeLLMAttention this graph was compiled with no "
                           "longer exists; compile the model again")
    return attention


@torch.library.custom_op("sparge_diffusers::llm_masked_prefill", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _llm_masked_prefill_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                           scale: float | None, handle: int, window: int | None = None,
                           sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """A compiled model's prefill call with an explicit mask (and the layer's sliding window and sink logits, if
    any): :meth:`SpargeLLMAttention._masked_call` of the function ``handle`` names. Its route depends on the mask's
    contents (a read-back), hence an operator opaque to the compiler and kept out of CUDA graphs."""
    return _live_function(handle, "llm_masked_prefill")._masked_call(query, key, value, mask, scale, window,
                                                                     ScoreTerms(sinks, softcap))


@torch.library.custom_op("sparge_diffusers::llm_prefill", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _llm_prefill_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                    variant: str | None, handle: int, window: int | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """A compiled model's prefill call without a mask when its function collects statistics:
    :meth:`SpargeLLMAttention._compiled_call`. It records the call when it runs, so it stays out of CUDA graphs (a
    replay would skip the recording)."""
    return _live_function(handle, "llm_prefill")._compiled_call(query, key, value, scale, variant, window,
                                                                ScoreTerms(sinks, softcap))


def _transformers_output(query: torch.Tensor) -> torch.Tensor:
    """An empty (B, Nq, H, D) output, as transformers' attention functions return it (the llm operators' fake)."""
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


@_llm_prefill_op.register_fake
def _(query, key, value, scale, variant, handle, window=None, sinks=None, softcap=None):
    return _transformers_output(query)


@_llm_masked_prefill_op.register_fake
def _(query, key, value, mask, scale, handle, window=None, sinks=None, softcap=None):
    return _transformers_output(query)


class CausalMaskLayout(NamedTuple):
    """What :func:`read_causal_mask` found in a transformers mask: the queries attend lower-right causally to the
    first ``keys`` keys (the rest are cache slots not filled yet, hidden from every query), each prompt's first
    ``padding[b]`` of them hidden (left padding; all 0 without).

    ``segments`` (None for the masks above): a mask that also restarts the causal attention within a prompt
    (Llama 4's chunked attention, packed sequences). For each mask row, the ``(first query, end query, first key)``
    of each run of queries that see the same first key: query i of a run sees keys first key..i + keys - Nq. Queries
    in no run see no key; ``padding[b]`` is then the first key any query of row b sees.

    ``ends`` (None for the masks above): right padding. Prompt b's real tokens are keys 0..ends[b] - 1 and no query
    sees a key from ends[b] on: a real query (at position ends[b] - 1 or before) sees keys 0..its position, a
    padding query (at a later position) all of keys 0..ends[b] - 1 (ends[b] = 0: no query of the prompt sees a
    key, its padding queries all past a sliding window's reach). ``query_start`` (with ``ends`` only): the
    first query's position, Nkv - Nq without a cache or with a dynamic one, less against a static cache (whose
    slots past the last query's position are empty). Right padding over causal attention restarted within a prompt
    (Llama 4's chunks, packed sequences; no sliding window): ``segments`` then holds each row's runs of real queries
    as above (first query, end query, first key), and ``padding_runs`` its runs of padding queries that see the
    same keys, (first query, end query, first key): each such query sees keys first key..ends[b] - 1."""

    keys: int
    padding: list[int]
    segments: list[list[tuple[int, int, int]]] | None = None
    ends: list[int] | None = None
    query_start: int | None = None
    padding_runs: list[list[tuple[int, int, int]]] | None = None


def read_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int, max_elements: int = 1 << 26,
                     sliding_window: int | None = None) -> CausalMaskLayout | None:
    """The layout of a boolean (B|1, 1, Nq, >= Nkv) mask (True = attend), cut to its first ``kv_len`` keys, if it is
    lower-right causal over its first L <= Nkv keys: query i sees at most keys ..i + L - Nq, keys L.. none. Returns
    :class:`CausalMaskLayout`, or None for any other mask (per-head or additive masks, rows that are not one
    contiguous run of keys). L is read off the last query; one read-back (a device sync) at the end.

    - Each batch row's first p_b keys hidden from every query (left padding; p_b = 0 without): ``keys`` = L and
      ``padding`` = [p_b]. transformers builds this mask for a left-padded batch, with or without a cache (L = Nkv),
      and for a chunk against a static cache, whose slots past the chunk's last position are still empty (L < Nkv:
      ``StaticCache``, ``cache_implementation="static"``; transformers 4.x masks a static cache's first prefill the
      same way). L = Nkv and all p_b = 0: the plain lower-right causal mask.
    - Causal attention restarted within a prompt, each query seeing the keys from the start of its chunk or
      sequence on: ``segments`` as well (:class:`CausalMaskLayout`). transformers masks Llama 4's chunked-attention
      layers so (chunks of ``attention_chunk_size`` positions, counted from the prompt's first real token) and
      sequences packed in one row (position ids restarting, no cache).

    - Right padding: prompt b's keys from ends[b] on hidden from every query, so that a padding query (past
      position ends[b] - 1) sees all of keys 0..ends[b] - 1 (with a ``sliding_window`` W those from p - W + 1 on,
      none past the window's reach) rather than its causal range: ``ends`` (see
      :class:`CausalMaskLayout`; ``keys`` = the largest end). transformers builds this mask for a right-padded
      batch (many tokenizers' default side; ``padding="max_length"`` or ``pad_to_multiple_of`` pad every prompt).
      The queries' positions (``query_start``) are counted from Nkv - Nq, as without a cache or with a dynamic one,
      or else from where the mask puts them: against a static cache the slots after the last query's position are
      empty, seen by no query. Without a window, the real queries may also restart causal attention (Llama 4's
      chunks, packed sequences: ``segments``) and each padding query see any one run of keys that ends at its
      prompt's last (``padding_runs``), which transformers' chunked or packed mask gives a right-padded batch.

    Each query row's first and last seen key and its count of seen keys are read (:func:`mask_row_extents`: one
    Triton pass over the mask on CUDA; on CPU PyTorch reductions over row chunks of at most ``max_elements`` mask
    entries): a row matches when its keys are one run that ends at its causal end, no full-size pattern built.

    With a ``sliding_window`` W, the query at position p also sees no key before p - W + 1 (transformers' sliding
    mask of a local layer). p_b is then the first key any query of the row sees, the padding's end, or where the
    first query's window starts if that is later, which leaves each query the same keys. Sequences packed in one row
    under the window are read too (a query that sees only itself opens one, and no later query sees a key before
    it): ``segments`` as above, each run under the window."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != q_len \
            or mask.shape[3] < kv_len or q_len == 0:
        return None
    if sliding_window is not None and sliding_window >= kv_len:
        sliding_window = None  # a window that hides no key: the mask is the one without it
    mask = mask[:, 0, :, :kv_len]
    first, last, count = mask_row_extents(mask, max_elements)  # (B, Nq) each; first = kv_len where no key is seen
    seen = count > 0
    used = torch.where(seen[:, -1], last[:, -1], -1).amax() + 1  # the last query's causal end + 1, shared by the batch
    used = torch.where(used > 0, used, kv_len)  # (no row of the last query sees a key: then none may)
    positions = torch.arange(q_len, device=mask.device) + (used - q_len)
    runs = (last == positions) & (count == last - first + 1)  # keys first..position: one run to the causal end
    right_padding = _right_padding(first, last, count, q_len, kv_len, sliding_window)
    if sliding_window is None:
        return _causal_runs_layout(first, torch.where(seen, runs, True).all(), used, q_len, kv_len, right_padding)
    padding = first.amin(1)  # (B,): the first key any query of the row sees, kv_len where none
    padding = torch.where(padding < kv_len, padding, used)
    # a query that sees only itself opens a sequence (packed sequences restart there); the queries after it see no
    # key before that one. Queries before a row's first such query continue the sequence the padding ends. (Under a
    # one-key window every query sees only itself: one sequence, the same attention.)
    head = seen & (count == 1) & (last == positions) & (sliding_window > 1)
    sequence_start = torch.where(head, positions, -1).cummax(dim=1).values
    sequence_start = torch.where(sequence_start >= 0, sequence_start, padding[:, None])  # (B, Nq): its first key
    window_start = torch.maximum(sequence_start, positions - sliding_window + 1)  # (B, Nq): the first key in view
    expected_seen = window_start <= positions
    matches = torch.where(expected_seen, seen & runs & (first == window_start), ~seen).all()
    # each query's sequence start plays the part of its first key in the layout without a window: runs of queries
    # of one sequence are its segments, one per row from the padding's end is the padded mask
    return _causal_runs_layout(torch.where(expected_seen, sequence_start, kv_len), matches, used, q_len, kv_len,
                               right_padding)


def _right_padding(first: torch.Tensor, last: torch.Tensor, count: torch.Tensor, q_len: int, kv_len: int,
                   window: int | None = None) -> tuple[torch.Tensor, ...]:
    """(whether the rows read as right padding, (B,) ends, the first query's position, whether the mask is the plain
    right-padded one: each query sees from key 0 or its window's start, or none past the window) from each query
    row's first and last seen key and count (:func:`mask_row_extents`): prompt b's keys end after the last key any
    of its queries sees (ends[b]). Under a ``window`` the query at position p (the first query's position + its
    row) sees exactly keys
    max(0, p - window + 1)..min(p, ends[b] - 1), one run, or none where that range is empty (a padding query past
    the window's reach; ends[b] = 0 where every query of the prompt is, as in a late chunk of a short prompt).
    Without one, a real query (p < ends[b]) sees one run of keys that ends at p and a padding query none or one run
    that ends at ends[b] - 1, wherever the runs start (key 0 in a plain right-padded batch; a chunk's or packed
    sequence's first key otherwise). Only where some prompt is padded and some query sees a key is it right
    padding: otherwise the mask is the plain causal one, or sees nothing.

    The first query sits at Nkv - Nq without a cache or with a dynamic one, which is tried first (a chunk of only
    padding queries does not show its positions otherwise). Against a static cache it sits earlier, the slots after
    the last query's position empty: a real query's last key is its own position and a padding query's is before
    it, so the largest (last key - row) over the rows is the first query's position."""
    seen = count > 0
    ends = torch.where(seen, last, -1).amax(1) + 1  # (B,); 0 where no query sees a key
    rows = torch.arange(q_len, device=first.device)
    contiguous = count == last - first + 1

    def fits(start: torch.Tensor | int) -> torch.Tensor:
        positions = rows + start
        if window is None:
            real = positions[None, :] < ends[:, None]
            rows_fit = torch.where(real, seen & (last == positions) & contiguous,
                                   ~seen | ((last == ends[:, None] - 1) & contiguous))
        else:
            low = (positions - window + 1).clamp(min=0)[None, :]
            high = torch.minimum(positions[None, :], ends[:, None] - 1)
            rows_fit = torch.where(low <= high, seen & (first == low) & (last == high) & contiguous, ~seen)
        return rows_fit.all() & (ends < start + q_len).any() & (ends > 0).any()

    read = torch.where(seen, last - rows, -1).amax().clamp(0, kv_len - q_len)
    dynamic = fits(kv_len - q_len)
    # the plain right-padded mask: every run from key 0 and every query seeing one but those of a prompt that shows
    # none (under a window the runs were checked against its start)
    plain = torch.where(seen, first == 0, ends[:, None] == 0).all() if window is None else \
        torch.ones((), dtype=torch.bool, device=first.device)
    return dynamic | fits(read), ends, torch.where(dynamic, kv_len - q_len, read), plain


def _causal_runs_layout(first: torch.Tensor, matches: torch.Tensor, used: torch.Tensor, q_len: int, kv_len: int,
                        right_padding: tuple[torch.Tensor, ...]) -> CausalMaskLayout | None:
    """:func:`read_causal_mask`'s layout, from each query row's first seen key (``first``, (B, Nq), kv_len where none;
    under a window the first key of the query's sequence) once every row matched (``matches``) one run of keys to
    its causal end (``used`` - Nq + i):
    rows sharing their first key form the segments; one per batch row, starting where its queries first reach a key,
    is the padded causal mask. Otherwise, where ``right_padding`` (:func:`_right_padding`) holds, the right-padded
    layout. One read-back (a device sync)."""
    batch = first.shape[0]
    right, ends, query_start, plain_right = right_padding
    packed = torch.cat([matches.int()[None], used.int()[None], right.int()[None], query_start.int()[None],
                        plain_right.int()[None], ends.int(), first.flatten()]).cpu()
    keys, first_keys = int(packed[1]), packed[5 + batch:].view(batch, q_len)
    if not packed[0]:
        if not packed[2]:
            return None
        prompt_ends, start = packed[5:5 + batch].tolist(), int(packed[3])
        if packed[4]:
            return CausalMaskLayout(max(prompt_ends), [0] * batch, None, prompt_ends, start)
        # restarted causal attention: each row's real queries (before its end) in runs of one first key, and its
        # padding queries that see a key in runs of one first key too
        real_runs, padding_runs = [], []
        for row, end in zip(first_keys, prompt_ends):
            real = min(q_len, max(0, end - start))
            real_runs.append(_runs_of_equal(row, 0, real, kv_len))
            padding_runs.append(_runs_of_equal(row, real, q_len, kv_len))
        return CausalMaskLayout(max(prompt_ends), [0] * batch, real_runs, prompt_ends, start, padding_runs)
    segments: list[list[tuple[int, int, int]]] = []
    plain = True
    for row in first_keys:
        runs = _runs_of_equal(row, 0, q_len, kv_len)
        # the padded causal mask: at most one run, from the first query whose causal end reaches its first key
        plain &= not runs or (len(runs) == 1 and runs[0][1] == q_len
                              and runs[0][0] == max(0, runs[0][2] - (keys - q_len)))
        segments.append(runs)
    padding = [runs[0][2] if runs else keys for runs in segments]
    return CausalMaskLayout(keys, padding, None if plain else segments)


def _runs_of_equal(first_keys: torch.Tensor, begin: int, end: int, kv_len: int) -> list[tuple[int, int, int]]:
    """The runs of rows begin..end - 1 that share their first seen key (``first_keys``: one mask row's, on the
    host), as (first row, end row, first key); rows that see no key (first key ``kv_len``) in none."""
    row = first_keys[begin:end]
    if not len(row):
        return []
    starts = torch.cat([torch.tensor([0]), (row[1:] != row[:-1]).nonzero().flatten() + 1]).tolist()
    return [(begin + s, begin + e, int(row[s])) for s, e in zip(starts, starts[1:] + [len(row)]) if row[s] < kv_len]


def _layout_span(layout: CausalMaskLayout | None, q_len: int, kv_len: int) -> int:
    """How far back from its own position a query under this layout may see, in keys (its position + 1 from key 0
    on): whether a sliding window hides a key from any query. The last query sits at position ``keys`` - 1, except
    in a right-padded batch, whose padding queries sit at positions up to ``query_start`` + Nq - 1 past every
    prompt's last real key: a window shorter than that hides keys from them even where every prompt is shorter than
    the window. No layout (no causal mask read): any key, ``kv_len``."""
    if layout is None:
        return kv_len
    if layout.ends is not None:
        assert layout.query_start is not None  # (read with the ends)
        return layout.query_start + q_len
    return layout.keys


def register(name: str = "sparge", attention: SpargeLLMAttention | None = None, **settings: Any
             ) -> SpargeLLMAttention:
    """Register SpargeAttn under ``name`` for ``attn_implementation=name`` (transformers' AttentionInterface),
    with SDPA's mask function (a causal prompt without padding then gets no mask at all, which is what lets a
    call run sparse). ``settings`` are :class:`SpargeLLMAttention`'s fields; returns the registered function."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:  # the attention and mask registries of transformers >= 4.53
        raise ImportError(f"sparge_diffusers.llm needs transformers >= 4.53 (AttentionInterface and "
                          f"AttentionMaskInterface): {e}") from e

    if attention is not None and settings:  # they would be ignored: the function has its own
        raise ValueError(f"register takes a SpargeLLMAttention or its settings, not both (got attention and "
                         f"{sorted(settings)})")
    attention = attention or SpargeLLMAttention(**settings)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return attention

