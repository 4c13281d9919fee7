"""Per-layer threshold tuning: the search against a brute-force evaluation with the reference, tune() on a tiny
Flux transformer, settings files (round trip, mismatches) and the ``tune`` command on a locally saved pipeline."""

import functools
import json
import re
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from sparge_diffusers import sparge_attention
from sparge_diffusers.testing import video_like_qkv
from sparge_diffusers.tuning import ThresholdGrid, ThresholdSearch

GRID = ThresholdGrid(simthreshd1=(0.3, 0.6, 1.0), cdfthreshd=(0.8, 0.95, 0.98, 1.0), pvthreshd=(50.0, 4.0, 1.0))


def exact(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


def evaluate(samples, simthreshd1, cdfthreshd, pvthreshd):
    """Per call: ([H] sparsity, [H] relative L1) of one setting, with the float32 reference."""
    rows = []
    for q, k, v, ref in samples:
        out, st = sparge_attention(q, k, v, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, pvthreshd=pvthreshd,
                                   return_sparsity=True, backend="reference")
        l1 = (out.float() - ref).abs().sum((0, 2, 3)) / ref.abs().sum((0, 2, 3))
        rows.append(((st.qk_skipped + st.pv_skipped) / 2, l1))
    return rows


def brute_force(samples, grid, l1, l2, aggregate):
    """Per head: the highest mean sparsity whose aggregated L1 is below budget, phase by phase."""
    agg = (lambda xs: max(xs)) if aggregate == "max" else (lambda xs: sum(xs) / len(xs))
    heads = samples[0][0].shape[1]

    def best(candidates, budget):  # candidates: list of (setting, rows) -> per head (setting, sparsity, l1)
        chosen = []
        for h in range(heads):
            scored = [(s, sum(float(r[0][h]) for r in rows) / len(rows), agg([float(r[1][h]) for r in rows]))
                      for s, rows in candidates]
            ok = [c for c in scored if c[2] < budget]
            chosen.append(max(ok, key=lambda c: (c[1], -c[2])))
        return chosen

    phase1 = best([((s, c), evaluate(samples, s, c, None)) for s, c in grid.stage1_points()], l1)
    sim = [c[0][0] for c in phase1]
    cdf = [c[0][1] for c in phase1]
    return best([(p, evaluate(samples, sim, cdf, p)) for p in grid.pvthreshd], l2), phase1


def run_search(search, samples):
    """Both phases over the same calibration calls, as tune() runs them."""
    for phase in (1, 2):
        for q, k, v, ref in samples:
            search.observe(q, k, v, ref)
        if phase == 1:
            search.finish_stage1()
    return search.result()


def calibration_samples(seeds, grid=(2, 16, 16), heads=4):
    samples = []
    for s in seeds:
        q, k, v = video_like_qkv(grid, heads=heads, head_dim=32, seed=s, locality=(14.0, 2.0))
        samples.append((q, k, v, exact(q, k, v)))
    return samples


@pytest.mark.parametrize("aggregate", ["max", "mean"])
def test_search_picks_the_best_grid_point_within_budget(aggregate):
    samples = calibration_samples([0, 1, 2])
    search = ThresholdSearch(l1=0.05, l2=0.06, grid=GRID, aggregate=aggregate)
    choice = run_search(search, samples)
    expected, _ = brute_force(samples, GRID, 0.05, 0.06, aggregate)
    assert choice.within_budget and choice.calls == 3
    for h, (pv, sparsity, l1) in enumerate(expected):
        assert choice.sparsity_per_head[h] == pytest.approx(sparsity, abs=1e-9)
        assert choice.l1_per_head[h] == pytest.approx(l1, rel=1e-6) and l1 < 0.06
        # the chosen setting itself, re-run: the budget holds on the calibration data
        rows = evaluate(samples, choice.simthreshd1, choice.cdfthreshd, choice.pvthreshd)
        l1s = [float(r[1][h]) for r in rows]
        assert (max(l1s) if aggregate == "max" else sum(l1s) / 3) < 0.06
    assert choice.sparsity > 0.05, "structured inputs must leave something to skip"
    assert choice.l1 == max(choice.l1_per_head), "with a choice per head, the worst head bounds the layer"


def layer_rows(samples, *setting):
    """Per call: (layer sparsity, layer relative L1) of one setting."""
    rows = []
    for q, k, v, ref in samples:
        out, st = sparge_attention(q, k, v, simthreshd1=setting[0], cdfthreshd=setting[1], pvthreshd=setting[2],
                                   return_sparsity=True, backend="reference")
        rows.append((st.sparsity, float((out.float() - ref).abs().sum() / ref.abs().sum())))
    return rows


def test_search_per_layer_chooses_one_setting():
    samples = calibration_samples([0, 1])
    search = ThresholdSearch(l1=0.05, l2=0.06, grid=GRID, per_head=False)
    choice = run_search(search, samples)
    assert len(set(choice.simthreshd1)) == len(set(choice.cdfthreshd)) == len(set(choice.pvthreshd)) == 1

    def best(settings, budget):
        scored = []
        for setting in settings:
            rows = layer_rows(samples, *setting)
            scored.append((sum(r[0] for r in rows) / len(rows), -max(r[1] for r in rows), setting))
        return max((c for c in scored if -c[1] < budget), key=lambda c: c[:2])  # ties: the first point

    _, _, (sim, cdf, _) = best([(s, c, None) for s, c in GRID.stage1_points()], 0.05)
    sparsity, neg_l1, _ = best([(sim, cdf, p) for p in GRID.pvthreshd], 0.06)
    assert (choice.simthreshd1[0], choice.cdfthreshd[0]) == (sim, cdf)
    assert choice.sparsity == pytest.approx(sparsity, abs=1e-6) and choice.l1 == pytest.approx(-neg_l1, rel=1e-6)
    assert choice.l1 < 0.06


def test_search_errors():
    with pytest.raises(ValueError, match="l1 <= l2"):
        ThresholdSearch(l1=0.1, l2=0.05)
    ThresholdSearch(l1=0.05, l2=0.05)  # equal budgets are allowed
    with pytest.raises(ValueError, match="aggregate"):
        ThresholdSearch(aggregate="median")
    search = ThresholdSearch()
    with pytest.raises(RuntimeError, match="finish_stage1"):
        search.result()
    q, k, v = video_like_qkv((1, 8, 16), heads=2, head_dim=32)
    search.observe(q, k, v)
    with pytest.raises(ValueError, match="heads"):
        search.observe(q[:, :1], k[:, :1], v[:, :1])
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)
    for broadcasting in (exact[:, :, :1], exact[:, :1], exact[..., :1]):  # tallied against the wrong elements
        with pytest.raises(ValueError, match="reference must have the call's output shape"):
            search.observe(q, k, v, broadcasting)
    with pytest.raises(RuntimeError, match="finish_stage1 needs phase 1 with at least one observed call"):
        ThresholdSearch().finish_stage1()
    search.finish_stage1()
    with pytest.raises(RuntimeError, match="finish_stage1 needs phase 1"):  # twice
        search.finish_stage1()
    with pytest.raises(RuntimeError, match="at least one observed call in phase 2"):
        search.result()
    search.observe(q, k, v)
    assert search.result().sparsity >= 0


