"""Triton sparse attention kernels (SpargeAttn) and their float32 references. Knows nothing of diffusers."""

from ._inputs import BLOCK_K, BLOCK_Q, PermutedKeys
from .compact import CompactBlockMask, compact_block_mask
from .api import block_sparse_attention, predict_block_mask, relative_l1, s2o_attention, sparge_attention
from .library import s2o_attention_op, select_key_blocks_op, selected_block_attention_op, sparge_attention_op
from .s2o import VisitOrder, s2o_visit_order
from .block_selection import select_key_blocks
from .selected import SelectionIndex, build_selection_index, selected_block_attention, selection_sparsity
from .stats import SparsityStats

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "CompactBlockMask",
    "PermutedKeys",
    "compact_block_mask",
    "SparsityStats",
    "block_sparse_attention",
    "predict_block_mask",
    "relative_l1",
    "s2o_attention",
    "s2o_attention_op",
    "s2o_visit_order",
    "SelectionIndex",
    "build_selection_index",
    "select_key_blocks",
    "select_key_blocks_op",
    "selected_block_attention",
    "selected_block_attention_op",
    "selection_sparsity",
    "VisitOrder",
    "sparge_attention",
    "sparge_attention_op",
]
