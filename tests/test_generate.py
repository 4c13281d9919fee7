"""``sparge-diffusers generate`` and sparge_diffusers.generation.generate on tiny random-weight pipelines (a CogVideoX
pipeline saved locally and loaded through DiffusionPipeline.from_pretrained; a stand-in image pipeline)."""

import importlib.util
import json
import math
import time

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from sparge_diffusers.cli import main  # noqa: E402
from sparge_diffusers.generation import generate  # noqa: E402
from sparge_diffusers.pipelines import SpargeSettings  # noqa: E402
from json_checks import strict_json_load  # noqa: E402
from tiny_pipes import TinyImagePipeline, save_tiny_cogvideox_pipeline  # noqa: E402

VIDEO_ARGS = ["--steps", "2", "--height", "64", "--width", "64", "--num-frames", "9", "--guidance-scale", "1.0",
              "--quiet"]
LAYERS = {"transformer_blocks.0.attn1", "transformer_blocks.1.attn1"}


@pytest.fixture(scope="module")
def video_model(tmp_path_factory):
    return save_tiny_cogvideox_pipeline(tmp_path_factory.mktemp("cogvideox") / "pipe")


class CountingImagePipeline(TinyImagePipeline):
    """Records the steps of each call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, prompt, generator, output_type, num_inference_steps=1):
        self.calls.append(num_inference_steps)
        return super().__call__(prompt, generator, output_type, num_inference_steps)


def gif_frames(path):
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return np.stack([np.asarray(f.convert("RGB"), dtype=np.int16) for f in ImageSequence.Iterator(image)])


def test_generate_command_saves_videos_and_reports_sparsity(video_model, tmp_path, capsys):
    out = tmp_path / "out"
    start = time.perf_counter()
    assert main(["generate", "--model", video_model, "--prompt", "a cat walks on the moon", "--prompt", "a red car",
                 "--out", str(out), "--seed", "5", "--fps", "4"] + VIDEO_ARGS) == 0
    elapsed = time.perf_counter() - start
    captured = capsys.readouterr()
    printed = captured.out
    assert "CogVideoXTransformer3DModel on cpu, attention sparge" in printed and "prompt_1.gif" in printed
    assert "generate:" not in captured.err  # --quiet (VIDEO_ARGS): no bar of ours
    report = json.loads((out / "generate.json").read_text())
    assert all(f"{r['sparsity']:8.3f}" in printed for r in report["outputs"])  # the table's sparsity column
    assert report["attention"] == "sparge" and report["sparge"]["settings"]["cdfthreshd"] == 0.98
    assert [r["seed"] for r in report["outputs"]] == [5, 6]
    for i, r in enumerate(report["outputs"]):
        assert r["frames"] == 9 and (r["height"], r["width"]) == (64, 64)
        assert set(r["sparsity_by_layer"]) == LAYERS and 0 <= r["sparsity"] <= 1
        assert r["sparsity"] == pytest.approx(sum(r["sparsity_by_layer"].values()) / len(LAYERS))  # the layers' mean
        assert 0 < r["seconds"] < elapsed and r["seconds_per_step"] == pytest.approx(r["seconds"] / 2)
        frames = gif_frames(out / f"prompt_{i}.gif")
        assert frames.shape == (9, 64, 64, 3)
        with Image.open(out / f"prompt_{i}.gif") as gif:
            assert gif.info["duration"] == 250  # ms per frame at --fps 4
    if not (importlib.util.find_spec("imageio") and importlib.util.find_spec("imageio_ffmpeg")):
        assert any("imageio-ffmpeg" in n for n in report["notes"]) and "MP4 not written" in printed
    else:
        assert (out / "prompt_0.mp4").is_file()


def test_keeping_every_block_gives_the_dense_video(video_model, tmp_path):
    """simthreshd1=1 forces every block (no block is that self-similar) and pvthreshd=50 skips no product: the
    sparse path must give the dense frames, up to the reference's float32 rounding against SDPA's."""
    dense, sparse = tmp_path / "dense", tmp_path / "sparse"
    assert main(["generate", "--model", video_model, "--prompt", "a bird flies", "--out", str(dense),
                 "--attention", "dense"] + VIDEO_ARGS) == 0
    assert main(["generate", "--model", video_model, "--prompt", "a bird flies", "--out", str(sparse),
                 "--simthreshd1", "1", "--pvthreshd", "50"] + VIDEO_ARGS) == 0
    report = json.loads((sparse / "generate.json").read_text())
    assert all(s == 0 for s in report["outputs"][0]["sparsity_by_layer"].values())
    a, b = gif_frames(dense / "prompt_0.gif"), gif_frames(sparse / "prompt_0.gif")
    assert np.abs(a - b).max() <= 2  # GIF palettes quantise alike; a real difference moves many levels
    assert json.loads((dense / "generate.json").read_text())["sparge"] is None


def test_several_images_per_prompt_are_all_saved(tmp_path):
    """num_images_per_prompt=2: both images of the call are saved (prompt_<i>_0, prompt_<i>_1), and they differ (two
    latents of one generator), so the second file is not a copy of the first. (diffusers' CogVideoX pipeline fixes
    num_videos_per_prompt to 1; videos go through the same loop.)"""
    from PIL import Image

    report = generate(TinyImagePipeline(), ["a cat", "a dog"], tmp_path, progress=False,
                      pipe_kwargs={"num_inference_steps": 2, "num_images_per_prompt": 2})
    for i, row in enumerate(report["outputs"]):
        assert row["outputs"] == 2 and row["frames"] == 1
        assert [p.rsplit("/", 1)[1] for p in row["files"]] == [f"prompt_{i}_0.png", f"prompt_{i}_1.png"]
        first, second = (np.asarray(Image.open(p), dtype=np.int16) for p in row["files"])
        assert first.shape == second.shape == (16, 16, 3) and np.abs(first - second).max() > 10
        assert row["sparse_calls"] == 4  # 2 steps x 2 layers: one call per layer covers both images (batch 2)
    assert not (tmp_path / "prompt_0.png").exists()


def test_generate_counts_the_pipelines_default_steps_and_runs_one_without_them(tmp_path, capsys):
    """Without num_inference_steps in pipe_kwargs the pipeline's own default counts the steps (the progress bar's
    total, seconds per step); a pipeline whose call takes no num_inference_steps is counted per output. The output
    folder is made with its parents."""

    class ThreeStepPipeline(TinyImagePipeline):  # with diffusers' step callback, called after each step
        seeds: list = []

        def __call__(self, prompt, generator, output_type, num_inference_steps=3, callback_on_step_end=None):
            self.seeds.append(generator.initial_seed())
            out = super().__call__(prompt, generator, output_type, num_inference_steps)
            for step in range(num_inference_steps):
                callback_on_step_end(self, step, 0, {})
            return out

    class StepFreePipeline(TinyImagePipeline):
        def __call__(self, prompt, generator, output_type):
            return super().__call__(prompt, generator, output_type, 2)

    pipe = ThreeStepPipeline()
    report = generate(pipe, ["a cat", "a dog"], tmp_path / "new" / "three", sparse=False, seed=5)  # folder made
    final = capsys.readouterr().err.strip().split("\r")[-1]  # the bar's last state
    assert "6/6" in final and "step" in final
    assert pipe.seeds == [5, 6]  # prompt i with seed + i
    assert report["notes"] == []  # images: no MP4 to miss
    assert [row["seconds_per_step"] for row in report["outputs"]] == [
        pytest.approx(row["seconds"] / 3) for row in report["outputs"]]
    report = generate(StepFreePipeline(), ["a cat", "a dog"], tmp_path / "free", sparse=False)
    final = capsys.readouterr().err.strip().split("\r")[-1]
    assert "2/2" in final and "output" in final
    assert not any("seconds_per_step" in row for row in report["outputs"])
    assert all((tmp_path / "free" / f"prompt_{i}.png").is_file() for i in range(2))


def test_dense_steps_reach_the_processor(video_model, tmp_path):
    """With every step dense no sparse call is recorded; with one of two, the sparse step is."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog runs\n")
    for dense_steps, recorded in ((2, set()), (1, LAYERS)):
        out = tmp_path / f"d{dense_steps}"
        assert main(["generate", "--model", video_model, "--prompts", str(prompts), "--out", str(out),
                     "--dense-steps", str(dense_steps)] + VIDEO_ARGS) == 0
        row = json.loads((out / "generate.json").read_text())["outputs"][0]
        assert set(row["sparsity_by_layer"]) == recorded, dense_steps
        assert row["sparse_calls"] == len(recorded)
    pipe = CountingImagePipeline()  # the warm-up call runs the dense steps and one sparse step
    generate(pipe, ["a cat"], tmp_path / "w", dense_steps=2, warmup=True, pipe_kwargs={"num_inference_steps": 4},
             progress=False)
    assert pipe.calls == [3, 4]


