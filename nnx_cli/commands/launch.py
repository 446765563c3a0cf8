"""The console scripts of the commands that compute: the process set up for large buffers, then the command.

`[project.scripts]` points `nnx-train`, `nnx-eval`, `nnx-generate` and `nnx-export` here. Each first starts its
process again with glibc's malloc asking for transparent huge pages (:func:`nnx_cli.runtime.with_huge_pages`;
`NNX_HUGE_PAGES=off` skips it), before the command's imports (JAX, Orbax, datasets) are paid, then runs the
command module's `main`. The quick commands (`nnx-inspect`, `nnx-plot`, `nnx-configs`) start directly.
"""

from __future__ import annotations

import importlib

from nnx_cli.runtime import with_huge_pages

COMMANDS = {  # this module's functions -> the command module each runs (tools/gen_reference.py reads it too)
    "train": "nnx_cli.commands.train",
    "evaluate": "nnx_cli.commands.eval",
    "generate": "nnx_cli.commands.generate",
    "export": "nnx_cli.commands.export",
}


def _run(function: str) -> None:
    with_huge_pages()
    importlib.import_module(COMMANDS[function]).main()


def train() -> None:
    _run("train")


def evaluate() -> None:
    _run("evaluate")


def generate() -> None:
    _run("generate")


def export() -> None:
    _run("export")
