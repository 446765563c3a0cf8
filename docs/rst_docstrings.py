"""A Griffe extension for the API pages: the library's docstrings keep Python's habits, the site reads Markdown.

The docstrings mark a code example the way Python's own docs and doctest do: a paragraph ending in ``::``
followed by an indented block, or a ``>>>`` session on its own (sessions the suite runs as doctests), and name
other objects with roles such as ``:class:`Module```. Markdown reads a session as nested block quotes and
prints a role as it is. This turns each literal block and session into a fenced one (``pycon`` for a session,
``python`` otherwise) and each role into inline code, as the docstrings are loaded; the source stays as it is.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`~?([^`]+)`")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def to_markdown(text: str) -> str:
    """``text`` with its ``::`` literal blocks fenced and its roles as inline code."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.lstrip().startswith(">>>"):  # a session on its own, with no '::' before it: up to a blank line
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            pad = " " * _indent(line)
            session = [pad + s[len(pad) :] if s.startswith(pad) else s for s in lines[i - 1 : j]]
            out += ["", f"{pad}```pycon", *session, f"{pad}```", ""]
            i = j
            continue
        if not line.rstrip().endswith("::"):
            out.append(_ROLE.sub(r"`\1`", line))
            continue
        base = _indent(line)
        block: list[str] = []
        j = i
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        while block and not block[0].strip():
            block.pop(0)
        if not any(b.strip() for b in block):  # a '::' with no block under it: leave the line alone
            out.append(_ROLE.sub(r"`\1`", line))
            continue
        head = line.rstrip()[:-2].rstrip()
        if head.strip():
            out.append(_ROLE.sub(r"`\1`", head) + ":")
        code = [b for b in block if b.strip()]
        inner = min(_indent(b) for b in code)
        pad = " " * base
        language = "pycon" if code[0].lstrip().startswith(">>>") else "python"
        out += ["", f"{pad}```{language}", *(pad + b[inner:] if b.strip() else "" for b in block), f"{pad}```", ""]
        i = j
    return "\n".join(out)


class RstLiteralBlocks(griffe.Extension):
    """Rewrites every loaded docstring with :func:`to_markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
