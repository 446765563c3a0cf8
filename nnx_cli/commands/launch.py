"""The console scripts of the commands that compute: the process set up for large buffers, then the command.

`[project.scripts]` points `nnx-train`, `nnx-eval`, `nnx-generate` and `nnx-export` here. Each first starts its
process again with glibc's malloc asking for transparent huge pages (:func:`nnx_cli.runtime.with_huge_pages`;
`NNX_HUGE_PAGES=off` skips it), before the command's imports (JAX, Orbax, datasets) are paid, then runs the
command module's `main`. A Ctrl-C during those imports ends the command once they are done (`interrupted`,
exit 130: stopped part-way, JAX's extensions fail with a page of traceback); one later, while the command
compiles, is not lost in a garbage-collector callback. The quick commands (`nnx-inspect`, `nnx-plot`,
`nnx-configs`) start directly.
"""

from __future__ import annotations

import importlib

from nnx_cli.errors import interrupt_outside_collections, interrupts_after
from nnx_cli.runtime import with_huge_pages

COMMANDS = {  # this module's functions -> the command module each runs (tools/gen_reference.py reads it too)
    "train": "nnx_cli.commands.train",
    "evaluate": "nnx_cli.commands.eval",
    "generate": "nnx_cli.commands.generate",
    "export": "nnx_cli.commands.export",
}


def _run(function: str) -> None:
    with_huge_pages()
    with interrupts_after():  # a Ctrl-C in the imports, which take seconds, ends the command after them
        command = importlib.import_module(COMMANDS[function])
    interrupt_outside_collections()
    command.main()


def train() -> None:
    _run("train")


def evaluate() -> None:
    _run("evaluate")


def generate() -> None:
    _run("generate")


def export() -> None:
    _run("export")
