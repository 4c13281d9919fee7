"""The static-cache helpers of benchmarks/llm_prefill.py that decide its FlexAttention figures (CPU)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import llm_prefill  # noqa: E402  (a broken import must fail here, not skip)

from sparge_diffusers import relative_l1  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_flex_prefills_into_a_reused_static_cache_give_sdpas_rows(tiny_llama):
    """The benchmark times each forward into one StaticCache, rewound after it. transformers hands a filled cache's live
    write counter to FlexAttention's mask_mod, which each layer's cache update moves on before attention: without
    ``static_cache``'s copy, every forward after the first gets rows far from SDPA's (rel. L1 0.7 here), and the
    FlexAttention time the benchmark printed was for that wrong result."""
    model = tiny_llama
    lengths, slots = [256, 200], 384
    ids = torch.randint(0, 500, (2, 256), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    real = mask.bool()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    model.set_attn_implementation("flex_attention")
    try:
        cache, name = llm_prefill.static_cache(model, slots, batch=2, device="cpu", dtype=torch.float32)
        rewind = llm_prefill.rewinder(cache, ids.shape[1])
        for _ in range(3):
            with torch.no_grad():
                out = model.model(input_ids=ids, attention_mask=mask, use_cache=True,
                                  cache_position=torch.arange(ids.shape[1]), **{name: cache}).last_hidden_state
            rewind()
            assert relative_l1(out[real], dense) < 1e-4
    finally:
        model.set_attn_implementation("sdpa")
