"""Per-layer settings files: what ``sparge_diffusers.tune`` writes and ``SpargeProcessor``/``apply`` read.

A file is JSON::

    {"format": "sparge-diffusers/layer-settings", "version": 1,
     "model_class": "FluxTransformer2DModel", "diffusers_version": "0.42.1", "sparge_diffusers_version": "0.1.0",
     "budget": {"l1": 0.05, "l2": 0.06, "aggregate": "max", "per_head": true},
     "layers": {"transformer_blocks.0.attn": {"simthreshd1": [...], "cdfthreshd": [...], "pvthreshd": [...],
                                              "permutation": null, "dense": false,
                                              "measured": {"sparsity": 0.41, "l1": 0.043, ...}}, ...},
     "calibration": {...}}

Thresholds are one number per layer or one per head. ``measured`` is what tuning saw on its calibration
data; loading ignores it. The file is strict JSON: a ``pvthreshd`` of ``math.inf`` (stage 2 off, as ``None``)
is written as null, also inside a per-head list, and read back as off; non-finite measurements are null.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .._json import write_json

FORMAT = "sparge-diffusers/layer-settings"
VERSION = 1
_THRESHOLDS = ("simthreshd1", "cdfthreshd", "pvthreshd", "permutation", "dense")


@dataclass
class LayerSettingsFile:
    """Per-layer thresholds for one model class, with the budget and measurements that produced them."""

    model_class: str
    layers: dict[str, Any]  # name -> SpargeSettings
    diffusers_version: str | None = None
    budget: dict = field(default_factory=dict)
    measured: dict[str, dict] = field(default_factory=dict)  # name -> {"sparsity": ..., "l1": ..., ...}
    calibration: dict = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> None:
        """Write the file as strict JSON (an off ``pvthreshd`` as null), with this package's version and the tuned
        model's diffusers version."""
        from .. import __version__

        layers = {}
        for name, s in self.layers.items():
            layers[name] = {key: getattr(s, key) for key in _THRESHOLDS}  # inf pvthreshd (off) -> null
            if name in self.measured:
                layers[name]["measured"] = self.measured[name]
        doc = {"format": FORMAT, "version": VERSION, "model_class": self.model_class,
               "diffusers_version": self.diffusers_version, "sparge_diffusers_version": __version__,
               "budget": self.budget, "layers": layers, "calibration": self.calibration}
        write_json(path, doc)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LayerSettingsFile":
        """Read a settings file; raises ValueError naming what is wrong with it."""
        from .processor import SpargeSettings

        try:
            with open(path) as f:
                doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a JSON settings file: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path} is not a sparge-diffusers layer-settings file (no format {FORMAT!r})")
        if doc.get("version") != VERSION:
            raise ValueError(f"{path} has settings format version {doc.get('version')}; this release reads "
                             f"version {VERSION}")
        model_class = doc.get("model_class")
        if not isinstance(model_class, str) or not model_class:
            raise ValueError(f"{path} names no model_class (the diffusers class the settings were tuned for)")
        entries = doc.get("layers", {})
        if not isinstance(entries, dict):  # a hand-edited file: say so instead of an AttributeError below
            raise ValueError(f"{path}: 'layers' must map layer names to settings, got a {type(entries).__name__}")
        layers, measured = {}, {}
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: layer {name!r} must map setting names to values, got a "
                                 f"{type(entry).__name__}")
            unknown = set(entry) - set(_THRESHOLDS) - {"measured"}
            if unknown:
                raise ValueError(f"{path}: layer {name!r} has unknown keys {sorted(unknown)}")
            values = {k: entry[k] for k in _THRESHOLDS if k in entry}
            if isinstance(values.get("pvthreshd"), list):  # a head with stage 2 off is null in the file
                values["pvthreshd"] = [math.inf if t is None else t for t in values["pvthreshd"]]
            try:
                layers[name] = SpargeSettings(**values)
            except ValueError as e:
                raise ValueError(f"{path}: layer {name!r}: {e}") from None
            if "measured" in entry:
                measured[name] = entry["measured"]
        if not layers:
            raise ValueError(f"{path} holds no layers")
        return cls(model_class=model_class, layers=layers,
                   diffusers_version=doc.get("diffusers_version"), budget=doc.get("budget", {}),
                   measured=measured, calibration=doc.get("calibration", {}))

    def check_model(self, transformer: Any, layer_names: list[str], strict: bool) -> None:
        """Refuse a file made for another model class or naming layers the model lacks; warn about layers
        the file does not cover (they use the processor's ``settings``), or raise when ``strict``."""
        name = type(transformer).__name__
        if self.model_class != name:
            raise ValueError(f"these settings were tuned for {self.model_class}, not {name}")
        unknown = sorted(set(self.layers) - set(layer_names))
        if unknown:
            raise ValueError(f"the settings name {len(unknown)} layer(s) that {name} lacks, e.g. {unknown[:3]}: "
                             "was the file made for another configuration of this model?")
        missing = [n for n in layer_names if n not in self.layers]
        if missing:
            msg = (f"the settings cover {len(layer_names) - len(missing)} of {len(layer_names)} attention layers "
                   f"of {name}; {len(missing)} (e.g. {missing[:3]}) use the processor's default settings")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=4)
        try:
            import diffusers

            if self.diffusers_version and self.diffusers_version != diffusers.__version__:
                warnings.warn(f"these settings were tuned under diffusers {self.diffusers_version}, running "
                              f"{diffusers.__version__}", stacklevel=4)
        except ImportError:
            pass