@pytest.mark.parametrize("per_head", [True, False])
def test_search_keeps_the_budget_strict_and_breaks_sparsity_ties_by_the_lower_error(per_head):
    # A stand-in for sparge_attention whose sparsity and error at each grid point are set here. The errors are
    # exact in binary (the output is 1 + l1 where the reference is 1), so "below the budget" is tested at equality.
    outcomes = {(0.3, None): (0.5, 0.0625),  # stage 1: at the budget, so not below it
                (0.6, None): (0.4, 0.03125), (0.9, None): (0.4, 0.015625),  # tied sparsity: the lower error wins
                (0.9, 50.0): (0.4, 0.015625), (0.9, 8.0): (0.45, 0.046875), (0.9, 4.0): (0.5, 0.0625)}

    def attention(q, k, v, *, simthreshd1, cdfthreshd, pvthreshd, return_sparsity, **_):
        sim = simthreshd1[0] if isinstance(simthreshd1, list) else simthreshd1
        pv = pvthreshd[0] if isinstance(pvthreshd, list) else pvthreshd
        sparsity, l1 = outcomes[(sim, pv)]
        skipped = torch.full((q.shape[1],), sparsity)
        return torch.full_like(q, 1 + l1), types.SimpleNamespace(qk_skipped=skipped, pv_skipped=skipped)

    grid = ThresholdGrid(simthreshd1=(0.3, 0.6, 0.9), cdfthreshd=(0.9,), pvthreshd=(50.0, 8.0, 4.0))
    search = ThresholdSearch(l1=0.0625, l2=0.0625, grid=grid, per_head=per_head)
    q = torch.zeros(1, 2, 8, 4)
    for phase in (1, 2):
        for call in range(2):
            assert search.calls == call
            search.observe(q, q, q, torch.ones_like(q), attention=attention)
        if phase == 1:
            search.finish_stage1()
    choice = search.result()
    assert (choice.simthreshd1, choice.cdfthreshd, choice.pvthreshd) == ([0.9] * 2, [0.9] * 2, [8.0] * 2)
    assert choice.sparsity == pytest.approx(0.45)
    assert (choice.l1, choice.calls, choice.within_budget) == (0.046875, 2, True)


def test_search_without_a_reference_computes_the_same_one_in_either_layout_and_with_grouped_heads():
    q, k, v = video_like_qkv((1, 8, 16), heads=4, head_dim=32, seed=3)
    k, v = k[:, ::2], v[:, ::2]  # two key/value heads for four query heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))  # q's dtype
    choices = []
    for layout, given in (("HND", ref), ("HND", None), ("NHD", None)):
        t = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2))
        search = ThresholdSearch(l1=0.05, l2=0.06, grid=GRID)
        for phase in (1, 2):
            search.observe(t(q), t(k), t(v), None if given is None else t(given), tensor_layout=layout)
            if phase == 1:
                search.finish_stage1()
        choices.append(search.result())
    assert choices[0].l1_per_head == pytest.approx(choices[1].l1_per_head, rel=1e-5, abs=1e-7)
    assert choices[1] == choices[2]


