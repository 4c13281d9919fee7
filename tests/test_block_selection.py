"""NSA-style key-block selection (kernels/block_selection.py): the fused Triton kernel in the interpreter against
the float32 reference, the selection rules on both backends, input errors, and the GPU.

``SPARGE_RANDOM_SELECTION_CALLS`` sets the number of random calls on the CPU (default 16),
``SPARGE_RANDOM_SELECTION_FIRST`` the first seed (default 0); ``SPARGE_GPU_RANDOM_CALLS`` (default 12 here) and
``SPARGE_GPU_RANDOM_FIRST`` set the GPU's random calls, as for test_gpu_random_calls.py.
"""

import math
import os
import random

import pytest
import torch

from sparge_diffusers import select_key_blocks, select_key_blocks_op
from sparge_diffusers.kernels import block_selection as selection_module
from sparge_diffusers.kernels._inputs import to_hnd
from sparge_diffusers.kernels.reference import reference_block_importance

RANDOM_CALLS = int(os.environ.get("SPARGE_RANDOM_SELECTION_CALLS", "16"))
RANDOM_FIRST = int(os.environ.get("SPARGE_RANDOM_SELECTION_FIRST", "0"))
GPU_CALLS = int(os.environ.get("SPARGE_GPU_RANDOM_CALLS", "12"))
GPU_FIRST = int(os.environ.get("SPARGE_GPU_RANDOM_FIRST", "0"))

CASES = [
    # B, H, HK, N (q and k), Nkv (non-causal), D, block, top_k, causal
    (1, 4, 2, 300, 300, 32, 32, 4, True),
    (2, 6, 2, 200, 170, 24, 32, 3, False),   # group 3 (padded to 4), head dim 24, Nq != Nkv
    (1, 2, 1, 700, 700, 64, 32, 16, True),   # several chunks, top_k 16
    (1, 16, 1, 150, 150, 16, 32, 5, True),   # group 16: four tokens per program
    (1, 2, 2, 90, 400, 32, 64, 20, False),   # top_k above the blocks there are: -1 after them
    (1, 4, 4, 33, 33, 32, 128, 2, True),     # one ragged block
]


def make_qk(B, H, HK, Nq, Nkv, D, dtype, layout, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, HK, Nkv, D, generator=g).to(dtype)
    if layout == "NHD":
        q, k = (t.transpose(1, 2).contiguous() for t in (q, k))
    return q.to(device), k.to(device)


def apply_drawn_view(tensors: tuple[torch.Tensor, ...], view: str, layout: str) -> tuple[torch.Tensor, ...]:
    """A random draw's inputs as the call sees them: made in HND for ``view == "transposed"`` (NHD then becomes a
    transposed view of them), otherwise in ``layout``; for "strided_q" the first tensor (q) becomes a view whose rows
    are padded to twice their width."""
    if view == "transposed" and layout == "NHD":
        tensors = tuple(t.transpose(1, 2) for t in tensors)
    if view == "strided_q":
        q, width = tensors[0], tensors[0].shape[-1]
        wide = q.new_zeros(*q.shape[:-1], 2 * width)
        wide[..., :width] = q
        tensors = (wide[..., :width],) + tuple(tensors[1:])
    return tensors


def check_is_top_k(sel, importance, top_k, tol, rel=0.0):
    """sel holds, per row, min(top_k, visible) distinct visible blocks whose importance no unchosen visible block
    exceeds by more than tol + rel * its importance, then -1s."""
    n_blocks = importance.shape[-1]
    visible = importance >= 0
    valid = sel >= 0
    assert (valid.sum(-1) == visible.sum(-1).clamp(max=top_k)).all()
    assert (valid[..., :-1] | ~valid[..., 1:]).all()  # the -1s come last
    assert ((sel < n_blocks) & (sel >= -1)).all()
    chosen = torch.zeros(*sel.shape[:-1], n_blocks + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(valid, sel, n_blocks).long(), True)
    chosen = chosen[..., :n_blocks]
    assert (chosen.sum(-1) == valid.sum(-1)).all()  # no repeats
    assert (chosen <= visible).all()
    low = torch.where(chosen, importance, math.inf).amin(-1)
    high = torch.where(visible & ~chosen, importance, -math.inf).amax(-1)
    assert (low >= high - tol - rel * high.clamp(min=0)).all(), float((high - low).max())


