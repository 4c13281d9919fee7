"""DOVER video quality: our view sampling and fusion on known answers, the scorer's contract against a stand-in
of DOVER's package (same module layout and constructor), and the real package when it is installed."""

import json
import math
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers.eval.dover import (
    DOVER_INSTALL,
    DOVER_WEIGHTS_URL,
    MEAN,
    STD,
    DoverScorer,
    chunk_frame_indices,
    dover_views,
    fuse_dover_scores,
    technical_view,
)


def test_frame_indices_follow_dovers_sampler():
    g = torch.Generator().manual_seed(0)
    # 49 frames (CogVideoX): spans of 16 are shorter than 32 frames x 2, so no random offset, indices wrap
    tech = chunk_frame_indices(49, 32, 3, 2, g)
    want = torch.tensor([(16 * c + 2 * k) % 49 for c in range(3) for k in range(32)])
    assert torch.equal(tech, want)
    assert torch.equal(chunk_frame_indices(49, 1, 32, 2, g), torch.arange(32))  # aesthetic: one per span
    # a long video: each chunk is 32 frames 2 apart inside its own span, at a seeded offset
    a = chunk_frame_indices(1000, 32, 3, 2, torch.Generator().manual_seed(5)).view(3, 32)
    b = chunk_frame_indices(1000, 32, 3, 2, torch.Generator().manual_seed(5)).view(3, 32)
    assert torch.equal(a, b)
    for c in range(3):
        assert (a[c].diff() == 2).all() and 333 * c <= a[c, 0] and a[c, -1] < 333 * (c + 1)
    # spans exactly as long as a chunk's reach (64 frames): no room for an offset, as in DOVER (span > reach)
    assert torch.equal(chunk_frame_indices(192, 32, 3, 2, g), torch.arange(0, 192, 2))
    assert torch.equal(chunk_frame_indices(1, 32, 3, 2, g), torch.zeros(96, dtype=torch.long))  # one frame
    with pytest.raises(ValueError, match="at least one frame"):
        chunk_frame_indices(0, 32, 3, 2, g)


def test_technical_view_splices_one_fragment_per_grid_cell():
    T, H, W = 64, 300, 400
    rows = torch.arange(H, dtype=torch.float32).view(1, 1, H, 1).expand(1, T, H, W)
    cols = torch.arange(W, dtype=torch.float32).view(1, 1, 1, W).expand(1, T, H, W)
    frames = torch.arange(T, dtype=torch.float32).view(1, T, 1, 1).expand(1, T, H, W)
    out = technical_view(torch.cat([rows, cols, frames]), torch.Generator().manual_seed(1))
    assert out.shape == (3, T, 224, 224)
    assert torch.equal(out[2], frames[0, :, :224, :224])  # frames stay in order
    cell_h, cell_w = H // 7, W // 7
    for i in range(7):
        for j in range(7):
            for chunk in range(2):
                frag = out[:, 32 * chunk:32 * (chunk + 1), 32 * i:32 * (i + 1), 32 * j:32 * (j + 1)]
                r0, c0 = int(frag[0, 0, 0, 0]), int(frag[1, 0, 0, 0])
                assert 0 <= r0 - cell_h * i < cell_h - 32 and 0 <= c0 - cell_w * j < cell_w - 32
                # one contiguous 32 x 32 crop, the same for the chunk's 32 frames
                assert torch.equal(frag[0], (r0 + torch.arange(32.0)).view(1, 32, 1).expand(32, 32, 32))
                assert torch.equal(frag[1], (c0 + torch.arange(32.0)).view(1, 1, 32).expand(32, 32, 32))
    # smaller than 224: upscaled to 224 first, then the 7 x 7 cells of 32 tile the frame exactly
    small = torch.rand(3, 32, 112, 112) * 255
    assert torch.allclose(technical_view(small, torch.Generator()), F.interpolate(small, scale_factor=2.0,
                                                                                   mode="bilinear"))
    # short on one side only (160 x 320): upscaled by 224 / 160, to 224 x 448, then cut as a frame of that size
    wide = torch.rand(3, 32, 160, 320) * 255
    upscaled = F.interpolate(wide, scale_factor=1.4, mode="bilinear")
    assert upscaled.shape[-2:] == (224, 448)
    assert torch.equal(technical_view(wide, torch.Generator().manual_seed(3)),
                       technical_view(upscaled, torch.Generator().manual_seed(3)))


