"""Lifted transforms: JAX transforms that take Modules and write state back.

``jax.jit`` and friends work on pure functions of arrays. The lifted versions
here take a Module directly, run the function on a copy rebuilt inside the
transform (``partition`` outside, ``merge`` inside) and write every state
change made inside back to the Module you passed::

    @nnx.jit
    def train_step(model, x, y):
      def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)
      grads = nnx.grad(loss_fn)(model)         # State keyed like the model
      params = model.filter(nnx.Param)
      model.update_state(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))

    train_step(model, x, y)                    # model now holds new params

* :func:`jit`: ``jax.jit``; compiled once per Module structure.
* :func:`grad`: ``jax.grad`` with respect to the nodes a filter selects.
* :class:`Scan` / :func:`scan`: ``jax.lax.scan`` over stacked layers.
* :class:`Remat` / :func:`remat`: ``jax.checkpoint``.

A ``Context`` passed as ``ctx=`` is partitioned on the way in and merged
inside, so layers can draw RNG keys in the transformed function.

Trace safety: the function runs at a new nnx trace level
(:func:`nnx.tracers.nnx_trace`). Only Modules passed in (and Modules created
inside) can be mutated there; mutating a Module captured from outside
raises ``TraceContextError`` ("Cannot mutate Module from different trace
level"). Pass every Module the function changes as an argument.
"""

import dataclasses
import functools
import typing as tp
import weakref
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np

from nnx import containers, contextlib, partitioning, spmd, tracers
from nnx.module import (
    _MODULE_STATE,
    Module,
    ModuleDef,
    ModuleMeta,
    ModuleState,
    _check_trace,
    _dict,
)
from nnx.state import State

A = tp.TypeVar("A")
C = tp.TypeVar("C")
F = tp.TypeVar("F", bound=tp.Callable[..., tp.Any])
M = tp.TypeVar("M", bound=Module)
Filter = partitioning.Filter

_UNSPECIFIED = object()


def _check_module(transform: str, module: tp.Any) -> None:
    if not isinstance(module, Module):
        raise TypeError(
            f"{transform} expects a Module as the first argument of the "
            f"transformed function, got {type(module).__name__}. For functions "
            f"of arrays only, use jax.{transform.split('.')[1]} directly."
        )


