"""The transformers attention function: causal GQA prefill through sparge_attention on a tiny random-weight
Llama (CPU: the float32 reference path), loaded through from_pretrained like a real checkpoint."""

import inspect
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils")  # transformers >= 4.53, as sparge_diffusers.llm needs

from sparge_diffusers import relative_l1  # noqa: E402
from sparge_diffusers.llm import CausalMaskLayout, SpargeLLMAttention, read_causal_mask, register  # noqa: E402

# transformers 4.x (4.53-4.57 run) differs from 5.x where these tests look: its generate leaves a prompt's last token
# to the first decode step, it masks a static cache's first prefill, and its SDPA function adds no position bias
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5
# the models' cache argument: `cache` in recent 5.x releases (past_key_values warns there, to go in 5.40), before that
# past_key_values
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters \
    else "past_key_values"


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


def dynamic_cache(model):
    """An empty DynamicCache for the model (transformers before 4.56 takes no config)."""
    try:
        return transformers.DynamicCache(config=model.config)
    except TypeError:
        return transformers.DynamicCache()


def static_cache(model, slots, batch=1):
    """A StaticCache of ``slots`` positions for the model, sized at its first use (transformers before 4.56 wants the
    batch, device and dtype up front)."""
    try:
        return transformers.StaticCache(config=model.config, max_cache_len=slots)
    except TypeError:
        weight = next(model.parameters())
        return transformers.StaticCache(config=model.config, max_batch_size=batch, max_cache_len=slots,
                                        device=weight.device, dtype=weight.dtype)


def load(path, implementation):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation).eval()


