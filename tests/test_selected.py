"""Per-query block selection with FSA's KV-outer loop (kernels/selected.py): the Triton kernels in the interpreter
against the float32 reference, the selection index, the NSA-style block choice, input errors, random calls that
combine the grid's axes, and the GPU.

``SPARGE_RANDOM_SELECTED_CALLS`` sets the number of random calls on the CPU (default 16, about 1 s each),
``SPARGE_RANDOM_SELECTED_FIRST`` the first seed (default 0); ``SPARGE_GPU_RANDOM_CALLS`` (default 24 here) and
``SPARGE_GPU_RANDOM_FIRST`` those of the GPU's random calls.
"""

import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import (block_sparse_attention, build_selection_index, relative_l1, select_key_blocks,
                              selected_block_attention, selection_sparsity)
from sparge_diffusers import selected_block_attention_op
from sparge_diffusers.kernels import selected as selected_module
from sparge_diffusers.kernels.reference import reference_block_importance

from test_block_selection import apply_drawn_view, check_is_top_k, check_top_k_at_kernel_precision

L1_TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3}
RANDOM_CALLS = int(os.environ.get("SPARGE_RANDOM_SELECTED_CALLS", "16"))
RANDOM_FIRST = int(os.environ.get("SPARGE_RANDOM_SELECTED_FIRST", "0"))
GPU_CALLS = int(os.environ.get("SPARGE_GPU_RANDOM_CALLS", "24"))  # as for test_gpu_random_calls.py
GPU_FIRST = int(os.environ.get("SPARGE_GPU_RANDOM_FIRST", "0"))


def make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, HK, Nkv, D, generator=g).to(dtype) for _ in range(2))
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q.to(device), k.to(device), v.to(device)


