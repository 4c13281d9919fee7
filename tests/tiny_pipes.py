"""A tiny CogVideoX pipeline with every component (T5 text encoder and a word-level tokenizer included), built
from random weights and saved locally, so the commands' real ``DiffusionPipeline.from_pretrained`` path runs
without downloads."""

import torch

WORDS = "a an the cat dog bird red blue green on in under moon sky sea car tree walks flies runs".split()


def tiny_cogvideox_vae():
    import diffusers

    return diffusers.AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4)


def save_tiny_cogvideox_pipeline(path) -> str:
    import diffusers
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                                     unk_token="<unk>", model_max_length=226)
    text_encoder = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(vocab), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    vae = tiny_cogvideox_vae()
    transformer = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=4,
        text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=226)
    pipe = diffusers.CogVideoXPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                                       transformer=transformer, scheduler=diffusers.CogVideoXDDIMScheduler())
    pipe.save_pretrained(path)
    return str(path)


class TinyImagePipeline:
    """A stand-in image pipeline: a tiny Flux transformer denoises seeded latents; the image is their sigmoid.
    Enough to drive every image branch of the runner (the real pipelines are exercised in test_pipeline_calls)."""

    def __init__(self):
        import diffusers

        torch.manual_seed(0)
        self.transformer = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=3, num_layers=1, num_single_layers=1, attention_head_dim=64,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(8, 28, 28))
        self.device = torch.device("cpu")
        ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(16.0), torch.arange(16.0), indexing="ij"), -1)
        self.img_ids = ids.reshape(-1, 3)

    def __call__(self, prompt, generator, output_type, num_inference_steps=1, num_images_per_prompt=1):
        assert output_type == "pt"
        n = num_images_per_prompt
        x = torch.randn(n, 256, 3, generator=generator)
        text = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(len(prompt))).expand(n, -1, -1)
        with torch.no_grad():
            for _ in range(num_inference_steps):
                x = x + 0.5 * self.transformer(hidden_states=x, encoder_hidden_states=text,
                                               pooled_projections=torch.zeros(n, 16), timestep=torch.full((n,), 0.5),
                                               img_ids=self.img_ids, txt_ids=torch.zeros(8, 3), return_dict=False)[0]
        image = torch.sigmoid(x).reshape(n, 16, 16, 3).permute(0, 3, 1, 2)
        return type("Output", (), {"images": image})()
