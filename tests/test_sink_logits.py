"""Learned attention sinks (``sink_logits``: one logit per query head joining each row's softmax with no value
vector, gpt-oss's ``sinks``). The reference against the definition written here (transformers' eager formula of
gpt-oss: the sink as one more logit column, dropped after the softmax), the Triton kernels in the interpreter against
the reference, and the input checks."""

import math

import pytest
import torch

from sparge_diffusers import (block_sparse_attention, relative_l1, s2o_attention, s2o_attention_op, sparge_attention,
                              sparge_attention_op, selected_block_attention, selected_block_attention_op)
from sparge_diffusers.kernels._inputs import check_attention_inputs
from test_kernels import L1_TOL, exact_attention, make_qkv, poisoned_like
from test_sliding_window import random_mask, window_mask

# one head without a sink (-inf), one whose sink outweighs every key (100: rows almost zero, never NaN), two ordinary
SINKS = [0.5, -math.inf, 100.0, -2.0]
# The GPU cases' rows see 500-4600 keys, whose mass (about e^0.5 per key) drowns a sink of 0.5 or -2 there: add
# sinks of 6-9, which weigh about as much as the keys (a wrong log2(e) factor shows), and -100, so far below the row
# max that rescaling by the smaller of the two instead of the larger overflows
GPU_SINKS = SINKS + [6.0, 7.5, 9.0, -100.0]

# Nq, Nkv, causal, variant, window: odd lengths, N_q != N_kv both ways, a chunk against a cache, a window
CASES = [
    (200, 333, False, None, None),
    (300, 300, True, None, None),
    (77, 390, True, "lower_right", None),
    (300, 300, True, None, 100),
]


def allowed_keys(nq, nkv, causal, variant, window):
    if not causal:
        return torch.ones(nq, nkv, dtype=torch.bool)
    return window_mask(nq, nkv, variant, window if window is not None else nkv + nq)


@pytest.mark.parametrize("Nq,Nkv,causal,variant,window", CASES)
def test_reference_with_every_block_equals_the_definition(Nq, Nkv, causal, variant, window):
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, 64, torch.float32, "HND", seed=Nq + Nkv)
    sinks = torch.tensor(SINKS)
    kw = dict(is_causal=causal, causal_variant=variant, sliding_window=window)
    out = block_sparse_attention(q, k, v, None, sink_logits=sinks, **kw)
    expected = exact_attention(q, k, v, allowed_keys(Nq, Nkv, causal, variant, window), sinks=sinks)
    assert relative_l1(out, expected) < 1e-5
    without = block_sparse_attention(q, k, v, None, **kw)
    assert relative_l1(without, expected) > 0.05, "the sinks must change the output for this test to mean anything"
    assert out[:, 2].abs().max() < 1e-20, "a sink of 100 takes all of its head's weight"
    assert torch.equal(out[:, 1], without[:, 1]), "a sink of -inf is no sink"


# stage 2's gap (m_local - m_new) of a row that has seen no key yet is -inf - -inf in the interpreter's numpy, then
# discarded by the kernel's where (test_sliding_window has the same)
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nkv,causal,variant,window", CASES)
def test_kernel_matches_reference_with_sinks(Nq, Nkv, causal, variant, window, dtype, layout):
    """A random mask (query block 0 empty in every head, the -inf sink's too), the dense call and the mask with
    stage 2's test, against the reference, sink logits in float32 and in the inputs' dtype; every element written,
    no NaN."""
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, 64, dtype, layout, seed=Nq + 7)
    shape = check_attention_inputs(q, k, v, tensor_layout=layout, is_causal=causal, causal_variant=variant,
                                   sliding_window=window)
    kw = dict(is_causal=causal, causal_variant=variant, sliding_window=window, tensor_layout=layout)
    drawn = random_mask(shape, 0.5, Nq)
    drawn[0, :, 0] = False  # rows that see no key: zeros, whatever the sink (-inf too: nothing to rescale)
    for mask, pvthreshd, sink_dtype in ((drawn, None, torch.float32), (None, None, dtype), (drawn, 4.0, dtype)):
        sinks = torch.tensor(SINKS).to(sink_dtype)
        ref = block_sparse_attention(q, k, v, mask, backend="reference", pvthreshd=pvthreshd, sink_logits=sinks, **kw)
        out = block_sparse_attention(q, k, v, mask, backend="triton", out=poisoned_like(q), pvthreshd=pvthreshd,
                                     sink_logits=sinks, **kw)
        assert not torch.isnan(out).any()
        assert relative_l1(out.float(), ref.float()) < L1_TOL[dtype] / 2
        if mask is not None:
            rows = out[0, :128] if layout == "NHD" else out[0, :, :128]
            assert not rows.any()