def check_top_k_at_kernel_precision(sel, q, k, top_k, *, tensor_layout="HND", q_start=0, **kwargs):
    """sel holds each row's top_k visible blocks of the float32 importance computed from the kernel's own block
    means (rounded to the inputs' dtype, as the kernel scores them), to the bits the kernel's key keeps plus float32
    rounding. kwargs: the selection's block_size, is_causal, scale, sink_blocks and local_blocks."""
    kernel_means = selection_module.block_mean_keys(to_hnd(k, tensor_layout), kwargs["block_size"]).to(k.dtype)
    importance = reference_block_importance(q.cpu(), k.cpu(), tensor_layout=tensor_layout, q_start=q_start,
                                            block_means=kernel_means.cpu(), **kwargs)
    n_blocks = kernel_means.shape[2]
    # an int32 key keeps 23 - ceil(log2(n_blocks)) mantissa bits, so truncation moves an importance by less than
    # 2^-key_bits of it (twice that between two keys); an int64 key keeps all 23; 1e-5: exp2, the sums and the dot
    # in float32
    key_bits = 23 if n_blocks > selection_module.KEY32_MAX_BLOCKS else 23 - max(1, (n_blocks - 1).bit_length())
    check_is_top_k(sel.cpu(), importance, top_k, tol=1e-9, rel=2.0 ** -(key_bits - 1) + 1e-5)


GRID = [(case, dtype, layout, "int32") for case in CASES for dtype in (torch.bfloat16, torch.float16)
        for layout in ("HND", "NHD")] + [(case, torch.float16, "HND", "int64") for case in CASES]


