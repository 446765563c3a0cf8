"""Modules: plain Python objects with a pure functional view.

Subclass :class:`Module` and write an ordinary ``__init__``::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> class Linear(nnx.Module):
    ...   def __init__(self, din, dout, *, ctx: nnx.Context):
    ...     self.w = nnx.Param(jax.random.uniform(ctx.make_rng('params'), (din, dout)))
    ...     self.b = nnx.Param(jnp.zeros((dout,)))
    ...
    ...   def __call__(self, x):
    ...     return x @ self.w + self.b
    >>> model = Linear(2, 3, ctx=nnx.context(0))
    >>> model(jnp.ones((4, 2))).shape
    (4, 3)

Modules are mutable, may share submodules and may contain cycles.
``partition`` walks the object graph once and returns a pure
``(State, ModuleDef)`` pair; ``ModuleDef.merge`` builds new Modules from it::

    >>> state, moduledef = model.partition()
    >>> list(state)
    ['b', 'w']
    >>> model2 = moduledef.merge(state)
    >>> bool((model2(jnp.ones((1, 2))) == model(jnp.ones((1, 2)))).all())
    True

The walk is the hot path of every functional call, so it reads instance
dicts directly, keeps the static structure as nested tuples that compare at C
speed, and records each node's full path in the ModuleDef so that ``merge``
does no string work.
"""

import typing as tp
import warnings
from abc import ABCMeta

import jax.tree_util as jtu

from nnx import containers, errors, ids, nodes, partitioning, reprlib, tracers
from nnx import dataclasses as nnx_dataclasses
from nnx._call_proxy import CallProxy
from nnx.state import State

A = tp.TypeVar("A")
M = tp.TypeVar("M", bound="Module")
Path = str
Filter = partitioning.Filter

_get_attribute = object.__getattribute__
_MODULE_STATE = "_module__state"

# ModuleDef attribute kinds.
_NODE = 0  # payload: the node's full path in the State
_MODULE = 1  # payload: the submodule's ModuleDef
_SHARED = 2  # payload: index of a module already built (sharing, cycles)
_STATIC = 3  # payload: the attribute value itself


class ModuleState:
    """Hidden per-instance state: the trace level and a unique id."""

    __slots__ = ("_trace_state", "_id")

    def __init__(self):
        self._trace_state = tracers.TraceState()
        self._id = None

    @property
    def trace_state(self) -> tracers.TraceState:
        return self._trace_state

    @property
    def id(self) -> ids.UUID:
        if self._id is None:
            self._id = ids.uuid()
        return self._id


def _dict(module: "Module") -> dict[str, tp.Any]:
    return _get_attribute(module, "__dict__")


def _check_trace(module: "Module") -> None:
    if not _dict(module)[_MODULE_STATE]._trace_state.is_valid():
        raise errors.TraceContextError(
            "Cannot mutate Module from different trace level: it was created "
            "outside the current jax/nnx transform. Pass it through the "
            "transform (partition outside, merge inside) or use a lifted "
            "transform such as nnx.jit or nnx.grad."
        )


def _construct(cls: type[M], args: tuple, kwargs: dict[str, tp.Any], init: tp.Callable[..., None] | None = None) -> M:
    """What calling a Module class does; ``init`` stands in for ``cls.__init__`` when given.

    The hidden state is attached before ``__init__`` runs, and declared
    dataclass fields are wrapped into their containers after it.
    """
    if cls.__new__ is object.__new__:
        module = object.__new__(cls)
    else:
        module = cls.__new__(cls, *args, **kwargs)
    _dict(module)[_MODULE_STATE] = ModuleState()
    if init is None:
        module.__init__(*args, **kwargs)
    else:
        init(module, *args, **kwargs)
    nnx_dataclasses.wrap_fields(module)
    return module


_COLLECTIONS = (list, tuple, dict)


