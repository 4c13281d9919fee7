"""The command line: its help texts, bench on the CPU reference path, and the other commands' argument checks."""

import argparse

import pytest

from json_checks import strict_json_load
from sparge_diffusers.cli import build_parser, main


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """The parser of each subcommand by name (bench, tune, generate, eval)."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("name", list(subcommands()))
def test_each_subcommand_describes_itself_and_every_option(name):
    parser = subcommands()[name]
    assert parser.description, f"'sparge-diffusers {name} --help' says nothing of what the command does"
    undocumented = [a.option_strings for a in parser._actions if not a.help]
    assert not undocumented, f"options of {name} without help: {undocumented}"


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


def test_bench_runs_the_head_dim_256_workload_on_request(tmp_path, capsys):
    """Gemma-3-12B's prefill shape (head dim 256) is not among the default workloads but runs when named."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--cpu", "--quiet", "--workloads", "gemma3_32k", "--json", str(out)]) == 0
    (row,) = strict_json_load(out)["workloads"]
    assert row["workload"] == "gemma3_32k" and row["D"] == 256 and row["causal"]
    assert 0.05 < row["sparsity"] < 1 and 0 < row["relative_l1"] < 0.1, row


def test_bench_rejects_unknown_workload(capsys):
    assert main(["bench", "--cpu", "--quiet", "--workloads", "sora"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_bench_checks_its_json_path_before_running(tmp_path, capsys):
    assert main(["bench", "--cpu", "--quiet", "--workloads", "flux", "--json", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "is a folder" in captured.err and "flux" not in captured.out  # nothing ran
    out = tmp_path / "new" / "bench.json"  # its folder is made first: the file is written after the run
    assert main(["bench", "--cpu", "--quiet", "--workloads", "flux", "--json", str(out)]) == 0
    assert strict_json_load(out)["workloads"][0]["workload"] == "flux"


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
                 "--height", "64", "--width", "64", "--num-frames", "9", "--pipe-arg", "guidance_scale=1.0",
                 "--no-stage2", "--quiet"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "transformer_blocks.1.attn1" in printed and "wrote" in printed
    assert "tune:" not in captured.err  # --quiet: no progress bar of ours (loading the model shows its own)
    tuned = LayerSettingsFile.load(out)
    mean = sum(m["sparsity"] for m in tuned.measured.values()) / 2
    assert f"2 layers, mean sparsity {mean:.3f} on the calibration prompts" in printed
    assert tuned.model_class == "CogVideoXTransformer3DModel"
    assert set(tuned.layers) == {"transformer_blocks.0.attn1", "transformer_blocks.1.attn1"}
    # 2 prompts x 2 steps (no classifier-free guidance) per layer, both within the budget
    assert all(m["calls"] == 4 and m["within_budget"] and m["l1"] < 0.06 for m in tuned.measured.values())
    assert tuned.calibration["pipe_kwargs"]["num_inference_steps"] == 2
    assert all(s.pvthreshd == [50.0, 50.0] for s in tuned.layers.values()), "--no-stage2 leaves pvthreshd off"

    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model)
    processor = apply(pipe, layer_settings=out, collect_stats=True)
    pipe.set_progress_bar_config(disable=True)
    pipe("a dog", num_inference_steps=2, height=64, width=64, num_frames=9, guidance_scale=1.0, output_type="np")
    assert set(processor.sparsity_by_layer()) == set(tuned.layers)


def test_generation_options_reach_the_pipeline_and_the_number_checks_take_their_bounds():
    """pipeline_kwargs passes each generation option that was given, and only those (--pipe-arg values as JSON);
    a count takes its lower bound itself; a positive float refuses 0, inf and NaN."""
    from sparge_diffusers.cli import _int_at_least, _positive_float, pipeline_kwargs

    generate = subcommands()["generate"]
    args = generate.parse_args(["--model", "m", "--out", "o", "--prompt", "p", "--height", "64",
                                "--guidance-scale", "1.5", "--pipe-arg", "max_sequence_length=77"])
    assert pipeline_kwargs(args) == {"height": 64, "guidance_scale": 1.5, "max_sequence_length": 77}
    args = generate.parse_args(["--model", "m", "--out", "o", "--prompt", "p", "--steps", "3", "--num-frames", "9"])
    assert pipeline_kwargs(args) == {"num_inference_steps": 3, "num_frames": 9}
    assert _int_at_least(1)("1") == 1
    assert _positive_float("1e-3") == 1e-3
    for parse, text in ((_int_at_least(1), "0"), (_positive_float, "0"), (_positive_float, "inf"),
                        (_positive_float, "nan")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_tune_command_rejects_empty_prompt_file(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n")
    assert main(["tune", "--model", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert "holds no prompts" in capsys.readouterr().err


def _error_of(argv, capsys) -> str:
    """The stderr of a command that must stop with status 2 (returned, or argparse's SystemExit) before it loads
    its model: the model path does not exist, so a later failure would be a loading error instead."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2, argv
    return capsys.readouterr().err


def test_commands_check_their_arguments_before_loading_the_model(tmp_path, capsys):
    import pytest

    pytest.importorskip("diffusers")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    not_settings = tmp_path / "not-settings.json"
    not_settings.write_text('{"layers": {}}')
    model = str(tmp_path / "no-model")
    generate = ["generate", "--model", model, "--out", str(tmp_path / "g"), "--prompt", "a cat"]
    assert "must be at least 0" in _error_of(generate + ["--dense-steps", "-1"], capsys)
    assert "one of the arguments --prompt --prompts is required" in _error_of(generate[:5], capsys)
    empty_prompts = tmp_path / "empty.txt"
    empty_prompts.write_text("\n  \n")
    assert "holds no prompts" in _error_of(generate[:5] + ["--prompts", str(empty_prompts)], capsys)
    assert "expected KEY=VALUE, got 'steps'" in _error_of(generate + ["--pipe-arg", "steps"], capsys)
    assert "must be at least 1" in _error_of(generate + ["--steps", "0"], capsys)
    assert "pipe_kwargs sets prompt" in _error_of(generate + ["--pipe-arg", "prompt=a dog"], capsys)
    assert "expected an integer" in _error_of(generate + ["--fps", "x"], capsys)
    assert "not found" in _error_of(generate + ["--attention", f"sparge:{tmp_path / 'missing.json'}"], capsys)
    assert "not a sparge-diffusers layer-settings file" in _error_of(
        generate + ["--attention", f"sparge:{not_settings}"], capsys)
    evaluate = ["eval", "--model", model, "--out", str(tmp_path / "e"), "--prompts", str(prompts)]
    assert "not a sparge-diffusers layer-settings file" in _error_of(
        evaluate + ["--attention", f"dense,sparge:{not_settings}"], capsys)
    fid = ["--fid-weights", str(tmp_path / "inception.pth")]
    assert "needs at least two prompts" in _error_of(evaluate + fid, capsys)  # one prompt: FID was left out
    assert "--fid-real is for FID: give --fid-weights too" in _error_of(
        evaluate + ["--fid-real", str(tmp_path)], capsys)
    assert "list 'dense' among the modes" in _error_of(
        evaluate + ["--attention", "sparge", "--lpips-weights", str(tmp_path / "a.pth")], capsys)
    prompts.write_text("a cat\na dog\n")
    assert "no such folder" in _error_of(evaluate + fid + ["--fid-real", str(tmp_path / "no-images")], capsys)
    one_image = tmp_path / "one-image"
    one_image.mkdir()
    (one_image / "a.png").write_bytes(b"")
    assert "must hold at least two images" in _error_of(evaluate + fid + ["--fid-real", str(one_image)], capsys)
    (one_image / "b.png").write_bytes(b"not a png")  # was read after the pipeline had loaded, and raised there
    assert "cannot identify image file" in _error_of(evaluate + fid + ["--fid-real", str(one_image)], capsys)
    import sparge_diffusers.eval.run as eval_run

    sizes = []

    def record_size(folder, size):  # the real images are resized to the generated ones' size, 1024 px by default
        sizes.append(size)
        raise OSError("stop before the model loads")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_run, "load_images", record_size)
        for sizing in ([], ["--height", "64", "--width", "48"]):
            assert "stop before" in _error_of(evaluate + fid + ["--fid-real", str(one_image)] + sizing, capsys)
    assert sizes == [(1024, 1024), (64, 48)]
    for argv, missing in ((generate[:1] + generate[3:], "--model"), (generate[:3] + generate[5:], "--out"),
                          (evaluate[:5], "--prompts"), (evaluate[:3] + evaluate[5:], "--out"),
                          (["tune"] + generate[1:5], "--prompts"),
                          (["tune", "--model", model, "--prompts", str(prompts)], "--out"), ([], "command")):
        assert f"the following arguments are required: {missing}" in _error_of(argv, capsys), argv
    prompts.write_text("a cat\n")
    assert "pipe_kwargs sets output_type" in _error_of(evaluate + ["--pipe-arg", "output_type=np"], capsys)
    assert "CLIP model spec" in _error_of(evaluate + ["--clip", "clip-vit"], capsys)  # was loaded after the pipeline
    assert "alexnet" in _error_of(evaluate + ["--lpips-weights", str(tmp_path / "none.pth")], capsys).lower()
    a_file = str(prompts)
    assert "cannot make the output folder" in _error_of(evaluate[:3] + ["--out", a_file] + evaluate[5:], capsys)
    assert "cannot make the output folder" in _error_of(generate[:3] + ["--out", a_file] + generate[5:], capsys)
    assert "cannot read the prompts file" in _error_of(
        ["eval", "--model", model, "--out", str(tmp_path / "e"), "--prompts", str(tmp_path / "none.txt")], capsys)
    tune = ["tune", "--model", model, "--prompts", str(prompts)]
    assert "need 0 < l1 <= l2" in _error_of(tune + ["--out", str(tmp_path / "s.json"), "--l1", "0.1", "--l2",
                                                    "0.05"], capsys)
    assert "positive finite" in _error_of(tune + ["--out", str(tmp_path / "s.json"), "--l1", "nan"], capsys)
    assert "expected a number, got 'x'" in _error_of(tune + ["--out", str(tmp_path / "s.json"), "--l1", "x"], capsys)
    assert "pipe_kwargs sets generator" in _error_of(tune + ["--out", str(tmp_path / "s.json"), "--pipe-arg",
                                                             "generator=1"], capsys)
    assert "is a folder" in _error_of(tune + ["--out", str(tmp_path)], capsys)


def test_tune_command_makes_the_settings_folder_before_loading_the_model(tmp_path):
    import pytest

    pytest.importorskip("diffusers")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    out = tmp_path / "new" / "dir" / "settings.json"
    # no such model: diffusers' error (ValueError in 0.42, OSError in older releases) names the path
    with pytest.raises((ValueError, OSError), match="no-model"):
        main(["tune", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts), "--out", str(out)])
    assert out.parent.is_dir()  # the settings are written after the whole calibration: no folder lost them
