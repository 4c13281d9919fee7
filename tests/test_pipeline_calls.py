"""Full tiny diffusers pipeline calls (random components, prompt embeddings instead of text encoders, no
downloads) with SpargeProcessor set: the same output as the dense pipeline when every block is kept."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")  # the pipeline modules import it

from sparge_diffusers.pipelines import SpargeSettings, apply  # noqa: E402
from tiny_pipes import tiny_cogvideox_vae  # noqa: E402


def image_vae():
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1, latent_channels=4,
        norm_num_groups=8, sample_size=32, shift_factor=0.1, scaling_factor=0.5)


def flux_pipe():
    tr = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 28, 28))
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=image_vae(),
                                  text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                  transformer=tr)
    kw = dict(prompt_embeds=torch.randn(1, 16, 32), pooled_prompt_embeds=torch.randn(1, 16), height=64, width=64)
    return pipe, kw, "images", ((1, 16, 16), "before")


def sd3_pipe():  # with classifier-free guidance: a batch of two
    tr = diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=64, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=128, pooled_projection_dim=16, out_channels=4)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=tr, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=image_vae(), text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    kw = dict(prompt_embeds=torch.randn(1, 20, 32), pooled_prompt_embeds=torch.randn(1, 16),
              negative_prompt_embeds=torch.randn(1, 20, 32), negative_pooled_prompt_embeds=torch.randn(1, 16),
              height=64, width=64, guidance_scale=5.0)
    return pipe, kw, "images", ((1, 16, 16), "after")


def cogvideox_pipe():
    vae = tiny_cogvideox_vae()
    tr = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=4,
        text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16)
    pipe = diffusers.CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tr,
                                       scheduler=diffusers.CogVideoXDDIMScheduler())
    kw = dict(prompt_embeds=torch.randn(1, 16, 16), negative_prompt_embeds=torch.randn(1, 16, 16), height=32,
              width=32, num_frames=9, guidance_scale=6.0, max_sequence_length=16)
    return pipe, kw, "frames", ((3, 2, 2), "before")


def mochi_pipe():
    vae = diffusers.AutoencoderKLMochi(latent_channels=12, out_channels=3, encoder_block_out_channels=(32,) * 4,
                                       decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5)
    tr = diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=64, num_layers=2, pooled_projection_dim=16,
        in_channels=12, text_embed_dim=32, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16)
    pipe = diffusers.MochiPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                   tokenizer=None, transformer=tr)
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[:, 10:] = 0  # padded prompt
    kw = dict(prompt_embeds=torch.randn(1, 16, 32), prompt_attention_mask=mask,
              negative_prompt_embeds=torch.randn(1, 16, 32),
              negative_prompt_attention_mask=torch.ones(1, 16, dtype=torch.long), height=32, width=32, num_frames=7,
              guidance_scale=4.5)
    return pipe, kw, "frames", ((2, 2, 2), "after")


PIPES = {"flux": flux_pipe, "sd3": sd3_pipe, "cogvideox": cogvideox_pipe, "mochi": mochi_pipe}


@pytest.mark.parametrize("name", list(PIPES))
def test_pipeline_call_with_processor_matches_dense(name):
    torch.manual_seed(0)
    pipe, kw, field, grid = PIPES[name]()
    pipe.set_progress_bar_config(disable=True)
    kw.update(num_inference_steps=2, output_type="np")
    dense = getattr(pipe(**kw, generator=torch.Generator().manual_seed(0)), field)
    processor = apply(pipe, SpargeSettings(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, permutation="hilbert"),
                      dense_steps=1, collect_stats=True)
    sparse = getattr(pipe(**kw, generator=torch.Generator().manual_seed(0)), field)
    assert abs(dense - sparse).max() < 1e-4
    assert processor.grid == grid
    assert processor.stats and {s["step"] for s in processor.stats} == {2}, "step 1 was a dense warm-up"
    # a second generation starts its warm-up again
    n = len(processor.stats)
    getattr(pipe(**kw, generator=torch.Generator().manual_seed(0)), field)
    assert len(processor.stats) == 2 * n and {s["step"] for s in processor.stats} == {2}
    # with skipping on, the pipeline still completes and reports sparsity
    processor.settings = SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3, pvthreshd=None, permutation="hilbert")
    processor.reset_stats()
    out = getattr(pipe(**kw, generator=torch.Generator().manual_seed(0)), field)
    assert (out == out).all() and processor.stats


def test_mochi_with_its_inverted_sigmas_warms_up_then_runs_sparse():
    """Mochi's scheduler inverts the sigmas (invert_sigmas in its scheduler config), so its timesteps rise from 0.
    The step count took every rise for a new generation: with dense_steps every step ran dense and nothing sparse.
    Now step 1 is the warm-up, the later steps run sparse, and a second generation warms up again."""
    torch.manual_seed(0)
    pipe, kw, field, _ = mochi_pipe()
    pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    pipe.set_progress_bar_config(disable=True)
    kw.update(num_inference_steps=3, output_type="np")
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(float(k["timestep"][0])), with_kwargs=True)
    processor = apply(pipe, SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3, pvthreshd=None), dense_steps=1,
                      collect_stats=True)
    pipe(**kw, generator=torch.Generator().manual_seed(0))
    assert seen == sorted(seen) and seen[0] < seen[-1], seen  # rising timesteps
    first = [s["step"] for s in processor.stats]  # Mochi's processor calls SDPA once per prompt of the batch
    assert set(first) == {2, 3} and first.count(2) == first.count(3), first
    pipe(**kw, generator=torch.Generator().manual_seed(0))
    assert [s["step"] for s in processor.stats[len(first):]] == first, "the second generation warms up again"


def test_flux_true_cfg_runs_both_forwards_of_a_warm_up_step_densely():
    """FluxPipeline's true CFG (a negative prompt, true_cfg_scale > 1) calls the transformer twice per step with one
    timestep: dense_steps counts steps, so both forwards of step 1 run densely and each later step's two forwards
    record one step number."""
    torch.manual_seed(0)
    pipe, kw, field, _ = flux_pipe()
    pipe.set_progress_bar_config(disable=True)
    kw.update(num_inference_steps=3, output_type="np", true_cfg_scale=2.0,
              negative_prompt_embeds=torch.randn(1, 16, 32), negative_pooled_prompt_embeds=torch.randn(1, 16))
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    processor = apply(pipe, SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.3, pvthreshd=None), dense_steps=1,
                      collect_stats=True)
    getattr(pipe(**kw, generator=torch.Generator().manual_seed(0)), field)
    assert len(calls) == 6, "two forwards per step"
    per_step = {}
    for record in processor.stats:
        per_step[record["step"]] = per_step.get(record["step"], 0) + 1
    assert per_step == {2: 4, 3: 4}, per_step  # two forwards x two attention modules; step 1 dense
