"""Dataclass Modules and Pytrees whose fields declare their container.

After ``__init__`` each declared field is wrapped into its container
(``scale`` becomes a ``Param``, ``count`` a ``Count``, ``features`` a
``Static``), so the fields show up in ``partition`` exactly like hand-written
``nnx.Param(...)`` attributes, and static fields never do::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> class Count(nnx.Variable):
    ...   pass
    >>> @nnx.dataclass
    ... class Affine(nnx.Module):
    ...   features: int = nnx.static_field()
    ...   scale: jax.Array = nnx.param_field()
    ...   count: int = nnx.var_field(Count)
    >>> affine = Affine(3, jnp.ones(3), 0)
    >>> state = affine.get_state()
    >>> list(state), type(state['count']).__name__
    (['count', 'scale'], 'Count')

A
field that is given a container must be compatible with the declared one:
``nnx.Node(1)`` is accepted by a ``node_field``, ``nnx.Param(1)`` is not.
"""

import dataclasses
import typing as tp

from nnx import containers

A = tp.TypeVar("A")
T = tp.TypeVar("T", bound=type)
_CONTAINER_FN = "nnx_container_fn"


def field(
    *,
    default: tp.Any = dataclasses.MISSING,
    default_factory: tp.Any = dataclasses.MISSING,
    init: bool = True,
    repr: bool = True,
    hash: bool | None = None,
    compare: bool = True,
    metadata: tp.Mapping[str, tp.Any] | None = None,
) -> tp.Any:
    """A ``dataclasses.field``; the value is kept as it is."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        init=init,
        repr=repr,
        hash=hash,
        compare=compare,
        metadata=metadata,
    )


def _container_field(container_fn, metadata, **kwargs) -> tp.Any:
    return field(metadata={**(metadata or {}), _CONTAINER_FN: container_fn}, **kwargs)


def static_field(*, metadata: tp.Mapping[str, tp.Any] | None = None, **kwargs) -> tp.Any:
    """A field that is static structure, never state, even when it holds an array.

    Wrapped into ``nnx.Static`` after ``__init__``: it lives in the ModuleDef (or
    a Pytree's aux data) and reading it gives the value.
    """
    return _container_field(containers.Static, {**(metadata or {}), "static": True}, **kwargs)


def node_field(*, metadata: tp.Mapping[str, tp.Any] | None = None, **kwargs) -> tp.Any:
    """A field wrapped into ``nnx.Node`` after ``__init__``."""
    return _container_field(containers.Node, metadata, **kwargs)


def param_field(
    sharding: containers.Sharding | None = None,
    *,
    metadata: tp.Mapping[str, tp.Any] | None = None,
    **kwargs,
) -> tp.Any:
    """A field wrapped into ``nnx.Param`` after ``__init__``."""
    return var_field(containers.Param, sharding, metadata=metadata, **kwargs)


def var_field(
    variable_type: type[containers.Variable[tp.Any]],
    sharding: containers.Sharding | None = None,
    *,
    metadata: tp.Mapping[str, tp.Any] | None = None,
    **kwargs,
) -> tp.Any:
    """A field wrapped into ``variable_type`` (with ``sharding``) after ``__init__``. A container given for it
    keeps its own sharding, or takes the declared one when it has none."""

    def wrap(value):
        if isinstance(value, containers.Container):
            container = variable_type(value)
            if sharding is not None and container.sharding is None:
                container = container.replace(sharding=sharding)
            return container
        return variable_type(value, sharding=sharding)

    return _container_field(wrap, metadata, **kwargs)


_declared: dict[type, tuple[tuple[str, tp.Callable[[tp.Any], tp.Any]], ...]] = {}


def _declared_containers(cls: type) -> tuple[tuple[str, tp.Callable[[tp.Any], tp.Any]], ...]:
    """``(name, container_fn)`` of the fields of ``cls`` that declare a container.

    Dataclass fields, and for plain classes, ``x: int = nnx.node_field()``
    class attributes.
    """
    found = _declared.get(cls)
    if found is None:
        if dataclasses.is_dataclass(cls):
            fields = dataclasses.fields(cls)
        else:
            fields = [
                value
                for klass in reversed(cls.__mro__)
                for value in vars(klass).values()
                if isinstance(value, dataclasses.Field)
            ]
            for klass in reversed(cls.__mro__):
                for name, value in vars(klass).items():
                    if isinstance(value, dataclasses.Field) and value.name is None:
                        value.name = name
        found = tuple((f.name, f.metadata[_CONTAINER_FN]) for f in fields if _CONTAINER_FN in f.metadata)
        _declared[cls] = found
    return found


def wrap_fields(obj: tp.Any) -> None:
    """Wraps the declared fields of ``obj`` into their containers."""
    declared = _declared_containers(type(obj))
    if not declared:
        return
    attributes = object.__getattribute__(obj, "__dict__")
    for name, container_fn in declared:
        if name in attributes:
            attributes[name] = container_fn(attributes[name])


@tp.overload
def dataclass(cls: T, /) -> T: ...


@tp.overload
def dataclass(*, frozen: bool = False, **kwargs: tp.Any) -> tp.Callable[[T], T]: ...


def dataclass(cls: T | None = None, /, *, frozen: bool = False, **kwargs: tp.Any):
    """``dataclasses.dataclass`` for Modules and Pytrees.

    Modules keep identity equality and hashing (``eq=False``) and nnx's repr.
    """

    def decorate(cls: T) -> T:
        options = dict(repr=False, **kwargs)
        if getattr(cls, "_identity_equality", False):  # a Module (nnx.module imports this file, not the reverse)
            options.setdefault("eq", False)
        return dataclasses.dataclass(cls, frozen=frozen, **options)  # type: ignore

    return decorate if cls is None else decorate(cls)
