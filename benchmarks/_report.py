"""Shared by the benchmark scripts: print the table, write the JSON results and the table beside them."""

import json


def save_report(results: dict, table: str, out: str | None) -> None:
    """Print ``table``; with ``out`` (a .json path) write ``results`` there and the table to the .txt beside it."""
    print(table)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        with open(out.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(table + "\n")
