"""Causal attention with a sliding window (``sliding_window=W``: the query at causal position p sees keys
p - W + 1 .. p). Triton kernels run in the interpreter against the float32 reference, and the reference against
SDPA under an element-wise mask written here from the definition (not from the package)."""

import math

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import (BLOCK_K, BLOCK_Q, PermutedKeys, block_sparse_attention, compact_block_mask,
                              predict_block_mask, relative_l1, sparge_attention, sparge_attention_op)
from sparge_diffusers.kernels._inputs import check_attention_inputs, key_blocks_needing_masking
from sparge_diffusers.kernels.attention import block_mask_to_index
from sparge_diffusers.kernels.stats import dense_block_count
from sparge_diffusers.testing import llm_like_qkv
from test_kernels import L1_TOL, make_qkv, poisoned_like

# Nq, Nkv, variant, window: windows under one block, of one block, across block edges, wider than the sequence;
# chunks whose offset is no multiple of a block; a window of one key (each query sees only itself); rows whose walk
# holds blocks cut by the window, whole blocks and the diagonal (700 / 400); more queries than keys under either
# variant (upper left: rows past the last key, whose windows start past the last key's window; lower right: rows
# before the first key); upper left with query blocks whose windows start between the last key and the padded end of
# its ragged block: no row of them sees a key, and until session 78 every kernel and the reference counted that block
# as visible (walked fully masked, and one dense block too many in the statistics). Window 157 puts row 256's window
# start at key 100, the first past the last key (99), so a rule off by one or two keys at the ragged end fails too
CASES = [
    (700, 700, None, 400),
    (300, 300, None, 100),
    (300, 300, None, 64),
    (333, 333, None, 1),
    (260, 260, None, 1000),
    (200, 457, "lower_right", 129),
    (77, 390, "lower_right", 200),
    (700, 500, "upper_left", 300),
    (450, 300, "lower_right", 100),
    (400, 100, "upper_left", 157),
]


def window_mask(nq: int, nkv: int, variant: str | None, window: int) -> torch.Tensor:
    """(Nq, Nkv) bool: query i sees key j, from the definitions of the causal variants and of the window."""
    offset = nkv - nq if variant == "lower_right" else 0
    position = torch.arange(nq)[:, None] + offset
    key = torch.arange(nkv)[None, :]
    return (key <= position) & (key > position - window)


def blocks_seen(allowed: torch.Tensor, key_block: int = BLOCK_K) -> torch.Tensor:
    """(q blocks, k blocks) bool from an element-wise (Nq, Nkv) mask: the blocks holding a pair it allows (key
    blocks of ``key_block`` keys: PBS-Attn's segments, say)."""
    nq, nkv = allowed.shape
    q_blocks, k_blocks = math.ceil(nq / BLOCK_Q), math.ceil(nkv / key_block)
    padded = allowed.new_zeros(q_blocks * BLOCK_Q, k_blocks * key_block)
    padded[:nq, :nkv] = allowed
    return padded.view(q_blocks, BLOCK_Q, k_blocks, key_block).any(3).any(1)