def prompt(n, batch=1, seed=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def aot_compiled(model):
    """``model`` compiled as one graph (aot_eager, fullgraph) after a Dynamo reset, as every compiled test here runs."""
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager", fullgraph=True)


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


def test_a_registered_function_is_the_one_the_model_calls(tiny_llama, monkeypatch):
    """``register(name, attention=...)`` registers that very function: its settings and counters are the ones the
    model's calls use. Without transformers' registries the error names the version needed."""
    built = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    assert register("sparge_test_built", attention=built) is built
    ids = prompt(200)
    sparse = logits(load(tiny_llama, "sparge_test_built"), ids)
    assert built.sparse_calls == 2, "the model must call the function it was given"
    assert relative_l1(sparse, logits(load(tiny_llama, "sdpa"), ids)) < 1e-5
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with pytest.raises(ImportError, match="transformers >= 4.53"):
        register("sparge_test_no_registry")


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
    register("sparge_test_pbs_plain", simthreshd1=-1.0, cdfthreshd=0.9)
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
    original = llm.read_causal_mask
    monkeypatch.setattr(llm, "read_causal_mask", lambda *a, **k: checks.append(a[1:]) or original(*a, **k))
    attention = register("sparge_test_chunked", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    ids = prompt(400)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = load(tiny_llama, "sparge_test_chunked").generate(ids, max_new_tokens=4, do_sample=False,
                                                                prefill_chunk_size=128)
    theirs = load(tiny_llama, "sdpa").generate(ids, max_new_tokens=4, do_sample=False, prefill_chunk_size=128)
    assert torch.equal(ours, theirs)
    assert attention.sparse_calls == 8, "4 chunks (128, 128, 128, 16 queries) x 2 layers"
    last = (15, 399) if TRANSFORMERS_4 else (16, 400)  # 4.x: the prompt's last token goes to the first decode step
    assert checks == [(128, 256), (128, 384), last], "one mask check per chunk (the first has no mask)"


def test_continued_prompt_and_static_cache_prefill_run_sparse(tiny_llama):
    """A prompt continued on a DynamicCache (150 queries, 400 keys: lower-right), and a static cache's prefill
    (400 queries against 402 slots, no mask: SDPA's upper-left is_causal; run on the first 400) both run sparse and
    give SDPA's logits; with TopCdf skipping blocks the chunk's output differs (the kernel, not a fallback, computed
    it)."""
    ids = prompt(400)
    keep_all = register("sparge_test_continue", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    skipping = register("sparge_test_continue_skip", simthreshd1=-1.0, cdfthreshd=0.5, collect_stats=True)
    results = {}
    for name in ("sdpa", "sparge_test_continue", "sparge_test_continue_skip"):
        model = load(tiny_llama, name)
        cache = dynamic_cache(model)
        logits(model, ids[:, :250], **{CACHE: cache}, use_cache=True)
        results[name] = logits(model, ids[:, 250:], **{CACHE: cache}, use_cache=True)
    assert relative_l1(results["sparge_test_continue"], results["sdpa"]) < 1e-5
    assert keep_all.sparse_calls == 4 and skipping.sparse_calls == 4
    assert skipping.stats[-1].sparsity > 0 and relative_l1(results["sparge_test_continue_skip"], results["sdpa"]) > 1e-3
    static = register("sparge_test_static", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    lengths = recording_key_lengths(static)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = load(tiny_llama, "sparge_test_static").generate(ids, max_new_tokens=3, do_sample=False,
                                                               cache_implementation="static")
    assert torch.equal(ours, load(tiny_llama, "sdpa").generate(ids, max_new_tokens=3, do_sample=False,
                                                                cache_implementation="static"))
    assert static.sparse_calls == 2
    assert lengths == [400, 400], "the slots past the prompt are left out (5.x: no mask, 4.x: a static-cache mask)"


def recording_key_lengths(attention):
    """Record the key length of every sparse call ``attention`` makes (after any cut of a static cache's slots)."""
    lengths = []

    def prefill(q, k, v, *rest):
        lengths.append(k.shape[2])
        return SpargeLLMAttention._prefill(attention, q, k, v, *rest)

    attention._prefill = prefill
    return lengths


def test_static_cache_chunks_run_sparse_on_the_filled_slots(tiny_llama):
    """Against a static cache a chunk's mask also hides the slots not filled yet from every query. Such chunks run
    sparse on the filled slots only (lower right), not SDPA under the mask: generate(cache_implementation="static",
    prefill_chunk_size=128), a prompt continued on a StaticCache of 512 slots, and a left-padded batch chunked
    against a static cache; tokens and logits are SDPA's."""
    ids = prompt(400)
    chunked = register("sparge_test_static_chunked", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    lengths = recording_key_lengths(chunked)
    options = dict(max_new_tokens=3, do_sample=False, cache_implementation="static", prefill_chunk_size=128)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = load(tiny_llama, "sparge_test_static_chunked").generate(ids, **options)
    assert torch.equal(ours, load(tiny_llama, "sdpa").generate(ids, **options))
    last = 399 if TRANSFORMERS_4 else 400  # 4.x: the prompt's last token goes to the first decode step
    # the first chunk has no mask on 5.x (upper left against all 402 slots, cut to its 128) and a static-cache mask
    # on 4.x
    assert lengths == [128] * 2 + [256] * 2 + [384] * 2 + [last] * 2

    results = {}
    for name in ("sdpa", "sparge_test_static_continue", "sparge_test_static_skip"):
        if name != "sdpa":
            attention = register(name, simthreshd1=-1.0, cdfthreshd=1.0 if name.endswith("continue") else 0.5,
                                 pvthreshd=None, strict=True)
            lengths = recording_key_lengths(attention)
        model = load(tiny_llama, name)
        cache = static_cache(model, 512)
        logits(model, ids[:, :250], **{CACHE: cache}, use_cache=True, cache_position=torch.arange(250))
        results[name] = logits(model, ids[:, 250:], **{CACHE: cache}, use_cache=True,
                               cache_position=torch.arange(250, 400))
        if name != "sdpa":
            assert lengths == [250] * 2 + [400] * 2, name
    assert relative_l1(results["sparge_test_static_continue"], results["sdpa"]) < 1e-5
    assert relative_l1(results["sparge_test_static_skip"], results["sdpa"]) > 1e-3  # the kernel computed it

    batch = prompt(300, batch=2)
    mask, _ = left_padded(batch, (0, 40))
    padded = register("sparge_test_static_padded", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                      min_padded_tokens=0, strict=True)
    options = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static",
                   prefill_chunk_size=128, pad_token_id=0)
    ours = load(tiny_llama, "sparge_test_static_padded").generate(batch, **options)
    assert torch.equal(ours, load(tiny_llama, "sdpa").generate(batch, **options))
    assert padded.sparse_calls == 6, "3 chunks (128, 128, 44 queries) x 2 layers, each prompt its own call"


def test_mask_check_accepts_only_the_left_padded_lower_right_pattern():
    from sparge_diffusers.llm import read_causal_mask as check

    def pattern(nq, nkv, batch=2, extra=0, padding=(0, 0), empty=0):
        """transformers' mask: nq queries lower right over the first nkv - empty keys (the rest: a static cache's
        empty slots, hidden from every query), each prompt's first padding[b] keys hidden; extra columns after."""
        used = nkv - empty
        m = torch.ones(nq, nkv + extra, dtype=torch.bool).tril(diagonal=used - nq)
        m[:, used:] = False
        m = m.expand(batch, 1, nq, nkv + extra).clone()
        for b, p in enumerate(padding[:batch]):
            m[b, :, :, :p] = False  # transformers hides a left-padded prompt's first p keys from every query
        return m

    def layout(keys, padding):
        return CausalMaskLayout(keys, list(padding))

    assert check(pattern(100, 300), 100, 300) == layout(300, [0, 0])
    assert check(pattern(100, 300, extra=50), 100, 300, max_elements=1000) == layout(300, [0, 0])  # cut, row chunks
    assert check(pattern(300, 300), 300, 300) == layout(300, [0, 0])
    assert check(pattern(100, 300, padding=(0, 5)), 100, 300) == layout(300, [0, 5])  # padding inside the cache
    assert check(pattern(100, 300, padding=(250, 0)), 100, 300, max_elements=700) == layout(300, [250, 0])
    assert check(pattern(100, 300, padding=(300, 7)), 100, 300) == layout(300, [300, 7])  # a chunk of padding only
    assert check(pattern(150, 150, batch=1, padding=(20,)), 150, 150) == layout(150, [20])  # one row for the batch
    # a static cache: slots past the chunk's last position are empty
    assert check(pattern(100, 512, empty=112), 100, 512) == layout(400, [0, 0])  # a chunk at positions 300..399
    assert check(pattern(400, 402, empty=2), 400, 402) == layout(400, [0, 0])  # transformers 4.x's first prefill
    assert check(pattern(100, 512, empty=112, padding=(0, 30)), 100, 512, max_elements=900) == layout(400, [0, 30])
    assert check(pattern(100, 512, empty=112, padding=(400, 30)), 100, 512) == layout(400, [400, 30])
    assert check(pattern(100, 512, padding=(512, 512)), 100, 512) == layout(512, [512, 512])  # nothing seen
    right = pattern(150, 150)
    right[1, :, :, 140:] = False  # right padding of the second prompt (read by the next test)
    assert check(right, 150, 150) == CausalMaskLayout(150, [0, 0], None, [150, 140], 0)
    inner = pattern(100, 300, padding=(0, 5))
    inner[1, :, 50:, 7] = False  # a hole that is no padding
    assert check(inner, 100, 300) is None
    seen_late = pattern(100, 512, empty=112)
    seen_late[:, :, 10, 450] = True  # an "empty" slot that one query sees
    assert check(seen_late, 100, 512) is None
    assert check(pattern(100, 300)[..., :299].contiguous(), 100, 299) is None  # one key more each
    # upper left (query i sees keys 0..i) is lower right over the first 100 keys, the rest unseen: the same attention
    assert check(torch.ones(1, 1, 100, 300, dtype=torch.bool).tril(), 100, 300) == layout(100, [0])
    assert check(pattern(100, 300).float(), 100, 300) is None  # additive masks are not read
    assert check(pattern(100, 300).expand(2, 4, 100, 300), 100, 300) is None  # per-head masks
    assert check(pattern(100, 300), 100, 301) is None  # fewer keys than the call has
    assert check(pattern(100, 300), 99, 300) is None  # other query rows
    assert check(pattern(100, 300)[:, :, :0], 0, 300) is None  # no query
    assert check(pattern(100, 300)[0], 100, 300) is None  # not (B, 1, Nq, Nkv)
    # a sliding window of 64 keys (the query at position p sees p - 63 .. p), as transformers masks a local layer
    def windowed(m, nq, used, window=64):
        positions = torch.arange(nq)[:, None] + used - nq
        return m & (torch.arange(m.shape[-1])[None, :] > positions - window)

    assert check(windowed(pattern(100, 300), 100, 300), 100, 300, sliding_window=64) == layout(300, [137, 137])
    assert check(windowed(pattern(300, 300), 300, 300), 300, 300, sliding_window=64) == layout(300, [0, 0])
    # padding that the first query's window still reaches, and padding no window reaches
    assert check(windowed(pattern(100, 300, padding=(150, 20)), 100, 300), 100, 300, sliding_window=64,
                 max_elements=900) == layout(300, [150, 137])
    assert check(windowed(pattern(100, 512, empty=112, padding=(350, 0)), 100, 400), 100, 512,
                 sliding_window=64) == layout(400, [350, 237])  # and a static cache's empty slots
    # read without its window: one segment per query (each its own first key), which the function refuses as
    # segments too short to run one call each
    assert check(windowed(pattern(100, 300), 100, 300), 100, 300).segments == [[(i, i + 1, 137 + i) for i in
                                                                                 range(100)]] * 2
    assert check(windowed(pattern(100, 300), 100, 300, window=65), 100, 300, sliding_window=64) is None
    assert check(pattern(100, 300), 100, 300, sliding_window=64) is None  # a window the mask does not apply


def right_padded_mask_4d(ends, nq, nkv=None):
    """transformers' boolean (B, 1, Nq, Nkv) mask of a right-padded batch (Nkv - Nq keys cached before the queries):
    causal, and prompt b's keys from ends[b] on hidden from every query."""
    nkv = nq if nkv is None else nkv
    causal = torch.ones(nq, nkv, dtype=torch.bool).tril(diagonal=nkv - nq)
    real = torch.arange(nkv)[None, :] < torch.tensor(ends)[:, None]
    return causal[None, None] & real[:, None, None, :]


def test_mask_reader_finds_right_padding():
    """read_causal_mask reads a right-padded batch (each prompt's keys from ends[b] on hidden from every query, so
    its padding queries see all of its keys): its ends, with or without an unpadded prompt, after cached keys (a
    chunk whose queries may all be padding), in row chunks. Rows that stray from it are read as they are where each
    still sees one run of keys ending at its causal end or its prompt's last key, or none (a padding query seeing no
    key, real queries restarting their run: ``padding_runs``, ``segments``), and refused otherwise (a padding query
    seeing a padding key or missing a real key inside its run, a real query seeing no key)."""
    from sparge_diffusers.llm import read_causal_mask as read

    assert read(right_padded_mask_4d([150, 140], 150), 150, 150) == CausalMaskLayout(150, [0, 0], None, [150, 140], 0)
    assert read(right_padded_mask_4d([99, 1, 140], 150), 150, 150, max_elements=700) == CausalMaskLayout(
        140, [0, 0, 0], None, [99, 1, 140], 0)  # every prompt padded (padding="max_length"), one of a single token
    assert read(right_padded_mask_4d([300, 220], 100, 300), 100, 300).ends == [300, 220]  # 200 cached keys
    assert read(right_padded_mask_4d([300, 150], 100, 300), 100, 300).ends == [300, 150]  # a chunk of padding only
    assert read(right_padded_mask_4d([150], 150), 150, 150) == CausalMaskLayout(150, [0])  # no padding: plain causal
    odd = right_padded_mask_4d([150, 140], 150)
    odd[1, 0, 145, 140] = True  # a padding query that sees a padding key
    assert read(odd, 150, 150) is None
    odd = right_padded_mask_4d([150, 140], 150)
    odd[1, 0, 145, 139] = False  # a padding query that misses a real key
    assert read(odd, 150, 150) is None
    # read since session 60: the real queries' runs (segments) and the padding queries' (padding_runs) as they are
    odd = right_padded_mask_4d([150, 140], 150)
    odd[1, 0, 145] = False  # a padding query that sees no key: left out of the padding runs (zeros)
    assert read(odd, 150, 150) == CausalMaskLayout(150, [0, 0], [[(0, 150, 0)], [(0, 140, 0)]], [150, 140], 0,
                                                   [[], [(140, 145, 0), (146, 150, 0)]])
    odd = right_padded_mask_4d([150, 140], 150)
    odd[1, 0, 1:, 0] = False  # the second prompt's queries but its first no longer see key 0
    assert read(odd, 150, 150) == CausalMaskLayout(150, [0, 0], [[(0, 150, 0)], [(0, 1, 0), (1, 140, 1)]],
                                                   [150, 140], 0, [[], [(140, 150, 1)]])
    odd[1, 0, 0, 0] = False  # left and right padding at once: a real query that sees no key
    assert read(odd, 150, 150) is None
    assert read(right_padded_mask_4d([150, 140], 150), 150, 150, sliding_window=64) is None  # no window read
    assert read(right_padded_mask_4d([150, 140], 150), 150, 150, sliding_window=150).ends == [150, 140]  # hides none
    assert read(right_padded_mask_4d([150, 140], 150).float(), 150, 150) is None


def test_mask_reader_finds_right_padding_against_a_static_cache():
    """Against a static cache a right-padded batch's mask also hides the slots past the last query's position, so its
    queries do not sit at Nkv - Nq: the reader finds their first position (``query_start``) from the real queries,
    whose last key is their own position. A first prefill at 0, a chunk at 200 (one prompt padded from inside it, or
    a chunk whose queries are all padding: any start that describes every row is exact), under a window too; a
    padding query that sees an empty slot is refused. Before session 60 such masks fell back to SDPA."""
    from sparge_diffusers.llm import read_causal_mask as read

    def static(ends, nq, nkv, start, window=None):
        """right_padded_mask_4d with the queries at start.. and slots from start + nq on empty."""
        positions, keys = torch.arange(nq)[:, None] + start, torch.arange(nkv)[None, :]
        seen = ((keys <= positions) | (positions >= torch.tensor(ends)[:, None, None])) & (keys <= start + nq - 1)
        seen &= keys < torch.tensor(ends)[:, None, None]
        if window is not None:
            seen &= keys > positions - window
        return seen[:, None]

    assert read(static([150, 140], 150, 512, 0), 150, 512) == CausalMaskLayout(150, [0, 0], None, [150, 140], 0)
    assert read(static([130, 1, 140], 150, 512, 0), 150, 512, max_elements=900) == CausalMaskLayout(
        140, [0, 0, 0], None, [130, 1, 140], 0)  # every prompt padded
    assert read(static([300, 250], 100, 512, 200), 100, 512) == CausalMaskLayout(
        300, [0, 0], None, [300, 250], 200)
    assert read(static([300, 150], 100, 512, 200), 100, 512).query_start == 200  # one prompt's queries all padding
    only_padding = read(static([150, 140], 100, 512, 200), 100, 512)  # every query padding: rows alike from 149 on
    assert only_padding is not None and only_padding.ends == [150, 140] and only_padding.query_start >= 149
    windowed = static([150, 100], 150, 512, 0, window=64)
    assert read(windowed, 150, 512, sliding_window=64) == CausalMaskLayout(150, [0, 0], None, [150, 100], 0)
    # the window not given: one segment per query past the 64th (which the function refuses as too short)
    assert read(windowed, 150, 512).segments[0][:2] == [(0, 64, 0), (64, 65, 1)]
    odd = static([150, 140], 150, 512, 0)
    odd[1, 0, 145, 300] = True  # a padding query that sees an empty slot
    assert read(odd, 150, 512) is None
    odd = static([300, 250], 100, 512, 200)
    odd[0, 0, 10, 211] = True  # a real query that sees the next position
    assert read(odd, 100, 512) is None


def test_right_padded_call_shorter_than_its_window_keeps_the_window_for_its_padding_queries():
    """Every prompt right-padded and shorter than the window (ends 9 and 43, window 50) after 3 cached keys: the
    window hides no key from a real query, but the padding queries at positions 50..67 see only keys from p - 49 on.
    The function read the window's span off the longest prompt (43 keys) and dropped the window, so those rows saw
    every real key (found by a random mask draw, session 57). Eager calls and the compiled path's masked operator
    (``_masked_call``) give SDPA's rows under the mask, wherever a row sees a key."""
    # (the second case: a window wider than the first query's position plus the head dim, 64, but not its position
    # plus the query count; a mutant of the masked operator's span that took the head dim for the query count lived)
    for ends, nq, nkv, window in (([9, 43], 65, 68, 50), ([9, 43], 100, 103, 70)):
        positions = torch.arange(nq)[:, None] + nkv - nq
        mask = right_padded_mask_4d(ends, nq, nkv) & (torch.arange(nkv)[None, :] > positions - window)
        assert read_causal_mask(mask, nq, nkv, sliding_window=window).ends == ends
        assert not assert_rows_are_sdpas(mask, window, seed=924).all()


def assert_rows_are_sdpas(mask, window=None, seed=0, batch=2):
    """One sparse call of SpargeLLMAttention under the boolean ``mask`` (eager, and through the masked operator,
    ``_masked_call``) on random q/k/v of ``batch`` prompts (4 query heads, 2 K/V heads, D = 64): SDPA's rows under
    the mask where a row sees a key, zeros where none. Returns which rows see a key, (B | 1, Nq, 1, 1)."""
    nq, nkv = mask.shape[2:]
    torch.manual_seed(seed)
    q, k, v = torch.randn(batch, 4, nq, 64), torch.randn(batch, 2, nkv, 64), torch.randn(batch, 2, nkv, 64)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, min_padded_tokens=0,
                                   min_segment_queries=0, strict=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    seen = mask[:, 0].any(-1)[:, :, None, None]
    eager, _ = attention(module, q, k, v, mask, scaling=0.2, sliding_window=window)
    masked = attention._masked_call(q, k, v, mask, 0.2, window)
    for out in (eager, masked):
        assert out.shape == (batch, nq, 4, 64) and torch.isfinite(out).all()
        assert torch.equal(out * ~seen, torch.zeros_like(out))
        torch.testing.assert_close(out * seen, expected.transpose(1, 2) * seen, rtol=1e-5, atol=1e-5)
    assert attention.sparse_calls == 1
    return seen


@pytest.mark.parametrize("slots,window", [(None, 64), (512, 64), (512, None)])
def test_right_padded_chunk_with_a_prompt_that_sees_no_key_runs_sparse(slots, window):
    """A right-padded chunk (queries at positions 200..299) of two prompts, the second 280 tokens long, the first 9
    tokens long under a window of 64 keys (its queries are all padding past the window's reach) or, without a
    window, all padding: no query of the first prompt sees a key. The mask reads as right padding, with that
    prompt's end at 0 (before session 60 it fell back to SDPA), with a dynamic cache (300 keys) and a static one
    (512 slots, those after position 299 empty); eager calls and the masked operator give SDPA's rows where a row
    sees a key and zeros where none."""
    nq, nkv, start = 100, slots or 300, 200
    positions, keys = torch.arange(nq)[:, None] + start, torch.arange(nkv)[None, :]
    ends = torch.tensor([9 if window else 0, 280])[:, None, None]
    mask = ((keys <= positions) | (positions >= ends)) & (keys < ends)
    mask = (mask & (keys > positions - window) if window else mask)[:, None]
    layout = read_causal_mask(mask, nq, nkv, sliding_window=window)
    assert layout is not None and layout.ends == [0, 280] and layout.query_start == start
    seen = assert_rows_are_sdpas(mask, window, seed=60)
    assert not seen[0].any() and seen[1].all()


def test_right_padded_mask_of_one_row_runs_for_the_whole_batch():
    """A right-padded (1, 1, Nq, Nkv) mask that a caller built for a batch of two (broadcast over it), plain and over
    packed sequences: every prompt runs with that row's layout, and the rows are SDPA's under the mask."""
    plain = right_padded_mask_4d([140], 150)
    packed = plain & (torch.arange(150)[None, :] >= torch.where(torch.arange(150) >= 70, 70, 0)[:, None])
    for mask in (plain, packed):
        assert assert_rows_are_sdpas(mask, seed=3).all()


def test_right_padded_prompt_shorter_than_the_window_runs_as_alone():
    """A right-padded batch whose window hides keys from some padding queries (window 300, 400 positions) but not from
    a prompt's real queries (ends 290 and 100): each prompt's real rows are its call alone, without the window, as
    predicted by stage 1 (cdfthreshd 0.5 skips blocks). A window shorter than ``min_predicted_window`` made them
    keep every block."""
    ends, n, window = [290, 100], 400, 300
    positions = torch.arange(n)[:, None]
    mask = right_padded_mask_4d(ends, n) & (torch.arange(n)[None, :] > positions - window)
    torch.manual_seed(7)
    q, k, v = torch.randn(2, 4, n, 64), torch.randn(2, 2, n, 64), torch.randn(2, 2, n, 64)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=0.5, min_padded_tokens=0, collect_stats=True,
                                   strict=True)
    out, _ = attention(module, q, k, v, mask, scaling=0.125, sliding_window=window)
    assert attention.stats[-1].sparsity > 0  # stage 1 skipped blocks
    for b, end in enumerate(ends):
        alone, _ = attention(module, q[b:b + 1, :, :end], k[b:b + 1, :, :end], v[b:b + 1, :, :end], None,
                             scaling=0.125, sliding_window=window)
        assert torch.equal(out[b:b + 1, :end], alone), b


def test_segmented_mask_reader_finds_each_run_of_queries_on_its_own_keys():
    """read_causal_mask reads causal attention restarted within a prompt (Llama 4's chunks, packed
    sequences): each run of queries that see the same first key, with padding, a cache and a static cache's empty
    slots; any mask whose rows are not one contiguous run ending lower right is refused."""
    from sparge_diffusers.llm import read_causal_mask as read

    def chunked(nq, nkv, chunk, batch=1, padding=(0,), empty=0, phase=0):
        """transformers' chunked mask: query at key position p sees keys k <= p of its own chunk, chunks counted
        from the prompt's first real key (+ phase: the cache dropped keys before the first slot)."""
        used = nkv - empty
        keys, positions = torch.arange(nkv), torch.arange(nq) + used - nq
        m = torch.zeros(batch, 1, nq, nkv, dtype=torch.bool)
        for b, pad in enumerate(padding[:batch]):
            same = (keys[None] - pad + phase) // chunk == (positions[:, None] - pad + phase) // chunk
            m[b, 0] = (keys[None] <= positions[:, None]) & (keys[None] >= pad) & same & (keys[None] < used)
        return m

    # 300 queries in chunks of 64: five runs, each on its own chunk's keys
    assert read(chunked(300, 300, 64), 300, 300) == CausalMaskLayout(
        300, [0], [[(0, 64, 0), (64, 128, 64), (128, 192, 128), (192, 256, 192), (256, 300, 256)]])
    assert read(chunked(300, 300, 64), 300, 300, max_elements=1000) == read(chunked(300, 300, 64), 300, 300)
    # a chunk of 100 queries after 200 cached keys: the first 56 finish the chunk at 192, the rest open the next
    assert read(chunked(100, 300, 64), 100, 300) == CausalMaskLayout(300, [192], [[(0, 56, 192), (56, 100, 256)]])
    # a cache that dropped keys (Llama 4's chunked layers keep a sliding cache): chunk starts off the slot grid
    assert read(chunked(100, 150, 64, phase=10), 100, 150).segments == [[(0, 4, 0), (4, 68, 54), (68, 100, 118)]]
    # left padding: chunks counted from each prompt's first real key, padding queries in no run
    layout = read(chunked(300, 300, 64, batch=2, padding=(0, 70)), 300, 300)
    assert layout.padding == [0, 70] and layout.segments[1] == [
        (70, 134, 70), (134, 198, 134), (198, 262, 198), (262, 300, 262)]
    # a static cache's empty slots, hidden from every query
    assert read(chunked(100, 512, 64, empty=112), 100, 512) == CausalMaskLayout(
        400, [256], [[(0, 20, 256), (20, 84, 320), (84, 100, 384)]])
    # packed sequences: runs of any length
    packed = torch.zeros(1, 1, 10, 10, dtype=torch.bool)
    for start, end in ((0, 3), (3, 8), (8, 10)):
        packed[0, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    assert read(packed, 10, 10).segments == [[(0, 3, 0), (3, 8, 3), (8, 10, 8)]]
    # packed under a sliding window of 4 keys: the same sequences, each query also seeing at most 4 keys back
    windowed = packed & (torch.arange(10)[None, :] > torch.arange(10)[:, None] - 4)
    assert read(windowed, 10, 10, sliding_window=4).segments == [[(0, 3, 0), (3, 8, 3), (8, 10, 8)]]
    assert read(windowed, 10, 10, sliding_window=3) is None  # a window the mask does not apply
    assert read(windowed, 10, 10, sliding_window=1) is None
    one_key = torch.eye(10, dtype=torch.bool)[None, None]  # a one-key window: every query sees itself only
    assert read(one_key, 10, 10, sliding_window=1) == CausalMaskLayout(10, [0])
    late_head = windowed.clone()
    late_head[0, 0, 6, 3:6] = False  # a query that sees itself only, whose successors still see keys before it
    assert read(late_head, 10, 10, sliding_window=4) is None
    hole = chunked(300, 300, 64)
    hole[0, 0, 100, 70] = False  # a row that is not one run
    assert read(hole, 300, 300) is None
    late = chunked(300, 300, 64)
    late[0, 0, 100, 101] = True  # a key after the diagonal
    assert read(late, 300, 300) is None
    assert read(chunked(300, 300, 64)[..., :299].contiguous(), 300, 299) is None  # one key more each
    assert read(chunked(300, 300, 64).float(), 300, 300) is None  # additive masks are not read
    assert read(chunked(300, 300, 64).expand(1, 2, 300, 300), 300, 300) is None  # per-head masks
    assert read(torch.zeros(1, 1, 5, 5, dtype=torch.bool), 5, 5) == CausalMaskLayout(5, [5])  # all padding
    late_start = chunked(300, 300, 300)
    late_start[0, 0, :10] = False  # one run, but after queries that would see its first key: not left padding
    assert read(late_start, 300, 300) == CausalMaskLayout(300, [0], [[(10, 300, 0)]])


def left_padded(ids, padding):
    """The batch with prompt b's first padding[b] tokens marked as padding, and the position ids generate gives
    them (counted from the first real token)."""
    mask = torch.ones_like(ids)
    for b, p in enumerate(padding):
        mask[b, :p] = 0
    return mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_left_padded_batch_runs_each_prompt_sparse_as_if_alone(tiny_llama):
    """A left-padded batch runs sparse (no warning): keeping every block gives SDPA's logits at every real position;
    with TopCdf skipping blocks, the padded prompt gives the logits of the same tokens run alone without padding
    (its padding is neither attended nor part of stage 1's blocks), and the stats cover both prompts."""
    ids = prompt(300, batch=3)
    mask, positions = left_padded(ids, (0, 70, 299))  # the third prompt is a single token
    real = mask.bool()
    keep_all = register("sparge_test_padded_keep", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                        min_padded_tokens=0)
    skipping = register("sparge_test_padded_skip", simthreshd1=-1.0, cdfthreshd=0.5, collect_stats=True,
                        min_padded_tokens=0)
    dense = logits(load(tiny_llama, "sdpa"), ids, attention_mask=mask, position_ids=positions)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = logits(load(tiny_llama, "sparge_test_padded_keep"), ids, attention_mask=mask, position_ids=positions)
        sparse = logits(load(tiny_llama, "sparge_test_padded_skip"), ids, attention_mask=mask, position_ids=positions)
    assert keep_all.sparse_calls == 2 and skipping.sparse_calls == 2
    assert relative_l1(ours[real], dense[real]) < 1e-5
    alone = logits(load(tiny_llama, "sparge_test_padded_skip"), ids[1:, 70:])
    assert relative_l1(sparse[1, 70:], alone[0]) < 1e-5
    assert relative_l1(sparse[1, 70:], dense[1, 70:]) > 1e-3, "the settings must skip blocks"
    joined, single = skipping.stats[0], skipping.stats[2]  # layer 0 of the padded batch and of the prompt alone
    assert joined.qk_skipped.shape == (4,) and 0 < joined.sparsity < 1 and single.sparsity > 0
    assert joined.sparsity != single.sparsity  # the other prompts' rows are in the joined stats too
    assert torch.isfinite(sparse[real]).all()


def test_left_padded_generate_chunked_or_not_gives_sdpa_tokens(tiny_llama):
    """generate on a left-padded batch, whole and in 128-token chunks (whose first chunk is mostly padding for
    the second prompt): the sparse prefill with every block kept gives SDPA's tokens, and no call falls back."""
    ids = prompt(300, batch=2, seed=3)
    mask, _ = left_padded(ids, (0, 170))
    attention = register("sparge_test_padded_generate", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                         min_padded_tokens=0)
    for chunk in (None, 128):
        options = dict(max_new_tokens=4, do_sample=False, attention_mask=mask, pad_token_id=0)
        if chunk:
            options["prefill_chunk_size"] = chunk
        calls = attention.sparse_calls
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="SpargeLLMAttention")
            ours = load(tiny_llama, "sparge_test_padded_generate").generate(ids, **options)
        assert torch.equal(ours, load(tiny_llama, "sdpa").generate(ids, **options)), chunk
        assert attention.sparse_calls - calls == (6 if chunk else 2), chunk  # 3 chunks (128, 128, 44) x 2 layers


def test_short_left_padded_batch_goes_to_sdpa_unless_asked(tiny_llama):
    """Below min_padded_tokens (default 4096 keys) a left-padded batch runs SDPA under the mask, with a warning
    that names the setting (one call per prompt would cost more there); min_padded_tokens=0 runs it sparse."""
    ids = prompt(300, batch=2)
    mask, positions = left_padded(ids, (0, 30))
    short = register("sparge_test_padded_short", simthreshd1=-1.0, cdfthreshd=0.5)
    with pytest.warns(UserWarning, match="min_padded_tokens=4096"):
        got = logits(load(tiny_llama, "sparge_test_padded_short"), ids, attention_mask=mask, position_ids=positions)
    assert short.sparse_calls == 0
    assert torch.equal(got, logits(load(tiny_llama, "sdpa"), ids, attention_mask=mask, position_ids=positions))
    assert SpargeLLMAttention(min_padded_tokens=300).route(
        torch.nn.Module(), torch.zeros(2, 4, 300, 64), torch.zeros(2, 2, 300, 64), torch.zeros(2, 2, 300, 64),
        left_padded_mask_4d(mask), 0.0, True, {})[0] is None, "300 keys reach a threshold of 300"
    with pytest.raises(ValueError, match="min_padded_tokens"):
        SpargeLLMAttention(min_padded_tokens=-1)


def left_padded_mask_4d(mask):
    """transformers' boolean (B, 1, N, N) mask of a left-padded batch without a cache."""
    n = mask.shape[1]
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]


def right_padded(ids, ends):
    """The attention mask of the batch with prompt b's tokens from ends[b] on marked as padding."""
    mask = torch.ones_like(ids)
    for b, end in enumerate(ends):
        mask[b, end:] = 0
    return mask


def test_right_padded_batch_runs_each_prompt_sparse_and_gives_sdpa_logits_everywhere(tiny_llama):
    """A right-padded batch (one prompt unpadded, one padded, one of a single token) runs sparse with no warning:
    keeping every block gives SDPA's logits at every position, padding included (padding queries attend exactly to
    their prompt's keys, as under SDPA's mask); with TopCdf skipping blocks, a padded prompt's real tokens get the
    logits of the same tokens run alone; a batch padded throughout (padding="max_length") and a chunk against a
    cache run sparse too."""
    ids = prompt(300, batch=3, seed=4)
    mask = right_padded(ids, (300, 230, 1))
    keep_all = register("sparge_test_right_keep", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                        min_padded_tokens=0)
    skipping = register("sparge_test_right_skip", simthreshd1=-1.0, cdfthreshd=0.5, collect_stats=True,
                        min_padded_tokens=0)
    dense = logits(load(tiny_llama, "sdpa"), ids, attention_mask=mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        ours = logits(load(tiny_llama, "sparge_test_right_keep"), ids, attention_mask=mask)
        sparse = logits(load(tiny_llama, "sparge_test_right_skip"), ids, attention_mask=mask)
    assert keep_all.sparse_calls == 2 and skipping.sparse_calls == 2
    assert relative_l1(ours, dense) < 1e-5
    alone = logits(load(tiny_llama, "sparge_test_right_skip"), ids[1:2, :230])
    assert relative_l1(sparse[1, :230], alone[0]) < 1e-5
    assert relative_l1(sparse[1, :230], dense[1, :230]) > 1e-3, "the settings must skip blocks"
    assert skipping.stats[0].qk_skipped.shape == (4,) and 0 < skipping.stats[0].sparsity < 1
    assert torch.isfinite(sparse).all()
    everywhere = right_padded(ids, (290, 230, 1))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        got = logits(load(tiny_llama, "sparge_test_right_keep"), ids, attention_mask=everywhere)
    assert keep_all.sparse_calls == 4
    assert relative_l1(got, logits(load(tiny_llama, "sdpa"), ids, attention_mask=everywhere)) < 1e-5
    # a chunk against a cache: the second prompt's padding starts inside the chunk
    import copy

    sdpa = load(tiny_llama, "sdpa")
    mask = right_padded(ids[:2], (300, 230))
    cache = dynamic_cache(sdpa)
    logits(sdpa, ids[:2, :200], attention_mask=mask[:, :200], **{CACHE: cache}, use_cache=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        got = logits(load(tiny_llama, "sparge_test_right_keep"), ids[:2, 200:], attention_mask=mask,
                     **{CACHE: copy.deepcopy(cache)}, use_cache=True)
    assert keep_all.sparse_calls == 6
    assert relative_l1(got, logits(sdpa, ids[:2, 200:], attention_mask=mask, **{CACHE: cache}, use_cache=True)) < 1e-5


def test_right_padded_batch_against_a_static_cache_runs_sparse_and_gives_sdpa_tokens(tiny_llama):
    """A right-padded batch generated with a static cache (``cache_implementation="static"``, whole and chunked)
    runs each prompt sparse on its own keys (the slots past the last query's position never read) with no warning,
    and gives SDPA's tokens; a right-padded chunk continued on a StaticCache gives SDPA's logits at every position,
    and with TopCdf skipping blocks a padded prompt's real tokens get those of the same chunk without the padding."""
    ids = prompt(300, batch=3, seed=5)
    mask = right_padded(ids, (300, 230, 1))
    attention = register("sparge_test_static_right", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                         min_padded_tokens=0, strict=True)
    lengths = recording_key_lengths(attention)
    for chunk in (None, 128):
        options = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static",
                       pad_token_id=0, **({} if chunk is None else {"prefill_chunk_size": chunk}))
        calls = attention.sparse_calls
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*right-padding was detected")  # transformers' own
            ours = load(tiny_llama, "sparge_test_static_right").generate(ids, **options)
            dense = load(tiny_llama, "sdpa").generate(ids, **options)
        assert torch.equal(ours, dense), chunk
        assert attention.sparse_calls - calls == (2 if chunk is None else 6), chunk  # each prefill chunk, 2 layers
    assert max(lengths) <= 300, "a static cache's empty slots must not be attended"

    results = {}
    for name in ("sdpa", "sparge_test_static_right_keep", "sparge_test_static_right_skip"):
        if name != "sdpa":
            register(name, simthreshd1=-1.0, cdfthreshd=1.0 if name.endswith("keep") else 0.5,
                     pvthreshd=None if name.endswith("keep") else 50, min_padded_tokens=0, strict=True)
        model = load(tiny_llama, name)
        cache = static_cache(model, 512, batch=2)
        batch_mask = right_padded(ids[:2], (300, 260))
        logits(model, ids[:2, :200], attention_mask=batch_mask[:, :200], **{CACHE: cache}, use_cache=True,
               cache_position=torch.arange(200))
        results[name] = logits(model, ids[:2, 200:], attention_mask=batch_mask, **{CACHE: cache}, use_cache=True,
                               cache_position=torch.arange(200, 300))
    assert relative_l1(results["sparge_test_static_right_keep"], results["sdpa"]) < 1e-5
    skip = results["sparge_test_static_right_skip"]
    assert relative_l1(skip[1, :60], results["sdpa"][1, :60]) > 1e-3, "the settings must skip blocks"
    model = load(tiny_llama, "sparge_test_static_right_skip")  # the padded prompt alone, unpadded, on its cache
    cache = static_cache(model, 512)
    logits(model, ids[1:2, :200], **{CACHE: cache}, use_cache=True, cache_position=torch.arange(200))
    alone = logits(model, ids[1:2, 200:260], **{CACHE: cache}, use_cache=True, cache_position=torch.arange(200, 260))
    assert relative_l1(skip[1, :60], alone[0]) < 1e-5


def test_short_right_padded_batches_and_other_masks_fall_back_to_sdpa_and_strict_raises(tiny_llama):
    """Below min_padded_tokens a right-padded batch runs SDPA under the mask with a warning naming the setting; a
    mask that is neither padding nor causal runs SDPA with a warning, and strict=True raises."""
    ids = prompt(150, batch=2)
    mask = right_padded(ids, (150, 130))
    dense = logits(load(tiny_llama, "sdpa"), ids, attention_mask=mask)
    short = register("sparge_test_right_short")
    with pytest.warns(UserWarning, match="right-padded batch of fewer than min_padded_tokens=4096"):
        assert torch.equal(logits(load(tiny_llama, "sparge_test_right_short"), ids, attention_mask=mask), dense)
    assert short.sparse_calls == 0
    register("sparge_test_padding", min_padded_tokens=0)
    custom = right_padded_mask_4d([150, 130], 150)
    custom[0, 0, 100:, 3] = False  # a hole that is no padding
    with pytest.warns(UserWarning, match="explicit attention mask"):
        ours = logits(load(tiny_llama, "sparge_test_padding"), ids, attention_mask=custom)
    assert torch.equal(ours, logits(load(tiny_llama, "sdpa"), ids, attention_mask=custom))
    register("sparge_test_strict", strict=True, min_padded_tokens=0)
    with pytest.raises(ValueError, match="strict=True"):
        logits(load(tiny_llama, "sparge_test_strict"), ids, attention_mask=custom)


ARCHITECTURES = ("qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma", "gemma3_text", "phi", "phi3", "olmo2",
                 "granite", "cohere", "starcoder2", "gpt_neox", "gpt2", "opt", "gptj")


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_other_architectures_run_sparse_and_give_sdpa_logits(model_type, tmp_path):
    """Decoder-only families other than Llama (their own rotary, norms on q/k, MoE, absolute positions, parallel
    blocks, no GQA), tiny and random, through from_pretrained: keeping every block, each layer's prefill runs sparse
    and the logits are SDPA's."""
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    if TRANSFORMERS_4 and model_type in ("gpt2", "opt"):
        # 4.x: OPT passes its own additive mask and GPT-2 (4.53) is_causal=False with a mask (both go to SDPA, with a
        # warning)
        pytest.skip(f"{model_type} on transformers {transformers.__version__} does not run sparse")
    if model_type == "gptj" and hasattr(transformers.models.gptj.modeling_gptj, "GPTJ_ATTENTION_CLASSES"):
        # GPT-J's attention classes by name (4.x, and 5.x through 5.18 at least) take no registered function:
        # loading raises KeyError in transformers
        pytest.skip(f"GPT-J's attention on transformers {transformers.__version__} takes no registered function")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    attention = register(f"sparge_test_{model_type}", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True)
    ids = prompt(300)
    got = logits(load(tmp_path, f"sparge_test_{model_type}"), ids)
    assert attention.sparse_calls == 2
    assert relative_l1(got, logits(load(tmp_path, "sdpa"), ids)) < 1e-5


def mistral_with_window(tmp_path, window):
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                        max_position_embeddings=2048, sliding_window=window)
    path = tmp_path / str(window)
    transformers.MistralForCausalLM(config).save_pretrained(path)
    return path


def test_a_sliding_window_runs_sparse_whether_or_not_it_hides_keys(tmp_path):
    """Mistral passes its sliding window to every layer. Whole prompts (300 tokens under windows of 4096, 128 and 100
    keys), chunks on a cache (128 tokens after 256 under 384, 383 and 100) and a left-padded batch (windows of 100)
    run sparse with SDPA's logits: where the window hides keys, the kernels take it (transformers' sliding mask is read
    for its keys and padding). Methods that take no window (S2O, PBS's permuted keys) go to SDPA where it hides keys,
    with a warning naming the window; strict raises."""
    ids = prompt(300)
    paths = {window: mistral_with_window(tmp_path, window) for window in (4096, 384, 383, 128, 100)}

    def chunk_logits(path, implementation):
        model = load(path, implementation)
        cache = dynamic_cache(model)
        logits(model, ids[:, :256], **{CACHE: cache}, use_cache=True)
        return logits(model, prompt(128, seed=7), **{CACHE: cache}, use_cache=True)

    attention = register("sparge_test_window", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_padded_tokens=0)
    for window in (4096, 128, 100):
        whole = logits(load(paths[window], "sparge_test_window"), ids)
        assert relative_l1(whole, logits(load(paths[window], "sdpa"), ids)) < 1e-5, window
    assert attention.sparse_calls == 6
    for window in (384, 383, 100):
        got = chunk_logits(paths[window], "sparge_test_window")
        assert relative_l1(got, chunk_logits(paths[window], "sdpa")) < 1e-5, window
    assert attention.sparse_calls == 18, "the cache's prefill and the chunk, 2 layers each"
    batch = prompt(300, batch=2)
    mask, positions = left_padded(batch, (0, 130))
    real = mask.bool()
    got = logits(load(paths[100], "sparge_test_window"), batch, attention_mask=mask, position_ids=positions)
    expected = logits(load(paths[100], "sdpa"), batch, attention_mask=mask, position_ids=positions)
    assert relative_l1(got[real], expected[real]) < 1e-5
    assert attention.sparse_calls == 20
    for name, settings, what in (("s2o", dict(method="s2o"), "'s2o'"),
                                 ("pbs", dict(pbs_segment=128), r"'sparge' \(with pbs_segment\)")):
        register(f"sparge_test_window_{name}", strict=True, **settings)
        with pytest.raises(ValueError, match=rf"sliding window \(128 keys\) shorter than the keys this call sees "
                                             rf"\(300\), which the {what} method does not take"):
            logits(load(paths[128], f"sparge_test_window_{name}"), ids)
    falling_back = register("sparge_test_window_fallback", method="s2o", tau=0.0)
    with pytest.warns(UserWarning, match="falling back to SDPA: a sliding window"):
        got = logits(load(paths[128], "sparge_test_window_fallback"), ids)
    assert torch.equal(got, logits(load(paths[128], "sdpa"), ids)) and falling_back.sparse_calls == 0


def test_a_sliding_window_skips_blocks_outside_it_and_compiles(tmp_path):
    """With TopCdf skipping, a 100-key window's layers report sparsity against the blocks the window leaves; the
    model compiled (aot_eager, fullgraph) gives the eager logits, the mask read inside the operator with the window.
    By default a window under min_predicted_window keys keeps every block in it, whatever cdfthreshd says."""
    path = mistral_with_window(tmp_path, 100)
    ids = prompt(600)
    default = register("sparge_test_window_default", simthreshd1=-1.0, cdfthreshd=0.9, collect_stats=True)
    kept = logits(load(path, "sparge_test_window_default"), ids)
    assert default.sparse_calls == 2 and all(s.sparsity == 0 for s in default.stats)
    assert relative_l1(kept, logits(load(path, "sdpa"), ids)) < 1e-5
    # a window of exactly min_predicted_window keys is predicted ("shorter than this many keys" keep every block)
    at_limit = register("sparge_test_window_at_limit", simthreshd1=-1.0, cdfthreshd=0.9, collect_stats=True,
                        min_predicted_window=100)
    logits(load(path, "sparge_test_window_at_limit"), ids)
    assert at_limit.sparse_calls == 2 and all(s.sparsity > 0 for s in at_limit.stats)
    attention = register("sparge_test_window_stats", simthreshd1=-1.0, cdfthreshd=0.9, collect_stats=True,
                         min_predicted_window=0)
    model = load(path, "sparge_test_window_stats")
    eager = logits(model, ids)
    assert attention.sparse_calls == 2
    stats = attention.stats[0]
    # 600 tokens: query block 0 sees key blocks 0-1, each later one 4 blocks of 64 (e.g. rows 256-383: keys 157-383)
    assert stats.dense_blocks == 2 + 4 * 4
    assert 0 < stats.sparsity < 1 and torch.isfinite(eager).all()
    compiled = aot_compiled(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        assert torch.equal(logits(compiled, ids), eager)


def test_local_and_global_layers_both_run_sparse(tmp_path):
    """Gemma 3 alternates local (sliding-window) and global layers: both run sparse, on a prompt shorter than the
    window and on a longer one (the local layer then under its window), with SDPA's logits."""
    if "gemma3_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 3")
    for window in (512, 128):
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(
            "gemma3_text", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
            sliding_window=window, layer_types=["sliding_attention", "full_attention"])
        path = tmp_path / str(window)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        attention = register(f"sparge_test_gemma3_{window}", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                             strict=True)
        got = logits(load(path, f"sparge_test_gemma3_{window}"), prompt(300))
        assert relative_l1(got, logits(load(path, "sdpa"), prompt(300))) < 1e-5
        assert attention.sparse_calls == 2, window


def tiny_gemma3(path, *, head_dim: int, sliding_window: int, layer_types: list[str]) -> None:
    """A tiny Gemma 3 with these head dim, window and layers saved at ``path`` (skips where transformers has none)."""
    if "gemma3_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 3")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "gemma3_text", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=head_dim,
        max_position_embeddings=2048, sliding_window=sliding_window, layer_types=layer_types)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def test_alternating_layers_read_each_of_their_masks_once_per_forward(tmp_path, monkeypatch):
    """A left-padded batch through Gemma 3's alternating local and global layers (4 layers): transformers hands the
    local layers one mask and the global layers another; each is read once per forward (the function keeps the last
    two verdicts), and the logits are SDPA's at the real positions."""
    import sparge_diffusers.llm as llm

    tiny_gemma3(tmp_path, head_dim=64, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2)
    attention = register("sparge_test_gemma3_reads", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_padded_tokens=0)
    reads = []
    read = llm.read_causal_mask

    def counted(*args, **kwargs):
        reads.append(kwargs.get("sliding_window"))
        return read(*args, **kwargs)

    monkeypatch.setattr(llm, "read_causal_mask", counted)
    batch = prompt(300, batch=2)
    mask, positions = left_padded(batch, (0, 90))
    got = logits(load(tmp_path, "sparge_test_gemma3_reads"), batch, attention_mask=mask, position_ids=positions)
    assert sorted(reads, key=str) == [128, None] and attention.sparse_calls == 4
    expected = logits(load(tmp_path, "sdpa"), batch, attention_mask=mask, position_ids=positions)
    assert relative_l1(got[mask.bool()], expected[mask.bool()]) < 1e-5


