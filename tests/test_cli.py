"""The command line's bench on the CPU reference path."""

from json_checks import strict_json_load
from sparge_diffusers.cli import main


def test_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--cpu", "--quiet", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "No GPU" in printed and "llama32k" in printed
    rows = strict_json_load(out)["workloads"]
    assert [r["workload"] for r in rows] == ["cogvideox", "mochi", "flux", "llama32k"]
    for r in rows:
        assert 0.05 < r["sparsity"] < 1, r
        assert 0 < r["relative_l1"] < 0.1, r


def test_bench_rejects_unknown_workload(capsys):
    assert main(["bench", "--cpu", "--quiet", "--workloads", "sora"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_tune_command_on_a_locally_saved_pipeline(tmp_path, capsys):
    import pytest

    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from tiny_pipes import save_tiny_cogvideox_pipeline

    from sparge_diffusers.pipelines import LayerSettingsFile, apply

    model = save_tiny_cogvideox_pipeline(tmp_path / "pipe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat walks on the moon\n\na red car under the sea\n")
    out = tmp_path / "settings.json"
    assert main(["tune", "--model", model, "--prompts", str(prompts), "--out", str(out), "--steps", "2",
                 "--height", "64", "--width", "64", "--num-frames", "9", "--pipe-arg", "guidance_scale=1.0", "--no-stage2",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "transformer_blocks.1.attn1" in printed and "wrote" in printed
    tuned = LayerSettingsFile.load(out)
    assert tuned.model_class == "CogVideoXTransformer3DModel"
    assert set(tuned.layers) == {"transformer_blocks.0.attn1", "transformer_blocks.1.attn1"}
    # 2 prompts x 2 steps (no classifier-free guidance) per layer, both within the budget
    assert all(m["calls"] == 4 and m["within_budget"] and m["l1"] < 0.06 for m in tuned.measured.values())
    assert tuned.calibration["pipe_kwargs"]["num_inference_steps"] == 2
    assert all(s.pvthreshd == [50.0, 50.0] for s in tuned.layers.values()), "--no-stage2 leaves pvthreshd off"

    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    processor = apply(pipe, layer_settings=out)
    pipe.set_progress_bar_config(disable=True)
    pipe("a dog", num_inference_steps=2, height=64, width=64, num_frames=9, guidance_scale=1.0, output_type="np")
    assert set(processor.sparsity_by_layer()) == set(tuned.layers)


def test_tune_command_rejects_empty_prompt_file(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n")
    assert main(["tune", "--model", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