def test_generate_images_with_warmup_settings_file_and_progress(tmp_path, capsys):
    from sparge_diffusers.pipelines import LayerSettingsFile

    pipe = CountingImagePipeline()
    aggressive = tmp_path / "aggressive.json"
    LayerSettingsFile(model_class="FluxTransformer2DModel", layers={
        "transformer_blocks.0.attn": SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3)}).save(aggressive)
    report = generate(pipe, ["a cat", "a dog"], tmp_path / "out", layer_settings=str(aggressive),
                      settings=SpargeSettings(cdfthreshd=0.5, pvthreshd=math.inf),  # stage 2 off: null in the file
                      pipe_kwargs={"num_inference_steps": 3}, warmup=True)
    assert pipe.calls == [1, 3, 3]
    captured = capsys.readouterr()
    assert "generate: 100%" in captured.err and "6/6" in captured.err  # steps of the timed calls
    for i, row in enumerate(report["outputs"]):
        from PIL import Image

        with Image.open(tmp_path / "out" / f"prompt_{i}.png") as image:
            assert image.size == (16, 16)
        assert row["sparse_calls"] == 6  # 3 steps x 2 layers (the warm-up's calls are not counted)
        assert set(row["sparsity_by_layer"]) == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
        assert row["sparsity_by_layer"]["transformer_blocks.0.attn"] > 0.3  # the file's aggressive layer
    assert report["sparge"]["layer_settings"] == str(aggressive) and report["warmup"] is True
    assert report["sparge"]["settings"]["cdfthreshd"] == 0.5
    written = strict_json_load(tmp_path / "out" / "generate.json")["sparge"]["settings"]
    assert written["cdfthreshd"] == 0.5 and written["pvthreshd"] is None
    processors = {type(m.processor).__name__ for m in pipe.transformer.modules() if hasattr(m, "processor")}
    assert processors == {"FluxAttnProcessor"}, "generate puts the native processors back"


