"""Orders of a (T, H, W) token grid, and applying them to q/k/v and their inverse to the output."""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, cast

import numpy as np
import torch

from .gather import gather_rows

Grid = tuple[int, int, int]


def _coords(grid: Grid) -> np.ndarray:
    """[T*H*W, 3] (t, h, w) of the tokens in storage order (row-major, w fastest)."""
    T, H, W = grid
    t, h, w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    return np.stack([t.ravel(), h.ravel(), w.ravel()], axis=1)


def _sort_by(*keys: np.ndarray) -> np.ndarray:
    return np.lexsort(keys[::-1])  # np.lexsort sorts by the last key first


def _hilbert(grid: Grid, seed: int) -> np.ndarray:
    """Visit the tokens in the order of a Hilbert curve through the smallest power-of-two cube holding the
    grid, over the axes longer than 1 (an image uses a 2-D curve). For sizes that are not powers of two the
    visit jumps where the curve leaves the grid, but stays local: neighbours on the curve are neighbours in
    space."""
    from hilbertcurve.hilbertcurve import HilbertCurve

    coords = _coords(grid)
    axes = [i for i, n in enumerate(grid) if n > 1] or [2]
    bits = max(1, math.ceil(math.log2(max(grid))))
    curve = HilbertCurve(bits, len(axes))
    distances = np.asarray(curve.distances_from_points(coords[:, axes].tolist()), dtype=np.int64)
    return np.argsort(distances, kind="stable")


def _rowmajor(grid: Grid, seed: int) -> np.ndarray:
    return np.arange(math.prod(grid))


def _colmajor(grid: Grid, seed: int) -> np.ndarray:
    c = _coords(grid)
    return _sort_by(c[:, 0], c[:, 2], c[:, 1])  # frame by frame, each frame column by column


def _timemajor(grid: Grid, seed: int) -> np.ndarray:
    c = _coords(grid)
    return _sort_by(c[:, 1], c[:, 2], c[:, 0])  # the same pixel across frames is contiguous


def _random(grid: Grid, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(math.prod(grid))


# name -> function(grid, seed) giving, for each position of the new order, the token it takes
ORDERS: dict[str, Callable[[Grid, int], np.ndarray]] = {
    "hilbert": _hilbert,
    "rowmajor": _rowmajor,
    "colmajor": _colmajor,
    "timemajor": _timemajor,
    "random": _random,
}


def _whole(value: Any) -> int | None:
    """``value`` as an int where it is one (Python or NumPy ints, 0-dim integer tensors), else None: int() made
    a grid of (2, 4.7, 4) sizes (2, 4, 4) and text_before=2.5 two tokens, silently."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _grid_sizes(grid: Grid) -> tuple[int, int, int]:
    sizes = tuple(_whole(n) for n in grid)
    if len(sizes) != 3 or any(n is None or n < 1 for n in sizes):
        raise ValueError(f"grid must be three positive sizes (T, H, W) as ints, got {grid}")
    t, h, w = cast("tuple[int, int, int]", sizes)
    return t, h, w


def grid_order(grid: Grid, order: str, seed: int = 0) -> np.ndarray:
    """The permutation of T*H*W row-major tokens: new position i holds old token ``perm[i]``."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose from {sorted(ORDERS)}")
    return ORDERS[order](_grid_sizes(grid), seed)


@dataclass(frozen=True)
class TokenPermutation:
    """A permutation of the sequence dimension and its inverse, as 1-D int64 index tensors on one device.

    Checked when made (one read-back on a GPU; :func:`visual_token_permutation` caches what it builds): the indices
    must be a permutation of 0..N-1 and ``inverse`` its inverse. Raises ValueError otherwise."""

    perm: torch.Tensor
    inverse: torch.Tensor

    def __post_init__(self) -> None:
        # a hand-made permutation was taken as given: the Triton copy reads its indices unchecked (one out of range
        # reads other memory), and a duplicate or a wrong inverse put the output's rows in wrong places without a word
        for name, t in (("perm", self.perm), ("inverse", self.inverse)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"TokenPermutation.{name} must be a 1-D int64 tensor, got {got}")
        if self.perm.shape != self.inverse.shape or self.perm.device != self.inverse.device:
            raise ValueError(f"TokenPermutation's perm and inverse must have one length and device, got "
                             f"{self.perm.numel()} on {self.perm.device} and {self.inverse.numel()} on "
                             f"{self.inverse.device}")
        if torch.compiler.is_compiling() or self.perm.device.type == "meta":
            return  # (inside a compiled graph: the constants _build made and checked; meta tensors hold no values)
        n = self.perm.numel()
        in_range = ((self.perm >= 0) & (self.perm < n)).all()
        # inverse[perm] = 0..N-1 holds only for a permutation (no index twice) and its inverse
        inverts = (self.inverse[self.perm.clamp(0, max(n - 1, 0))] == torch.arange(n, device=self.perm.device)).all()
        if not bool(in_range & inverts):
            raise ValueError("TokenPermutation's perm must be a permutation of 0..N-1 and inverse its inverse "
                             "(inverse[perm[i]] == i)")

    def __len__(self) -> int:
        return self.perm.numel()

    def _gather(self, x: torch.Tensor, index: torch.Tensor, tensor_layout: str) -> torch.Tensor:
        dim = {"HND": 2, "NHD": 1}.get(tensor_layout)
        if dim is None:
            raise ValueError(f"tensor_layout must be 'HND' or 'NHD', got {tensor_layout!r}")
        if x.dim() != 4:  # the Triton copy reads rows of (B, H, N, D) views; index_select would take any shape
            raise ValueError(f"expected a 4-D tensor ({'(B, H, N, D)' if dim == 2 else '(B, N, H, D)'} in layout "
                             f"{tensor_layout}), got shape {tuple(x.shape)}")
        if x.shape[dim] != index.numel():
            raise ValueError(f"sequence length {x.shape[dim]} does not match the permutation's {index.numel()} "
                             f"tokens (layout {tensor_layout})")
        if index.device != x.device:
            raise ValueError(f"permutation indices are on {index.device}, tensor on {x.device}")
        return gather_rows(x, index, dim)  # one gather

    def apply(self, x: torch.Tensor, tensor_layout: str = "HND") -> torch.Tensor:
        """Reorder the tokens of q, k or v."""
        return self._gather(x, self.perm, tensor_layout)

    def restore(self, x: torch.Tensor, tensor_layout: str = "HND") -> torch.Tensor:
        """Put the tokens of an output back in the original order."""
        return self._gather(x, self.inverse, tensor_layout)


