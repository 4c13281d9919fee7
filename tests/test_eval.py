"""Evaluation metrics on inputs with known answers, metric models with random weights built here (nothing
downloads), and the eval runner end to end on tiny models."""

import csv
import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchmetrics")

from sparge_diffusers.eval import (  # noqa: E402
    LPIPS, ClipModel, clip_score, clip_temp, clipsim, fid, parse_modes, psnr, sharpness, ssim, temporal_flicker)
from sparge_diffusers.eval.fidelity import ALEXNET_FILE  # noqa: E402
from json_checks import strict_json_load  # noqa: E402
from tiny_pipes import TinyImagePipeline  # noqa: E402


def images(n=4, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, size // 8, size // 8, generator=g)
    return F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)


# --- fidelity -----------------------------------------------------------------------------------------

def test_psnr_ssim_lpips_of_identical_images():
    x = images()
    lpips = LPIPS()
    assert psnr(x, x) == math.inf
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-6)
    assert lpips.distance(x, x) == pytest.approx(0.0, abs=1e-7)


def test_psnr_known_value_and_ordering():
    x = images()
    y = 0.9 * x  # so that y + 0.1 stays in [0, 1]
    assert psnr(y + 0.1, y) == pytest.approx(20.0, abs=1e-4)  # MSE 0.01 (up to float32 rounding of y + 0.1)
    def noisy(s):
        return (x + s * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)

    assert psnr(noisy(0.02), x) > psnr(noisy(0.1), x)
    assert ssim(noisy(0.02), x) > ssim(noisy(0.1), x)
    # flat images leave SSIM's luminance term alone, (2ab + C1) / (a^2 + b^2 + C1) with C1 = (0.01 * data range)^2
    assert ssim(torch.full((2, 3, 32, 32), 0.1), torch.zeros(2, 3, 32, 32)) == pytest.approx(1e-4 / 0.0101, rel=1e-4)
    lpips = LPIPS()
    assert 0 < lpips.distance(noisy(0.02), x) < lpips.distance(noisy(0.2), x)


def test_fidelity_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(images(2), images(3))
    with pytest.raises(ValueError, match="3, H, W"):
        ssim(torch.rand(2, 1, 8, 8), torch.rand(2, 1, 8, 8))
    with pytest.raises(ValueError, match="3, H, W"):  # one (3, H, W) image without its batch dimension, H = 3
        psnr(torch.rand(3, 3, 8), torch.rand(3, 3, 8))
    # SSIM's 11-px window is reflect-padded by 5: a 5-px side failed inside torch's padding without a word of why
    for side in ((5, 8), (8, 5)):
        with pytest.raises(ValueError, match="ssim needs images of at least 6 px a side") as error:
            ssim(torch.rand(1, 3, *side), torch.rand(1, 3, *side))
        assert str(error.value).endswith(f"got {side}")
    assert -1 <= ssim(torch.rand(1, 3, 6, 6), torch.rand(1, 3, 6, 6)) <= 1  # from 6 px it is computed
    # the range check's tolerance is inclusive: a decoder output exactly 0.01 outside [0, 1] passes
    from sparge_diffusers.eval._images import RANGE_TOLERANCE, check_unit_images

    edge = images(2).double()
    edge[0, 0, 0, 0], edge[1, 2, 3, 4] = -RANGE_TOLERANCE, 1 + RANGE_TOLERANCE
    check_unit_images(edge)
    for outside in (-RANGE_TOLERANCE - 1e-9, 1 + RANGE_TOLERANCE + 1e-9):
        edge[0, 0, 0, 0] = outside
        with pytest.raises(ValueError, match="values span"):
            check_unit_images(edge)


