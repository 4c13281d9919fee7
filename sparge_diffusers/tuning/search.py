"""The per-layer threshold search of SpargeAttn section 3.6, one attention layer at a time.

Phase 1 grid-searches (simthreshd1, cdfthreshd) with stage 2 off for the highest sparsity whose relative L1
error stays below ``l1``; phase 2 keeps that pair and searches pvthreshd for the highest sparsity below
``l2``. A :class:`ThresholdSearch` sees one attention call at a time (``observe``): it runs every grid point
on that call's q, k, v with the Triton kernels (or the reference on CPU) and keeps only small per-head
tallies on the device, so memory stays bounded however many calls calibration makes.

Departures from the paper, both optional: the choice is made per head by default (one threshold per head,
as upstream SpargeAttn's tuner does; ``per_head=False`` chooses one per layer), and the error must hold on
every calibration call (``aggregate="max"``, the strict reading of "constrain the error across the inputs";
``"mean"`` bounds the average instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from ..kernels import sparge_attention
from ..kernels._inputs import THRESHOLD_RANGES, check_flag, check_threshold_values

# theta = 1 keeps every block (no block similarity exceeds 1) and tau = 1 keeps every key block with any
# probability, so the densest point of the default grid is exact up to rounding: a budget is always met.
DEFAULT_SIMTHRESHD1 = (0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DEFAULT_CDFTHRESHD = (0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)
# pvthreshd >= 24 (kernels.api.PV_TEST_LIMIT) turns stage 2 off; 50 is upstream's default.
DEFAULT_PVTHRESHD = (50.0, 20.0, 16.0, 12.0, 10.0, 8.0, 6.0, 4.0, 3.0, 2.0, 1.0)

Aggregate = Literal["max", "mean"]


@dataclass(frozen=True)
class ThresholdGrid:
    """The candidate values of each threshold."""

    simthreshd1: tuple[float, ...] = DEFAULT_SIMTHRESHD1
    cdfthreshd: tuple[float, ...] = DEFAULT_CDFTHRESHD
    pvthreshd: tuple[float, ...] = DEFAULT_PVTHRESHD

    def __post_init__(self):
        # checked here, before tune() runs the model, rather than by the kernels at the first calibration call
        for name in THRESHOLD_RANGES:
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not values or None in values:
                raise ValueError(f"ThresholdGrid.{name} must be a non-empty sequence of numbers, got {values!r}")
            check_threshold_values(name, values)

    def stage1_points(self) -> list[tuple[float, float]]:
        """(theta, tau) pairs; with theta >= 1 every block is kept whatever tau, so only one such pair."""
        points = [(s, c) for s in self.simthreshd1 if s < 1 for c in self.cdfthreshd]
        if any(s >= 1 for s in self.simthreshd1):
            points.append((max(self.simthreshd1), max(self.cdfthreshd)))
        return points


@dataclass
class LayerChoice:
    """The thresholds chosen for one layer (lists hold one value per head) and what calibration measured."""

    simthreshd1: list[float]
    cdfthreshd: list[float]
    pvthreshd: list[float]
    sparsity: float  # mean over heads and calibration calls
    l1: float  # relative L1 aggregated over calls: the layer's, or with per-head choices the worst head's
    sparsity_per_head: list[float]
    l1_per_head: list[float]
    calls: int
    within_budget: bool  # False when not even the densest grid point met the budget

    def as_dict(self) -> dict:
        """What calibration measured, for the settings file (the thresholds are stored with the layer's settings)."""
        return {"sparsity": self.sparsity, "l1": self.l1, "sparsity_per_head": self.sparsity_per_head,
                "l1_per_head": self.l1_per_head, "calls": self.calls, "within_budget": self.within_budget}


@dataclass
class _Tally:
    """Per grid point and head: summed sparsity, summed and worst relative L1, and the same for the layer."""

    points: int
    heads: int
    device: torch.device
    calls: int = 0
    sparsity: torch.Tensor = field(init=False)
    l1_sum: torch.Tensor = field(init=False)
    l1_max: torch.Tensor = field(init=False)
    layer_l1_sum: torch.Tensor = field(init=False)
    layer_l1_max: torch.Tensor = field(init=False)

    def __post_init__(self):
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=self.device)  # noqa: E731
        self.sparsity, self.l1_sum, self.l1_max = z(self.points, self.heads), z(self.points, self.heads), \
            z(self.points, self.heads)
        self.layer_l1_sum, self.layer_l1_max = z(self.points), z(self.points)

    def add(self, sparsity: torch.Tensor, err: torch.Tensor, norm: torch.Tensor) -> None:
        """sparsity, err: [P, H]; norm: [H] (err / norm is the relative L1 of each head)."""
        l1 = err / norm.clamp(min=1e-30)
        layer = err.sum(1) / norm.sum().clamp(min=1e-30)
        self.sparsity += sparsity
        self.l1_sum += l1
        torch.maximum(self.l1_max, l1, out=self.l1_max)
        self.layer_l1_sum += layer
        torch.maximum(self.layer_l1_max, layer, out=self.layer_l1_max)
        self.calls += 1

    def l1(self, aggregate: Aggregate) -> tuple[torch.Tensor, torch.Tensor]:
        """([P, H], [P]) relative L1 per head and per layer, aggregated over the calls."""
        if aggregate == "max":
            return self.l1_max, self.layer_l1_max
        return self.l1_sum / self.calls, self.layer_l1_sum / self.calls