def exact(q, k, v, allowed):
    """float32 SDPA under ``allowed`` (HND, GQA), rows that see no key zero."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, 1),
                                         v.float().repeat_interleave(group, 1), attn_mask=allowed)
    return torch.where(allowed.any(-1)[:, None], out, 0.0)


def random_mask(shape, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape.batch, shape.heads, shape.q_blocks, shape.k_blocks, generator=g) < density


@pytest.mark.parametrize("Nq,Nkv,variant,window", CASES)
def test_reference_with_every_block_equals_sdpa_under_the_window(Nq, Nkv, variant, window):
    q, k, v = make_qkv(1, 4, 2, Nq, Nkv, 64, torch.float32, "HND", seed=Nq + window)
    out = block_sparse_attention(q, k, v, None, is_causal=True, causal_variant=variant, sliding_window=window)
    ref = exact(q, k, v, window_mask(Nq, Nkv, variant, window))
    assert relative_l1(out, ref) < 1e-5


# stage 2's gap (m_local - m_new) of a row that has seen no key yet is -inf - -inf in the interpreter's numpy, then
# discarded by the kernel's where (a window of one key leaves most rows so in most tiles)
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nkv,variant,window", CASES)
def test_kernel_matches_reference_with_a_window(Nq, Nkv, variant, window, dtype, layout):
    """A random mask, the dense call (every block) and the mask with stage 2's test, against the reference; every
    element written."""
    q, k, v = make_qkv(2, 4, 2, Nq, Nkv, 64, dtype, layout, seed=Nq + Nkv + window)
    shape = check_attention_inputs(q, k, v, tensor_layout=layout, is_causal=True, causal_variant=variant,
                                   sliding_window=window)
    kw = dict(is_causal=True, causal_variant=variant, sliding_window=window, tensor_layout=layout)
    drawn = random_mask(shape, 0.5, Nq)
    for mask, pvthreshd in ((drawn, None), (None, None), (drawn, 4.0)):
        ref = block_sparse_attention(q, k, v, mask, backend="reference", pvthreshd=pvthreshd, **kw)
        out = block_sparse_attention(q, k, v, mask, backend="triton", out=poisoned_like(q), pvthreshd=pvthreshd, **kw)
        assert not torch.isnan(out).any()
        assert relative_l1(out.float(), ref.float()) < L1_TOL[dtype] / 2


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_block_starting_one_key_before_the_last_rows_window_is_masked(backend):
    """Window 191: query block 1 (positions 128-255) and key block 1 (keys 64-127) are neither diagonal nor wholly
    inside every row's window: the last row (255) sees keys 65-255, so key 64, the block's first, must be masked
    element by element. Key 64 is made to dominate row 255's scores, so attending it would change the row whole
    (a relative L1 over all rows would hide one key of one row)."""
    g = torch.Generator().manual_seed(191)
    q, k, v = (torch.randn(1, 1, 256, 64, generator=g) for _ in range(3))
    k[0, 0, 64] = q[0, 0, 255] * 4.0  # score ~ 4 * |q|^2 / 8 = 32: weight ~1 if seen
    q, k, v = q.half(), k.half(), v.half()
    out = block_sparse_attention(q, k, v, None, is_causal=True, sliding_window=191, backend=backend,
                                 out=poisoned_like(q)).float()
    allowed = window_mask(256, 256, None, 191)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed)
    assert (out - exact).abs().max() < 2e-2


# window 191: key block 1 starts one key before the window of query block 1's last row (as in the test above)
@pytest.mark.parametrize("Nq,Nkv,variant,window", CASES + [(256, 256, None, 191)])
def test_compacted_walk_puts_the_masked_blocks_last_and_drops_those_outside_the_window(Nq, Nkv, variant, window):
    """The kernels take the first n_full blocks of a row without element masking: each of them must be wholly
    inside every row's window; the rest, each cut by the window or the diagonal, follow; blocks wholly outside
    every row's window are not in the walk."""
    q, k, _ = make_qkv(1, 2, 2, Nq, Nkv, 64, torch.float16, "HND", seed=1)
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=True, causal_variant=variant,
                                   sliding_window=window)
    mask = random_mask(shape, 0.7, Nkv)
    index, count, n_full = block_mask_to_index(mask, shape, True)
    allowed = window_mask(Nq, Nkv, variant, window)
    needs_masking = key_blocks_needing_masking(shape.q_blocks, shape.k_blocks, Nkv, torch.device("cpu"),
                                               is_causal=True, q_len=Nq, causal_offset=shape.causal_offset,
                                               sliding_window=window)
    for h in range(2):
        for i in range(shape.q_blocks):
            rows = allowed[i * BLOCK_Q:(i + 1) * BLOCK_Q]
            walk = index[0, h, i, :count[0, h, i]].tolist()
            expected = [j for j in range(shape.k_blocks)
                        if mask[0, h, i, j] and rows[:, j * BLOCK_K:(j + 1) * BLOCK_K].any()]
            assert sorted(walk) == expected
            full = walk[:n_full[0, h, i]]
            assert all(rows[:, j * BLOCK_K:(j + 1) * BLOCK_K].all() and (j + 1) * BLOCK_K <= Nkv for j in full)
            assert all(not (rows[:, j * BLOCK_K:(j + 1) * BLOCK_K].all() and (j + 1) * BLOCK_K <= Nkv)
                       for j in walk[n_full[0, h, i]:])
            assert full == sorted(full) and walk[len(full):] == sorted(walk[len(full):])
            # the reference's restatement of the rule, which orders its walk (stage 2's test depends on the order)
            assert walk[len(full):] == [j for j in walk if needs_masking[i, j]]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_stage_2_decides_in_the_walk_order_full_blocks_before_the_windows_edge(backend):
    """One query block (positions 384-511 of 512 keys, window 300) walks key blocks 4 and 5 (wholly inside every
    row's window) first, then the window's edge (blocks 1-3, masked element by element) and the diagonal (6, 7). The
    keys of blocks 4 and 5 score 16 above all others (23 in log2 units), so after them every later tile's gap is -23
    and a threshold of 10 skips five of seven P.V products. A walk in ascending order (what the reference did until
    session 112, when CPU statistics seed 35714 found it) meets blocks 1-3 first, their gap 0, and skips two."""
    D = 64
    q = torch.zeros(1, 1, BLOCK_Q, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 8 * BLOCK_K, D)
    k[:, :, 4 * BLOCK_K:6 * BLOCK_K, 0] = 16.0 * math.sqrt(D)  # scores 16 at the default scale
    v = torch.randn(1, 1, 8 * BLOCK_K, D, generator=torch.Generator().manual_seed(112))
    q, k, v = q.half(), k.half(), v.half()
    out, stats = block_sparse_attention(q, k, v, None, is_causal=True, causal_variant="lower_right",
                                        sliding_window=300, pvthreshd=10.0, return_sparsity=True,
                                        out=poisoned_like(q), backend=backend)
    assert stats.dense_blocks == 7
    assert stats.pv_skipped_stage2.item() == pytest.approx(5 / 7)
    assert relative_l1(out.float(), exact(q, k, v, window_mask(BLOCK_Q, 8 * BLOCK_K, "lower_right", 300))) < 2e-3