def test_metrics_refuse_empty_inputs_and_batches_that_skip_images():
    """Each gave a number or a stray error: LPIPS with batch=-1 visited no image and returned 0.0 (a perfect score);
    zero images gave PSNR NaN, LPIPS ZeroDivisionError and SSIM an IndexError inside torchmetrics; sharpness of
    3 x 3 frames took the variance of one Laplacian value, NaN."""
    x, y = images(3), images(3, seed=1)
    lpips = LPIPS()
    want = lpips.distance(x, y)
    assert lpips.distance(x, y, batch=1) == pytest.approx(want)
    assert lpips.distance(x, y, batch=100) == pytest.approx(want)
    for batch in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch must be a positive int"):
            lpips.distance(x, y, batch=batch)
    empty = torch.rand(0, 3, 32, 32)
    for metric in (psnr, ssim, lpips.distance):
        with pytest.raises(ValueError, match="no pixels"):
            metric(empty, empty)
    with pytest.raises(ValueError, match="no pixels"):
        psnr(torch.rand(2, 3, 0, 8), torch.rand(2, 3, 0, 8))
    with pytest.raises(ValueError, match="no pixels"):
        sharpness(torch.rand(0, 3, 8, 8))
    with pytest.raises(ValueError, match="at least 3 x 4"):
        sharpness(torch.rand(2, 3, 3, 3))
    assert math.isfinite(sharpness(torch.rand(2, 3, 3, 4))) and math.isfinite(sharpness(torch.rand(2, 3, 4, 3)))
    model = ClipModel(encode_image_fn=lambda t: t.flatten(1), encode_text_fn=lambda t: torch.ones(len(t), 1),
                      image_size=4)
    assert model.encode_images(x, batch=2).shape == (3, 48)
    for batch in (0, -2, 2.0):
        with pytest.raises(ValueError, match="batch must be a positive int"):
            model.encode_images(x, batch=batch)


@pytest.mark.parametrize("data, message", [
    (lambda x: (x * 255).round().to(torch.uint8), "uint8"),  # what PIL / numpy images give
    (lambda x: x * 2 - 1, r"values span \[-0\.\d+, 0\.\d+\], not \[0, 1\]"),  # a VAE decoder's [-1, 1] output
    (lambda x: x * 255, r"values span \[\d+\.?\d*, 2\d\d\.?\d*\], not \[0, 1\]"),  # [0, 255] floats
], ids=["uint8", "minus_one_to_one", "zero_to_255"])
def test_every_metric_rejects_images_outside_0_1(data, message):
    """Each metric scales, normalises or clamps assuming [0, 1]; other data gave plausible wrong numbers
    (uint8 images: CLIP's clamp made them white, PSNR and SSIM used the wrong data range)."""
    from sparge_diffusers.eval import dover_views

    x = images(2, 32)
    bad = data(x)
    clip = ClipModel(encode_image_fn=lambda t: t.flatten(1), encode_text_fn=lambda t: torch.ones(len(t), 3 * 16 * 16),
                     image_size=16)
    calls = [lambda: psnr(bad, x), lambda: psnr(x, bad), lambda: ssim(bad, x), lambda: LPIPS()(bad, x),
             lambda: clip_score(bad, ["a", "b"], clip), lambda: clipsim(bad, "a", clip), lambda: clip_temp(bad, clip),
             lambda: fid(bad, x, feature=SmallFeatures()), lambda: fid(x, bad, feature=SmallFeatures()),
             lambda: temporal_flicker(bad), lambda: sharpness(bad), lambda: dover_views(bad)]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    stray = (x * 1.008 - 0.004)  # a decoder output a hair outside [0, 1] is still accepted
    assert psnr(stray, x) > 40 and math.isfinite(clip_score(stray, ["a", "b"], clip))


def test_lpips_loads_weight_files(tmp_path):
    torch.manual_seed(0)
    backbone = LPIPS().features
    path = tmp_path / ALEXNET_FILE
    torch.save({f"features.{k}": v for k, v in backbone.state_dict().items()} | {"classifier.1.weight": torch.ones(1)},
               path)
    lpips = LPIPS.from_files(path)  # layer weights: the LPIPS v0.1 copy that torchmetrics ships
    for a, b in zip(lpips.features.state_dict().values(), backbone.state_dict().values()):
        assert torch.equal(a, b)
    assert all((p >= 0).all() for p in lpips.lins), "LPIPS layer weights are non-negative"
    x = images()
    assert lpips.distance(x, x) == 0 and lpips.distance(images(seed=1), x) > 0
    with pytest.raises(FileNotFoundError, match=ALEXNET_FILE):
        LPIPS.from_files(tmp_path / "missing.pth")