def test_aesthetic_view_resizes_each_frame_with_antialiasing():
    """Frames go to 224 x 224 whatever their aspect, antialiased as torchvision's Resize of a tensor (antialias=True
    since torchvision 0.17): stripes one pixel bright in four, 896 px wide, average to a quarter, where a plain
    bilinear resize would read only the dark pixels between them."""
    from sparge_diffusers.eval.dover import aesthetic_view

    stripes = (torch.arange(896) % 4 == 0).float().mul(255).expand(3, 2, 224, 896)
    out = aesthetic_view(stripes)
    assert out.shape == (3, 2, 224, 224)
    inner = out[..., 1:-1]  # the edge columns' filters are cut by the frame's border
    torch.testing.assert_close(inner, torch.full_like(inner, 255 / 4))


def test_dover_views_shapes_and_normalisation():
    frames = torch.full((49, 3, 64, 96), 0.5)
    views = dover_views(frames)
    assert views["technical"].shape == (3, 3, 32, 224, 224) and views["aesthetic"].shape == (1, 3, 32, 224, 224)
    assert list(views) == ["technical", "aesthetic"]  # DOVER returns its scores in this order
    for v in views.values():
        want = (127.5 - torch.tensor(MEAN)) / torch.tensor(STD)
        torch.testing.assert_close(v.mean((0, 2, 3, 4)), want)
    x = torch.rand(20, 3, 64, 64)
    assert all(torch.equal(a, b) for a, b in zip(dover_views(x, seed=3).values(), dover_views(x, seed=3).values()))
    with pytest.raises(ValueError, match="3, H, W"):
        dover_views(torch.rand(9, 64, 64))


def test_fusion_is_dovers_formula():
    assert fuse_dover_scores(0.1107, -0.08285) == pytest.approx(0.5)
    x = (0.3 - 0.1107) / 0.07355 * 0.6104 + (0.1 + 0.08285) / 0.03774 * 0.3896
    assert fuse_dover_scores(0.3, 0.1) == pytest.approx(1 / (1 + math.exp(-x)))
    assert fuse_dover_scores(0.2, 0.0) > fuse_dover_scores(0.1, 0.0)
    assert fuse_dover_scores(0.1, 0.1) > fuse_dover_scores(0.1, 0.0)
    # far from DOVER's range the fused score saturates; 1 / (1 + exp(-x)) raised OverflowError below x = -709
    assert 0.0 <= fuse_dover_scores(-100.0, 0.0) < 1e-300 and fuse_dover_scores(100.0, 0.0) == 1.0
    assert fuse_dover_scores(-0.2, -0.1) == pytest.approx(1 / (1 + math.exp(-((-0.2 - 0.1107) / 0.07355 * 0.6104
                                                                              + (-0.1 + 0.08285) / 0.03774 * 0.3896))))


STAND_IN = {
    "dover/__init__.py": "from .models import *\n",
    "dover/models/__init__.py": "from .evaluator import DOVER\n",
    "dover/models/conv_backbone.py": """
        import torch
        def convnext_3d_tiny(pretrained=False, **kwargs):
            if pretrained:
                raise RuntimeError("would download ImageNet weights")
            return torch.nn.Linear(1, 1)
    """,
    "dover/models/evaluator.py": """
        import torch
        from .conv_backbone import convnext_3d_tiny
        SEEN = []
        class DOVER(torch.nn.Module):
            # the constructor and call of DOVER's evaluator; scores: a linear map of each view's mean
            def __init__(self, backbone_size="divided", backbone_preserve_keys="fragments,resize", multi=False,
                         layer=-1, backbone=None, divide_head=False, vqa_head=None, var=False):
                super().__init__()
                assert backbone["technical"]["type"] == "swin_tiny_grpb" and divide_head
                self.aesthetic_backbone = convnext_3d_tiny(pretrained=True)
                self.technical_head = torch.nn.Linear(1, 1)
            def forward(self, vclips, inference=True, **kwargs):
                SEEN.append({k: tuple(v.shape) for k, v in vclips.items()})
                return [getattr(self, ("technical_head", "aesthetic_backbone")[i])(v.mean().view(1, 1))
                        for i, v in enumerate(vclips.values())]
    """,
}


