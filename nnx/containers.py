"""Containers: a value plus metadata, the leaves of nnx state.

A container wraps one ``value`` and any number of named metadata attributes::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> p = nnx.Param(jnp.ones(3), sharding=('embed',))
    >>> p.value
    Array([1., 1., 1.], dtype=float32)
    >>> p.sharding
    ('embed',)
    >>> jax.tree.map(lambda x: x * 2, p).sharding  # the metadata rides along
    ('embed',)

``Node`` and its subclasses are pytrees with exactly one child (``value``);
their metadata travels as static aux data, so ``jax.tree.map`` over a
``Param`` gives back a ``Param`` with the same metadata. ``Variable`` adds a
``sharding`` attribute (logical axis names), and ``Param``, ``BatchStat``,
``Cache`` and ``Intermediate`` are the variable kinds nnx ships; define your
own with ``class Count(nnx.Variable): pass``. ``Static`` holds a value as
aux data only (no leaves).

Containers are treated as immutable by nnx: assigning to a Module attribute
that holds a container creates a new container, so a ``State`` taken from a
Module never changes under you.
"""

import dataclasses
import functools
import typing as tp
from abc import ABCMeta

import jax
import jax.tree_util as jtu
import numpy as np

from nnx import _flax_serialization, nodes, reprlib

A = tp.TypeVar("A")
B = tp.TypeVar("B")
F = tp.TypeVar("F", bound=tp.Callable[..., tp.Any])
Sharding = tuple[str | None, ...]


@dataclasses.dataclass
class ContainerMetadata(tp.Generic[A]):
    """A value that carries metadata for the container it will be put in.

    Constructing any container from a ``ContainerMetadata`` merges
    ``metadata`` into the container's attributes. Initializers wrapped with
    :func:`with_metadata` return these.
    """

    value: A
    metadata: tp.Mapping[str, tp.Any]


def _incompatible(source: "Container", target: type, given: tp.Mapping[str, tp.Any] | None = None) -> ValueError:
    """``target(source)`` is refused: another container type, or other metadata than ``given``."""
    mismatch = f"input value of type '{type(source).__name__}' is not compatible with return type '{target.__name__}'"
    if given is None:
        fix = (
            f"a container does not convert to another container type. Pass the plain value instead, "
            f"e.g. {target.__name__}(x.value) (for a dataclass field, give it a plain value or a {target.__name__})."
        )
    else:
        fix = (
            f"the container has metadata {_metadata(source)}, the call asks for {dict(given)}. "
            f"To change metadata use x.replace({', '.join(f'{k}={v!r}' for k, v in given.items())}); "
            f"to start afresh pass x.value."
        )
    return ValueError(f"{mismatch}: {fix}")


def _metadata(container: "Container") -> dict[str, tp.Any]:
    return {k: v for k, v in vars(container).items() if k != "value"}


class _ContainerMeta(ABCMeta):
    """Makes construction idempotent: ``Node(Node(1))`` is a ``Node`` of 1."""

    def __call__(cls, /, value=None, *args, **metadata):
        if not isinstance(value, Container):
            return super().__call__(value, *args, **metadata)
        source = value
        if type(source) is not cls:
            raise _incompatible(source, cls)
        obj = super().__call__(source.value, *args, **metadata)
        explicit = _metadata(obj)
        inherited = _metadata(source)
        for key, inherited_value in inherited.items():
            if key not in metadata and not args:
                explicit[key] = inherited_value
        if explicit != inherited and (metadata or args):
            raise _incompatible(source, cls, {k: v for k, v in explicit.items() if k in metadata} or dict(explicit))
        vars(obj).update(explicit)
        return obj


