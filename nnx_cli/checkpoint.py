"""Orbax checkpoints of a run, in `<workdir>/checkpoints/<step>/`, as named items.

A step holds `state` (the train state: params, optimizer state, step, other
collections), `loop` (what exact resumption needs beyond it: the running
metric sums since the last log) and `manifest` (JSON: the format and the
items written). Readers restore the items they know and find; an item added
later is simply absent from older checkpoints, which keep restoring.

Any pytree of arrays can be saved; on disk it is a nested mapping named after
the tree's key paths (`params/encoder/linear1/kernel`,
`opt_state/0/mu/encoder/linear1/kernel`, ...), so checkpoints stay readable
without this code. Restoring takes an abstract target (from `jax.eval_shape`,
carrying shardings where the arrays should land) and returns the same tree
structure::

    ckpt = Checkpointer(workdir / "checkpoints", keep=3)
    ckpt.save(step, state, loop=sums)        # asynchronous: returns once the arrays are copied
    state = ckpt.restore(ckpt.latest_step(), jax.eval_shape(init))
    sums = ckpt.restore_item(step, "loop", abstract_sums)   # None for a checkpoint without it
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from nnx_cli.errors import UserError, first_line

_ITEM = "state"
LOOP = "loop"
MANIFEST = "manifest"
FORMAT = 2  # 1: `state` only (before named items)


class Checkpointer:
    """A thin wrapper over `ocp.CheckpointManager` that keeps `keep` checkpoints."""

    def __init__(self, directory: str | Path, *, keep: int | None = None, async_: bool = True, read_only: bool = False):
        _quiet_absl()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_,
            create=not read_only,
            read_only=read_only,
        )
        self.directory = Path(directory).absolute()
        handlers = {
            _ITEM: ocp.StandardCheckpointHandler(),
            LOOP: ocp.StandardCheckpointHandler(),
            MANIFEST: ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, *, loop: Any = None) -> None:
        """Save `state` (and the `loop` item) at `step`, asynchronously if configured; the caller decides when."""
        items = {_ITEM: ocp.args.StandardSave(to_named_tree(state))}
        if loop is not None:
            items[LOOP] = ocp.args.StandardSave(to_named_tree(loop))
        manifest = {"format": FORMAT, "step": step, "items": sorted([*items, MANIFEST])}
        items[MANIFEST] = ocp.args.JsonSave(manifest)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def items(self, step: int) -> set[str]:
        """The items the checkpoint at `step` holds (`{"state"}` for one written before named items)."""
        return {p.name for p in (self.directory / str(step)).iterdir() if p.is_dir()}

    def restore_item(self, step: int, item: str, target: Any) -> Any:
        """Restore one item other than the train state into `target`'s structure; None when the checkpoint lacks it."""
        if item not in self.items(step):
            return None
        abstract = to_named_tree(jax.tree.map(_as_abstract, target))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract)}))
        except Exception as e:
            raise self._unreadable(step, "restored", e) from None
        return from_named_tree(restored[item], target)

    def restore(self, step: int, target: Any) -> Any:
        """Restore the checkpoint at `step` into the structure, dtypes and shardings of `target`.

        A checkpoint of a different model or optimizer is a UserError, found
        from the checkpoint's metadata before any array is read.
        """
        abstract = to_named_tree(jax.tree.map(_as_abstract, target))
        self._check_matches(step, abstract)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(abstract)})
            )[_ITEM]
        except Exception as e:
            raise self._unreadable(step, "restored", e) from None
        return from_named_tree(restored, target)

    def _unreadable(self, step: int, what: str, error: Exception) -> UserError:
        return UserError(
            f"checkpoint {self.directory / str(step)} cannot be {what} ({type(error).__name__}: "
            f"{first_line(error)}); it may be damaged: "
            f"pick another step, or move that step directory away to fall back to the previous checkpoint"
        )

    def _check_matches(self, step: int, abstract: dict[str, Any]) -> None:
        def layout(tree: Any) -> dict[str, tuple]:
            return {
                "/".join(_names(path)): (tuple(x.shape), str(x.dtype))
                for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            }

        saved, wanted = layout(self.metadata(step)), layout(abstract)
        if saved == wanted:
            return
        params_first = lambda path: (not path.startswith("params/"), path)  # noqa: E731
        missing = sorted(wanted.keys() - saved.keys(), key=params_first)
        extra = sorted(saved.keys() - wanted.keys(), key=params_first)
        changed = sorted((k for k in wanted.keys() & saved.keys() if wanted[k] != saved[k]), key=params_first)
        if changed:
            (old_shape, old_dtype), (new_shape, new_dtype) = saved[changed[0]], wanted[changed[0]]
            what = f"{changed[0]} is {old_dtype}{list(old_shape)} there but {new_dtype}{list(new_shape)} in the config"
        elif missing:
            what = f"it has no {missing[0]}"
        else:
            what = f"it has {extra[0]}, which the config's model and optimizer do not"
        raise UserError(
            f"checkpoint {self.directory / str(step)} does not match the model and optimizer of the config: {what}; "
            f"train in a new --workdir, or pass --no-resume to start over"
        )

    def metadata(self, step: int) -> dict[str, Any]:
        """What the checkpoint at `step` holds, without reading arrays: Orbax array
        metadata (`shape`, `dtype`, `sharding.partition_spec`) in the saved tree.

        A checkpoint that cannot be read (damaged, or not written by nnx-train) is a UserError.
        """
        try:
            return self.manager.item_metadata(step)[_ITEM]
        except Exception as e:
            raise self._unreadable(step, "read", e) from None

    def restore_raw(self, step: int) -> dict[str, Any]:
        """The checkpoint at `step` as saved: nested dicts of numpy arrays, whatever devices wrote it."""
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), self.metadata(step))
        restored = self.manager.restore(step, args=ocp.args.Composite(**{_ITEM: ocp.args.StandardRestore(target)}))[
            _ITEM
        ]
        return jax.tree.map(np.asarray, restored)

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _quiet_absl() -> None:
    """Keep Orbax's absl INFO/WARNING chatter (read-only notices, ...) out of the CLI's output."""
    import logging

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)


def to_named_tree(tree: Any) -> dict[str, Any]:
    """A nested dict whose keys spell each leaf's key path (`Param.value` wrappers dropped)."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = _names(path)
        node = out
        for name in names[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"checkpoint name clash at {'/'.join(names)}")
        if names[-1] in node:
            raise ValueError(f"checkpoint name clash at {'/'.join(names)}")
        node[names[-1]] = leaf
    return out


def from_named_tree(named: dict[str, Any], target: Any) -> Any:
    """Inverse of :func:`to_named_tree`: put the leaves of `named` into `target`'s structure."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, _ in paths:
        node: Any = named
        for name in _names(path):
            node = node[name]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _names(path: tuple) -> list[str]:
    names: list[str] = []
    for i, entry in enumerate(path):
        if isinstance(entry, jax.tree_util.DictKey):
            names.extend(str(entry.key).split("/"))
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            if not (entry.name == "value" and i == len(path) - 1):
                names.append(entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            names.append(str(entry.idx))
        else:
            names.append(str(getattr(entry, "key", entry)))
    return names or ["value"]


def _as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