def _warn_if_holding_state(module: "Module", name: str, value: tp.Any) -> None:
    """Warns when a plain list, tuple or dict (static, by the rules of ``partition``) holds Modules or arrays:
    their state would silently not train, and a jitted call would bake it in as constants. A value assigned over a
    container becomes the container's value (``sow``'s tuples): that one is state."""
    if isinstance(_dict(module).get(name), containers.Container):
        return
    items = value.values() if isinstance(value, dict) else value
    if any(isinstance(item, Module) or nodes.is_node(item) for item in items):
        kind = type(value).__name__
        holder = "nnx.Dict({...})" if kind == "dict" else "nnx.Sequence([...])"
        warnings.warn(
            f"{type(module).__name__}.{name}: a plain {kind} holding Modules or arrays is static, so what it holds "
            f"is not state: it does not train, and nnx.jit compiles it in as constants. Hold them in {holder}",
            stacklevel=3,
        )


class ModuleMeta(ABCMeta):
    def __call__(cls, /, *args, **kwargs):
        return _construct(cls, args, kwargs)


class Module(reprlib.Representable, metaclass=ModuleMeta):
    """Base class of every nnx Module; the module docstring shows one written from scratch.

    Attributes that hold containers (``nnx.Param``, ``nnx.BatchStat``, ...) are
    the Module's state, Modules are submodules, anything else is static. A
    submodule reached twice is one submodule: its state appears once, under the
    first of its paths in sorted order, and merging rebuilds the sharing::

      >>> import nnx
      >>> class Tied(nnx.Module):
      ...   def __init__(self, layer):
      ...     self.encoder = layer
      ...     self.decoder = layer
      >>> tied = Tied(nnx.Linear(2, 2, ctx=nnx.context(0)))
      >>> state, moduledef = tied.partition()
      >>> list(state)
      ['decoder/bias', 'decoder/kernel']
      >>> rebuilt = moduledef.merge(state)
      >>> rebuilt.encoder is rebuilt.decoder
      True
    """

    _identity_equality: tp.ClassVar[bool] = True  # nnx.dataclass leaves Modules equal only to themselves

    if not tp.TYPE_CHECKING:
        __getattribute__ = containers.getattribute_unboxed

        def __setattr__(self, name: str, value: tp.Any) -> None:
            _check_trace(self)
            if "/" in name:
                raise ValueError(
                    f"{type(self).__name__}: the attribute name {name!r} holds '/', which joins the names of a "
                    "State path ('encoder/kernel'); name it without one (e.g. with '_')"
                )
            if type(value) in _COLLECTIONS:
                _warn_if_holding_state(self, name, value)
            descriptor = getattr(type(self), name, None)
            if hasattr(descriptor, "__set__"):
                object.__setattr__(self, name, value)
            else:
                containers.assign(_dict(self), name, value, copy=True)

        def __delattr__(self, name: str) -> None:
            _check_trace(self)
            object.__delattr__(self, name)

    # --- the functional API -------------------------------------------------

    @tp.overload
    def partition(self: M) -> "Pure[State, M]": ...

    @tp.overload
    def partition(self: M, filter: Filter, /) -> "Pure[State, M]": ...

    @tp.overload
    def partition(self: M, filter: Filter, filter2: Filter, /, *filters: Filter) -> "Pure[tuple[State, ...], M]": ...

    def partition(self: M, *filters: Filter) -> "Pure[tp.Any, M]":
        """Splits the Module into pure state and a static ``ModuleDef``.

        With no filter, the state is one ``State`` holding every node; with one
        filter, one ``State`` (the filter must match every node); with several,
        a tuple of ``State``s, one per filter, which together must match every
        node (put ``...`` last to catch the rest)::

            >>> import nnx
            >>> model = nnx.BatchNorm(3, ctx=nnx.context(0))
            >>> (params, rest), moduledef = model.partition(nnx.Param, ...)
            >>> list(params), list(rest)
            (['bias', 'scale'], ['mean', 'var'])
            >>> model = moduledef.merge(params, rest)
        """
        state, moduledef = _graph_flatten(self)
        if filters:
            return Pure(state.partition(*filters), moduledef)
        return Pure(state, moduledef)

    def get_state(self) -> State:
        """Every node of the Module (and its submodules) as one ``State``."""
        return _graph_flatten(self)[0]

    def get_module_def(self: M) -> "ModuleDef[M]":
        """The static structure of the Module."""
        return _graph_flatten(self)[1]

    def filter(self, *filters: Filter) -> State | tuple[State, ...]:
        """Like ``partition`` but returns only the states and drops unmatched nodes."""
        return self.get_state().filter(*filters)

    def pop_state(self, *filters: Filter) -> State | tuple[State, ...]:
        """Removes the nodes matching ``filters`` from the Module and returns them."""
        if not filters:
            raise TypeError("pop_state needs at least one filter, e.g. pop_state(nnx.Intermediate)")
        states = self.filter(*filters)
        for state in states if isinstance(states, tuple) else (states,):
            for path in state:
                owner, name = _owner(self, path)
                _check_trace(owner)
                del _dict(owner)[name]
        return states

    def update_state(self, updates: tp.Union["Module", "Pure[tp.Any, tp.Any]", State, tp.Sequence[State]]) -> None:
        """Writes every value of ``updates`` at its path, creating missing attributes.

        ``updates`` is a Module, a ``Pure``, a ``State`` or a tuple of States.
        """
        if isinstance(updates, Module):
            states: tp.Sequence[State] = (updates.get_state(),)
        elif isinstance(updates, Pure):
            states = _as_state_tuple(updates.states)
        else:
            states = _as_state_tuple(updates)
        for state in states:
            for path, value in state.items():
                owner, name = _owner(self, path)
                _check_trace(owner)
                current = _dict(owner).get(name)
                if isinstance(current, Module) and not isinstance(value, Module):
                    raise ValueError(
                        f"Cannot update path {path!r}: it is a submodule ({type(current).__name__}), and a State "
                        f"writes the values of variables at their paths; got {type(value).__name__}"
                    )
                containers.assign(_dict(owner), name, value, copy=False)

    def clone(self: M) -> M:
        """An independent deep copy, made through partition and merge."""
        return self.partition().merge()

    @property
    def apply(self: M) -> "CallProxy[tuple[tp.Any, M]]":
        """Calls the Module (or one of its methods/submodules) on a clone.

        ``out, updated = model.apply(x)`` and ``model.apply.encode(x)`` leave
        ``model`` untouched and return the clone that saw the call.
        """
        return CallProxy(_run_on(self.clone, lambda out, module: (out, module)))

    def sow(self, variable_type: type[containers.Variable[tp.Any]], name: str, value: tp.Any) -> None:
        """Appends ``value`` to a tuple kept in a ``variable_type`` attribute.

        Example: ``self.sow(nnx.Intermediate, 'y', y)`` twice gives
        ``self.y == (y1, y2)``; ``model.pop_state(nnx.Intermediate)`` collects them.
        """
        attributes = _dict(self)
        if name not in attributes:
            setattr(self, name, variable_type((value,)))
            return
        current = attributes[name]
        if not isinstance(current, containers.Variable):
            raise ValueError(
                f"Expected '{name}' to be a Variable, got {type(current).__name__}: sow appends to a tuple kept in "
                f"a Variable, and '{name}' is already a plain attribute. Sow under another name, or delete the "
                f"attribute first (del module.{name})."
            )
        if type(current) is not variable_type:
            raise ValueError(
                f"Expected '{name}' to be of type '{variable_type.__name__}', got '{type(current).__name__}': "
                f"'{name}' already holds a {type(current).__name__}. Sow with {type(current).__name__} to append "
                f"to it, or sow the {variable_type.__name__} under another name."
            )
        if not isinstance(current.value, tuple):
            raise ValueError(
                f"Expected '{name}' to be a tuple, got {type(current.value).__name__}: '{name}' holds a value that "
                f"was assigned, not sown. Sow under another name, or reset it to an empty tuple first "
                f"(module.{name} = ())."
            )
        setattr(self, name, current.value + (value,))

    def for_each(self, module_type: type[M], fn: tp.Callable[[M], None]) -> None:
        """Calls ``fn`` once on every distinct submodule (self included) of ``module_type``."""
        for module in _iter_modules(self):
            if isinstance(module, module_type):
                fn(module)

    def modules(self) -> tp.Iterator[tuple[Path, "Module"]]:
        """Every distinct Module of the graph with its first path (``''`` for self)."""
        return _iter_modules_with_paths(self)

    def __nnx_repr__(self):
        yield reprlib.Object(type(self))
        for name, value in sorted(_dict(self).items()):
            if name == _MODULE_STATE:
                continue
            if isinstance(value, containers.Container):
                value = f"{type(value).__name__}({containers._short_repr(value.value)})"
            yield reprlib.Attr(name, value)


