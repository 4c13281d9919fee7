"""Random calls of the public API on a GPU, each against the float32 reference.

The grids of test_kernels.py and test_attention_hopper.py vary one axis at a time on a few shapes. Each seed
here draws one call that combines them: odd lengths up to several waves of the Hopper kernel's schedule,
either layout, bf16 or fp16, a GQA group, the Hopper kernel's head dims and the Triton kernel's others,
causal or not, N_q != N_kv, a mask of random density (broadcast over batch or heads, some rows empty) given
as a bool tensor, as a prebuilt CompactBlockMask, or not at all (dense), or the whole method on structured
inputs, the stage-2 test on or off, a non-contiguous q, and an output buffer poisoned with NaN that is
longer than the call's rows. Every check is the same: no NaN, the rows past the call untouched, relative L1
against the reference under the dtype's tolerance.

``SPARGE_GPU_RANDOM_CALLS`` sets the number of seeds (default 40), ``SPARGE_GPU_RANDOM_FIRST`` the first (default 0).
"""

import math
import os
import random

import pytest
import torch

from sparge_diffusers import (
    BLOCK_K,
    BLOCK_Q,
    block_sparse_attention,
    compact_block_mask,
    predict_block_mask,
    relative_l1,
    sparge_attention,
)
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv

from test_kernels import L1_TOL

CALLS = int(os.environ.get("SPARGE_GPU_RANDOM_CALLS", "40"))
FIRST = int(os.environ.get("SPARGE_GPU_RANDOM_FIRST", "0"))


def draw_call(seed: int) -> dict:
    """One call's settings, a pure function of ``seed``."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2, 3, 4])
    causal = rng.random() < 0.35
    q_len = rng.randint(1, 5000)
    return dict(
        entry=rng.choice(["mask", "compact", "dense", "whole"]),
        batch=rng.choice([1, 1, 2]),
        kv_heads=kv_heads,
        heads=kv_heads * rng.choice([1, 1, 2, 4, 7]),
        head_dim=rng.choice([64, 128, 128, 64, 96, 32]),
        causal=causal,
        q_len=q_len,
        kv_len=q_len if causal else rng.randint(1, 5000),
        layout=rng.choice(["HND", "NHD"]),
        dtype=rng.choice([torch.bfloat16, torch.float16]),
        density=rng.choice([0.02, 0.1, 0.3, 0.7, 1.0]),
        mask_batch=rng.choice([1, None]),  # None: one mask per batch element
        mask_heads=rng.choice([1, None]),
        empty_rows=rng.random() < 0.3,
        pvthreshd=rng.choice([None, None, 50.0, 20.0]),
        strided_q=rng.random() < 0.25,
        seed=seed,
    )


def _inputs(call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, HK, D = call["batch"], call["heads"], call["kv_heads"], call["head_dim"]
    layout, dtype = call["layout"], call["dtype"]
    if call["entry"] == "whole":  # stage 1 needs structure to select anything
        if call["causal"]:
            return llm_like_qkv(call["q_len"], batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=dtype,
                                device="cuda", seed=call["seed"], tensor_layout=layout)
        side = max(1, round(math.sqrt(call["q_len"] / 2)))
        return video_like_qkv((2, side, side), batch=B, heads=H, kv_heads=HK, head_dim=D,
                              text_tokens=call["seed"] % 100, dtype=dtype, device="cuda", seed=call["seed"],
                              tensor_layout=layout)
    g = torch.Generator(device="cuda").manual_seed(call["seed"])

    def rnd(h, n, width=D):
        shape = (B, h, n, width) if layout == "HND" else (B, n, h, width)
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    q = rnd(H, call["q_len"], 2 * D)[..., ::2] if call["strided_q"] else rnd(H, call["q_len"])
    return q, rnd(HK, call["kv_len"]), rnd(HK, call["kv_len"])


def _mask(call: dict, q_len: int, kv_len: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(call["seed"] + 1)
    shape = (call["mask_batch"] or call["batch"], call["mask_heads"] or call["heads"],
             math.ceil(q_len / BLOCK_Q), math.ceil(kv_len / BLOCK_K))
    mask = torch.rand(shape, generator=g, device="cuda") < call["density"]
    if call["empty_rows"]:
        mask[..., ::3, :] = False  # query blocks with no kept key block: zeros, never NaN
    return mask


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(FIRST, FIRST + CALLS))
def test_gpu_random_call_matches_reference(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    call = draw_call(seed)
    q, k, v = _inputs(call)
    layout, causal, pv = call["layout"], call["causal"], call["pvthreshd"]
    seq_dim = 2 if layout == "HND" else 1
    q_len, kv_len = q.shape[seq_dim], k.shape[seq_dim]
    big_shape = list(q.shape)
    big_shape[seq_dim] += 7
    big = torch.full(big_shape, float("nan"), dtype=q.dtype, device="cuda")
    out = big.narrow(seq_dim, 0, q_len)
    common = dict(is_causal=causal, tensor_layout=layout)

    if call["entry"] == "whole":
        result = sparge_attention(q, k, v, pvthreshd=pv, out=out, **common)
        mask = predict_block_mask(q, k, **common)
        ref_mask = predict_block_mask(q, k, backend="reference", **common)
        # the tf32x3 compressed scores may tip a block lying exactly at the TopCdf cut
        assert (mask != ref_mask).float().mean() <= 0.01, call
    else:
        mask = None if call["entry"] == "dense" else _mask(call, q_len, kv_len)
        given = compact_block_mask(mask, q, k, **common) if call["entry"] == "compact" else mask
        result = block_sparse_attention(q, k, v, given, pvthreshd=pv, out=out, **common)
    # the float32 reference, on the GPU for speed (TF32 off: torch's default for float32 matmuls)
    assert not torch.backends.cuda.matmul.allow_tf32
    ref = block_sparse_attention(q, k, v, mask, pvthreshd=pv, backend="reference", **common)

    assert result.data_ptr() == out.data_ptr(), call
    assert not torch.isnan(result).any(), call
    assert torch.isnan(big.narrow(seq_dim, q_len, 7)).all(), ("rows past the call were written", call)
    if ref.abs().sum() == 0:  # every kept row empty: an all-zero output, which relative L1 cannot measure
        assert (result == 0).all(), call
    else:
        assert relative_l1(result, ref) < L1_TOL[call["dtype"]], call