def llama4_with_chunks(path, chunk=64):
    """A 4-layer Llama 4 text model (three chunked-attention layers of ``chunk`` positions, then a global NoPE layer;
    two experts), saved at ``path``; skips where transformers has no Llama 4."""
    if "llama4_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=128, hidden_size=256, intermediate_size=512, intermediate_size_mlp=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=2,
        attention_chunk_size=chunk, max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def sizes_per_call(attention, monkeypatch):
    """The (batch, query, key) counts of ``attention``'s sparse calls, in order (a list filled as they run)."""
    seen, prefill = [], attention._prefill
    monkeypatch.setattr(attention, "_prefill", lambda q, k, *a, **kw: seen.append((q.shape[0], q.shape[2], k.shape[2]))
                        or prefill(q, k, *a, **kw))
    return seen


def test_chunked_attention_layers_run_each_chunk_sparse(tmp_path, monkeypatch):
    """Llama 4's chunked-attention layers (chunks of 64) get transformers' chunked mask: each chunk of queries runs
    as its own causal call on its chunk's keys, and keeping every block gives SDPA's logits, for a whole prompt, a
    left-padded batch (chunks counted from each prompt's first real token), a chunk continued on the cache (whose
    chunked layers keep a sliding cache) and generate's tokens. With TopCdf skipping, a chunk's rows are those of
    the same tokens run alone."""
    path = llama4_with_chunks(tmp_path)
    attention = register("sparge_test_chunked", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_segment_queries=0, min_padded_tokens=0)
    seen = sizes_per_call(attention, monkeypatch)
    ids = prompt(300, batch=2)
    got = logits(load(path, "sparge_test_chunked"), ids)
    assert relative_l1(got, logits(load(path, "sdpa"), ids)) < 1e-5
    assert seen == ([(2, 64, 64)] * 4 + [(2, 44, 44)]) * 3 + [(2, 300, 300)], "one call per chunk, on its keys"
    seen.clear()
    got = logits(load(path, "sparge_test_chunked"), ids[:1])
    assert relative_l1(got, logits(load(path, "sdpa"), ids[:1])) < 1e-5
    assert seen == [(4, 64, 64), (1, 44, 44)] * 3 + [(1, 300, 300)], "one prompt: its full chunks as one batch"
    mask, positions = left_padded(ids, (0, 70))
    seen.clear()
    got = logits(load(path, "sparge_test_chunked"), ids, attention_mask=mask, position_ids=positions)
    expected = logits(load(path, "sdpa"), ids, attention_mask=mask, position_ids=positions)
    assert relative_l1(got[mask.bool()], expected[mask.bool()]) < 1e-5
    # rows with other padding run apart, each its full chunks as one batch (the second row's too: it was run chunk
    # by chunk without a test noticing)
    assert seen == [(4, 64, 64), (1, 44, 44), (3, 64, 64), (1, 38, 38)] * 3 + [(1, 300, 300), (1, 230, 230)]

    def continued(implementation):
        model = load(path, implementation)
        cache = dynamic_cache(model)
        logits(model, ids[:, :200], **{CACHE: cache}, use_cache=True)
        return logits(model, ids[:, 200:], **{CACHE: cache}, use_cache=True)

    seen.clear()
    assert relative_l1(continued("sparge_test_chunked"), continued("sdpa")) < 1e-5
    assert seen[-3:] == [(2, 56, 64), (2, 44, 44), (2, 100, 300)], "first the chunk the cache began, then the next"

    def continued_at_a_chunk(implementation):  # one prompt, a cache of two whole chunks, then 200 tokens
        model = load(path, implementation)
        cache = dynamic_cache(model)
        logits(model, ids[:1, :128], **{CACHE: cache}, use_cache=True)
        return logits(model, ids[:1, 128:], **{CACHE: cache}, use_cache=True)

    seen.clear()
    assert relative_l1(continued_at_a_chunk("sparge_test_chunked"), continued_at_a_chunk("sdpa")) < 1e-5
    # the prefix: two chunks as one batch per chunked layer; then the chunks after the cache, whose keys sit past it
    # (offset > 0), again stacked (a mutant that matched first keys at first - offset ran them one by one)
    assert seen == [(2, 64, 64)] * 3 + [(1, 128, 128)] + [(2, 64, 64), (1, 44, 44)] * 3 + [(1, 172, 300)]
    generated = load(path, "sparge_test_chunked").generate(ids, attention_mask=torch.ones_like(ids),
                                                           max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, load(path, "sdpa").generate(ids, attention_mask=torch.ones_like(ids),
                                                               max_new_tokens=6, do_sample=False))
    wide = llama4_with_chunks(tmp_path / "wide", chunk=256)  # chunks of several blocks, for TopCdf to skip some
    skipping = register("sparge_test_chunked_skip", simthreshd1=-1.0, cdfthreshd=0.5, strict=True,
                        min_segment_queries=0)
    ids = prompt(512, seed=3)
    sparse = logits(load(wide, "sparge_test_chunked_skip"), ids)
    alone = logits(load(wide, "sparge_test_chunked_skip"), ids[:, :256])  # the first chunk, no later token in it
    assert relative_l1(sparse[:, :256], alone) < 1e-5
    assert relative_l1(sparse, logits(load(wide, "sdpa"), ids)) > 1e-3, "the settings must skip blocks"
    assert skipping.sparse_calls == 8  # one per layer and forward, however many chunks