@pytest.fixture
def stand_in_dover(tmp_path, monkeypatch):
    for name, text in STAND_IN.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    for name in [m for m in sys.modules if m == "dover" or m.startswith("dover.")]:
        monkeypatch.delitem(sys.modules, name)
    from dover.models import evaluator

    torch.manual_seed(0)
    weights = tmp_path / "DOVER.pth"
    torch.save({"technical_head.weight": torch.tensor([[2.0]]), "technical_head.bias": torch.tensor([0.5]),
                "aesthetic_backbone.weight": torch.tensor([[-1.0]]), "aesthetic_backbone.bias": torch.tensor([0.0])},
               weights)
    yield weights, evaluator
    for name in [m for m in sys.modules if m == "dover" or m.startswith("dover.")]:
        del sys.modules[name]


def test_scorer_runs_dovers_network_on_our_views(stand_in_dover):
    weights, evaluator = stand_in_dover
    scorer = DoverScorer(weights, seed=7)
    frames = torch.rand(40, 3, 48, 80)
    scores = scorer(frames)
    views = dover_views(frames, seed=7)
    technical = 2.0 * float(views["technical"].mean()) + 0.5
    aesthetic = -float(views["aesthetic"].mean())
    assert scores["dover_technical"] == pytest.approx(technical, rel=1e-5)
    assert scores["dover_aesthetic"] == pytest.approx(aesthetic, rel=1e-5)
    assert scores["dover_overall"] == pytest.approx(fuse_dover_scores(technical, aesthetic), rel=1e-5)
    assert evaluator.SEEN[-1] == {"technical": (3, 3, 32, 224, 224), "aesthetic": (1, 3, 32, 224, 224)}
    # no ImageNet download happened, and the constructor is restored afterwards
    assert evaluator.convnext_3d_tiny.__module__ == "dover.models.conv_backbone"


def test_scorer_errors_name_the_missing_piece(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="huggingface.co/teowu/DOVER"):
        DoverScorer(tmp_path / "DOVER.pth")
    assert "DOVER.pth" in DOVER_WEIGHTS_URL
    (tmp_path / "DOVER.pth").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "dover", None)
    monkeypatch.setitem(sys.modules, "dover.models", None)
    with pytest.raises(ImportError, match="VQAssessment/DOVER") as e:
        DoverScorer(tmp_path / "DOVER.pth")
    assert DOVER_INSTALL in str(e.value)


def test_eval_command_reports_dover_scores(tmp_path, stand_in_dover, capsys):
    pytest.importorskip("diffusers")
    pytest.importorskip("torchmetrics")
    from tiny_pipes import save_tiny_cogvideox_pipeline

    from sparge_diffusers.cli import main

    weights, _ = stand_in_dover
    model = save_tiny_cogvideox_pipeline(tmp_path / "pipe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat walks on the moon\n")
    out = tmp_path / "eval"
    assert main(["eval", "--model", model, "--prompts", str(prompts), "--out", str(out), "--steps", "2", "--height",
                 "64", "--width", "64", "--num-frames", "9", "--guidance-scale", "1.0", "--dover-weights",
                 str(weights), "--device", "cpu", "--quiet"]) == 0
    assert "dover_overall" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["dover"] is True
    for mode in ("dense", "sparge"):
        s = report["summary"][mode]
        assert 0 < s["dover_overall"] < 1 and math.isfinite(s["dover_technical"] + s["dover_aesthetic"])


def test_real_dover_network_with_random_weights(tmp_path):
    """Runs where DOVER's package is installed (not in CI): its real Swin-3D / ConvNeXt-3D take our views."""
    try:
        from dover.models import DOVER, conv_backbone, evaluator
    except ImportError:
        pytest.skip("DOVER's package is not installed")
    from sparge_diffusers.eval.dover import MODEL_ARGS, _without_imagenet_download

    with _without_imagenet_download(conv_backbone, evaluator):
        model = DOVER(**MODEL_ARGS)
    torch.save(model.state_dict(), tmp_path / "DOVER.pth")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scorer = DoverScorer(tmp_path / "DOVER.pth", device=device)
    frames = torch.rand(33, 3, 120, 160)
    first, second = scorer(frames), scorer(frames)
    assert all(math.isfinite(v) for v in first.values()) and 0 < first["dover_overall"] < 1
    for k in first:
        assert first[k] == pytest.approx(second[k], rel=1e-4, abs=1e-5)
