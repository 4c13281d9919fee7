"""Sparsity statistics: how much of dense attention a sparse call skipped."""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ._inputs import AttentionShape, causal_block_visible


class SparsityStats:
    """Per-head fractions of skipped block products (averaged over the batch).

    The denominators are the block products dense attention computes: every (query block, key block)
    pair, or under causal masking (and a sliding window, if any) only the pairs with at least one visible key.
    With keys permuted within segments (``_inputs.PermutedKeys``) the denominator stays plain causal
    attention's: the blocks of the diagonal segment are all computed, so a mask that keeps almost everything
    can skip a negative fraction.
    Per-query selections (FSA, :func:`~sparge_diffusers.kernels.selected.selection_sparsity`) count (query, key)
    pairs instead of block products.

    Building one costs a single reduction on the device (the per-(batch, head) sums of the kernel's counts);
    the fractions below are computed when first read. Every call of a pipeline layer builds one when stats
    are on, and each further small kernel added ~10 us of host time to the call (benchmarks/host_time.py).

    Attributes:
        qk_skipped: [H] fraction (a tensor on the input's device; so are the next two) of Q.K^T block products
            skipped by the block mask (stage 1).
        pv_skipped: [H] fraction of P.V block products skipped, by the block mask or by stage 2.
        pv_skipped_stage2: [H] fraction of the computed Q.K^T blocks whose P.V stage 2 skipped (0 for a batch row
            that computed none).
        dense_blocks: number of block products dense attention computes per (batch, head): an int, or for
            stats joined over calls of different lengths (:meth:`concat`) a [B, 1] float64 tensor, one per row.
    """

    def __init__(self, qk_computed: torch.Tensor, pv_computed: torch.Tensor, dense_blocks: int | torch.Tensor):
        """``qk_computed`` and ``pv_computed``: [B, H] float64 block products computed per (batch, head)."""
        self._qk, self._pv, self.dense_blocks = qk_computed, pv_computed, dense_blocks

    @staticmethod
    def concat(parts: Sequence[SparsityStats]) -> SparsityStats:
        """The stats of several calls as one call's over their batch rows (the rows' fractions averaged, as for one
        call's batch), e.g. the prompts of a left-padded batch, each run at its own length. Calls must have the same
        heads; their lengths, hence their dense block counts, may differ. Nothing is read back from the device."""
        if not parts:
            raise ValueError("SparsityStats.concat needs at least one SparsityStats")
        if len(parts) == 1:
            return parts[0]
        if len({p._qk.shape[-1] for p in parts}) != 1:
            raise ValueError(f"SparsityStats.concat: head counts differ ({[p._qk.shape[-1] for p in parts]})")
        qk = torch.cat([p._qk for p in parts])
        pv = torch.cat([p._pv for p in parts])
        dense = [p.dense_blocks for p in parts]
        if all(isinstance(d, int) for d in dense) and len(set(dense)) == 1:
            return SparsityStats(qk, pv, dense[0])
        return SparsityStats(qk, pv, torch.cat([torch.as_tensor(d, dtype=torch.float64, device=qk.device)
                                                .expand(p._qk.shape[0], 1) for d, p in zip(dense, parts)]))

    # (total - computed) / total, not 1 - computed / total: CUDA divides a tensor by a number as a product with its
    # reciprocal, so 49 * (1 / 49) left 1.1e-16 "skipped" of a call that skipped nothing (session 79, on an H200)
    @functools.cached_property
    def qk_skipped(self) -> torch.Tensor:
        return ((self.dense_blocks - self._qk) / self.dense_blocks).mean(0).float()

    @functools.cached_property
    def pv_skipped(self) -> torch.Tensor:
        return ((self.dense_blocks - self._pv) / self.dense_blocks).mean(0).float()

    @functools.cached_property
    def pv_skipped_stage2(self) -> torch.Tensor:
        # a row that computed no Q.K^T block (its mask empty) skipped nothing in stage 2: 0, not 0/0
        return ((self._qk - self._pv) / self._qk.clamp(min=1)).mean(0).float()

    @property
    def sparsity(self) -> float:
        """The paper's sparsity: skipped (Q.K^T + P.V) products over those of dense attention."""
        return float((self.qk_skipped.mean() + self.pv_skipped.mean()) / 2)

    def as_dict(self) -> dict:
        """Plain floats and lists for JSON: the overall and mean fractions, and the per-head ones (one sync)."""
        return {
            "sparsity": self.sparsity,
            "qk_skipped": float(self.qk_skipped.mean()),
            "pv_skipped": float(self.pv_skipped.mean()),
            "pv_skipped_stage2": float(self.pv_skipped_stage2.mean()),
            "qk_skipped_per_head": self.qk_skipped.cpu().tolist(),
            "pv_skipped_per_head": self.pv_skipped.cpu().tolist(),
        }

    def __repr__(self) -> str:
        dense = self.dense_blocks if isinstance(self.dense_blocks, int) else "per row"
        return f"SparsityStats(dense_blocks={dense}, heads={self._qk.shape[-1]})"


@functools.lru_cache(maxsize=256)
def dense_block_count(shape: AttentionShape, is_causal: bool) -> int:
    """Block products dense attention computes per (batch, head); counted on the CPU (no device sync)."""
    if not is_causal:
        return shape.q_blocks * shape.k_blocks
    return int(causal_block_visible(shape.q_blocks, shape.k_blocks, shape.kv_len, torch.device("cpu"),
                                    q_len=shape.q_len, causal_offset=shape.causal_offset,
                                    sliding_window=shape.sliding_window).sum())


def sparsity_stats(qk_counts: torch.Tensor, pv_counts: torch.Tensor, shape: AttentionShape,
                   is_causal: bool) -> SparsityStats:
    """Build stats from per-(batch, head, q block) counts of computed Q.K^T and P.V products.

    Left on the counts' device: reading the stats (``as_dict``, ``float()``) is what synchronises, not building
    them. ``pv_counts`` may be ``qk_counts`` itself (no stage-2 test), which then costs one reduction, not two.
    """
    qk = qk_counts.sum(dim=-1, dtype=torch.float64)  # [B, H]
    pv = qk if pv_counts is qk_counts else pv_counts.sum(dim=-1, dtype=torch.float64)
    return SparsityStats(qk, pv, dense_block_count(shape, is_causal))