def test_right_padded_chunked_attention_runs_sparse_and_gives_sdpa_logits_everywhere(tmp_path, monkeypatch):
    """Llama 4's chunked layers on a right-padded batch (prompts of 300, 230 and 100 tokens; chunks of 64):
    transformers' mask restarts causal attention at each chunk and hides each prompt's keys from its end on, so a
    padding query sees its chunk's real keys, or none in a chunk after the prompt's. Each prompt's real chunks run
    sparse as their own calls and its padding queries by exact attention (before session 60 such layers went to
    SDPA under the mask): keeping every block gives SDPA's logits at every position, padding included, and
    ``generate`` SDPA's tokens; with TopCdf skipping, a padded prompt's real tokens get the logits of the same
    tokens run alone."""
    path = llama4_with_chunks(tmp_path)
    attention = register("sparge_test_chunked_right", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_segment_queries=0, min_padded_tokens=0)
    seen = sizes_per_call(attention, monkeypatch)
    ids = prompt(300, batch=3, seed=6)
    mask = right_padded(ids, (300, 230, 100))
    got = logits(load(path, "sparge_test_chunked_right"), ids, attention_mask=mask)
    assert relative_l1(got, logits(load(path, "sdpa"), ids, attention_mask=mask)) < 1e-5
    # per chunked layer: the full prompt's 4 chunks of 64 and its last of 44, then the 230-token prompt's 3 and its
    # 38, the 100-token prompt's first and its 36; the global layer one call per prompt
    layer = [(4, 64, 64), (1, 44, 44), (3, 64, 64), (1, 38, 38), (1, 64, 64), (1, 36, 36)]
    assert seen == layer * 3 + [(1, 300, 300), (1, 230, 230), (1, 100, 100)]
    options = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*right-padding was detected")  # transformers' own
        generated = load(path, "sparge_test_chunked_right").generate(ids, **options)
        assert torch.equal(generated, load(path, "sdpa").generate(ids, **options))
    wide = llama4_with_chunks(tmp_path / "wide", chunk=256)  # chunks of several blocks, for TopCdf to skip some
    register("sparge_test_chunked_right_skip", simthreshd1=-1.0, cdfthreshd=0.5, strict=True, min_segment_queries=0,
             min_padded_tokens=0)
    ids = prompt(600, batch=2, seed=7)
    mask = right_padded(ids, (600, 500))
    sparse = logits(load(wide, "sparge_test_chunked_right_skip"), ids, attention_mask=mask)
    alone = logits(load(wide, "sparge_test_chunked_right_skip"), ids[1:2, :500])
    assert relative_l1(sparse[1, :500], alone[0]) < 1e-5
    assert relative_l1(sparse[1, :500], logits(load(wide, "sdpa"), ids, attention_mask=mask)[1, :500]) > 1e-3, \
        "the settings must skip blocks"


