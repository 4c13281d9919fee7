"""Logit soft-capping (``softcap=c``: the scores c * tanh(s / c) before the softmax, Gemma 2's
``attn_logit_softcapping``). The reference against the definition written here, the Triton kernels (interpreter)
against the reference, stage 1 with capped compressed scores, and the input checks."""

import math

import pytest
import torch

from sparge_diffusers import (block_sparse_attention, predict_block_mask, relative_l1, sparge_attention,
                              sparge_attention_op)
from sparge_diffusers.kernels._inputs import check_attention_inputs
from sparge_diffusers.testing import llm_like_qkv
from test_kernels import L1_TOL, assert_stage1_agrees, exact_attention, make_qkv, poisoned_like
from test_sink_logits import allowed_keys
from test_sliding_window import random_mask

CAP = 1.5  # small against these scores (std ~1 at D = 64), so capping changes the output

# Nq, Nkv, causal, variant, window
CASES = [
    (200, 333, False, None, None),
    (300, 300, True, None, None),
    (77, 390, True, "lower_right", None),
    (300, 300, True, None, 100),
]


@pytest.mark.parametrize("Nq,Nkv,causal,variant,window", CASES)
def test_reference_with_every_block_equals_the_definition(Nq, Nkv, causal, variant, window):
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, 64, torch.float32, "HND", seed=Nq + Nkv)
    kw = dict(is_causal=causal, causal_variant=variant, sliding_window=window)
    out = block_sparse_attention(q, k, v, None, softcap=CAP, **kw)
    expected = exact_attention(q, k, v, allowed_keys(Nq, Nkv, causal, variant, window), softcap=CAP)
    assert relative_l1(out, expected) < 1e-5
    assert relative_l1(block_sparse_attention(q, k, v, None, **kw), expected) > 0.05, "the cap must matter here"


# stage 2's gap of a row that has seen no key yet is -inf - -inf in the interpreter's numpy (test_sliding_window)
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nkv,causal,variant,window", CASES)
def test_kernel_matches_reference_with_a_cap(Nq, Nkv, causal, variant, window, dtype, layout):
    """A random mask (one row empty), the dense call and the mask with stage 2's test, against the reference; every
    element written, no NaN."""
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, 64, dtype, layout, seed=Nq + 3)
    shape = check_attention_inputs(q, k, v, tensor_layout=layout, is_causal=causal, causal_variant=variant,
                                   sliding_window=window)
    kw = dict(is_causal=causal, causal_variant=variant, sliding_window=window, tensor_layout=layout, softcap=CAP)
    drawn = random_mask(shape, 0.5, Nq)
    drawn[0, 0, 0] = False
    for mask, pvthreshd in ((drawn, None), (None, None), (drawn, 4.0)):
        ref = block_sparse_attention(q, k, v, mask, backend="reference", pvthreshd=pvthreshd, **kw)
        out = block_sparse_attention(q, k, v, mask, backend="triton", out=poisoned_like(q), pvthreshd=pvthreshd, **kw)
        assert not torch.isnan(out).any()
        assert relative_l1(out.float(), ref.float()) < L1_TOL[dtype] / 2


@pytest.mark.parametrize("causal", [False, True])
def test_stage_1_caps_the_compressed_scores(causal):
    """Stage 1's kernel equals its reference with the cap; the cap flattens the compressed scores' softmax, so TopCdf
    keeps more blocks at the same tau; the whole method keeping every block equals the definition (also through the
    operator)."""
    q, k, v = llm_like_qkv(700, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, seed=2)
    kw = dict(is_causal=causal, simthreshd1=-1.0, cdfthreshd=0.8)
    capped = predict_block_mask(q, k, backend="triton", softcap=2.0, **kw)
    assert torch.equal(capped, predict_block_mask(q, k, backend="reference", softcap=2.0, **kw))
    assert capped.sum() > predict_block_mask(q, k, backend="triton", **kw).sum()
    expected = exact_attention(q, k, v, allowed_keys(700, 700, causal, None, None), softcap=2.0)
    for out in (sparge_attention(q, k, v, is_causal=causal, cdfthreshd=1.0, pvthreshd=None, softcap=2.0,
                                 backend="triton"),
                sparge_attention_op(q, k, v, is_causal=causal, cdfthreshd=1.0, pvthreshd=None, softcap=2.0)):
        assert relative_l1(out.float(), expected) < L1_TOL[torch.float16]


