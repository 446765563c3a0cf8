"""Which package may import which: the arrows run one way, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module each file under `package` imports (top-level or inside a function), by file."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(ROOT))] = names
    return found


def module_graph(package: str) -> dict[str, set[str]]:
    """Which modules of `package` each of its modules imports, top-level or inside a function: `from a import b`
    imports the module `a.b` when there is one, else `a`."""
    files = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    names.add(name if name in files else node.module)
        graph[module] = {name for name in names if name in files and name != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or through others (the strongly connected
    components of more than one module): every circle of imports runs inside one of them."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for child in graph[todo.pop()] - seen:
                seen.add(child)
                todo.append(child)
        reach[start] = seen
    groups = {tuple(sorted(m for m in reach[start] if start in reach[m])) for start in graph if start in reach[start]}
    return sorted(list(g) for g in groups)


def offending(package: str, forbidden: str) -> dict[str, list[str]]:
    return {
        file: sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
        for file, names in imported_modules(package).items()
        if any(n == forbidden or n.startswith(forbidden + ".") for n in names)
    }


def test_the_data_package_never_imports_hf():
    # hf reads model directories and provides data's `pretrained` tokenizer (data.tokenizers.provide_pretrained)
    assert offending("nnx_cli/data", "nnx_cli.hf") == {}


def test_the_library_never_imports_the_trainer():
    assert offending("nnx", "nnx_cli") == {}


def test_the_circle_finder_finds_a_circle_through_three_modules_and_nothing_in_a_chain():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_of_the_trainer_imports_itself_through_others():
    # e.g. steps -> objectives -> grpo -> rollouts -> steps: rollouts get the step through objectives.Steps instead
    assert import_circles(module_graph("nnx_cli")) == []


def test_no_module_of_the_library_imports_itself_through_others():
    # nnx.dataclasses tells a Module by its class attribute, not by importing nnx.module (which imports it)
    assert import_circles(module_graph("nnx")) == []
