"""Sparsity statistics: how much of dense attention a sparse call skipped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._inputs import AttentionShape, causal_block_visible


@dataclass
class SparsityStats:
    """Per-head fractions of skipped block products (averaged over the batch).

    The denominators are the block products dense attention computes: every (query block, key block)
    pair, or under causal masking only the pairs with at least one visible key.

    Attributes:
        qk_skipped: [H] fraction (a tensor on the input's device; so are the next two) of Q.K^T block products
            skipped by the block mask (stage 1).
        pv_skipped: [H] fraction of P.V block products skipped, by the block mask or by stage 2.
        pv_skipped_stage2: [H] fraction of the computed Q.K^T blocks whose P.V stage 2 skipped.
        dense_blocks: number of block products dense attention computes per (batch, head).
    """

    qk_skipped: torch.Tensor
    pv_skipped: torch.Tensor
    pv_skipped_stage2: torch.Tensor
    dense_blocks: int

    @property
    def sparsity(self) -> float:
        """The paper's sparsity: skipped (Q.K^T + P.V) products over those of dense attention."""
        return float((self.qk_skipped.mean() + self.pv_skipped.mean()) / 2)

    def as_dict(self) -> dict:
        return {
            "sparsity": self.sparsity,
            "qk_skipped": float(self.qk_skipped.mean()),
            "pv_skipped": float(self.pv_skipped.mean()),
            "pv_skipped_stage2": float(self.pv_skipped_stage2.mean()),
            "qk_skipped_per_head": self.qk_skipped.cpu().tolist(),
            "pv_skipped_per_head": self.pv_skipped.cpu().tolist(),
        }


def dense_block_count(shape: AttentionShape, is_causal: bool, device: torch.device) -> int:
    if not is_causal:
        return shape.q_blocks * shape.k_blocks
    return int(causal_block_visible(shape.q_blocks, shape.k_blocks, shape.kv_len, device).sum())


def sparsity_stats(qk_counts: torch.Tensor, pv_counts: torch.Tensor, shape: AttentionShape,
                   is_causal: bool) -> SparsityStats:
    """Build stats from per-(batch, head, q block) counts of computed Q.K^T and P.V products."""
    dense = dense_block_count(shape, is_causal, qk_counts.device)
    qk = qk_counts.double().sum(dim=-1)  # [B, H]
    pv = pv_counts.double().sum(dim=-1)
    # left on the counts' device: reading them (as_dict, float()) is what synchronises, not building them
    qk_skipped = (1 - qk / dense).mean(0).float()
    pv_skipped = (1 - pv / dense).mean(0).float()
    stage2 = (1 - pv / qk.clamp(min=1)).mean(0).float()
    return SparsityStats(qk_skipped, pv_skipped, stage2, dense)
