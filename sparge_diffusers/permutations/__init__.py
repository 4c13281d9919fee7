"""Token permutations for visual tokens (SpargeAttn Sec. 3.7, appendix A.1). Knows nothing of the kernels.

Attention is invariant to a permutation of the key/value tokens and equivariant to one of the queries, so
reordering the visual tokens of a (T, H, W) grid so that neighbours in space-time share a block raises
block self-similarity, and with it the sparsity SpargeAttn finds, without changing the exact result.

    perm = visual_token_permutation((13, 30, 45), "hilbert", text_before=226, device="cuda")
    attention = permuted(sparge_attention, perm)            # same signature, output in the original order
    out = attention(q, k, v, tensor_layout="NHD")

For causal attention, PBS-Attn's segmented key order (``segmented_key_order``) reorders keys only within
aligned segments; ``sparge_diffusers.llm.pbs_sparge_attention`` composes it with the kernels.
"""

from .orders import ORDERS, TokenPermutation, grid_order, permuted, visual_token_permutation
from .segmented import gather_keys, last_block_key_importance, segmented_key_order
from .similarity import block_self_similarity

__all__ = [
    "ORDERS",
    "TokenPermutation",
    "block_self_similarity",
    "gather_keys",
    "last_block_key_importance",
    "segmented_key_order",
    "grid_order",
    "permuted",
    "visual_token_permutation",
]
