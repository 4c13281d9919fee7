"""The README against the code and the results: its two commands, examples, command lines, links and tables (and
the pages under docs/: their links, line widths, and the commands and variables docs/testing.md gives).

Users copy these; a renamed function, a dropped keyword or CLI option must fail here, not on their machine. The
examples need a GPU and weights to run, so they are checked statically: each block compiles, every name it imports
from the package exists, every attribute it reads from the package exists, and every keyword it passes to one of
the package's functions or classes is a parameter of it. Command lines go through the real argument parser. The
benchmark tables show the committed results files, cell by cell; the S2O trade-off table, whose cells are written
as text ("1.26× at 0.049, 0.97-0.98× at 0.36-0.55"), number by number.
"""

from __future__ import annotations

import ast
import importlib
import json
import inspect
import re
import shlex
from pathlib import Path

import pytest

from sparge_diffusers.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def outside_code_blocks(markdown: str) -> str:
    """Headings, links and prose: the text without its fenced code blocks."""
    return re.sub(r"```.*?```", "", markdown, flags=re.S)


def outside_code(markdown: str) -> str:
    """The text without fenced code blocks and inline code, where link syntax and headings mean nothing."""
    return re.sub(r"`[^`\n]*`", "", outside_code_blocks(markdown))


OUTSIDE_CODE_BLOCKS = outside_code_blocks(README)


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def command_lines(block: str) -> list[str]:
    """The block's commands, backslash continuations joined, ``&&`` chains split, trailing comments dropped."""
    joined = block.replace("\\\n", " ")
    return [part.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
            for part in line.split("  #")[0].split("&&")]


