"""Sparsity statistics: their figures, and that building them costs one reduction per call (every layer of an
eager pipeline builds one when stats are on; each further small kernel is ~10 us of host time)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparge_diffusers.kernels._inputs import AttentionShape
from sparge_diffusers.kernels.stats import dense_block_count, sparsity_stats


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [False, True])
def test_stats_figures_and_ops_per_call(causal):
    shape = AttentionShape(batch=2, heads=3, kv_heads=3, q_len=300, kv_len=300, head_dim=64)  # 3 x 5 blocks
    dense = dense_block_count(shape, causal)
    assert dense == (11 if causal else 15)  # causal: the query blocks see 2, 4 and all 5 key blocks
    qk = torch.randint(1, dense + 1, (2, 3, 3), dtype=torch.int32)
    pv = qk - torch.randint(0, 2, qk.shape, dtype=torch.int32)
    with CountOps() as counted:
        stats = sparsity_stats(qk, pv, shape, causal)
    assert len(counted.ops) <= 2, counted.ops  # the two per-(batch, head) sums, nothing else until read
    with CountOps() as counted:
        same = sparsity_stats(qk, qk, shape, causal)
    assert len(counted.ops) == 1, counted.ops  # no stage-2 test: one sum serves both
    want_qk = (1 - qk.double().sum(-1) / dense).mean(0).float()
    want_pv = (1 - pv.double().sum(-1) / dense).mean(0).float()
    torch.testing.assert_close(stats.qk_skipped, want_qk)
    torch.testing.assert_close(stats.pv_skipped, want_pv)
    torch.testing.assert_close(stats.pv_skipped_stage2, (1 - pv.double().sum(-1) / qk.double().sum(-1)).mean(0).float())
    assert stats.sparsity == pytest.approx(float((want_qk.mean() + want_pv.mean()) / 2))
    assert float(same.pv_skipped_stage2.abs().max()) == 0.0
    d = stats.as_dict()
    assert d["qk_skipped_per_head"] == pytest.approx(want_qk.tolist()) and len(d["pv_skipped_per_head"]) == 3


def test_concat_joins_calls_over_their_batch_rows():
    """Joining the stats of the batch rows run as separate calls gives the batched call's stats; calls of different
    lengths keep each row's own dense count (the rows' fractions are averaged, as within one call)."""
    from sparge_diffusers.kernels.stats import SparsityStats

    shape = AttentionShape(batch=3, heads=2, kv_heads=2, q_len=300, kv_len=300, head_dim=64)
    qk = torch.randint(1, 12, (3, 2, 3), dtype=torch.int32)
    pv = qk - torch.randint(0, 2, qk.shape, dtype=torch.int32)
    whole = sparsity_stats(qk, pv, shape, True)
    row = AttentionShape(batch=1, heads=2, kv_heads=2, q_len=300, kv_len=300, head_dim=64)
    parts = [sparsity_stats(qk[b:b + 1], pv[b:b + 1], row, True) for b in range(3)]
    joined = SparsityStats.concat(parts)
    assert joined.dense_blocks == whole.dense_blocks
    for name in ("qk_skipped", "pv_skipped", "pv_skipped_stage2"):
        torch.testing.assert_close(getattr(joined, name), getattr(whole, name))
    short = AttentionShape(batch=1, heads=2, kv_heads=2, q_len=100, kv_len=100, head_dim=64)  # 1 x 2 blocks
    mixed = SparsityStats.concat([parts[0], sparsity_stats(torch.full((1, 2, 1), 2, dtype=torch.int32),
                                                           torch.zeros(1, 2, 1, dtype=torch.int32), short, True)])
    want = (1 - qk[0].double().sum(-1) / 11 + 0) / 2  # the short call skipped no Q.K^T product, every P.V one
    torch.testing.assert_close(mixed.qk_skipped, want.float())
    torch.testing.assert_close(mixed.pv_skipped, ((1 - pv[0].double().sum(-1) / 11) + 1) / 2, check_dtype=False)
    assert "per row" in repr(mixed) and SparsityStats.concat([parts[1]]) is parts[1]
    with pytest.raises(ValueError, match="at least one"):
        SparsityStats.concat([])
    other_heads = sparsity_stats(torch.ones(1, 4, 1, dtype=torch.int32), torch.ones(1, 4, 1, dtype=torch.int32),
                                 AttentionShape(batch=1, heads=4, kv_heads=4, q_len=100, kv_len=100, head_dim=64), True)
    with pytest.raises(ValueError, match=r"head counts differ \(\[2, 4\]\)"):
        SparsityStats.concat([parts[0], other_heads])
    # three heads over calls of two lengths: each row keeps its own count whatever the heads
    three = [sparsity_stats(torch.full((1, 3, 1), 2, dtype=torch.int32), torch.ones(1, 3, 1, dtype=torch.int32),
                            AttentionShape(batch=1, heads=3, kv_heads=3, q_len=n, kv_len=n, head_dim=64), False)
             for n in (100, 300)]  # 1 x 2 and 3 x 5 blocks
    joined = SparsityStats.concat(three)
    torch.testing.assert_close(joined.qk_skipped, torch.full((3,), (0 + 13 / 15) / 2))
    torch.testing.assert_close(joined.pv_skipped, torch.full((3,), (1 / 2 + 14 / 15) / 2))
    assert repr(joined) == "SparsityStats(dense_blocks=per row, heads=3)"


def test_stage_two_fraction_of_heads_that_computed_few_blocks():
    """pv_skipped_stage2 is over the Q.K^T blocks computed: 1 where stage 2 skipped a head's only block, 0 where a
    head computed no block at all (its mask empty; the fraction was 1, as if stage 2 had skipped everything)."""
    shape = AttentionShape(batch=1, heads=4, kv_heads=4, q_len=300, kv_len=300, head_dim=64)
    qk = torch.tensor([[[0, 0, 0], [1, 0, 0], [1, 0, 0], [2, 1, 0]]], dtype=torch.int32)
    pv = torch.tensor([[[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0]]], dtype=torch.int32)
    stats = sparsity_stats(qk, pv, shape, False)
    torch.testing.assert_close(stats.pv_skipped_stage2, torch.tensor([0.0, 1.0, 0.0, 1 / 3]))
    torch.testing.assert_close(stats.qk_skipped, torch.tensor([1.0, 14 / 15, 14 / 15, 12 / 15]))
