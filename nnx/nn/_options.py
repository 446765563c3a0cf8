"""How layers hold and read their options.

* :func:`freeze`: list-valued options become tuples, so a layer's static
  attributes stay hashable (a ``ModuleDef`` must be, for ``jax.jit``).
* :func:`resolve_flag`: a call-time mode such as Dropout's ``deterministic``
  is the first one set of the call argument, the layer attribute and the
  ``ctx`` flag of the same name.
"""

from __future__ import annotations

import typing as tp

from nnx.contextlib import Context


def freeze(x: tp.Any) -> tp.Any:
    """Lists to tuples (recursively): ``freeze([1, [2]]) == (1, (2,))``."""
    if isinstance(x, (list, tuple)):
        return tuple(freeze(item) for item in x)
    return x


def resolve_flag(name: str, argument: bool | None, attribute: bool | None, ctx: Context | None, error: str) -> bool:
    """The first of ``argument``, ``attribute`` and ``ctx.get_flag(name)`` that is not ``None``.

    Raises ``ValueError(error)`` when none is set; ``error`` says how to set it.
    Example: ``resolve_flag("deterministic", None, None, nnx.context(flags={"deterministic": True}), ...)``
    is ``True``.
    """
    if argument is not None:
        return argument
    if attribute is not None:
        return attribute
    if ctx is not None:
        flag = ctx.get_flag(name)
        if flag is not None:
            return flag
    raise ValueError(error)