def torchvision_alexnet_features():
    """torchvision's ``alexnet().features``, written out here (torchvision is not a dependency)."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
                         nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
                         nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))


def test_lpips_equals_torchmetrics_lpips_given_the_same_backbone(tmp_path, monkeypatch):
    # The oracle is torchmetrics' own LPIPS network: its input scaling, unit normalisation, layer weights (the same
    # shipped alex.pth), spatial mean and sum over layers. Only its backbone is swapped for a random AlexNet, since
    # torchvision (which would build it) is not installed and the real weights would need a download.
    from torchmetrics.functional.image import lpips as tm_lpips

    torch.manual_seed(0)
    backbone = torchvision_alexnet_features()
    monkeypatch.setattr(tm_lpips, "_get_tv_model_features", lambda net, pretrained=False: backbone)
    oracle = tm_lpips._LPIPS(pretrained=True, net="alex", pnet_rand=True).eval()
    path = tmp_path / ALEXNET_FILE
    torch.save({f"features.{k}": v for k, v in backbone.state_dict().items()}, path)
    lpips = LPIPS.from_files(path)
    for size in ((31, 45), (40, 33), (64, 64), (131, 67)):  # AlexNet's smallest input (31 px) and odd sizes
        x = torch.rand(3, 3, *size, generator=torch.Generator().manual_seed(sum(size)))
        for y in (x.flip(0), (x + 0.05 * torch.randn_like(x)).clamp(0, 1), x.roll(7, -1)):
            want = oracle(x, y, normalize=True).flatten().double()
            got = lpips(x, y).double()
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (size, got, want)
            assert lpips.distance(x, y, batch=2) == pytest.approx(float(want.mean()), rel=1e-4)
    x = torch.rand(2, 3, 20, 48)  # a side shorter than AlexNet takes: upsampled to a short side of 31 first
    up = F.interpolate(torch.cat([x, x.flip(0)]), size=(31, 74), mode="bilinear", align_corners=False)
    assert torch.allclose(lpips(x, x.flip(0)), oracle(up[:2], up[2:], normalize=True).flatten(), rtol=1e-4)


# --- FID ----------------------------------------------------------------------------------------------

class SmallFeatures(torch.nn.Module):
    """A fixed random feature extractor standing in for Inception (images in [0, 1] -> 8 features)."""

    num_features = 8

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 5, stride=2)

    def forward(self, x):
        return self.conv(x.float()).relu().mean((2, 3))


def frechet(a, b):
    """|mu_a - mu_b|^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)), in float64."""
    a, b = a.double(), b.double()
    sa, sb = torch.cov(a.T), torch.cov(b.T)
    root = torch.linalg.eigvals(sa @ sb).real.clamp(min=0).sqrt().sum()
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + sa.trace() + sb.trace() - 2 * root)


def test_fid_same_set_is_zero_and_shifted_set_matches_the_formula():
    real, feature = images(16), SmallFeatures()
    assert abs(fid(real, real, feature=feature)) < 1e-4
    fake = real * 0.6 + 0.3
    with torch.no_grad():
        expected = frechet(feature(real), feature(fake))
    assert expected > 1e-3
    assert fid(real, fake, feature=feature) == pytest.approx(expected, rel=1e-3)
    assert fid(real, real * 0.3 + 0.5, feature=feature) > fid(real, fake, feature=feature)


def test_fid_errors():
    for real, fake in ((1, 1), (1, 3), (3, 1)):  # each set needs two images, whatever the other holds
        with pytest.raises(ValueError, match="at least two"):
            fid(images(real), images(fake), feature=SmallFeatures())
    for weights in ("/nowhere/inception.pth", None):
        with pytest.raises(FileNotFoundError, match="weights-inception-2015-12-05"):
            fid(images(2), images(2), inception_weights=weights)


def test_fid_builds_the_standard_metric_on_the_inception_weights_given(tmp_path, monkeypatch):
    """Without a custom feature: torchmetrics' 2048-feature Inception FID on the weights file, images in [0, 1]
    (``normalize``: it scales them to the 0-255 bytes Inception takes). The metric is recorded, not run: its
    weights are a download."""
    import torchmetrics.image.fid as torchmetrics_fid

    made = []

    class Recorder:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def update(self, imgs, real):
            pass

        def compute(self):
            return torch.tensor(1.5)

    monkeypatch.setattr(torchmetrics_fid, "FrechetInceptionDistance", Recorder)
    weights = tmp_path / "weights-inception-2015-12-05-6726825d.pth"
    weights.write_bytes(b"")
    assert fid(images(2), images(2), inception_weights=weights) == 1.5
    assert made == [dict(feature=2048, normalize=True, feature_extractor_weights_path=str(weights))]


# --- CLIP ---------------------------------------------------------------------------------------------

WORDS = "a an the cat dog red blue on in moon sky sea car tree".split()


def save_tiny_transformers_clip(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                            model_max_length=16).save_pretrained(path)
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(path)
    return f"transformers:{path}"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    pytest.importorskip("transformers")
    from sparge_diffusers.eval import load_clip

    return load_clip(save_tiny_transformers_clip(tmp_path_factory.mktemp("clip")))


def test_clip_metrics_on_known_answers(tiny_clip):
    frames = images(6, size=48)
    still = frames[:1].expand(5, -1, -1, -1)
    assert clip_temp(still, tiny_clip) == pytest.approx(1.0, abs=1e-5)
    assert clip_temp(frames, tiny_clip) < 1.0
    e_img, e_txt = tiny_clip.encode_images(frames), tiny_clip.encode_texts(["a red car"])
    assert torch.allclose(e_img.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert clipsim(frames, "a red car", tiny_clip) == pytest.approx(float((e_img @ e_txt[0]).mean()), abs=1e-6)
    prompts = ["a cat", "the moon", "a blue sea"]
    cos = (tiny_clip.encode_images(frames[:3]) * tiny_clip.encode_texts(prompts)).sum(-1)
    assert clip_score(frames[:3], prompts, tiny_clip) == pytest.approx(float((100 * cos.clamp(min=0)).mean()), abs=1e-4)
    with pytest.raises(ValueError, match="3 images but 2 prompts"):
        clip_score(frames[:3], prompts[:2], tiny_clip)
    with pytest.raises(ValueError, match="two frames"):
        clip_temp(frames[:1], tiny_clip)
    with pytest.raises(ValueError, match="one str per image"):  # was one prompt per character
        clip_score(frames[:5], "a cat", tiny_clip)
    with pytest.raises(ValueError, match="takes one prompt"):
        clipsim(frames, ["a red car"], tiny_clip)


def test_clip_preprocess_resizes_and_crops():
    model = ClipModel(encode_image_fn=lambda x: x.flatten(1), encode_text_fn=lambda t: torch.zeros(len(t), 1),
                      image_size=16)
    x = model.preprocess(torch.rand(2, 3, 40, 64))
    assert x.shape == (2, 3, 16, 16)


def test_clip_score_equals_torchmetrics_image_by_image(tmp_path):
    # The oracle is torchmetrics' clip_score with transformers' own CLIPImageProcessor (resize, crop, normalise)
    # and tokenizer, on the same tiny random CLIP. Noise images are the hard case for resizing: there a long side
    # of 68 instead of 67 pixels (70x33 resized to a short side of 32) moved scores by up to 6 points of 100.
    from torchmetrics.functional.multimodal import clip_score as torchmetrics_clip_score
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from sparge_diffusers.eval import load_clip

    ours = load_clip(save_tiny_transformers_clip(tmp_path))
    model = CLIPModel.from_pretrained(tmp_path).eval()
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=AutoTokenizer.from_pretrained(tmp_path))

    class Projections:  # torchmetrics 1.9 takes features as tensors; transformers 5 returns model outputs
        config = model.config

        def to(self, device):
            return self

        def get_image_features(self, *args, **kwargs):
            out = model.get_image_features(*args, **kwargs)
            return out if isinstance(out, torch.Tensor) else out.pooler_output

        def get_text_features(self, *args, **kwargs):
            out = model.get_text_features(*args, **kwargs)
            return out if isinstance(out, torch.Tensor) else out.pooler_output

    prompts = [f"{a} {b}" for i, a in enumerate(WORDS[3:9]) for b in WORDS[4 + i:9]]  # 15 of two words
    for size in ((32, 32), (40, 64), (70, 33)):
        pixels = torch.randint(0, 256, (3, 3, *size), generator=torch.Generator().manual_seed(size[0]),
                               dtype=torch.uint8)
        with torch.no_grad():
            want = torch.tensor([[float(torchmetrics_clip_score(image, [p], lambda: (Projections(), processor)))
                                  for p in prompts] for image in pixels])
        got = torch.tensor([[clip_score(image[None].float() / 255, [p], ours) for p in prompts] for image in pixels])
        assert (want > 1).sum() >= 3 and (want == 0).sum() >= 1, want  # both sides of the clamp are drawn
        # PIL's resize rounds to 8 bits between its two passes; without resizing the scores are equal
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 if size == (32, 32) else 0.25), (size, got - want)
        pairs = [int(want[i].argmax()) for i in range(3)]  # a batch scores the mean of its images' scores
        assert clip_score(pixels.float() / 255, [prompts[j] for j in pairs], ours) == pytest.approx(
            float(want[range(3), pairs].mean()), abs=0.25)


def test_load_clip_errors(tmp_path, monkeypatch):
    from sparge_diffusers.eval import load_clip

    with pytest.raises(ValueError, match="open_clip:ARCH:WEIGHTS"):
        load_clip("clip-vit")
    with pytest.raises(FileNotFoundError, match="open_clip_pytorch_model.bin"):
        load_clip("open_clip:ViT-B-32:/nowhere/open_clip_pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_clip(f"transformers:{tmp_path}")
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):  # a file name without a folder
        load_clip("open_clip:ViT-B-32:model.safetensors")
    asked = []

    def create_model(arch, pretrained=None, device=None):  # stands in for open_clip's: nothing downloads
        asked.append((arch, pretrained))
        raise LookupError("stub")

    monkeypatch.setitem(sys.modules, "open_clip", types.SimpleNamespace(create_model=create_model))
    with pytest.raises(LookupError, match="stub"):  # a pretrained tag is no file name: open_clip is asked for it
        load_clip("open_clip:ViT-B-32:laion2b_s34b_b79k")
    assert asked == [("ViT-B-32", "laion2b_s34b_b79k")]


def test_open_clip_architecture_with_random_weights():
    open_clip = pytest.importorskip("open_clip", reason="open_clip needs torchvision, which this torch build lacks")
    from sparge_diffusers.eval import from_open_clip

    torch.manual_seed(0)
    model = open_clip.CLIP(embed_dim=16,
                           vision_cfg=dict(image_size=32, layers=1, width=32, patch_size=8, head_width=16),
                           text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=1)).eval()
    clip = from_open_clip(model, open_clip.tokenizer.SimpleTokenizer(context_length=16))
    frames = images(4, size=40)
    assert clip_temp(frames[:1].expand(3, -1, -1, -1), clip) == pytest.approx(1.0, abs=1e-5)
    assert -1 <= clipsim(frames, "a cat on the moon", clip) <= 1
    assert 0 <= clip_score(frames[:2], ["a cat", "a dog"], clip) <= 100


# --- video indicators and modes ------------------------------------------------------------------------

def test_video_indicators():
    frames = images(5)
    still = frames[:1].expand(5, -1, -1, -1)
    assert temporal_flicker(still) == 0 and temporal_flicker(frames) > 0
    assert sharpness(torch.full((2, 3, 16, 16), 0.5)) == 0
    blurred = F.avg_pool2d(F.pad(frames, (2, 2, 2, 2), mode="replicate"), 5, stride=1)
    assert sharpness(blurred) < sharpness(frames)
    # known values: black, red, green, blue frames change luma (0.299 R + 0.587 G + 0.114 B) by 0.299, 0.288, 0.473;
    # a checkerboard's Laplacian is +-4 at each of the 14 x 14 valid pixels (unbiased variance)
    colours = torch.zeros(4, 3, 8, 8)
    colours[1, 0], colours[2, 1], colours[3, 2] = 1, 1, 1
    assert temporal_flicker(colours) == pytest.approx((0.299 + 0.288 + 0.473) / 3, rel=1e-6)
    assert temporal_flicker(colours[:2]) == pytest.approx(0.299, rel=1e-6)  # two frames are enough
    board = ((torch.arange(16)[:, None] + torch.arange(16)) % 2).float().expand(2, 3, 16, 16)
    assert sharpness(board) == pytest.approx(16 * 196 / 195, rel=1e-6)


def test_parse_modes(tmp_path):
    settings = tmp_path / "flux-tuned.json"
    settings.write_text("{}")
    modes = parse_modes(f"dense,sparge,sparge:{settings}")
    assert [m.name for m in modes] == ["dense", "sparge", "sparge:flux-tuned"]
    assert [m.sparse for m in modes] == [False, True, True] and modes[2].settings_file == str(settings)
    for bad in ["", "dense,dense", "flash", "dense:x"]:
        with pytest.raises(ValueError):
            parse_modes(bad)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        parse_modes("sparge:missing.json")


# --- the runner end to end -----------------------------------------------------------------------------

def test_evaluate_image_pipeline(tmp_path, tiny_clip):
    pytest.importorskip("diffusers")
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.pipelines import LayerSettingsFile, SpargeSettings

    pipe = TinyImagePipeline()
    aggressive = tmp_path / "aggressive.json"
    LayerSettingsFile(model_class="FluxTransformer2DModel", layers={
        n: SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3, pvthreshd=None)
        for n in ("transformer_blocks.0.attn", "single_transformer_blocks.0.attn")}).save(aggressive)
    modes = [AttentionMode("dense", False), AttentionMode("keep-all", True, None),
             AttentionMode("aggressive", True, str(aggressive))]
    from PIL import Image

    from sparge_diffusers.eval.run import load_images

    real_dir = tmp_path / "real"
    real_dir.mkdir()
    for i in range(3):
        Image.fromarray((images(1, 32, seed=i)[0].permute(1, 2, 0) * 255).byte().numpy()).save(real_dir / f"{i}.png")
    real = load_images(real_dir, (16, 16))
    assert real.shape == (3, 3, 16, 16) and 0 <= real.min() and real.max() <= 1
    pair = tmp_path / "pair"
    pair.mkdir()
    for i in range(2):
        (real_dir / f"{i}.png").rename(pair / f"{i}.png")
    assert torch.equal(load_images(pair, (16, 16)), real[:2])  # two images are enough for FID
    (pair / "1.png").unlink()
    with pytest.raises(ValueError, match="at least two images"):
        load_images(pair, (16, 16))
    with pytest.raises(ValueError, match="distinct names"):  # outputs are kept by name: the second overwrote
        evaluate(pipe, ["a cat"], [modes[1], AttentionMode("keep-all", True)], tmp_path / "bad", progress=False)
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate(pipe, [], modes, tmp_path / "bad", progress=False)
    with pytest.raises(ValueError, match="real_images: expected float"):  # before generating anything
        evaluate(pipe, ["a cat"], modes, tmp_path / "bad", real_images=(real * 255).byte(), progress=False)
    assert not (tmp_path / "bad").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = evaluate(pipe, ["a cat", "a red car", "the moon"], modes, tmp_path / "out", pipe_kwargs={
            "num_inference_steps": 2}, clip=tiny_clip, lpips=LPIPS(), fid_feature=SmallFeatures(), real_images=real,
            progress=False)
    assert not [w for w in caught if "skipped" in str(w.message)]  # every metric asked for applies to images
    s = report["summary"]
    assert report["kind"] == "image" and set(s) == {"dense", "keep-all", "aggressive"}
    samples = report["samples"]
    assert [r["seed"] for r in samples if r["mode"] == "aggressive"] == [0, 1, 2]  # prompt i with seed + i
    assert all(r["seconds_per_step"] == r["seconds"] / 2 for r in samples)
    layers = report["sparsity_by_layer"]["aggressive"]
    assert s["aggressive"]["sparsity"] == pytest.approx(sum(layers.values()) / len(layers))
    assert s["dense"]["psnr"] == math.inf and s["dense"]["lpips"] == 0 and abs(s["dense"]["fid_vs_dense"]) < 1e-3
    assert s["keep-all"]["sparsity"] == 0 and s["aggressive"]["sparsity"] > 0.2
    assert all(v["fid_vs_real"] > 0 for v in s.values())
    assert s["aggressive"]["psnr"] < math.inf and 0 < s["aggressive"]["ssim"] < 1
    assert 0 <= s["aggressive"]["clip_score"] <= 100 and s["aggressive"]["seconds_per_step"] > 0
    assert set(report["sparsity_by_layer"]["aggressive"]) == {"transformer_blocks.0.attn",
                                                              "single_transformer_blocks.0.attn"}
    out = tmp_path / "out"
    strict = strict_json_load(out / "report.json")
    assert strict["summary"]["aggressive"]["sparsity"] > 0.2
    # dense against itself: PSNR infinite in the returned report, null in the file, and marked identical
    assert strict["summary"]["dense"]["psnr"] is None and strict["summary"]["dense"]["identical_to_dense"] == 1
    assert strict["summary"]["aggressive"]["identical_to_dense"] == 0
    assert all(r["psnr"] is None and r["identical_to_dense"] for r in strict["samples"] if r["mode"] == "dense")
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and {r["mode"] for r in rows} == {"dense", "keep-all", "aggressive"}
    with Image.open(out / "grid_0.png") as image:
        assert image.size == (3 * 16, 16)  # three modes side by side
    assert (out / "quality_vs_time.png").stat().st_size > 0
    # the model is back on its native processors afterwards
    assert all(type(m.processor).__name__ == "FluxAttnProcessor" for m in pipe.transformer.modules()
               if hasattr(m, "processor"))


def test_eval_command_on_a_locally_saved_video_pipeline(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from tiny_pipes import save_tiny_cogvideox_pipeline

    from sparge_diffusers.cli import main

    model = save_tiny_cogvideox_pipeline(tmp_path / "pipe")
    clip = save_tiny_transformers_clip(tmp_path / "clip")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat walks on the moon\na red car under the sea\n")
    out = tmp_path / "eval"
    assert main(["eval", "--model", model, "--prompts", str(prompts), "--attention", "dense,sparge", "--out", str(out),
                 "--steps", "2", "--height", "64", "--width", "64", "--num-frames", "9", "--guidance-scale", "1.0",
                 "--clip", clip, "--quiet"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "eval:" not in captured.err  # --quiet: no bar of ours
    assert "CogVideoXTransformer3DModel on cpu" in printed and "clipsim" in printed
    report = strict_json_load(out / "report.json")
    assert report["kind"] == "video" and report["device"] == "cpu"
    for mode in ("dense", "sparge"):
        s = report["summary"][mode]
        assert -1 <= s["clipsim"] <= 1 and -1 <= s["clip_temp"] <= 1 and s["temporal_flicker"] >= 0
    assert "sparsity" in report["summary"]["sparge"] and set(report["sparsity_by_layer"]["sparge"]) == {
        "transformer_blocks.0.attn1", "transformer_blocks.1.attn1"}
    assert report["summary"]["dense"]["psnr"] is None and report["summary"]["dense"]["identical_to_dense"] == 1
    for name in ("metrics.csv", "grid_0.png", "grid_0.gif", "grid_1.png", "quality_vs_time.png"):
        assert (out / name).is_file(), name
    from PIL import Image

    with Image.open(out / "grid_0.gif") as gif:
        assert gif.n_frames == 9 and gif.size == (2 * 64, 64)


def test_eval_command_fails_before_generating_when_weights_are_missing(tmp_path, capsys):
    from sparge_diffusers.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--prompts", str(prompts), "--out",
                 str(tmp_path / "o"), "--lpips-weights", str(tmp_path / "alexnet.pth")]) == 2  # not a loading error
    assert ALEXNET_FILE in capsys.readouterr().err


@pytest.mark.gpu
def test_eval_command_on_gpu(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from tiny_pipes import save_tiny_cogvideox_pipeline

    from sparge_diffusers.cli import main

    model = save_tiny_cogvideox_pipeline(tmp_path / "pipe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat walks on the moon\n")
    out = tmp_path / "eval"
    assert main(["eval", "--model", model, "--prompts", str(prompts), "--out", str(out), "--steps", "2", "--height",
                 "64", "--width", "64", "--num-frames", "9", "--guidance-scale", "1.0", "--quiet"]) == 0
    report = strict_json_load(out / "report.json")
    assert report["device"] != "cpu" and "sparge" in report["sparsity_by_layer"]
    sparge = report["summary"]["sparge"]
    assert sparge["identical_to_dense"] == 1 or sparge["psnr"] > 20  # identical: PSNR infinite, null in the file


def test_evaluate_refuses_metrics_it_could_not_compute_and_warns_of_skipped_ones(tmp_path):
    """Asked-for metrics were left out of the report without a word: FID with one prompt, real images without FID
    weights, LPIPS without the dense mode; FID of videos and DOVER of images are skipped with a warning."""
    pytest.importorskip("diffusers")
    from sparge_diffusers.eval import AttentionMode, evaluate

    pipe = TinyImagePipeline()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    dense, sparse = AttentionMode("dense", False), AttentionMode("sparge", True)
    cases = [(dict(prompts=["a cat"], modes=[dense], fid_feature=torch.nn.Identity()), "at least two prompts"),
             (dict(prompts=["a cat", "a dog"], modes=[dense], real_images=images(2)), "real_images is for FID"),
             (dict(prompts=["a cat"], modes=[sparse], lpips=object()), "list 'dense' among the modes")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            evaluate(pipe, out_dir=tmp_path / "e", progress=False, **kwargs)
    assert calls == []  # refused before generating
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = evaluate(pipe, ["a cat", "a dog"], [dense], tmp_path / "e", dover=object(), progress=False,
                          fid_feature=SmallFeatures())
    assert [str(w.message) for w in caught if "skipped" in str(w.message)] == [
        "evaluate: DOVER (a video metric) skipped for these images"]  # FID is not: two prompts are enough
    assert report["kind"] == "image" and abs(report["summary"]["dense"]["fid_vs_dense"]) < 1e-3

    class VideoPipeline:  # three random frames per call
        transformer = torch.nn.Linear(1, 1)

        def __call__(self, prompt, generator, output_type):
            return type("Output", (), {"frames": torch.rand(1, 3, 3, 16, 16, generator=generator)})()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = evaluate(VideoPipeline(), ["a cat", "a dog"], [dense], tmp_path / "v", fid_feature=torch.nn.Identity(),
                          progress=False)
    assert [str(w.message) for w in caught if "skipped" in str(w.message)] == [
        "evaluate: FID (an image metric) skipped for these videos"]
    assert report["kind"] == "video" and "fid_vs_dense" not in report["summary"]["dense"]


def test_evaluate_video_grid_shows_eight_evenly_spaced_frames_and_the_bar_counts_samples(tmp_path, capsys,
                                                                                         monkeypatch):
    """A video of 11 frames: the grid shows frames round(j * 10 / 7), j = 0..7, of each mode side by side in rows;
    prompt i runs with seed + i; the progress bar counts modes x prompts, and progress=False shows none. The plot
    draws dense as a vertical line at its time per step and a mode identical to it at 100 dB; without the dense
    mode it has no quality metric to draw."""
    import matplotlib.figure
    from PIL import Image

    from sparge_diffusers.eval import AttentionMode, evaluate

    class RampVideoPipeline:  # frame f of every call is flat grey at f / 10
        transformer = torch.nn.Linear(1, 1)
        seeds: list = []

        def __call__(self, prompt, generator, output_type, num_inference_steps=1):
            self.seeds.append(generator.initial_seed())
            ramp = torch.linspace(0, 1, 11)[:, None, None, None].expand(11, 3, 8, 8)
            return type("Output", (), {"frames": ramp[None].clone()})()

    pipe = RampVideoPipeline()
    modes = [AttentionMode("dense", False), AttentionMode("again", False)]
    figures = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig),
                                                                                      savefig(fig, *a, **k)))
    report = evaluate(pipe, ["a cat", "a dog"], modes, tmp_path / "v", seed=7, pipe_kwargs={"num_inference_steps": 2})
    final = capsys.readouterr().err.strip().split("\r")[-1]
    assert "eval: 100%" in final and "4/4" in final
    assert pipe.seeds == [7, 8, 7, 8] and report["kind"] == "video"
    with Image.open(tmp_path / "v" / "grid_1.png") as image:
        grid = np.asarray(image)
    assert grid.shape == (2 * 8, 8 * 8, 3)  # two modes' rows of eight 8 x 8 frames
    picks = [0, 1, 3, 4, 6, 7, 9, 10]
    assert grid[::8, ::8, 0].tolist() == [[round(f / 10 * 255) for f in picks]] * 2
    ax, = figures[0].axes
    assert ax.get_xlabel() == "seconds per denoising step" and ax.get_ylabel().startswith("PSNR vs dense")
    assert [t.get_text() for t in ax.texts] == ["dense", "again, identical to dense"]
    dense_line, = ax.lines
    assert list(dense_line.get_xdata()) == [report["summary"]["dense"]["seconds_per_step"]] * 2
    assert ax.collections[0].get_offsets().tolist() == [[report["summary"]["again"]["seconds_per_step"], 100.0]]
    # no dense mode: no PSNR; no num_inference_steps: the pipeline's default (1) counts the steps, as in generate
    report = evaluate(pipe, ["a cat"], modes[1:], tmp_path / "made" / "quiet", progress=False)  # parents made
    assert "eval" not in capsys.readouterr().err
    assert figures[1].axes[0].get_ylabel() == "(no quality metric)"
    assert report["samples"][0]["seconds_per_step"] == report["samples"][0]["seconds"]

    class NoStepsPipeline(RampVideoPipeline):
        def __call__(self, prompt, generator, output_type):
            return super().__call__(prompt, generator, output_type)

    report = evaluate(NoStepsPipeline(), ["a cat"], modes[1:], tmp_path / "no-steps", progress=False)
    assert "seconds_per_step" not in report["samples"][0]
    assert figures[2].axes[0].get_xlabel() == "seconds per sample"