@pytest.mark.parametrize("Nq,Nkv,variant,window", CASES)
def test_stage_1_keeps_only_blocks_in_the_window_and_matches_reference(Nq, Nkv, variant, window):
    """Stage 1's kernel against the reference, with the sink block forced (it falls outside most windows and
    must then be dropped); every query block keeps its diagonal."""
    n = max(Nq, Nkv)  # one sequence: the queries and keys are its last rows (lower right) or its first
    q, k, _ = llm_like_qkv(n, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, seed=window)
    q, k = (q[:, :, n - Nq:], k[:, :, n - Nkv:]) if variant == "lower_right" else (q[:, :, :Nq], k[:, :, :Nkv])
    kw = dict(is_causal=True, causal_variant=variant, sliding_window=window, attention_sink=True, cdfthreshd=0.9)
    mask = predict_block_mask(q, k, backend="triton", **kw)
    ref = predict_block_mask(q, k, backend="reference", **kw)
    assert torch.equal(mask, ref)
    seen = blocks_seen(window_mask(Nq, Nkv, variant, window))
    assert not (mask & ~seen).any()
    assert (mask.any(-1) == seen.any(-1)).all(), "every query block that sees a key keeps a block"


@pytest.mark.parametrize("Nq,Nkv,variant,window", CASES[:4] + CASES[5:6] + CASES[7:])
def test_whole_method_with_a_window(Nq, Nkv, variant, window):
    """sparge_attention keeping every block equals SDPA under the window; at default settings its statistics
    count against the blocks the window leaves (keep-all: nothing skipped)."""
    q, k, v = make_qkv(1, 4, 2, Nq, Nkv, 64, torch.float16, "HND", seed=window)
    ref = exact(q, k, v, window_mask(Nq, Nkv, variant, window))
    out, stats = sparge_attention(q, k, v, is_causal=True, causal_variant=variant, sliding_window=window,
                                  cdfthreshd=1.0, pvthreshd=None, backend="triton", return_sparsity=True)
    assert relative_l1(out.float(), ref) < L1_TOL[torch.float16]
    assert stats.sparsity == 0.0
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=True, causal_variant=variant,
                                   sliding_window=window)
    blocks = int(blocks_seen(window_mask(Nq, Nkv, variant, window)).sum())
    assert stats.dense_blocks == dense_block_count(shape, True) == blocks
    out_op = sparge_attention_op(q, k, v, is_causal=True, causal_variant=variant, sliding_window=window,
                                 cdfthreshd=1.0, pvthreshd=None)  # the reference on CPU, through the operator
    assert relative_l1(out_op.float(), ref) < L1_TOL[torch.float16]