def test_generate_compiled_restores_the_transformer(tmp_path):
    """Compiled, with every block kept: the eager dense image, no statistics, and the transformer and its
    native processors back afterwards."""
    pipe = TinyImagePipeline()
    transformer = pipe.transformer
    eager = generate(pipe, ["a cat"], tmp_path / "eager", sparse=False, pipe_kwargs={"num_inference_steps": 1},
                     progress=False)
    compiled = generate(pipe, ["a cat"], tmp_path / "compiled", settings=SpargeSettings(simthreshd1=1.0),
                        compile=True, pipe_kwargs={"num_inference_steps": 1}, progress=False)
    assert pipe.transformer is transformer and compiled["compile"] is True and eager["compile"] is False
    assert "sparsity" not in compiled["outputs"][0] and "sparse_calls" not in compiled["outputs"][0]
    assert {type(m.processor).__name__ for m in transformer.modules() if hasattr(m, "processor")} == {
        "FluxAttnProcessor"}
    from PIL import Image

    a, b = (np.asarray(Image.open(tmp_path / d / "prompt_0.png"), dtype=np.int16) for d in ("eager", "compiled"))
    assert np.abs(a - b).max() <= 1


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "a cat", "--attention", "dense,sparge"], "generate runs one mode"),
    (["--prompt", "a cat", "--attention", "dense", "--cdfthreshd", "0.9"], "--cdfthreshd apply to sparge attention"),
    (["--prompt", "a cat", "--attention", "dense", "--dense-steps", "2"], "--dense-steps apply to sparge"),
    (["--prompt", "a cat", "--attention", "dense", "--simthreshd1", "0"], "--simthreshd1 apply to sparge"),  # 0 is set
    (["--prompt", "a cat", "--attention", "dense", "--strict"], "--strict apply to sparge"),
    (["--prompt", "a cat", "--cdfthreshd", "1.5"], "cdfthreshd values must lie in [0.0, 1.0]"),  # before loading
    (["--prompt", "a cat", "--pvthreshd", "0"], "pvthreshd values must lie in (0, inf]"),
])
def test_generate_command_errors(tmp_path, capsys, argv, message):
    assert main(["generate", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o")] + argv) == 2
    assert message in capsys.readouterr().err


def test_generate_command_needs_a_prompt(tmp_path, capsys):
    empty = tmp_path / "p.txt"
    empty.write_text("\n")
    assert main(["generate", "--model", "m", "--out", str(tmp_path / "o"), "--prompts", str(empty)]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --prompt and --prompts exclude each other, one is required
        main(["generate", "--model", "m", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main(["generate", "--model", "m", "--out", str(tmp_path / "o"), "--prompt", "a", "--prompts", str(empty)])


@pytest.mark.gpu
def test_generate_command_on_gpu(video_model, tmp_path):
    """The Triton kernels through the command on CUDA (bf16): keeping every block gives the dense frames."""
    dense, sparse, default = tmp_path / "dense", tmp_path / "sparse", tmp_path / "default"
    assert main(["generate", "--model", video_model, "--prompt", "a bird flies", "--out", str(dense),
                 "--attention", "dense"] + VIDEO_ARGS) == 0
    assert main(["generate", "--model", video_model, "--prompt", "a bird flies", "--out", str(sparse),
                 "--simthreshd1", "1", "--warmup"] + VIDEO_ARGS) == 0
    assert main(["generate", "--model", video_model, "--prompt", "a bird flies", "--out", str(default)]
                + VIDEO_ARGS) == 0
    report = json.loads((sparse / "generate.json").read_text())
    assert report["device"] != "cpu" and report["warmup"] is True
    assert report["outputs"][0]["sparse_calls"] == 4  # 2 steps x 2 layers, the warm-up's not counted
    a, b = gif_frames(dense / "prompt_0.gif"), gif_frames(sparse / "prompt_0.gif")
    assert np.abs(a - b).mean() < 1.0  # bf16: our kernel's rounding against SDPA's, not a different video
    assert json.loads((default / "generate.json").read_text())["outputs"][0]["sparse_calls"] == 4
