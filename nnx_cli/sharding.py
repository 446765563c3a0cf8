"""Where arrays live: one mesh from `sharding.mesh`, shardings from logical axes.

The model declares logical axis names on its parameters; `sharding.rules`
maps them to mesh axes. Everything a run places goes through two functions:
:func:`state_shardings` (params, optimizer state, batch stats: each array's
`NamedSharding` derived with `nnx.get_partition_spec` and the rules) and
:class:`BatchLayout` (batches split along the mesh axes of the logical
`batch` axis, each process contributing the rows its devices hold)::

    mesh = make_mesh(cfg.sharding)
    rules = axis_rules(cfg.sharding)
    shardings = state_shardings(abstract_state, mesh, rules)
    layout = batch_layout(mesh, rules, batch_size=128)
    batch = layout.place(batches.get(step, layout.rows))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import nnx
from nnx_cli.config import ShardingConfig, TrainConfig
from nnx_cli.errors import UserError, did_you_mean

DEFAULT_RULES = [["batch", "data"], ["hidden", "model"]]  # a model class may declare its own `default_rules`

ACTIVATION_AXES = ("batch", "length")
"""Logical axes of activations that no parameter need have: a batch's rows, a sequence's positions."""


def default_rules(rules: list[list[Any]], mesh: dict[str, int]) -> list[list[Any]]:
    """A model's default `rules` for a mesh with the axes of `mesh`: each rule keeps the mesh axes the mesh has,
    a rule left with none is dropped, and one mesh axis is written alone. A model may so name axes that only
    some meshes have::

        default_rules([["batch", "data"], ["expert", "expert"]], {"data": -1, "model": 1})
        # [["batch", "data"]]
    """
    out = []
    for logical, axes in rules:
        if axes is None:
            out.append([logical, None])
            continue
        kept = [a for a in ([axes] if isinstance(axes, str) else axes) if a in mesh]
        if kept:
            out.append([logical, kept[0] if len(kept) == 1 else kept])
    return out


def axis_rules(cfg: ShardingConfig) -> list[tuple[str, Any]]:
    """`sharding.rules` (null: :data:`DEFAULT_RULES`) as `(logical_axis, mesh_axis_or_axes_or_None)` pairs."""
    rules = cfg.rules if cfg.rules is not None else DEFAULT_RULES
    return [(rule[0], tuple(rule[1]) if isinstance(rule[1], list) else rule[1]) for rule in rules]


def mesh_shape(cfg: ShardingConfig, device_count: int) -> dict[str, int]:
    """Axis sizes with `-1` resolved to the remaining devices; their product must be `device_count`."""
    fixed = math.prod(size for size in cfg.mesh.values() if size != -1)
    sizes = {}
    for name, size in cfg.mesh.items():
        sizes[name] = device_count // fixed if size == -1 else size
    if math.prod(sizes.values()) != device_count or any(s < 1 for s in sizes.values()):
        raise UserError(
            f"config key 'sharding.mesh' {cfg.mesh} does not fit the {device_count} available device(s); "
            f"the axis sizes must multiply to {device_count}; override it on the command line, for example "
            + (
                " ".join(f"sharding.mesh.{name}={-1 if i == 0 else 1}" for i, name in enumerate(cfg.mesh))
                or "sharding.mesh.data=-1"
            )
            + " (-1: all remaining devices)"
        )
    return sizes


def make_mesh(cfg: ShardingConfig) -> Mesh:
    """The one device mesh of a run, over every device of every process."""
    sizes = mesh_shape(cfg, jax.device_count())
    auto = (jax.sharding.AxisType.Auto,) * len(sizes)
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=auto)


def preview_problem(
    abstract: Any, cfg: ShardingConfig, rules: list[tuple[str, Any]], batch_size: int | None = None
) -> str | None:
    """Why `nnx-train` would refuse to split `abstract` over `sharding.mesh` (an entry a mesh axis does not
    divide, a rule for an axis the model lacks), or None. The mesh may be for another machine: its sizes are
    taken as written, a `-1` as the rest of this machine's devices; where they do not fit, it says the split was
    not checked (it said nothing, which read as a split that is fine). With `batch_size`, rows of a batch that the
    batch axes do not split evenly too."""
    sizes = dict(cfg.mesh)
    if -1 in sizes.values():
        try:
            sizes = mesh_shape(cfg, jax.device_count())
        except UserError:
            return (
                f"the split was not checked: sharding.mesh {dict(cfg.mesh)} takes the rest of the devices with -1, "
                f"and this machine's {jax.device_count()} do not fill its other axes; give every axis its size to "
                "preview another machine's mesh"
            )
    if any(size < 1 for size in sizes.values()):
        return None
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
    try:
        state_shardings(abstract, mesh, rules)
        if batch_size is not None:  # train.batch_size: rows the batch axes split evenly
            _check_batch(mesh, rules, batch_size)
    except UserError as e:
        return f"nnx-train would refuse this sharding: {e}"
    return None


def state_shardings(abstract: Any, mesh: Mesh, rules: list[tuple[str, Any]]) -> Any:
    """A `NamedSharding` for every array of `abstract`, in the same tree structure.

    Every sharded dimension must split evenly over its mesh axes; one that
    does not is a UserError naming the entry and its logical axis. Rules that
    would leave devices computing the same are one too (:func:`check_rules`).
    """

    # get_partition_spec drops the Variable wrappers; expand back to one spec per leaf. Optimizer statistics that
    # are not shaped as their parameter (Adafactor's row and column means, of another rank or of size 1) keep the
    # dimensions they cannot split whole; parameters, frozen or trained, are split as their names say or refused.
    def spec_of(path: tuple, spec: Any, leaf: Any) -> Any:
        if jax.tree_util.keystr(path[:1], simple=True) != "opt_state":
            return spec
        if len(spec) != len(leaf.shape):
            return type(spec)(*[None] * len(leaf.shape))
        return type(spec)(*[None if size == 1 else name for size, name in zip(leaf.shape, spec)])

    logical = jax.tree_util.tree_map_with_path(
        lambda path, spec, subtree: jax.tree.map(lambda leaf: spec_of(path, spec, leaf), subtree),
        nnx.get_partition_spec(abstract),
        abstract,
    )
    sizes: dict[str, set[int]] = {}  # each logical axis's dimensions: a rule suggested must divide them
    for spec, leaf in zip(jax.tree.leaves(logical), jax.tree.leaves(abstract)):
        for name, size in zip(spec, getattr(leaf, "shape", ())):
            if isinstance(name, str):
                sizes.setdefault(name, set()).add(size)
    check_rules(list(sizes), mesh, rules, sizes)
    shardings = nnx.spmd.logical_to_mesh_sharding(logical, mesh, rules)
    entries = [
        (jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value"), leaf, names, sharding)
        for (path, leaf), names, sharding in zip(
            jax.tree_util.tree_flatten_with_path(abstract)[0], jax.tree.leaves(logical), jax.tree.leaves(shardings)
        )
    ]
    for entry, leaf, names, sharding in sorted(
        entries, key=lambda e: not e[0].startswith("params/")
    ):  # name a parameter first
        for size, name, axes in zip(leaf.shape, names, sharding.spec):
            if size % _ways(mesh, axes):
                raise UserError(
                    f"{entry} {list(leaf.shape)} cannot be split as {sharding.spec} over the mesh {dict(mesh.shape)}: "
                    f"{size} is not divisible by {_ways(mesh, axes)}; change sharding.mesh, or map {name!r} to null "
                    "in sharding.rules"
                )
    return shardings


def check_rules(
    axes: list[str], mesh: Mesh, rules: list[tuple[str, Any]], sizes: dict[str, set[int]] | None = None
) -> None:
    """Rules that would leave work silently replicated are a UserError: a rule for a logical axis the model does
    not have where a close one that it has is left without a rule (a typo), and a mesh axis of more than one
    device that no rule of an axis the model has maps to (its devices would all compute the same).

    `axes` are the logical axes of the state's arrays; :data:`ACTIVATION_AXES` are taken as used too. A rule for
    an axis the model lacks is otherwise harmless, and a model's own default rules may have one (`kv_heads`
    without grouped-query attention, `expert` in a dense model). `sizes` (each logical axis's dimensions) keeps
    the rule the message offers to one whose dimensions the mesh axis divides::

        check_rules(["embed", "hidden"], mesh, [("batch", "data"), ("hiddn", "model")])
        # UserError: config key 'sharding.rules[1]' maps logical axis 'hiddn', ... (did you mean 'hidden'?) ...
    """
    used = dict.fromkeys([*ACTIVATION_AXES, *axes])
    ruled = {logical for logical, _ in rules}
    for i, (logical, _) in enumerate(rules):
        hint = "" if logical in used else did_you_mean(logical, [a for a in used if a not in ruled])
        if hint:
            raise UserError(
                f"config key 'sharding.rules[{i}]' maps logical axis {logical!r}, which no parameter or activation "
                f"of the model has{hint}; its parameters' logical axes: {', '.join(dict.fromkeys(axes))}"
            )
    splitting = {axis for logical, targets in rules if logical in used for axis in _as_tuple(targets)}
    for axis, size in mesh.shape.items():
        if size > 1 and axis not in splitting:
            divides = lambda a, ways=size: all(n % ways == 0 for n in (sizes or {}).get(a, ()))  # noqa: E731
            free = next((a for a in used if a not in ruled and a != "length" and divides(a)), None)  # `batch` first
            if free is not None:
                example = [*rules, (free, axis)]
            else:  # every axis has a rule: split the batch over this axis too
                example = [(a, (*_as_tuple(t), axis) if a == "batch" else t) for a, t in rules]
            named = sorted({a for _, targets in rules for a in _as_tuple(targets)} - {axis})  # a typo of one?
            raise UserError(
                f"config key 'sharding.mesh': axis {axis!r}{did_you_mean(axis, named)} has {size} devices but "
                f"sharding.rules "
                f"{_flow(rules)} map no logical axis of the model to it, so its devices would all compute the "
                f"same; add a rule that does (for example sharding.rules={_flow(example)}), or leave {axis!r} out "
                "of sharding.mesh"
            )


def _as_tuple(axes: Any) -> tuple[str, ...]:
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def _flow(rules: list[tuple[str, Any]]) -> str:
    """Rules as a YAML flow list, as they are written on the command line: `[[batch, data], [embed, [data, model]]]`."""

    def target(axes: Any) -> str:
        return "null" if axes is None else axes if isinstance(axes, str) else f"[{', '.join(axes)}]"

    return "[" + ", ".join(f"[{logical}, {target(axes)}]" for logical, axes in rules) + "]"


def _ways(mesh: Mesh, axes: Any) -> int:
    """How many pieces a dimension with PartitionSpec entry `axes` is split into."""
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """`abstract` with each `ShapeDtypeStruct` carrying its sharding (a restore target)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    """A copy on every device: scalars, metrics, images for the host."""
    return NamedSharding(mesh, PartitionSpec())


def put_replicated(tree: Any, mesh: Mesh) -> Any:
    """Host values (the same on every process) as arrays copied on every device of `mesh`.

    Jitted functions then always get device arrays: a numpy argument would
    make them trace and lower a second time.
    """
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x), np.shape(x)), tree)


