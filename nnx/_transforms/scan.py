"""``nnx.Scan`` / ``nnx.scan``: ``jax.lax.scan`` over stacked layers.

Building: ``length`` copies of a layer are created in one ``jax.vmap`` and
their state is stacked along ``variable_axes``. Calling: ``jax.lax.scan``
slices the stacked state (and ``xs``), rebuilds one layer per step, threads
the carry and stacks what comes out.
"""

import dataclasses
import functools
import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp

from nnx import containers, contextlib, partitioning, spmd, tracers
from nnx._transforms.wrapper import LiftedModule, adopt, decorates_init
from nnx.module import Module, ModuleDef, _construct
from nnx.state import State

A = tp.TypeVar("A")
C = tp.TypeVar("C")
F = tp.TypeVar("F", bound=tp.Callable[..., tp.Any])
M = tp.TypeVar("M", bound=Module)
Filter = partitioning.Filter


def _check_scan_length(variable_axes: tp.Mapping[Filter, int], length: int | None) -> None:
    if variable_axes and length is None:
        raise ValueError(
            "Cannot use variable_axes without specifying a length: pass "
            "length=<number of layers> to nnx.Scan / nnx.scan."
        )


@dataclasses.dataclass(frozen=True)
class _ScanOptions:
    """The options of :class:`Scan` (see there); mappings are frozen copies."""

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
        object.__setattr__(self, "variable_axes", MappingProxyType(dict(self.variable_axes)))
        object.__setattr__(self, "metadata_params", MappingProxyType(dict(self.metadata_params)))
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


class _LayerKeys(tp.NamedTuple):
    """A ``ctx=`` Context split for the layers: ``split`` keys are stacked, one per layer."""

    split: dict[str, jax.Array]
    broadcast: dict[str, jax.Array]
    contextdef: contextlib.ContextDef | None


def _pop_ctx(kwargs: dict[str, tp.Any], split_rngs: contextlib.RngFilter, length: int | None) -> _LayerKeys:
    """Removes ``ctx`` from ``kwargs`` and splits the streams ``split_rngs`` chooses into ``length`` keys."""
    ctx = kwargs.pop("ctx", None)
    if ctx is None:
        return _LayerKeys({}, {}, None)
    if not isinstance(ctx, contextlib.Context):
        raise TypeError(f"Expected ctx to be a Context, got {type(ctx).__name__}")
    keys, contextdef = ctx.partition()
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
    return _LayerKeys(split, broadcast, contextdef)


def _with_ctx(kwargs: dict[str, tp.Any], contextdef: contextlib.ContextDef | None, keys: dict) -> dict[str, tp.Any]:
    """``kwargs`` plus ``ctx=`` rebuilt, inside the transform, from one layer's ``keys``."""
    if contextdef is None:
        return kwargs
    return {**kwargs, "ctx": contextdef.merge(keys)}


def _scan_init(
    options: _ScanOptions,
    constructor: tp.Callable[..., M],
    args: tuple,
    kwargs: dict[str, tp.Any],
) -> M:
    """Builds ``length`` layers with ``constructor`` and stacks their state."""
    keys = _pop_ctx(kwargs, options.split_rngs, options.length)
    moduledef: ModuleDef[M] | None = None

    def init_one(split_keys, broadcast_keys):
        nonlocal moduledef
        with tracers.nnx_trace():
            module = constructor(*args, **_with_ctx(kwargs, keys.contextdef, {**split_keys, **broadcast_keys}))
            states, moduledef = _partition(module, options.filters)
        return states

    if options.length is not None and (options.variable_axes or keys.split):
        out_axes = (*options.axes, None, None)
        init_all = jax.vmap(init_one, in_axes=(0, None), out_axes=out_axes, axis_size=options.length)
        # Compiled as one program: run eagerly, every initializer op of the
        # vmapped constructor would be compiled on its own.
        states = jax.jit(init_all)(keys.split, keys.broadcast)
    else:
        states = init_one(keys.split, keys.broadcast)
    *axes_states, broadcast_state, carry_state = states
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