def _partition_ctx(kwargs: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """Replaces a ``ctx=`` Context by its pure ``(keys, contextdef)`` form."""
    ctx = kwargs.get("ctx")
    if isinstance(ctx, contextlib.Context):
        kwargs = dict(kwargs)
        kwargs["ctx"] = ctx.partition()
    return kwargs


def _merge_ctx(kwargs: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """Inverse of :func:`_partition_ctx`, called inside the transform."""
    ctx = kwargs.get("ctx")
    if isinstance(ctx, contextlib.PureContext):
        kwargs = dict(kwargs)
        kwargs["ctx"] = ctx.merge()
    return kwargs


# jit
# ------------------------------------------------------------------------------


def _reconcile(target: Module, fresh: Module) -> None:
    """Makes ``target`` look like ``fresh``, keeping ``target``'s submodules.

    ``fresh`` was built from what a transform returned (state and structure).
    Attributes are copied over (new ones added, missing ones deleted);
    submodules of the same type at the same place are updated in place rather
    than replaced, so references to them stay valid. Sharing is preserved.
    """
    targets: dict[int, Module] = {}  # id(fresh module) -> module standing for it
    used: set[int] = set()  # ids of existing modules already updated

    def adopt(module: Module) -> None:
        for _, sub in module.modules():
            targets.setdefault(id(sub), sub)

    def update(target: Module, fresh: Module) -> None:
        _check_trace(target)
        targets[id(fresh)] = target
        used.add(id(target))
        attributes, new = _dict(target), _dict(fresh)
        for name in [n for n in attributes if n not in new]:
            del attributes[name]
        for name, value in new.items():
            if name == _MODULE_STATE:
                continue
            if isinstance(value, Module):
                if id(value) in targets:
                    attributes[name] = targets[id(value)]
                    continue
                current = attributes.get(name)
                if type(current) is type(value) and id(current) not in used:
                    update(current, value)
                else:
                    adopt(value)
                    attributes[name] = value
            else:
                attributes[name] = value

    update(target, fresh)


class _Signature:
    """The static half of a jitted call: the state's treedef and the ModuleDef.

    Equal by value (so an identical structure rebuilt later hits JAX's
    cache), with a precomputed hash and an identity shortcut (so the usual
    call, which passes the very same object, costs nothing to look up).
    """

    __slots__ = ("treedef", "moduledef", "_hash")

    def __init__(self, treedef: tp.Any, moduledef: ModuleDef[tp.Any]):
        self.treedef = treedef
        self.moduledef = moduledef
        self._hash = hash((treedef, moduledef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is _Signature
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.moduledef == other.moduledef
        )


class _Flat:
    """A Module's state as flat leaves, cached between ``nnx.jit`` calls.

    Rebuilding the ``State`` (a walk of the whole object graph) at every call
    is the main per-call cost of a lifted ``jit``. Instead, the leaves and the
    attributes they came from are kept here, with a copy of every Module's
    attribute dict. While the copies still equal the dicts (checked at C
    speed; unchanged values compare by identity), nothing was assigned to the
    Modules since the last call and the cached leaves are their state.
    """

    __slots__ = ("module", "dicts", "copies", "signature", "leaves", "slots")

    def __init__(self, module: Module):
        state, moduledef = module.partition()
        leaves, treedef = jax.tree.flatten(state)
        self.module = weakref.ref(module)  # the cache must not keep models alive
        self.dicts = tuple(_dict(m) for _, m in module.modules())
        self.copies = tuple(dict(d) for d in self.dicts)
        self.signature = _Signature(treedef, moduledef)
        self.leaves = leaves
        self.slots = self._slots(module, state, leaves)

    def _slots(self, module: Module, state: State, leaves: list) -> list | None:
        """Where each leaf lives, or None if some node does not hold exactly one.

        ``slots[i] = (attributes, copy, name, container type, metadata)`` for
        leaf ``i``; type and metadata are None for a plain array attribute.
        """
        if len(leaves) != len(state):
            return None
        copy_of = {id(d): c for d, c in zip(self.dicts, self.copies)}
        slots = []
        for (path, node), leaf in zip(state.items(), leaves):
            if isinstance(node, containers.NodeBase):
                if node.value is not leaf:
                    return None
                metadata = {k: v for k, v in vars(node).items() if k != "value"}
                kind = type(node)
            elif node is leaf:
                kind = metadata = None
            else:
                return None
            *prefix, name = path.split("/")
            owner = module
            for part in prefix:
                owner = _dict(owner)[part]
            attributes = _dict(owner)
            slots.append((attributes, copy_of[id(attributes)], name, kind, metadata))
        return slots

    def is_current(self) -> bool:
        try:
            return self.dicts == self.copies
        except Exception:  # a changed value whose == is not a bool (arrays)
            return False

    def write_back(self, leaves: list) -> None:
        new_object = object.__new__
        for (attributes, copy, name, kind, metadata), leaf in zip(self.slots, leaves):
            if kind is None:
                value = leaf
            else:  # what Container._with_value does, inlined: this loop is hot
                value = new_object(kind)
                value.__dict__ = {"value": leaf, **metadata}
            attributes[name] = copy[name] = value
        self.leaves = leaves


class _Jitted:
    """``f(module, *args, **kwargs)`` compiled by ``jax.jit``, state written back.

    The compiled function is pure in ``(leaves, signature, *args)``: the
    Module's state as a flat list of arrays and, as a static argument, the
    structure (treedef and ``ModuleDef``). JAX compiles once per structure.
    Between calls the flat state is cached (see :class:`_Flat`), so a call on
    an unchanged Module does no graph walk: one jitted call and one pass
    writing the new leaves back into the Module's attributes.
    """

    _MAX_CACHED_MODULES = 8

    def __init__(self, fun: tp.Callable[..., tp.Any], stateful: bool, jit_kwargs: dict):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._stateful = stateful
        self._structured = "in_shardings" in jit_kwargs or "out_shardings" in jit_kwargs
        pure = functools.partial(_Jitted._pure, self)
        # Named after the user's function in HLO dumps and profiles (no
        # __wrapped__: jax.jit must see the pure signature, not the user's).
        pure.__name__ = getattr(fun, "__name__", "fun")  # type: ignore[attr-defined]
        self._jitted = jax.jit(pure, **jit_kwargs)
        self._flats: dict[int, _Flat] = {}

    def _pure(self, leaves: tp.Any, signature: _Signature, *args, **kwargs):
        # ``leaves`` is the flat list, or the State itself when shardings are
        # given for it (they are written against the State's structure).
        state = leaves if self._structured else signature.treedef.unflatten(leaves)
        with tracers.nnx_trace():
            module = signature.moduledef.merge(state)
            out = self._fun(module, *args, **_merge_ctx(kwargs))
            if not self._stateful:
                return out
            state, moduledef = module.partition()
        if self._structured:
            return out, state
        new_leaves, treedef = jax.tree.flatten(state)
        if treedef == signature.treedef and moduledef == signature.moduledef:
            return out, new_leaves  # same structure: the fast write-back applies
        # New attributes, submodules or static fields: the structure comes back
        # too (a ModuleDef has no leaves, so this costs nothing at run time).
        return out, state, moduledef

    def _flat(self, module: Module) -> _Flat:
        flat = self._flats.get(id(module))
        if flat is not None and flat.module() is module and flat.is_current():
            return flat
        flat = _Flat(module)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in flat.leaves):
            return flat  # a Module of an enclosing trace: do not keep its tracers
        if len(self._flats) >= self._MAX_CACHED_MODULES:
            del self._flats[next(iter(self._flats))]
        key, flats = id(module), self._flats
        flat.module = weakref.ref(module, lambda _: flats.pop(key, None) if flats.get(key) is flat else None)
        flats[key] = flat
        return flat

    def __call__(self, module: Module, *args, **kwargs):
        if not isinstance(module, Module):
            _check_module("nnx.jit", module)
        if "ctx" in kwargs:
            kwargs = _partition_ctx(kwargs)
        flat = self._flat(module)
        if not self._stateful:
            leaves = flat.leaves
            if self._structured:
                leaves = flat.signature.treedef.unflatten(leaves)
            return self._jitted(leaves, flat.signature, *args, **kwargs)
        _check_trace(module)
        if self._structured:
            state = flat.signature.treedef.unflatten(flat.leaves)
            out, new = self._jitted(state, flat.signature, *args, **kwargs)
            leaves, treedef = jax.tree.flatten(new)
            if treedef == flat.signature.treedef and flat.slots is not None:
                flat.write_back(leaves)
            else:
                module.update_state(new)
                self._flats.pop(id(module), None)
            return out
        result = self._jitted(flat.leaves, flat.signature, *args, **kwargs)
        if len(result) == 2:
            out, leaves = result
            if flat.slots is not None:
                flat.write_back(leaves)
                return out
            module.update_state(flat.signature.treedef.unflatten(leaves))
        else:
            out, state, moduledef = result
            _reconcile(module, moduledef.merge(state))
        self._flats.pop(id(module), None)
        return out

    def lower(self, module: Module, *args, **kwargs):
        """``jax.jit(...).lower`` for the given Module and arguments."""
        flat = _Flat(module)
        leaves = flat.leaves
        if self._structured:
            leaves = flat.signature.treedef.unflatten(leaves)
        return self._jitted.lower(leaves, flat.signature, *args, **_partition_ctx(kwargs))

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"nnx.jit({getattr(self._fun, '__qualname__', self._fun)!r})"


def _shift_argnums(argnums: int | tp.Sequence[int] | None) -> tuple[int, ...]:
    """Maps argument indices of ``f(module, *args)`` onto ``pure(state, moduledef, *args)``."""
    if argnums is None:
        return ()
    if isinstance(argnums, int):
        argnums = (argnums,)
    shifted = []
    for i in argnums:
        if i < 0:
            raise ValueError(
                f"Negative argnums are not supported by nnx.jit, got {i}; count from the Module, which is argument 0."
            )
        shifted.append(0 if i == 0 else i + 1)
    return tuple(shifted)


def jit(
    fun: F | None = None,
    *,
    stateful: bool = True,
    in_shardings: tp.Any = _UNSPECIFIED,
    out_shardings: tp.Any = _UNSPECIFIED,
    static_argnums: int | tp.Sequence[int] | None = None,
    static_argnames: str | tp.Iterable[str] | None = None,
    donate_argnums: int | tp.Sequence[int] | None = None,
    donate_argnames: str | tp.Iterable[str] | None = None,
    keep_unused: bool = False,
    device: jax.Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, tp.Any] | None = None,
) -> F:
    """``jax.jit`` for functions whose first argument is a Module.

    ``fun(module, *args, **kwargs)`` runs compiled on a copy of ``module``
    built inside the trace. With ``stateful=True`` every state change made
    inside (new parameter values, updated batch statistics, new attributes
    such as sown intermediates) is written back to ``module`` after the call;
    with ``stateful=False`` the module is left untouched. A ``Context``
    passed as ``ctx=`` is forked on the way in and rebuilt inside::

        @nnx.jit
        def forward(model, x, *, ctx):
          return model(x, ctx=ctx)

        y = forward(model, x, ctx=nnx.context(dropout=0))

    Calls with the same Module structure (same submodules, attributes and
    static fields) reuse the compiled function. Argument indices
    (``static_argnums``, ``donate_argnums``) count the Module as argument 0;
    donating 0 donates the Module's state buffers. For ``in_shardings`` /
    ``out_shardings``, the Module's entry is a tree of shardings matching its
    ``State`` (see :func:`nnx.get_partition_spec`); with ``stateful=True`` the
    output is ``(out, state)``.
    """
    if fun is None:
        return functools.partial(  # type: ignore[return-value]
            jit,
            stateful=stateful,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            keep_unused=keep_unused,
            device=device,
            backend=backend,
            inline=inline,
            compiler_options=compiler_options,
        )
    static = _shift_argnums(static_argnums)
    if 0 in static:
        raise ValueError("The Module (argument 0) cannot be static in nnx.jit.")
    jit_kwargs: dict[str, tp.Any] = dict(
        static_argnums=(1, *static),
        static_argnames=static_argnames,
        donate_argnums=_shift_argnums(donate_argnums) or None,
        donate_argnames=donate_argnames,
        keep_unused=keep_unused,
        device=device,
        backend=backend,
        inline=inline,
        compiler_options=compiler_options,
    )
    if in_shardings is not _UNSPECIFIED:
        jit_kwargs["in_shardings"] = in_shardings
    if out_shardings is not _UNSPECIFIED:
        jit_kwargs["out_shardings"] = out_shardings
    return _Jitted(fun, stateful, jit_kwargs)  # type: ignore[return-value]


# grad
# ------------------------------------------------------------------------------


def grad(
    fun: tp.Callable[..., tp.Any] | None = None,
    wrt: Filter = containers.Param,
    *,
    stateful: bool = True,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> tp.Callable[..., tp.Any]:
    """``jax.grad`` for functions whose first argument is a Module.

    Differentiates ``fun(module, *args, **kwargs)`` with respect to the nodes
    that ``wrt`` selects (``nnx.Param`` by default) and returns their
    gradients as a ``State`` keyed like the module's state, each gradient in
    the same container type as its node (a plain array node gives a ``Node``)::

        grads = nnx.grad(loss_fn)(model, x, y)
        grads['linear/kernel']          # Param holding d loss / d kernel

    ``wrt`` is any filter: ``nnx.All(nnx.Param, lambda path, _: not
    path.startswith('backbone'))`` freezes the backbone. With ``stateful=True``
    the other state changes made inside (batch statistics, counters) are
    written back to ``module``. With ``has_aux=True``, ``fun`` returns
    ``(loss, aux)`` and the call returns ``(grads, aux)``.
    """
    if fun is None:
        return functools.partial(
            grad,
            wrt=wrt,
            stateful=stateful,
            has_aux=has_aux,
            holomorphic=holomorphic,
            allow_int=allow_int,
        )

    @functools.wraps(fun)
    def grad_fn(module: Module, *args, **kwargs):
        _check_module("nnx.grad", module)
        kwargs = _partition_ctx(kwargs)
        state, moduledef = module.partition()
        diff, rest = state.partition(wrt, ...)
        boxed = frozenset(path for path, value in diff.items() if not isinstance(value, containers.Container))
        if boxed:
            diff = State({path: containers.Node(value) if path in boxed else value for path, value in diff.items()})

        def pure(diff: State, rest: State, *args, **kwargs):
            if boxed:
                diff = State({path: value.value if path in boxed else value for path, value in diff.items()})
            with tracers.nnx_trace():
                inner = moduledef.merge(diff, rest)
                out = fun(inner, *args, **_merge_ctx(kwargs))
                loss, aux = out if has_aux else (out, None)
                updates = (inner.get_state() - diff) if stateful else None
            return loss, (aux, updates)

        grads, (aux, updates) = jax.grad(
            pure,
            argnums=0,
            has_aux=True,
            holomorphic=holomorphic,
            allow_int=allow_int,
        )(diff, rest, *args, **kwargs)
        if stateful:
            module.update_state(updates)
        return (grads, aux) if has_aux else grads

    return grad_fn


# Shared helpers for Scan and Remat
# ------------------------------------------------------------------------------


class _CallProxy:
    """``proxy.method(...)`` / ``proxy.sub[0](...)``: calls ``run(accessor, ...)``.

    ``accessor(module)`` reaches the chosen method or submodule of a module.
    """

    __slots__ = ("_run", "_path")

    def __init__(self, run: tp.Callable[..., tp.Any], path: tuple = ()):
        self._run = run
        self._path = path

    def __getattr__(self, name: str) -> "_CallProxy":
        if name.startswith("__"):
            raise AttributeError(name)
        return _CallProxy(self._run, self._path + ((True, name),))

    def __getitem__(self, key: tp.Any) -> "_CallProxy":
        return _CallProxy(self._run, self._path + ((False, key),))

    def __call__(self, *args, **kwargs):
        path = self._path

        def accessor(module: Module) -> tp.Callable[..., tp.Any]:
            target: tp.Any = module
            for is_attribute, key in path:
                target = getattr(target, key) if is_attribute else target[key]
            return target

        return self._run(accessor, *args, **kwargs)


class _LiftedMeta(ModuleMeta):
    """``Wrapper(module_constructor, **options)`` returns a constructor.

    The options are checked right away (``cls._check_options``), so a wrong
    one fails where the wrapper is declared, not where it is first built.
    """

    def __call__(cls, module_constructor, *args, **options):
        cls._check_options(*args, **options)
        create = super().__call__

        def constructor(*init_args, **init_kwargs):
            return create(module_constructor, init_args, init_kwargs, *args, **options)

        functools.update_wrapper(constructor, module_constructor, updated=())
        return constructor

    def _check_options(cls, *args, **options) -> None:
        """Validates the options; a class may override it with a staticmethod."""


def _new_instance(cls: type[M], init: tp.Callable[..., None], args, kwargs) -> M:
    """Builds a ``cls`` with ``init`` (an undecorated ``__init__``)."""
    from nnx import dataclasses as nnx_dataclasses

    module = object.__new__(cls)
    _dict(module)[_MODULE_STATE] = ModuleState()
    init(module, *args, **kwargs)
    nnx_dataclasses.wrap_fields(module)
    return module


def _adopt(target: Module, source: Module) -> None:
    """Moves every attribute of ``source`` (built from pure state) onto ``target``."""
    attributes = _dict(target)
    for name, value in _dict(source).items():
        if name != _MODULE_STATE:
            attributes[name] = value


# Scan
# ------------------------------------------------------------------------------


def _check_scan_length(variable_axes: tp.Mapping[Filter, int], length: int | None) -> None:
    if variable_axes and length is None:
        raise ValueError(
            "Cannot use variable_axes without specifying a length: pass "
            "length=<number of layers> to nnx.Scan / nnx.scan."
        )


@dataclasses.dataclass(frozen=True)
class _ScanOptions:
    variable_axes: tp.Mapping[Filter, int]
    variable_broadcast: Filter
    variable_carry: Filter
    split_rngs: contextlib.RngFilter
    in_axes: tp.Any
    out_axes: tp.Any
    length: int | None
    reverse: bool
    unroll: int
    data_transform: tp.Callable[..., tp.Any] | None
    metadata_params: tp.Mapping[str, tp.Any]

    def __post_init__(self):
        _check_scan_length(self.variable_axes, self.length)

    @property
    def filters(self) -> tuple[Filter, ...]:
        """``(*variable_axes, broadcast, carry)``; ``...`` only in last place."""
        filters = (*self.variable_axes, self.variable_broadcast, self.variable_carry)
        return tuple(
            partitioning.Everything() if f is ... and i < len(filters) - 1 else f for i, f in enumerate(filters)
        )

    @property
    def axes(self) -> tuple[int, ...]:
        return tuple(self.variable_axes.values())


def _split_keys(pure_ctx, split_rngs, length):
    """Splits the streams chosen by ``split_rngs`` into ``length`` keys each."""
    keys, contextdef = pure_ctx
    predicate = contextlib.to_rng_predicate(split_rngs)
    split, broadcast = {}, {}
    for name, key in keys.items():
        if predicate(name):
            if length is None:
                raise ValueError(
                    f"Cannot split RNG stream {name!r} without a length: pass length= to nnx.Scan / nnx.scan."
                )
            split[name] = jax.random.split(key, length)
        else:
            broadcast[name] = key
    return split, broadcast, contextdef


def _scan_init(
    options: _ScanOptions,
    constructor: tp.Callable[..., M],
    args: tuple,
    kwargs: dict[str, tp.Any],
) -> M:
    """Builds ``length`` layers with ``constructor`` and stacks their state."""
    ctx = kwargs.pop("ctx", None)
    if ctx is not None and not isinstance(ctx, contextlib.Context):
        raise TypeError(f"Expected ctx to be a Context, got {type(ctx).__name__}")
    if ctx is not None:
        split, broadcast, contextdef = _split_keys(ctx.partition(), options.split_rngs, options.length)
    else:
        split, broadcast, contextdef = {}, {}, None
    moduledef: ModuleDef[M] | None = None

    def init_one(split_keys, broadcast_keys):
        nonlocal moduledef
        with tracers.nnx_trace():
            init_kwargs = dict(kwargs)
            if contextdef is not None:
                init_kwargs["ctx"] = contextdef.merge({**split_keys, **broadcast_keys})
            module = constructor(*args, **init_kwargs)
            states, moduledef = module.partition(*options.filters)
        return states

    if options.length is not None and (options.variable_axes or split):
        out_axes = (*options.axes, None, None)
        init_all = jax.vmap(init_one, in_axes=(0, None), out_axes=out_axes, axis_size=options.length)
        # Compiled as one program: run eagerly, every initializer op of the
        # vmapped constructor would be compiled on its own.
        states = jax.jit(init_all)(split, broadcast)
    else:
        states = init_one(split, broadcast)
    *axes_states, broadcast_state, carry_state = states
    if options.metadata_params:
        axes_states = [
            spmd.add_axis(state, axis, options.metadata_params) for state, axis in zip(axes_states, options.axes)
        ]
    assert moduledef is not None
    return moduledef.merge(*axes_states, broadcast_state, carry_state)


def _move_axes(tree: A, source: tp.Any, destination: bool) -> A:
    """``jnp.moveaxis`` every leaf between ``source`` (a tree prefix of ints) and 0."""

    def move(axis, subtree):
        if axis is None or axis == 0:
            return subtree
        if destination:
            return jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), subtree)
        return jax.tree.map(lambda x: jnp.moveaxis(x, axis, 0), subtree)

    if isinstance(source, int) or source is None:
        return move(source, tree)
    return jax.tree.map(move, source, tree, is_leaf=lambda x: x is None)


