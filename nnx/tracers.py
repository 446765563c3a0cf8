"""Trace levels: where a Module or Context may be used.

A :class:`TraceState` records two things when an object is created:

* JAX's current (opaque) trace, so an object created outside ``jax.jit`` is
  not mutated with tracers inside it, and vice versa;
* the top of nnx's own trace stack, which lifted transforms (``nnx.jit``,
  ``nnx.grad``, ...) push with :func:`nnx_trace`, so that a Module captured
  from outside a lifted transform cannot be mutated inside it.

Note: on current JAX every transform, ``jax.grad`` included, opens a new trace.
Mutating a Module created outside a plain ``jax.grad`` from inside the
differentiated function therefore raises ``TraceContextError`` too. Pass the
state in as an argument (``moduledef.apply(params)(x)``) or use ``nnx.grad``.
"""

import contextlib
import threading
import typing as tp

try:  # jax >= 0.7
    from jax.extend.core import get_opaque_trace_state as _get_trace_state
except ImportError:  # pragma: no cover - older jax
    from jax.core import get_opaque_trace_state as _get_trace_state


def current_jax_trace() -> tp.Any:
    """JAX's current trace, as an opaque object comparable with ``==``."""
    return _get_trace_state(convention="nnx")


_TOP = object()  # the level outside every lifted transform: one for all threads, so that a Module made at the
# top level of one thread (the main one) may be used at the top level of another (a data loader, a writer)


class _NnxTraceStack(threading.local):
    def __init__(self):
        self.stack: list[object] = [_TOP]


_nnx_stack = _NnxTraceStack()


def current_nnx_trace() -> object:
    """The innermost nnx trace level (a unique marker object)."""
    return _nnx_stack.stack[-1]


@contextlib.contextmanager
def nnx_trace() -> tp.Iterator[object]:
    """Opens a new nnx trace level for the duration of the ``with`` block.

    Lifted transforms run the user's function inside this block, after merging
    the Modules they were given, so only those Modules (and any created
    inside) can be mutated there.
    """
    level = object()
    _nnx_stack.stack.append(level)
    try:
        yield level
    finally:
        _nnx_stack.stack.pop()


class TraceState:
    """The trace level an object was created at."""

    __slots__ = ("_jax_trace", "_nnx_trace")

    def __init__(self):
        self._jax_trace = current_jax_trace()
        self._nnx_trace = _nnx_stack.stack[-1]

    def is_valid(self) -> bool:
        """Whether the current trace level is the one this state recorded."""
        return self._nnx_trace is _nnx_stack.stack[-1] and self._jax_trace == current_jax_trace()

    def __copy__(self) -> "TraceState":
        return TraceState()

    def __deepcopy__(self, memo) -> "TraceState":
        return TraceState()
