"""The protocol behind nnx's multi-line reprs.

A class opts in by subclassing :class:`Representable` and implementing
``__nnx_repr__``, a generator that yields one :class:`Object` header and then
one :class:`Attr` per line::

    >>> from nnx import reprlib
    >>> class Point(reprlib.Representable):
    ...   def __init__(self, x, y):
    ...     self.x, self.y = x, y
    ...
    ...   def __nnx_repr__(self):
    ...     yield reprlib.Object(type(self))
    ...     yield reprlib.Attr('x', self.x)
    ...     yield reprlib.Attr('y', self.y)
    >>> Point(1, 2)
    Point(
      x=1,
      y=2
    )

Nested Representables are indented, and an object that is already being
printed higher up the stack (a cycle) prints as ``...``.
"""

import dataclasses
import threading
import typing as tp


@dataclasses.dataclass
class Object:
    """Header of a repr: the type name and the brackets around its attributes."""

    type: str | type
    start: str = "("
    end: str = ")"
    value_sep: str = "="
    elem_indent: str = "  "
    empty_repr: str = ""


@dataclasses.dataclass
class Attr:
    """One line of a repr: ``key<value_sep>value``.

    ``value`` is passed through ``repr`` unless it already is a string.
    """

    key: str
    value: tp.Any
    start: str = ""
    end: str = ""


class _Printing(threading.local):
    def __init__(self):
        self.active: set[int] = set()


_printing = _Printing()


class Representable:
    __slots__ = ()

    def __nnx_repr__(self) -> tp.Iterator[Object | Attr]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return get_repr(self)


def get_repr(obj: Representable) -> str:
    """Renders ``obj.__nnx_repr__()`` as an indented multi-line string."""
    key = id(obj)
    if key in _printing.active:
        return "..."
    _printing.active.add(key)
    try:
        iterator = obj.__nnx_repr__()
        header = next(iterator)
        if not isinstance(header, Object):
            raise TypeError(f"__nnx_repr__ must yield an Object first, got {header!r}")
        name = header.type if isinstance(header.type, str) else header.type.__name__

        lines = []
        for attr in iterator:
            value = attr.value if isinstance(attr.value, str) else repr(attr.value)
            value = value.replace("\n", "\n" + header.elem_indent)
            lines.append(f"{header.elem_indent}{attr.start}{attr.key}{header.value_sep}{value}{attr.end}")
    finally:
        _printing.active.discard(key)

    if not lines:
        return f"{name}{header.start}{header.empty_repr}{header.end}"
    return f"{name}{header.start}\n" + ",\n".join(lines) + f"\n{header.end}"
