"""The examples in the library's docstrings run and print what they show.

The API reference is made from these docstrings (docs/reference/api), so an example that drifts from the
code is a wrong page. Each example imports what it uses and starts from nothing.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import nnx


def _examples() -> dict[str, list[doctest.DocTest]]:
    """The doctests of every module of the `nnx` package, by module name (those without any left out)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for info in pkgutil.walk_packages(nnx.__path__, "nnx."):
        module = importlib.import_module(info.name)
        # A module's own names only: nnx re-exports, and `nnx` itself would run every example twice.
        tests = [t for t in finder.find(module, globs={}) if t.examples and _defined_in(t, module)]
        if tests:
            found[info.name] = tests
    return found


def _defined_in(test: doctest.DocTest, module: object) -> bool:
    return test.filename is None or test.filename == getattr(module, "__file__", None)


EXAMPLES = _examples()


def test_the_core_api_has_examples() -> None:
    """The pages a reader learns the library from carry examples: modules, state, filters, RNG, transforms."""
    for name in ("nnx.module", "nnx.state", "nnx.partitioning", "nnx.contextlib", "nnx.containers"):
        assert name in EXAMPLES, f"{name} has no example in its docstrings"
    for name in ("nnx._transforms.jit", "nnx._transforms.grad", "nnx._transforms.scan", "nnx.helpers", "nnx.spmd"):
        assert name in EXAMPLES, f"{name} has no example in its docstrings"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_examples_run(name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    reports: list[str] = []  # doctest swaps sys.stdout while it runs an example: collect, do not print
    for test in EXAMPLES[name]:
        runner.run(test, out=reports.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(reports)