def _carry_and_xs(args: tuple) -> tuple[tp.Any, tp.Any, tuple]:
    if len(args) < 2:
        raise TypeError(
            "A scanned call takes (carry, xs, *broadcast_args): expected at "
            f"least 2 positional arguments, got {len(args)}. Pass None for a "
            "carry or xs you do not use."
        )
    return args[0], args[1], args[2:]


def _scan_apply(
    options: _ScanOptions,
    fun: tp.Callable[..., tuple[C, tp.Any]],
    module: Module,
    carry: C,
    xs: tp.Any,
    args: tuple,
    kwargs: dict[str, tp.Any],
) -> tuple[C, tp.Any]:
    """Runs ``fun(layer, carry, x, *args, **kwargs)`` over the stacked layers."""
    filters = options.filters
    (*axes_states, broadcast_state, carry_state), moduledef = module.partition(*filters)
    if options.metadata_params:
        axes_states = [
            spmd.remove_axis(state, axis, options.metadata_params) for state, axis in zip(axes_states, options.axes)
        ]
    axes_states = [_move_axes(state, axis, destination=False) for state, axis in zip(axes_states, options.axes)]
    xs = _move_axes(xs, options.in_axes, destination=False)

    lengths = {x.shape[0] for x in jax.tree.leaves((axes_states, xs))}
    if options.length is not None:
        lengths.add(options.length)
    if len(lengths) > 1:
        raise ValueError(
            f"Inconsistent scan lengths: the scanned states and inputs have leading axes of sizes {sorted(lengths)}."
        )
    if not lengths:
        raise ValueError(
            "Cannot infer the scan length (no scanned state or inputs): pass length= to nnx.Scan / nnx.scan."
        )
    length = lengths.pop()

    ctx = kwargs.pop("ctx", None)
    if ctx is not None:
        if not isinstance(ctx, contextlib.Context):
            raise TypeError(f"Expected ctx to be a Context, got {type(ctx).__name__}")
        split, broadcast_keys, contextdef = _split_keys(ctx.partition(), options.split_rngs, length)
    else:
        split, broadcast_keys, contextdef = {}, {}, None

    known_paths = set(broadcast_state) | set(carry_state)
    for state in axes_states:
        known_paths.update(state)

    def body(carry_in, x_in):
        carry_state, carry_arg = carry_in
        split_keys, axes_slices, x = x_in
        if options.data_transform is not None:
            axes_slices = options.data_transform(axes_slices)
        with tracers.nnx_trace():
            call_kwargs = dict(kwargs)
            if contextdef is not None:
                call_kwargs["ctx"] = contextdef.merge({**split_keys, **broadcast_keys})
            layer = moduledef.merge(*axes_slices, broadcast_state, carry_state)
            carry_out, y = fun(layer, carry_arg, x, *args, **call_kwargs)
            state = layer.get_state()
        # State created inside the body (e.g. sown intermediates, a new cache)
        # is not part of the carry: it comes out stacked, one entry per layer.
        new = State({p: v for p, v in state.items() if p not in known_paths})
        (*axes_out, _, carry_state_out) = (state - new).partition(*filters)
        return (carry_state_out, carry_out), (axes_out, new, y)

    (carry_state, carry_out), (axes_states, new_state, ys) = jax.lax.scan(
        body,
        (carry_state, carry),
        (split, axes_states, xs),
        length=length,
        reverse=options.reverse,
        unroll=options.unroll,
    )
    axes_states = [_move_axes(state, axis, destination=True) for state, axis in zip(axes_states, options.axes)]
    if options.metadata_params:
        axes_states = [
            spmd.add_axis(state, axis, options.metadata_params) for state, axis in zip(axes_states, options.axes)
        ]
    ys = _move_axes(ys, options.out_axes, destination=True)
    module.update_state((*axes_states, carry_state, new_state))
    return carry_out, ys