def _partition(module: Module, filters: tuple) -> tuple[tuple[State, ...], ModuleDef]:
    """``module.partition(*filters)``, where a remainder is said in the Scan's terms (its three options)."""
    try:
        return module.partition(*filters)
    except ValueError as e:
        if not str(e).startswith("Non-exhaustive filters"):
            raise
        (*_, rest), _ = module.partition(*filters, ...)  # what no filter matched: the rest, not parsed from e
        raise ValueError(
            f"Non-exhaustive filters, got a non-empty remainder: {list(rest)}. nnx.Scan's variable_axes, "
            "variable_broadcast and variable_carry match none of it: name it in one of them (variable_carry=..., "
            "the default, carries everything the others do not name)"
        ) from None


def _stored(node: tp.Any) -> tp.Any:
    return vars(node)["value"] if isinstance(node, containers.Container) else node


def _check_unchanged(before: State, after: State) -> None:
    """Raises ``ValueError`` when a scanned call assigned new values to ``variable_broadcast`` state."""
    changed = [path for path, node in after.items() if _stored(node) is not _stored(before[path])]
    if changed:
        raise ValueError(
            f"nnx.Scan: {changed} is variable_broadcast state, which every layer reads and none may change, and the "
            "scanned call assigned to it. Name it in variable_carry to thread it from layer to layer, or in "
            "variable_axes to give each layer its own"
        )


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
    filters, axes = options.filters, options.axes
    # Intermediates an earlier call sowed came out stacked, one entry per layer (see `body`), and are scanned so
    # again: in the carry a sow would lengthen them at each layer (which lax.scan refuses), and filters that name
    # what is carried do not cover them. Unless variable_carry names them.
    rest = () if options.variable_carry is ... else (...,)  # what no filter names, when the carry is named
    states, moduledef = module.partition(*filters, *rest)
    unnamed = states[-1]  # the carry, or the rest
    sown = frozenset(path for path, value in unnamed.items() if isinstance(value, containers.Intermediate))
    if sown:
        filters, axes = (lambda path, _: path in sown, *filters), (0, *axes)
    if sown or (rest and len(unnamed)):  # partitioned again: with the sown ones scanned, or to refuse the rest
        states, moduledef = _partition(module, filters)
    (*axes_states, broadcast_state, carry_state) = states[: len(filters)]
    axes_states = [
        _move_axes(spmd.remove_axis(state, axis, options.metadata_params), axis, destination=False)
        for state, axis in zip(axes_states, axes)
    ]
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

    keys = _pop_ctx(kwargs, options.split_rngs, length)

    known_paths = set(broadcast_state) | set(carry_state)
    for state in axes_states:
        known_paths.update(state)

    def body(carry_in, x_in):
        carry_state, carry_arg = carry_in
        split_keys, axes_slices, x = x_in
        if options.data_transform is not None:
            axes_slices = options.data_transform(axes_slices)
        with tracers.nnx_trace():
            layer = moduledef.merge(*axes_slices, broadcast_state, carry_state)
            carry_out, y = fun(
                layer, carry_arg, x, *args, **_with_ctx(kwargs, keys.contextdef, {**split_keys, **keys.broadcast})
            )
            state = layer.get_state()
        # State created inside the body (e.g. sown intermediates, a new cache)
        # is not part of the carry: it comes out stacked, one entry per layer.
        new = State({p: v for p, v in state.items() if p not in known_paths})
        (*axes_out, broadcast_out, carry_state_out) = (state - new).partition(*filters)
        _check_unchanged(broadcast_state, broadcast_out)
        return (carry_state_out, carry_out), (axes_out, new, y)

    (carry_state, carry_out), (axes_states, new_state, ys) = jax.lax.scan(
        body,
        (carry_state, carry),
        (keys.split, axes_states, xs),
        length=length,
        reverse=options.reverse,
        unroll=options.unroll,
    )
    axes_states = [
        spmd.add_axis(_move_axes(state, axis, destination=True), axis, options.metadata_params)
        for state, axis in zip(axes_states, axes)
    ]
    ys = _move_axes(ys, options.out_axes, destination=True)
    module.update_state((*axes_states, carry_state, new_state))
    return carry_out, ys


