"""benchmarks/pipelines.py runs each model through dense, then every sparse setting, on one model (CPU, a tiny
random-weight Flux, the reference path; the timings themselves need a GPU)."""

import json
import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import pipelines as pipelines_bench  # noqa: E402  (a broken import must fail here, not skip)

from sparge_diffusers.pipelines import installed_processor  # noqa: E402


def tiny_flux():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 28, 28)).to(torch.bfloat16)
    H = W = 12
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(H).float(), torch.arange(W).float(),
                                     indexing="ij"), -1).reshape(-1, 3)
    inputs = dict(hidden_states=torch.randn(1, H * W, 4, dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, 20, 32, dtype=torch.bfloat16),
                  pooled_projections=torch.randn(1, 16, dtype=torch.bfloat16), timestep=torch.tensor([0.5]),
                  img_ids=ids, txt_ids=torch.zeros(20, 3))
    return model.eval(), inputs, "tiny"


def test_every_setting_runs_on_the_same_model_and_leaves_it_dense(monkeypatch):
    built = []

    def build(name):
        built.append(tiny_flux())
        return built[-1]

    installed = []  # the setting installed at each timing, in order

    def timed(fn, reps=5, warmup=3):
        fn()
        processor = installed_processor(built[0][0])
        installed.append(None if processor is None else processor.settings.cdfthreshd)
        return float(len(installed))

    monkeypatch.setattr(pipelines_bench, "build_on_gpu", build)
    monkeypatch.setattr(pipelines_bench, "timed", timed)
    monkeypatch.setattr(pipelines_bench, "kernel_ms", lambda fn: 1.0)
    row = pipelines_bench.run_model("flux")
    assert set(row["settings"]) == {"default", "aggressive"}  # the second setting used to meet the first's processor
    for setting in row["settings"].values():
        assert 0.0 <= setting["sparsity"] <= 1.0
        assert 0.0 <= setting["relative_l1_vs_dense_step"] < 0.5
    assert row["attention_calls"] == 2 and row["attention_shape"][2] == 20 + 12 * 12
    assert installed_processor(built[0][0]) is None
    # eager steps: rounds that take dense and the two settings in turn, each setting's fastest round reported
    rounds = installed[-3 * pipelines_bench.EAGER_ROUNDS:]
    assert rounds == [None, 0.98, 0.9] * pipelines_bench.EAGER_ROUNDS
    assert row["dense_step_ms_rounds"] == [len(installed) - 3 * (pipelines_bench.EAGER_ROUNDS - r) + 1
                                           for r in range(pipelines_bench.EAGER_ROUNDS)]
    assert row["dense_step_ms"] == min(row["dense_step_ms_rounds"])
    assert row["settings"]["aggressive"]["step_ms"] == min(row["settings"]["aggressive"]["step_ms_rounds"])


def test_compile_dense_steps_parses_its_arguments(capsys):
    import compile_dense_steps  # benchmarks/ is on the path (above)

    assert compile_dense_steps.parse_args(["flux", "default:2,reduce-overhead:0"]).configs == [
        ("default", 2), ("reduce-overhead", 0)]
    assert compile_dense_steps.parse_args([]).model == "cogvideox"
    with pytest.raises(SystemExit) as e:  # was a KeyError: --help taken for a model name
        compile_dense_steps.parse_args(["--help"])
    assert e.value.code == 0 and "MODE:DENSE_STEPS" in capsys.readouterr().out
    for bad in (["flux", "default:x"], ["flux", "default"], ["unet"]):
        with pytest.raises(SystemExit) as e:
            compile_dense_steps.parse_args(bad)
        assert e.value.code == 2


def test_a_run_stopped_after_a_model_keeps_that_model(tmp_path, monkeypatch):
    def run_model(name, graph=False, compiled=False, rounds=3):
        if name == "sd3":
            raise KeyboardInterrupt  # a time limit's kill, after flux was measured
        return {"measured": name}

    monkeypatch.setattr(pipelines_bench, "run_model", run_model)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    out = tmp_path / "pipelines.json"
    with pytest.raises(KeyboardInterrupt):
        pipelines_bench.main(["--models", "flux,sd3", "--out", str(out)])
    assert json.loads(out.read_text())["models"] == {"flux": {"measured": "flux"}}
