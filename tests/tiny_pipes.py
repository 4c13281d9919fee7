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
