"""A block mask compacted once into the attention kernel's walk, reusable across calls.

The attention kernel does not read the (B, H, nq, nk) mask itself: per (batch, head, query block) it walks
an ascending list of kept key blocks, those needing no element masking first. ``block_sparse_attention``
builds that list from a bool mask on every call (one small kernel); a :class:`CompactBlockMask` holds it,
so callers that reuse a mask (every layer of a step, every step of a cached schedule, a benchmark against
FlexAttention's prebuilt ``BlockMask``) pay for it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._inputs import (BLOCK_K, AttentionShape, Backend, CausalVariant, PermutedKeys, TensorLayout,
                      check_attention_inputs, check_permuted_keys, pick_backend, size_or_one)
from .attention import block_mask_to_index
from .attention_hopper import TailSchedule, new_tail_schedule, wants_tail_schedule


@dataclass(frozen=True, eq=False)
class CompactBlockMask:
    """A (B|1, H|1, ceil(Nq/128), ceil(Nkv/64)) block mask with the kernel's compacted walk.

    Attributes:
        mask: the bool mask it was built from (the reference backend reads it).
        index: (B, H, nq, nk) int32, the kept key blocks of each row in ascending order, the
            ``n_full`` that need no element masking first; None when built for the reference backend.
        count: (B, H, nq) int32, kept blocks per row (blocks hidden by causal masking excluded).
        n_full: (B, H, nq) int32.
        batch, heads, q_len, kv_len, is_causal: the calls it is valid for.
        key_segment: the segment of the calls' ``PermutedKeys`` (BLOCK_K = keys in order), whose causal rule
            decided which blocks are hidden and which need element masking.
        tail: the Hopper kernel's schedule end, longest tiles first (``attention_hopper.TailSchedule``), filled
            with the walk for a CUDA mask; None elsewhere.
        causal_offset: the causal position of query row 0 (``AttentionShape.causal_offset``: nonzero for a
            causal variant with Nq != Nkv), which decided the hidden and the diagonal blocks.
        sliding_window: the calls' sliding window (None: none), which hid the blocks before it.
    """

    mask: torch.Tensor
    index: torch.Tensor | None
    count: torch.Tensor | None
    n_full: torch.Tensor | None
    batch: int
    heads: int
    q_len: int
    kv_len: int
    is_causal: bool
    tail: TailSchedule | None = None
    key_segment: int = BLOCK_K
    causal_offset: int = 0
    sliding_window: int | None = None

    @property
    def kernel_walk(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.index is None or self.count is None or self.n_full is None:  # all three or none (reference)
            return None
        return self.index, self.count, self.n_full

    def check_matches(self, shape: AttentionShape, is_causal: bool, device: torch.device,
                      key_segment: int = BLOCK_K) -> None:
        """Raise ValueError unless this mask was built for calls of this shape, causality (and causal variant and
        sliding window), device and key segment."""
        built = (self.batch, self.heads, self.q_len, self.kv_len)
        given = (shape.batch, shape.heads, shape.q_len, shape.kv_len)
        if built != given:
            raise ValueError(f"CompactBlockMask was built for (batch, heads, q_len, kv_len) = {built}, "
                             f"the inputs have {given}")
        if self.is_causal != is_causal:
            raise ValueError(f"CompactBlockMask was built with is_causal={self.is_causal}, the call has "
                             f"is_causal={is_causal}")
        if is_causal and self.causal_offset != shape.causal_offset:
            raise ValueError(f"CompactBlockMask was built for causal offset {self.causal_offset} (query row 0 at key "
                             f"position {self.causal_offset}), the call has {shape.causal_offset}: another "
                             f"causal_variant")
        if is_causal and self.sliding_window != shape.sliding_window:
            raise ValueError(f"CompactBlockMask was built for sliding_window={self.sliding_window}, the call has "
                             f"sliding_window={shape.sliding_window}")
        if self.mask.device != device:
            raise ValueError(f"CompactBlockMask is on {self.mask.device}, q on {device}")
        if is_causal and self.key_segment != key_segment:
            raise ValueError(f"CompactBlockMask was built for keys permuted within segments of {self.key_segment} "
                             f"positions ({BLOCK_K}: keys in order), the call has {key_segment}")


def check_block_mask(block_mask: torch.Tensor, shape: AttentionShape, device: torch.device) -> None:
    """Raise ValueError unless ``block_mask`` is a bool/int (B|1, H|1, nq, nk) tensor on ``device``."""
    expected = (shape.q_blocks, shape.k_blocks)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dim() != 4:
        raise ValueError(f"block_mask must be a 4-D tensor (B|1, H|1, {expected[0]}, {expected[1]}) or a "
                         f"CompactBlockMask")
    b, h, nq, nk = block_mask.shape
    if (nq, nk) != expected or b not in (1, shape.batch) or h not in (1, shape.heads):
        raise ValueError(f"block_mask shape {tuple(block_mask.shape)} does not match the inputs: expected "
                         f"({size_or_one(shape.batch)}, {size_or_one(shape.heads)}, {expected[0]}, {expected[1]}) for "
                         f"128-query x 64-key blocks")
    if block_mask.device != device:
        raise ValueError(f"block_mask is on {block_mask.device}, q on {device}")
    if block_mask.dtype.is_floating_point or block_mask.dtype.is_complex:
        raise ValueError(f"block_mask must be bool or integer, got {block_mask.dtype}")


def compact_block_mask(
    block_mask: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool = False,
    tensor_layout: TensorLayout = "HND",
    backend: Backend = "auto",
    permuted_keys: PermutedKeys | None = None,
    causal_variant: CausalVariant | None = None,
    sliding_window: int | None = None,
) -> CompactBlockMask:
    """Compact ``block_mask`` once for repeated :func:`block_sparse_attention` calls on inputs shaped like
    ``q`` and ``k`` (only their shapes and device are read), and with ``permuted_keys`` of the same segment
    and the same ``causal_variant`` and ``sliding_window`` (see :func:`~sparge_diffusers.predict_block_mask`).

    Example:
        >>> cm = compact_block_mask(mask, q, k)             # mask: (B|1, H|1, ceil(N/128), ceil(N/64)) bool
        >>> for layer_q, layer_k, layer_v in layers:
        ...     out = block_sparse_attention(layer_q, layer_k, layer_v, cm)
    """
    shape = check_attention_inputs(q, k, None, tensor_layout=tensor_layout, is_causal=is_causal,
                                   causal_variant=causal_variant, sliding_window=sliding_window)
    check_block_mask(block_mask, shape, q.device)
    key_segment = check_permuted_keys(permuted_keys, shape, q.device, is_causal)
    walk, tail = None, None
    if pick_backend(backend, q.device, q.shape[-1]) == "triton":
        tail = new_tail_schedule(shape, q.device)[0] if wants_tail_schedule(shape, q.device) else None
        walk = block_mask_to_index(block_mask, shape, is_causal, tail=tail, key_segment=key_segment)
    return from_kernel_walk(block_mask, walk, shape, is_causal, tail, key_segment)


def from_kernel_walk(mask: torch.Tensor, walk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                     shape: AttentionShape, is_causal: bool, tail: TailSchedule | None = None,
                     key_segment: int = BLOCK_K) -> CompactBlockMask:
    """Wrap a mask and a walk built elsewhere (stage 1 writes both, and fills ``tail``, in one kernel)."""
    index, count, n_full = walk if walk is not None else (None, None, None)
    return CompactBlockMask(mask, index, count, n_full, shape.batch, shape.heads, shape.q_len, shape.kv_len,
                            is_causal, tail if walk is not None else None, key_segment, shape.causal_offset,
                            shape.sliding_window)