def random_selection(B, HK, Nq, n_blocks, top_k, seed, device="cpu"):
    """-1 (none), repeats and any order: what callers may pass."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, n_blocks, (B, HK, Nq, top_k), generator=g, dtype=torch.int32).to(device)


def poisoned_like(q):
    return torch.full_like(q, float("nan"))


CASES = [
    # B, H, HK, Nq, Nkv, D, block, top_k, causal
    (1, 4, 2, 200, 200, 64, 32, 3, True),
    (2, 2, 1, 130, 167, 32, 64, 4, False),
    (1, 3, 3, 77, 77, 16, 64, 2, True),     # shorter than a query chunk's first tile, one ragged block
    (1, 2, 1, 300, 300, 32, 128, 2, True),
    (1, 2, 2, 45, 260, 32, 32, 5, False),   # Nq < Nkv, several work items per block
    (1, 2, 1, 100, 100, 24, 32, 3, True),   # a head dim that is not a power of two
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_kernel_matches_reference(case, dtype, layout, monkeypatch):
    B, H, HK, Nq, Nkv, D, block, top_k, causal = case
    monkeypatch.setattr(selected_module, "QUERY_CHUNK", 64)  # blocks split over several work items
    q, k, v = make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed=Nq + D)
    idx = random_selection(B, HK, Nq, math.ceil(Nkv / block), top_k, seed=Nkv)
    ref = selected_block_attention(q, k, v, idx, block_size=block, is_causal=causal, tensor_layout=layout,
                                   backend="reference")
    out = poisoned_like(q)
    got = selected_block_attention(q, k, v, idx, block_size=block, is_causal=causal, tensor_layout=layout,
                                   backend="triton", out=out)
    assert got is out and got.dtype == dtype and got.shape == q.shape
    assert not torch.isnan(got).any()
    assert relative_l1(got.float(), ref.float()) < L1_TOL[dtype]
    assert (got.float() - ref.float()).abs().max() < (0.05 if dtype == torch.bfloat16 else 0.01)


VARIANT_CASES = [
    # B, H, HK, Nq, Nkv, D, block, top_k, causal_variant
    (1, 4, 2, 70, 200, 64, 32, 3, "lower_right"),   # a chunk against a cache; offset 130 is no multiple of a block
    (1, 2, 1, 130, 77, 32, 64, 4, "lower_right"),   # Nq > Nkv: the first 53 rows see no key (zeros)
    (2, 2, 2, 90, 167, 32, 64, 2, "upper_left"),
    (1, 2, 1, 200, 100, 16, 32, 3, "upper_left"),   # rows past the keys see all of them
]


@pytest.mark.parametrize("case", VARIANT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_kernel_matches_reference_with_causal_variants(case, dtype, layout, monkeypatch):
    B, H, HK, Nq, Nkv, D, block, top_k, variant = case
    monkeypatch.setattr(selected_module, "QUERY_CHUNK", 64)
    q, k, v = make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed=Nq + Nkv)
    idx = random_selection(B, HK, Nq, math.ceil(Nkv / block), top_k, seed=Nq)
    kwargs = dict(block_size=block, tensor_layout=layout, causal_variant=variant)
    ref = selected_block_attention(q, k, v, idx, backend="reference", **kwargs)
    got = selected_block_attention(q, k, v, idx, backend="triton", out=poisoned_like(q), **kwargs)
    assert not torch.isnan(got).any()
    assert relative_l1(got.float(), ref.float()) < L1_TOL[dtype]
    assert (got.float() - ref.float()).abs().max() < (0.05 if dtype == torch.bfloat16 else 0.01)
    if variant == "lower_right" and Nq > Nkv:
        rows = got[:, :, :Nq - Nkv] if layout == "HND" else got[:, :Nq - Nkv]
        assert (rows == 0).all()  # rows before the first key see none


def test_causal_variants_reproduce_the_equal_length_call():
    """The semantics, against the equal-length causal call: a lower-right chunk of the last C queries gives the full
    call's last C rows (same selections); upper-left with fewer queries than keys gives the call on the first Nq
    keys. Both backends."""
    q, k, v = make_qkv(1, 4, 2, 230, 230, 32, torch.float16, "HND", seed=9)
    idx = random_selection(1, 2, 230, 8, 4, seed=9)
    for backend in ("reference", "triton"):
        kw = dict(block_size=32, backend=backend)
        full = selected_block_attention(q, k, v, idx, **kw)
        chunk = selected_block_attention(q[:, :, 150:], k, v, idx[:, :, 150:], causal_variant="lower_right", **kw)
        assert relative_l1(chunk.float(), full[:, :, 150:].float()) < 1e-6, backend
        early = torch.where(idx[:, :, :100] >= 4, -1, idx[:, :, :100])  # blocks past key 99: hidden from these rows
        first = selected_block_attention(q[:, :, :100], k[:, :, :100], v[:, :, :100], early, **kw)
        upper = selected_block_attention(q[:, :, :100], k, v, idx[:, :, :100], causal_variant="upper_left", **kw)
        assert relative_l1(upper.float(), first.float()) < 1e-6, backend
        with pytest.raises(ValueError, match="causal_variant"):
            selected_block_attention(q[:, :, 150:], k, v, idx[:, :, 150:], **kw)
    index = build_selection_index(idx[:, :, 150:], q_len=80, kv_len=230, block_size=32, is_causal=True,
                                  causal_offset=150)
    chunk = selected_block_attention(q[:, :, 150:], k, v, idx[:, :, 150:], block_size=32, backend="triton",
                                     causal_variant="lower_right")
    assert torch.equal(selected_block_attention(q[:, :, 150:], k, v, index, block_size=32, backend="triton",
                                                causal_variant="lower_right"), chunk)
    with pytest.raises(ValueError, match="causal_offset=150"):  # an index of the chunk, used upper-left
        selected_block_attention(q[:, :, 150:], k, v, index, block_size=32, backend="triton",
                                 causal_variant="upper_left")


def test_every_block_selected_equals_sdpa_and_empty_rows_are_zero():
    B, H, HK, N, D, block = 1, 4, 2, 150, 32, 32
    q, k, v = make_qkv(B, H, HK, N, N, D, torch.float16, "HND", seed=3)
    n_blocks = math.ceil(N / block)
    every = torch.arange(n_blocks, dtype=torch.int32).expand(B, HK, N, n_blocks).contiguous()
    dense = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                           v.float().repeat_interleave(2, 1), is_causal=True)
    for backend in ("triton", "reference"):
        got = selected_block_attention(q, k, v, every, block_size=block, backend=backend)
        assert relative_l1(got.float(), dense) < 2e-3
    # under causal masking a query whose only selection lies after it sees no key: a zero row, not NaN
    late = torch.full((B, HK, N, 1), n_blocks - 1, dtype=torch.int32)
    got = selected_block_attention(q, k, v, late, block_size=block, backend="triton", out=poisoned_like(q))
    first_seen = (n_blocks - 1) * block
    assert (got[:, :, :first_seen] == 0).all()
    assert not torch.isnan(got).any() and (got[:, :, first_seen:].abs().sum(-1) > 0).all()


def test_one_block_each_is_softmax_over_that_block():
    """Independent of the reference: a query choosing block j alone attends to j's keys only."""
    B, H, HK, N, D, block = 1, 2, 1, 96, 16, 32
    q, k, v = make_qkv(B, H, HK, N, N, D, torch.float16, "HND", seed=5)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 3, (B, HK, N, 1), generator=g, dtype=torch.int32)
    got = selected_block_attention(q, k, v, idx, block_size=block, is_causal=False, backend="triton").float()
    for n in (0, 31, 50, 95):
        j = int(idx[0, 0, n, 0])
        keys = slice(j * block, (j + 1) * block)
        for h in range(H):
            p = torch.softmax(q[0, h, n].float() @ k[0, 0, keys].float().T / math.sqrt(D), -1)
            assert torch.allclose(got[0, h, n], p @ v[0, 0, keys].float(), atol=2e-3)