def test_whole_method_with_sinks_and_its_operator():
    """sparge_attention keeping every block equals the definition, through the Triton kernels (interpreter), the
    reference and the custom operator; a strided sink tensor is read as its values."""
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, torch.float16, "HND", seed=5)
    sinks = torch.tensor([[x, 0.0] for x in SINKS])[:, 0]  # stride 2
    expected = exact_attention(q, k, v, allowed_keys(300, 300, True, None, None), sinks=sinks)
    kw = dict(is_causal=True, cdfthreshd=1.0, pvthreshd=None, sink_logits=sinks)
    for out in (sparge_attention(q, k, v, backend="triton", **kw), sparge_attention(q, k, v, **kw),
                sparge_attention_op(q, k, v, **kw)):
        assert relative_l1(out.float(), expected) < L1_TOL[torch.float16]
    out, stats = sparge_attention(q, k, v, is_causal=True, simthreshd1=-1.0, cdfthreshd=0.5, sink_logits=sinks,
                                  backend="triton", return_sparsity=True)
    ref, ref_stats = sparge_attention(q, k, v, is_causal=True, simthreshd1=-1.0, cdfthreshd=0.5, sink_logits=sinks,
                                      backend="reference", return_sparsity=True)
    assert stats.sparsity > 0 and stats.sparsity == ref_stats.sparsity, "the sinks change no block decision"
    assert relative_l1(out.float(), ref.float()) < L1_TOL[torch.float16]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
def test_s2o_walk_with_sinks_matches_reference(causal, layout):
    """S2O's ordered walk with sinks: the Triton walk (interpreter) against the reference, with stops taken (the same
    blocks visited: the stop test weighs the keys' normaliser only) and with every block visited, which equals the
    definition; through the operator too."""
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, torch.float16, layout, seed=11)
    sinks = torch.tensor(SINKS)
    for tau, check_every in ((0.5, 1), (0.0, 16)):
        kw = dict(is_causal=causal, tau=tau, segment=128, check_every=check_every, simthreshd1=-1.0,
                  tensor_layout=layout, sink_logits=sinks, return_sparsity=True)
        ref, ref_stats = s2o_attention(q, k, v, backend="reference", **kw)
        out, stats = s2o_attention(q, k, v, backend="triton", out=poisoned_like(q), **kw)
        assert not torch.isnan(out).any() and relative_l1(out.float(), ref.float()) < L1_TOL[torch.float16]
        torch.testing.assert_close(stats.qk_skipped, ref_stats.qk_skipped)
        if tau == 0.0:
            qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
            expected = exact_attention(qh, kh, vh, allowed_keys(300, 300, causal, None, None), sinks=sinks)
            expected = expected if layout == "HND" else expected.transpose(1, 2)
            assert relative_l1(out.float(), expected) < L1_TOL[torch.float16]
            op = s2o_attention_op(q, k, v, **{name: value for name, value in kw.items() if name != "return_sparsity"})
            assert relative_l1(op.float(), expected) < L1_TOL[torch.float16]
        else:
            assert stats.sparsity > 0, "the walk must stop somewhere for this case to mean anything"


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
def test_fsa_merge_adds_the_sinks(causal, layout, monkeypatch):
    """FSA's per-query selection with sinks: the KV-outer kernel and its merge (interpreter) against the reference on a
    random selection (-1s, repeats, rows that see no key), and with every block selected against the definition;
    through the operator too."""
    from sparge_diffusers.kernels import selected as selected_module

    monkeypatch.setattr(selected_module, "QUERY_CHUNK", 64)  # blocks split over several work items
    q, k, v = make_qkv(1, 4, 2, 200, 200, 64, torch.float16, layout, seed=13)
    sinks = torch.tensor(SINKS)
    g = torch.Generator().manual_seed(3)
    kw = dict(block_size=64, is_causal=causal, tensor_layout=layout, sink_logits=sinks)
    for selection in (torch.randint(-1, 4, (1, 2, 200, 3), generator=g, dtype=torch.int32),
                      torch.arange(4, dtype=torch.int32).expand(1, 2, 200, 4)):
        ref = selected_block_attention(q, k, v, selection, backend="reference", **kw)
        out = selected_block_attention(q, k, v, selection, backend="triton", out=poisoned_like(q), **kw)
        assert not torch.isnan(out).any() and relative_l1(out.float(), ref.float()) < L1_TOL[torch.float16]
    qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
    expected = exact_attention(qh, kh, vh, allowed_keys(200, 200, causal, None, None), sinks=sinks)
    expected = expected if layout == "HND" else expected.transpose(1, 2)
    assert relative_l1(out.float(), expected) < L1_TOL[torch.float16]
    assert relative_l1(selected_block_attention_op(q, k, v, selection, **kw).float(), expected) < L1_TOL[torch.float16]


