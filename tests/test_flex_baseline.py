"""The benchmarks' FlexAttention baseline (benchmarks/attention.py ``flex_fn``, also used by chunked_prefill.py,
pbs.py and tile_cost.py) computes what our kernel computes under the same block mask (CPU: FlexAttention compiled
for the CPU, our functions on the float32 reference). Every "ours vs FlexAttention" ratio rests on this: a BlockMask
that kept other blocks, or masked other elements, would time other work."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from attention import flex_fn, random_block_mask  # noqa: E402  (a broken import must fail here, not skip)

from sparge_diffusers import block_sparse_attention, predict_block_mask, relative_l1  # noqa: E402
from sparge_diffusers.kernels import PermutedKeys  # noqa: E402
from sparge_diffusers.kernels._inputs import check_attention_inputs  # noqa: E402
from sparge_diffusers.permutations import gather_keys, last_block_key_importance, segmented_key_order  # noqa: E402

pytest.importorskip("torch.nn.attention.flex_attention")


def qkv(q_len: int, kv_len: int, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, q_len, 64, generator=g), torch.randn(1, kv_heads, kv_len, 64, generator=g),
            torch.randn(1, kv_heads, kv_len, 64, generator=g))


@pytest.mark.parametrize("causal", [False, True])
def test_flex_baseline_equals_ours_under_the_same_mask(causal):
    """GQA, an odd length, a random mask of half the visible blocks, and one head's second query block empty (its
    rows are zeros in both)."""
    q, k, v = qkv(300, 300)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal)
    mask = random_block_mask(1, 4, shape.q_blocks, shape.k_blocks, 0.5, causal, 300, "cpu", seed=1)
    mask[0, 2, 1] = False
    ours = block_sparse_attention(q, k, v, mask, is_causal=causal)
    flex = flex_fn(q, k, v, mask, causal, shape)()
    assert torch.isfinite(flex).all() and (flex[0, 2, 128:256] == 0).all()
    assert relative_l1(flex, ours) < 1e-5
    dense = block_sparse_attention(q, k, v, None, is_causal=causal)
    assert relative_l1(ours, dense) > 0.05  # the mask matters: a baseline ignoring it would fail above


def test_flex_baseline_equals_ours_on_a_chunk_against_a_longer_prefix():
    """Lower-right causal (chunked_prefill.py): 100 queries after 200 cached keys."""
    q, k, v = qkv(100, 300)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=True, causal_variant="lower_right")
    mask = random_block_mask(1, 4, shape.q_blocks, shape.k_blocks, 0.5, True, 300, "cpu", seed=2, q_len=100,
                             causal_offset=shape.causal_offset)
    ours = block_sparse_attention(q, k, v, mask, is_causal=True, causal_variant="lower_right")
    flex = flex_fn(q, k, v, mask, True, shape)()
    assert relative_l1(flex, ours) < 1e-5


def test_flex_baseline_equals_ours_on_permuted_keys():
    """PBS-Attn's segmented permutation (pbs.py): keys sorted within segments of 128, the mask predicted on them, the
    causal test on each key's original position."""
    q, k, v = qkv(300, 300)
    order = segmented_key_order(last_block_key_importance(q, k), 128)
    kk, vv, pk = gather_keys(k, order), gather_keys(v, order), PermutedKeys(order.to(torch.int32), 128)
    shape = check_attention_inputs(q, kk, vv, tensor_layout="HND", is_causal=True)
    mask = predict_block_mask(q, kk, is_causal=True, permuted_keys=pk, cdfthreshd=0.5)
    assert not mask[..., :shape.k_blocks].all()
    ours = block_sparse_attention(q, kk, vv, mask, is_causal=True, permuted_keys=pk)
    flex = flex_fn(q, kk, vv, mask, True, shape, pk.positions, pk.segment)()
    assert relative_l1(flex, ours) < 1e-5