def test_selection_index_lists_each_blocks_queries_once_in_order():
    idx = torch.tensor([[[[0, 0, 2], [1, -1, 0], [2, 1, 5], [1, 1, 1]]]], dtype=torch.int32)  # 4 queries
    index = build_selection_index(idx, q_len=4, kv_len=4 * 32, block_size=32, is_causal=False)
    starts = index.block_start[0].tolist()
    assert starts == [0, 2, 5, 7, 7]  # block 0: queries 0, 1; block 1: 1, 2, 3; block 2: 0, 2; block 3: none
    lists = [index.query_list[0, starts[j]:starts[j + 1]].tolist() for j in range(4)]
    assert lists == [[0, 1], [1, 2, 3], [0, 2], []]
    slots = index.slot[0]
    kept = slots >= 0
    assert kept.sum(-1).tolist() == [2, 2, 2, 1]  # repeats once, -1 and out-of-range (5) dropped
    assert (slots[~kept] == -1).all()  # the documented mark of a dropped pair
    for n in range(4):  # each kept slot points back at its query
        assert (index.query_list[0, slots[n][kept[n]].long()] == n).all()
    items = index.chunk_block[0]
    assert sorted(items[items >= 0].tolist()) == [0, 1, 2] and (items[items < 0] == -1).all()  # -1: unused item
    far = torch.where(idx == 5, (1 << 32) + 1, idx.long())  # an int32 cast would make it block 1: it stays none
    wrapped = build_selection_index(far, q_len=4, kv_len=4 * 32, block_size=32, is_causal=False)
    assert torch.equal(wrapped.slot, index.slot)
    causal = build_selection_index(idx, q_len=4, kv_len=4, block_size=32, is_causal=True)
    assert causal.block_start[0].tolist() == [0, 2]  # one block of 4 keys: only queries 0 and 1 chose it


def test_selection_index_sorts_block_numbers_as_16_bit_keys_only_where_they_fit():
    """The (block, query) pairs sort on 16-bit keys while every block number and the "none" sentinel (the block
    count) fit in int16, fewer than 2 ** 15 blocks (1M keys at block size 32); at 2 ** 15 the sentinel would wrap to
    -2 ** 15 and sort first, shifting every block's query list."""
    for n_blocks in (2 ** 15 - 1, 2 ** 15):
        last = n_blocks - 1
        idx = torch.tensor([[[[last, -1], [0, last], [last - 1, 0]]]], dtype=torch.int32)  # 3 queries, 2 picks each
        index = build_selection_index(idx, q_len=3, kv_len=n_blocks * 32, block_size=32, is_causal=False)
        starts = index.block_start[0]
        lists = {j: index.query_list[0, starts[j]:starts[j + 1]].tolist() for j in (0, last - 1, last)}
        assert lists == {0: [1, 2], last - 1: [2], last: [0, 1]}, n_blocks