def test_padded_segments_are_held_to_the_setting_of_their_side():
    """A left-padded mask of chunks (chunks of 64 counted from each prompt's first real token) runs per segment under
    min_segment_queries alone, however few its keys; the same chunks right-padded also need min_padded_tokens (their
    padding rows cost calls of their own)."""
    n, chunk = 300, 64
    keys, positions = torch.arange(n)[None, :], torch.arange(n)[:, None]
    rows = []
    for padding, end in ((0, n), (40, n)):
        rows.append((keys <= positions) & ((keys - padding) // chunk == (positions - padding) // chunk)
                    & (keys >= padding) & (keys < end))
    left = torch.stack(rows)[:, None]
    right = (keys <= positions) & (keys // chunk == positions // chunk) & (keys < torch.tensor([n, 230])[:, None, None])
    attention = SpargeLLMAttention(min_segment_queries=0)  # min_padded_tokens at its default, 4096
    reason, _, layout = attention._mask_route(left, n, n)
    assert reason is None and layout.segments is not None and layout.padding == [0, 40]
    reason, _, layout = attention._mask_route(right[:, None], n, n)
    assert layout is None and "right-padded batch of fewer than min_padded_tokens=4096" in reason
    assert SpargeLLMAttention(min_segment_queries=0, min_padded_tokens=0)._mask_route(right[:, None], n, n)[0] is None


def test_short_segments_go_to_sdpa_unless_asked(tmp_path):
    """Chunks that average fewer queries than min_segment_queries (one call each would cost more than SDPA under
    the mask) go to SDPA with a warning naming the option; strict raises; the global layer still runs sparse."""
    path = llama4_with_chunks(tmp_path)
    attention = register("sparge_test_short_chunks", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    ids = prompt(300)
    with pytest.warns(UserWarning, match=r"falling back to SDPA: a mask of causal segments \(chunked attention or "
                                         r"packed sequences\) averaging fewer than min_segment_queries=1024"):
        got = logits(load(path, "sparge_test_short_chunks"), ids)
    assert relative_l1(got, logits(load(path, "sdpa"), ids)) < 1e-5 and attention.sparse_calls == 1
    register("sparge_test_short_chunks_strict", strict=True)
    with pytest.raises(ValueError, match="min_segment_queries=1024 queries per call \\(2 calls"):  # 4 chunks in one
        logits(load(path, "sparge_test_short_chunks_strict"), ids)


def skip_without_packed_masks():
    """Skip where transformers does not mask sequences packed in one row apart (before 4.54): they attend across each
    other there, under SDPA too."""
    import transformers.masking_utils as masking

    if not hasattr(masking, "find_packed_sequence_indices"):
        pytest.skip(f"transformers {transformers.__version__} does not mask packed sequences apart")


def packed_positions(lengths):
    """Position ids of sequences of ``lengths`` packed in one row: restarting at each."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def assert_each_sequence_as_if_alone(model, ids, lengths):
    """The packed row's logits through ``model``, after checking that each sequence's equal those of its tokens run
    alone."""
    packed = logits(model, ids, position_ids=packed_positions(lengths), use_cache=False)
    start = 0
    for n in lengths:
        alone = logits(model, ids[:, start:start + n], use_cache=False)
        assert relative_l1(packed[:, start:start + n], alone) < 1e-5, (start, n)
        start += n
    return packed


def test_packed_sequences_run_each_sequence_as_if_alone(tiny_llama):
    """Sequences packed in one row (position ids restarting, no cache: transformers then masks each sequence
    causally on its own keys) run one call each: with TopCdf skipping, each sequence's logits are those of the same
    tokens run alone; keeping every block gives SDPA's."""
    skip_without_packed_masks()
    lengths = (400, 260, 220)
    ids = prompt(sum(lengths))
    positions = packed_positions(lengths)
    keep_all = register("sparge_test_packed_keep", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                        min_segment_queries=0)
    register("sparge_test_packed_skip", simthreshd1=-1.0, cdfthreshd=0.5, strict=True, min_segment_queries=0)
    got = logits(load(tiny_llama, "sparge_test_packed_keep"), ids, position_ids=positions, use_cache=False)
    assert relative_l1(got, logits(load(tiny_llama, "sdpa"), ids, position_ids=positions, use_cache=False)) < 1e-5
    assert keep_all.sparse_calls == 2
    sparse = assert_each_sequence_as_if_alone(load(tiny_llama, "sparge_test_packed_skip"), ids, lengths)
    assert relative_l1(sparse, got) > 1e-3, "the settings must skip blocks"
    # the same sequences described only by flash-attention's cumulative lengths, with a cache (transformers then
    # builds no mask): the same logits
    cumulative = torch.tensor([0, 400, 660, 880], dtype=torch.int32)
    varlen = logits(load(tiny_llama, "sparge_test_packed_keep"), ids, position_ids=positions,
                    cu_seq_lens_q=cumulative, cu_seq_lens_k=cumulative, max_length_q=400, max_length_k=400)
    assert relative_l1(varlen, got) < 1e-5


def test_packed_sequences_under_a_sliding_window_run_each_sequence_under_it(tmp_path):
    """Mistral with a 64-key window and three sequences packed in one row (position ids restarting): transformers'
    sliding mask holds both the packing and the window; each sequence runs as its own call under the window, SDPA's
    logits with every block kept (before session 55 the call went to SDPA under the mask), and with TopCdf skipping
    each sequence's logits are those of its tokens alone."""
    skip_without_packed_masks()
    path = mistral_with_window(tmp_path, 64)
    lengths = (300, 40, 200)
    ids = prompt(sum(lengths), seed=6)
    positions = packed_positions(lengths)
    keep_all = register("sparge_test_packed_window", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                        min_segment_queries=0)
    got = logits(load(path, "sparge_test_packed_window"), ids, position_ids=positions, use_cache=False)
    assert keep_all.sparse_calls == 2
    assert relative_l1(got, logits(load(path, "sdpa"), ids, position_ids=positions, use_cache=False)) < 1e-5
    register("sparge_test_packed_window_skip", simthreshd1=-1.0, cdfthreshd=0.5, strict=True, min_segment_queries=0,
             min_predicted_window=0)
    sparse = assert_each_sequence_as_if_alone(load(path, "sparge_test_packed_window_skip"), ids, lengths)
    assert relative_l1(sparse, got) > 1e-3, "the settings must skip blocks"


def test_compiled_chunked_attention_reads_its_mask_at_run_time(tmp_path):
    """Llama 4 compiled (aot_eager, fullgraph): the chunked layers' mask reaches the masked-prefill operator, which
    runs each chunk sparse; logits equal eager's."""
    path = llama4_with_chunks(tmp_path)
    attention = register("sparge_test_chunked_compiled", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None,
                         strict=True, min_segment_queries=0)
    model = load(path, "sparge_test_chunked_compiled")
    ids = prompt(300)
    eager = logits(model, ids)
    compiled = aot_compiled(model)
    assert torch.equal(logits(compiled, ids), eager)
    assert attention.sparse_calls == 4  # eager's; compiled calls are counted only with collect_stats


def test_a_training_step_falls_back_to_sdpa_with_its_gradients(tiny_llama):
    """Under autograd (a fine-tuning step) the prefill goes to SDPA with one warning, since the kernels have no
    backward pass: the loss and the weights' gradients equal SDPA's; under no_grad the same model runs sparse."""
    attention = register("sparge_test_training", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    ids = prompt(200)

    def loss_and_grads(model):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    dense_loss, dense_grads = loss_and_grads(load(tiny_llama, "sdpa"))
    model = load(tiny_llama, "sparge_test_training")
    with pytest.warns(UserWarning, match="requires grad.*no backward pass"):
        loss, grads = loss_and_grads(model)
    assert attention.sparse_calls == 0
    assert torch.equal(loss, dense_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, dense_grads))
    logits(model, ids)
    assert attention.sparse_calls == 2, "both layers run sparse under no_grad"


@pytest.mark.parametrize("method, keep_all, skipping", [
    ("s2o", dict(tau=0.0, simthreshd1=-1.0), dict(tau=0.2, simthreshd1=-1.0, s2o_segment=128)),
    ("fsa", dict(top_k=8), dict(top_k=2)),
])
def test_s2o_and_fsa_methods_run_the_prefill(tiny_llama, method, keep_all, skipping):
    """method="s2o" / "fsa" through from_pretrained: visiting every block (tau 0; top_k at least the 5 blocks of 300
    tokens) gives SDPA's logits; skipping changes them (the method ran, not SDPA); the left-padded batch runs each
    prompt by the method too (its logits those of the prompt alone); both report their sparsity."""
    ids = prompt(300)
    dense = logits(load(tiny_llama, "sdpa"), ids)
    full = register(f"sparge_test_{method}_all", method=method, **keep_all)
    assert relative_l1(logits(load(tiny_llama, f"sparge_test_{method}_all"), ids), dense) < 1e-5
    assert full.sparse_calls == 2
    skip = register(f"sparge_test_{method}_skip", method=method, collect_stats=True, min_padded_tokens=0, **skipping)
    model = load(tiny_llama, f"sparge_test_{method}_skip")
    if method == "s2o":  # S2O tests its stop every 16 ranked tiles: a query block needs more than 16 to skip any
        ids = prompt(1500)
        dense = logits(load(tiny_llama, "sdpa"), ids)
    sparse = logits(model, ids)
    assert len(skip.stats) == 2 and all(s.sparsity > 0 for s in skip.stats)
    if method == "fsa":  # 2 blocks of 64 keys per query of 300: (query, key) pairs, as selection_sparsity counts
        assert all(s.dense_blocks == 300 * 301 // 2 for s in skip.stats)
    assert skip.sparse_calls == 2 and relative_l1(sparse, dense) > 1e-3
    batch = torch.cat([prompt(ids.shape[1], seed=4), ids])
    mask, positions = left_padded(batch, (0, 40))
    padded = logits(model, batch, attention_mask=mask, position_ids=positions)
    assert relative_l1(padded[1, 40:], logits(model, ids[:, 40:])[0]) < 1e-5


def test_chunks_against_a_cache_run_each_method(tiny_llama):
    """A chunk against a cache (fewer queries than keys): each method runs its lower-right variant, no warning.
    "s2o" visiting every block and "fsa" keeping every block give SDPA's logits; "fsa" with top_k=2: its stats over
    the chunk's (query, key) pairs and logits that differ (S2O's skipping: the next test). pbs_segment permutes the
    cache's keys too: keeping every block SDPA's logits, skipping other blocks than keys in order."""
    import copy

    ids = prompt(400)
    sdpa = load(tiny_llama, "sdpa")
    prefix = dynamic_cache(sdpa)  # one cache for all, so that only the chunk differs
    logits(sdpa, ids[:, :250], **{CACHE: prefix}, use_cache=True)
    dense = logits(sdpa, ids[:, 250:], **{CACHE: copy.deepcopy(prefix)}, use_cache=True)
    results, functions = {}, {}
    for name, settings in (("sparge", {}), ("s2o", dict(method="s2o", tau=0.0)), ("fsa", dict(method="fsa", top_k=7)),
                           ("fsa_skip", dict(method="fsa", top_k=2, collect_stats=True)),
                           ("pbs", dict(pbs_segment=128)), ("pbs_keep", dict(pbs_segment=128, cdfthreshd=1.0,
                                                                             pvthreshd=None))):
        attention = functions[name] = register(f"sparge_test_chunk_{name}", **{**dict(simthreshd1=-1.0,
                                                                                      cdfthreshd=0.5), **settings})
        model = load(tiny_llama, f"sparge_test_chunk_{name}")
        cache = copy.deepcopy(prefix)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="SpargeLLMAttention")
            results[name] = logits(model, ids[:, 250:], **{CACHE: cache}, use_cache=True)
        assert attention.sparse_calls == 2
    assert relative_l1(results["sparge"], dense) > 1e-3
    assert relative_l1(results["s2o"], dense) < 1e-5
    assert relative_l1(results["fsa"], dense) < 1e-5  # 7 blocks of 64: all 400 keys
    assert relative_l1(results["fsa_skip"], dense) > 1e-3
    assert relative_l1(results["pbs_keep"], dense) < 1e-5  # the cache's keys permuted, causality kept
    assert relative_l1(results["pbs"], dense) > 1e-3 and not torch.equal(results["pbs"], results["sparge"])
    stats = functions["fsa_skip"].stats  # the chunk's rows see 251..400 keys
    assert len(stats) == 2 and all(s.dense_blocks == sum(range(251, 401)) and s.sparsity > 0 for s in stats)


def test_s2o_chunk_against_a_cache_stops_early(tiny_llama):
    """S2O on a chunk of 200 queries after 1300 cached tokens (lower right): its stop test runs every 16 ranked
    tiles, which the 24 key blocks allow; the stops change the logits, and the stats count the chunk's visible
    blocks (2 query blocks: 23 and 24 of 64 keys)."""
    import copy

    ids = prompt(1500)
    sdpa = load(tiny_llama, "sdpa")
    prefix = dynamic_cache(sdpa)
    logits(sdpa, ids[:, :1300], **{CACHE: prefix}, use_cache=True)
    dense = logits(sdpa, ids[:, 1300:], **{CACHE: copy.deepcopy(prefix)}, use_cache=True)
    attention = register("sparge_test_chunk_s2o_stop", method="s2o", tau=0.2, s2o_segment=128, simthreshd1=-1.0,
                         collect_stats=True)
    got = logits(load(tiny_llama, "sparge_test_chunk_s2o_stop"), ids[:, 1300:], **{CACHE: copy.deepcopy(prefix)},
                 use_cache=True)
    assert attention.sparse_calls == 2 and relative_l1(got, dense) > 1e-3
    assert len(attention.stats) == 2 and all(s.dense_blocks == 23 + 24 and s.sparsity > 0 for s in attention.stats)


def test_defaults_are_the_kernels_and_the_readmes():
    """The thresholds default to the kernels' own, as the docstring says; attention_sink is on (an LLM's sink token);
    the cost thresholds are the README's (4096 padded keys, 4096-key windows, 1024 queries per segment); FSA keeps
    NSA's 16 blocks of 64 keys, the README's example."""
    from sparge_diffusers import s2o_attention, select_key_blocks, sparge_attention

    def defaults(function):
        return {name: p.default for name, p in inspect.signature(function).parameters.items()}

    attention, sparge, s2o = SpargeLLMAttention(), defaults(sparge_attention), defaults(s2o_attention)
    assert [getattr(attention, name) for name in ("simthreshd1", "cdfthreshd", "pvthreshd")] == \
        [sparge["simthreshd1"], sparge["cdfthreshd"], sparge["pvthreshd"]] == [0.6, 0.98, 50]
    assert (attention.tau, attention.s2o_segment) == (s2o["tau"], s2o["segment"]) == (0.0005, 2048)
    # s2o_attention's own, as its docstring gives them: stage 2 off; neither kernel forces the sink block by default
    assert (s2o["simthreshd1"], s2o["pvthreshd"], s2o["attention_sink"]) == (0.6, None, False)
    assert sparge["attention_sink"] is False
    assert attention.block_size == defaults(select_key_blocks)["block_size"] == 64 and attention.top_k == 16
    assert attention.attention_sink is True and attention.pbs_segment is None and attention.method == "sparge"
    assert (attention.min_padded_tokens, attention.min_predicted_window, attention.min_segment_queries) == \
        (4096, 4096, 1024)
    assert attention.strict is False and attention.collect_stats is False and attention.sparse_calls == 0
    # PBS-Attn's wrappers: its 256-position segments, and the operator's thresholds those of sparge_attention
    from sparge_diffusers.llm import pbs_sparge_attention, pbs_sparge_attention_op

    pbs, pbs_op = defaults(pbs_sparge_attention), defaults(pbs_sparge_attention_op)
    assert pbs["segment"] == pbs_op["segment"] == 256
    assert all(pbs_op[name] == sparge[name] for name in ("simthreshd1", "cdfthreshd", "pvthreshd", "attention_sink"))


def test_options_take_their_ends_and_tau_what_s2o_attention_takes():
    """tau is checked with the other options, and every value s2o_attention takes is taken: None (no early stop), 0,
    inf, one per head and a tensor (left to the call's own check). The other options take the ends of their ranges
    (block sizes 32 and 128, the smallest segments, counts of 0)."""
    for tau in (None, 0, 0.0, 5e-4, float("inf"), [0.0, 0.1], torch.tensor([0.0, 0.1])):
        attention = SpargeLLMAttention(method="s2o", tau=tau)
        attention.tau = tau
    for block_size in (32, 64, 128):  # and the other options at their ends
        SpargeLLMAttention(method="fsa", block_size=block_size, top_k=1)
    SpargeLLMAttention(pbs_segment=64, s2o_segment=128, min_padded_tokens=0, min_predicted_window=0,
                       min_segment_queries=0)


def test_bad_settings_raise():
    for bad, message in ((dict(method="topk"), "method must be one of"), (dict(method="fsa", pbs_segment=256),
                         "pbs_segment pairs"), (dict(s2o_segment=100), "s2o_segment"), (dict(top_k=0), "top_k"),
                         (dict(block_size=48), "block_size"), (dict(cdfthreshd=1.5), r"cdfthreshd values must lie"),
                         (dict(pvthreshd=0), r"pvthreshd values must lie in \(0, inf\]"),
                         (dict(min_predicted_window=-1), "min_predicted_window must be an int"),
                         (dict(min_segment_queries=1.5), "min_segment_queries must be an int"),
                         (dict(simthreshd1=[0.5, float("nan")]), "simthreshd1 values"),
                         (dict(method="s2o", tau=-0.1), r"tau values must lie in \[0.0, inf\]"),  # was taken
                         (dict(tau=[0.1, float("nan")]), "tau values"), (dict(tau="0.1"), "tau values"),
                         (dict(pbs_segment=0), "pbs_segment must be None or a positive multiple of 64, got 0"),
                         (dict(s2o_segment=0), "s2o_segment must be a positive multiple of 128, got 0"),
                         (dict(attention_sink="False"), "attention_sink must be True or False"),  # read as True
                         (dict(strict=1), "strict must be True or False"),
                         (dict(collect_stats=None), "collect_stats must be True or False")):
        # (each was first refused at the model's first prefill, if at all)
        with pytest.raises(ValueError, match=message):
            SpargeLLMAttention(**bad)


def direct_call_setup(seed):
    """A causal module stub with grouped-query heads, random (B, H, N, D) q/k/v and a function keeping every block."""
    torch.manual_seed(seed)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(1, 4, 130, 64), torch.randn(1, 2, 130, 64), torch.randn(1, 2, 130, 64)
    return module, (q, k, v), SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)


def test_attention_function_answers_in_transformers_layout():
    """query (B, H, N, D), key/value (B, H_kv, N, D) in; (B, N, H, D) out, contiguous, like SDPA's function."""
    module, (q, k, v), attention = direct_call_setup(2)
    out, weights = attention(module, q, k, v, None, scaling=0.125)
    assert weights is None and out.shape == (1, 130, 4, 64) and out.is_contiguous()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert relative_l1(out, expected.transpose(1, 2)) < 1e-5


def test_fsa_selects_at_most_the_key_blocks_a_call_has(monkeypatch):
    """method="fsa" with top_k above a call's key blocks (1000 against 3 blocks of 64 for 130 keys) selects 3: the
    selection's index and partial outputs grow with its width, and its further columns would all be -1. Every block
    kept: SDPA's output."""
    from sparge_diffusers import llm

    module, (q, k, v), _ = direct_call_setup(5)
    widths = []
    select = llm.select_key_blocks
    monkeypatch.setattr(llm, "select_key_blocks", lambda *a, top_k, **kw: widths.append(top_k) or select(
        *a, top_k=top_k, **kw))
    out, _ = SpargeLLMAttention(method="fsa", top_k=1000)(module, q, k, v, None, scaling=0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert widths == [3] and relative_l1(out, expected.transpose(1, 2)) < 1e-5


def test_a_value_head_dim_unlike_the_querys_falls_back_to_sdpa():
    """SDPA takes v with another head dim than q and k (DeepSeek-style attention at small sizes); the kernels
    refuse it, which raised in the middle of the model. Now transformers' SDPA function answers, with a warning."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, (q, k, v), attention = direct_call_setup(4)
    v = torch.randn(1, 2, 130, 32)
    with pytest.warns(UserWarning, match="k and v shapes differ"):
        out, _ = attention(module, q, k, v, None, scaling=0.125)
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)
    assert attention.sparse_calls == 0 and out.shape == (1, 130, 4, 32) and torch.equal(out, expected)


def test_one_kv_head_under_a_mask_falls_back_to_sdpa_on_contiguous_kv(monkeypatch):
    """transformers' SDPA function repeats one K/V head as views of head stride 0, which torch 2.11's memory-efficient
    kernel misreads under a mask (pytorch/pytorch#191937; mask seeds 102021 and 103979 with cuDNN's SDPA off). The
    fallback hands SDPA contiguous copies for such a prefill call, and the same values as the function; decode steps,
    models with more K/V heads and calls without a mask still go to the function. Without the copies SDPA gets the
    views (head stride 0) and the stride check below fails."""
    import transformers.integrations.sdpa_attention as transformers_sdpa

    function, sdpa = transformers_sdpa.sdpa_attention_forward, torch.nn.functional.scaled_dot_product_attention
    function_calls, head_strides = [], []

    def counted_function(*args, **kwargs):
        function_calls.append(args[1].shape[2])
        return function(*args, **kwargs)

    def strides_seen(query, key, value, **kwargs):
        head_strides.append((key.stride(1), value.stride(1)))
        return sdpa(query, key, value, **kwargs)

    torch.manual_seed(11)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(2, 2, 65, 64), torch.randn(2, 1, 185, 64), torch.randn(2, 1, 185, 64)
    mask = torch.rand(2, 1, 65, 185) < 0.3  # no causal pattern: the fallback
    mask[..., 0] = True
    expected, _ = function(module, q, k, v, mask, scaling=0.125)
    monkeypatch.setattr(transformers_sdpa, "sdpa_attention_forward", counted_function)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", strides_seen)
    attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    with pytest.warns(UserWarning, match="an explicit attention mask"):
        out, weights = attention(module, q, k, v, mask, scaling=0.125)
    assert attention.sparse_calls == 0 and weights is None and out.shape == (2, 65, 2, 64) and out.is_contiguous()
    assert function_calls == [] and len(head_strides) == 1 and 0 not in head_strides[0], head_strides
    assert relative_l1(out, expected) < 1e-6
    exact = sdpa(q.double(), k.double().expand(-1, 2, -1, -1), v.double().expand(-1, 2, -1, -1), attn_mask=mask,
                 scale=0.125)
    assert relative_l1(out, exact.transpose(1, 2)) < 1e-5

    head_strides.clear()
    attention(module, q[:, :, -1:], k, v, mask[:, :, -1:], scaling=0.125)  # a decode step: the function's own path
    q4, k2, v2 = torch.randn(2, 4, 65, 64), torch.randn(2, 2, 185, 64), torch.randn(2, 2, 185, 64)
    attention(module, q4, k2, v2, mask, scaling=0.125)  # two K/V heads: repeat_kv copies them
    with pytest.warns(UserWarning, match="a non-causal attention module"):
        attention(module, q, k, v, None, scaling=0.125, is_causal=False)  # no mask: enable_gqa, no views
    assert function_calls == [1, 65, 65], function_calls


def test_a_non_causal_call_or_dropout_falls_back_to_sdpa():
    """The kernels of the LLM path run causal prefill: an encoder's attention (module.is_causal False, or
    is_causal=False passed) must get transformers' SDPA function, which attends to every key, and so must a call
    with dropout. Before session 84 no test made either call: without the check a non-causal module got causal
    attention, silently."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, (q, k, v), _ = direct_call_setup(7)
    encoder = torch.nn.Module()
    encoder.is_causal, encoder.num_key_value_groups = False, 2
    for mod, kwargs in ((encoder, {}), (module, {"is_causal": False})):
        attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)  # each warns once
        with pytest.warns(UserWarning, match="a non-causal attention module"):
            out, _ = attention(mod, q, k, v, None, scaling=0.125, **kwargs)
        expected, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.125, **kwargs)
        assert attention.sparse_calls == 0 and torch.equal(out, expected)
        every_key = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
        assert relative_l1(out, every_key.transpose(1, 2)) < 1e-5
    with pytest.warns(UserWarning, match="dropout"):
        torch.manual_seed(0)
        out, _ = attention(module, q, k, v, None, dropout=0.5, scaling=0.125)
    torch.manual_seed(0)
    expected, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.5, scaling=0.125)
    assert attention.sparse_calls == 0 and torch.equal(out, expected)
    with pytest.raises(ValueError, match="a non-causal attention module; strict=True forbids"):
        SpargeLLMAttention(strict=True)(encoder, q, k, v, None, scaling=0.125)
    plain = torch.nn.Module()  # no is_causal: transformers' SDPA function takes it for causal, and so do we
    plain.num_key_value_groups = 2
    attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True, collect_stats=True)
    out, _ = attention(plain, q, k, v, None, scaling=0.125)
    expected, _ = sdpa_attention_forward(plain, q, k, v, None, scaling=0.125)
    assert attention.sparse_calls == 1 and relative_l1(out, expected) < 1e-5


