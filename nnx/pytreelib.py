"""Pytree: a base class for immutable pytree objects.

Attributes that are nodes (arrays, containers, nested Pytrees, States) are
children; everything else is static aux data. Field order is sorted, so two
instances built in a different order have the same structure::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> class Point(nnx.Pytree):
    ...   def __init__(self, x, y, name):
    ...     self.x, self.y = x, y  # arrays: children
    ...     self.name = name  # a str: static
    >>> p = jax.tree.map(lambda a: a * 2, Point(jnp.ones(2), jnp.ones(2), 'p'))
    >>> p.x, p.name
    (Array([2., 2.], dtype=float32), 'p')
    >>> p.replace(name='q').name
    'q'

After ``__init__`` a Pytree is immutable (``class P(nnx.Pytree, mutable=True)``
allows assignment, never new fields). Wrap a non-node value in
``nnx.TreeNode`` to make it a child anyway. Reading an attribute that holds a
container returns its value.

With flax installed, every Pytree round-trips through
``flax.serialization.to_state_dict`` / ``from_state_dict`` (and so through
``to_bytes`` / ``from_bytes``), whether flax is imported before or after the
class is defined.
"""

import typing as tp
from abc import ABCMeta

import jax.tree_util as jtu

from nnx import _flax_serialization, containers, nodes, reprlib
from nnx import dataclasses as nnx_dataclasses

A = tp.TypeVar("A")
P = tp.TypeVar("P", bound="Pytree")

_INITIALIZING = "_pytree__initializing"
_get_attribute = object.__getattribute__


class TreeNode(containers.NodeBase[A]):
    """Marks a Pytree attribute as a child, whatever its value."""


class PytreeMeta(ABCMeta):
    def __call__(cls, /, *args: tp.Any, **kwargs: tp.Any):
        if cls.__new__ is object.__new__:
            obj = object.__new__(cls)
        else:
            obj = cls.__new__(cls, *args, **kwargs)
        attributes = _get_attribute(obj, "__dict__")
        attributes[_INITIALIZING] = True
        try:
            obj.__init__(*args, **kwargs)
        finally:
            del attributes[_INITIALIZING]
        nnx_dataclasses.wrap_fields(obj)
        return obj


class Pytree(reprlib.Representable, metaclass=PytreeMeta):
    """Base class for immutable pytrees. See the module docstring."""

    _pytree__class_is_mutable: bool = False

    def __init_subclass__(cls, mutable: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._pytree__class_is_mutable = mutable
        jtu.register_pytree_with_keys(
            cls,
            _flatten_with_keys,
            lambda aux, children: _unflatten(cls, aux, children),
            flatten_func=_flatten,
        )
        _flax_serialization.register(cls, _to_state_dict, _from_state_dict)

    if not tp.TYPE_CHECKING:
        __getattribute__ = containers.getattribute_unboxed

        def __setattr__(self, name: str, value: tp.Any) -> None:
            attributes = _get_attribute(self, "__dict__")
            descriptor = getattr(type(self), name, None)
            if hasattr(descriptor, "__set__"):
                object.__setattr__(self, name, value)
                return
            if _INITIALIZING not in attributes:
                if name not in attributes:
                    raise AttributeError(
                        f"Cannot add new fields to an initialized Pytree: {type(self).__name__} has no field {name!r}"
                    )
                if not self._pytree__class_is_mutable:
                    raise AttributeError(
                        f"{type(self).__name__} is immutable, trying to update field "
                        f"{name!r}; use .replace({name}=...) for a modified copy"
                    )
            containers.assign(attributes, name, value, copy=True)

        def __delattr__(self, name: str) -> None:
            attributes = _get_attribute(self, "__dict__")
            if _INITIALIZING not in attributes and not self._pytree__class_is_mutable and name in attributes:
                raise AttributeError(  # deleting a field changes the tree's structure as much as adding one
                    f"{type(self).__name__} is immutable, trying to update field {name!r}: fields cannot be "
                    "deleted after __init__"
                )
            object.__delattr__(self, name)

    def replace(self: P, **updates: tp.Any) -> P:
        """A copy with some fields replaced."""
        import dataclasses

        attributes = _get_attribute(self, "__dict__")
        unknown = set(updates) - set(attributes)
        if unknown:
            raise ValueError(
                f"Trying to replace unknown fields {sorted(unknown)} for {type(self).__name__!r}: its fields are "
                f"{sorted(attributes)}. replace() changes existing fields only."
            )
        if dataclasses.is_dataclass(self):
            return dataclasses.replace(self, **updates)
        return _copy_with(self, updates)

    def __nnx_repr__(self):
        yield reprlib.Object(type(self))
        for name, value in sorted(_get_attribute(self, "__dict__").items()):
            yield reprlib.Attr(name, value)


def _copy_with(pytree: P, updates: tp.Mapping[str, tp.Any]) -> P:
    """A shallow copy of ``pytree`` with ``updates`` assigned (no validation)."""
    new = object.__new__(type(pytree))
    attributes = _get_attribute(new, "__dict__")
    attributes.update(_get_attribute(pytree, "__dict__"))
    for name, value in updates.items():
        containers.assign(attributes, name, value, copy=True)
    return new


def _split(pytree: Pytree):
    attributes = _get_attribute(pytree, "__dict__")
    node_types = nodes._node_types
    names, children, static = [], [], []
    for name in sorted(attributes):
        value = attributes[name]
        if isinstance(value, node_types):
            names.append(name)
            children.append(value)
        else:
            static.append((name, value))
    return names, children, (tuple(names), tuple(static))


def _flatten(pytree: Pytree):
    _, children, aux = _split(pytree)
    return children, aux


def _flatten_with_keys(pytree: Pytree):
    names, children, aux = _split(pytree)
    return [(jtu.GetAttrKey(n), c) for n, c in zip(names, children)], aux


def _unflatten(cls: type[P], aux, children) -> P:
    names, static = aux
    pytree = object.__new__(cls)
    attributes = _get_attribute(pytree, "__dict__")
    attributes.update(zip(names, children))
    attributes.update(static)
    return pytree


def _to_state_dict(serialization: tp.Any, pytree: Pytree) -> dict[str, tp.Any]:
    attributes = _get_attribute(pytree, "__dict__")
    return {
        name: serialization.to_state_dict(getattr(pytree, name))
        for name in sorted(attributes)
        if nodes.is_node(attributes[name])
    }


def _from_state_dict(serialization: tp.Any, pytree: Pytree, state: dict[str, tp.Any]) -> Pytree:
    attributes = _get_attribute(pytree, "__dict__")
    targets = {name: getattr(pytree, name) for name in sorted(attributes) if nodes.is_node(attributes[name])}
    owner = f"an instance of {type(pytree).__name__}"
    return _copy_with(pytree, _flax_serialization.restore_fields(serialization, owner, targets, state))


def register_flax_serialization() -> None:
    """Registers every Pytree class (and ``State`` and the containers) with ``flax.serialization``.

    Not needed in normal use: they register themselves when
    ``flax.serialization`` is imported, before or after they are defined.
    """
    _flax_serialization.register_all()


nodes.register_node_type(Pytree)
nodes.register_node_type(TreeNode)
