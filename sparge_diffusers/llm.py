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
dtypes or head dims. ``strict=True`` raises instead of falling back. Composes the kernels only; knows nothing of
diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._compile import compiling, warn_once
from .kernels import SparsityStats, sparge_attention, sparge_attention_op
from .kernels._inputs import PerHead, unsupported_reason


@dataclass
class SpargeLLMAttention:
    """A transformers attention function (``AttentionInterface``) computing causal prefill with SpargeAttn.

    Args:
        simthreshd1, cdfthreshd, pvthreshd, attention_sink: as in :func:`sparge_attention` (upstream names;
            ``attention_sink`` keeps the first key block of every query block, as LLMs' sink token needs).
        strict: raise instead of falling back to SDPA for a call that cannot run sparse (decode steps and
            chunked prefill always use SDPA: that is where a sparse prefill kernel does not apply).
        collect_stats: keep each sparse call's :class:`SparsityStats` in ``stats`` (on the device until read).
    """

    simthreshd1: PerHead = 0.6
    cdfthreshd: PerHead = 0.98
    pvthreshd: PerHead | None = 50
    attention_sink: bool = True
    strict: bool = False
    collect_stats: bool = False
    sparse_calls: int = 0  # calls answered by sparge_attention (the rest went to SDPA)

    def __post_init__(self):
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
            return sparge_attention_op(query, key, value, **thresholds).transpose(1, 2).contiguous(), None
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