class Scan(Module, tp.Generic[M], metaclass=_LiftedMeta):
    """Stacks ``length`` copies of a layer and runs them with ``jax.lax.scan``.

    ``nnx.Scan(Block, **options)`` is a constructor: calling it with
    ``Block``'s arguments builds ``length`` Blocks (in ``jax.vmap``) and keeps
    their stacked state as one Block, ``scan_module``. Calling the Scan runs
    ``Block.__call__(carry, x, *broadcast)`` once per layer, threading
    ``carry`` and slicing ``xs`` (``None`` when there is nothing to slice)::

        class Block(nnx.Module):
          def __init__(self, d, *, ctx):
            self.linear = nnx.Linear(d, d, ctx=ctx)
          def __call__(self, x, _):
            return nnx.relu(self.linear(x)), None

        MLP = nnx.Scan(Block, variable_axes={nnx.Param: 0},
                       split_rngs='params', length=5)
        mlp = MLP(3, ctx=nnx.context(0))
        mlp.scan_module.linear.kernel.shape   # (5, 3, 3)
        y, _ = mlp(x, None)

    Options:
      variable_axes: ``{filter: axis}``; matching state is stacked along
        ``axis`` (each layer gets its own slice). Needs ``length``.
      variable_broadcast: filter of state shared by every layer, read-only.
      variable_carry: filter of state threaded from layer to layer (``...``,
        everything else, by default: e.g. BatchNorm statistics shared by all
        layers).
      split_rngs: RNG filter of the ``ctx`` streams split per layer (others
        give every layer the same key).
      in_axes / out_axes: scanned axis of ``xs`` / of the stacked outputs.
      length, reverse, unroll: as in ``jax.lax.scan``.
      data_transform: optional ``fn(axes_states) -> axes_states`` applied to
        each layer's slice of the stacked state inside the scan.
      metadata_params: ``{nnx.PARTITION_NAME: 'layers'}`` inserts ``'layers'``
        into each stacked Variable's ``sharding`` at the stacked axis (and
        removes it inside the scan).

    ``m.call.some_method(carry, xs, ...)`` scans another method. State created
    inside the scan (sown values, caches) is written back stacked.
    """

    def __init__(
        self,
        module_constructor: tp.Callable[..., M],
        module_init_args: tuple,
        module_init_kwargs: dict[str, tp.Any],
        *,
        variable_axes: tp.Mapping[Filter, int] = MappingProxyType({}),
        variable_broadcast: Filter = None,
        variable_carry: Filter = ...,
        split_rngs: contextlib.RngFilter = None,
        in_axes: tp.Any = 0,
        out_axes: tp.Any = 0,
        length: int | None = None,
        reverse: bool = False,
        unroll: int = 1,
        data_transform: tp.Callable[..., tp.Any] | None = None,
        metadata_params: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    ):
        self.module_constructor = module_constructor
        self.options = _ScanOptions(
            variable_axes=MappingProxyType(dict(variable_axes)),
            variable_broadcast=variable_broadcast,
            variable_carry=variable_carry,
            split_rngs=split_rngs,
            in_axes=in_axes,
            out_axes=out_axes,
            length=length,
            reverse=reverse,
            unroll=unroll,
            data_transform=data_transform,
            metadata_params=MappingProxyType(dict(metadata_params)),
        )
        self.scan_module = _scan_init(self.options, module_constructor, module_init_args, dict(module_init_kwargs))

    @staticmethod
    def _check_options(
        *,
        variable_axes: tp.Mapping[Filter, int] = MappingProxyType({}),
        length: int | None = None,
        **options: tp.Any,
    ) -> None:
        _check_scan_length(variable_axes, length)

    def __call__(self, *args, **kwargs) -> tuple[C, tp.Any]:
        return self.call(*args, **kwargs)

    @property
    def call(self) -> M:
        """Scans any method of the layer: ``m.call.decode(carry, xs, ...)``."""

        def run(accessor, *args, **kwargs):
            carry, xs, args = _carry_and_xs(args)
            return _scan_apply(
                self.options,
                lambda layer, *a, **k: accessor(layer)(*a, **k),
                self.scan_module,
                carry,
                xs,
                args,
                kwargs,
            )

        return _CallProxy(run)  # type: ignore[return-value]