def test_readme_starts_with_the_run_and_test_commands_and_ci_runs_the_test_command():
    first, second = fenced_blocks("bash")[:2]
    assert README.index(first) < README.index("## ")  # before the first section
    assert "sparge-diffusers bench" in first and "pip install" in first
    install, test = (part.strip() for part in second.strip().split("&&"))
    assert install.startswith("pip install torch==2.13.0") and test.startswith("pytest")
    ci = [line.removeprefix("python3 -m ") for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python3 -m ")]
    assert ci == [install.replace("pip install", "pip install -q", 1), test]  # CI's pip is only quieter


def _package_objects(tree: ast.AST) -> dict[str, object]:
    """Names a block binds to the package's modules and objects (``import``, ``from ... import``); the package's
    own name too, as the fragments use it without importing it."""
    bound: dict[str, object] = {"sparge_diffusers": importlib.import_module("sparge_diffusers")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sparge_diffusers"):
                    top = alias.name.split(".")[0]
                    module = importlib.import_module(alias.name)
                    bound[alias.asname or top] = module if alias.asname else importlib.import_module(top)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparge_diffusers"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"the README imports {alias.name} from {node.module}"
                bound[alias.asname or alias.name] = getattr(module, alias.name)
    return bound


def _resolve(node: ast.AST, bound: dict[str, object]) -> object | None:
    """The package object an expression such as ``sparge_diffusers.llm.register`` names (None: not ours)."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, bound)
        if owner is None:
            return None
        if inspect.ismodule(owner) and not hasattr(owner, node.attr):  # a submodule not imported yet
            try:
                importlib.import_module(f"{owner.__name__}.{node.attr}")
            except ImportError:
                pass
        assert hasattr(owner, node.attr), f"the README reads {ast.unparse(node)}, which does not exist"
        return getattr(owner, node.attr)
    return None


@pytest.mark.parametrize("index", range(len(fenced_blocks("python"))))
def test_readme_python_example_uses_names_and_keywords_that_exist(index):
    block = fenced_blocks("python")[index]
    tree = ast.parse(block)  # a syntax error fails here
    bound = _package_objects(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _resolve(node, bound)
        if not isinstance(node, ast.Call):
            continue
        target = _resolve(node.func, bound)
        if target is None or not callable(target):
            continue
        params = inspect.signature(target).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        for keyword in node.keywords:
            assert keyword.arg is None or keyword.arg in params, (
                f"the README passes {keyword.arg}= to {ast.unparse(node.func)}, which takes {list(params)}")


def test_readme_python_examples_exist():
    assert len(fenced_blocks("python")) >= 8  # the parametrised test above would pass vacuously on none


def readme_command_lines() -> list[str]:
    return [line for block in fenced_blocks("bash") for line in command_lines(block)
            if line.startswith("sparge-diffusers ")]


def test_readme_shows_each_subcommand():
    shown = {shlex.split(line)[1] for line in readme_command_lines()}
    assert shown >= {"bench", "tune", "generate", "eval"}


@pytest.mark.parametrize("line", readme_command_lines())
def test_readme_command_line_parses(line):
    args = build_parser().parse_args(shlex.split(line)[1:])  # argparse exits (SystemExit) on an unknown option
    assert callable(args.func)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


DOCS = sorted((ROOT / "docs").glob("*.md"))  # the pages the README links to for detail


def headings_anchors(markdown: str) -> set[str]:
    return {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", outside_code(markdown), re.M)}


def assert_links_resolve(markdown: str, path: Path) -> None:
    """Every relative link of a Markdown file names a file that exists, and a heading there (or here) after ``#``."""
    targets = re.findall(r"\]\(([^)\s]+)\)", outside_code(markdown))
    assert targets
    for target in targets:
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to {target}, no such file"
        if anchor:
            assert anchor in headings_anchors(linked.read_text()), f"{path.name} links to {target}, no such heading"


def test_readme_links_point_at_headings_and_files_that_exist():
    assert_links_resolve(README, ROOT / "README.md")


def test_readme_prose_lines_fit_120_columns():
    lines = OUTSIDE_CODE_BLOCKS.splitlines()
    long = [line[:60] for line in lines if len(line) > 120 and not line.startswith("|")]  # table rows cannot wrap
    assert not long, f"README lines over 120 columns (rewrap their paragraphs): {long}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_links_resolve_and_prose_lines_fit_120_columns(doc: Path):
    text = doc.read_text()
    assert_links_resolve(text, doc)
    lines = outside_code_blocks(text).splitlines()
    long = [line[:60] for line in lines if len(line) > 120 and not line.startswith("|")]  # table rows cannot wrap
    assert not long, f"{doc.name}: lines over 120 columns: {long}"
    assert f"[`docs/{doc.name}`](docs/{doc.name})" in README, f"the README does not link to docs/{doc.name}"


def test_testing_doc_gives_the_readme_test_command_and_the_tests_own_variables():
    """docs/testing.md: its CPU command is the README's (and so CI's), and every seed variable it names is read by
    a test (or the test setup), so a renamed variable fails here rather than silently running the default seeds."""
    text = (ROOT / "docs" / "testing.md").read_text()
    assert fenced_blocks("bash")[1] in re.findall(r"```bash\n(.*?)```", text, re.S)
    named = set(re.findall(r"SPARGE_[A-Z_]+", text))
    assert len(named) >= 8
    tests = "".join(p.read_text() for p in [*(ROOT / "tests").glob("test_*.py"), ROOT / "tests" / "conftest.py"])
    read = set(re.findall(r"environ.get\(\s*\"(SPARGE_[A-Z_]+)\"", tests))
    assert named <= read, f"docs/testing.md names {sorted(named - read)}, which no test reads"


def test_readme_contents_lists_every_section_in_order():
    headings = re.findall(r"^(##+) (.+)$", OUTSIDE_CODE_BLOCKS, re.M)
    sections = [(len(level) - 2, heading_anchor(text)) for level, text in headings]  # (nesting depth, anchor)
    contents = README[README.index("**Contents**"):README.index("\n## ")]
    entries = re.findall(r"^( *)- \[[^]]+\]\(#([^)]+)\)$", contents, re.M)
    listed = [(len(indent) // 2, target) for indent, target in entries]
    assert listed == sections  # a section added, renamed, moved or nested differently must be listed again


SHAPE_KEYS = {"CogVideoX": "cogvideox", "Mochi": "mochi", "Flux": "flux", "Llama": "llama32k"}
SHAPES = list(SHAPE_KEYS.values())  # the order of the README's columns and lists


def table_after(header_start: str) -> list[list[str]]:
    """The body rows (cells stripped) of the README table whose header row starts with ``header_start``."""
    lines = README[README.index("\n" + header_start) + 1:].splitlines()
    rows = []
    for line in lines[2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def assert_shown_as(cell: str, value: float, what: str) -> None:
    """A table cell is ``value`` rounded to the cell's decimals."""
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    assert abs(float(cell) - value) <= 0.5 * 10 ** -decimals + 1e-9, f"{what}: README {cell}, results {value:.6g}"


def assert_cell_shows(cell: str, values: list[float], what: str) -> None:
    """A cell holding several numbers (e.g. "188.9 (180.5) / 0.97 / 0.000") shows ``values`` in order."""
    shown = re.findall(r"\d+(?:\.\d+)?", cell)
    assert len(shown) == len(values), f"{what}: {cell!r}"
    for number, value in zip(shown, values):
        assert_shown_as(number, value, f"{what} {cell!r}")


def test_readme_attention_tables_are_the_committed_results():
    """The issue's benchmark tables in the README show benchmarks/results/attention-H100.json, cell by cell."""
    results = json.loads((ROOT / "benchmarks" / "results" / "attention-H100.json").read_text())["shapes"]
    key_of = lambda name: next(v for k, v in SHAPE_KEYS.items() if name.startswith(k))  # noqa: E731

    dense_rows = table_after("| shape (B, H_q/H_kv, N, D) | cuDNN ms")
    assert len(dense_rows) == 4
    for name, cudnn, flash, ours, ratio, predict in dense_rows:
        r = results[key_of(name)]
        for cell, value, what in [(cudnn, r["dense"]["cudnn_ms"], "cuDNN ms"), (flash, r["dense"]["flash_ms"], "flash"),
                                  (ours, r["dense"]["ours_ms"], "ours"), (ratio, r["dense"]["ours_vs_cudnn"], "ratio"),
                                  (predict, 100 * r["predict"]["share_of_cudnn"], "prediction %")]:
            assert_shown_as(cell, value, f"{name} {what}")

    sparse_rows, shape = table_after("| shape | density | ours ms"), None
    assert len(sparse_rows) == 12
    for i, (name, density, ours, prebuilt, flex, flex_ours, flex_pre, speedup, ideal) in enumerate(sparse_rows):
        shape = key_of(name) if name else shape
        r = results[shape]["sparse"][i % 3]
        ideal_ours, ideal_pre = ideal.split(" / ")
        for cell, field in [(density, "actual_density"), (ours, "ours_ms"), (prebuilt, "ours_prebuilt_ms"),
                            (flex, "flex_ms"), (flex_ours, "ours_vs_flex"), (flex_pre, "prebuilt_vs_flex"),
                            (speedup, "speedup_vs_own_dense"), (ideal_ours, "speedup_over_ideal"),
                            (ideal_pre, "prebuilt_speedup_over_ideal")]:
            assert_shown_as(cell, r[field], f"{shape} at {density}: {field}")

    whole_rows = table_after("| workload | sparsity | rel. L1")
    assert len(whole_rows) == 4
    for name, sparsity, l1, ours, cudnn, speedup in whole_rows:
        r = results[key_of(name)]["structured_default"]
        for cell, field in [(sparsity, "sparsity"), (l1, "relative_l1"), (ours, "ms"), (cudnn, "cudnn_ms"),
                            (speedup, "speedup_vs_cudnn")]:
            assert_shown_as(cell, r[field], f"{name} whole method: {field}")


def assert_range_shown(shown: str, values: list[float], what: str) -> None:
    """``shown`` ("0.96-1.14") is the smallest and largest of ``values``, each at its decimals."""
    lo, hi = shown.split("-")
    assert_shown_as(lo, min(values), f"{what} (smallest)")
    assert_shown_as(hi, max(values), f"{what} (largest)")


NUMBER_WORDS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def test_readme_attention_rerun_ranges_are_the_committed_reruns():
    """The paragraph on re-runs names every attention-H100-session<N>.json and gives the ranges they span."""
    reruns = {int(re.search(r"session(\d+)", p.name)[1]): json.loads(p.read_text())["shapes"]
              for p in (ROOT / "benchmarks" / "results").glob("attention-H100-session*.json")}
    text = README[README.index(f"{NUMBER_WORDS[len(reruns)].capitalize()} re-runs after later changes"):]
    text = " ".join(text[:text.index("\n\n")].split())  # the paragraph, line breaks as spaces
    named = [int(n) for n in re.findall(r"\d+", text[text.index("sessions"):text.index("each saved as")])]
    assert named == sorted(reruns), f"the README names sessions {named}, results hold {sorted(reruns)}"
    shapes = [s for run in reruns.values() for s in run.values()]
    on_sdpa = [s for s in shapes if "sdpa_default_ms" in s["dense"]]
    at_01 = lambda key, field: [r[field] for run in reruns.values() for r in run[key]["sparse"]  # noqa: E731
                                if r["density"] == 0.1]
    tables = json.loads((ROOT / "benchmarks" / "results" / "attention-H100.json").read_text())["shapes"].values()
    cudnn_over_ours = lambda results: [s["dense"]["cudnn_ms"] / s["dense"]["ours_ms"] for s in results]  # noqa: E731
    flex_over_ours = lambda results: [r["ours_vs_flex"] for s in results for r in s["sparse"]]  # noqa: E731
    expected = [("cuDNN/ours", cudnn_over_ours(shapes)), ("cuDNN/ours in the tables", cudnn_over_ours(tables)),
                ("FlexAttention/ours", flex_over_ours(shapes)), ("Flex/ours in the tables", flex_over_ours(tables))]
    expected += [(f"{key} per call", at_01(key, "speedup_over_ideal")) for key in SHAPES]
    expected += [(f"{key} prebuilt", at_01(key, "prebuilt_speedup_over_ideal")) for key in SHAPES]
    expected += [("SDPA/ours", [s["dense"]["sdpa_default_ms"] / s["dense"]["ours_ms"] for s in on_sdpa])]
    expected += [(f"{key} stored (B, N, H, D)", [run[key]["dense"]["ours_vs_cudnn_nhd_stored"] for run in
                                                 reruns.values() if "ours_vs_cudnn_nhd_stored" in run[key]["dense"]])
                 for key in SHAPES]
    ranges = re.findall(r"\d\.\d\d\d?-\d\.\d\d\d?", text)  # in the order the paragraph gives them
    assert len(ranges) == len(expected), ranges
    for shown, (what, values) in zip(ranges, expected):
        assert_range_shown(shown, values, f"re-runs: {what}")
    below = sum(r < 0.85 for r in at_01("llama32k", "speedup_over_ideal"))
    assert f"under the 0.85 target in {NUMBER_WORDS[below]} of the {NUMBER_WORDS[len(reruns)]}" in text
    for key in SHAPES:  # "the whole method's sparsity and relative L1 unchanged in every one"
        assert len({(round(run[key]["structured_default"]["sparsity"], 4),
                     round(run[key]["structured_default"]["relative_l1"], 4)) for run in reruns.values()}) == 1


def test_readme_h200_attention_figures_are_the_committed_results():
    """The paragraph on the H200 run gives attention-H200.json's dense ratios, Flex range and density-0.1 shares."""
    results = json.loads((ROOT / "benchmarks" / "results" / "attention-H200.json").read_text())
    assert results["gpu"] == "NVIDIA H200"
    shapes = [results["shapes"][key] for key in SHAPES]
    text = README[README.index("On an **NVIDIA H200**"):]
    text = " ".join(text[:text.index("\n\n")].split())
    dense = re.search(r"cuDNN/ours ([\d. /]+) \(", text)[1]
    assert_cell_shows(dense, [s["dense"]["cudnn_ms"] / s["dense"]["ours_ms"] for s in shapes], "H200 cuDNN/ours")
    flex = re.search(r"FlexAttention/ours (\d\.\d\d-\d\.\d\d)", text)[1]
    assert_range_shown(flex, [r["ours_vs_flex"] for s in shapes for r in s["sparse"]], "H200 FlexAttention/ours")
    at_01 = [next(r for r in s["sparse"] if r["density"] == 0.1) for s in shapes]
    shares = re.search(r"per call / prebuilt, (.+?)\. ", text)[1]
    assert_cell_shows(shares, [x for r in at_01 for x in (r["speedup_over_ideal"], r["prebuilt_speedup_over_ideal"])],
                      "H200 share of ideal at 0.1")
    runs = [json.loads(path.read_text()) for path in (ROOT / "benchmarks" / "results").glob("attention-H200*.json")]
    assert f"all {NUMBER_WORDS[len(runs)]} with the same sparsity and relative L1" in text
    for key in SHAPES:
        assert len({(round(run["shapes"][key]["structured_default"]["sparsity"], 4),
                     round(run["shapes"][key]["structured_default"]["relative_l1"], 4)) for run in runs}) == 1


# Which run each row of the README's pipeline table shows (Flux and SD3 re-run in session 45).
PIPELINE_ROWS = {"Flux": ("flux", "pipelines-H100-session45-1.json"),
                 "SD3.5": ("sd3", "pipelines-H100-session45-1.json"),
                 "CogVideoX": ("cogvideox", "pipelines-H100.json"), "Mochi": ("mochi", "pipelines-H100.json")}


def test_readme_pipeline_table_is_the_committed_results():
    rows = table_after("| model (resolution) | tokens | dense step ms")
    assert len(rows) == 4
    for row in rows:
        model, file = next(v for k, v in PIPELINE_ROWS.items() if row[0].startswith(k))
        r = json.loads((ROOT / "benchmarks" / "results" / file).read_text())["models"][model]
        d, a = r["settings"]["default"], r["settings"]["aggressive"]
        expected = [[r["attention_shape"][2]], [r["dense_step_ms"], r["dense_step_kernel_ms"]],
                    [100 * r["attention_share"]], [d["step_ms"], d["step_kernel_ms"], d["speedup"], d["sparsity"]],
                    [a["step_ms"], a["step_kernel_ms"], a["speedup"], a["sparsity"], a["relative_l1_vs_dense_step"]],
                    [r["dense_graph_ms"], d["graph_ms"], d["graph_speedup"], a["graph_ms"], a["graph_speedup"]]
                    if "dense_graph_ms" in r else []]
        for cell, values in zip(row[1:], expected):
            assert_cell_shows(cell, values, row[0])


def test_readme_llm_prefill_table_is_the_committed_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "llm-prefill-H100.json").read_text())
    rows = table_after("| | SDPA | FlexAttention | default | `simthreshd1=-1, cdfthreshd=0.9` |")
    assert [row[0].split()[0] for row in rows] == ["8K", "32K", "left-padded"]
    for row, r in zip(rows, [results["lengths"]["8192"], results["lengths"]["32768"], results["padded"]]):
        ratios = {name: [r[name]["ms"], r[name]["speedup"], r[name]["x_flex"]] for name in ("default", "aggressive",
                                                                                              "s2o", "fsa")}
        expected = [[r["sdpa_ms"]], [r["flex_ms"]], ratios["default"],
                    ratios["aggressive"] + [r["aggressive"]["sparsity"]], ratios["s2o"],
                    ratios["fsa"] + [r["fsa"]["sparsity"]]]
        if row[0].startswith("left-padded"):  # the padded row shows times and ratios only
            expected = [values[:3] for values in expected]
        for cell, values in zip(row[1:], expected):
            assert_cell_shows(cell, values, f"LLM prefill {row[0]}")


def test_readme_gemma3_prefill_table_is_the_committed_results():
    results = json.loads((ROOT / "benchmarks" / "results" / "llm-prefill-gemma3-H100.json").read_text())
    rows = table_after("| tokens | SDPA | FlexAttention | ours default | x SDPA | x FlexAttention |")
    assert [row[0].split()[0] for row in rows] == ["8192", "32768", "left-padded"]
    for row, r in zip(rows, [results["lengths"]["8192"], results["lengths"]["32768"], results["padded"]]):
        d = r["default"]
        for cell, value in zip(row[1:], [r["sdpa_ms"], r["flex_ms"], d["ms"], d["speedup"], d["x_flex"],
                                         d["relative_l1"]]):
            assert_shown_as(cell, value, f"Gemma 3 prefill {row[0]}")


def test_readme_pbs_table_is_the_committed_results():
    lengths = json.loads((ROOT / "benchmarks" / "results" / "pbs-H100.json").read_text())["lengths"]
    rows = table_after("| N | tau | keys | density | rel. L1 | whole call ms")
    assert len(rows) == 8
    for n, tau, keys, density, l1, whole, cudnn_whole, prebuilt, flex_prebuilt in rows:
        method = {"in order": "in_order", "PBS 256": "pbs256"}[keys]
        cell = next(c for c in lengths[str(int(n.rstrip("K")) * 1024)]["cells"]
                    if c["method"] == method and c["tau"] == float(tau))
        for shown, field in [(density, "density"), (l1, "relative_l1"), (whole, "whole_ms"), (cudnn_whole,
                             "cudnn_vs_whole"), (prebuilt, "prebuilt_ms"), (flex_prebuilt, "flex_vs_prebuilt")]:
            assert_shown_as(shown, cell[field], f"PBS {n} tau {tau} {keys}: {field}")


def test_readme_fsa_table_is_the_committed_results():
    cells = json.loads((ROOT / "benchmarks" / "results" / "fsa-H100.json").read_text())["cells"]
    rows = table_after("| group | block × top_k | select ms")
    assert len(rows) == 6
    for group, block_top_k, *shown in rows:
        block, top_k = (int(x) for x in block_top_k.split(" × "))
        cell = next(c for c in cells if (c["group"], c["block"], c["top_k"]) == (int(group), block, top_k))
        fields = ["select_ms", "select_reference_ms", "prebuilt_ms", "whole_ms", "whole_one_piece_ms",
                  "query_outer_vs_prebuilt", "flex_vs_prebuilt", "cudnn_vs_prebuilt"]
        for number, field in zip(shown, fields, strict=True):
            assert_shown_as(number, cell[field], f"FSA group {group} {block_top_k}: {field}")


def test_readme_tuning_table_is_the_committed_results():
    mean = json.loads((ROOT / "benchmarks" / "results" / "tuning-H100.json").read_text())["mean"]
    rows = table_after("| setting | sparsity | L1 mean | L1 max | ms | vs cuDNN")
    configs = ["default", "tuned", "tuned-nopv", "matched", "matched-nopv"]
    assert len(rows) == len(configs)
    for (setting, *shown), config in zip(rows, configs):
        fields = ["sparsity", "l1", "l1_max", "ms", "speedup_vs_cudnn"]
        for number, field in zip(shown, fields, strict=True):
            assert_shown_as(number.rstrip("×"), mean[config][field], f"tuning {setting}: {field}")


def test_readme_permutations_table_is_the_committed_results():
    workloads = json.loads((ROOT / "benchmarks" / "results" / "permutations-H100.json").read_text())["workloads"]
    rows = table_after("| order | CogVideoX Sim-q / Sim-k | L1 | sparsity")
    assert [row[0] for row in rows] == ["random", "rowmajor", "colmajor", "timemajor", "hilbert"]
    for order, *cells in rows:
        for workload, (sims, l1, sparsity) in zip(["cogvideox", "mochi"], [cells[:3], cells[3:]], strict=True):
            r = workloads[workload]["orders"][order]
            sim_q, sim_k = sims.split(" / ")
            for number, field in [(sim_q, "sim_q"), (sim_k, "sim_k"), (l1, "relative_l1"), (sparsity, "sparsity")]:
                assert_shown_as(number, r[field], f"permutations {workload} {order}: {field}")


def test_readme_chunked_prefill_tables_are_the_committed_results():
    cases = {str(c["C"]): c for c in
             json.loads((ROOT / "benchmarks" / "results" / "chunked-prefill-H100.json").read_text())["cases"]}
    rows = table_after("| C | ours dense ms | SDPA-LR ms")
    assert [row[0] for row in rows] == ["2048", "8192"]
    for c, ours, sdpa_lr, cudnn_mask, flex, *ratios, ideal, flex_prebuilt in rows:
        dense, sparse = cases[c]["dense"], cases[c]["sparse"]
        expected = [(ours, dense["ours_ms"]), (sdpa_lr, dense["sdpa_lower_right_ms"]),
                    (cudnn_mask, dense["cudnn_mask_ms"]), (flex, dense["flex_ms"])]
        expected += [(shown, dense[name] / dense["ours_ms"])
                     for shown, name in zip(ratios, ["sdpa_lower_right_ms", "cudnn_mask_ms", "flex_ms"], strict=True)]
        expected += [(shown, s["prebuilt_speedup_over_ideal"]) for shown, s in zip(ideal.split(" / "), sparse,
                                                                                   strict=True)]
        low, high = flex_prebuilt.split("-")
        flex_ratios = [s["flex_vs_prebuilt"] for s in sparse]
        expected += [(low, min(flex_ratios)), (high, max(flex_ratios))]
        for shown, value in expected:
            assert_shown_as(shown, value, f"chunked prefill C = {c} (dense and masks)")

    methods = {"SpargeAttn": None, "SpargeAttn, PBS 256": "pbs", "S2O": "s2o", "FSA (16 × 64 keys)": "fsa"}
    rows = table_after("| C | method | sparsity | rel. L1 | ms | × SDPA-LR")
    assert len(rows) == 8
    for c, method, sparsity, l1, ms, x_sdpa, x_cudnn in rows:
        s = cases[c]["structured_default"]
        r = {"sparsity": s["sparsity"], "relative_l1": s["relative_l1"], "ms": s["whole_ms"]}
        r = s[methods[method]] if methods[method] else r
        for shown, value in [(sparsity.split()[0], r["sparsity"]), (l1, r["relative_l1"]), (ms, r["ms"]),
                             (x_sdpa, s["sdpa_lower_right_ms"] / r["ms"]), (x_cudnn, s["cudnn_mask_ms"] / r["ms"])]:
            assert_shown_as(shown, value, f"chunked prefill C = {c}, {method}")


def test_readme_padded_batch_table_is_the_committed_results():
    batches = json.loads((ROOT / "benchmarks" / "results" / "padded-batch-H100.json").read_text())["batches"]
    rows = table_after("| prompts × tokens | ours ms | SDPA + mask ms")
    assert len(rows) == 5
    for label, ours, sdpa_mask, flex, sdpa_over_ours, flex_over_ours in rows:
        prompts, lengths = label.split(" × ")
        shortest, longest = (int(x) for x in lengths.split("-"))
        b = next(b for b in batches if (b["prompts"], b["shortest"], b["longest"]) == (int(prompts), shortest, longest))
        for shown, value in [(ours, b["ms"]["ours"]), (sdpa_mask, b["ms"]["sdpa_mask"]), (flex, b["ms"]["flex"]),
                             (sdpa_over_ours, b["sdpa_mask_over_ours"]), (flex_over_ours, b["flex_over_ours"])]:
            assert_shown_as(shown, value, f"padded batch {label}")


def test_readme_compiled_pipeline_table_is_the_committed_results():
    models = json.loads((ROOT / "benchmarks" / "results" / "pipelines-compile-H100.json").read_text())["models"]
    rows = table_after("| model | dense ms | default ms (×, sparsity)")
    assert len(rows) == 3
    for name, dense, default, aggressive, compile_s in rows:
        r = models[next(v for k, v in {"Flux": "flux", "SD3.5": "sd3", "CogVideoX": "cogvideox"}.items()
                        if name.startswith(k))]
        d, a = r["settings"]["default"], r["settings"]["aggressive"]
        expected = [(dense, [r["dense_compiled_ms"]]),
                    (default, [d["compiled_ms"], d["compiled_speedup"], d["sparsity"]]),
                    (aggressive, [a["compiled_ms"], a["compiled_speedup"], a["sparsity"]]),
                    (compile_s, [r["dense_compile_s"], d["compile_s"], a["compile_s"]])]
        for cell, values in expected:
            assert_cell_shows(cell, values, f"compiled {name}")


S2O_RESULTS = ROOT / "benchmarks" / "results" / "s2o-H100.json"


def test_readme_s2o_overhead_table_is_the_committed_results():
    overhead = json.loads(S2O_RESULTS.read_text())["overhead"]
    rows = table_after("| | CogVideoX | Mochi | Flux | Llama 32K causal |")
    fields = ["B_over_A64", "B_over_A_triton", "B_over_A", "C_over_B", "D_over_C", "D_minus_C_over_A"]
    labels = [row[0].split(":")[0].split(" (")[0] for row in rows]
    assert labels == ["B / A64", "B / At", "B / A", "C / B", "D / C", "(D - C) / A"]
    for row, field in zip(rows, fields, strict=True):
        for shown, shape in zip(row[1:], SHAPES, strict=True):
            assert_shown_as(shown.strip("+%"), 100 * overhead[shape][field], f"S2O overhead {shape}: {field}")


def test_readme_s2o_gluon_walk_table_is_the_committed_results():
    overhead = json.loads(S2O_RESULTS.read_text())["overhead"]
    assert {overhead[shape]["walk_kernel"] for shape in SHAPES} == {"gluon"}  # what the README says ran there
    rows = table_after("| Gluon walk | CogVideoX | Mochi | Flux | Llama 32K causal |")
    fields = ["GB_over_A", "GC_over_GB", "GD_over_GC", "GD_over_A", "GD_over_D"]
    assert [row[0].split(":")[0] for row in rows] == ["GB / A", "GC / GB", "GD / GC", "GD / A", "GD / D"]
    for row, field in zip(rows, fields, strict=True):
        for shown, shape in zip(row[1:], SHAPES, strict=True):
            assert_shown_as(shown.strip("+%"), 100 * overhead[shape][field], f"S2O Gluon walk {shape}: {field}")


def shows(shown_lo: str, shown_hi: str, value: float) -> bool:
    """A shown number (or range) holds ``value``: equal at the shown decimals, or inside the range."""
    return float(shown_lo) <= value <= float(shown_hi) or any(
        abs(value - float(x)) <= 0.5 * 10 ** -len(x.split(".")[1]) + 1e-9 for x in {shown_lo, shown_hi})


def assert_ratios_at_sparsities_shown(cell: str, matched: list[dict], ratio_field: str, what: str) -> None:
    """A trade-off cell such as "1.26× at 0.049, 0.97-0.98× at 0.36-0.55" (or "0.74-0.87×": every matched point):
    each item's sparsity (one or a range) picks matched points whose ratio it shows (one or a range), and every
    matched point is shown by an item."""
    items = re.findall(r"(\d+\.\d+)(?:-(\d+\.\d+))?×(?: at (\d+\.\d+)(?:-(\d+\.\d+))?)?", cell)
    assert items, f"{what}: {cell!r}"
    covered = set()
    for r_lo, r_hi, s_lo, s_hi in items:
        picked = [i for i, m in enumerate(matched) if not s_lo or shows(s_lo, s_hi or s_lo, m["sparsity"])]
        assert picked, f"{what}: no matched point at sparsity {s_lo}-{s_hi} ({cell!r})"
        for i in picked:
            assert shows(r_lo, r_hi or r_lo, matched[i][ratio_field]), f"{what}: {cell!r} vs {matched[i]}"
        covered.update(picked)
    assert covered == set(range(len(matched))), f"{what}: {cell!r} leaves matched points out"


def test_readme_s2o_tradeoff_table_is_the_committed_results():
    tradeoff = json.loads(S2O_RESULTS.read_text())["tradeoff"]
    rows = table_after("| | Llama-3.1-8B causal 32K | CogVideoX (B=2, H=30, N=17776, D=64) |")
    assert [row[0] for row in rows] == ["TopCdf L1 / S2O L1 at matched sparsity",
                                        "TopCdf MSE / S2O MSE at matched sparsity",
                                        "sparsity at L1 = 0.05, TopCdf / S2O"]
    for shape, (l1_cell, mse_cell, at_l1_cell) in zip(["llama32k", "cogvideox"], zip(*[row[1:] for row in rows])):
        matched = tradeoff[shape]["matched_sparsity"]
        assert_ratios_at_sparsities_shown(l1_cell, matched, "l1_ratio_topcdf_over_s2o", f"{shape} L1 ratio")
        assert_ratios_at_sparsities_shown(mse_cell, matched, "mse_ratio_topcdf_over_s2o", f"{shape} MSE ratio")
        at = next(m for m in tradeoff[shape]["matched_l1"] if m["l1"] == 0.05)
        assert_cell_shows(at_l1_cell, [at["topcdf_sparsity"], at["s2o_sparsity"]], f"{shape} sparsity at L1 0.05")


def test_readme_s2o_default_tau_figures_are_the_committed_results():
    """The sentence after the overhead table: S2O's and TopCdf's speed over cuDNN at their defaults, S2O's
    sparsity."""
    timing = json.loads(S2O_RESULTS.read_text())["timing"]
    sentence = README[README.index("At the default `tau` = 0.0005 against cuDNN"):]
    sentence = sentence[:sentence.index(": the right `tau`")]
    for name, shape in zip(["CogVideoX", "Mochi", "Flux", "Llama"], SHAPES, strict=True):
        part = sentence[sentence.index(name):]
        s2o, topcdf = re.findall(r"(\d+\.\d+)×", part)[:2]
        assert_shown_as(s2o, timing[shape]["s2o_vs_cudnn"], f"S2O at the default tau, {name}")
        assert_shown_as(topcdf, timing[shape]["topcdf_vs_cudnn"], f"TopCdf at its defaults, {name}")
        sparsity = re.search(r"×\s+at\s+(?:sparsity\s+)?(\d+\.\d+)", part)[1]
        assert_shown_as(sparsity, timing[shape]["s2o_sparsity"], f"S2O's sparsity at the default tau, {name}")