def test_keeping_every_block_skips_stage_1(monkeypatch):
    """cdfthreshd=1 keeps every visible block, so sparge_attention runs the dense walk without stage 1: the output
    and statistics of stage 1's all-kept mask, with or without a window; a bad cdfthreshd still raises."""
    import sparge_diffusers.kernels.api as api

    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, torch.float16, "HND", seed=9)
    for window in (None, 100):
        kw = dict(is_causal=True, sliding_window=window, simthreshd1=0.6, backend="triton")
        with_stage_1, stats_1 = api.block_sparse_attention(
            q, k, v, api.predict_block_mask(q, k, cdfthreshd=1.0, **kw), return_sparsity=True, pvthreshd=50, **{
                name: value for name, value in kw.items() if name != "simthreshd1"})
        monkeypatch.setattr(api, "_predict_checked", lambda *a, **kw: pytest.fail("stage 1 ran"))
        out, stats = sparge_attention(q, k, v, cdfthreshd=[1.0] * 4, return_sparsity=True, **kw)
        monkeypatch.undo()
        assert relative_l1(out.float(), with_stage_1.float()) < 1e-3
        assert stats.sparsity == stats_1.sparsity == 0 and stats.dense_blocks == stats_1.dense_blocks
    with pytest.raises(ValueError, match="cdfthreshd"):
        sparge_attention(q, k, v, cdfthreshd=1.5)


def test_bad_sink_logits_raise():
    q, k, v = make_qkv(1, 4, 2, 100, 100, 64, torch.float16, "HND", seed=0)
    for bad, message in ((torch.zeros(2), r"shape \(4,\)"), (torch.zeros(1, 4), r"shape \(4,\)"),
                         (torch.zeros(4, dtype=torch.int32), "float32, float16 or bfloat16"),
                         ([0.0] * 4, "must be a torch.Tensor"), (torch.zeros(4, device="meta"), "is on meta")):
        with pytest.raises(ValueError, match=message):
            sparge_attention(q, k, v, sink_logits=bad)
        with pytest.raises(ValueError, match=message):
            block_sparse_attention(q, k, v, None, sink_logits=bad)
    learned = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="sink_logits requires grad"):
        sparge_attention(q, k, v, sink_logits=learned)
    with torch.no_grad():
        sparge_attention(q, k, v, sink_logits=learned)  # inference: fine
    with pytest.raises(ValueError, match="dense or sink_logits"):
        sparge_attention_op(q, k, v, sink_logits=torch.zeros(4), dense=torch.tensor(False))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Nq,Nkv,causal,variant,window", [(3000, 3000, False, None, None),
                                                          (1000, 4567, True, "lower_right", None),
                                                          (2049, 2049, True, None, 512)])
def test_gpu_kernels_match_reference_with_sinks(Nq, Nkv, causal, variant, window, D, monkeypatch):
    """On a GPU: the Hopper kernel (where it runs) and the Triton kernel, on a random mask and on every block,
    against the float32 reference; the whole method keeping every block against the definition."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sparge_diffusers.kernels import attention_hopper

    q, k, v = (t.cuda() for t in make_qkv(1, 8, 2, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + D))
    sinks = torch.tensor(GPU_SINKS, device="cuda", dtype=torch.bfloat16)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal, causal_variant=variant,
                                   sliding_window=window)
    kw = dict(is_causal=causal, causal_variant=variant, sliding_window=window, sink_logits=sinks)
    drawn = random_mask(shape, 0.3, Nq)
    drawn[0, :, 1] = False  # query block 1 sees no key in any head, the -inf sinks' too: zeros
    for mask in (drawn.cuda(), None):
        ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                                     backend="reference", **{**kw, "sink_logits": sinks.cpu()})
        for forced in (None, False):  # as chosen (the Hopper kernel on an H100), then the Triton kernel
            monkeypatch.setattr(attention_hopper, "OVERRIDE", forced)
            out = block_sparse_attention(q, k, v, mask, out=poisoned_like(q), **kw)
            assert not torch.isnan(out).any()
            assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16]
            assert mask is None or not out[0, :, 128:256].any()
    monkeypatch.setattr(attention_hopper, "OVERRIDE", None)
    out = sparge_attention(q, k, v, cdfthreshd=1.0, pvthreshd=None, **kw)
    expected = exact_attention(q, k, v, allowed_keys(Nq, Nkv, causal, variant, window).cuda(), sinks=sinks)
    assert relative_l1(out.float(), expected) < L1_TOL[torch.bfloat16]
    if window is None:  # S2O's walks (the Gluon one on an H100, then the Triton one) visiting every block
        from sparge_diffusers.kernels import s2o_hopper

        for forced in (None, False):
            monkeypatch.setattr(s2o_hopper, "OVERRIDE", forced)
            out = s2o_attention(q, k, v, is_causal=causal, causal_variant=variant, tau=0.0, sink_logits=sinks,
                                out=poisoned_like(q))
            assert relative_l1(out.float(), expected) < L1_TOL[torch.bfloat16], forced
        every_block = torch.arange(math.ceil(Nkv / 64), dtype=torch.int32, device="cuda").expand(1, 2, Nq, -1)
        out = selected_block_attention(q, k, v, every_block, is_causal=causal, causal_variant=variant,
                                       sink_logits=sinks, out=poisoned_like(q))  # FSA's kernels and merge
        assert relative_l1(out.float(), expected) < L1_TOL[torch.bfloat16]