def scan(
    f: F | None = None,
    *,
    variable_axes: tp.Mapping[Filter, int] = MappingProxyType({}),
    variable_broadcast: Filter = None,
    variable_carry: Filter = ...,
    split_rngs: contextlib.RngFilter = None,
    in_axes: tp.Any = 0,
    out_axes: tp.Any = 0,
    length: int | None = None,
    reverse: bool = False,
    unroll: int = 1,
    data_transform: tp.Callable[..., tp.Any] | None = None,
    metadata_params: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    is_init: bool | None = None,
) -> F:
    """Decorator form of :class:`Scan`, for a Module's methods.

    On ``__init__`` it builds ``length`` stacked layers in place; on any other
    method ``(self, carry, xs, *args)`` it scans that method over them::

        class Block(nnx.Module):
          @functools.partial(nnx.scan, variable_axes={nnx.Param: 0},
                             split_rngs='params', length=5)
          def __init__(self, *, ctx):
            self.linear = nnx.Linear(3, 3, ctx=ctx)

          @functools.partial(nnx.scan, variable_axes={nnx.Param: 0}, length=5)
          def __call__(self, x, _):
            return self.linear(x), None

    Options are those of :class:`Scan`; ``is_init`` overrides the detection of
    ``__init__`` by name.
    """
    options = dict(
        variable_axes=variable_axes,
        variable_broadcast=variable_broadcast,
        variable_carry=variable_carry,
        split_rngs=split_rngs,
        in_axes=in_axes,
        out_axes=out_axes,
        length=length,
        reverse=reverse,
        unroll=unroll,
        data_transform=data_transform,
        metadata_params=metadata_params,
    )
    if f is None:
        return functools.partial(scan, is_init=is_init, **options)  # type: ignore
    scan_options = _ScanOptions(
        **{
            **options,
            "variable_axes": MappingProxyType(dict(variable_axes)),
            "metadata_params": MappingProxyType(dict(metadata_params)),
        }
    )
    if is_init is None:
        is_init = f.__name__ == "__init__"

    if is_init:

        @functools.wraps(f)
        def init_wrapper(self: Module, *args, **kwargs):
            cls = type(self)
            stacked = _scan_init(
                scan_options,
                lambda *a, **k: _new_instance(cls, f, a, k),
                args,
                dict(kwargs),
            )
            _adopt(self, stacked)

        return init_wrapper  # type: ignore[return-value]

    @functools.wraps(f)
    def apply_wrapper(self: Module, *args, **kwargs):
        carry, xs, args = _carry_and_xs(args)
        return _scan_apply(scan_options, f, self, carry, xs, args, dict(kwargs))

    return apply_wrapper  # type: ignore[return-value]