def _best(sparsity: torch.Tensor, l1: torch.Tensor, budget: float) -> tuple[int, bool]:
    """Index of the highest sparsity with l1 < budget (ties: lower l1); the lowest l1 if none fits."""
    ok = l1 < budget
    if not bool(ok.any()):
        return int(torch.argmin(l1)), False
    score = torch.where(ok, sparsity, torch.full_like(sparsity, -math.inf))
    top = score.max()
    candidates = torch.nonzero(score == top).flatten()
    return int(candidates[torch.argmin(l1[candidates])]), True


class ThresholdSearch:
    """Two-phase threshold search for one attention layer.

    Example:
        >>> search = ThresholdSearch(l1=0.05, l2=0.06)
        >>> for q, k, v in calibration: search.observe(q, k, v)     # phase 1
        >>> search.finish_stage1()
        >>> for q, k, v in calibration: search.observe(q, k, v)     # phase 2 (pvthreshd)
        >>> choice = search.result()
    """

    def __init__(self, *, l1: float = 0.05, l2: float = 0.06, grid: ThresholdGrid | None = None,
                 per_head: bool = True, aggregate: Aggregate = "max"):
        if not (0 < l1 <= l2):
            raise ValueError(f"need 0 < l1 <= l2, got l1={l1}, l2={l2}")
        if aggregate not in ("max", "mean"):
            raise ValueError(f"aggregate must be 'max' or 'mean', got {aggregate!r}")
        check_flag(per_head, "per_head")  # "False" was read as True: per-head thresholds where one per layer was meant
        self.l1, self.l2, self.grid = l1, l2, grid or ThresholdGrid()
        self.per_head, self.aggregate = per_head, aggregate
        self.phase = 1
        self._points1 = self.grid.stage1_points()
        self._tally1: _Tally | None = None
        self._tally2: _Tally | None = None
        self._stage1: tuple[list[float], list[float]] | None = None
        self._stage1_ok = True

    @property
    def calls(self) -> int:
        tally = self._tally1 if self.phase == 1 else self._tally2
        return tally.calls if tally else 0

    def observe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reference: torch.Tensor | None = None,
                *, is_causal: bool = False, scale: float | None = None, tensor_layout: str = "HND",
                attention: Callable = sparge_attention) -> None:
        """Run every grid point of the current phase on one attention call and tally error and sparsity.

        Args:
            q, k, v: the call's inputs (any layout and dtype ``sparge_attention`` takes).
            reference: the exact output of the call (what the dense model computed); computed with SDPA
                when None.
            attention: ``sparge_attention`` or a wrapper with its signature (e.g. a token permutation).
        """
        if reference is None:
            reference = _dense(q, k, v, is_causal, scale, tensor_layout)
        elif tuple(reference.shape) != tuple(q.shape[:-1]) + (v.shape[-1],):
            # the error is out - reference: one that broadcasts (a single token, one head) compared other elements
            raise ValueError(f"reference must have the call's output shape {tuple(q.shape[:-1]) + (v.shape[-1],)}, "
                             f"got {tuple(reference.shape)}")
        head_dim = 1 if tensor_layout == "HND" else 2
        reduce = tuple(d for d in range(4) if d != head_dim)
        ref = reference.float()
        norm = ref.abs().sum(reduce).double()
        heads = norm.numel()
        settings: list[dict[str, Any]]
        if self.phase == 1:
            settings = [dict(simthreshd1=s, cdfthreshd=c, pvthreshd=None) for s, c in self._points1]
        else:
            sim, cdf = self._chosen_stage1()
            settings = [dict(simthreshd1=sim, cdfthreshd=cdf, pvthreshd=p) for p in self.grid.pvthreshd]
        sparsity = torch.empty(len(settings), heads, dtype=torch.float64, device=q.device)
        err = torch.empty_like(sparsity)
        for i, kw in enumerate(settings):
            out, stats = attention(q, k, v, is_causal=is_causal, scale=scale, tensor_layout=tensor_layout,
                                   return_sparsity=True, **kw)
            sparsity[i] = (stats.qk_skipped.double() + stats.pv_skipped.double()) / 2
            err[i] = (out.float() - ref).abs().sum(reduce).double()
        tally = self._tally1 if self.phase == 1 else self._tally2
        if tally is None:
            tally = _Tally(len(settings), heads, q.device)
            if self.phase == 1:
                self._tally1 = tally
            else:
                self._tally2 = tally
        elif tally.heads != heads:
            raise ValueError(f"this layer had {tally.heads} heads in earlier calls, now {heads}")
        tally.add(sparsity, err, norm)

    def _choose(self, tally: _Tally, budget: float) -> tuple[list[int], bool]:
        """Grid index per head (the same index for all heads unless per_head)."""
        l1_head, l1_layer = tally.l1(self.aggregate)
        sparsity = tally.sparsity / tally.calls
        if self.per_head:
            picks = [_best(sparsity[:, h], l1_head[:, h], budget) for h in range(tally.heads)]
            return [i for i, _ in picks], all(ok for _, ok in picks)
        index, ok = _best(sparsity.mean(1), l1_layer, budget)
        return [index] * tally.heads, ok

    def _chosen_stage1(self) -> tuple[list[float], list[float]]:
        if self._stage1 is None:
            raise RuntimeError("phase 2 needs finish_stage1 first")
        return self._stage1

    def finish_stage1(self) -> None:
        """Fix (simthreshd1, cdfthreshd) per head and move to the pvthreshd search."""
        if self.phase != 1 or self._tally1 is None:
            raise RuntimeError("finish_stage1 needs phase 1 with at least one observed call")
        index, self._stage1_ok = self._choose(self._tally1, self.l1)
        self._stage1 = ([self._points1[i][0] for i in index], [self._points1[i][1] for i in index])
        self.phase = 2

    def result(self) -> LayerChoice:
        """The chosen thresholds and their calibration sparsity and error (after phase 2)."""
        if self.phase != 2 or self._tally2 is None:
            raise RuntimeError("result needs finish_stage1 and at least one observed call in phase 2")
        tally = self._tally2
        index, ok = self._choose(tally, self.l2)
        l1_head, _ = tally.l1(self.aggregate)
        sparsity = tally.sparsity / tally.calls
        heads = torch.arange(tally.heads)
        chosen = torch.tensor(index)
        sp_head = sparsity[chosen, heads].cpu().tolist()
        l1_per_head = l1_head[chosen, heads].cpu().tolist()
        if self.per_head:  # every head is within budget, so the worst head bounds the layer
            layer_l1 = max(l1_per_head)
        else:
            layer_l1 = float(tally.l1(self.aggregate)[1][index[0]])
        sim, cdf = self._chosen_stage1()
        return LayerChoice(simthreshd1=sim, cdfthreshd=cdf, pvthreshd=[self.grid.pvthreshd[i] for i in index],
                           sparsity=sum(sp_head) / len(sp_head), l1=layer_l1, sparsity_per_head=sp_head,
                           l1_per_head=l1_per_head, calls=tally.calls, within_budget=ok and self._stage1_ok)


def _dense(q, k, v, is_causal, scale, tensor_layout):
    import torch.nn.functional as F

    t = (lambda x: x) if tensor_layout == "HND" else (lambda x: x.transpose(1, 2))
    group = t(q).shape[1] // t(k).shape[1]
    kk, vv = (t(x).repeat_interleave(group, 1) if group > 1 else t(x) for x in (k, v))
    return t(F.scaled_dot_product_attention(t(q), kk, vv, is_causal=is_causal, scale=scale))
