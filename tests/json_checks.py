"""Shared by the tests of the files the package writes."""

import json


def strict_json_load(path):
    """Parse a file as strict JSON: Infinity, -Infinity and NaN (which json.dump writes by default) fail."""
    def reject(token):
        raise ValueError(f"{path} is not strict JSON: {token}")

    return json.loads(path.read_text(), parse_constant=reject)
