"""The node registry: which attribute values are *state*.

Partitioning a Module collects every attribute whose value is a node into a
``State``; every other value (ints, strings, lists, callables, ...) is static
structure and lives in the ``ModuleDef``. Arrays, ``Node`` containers,
``State``, ``Pure`` and ``Pytree`` instances are nodes out of the box::

    >>> import jax.numpy as jnp
    >>> import nnx
    >>> nnx.is_node(jnp.ones(3)), nnx.is_node(nnx.Param(1)), nnx.is_node([1, 2])
    (True, True, False)

Register your own types with :func:`register_node_type`.
"""

import typing as tp

import jax
import numpy as np

_node_types: tuple[type, ...] = ()

# Per-type answers cached by the graph walk (``isinstance`` against ABCs such
# as ``jax.Array`` is slow); cleared whenever the registry changes.
type_cache: dict[type, tp.Any] = {}


def register_node_type(node_type: type) -> None:
    """Makes instances of ``node_type`` (and its subclasses) nodes."""
    global _node_types
    if node_type not in _node_types:
        _node_types = (*_node_types, node_type)
        type_cache.clear()


def is_node(x: tp.Any) -> bool:
    """Whether ``x`` is state (collected by partition) rather than static."""
    return isinstance(x, _node_types)


def node_types() -> tuple[type, ...]:
    """The registered node types, for fast ``isinstance`` checks."""
    return _node_types


register_node_type(jax.Array)
register_node_type(np.ndarray)
# Tracers stand for arrays inside transforms, but only pass isinstance (not
# issubclass, which the graph walk's type cache uses) against jax.Array.
register_node_type(jax.core.Tracer)
