"""Visual token permutations: bijections, inverses, text tokens, caching, and exactness of attention."""

import random

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import block_sparse_attention, relative_l1, sparge_attention
from sparge_diffusers.kernels.reference import reference_block_statistics
from sparge_diffusers.permutations import (
    ORDERS,
    block_self_similarity,
    grid_order,
    permuted,
    visual_token_permutation,
)
from sparge_diffusers.testing import video_like_qkv

GRIDS = [(3, 5, 7), (1, 9, 13), (13, 3, 1), (2, 4, 8), (1, 1, 1)]


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("grid", GRIDS)
def test_every_order_is_a_bijection(order, grid):
    perm = grid_order(grid, order, seed=3)
    n = grid[0] * grid[1] * grid[2]
    assert sorted(perm.tolist()) == list(range(n))


def test_orders_are_what_their_names_say():
    T, H, W = 2, 3, 4
    assert grid_order((T, H, W), "rowmajor").tolist() == list(range(T * H * W))
    # column-major: within a frame, down a column first
    assert grid_order((T, H, W), "colmajor")[:3].tolist() == [0, W, 2 * W]
    # time-major: the same pixel across frames first
    assert grid_order((T, H, W), "timemajor")[:2].tolist() == [0, H * W]
    # Hilbert: consecutive tokens are grid neighbours when the grid is a power-of-two cube, or square (an image,
    # or one row over time: a 2-D curve; a 3-D curve through the plane would jump up to 3 steps at 8 x 8)
    for grid in ((4, 4, 4), (1, 8, 8), (8, 1, 8), (16, 16, 1)):
        c = torch.tensor([(t, h, w) for t in range(grid[0]) for h in range(grid[1]) for w in range(grid[2])])
        path = c[torch.from_numpy(grid_order(grid, "hilbert"))]
        assert ((path[1:] - path[:-1]).abs().sum(-1) == 1).all(), grid
    # random is seeded
    assert (grid_order((T, H, W), "random", seed=1) == grid_order((T, H, W), "random", seed=1)).all()
    assert (grid_order((T, H, W), "random", seed=1) != grid_order((T, H, W), "random", seed=2)).any()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_inverse_restores_and_text_tokens_stay(layout, order):
    grid, before, after = (3, 5, 7), 4, 2
    n = before + 105 + after
    p = visual_token_permutation(grid, order, text_before=before, text_after=after)
    x = torch.randn(2, 3, n, 8) if layout == "HND" else torch.randn(2, n, 3, 8)
    y = p.apply(x, layout)
    assert torch.equal(p.restore(y, layout), x)
    seq = 2 if layout == "HND" else 1
    assert torch.equal(y.narrow(seq, 0, before), x.narrow(seq, 0, before))
    assert torch.equal(y.narrow(seq, n - after, after), x.narrow(seq, n - after, after))


def test_cache_hit_returns_the_same_tensors():
    a = visual_token_permutation((3, 5, 7), "hilbert", text_before=1)
    b = visual_token_permutation((3, 5, 7), "hilbert", text_before=1)
    assert a.perm is b.perm and a.inverse is b.inverse
    assert visual_token_permutation((3, 5, 7), "hilbert", text_before=2).perm is not a.perm


