"""Per-layer threshold tuning (SpargeAttn section 3.6): the search, and ``tune`` for diffusers models."""

from .search import LayerChoice, ThresholdGrid, ThresholdSearch

__all__ = ["LayerChoice", "ThresholdGrid", "ThresholdSearch", "tune"]


def __getattr__(name):
    if name == "tune":  # imports diffusers only when asked
        from .pipeline import tune

        return tune
    raise AttributeError(name)
