"""Logical-axis sharding: name array axes, map the names onto a device mesh.

Parameters are annotated with *logical* axis names (``('embed', 'mlp')``)
that say what each axis means; a separate, swappable list of *rules* says
which mesh axis each logical name is sharded over (here over every device
there is, one or many)::

    >>> import jax
    >>> import nnx
    >>> init = nnx.with_logical_partitioning(nnx.initializers.lecun_normal(),
    ...                                      ('embed', 'mlp'))
    >>> rules = [('batch', 'data'), ('embed', None), ('mlp', 'model')]
    >>> mesh = jax.make_mesh((1, jax.device_count()), ('data', 'model'))
    >>> @jax.jit
    ... def create():
    ...   return nnx.Linear(16, 32, kernel_init=init, ctx=nnx.context(0)).partition()
    >>> with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ...   state, moduledef = create()
    >>> state['kernel'].value.sharding.spec
    P(None, 'model')

Both of JAX's mesh contexts are understood: ``with jax.set_mesh(mesh):`` and
the legacy ``with mesh:``. With no mesh or no rules active every constraint
here is a no-op, so annotated models run unchanged on one device.

To lay out a whole training state (``jax.jit``'s ``in_shardings`` /
``out_shardings``)::

    >>> logical = nnx.get_partition_spec(state)
    >>> logical['kernel']
    P('embed', 'mlp')
    >>> nnx.spmd.logical_to_mesh_sharding(logical, mesh, rules)['kernel'].spec
    P(None, 'model')
"""

import contextlib
import dataclasses
import enum
import threading
import typing as tp

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx import containers

PARTITION_NAME = "partition_name"
"""Key of ``metadata_params`` (``nnx.Scan``) naming the scanned axis."""

LogicalName = tp.Optional[str]  # noqa: UP045 (a runtime alias)
LogicalNames = tp.Sequence[LogicalName]
MeshAxes = tp.Union[None, str, tuple[str, ...]]  # noqa: UP007 (a runtime alias)
LogicalRules = tp.Sequence[tuple[str, MeshAxes]]
A = tp.TypeVar("A")
F = tp.TypeVar("F", bound=tp.Callable[..., tp.Any])


# Rules
# ------------------------------------------------------------------------------


class _RulesState(threading.local):
    def __init__(self):
        self.rules: tuple[tuple[str, MeshAxes], ...] = ()


_rules_state = _RulesState()


def _freeze_rules(rules: LogicalRules | None) -> tuple:
    if rules is None:
        return ()
    if isinstance(rules, (str, tp.Mapping)) or not isinstance(rules, tp.Iterable):
        raise TypeError(
            "Logical axis rules must be a sequence of (logical_name, mesh_axes) "
            f"pairs, got {type(rules).__name__}: {rules!r}"
        )
    frozen = []
    for rule in rules:
        if not isinstance(rule, (tuple, list)) or len(rule) != 2:
            raise ValueError(f"Each logical axis rule must be a (logical_name, mesh_axes) pair, got {rule!r}")
        name, axes = rule
        if isinstance(axes, list):
            axes = tuple(axes)
        frozen.append((name, axes))
    return tuple(frozen)


def get_logical_axis_rules() -> tuple[tuple[str, MeshAxes], ...]:
    """The rules set by the innermost :func:`logical_axis_rules` block."""
    return _rules_state.rules


@contextlib.contextmanager
def logical_axis_rules(rules: LogicalRules) -> tp.Iterator[None]:
    """Sets the logical-to-mesh axis rules for this thread inside the block.

    ``rules`` is a sequence of ``(logical_name, mesh_axes)`` pairs in priority
    order; ``mesh_axes`` is a mesh axis name, a tuple of them, or ``None``
    (replicated)::

        >>> import nnx
        >>> with nnx.logical_axis_rules([('batch', 'data'), ('mlp', 'model')]):
        ...   nnx.spmd.logical_to_mesh_axes(('batch', 'embed', 'mlp'))
        P('data', None, 'model')
    """
    previous = _rules_state.rules
    _rules_state.rules = _freeze_rules(rules)
    try:
        yield
    finally:
        _rules_state.rules = previous