# Remat
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _RematOptions:
    prevent_cse: bool
    static_argnums: tuple[int, ...]
    policy: tp.Callable[..., bool] | None


def _as_argnums(argnums: int | tp.Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _all_arrays(tree: tp.Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def _remat_apply(
    options: _RematOptions,
    fun: tp.Callable[..., tp.Any],
    module: Module,
    args: tuple,
    kwargs: dict[str, tp.Any],
) -> tp.Any:
    """Runs ``fun(module, *args, **kwargs)`` under ``jax.checkpoint``."""
    state, moduledef = module.partition()
    kwargs = _partition_ctx(kwargs)
    # Keyword arguments holding arrays (a Context's keys) are traced; others
    # (flags such as train=True) stay Python values, as in a direct call.
    traced = {k: v for k, v in kwargs.items() if _all_arrays(v)}
    untraced = {k: v for k, v in kwargs.items() if k not in traced}

    def pure(state: State, traced: dict[str, tp.Any], *args):
        with tracers.nnx_trace():
            inner = moduledef.merge(state)
            out = fun(inner, *args, **_merge_ctx({**untraced, **traced}))
            return inner.get_state(), out

    # Argument 0 is the state, 1 the keyword arguments: shift user indices by 2.
    static = tuple(i + 2 for i in options.static_argnums)
    state, out = jax.checkpoint(
        pure,
        prevent_cse=options.prevent_cse,
        static_argnums=static,
        policy=options.policy,
    )(state, traced, *args)
    module.update_state(state)
    return out


class Remat(Module, tp.Generic[M], metaclass=_LiftedMeta):
    """A layer whose calls are rematerialised (``jax.checkpoint``).

    ``nnx.Remat(Block, **options)`` is a constructor; the built module holds
    the layer as ``remat_module``, and calling it (or ``m.call.method(...)``)
    recomputes the layer's activations in the backward pass instead of
    storing them. State changes are written back. Composes with Scan:
    ``nnx.Scan(nnx.Remat(Block), variable_axes={nnx.Param: 0}, length=8)``.

    Options: ``prevent_cse``, ``static_argnums`` (indices into the call's
    positional arguments) and ``policy``, as in ``jax.checkpoint``.
    """

    def __init__(
        self,
        module_constructor: tp.Callable[..., M],
        module_init_args: tuple,
        module_init_kwargs: dict[str, tp.Any],
        *,
        prevent_cse: bool = True,
        static_argnums: int | tp.Sequence[int] = (),
        policy: tp.Callable[..., bool] | None = None,
    ):
        self.module_constructor = module_constructor
        self.options = _RematOptions(prevent_cse, _as_argnums(static_argnums), policy)
        self.remat_module = module_constructor(*module_init_args, **module_init_kwargs)

    def __call__(self, *args, **kwargs) -> tp.Any:
        return self.call(*args, **kwargs)

    @property
    def call(self) -> M:
        """Rematerialises any method of the layer: ``m.call.encode(x)``."""

        def run(accessor, *args, **kwargs):
            return _remat_apply(
                self.options,
                lambda layer, *a, **k: accessor(layer)(*a, **k),
                self.remat_module,
                args,
                kwargs,
            )

        return _CallProxy(run)  # type: ignore[return-value]


def remat(
    f: F | None = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | tp.Sequence[int] = (),
    policy: tp.Callable[..., bool] | None = None,
    is_init: bool | None = None,
) -> F:
    """Decorator form of :class:`Remat` for a Module's methods.

    ``@nnx.remat`` on a method rematerialises its calls; on ``__init__`` it
    changes nothing (so it stacks under ``@nnx.scan`` on both methods).
    ``static_argnums`` index the method's arguments after ``self``.
    """
    if f is None:
        return functools.partial(  # type: ignore[return-value]
            remat,
            prevent_cse=prevent_cse,
            static_argnums=static_argnums,
            policy=policy,
            is_init=is_init,
        )
    if is_init is None:
        is_init = f.__name__ == "__init__"
    if is_init:
        return f
    options = _RematOptions(prevent_cse, _as_argnums(static_argnums), policy)

    @functools.wraps(f)
    def wrapper(self: Module, *args, **kwargs):
        return _remat_apply(options, f, self, args, kwargs)

    return wrapper  # type: ignore[return-value]