def _as_state_tuple(states: tp.Any) -> tuple[State, ...]:
    if isinstance(states, State):
        return (states,)
    if isinstance(states, (tuple, list)):
        return tuple(s for item in states for s in _as_state_tuple(item))
    if isinstance(states, tp.Mapping):
        return (State(states),)
    raise TypeError(
        f"Expected a State or a tuple of States, got {type(states).__name__}: pass what partition, filter or "
        "get_state returned (or a Module, or a Pure)."
    )


def _owner(root: Module, path: Path) -> tuple[Module, str]:
    """The module holding the attribute at ``path`` and the attribute's name."""
    *prefix, name = path.split("/")
    module = root
    for i, part in enumerate(prefix):
        child = _dict(module).get(part)
        if not isinstance(child, Module):
            where = "/".join(prefix[: i + 1])
            raise ValueError(f"Cannot reach path {path!r}: {where!r} is not a submodule of {type(root).__name__}")
        module = child
    return module, name


def _iter_modules(root: Module) -> list[Module]:
    return [module for _, module in _iter_modules_with_paths(root)]


def _iter_modules_with_paths(root: Module) -> list[tuple[Path, Module]]:
    seen: set[int] = set()
    out: list[tuple[Path, Module]] = []

    def visit(module: Module, path: Path) -> None:
        seen.add(id(module))
        out.append((path, module))
        attributes = _dict(module)
        for name in sorted(attributes):
            value = attributes[name]
            if isinstance(value, Module) and id(value) not in seen:
                visit(value, f"{path}/{name}" if path else name)

    visit(root, "")
    return out