def test_bad_caps_raise():
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64, torch.float16, "HND", seed=0)
    for bad in (0, -1.0, math.inf, math.nan, True, "50"):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            sparge_attention(q, k, v, softcap=bad)
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            block_sparse_attention(q, k, v, None, softcap=bad)
    with pytest.raises(ValueError, match="dense or softcap"):
        sparge_attention_op(q, k, v, softcap=30.0, dense=torch.tensor(False))


def test_compiled_gpu_kernels_take_tanh_from_the_fast_instruction(monkeypatch):
    """``softcap_mode``: tanh.approx.f32 only where the attention kernel compiles for an NVIDIA GPU of sm75 or newer;
    the exp2 form on CPU tensors (the interpreter), under TRITON_INTERPRET, on older GPUs and on ROCm."""
    from sparge_diffusers.kernels import attention

    fast, exact, cuda = attention.SOFTCAP_FAST.value, attention.SOFTCAP_EXACT.value, torch.device("cuda", 0)
    assert attention.softcap_mode(None, cuda) == 0 and 0 not in (fast, exact) and fast != exact
    assert attention.softcap_mode(30.0, torch.device("cpu")) == exact
    monkeypatch.setattr(attention, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(attention, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert attention.softcap_mode(30.0, cuda) == fast
    monkeypatch.setattr(attention, "device_capability", lambda index: (7, 5))  # the first with the instruction
    assert attention.softcap_mode(30.0, cuda) == fast
    monkeypatch.setattr(attention, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(attention, "interpreting", lambda: True)
    assert attention.softcap_mode(30.0, cuda) == exact
    monkeypatch.setattr(attention, "interpreting", lambda: False)
    monkeypatch.setattr(attention, "device_capability", lambda index: (7, 0))
    assert attention.softcap_mode(30.0, cuda) == exact
    monkeypatch.setattr(attention, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert attention.softcap_mode(30.0, cuda) == exact


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Nq,Nkv,causal,variant,window", [(3000, 3000, False, None, None),
                                                          (1000, 4567, True, "lower_right", None),
                                                          (2049, 2049, True, None, 512)])
def test_gpu_kernels_match_reference_with_a_cap(Nq, Nkv, causal, variant, window, D, monkeypatch):
    """On a GPU: the Hopper kernel (where it runs) and the Triton kernel, on a random mask and on every block,
    against the float32 reference; stage 1's kernel against its reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sparge_diffusers.kernels import attention, attention_hopper

    q, k, v = (t.cuda() for t in make_qkv(1, 8, 2, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + D))
    assert attention.softcap_mode(CAP, q.device) == attention.SOFTCAP_FAST.value  # the instruction is what is tested
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal, causal_variant=variant,
                                   sliding_window=window)
    kw = dict(is_causal=causal, causal_variant=variant, sliding_window=window, softcap=CAP)
    for mask in (random_mask(shape, 0.3, Nq).cuda(), None):
        ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                                     backend="reference", **kw)
        for forced in (None, False):  # as chosen (the Hopper kernel on an H100), then the Triton kernel
            monkeypatch.setattr(attention_hopper, "OVERRIDE", forced)
            out = block_sparse_attention(q, k, v, mask, out=poisoned_like(q), **kw)
            assert not torch.isnan(out).any()
            assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16]
    predicted = predict_block_mask(q, k, simthreshd1=0.6, cdfthreshd=0.8, **kw).cpu()
    # tf32x3 against float32 compressed scores: only a decision that sits on a threshold may flip
    assert_stage1_agrees(predicted, q.cpu(), k.cpu(), theta=torch.full((8,), 0.6), tau=torch.full((8,), 0.8),
                         causal=causal, layout="HND", causal_variant=variant, sliding_window=window, softcap=CAP)
