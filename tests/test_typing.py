"""The package's type hints: mypy passes on the package (configured in pyproject.toml), the package ships them
(``py.typed``), a user's code gets a tensor or a (tensor, statistics) pair from ``return_sparsity`` as written,
and every ``@overload`` of an entry point takes exactly its implementation's arguments."""

from __future__ import annotations

import inspect
import os
import sys
import typing

import pytest

from mypy import api as mypy_api  # a test dependency: a missing one must fail, not skip

import sparge_diffusers
from sparge_diffusers import block_sparse_attention, s2o_attention, sparge_attention
from sparge_diffusers.llm import pbs_sparge_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_mypy(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[str, int]:
    """mypy from the repository root (its [tool.mypy] settings), its report and exit status."""
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = mypy_api.run(list(args))
    return stdout + stderr, status


def test_the_package_type_checks(monkeypatch):
    report, status = run_mypy(monkeypatch)
    assert status == 0, report


def test_the_package_ships_its_hints():
    assert os.path.isfile(os.path.join(os.path.dirname(sparge_diffusers.__file__), "py.typed"))
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with the standard library")

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["sparge_diffusers"]  # so a wheel carries it too


USER_CODE = """\
import torch
from sparge_diffusers import SparsityStats, block_sparse_attention, s2o_attention, sparge_attention
from sparge_diffusers.llm import pbs_sparge_attention

q = torch.zeros(1, 2, 3, 64)
out: torch.Tensor = sparge_attention(q, q, q)
pair: tuple[torch.Tensor, SparsityStats] = sparge_attention(q, q, q, return_sparsity=True)
out = block_sparse_attention(q, q, q, None, tensor_layout="NHD")
pair = block_sparse_attention(q, q, q, None, return_sparsity=True)
out = s2o_attention(q, q, q, tau=None)
pair = s2o_attention(q, q, q, return_sparsity=True)
out = pbs_sparge_attention(q, q, q, cdfthreshd=0.9)
pair = pbs_sparge_attention(q, q, q, return_sparsity=True)
flag = bool(q.numel())
either = sparge_attention(q, q, q, return_sparsity=flag)
reveal_type(either)
out = sparge_attention(q, q, q, return_sparsity=True)
out = sparge_attention(q, q, q, tensor_layout="BHND")
"""


def test_a_users_code_gets_the_type_its_flag_asks_for(tmp_path, monkeypatch):
    """Annotated as they are used, the calls above check, and the last two lines are errors: a pair where a tensor
    was asked for, and a layout that does not exist."""
    path = tmp_path / "user_code.py"
    path.write_text(USER_CODE)
    report, status = run_mypy(monkeypatch, str(path))
    lines = USER_CODE.splitlines()
    errors = [line for line in report.splitlines() if ": error:" in line]
    at = sorted({int(line.split(":")[1]) for line in errors})
    assert at == [len(lines) - 1, len(lines)], report
    assert "tuple[Tensor, SparsityStats]" in errors[0] and "No overload variant" in errors[1], report
    revealed = next(line for line in report.splitlines() if ": note: Revealed type" in line)
    assert "Tensor" in revealed and "tuple" in revealed, revealed  # a bool known only at run time: either
    assert status == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is Python 3.11+")
@pytest.mark.parametrize("function", [sparge_attention, block_sparse_attention, s2o_attention, pbs_sparge_attention])
def test_each_overload_takes_the_implementations_arguments(function):
    """A keyword added to an entry point but not to its overloads would be an error in every typed caller."""
    overloads = typing.get_overloads(function)
    assert len(overloads) == 3  # return_sparsity False, True, and a bool known only at run time
    own = inspect.signature(function).parameters
    for stub in overloads:
        theirs = inspect.signature(stub).parameters
        assert [(p.name, p.kind) for p in theirs.values()] == [(p.name, p.kind) for p in own.values()]
        for name, p in theirs.items():  # a default where the implementation has one
            assert (p.default is inspect.Parameter.empty) == (own[name].default is inspect.Parameter.empty) \
                or name == "return_sparsity"
    annotations = [inspect.signature(stub).parameters["return_sparsity"].annotation for stub in overloads]
    assert annotations == ["Literal[False]", "Literal[True]", "bool"]
