"""SpargeAttn for causal LLM prefill in Hugging Face transformers: an attention function for
``AttentionInterface``.

    from sparge_diffusers.llm import register
    register("sparge", cdfthreshd=0.98)                      # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sparge", torch_dtype=torch.bfloat16)

The prefill of a causal model (every query of the prompt, no padding) runs :func:`sparge_attention` with
``is_causal=True`` and grouped-query heads as they come (no repeat of K/V). Everything else is left to
transformers' own SDPA function, the one ``attn_implementation="sdpa"`` uses: decode steps and chunked prefill
(fewer queries than keys: the kernel's causal mode needs equal lengths), and, with one warning per reason,
padding or other explicit masks, dropout, softcapping, sliding windows, non-causal modules and unsupported
dtypes or head dims. ``strict=True`` raises instead of falling back. Composes the kernels and the segmented key
permutation of PBS-Attn (``pbs_segment``, see :func:`pbs_sparge_attention`); knows nothing of diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._compile import compiling, warn_once
from .kernels import PermutedKeys, SparsityStats, sparge_attention, sparge_attention_op
from .kernels._inputs import PerHead, unsupported_reason
from .permutations import gather_keys, last_block_key_importance, segmented_key_order


def pbs_sparge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment: int = 256,
                         scale: float | None = None, return_sparsity: bool = False, **sparge_settings: Any
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

    Args:
        q: (B, H, N, D); k, v: (B, H_kv, N, D), HND layout (transformers' attention functions get these).
        segment: positions per segment, a positive multiple of 64; larger sorts more keys together but makes
            the always-computed diagonal segment wider. PBS-Attn uses 256.
        sparge_settings: :func:`sparge_attention`'s thresholds (simthreshd1, cdfthreshd, pvthreshd,
            attention_sink) and backend.
    """
    if sparge_settings.get("tensor_layout", "HND") != "HND" or "is_causal" in sparge_settings:
        raise ValueError("pbs_sparge_attention takes HND inputs and is always causal")
    order = segmented_key_order(last_block_key_importance(q, k, scale=scale), segment)
    positions = order.to(torch.int32)
    return sparge_attention(q, gather_keys(k, order), gather_keys(v, order), is_causal=True, scale=scale,
                            permuted_keys=PermutedKeys(positions, segment), return_sparsity=return_sparsity,
                            **sparge_settings)


@dataclass
class SpargeLLMAttention:
    """A transformers attention function (``AttentionInterface``) computing causal prefill with SpargeAttn.

    Args:
        simthreshd1, cdfthreshd, pvthreshd, attention_sink: as in :func:`sparge_attention` (upstream names;
            ``attention_sink`` keeps the first key block of every query block, as LLMs' sink token needs).
        strict: raise instead of falling back to SDPA for a call that cannot run sparse (decode steps and
            chunked prefill always use SDPA: that is where a sparse prefill kernel does not apply).
        collect_stats: keep each sparse call's :class:`SparsityStats` in ``stats`` (on the device until read).
        pbs_segment: sort keys within segments of this many positions first (PBS-Attn,
            :func:`pbs_sparge_attention`); None: keys in order. Eager calls only: under torch.compile the call
            runs :func:`sparge_attention` on keys in order.
    """

    simthreshd1: PerHead = 0.6
    cdfthreshd: PerHead = 0.98
    pvthreshd: PerHead | None = 50
    attention_sink: bool = True
    pbs_segment: int | None = None
    strict: bool = False
    collect_stats: bool = False
    sparse_calls: int = 0  # calls answered by sparge_attention (the rest went to SDPA)

    def __post_init__(self):
        if self.pbs_segment is not None and (not isinstance(self.pbs_segment, int) or self.pbs_segment <= 0
                                             or self.pbs_segment % 64):
            raise ValueError(f"pbs_segment must be None or a positive multiple of 64, got {self.pbs_segment!r}")
        self._warned: set[str] = set()
        self.stats: list[SparsityStats] = []

    def fallback_reason(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float, is_causal: bool | None,
                        kwargs: dict) -> str | None:
        """Why this call cannot run sparse: None when it can, "" for the expected SDPA cases (decode)."""
        if query.shape[2] != key.shape[2] or query.shape[2] == 1:
            return ""  # decode step or chunked prefill: not a prefill of the whole prompt
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            return "a non-causal attention module"
        if attention_mask is not None:
            return "an explicit attention mask (padding, packed sequences or a custom mask)"
        if dropout:
            return "dropout"
        if kwargs.get("softcap") is not None:
            return "softcapping"
        if kwargs.get("sliding_window") is not None:
            return "a sliding window"
        return unsupported_reason(query)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """query (B, H, N, D), key/value (B, H_kv, N, D) -> ((B, N, H, D), None), as transformers' SDPA function."""
        reason = self.fallback_reason(module, query, key, attention_mask, dropout, is_causal, kwargs)
        if reason is not None:
            if reason:
                self._warn(reason)
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
        thresholds = dict(is_causal=True, scale=scaling, simthreshd1=self.simthreshd1, cdfthreshd=self.cdfthreshd,
                          pvthreshd=self.pvthreshd, attention_sink=self.attention_sink)
        if compiling():
            # one node of the compiled graph (see kernels/library.py); no statistics, no call count: a Python
            # counter read under compilation would be a guard that recompiles at every call
            if self.pbs_segment is not None:
                warn_once("SpargeLLMAttention: pbs_segment has no effect under torch.compile (keys stay in order)",
                          self._warned, stacklevel=2)
            return sparge_attention_op(query, key, value, **thresholds).transpose(1, 2).contiguous(), None
        if self.pbs_segment is not None:
            del thresholds["is_causal"]
            out = pbs_sparge_attention(query, key, value, segment=self.pbs_segment,
                                       return_sparsity=self.collect_stats, **thresholds)
        else:
            out = sparge_attention(query, key, value, return_sparsity=self.collect_stats, **thresholds)
        if self.collect_stats:
            out, stats = out
            self.stats.append(stats)
        self.sparse_calls += 1
        return out.transpose(1, 2).contiguous(), None

    def _warn(self, reason: str) -> None:
        if self.strict:
            raise ValueError(f"SpargeLLMAttention: {reason}; strict=True forbids falling back to SDPA")
        warn_once(f"SpargeLLMAttention: falling back to SDPA: {reason}", self._warned, stacklevel=3)


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

    attention = attention or SpargeLLMAttention(**settings)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return attention