def test_selection_index_keeps_each_blocks_queries_ascending():
    """``query_list``'s documented order within a block (ascending: gathers stay near-contiguous), on
    enough pairs that an unstable sort scrambles them (torch's CPU sort does at 5000 keys of three values)."""
    idx = torch.randint(0, 3, (1, 2, 2500, 2), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    index = build_selection_index(idx, q_len=2500, kv_len=3 * 32, block_size=32, is_causal=False)
    for bh in range(2):
        starts = index.block_start[bh].tolist()
        for j in range(3):
            want = (idx[0, bh] == j).any(-1).nonzero().flatten()  # each query once, however often it picked j
            assert torch.equal(index.query_list[bh, starts[j]:starts[j + 1]].long(), want), (bh, j)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, i: dict(block_indices=i[..., :0]), "top_k >= 1"),
    (lambda q, k, v, i: dict(block_indices=i[:, :, :-1]), r"= \(1, 1, 140, top_k >= 1\), got \(1, 1, 139, 2\)"),
    (lambda q, k, v, i: dict(block_indices=i.float()), "integer"),
    (lambda q, k, v, i: dict(block_indices=i + 100), r"block index >= 5"),
    (lambda q, k, v, i: dict(block_indices=torch.where(i == i.max(), 5, i)), r"block index >= 5"),  # one past
    (lambda q, k, v, i: dict(block_indices=i, block_size=48), "block_size"),
    (lambda q, k, v, i: dict(block_indices=i, max_partial_bytes=0), "max_partial_bytes"),
    (lambda q, k, v, i: dict(block_indices=i, out=q[:, :1]), "out must match"),
])
def test_input_errors(bad, match):
    q, k, v = make_qkv(1, 2, 1, 140, 140, 16, torch.float16, "HND", seed=0)
    idx = random_selection(1, 1, 140, 5, 2, seed=0)
    kwargs = dict(block_size=32, backend="triton")
    kwargs.update(bad(q, k, v, idx))
    with pytest.raises(ValueError, match=match):
        selected_block_attention(q, k, v, **kwargs)


def test_query_chunks_give_the_one_piece_output(monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 300, 300, 32, torch.bfloat16, "NHD", seed=4)
    idx = random_selection(1, 2, 300, 10, 3, seed=4)
    kwargs = dict(block_size=32, tensor_layout="NHD", backend="triton")
    whole = selected_block_attention(q, k, v, idx, **kwargs)
    per_query = 3 * 4 * (32 * 2 + 4)  # the documented top_k * H * (D * 2 + 4) bytes of partial outputs per query
    pieces = []  # (first query, queries) of each launch
    launch = selected_module.selected_attention_triton
    monkeypatch.setattr(selected_module, "selected_attention_triton", lambda *a, **kw: pieces.append(
        (a[5].q_start, a[5].slot.shape[1])) or launch(*a, **kw))
    chunked = selected_block_attention(q, k, v, idx, max_partial_bytes=per_query * 70, out=poisoned_like(q), **kwargs)
    assert torch.equal(chunked, whole)  # rows are computed independently
    assert pieces == [(0, 60), (60, 60), (120, 60), (180, 60), (240, 60)]  # the fewest equal chunks under the cap
    for cap, expected in ((per_query * 60, [(s, 60) for s in range(0, 300, 60)]),  # the cap exactly: still 5
                          (per_query * 60 - 1, [(s, 50) for s in range(0, 300, 50)]),  # a byte less: 6
                          (per_query * 300, [(0, 300)])):
        pieces.clear()
        assert torch.equal(selected_block_attention(q, k, v, idx, max_partial_bytes=cap, **kwargs), whole)
        assert pieces == expected, cap
    tail = dict(kwargs, causal_variant="lower_right")  # the last 200 queries: each chunk keeps the causal offset
    whole = selected_block_attention(q[:, 100:], k, v, idx[:, :, 100:], **tail)
    chunked = selected_block_attention(q[:, 100:], k, v, idx[:, :, 100:], max_partial_bytes=per_query * 70, **tail)
    assert torch.equal(chunked, whole)
    with pytest.raises(ValueError, match=r"queries 10\.\.309 of the selection lie outside the 300 queries"):
        build_selection_index(idx, q_len=300, kv_len=300, block_size=32, is_causal=True, q_start=10)
    part = build_selection_index(idx[:, :, 100:], q_len=300, kv_len=300, block_size=32, is_causal=True, q_start=100)
    with pytest.raises(ValueError, match="q_start"):
        selected_block_attention(q, k, v, part, **kwargs)


def test_block_size_defaults_to_64_keys():
    """The signatures' default block size (64), in the attention call and in the selection's statistics."""
    q, k, v = make_qkv(1, 2, 1, 200, 200, 16, torch.float16, "HND", seed=1)
    idx = random_selection(1, 1, 200, 4, 2, seed=1)
    for backend in ("reference", "triton"):
        assert torch.equal(selected_block_attention(q, k, v, idx, backend=backend),
                           selected_block_attention(q, k, v, idx, block_size=64, backend=backend)), backend
    by_default = selection_sparsity(idx, heads=2, kv_len=200)
    explicit = selection_sparsity(idx, heads=2, kv_len=200, block_size=64)
    assert torch.equal(by_default.qk_skipped, explicit.qk_skipped)
    other = selection_sparsity(idx, heads=2, kv_len=200, block_size=32)  # the block size changes the figure here
    assert not torch.equal(by_default.qk_skipped, other.qk_skipped)