def same_memory(x: jax.Array, dtype: Any) -> jax.Array | None:
    """`x`, on one CPU device, as an array of `dtype` (of the same width) in the same memory: JAX takes an aligned
    host buffer as it is. None elsewhere (another platform, several devices, a buffer it would copy). The view
    reads what `x` holds; a step donating `x` while the view lives copies instead."""
    if nnx.spmd.platform() != "cpu" or len(x.sharding.device_set) != 1:
        return None
    view = jax.device_put(np.asarray(x).view(dtype), x.sharding)
    return view if view.unsafe_buffer_pointer() == x.unsafe_buffer_pointer() else None


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a global batch of `size` rows lies on the mesh, and which rows this process feeds.

    Rows are split along the mesh axes that the logical `batch` axis maps to.
    In a multi-process run each process gathers only `rows` (the rows its own
    devices hold) and :meth:`place` assembles the global array from every
    process's share.
    """

    sharding: NamedSharding
    size: int
    rows: slice

    @property
    def stacked_sharding(self) -> NamedSharding:
        """Several batches stacked along a new leading axis (one dispatch's worth): that axis is not split."""
        return NamedSharding(self.sharding.mesh, PartitionSpec(None, *self.sharding.spec))

    def place(self, batch: dict[str, np.ndarray], stacked: bool = False) -> dict[str, jax.Array]:
        """Put this process's rows of a batch (`batch[k]` has `rows` rows; with `stacked`, `[n, rows, ...]`) on
        its devices, as global arrays."""
        sharding = self.stacked_sharding if stacked else self.sharding
        if jax.process_count() == 1:
            return jax.device_put(batch, sharding)
        lead = 1 if stacked else 0
        return {
            k: jax.make_array_from_process_local_data(sharding, v, (*v.shape[:lead], self.size, *v.shape[lead + 1 :]))
            for k, v in batch.items()
        }


def batch_layout(
    mesh: Mesh, rules: list[tuple[str, Any]], batch_size: int, key: str = "train.batch_size", said: str | None = None
) -> BatchLayout:
    """The layout of batches of `batch_size` rows (config key `key`, or rows `said` says how they are made).

    Rows are split along the mesh axes of the logical `batch` axis.
    """
    spec = _check_batch(mesh, rules, batch_size, key, said)
    sharding = NamedSharding(mesh, spec)
    return BatchLayout(sharding, batch_size, _process_rows(sharding, batch_size))


def _check_batch(
    mesh: Any, rules: list[tuple[str, Any]], batch_size: int, key: str = "train.batch_size", said: str | None = None
) -> PartitionSpec:
    """The batch's PartitionSpec on `mesh` (or an abstract one); a UserError when its rows do not split evenly."""
    spec = PartitionSpec(*nnx.spmd.logical_to_mesh_axes(("batch",), rules))
    ways = _ways(mesh, spec[0])
    if batch_size % ways:
        raise UserError(
            f"{said or f'config key {key!r} ({batch_size})'} must be divisible by the {ways} ways the batch is split "
            f"on the mesh {dict(mesh.shape)}"
        )
    return spec


def eval_batch_layout(mesh: Mesh, rules: list[tuple[str, Any]], train: TrainConfig) -> BatchLayout:
    """Eval batches: `train.eval_batch_size` rows, or `train.batch_size` when that is null."""
    if train.eval_batch_size:
        return batch_layout(mesh, rules, train.eval_batch_size, "train.eval_batch_size")
    return batch_layout(mesh, rules, train.batch_size)


def _process_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of a global batch that this process's devices hold (all rows in a single-process run)."""
    spans = sorted(
        {s[0].indices(batch_size)[:2] for s in sharding.addressable_devices_indices_map((batch_size,)).values()}
    )
    start, stop = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a != stop:
            raise UserError(
                f"the mesh {dict(sharding.mesh.shape)} gives process {jax.process_index()} batch rows that are not "
                "contiguous; order sharding.mesh with the batch (data) axis first"
            )
        stop = b
    return slice(start, stop)