class Container(tp.Generic[A], reprlib.Representable, metaclass=_ContainerMeta):
    """Base class of every container: a ``value`` plus metadata attributes."""

    value: A

    def __init__(self, value: A | ContainerMetadata[A], **metadata: tp.Any):
        if isinstance(value, ContainerMetadata):
            metadata = {**metadata, **value.metadata}
            value = value.value
        attributes = vars(self)
        attributes["value"] = value
        attributes.update(metadata)

    if tp.TYPE_CHECKING:

        def __getattr__(self, name: str) -> tp.Any: ...

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def _with_value(self, value: tp.Any) -> "Container[tp.Any]":
        """A copy holding ``value``, bypassing validation (internal fast path)."""
        new = object.__new__(type(self))
        attributes = vars(new)
        attributes.update(vars(self))
        attributes["value"] = value
        return new

    def replace(self, **updates: tp.Any) -> "Container[tp.Any]":
        """A new container of the same type with some attributes replaced.

        ``value`` may be given as a container; it must then be equivalent (same
        type and metadata) to this one. Unknown metadata keys raise
        ``ValueError``.
        """
        attributes = vars(self)
        for key in updates:
            if key not in attributes:
                raise ValueError(
                    f"Unknown metadata key {key!r}: a {type(self).__name__} has {sorted(attributes)}. replace() "
                    f"changes existing keys only; to add one build a new container, "
                    f"{type(self).__name__}(x.value, {key}=..., **other_metadata)."
                )
        if "value" in updates and isinstance(updates["value"], Container):
            source = updates["value"]
            if not self.is_equivalent(source):
                raise ValueError(
                    f"Cannot replace value from incompatible container, expected a "
                    f"{type(self).__name__} with metadata {_metadata(self)}, "
                    f"got {source!r}. Pass the plain value instead: replace(value=other.value)."
                )
            updates["value"] = source.value
        new = object.__new__(type(self))
        vars(new).update(attributes, **updates)
        return new

    def is_equivalent(self, other: tp.Any) -> bool:
        """Same type and same metadata (the values may differ)."""
        return type(self) is type(other) and _metadata(self) == _metadata(other)

    def copy(self: "Container[A]") -> "Container[A]":
        """A shallow copy (the value itself is shared)."""
        new = object.__new__(type(self))
        vars(new).update(vars(self))
        return new

    def __nnx_repr__(self):
        yield reprlib.Object(type=type(self))
        for name, value in vars(self).items():
            yield reprlib.Attr(name, _short_repr(value) if name == "value" else repr(value))


def _short_repr(value: tp.Any) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and len(shape) > 0:
        kind = "Array" if type(value).__name__ == "ArrayImpl" else type(value).__name__
        return f"{kind}(shape={tuple(shape)}, dtype={dtype})"
    return repr(value)


def unbox(container: Container[A]) -> A:
    """What reading a container attribute from a Module returns."""
    unbox_fn = vars(container).get("unbox_fn")
    if unbox_fn is not None:
        return unbox_fn(container)
    return container.value


def stored_value(obj: tp.Any, name: str) -> tp.Any:
    """``obj``'s attribute ``name`` as stored: a container's value without its ``unbox_fn`` (the sharding
    constraint that reading a logically partitioned parameter adds); anything else as it is.

    For a layer's reads of the weights it multiplies by. Under ``nnx.Scan`` such a read is a layer's slice of
    the stacked array, which carries its sharding already; constrained once more it is a value of its own,
    which autodiff keeps for the backward pass and the scan stacks again (a copy of the weights among the
    step's temporaries) where the slice itself is read back from the stack."""
    value = vars(obj)[name]
    return value.value if isinstance(value, Container) else value


def getattribute_unboxed(obj: tp.Any, name: str) -> tp.Any:
    """``__getattribute__`` of Modules and Pytrees: containers read as values."""
    value = object.__getattribute__(obj, name)
    if isinstance(value, Container):
        return unbox(value)
    return value


def assign(attributes: dict[str, tp.Any], name: str, value: tp.Any, *, copy: bool) -> None:
    """Assignment into an instance dict that keeps container types.

    A container is stored as is (or a copy of it); a plain value assigned over
    a container replaces the container's value, keeping its type and metadata.
    """
    if isinstance(value, Container):
        attributes[name] = value.copy() if copy else value
        return
    current = attributes.get(name)
    if isinstance(current, Container):
        attributes[name] = current._with_value(value)
    else:
        attributes[name] = value


def _node_flatten_with_keys(node: "NodeBase"):
    metadata = vars(node).copy()
    value = metadata.pop("value")
    return ((_VALUE_KEY, value),), metadata


def _node_flatten(node: "NodeBase"):
    metadata = vars(node).copy()
    value = metadata.pop("value")
    return (value,), metadata


