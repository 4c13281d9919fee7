"""sparge-diffusers: training-free sparse attention (SpargeAttn) in Triton for diffusion transformers."""

from .kernels import (
    BLOCK_K,
    BLOCK_Q,
    SparsityStats,
    block_sparse_attention,
    predict_block_mask,
    relative_l1,
    sparge_attention,
)

__version__ = "0.1.0"

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "SparsityStats",
    "block_sparse_attention",
    "predict_block_mask",
    "relative_l1",
    "sparge_attention",
]