def test_arguments_sdpa_computes_fall_back_and_those_nobody_computes_raise(monkeypatch):
    """Keyword arguments that change attention: a position bias goes to transformers' SDPA function, which adds it
    (a warning; strict raises); per-token sinks and model-chosen key indices raise on every call, decode steps
    included (SDPA's function would drop them)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, (q, k, v), attention = direct_call_setup(3)
    plain, _ = attention(module, q, k, v, None, scaling=0.125)
    assert attention.sparse_calls == 1

    bias = torch.randn(1, 4, 130, 130)
    if "position_bias" in inspect.signature(sdpa_attention_forward).parameters:
        with pytest.warns(UserWarning, match="position bias"):
            out, _ = attention(module, q, k, v, None, scaling=0.125, position_bias=bias)
        assert attention.sparse_calls == 1
        expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125, position_bias=bias)
        assert torch.equal(out, expected) and relative_l1(out, plain) > 0.05
        with pytest.raises(ValueError, match="position bias.*strict=True"):
            SpargeLLMAttention(strict=True)(module, q, k, v, None, position_bias=bias)
    else:  # transformers 4.x: its SDPA function would drop the bias, so nobody computes it
        with pytest.raises(ValueError, match="position bias.*does not add; upgrade transformers"):
            attention(module, q, k, v, None, scaling=0.125, position_bias=bias)
    import sparge_diffusers.llm as llm

    calls = attention.sparse_calls
    monkeypatch.setattr(llm, "_sdpa_function_parameters", lambda: frozenset({"query", "key", "value"}))  # as 4.x
    with pytest.raises(ValueError, match="position bias.*does not add; upgrade transformers"):
        attention(module, q, k, v, None, scaling=0.125, position_bias=bias)
    assert torch.equal(attention(module, q, k, v, None, scaling=0.125)[0], plain)  # without a bias: sparse
    assert attention.sparse_calls == calls + 1
    monkeypatch.undo()

    uncomputed = dict(sinks=torch.zeros(1, 4, 130, 1),
                      indices=torch.zeros(1, 130, 8, dtype=torch.int32),
                      block_indices=torch.zeros(1, 4, 3, 2, dtype=torch.int32))
    for name, value in uncomputed.items():
        for n in (130, 1):  # a prefill and a decode step
            with pytest.raises(ValueError, match=f"{name}.*neither the sparse kernels nor"):
                attention(module, q[:, :, :n], k, v, None, scaling=0.125, **{name: value})

    one = torch.tensor([0, 130], dtype=torch.int32)

    def packed(*args):
        raise AssertionError("one sequence read as packed ones (a read-back, and a compiled call raises there)")

    monkeypatch.setattr(llm, "packed_segments", packed)
    out, _ = attention(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=one, cu_seq_lens_k=one)
    assert attention.sparse_calls == 3 and torch.equal(out, plain), "one sequence: the plain causal call"


def test_packed_sequences_given_only_by_cu_seq_lens_run_each_alone(monkeypatch):
    """flash-attention's cu_seq_lens_q/k without a mask (transformers' SDPA function would attend across the
    sequences): each sequence runs as its own causal call; descriptions that are not one row of the call's own
    queries and keys raise, and so do fallbacks that would lose them and compiled calls (the lengths are read on
    the host)."""
    import sparge_diffusers.llm as llm

    module, (q, k, v), attention = direct_call_setup(3)
    packed = torch.tensor([0, 60, 130], dtype=torch.int32)
    out, _ = attention(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=packed, cu_seq_lens_k=packed)
    parts = [attention(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None, scaling=0.125)[0]
             for s, e in ((0, 60), (60, 130))]
    assert relative_l1(out, torch.cat(parts, 1)) < 1e-6 and attention.sparse_calls == 3
    assert relative_l1(out, attention(module, q, k, v, None, scaling=0.125)[0]) > 1e-2, "not attending across"
    reads = []
    read = llm.packed_segments
    monkeypatch.setattr(llm, "packed_segments", lambda *a: reads.append(1) or read(*a))
    again, _ = attention(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=packed, cu_seq_lens_k=packed)
    assert torch.equal(again, out) and reads == [], "the same lengths (every layer's): read once"
    packed[1] = 70  # changed in place: read again
    moved, _ = attention(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=packed, cu_seq_lens_k=packed)
    assert reads == [1] and relative_l1(moved, out) > 1e-3
    monkeypatch.setattr(llm, "packed_segments", read)
    packed[1] = 60
    # a window shorter than the longer sequence (70) but not the shorter (60): it hides keys in the longer one only
    windowed, _ = attention(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=packed, cu_seq_lens_k=packed,
                            sliding_window=65)
    parts = [attention(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None, scaling=0.125, sliding_window=65)[0]
             for s, e in ((0, 60), (60, 130))]
    assert relative_l1(windowed, torch.cat(parts, 1)) < 1e-6 and relative_l1(windowed, out) > 1e-4
    for bad, message in ((dict(cu_seq_lens_q=packed, cu_seq_lens_k=torch.tensor([0, 70, 130])), "the same for both"),
                         (dict(cu_seq_lens_q=torch.tensor([0, 60, 120])), "from 0 to its 130"),
                         (dict(cu_seq_lens_q=torch.tensor([0, 60, 60, 130])), "increasing offsets")):
        with pytest.raises(ValueError, match=message):
            attention(module, q, k, v, None, **bad)
    with pytest.raises(ValueError, match="batch 2"):
        attention(module, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), None,
                  cu_seq_lens_q=packed)
    with pytest.raises(ValueError, match="and dropout, which it does not take"):
        attention(module, q, k, v, None, dropout=0.1, cu_seq_lens_q=packed, cu_seq_lens_k=packed)
    monkeypatch.setattr(llm, "compiling", lambda: True)
    with pytest.raises(ValueError, match="a compiled graph cannot do"):
        attention(module, q, k, v, None, cu_seq_lens_q=packed, cu_seq_lens_k=packed)


def gpt_oss_with_sinks(path, window=100, sinks_std=2.0):
    """A 2-layer gpt-oss (a sliding-window layer of ``window`` keys, then a global one) with learned sinks drawn
    large enough to matter (its own initialisation draws them near 0), saved at ``path``; skips where transformers
    has no gpt-oss."""
    if "gpt_oss" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss (4.55 and later have)")
    config = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
        vocab_size=128, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, sinks_std)
    model.save_pretrained(path)
    return path


def test_right_padded_batch_with_sinks_gives_eager_logits_everywhere(tmp_path):
    """gpt-oss with its sinks (and a window wider than the prompt, which hides no key) on a right-padded batch: each
    prompt runs sparse with the sinks, its padding queries on the sinks' exact path, and the logits are eager's at
    every position."""
    path = gpt_oss_with_sinks(tmp_path, window=1000)
    attention = register("sparge_test_sinks_right", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_padded_tokens=0)
    ids = prompt(300, batch=2)
    mask = right_padded(ids, (300, 170))
    got = logits(load(path, "sparge_test_sinks_right"), ids, attention_mask=mask)
    assert attention.sparse_calls == 2
    assert relative_l1(got, logits(load(path, "eager"), ids, attention_mask=mask)) < 1e-5


def test_a_model_with_attention_sinks_runs_sparse_with_them(tmp_path):
    """gpt-oss passes its learned sinks (s_aux) to every layer: both layers (one under a 100-key window) run sparse
    with them and give eager attention's logits and tokens (decode steps with the sinks too, not SDPA's function,
    which drops them); a left-padded batch gives eager's logits at its real positions; with TopCdf skipping, the
    output moves away from eager's (the sinks change no block decision)."""
    path = gpt_oss_with_sinks(tmp_path)
    ids = prompt(300)
    eager = logits(load(path, "eager"), ids)
    model = load(path, "eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-float("inf"))
    assert relative_l1(logits(model, ids), eager) > 1e-2, "the sinks must matter for this test to mean anything"
    attention = register("sparge_test_sinks", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_padded_tokens=0)
    ours = load(path, "sparge_test_sinks")
    assert relative_l1(logits(ours, ids), eager) < 1e-5 and attention.sparse_calls == 2
    options = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(ids[:, :200], **options), load(path, "eager").generate(ids[:, :200], **options))
    assert attention.sparse_calls == 4, "the prompt's 2 layers sparse, 5 decode steps on the sinks' exact path"
    batch = prompt(300, batch=2)
    mask, positions = left_padded(batch, (0, 130))
    real = mask.bool()
    got = logits(ours, batch, attention_mask=mask, position_ids=positions)
    expected = logits(load(path, "eager"), batch, attention_mask=mask, position_ids=positions)
    assert relative_l1(got[real], expected[real]) < 1e-5
    register("sparge_test_sinks_skip", simthreshd1=-1.0, cdfthreshd=0.5)
    assert relative_l1(logits(load(path, "sparge_test_sinks_skip"), ids), eager) > 1e-3


def test_every_method_takes_sinks_and_a_method_without_falls_back_to_their_exact_path(tmp_path, monkeypatch):
    """S2O (every block visited), FSA (every block selected) and PBS's permuted keys (every block kept) run sparse with
    the sinks, eager's logits; a method registered without them goes to the sinks' exact fallback (eager's logits)
    with a warning, or raises under strict; the fallback in query chunks equals eager attention under a boolean, an
    additive or no mask, with or without softcapping, which a direct call runs sparse with the sinks; sinks with a
    position bias raise (nobody computes both)."""
    import sparge_diffusers.llm as llm
    from sparge_diffusers.llm import eager_attention

    path = gpt_oss_with_sinks(tmp_path, window=4096)  # a window that hides no key here: the sinks decide alone
    ids = prompt(300)
    eager = logits(load(path, "eager"), ids)
    for name, settings in (("s2o", dict(method="s2o", tau=0.0)), ("fsa", dict(method="fsa", top_k=8)),
                           ("pbs", dict(pbs_segment=128, cdfthreshd=1.0, pvthreshd=None))):
        attention = register(f"sparge_test_sinks_{name}", simthreshd1=-1.0, strict=True, **settings)
        assert relative_l1(logits(load(path, f"sparge_test_sinks_{name}"), ids), eager) < 1e-5, name
        assert attention.sparse_calls == 2, name
    monkeypatch.setitem(llm.PREFILL_METHODS, "no_sinks", llm.PrefillMethod(llm._s2o_prefill, llm._s2o_compiled))
    register("sparge_test_sinks_strict", method="no_sinks", strict=True)
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\), which the 'no_sinks' method does not take"):
        logits(load(path, "sparge_test_sinks_strict"), ids)
    falling_back = register("sparge_test_sinks_fallback", method="no_sinks")
    with pytest.warns(UserWarning, match=r"falling back to exact attention \(llm.eager_attention\): attention sinks"):
        got = logits(load(path, "sparge_test_sinks_fallback"), ids)
    assert relative_l1(got, eager) < 1e-5 and falling_back.sparse_calls == 0

    module, (q, k, v), attention = direct_call_setup(5)
    sinks = torch.tensor([0.5, -1.0, 3.0, -float("inf")])
    causal = torch.ones(130, 130, dtype=torch.bool).tril()
    group_k, group_v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ group_k.transpose(-1, -2)) * 0.125
    for softcap in (None, 1.5):
        capped = scores if softcap is None else softcap * torch.tanh(scores / softcap)
        for mask in (causal[None, None], torch.zeros(130, 130).masked_fill(~causal, -1e9)[None, None], None):
            masked = capped.masked_fill(~causal, -float("inf"))
            probs = torch.softmax(torch.cat([masked, sinks.view(1, 4, 1, 1).expand(1, 4, 130, 1)], -1), -1)[..., :-1]
            expected = (probs @ group_v).transpose(1, 2)
            for max_scores in (1 << 26, 4 * 130 * 50):  # all rows at once, chunks of 50 rows
                out = eager_attention(q, k, v, mask, sinks=sinks, softcap=softcap, scale=0.125, is_causal=True,
                                      max_scores=max_scores)
                assert out.shape == (1, 130, 4, 64) and relative_l1(out, expected) < 1e-5, (softcap, mask)
        calls = attention.sparse_calls
        out, _ = attention(module, q, k, v, None, scaling=0.125, s_aux=sinks, softcap=softcap)
        assert attention.sparse_calls == calls + 1 and relative_l1(out, expected) < 1e-5, softcap
    with pytest.raises(ValueError, match="a position bias together with attention sinks"):
        attention(module, q, k, v, None, scaling=0.125, s_aux=sinks, position_bias=torch.zeros(1, 4, 130, 130))
    # a query that sees no key: the mean of the values without a sink (eager's additive mask), zero with one; not NaN
    blind = causal.clone()
    blind[7] = False
    out = eager_attention(q, k, v, blind[None, None], softcap=1.5, scale=0.125)
    assert torch.allclose(out[0, 7], group_v[0, :, :, :].mean(1), atol=1e-5) and torch.isfinite(out).all()
    out = eager_attention(q, k, v, blind[None, None], sinks=sinks.clamp(min=-5.0), scale=0.125)
    assert torch.equal(out[0, 7], torch.zeros_like(out[0, 7])) and torch.isfinite(out).all()


def test_eager_attention_takes_values_of_another_head_dim():
    """Multi-head latent attention (DeepSeek) has value heads narrower than query heads: the output reshaped to the
    query's head dim failed."""
    from sparge_diffusers.llm import eager_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g), \
        torch.randn(1, 2, 20, 8, generator=g)
    scores = 2.0 * torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25 / 2.0)
    scores = scores.masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(), -float("inf"))
    expected = (torch.softmax(scores, -1) @ v.repeat_interleave(2, 1)).transpose(1, 2)
    out = eager_attention(q, k, v, None, softcap=2.0, scale=0.25, is_causal=True, max_scores=4 * 20 * 7)
    assert out.shape == (1, 20, 4, 8) and relative_l1(out, expected) < 1e-6