def test_selection_index_reuse_is_checked():
    q, k, v = make_qkv(1, 2, 1, 140, 140, 16, torch.float16, "HND", seed=0)
    idx = random_selection(1, 1, 140, 5, 2, seed=0)
    index = build_selection_index(idx, q_len=140, kv_len=140, block_size=32, is_causal=True)
    fresh = selected_block_attention(q, k, v, idx, block_size=32, backend="triton")
    assert torch.equal(selected_block_attention(q, k, v, index, block_size=32, backend="triton"), fresh)
    with pytest.raises(ValueError, match="built for"):
        selected_block_attention(q, k, v, index, block_size=64, backend="triton")
    with pytest.raises(ValueError, match="built for"):
        selected_block_attention(q, k, v, index, block_size=32, is_causal=False, backend="triton")
    # batch x KV heads = 2 x 1 against a call of 1 x 2: the same B * H_kv, each row's picks another's
    two_rows = build_selection_index(torch.cat([idx, idx.flip(2)]), q_len=140, kv_len=140, block_size=32,
                                     is_causal=True)
    q2, k2, v2 = make_qkv(1, 2, 2, 140, 140, 16, torch.float16, "HND", seed=1)
    with pytest.raises(ValueError, match=r"built for .* \(B, H_kv\) = \(2, 1\)"):
        selected_block_attention(q2, k2, v2, two_rows, block_size=32, backend="triton")


@pytest.mark.parametrize("is_causal, nq, variant", [(True, 150, None), (False, 150, None), (True, 60, "lower_right"),
                                                     (True, 60, "upper_left"), (True, 200, "lower_right")])
def test_selection_sparsity_counts_the_pairs_a_selection_covers(is_causal, nq, variant):
    """Against a dense (query, key) coverage mask built pair by pair: repeats, -1, out-of-range picks, hidden and
    partly hidden blocks (causal, both variants with Nq != Nkv), the short last block; per query head of each
    group."""
    n, block, heads = 150, 32, 4  # 5 blocks of keys, the last of 22
    generator = torch.Generator().manual_seed(4)
    sel = torch.randint(-1, 7, (2, 2, nq, 4), generator=generator)  # -1 = none, 5 and 6 = out of range
    sel[0, 0, :, 1] = sel[0, 0, :, 0]  # repeats
    stats = selection_sparsity(sel, heads=heads, kv_len=n, block_size=block, is_causal=is_causal,
                               causal_variant=variant)
    assert_selection_sparsity(stats, sel, heads, n, block, is_causal, variant)
    assert 0 < stats.sparsity < 1
    everything = torch.arange(5).expand(1, 1, nq, 5)
    assert selection_sparsity(everything, heads=1, kv_len=n, block_size=block, is_causal=is_causal,
                              causal_variant=variant).sparsity == 0
    with pytest.raises(ValueError, match="multiple"):
        selection_sparsity(sel, heads=3, kv_len=n, block_size=block)
    with pytest.raises(ValueError, match="pass causal_variant"):
        selection_sparsity(sel, heads=4, kv_len=n + 1, block_size=block)


def test_selection_sparsity_and_index_refuse_sizes_and_indices_that_gave_a_figure():
    """selection_sparsity gave kv_len=0 NaN, kv_len=-5 and block_size=-64 fractions of 1 and 3, kv_len=64.5 and
    block_size=32.5 fractions of blocks, and float indices were truncated (0.7 read as block 0); heads=0 gave an
    empty result. build_selection_index truncated float indices too, into an index the kernel then ran."""
    sel = torch.zeros(1, 2, 8, 2, dtype=torch.long)
    want = selection_sparsity(sel, heads=2, kv_len=64, block_size=32, is_causal=False).sparsity
    assert want == pytest.approx(0.5)
    for bad in (dict(kv_len=0), dict(kv_len=-5), dict(kv_len=64.5), dict(heads=0), dict(heads=2.0),
                dict(block_size=0), dict(block_size=-64), dict(block_size=32.5), dict(block_size=True)):
        kwargs = dict(heads=2, kv_len=64, block_size=32, is_causal=False)
        kwargs.update(bad)
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive int"):
            selection_sparsity(sel, **kwargs)
    for tensor, match in ((sel.float() + 0.7, "integer"), (sel[0], "shape"), (sel[..., :0], "shape"),
                          (sel.tolist(), "torch.Tensor")):
        with pytest.raises(ValueError, match=match):
            selection_sparsity(tensor, heads=2, kv_len=64, block_size=32, is_causal=False)
        with pytest.raises(ValueError, match=match):
            build_selection_index(tensor, q_len=8, kv_len=64, block_size=32, is_causal=False)
    for bad, match in ((dict(kv_len=0), "kv_len"), (dict(q_len=8.0), "q_len"), (dict(block_size=48), "block_size"),
                       (dict(block_size=0), "block_size"), (dict(block_size=64.0), "block_size"),
                       (dict(q_start=0.5), "outside"), (dict(q_start=True), "outside"), (dict(q_start=1), "outside")):
        kwargs = dict(q_len=8, kv_len=64, block_size=32, is_causal=False)
        kwargs.update(bad)
        with pytest.raises(ValueError, match=match):
            build_selection_index(sel, **kwargs)
    with pytest.raises(ValueError, match="outside"):  # a chunk of the queries, placed by a bool
        build_selection_index(sel[:, :, :4], q_len=8, kv_len=64, block_size=32, is_causal=False, q_start=True)


