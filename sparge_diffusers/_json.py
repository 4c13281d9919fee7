"""Strict JSON for every file the package writes (reports, settings).

``json.dump`` writes non-finite floats as ``Infinity`` / ``NaN``, which jq, JavaScript's ``JSON.parse`` and most
other JSON readers reject; a file that only Python can read back is a silent failure for whoever consumes it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with each non-finite float (in nested dicts, lists and tuples too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def write_json(path: str | os.PathLike, doc: Any, *, other_types_as_null: bool = False) -> None:
    """Write ``doc`` as strict JSON, non-finite floats as null, indented one space per level.

    Objects JSON cannot hold (tensors, callables) raise TypeError, or with ``other_types_as_null`` (reports
    that echo whatever the caller passed) are written as null. The text is built first and replaces the file in
    one step: ``json.dump`` straight into the file left it cut off at such an object, and a settings file saved
    over a good one lost both."""
    default = (lambda v: None) if other_types_as_null else None
    text = json.dumps(finite_or_none(doc), indent=1, default=default, allow_nan=False)
    partial = f"{os.fspath(path)}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)