class Scan(LiftedModule[M]):
    """Stacks ``length`` copies of a layer and runs them with ``jax.lax.scan``.

    ``nnx.Scan(Block, **options)`` is a constructor: calling it with
    ``Block``'s arguments builds ``length`` Blocks (in ``jax.vmap``) and keeps
    their stacked state as one Block, ``scan_module``. Calling the Scan runs
    ``Block.__call__(carry, x, *broadcast)`` once per layer, threading
    ``carry`` and slicing ``xs`` (``None`` when there is nothing to slice)::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> class Block(nnx.Module):
        ...   def __init__(self, d, *, ctx):
        ...     self.linear = nnx.Linear(d, d, ctx=ctx)
        ...   def __call__(self, x, _):
        ...     return nnx.relu(self.linear(x)), None
        >>> MLP = nnx.Scan(Block, variable_axes={nnx.Param: 0},
        ...                split_rngs='params', length=5)
        >>> mlp = MLP(3, ctx=nnx.context(0))
        >>> mlp.scan_module.linear.kernel.shape  # five layers' kernels, stacked
        (5, 3, 3)
        >>> y, _ = mlp(jnp.ones((2, 3)), None)
        >>> y.shape
        (2, 3)

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
        self.scan_module = _scan_init(self.options, module_constructor, module_init_args, dict(module_init_kwargs))

    @staticmethod
    def _check_options(
        *,
        variable_axes: tp.Mapping[Filter, int] = MappingProxyType({}),
        length: int | None = None,
        **options: tp.Any,
    ) -> None:
        _check_scan_length(variable_axes, length)

    def _run(self, fun: tp.Callable[..., tp.Any], args: tuple, kwargs: dict[str, tp.Any]) -> tuple[C, tp.Any]:
        carry, xs, args = _carry_and_xs(args)
        return _scan_apply(self.options, fun, self.scan_module, carry, xs, args, kwargs)


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

        >>> import functools
        >>> import jax.numpy as jnp
        >>> import nnx
        >>> class Block(nnx.Module):
        ...   @functools.partial(nnx.scan, variable_axes={nnx.Param: 0},
        ...                      split_rngs='params', length=5)
        ...   def __init__(self, *, ctx):
        ...     self.linear = nnx.Linear(3, 3, ctx=ctx)
        ...
        ...   @functools.partial(nnx.scan, variable_axes={nnx.Param: 0}, length=5)
        ...   def __call__(self, x, _):
        ...     return self.linear(x), None
        >>> block = Block(ctx=nnx.context(0))
        >>> block.linear.kernel.shape, block(jnp.ones((2, 3)), None)[0].shape
        ((5, 3, 3), (2, 3))

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
    scan_options = _ScanOptions(**options)

    if decorates_init(f, is_init):

        @functools.wraps(f)
        def init_wrapper(self: Module, *args, **kwargs):
            cls = type(self)
            stacked = _scan_init(scan_options, lambda *a, **k: _construct(cls, a, k, init=f), args, dict(kwargs))
            adopt(self, stacked)

        return init_wrapper  # type: ignore[return-value]

    @functools.wraps(f)
    def apply_wrapper(self: Module, *args, **kwargs):
        carry, xs, args = _carry_and_xs(args)
        return _scan_apply(scan_options, f, self, carry, xs, args, dict(kwargs))

    return apply_wrapper  # type: ignore[return-value]
