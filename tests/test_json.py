"""``_json.write_json``: the strict JSON every report and settings file is written as."""

import json
import math

import pytest
import torch

from sparge_diffusers._json import write_json


def test_write_json_is_strict_indented_and_keeps_a_good_file_when_a_value_cannot_be_written(tmp_path):
    """Non-finite floats (nested in dicts, lists and tuples) as null, one space of indent per level (the docstring's
    format); a tensor raises TypeError and leaves the file as it was, or is written as null when asked."""
    path = tmp_path / "report.json"
    write_json(path, {"a": [1.5, math.nan, (math.inf, 2)], "b": {"c": -math.inf}})
    text = path.read_text()
    assert text == '{\n "a": [\n  1.5,\n  null,\n  [\n   null,\n   2\n  ]\n ],\n "b": {\n  "c": null\n }\n}'
    with pytest.raises(TypeError):
        write_json(path, {"t": torch.zeros(1)})
    assert path.read_text() == text, "a failed write must not touch the file"
    write_json(path, {"t": torch.zeros(1), "x": 1}, other_types_as_null=True)
    assert json.loads(path.read_text()) == {"t": None, "x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no partial file left behind
