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
