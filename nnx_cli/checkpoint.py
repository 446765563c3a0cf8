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

Once Orbax has committed a step, every process records checksums of the files
it wrote there (`nnx_cli.integrity.seal`, in a background thread), so that
`integrity.verify` can tell later whether the step is still what was written.
A write that fails (disk full, permission lost) is a `RunError` naming the
step directory and the cause, raised by `save`, `wait` or `close`; the
half-written directory is removed and the checkpoints before it stay intact.
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nnx_cli import integrity
from nnx_cli.errors import WRITE_FIXES, RunError, UserError, first_line, write_cause

_ITEM = "state"
LOOP = "loop"
MANIFEST = "manifest"
FORMAT = 2  # 1: `state` only (before named items)


class _Orbax:
    """`orbax.checkpoint`, imported when first used: a fresh run imports it while its first steps run (see
    `nnx_cli.runtime.preload`), not before them."""

    def __getattr__(self, name: str) -> Any:
        import orbax.checkpoint

        return getattr(orbax.checkpoint, name)


ocp = _Orbax()


class Unreadable(UserError):
    """A checkpoint that cannot be read or restored: damaged, or not written by nnx-train."""


class Checkpointer:
    """A wrapper over `ocp.CheckpointManager` that seals each step with checksums and keeps `keep` steps.

    Old steps are removed by `integrity.prune` (on process 0, once the newer
    step is sealed), never one that no newer verified step replaces, nor
    those in `protect` (the best step, with `checkpoint.keep_best`). Steps in `passed_over` (saved for
    `keep_best` alone) do not count among the `keep` newest: they go once no longer the best.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int | None = None,
        async_: bool = True,
        read_only: bool = False,
        checksums: bool = True,
        mismatch_fix: str = "the run's own config.yaml describes its checkpoints: drop the overrides of its model or "
        "optimizer",
    ):
        _quiet_absl()
        _hush_closed_event_loops()
        self.directory = Path(directory).absolute()
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._read_only = read_only
        self.mismatch_fix = mismatch_fix  # what to do when a checkpoint does not match the config (nnx-train's own)
        self._manager: Any = None
        self._async = async_
        self._checksums = checksums and not read_only
        self._sealing: threading.Thread | None = None  # waits for Orbax's commit of `_pending`, then seals it
        self._pending: int | None = None
        self._error: tuple[str, BaseException] | None = None  # ("write" or "seal", what went wrong)
        self._failed = False
        self.keep = keep
        self.protect: set[int] = set()
        self.passed_over: set[int] = set()  # steps saved for keep_best alone: not among checkpoint.keep's newest
        self._pruned_protecting: set[int] = set()  # `protect` as the last prune saw it

    @property
    def manager(self) -> Any:
        """Orbax's `CheckpointManager` of the directory, made (and Orbax imported) on first use."""
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None,  # `integrity.prune` removes old steps, only behind a verified newer one
                enable_async_checkpointing=self._async,
                create=not self._read_only,
                read_only=self._read_only,
                # what a killed run left of a step it was writing (`<step>.orbax-checkpoint-tmp-*`): never a
                # checkpoint, removed when the run that resumes (which holds the work dir) opens it
                cleanup_tmp_directories=not self._read_only,
            )
            handlers = {
                _ITEM: ocp.StandardCheckpointHandler(),
                LOOP: ocp.StandardCheckpointHandler(),
                MANIFEST: ocp.JsonCheckpointHandler(),
            }
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The committed steps on disk now (Orbax's own list is cached: it misses pruned and moved steps)."""
        return integrity.steps(self.directory)

    def save(self, step: int, state: Any, *, loop: Any = None, base: dict[str, Any] | None = None) -> None:
        """Save `state` (and the `loop` item) at `step`, asynchronously if configured; the caller decides when.
        `base` (JSON) goes into the step's manifest: for an adapter run, the base model it needs and the
        checksums of its weight files.

        First waits for the previous save: a RunError if that one failed.
        """
        self._settle()
        items = {_ITEM: ocp.args.StandardSave(to_named_tree(state))}
        if loop is not None:
            items[LOOP] = ocp.args.StandardSave(to_named_tree(loop, paths=False))
        manifest = {"format": FORMAT, "step": step, "items": sorted([*items, MANIFEST])}
        if base is not None:
            manifest["base"] = base
        items[MANIFEST] = ocp.args.JsonSave(manifest)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            raise self._write_failed(step, "write", e) from None
        self._pending = step
        if self._async:
            self._sealing = threading.Thread(target=self._commit_and_seal, args=(step,), name="nnx-seal", daemon=True)
            self._sealing.start()
        else:
            self._commit_and_seal(step)
            self._settle()

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of the checkpoint at `step` ({} for one written before manifests, or unreadable)."""
        if MANIFEST not in self.items(step):
            return {}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**{MANIFEST: ocp.args.JsonRestore()}))
        except Exception:  # a damaged manifest: integrity.verify reports the step as a whole
            return {}
        return dict(restored[MANIFEST] or {})

    def items(self, step: int) -> set[str]:
        """The items the checkpoint at `step` holds (`{"state"}` for one written before named items)."""
        return {p.name for p in (self.directory / str(step)).iterdir() if p.is_dir()}

    def restore_params(self, step: int, target: Any) -> Any:
        """Only the parameters of the checkpoint at `step`, into `target`'s structure and shardings (an
        abstract `State` of params): no optimizer state is read. A parameter whose shape or dtype differs is
        a UserError naming it; a damaged step is `Unreadable`."""
        named = to_named_tree(jax.tree.map(_as_abstract, target))
        try:
            saved = self.metadata(step)["params"]
        except KeyError:
            raise self._unreadable(step, "read", KeyError("no params")) from None
        _check_params(self.directory / str(step), saved, named)
        args = ocp.args.PyTreeRestore(
            item={"params": named},
            restore_args={"params": ocp.checkpoint_utils.construct_restore_args(named)},
            partial_restore=True,
        )
        try:
            restored = ocp.PyTreeCheckpointer().restore(self.directory / str(step) / _ITEM, args=args)
        except Exception as e:
            raise self._unreadable(step, "restored", e) from None
        return from_named_tree(restored["params"], target)

    def restore_item(self, step: int, item: str, target: Any) -> Any:
        """Restore one item other than the train state into `target`'s structure; None when the checkpoint lacks it."""
        if item not in self.items(step):
            return None
        abstract = to_named_tree(jax.tree.map(_as_abstract, target), paths=False)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract)}))
        except Exception as e:
            raise self._unreadable(step, "restored", e) from None
        return from_named_tree(restored[item], target, paths=False)

    def _commit_and_seal(self, step: int) -> None:
        stage = "write"
        try:
            self.manager.wait_until_finished()
            stage = "seal"
            if self._checksums:
                integrity.seal(self.directory / str(step))
            if self.keep is not None and jax.process_index() == 0:
                stage = "prune"
                trusted = {step} if self._checksums and jax.process_count() == 1 else set()
                self._pruned_protecting = set(self.protect)
                integrity.prune(
                    self.directory, self.keep, protect=self._pruned_protecting, trusted=trusted,
                    passed_over=self.passed_over,
                )  # fmt: skip
        except BaseException as e:
            self._error = (stage, e)

    def _settle(self) -> None:
        """Wait until the pending save is committed and sealed; a RunError if it failed."""
        if self._sealing is not None:
            self._sealing.join()
            self._sealing = None
        step, self._pending = self._pending, None
        if self._error is not None:
            (stage, error), self._error = self._error, None
            raise self._write_failed(step, stage, error)

    def _write_failed(self, step: int | None, stage: str, error: BaseException) -> RunError:
        """The one-line RunError for a failed save; removes what Orbax left of the step."""
        self._failed = True
        step_dir = self.directory / str(step)
        if stage == "write" and jax.process_index() == 0:  # process 0 alone cleans up, as Orbax does
            for leftover in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(leftover, ignore_errors=True)
        cause, code = write_cause(error)
        fix = WRITE_FIXES.get(code, "fix the cause")
        before = [s for s in integrity.steps(self.directory) if step is None or s < step]
        kept = (
            f"the checkpoints before it are intact, the latest is {self.directory / str(before[-1])}"
            if before
            else "there is no earlier checkpoint"
        )
        if stage == "seal":
            return RunError(
                f"checkpoint {step_dir} was written but its checksums could not be ({cause}); "
                f"{fix} and run again to resume"
            )
        if stage == "prune":
            return RunError(
                f"checkpoint {step_dir} was written but removing checkpoints beyond checkpoint.keep failed ({cause}); "
                f"{fix} and run again to resume"
            )
        return RunError(f"cannot write checkpoint {step_dir} ({cause}); {kept}: {fix} and run again to resume")

    def _prune_unprotected(self) -> None:
        """A best step that an eval after the last save replaced was still protected when that save pruned: with
        `checkpoint.keep: 1` it would outlive the run beside the newest and the new best."""
        if self.keep is None or self._failed or self.protect == self._pruned_protecting or jax.process_index() != 0:
            return
        self._pruned_protecting = set(self.protect)
        try:
            integrity.prune(self.directory, self.keep, protect=self._pruned_protecting, passed_over=self.passed_over)
        except OSError as e:
            latest = (integrity.steps(self.directory) or [None])[-1]
            raise self._write_failed(latest, "prune", e) from None

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

    def _unreadable(self, step: int, what: str, error: Exception) -> Unreadable:
        detail = first_line(error).split(" [tensorstore_spec")[0]  # TensorStore appends kilobytes of its spec
        if len(detail) > 300:
            detail = detail[:297] + "..."
        return Unreadable(
            f"checkpoint {self.directory / str(step)} cannot be {what} ({type(error).__name__}: {detail}); "
            "it may be damaged"
        )

    def check_matches(self, step: int, target: Any) -> None:
        """A UserError unless the checkpoint at `step` holds the shapes and dtypes of `target` (from its metadata)."""
        self._check_matches(step, to_named_tree(jax.tree.map(_as_abstract, target)))

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
        adapters = [any("/lora/" in k for k in tree if k.startswith("params/")) for tree in (saved, wanted)]
        if adapters == [True, False]:  # the path above says little of the change that made it
            what += " (the run trained LoRA adapters, and the config has no model.lora)"
        elif adapters == [False, True]:
            what += " (the run trained every weight, and the config adds model.lora)"
        raise UserError(
            f"checkpoint {self.directory / str(step)} does not match the model and optimizer of the config: {what}; "
            + self.mismatch_fix
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
        """Block until pending asynchronous saves are on disk and sealed; a RunError if one failed."""
        self._settle()

    def close(self) -> None:
        """Wait for the pending save (a RunError if it failed), prune once more if the protected (best) step moved
        since the last save's prune, then release Orbax's resources."""
        try:
            self._settle()
            self._prune_unprotected()
        finally:
            try:
                if self._manager is not None:
                    self._manager.close()
            except Exception:
                if not self._failed:  # else it is the failure already reported, raised again by Orbax
                    raise


def _check_params(where: Path, saved: Any, wanted: Any) -> None:
    """The parameters a model wants, against those a checkpoint holds: the first difference, as a UserError."""

    def layout(tree: Any) -> dict[str, tuple]:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(_names(path)): (tuple(x.shape), str(x.dtype)) for path, x in flat}

    have, want = layout(saved), layout(wanted)
    if have == want:
        return
    changed = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
    if changed:
        (old_shape, old_dtype), (new_shape, new_dtype) = have[changed[0]], want[changed[0]]
        what = f"{changed[0]} is {old_dtype}{list(old_shape)} there but {new_dtype}{list(new_shape)} in this model"
    elif want.keys() - have.keys():
        what = f"it has no {sorted(want.keys() - have.keys())[0]}"
    else:
        what = f"it has {sorted(have.keys() - want.keys())[0]}, which this model does not"
    adapters = lambda keys: bool(keys) and all("/lora/" in k for k in keys)  # noqa: E731
    if adapters(want) and not any("/lora/" in k for k in have):
        what += (" (it holds a full run's parameters, and this run trains LoRA adapters: those start from a LoRA run "
                 "or a PEFT adapter directory)")  # fmt: skip
    elif adapters(have) and not any("/lora/" in k for k in want):
        what += (" (it holds LoRA adapters alone, and this run trains every parameter: export that run merged with "
                 "nnx-export and point model.pretrained at the export)")  # fmt: skip
    raise UserError(f"the parameters of checkpoint {where} do not fit this model: {what}")