def test_hilbert_order_of_the_full_mochi_grid_is_a_permutation():
    # full size (a 28 x 30 x 53 grid, not a power of two): no test times it (project rule); its build time is
    # what any pipeline pays once per grid, and is cached after that
    p = visual_token_permutation((28, 30, 53), "hilbert", text_before=256, seed=99)
    assert len(p) == 44776
    assert torch.equal(p.perm.sort().values, torch.arange(44776))
    assert torch.equal(p.perm[p.inverse], torch.arange(44776))
    assert torch.equal(p.perm[:256], torch.arange(256))  # text tokens left in place


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("order", ["hilbert", "random", "timemajor"])
def test_permuted_attention_keeping_everything_equals_dense(layout, order):
    grid, text = (3, 7, 9), 5
    q, k, v = video_like_qkv(grid, heads=2, head_dim=64, text_tokens=text, dtype=torch.float16,
                             tensor_layout=layout, seed=2)
    p = visual_token_permutation(grid, order, text_before=text)
    attention = permuted(sparge_attention, p)
    for backend in ("triton", "reference"):
        out = attention(q, k, v, tensor_layout=layout, cdfthreshd=1.0, pvthreshd=None, backend=backend)
        qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
        dense = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float())
        dense = dense if layout == "HND" else dense.transpose(1, 2)
        assert relative_l1(out, dense) < 2e-3, backend
    # a returned (out, stats) tuple keeps its stats
    out, stats = attention(q, k, v, tensor_layout=layout, return_sparsity=True, backend="reference")
    assert out.shape == q.shape and 0 <= stats.sparsity <= 1