# --- graph flatten / unflatten -------------------------------------------


class ModuleDef(tp.Generic[M], reprlib.Representable):
    """The static structure of a Module graph: types, sharing, static fields.

    A pytree with no leaves, hashable and equal by structure, so a jitted
    function that receives it back unchanged does not retrace.
    """

    __slots__ = ("_type", "_index", "_attributes", "_hash")

    def __init__(self, type: type[M], index: int, attributes: tuple[tuple[str, int, tp.Any], ...]):
        self._type = type
        self._index = index
        self._attributes = attributes
        self._hash: int | None = None

    @property
    def type(self) -> type[M]:
        return self._type

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ModuleDef):
            return False
        return self._type is other._type and self._index == other._index and self._attributes == other._attributes

    def __hash__(self) -> int:
        # Static values may be unhashable (lists); the skeleton is enough for a
        # hash consistent with __eq__.
        if self._hash is None:
            self._hash = hash(
                (
                    self._type,
                    self._index,
                    tuple(
                        (name, kind, hash(payload) if kind in (_MODULE, _SHARED) else None)
                        for name, kind, payload in self._attributes
                    ),
                )
            )
        return self._hash

    def __nnx_repr__(self):
        yield reprlib.Object(type(self))
        yield reprlib.Attr("type", self._type.__name__)
        yield reprlib.Attr("index", self._index)
        for name, kind, payload in self._attributes:
            if kind == _NODE:
                yield reprlib.Attr(name, f"<node {payload!r}>")
            elif kind == _SHARED:
                yield reprlib.Attr(name, f"<shared module {payload}>")
            else:
                yield reprlib.Attr(name, payload)

    def merge(self, state: State | tp.Sequence[State], *states: State) -> M:
        """Builds new Modules from ``states``, preserving sharing and cycles."""
        if not states and isinstance(state, State):
            mapping = state._mapping
        else:
            mapping = {}
            for s in _as_state_tuple((state, *states)):
                mapping.update(s._mapping)
        return _graph_unflatten(self, mapping)

    def apply(self, state: State | tp.Sequence[State], *states: State) -> "CallProxy[tuple[tp.Any, Pure[State, M]]]":
        """Calls a Module built from ``states`` and returns ``(out, Pure)``: the output and the Module's
        state after the call. Reach a method or a submodule's method through attributes
        (``moduledef.apply(state).encoder(x)``)::

            >>> import jax.numpy as jnp
            >>> import nnx
            >>> norm = nnx.BatchNorm(2, momentum=0.5, ctx=nnx.context(0))
            >>> (params, stats), moduledef = norm.partition(nnx.Param, nnx.BatchStat)
            >>> x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
            >>> y, (state, _) = moduledef.apply(params, stats)(x, use_running_average=False)
            >>> state['mean'].value  # the running mean moved halfway to the batch's
            Array([1. , 1.5], dtype=float32)
        """
        return CallProxy(_run_on(lambda: self.merge(state, *states), lambda out, module: (out, module.partition())))