_VALUE_KEY = jtu.GetAttrKey("value")


def _node_to_state_dict(serialization: tp.Any, node: "NodeBase") -> tp.Any:
    """A node serializes as its value; type and metadata come from the restore target."""
    return serialization.to_state_dict(node.value)


def _node_from_state_dict(serialization: tp.Any, node: "NodeBase", state: tp.Any) -> "NodeBase":
    return node._with_value(serialization.from_state_dict(node.value, state))


class NodeBase(Container[A]):
    """A container that is a pytree with one child, ``value``.

    Every subclass is registered with JAX when it is defined.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)

        def unflatten(metadata, children):
            node = object.__new__(cls)
            attributes = vars(node)
            attributes["value"] = children[0]
            attributes.update(metadata)
            return node

        jtu.register_pytree_with_keys(cls, _node_flatten_with_keys, unflatten, flatten_func=_node_flatten)
        _flax_serialization.register(cls, _node_to_state_dict, _node_from_state_dict)


class Node(NodeBase[A]):
    """A generic node of state: ``nnx.Node(x)`` makes ``x`` part of the state."""


class Variable(Node[A]):
    """A node with a ``sharding``: a tuple of logical axis names (or ``None``).

    Subclass it to make a new kind of state that filters can select::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> class Count(nnx.Variable):
        ...   pass
        >>> class Counter(nnx.Module):
        ...   def __init__(self, *, ctx):
        ...     self.linear = nnx.Linear(2, 2, ctx=ctx)
        ...     self.calls = Count(jnp.array(0))
        >>> model = Counter(ctx=nnx.context(0))
        >>> list(model.filter(Count)), list(model.filter(nnx.Param))
        (['calls'], ['linear/bias', 'linear/kernel'])
    """

    sharding: Sharding | None

    def __init__(
        self,
        value: A | ContainerMetadata[A],
        sharding: Sharding | None = None,
        **metadata: tp.Any,
    ):
        super().__init__(value, sharding=sharding, **metadata)


class Param(Variable[A]):
    """A trainable parameter."""


class BatchStat(Variable[A]):
    """A running statistic, such as BatchNorm's mean and variance."""


class Cache(Variable[A]):
    """A cache carried between calls, such as an attention kv-cache."""


class Intermediate(Variable[A]):
    """A value recorded during a call with ``Module.sow``."""


class Static(Container[A]):
    """A value carried as static pytree aux data: it has no leaves.

    The value (and any metadata a subclass adds) must be hashable to pass
    through ``jax.jit``. Subclasses are pytrees too, registered when defined.
    """

    def __init__(self, value: A):
        super().__init__(value)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _register_static(cls)

    def __hash__(self) -> int:
        return hash(self.value)


# Arrays compare elementwise and do not hash, so as aux data they break jit's cache only on a later call: refuse
# them when the Static is flattened instead.
_ARRAY_TYPES = (np.ndarray, jax.Array)


def _register_static(cls: type[Static[tp.Any]]) -> None:
    def unflatten(attributes, _children):
        static = object.__new__(cls)
        vars(static).update(attributes)
        return static

    def flatten(static):
        attributes = tuple(vars(static).items())
        for name, value in attributes:
            if isinstance(value, _ARRAY_TYPES):
                raise TypeError(
                    f"{cls.__name__}.{name} holds an array ({type(value).__name__} of shape {value.shape}): a Static "
                    "travels as pytree aux data, which must be hashable; keep arrays in a Variable or pass a tuple"
                )
        return (), attributes

    jtu.register_pytree_node(cls, flatten, unflatten)


_register_static(Static)


def with_metadata(initializer: F, **metadata: tp.Any) -> F:
    """Wraps ``initializer`` so that its result carries ``metadata``.

    Example::

        >>> import nnx
        >>> init = nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=('din', 'dout'))
        >>> layer = nnx.Linear(2, 3, kernel_init=init, ctx=nnx.context(0))
        >>> layer.partition(nnx.Param)[0]['kernel'].sharding
        ('din', 'dout')
    """

    @functools.wraps(initializer)
    def wrapper(*args, **kwargs):
        return ContainerMetadata(initializer(*args, **kwargs), metadata)

    return wrapper  # type: ignore[return-value]


nodes.register_node_type(Node)