def test_budget_too_tight_is_reported():
    samples = calibration_samples([0], heads=2)
    search = ThresholdSearch(l1=1e-9, l2=1e-9, grid=GRID)
    choice = run_search(search, samples)
    assert not choice.within_budget
    assert not run_search(ThresholdSearch(l1=1e-9, l2=1.0, grid=GRID), samples).within_budget, "phase 1 missed"
    # none fits, so each phase falls back to its least error: every block kept (as at GRID's densest point) and
    # stage 2 off
    dense = evaluate(samples, [1.0] * 2, [1.0] * 2, [50.0] * 2)[0][1]
    assert choice.l1_per_head == pytest.approx([float(x) for x in dense], rel=1e-6) and choice.sparsity == 0


# --- tune() on a tiny Flux transformer ------------------------------------------------------------------

diffusers = pytest.importorskip("diffusers")


def tiny_flux(size=32):
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 28, 28))
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(size).float(), torch.arange(size).float(),
                                     indexing="ij"), -1).reshape(-1, 3)

    def latents(seed):  # structured: a spatially smooth latent field, as image latents are
        g = torch.Generator().manual_seed(seed)
        field = F.interpolate(torch.randn(1, 4, 4, 4, generator=g), size=(size, size), mode="bicubic")
        return dict(hidden_states=3 * field.flatten(2).transpose(1, 2),
                    encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                    pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]), img_ids=ids,
                    txt_ids=torch.zeros(8, 3))
    return model, latents


class CaptureSDPA(TorchFunctionMode):
    """Records (layer, q, k, v, exact output) of every SDPA call of a dense run."""

    def __init__(self, model):
        super().__init__()
        self.layer, self.samples = None, {}
        for name, m in model.named_modules():
            if hasattr(m, "processor"):
                m.register_forward_pre_hook(lambda mod, args, name=name: setattr(self, "layer", name))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
            self.samples.setdefault(self.layer, []).append((q, k, v, exact(q, k, v)))
        return func(*args, **kwargs)


def test_tune_refuses_what_it_cannot_calibrate():
    """None of these ran in a test before session 84: a calibration item that is neither a prompt nor a dict of
    transformer inputs; pipeline call arguments without a pipeline; a model none of whose attention calls can run
    sparse (head dim 12: each call warns that it is not tuned, then tune raises instead of writing an empty file)."""
    from sparge_diffusers import tune

    model, latents = tiny_flux(8)
    with pytest.raises(ValueError, match="calibration item 1 is a int: use prompts"):
        tune(model, [latents(0), 3], grid=GRID, progress=False)
    with pytest.raises(ValueError, match="pipe_kwargs are pipeline call arguments; pass the pipeline"):
        tune(model, [latents(0)], grid=GRID, progress=False, pipe_kwargs={"num_inference_steps": 2})
    torch.manual_seed(0)
    narrow = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=12, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 4, 4))
    with pytest.warns(UserWarning, match="head dim 12; such calls are not tuned"):
        with pytest.raises(ValueError, match="no attention call could run sparse during calibration"):
            tune(narrow, [latents(0)], grid=GRID, progress=False)


