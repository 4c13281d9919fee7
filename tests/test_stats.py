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