def _attribute_kind(value_type: type) -> int:
    """``_MODULE``, ``_NODE`` or ``_STATIC`` for values of ``value_type`` (cached)."""
    kind = nodes.type_cache.get(value_type)
    if kind is None:
        if issubclass(value_type, Module):
            kind = _MODULE
        elif issubclass(value_type, nodes._node_types):
            kind = _NODE
        else:
            kind = _STATIC
        nodes.type_cache[value_type] = kind
    return kind


def _graph_flatten(root: Module) -> tuple[State, ModuleDef[tp.Any]]:
    flat: dict[Path, tp.Any] = {}
    indices: dict[int, int] = {}
    kinds = nodes.type_cache
    get_dict = _get_attribute

    def walk(module: Module, prefix: str) -> ModuleDef[tp.Any]:
        index = len(indices)
        indices[id(module)] = index
        attributes = get_dict(module, "__dict__")
        entries = []
        append = entries.append
        for name in sorted(attributes):
            value = attributes[name]
            kind = kinds.get(type(value))
            if kind is None:
                kind = _attribute_kind(type(value))
            if kind == _STATIC:
                if name != _MODULE_STATE:
                    append((name, _STATIC, value))
            elif kind == _NODE:
                path = prefix + name
                flat[path] = value
                append((name, _NODE, path))
            else:
                shared = indices.get(id(value))
                if shared is None:
                    append((name, _MODULE, walk(value, prefix + name + "/")))
                else:
                    append((name, _SHARED, shared))
        return ModuleDef(type(module), index, tuple(entries))

    moduledef = walk(root, "")
    paths = list(flat)
    if paths != sorted(paths):  # only for names with characters below '/'
        flat = dict(sorted(flat.items()))
    return State._from_sorted(flat), moduledef