def test_cpu_auto_runs_reference_and_fp32_only_there():
    q, k, v = make_qkv(1, 2, 1, 70, 70, 16, torch.float32, "HND", seed=2)
    idx = random_selection(1, 1, 70, 3, 2, seed=2)
    out = selected_block_attention(q, k, v, idx, block_size=32)  # auto on CPU: the reference takes fp32
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="block index >= 3"):  # the reference checks the range even unasked
        selected_block_attention(q, k, v, idx + 3, block_size=32, validate=False)
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        selected_block_attention(q, k, v, idx, block_size=32, backend="triton")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_custom_op_compiles_as_one_graph_and_matches(layout):
    q, k, v = make_qkv(1, 4, 2, 150, 150, 16, torch.float32, layout, seed=6)
    idx = random_selection(1, 2, 150, 5, 3, seed=6)
    kwargs = dict(block_size=32, tensor_layout=layout)
    eager = selected_block_attention(q, k, v, idx, **kwargs)
    assert torch.equal(selected_block_attention_op(q, k, v, idx, **kwargs), eager)
    torch.library.opcheck(torch.ops.sparge_diffusers.selected_block_attention.default,
                          (q, k, v, idx, 32, True, 0.25, layout, True, 1 << 30))

    def layer(q, k, v, idx):
        return selected_block_attention_op(q * 1.0, k, v, idx, **kwargs) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first, second = compiled(q, k, v, idx), compiled(q, k, v, idx)
    assert torch.equal(first, eager + 1.0) and torch.equal(first, second)
    with pytest.raises(ValueError, match="block_size"):
        selected_block_attention_op(q, k, v, idx, block_size=48, tensor_layout=layout)
    chunk = (q[:, :, 100:] if layout == "HND" else q[:, 100:]).contiguous()  # a lower-right chunk, through the op
    args = (chunk, k, v, idx[:, :, 100:])
    want = selected_block_attention(*args, causal_variant="lower_right", **kwargs)
    assert torch.equal(selected_block_attention_op(*args, causal_variant="lower_right", **kwargs), want)
    torch.library.opcheck(torch.ops.sparge_diffusers.selected_block_attention.default,
                          args + (32, True, 0.25, layout, True, 1 << 30, "lower_right"))
    with pytest.raises(ValueError, match="causal_variant"):
        selected_block_attention_op(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference(layout, dtype):
    for B, H, HK, N, D, block, top_k in [(1, 8, 2, 1000, 128, 64, 6), (2, 4, 4, 777, 64, 128, 3),
                                         (1, 4, 1, 3001, 128, 32, 16)]:
        q, k, v = make_qkv(B, H, HK, N, N, D, dtype, layout, seed=N, device="cuda")
        sel = select_key_blocks(q, k, top_k=top_k, block_size=block, tensor_layout=layout)
        out = poisoned_like(q)
        got = selected_block_attention(q, k, v, sel, block_size=block, tensor_layout=layout, out=out)
        ref = selected_block_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), sel.cpu(),
                                       block_size=block, tensor_layout=layout)
        assert not torch.isnan(got).any()
        assert relative_l1(got.cpu().float(), ref) < L1_TOL[dtype], (B, H, HK, N, D, block, top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(GPU_FIRST, GPU_FIRST + GPU_CALLS))