def test_tune_tiny_model_matches_brute_force(tmp_path):
    from sparge_diffusers import tune

    model, latents = tiny_flux()
    inputs = [latents(0), latents(1)]
    capture = CaptureSDPA(model)
    with torch.no_grad(), capture:
        for kw in inputs:
            model(**kw)
    tuned = tune(model, inputs, l1=0.05, l2=0.06, grid=GRID, progress=False)
    layers = {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
    assert set(tuned.layers) == set(capture.samples) == layers
    for layer, samples in capture.samples.items():
        expected, _ = brute_force(samples, GRID, 0.05, 0.06, "max")
        got = tuned.measured[layer]
        assert got["within_budget"] and got["calls"] == 2
        for h, (pv, sparsity, l1) in enumerate(expected):
            assert got["sparsity_per_head"][h] == pytest.approx(sparsity, abs=1e-6)
            assert got["l1_per_head"][h] < 0.06
    assert any(m["sparsity"] > 0 for m in tuned.measured.values())

    # save, load, apply: the per-layer (per-head) thresholds reach their layers
    path = tmp_path / "settings.json"
    tuned.save(path)
    doc = json.loads(path.read_text())
    assert doc["model_class"] == "FluxTransformer2DModel" and doc["budget"]["l1"] == 0.05
    assert doc["diffusers_version"] == diffusers.__version__
    from sparge_diffusers import apply
    from sparge_diffusers.pipelines import LayerSettingsFile

    loaded = LayerSettingsFile.load(path)
    assert loaded.layers == tuned.layers and loaded.measured == json.loads(json.dumps(tuned.measured))
    processor = apply(model, layer_settings=str(path), collect_stats=True)
    with torch.no_grad():
        model(**latents(0))
    by_layer = processor.sparsity_by_layer()
    assert set(by_layer) == set(tuned.layers)
    # the first layer sees calibration input 0 as in the dense run (later ones see sparse outputs): its
    # sparsity is that of its chosen per-head setting on that input
    first = "transformer_blocks.0.attn"
    s = tuned.layers[first]
    rows = evaluate(capture.samples[first][:1], s.simthreshd1, s.cdfthreshd, s.pvthreshd)
    assert by_layer[first] == pytest.approx(float(rows[0][0].mean()), abs=1e-6)


def test_settings_file_mismatches(tmp_path):
    from sparge_diffusers.pipelines import LayerSettingsFile, SpargeSettings, apply

    model, _ = tiny_flux(8)
    good = LayerSettingsFile(model_class="FluxTransformer2DModel", diffusers_version=diffusers.__version__,
                             layers={"transformer_blocks.0.attn": SpargeSettings(cdfthreshd=0.9)})
    path = tmp_path / "s.json"
    good.save(path)
    uncovered = r"cover 1 of 2 attention layers .*; 1 \(e\.g\. \['single_transformer_blocks\.0\.attn'\]\)"
    with pytest.warns(UserWarning, match=uncovered):
        processor = apply(model, layer_settings=path)
    assert processor.layer_settings["transformer_blocks.0.attn"].cdfthreshd == 0.9
    processor.detach(model)
    with pytest.raises(ValueError, match="cover 1 of 2"):
        apply(model, layer_settings=path, strict=True)

    other = LayerSettingsFile(model_class="SD3Transformer2DModel", layers=good.layers)
    other.save(path)
    with pytest.raises(ValueError, match="tuned for SD3Transformer2DModel, not FluxTransformer2DModel"):
        apply(model, layer_settings=path)
    extra = LayerSettingsFile(model_class="FluxTransformer2DModel",
                              layers={"transformer_blocks.7.attn": SpargeSettings()})
    extra.save(path)
    with pytest.raises(ValueError, match="lacks"):
        apply(model, layer_settings=path)
    old = LayerSettingsFile(model_class="FluxTransformer2DModel", diffusers_version="0.30.0",
                            layers={n: SpargeSettings() for n in ("transformer_blocks.0.attn",
                                                                  "single_transformer_blocks.0.attn")})
    old.save(path)
    with pytest.warns(UserWarning, match="diffusers 0.30.0") as caught:
        apply(model, layer_settings=path).detach(model)
    assert len(caught) == 1  # every layer is covered: no coverage warning
    whole = LayerSettingsFile(model_class="FluxTransformer2DModel", diffusers_version=diffusers.__version__,
                              layers=old.layers)
    whole.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file's diffusers version is the one running: nothing to warn about
        apply(model, layer_settings=path).detach(model)

    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON settings file"):
        LayerSettingsFile.load(path)
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a sparge-diffusers layer-settings file"):
        LayerSettingsFile.load(path)
    path.write_text(json.dumps({"format": "sparge-diffusers/layer-settings", "version": 1, "model_class": "X",
                                "layers": {"a": {"cdfthreshd": 0.9, "bogus": 1}}}))
    with pytest.raises(ValueError, match="unknown keys"):
        LayerSettingsFile.load(path)
    path.write_text(json.dumps({"format": "sparge-diffusers/layer-settings", "version": 1, "model_class": "X",
                                "layers": {"a": {"cdfthreshd": [0.9, 1.5]}}}))
    with pytest.raises(ValueError, match=r"s.json: layer 'a': cdfthreshd values must lie in \[0.0, 1.0\], got 1.5"):
        LayerSettingsFile.load(path)
    header = {"format": "sparge-diffusers/layer-settings", "version": 1, "model_class": "X"}
    for change, message in [({"version": 2}, "has settings format version 2; this release reads version 1"),
                            ({"layers": {}}, "holds no layers"),
                            ({"model_class": None}, "names no model_class"),
                            ({"model_class": ""}, "names no model_class"),
                            ({"layers": [{"cdfthreshd": 0.9}]},
                             "'layers' must map layer names to settings, got a list"),
                            ({"layers": {"a": 0.9}}, "layer 'a' must map setting names to values, got a float")]:
        path.write_text(json.dumps({**header, "layers": {"a": {"cdfthreshd": 0.9}}, **change}))
        with pytest.raises(ValueError, match=message):  # hand-edited files: a ValueError naming the problem
            LayerSettingsFile.load(path)


def test_settings_file_is_strict_json_and_keeps_stage_2_off(tmp_path):
    """pvthreshd = inf (stage 2 off) and non-finite measurements: json.dump wrote Infinity / NaN, which strict
    readers reject; the file holds null and reads back as off (per head too), and unserialisable values raise."""
    import math

    from json_checks import strict_json_load
    from sparge_diffusers.pipelines import LayerSettingsFile, SpargeSettings

    path = tmp_path / "s.json"
    LayerSettingsFile(model_class="FluxTransformer2DModel", layers={
        "a": SpargeSettings(pvthreshd=math.inf), "b": SpargeSettings(pvthreshd=[50.0, math.inf]),
        "c": SpargeSettings(pvthreshd=None)}, measured={"a": {"l1": math.nan, "sparsity": 0.5}},
        budget={"l1": math.inf}).save(path)
    doc = strict_json_load(path)
    assert doc["layers"]["a"]["pvthreshd"] is None and doc["layers"]["b"]["pvthreshd"] == [50.0, None]
    assert doc["layers"]["a"]["measured"] == {"l1": None, "sparsity": 0.5} and doc["budget"] == {"l1": None}
    loaded = LayerSettingsFile.load(path)
    assert loaded.layers["a"].pvthreshd is None and loaded.layers["c"].pvthreshd is None
    assert loaded.layers["b"].pvthreshd == [50.0, math.inf]
    q = torch.randn(1, 2, 130, 64)
    for name in "ab":  # what the loaded settings run equals what the saved ones ran
        s = loaded.layers[name]
        out = sparge_attention(q, q, q, pvthreshd=s.pvthreshd, backend="reference")
        assert torch.equal(out, sparge_attention(q, q, q, pvthreshd=math.inf, backend="reference"))
    with pytest.raises(TypeError, match="Tensor"):
        LayerSettingsFile(model_class="X", layers={"a": SpargeSettings(cdfthreshd=torch.tensor(0.9))}).save(path)
    # the failed save left the file it would have replaced as it was (json.dump into it cut it off at the tensor)
    assert strict_json_load(path) == doc and [p.name for p in tmp_path.iterdir()] == ["s.json"]


@pytest.mark.parametrize("field, values, message", [
    ("cdfthreshd", (0.9, 1.5), r"cdfthreshd values must lie in \[0.0, 1.0\], got 1.5"),
    ("simthreshd1", (2.0,), r"simthreshd1 values must lie in \[-1.0, 1.0\]"),
    ("pvthreshd", (4.0, 0.0), r"pvthreshd values must lie in \(0, inf\]"),
    ("pvthreshd", (float("nan"),), "got nan"),
    ("pvthreshd", (None,), r"non-empty sequence of numbers, got \(None,\)"),
    ("cdfthreshd", (), "non-empty sequence"),
    ("cdfthreshd", 0.9, "non-empty sequence"),
])
def test_threshold_grid_rejects_values_the_kernels_refuse(field, values, message):
    """Checked when the grid is made, so tune() fails before running the model, not at its first attention call;
    inf (stage 2 off) is a valid pvthreshd."""
    with pytest.raises(ValueError, match=message):
        ThresholdGrid(**{field: values})
    ThresholdGrid(pvthreshd=(float("inf"), 4.0))


@pytest.mark.parametrize("settings, message", [
    (dict(cdfthreshd=1.5), r"cdfthreshd values must lie in \[0.0, 1.0\]"),
    (dict(simthreshd1=[0.5, float("nan")]), "simthreshd1 values must lie in"),
    (dict(pvthreshd=0), r"pvthreshd values must lie in \(0, inf\]"),
    (dict(pvthreshd=[50, None]), "got None"),
    (dict(simthreshd1=[]), "non-empty list"),
    (dict(permutation="zigzag"), "unknown permutation 'zigzag'"),
    (dict(permutation=["hilbert"]), r"unknown permutation \['hilbert'\]"),
    (dict(dense="false"), "dense must be True or False, got str 'false'"),  # truthy: it ran the layer densely
    (dict(dense=1), "dense must be True or False, got int '1'"),
])
def test_settings_are_checked_when_made(settings, message):
    """Not at the model's first attention call (after its text encoders ran); None and inf turn stage 2 off."""
    from sparge_diffusers.pipelines import SpargeSettings

    with pytest.raises(ValueError, match=message):
        SpargeSettings(**settings)
    SpargeSettings(pvthreshd=None), SpargeSettings(pvthreshd=float("inf"), simthreshd1=[0.5, -1.0, 1.0])
    one = SpargeSettings()
    (name, value), = settings.items()
    with pytest.raises(ValueError, match=message):  # and when set later: it failed at the first attention call
        setattr(one, name, value)
    assert one == SpargeSettings()


def test_tune_generate_and_evaluate_refuse_a_model_that_already_runs_a_processor(tmp_path):
    """tune's calibration processor would have wrapped it and taken its sparse output for the exact one; generate's
    and evaluate's dense runs would have run it. Each refuses before running the model."""
    from sparge_diffusers import apply, tune
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.generation import generate

    model, latents = tiny_flux(8)
    applied = apply(model)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="already runs a SpargeProcessor"):
        tune(model, [latents(0)], progress=False)
    pipe = type("Pipe", (), {"transformer": model})()
    with pytest.raises(ValueError, match="already runs a SpargeProcessor"):
        generate(pipe, ["a cat"], tmp_path / "g", sparse=False, progress=False)
    with pytest.raises(ValueError, match="already runs a SpargeProcessor"):
        evaluate(pipe, ["a cat"], [AttentionMode("dense", False)], tmp_path / "e", progress=False)
    assert calls == []
    applied.detach(model)