# Built permutations by (grid, order, text_before, text_after, device, seed). A plain dict rather than an
# lru_cache. A few KB to MB per entry, the oldest dropped beyond _MAX_PERMUTATIONS (the bound the lru_cache had).
_PERMUTATIONS: dict[tuple, TokenPermutation] = {}
_MAX_PERMUTATIONS = 64


def _cached(grid: Grid, order: str, text_before: int, text_after: int, device: str, seed: int
            ) -> TokenPermutation:
    key = (grid, order, text_before, text_after, device, seed)
    if torch.compiler.is_compiling():
        return TokenPermutation(*_permutation_constants(key))
    found = _PERMUTATIONS.get(key)
    return found if found is not None else _build_and_store(key)


# While torch.compile traces, the permutation is looked up (or built: NumPy work Dynamo cannot trace) there and
# then, and its tensors become constants of the graph: the key holds only trace-time constants, so the graph
# needs no break and no guard on the cache's contents (fullgraph=True holds before any eager call built it).
@torch.compiler.assume_constant_result
def _permutation_constants(key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    built = _PERMUTATIONS.get(key)
    if built is None:
        built = _build_and_store(key)
    return built.perm, built.inverse


def _build_and_store(key: tuple) -> TokenPermutation:
    if len(_PERMUTATIONS) >= _MAX_PERMUTATIONS:
        del _PERMUTATIONS[next(iter(_PERMUTATIONS))]  # insertion order: the oldest
    built = _PERMUTATIONS[key] = _build(*key)
    return built


def _build(grid: Grid, order: str, text_before: int, text_after: int, device: str, seed: int) -> TokenPermutation:
    visual = torch.from_numpy(np.ascontiguousarray(grid_order(grid, order, seed))).long()
    n_vis = visual.numel()
    perm = torch.cat([torch.arange(text_before), visual + text_before,
                      torch.arange(text_before + n_vis, text_before + n_vis + text_after)])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return TokenPermutation(perm.to(device), inverse.to(device))


def visual_token_permutation(grid: Grid, order: str, *, text_before: int = 0, text_after: int = 0,
                             device: str | torch.device = "cpu", seed: int = 0) -> TokenPermutation:
    """Permutation of a sequence made of ``text_before`` tokens, a (T, H, W) grid, then ``text_after`` tokens.

    Only the visual span moves; text tokens keep their positions. Built once per (grid, order, text
    lengths, device, seed) and cached: a repeated call returns the same tensors.

    Args:
        grid: (T, H, W) sizes of the visual tokens, stored row-major (W fastest).
        order: "hilbert", "rowmajor" (identity), "colmajor", "timemajor" or "random" (seeded).
    """
    before, after, whole_seed = _whole(text_before), _whole(text_after), _whole(seed)
    if before is None or after is None or before < 0 or after < 0:
        raise ValueError(f"text_before and text_after must be ints >= 0, got {text_before!r} and {text_after!r}")
    if whole_seed is None:
        raise ValueError(f"seed must be an int, got {seed!r}")
    return _cached(_grid_sizes(grid), order, before, after, str(torch.device(device)), whole_seed)


def permuted(attention_fn: Callable, permutation: TokenPermutation) -> Callable:
    """Wrap an attention function ``f(q, k, v, *, tensor_layout=..., **kw)``: permute q, k, v, call it, and
    put its output (or the first element of a returned tuple) back in the original order. An ``out=`` buffer
    receives the output in the original order too.

    Not for causal attention: reordering tokens changes which keys a query may see.
    """

    @functools.wraps(attention_fn)
    def wrapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, tensor_layout: str = "HND", **kwargs):
        if kwargs.get("is_causal"):
            raise ValueError("a token permutation cannot be combined with causal attention")
        result = attention_fn(permutation.apply(q, tensor_layout), permutation.apply(k, tensor_layout),
                              permutation.apply(v, tensor_layout), *args, tensor_layout=tensor_layout, **kwargs)
        first = result[0] if isinstance(result, tuple) else result
        restored = permutation.restore(first, tensor_layout)
        if kwargs.get("out") is not None:
            # the attention wrote the permuted output into out (after checking it); restoring returned a new tensor
            # and left out in the permuted order, where a caller reading out found its rows shuffled
            restored = kwargs["out"].copy_(restored)
        return (restored,) + result[1:] if isinstance(result, tuple) else restored

    return wrapped