def test_gpu_random_calls(seed, monkeypatch):
    """The CPU's random FSA call (:func:`draw_selected_call`) at GPU sizes: lengths up to 2500, top_k up to 20, head
    dim 96 too; the compiled kernels against the float32 reference on the CPU, with the same checks."""
    call = draw_selected_call(seed, max_len=2500, max_top_k=20, head_dims=(16, 24, 32, 64, 96, 128))
    check_selected_call(call, monkeypatch, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_custom_op_under_inductor(mode):
    q, k, v = make_qkv(1, 8, 2, 1500, 1500, 128, torch.bfloat16, "HND", seed=9, device="cuda")
    sel = select_key_blocks(q, k, top_k=6, block_size=64)
    eager = selected_block_attention(q, k, v, sel, block_size=64)

    def layer(q, k, v, sel):
        return selected_block_attention_op(q, k, v, sel, block_size=64, validate=False) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(layer, mode=mode, fullgraph=True)
    for _ in range(3):  # reduce-overhead records a CUDA graph on a later call, then replays it
        got = compiled(q, k, v, sel).clone()
    assert torch.equal(got, eager * 2.0)


def assert_selection_sparsity(stats, sel: torch.Tensor, heads: int, kv_len: int, block: int, is_causal: bool,
                              variant: str | None) -> None:
    """``stats`` (from :func:`selection_sparsity`) against a dense (query, key) coverage mask built from the
    definition: a pick covers its block's keys (none for -1, an out-of-range pick or a repeat's second time), causal
    masking hides the keys after the query; per query head of each group, mean over the batch."""
    B, HK, nq, _ = sel.shape
    key_block = torch.arange(kv_len) // block
    covered = torch.zeros(B, HK, nq, kv_len, dtype=torch.bool)
    for pick in sel.long().unbind(-1):  # one pick at a time keeps the mask at (B, HK, nq, kv_len); -1 matches none
        covered |= pick.unsqueeze(-1) == key_block
    visible = torch.ones(nq, kv_len, dtype=torch.bool)
    if is_causal:
        visible = visible.tril(diagonal=kv_len - nq if variant == "lower_right" else 0)
    covered &= visible
    want = 1 - covered.sum(dim=(2, 3)).double() / max(int(visible.sum()), 1)
    want = want.repeat_interleave(heads // HK, dim=1).mean(0).float()
    torch.testing.assert_close(stats.qk_skipped.cpu(), want)
    torch.testing.assert_close(stats.pv_skipped.cpu(), want)
    assert stats.dense_blocks == int(visible.sum())


def draw_selected_call(seed: int, max_len: int = 400, max_top_k: int = 8,
                       head_dims: tuple[int, ...] = (16, 32, 64, 24, 128)) -> dict:
    """One call of the FSA path, a pure function of ``seed`` (and the bounds): shapes, GQA group, layout
    (contiguous, a transposed view or a strided q), dtype, block size, top_k, causality and variant, scale, sinks,
    where the selection comes from (random picks with -1s and repeats, the NSA-style kernel, or every block), the
    kernel's query chunk and whether the call runs in query pieces."""
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    causal = rng.random() < 0.6
    variant = rng.choice([None, None, "lower_right", "upper_left"]) if causal else None
    q_len = rng.randint(1, max_len)
    return dict(
        batch=rng.choice([1, 2]), kv_heads=kv_heads, heads=kv_heads * rng.choice([1, 2, 3, 4]),
        head_dim=rng.choice(head_dims), block=rng.choice([32, 64, 128]), top_k=rng.randint(1, max_top_k),
        causal=causal, variant=variant, q_len=q_len,
        kv_len=q_len if causal and variant is None else rng.randint(1, max_len),
        dtype=rng.choice([torch.bfloat16, torch.float16]), layout=rng.choice(["HND", "NHD"]),
        view=rng.choice(["contiguous", "contiguous", "transposed", "strided_q"]),
        selection=rng.choice(["random", "random", "nsa", "every"]), scale=rng.choice([None, None, 0.05, 0.3]),
        sinks=rng.random() < 0.25, query_chunk=rng.choice([64, 256]), pieces=rng.choice([1, 1, 3]), seed=seed)


def _selected_call_inputs(call: dict, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a drawn call in its layout: contiguous, NHD as a transposed view of HND tensors, or q a strided
    view (rows padded to twice their width)."""
    B, H, HK, D, layout = call["batch"], call["heads"], call["kv_heads"], call["head_dim"], call["layout"]
    view = call["view"]
    q, k, v = apply_drawn_view(make_qkv(B, H, HK, call["q_len"], call["kv_len"], D, call["dtype"],
                                        "HND" if view == "transposed" else layout, seed=call["seed"], device=device),
                               view, layout)
    return q, k, v


def check_selected_call(call: dict, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> None:
    """A drawn FSA call on the Triton kernels (the interpreter on the CPU) into a NaN-poisoned buffer: every element
    written, relative L1 against the float32 reference (on the CPU) under the dtype's tolerance, rows whose selection
    shows no key zero, with every block selected also against exact attention; a prebuilt index gives the same
    output; an NSA-style selection holds each row's top blocks of the reference importance, exact and at the
    kernel's own precision; the selection's statistics against the pair-by-pair definition."""
    monkeypatch.setattr(selected_module, "QUERY_CHUNK", call["query_chunk"])
    q, k, v = _selected_call_inputs(call, device)
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    layout, block, top_k, variant, seed = call["layout"], call["block"], call["top_k"], call["variant"], call["seed"]
    B, H, HK, D, q_len, kv_len = (call[n] for n in ("batch", "heads", "kv_heads", "head_dim", "q_len", "kv_len"))
    n_blocks = math.ceil(kv_len / block)
    common = dict(block_size=block, is_causal=call["causal"], tensor_layout=layout, causal_variant=variant)
    offset = kv_len - q_len if variant == "lower_right" else 0
    if call["selection"] == "nsa":
        nsa = dict(block_size=block, is_causal=call["causal"], scale=call["scale"] or D ** -0.5, sink_blocks=1,
                   local_blocks=1)
        sel = select_key_blocks(q, k, top_k=top_k, tensor_layout=layout, backend="triton", causal_variant=variant,
                                **nsa)
        importance = reference_block_importance(qc, kc, tensor_layout=layout, q_start=offset, **nsa)
        check_is_top_k(sel.cpu(), importance, top_k, tol=1e-2 * (H // HK))
        check_top_k_at_kernel_precision(sel, q, k, top_k, tensor_layout=layout, q_start=offset, **nsa)
    elif call["selection"] == "every":
        sel = torch.arange(n_blocks, dtype=torch.int32, device=device).expand(B, HK, q_len, n_blocks)
    else:
        sel = random_selection(B, HK, q_len, n_blocks, top_k, seed=seed, device=device)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 3 if call["sinks"] else None
    kw = dict(common, scale=call["scale"])
    on_device = dict(kw, sink_logits=None if sinks is None else sinks.to(device))
    per_query = sel.shape[-1] * H * (D * 2 + 4)  # the partial outputs' bytes per query (the docstring's figure)
    budget = per_query * math.ceil(q_len / call["pieces"]) if call["pieces"] > 1 else selected_module.MAX_PARTIAL_BYTES

    out = poisoned_like(q)
    got = selected_block_attention(q, k, v, sel, backend="triton", out=out, max_partial_bytes=budget, **on_device)
    ref = selected_block_attention(qc, kc, vc, sel.cpu(), backend="reference", sink_logits=sinks, **kw)
    assert got.data_ptr() == out.data_ptr() and got.shape == q.shape, call
    got = got.cpu()
    assert not torch.isnan(got).any(), call
    seq_dim = 2 if layout == "HND" else 1
    empty = (ref.float().abs().sum(-1) == 0).movedim(seq_dim, -1)  # (B, H, Nq) rows with no visible key
    assert (got.float().abs().sum(-1).movedim(seq_dim, -1)[empty] == 0).all(), call
    if ref.abs().sum() > 0:
        assert relative_l1(got.float(), ref.float()) < L1_TOL[call["dtype"]], call
    if call["selection"] == "every":
        exact = block_sparse_attention(qc, kc, vc, None, backend="reference", is_causal=call["causal"],
                                       tensor_layout=layout, causal_variant=variant, scale=call["scale"],
                                       sink_logits=sinks)
        if exact.abs().sum() > 0:
            assert relative_l1(got.float(), exact.float()) < L1_TOL[call["dtype"]], call
    index = build_selection_index(sel, q_len=q_len, kv_len=kv_len, block_size=block, is_causal=call["causal"],
                                  causal_offset=offset)
    assert torch.equal(selected_block_attention(q, k, v, index, backend="triton", **on_device).cpu(), got), call
    stats = selection_sparsity(sel, heads=H, kv_len=kv_len, block_size=block, is_causal=call["causal"],
                               causal_variant=variant)
    assert_selection_sparsity(stats, sel.cpu(), H, kv_len, block, call["causal"], variant)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("seed", range(RANDOM_FIRST, RANDOM_FIRST + RANDOM_CALLS))
def test_random_selected_call_matches_reference(seed, monkeypatch):
    """A drawn FSA call (:func:`draw_selected_call`) in the interpreter, checked by :func:`check_selected_call`."""
    check_selected_call(draw_selected_call(seed), monkeypatch)