@pytest.mark.parametrize("options, message", [
    (dict(dense_steps=-1), "dense_steps must be an int >= 0, got -1"),  # ran no warm-up without a word
    (dict(dense_steps="2"), "dense_steps must be an int >= 0, got '2'"),  # failed at the first step
    (dict(dense_steps=1.5), "dense_steps must be an int"),
    (dict(dense_steps=True), "dense_steps must be an int >= 0, got True"),  # a bool is an int to Python
    (dict(layer_settings={"transformer_blocks.0.attn": {"cdfthreshd": 0.9}}), "must be SpargeSettings"),
    (dict(enabled="False"), "enabled must be True or False"),  # was read as True: sparse where dense was meant
    (dict(strict=0), "strict must be True or False"),
    (dict(collect_stats=None), "collect_stats must be True or False"),
])
def test_processor_options_are_checked_when_made(options, message):
    from sparge_diffusers.pipelines import SpargeProcessor, SpargeSettings

    with pytest.raises(ValueError, match=message):
        SpargeProcessor(**options)
    assert SpargeProcessor(settings=None).settings == SpargeSettings()  # None: the defaults, as apply() takes it
    processor = SpargeProcessor()
    (name, value), = options.items()
    with pytest.raises(ValueError, match=message):  # and when set later (processor.settings = ... is documented)
        setattr(processor, name, value)
    assert processor == SpargeProcessor()  # unchanged