def _graph_unflatten(moduledef: ModuleDef[M], mapping: tp.Mapping[Path, tp.Any]) -> M:
    built: dict[int, Module] = {}

    def build(definition: ModuleDef[tp.Any]) -> Module:
        module = object.__new__(definition._type)
        built[definition._index] = module
        attributes = _get_attribute(module, "__dict__")
        attributes[_MODULE_STATE] = ModuleState()
        for name, kind, payload in definition._attributes:
            if kind == _NODE:
                if payload in mapping:
                    attributes[name] = mapping[payload]
            elif kind == _MODULE:
                attributes[name] = build(payload)
            elif kind == _SHARED:
                attributes[name] = built[payload]
            else:
                attributes[name] = payload
        return module

    return tp.cast(M, build(moduledef))


# --- Pure and apply --------------------------------------------------------

S = tp.TypeVar("S", bound=State | tuple[State, ...])


def _run_on(make: tp.Callable[[], "Module"], finish: tp.Callable[[tp.Any, tp.Any], A]) -> tp.Callable[..., A]:
    """A ``CallProxy`` run: calls what the proxy reaches on ``make()``, returns ``finish(out, module)``."""

    def run(reach, *args, **kwargs):
        module = make()
        return finish(reach(module)(*args, **kwargs), module)

    return run


# The proxy's earlier name, kept for code that annotates with it.
ApplyCaller = CallProxy


class Pure(tuple[S, ModuleDef[M]]):
    """A partitioned Module: the pytree tuple ``(states, moduledef)``.

    ``states`` is a ``State`` or a tuple of them; only they are leaves, the
    ``ModuleDef`` is static. Alias: ``PureModule``.
    """

    def __new__(cls, states: S, moduledef: ModuleDef[M]):
        return tuple.__new__(cls, (states, moduledef))

    @property
    def states(self) -> S:
        return self[0]

    @property
    def moduledef(self) -> ModuleDef[M]:
        return self[1]

    def merge(self) -> M:
        """Builds the Module."""
        return self.moduledef.merge(self.states)

    @property
    def apply(self) -> CallProxy[tuple[tp.Any, "Pure[State, M]"]]:
        """Calls the merged Module; returns ``(out, updated Pure)``."""
        return self.moduledef.apply(self.states)

    @property
    def call(self) -> CallProxy[tp.Any]:
        """Calls the merged Module; returns only the output."""
        return CallProxy(_run_on(self.merge, lambda out, _: out))

    def get_state(self) -> State:
        """All states merged into one."""
        states = _as_state_tuple(self.states)
        return states[0] if len(states) == 1 else State.merge(*states)

    def filter(self, *filters: Filter) -> State | tuple[State, ...]:
        return self.get_state().filter(*filters)

    def partition(self, *filters: Filter) -> "Pure[tp.Any, M]":
        """Re-splits the state by ``filters`` (or merges it into one State)."""
        state = self.get_state()
        return Pure(state.partition(*filters) if filters else state, self.moduledef)

    def pop_state(self, *filters: Filter) -> tuple[tp.Any, "Pure[State, M]"]:
        """Returns ``(popped states, Pure of the rest)``."""
        if not filters:
            raise TypeError("pop_state needs at least one filter, e.g. pop_state(nnx.Intermediate)")
        state = self.get_state()
        popped = state.filter(*filters)
        removed = State.merge(*popped) if isinstance(popped, tuple) else popped
        return popped, Pure(state - removed, self.moduledef)

    def update_state(self, updates: tp.Any) -> "Pure[State, M]":
        """A new Pure with ``updates`` written in (see ``Module.update_state``)."""
        module = self.merge()
        module.update_state(updates)
        return module.partition()


PureModule = Pure

jtu.register_pytree_with_keys(
    Pure,
    lambda pure: (((jtu.GetAttrKey("states"), pure[0]),), pure[1]),
    lambda moduledef, children: Pure(children[0], moduledef),
    flatten_func=lambda pure: ((pure[0],), pure[1]),
)
jtu.register_pytree_node(ModuleDef, lambda moduledef: ((), moduledef), lambda moduledef, _: moduledef)
nodes.register_node_type(Pure)
