"""benchmarks/s2o.py's bookkeeping (CPU; its measurements need a GPU): the table it writes from its JSON, and a run
stopped part-way keeping the shapes it finished."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import s2o as s2o_bench  # noqa: E402  (a broken import must fail here, not skip)

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")


def test_the_table_is_the_committed_one_for_the_committed_results():
    with open(os.path.join(RESULTS, "s2o-H100.json")) as f:
        results = json.load(f)
    with open(os.path.join(RESULTS, "s2o-H100.txt")) as f:
        assert s2o_bench.report_table(results) + "\n" == f.read()


def test_a_run_stopped_after_a_shape_keeps_that_shape(tmp_path, monkeypatch):
    with open(os.path.join(RESULTS, "s2o-H100.json")) as f:
        committed = json.load(f)

    def overhead(name, workload):
        if name == "llama32k":
            raise KeyboardInterrupt  # a time limit's kill, after flux was measured
        return committed["overhead"][name]

    monkeypatch.setattr(s2o_bench, "overhead", overhead)
    monkeypatch.setattr(s2o_bench, "timing", lambda name, workload: committed["timing"][name])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    out = tmp_path / "s2o.json"
    with pytest.raises(KeyboardInterrupt):
        s2o_bench.main(["--parts", "overhead,timing", "--shapes", "flux,llama32k", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["overhead"]) == {"flux"} and saved["timing"]["flux"] == committed["timing"]["flux"]


def test_the_triton_dense_baselines_force_the_triton_kernel_and_restore_the_defaults():
    """A (the dense mode as called) must stay the default dispatch after At / A64 are measured, even if one raises."""
    attention, hopper = s2o_bench.attention, s2o_bench.attention_hopper
    defaults = attention.dense_block_n(128), hopper.OVERRIDE
    with s2o_bench.triton_dense_mode():
        assert hopper.OVERRIDE is False and attention.dense_block_n(128) == defaults[0]
    with pytest.raises(RuntimeError), s2o_bench.triton_dense_mode(s2o_bench.BLOCK_K):
        assert hopper.OVERRIDE is False and attention.dense_block_n(128) == s2o_bench.BLOCK_K
        raise RuntimeError("a failed measurement")
    assert (attention.dense_block_n(128), hopper.OVERRIDE) == defaults
