"""SpargeProcessor on tiny random-weight diffusers transformers (CPU: the float32 reference path)."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers")

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.pipelines import SpargeProcessor, SpargeSettings, apply, install  # noqa: E402

KEEP_ALL = SpargeSettings(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
AGGRESSIVE = SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3, pvthreshd=None)
MODERATE = SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None)


def flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 28, 28))
    H = W = 16
    grid = torch.meshgrid(torch.zeros(1), torch.arange(H).float(), torch.arange(W).float(), indexing="ij")
    ids = torch.stack(grid, -1).reshape(-1, 3)
    inputs = dict(hidden_states=torch.randn(2, H * W, 4), encoder_hidden_states=torch.randn(2, 40, 32),
                  pooled_projections=torch.randn(2, 16), timestep=torch.tensor([0.5, 0.5]), img_ids=ids,
                  txt_ids=torch.zeros(40, 3))
    return model, inputs


def sd3():
    model = diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=128, pooled_projection_dim=16, out_channels=4)
    inputs = dict(hidden_states=torch.randn(2, 4, 32, 32), encoder_hidden_states=torch.randn(2, 20, 32),
                  pooled_projections=torch.randn(2, 16), timestep=torch.tensor([10, 10]))
    return model, inputs


def sd35_medium():
    """SD3.5 Medium's layout: QK RMS norms, and dual-attention layers whose second, image-only self-attention
    (attn2) diffusers runs with JointAttnProcessor2_0 and no text."""
    model = diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=128, pooled_projection_dim=16, out_channels=4,
        qk_norm="rms_norm", dual_attention_layers=(0,))
    inputs = dict(hidden_states=torch.randn(2, 4, 32, 32), encoder_hidden_states=torch.randn(2, 20, 32),
                  pooled_projections=torch.randn(2, 16), timestep=torch.tensor([10, 10]))
    return model, inputs


def cogvideox():
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=4,
        text_embed_dim=16, num_layers=2, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16, use_rotary_positional_embeddings=True)
    # rotary embeddings as CogVideoX-5B passes them: if a processor lost them, the native comparison fails
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    rotary = get_3d_rotary_pos_embed(64, ((0, 0), (8, 8)), (8, 8), 3)
    inputs = dict(hidden_states=torch.randn(2, 3, 4, 16, 16), encoder_hidden_states=torch.randn(2, 16, 16),
                  timestep=torch.tensor([10, 10]), image_rotary_emb=rotary)
    return model, inputs


def mochi():
    model = diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=64, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=32, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 10:] = False  # text padding in the second prompt
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 16, 16), encoder_hidden_states=torch.randn(2, 16, 32),
                  timestep=torch.tensor([10, 10]), encoder_attention_mask=mask)
    return model, inputs


MODELS = {"flux": flux, "sd3": sd3, "sd35_medium": sd35_medium, "cogvideox": cogvideox, "mochi": mochi}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def later_step(inputs, factor=0.5):
    """The inputs of a later denoising step (a lower timestep: the processor counts steps by it)."""
    return dict(inputs, timestep=inputs["timestep"] * factor)


@pytest.mark.parametrize("name", list(MODELS))
def test_keeping_every_block_matches_native_processors(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    processor = apply(model, KEEP_ALL, collect_stats=True)
    out = run(model, inputs)
    assert processor.stats, "the sparse path must have run"
    assert all(s["sparsity"] == 0 for s in processor.stats)
    # float32 reference on CPU: only summation order differs from SDPA
    assert relative_l1(out, native) < 1e-5
    processor.enabled = False
    assert torch.equal(run(model, inputs), native), "switching back to dense gives native results exactly"


def test_a_module_calling_its_processor_positionally_runs_through_apply():
    """Wan's attention modules hand their processor the encoder states, mask and rotary embedding by position (its
    processor names the last rotary_emb, not image_rotary_emb): apply() passes them on in place. Keeping every block
    gives the native processors' output (rotary embeddings included); skipping blocks runs the self- and
    cross-attention calls sparse. (Wan is not one of the four models apply knows: no token grid, no tuning.)"""
    torch.manual_seed(3)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, text_dim=32,
        freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, rope_max_seq_len=64).eval()
    inputs = dict(hidden_states=torch.randn(1, 4, 3, 32, 32), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 20, 32))
    native = run(model, inputs)
    processor = apply(model, KEEP_ALL, collect_stats=True, strict=True)
    assert relative_l1(run(model, inputs), native) < 1e-5
    assert len(processor.stats) == 4, "2 blocks x (self-attention, cross-attention)"
    processor.settings = AGGRESSIVE
    out = run(model, inputs)
    assert max(processor.sparsity_by_layer().values()) > 0 and 0 < relative_l1(out, native) < 0.3


def qwen_image(batch=1):
    """A tiny QwenImage transformer and inputs whose prompts end in text padding: prompt 0's last 3 of 12 text
    tokens, prompt 1 none (the joint sequence is [text, image], so the padding sits between)."""
    import inspect

    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(8, 28, 28)).eval()
    text_mask = torch.ones(batch, 12, dtype=torch.long)
    text_mask[0, 9:] = 0
    inputs = dict(hidden_states=torch.randn(batch, 16 * 16, 16), encoder_hidden_states=torch.randn(batch, 12, 32),
                  encoder_hidden_states_mask=text_mask, timestep=torch.tensor([0.5] * batch),
                  img_shapes=[(1, 16, 16)] * batch)
    if "txt_seq_lens" in inspect.signature(model.forward).parameters:  # diffusers before 0.37 takes it too
        inputs["txt_seq_lens"] = [12] * batch
    return model, inputs


def test_arguments_only_the_native_processor_names_still_reach_it():
    """QwenImage's modules hand their processor encoder_hidden_states_mask, which SpargeProcessor's own signature does
    not name; diffusers passes a processor only what its signature names, so the mask was dropped (a logged warning)
    and padded text tokens were attended to: keep-all moved the output by a relative L1 of 4e-4, silently. apply()
    now widens this processor's signature with the native's names, eagerly and under torch.compile (where the seam
    hands the masked call to SDPA), and the padding stays hidden. A fresh processor's signature is unchanged."""
    import inspect

    torch.manual_seed(4)
    model, inputs = qwen_image()
    native = run(model, inputs)
    processor = apply(model, KEEP_ALL)
    assert "encoder_hidden_states_mask" in inspect.signature(processor.__call__).parameters
    assert "encoder_hidden_states_mask" not in inspect.signature(SpargeProcessor().__call__).parameters
    assert isinstance(processor, SpargeProcessor) and type(processor) is not SpargeProcessor
    assert relative_l1(run(model, inputs), native) < 1e-5
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")  # Dynamo reads the processor's signature as diffusers does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert relative_l1(run(compiled, inputs), native) < 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("model_name", ["qwen_image", "hunyuan_video"])
def test_key_padding_masks_run_sparse_on_the_kept_keys(model_name, monkeypatch):
    """SDPA calls under a boolean key-padding mask, (B, 1, 1, N_kv) as QwenImage and HunyuanVideo pass their text
    padding, run sparse on each batch row's kept keys: cut where the padding ends the sequence (HunyuanVideo),
    gathered where it does not (QwenImage: [text, image]), the whole batch in one call where no row pads. Keeping
    every block gives the native output; skipping blocks records one statistics entry per call, and compiled
    (aot_eager) gives the same output through the key_padded_sparge_attention operator. Masks that differ per query
    (HunyuanVideo's token refiner) still go to SDPA, with a warning."""
    torch.manual_seed(5)
    if model_name == "qwen_image":
        if diffusers.__version__ < "0.37":
            pytest.skip("diffusers before 0.37 builds no joint mask for QwenImage")
        model, inputs = qwen_image(batch=2)
    else:
        model = diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, text_embed_dim=32, pooled_projection_dim=16,
            rope_axes_dim=(16, 24, 24)).eval()
        text_mask = torch.ones(2, 12)
        text_mask[1, 7:] = 0
        inputs = dict(hidden_states=torch.randn(2, 4, 3, 16, 16), timestep=torch.tensor([500, 500]),
                      encoder_hidden_states=torch.randn(2, 12, 32), encoder_attention_mask=text_mask,
                      pooled_projections=torch.randn(2, 16), guidance=torch.tensor([3.5, 3.5]))
    native = run(model, inputs)
    processor = apply(model, KEEP_ALL, collect_stats=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, inputs)
    assert relative_l1(out, native) < 1e-5
    refiner = model_name == "hunyuan_video"
    assert any("an attention mask" in str(w.message) for w in caught) == refiner
    assert processor.recorded_calls == 2 and all(s["sparsity"] == 0 for s in processor.stats)
    processor.reset_stats()
    processor.settings = AGGRESSIVE
    sparse = run(model, inputs)
    assert max(processor.sparsity_by_layer().values()) > 0 and 0 < relative_l1(sparse, native) < 0.3
    # compiled, the calls go through an operator that reads the mask when it runs: the same sparse output
    from sparge_diffusers.pipelines import processor as processor_module

    calls = []
    real = processor_module._attend_kept_keys
    monkeypatch.setattr(processor_module, "_attend_kept_keys", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = run(torch.compile(model, backend="aot_eager"), inputs)
    torch._dynamo.reset()
    assert len(calls) == 2 and relative_l1(compiled, sparse) < 1e-5


def test_key_padding_mask_shapes_against_sdpa_under_the_mask():
    """The seam's answer to SDPA calls under key-padding masks, against SDPA under the same mask (CPU: the float32
    reference, every block kept), odd lengths: one mask row for a batch of 2 (trailing padding: a cut), two rows
    (hidden keys in the middle of one: a gather; none in the other). Each runs sparse (a statistics record). A row
    with every key hidden goes to SDPA (NaN there, as SDPA gives it) with a warning; so does a float mask."""
    processor = SpargeProcessor(settings=KEEP_ALL, collect_stats=True)
    q, k, v = (torch.randn(2, 3, n, 64) for n in (150, 201, 201))
    broadcast = torch.ones(1, 1, 1, 201, dtype=torch.bool)
    broadcast[..., 170:] = False
    rows = torch.ones(2, 1, 1, 201, dtype=torch.bool)
    rows[0, ..., 30:90] = False
    for calls, mask in enumerate((broadcast, rows), start=1):
        out = processor._attention("layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
        assert relative_l1(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) < 1e-5
        assert processor.recorded_calls == calls
    empty = rows.clone()
    empty[1] = False
    with pytest.warns(UserWarning, match="SpargeProcessor: falling back to native attention: a key-padding mask that "
                                         "hides every key of a batch row"):
        out = processor._attention("layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=empty)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=empty), equal_nan=True)
    additive = torch.zeros(2, 1, 1, 201).masked_fill(~rows, float("-inf"))
    with pytest.warns(UserWarning, match="an attention mask"):
        processor._attention("layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=additive)
    assert processor.recorded_calls == 2
    # a layer with a token permutation, whose order covers all of the layer's tokens: SDPA under the mask, warned
    permuting = SpargeProcessor(settings=dataclasses.replace(KEEP_ALL, permutation="rowmajor"))
    permuting.grid = ((1, 13, 15), "after")  # 195 visual tokens, then 6 of text
    with pytest.warns(UserWarning, match="falling back to native attention: a key-padding mask with a token perm"):
        out = permuting._attention("layer", permuting.settings, F.scaled_dot_product_attention, k, k, v,
                                   attn_mask=rows)
    assert torch.equal(out, F.scaled_dot_product_attention(k, k, v, attn_mask=rows))
    three_rows = torch.ones(3, 1, 1, 201, dtype=torch.bool)  # for a batch of 2: SDPA raises, and so must the seam
    with pytest.raises(RuntimeError, match="must match the size"):  # not read as a key-padding mask (two rows of it)
        processor._attention("layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=three_rows)


@pytest.mark.gpu
def test_key_padding_masks_on_gpu_match_sdpa_under_the_mask():
    """The kept-keys calls on the GPU kernels (bf16, D = 128, every block kept): a cut, a gather and a batch row
    without padding, against SDPA under the mask; compiled with inductor, the same output."""
    processor = SpargeProcessor(settings=KEEP_ALL, collect_stats=True)
    q, k, v = (torch.randn(2, 4, n, 128, device="cuda", dtype=torch.bfloat16) for n in (1000, 1333, 1333))
    rows = torch.ones(2, 1, 1, 1333, dtype=torch.bool, device="cuda")
    rows[0, ..., 200:450] = False
    rows[1, ..., 1100:] = False
    for mask in (rows, rows[:1], rows[1:]):
        out = processor._attention("layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.isfinite(out).all() and relative_l1(out.float(), expected.float()) < 2e-2
    assert processor.recorded_calls == 3
    # under inductor: the key_padded_sparge_attention operator, one graph node, the eager call's output
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, m: processor._attention(
        "layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=m), fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = compiled(q, k, v, rows)
    torch._dynamo.reset()
    eager = processor._attention("layer", KEEP_ALL, F.scaled_dot_product_attention, q, k, v, attn_mask=rows)
    assert torch.equal(got, eager)


def test_statistics_are_off_by_default_and_reading_none_warns(monkeypatch):
    """The default processor recorded one statistics object per sparse call (host time per call, and records that
    grew for as long as a process generated). Collection is now opt-in: by default nothing is recorded, the
    sparse path's call asks for no statistics, and reading them says why there are none."""
    from sparge_diffusers.pipelines import processor as processor_module

    torch.manual_seed(1)
    model, inputs = flux()
    asked = []
    real = processor_module.sparge_attention

    def spy(*args, **kwargs):
        asked.append(kwargs.get("return_sparsity", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(processor_module, "sparge_attention", spy)
    processor = apply(model, AGGRESSIVE)
    run(model, inputs)
    run(model, inputs)
    assert asked and not any(asked), "the sparse path ran, asking for no statistics"
    assert processor.recorded_calls == 0
    with pytest.warns(UserWarning, match="collect_stats=True") as by_layer:
        assert processor.sparsity_by_layer() == {}
    with pytest.warns(UserWarning, match="collect_stats=True") as caught:
        assert processor.stats == []
    assert caught[0].filename == __file__, "the warning names the line that read the stats"
    assert by_layer[0].filename == __file__, "and the line that asked for them by layer (it named processor.py)"
    processor.collect_stats = True
    run(model, inputs)
    assert processor.recorded_calls == len(model.attn_processors) and any(asked)
    processor.reset_stats()
    assert processor.recorded_calls == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # collection is on, nothing ran since: no records, and nothing to warn of
        assert processor.stats == [] and processor.sparsity_by_layer() == {}


@pytest.mark.parametrize("name", list(MODELS))
def test_sparse_run_reports_stats_and_bounded_error(name):
    torch.manual_seed(1)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    processor = apply(model, AGGRESSIVE, collect_stats=True)
    out = run(model, inputs)
    assert torch.isfinite(out).all()
    by_layer = processor.sparsity_by_layer()
    assert by_layer and max(by_layer.values()) > 0
    assert all(not k.startswith("<unbound") for k in by_layer)
    # measured (seed 1): 0.013-0.17 at sparsity 0.75-0.8; a moderate setting stays close to dense
    assert relative_l1(out, native) < 0.3
    processor.settings = MODERATE
    moderate = run(model, inputs)
    assert relative_l1(moderate, native) < 0.06  # measured 0.0025-0.034 at sparsity 0.2-0.25
    assert relative_l1(moderate, native) < relative_l1(out, native)
    calls: dict[str, list[float]] = {}
    for record in processor.stats:
        calls.setdefault(record["layer"], []).append(record["sparsity"])
    assert all(len(v) >= 2 for v in calls.values()), "each layer ran in both runs"  # Mochi: a call per prompt
    assert processor.sparsity_by_layer() == pytest.approx({k: sum(v) / len(v) for k, v in calls.items()})


@pytest.mark.parametrize("name", ["flux", "sd3", "sd35_medium", "cogvideox"])
def test_set_attn_processor_works_where_the_model_has_it(name):
    """Without apply() the processor never saw the model's own processors: it picks each module's diffusers
    default itself (SD3.5 Medium's image-only attn2 once got CogVideoX's, which needs text, and failed)."""
    torch.manual_seed(2)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    originals = {n: type(p) for n, p in model.attn_processors.items()}
    processor = SpargeProcessor(settings=KEEP_ALL, collect_stats=True)
    model.set_attn_processor(processor)
    assert relative_l1(run(model, inputs), native) < 1e-5
    assert len({s["layer"] for s in processor.stats}) == len(model.attn_processors)
    processor.detach(model)  # after calls: each module's native as its calls showed it
    assert {n: type(p) for n, p in model.attn_processors.items()} == originals

    # detached before any call: the natives come from the registry by the model's class (SD3.5 Medium's attn2
    # got CogVideoX's processor, and the model then failed for want of text)
    fresh = SpargeProcessor(settings=KEEP_ALL)
    model.set_attn_processor(fresh)
    fresh.detach(model)
    assert {n: type(p) for n, p in model.attn_processors.items()} == originals
    assert torch.equal(run(model, inputs), native)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_processor_set_on_each_attention_module_picks_the_modules_native_processor(name):
    """Mochi's transformer has no set_attn_processor: a user may set the processor module by module. Each module
    of each model then gets its diffusers default from the processor's registry (Mochi's branch of it ran in no
    test before session 84), and a module of a class it does not know raises, naming the way out."""
    torch.manual_seed(6)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    processor = SpargeProcessor(settings=KEEP_ALL, collect_stats=True)
    modules = [m for m in model.modules() if callable(getattr(m, "processor", None))]
    assert modules
    for module in modules:
        if hasattr(module, "set_processor"):
            module.set_processor(processor)
        else:  # MochiAttention (diffusers 0.42) has the attribute but no set_processor
            module.processor = processor
    assert relative_l1(run(model, inputs), native) < 1e-5
    assert len({s["layer"] for s in processor.stats}) == len(modules)

    class UnknownAttention(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="does not know the native processor of UnknownAttention; pass native="):
        processor(UnknownAttention(), torch.randn(1, 4, 8))
    from diffusers.models.attention_processor import Attention

    # diffusers' Attention of none of the four models: the registry covers joint attention (SD3), and self-attention
    # with QK norms (CogVideoX; SD3.5 Medium's attn2), not a plain or a cross-attention module
    for other in (Attention(query_dim=16, heads=2, dim_head=8),
                  Attention(query_dim=16, cross_attention_dim=16, heads=2, dim_head=8, qk_norm="layer_norm")):
        with pytest.raises(ValueError, match="does not know the native processor of Attention"):
            processor(other, torch.randn(1, 4, 16))


def test_what_runs_unpermuted_or_dense_says_why():
    """Paths no test took before session 84: a permutation without a token grid (set_attn_processor alone tells
    the processor nothing of the model) warns and runs the tokens in their order; dropout is a reason to fall back
    to SDPA; apply on a model without attention modules raises."""
    torch.manual_seed(8)
    model, inputs = flux()
    native = run(model, inputs)
    processor = SpargeProcessor(settings=dataclasses.replace(KEEP_ALL, permutation="hilbert"), collect_stats=True)
    model.set_attn_processor(processor)
    with pytest.warns(UserWarning, match=r"SpargeProcessor: falling back to no token permutation: no token grid for "
                                         r"permutation \(use apply\(\) or bind\(\)"):
        out = run(model, inputs)
    assert relative_l1(out, native) < 1e-5 and processor.stats
    q = torch.randn(1, 2, 64, 64)
    assert processor.fallback_reason(q, q, q, None, 0.1) == "dropout"
    assert processor.fallback_reason(q, q, q, None, 0.0) is None
    assert processor.fallback_reason(q, q[:, :, :32], q[:, :, :32]) is None  # not causal unless asked
    assert "is_causal=True with 64 queries and 32 keys" in processor.fallback_reason(q, q[:, :, :32], q[:, :, :32],
                                                                                     is_causal=True)
    with pytest.raises(ValueError, match="Linear has no attention modules with a processor"):
        apply(torch.nn.Linear(4, 4))


def test_set_attn_processor_with_per_layer_settings_or_warm_up_steps_needs_bind():
    """set_attn_processor tells the processor nothing of the model. Per-layer settings are found by layer name and
    warm-up steps counted by bind's hook, so through that call alone every layer silently ran the processor's
    default settings (a tuned file ignored) and, with dense_steps, every step stayed dense. Such a processor now
    refuses the first call until bound; bound, both apply."""
    torch.manual_seed(5)
    model, inputs = flux()
    per_layer = {"transformer_blocks.0.attn": AGGRESSIVE}
    for options, message in (({"layer_settings": per_layer}, "with layer_settings was called"),
                             ({"dense_steps": 1}, "with dense_steps=1 was called")):
        processor = SpargeProcessor(settings=KEEP_ALL, collect_stats=True, **options)
        model.set_attn_processor(processor)
        with pytest.raises(ValueError, match=message + ".*processor.bind"):
            run(model, inputs)
        processor.bind(model)
        run(model, inputs)
        run(model, later_step(inputs, 0.5))
        by_layer = {(s["layer"], s["step"]): s["sparsity"] for s in processor.stats}
        if "layer_settings" in options:
            assert by_layer[("transformer_blocks.0.attn", 1)] > 0.3  # the aggressive layer's own setting
            assert by_layer[("single_transformer_blocks.0.attn", 1)] == 0
        else:
            assert {step for _, step in by_layer} == {2}, "step 1 dense, step 2 sparse"
        processor.detach(model)
    model.set_attn_processor(SpargeProcessor(settings=KEEP_ALL))  # one setting for every layer: no bind needed
    run(model, inputs)


def test_a_processor_bound_to_one_model_refuses_to_bind_another_until_detached():
    """bind() moved the step hook to the second model while the first still ran the processor: the first model's
    dense_steps then followed the second model's steps (all dense or all sparse, silently)."""
    first, inputs = flux()
    second, _ = flux()
    processor = apply(first, KEEP_ALL, dense_steps=1)
    second.set_attn_processor(processor)
    with pytest.raises(ValueError, match="still runs a FluxTransformer2DModel"):
        processor.bind(second)
    with pytest.raises(ValueError, match="still runs a FluxTransformer2DModel"):
        install(second, processor)
    processor.bind(first)  # the model it is bound to: fine
    processor.detach(first)
    install(second, processor)
    run(second, inputs)


def test_a_processor_reused_on_another_model_keeps_nothing_of_a_dead_one():
    """The processor keys each attention module's layer name and native processor by id(), and CPython hands a
    dead module's id to new objects: reused after its first model was deleted (an eval loop over checkpoints), it
    gave the next model's modules a dead module's entries. Measured before the fix: an SD3 model's module got
    Flux's FluxAttnProcessor (AttributeError: no 'head_dim'), a Flux module SD3's JointAttnProcessor2_0 (no
    'to_out'); a stale layer name would pick another layer's settings. A dead module's entries now go with it."""
    import gc

    processor = SpargeProcessor(settings=KEEP_ALL)
    for make, install_with_apply in ((sd3, False), (flux, True), (cogvideox, False)):
        torch.manual_seed(4)
        model, inputs = make()
        native = run(model, inputs)
        if install_with_apply:  # apply()'s path: names bound, natives taken from the model
            install(model, processor)
        else:  # diffusers' own call: natives made at the first call
            model.set_attn_processor(processor)
        assert relative_l1(run(model, inputs), native) < 1e-5
        assert processor._natives and (processor._names or not install_with_apply)
        if install_with_apply:
            processor.detach(model)
        del model
        gc.collect()
        assert processor._natives == {} and processor._names == {}, "a dead module's entries stay"


def test_a_second_processor_is_refused_until_the_first_is_detached():
    """A second apply() wrapped the first processor as the layers' native one: the first answered every call with
    its own settings while the second recorded nothing (and warned that the layers ran dense)."""
    torch.manual_seed(3)
    model, inputs = flux()
    first = apply(model, AGGRESSIVE, collect_stats=True)
    with pytest.raises(ValueError, match="already runs a SpargeProcessor"):
        apply(model, KEEP_ALL)
    assert install(model, first) is first  # the same processor again: nothing changes
    first.detach(model)
    second = apply(model, KEEP_ALL, collect_stats=True)
    run(model, inputs)
    assert second.stats and first.stats == []
    second.detach(model)
    model.set_attn_processor(SpargeProcessor())  # diffusers' own call installs one too
    with pytest.raises(ValueError, match="already runs a SpargeProcessor"):
        apply(model)


def flux_with_ip_adapter():
    """The tiny Flux with an IP-Adapter loaded through diffusers' own loader (random weights): its double-stream
    block gets FluxIPAdapterAttnProcessor (an nn.Module holding to_k_ip/to_v_ip), its single-stream block keeps
    FluxAttnProcessor. Returns the model, its inputs, the output before loading the adapter, and a factory of
    joint_attention_kwargs (the model pops the embeddings out of the dict it is given)."""
    model, inputs = flux()
    before = run(model, inputs)
    cross, hidden = 32, 128  # joint_attention_dim, heads x head dim
    ip = {f"0.to_{w}_ip.{p}": torch.randn(hidden, cross) * 0.2 if p == "weight" else torch.randn(hidden) * 0.2
          for w in "kv" for p in ("weight", "bias")}
    projection = {"proj.weight": torch.randn(4 * cross, 24) * 0.2, "proj.bias": torch.zeros(4 * cross),
                  "norm.weight": torch.ones(cross), "norm.bias": torch.zeros(cross)}
    model._load_ip_adapter_weights({"image_proj": projection, "ip_adapter": ip})
    embeds = torch.randn(2, 1, 24)
    return model, inputs, before, lambda: {"ip_adapter_image_embeds": [embeds]}


def sd3_with_ip_adapter(make=sd3):
    """As flux_with_ip_adapter for SD3 (or SD3.5 Medium): every attention module gets
    SD3IPAdapterJointAttnProcessor2_0, and the model an image projection (a resampler with attention modules of
    its own, which stay native)."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    model, inputs = make()
    before = run(model, inputs)
    projection = IPAdapterTimeImageProjection(embed_dim=24, output_dim=128, hidden_dim=64, heads=1, num_queries=8,
                                              timestep_in_dim=32)
    ip = {}
    for i in range(len(model.attn_processors)):
        layer = SD3IPAdapterJointAttnProcessor2_0(hidden_size=128, ip_hidden_states_dim=128, head_dim=64,
                                                  timesteps_emb_dim=64)
        ip.update({f"{i}.{k}": v for k, v in layer.state_dict().items()})
    model._load_ip_adapter_weights({"image_proj": projection.state_dict(), "ip_adapter": ip})
    embeds = torch.randn(2, 10, 24)
    return model, inputs, before, lambda: {"ip_adapter_image_embeds": embeds}


IP_ADAPTER_MODELS = {"flux": flux_with_ip_adapter, "sd3": sd3_with_ip_adapter,
                     "sd35_medium": lambda: sd3_with_ip_adapter(sd35_medium)}


def run_with_image_prompt(model, inputs, ip_kwargs):
    with torch.no_grad():
        return model(**inputs, joint_attention_kwargs=ip_kwargs(), return_dict=False)[0]


@pytest.mark.parametrize("permutation", [None, "hilbert"])
@pytest.mark.parametrize("name", list(IP_ADAPTER_MODELS))
def test_ip_adapter_layers_run_sparse_and_keep_their_image_prompt(name, permutation):
    """apply() once left every module whose processor is an IP-Adapter's (an nn.Module) out, silently dense: all
    of SD3's layers. Now it delegates to that processor, whose two attention calls (the layer's own tokens, and the
    image prompt's keys, which a token permutation leaves in place) run sparse, and keeps its weights registered
    on the module (moved by .to()) until detach() gives the processor back."""
    torch.manual_seed(4)
    model, inputs, before, ip_kwargs = IP_ADAPTER_MODELS[name]()
    native = run_with_image_prompt(model, inputs, ip_kwargs)
    assert relative_l1(native, before) > 0.01, "the image prompt must change the output for this test to mean much"
    processors = dict(model.attn_processors)
    keys = set(model.state_dict())
    layers = {n.removesuffix(".processor") for n in processors if not n.startswith("image_proj.")}
    processor = apply(model, dataclasses.replace(KEEP_ALL, permutation=permutation), collect_stats=True)
    out = run_with_image_prompt(model, inputs, ip_kwargs)
    assert relative_l1(out, native) < 1e-5
    assert set(processor.sparsity_by_layer()) == layers, "every layer of the blocks runs sparse, none else"
    ip_layers = [m for m in model.modules() if type(m.__dict__.get("processor")) is SpargeProcessor
                 and isinstance(processor._natives[id(m)], torch.nn.Module)]
    assert ip_layers
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for m in ip_layers for p in processor._natives[id(m)].parameters())
    model.to(torch.float32)
    processor.detach(model)
    assert model.attn_processors == processors and set(model.state_dict()) == keys


def test_a_processor_with_weights_on_mochi_which_lacks_set_processor_is_kept_and_given_back():
    """MochiAttention (diffusers 0.42) has no set_processor: apply assigns the attribute itself. A native processor
    that is an nn.Module (a child module named "processor") must leave its slot for ours, keep its weights on the
    module while ours runs, and come back as the child module at detach."""
    from diffusers.models.transformers.transformer_mochi import MochiAttnProcessor2_0

    class WeightedMochiProcessor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(()))
            self.inner = MochiAttnProcessor2_0()

        def forward(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None):
            out = self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
            return tuple(o * self.gain for o in out)

    torch.manual_seed(6)
    model, inputs = mochi()
    layers = [m for _, m in model.named_modules() if type(m).__name__ == "MochiAttention"]
    assert layers and not hasattr(layers[0], "set_processor")
    for m in layers:
        m.processor = WeightedMochiProcessor()  # registered as the child module "processor"
    keys = set(model.state_dict())
    assert any(k.endswith("processor.gain") for k in keys)
    native = run(model, inputs)
    processor = apply(model, KEEP_ALL, collect_stats=True)
    assert all(type(m.processor) is SpargeProcessor for m in layers)
    assert relative_l1(run(model, inputs), native) < 1e-5 and processor.recorded_calls > 0
    model.to(torch.float64)
    assert all(processor._natives[id(m)].gain.dtype == torch.float64 for m in layers), "its weights move with the model"
    model.to(torch.float32)
    processor.detach(model)
    assert all(type(m.processor) is WeightedMochiProcessor and "processor" in m._modules for m in layers)
    assert set(model.state_dict()) == keys and torch.equal(run(model, inputs), native)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_ip_adapter_layers_on_gpu_after_moving_the_model_run_sparse_with_their_image_prompt(name):
    """apply() on the CPU, then .to("cuda", bfloat16): the IP-Adapter weights the processor keeps move with the
    model, and the Triton kernels answer both attention calls of each IP-Adapter layer (the image prompt's 4 or
    8 keys: shorter than one key block)."""
    torch.manual_seed(4)
    model, inputs, _, ip_kwargs = IP_ADAPTER_MODELS[name]()
    processor = apply(model, KEEP_ALL, collect_stats=True)
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() and not k.endswith("_ids") else v.dtype)
              for k, v in inputs.items()}

    def on_gpu():
        return {k: [e.to("cuda", torch.bfloat16) for e in v] if isinstance(v, list) else v.to("cuda", torch.bfloat16)
                for k, v in ip_kwargs().items()}

    out = run_with_image_prompt(model, inputs, on_gpu)
    layers = set(processor.sparsity_by_layer())
    processor.enabled = False
    native = run_with_image_prompt(model, inputs, on_gpu)
    assert torch.isfinite(out).all() and relative_l1(out, native) < 2e-2
    assert layers == {n.removesuffix(".processor") for n in model.attn_processors if not n.startswith("image_proj.")}


@pytest.mark.parametrize("name", list(IP_ADAPTER_MODELS))
def test_set_attn_processor_over_an_ip_adapter_raises_instead_of_ignoring_the_image_prompt(name):
    """set_attn_processor replaces (and discards) the IP-Adapter processors with their weights, and diffusers drops
    the image features quietly where a processor does not name them: the output was the model's without its image
    prompt. Such a call now raises, pointing to apply(); calls without an image prompt still run."""
    torch.manual_seed(5)
    model, inputs, before, ip_kwargs = IP_ADAPTER_MODELS[name]()
    model.set_attn_processor(SpargeProcessor(settings=KEEP_ALL, collect_stats=True))
    with pytest.raises(ValueError, match="apply"):
        run_with_image_prompt(model, inputs, ip_kwargs)
    if name == "flux":  # FluxIPAdapterAttnProcessor itself fails without an image prompt; the default one runs
        assert relative_l1(run(model, inputs), before) < 1e-5


def test_per_layer_settings_and_dense_warmup():
    torch.manual_seed(3)
    model, inputs = sd3()
    layer = "transformer_blocks.1.attn"
    processor = apply(model, AGGRESSIVE, layer_settings={layer: SpargeSettings(dense=True)}, dense_steps=1,
                      collect_stats=True)
    run(model, inputs)
    assert processor.stats == [], "step 1 is a dense warm-up step"
    run(model, later_step(inputs))
    layers = {s["layer"] for s in processor.stats}
    assert layers == {"transformer_blocks.0.attn"}, layers
    assert {s["step"] for s in processor.stats} == {2}
    with pytest.raises(ValueError, match="does not have"):
        apply(sd3()[0], layer_settings={"nope.attn": SpargeSettings()})


@pytest.mark.parametrize("timesteps", [
    [10, 10, 8, 8, 6, 10, 10, 8],  # two steps with true CFG, a third without; a new generation
    [0, 0, 2, 2, 4, 0, 0, 2],  # the same with rising timesteps, as Mochi's inverted sigmas give them
])
def test_forwards_that_repeat_a_timestep_are_one_step(timesteps):
    """True CFG calls the transformer twice per denoising step with one timestep (Flux's negative prompt): both
    forwards belong to that step, so the dense warm-up covers both and their statistics carry one step number; a
    move of the timestep against the generation's direction starts the next generation at step 1."""
    torch.manual_seed(4)
    model, inputs = sd3()
    calls = [dict(inputs, timestep=torch.full_like(inputs["timestep"], t)) for t in timesteps]
    native = [run(model, call) for call in calls]
    processor = apply(model, AGGRESSIVE, dense_steps=1, collect_stats=True)
    outs = [run(model, call) for call in calls]
    assert all(torch.equal(outs[i], native[i]) for i in (0, 1)), "both forwards of step 1 are dense"
    assert all(torch.equal(outs[i], native[i]) for i in (5, 6)), "and so are the new generation's"
    assert relative_l1(outs[2], native[2]) > 1e-3 and torch.equal(outs[2], outs[3])
    per_step = {}
    for record in processor.stats:
        per_step[record["step"]] = per_step.get(record["step"], 0) + 1
    assert per_step == {2: 3 * 2, 3: 2}, per_step  # sparse forwards: step 2 three times, step 3 once; 2 layers
    assert processor.step == 2


def test_fallback_warns_once_and_strict_raises():
    import torch.nn.functional as F

    from sparge_diffusers.pipelines.processor import _SparseSDPA

    processor = SpargeProcessor()
    q = torch.randn(1, 2, 64, 64)
    mask = torch.ones(64, 64, dtype=torch.bool)
    with pytest.warns(UserWarning, match="attention mask"):
        with _SparseSDPA(processor, "layer", SpargeSettings()):
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q))
    strict = SpargeProcessor(strict=True)
    with pytest.raises(ValueError, match="strict"):
        with _SparseSDPA(strict, "layer", SpargeSettings()):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("shapes, causal, message", [
    (((2, 64, 64),) * 3, False, "must be 4-D"),  # (B*H, N, D), as older processors call SDPA
    (((1, 1, 2, 64, 64),) * 3, False, "must be 4-D"),  # extra batch dims
    (((1, 2, 64, 64), (1, 2, 96, 64), (1, 2, 96, 64)), True, "is_causal=True with 64 queries and 96 keys"),
    (((1, 2, 64, 64), (1, 2, 64, 64), (1, 2, 64, 32)), False, "k and v shapes differ"),  # value head dim != q's
    (((2, 2, 64, 64), (1, 2, 64, 64), (1, 2, 64, 64)), False, "batch sizes differ"),  # SDPA broadcasts
])
def test_calls_sdpa_takes_and_the_kernels_refuse_fall_back(shapes, causal, message):
    """Such a call raised the kernels' ValueError in the middle of the model; it is SDPA's to answer (with the
    one-time warning), and strict refuses it. Causal with unequal lengths: SDPA aligns it upper left."""
    import torch.nn.functional as F

    from sparge_diffusers.pipelines.processor import _SparseSDPA

    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape) for shape in shapes)
    with pytest.warns(UserWarning, match=message):
        with _SparseSDPA(SpargeProcessor(), "layer", SpargeSettings()):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    with pytest.raises(ValueError, match="strict"):
        with _SparseSDPA(SpargeProcessor(strict=True), "layer", SpargeSettings()):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_a_training_step_falls_back_to_sdpa_with_its_gradients():
    """With autograd on (a fine-tuning step) the kernels, which have no backward pass, would hand back outputs
    without a gradient: the processor falls back to native attention, warns once, and the step's loss and weight
    gradients equal the native model's; strict=True raises. Under no_grad the same model runs sparse."""
    torch.manual_seed(6)
    model, inputs = flux()

    def loss_and_grads():
        model.zero_grad()
        loss = model(**inputs, return_dict=False)[0].square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    native_loss, native_grads = loss_and_grads()
    processor = apply(model, KEEP_ALL, collect_stats=True)
    with pytest.warns(UserWarning, match="requires grad.*no backward pass"):
        loss, grads = loss_and_grads()
    assert not processor.stats, "no sparse call under autograd"
    assert torch.equal(loss, native_loss)
    assert len(grads) == len(native_grads) and all(torch.equal(a, b) for a, b in zip(grads, native_grads))
    run(model, inputs)
    assert processor.stats, "the sparse path runs under no_grad"
    processor.strict = True
    with pytest.raises(ValueError, match="requires grad.*strict"):
        model(**inputs, return_dict=False)


@pytest.mark.parametrize("name,grid", [("flux", ((1, 16, 16), "before")), ("sd3", ((1, 16, 16), "after")),
                                       ("sd35_medium", ((1, 16, 16), "after")),  # attn2: image tokens, no text
                                       ("cogvideox", ((3, 8, 8), "before")), ("mochi", ((3, 8, 8), "after"))])
def test_token_grid_is_inferred_and_permutation_keeps_native_results(name, grid):
    torch.manual_seed(4)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    processor = apply(model, SpargeSettings(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, permutation="hilbert"),
                      collect_stats=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeProcessor")  # no fallback may happen silently here
        out = run(model, inputs)
    assert processor.grid == grid
    assert relative_l1(out, native) < 1e-5  # a permutation never changes the exact result



def test_capture_reads_nothing_from_the_gpu_and_keeps_eager_state(monkeypatch):
    """While a CUDA graph captures a step (simulated: the CPU cannot capture), the hook reads no timestep and
    no img_ids, keeps the eager step count and Flux grid, and records no statistics; each warns once."""
    from sparge_diffusers.pipelines import processor as processor_module

    torch.manual_seed(5)
    model, inputs = flux()
    settings = SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3, pvthreshd=None, permutation="hilbert")
    processor = apply(model, settings, dense_steps=1, collect_stats=True)
    run(model, inputs)
    inputs = later_step(inputs)
    eager = run(model, inputs)
    step, grid, records = processor.step, processor.grid, len(processor.stats)
    assert grid == ((1, 16, 16), "before") and step == 2

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read back while capturing")

    monkeypatch.setattr(processor_module, "_capturing", lambda: True)
    monkeypatch.setattr(processor_module, "infer_token_grid", no_read)  # Flux's would read img_ids
    monkeypatch.setattr(torch.Tensor, "__float__", no_read)  # the timestep
    with pytest.warns(UserWarning) as caught:
        captured = run(model, inputs)
        run(model, inputs)
    monkeypatch.undo()
    messages = [str(w.message) for w in caught]
    assert sum("dense_steps has no effect" in m for m in messages) == 1, messages
    assert sum("statistics are not recorded" in m for m in messages) == 1, messages
    assert processor.step == step and processor.grid == grid
    assert len(processor.stats) == records
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_cuda_graph_replay_matches_the_eager_sparse_step(name):
    torch.manual_seed(6)
    model, inputs = MODELS[name]()
    model = model.to("cuda", torch.bfloat16)
    static = {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() and not k.endswith("_ids") else v.dtype)
              for k, v in inputs.items()}
    # with a token permutation: its index tensors must come from the eager warm-up's cache, not a copy
    processor = apply(model, SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None, permutation="hilbert"),
                      collect_stats=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels and fills the per-head threshold caches
        for _ in range(2):
            run(model, static)
    torch.cuda.current_stream().wait_stream(side)
    assert processor.stats and max(s["sparsity"] for s in processor.stats) > 0
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            captured = model(**static, return_dict=False)[0]
    messages = [str(w.message) for w in caught]
    assert any("statistics are not recorded" in m for m in messages), messages
    assert not any("falling back" in m for m in messages), messages
    static["hidden_states"].copy_(torch.randn_like(static["hidden_states"]))
    captured.fill_(float("nan"))
    graph.replay()
    eager = run(model, static)
    processor.enabled = False
    native = run(model, static)
    assert torch.isfinite(captured).all()
    assert relative_l1(captured, eager) < 1e-3  # same kernels, same inputs: equal up to atomics' order
    assert relative_l1(captured, native) > 1e-4, "the graph must have recorded the sparse path"


def test_a_native_processor_that_never_calls_sdpa_is_reported_not_silently_dense():
    """Flux after set_attention_backend("flex") computes attention without F.scaled_dot_product_attention:
    the seam has nothing to answer, so the layer runs dense. That must be said, and strict must refuse it.
    (diffusers also makes the backend the process-wide default for every model: restored afterwards.)"""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    torch.manual_seed(11)
    model, inputs = flux()
    native = run(model, inputs)
    active = _AttentionBackendRegistry._active_backend
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # diffusers: attention backends are experimental
            model.set_attention_backend("flex")
        processor = apply(model, AGGRESSIVE, collect_stats=True)
        with pytest.warns(UserWarning, match="made no F.scaled_dot_product_attention call.*'flex'"):
            out = run(model, inputs)
        assert processor.stats == []
        assert relative_l1(out, native) < 1e-5  # flex attention, dense: the native result
        processor.detach(model)
        strict = apply(model, AGGRESSIVE, strict=True, collect_stats=True)
        with pytest.raises(ValueError, match="strict=True"):
            run(model, inputs)
        assert strict.stats == []
    finally:
        _AttentionBackendRegistry._active_backend = active  # what set_active_backend does (diffusers >= 0.37 has it)


class _FakeSeam:
    """Answers with a marker and records the SDPA it was handed."""

    def __init__(self):
        self.handed = []

    def answer(self, sdpa, args, kwargs):
        self.handed.append(sdpa)
        inner = F.scaled_dot_product_attention(*args, **kwargs)  # inside an answer: plain SDPA, no recursion
        return inner + 1000


def test_eager_router_answers_this_thread_only_and_is_removed_afterwards():
    import threading

    from sparge_diffusers.pipelines import processor as P

    q = torch.randn(1, 2, 16, 8)
    exact = F.scaled_dot_product_attention(q, q, q)
    seam, seen_elsewhere = _FakeSeam(), []
    with P._sdpa_answered_by(seam):
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), exact + 1000)
        assert torch._C._len_torch_function_stack() == 0  # no mode: the native processor's other calls pay nothing
        other = threading.Thread(target=lambda: seen_elsewhere.append(F.scaled_dot_product_attention(q, q, q)))
        other.start()
        other.join()
        with P._sdpa_answered_by(_FakeSeam()):  # nested: the inner seam answers, then the outer one again
            F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    assert torch.equal(seen_elsewhere[0], exact)
    assert seam.handed == [P._NATIVE_SDPA, P._NATIVE_SDPA]
    assert F.scaled_dot_product_attention is P._NATIVE_SDPA
    with pytest.raises(RuntimeError, match="boom"):
        with P._sdpa_answered_by(seam):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is P._NATIVE_SDPA and P._routed_calls == 0


def test_eager_router_leaves_a_later_replacement_in_place():
    from sparge_diffusers.pipelines import processor as P

    def someone_elses(*args, **kwargs):
        return P._NATIVE_SDPA(*args, **kwargs)

    try:
        with P._sdpa_answered_by(_FakeSeam()):
            F.scaled_dot_product_attention = someone_elses
        assert F.scaled_dot_product_attention is someone_elses  # not reset to what we displaced
    finally:
        F.scaled_dot_product_attention = P._NATIVE_SDPA


def test_processor_call_routes_eagerly_and_restores_sdpa():
    torch.manual_seed(1)
    model, inputs = MODELS["sd3"]()
    native = run(model, inputs)
    processor = apply(model, SpargeSettings(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None), collect_stats=True)
    original = F.scaled_dot_product_attention
    out = run(model, inputs)
    assert F.scaled_dot_product_attention is original
    assert len(processor.stats) == 2  # both layers answered sparse
    assert relative_l1(out, native) < 1e-5
