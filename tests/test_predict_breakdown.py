"""benchmarks/predict_breakdown.py drives stage 1's launchers directly: every part it times must run and, in
each launch setting, give the same result (CPU, Triton interpreter; the timing itself needs a GPU)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import predict_breakdown  # noqa: E402  (a broken import must fail here, not skip)

from sparge_diffusers.workloads import SMALL  # noqa: E402


def test_every_part_runs_and_each_launch_setting_gives_the_same_mask():
    w = SMALL["flux"]
    q, k, _ = w.make("cpu")
    parts, stats_default, topcdf_default = predict_breakdown.stage_one_parts(q, k, w.causal)
    results = {name: fn() for name, fn in parts.items()}
    assert {"api", "scores", f"stats_q@{stats_default}", f"stats_k@{stats_default}",
            f"topcdf@{topcdf_default}"} <= set(results)
    for which in ("q", "k"):
        base = results[f"stats_{which}@{stats_default}"]
        for name in parts:
            if name.startswith(f"stats_{which}@"):
                torch.testing.assert_close(results[name], base)
    mask, walk = results[f"topcdf@{topcdf_default}"]
    assert torch.equal(mask.bool(), results["api"])  # the launchers chained as stage 1 chains them
    assert 0 < mask.float().mean() < 1  # the structured input selects something
    for name, (other_mask, other_walk) in ((n, r) for n, r in results.items() if n.startswith("topcdf@")):
        assert torch.equal(other_mask, mask), name
        assert all(torch.equal(a, b) for a, b in zip(other_walk[1:], walk[1:])), name  # count, n_full