def test_a_window_wider_than_the_keys_is_plain_causal_attention():
    q, k, v = make_qkv(1, 2, 2, 200, 200, 64, torch.float16, "HND", seed=3)
    plain = block_sparse_attention(q, k, v, None, is_causal=True, backend="triton")
    wide = block_sparse_attention(q, k, v, None, is_causal=True, backend="triton", sliding_window=200)
    assert relative_l1(wide.float(), plain.float()) < 1e-3


def test_bad_windows_raise():
    q, k, v = make_qkv(1, 2, 2, 100, 100, 64, torch.float16, "HND", seed=0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            sparge_attention(q, k, v, is_causal=True, sliding_window=bad)
    with pytest.raises(ValueError, match="needs is_causal=True"):
        block_sparse_attention(q, k, v, None, sliding_window=10)
    positions = PermutedKeys(torch.arange(100, dtype=torch.int32).view(1, 1, -1), segment=64)
    with pytest.raises(ValueError, match="permuted_keys cannot be combined with sliding_window"):
        sparge_attention(q, k, v, is_causal=True, sliding_window=10, permuted_keys=positions)
    mask = torch.ones(1, 1, 1, 2, dtype=torch.bool)
    compact = compact_block_mask(mask, q, k, is_causal=True, sliding_window=50, backend="triton")
    with pytest.raises(ValueError, match="built for sliding_window=50"):
        block_sparse_attention(q, k, v, compact, is_causal=True, sliding_window=40)
    with pytest.raises(ValueError, match="dense or sliding_window"):
        sparge_attention_op(q, k, v, is_causal=True, sliding_window=10, dense=torch.tensor(False))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Nq,Nkv,variant,window", [(3000, 3000, None, 1024), (1000, 4567, "lower_right", 777),
                                                   (2049, 2049, None, 64), (700, 700, None, 4096),
                                                   (3987, 3268, "upper_left", 2000), (2500, 1800, "lower_right", 300),
                                                   (1000, 300, "upper_left", 200)])
def test_gpu_kernels_match_reference_with_a_window(Nq, Nkv, variant, window, D, monkeypatch):
    """On a GPU: the Hopper kernel (where it runs) and the Triton kernel, on a random mask and on every block,
    against the float32 reference; and the whole method keeping every block against SDPA under the window, its
    stage 1 keeping exactly the blocks the window lets some query see (the last case's query block 512-639 starts
    its windows at key 313, past the last key 299 but inside its ragged block 256-319: session 78's fix) and its
    statistics counting those blocks."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sparge_diffusers.kernels import attention_hopper

    q, k, v = (t.cuda() for t in make_qkv(1, 8, 2, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + D))
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=True, causal_variant=variant,
                                   sliding_window=window)
    kw = dict(is_causal=True, causal_variant=variant, sliding_window=window)
    for mask in (random_mask(shape, 0.3, Nq).cuda(), None):
        ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                                     backend="reference", **kw)
        outs = []
        for forced in (None, False):  # as chosen (the Hopper kernel on an H100), then the Triton kernel
            monkeypatch.setattr(attention_hopper, "OVERRIDE", forced)
            out = block_sparse_attention(q, k, v, mask, out=poisoned_like(q), **kw)
            assert not torch.isnan(out).any()
            outs.append(out.cpu())
        assert relative_l1(outs[0], ref) < L1_TOL[torch.bfloat16]
        assert relative_l1(outs[1], ref) < L1_TOL[torch.bfloat16]
    allowed = window_mask(Nq, Nkv, variant, window).cuda()
    out, stats = sparge_attention(q, k, v, cdfthreshd=1.0, pvthreshd=None, return_sparsity=True, **kw)
    assert relative_l1(out.float(), exact(q, k, v, allowed)) < L1_TOL[torch.bfloat16]
    assert math.isfinite(relative_l1(out.float(), exact(q, k, v, allowed)))
    seen = blocks_seen(allowed)
    assert (predict_block_mask(q, k, cdfthreshd=1.0, **kw) == seen).all()
    assert stats.dense_blocks == int(seen.sum()) and stats.sparsity == 0.0  # 1.1e-16 before session 79's fix