def _hush_closed_event_loops() -> None:
    """When a write fails, TensorStore's callbacks into Orbax's event loop, which the failure closed, report
    `RuntimeError: Event loop is closed` as unraisable exceptions, each a traceback on stderr; they say
    nothing the one-line error does not, so they are dropped (every other unraisable exception still prints)."""
    previous = sys.unraisablehook
    if getattr(previous, "hushes_closed_loops", False):
        return

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)

    hook.hushes_closed_loops = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _quiet_absl() -> None:
    """Keep Orbax's absl chatter (read-only notices, ...) out of the CLI's output.

    Errors too: Orbax logs a failed background save with its traceback, then
    raises it again in `wait_until_finished`, where it becomes one RunError line.
    """
    import logging

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.FATAL)
    logging.getLogger("absl").setLevel(logging.CRITICAL)


def to_named_tree(tree: Any, paths: bool = True) -> dict[str, Any]:
    """A nested dict whose keys spell each leaf's key path (`Param.value` wrappers dropped).

    With `paths`, a dict key with slashes (a `State` path) is a path of nested keys; without, the slashes are
    part of the name (as `%2F`: metric names such as `reward/correct` beside `reward`)."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = _names(path, paths)
        node = out
        for name in names[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ValueError(f"checkpoint name clash at {'/'.join(names)}")
        if names[-1] in node:
            raise ValueError(f"checkpoint name clash at {'/'.join(names)}")
        node[names[-1]] = leaf
    return out


def from_named_tree(named: dict[str, Any], target: Any, paths: bool = True) -> Any:
    """Inverse of :func:`to_named_tree`: put the leaves of `named` into `target`'s structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, _ in flat:
        node: Any = named
        for name in _names(path, paths):
            node = node[name]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _names(path: tuple, paths: bool = True) -> list[str]:
    names: list[str] = []
    for i, entry in enumerate(path):
        if isinstance(entry, jax.tree_util.DictKey):
            key = str(entry.key)
            names.extend(key.split("/") if paths else [key.replace("/", "%2F")])
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