def _resolve_rules(rules: LogicalRules | None) -> tuple:
    return _rules_state.rules if rules is None else _freeze_rules(rules)


# Logical names -> mesh axes
# ------------------------------------------------------------------------------


class _Unassigned:
    """A logical name that no rule has mapped (yet)."""

    def __repr__(self):
        return "UNASSIGNED"


_UNASSIGNED = _Unassigned()


def _as_axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _assign_axes(names: LogicalNames, rules: tuple) -> list[tp.Any]:
    """Maps each logical name to mesh axes; unmatched names stay _UNASSIGNED."""
    present = [name for name in names if isinstance(name, str)]
    duplicates = sorted({name for name in present if present.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"Logical axis names {duplicates} occur more than once in {tuple(names)}; "
            "each array axis needs its own logical name."
        )
    result: list[tp.Any] = [_UNASSIGNED if isinstance(name, str) else name for name in names]
    used: set[str] = set()
    for name in names:
        if name is not None and not isinstance(name, str):
            used.update(_as_axes_tuple(name))  # already a mesh axis or UNCONSTRAINED
    for logical, axes in rules:
        if logical not in present:
            continue
        position = list(names).index(logical)
        if result[position] is not _UNASSIGNED:
            continue
        wanted = _as_axes_tuple(axes)
        if used.intersection(wanted):  # a mesh axis shards one array axis at most
            continue
        result[position] = axes
        used.update(wanted)
    return result


def logical_to_mesh_axes(names: LogicalNames | None, rules: LogicalRules | None = None) -> PartitionSpec | None:
    """The mesh ``PartitionSpec`` for one array's logical axis names.

    Rules are tried in order; a rule applies when its logical name is one of
    ``names`` and its mesh axes are not used yet by this array. Names that no
    rule maps become ``None`` (not sharded)::

        >>> import nnx
        >>> nnx.spmd.logical_to_mesh_axes(('batch', 'embed'), [('batch', 'data')])
        P('data', None)
        >>> nnx.spmd.logical_to_mesh_axes(('rows', 'cols'), [('rows', 'data'), ('cols', 'data')])
        P('data', None)

    ``rules`` defaults to the ones set with :func:`logical_axis_rules`.
    """
    if names is None:
        return None
    assigned = _assign_axes(tuple(names), _resolve_rules(rules))
    return PartitionSpec(*(None if a is _UNASSIGNED else a for a in assigned))


def _is_logical_spec(x: tp.Any) -> bool:
    return isinstance(x, PartitionSpec) or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


def logical_to_mesh(tree: A, rules: LogicalRules | None = None) -> A:
    """Maps every logical ``PartitionSpec`` in ``tree`` to a mesh one.

    Usually applied to the result of :func:`get_partition_spec`::

        >>> import nnx
        >>> init = nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=('row', 'col'))
        >>> state = nnx.Linear(2, 3, kernel_init=init, ctx=nnx.context(0)).get_state()
        >>> with nnx.logical_axis_rules([('row', 'model'), ('col', 'data')]):
        ...   mesh_spec = nnx.logical_to_mesh(nnx.get_partition_spec(state))
        >>> mesh_spec['kernel'], mesh_spec['bias']
        (P('model', 'data'), P())
    """
    frozen = _resolve_rules(rules)
    return jax.tree.map(
        lambda spec: logical_to_mesh_axes(spec, frozen),
        tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def logical_to_mesh_sharding(tree: A, mesh: Mesh, rules: LogicalRules | None = None) -> A:
    """Like :func:`logical_to_mesh`, but gives ``NamedSharding``s on ``mesh``."""
    frozen = _resolve_rules(rules)
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_mesh_axes(spec, frozen)),
        tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def get_partition_spec(tree: A) -> A:
    """The logical ``PartitionSpec`` of every node in ``tree``.

    Nodes with a ``sharding`` (e.g. Params made with
    :func:`with_logical_partitioning`) give ``PartitionSpec(*sharding)``; every
    other leaf (plain arrays, optimizer counters) gives ``PartitionSpec()``.
    Works on any pytree holding nodes: a ``State``, a ``Pure``, a
    ``TrainState``, optimizer states::

        >>> import optax
        >>> import nnx
        >>> init = nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=('row', 'col'))
        >>> params, moduledef = nnx.Linear(2, 3, kernel_init=init, ctx=nnx.context(0)).partition(nnx.Param)
        >>> train_state = nnx.TrainState(moduledef, params=params, tx=optax.adam(1e-3))
        >>> spec = nnx.get_partition_spec(train_state)
        >>> spec.params['kernel'], spec.opt_state[0].mu['kernel']
        (P('row', 'col'), P('row', 'col'))
    """

    def spec_of(x: tp.Any) -> PartitionSpec:
        if isinstance(x, containers.Node):
            sharding = vars(x).get("sharding")
            if sharding is not None:
                return PartitionSpec(*sharding)
        return PartitionSpec()

    return jax.tree.map(spec_of, tree, is_leaf=lambda x: isinstance(x, containers.Node))


# Constraints
# ------------------------------------------------------------------------------


class RulesFallback(enum.Enum):
    """What :func:`with_logical_constraint` does with a name no rule maps."""

    AXIS_IS_UNSHARDED = "axis_is_unsharded"
    RAISE_ERROR = "raise_error"
    NO_CONSTRAINT = "no_constraint"


def _legacy_mesh() -> Mesh | None:
    """The mesh of a ``with mesh:`` block (JAX's older resource env), if any."""
    try:
        from jax._src import mesh as mesh_lib
    except ImportError:  # pragma: no cover - internals moved
        return None
    env = getattr(mesh_lib, "thread_resources", None)
    physical = getattr(getattr(env, "env", None), "physical_mesh", None)
    if physical is None or physical.empty:
        return None
    return physical


def platform() -> str:
    """The platform (``'cpu'``, ``'gpu'``, ``'tpu'``) that computations are placed on now: the default device's
    under ``jax.default_device``, else the default backend's.

    For choices that depend on the backend a program is compiled for (XLA's CPU and GPU lower the same program
    differently). ``jax.default_backend()`` ignores ``jax.default_device``: on a GPU machine it names the GPU
    inside ``with jax.default_device(jax.devices("cpu")[0]):`` too, where the programs compile for the CPU::

      >>> import jax
      >>> import nnx
      >>> with jax.default_device(jax.devices("cpu")[0]):
      ...   nnx.spmd.platform()  # wherever it runs
      'cpu'
    """
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def current_mesh() -> tp.Any:
    """The active mesh: ``jax.set_mesh``'s, else ``with mesh:``'s, else None.

    Inside ``jax.jit`` under ``jax.set_mesh`` this is the abstract mesh; outside it, the concrete one (eager
    arrays cannot be constrained to an abstract mesh's sharding).
    """
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return _concrete_mesh(abstract) or abstract
    return _legacy_mesh()


def _concrete_mesh(abstract: tp.Any) -> tp.Any:
    """``jax.set_mesh``'s concrete mesh outside ``jax.jit`` (None inside one, or where JAX has no ``get_mesh``)."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    if get_mesh is None:
        return None
    try:
        mesh = get_mesh()
    except ValueError:  # inside jax.jit: only the abstract mesh is known there
        return None
    return mesh if mesh is not None and not mesh.empty and mesh.axis_names == abstract.axis_names else None


def _constrain(x: tp.Any, spec: PartitionSpec, mesh: tp.Any) -> tp.Any:
    axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
    used = [
        axis
        for entry in spec
        if entry is not None and entry is not PartitionSpec.UNCONSTRAINED
        for axis in _as_axes_tuple(entry)
    ]
    missing = [a for a in used if a not in axis_types]
    if missing:
        raise ValueError(
            f"Cannot constrain an array to {spec}: the mesh has no axis {missing[0]!r} (its axes: "
            f"{', '.join(map(repr, mesh.axis_names))}); map the logical axis to one of them, or to None, in the rules."
        )
    explicit = [a for a in used if axis_types[a] == jax.sharding.AxisType.Explicit]
    sharding = NamedSharding(mesh, spec)
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    if len(explicit) == len(used):
        return jax.sharding.reshard(x, sharding)
    raise ValueError(
        f"Cannot constrain an array to {spec}: it mixes Explicit mesh axes "
        f"{explicit} with non-Explicit ones {sorted(set(used) - set(explicit))}. "
        "Use a mesh whose axes have one type (jax.make_mesh(..., axis_types=...))."
    )


def with_logical_constraint(
    x: A,
    logical_spec: tp.Any,
    rules: LogicalRules | None = None,
    mesh: Mesh | None = None,
    fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
) -> A:
    """``jax.lax.with_sharding_constraint`` with logical axis names.

    ``logical_spec`` is one logical spec (a ``PartitionSpec`` or tuple of
    names) for every leaf of ``x``, or a pytree of them matching ``x``. A no-op
    when no rules or no mesh are active, so layers can call it
    unconditionally::

        >>> import jax, jax.numpy as jnp
        >>> import nnx
        >>> h = jnp.ones((8, 4, 16))  # (batch, length, embed)
        >>> nnx.with_logical_constraint(h, ('batch', 'length', 'embed')) is h  # no rules: a no-op
        True
        >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
        >>> @jax.jit
        ... def layer(h):
        ...   return nnx.with_logical_constraint(h * 2, ('batch', 'length', 'embed'))
        >>> with jax.set_mesh(mesh), nnx.logical_axis_rules([('batch', 'data')]):
        ...   layer(h).sharding.spec
        P('data', None, None)

    ``fallback`` decides what a logical name with no rule means: not sharded
    (default), an error, or no constraint at all for that array. Axes of an
    ``Explicit`` mesh are resharded with ``jax.sharding.reshard``.
    """
    frozen = _resolve_rules(rules)
    if not frozen or logical_spec is None:
        return x
    if mesh is None:
        mesh = current_mesh()
    if mesh is None or mesh.empty:
        return x
    fallback = RulesFallback(fallback)

    def constrain_one(names: tp.Any, leaf: tp.Any) -> tp.Any:
        if names is None:
            return leaf
        assigned = _assign_axes(tuple(names), frozen)
        if any(a is _UNASSIGNED for a in assigned):
            if fallback is RulesFallback.RAISE_ERROR:
                missing = [n for n, a in zip(names, assigned) if a is _UNASSIGNED]
                raise ValueError(
                    f"Logical axis names {missing} of {tuple(names)} have no rule in "
                    f"{list(frozen)}; add a rule for them or use another fallback."
                )
            if fallback is RulesFallback.NO_CONSTRAINT:
                return leaf
        spec = PartitionSpec(*(None if a is _UNASSIGNED else a for a in assigned))
        return _constrain(leaf, spec, mesh)

    if _is_logical_spec(logical_spec):
        return jax.tree.map(lambda leaf: constrain_one(logical_spec, leaf), x)
    return jax.tree.map(constrain_one, logical_spec, x, is_leaf=lambda s: s is None or _is_logical_spec(s))


@dataclasses.dataclass(frozen=True)
class _LogicalUnbox:
    """The ``unbox_fn`` of logically partitioned containers.

    Equal by value (and hashable) so that containers carrying it still compare
    equal across calls and ``jax.jit`` keeps its cache.
    """

    mesh: Mesh | None = None
    rules: tuple | None = None

    def __call__(self, container: containers.Container[A]) -> A:
        sharding = vars(container).get("sharding")
        if sharding is None:
            return container.value
        return with_logical_constraint(container.value, sharding, rules=self.rules, mesh=self.mesh)


def with_logical_partitioning(
    initializer: F,
    sharding: LogicalNames,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    **metadata: tp.Any,
) -> F:
    """Wraps ``initializer`` so its result is laid out by logical axis names.

    The wrapped initializer returns a ``ContainerMetadata`` carrying
    ``sharding`` (and ``metadata``), so the container it is put in (``Param``)
    records the names. When a mesh and rules are active the value is
    constrained to its mesh sharding as it is created, and again each time a
    Module attribute holding it is read::

        >>> import nnx
        >>> kernel_init = nnx.with_logical_partitioning(
        ...     nnx.initializers.lecun_normal(), ('embed', 'mlp'))
        >>> layer = nnx.Linear(16, 32, kernel_init=kernel_init, ctx=nnx.context(0))
        >>> layer.get_state()['kernel'].sharding
        ('embed', 'mlp')

    ``mesh`` and ``rules`` override the active mesh and rules.
    """
    names = tuple(sharding)
    frozen_rules = None if rules is None else _freeze_rules(rules)
    unbox_fn = _LogicalUnbox(mesh, frozen_rules)

    def wrapper(*args, **kwargs):
        value = initializer(*args, **kwargs)
        value = with_logical_constraint(value, names, rules=frozen_rules, mesh=mesh)
        return containers.ContainerMetadata(value, {"sharding": names, "unbox_fn": unbox_fn, **metadata})

    wrapper.__name__ = getattr(initializer, "__name__", "initializer")
    wrapper.__doc__ = getattr(initializer, "__doc__", None)
    return wrapper  # type: ignore[return-value]


# Scanned axes (used by nnx.Scan's metadata_params)
# ------------------------------------------------------------------------------


def _partition_name(params: tp.Mapping[str, tp.Any]) -> str:
    if PARTITION_NAME not in params:
        raise ValueError(
            "Scanning Variables that have a sharding needs the name of the new "
            f'axis: pass metadata_params={{nnx.PARTITION_NAME: "layers"}}, '
            f"got metadata_params={dict(params)!r}"
        )
    return params[PARTITION_NAME]


def _map_shardings(tree: A, fn: tp.Callable[[tuple], tuple]) -> A:
    def update(x: tp.Any) -> tp.Any:
        if isinstance(x, containers.Variable):
            sharding = vars(x).get("sharding")
            if sharding is not None:
                new = x.copy()
                vars(new)["sharding"] = fn(tuple(sharding))
                return new
        return x

    return jax.tree.map(update, tree, is_leaf=lambda x: isinstance(x, containers.Node))


def add_axis(tree: A, index: int, params: tp.Mapping[str, tp.Any]) -> A:
    """Inserts the scanned axis name at ``index`` in every Variable's sharding."""
    if not params:
        return tree

    def insert(sharding: tuple) -> tuple:
        name = _partition_name(params)
        padded = list(sharding) + [None] * max(0, index - len(sharding))
        padded.insert(index, name)
        return tuple(padded)

    return _map_shardings(tree, insert)


def remove_axis(tree: A, index: int, params: tp.Mapping[str, tp.Any]) -> A:
    """Removes the scanned axis name at ``index`` from every Variable's sharding."""
    if not params:
        return tree

    def drop(sharding: tuple) -> tuple:
        name = _partition_name(params)
        if index >= len(sharding) or sharding[index] != name:
            raise ValueError(f"Expected axis {index} of sharding {sharding} to be the scanned axis {name!r}.")
        return sharding[:index] + sharding[index + 1 :]

    return _map_shardings(tree, drop)