@pytest.mark.parametrize("case, dtype, layout, keys", GRID)
def test_kernel_matches_reference(case, dtype, layout, keys, monkeypatch):
    B, H, HK, N, Nkv, D, block, top_k, causal = case
    Nkv = N if causal else Nkv
    monkeypatch.setattr(selection_module, "SELECT_CHUNK", 16)  # several chunks of block means per walk
    if keys == "int64":
        monkeypatch.setattr(selection_module, "KEY32_MAX_BLOCKS", 0)
    q, k = make_qk(B, H, HK, N, Nkv, D, dtype, layout, seed=N + D)
    kwargs = dict(block_size=block, is_causal=causal, scale=D ** -0.5, sink_blocks=1, local_blocks=2)
    out = torch.full((B, HK, N, top_k), 7777, dtype=torch.int32)  # poisoned: every element must be written
    selection_module.select_key_blocks_triton(to_hnd(q, layout), to_hnd(k, layout), out, **kwargs)
    ref = select_key_blocks(q, k, top_k=top_k, tensor_layout=layout, backend="reference", **kwargs)
    importance = reference_block_importance(q, k, tensor_layout=layout, **kwargs)
    check_is_top_k(out, importance, top_k, tol=1e-2 * (H // HK))
    check_top_k_at_kernel_precision(out, q, k, top_k, tensor_layout=layout, **kwargs)
    # the same blocks as the reference's in (almost) every row, best first: the rest are near-ties
    same = (out.sort(-1).values == ref.sort(-1).values).all(-1).float().mean()
    assert same > 0.97, float(same)
    assert (out[..., 0] == ref[..., 0]).float().mean() > 0.97


def test_reference_importance_scores_given_block_means_and_checks_their_shape():
    """block_means equal to k's own float32 means give the exact importance; rounded ones move it; a wrong shape
    (a block too few) raises ValueError naming the shape expected."""
    q, k = make_qk(1, 4, 2, 100, 100, 32, torch.bfloat16, "HND", seed=3)
    kwargs = dict(block_size=32, is_causal=True, scale=32 ** -0.5, sink_blocks=1, local_blocks=1)
    exact = reference_block_importance(q, k, **kwargs)
    means = selection_module.block_mean_keys(k, 32)
    torch.testing.assert_close(reference_block_importance(q, k, block_means=means, **kwargs), exact)
    assert not torch.equal(reference_block_importance(q, k, block_means=means.to(torch.bfloat16), **kwargs), exact)
    with pytest.raises(ValueError, match=r"block_means must have shape \(1, 2, 4, 32\)"):
        reference_block_importance(q, k, block_means=means[:, :, :3], **kwargs)


def test_top_k_above_the_key_blocks_sorts_only_the_blocks_there_are(monkeypatch):
    """top_k far above the key blocks (1000 against 7): the kernel is launched on 7 columns (its sort width, a
    compile-time constant, followed top_k: 10_000 compiled a 16384-wide sort, once per block count, minutes each on
    an H100), and the public result is the 7-column selection followed by -1s."""
    q, k = make_qk(1, 4, 2, 200, 200, 32, torch.float16, "HND", seed=11)
    launched = []
    kernel = selection_module.select_key_blocks_triton
    monkeypatch.setattr(selection_module, "select_key_blocks_triton",
                        lambda qh, kh, out, **kw: launched.append(out.shape[-1]) or kernel(qh, kh, out, **kw))
    wide = select_key_blocks(q, k, top_k=1000, block_size=32, backend="triton")
    exact = select_key_blocks(q, k, top_k=7, block_size=32, backend="triton")
    assert launched == [7, 7] and wide.shape == (1, 2, 200, 1000)
    assert torch.equal(wide[..., :7], exact) and (wide[..., 7:] == -1).all()
    assert torch.equal(wide, select_key_blocks(q, k, top_k=1000, block_size=32, backend="reference"))


@pytest.mark.parametrize("nq, nkv, variant", [(70, 300, "lower_right"), (200, 90, "lower_right"),
                                              (100, 300, "upper_left"), (64, 513, "lower_right")])
def test_causal_variants_match_the_reference_and_the_equal_length_call(nq, nkv, variant, monkeypatch):
    """Causal calls with Nq != Nkv: the kernel against the reference (rows place their own block and visibility
    at position i + offset; rows that see no block get only -1), and the reference's lower-right chunk equal to
    the last rows of the equal-length call on the same keys.

    (64, 513): the second tile's last query (32 tokens per tile at group 2) sits on key 512, the first key of block
    16, which starts a chunk of both passes (16 blocks each): a causal walk one block short skips that chunk and the
    query's own block. The random draws rarely meet this (none of seeds 0-599 did)."""
    monkeypatch.setattr(selection_module, "SELECT_CHUNK", 16)
    q, k = make_qk(1, 4, 2, nq, nkv, 32, torch.float16, "HND", seed=nq)
    kwargs = dict(block_size=32, is_causal=True, scale=32 ** -0.5, sink_blocks=1, local_blocks=2)
    offset = nkv - nq if variant == "lower_right" else 0
    out = torch.full((1, 2, nq, 6), 7777, dtype=torch.int32)
    selection_module.select_key_blocks_triton(q, k, out, causal_offset=offset, **kwargs)
    ref = select_key_blocks(q, k, top_k=6, backend="reference", causal_variant=variant, **kwargs)
    importance = reference_block_importance(q, k, q_start=offset, **kwargs)
    check_is_top_k(out, importance, 6, tol=2e-2)
    check_top_k_at_kernel_precision(out, q, k, 6, q_start=offset, **kwargs)
    assert (out.sort(-1).values == ref.sort(-1).values).all(-1).float().mean() > 0.97
    if offset < 0:
        assert (out[:, :, :-offset] == -1).all() and (ref[:, :, :-offset] == -1).all()  # no key to see
    if variant == "lower_right" and nq < nkv:
        qf, _ = make_qk(1, 4, 2, nkv, nkv, 32, torch.float16, "HND", seed=nq + 1)
        qf[:, :, nkv - nq:] = q
        full = select_key_blocks(qf, k, top_k=6, backend="reference", **kwargs)
        assert torch.equal(ref, full[:, :, nkv - nq:])
    with pytest.raises(ValueError, match="causal_variant"):
        select_key_blocks(q, k, top_k=6, backend="reference", **kwargs)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_selection_rules(backend):
    """Forced sink and local blocks, nothing hidden, all it can up to top_k, no repeats, the scores followed."""
    B, H, HK, N, D, block, top_k = 1, 4, 2, 400, 32, 32, 4
    dtype = torch.float16 if backend == "triton" else torch.float32
    q, k = make_qk(B, H, HK, N, N, D, dtype, "HND", seed=7)
    sel = select_key_blocks(q, k, top_k=top_k, block_size=block, backend=backend, query_chunk=150)
    assert sel.shape == (B, HK, N, top_k) and sel.dtype == torch.int32
    pos = torch.arange(N).view(1, 1, N, 1)
    valid = sel >= 0
    assert ((sel * block <= pos) | ~valid).all()  # never a hidden block
    assert (sel == 0).any(-1).all()  # the sink
    assert (sel == pos // block).any(-1).all()  # the own block
    assert (valid.sum(-1) == torch.clamp(pos[..., 0] // block + 1, max=top_k)).all()  # all it can, up to top_k
    rows = sel.sort(-1).values
    assert not ((rows[..., 1:] == rows[..., :-1]) & (rows[..., 1:] >= 0)).any()  # no repeats
    if backend == "reference":  # the reference's query chunks bound its memory, not its choice: one query a step
        assert torch.equal(select_key_blocks(q[:, :, :40], k, top_k=top_k, block_size=block, backend=backend,
                                             query_chunk=1, causal_variant="upper_left"), sel[:, :, :40])
    local = select_key_blocks(q, k, top_k=top_k, block_size=block, backend=backend, local_blocks=3)
    own = (pos // block)
    for back in range(3):  # the own block and the two before it
        assert ((local == own - back).any(-1) | (own[..., 0] - back < 0)).all()
    # the choice follows the scores: a block whose mean key aligns with every query is picked first
    shared = torch.randn(D, generator=torch.Generator().manual_seed(1))
    q2, k2 = (q.float() + 2 * shared).to(dtype), k.clone()
    k2[:, :, 5 * block:6 * block] = (2 * shared).to(dtype)
    sel2 = select_key_blocks(q2, k2, top_k=3, block_size=block, backend=backend)
    assert (sel2[:, :, 6 * block:] == 5).any(-1).float().mean() > 0.95
    free = select_key_blocks(q, k, top_k=top_k, block_size=block, is_causal=False, sink_blocks=0, backend=backend)
    assert (free >= 0).all()


def test_group_heads_are_summed_after_their_own_softmax():
    """Independent of the reference: with two heads per group, a block that only one head likes, sharply, beats
    one that both like mildly only if the softmax is taken per head before the sum (NSA, Eq. 10)."""
    D, block = 16, 32
    q = torch.zeros(1, 2, 1, D)
    k = torch.zeros(1, 1, 4 * block, D)
    q[0, 0, 0, 0] = q[0, 1, 0, 1] = 1.0
    k[0, 0, block:2 * block, 0] = 12.0   # block 1: head 0's scores 12 / 4, head 1's 0
    k[0, 0, 2 * block:3 * block, :2] = 7.0  # block 2: both heads 7 / 4
    for backend, dtype in (("triton", torch.float16), ("reference", torch.float32)):
        sel = select_key_blocks(q.to(dtype), k.to(dtype), top_k=1, block_size=block, is_causal=False,
                                sink_blocks=0, backend=backend, scale=0.25)
        importance = reference_block_importance(q, k, block_size=block, is_causal=False, scale=0.25,
                                                sink_blocks=0, local_blocks=0)
        expected = int(importance[0, 0, 0].argmax())
        assert int(sel[0, 0, 0, 0]) == expected == 2, (backend, importance[0, 0, 0])


def test_a_block_whose_importance_underflows_to_zero_is_still_selected():
    """"All it can, up to top_k" holds at zero importance too. Block 3 of 4 scores 200 below the others (base e), so
    its softmax weight is exactly 0; with top_k 4 it is still returned, last. The kernel's 32-bit key for it is 0
    (importance bits 0; the last index of a power-of-two block count packs as 0): a validity test of `> 0` for
    `>= 0` dropped it and passed every other test."""
    D, block = 16, 32
    q = torch.zeros(1, 1, 3, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 4 * block, D)
    k[0, 0, 3 * block:, 0] = -200.0
    for backend, dtype in (("triton", torch.float16), ("reference", torch.float32)):
        sel = select_key_blocks(q.to(dtype), k.to(dtype), top_k=4, block_size=block, is_causal=False,
                                sink_blocks=0, backend=backend, scale=1.0)
        assert sel.tolist() == [[[[0, 1, 2, 3]] * 3]], backend


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=0), "top_k"),
    (dict(top_k=2, block_size=48), "block_size"),
    (dict(top_k=2, sink_blocks=-1), "sink_blocks"),
    (dict(top_k=2, backend="triton", dtype=torch.float32), "float16 or torch.bfloat16"),
])
def test_input_errors(bad, match):
    bad = dict(bad)
    dtype = bad.pop("dtype", torch.float16)
    q, k = make_qk(1, 2, 1, 64, 64, 16, dtype, "HND", seed=0)
    with pytest.raises(ValueError, match=match):
        select_key_blocks(q, k, **bad)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_custom_op_compiles_as_one_graph_and_matches(layout):
    q, k = make_qk(1, 4, 2, 150, 150, 16, torch.float32, layout, seed=3)
    kwargs = dict(top_k=3, block_size=32, tensor_layout=layout)
    eager = select_key_blocks(q, k, **kwargs)
    assert torch.equal(select_key_blocks_op(q, k, **kwargs), eager)
    torch.library.opcheck(torch.ops.sparge_diffusers.select_key_blocks.default,
                          (q, k, 3, 32, True, 0.25, 1, 1, layout))

    def layer(q, k):
        return select_key_blocks_op(q * 1.0, k, **kwargs) + 1

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first, second = compiled(q, k), compiled(q, k)
    assert torch.equal(first, eager + 1) and torch.equal(first, second)


@pytest.mark.gpu
def test_gpu_custom_op_under_inductor():
    q, k = make_qk(1, 8, 2, 1500, 1500, 128, torch.bfloat16, "HND", seed=9, device="cuda")
    eager = select_key_blocks(q, k, top_k=6, block_size=64)

    def layer(q, k):
        return select_key_blocks_op(q, k, top_k=6, block_size=64) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(q, k), eager * 2)


def draw_selection_call(seed: int, max_len: int = 400) -> dict:
    """One NSA-style selection call, a pure function of ``seed`` (and the bound on lengths): shapes, group (3 is
    padded to 4 inside the kernel, 16 packs four tokens per program), head dim, block, top_k (mostly below the key
    blocks there are, so that the choice matters; at times above), forced sink and local blocks, scale, causality
    and variant, dtype, layout (contiguous, a transposed view or a strided q), the kernel's chunk of block means and
    its int64 sort keys."""
    rng = random.Random(seed)
    causal = rng.random() < 0.6
    variant = rng.choice([None, None, "lower_right", "upper_left"]) if causal else None
    q_len = rng.randint(1, max_len)
    kv_len = q_len if causal and variant is None else rng.randint(1, max_len)
    block = rng.choice([32, 32, 64, 128])
    n_blocks = math.ceil(kv_len / block)
    top_k = rng.randint(1, max(1, n_blocks - 1)) if rng.random() < 0.8 else rng.randint(n_blocks, n_blocks + 4)
    kv_heads = rng.choice([1, 2])
    return dict(
        batch=rng.choice([1, 2]), kv_heads=kv_heads, heads=kv_heads * rng.choice([1, 2, 3, 4, 8, 16]),
        head_dim=rng.choice([16, 24, 32, 64, 96, 128]), block=block, top_k=top_k,
        sink_blocks=rng.choice([0, 1, 1, 2]), local_blocks=rng.choice([0, 1, 1, 3]),
        scale_factor=rng.choice([1.0, 1.0, 0.5, 2.0]), causal=causal, variant=variant, q_len=q_len, kv_len=kv_len,
        dtype=rng.choice([torch.bfloat16, torch.float16]), layout=rng.choice(["HND", "NHD"]),
        view=rng.choice(["contiguous", "contiguous", "transposed", "strided_q"]),
        select_chunk=rng.choice([16, selection_module.SELECT_CHUNK]), int64_keys=rng.random() < 0.25, seed=seed)


def check_selection_call(call: dict, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> None:
    """A drawn selection on the Triton kernel (the interpreter on the CPU): each row holds its top_k visible blocks
    (forced blocks first, no repeats, -1s last) of the float32 importance computed from the kernel's own block means
    (rounded to the inputs' dtype, as the kernel scores them) to the bits its sort key keeps plus float32 rounding,
    and of the exact float32 importance within the tolerance of those fp16/bf16 means.

    (A first version asked instead that all but 3% of rows pick the reference backend's set. On the GPU, at 92-93
    key blocks and top_k 52-55, seeds 220 and 431 had 3.4% and 4.1% of their rows picked apart from it, each within
    the half-precision tolerance: near-ties of bf16-rounded means, not a fault of the kernel.)"""
    monkeypatch.setattr(selection_module, "SELECT_CHUNK", call["select_chunk"])
    if call["int64_keys"]:
        monkeypatch.setattr(selection_module, "KEY32_MAX_BLOCKS", 0)
    B, H, HK, D, layout = call["batch"], call["heads"], call["kv_heads"], call["head_dim"], call["layout"]
    q_len, kv_len, top_k, variant, view = call["q_len"], call["kv_len"], call["top_k"], call["variant"], call["view"]
    q, k = apply_drawn_view(make_qk(B, H, HK, q_len, kv_len, D, call["dtype"],
                                    "HND" if view == "transposed" else layout, seed=call["seed"], device=device),
                            view, layout)
    kwargs = dict(block_size=call["block"], is_causal=call["causal"], scale=call["scale_factor"] * D ** -0.5,
                  sink_blocks=call["sink_blocks"], local_blocks=call["local_blocks"])
    got = select_key_blocks(q, k, top_k=top_k, tensor_layout=layout, causal_variant=variant, backend="triton",
                            **kwargs).cpu()
    qc, kc = q.cpu(), k.cpu()
    q_start = kv_len - q_len if variant == "lower_right" else 0
    importance = reference_block_importance(qc, kc, tensor_layout=layout, q_start=q_start, **kwargs)
    check_is_top_k(got, importance, top_k, tol=1e-2 * (H // HK) * max(call["scale_factor"], 1.0))
    check_top_k_at_kernel_precision(got, q, k, top_k, tensor_layout=layout, q_start=q_start, **kwargs)


@pytest.mark.parametrize("seed", range(RANDOM_FIRST, RANDOM_FIRST + RANDOM_CALLS))
def test_random_selection_matches_reference(seed, monkeypatch):
    """A drawn selection call (:func:`draw_selection_call`) in the interpreter, checked by
    :func:`check_selection_call`."""
    check_selection_call(draw_selection_call(seed), monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(GPU_FIRST, GPU_FIRST + GPU_CALLS))
def test_gpu_random_calls(seed, monkeypatch):
    """The CPU's drawn selection calls (:func:`draw_selection_call`), lengths to 3000, on the compiled kernel, checked
    by :func:`check_selection_call` against the float32 reference on the CPU."""
    check_selection_call(draw_selection_call(seed, max_len=3000), monkeypatch, device="cuda")
