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
    parts, used = predict_breakdown.stage_one_parts(q, k, w.causal)
    results = {name: fn() for name, fn in parts.items()}
    assert {"api", "separate", *used} <= set(results)
    assert used[0].startswith("stats_qk@") and used[-1].startswith("topcdf@")
    # the one statistics launch against each tensor's own launch, in every setting
    for name in parts:
        if name.startswith("stats_qk@"):
            for which, got in zip("qk", results[name]):
                for other in (n for n in parts if n.startswith(f"stats_{which}@")):
                    torch.testing.assert_close(got, results[other])
    mask, walk = results[used[-1]]
    assert torch.equal(mask.bool(), results["api"])  # the launchers chained as stage 1 chains them
    assert 0 < mask.float().mean() < 1  # the structured input selects something
    topcdf = [(n, r) for n, r in results.items() if n.startswith("topcdf")] + [("separate", results["separate"])]
    assert len(topcdf) == 5
    for name, (other_mask, other_walk) in topcdf:
        assert torch.equal(other_mask, mask), name
        assert all(torch.equal(a, b) for a, b in zip(other_walk[1:], walk[1:])), name  # count, n_full
