"""The command line's bench on the CPU reference path."""

import json

from sparge_diffusers.cli import main


def test_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--cpu", "--quiet", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "No GPU" in printed and "llama32k" in printed
    rows = json.loads(out.read_text())["workloads"]
    assert [r["workload"] for r in rows] == ["cogvideox", "mochi", "flux", "llama32k"]
    for r in rows:
        assert 0.05 < r["sparsity"] < 1, r
        assert 0 < r["relative_l1"] < 0.1, r


def test_bench_rejects_unknown_workload(capsys):
    assert main(["bench", "--cpu", "--quiet", "--workloads", "sora"]) == 2
    assert "unknown workload" in capsys.readouterr().err
