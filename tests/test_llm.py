"""The transformers attention function: causal GQA prefill through sparge_attention on a tiny random-weight
Llama (CPU: the float32 reference path), loaded through from_pretrained like a real checkpoint."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils")  # transformers >= 4.53, as sparge_diffusers.llm needs

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.llm import SpargeLLMAttention, register  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with grouped-query heads (4 query heads, 2 K/V heads, D = 64), saved and its path."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def load(path, implementation):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation).eval()


def prompt(n, batch=1, seed=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def test_keeping_every_block_matches_sdpa_through_from_pretrained(tiny_llama):
    attention = register("sparge_test_keep_all", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    ids = prompt(300, batch=2)  # 3 query blocks of 128, the last one partial
    sparse = logits(load(tiny_llama, "sparge_test_keep_all"), ids)
    dense = logits(load(tiny_llama, "sdpa"), ids)
    assert attention.sparse_calls == 2, "both layers' prefill must have run sparse"
    assert relative_l1(sparse, dense) < 1e-5


def test_sparse_prefill_reports_its_sparsity_and_error_grows_with_it(tiny_llama):
    """Random weights attend broadly and their blocks are not self-similar: the default theta keeps every block
    (sparsity 0, the SDPA result); with theta off, TopCdf skips blocks and the error follows the sparsity
    (measured: 0.107 at sparsity 0.05-0.08 for tau 0.98, 0.32 at 0.37-0.39 for tau 0.5)."""
    ids = prompt(700)
    dense = logits(load(tiny_llama, "sdpa"), ids)
    default = register("sparge_test_default", collect_stats=True)
    assert relative_l1(logits(load(tiny_llama, "sparge_test_default"), ids), dense) < 1e-5
    assert [s.sparsity for s in default.stats] == [0.0, 0.0]
    errors, sparsity = [], []
    for tau in (0.98, 0.5):
        attention = register(f"sparge_test_tau{tau}", simthreshd1=-1.0, cdfthreshd=tau, collect_stats=True)
        errors.append(relative_l1(logits(load(tiny_llama, f"sparge_test_tau{tau}"), ids), dense))
        sparsity.append(sum(s.sparsity for s in attention.stats) / len(attention.stats))
        assert attention.sparse_calls == 2
    assert 0 < sparsity[0] < sparsity[1]
    assert 0 < errors[0] < errors[1] < 0.5, errors


def test_pbs_segment_permutes_keys_and_keeps_causal_attention(tiny_llama):
    """pbs_segment: keys sorted within segments (PBS-Attn) before the sparse prefill. Keeping every block it is
    causal attention (the SDPA model's logits); with TopCdf skipping blocks it runs sparse and differs from the
    unpermuted call, whose blocks hold other keys. (At 700 tokens 256-position segments would keep most blocks:
    the segments a query block overlaps are computed in full.)"""
    ids = prompt(700)
    keep_all = register("sparge_test_pbs_keep", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, pbs_segment=256)
    dense = logits(load(tiny_llama, "sdpa"), ids)
    assert relative_l1(logits(load(tiny_llama, "sparge_test_pbs_keep"), ids), dense) < 1e-5
    assert keep_all.sparse_calls == 2
    pbs = register("sparge_test_pbs", simthreshd1=-1.0, cdfthreshd=0.9, pbs_segment=128, collect_stats=True)
    plain = register("sparge_test_pbs_plain", simthreshd1=-1.0, cdfthreshd=0.9)
    ours = logits(load(tiny_llama, "sparge_test_pbs"), ids)
    assert pbs.sparse_calls == 2 and all(s.sparsity > 0 for s in pbs.stats)
    assert 0 < relative_l1(ours, dense) < 0.5
    assert not torch.equal(ours, logits(load(tiny_llama, "sparge_test_pbs_plain"), ids))
    with pytest.raises(ValueError, match="pbs_segment"):
        SpargeLLMAttention(pbs_segment=100)


def test_generate_runs_prefill_sparse_and_decode_on_sdpa(tiny_llama):
    attention = register("sparge_test_generate", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    ids = prompt(200)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")  # decode steps are no fallback to warn of
        ours = load(tiny_llama, "sparge_test_generate").generate(ids, max_new_tokens=5, do_sample=False)
    theirs = load(tiny_llama, "sdpa").generate(ids, max_new_tokens=5, do_sample=False)
    assert attention.sparse_calls == 2, "only the prefill (one call per layer) runs sparse"
    assert torch.equal(ours, theirs)


def test_chunked_prefill_runs_sparse_with_the_lower_right_mask(tiny_llama, monkeypatch):
    """generate(prefill_chunk_size=...) feeds 128-token chunks against the cache: each chunk's call gets transformers'
    lower-right causal mask, runs sparse (causal_variant="lower_right"), and the tokens are SDPA's. The mask is
    compared with the pattern once per mask tensor, not once per layer."""
    import sparge_diffusers.llm as llm

    checks = []
    original = llm.lower_right_causal_mask
    monkeypatch.setattr(llm, "lower_right_causal_mask", lambda *a, **k: checks.append(a[1:]) or original(*a, **k))
    attention = register("sparge_test_chunked", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    ids = prompt(400)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = load(tiny_llama, "sparge_test_chunked").generate(ids, max_new_tokens=4, do_sample=False,
                                                                prefill_chunk_size=128)
    theirs = load(tiny_llama, "sdpa").generate(ids, max_new_tokens=4, do_sample=False, prefill_chunk_size=128)
    assert torch.equal(ours, theirs)
    assert attention.sparse_calls == 8, "4 chunks (128, 128, 128, 16 queries) x 2 layers"
    assert checks == [(128, 256), (128, 384), (16, 400)], "one mask check per chunk (the first has no mask)"


def test_continued_prompt_and_static_cache_prefill_run_sparse(tiny_llama):
    """A prompt continued on a DynamicCache (150 queries, 400 keys: lower-right), and a static cache's prefill
    (400 queries against 402 slots, no mask: SDPA's upper-left is_causal) both run sparse and give SDPA's logits;
    with TopCdf skipping blocks the chunk's output differs (the kernel, not a fallback, computed it)."""
    ids = prompt(400)
    keep_all = register("sparge_test_continue", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    skipping = register("sparge_test_continue_skip", simthreshd1=-1.0, cdfthreshd=0.5, collect_stats=True)
    results = {}
    for name in ("sdpa", "sparge_test_continue", "sparge_test_continue_skip"):
        model = load(tiny_llama, name)
        cache = transformers.DynamicCache(config=model.config)
        logits(model, ids[:, :250], past_key_values=cache, use_cache=True)
        results[name] = logits(model, ids[:, 250:], past_key_values=cache, use_cache=True)
    assert relative_l1(results["sparge_test_continue"], results["sdpa"]) < 1e-5
    assert keep_all.sparse_calls == 4 and skipping.sparse_calls == 4
    assert skipping.stats[-1].sparsity > 0 and relative_l1(results["sparge_test_continue_skip"], results["sdpa"]) > 1e-3
    static = register("sparge_test_static", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = load(tiny_llama, "sparge_test_static").generate(ids, max_new_tokens=3, do_sample=False,
                                                               cache_implementation="static")
    assert torch.equal(ours, load(tiny_llama, "sdpa").generate(ids, max_new_tokens=3, do_sample=False,
                                                                cache_implementation="static"))
    assert static.sparse_calls == 2


def test_lower_right_mask_check_accepts_only_that_pattern():
    from sparge_diffusers.llm import lower_right_causal_mask

    def pattern(nq, nkv, batch=2, extra=0):
        m = torch.ones(nq, nkv + extra, dtype=torch.bool).tril(diagonal=nkv - nq)
        return m.expand(batch, 1, nq, nkv + extra).clone()

    assert lower_right_causal_mask(pattern(100, 300), 100, 300)
    assert lower_right_causal_mask(pattern(100, 300, extra=50), 100, 300, max_elements=1000)  # cut, row chunks
    assert lower_right_causal_mask(pattern(300, 300), 300, 300)
    padded = pattern(100, 300)
    padded[1, :, :, :5] = False  # left padding of the second prompt
    assert not lower_right_causal_mask(padded, 100, 300)
    assert not lower_right_causal_mask(pattern(100, 300)[..., :299].contiguous(), 100, 299)  # one key more each
    assert not lower_right_causal_mask(torch.ones(1, 1, 100, 300, dtype=torch.bool).tril(), 100, 300)  # upper-left
    assert not lower_right_causal_mask(pattern(100, 300).float(), 100, 300)  # additive masks are not read
    assert not lower_right_causal_mask(pattern(100, 300).expand(2, 4, 100, 300), 100, 300)  # per-head masks


def test_padding_mask_falls_back_to_sdpa_with_a_warning_and_strict_raises(tiny_llama):
    register("sparge_test_padding")
    ids = prompt(150, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # left padding in the second prompt
    dense = logits(load(tiny_llama, "sdpa"), ids, attention_mask=mask)
    with pytest.warns(UserWarning, match="explicit attention mask"):
        ours = logits(load(tiny_llama, "sparge_test_padding"), ids, attention_mask=mask)
    assert torch.equal(ours, dense)
    register("sparge_test_strict", strict=True)
    with pytest.raises(ValueError, match="strict=True"):
        logits(load(tiny_llama, "sparge_test_strict"), ids, attention_mask=mask)


def test_attention_function_answers_in_transformers_layout():
    """query (B, H, N, D), key/value (B, H_kv, N, D) in; (B, N, H, D) out, contiguous, like SDPA's function."""
    torch.manual_seed(2)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(1, 4, 130, 64), torch.randn(1, 2, 130, 64), torch.randn(1, 2, 130, 64)
    attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    out, weights = attention(module, q, k, v, None, scaling=0.125)
    assert weights is None and out.shape == (1, 130, 4, 64) and out.is_contiguous()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert relative_l1(out, expected.transpose(1, 2)) < 1e-5


def test_compiled_prefill_is_one_graph_and_matches_eager(tiny_llama):
    attention = register("sparge_test_compile", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None)
    model = load(tiny_llama, "sparge_test_compile")
    ids = prompt(300)
    eager = logits(model, ids)
    assert relative_l1(eager, logits(load(tiny_llama, "sdpa"), ids)) > 1e-3, "the settings must skip blocks"
    calls = attention.sparse_calls
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first, second = logits(compiled, ids), logits(compiled, ids)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert attention.sparse_calls == calls, "compiled calls are not counted (a counter would recompile)"
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, :10] = 0
    with pytest.warns(UserWarning, match="explicit attention mask"):  # raised while tracing
        logits(compiled, prompt(300, batch=2), attention_mask=mask)


def test_compiled_prefill_says_pbs_segment_has_no_effect(tiny_llama):
    register("sparge_test_compile_pbs", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None, pbs_segment=128)
    register("sparge_test_compile_in_order", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None)
    ids = prompt(300)
    torch._dynamo.reset()
    compiled = torch.compile(load(tiny_llama, "sparge_test_compile_pbs"), backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match="pbs_segment has no effect under torch.compile"):
        got = logits(compiled, ids)
    torch._dynamo.reset()
    plain = torch.compile(load(tiny_llama, "sparge_test_compile_in_order"), backend="aot_eager", fullgraph=True)
    assert torch.equal(got, logits(plain, ids))  # keys in order, as documented


@pytest.mark.gpu
def test_prefill_on_gpu_runs_the_kernels_and_matches_sdpa(tiny_llama):
    attention = register("sparge_test_gpu", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, collect_stats=True)
    ids = prompt(1000, batch=2).cuda()
    ours = load(tiny_llama, "sparge_test_gpu").to("cuda", torch.bfloat16)
    sdpa = load(tiny_llama, "sdpa").to("cuda", torch.bfloat16)
    out = logits(ours, ids)
    assert attention.sparse_calls == 2 and all(s.sparsity == 0 for s in attention.stats)
    assert torch.isfinite(out).all()
    assert relative_l1(out.float(), logits(sdpa, ids).float()) < 2e-2  # bf16 through 2 layers
    generated = ours.generate(ids[:1, :300], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 304) and attention.sparse_calls == 4
    torch._dynamo.reset()
    compiled = logits(torch.compile(ours, fullgraph=True), ids)  # inductor, the kernels behind the operator
    assert attention.sparse_calls == 4 and relative_l1(compiled.float(), out.float()) < 1e-2
    # chunked: 1000 prompt tokens continued by 600 on the cache (lower-right), both layers sparse
    chunked = {}
    for name, model in (("ours", ours), ("sdpa", sdpa)):
        cache = transformers.DynamicCache(config=model.config)
        logits(model, ids[:, :1000], past_key_values=cache, use_cache=True)
        chunked[name] = logits(model, prompt(600, batch=2, seed=5).cuda(), past_key_values=cache, use_cache=True)
    assert attention.sparse_calls == 8 and torch.isfinite(chunked["ours"]).all()
    assert relative_l1(chunked["ours"].float(), chunked["sdpa"].float()) < 2e-2