@pytest.mark.parametrize("seed", range(40))
def test_random_permutation_is_a_bijection_that_moves_only_the_grid(seed):
    """A drawn grid (any sizes, not only powers of two), order, text lengths and layout: the permutation is a
    bijection, moves the grid's tokens among themselves only, ``restore`` undoes ``apply``, each order visits the
    grid as its name says, and attention through :func:`permuted` (float32 reference, every block) equals dense
    attention in the original order."""
    rng = random.Random(seed)
    grid = tuple(rng.randint(1, 12) for _ in range(3))
    order, layout = rng.choice(sorted(ORDERS)), rng.choice(["HND", "NHD"])
    before, after = rng.choice([0, 0, 1, 7, 20]), rng.choice([0, 0, 3])
    T, H, W = grid
    n = before + T * H * W + after
    p = visual_token_permutation(grid, order, text_before=before, text_after=after, seed=seed)
    perm = p.perm.tolist()
    assert len(p) == n and sorted(perm) == list(range(n))
    assert perm[:before] == list(range(before)) and perm[n - after:] == list(range(n - after, n))
    visual = [i - before for i in perm[before:n - after]]  # row-major (t, h, w) indices in visiting order
    coords = [(i // (H * W), i // W % H, i % W) for i in visual]
    if order == "rowmajor":
        assert visual == list(range(T * H * W))
    elif order == "colmajor":  # frame by frame, down each column
        assert coords == sorted(coords, key=lambda c: (c[0], c[2], c[1]))
    elif order == "timemajor":  # each pixel across frames first
        assert coords == sorted(coords, key=lambda c: (c[1], c[2], c[0]))
    x = torch.randn(1, 2, n, 16) if layout == "HND" else torch.randn(1, n, 2, 16)
    assert torch.equal(p.restore(p.apply(x, layout), layout), x)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(x.shape, generator=g) for _ in range(3))
    attention = permuted(block_sparse_attention, p)
    out = attention(q, k, v, None, tensor_layout=layout, backend="reference")
    qh, kh, vh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v))
    dense = F.scaled_dot_product_attention(qh, kh, vh)
    torch.testing.assert_close(out, dense if layout == "HND" else dense.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_permutation_errors():
    p = visual_token_permutation((2, 2, 2), "hilbert")
    with pytest.raises(ValueError, match="does not match"):
        p.apply(torch.randn(1, 1, 9, 8))
    with pytest.raises(ValueError, match="unknown order"):
        visual_token_permutation((2, 2, 2), "zigzag")
    with pytest.raises(ValueError, match="causal"):
        permuted(sparge_attention, p)(*[torch.randn(1, 1, 8, 64)] * 3, is_causal=True)
    # an out= buffer ends in the original order, the one the returned tensor has (it held the permuted rows)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    for return_sparsity in (False, True):
        buf = torch.full_like(q, float("nan"))
        got = permuted(sparge_attention, p)(q, k, v, out=buf, backend="reference", cdfthreshd=1.0, pvthreshd=None,
                                            return_sparsity=return_sparsity)
        got = got[0] if return_sparsity else got
        assert got is buf
        torch.testing.assert_close(buf, want, atol=1e-5, rtol=1e-5)
    # the rest ran in no test before session 84
    from sparge_diffusers.permutations import block_self_similarity, last_block_key_importance, segmented_key_order

    x = torch.randn(1, 1, 8, 16)
    cases = [
        (lambda: visual_token_permutation((2, 0, 2), "hilbert"), r"grid must be three positive sizes \(T, H, W\)"),
        (lambda: visual_token_permutation((2, 2), "hilbert"), "grid must be three positive sizes"),
        (lambda: visual_token_permutation((2, 2, 2), "hilbert", text_before=-1), "text_before and text_after"),
        # int() truncated these, silently: a (2, 4, 4) grid, two text tokens, seed 1
        (lambda: visual_token_permutation((2, 4.7, 4), "hilbert"),
         r"three positive sizes \(T, H, W\) as ints, got \(2, 4.7, 4\)"),
        (lambda: visual_token_permutation((2, True, 4), "hilbert"), "three positive sizes"),
        (lambda: visual_token_permutation((2, 4, 4), "hilbert", text_before=2.5), "ints >= 0, got 2.5 and 0"),
        (lambda: visual_token_permutation((2, 4, 4), "random", seed=1.5), "seed must be an int, got 1.5"),
        (lambda: p.apply(x[0]), r"expected a 4-D tensor \(\(B, H, N, D\) in layout HND\), got shape \(1, 8, 16\)"),
        (lambda: p.restore(x[0], "NHD"), r"\(B, N, H, D\) in layout NHD"),
        (lambda: p.apply(x, "BHSD"), "tensor_layout must be 'HND' or 'NHD', got 'BHSD'"),
        (lambda: p.restore(x.to("meta")), "permutation indices are on cpu, tensor on meta"),
        (lambda: block_self_similarity(x, 4, "BHSD"), "tensor_layout must be 'HND' or 'NHD'"),
        (lambda: block_self_similarity(x[0], 4), r"4-D tensor and an int block_size >= 1, got shape \(1, 8, 16\)"),
        (lambda: block_self_similarity(x, 0), "block_size >= 1"),
        # True read as block size 1, 4.0 failed inside F.pad, an empty sequence raised an IndexError and zero
        # channels gave a similarity of 0
        (lambda: block_self_similarity(x, True), "int block_size >= 1, got .*, True"),
        (lambda: block_self_similarity(x, 4.0), "int block_size >= 1, got .*, 4.0"),
        (lambda: block_self_similarity(x[:, :, :0], 4), "tokens with channels"),
        (lambda: block_self_similarity(x[..., :0], 4), "tokens with channels"),
        (lambda: last_block_key_importance(x, x, backend="cuda"), "backend must be 'auto', 'triton' or 'torch'"),
        (lambda: segmented_key_order(x[:, :, :, 0], True), "segment must be a positive int, got True"),
        (lambda: segmented_key_order(x[:, :, :, 0], 4.0), "segment must be a positive int, got 4.0"),
        (lambda: last_block_key_importance(x[..., :12], x[..., :12], backend="triton"),
         "power-of-two head dim >= 16 .* got D = 12"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    import numpy as np

    as_ints = visual_token_permutation((2, 4, 4), "random", text_before=3, seed=5)
    other_ints = visual_token_permutation((np.int64(2), torch.tensor(4), 4), "random", text_before=np.int32(3),
                                          seed=torch.tensor(5))
    assert torch.equal(other_ints.perm, as_ints.perm) and torch.equal(other_ints.inverse, as_ints.inverse)


def test_a_hand_made_token_permutation_is_checked_when_made():
    """TokenPermutation is public: one built by hand that is no permutation, or whose inverse is not its inverse,
    was taken as given. The output's rows then came back in wrong places (or, on CUDA, an index past N made the
    Triton copy read other memory). A valid one made by hand permutes as a built one does."""
    from sparge_diffusers.permutations import TokenPermutation

    def long(*values):
        return torch.tensor(values, dtype=torch.int64)

    bad = [
        ((long(0, 1, 2), long(0, 2, 1)), "permutation of 0..N-1 and inverse its inverse"),  # a wrong inverse
        ((long(0, 0, 2), long(0, 1, 2)), "permutation of 0..N-1"),  # an index twice
        ((long(0, 1, 3), long(0, 1, 2)), "permutation of 0..N-1"),  # past N
        ((long(0, 1, -1), long(0, 1, 2)), "permutation of 0..N-1"),  # negative (index_select read it from the end)
        ((long(0, 1), long(0, 1, 2)), "one length and device, got 2 on cpu and 3 on cpu"),
        ((torch.tensor([0.0, 1.0]), long(0, 1)), r"perm must be a 1-D int64 tensor, got torch.float32 of shape \(2,\)"),
        ((long(0, 1), long(0, 1).int()), "inverse must be a 1-D int64 tensor, got torch.int32"),
        ((long(0, 1)[None], long(0, 1)), r"1-D int64 tensor, got torch.int64 of shape \(1, 2\)"),
        (([0, 1], long(0, 1)), "1-D int64 tensor, got list"),
    ]
    for (perm, inverse), message in bad:
        with pytest.raises(ValueError, match=message):
            TokenPermutation(perm, inverse)
    TokenPermutation(long(), long())  # no tokens
    TokenPermutation(long(0, 1).to("meta"), long(0, 1).to("meta"))  # no values to check
    built = visual_token_permutation((2, 3, 5), "hilbert", text_before=3)
    by_hand = TokenPermutation(built.perm.clone(), built.inverse.clone())
    reverse = TokenPermutation(torch.arange(32, -1, -1), torch.arange(32, -1, -1))
    q, k, v = (torch.randn(1, 2, 33, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    for p in (by_hand, reverse):
        got = permuted(sparge_attention, p)(q, k, v, backend="reference", cdfthreshd=1.0, pvthreshd=None)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(by_hand.apply(q), built.apply(q))


@pytest.mark.parametrize("block", [1, 7, 64, 128])
def test_block_self_similarity_matches_gram_definition(block):
    x = torch.randn(2, 3, 300, 64) + 0.5
    if block == 1:  # each token is its own block: cos(x, x) = 1
        torch.testing.assert_close(block_self_similarity(x, 1), torch.ones(2, 3, 300))
    torch.testing.assert_close(block_self_similarity(x, block), reference_block_statistics(x, block)[1])
    torch.testing.assert_close(block_self_similarity(x.transpose(1, 2), block, "NHD"),
                               reference_block_statistics(x, block)[1])


def test_hilbert_raises_self_similarity_over_random():
    grid = (4, 16, 16)
    q, k, _ = video_like_qkv(grid, heads=2, head_dim=64, seed=4)
    sims = {}
    for order in ("hilbert", "random"):
        p = visual_token_permutation(grid, order)
        sims[order] = float(block_self_similarity(p.apply(k), 64).mean())
    assert sims["hilbert"] > sims["random"] + 0.05


@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("D", [64, 72])
def test_triton_row_gather_equals_index_select(seq_dim, D):
    from sparge_diffusers.permutations.gather import _gather_rows_kernel  # noqa: F401  (interpreter run below)
    import triton

    x = torch.randn(2, 37, 3, D) if seq_dim == 1 else torch.randn(2, 3, 37, D)
    index = torch.randperm(37)
    xh = x if seq_dim == 2 else x.transpose(1, 2)
    out = torch.full_like(x, float("nan"))
    oh = out if seq_dim == 2 else out.transpose(1, 2)
    _gather_rows_kernel[(triton.cdiv(37, 16), 6)](
        xh, index, oh, 37, 3, xh.stride(0), xh.stride(1), xh.stride(2), oh.stride(0), oh.stride(1), oh.stride(2),
        D=D, D_PAD=triton.next_power_of_2(D), ROWS=16)
    assert torch.equal(out, x.index_select(seq_dim, index))


@pytest.mark.parametrize("index_batch", [2, 1])
@pytest.mark.parametrize("D", [64, 72])
def test_triton_per_head_row_gather_equals_torch_gather(index_batch, D):
    """The row gather with one index per (batch, head) (PBS's per-head key order), or per head broadcast over the
    batch, against torch.gather; NaN-poisoned output, a ragged last row tile."""
    from sparge_diffusers.permutations.gather import _gather_rows_kernel, gather_rows_per_head
    import triton

    x = torch.randn(2, 3, 37, D)
    index = torch.stack([torch.stack([torch.randperm(37) for _ in range(3)]) for _ in range(index_batch)])
    expected = torch.gather(x, 2, index.expand(2, 3, 37).unsqueeze(-1).expand(x.shape))
    out = torch.full_like(x, float("nan"))
    _gather_rows_kernel[(triton.cdiv(37, 16), 6)](
        x, index, out, 37, 3, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=D, D_PAD=triton.next_power_of_2(D), ROWS=16, stride_ib=index.stride(0) if index_batch > 1 else 0,
        stride_ih=index.stride(1))
    assert torch.equal(out, expected)
    assert torch.equal(gather_rows_per_head(x, index), expected)  # the CPU path


def test_row_gathers_take_the_triton_copy_only_where_it_applies(monkeypatch):
    """The dispatch of ``gather_rows`` and ``gather_rows_per_head``, run without a GPU by letting CPU tensors take
    the Triton copy under the interpreter: both sequence dims on dense and on diffusers-like strided views, one
    index per head with and without a batch, NaN-poisoned outputs; and the inputs the copy cannot read (a strided
    last dim or index) or that autograd records through go to torch, with the same result."""
    from sparge_diffusers._launch import interpreting
    from sparge_diffusers.permutations import gather

    if not interpreting():
        pytest.skip("runs the Triton copy on CPU tensors, which needs TRITON_INTERPRET=1")
    monkeypatch.setattr(gather, "_COPY_DEVICES", ("cuda", "cpu"))
    copies = []
    launch = gather._launch_gather
    monkeypatch.setattr(gather, "_launch_gather", lambda *a: (copies.append(a[0].shape), launch(*a))[1])
    nan_empty_like = torch.empty_like
    monkeypatch.setattr(gather.torch, "empty_like", lambda t: nan_empty_like(t).fill_(float("nan")))

    index = torch.randperm(37)
    projection = torch.randn(2, 37, 3 * 72)  # diffusers' (B, N, H*D) projection and its (B, H, N, D) view
    for x, seq_dim in [(torch.randn(2, 3, 37, 64), 2), (torch.randn(2, 37, 3, 64), 1),
                       (projection.view(2, 37, 3, 72).transpose(1, 2), 2), (projection.view(2, 37, 3, 72), 1)]:
        out = gather.gather_rows(x, index, seq_dim)
        assert torch.equal(out, x.index_select(seq_dim, index)) and out.stride() == x.stride()
    assert len(copies) == 4
    for index_batch in (2, 1):
        x = torch.randn(2, 3, 37, 72)
        order = torch.stack([torch.stack([torch.randperm(37) for _ in range(3)]) for _ in range(index_batch)])
        expected = torch.gather(x, 2, order.expand(2, 3, 37).unsqueeze(-1).expand(x.shape))
        assert torch.equal(gather.gather_rows_per_head(x, order), expected)
    assert len(copies) == 6

    x = torch.randn(2, 3, 37, 128)
    fallbacks = [(x[..., ::2], index, torch.randperm(37).expand(1, 3, 37)),  # strided last dim of x
                 (x, torch.randint(0, 37, (74,))[::2], torch.randint(0, 37, (1, 3, 37, 2))[..., 0])]  # of index
    for y, flat, order in fallbacks:
        assert torch.equal(gather.gather_rows(y, flat, 2), y.index_select(2, flat))
        assert torch.equal(gather.gather_rows_per_head(y, order),
                           torch.gather(y, 2, order.expand(2, 3, 37).unsqueeze(-1).expand(y.shape)))
    w = torch.randn(2, 3, 37, 128)
    tracked = x.clone().requires_grad_()
    (gather.gather_rows(tracked, index, 2) * w).sum().backward()
    assert torch.equal(tracked.grad, torch.zeros_like(w).index_add_(2, index, w))
    assert len(copies) == 6, "only dense, untracked inputs take the copy"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_permutation_round_trip(layout):
    p = visual_token_permutation((5, 7, 9), "hilbert", text_before=3, text_after=2, device="cuda")
    x = torch.randn(2, 4, 320, 128, device="cuda", dtype=torch.bfloat16)
    x = x if layout == "HND" else x.transpose(1, 2).contiguous()
    seq = 2 if layout == "HND" else 1
    y = p.apply(x, layout)
    assert torch.equal(y, x.index_select(seq, p.perm))
    assert torch.equal(p.restore(y, layout), x)


@pytest.mark.gpu
def test_gpu_permuted_attention_keeps_the_callers_layout():
    """Diffusers passes (B, H, N, D) views of (B, N, H*D) projections and reads the output back through the
    opposite transpose: the permuted path's output must be laid out like that too (no copy on read-back),
    and equal the unpermuted reference of the same permuted call."""
    p = visual_token_permutation((5, 7, 9), "hilbert", text_before=3, text_after=2, device="cuda")
    q, k, v = (torch.randn(2, 320, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    out = permuted(sparge_attention, p)(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    ref = p.restore(sparge_attention(*(p.apply(t.contiguous()) for t in (q, k, v)), backend="reference"))
    assert relative_l1(out, ref) < 0.01


@pytest.mark.gpu
def test_gpu_gathers_keep_autograd():
    """On CUDA the row gathers are a Triton copy without a backward pass: where autograd records through the
    input they run torch's gather instead, so a permutation inside a training step keeps its gradient (and the
    sparse call behind ``permuted`` then refuses such inputs rather than lose their gradient)."""
    from sparge_diffusers.permutations.gather import gather_rows_per_head

    p = visual_token_permutation((5, 7, 9), "hilbert", text_before=3, text_after=2, device="cuda")
    x = torch.randn(2, 4, 320, 64, device="cuda", requires_grad=True)
    w = torch.randn(2, 4, 320, 64, device="cuda")
    (p.apply(x) * w).sum().backward()
    assert torch.equal(x.grad, w.index_select(2, p.inverse))
    order = torch.stack([torch.randperm(320, device="cuda") for _ in range(4)])[None]
    x.grad = None
    (gather_rows_per_head(x, order) * w).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(w).scatter_(2, order.expand(2, 4, 320)[..., None].expand(w.shape), w))
    with torch.no_grad():
        assert torch.equal(p.apply(x), x.index_select(2, p.perm))  # the Triton copy
    q = x.to(torch.bfloat16)
    with pytest.raises(ValueError, match="requires grad"):
        permuted(sparge_attention, p)(q, q.detach(), q.detach())


def test_permutation_cache_returns_the_same_tensors_and_stays_bounded():
    from sparge_diffusers.permutations import orders

    first = visual_token_permutation((1, 4, 4), "hilbert", text_before=3)
    assert visual_token_permutation((1, 4, 4), "hilbert", text_before=3) is first  # no rebuild, no copy
    for w in range(1, orders._MAX_PERMUTATIONS + 10):
        visual_token_permutation((1, 2, w), "rowmajor")
    assert len(orders._PERMUTATIONS) == orders._MAX_PERMUTATIONS
    assert visual_token_permutation((1, 4, 4), "hilbert", text_before=3) is not first, "the oldest was dropped"
