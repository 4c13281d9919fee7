"""The public API documents itself: every public function, class and method has a docstring, and every public
function and method has type hints on its parameters and its return (users read them in their editors, and
mypy checks their calls: ``tests/test_typing.py``)."""

from __future__ import annotations

import functools
import importlib
import inspect

import pytest

# the package's public modules; those without __all__ export what they define under names without an underscore
MODULES = ["sparge_diffusers", "sparge_diffusers.kernels", "sparge_diffusers.permutations",
           "sparge_diffusers.pipelines", "sparge_diffusers.llm", "sparge_diffusers.eval", "sparge_diffusers.tuning",
           "sparge_diffusers.testing", "sparge_diffusers.workloads", "sparge_diffusers.generation"]


def public_objects(module_name: str) -> dict[str, object]:
    """The module's public functions and classes by name."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, obj in vars(module).items() if not n.startswith("_")
                 and getattr(obj, "__module__", None) == module_name]
    objects = {n: getattr(module, n) for n in names}
    return {n: obj for n, obj in objects.items() if inspect.isfunction(obj) or inspect.isclass(obj)}


def public_methods(cls: type) -> dict[str, tuple[object, bool]]:
    """Methods, static and class methods and properties the class itself defines, each with whether it is a
    property (a class documents those in its docstring's Attributes). Inherited ones are checked where they are
    defined; NamedTuple and dataclass machinery is not the package's."""
    found = {}
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        is_property = isinstance(attr, (property, functools.cached_property))
        func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        func = func.fget if isinstance(func, property) else getattr(func, "func", func)  # cached_property: .func
        if inspect.isfunction(func):
            found[name] = (func, is_property)
    return found


def missing_hints(func) -> list[str]:
    """The parameters (and "return") of ``func`` without a type hint."""
    signature = inspect.signature(func)
    missing = [name for name, p in signature.parameters.items()
               if p.annotation is inspect.Parameter.empty and name not in ("self", "cls")]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


@pytest.mark.parametrize("module_name", MODULES)
def test_public_functions_and_classes_have_docstrings_and_type_hints(module_name):
    objects = public_objects(module_name)
    assert objects, f"{module_name} exports nothing"
    problems = []
    for name, obj in objects.items():
        doc = (obj.__doc__ or "").strip()
        if not doc or doc.startswith(f"{name}("):  # dataclasses and NamedTuples write "Name(field, ...)" themselves
            problems.append(f"{name}: no docstring")
        if inspect.isfunction(obj) and missing_hints(obj):
            problems.append(f"{name}: no type hint for {missing_hints(obj)}")
        if inspect.isclass(obj):
            for method_name, (method, is_property) in public_methods(obj).items():
                if not is_property and not (method.__doc__ or "").strip():
                    problems.append(f"{name}.{method_name}: no docstring")
                if missing_hints(method):
                    problems.append(f"{name}.{method_name}: no type hint for {missing_hints(method)}")
    assert not problems, f"{module_name}: " + "; ".join(problems)
