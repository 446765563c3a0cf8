"""XLA's options for programs whose memory a test measures: as XLA compiles them outside the tests.

The session turns XLA's CPU fusion emitters off to compile faster (conftest). Some copies are made only by the
emitters (a 16-bit array converted back from its bits for a product, a table converted to bits for a loop of
slices), so a program compiled without them can show fewer temporaries than it holds in a run::

    compiled = jax.jit(step).lower(*args).compile(compiler_options=DEPLOYED)
    compiled.memory_analysis().temp_size_in_bytes
"""

from __future__ import annotations

import math
import os
import re

DEPLOYED: dict[str, bool] | None = (
    {"xla_cpu_use_fusion_emitters": True}
    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
    else None
)


def loop_instructions(hlo: str) -> list[str]:
    """The instructions of a compiled module's text (`compiled.as_text()`) that run inside a `while` loop: those
    of every loop's body and condition and of the computations they call (fusions, branches, inner loops)."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            computations[name] = []
        elif name is not None and line.startswith("  "):
            computations[name].append(line)
    calls = {n: {c for line in lines for c in _called(line)} for n, lines in computations.items()}
    pending = [c for lines in computations.values() for line in lines for c in _called(line, loops_only=True)]
    inside: set[str] = set()
    while pending:
        current = pending.pop()
        if current in computations and current not in inside:
            inside.add(current)
            pending.extend(calls[current])
    return [line for n in sorted(inside) for line in computations[n]]


def _called(line: str, loops_only: bool = False) -> list[str]:
    keys = "body|condition" if loops_only else "body|condition|calls|to_apply|branch_computations"
    names = []
    for match in re.finditer(rf"\b(?:{keys})=(\{{[^}}]*\}}|%[\w.\-]+)", line):
        names += re.findall(r"%([\w.\-]+)", match.group(1))
    return names


def converted_sizes(instructions: list[str]) -> list[int]:
    """The element count of each `convert` among `instructions` (a dtype change: not a `bitcast-convert`)."""
    sizes = []
    for line in instructions:
        match = re.search(r"= \w+\[([\d,]*)\]\{?[\d,]*\}? convert\(", line)
        if match:
            sizes.append(math.prod(int(d) for d in match.group(1).split(",") if d))
    return sizes