def test_processor_options_set_later_are_checked_and_read_as_when_made(tmp_path):
    """A dict or a path assigned to settings / layer_settings after construction failed at the model's first
    attention call; layer settings naming layers the bound model lacks were never used."""
    from sparge_diffusers.pipelines import LayerSettingsFile, SpargeSettings, apply

    model, latents = tiny_flux(8)
    processor = apply(model, collect_stats=True)
    with pytest.raises(ValueError, match="settings must be SpargeSettings, got dict"):
        processor.settings = {"cdfthreshd": 0.9}
    with pytest.raises(ValueError, match="does not have"):
        processor.layer_settings = {"transformer_blocks.7.attn": SpargeSettings()}
    with pytest.raises(ValueError, match="cdfthreshd has 3 values"):  # the layers have 2 heads
        processor.settings = SpargeSettings(cdfthreshd=[0.9] * 3)
    assert processor.settings == SpargeSettings() and processor.layer_settings == {}  # left as they were
    path = tmp_path / "flux.json"
    LayerSettingsFile("FluxTransformer2DModel", {"transformer_blocks.0.attn": SpargeSettings(dense=True)}).save(path)
    processor.layer_settings = str(path)  # read as SpargeProcessor(layer_settings=path) reads it
    assert processor.layer_settings == {"transformer_blocks.0.attn": SpargeSettings(dense=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file's coverage was warned of when it was set, not again here
        processor.settings = None
    assert processor.settings == SpargeSettings()
    with torch.no_grad():
        model(**latents(0))
    assert "transformer_blocks.0.attn" not in processor.sparsity_by_layer()  # dense by the file's setting
    assert processor.sparsity_by_layer()
    processor.detach(model)
    processor.layer_settings = {"transformer_blocks.7.attn": SpargeSettings()}  # detached: for another model


def test_detach_restores_native_processors():
    from sparge_diffusers import apply

    model, latents = tiny_flux(8)
    natives = {n: type(m.processor) for n, m in model.named_modules() if hasattr(m, "processor")}
    processor = apply(model, collect_stats=True)
    processor.detach(model)
    assert {n: type(m.processor) for n, m in model.named_modules() if hasattr(m, "processor")} == natives
    assert not model._forward_pre_hooks


def test_tune_rejects_bad_calibration():
    from sparge_diffusers import tune

    model, _ = tiny_flux(8)
    with pytest.raises(ValueError, match="non-empty list"):
        tune(model, [])
    with pytest.raises(ValueError, match="prompts need a pipeline"):
        tune(model, ["a cat"])
    for one in ("a cat", b"a cat"):  # not a list of five prompts of one letter each
        with pytest.raises(ValueError, match="non-empty list"):
            tune(model, one)
    with pytest.raises(ValueError, match="l1 <= l2"):
        tune(model, [{}], l1=0.1, l2=0.05)


@pytest.mark.gpu
def test_tune_on_gpu_with_the_triton_kernels():
    from sparge_diffusers import tune

    model, latents = tiny_flux()
    model = model.to("cuda", torch.bfloat16)

    def cuda(inputs):  # activations in bf16; positions and timestep as they are
        return {k: v.cuda().to(torch.bfloat16) if k in ("hidden_states", "encoder_hidden_states",
                                                        "pooled_projections") else v.cuda() for k, v in inputs.items()}

    tuned = tune(model, [cuda(latents(0)), cuda(latents(1))], grid=GRID, progress=False)
    assert set(tuned.layers) == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
    assert all(m["within_budget"] and m["calls"] == 2 and m["l1"] < 0.06 for m in tuned.measured.values())


def test_generate_evaluate_and_tune_refuse_pipe_kwargs_they_set_themselves(tmp_path):
    """A prompt, generator or output_type in pipe_kwargs clashed with the call's own ("got multiple values") after
    the model had loaded, and return_dict=False returned a tuple the runner could not read."""
    from sparge_diffusers import tune
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.generation import generate
    from tiny_pipes import TinyImagePipeline

    pipe = TinyImagePipeline()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    for kwargs in ({"prompt": "a dog"}, {"generator": None}, {"output_type": "np"}, {"return_dict": False}):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"pipe_kwargs sets {name}"):
            generate(pipe, ["a cat"], tmp_path / "g", pipe_kwargs=kwargs, progress=False)
        with pytest.raises(ValueError, match=f"pipe_kwargs sets {name}"):
            evaluate(pipe, ["a cat"], [AttentionMode("dense", False)], tmp_path / "e", pipe_kwargs=kwargs,
                     progress=False)
    for kwargs in ({"prompt": "a dog"}, {"generator": None}):
        with pytest.raises(ValueError, match=f"pipe_kwargs sets {next(iter(kwargs))}"):
            tune(pipe, ["a cat"], pipe_kwargs=kwargs, progress=False)
    assert calls == []


def test_generate_evaluate_and_tune_give_the_pipeline_its_progress_bar_back(tmp_path):
    """Each shows one bar over all its calls and turns the pipeline's own bar off meanwhile. They left it off: a
    later call of the pipeline by the user showed no progress. Its configuration now comes back, after an error
    too."""
    import diffusers
    from sparge_diffusers import tune
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.generation import generate
    from tiny_pipes import TinyImagePipeline

    seen = []

    class Pipeline(TinyImagePipeline):
        set_progress_bar_config = diffusers.DiffusionPipeline.set_progress_bar_config  # diffusers' own
        fail = False

        def __call__(self, prompt, generator, output_type="pt", **kwargs):  # tune passes no output_type here
            seen.append(dict(self._progress_bar_config))
            if self.fail:
                raise RuntimeError("out of memory")
            return super().__call__(prompt, generator, output_type, **kwargs)

    pipe = Pipeline()
    mine = {"leave": False, "desc": "mine"}
    runs = [lambda: generate(pipe, ["a cat"], tmp_path / "g", progress=False),
            lambda: evaluate(pipe, ["a cat"], [AttentionMode("dense", False)], tmp_path / "e", progress=False),
            lambda: tune(pipe, ["a cat"], progress=False)]
    for fail in (False, True):
        pipe.fail = fail
        for run in runs:
            pipe.set_progress_bar_config(**mine)
            seen.clear()
            if fail:
                with pytest.raises(RuntimeError, match="out of memory"):
                    run()
            else:
                run()
            assert seen and all(config == {"disable": True} for config in seen)
            assert pipe._progress_bar_config == mine
    pipe.fail = False
    del pipe._progress_bar_config  # never configured: diffusers reads that as {}
    runs[0]()
    assert pipe._progress_bar_config == {}


def test_tune_skips_the_vae_decode(tmp_path):
    """Calibration needs the transformer's calls only: the pipeline returns latents unless pipe_kwargs asks
    otherwise (a video VAE's decode costs seconds per calibration run)."""
    pytest.importorskip("transformers")
    import diffusers
    from sparge_diffusers import tune
    from tiny_pipes import save_tiny_cogvideox_pipeline

    pipe = diffusers.DiffusionPipeline.from_pretrained(save_tiny_cogvideox_pipeline(tmp_path / "pipe"))
    decodes = []
    decode = pipe.vae.decode
    pipe.vae.decode = lambda *a, **k: (decodes.append(1), decode(*a, **k))[1]
    kwargs = dict(num_inference_steps=1, height=64, width=64, num_frames=9, guidance_scale=1.0)
    tuned = tune(pipe, ["a cat"], pipe_kwargs=kwargs, progress=False)
    assert decodes == [] and tuned.layers
    assert tuned.calibration["pipe_kwargs"] == kwargs  # the settings file records what the caller gave
    tune(pipe, ["a cat"], pipe_kwargs={**kwargs, "output_type": "np"}, progress=False)
    assert decodes  # asked for


def test_evaluate_checks_every_modes_settings_file_before_generating(tmp_path):
    """A settings file tuned for another model failed only when its mode came, after the modes before it had run."""
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.pipelines import LayerSettingsFile, SpargeSettings
    from tiny_pipes import TinyImagePipeline

    pipe = TinyImagePipeline()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    other = tmp_path / "sd3.json"
    LayerSettingsFile("SD3Transformer2DModel", {"transformer_blocks.0.attn": SpargeSettings()}).save(other)
    modes = [AttentionMode("dense", False), AttentionMode("sparge:sd3", True, str(other))]
    with pytest.raises(ValueError, match="tuned for SD3Transformer2DModel, not FluxTransformer2DModel"):
        evaluate(pipe, ["a cat"], modes, tmp_path / "e", progress=False)
    assert calls == []
    unknown = tmp_path / "unknown.json"
    LayerSettingsFile("FluxTransformer2DModel", {"transformer_blocks.7.attn": SpargeSettings()}).save(unknown)
    with pytest.raises(ValueError, match="lacks"):
        evaluate(pipe, ["a cat"], [AttentionMode("dense", False), AttentionMode("sparge:unknown", True,
                                                                                  str(unknown))],
                 tmp_path / "e", progress=False)
    assert calls == []


def test_generate_and_evaluate_take_one_prompt_as_a_str_and_refuse_other_prompts(tmp_path):
    """generate(pipe, "a cat") iterated the string: five outputs, one per character."""
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.generation import generate
    from tiny_pipes import TinyImagePipeline

    pipe = TinyImagePipeline()
    report = generate(pipe, "a cat", tmp_path / "g", sparse=False, progress=False)
    assert [row["prompt"] for row in report["outputs"]] == ["a cat"]
    report = evaluate(pipe, "a cat", [AttentionMode("dense", False)], tmp_path / "e", progress=False)
    assert [row["prompt"] for row in report["samples"]] == ["a cat"]
    for prompts, message in (([], "at least one prompt"), (["a cat", None], "item 1 is a NoneType"),
                             (b"a cat", "takes a list of prompts"), (7, "takes a list of prompts")):
        with pytest.raises(ValueError, match=message):
            generate(pipe, prompts, tmp_path / "g", sparse=False, progress=False)
        with pytest.raises(ValueError, match=message):
            evaluate(pipe, prompts, [AttentionMode("dense", False)], tmp_path / "e", progress=False)


def test_tune_calls_other_pipelines_as_given(tmp_path, capsys, monkeypatch):
    """Only diffusers pipelines are asked for latents: a wrapper's call keeps the arguments it was given, even
    where it takes an ``output_type``. Prompt i runs with seed + i; a progress bar shows by default."""
    from sparge_diffusers import tune
    from tiny_pipes import TinyImagePipeline

    inner = TinyImagePipeline()
    calls = []

    class Wrapper:  # a pipeline-like callable without output_type
        transformer = inner.transformer

        def __call__(self, prompt, generator, output_type="pt"):
            calls.append((prompt, generator.initial_seed(), output_type))
            return inner(prompt, generator, output_type)

    import tqdm
    from sparge_diffusers.tuning import pipeline

    monkeypatch.setattr(pipeline, "tqdm", functools.partial(tqdm.tqdm, mininterval=0))  # print every update
    tuned = tune(Wrapper(), ["a cat", "a dog", "a cow"], seed=5)
    assert tuned.layers and tuned.calibration["pipe_kwargs"] == {} and tuned.calibration["runs"] == 3
    # prompt i uses seed + i, in both phases
    assert calls == [("a cat", 5, "pt"), ("a dog", 6, "pt"), ("a cow", 7, "pt")] * 2
    bars = capsys.readouterr().err.replace("\n", "\r").split("\r")  # each pass names what it searches
    first = [bar for bar in bars if re.match(r"tune: .* [12]/6 \[", bar)]
    second = [bar for bar in bars if re.match(r"tune: .* [4-6]/6 \[", bar)]
    # tqdm shows the rate as "run/s", or as "s/run" when a run takes over a second (a loaded machine): either
    rate = r"(run/s|s/run)"
    assert first and all(re.search(rate + r", simthreshd1, cdfthreshd\]$", bar) for bar in first)
    assert second and all(re.search(rate + r", pvthreshd\]$", bar) for bar in second) and "100%" in second[-1]


def test_attention_modes_are_consistent():
    """A sparse mode named 'dense' became every mode's exact reference (PSNR inf against itself)."""
    from sparge_diffusers.eval import AttentionMode

    with pytest.raises(ValueError, match="cannot be sparse"):
        AttentionMode("dense", True)
    with pytest.raises(ValueError, match="sparse modes only"):
        AttentionMode("baseline", False, "tuned.json")
    AttentionMode("dense", False), AttentionMode("sparge:tuned", True, "tuned.json")


def test_flags_of_generate_tune_and_evaluate_take_true_or_false_only(tmp_path):
    """As the kernels' flags: a string "False" from a config was read by its truth, so generate(sparse="False")
    and AttentionMode("baseline", "False") ran sparse where dense was meant, and ThresholdSearch(per_head="False")
    tuned one threshold per head. Each is refused before any model call."""
    from sparge_diffusers.eval import AttentionMode, evaluate
    from sparge_diffusers.generation import generate
    from sparge_diffusers.tuning import tune
    from tiny_pipes import TinyImagePipeline

    pipe = TinyImagePipeline()
    calls = {f"generate {flag}": (flag, lambda **f: generate(pipe, ["a cat"], tmp_path / "g", **f))
             for flag in ("sparse", "strict", "compile", "warmup", "progress")}
    calls["tune"] = ("progress", lambda **f: tune(pipe, ["a cat"], **f))
    calls["ThresholdSearch"] = ("per_head", lambda **f: ThresholdSearch(**f))
    calls["AttentionMode"] = ("sparse", lambda **f: AttentionMode("baseline", **f))
    calls["evaluate"] = ("progress", lambda **f: evaluate(pipe, ["a cat"], [AttentionMode("dense", False)],
                                                          tmp_path / "e", **f))
    for name, (flag, call) in calls.items():
        for bad in ("False", 0, 1, None, torch.tensor(True)):
            with pytest.raises(ValueError, match=f"{flag} must be True or False"):
                call(**{flag: bad})
    assert not (tmp_path / "g").exists() and not (tmp_path / "e").exists(), "refused before any output"
    AttentionMode("baseline", False), ThresholdSearch(per_head=False)


def test_generate_refuses_sparse_options_for_a_dense_run(tmp_path):
    """generate(..., sparse=False, settings=...) ran dense and dropped the settings without a word."""
    from sparge_diffusers.generation import generate
    from sparge_diffusers.pipelines import SpargeSettings
    from tiny_pipes import TinyImagePipeline

    pipe = TinyImagePipeline()
    for options in (dict(settings=SpargeSettings()), dict(dense_steps=2), dict(layer_settings={}), dict(strict=True)):
        with pytest.raises(ValueError, match="apply to sparse=True only"):
            generate(pipe, ["a cat"], tmp_path / "g", sparse=False, progress=False, **options)


def test_per_head_settings_of_another_head_count_are_refused_when_installed(tmp_path):
    """A settings file tuned on a model variant with other head counts passed the class and layer-name checks and
    failed at the first attention call, inside the model's forward."""
    from sparge_diffusers.pipelines import LayerSettingsFile, SpargeSettings, apply, installed_processor

    model, _ = tiny_flux(8)  # 2 heads per layer
    path = tmp_path / "other.json"
    LayerSettingsFile("FluxTransformer2DModel", {"transformer_blocks.0.attn": SpargeSettings(
        cdfthreshd=[0.9, 0.9, 0.9])}).save(path)
    with pytest.raises(ValueError, match="transformer_blocks.0.attn: cdfthreshd has 3 values.*2 heads"):
        apply(model, layer_settings=path)
    with pytest.raises(ValueError, match="simthreshd1 has 4 values"):
        apply(model, SpargeSettings(simthreshd1=[0.5] * 4))
    assert installed_processor(model) is None
    apply(model, SpargeSettings(simthreshd1=[0.5, -1.0], cdfthreshd=[0.9])).detach(model)  # one per head, or one