def test_eager_attention_refuses_what_the_kernels_refuse():
    """Until session 89 the fallback took softcap=0 (every score 0: uniform weights, where the sparse path of the same
    layer raised), a NaN cap (NaN rows) and a negative scale, and failed inside torch for sinks of the wrong length
    or heads that do not group."""
    from sparge_diffusers.llm import eager_attention

    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    cases = [
        (dict(softcap=0.0), "softcap must be a positive finite number"),
        (dict(softcap=float("nan")), "softcap must be a positive finite number"),
        (dict(scale=-1.0), "scale must be a positive finite number"),
        (dict(sinks=torch.zeros(2)), r"sinks must hold one logit per query head, shape \(4,\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            eager_attention(q, k, v, None, is_causal=True, **kwargs)
    with pytest.raises(ValueError, match="3 heads must be a multiple of the key's 2"):
        eager_attention(q[:, :3], k, v, None)


def test_eager_attention_masks_two_queries_causally_and_drops_weights_as_asked():
    """Without a mask, is_causal masks every call of more than one query (two as well: the first must not see the
    second key), and dropout drops weights whenever asked (transformers passes 0 outside training)."""
    from sparge_diffusers.llm import eager_attention

    q, k, v = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    out = eager_attention(q, k, v, None, is_causal=True)
    assert torch.allclose(out[0, 0], v[0, 0, 0].expand(2, 8))  # query 0 sees key 0 alone, in both heads
    assert not torch.allclose(out[0, 1], v[0, 0, 0].expand(2, 8))
    assert torch.equal(eager_attention(q, k, v, None, dropout=1.0), torch.zeros(1, 2, 2, 8))


def gemma2_with_cap(path) -> None:
    """A tiny Gemma 2 saved at ``path``: logit cap 1.0 (so that it matters on random weights), a sliding-window (100
    keys) layer and a global one, Q/K projections scaled so that scores reach a few units."""
    if "gemma2" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 2")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, sliding_window=100,
        attn_logit_softcapping=1.0, layer_types=["sliding_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # scores of a few units (the initialisation gives ~0.01), which a cap of 1 bends
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(path)


def test_a_model_with_softcapping_runs_sparse_with_it(tmp_path):
    """Gemma 2 caps its attention logits (``softcap``, here 1.0 so that it matters on random weights) and alternates
    sliding-window (100 keys) and global layers: both run sparse with the cap, eager's logits and tokens (decode steps
    on the exact path: transformers' SDPA function raises on softcap); S2O, which takes no cap, falls back to the
    exact path with a warning (strict raises); compiled (aot_eager, fullgraph) gives the eager logits."""
    gemma2_with_cap(tmp_path)
    ids = prompt(300).clamp(min=1)  # Gemma's pad token is 0: generate would read 0s in the prompt as padding
    eager = logits(load(tmp_path, "eager"), ids)
    uncapped = load(tmp_path, "eager")
    uncapped.config.attn_logit_softcapping = None
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert relative_l1(logits(uncapped, ids), eager) > 1e-2, "the cap must matter for this test to mean anything"
    attention = register("sparge_test_softcap", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True)
    model = load(tmp_path, "sparge_test_softcap")
    assert relative_l1(logits(model, ids), eager) < 1e-5 and attention.sparse_calls == 2
    options = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids[:, :200], **options), load(tmp_path, "eager").generate(ids[:, :200],
                                                                                                 **options))
    register("sparge_test_softcap_s2o", method="s2o", strict=True)
    with pytest.raises(ValueError, match="softcapping, which the 's2o' method does not take"):
        logits(load(tmp_path, "sparge_test_softcap_s2o"), prompt(90))  # within the window: the cap decides alone
    falling_back = register("sparge_test_softcap_fallback", method="s2o")
    with pytest.warns(UserWarning, match=r"falling back to exact attention \(llm.eager_attention\): softcapping"):
        got = logits(load(tmp_path, "sparge_test_softcap_fallback"), prompt(90))
    assert relative_l1(got, logits(load(tmp_path, "eager"), prompt(90))) < 1e-5 and falling_back.sparse_calls == 0
    compiled = aot_compiled(model)
    assert relative_l1(logits(compiled, ids), eager) < 1e-5


def test_padded_batches_of_a_capped_model_give_eager_logits_on_either_path(tmp_path):
    """Gemma 2 (cap 1.0, a 100-key window layer, then a global one) on a left- and a right-padded batch of 300
    tokens. Falling back (under min_padded_tokens) to the cap's exact path gives eager's logits at every position:
    before session 55 the padding queries that see no key came out NaN there and, through 0 x NaN in the next
    layer's P.V, so did every real position. Run sparse, each prompt's real positions give eager's logits and none is
    NaN."""
    gemma2_with_cap(tmp_path)
    ids = prompt(300, batch=2).clamp(min=1)
    batches = {"left": dict(zip(("attention_mask", "position_ids"), left_padded(ids, (0, 70)))),
               "right": dict(attention_mask=right_padded(ids, (300, 170)))}
    falling_back = register("sparge_test_cap_padded_fallback", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    sparse = register("sparge_test_cap_padded", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                      min_padded_tokens=0)
    for side, inputs in batches.items():
        eager = logits(load(tmp_path, "eager"), ids, **inputs)
        real = inputs["attention_mask"].bool()
        with pytest.warns(UserWarning, match="min_padded_tokens"):
            got = logits(load(tmp_path, "sparge_test_cap_padded_fallback"), ids, **inputs)
        assert relative_l1(got, eager) < 1e-5, side
        got = logits(load(tmp_path, "sparge_test_cap_padded"), ids, **inputs)
        assert torch.isfinite(got).all() and relative_l1(got[real], eager[real]) < 1e-5, side
    assert falling_back.sparse_calls == 0 and sparse.sparse_calls == 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shorter_than_window", [False, True])
def test_right_padded_batch_under_a_sliding_window_gives_sdpa_logits_everywhere(tmp_path, device,
                                                                               shorter_than_window):
    """Mistral with a 100-key window on a right-padded batch: the window's mask is read with the padding, each prompt
    runs sparse under the window, its padding queries see their window's remaining keys or, past its reach, none.
    SDPA's logits at every position that sees a key (float32 on CPU, bf16 on the GPU); those that see none get zeros
    from the attention, as from SDPA's math backend on the CPU (everywhere there). SDPA's GPU kernels under a mask
    give such rows other values, so on the GPU those positions are left out of the comparison.
    ``shorter_than_window``: every prompt padded and shorter than the window, which still hides keys from the padding
    queries past position 99 (the window was dropped there, as if it hid none: their rows saw every real key)."""
    path = mistral_with_window(tmp_path, 100)
    n, dtype, tolerance = (300, torch.float32, 1e-5) if device == "cpu" else (1000, torch.bfloat16, 2e-2)
    ids = prompt(n, batch=3, seed=5).to(device)
    ends = (90, 50, 40) if shorter_than_window else (n, n // 2, 40)
    mask = right_padded(ids, ends)
    attention = register("sparge_test_window_right", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                         min_padded_tokens=0)
    got = logits(load(path, "sparge_test_window_right").to(device, dtype), ids, attention_mask=mask)
    assert attention.sparse_calls == 2 and torch.isfinite(got).all()
    expected = logits(load(path, "sdpa").to(device, dtype), ids, attention_mask=mask)
    sees_a_key = torch.arange(n, device=device)[None, :] < torch.tensor(ends, device=device)[:, None] + 99
    assert not sees_a_key.all(), "some padding queries must be past their window's reach"
    compared = sees_a_key if device == "cuda" else torch.ones_like(sees_a_key)
    assert relative_l1(got[compared].float(), expected[compared].float()) < tolerance


def test_a_model_with_sinks_compiles_to_one_graph(tmp_path):
    """gpt-oss compiled (aot_eager, fullgraph): its sinks reach the kernels' operator, logits equal eager's."""
    if TRANSFORMERS_4:
        pytest.skip("transformers 4.x's gpt-oss loops over the experts hit (data-dependent): no fullgraph compile")
    path = gpt_oss_with_sinks(tmp_path)
    register("sparge_test_sinks_compiled", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None)
    model = load(path, "sparge_test_sinks_compiled")
    ids = prompt(300)
    eager = logits(model, ids)
    compiled = aot_compiled(model)
    assert torch.equal(logits(compiled, ids), eager)


def test_compiled_prefill_is_one_graph_and_matches_eager(tiny_llama):
    attention = register("sparge_test_compile", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None)
    model = load(tiny_llama, "sparge_test_compile")
    ids = prompt(300)
    eager = logits(model, ids)
    assert relative_l1(eager, logits(load(tiny_llama, "sdpa"), ids)) > 1e-3, "the settings must skip blocks"
    calls = attention.sparse_calls
    compiled = aot_compiled(model)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first, second = logits(compiled, ids), logits(compiled, ids)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert attention.sparse_calls == calls, "without collect_stats compiled calls are not counted"


@pytest.mark.parametrize("method", ["sparge", "s2o", "fsa"])
def test_compiled_prefill_collects_stats_when_asked(tiny_llama, method):
    """collect_stats under torch.compile: unmasked calls run inside the llm_prefill operator, masked ones inside
    llm_masked_prefill, and both record each sparse call (count and stats, equal to the eager call's) when they run,
    with one graph per call signature and no recompile on later calls."""
    settings = dict(sparge=dict(cdfthreshd=0.9), s2o=dict(tau=0.2, s2o_segment=128), fsa=dict(top_k=2))[method]
    attention = register(f"sparge_test_compile_stats_{method}", method=method, simthreshd1=-1.0, collect_stats=True,
                         min_padded_tokens=0, **settings)
    model = load(tiny_llama, f"sparge_test_compile_stats_{method}")
    ids = prompt(1500 if method == "s2o" else 300)
    batch = torch.cat([prompt(ids.shape[1], seed=4), ids])
    mask, positions = left_padded(batch, (0, 40))
    eager = logits(model, ids)
    eager_padded = logits(model, batch, attention_mask=mask, position_ids=positions)
    expected = [s.qk_skipped for s in attention.stats]
    assert len(expected) == 4 and attention.sparse_calls == 4  # 2 layers x (a prompt, a padded batch)
    attention.stats.clear()
    compiled = aot_compiled(model)
    for again in (False, True):  # one graph per call signature, then no recompile
        with torch._dynamo.config.patch(error_on_recompile=again):
            assert torch.equal(logits(compiled, ids), eager)
            assert torch.equal(logits(compiled, batch, attention_mask=mask, position_ids=positions), eager_padded)
    assert attention.sparse_calls == 4 + 8 and len(attention.stats) == 8
    for got, want in zip(attention.stats, expected * 2):
        assert torch.equal(got.qk_skipped, want)
    assert all(s.sparsity > 0 for s in attention.stats)


def test_compiled_calls_with_a_mask_read_it_at_run_time(tiny_llama):
    """Under torch.compile (fullgraph, no recompile between calls of the same shapes) a mask goes into the
    llm_masked_prefill operator, which routes the call by the mask's contents as an eager call does: a left-padded
    batch runs each prompt sparse and a chunk against a cache its lower-right call (both equal to eager, bitwise), a
    right-padded batch each prompt sparse; a custom mask and a short padded batch go to SDPA under the mask with the
    eager call's warning, at run time."""
    import copy

    attention = register("sparge_test_compile_mask", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None,
                         min_padded_tokens=0)
    model = load(tiny_llama, "sparge_test_compile_mask")
    sdpa = load(tiny_llama, "sdpa")
    batch = prompt(300, batch=2)
    mask, positions = left_padded(batch, (0, 40))
    eager = logits(model, batch, attention_mask=mask, position_ids=positions)
    real = mask.bool()
    assert relative_l1(eager[real], logits(sdpa, batch, attention_mask=mask, position_ids=positions)[real]) > 1e-3
    compiled = aot_compiled(model)
    with warnings.catch_warnings(), torch._dynamo.config.patch(error_on_recompile=True):
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        first = logits(compiled, batch, attention_mask=mask, position_ids=positions)
        second = logits(compiled, batch, attention_mask=mask, position_ids=positions)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    # a chunk against a cache: transformers' lower-right mask
    ids = prompt(400)
    prefix = dynamic_cache(model)
    logits(sdpa, ids[:, :250], **{CACHE: prefix}, use_cache=True)
    chunk = {}
    for name, m in (("eager", model), ("compiled", compiled)):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="SpargeLLMAttention")
            chunk[name] = logits(m, ids[:, 250:], **{CACHE: copy.deepcopy(prefix)}, use_cache=True)
    assert torch.equal(chunk["compiled"], chunk["eager"])
    assert relative_l1(chunk["eager"], logits(sdpa, ids[:, 250:], **{CACHE: copy.deepcopy(prefix)},
                                              use_cache=True)) > 1e-3, "the chunk ran sparse"
    # right padding: each prompt sparse, read when the operator runs; a custom mask goes to SDPA with a warning
    right = right_padded(batch, (300, 280))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        got = logits(compiled, batch, attention_mask=right)
    assert torch.equal(got, logits(model, batch, attention_mask=right))
    assert relative_l1(got, logits(sdpa, batch, attention_mask=right)) > 1e-3, "it ran sparse"
    custom = right_padded_mask_4d([300, 280], 300)
    custom[0, 0, 100:, 3] = False
    with pytest.warns(UserWarning, match="explicit attention mask"):
        got = logits(compiled, batch, attention_mask=custom)
    assert relative_l1(got, logits(sdpa, batch, attention_mask=custom)) < 1e-5
    attention.min_padded_tokens = 4096  # read when the operator runs: no recompile needed
    with pytest.warns(UserWarning, match="fewer than min_padded_tokens"):
        got = logits(compiled, batch, attention_mask=mask, position_ids=positions)
    assert relative_l1(got[real], logits(sdpa, batch, attention_mask=mask, position_ids=positions)[real]) < 1e-5


def test_masked_prefill_operator_without_its_function_says_so():
    import sparge_diffusers.llm  # noqa: F401  (registers the operator)

    q, k = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.sparge_diffusers.llm_masked_prefill(q, k, k, mask, None, -1)


def test_compiled_pbs_prefill_matches_eager(tiny_llama):
    """pbs_segment under torch.compile: an unmasked prompt is one node of the pbs_sparge_attention operator
    (fullgraph, no recompile, no warning), equal to the eager call and not to keys in order; a left-padded batch runs
    eagerly inside the masked-prefill operator, PBS included: equal to the eager call."""
    register("sparge_test_compile_pbs", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None, pbs_segment=128,
             min_padded_tokens=0)
    register("sparge_test_compile_in_order", simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None, min_padded_tokens=0)
    ids = prompt(300)
    model = load(tiny_llama, "sparge_test_compile_pbs")
    eager = logits(model, ids)
    with warnings.catch_warnings(), torch._dynamo.config.patch(error_on_recompile=True):
        warnings.filterwarnings("error", message="SpargeLLMAttention")
        compiled = aot_compiled(model)
        assert torch.equal(logits(compiled, ids), eager) and torch.equal(logits(compiled, ids), eager)
    assert not torch.equal(eager, logits(load(tiny_llama, "sparge_test_compile_in_order"), ids))
    batch = torch.cat([prompt(300, seed=4), ids])
    mask, positions = left_padded(batch, (0, 40))
    eager = logits(model, batch, attention_mask=mask, position_ids=positions)
    compiled = aot_compiled(model)
    assert torch.equal(logits(compiled, batch, attention_mask=mask, position_ids=positions), eager)
    in_order = logits(load(tiny_llama, "sparge_test_compile_in_order"), batch, attention_mask=mask,
                      position_ids=positions)
    assert not torch.equal(eager, in_order), "PBS's order changes the blocks stage 1 keeps here"


@pytest.mark.parametrize("method, settings, ids_len", [
    ("fsa", dict(top_k=2), 300),
    ("s2o", dict(tau=0.2, s2o_segment=128, simthreshd1=-1.0), 1500),  # a stop needs more than 16 ranked tiles
])
def test_compiled_s2o_and_fsa_are_one_graph_and_match_eager(tiny_llama, method, settings, ids_len):
    """method="fsa" / "s2o" compile to their operators (fullgraph, no recompile) and equal their eager result."""
    ids = prompt(ids_len)
    register(f"sparge_test_compile_{method}", method=method, **settings)
    model = load(tiny_llama, f"sparge_test_compile_{method}")
    eager = logits(model, ids)
    assert relative_l1(eager, logits(load(tiny_llama, "sdpa"), ids)) > 1e-3, "the settings must skip blocks"
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = aot_compiled(model)
        assert torch.equal(logits(compiled, ids), eager) and torch.equal(logits(compiled, ids), eager)


@pytest.mark.gpu
def test_one_kv_head_under_a_mask_is_right_on_the_memory_efficient_kernel():
    """Session 105's standalone case of pytorch/pytorch#191937 (65 queries, 185 keys, a causal window mask, 2 heads
    on 1 K/V head): transformers' SDPA function gave relative L1 0.024-0.027 on torch 2.11's memory-efficient kernel,
    on its K/V views of head stride 0. The fallback, which copies them, must give what the kernel gives on contiguous
    K/V (0.0018 there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)  # session 105's draw (its diag script), value for value
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q = torch.randn(1, 2, 65, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1, 185, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    positions, keys = torch.arange(120, 185, device="cuda")[:, None], torch.arange(185, device="cuda")[None, :]
    mask = ((keys <= positions) & (keys > positions - 50))[None, None]
    attention = SpargeLLMAttention(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning: a window no sliding_window declares reads as segments
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out, _ = attention(module, q, k, v, mask, scaling=0.2)
    assert attention.sparse_calls == 0
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().expand(-1, 2, -1, -1), v.double().expand(-1, 2, -1, -1), attn_mask=mask, scale=0.2)
    assert relative_l1(out.double(), exact.transpose(1, 2)) < 0.005


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
    # collect_stats: compiled calls are counted (the llm_prefill operator records them when they run); without it
    # the graph holds the kernels' operator itself, uncounted
    assert attention.sparse_calls == 6 and relative_l1(compiled.float(), out.float()) < 1e-2
    attention.collect_stats = False
    torch._dynamo.reset()
    compiled = logits(torch.compile(ours, fullgraph=True), ids)
    assert attention.sparse_calls == 6 and relative_l1(compiled.float(), out.float()) < 1e-2
    attention.collect_stats = True
    # chunked: 1000 prompt tokens continued by 600 on the cache (lower-right), both layers sparse
    chunked = {}
    for name, model in (("ours", ours), ("sdpa", sdpa)):
        cache = dynamic_cache(model)
        logits(model, ids[:, :1000], **{CACHE: cache}, use_cache=True)
        chunked[name] = logits(model, prompt(600, batch=2, seed=5).cuda(), **{CACHE: cache}, use_cache=True)
    assert attention.sparse_calls == 10 and torch.isfinite(chunked["ours"]).all()
    assert relative_l1(chunked["ours"].float(), chunked["sdpa"].float()) < 2e-2
    # the same against a static cache of 2048 slots: the chunk runs on the 1600 filled ones (a view of the cache)
    for name, model in (("ours", ours), ("sdpa", sdpa)):
        cache = static_cache(model, 2048, batch=2)
        logits(model, ids[:, :1000], **{CACHE: cache}, use_cache=True, cache_position=torch.arange(1000).cuda())
        chunked[name] = logits(model, prompt(600, batch=2, seed=5).cuda(), **{CACHE: cache}, use_cache=True,
                               cache_position=torch.arange(1000, 1600).cuda())
    assert attention.sparse_calls == 14 and torch.isfinite(chunked["ours"]).all()
    assert relative_l1(chunked["ours"].float(), chunked["sdpa"].float()) < 2e-2


@pytest.mark.gpu
def test_a_model_with_softcapping_on_gpu_matches_eager(tmp_path):
    """Gemma 2 with its logit cap on the GPU (bf16), where the kernels take tanh from tanh.approx.f32: both layers (one
    under a 100-key window) on the kernels, eager's logits (exact tanh) within bf16 tolerance."""
    gemma2_with_cap(tmp_path)
    attention = register("sparge_test_gpu_softcap", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True)
    ids = prompt(1000, batch=2).clamp(min=1).cuda()
    got = logits(load(tmp_path, "sparge_test_gpu_softcap").to("cuda", torch.bfloat16), ids)
    assert attention.sparse_calls == 2 and torch.isfinite(got).all()
    eager = logits(load(tmp_path, "eager").to("cuda", torch.bfloat16), ids)
    assert relative_l1(got.float(), eager.float()) < 2e-2  # bf16 through 2 layers


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_head_dim_of_256_runs_sparse(tmp_path, device):
    """Gemma 3 at head dim 256 (Gemma 2 and 3's; the kernels take it since session 54, before which every layer went to
    SDPA), a 100-key sliding layer and a global one: both on the sparse path (the reference on CPU, the Triton kernels
    in bf16 on the GPU), SDPA's logits."""
    tiny_gemma3(tmp_path, head_dim=256, sliding_window=100, layer_types=["sliding_attention", "full_attention"])
    attention = register(f"sparge_test_d256_{device}", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True)
    n, dtype, tolerance = (300, torch.float32, 1e-5) if device == "cpu" else (1000, torch.bfloat16, 2e-2)
    ids = prompt(n, batch=2).clamp(min=1).to(device)
    got = logits(load(tmp_path, f"sparge_test_d256_{device}").to(device, dtype), ids)
    assert attention.sparse_calls == 2 and torch.isfinite(got).all()
    expected = logits(load(tmp_path, "sdpa").to(device, dtype), ids)
    assert relative_l1(got.float(), expected.float()) < tolerance  # bf16 through 2 layers on the GPU


@pytest.mark.gpu
def test_a_model_with_sinks_on_gpu_matches_eager(tmp_path):
    """gpt-oss with its sinks on the GPU (bf16): both layers (one under a 100-key window) on the kernels, eager's
    logits; generate's decode steps on the sinks' exact path."""
    path = gpt_oss_with_sinks(tmp_path)
    attention = register("sparge_test_gpu_sinks", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True)
    ids = prompt(1000, batch=2).cuda()
    ours = load(path, "sparge_test_gpu_sinks").to("cuda", torch.bfloat16)
    eager = load(path, "eager").to("cuda", torch.bfloat16)
    got = logits(ours, ids)
    assert attention.sparse_calls == 2 and torch.isfinite(got).all()
    assert relative_l1(got.float(), logits(eager, ids).float()) < 2e-2  # bf16 through 2 layers
    assert ours.generate(ids[:1, :300], max_new_tokens=4, do_sample=False).shape == (1, 304)


@pytest.mark.gpu
def test_chunked_attention_on_gpu_matches_sdpa(tmp_path):
    """Llama 4's chunked layers (chunks of 256) on the GPU in bf16: a 1000-token batch of two runs each chunk
    through the kernels, keeping every block, and gives SDPA's logits; at default thresholds too (TopCdf skipping,
    so within a looser bound), compiled with inductor as well."""
    path = llama4_with_chunks(tmp_path, chunk=256)
    keep_all = register("sparge_test_chunked_gpu", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, strict=True,
                        min_segment_queries=0, collect_stats=True)
    default = register("sparge_test_chunked_gpu_default", strict=True, min_segment_queries=0)
    ids = prompt(1000, batch=2).cuda()
    expected = logits(load(path, "sdpa").to("cuda", torch.bfloat16), ids).float()
    got = logits(load(path, "sparge_test_chunked_gpu").to("cuda", torch.bfloat16), ids).float()
    assert keep_all.sparse_calls == 4 and len(keep_all.stats) == 4
    assert torch.isfinite(got).all() and relative_l1(got, expected) < 2e-2
    model = load(path, "sparge_test_chunked_gpu_default").to("cuda", torch.bfloat16)
    sparse = logits(model, ids).float()
    assert default.sparse_calls == 4 and torch.isfinite(sparse).all() and relative_l1(sparse, expected) < 5e-2
    torch._dynamo.reset()
    compiled = logits(torch.compile(model, fullgraph=True), ids).float()
    assert relative_l1(compiled, sparse) < 1e-2


@pytest.mark.gpu
def test_left_padded_prefill_on_gpu_matches_sdpa(tiny_llama):
    """The kernels on a left-padded batch (bf16): SDPA's logits at the real positions, padded prompt as if alone."""
    attention = register("sparge_test_gpu_padded", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                         min_padded_tokens=0)
    ids = prompt(1000, batch=3, seed=7).cuda()
    mask, positions = left_padded(ids, (0, 333, 999))
    real = mask.bool()
    ours = load(tiny_llama, "sparge_test_gpu_padded").to("cuda", torch.bfloat16)
    sdpa = load(tiny_llama, "sdpa").to("cuda", torch.bfloat16)
    got = logits(ours, ids, attention_mask=mask, position_ids=positions)
    assert attention.sparse_calls == 2 and torch.isfinite(got[real]).all()
    assert relative_l1(got[real].float(), logits(sdpa, ids, attention_mask=mask, position_ids=positions)[real].float()
                       ) < 2e-2
    assert relative_l1(got[1, 333:].float(), logits(ours, ids[1:, 333:])[0].float()) < 1e-2
    options = dict(max_new_tokens=3, do_sample=False, attention_mask=mask, pad_token_id=0, prefill_chunk_size=256)
    assert ours.generate(ids, **options).shape == (3, 1003) and attention.sparse_calls == 4 + 8  # 4 chunks


@pytest.mark.gpu
def test_right_padded_prefill_on_gpu_matches_sdpa(tiny_llama):
    """The kernels on a right-padded batch (bf16): SDPA's logits at every position, a padded prompt's real tokens as
    if alone."""
    attention = register("sparge_test_gpu_right", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                         min_padded_tokens=0)
    ids = prompt(1000, batch=3, seed=7).cuda()
    mask = right_padded(ids, (1000, 667, 1))
    ours = load(tiny_llama, "sparge_test_gpu_right").to("cuda", torch.bfloat16)
    sdpa = load(tiny_llama, "sdpa").to("cuda", torch.bfloat16)
    got = logits(ours, ids, attention_mask=mask)
    assert attention.sparse_calls == 2 and torch.isfinite(got).all()
    assert relative_l1(got.float(), logits(sdpa, ids, attention_mask=mask).float()) < 2e-2
    assert relative_l1(got[1, :667].float(), logits(ours, ids[1:, :667])[0].float()) < 1e-2


@pytest.mark.gpu
def test_compiled_masked_prefill_on_gpu(tiny_llama):
    """A compiled model (inductor, default and reduce-overhead modes) on a left-padded batch: the masked-prefill
    operator runs each prompt sparse (no fallback warning), SDPA's logits at the real positions when every block is
    kept; under reduce-overhead the operator stays out of the CUDA graphs (its mask read syncs)."""
    register("sparge_test_gpu_compiled_mask", simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, min_padded_tokens=0)
    ids = prompt(1000, batch=3, seed=7).cuda()
    mask, positions = left_padded(ids, (0, 333, 999))
    real = mask.bool()
    model = load(tiny_llama, "sparge_test_gpu_compiled_mask").to("cuda", torch.bfloat16)
    expected = logits(load(tiny_llama, "sdpa").to("cuda", torch.bfloat16), ids, attention_mask=mask,
                      position_ids=positions)[real].float()
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        compiled = torch.compile(model, mode=mode, fullgraph=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="SpargeLLMAttention")
            for _ in range(3):  # reduce-overhead records its graphs on the first calls
                got = logits(compiled, ids, attention_mask=mask, position_ids=positions)
        assert torch.isfinite(got[real]).all() and relative_l1(got[real].float(), expected) < 2e-2, mode


@pytest.mark.gpu
def test_compiled_stats_on_gpu_are_recorded_at_every_call(tiny_llama):
    """collect_stats under inductor's reduce-overhead mode: the llm_prefill operator stays out of the CUDA graphs, so
    every call, replays included, is counted and its stats kept (the eager call's, up to inductor's rounding)."""
    attention = register("sparge_test_gpu_compiled_stats", simthreshd1=-1.0, cdfthreshd=0.9, collect_stats=True)
    ids = prompt(1000, seed=7).cuda()
    model = load(tiny_llama, "sparge_test_gpu_compiled_stats").to("cuda", torch.bfloat16)
    logits(model, ids)
    expected = [s.qk_skipped for s in attention.stats]
    attention.stats.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        logits(compiled, ids)
    assert attention.sparse_calls == 2 + 6 and len(attention.stats) == 6
    for got, want in zip(attention.stats, expected * 3):  # inductor's bf16 fusions may flip a borderline block
        torch.testing.assert_close(got.qk_skipped, want, atol=0.02, rtol=0)


@pytest.mark.gpu
def test_s2o_and_fsa_methods_on_gpu(tiny_llama):
    """The S2O and FSA kernels behind the attention function (bf16): visiting every block gives SDPA's logits;
    skipping changes them; compiled FSA, S2O and PBS (inductor) give their eager outputs; PBS on a chunk keeping
    every block gives SDPA's logits."""
    ids = prompt(2000, batch=2).cuda()  # 32 key blocks: S2O tests its stop every 16 ranked tiles
    sdpa = load(tiny_llama, "sdpa").to("cuda", torch.bfloat16)
    dense = logits(sdpa, ids).float()
    for method, keep_all, skipping in (("s2o", dict(tau=0.0), dict(tau=0.2, s2o_segment=128)),
                                       ("fsa", dict(top_k=32), dict(top_k=2))):
        full = register(f"sparge_test_gpu_{method}", method=method, simthreshd1=-1.0, **keep_all)
        got = logits(load(tiny_llama, f"sparge_test_gpu_{method}").to("cuda", torch.bfloat16), ids).float()
        assert full.sparse_calls == 2 and torch.isfinite(got).all()
        assert relative_l1(got, dense) < 2e-2, method
        register(f"sparge_test_gpu_{method}_skip", method=method, simthreshd1=-1.0, **skipping)
        model = load(tiny_llama, f"sparge_test_gpu_{method}_skip").to("cuda", torch.bfloat16)
        sparse = logits(model, ids).float()
        assert torch.isfinite(sparse).all() and relative_l1(sparse, dense) > 3e-2, method
    # S2O and FSA on a chunk against a cache (lower right): every block visited / kept, SDPA's logits; S2O
    # stopping early changes them
    register("sparge_test_gpu_fsa_chunk", method="fsa", top_k=32)
    register("sparge_test_gpu_s2o_chunk", method="s2o", tau=0.0)
    register("sparge_test_gpu_s2o_chunk_skip", method="s2o", tau=0.2, s2o_segment=128, simthreshd1=-1.0)
    register("sparge_test_gpu_pbs_chunk", pbs_segment=256, simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None)
    chunked = {}
    for name in ("sdpa", "sparge_test_gpu_fsa_chunk", "sparge_test_gpu_s2o_chunk", "sparge_test_gpu_s2o_chunk_skip",
                 "sparge_test_gpu_pbs_chunk"):
        model = load(tiny_llama, name).to("cuda", torch.bfloat16)
        cache = dynamic_cache(model)
        logits(model, ids[:, :1400], **{CACHE: cache}, use_cache=True)
        chunked[name] = logits(model, ids[:, 1400:], **{CACHE: cache}, use_cache=True).float()
        assert torch.isfinite(chunked[name]).all()
    assert relative_l1(chunked["sparge_test_gpu_fsa_chunk"], chunked["sdpa"]) < 2e-2
    assert relative_l1(chunked["sparge_test_gpu_s2o_chunk"], chunked["sdpa"]) < 2e-2
    assert relative_l1(chunked["sparge_test_gpu_s2o_chunk_skip"], chunked["sdpa"]) > 3e-2
    assert relative_l1(chunked["sparge_test_gpu_pbs_chunk"], chunked["sdpa"]) < 2e-2  # the cache permuted
    # compiled FSA, S2O and PBS (inductor; PBS's operator also inside CUDA graphs): their operators on the same inputs
    # give the eager call's output (through a whole model, inductor's bf16 fusions move q and k enough to flip top-2
    # choices, so that is not compared)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    generator = torch.Generator("cuda").manual_seed(3)
    q, k, v = (torch.randn(1, h, 2000, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
               for h in (4, 2, 2))
    for attention, modes in ((SpargeLLMAttention(method="fsa", top_k=2), ("default",)),
                             (SpargeLLMAttention(method="s2o", tau=0.2, s2o_segment=128, simthreshd1=-1.0),
                              ("default",)),
                             (SpargeLLMAttention(pbs_segment=256, simthreshd1=-1.0, cdfthreshd=0.9),
                              ("default", "reduce-overhead"))):
        for chunk in (slice(None), slice(1500, None)):  # whole, and 500 queries (no mask: the upper-left variant)
            eager = attention(module, q[:, :, chunk], k, v, None)[0]
            for mode in modes:
                torch._dynamo.reset()
                compiled = torch.compile(lambda q, k, v: attention(module, q, k, v, None)[0], mode=mode,
                                         fullgraph=True)
                for _ in range(3):  # reduce-overhead records its graph on the first calls, then replays it
                    assert torch.equal(compiled(q[:, :, chunk], k, v), eager), (attention.method, chunk, mode)


def test_register_refuses_a_function_and_settings_together():
    """The settings were dropped without a word: the registered function kept its own."""
    function = SpargeLLMAttention(cdfthreshd=0.9)
    with pytest.raises(ValueError, match=r"not both \(got attention and \['cdfthreshd'\]\)"):
        register("sparge_test_both", function, cdfthreshd=0.5)
    with pytest.raises(ValueError, match=r"not both \(got attention and \['cdfthreshd'\]\)"):
        register("sparge_test_both", attention=function, cdfthreshd=0.5)
    assert register("sparge_test_both", function) is function


@pytest.mark.parametrize("name, value, message", [
    ("method", "bogus", "method must be one of"),  # was a KeyError inside the model's forward
    ("cdfthreshd", 2.0, r"cdfthreshd values must lie in \[0.0, 1.0\]"),
    ("min_padded_tokens", -5, "min_padded_tokens must be an int >= 0"),  # acted as 0 without a word
    ("pbs_segment", 100, "positive multiple of 64"),
    ("block_size", 48, "block_size must be 32, 64 or 128"),
    ("block_size", 64.0, "block_size must be 32, 64 or 128, got 64.0"),
    ("top_k", True, "top_k must be a positive int, got True"),
    ("top_k", 0, "top_k must be a positive int"),
    ("tau", -1.0, r"tau values must lie in \[0.0, inf\]"),  # was taken, then refused inside the forward
    ("attention_sink", "False", "attention_sink must be True or False"),  # was read by its truth
])
def test_options_set_later_are_checked(name, value, message):
    attention = SpargeLLMAttention()
    with pytest.raises(ValueError, match=message):
        setattr(attention, name, value)
    assert getattr(attention, name) == getattr(SpargeLLMAttention(), name)  # unchanged
    attention.cdfthreshd = 0.5  # a valid value is taken
    attention.method = "s2o"
    with pytest.raises(ValueError, match="pairs the key permutation"):  # checked with the other options
        attention.pbs_segment = 128
    assert (attention.cdfthreshd, attention.method, attention.pbs_segment) == (0.5, "s2o", None)
