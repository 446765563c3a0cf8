"""A training run's work dir: checked and locked by `nnx-train`, found by `nnx-eval` and `nnx-inspect`.

Layout written by `nnx-train`::

    <workdir>/config.yaml          the fully resolved config (input shape included)
    <workdir>/checkpoints/<step>/  Orbax checkpoints
    <workdir>/metrics.jsonl        train logs and evals
    <workdir>/images/<step>.png    reconstructions and samples of image models
    <workdir>/.lock                held by the nnx-train writing the work dir
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from nnx_cli.config import Config, load_config
from nnx_cli.errors import UserError, did_you_mean

_LAYOUT = {
    "checkpoints": "a directory",
    "images": "a directory",
    "samples": "a directory",
    "metrics.jsonl": "a file",
    "config.yaml": "a file",
    "run.json": "a file",
}


def check_workdir(workdir: Path) -> list[Path]:
    """Make sure `nnx-train` can use `workdir` (creating it if needed), before any data is loaded.

    Returns the directories it created, innermost first: `remove_if_empty` takes them away again when the run
    stops before writing anything (a data source that cannot be read leaves no empty work dir behind).
    """
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"work dir {str(workdir)!r} is a file; pass --workdir with a directory")
    _outside_checkpoints(workdir)
    try:
        str(workdir.absolute()).encode("utf-8")
    except UnicodeEncodeError:  # Orbax and TensorStore take UTF-8 paths only: its first checkpoint would fail
        raise UserError(f"work dir {str(workdir)!r} is not a UTF-8 path; pass --workdir with one") from None
    created = [p for p in (workdir, *workdir.parents) if not p.exists()]
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create work dir {str(workdir)!r}: {e.strerror or e}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise UserError(f"work dir {str(workdir)!r} is not writable")
    for name in ("checkpoints", "metrics.jsonl", "config.yaml", "run.json"):  # what every run writes
        path = workdir / name
        if not path.is_symlink() or path.exists():
            continue
        target = path.parent / os.readlink(path)  # a link to a file not yet made is fine: the run makes it
        if name != "checkpoints" and target.parent.is_dir():
            continue
        missing = (
            "which does not exist"
            if name == "checkpoints"
            else f"whose directory {str(target.parent)!r} does not exist"
        )
        raise UserError(  # a FileNotFoundError traceback where the run first wrote through it
            f"{str(path)!r} is a symbolic link to {os.readlink(path)!r}, {missing}; create it, remove the link, or "
            "pass another --workdir"
        )
    for name, kind in _LAYOUT.items():
        path = workdir / name
        if path.exists() and path.is_dir() != (kind == "a directory"):
            raise UserError(f"{str(path)!r} should be {kind}; move it away or pass another --workdir")
    return created


def _outside_checkpoints(workdir: Path) -> None:
    """Refuse a work dir inside a run's `checkpoints/` (`--workdir runs/lm/checkpoints/1000`, a step's path
    pasted for its run's): the new run's files would land in that step, which then fails its checksums."""
    path = Path(os.path.abspath(workdir))
    for folder in (path, *path.parents):
        run = folder.parent
        if folder.name == "checkpoints" and run != folder and (run / "config.yaml").is_file():
            inside = path.relative_to(folder).parts
            where = f"checkpoint step {inside[0]} of" if inside else "the checkpoints of"
            named = run if workdir.is_absolute() else os.path.relpath(run)
            raise UserError(
                f"work dir {str(workdir)!r} is {'inside ' if len(inside) > 1 else ''}{where} run {str(named)!r}: "
                f"a run there would write into {'it' if inside else 'them'}; pass --workdir {str(named)!r} to "
                "resume that run, or a directory outside it"
            )


def discard_unwritten(workdir: Path) -> None:
    """What a run that stopped before writing anything leaves in a work dir it created: its lock, and an empty
    `checkpoints/`."""
    (workdir / ".lock").unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (workdir / "checkpoints").rmdir()  # only when empty


def remove_if_empty(directories: Sequence[Path]) -> None:
    """Remove `directories` (innermost first) while they are empty: what `check_workdir` made for a run that failed."""
    for directory in directories:
        try:
            directory.rmdir()  # only an empty directory goes
        except OSError:
            return


ASIDE = ".replaced"  # where `nnx-train --no-resume` keeps the earlier run until the new one has a checkpoint
_MOVING = ".replaced.partial"  # the earlier run while `set_aside` moves it: renamed to ASIDE once all of it is in
_PUTTING_BACK = ".putting-back"  # in ASIDE: the put-back decided, with the names it moves (`settle_aside`)
_REPLACED = ("checkpoints", "images", "samples", "metrics.jsonl", "tensorboard", "wandb", "config.yaml", "run.json")


def set_aside_names(directory: Path) -> list[str]:
    """The names `--no-resume` sets aside: `_REPLACED`, and the earlier configs kept as `config.<step>.yaml` in
    `directory`."""
    return [*_REPLACED, *sorted(p.name for p in directory.glob("config.*.yaml") if p.is_file())]


def set_aside(workdir: Path) -> Path | None:
    """`--no-resume`: move the earlier run's checkpoints, images, samples, metrics (TensorBoard's and W&B's files
    too: the W&B run id a resume continues), configs and run.json into
    `<workdir>/.replaced` (None when there were none). `settle_aside` deletes them once the new run has committed
    a checkpoint, and puts them back when it stops before that: a rejected run loses nothing.

    A `.replaced` already there is what an earlier `--no-resume` run killed outright left: settled first, as a
    resuming run settles it (put back when that run committed no checkpoint, else deleted), so that a second
    `--no-resume` sets the earlier run aside again rather than deleting it."""
    aside = workdir / ASIDE
    settle_aside(aside)
    moved = [name for name in set_aside_names(workdir) if (workdir / name).exists()]
    if not moved:
        return None
    moving = workdir / _MOVING  # a process stopped among the renames leaves this, which `settle_aside` undoes
    moving.mkdir()
    for name in moved:
        (workdir / name).rename(moving / name)
    moving.rename(aside)
    return aside


def _undo_moving(workdir: Path) -> None:
    """Put back what a `set_aside` stopped among its renames had moved: the new run had not begun, so each name
    is the earlier run's, and the work dir lacks it."""
    moving = workdir / _MOVING
    if not moving.is_dir():
        return
    for entry in moving.iterdir():
        if not os.path.lexists(workdir / entry.name):
            entry.rename(workdir / entry.name)
    with contextlib.suppress(OSError):
        moving.rmdir()


def settle_aside(aside: Path | None, *, delete: bool = True, put_back: bool = False, later: bool = False) -> bool:
    """Delete what `set_aside` moved once the work dir has a committed checkpoint of the new run, else put it back
    (replacing whatever the new run wrote in those places: its first eval's images and samples too); return
    whether it was put back. Without `delete` (a process ending at once), a run with a checkpoint leaves it for
    the next `nnx-train` to delete. `put_back`: whatever the new run wrote (its only checkpoint is the one Ctrl-C
    made it write, before any of its own: the user stopped it before it replaced the earlier run).

    A put-back is decided once, in a record (`.replaced/.putting-back`), before anything moves: one cut short (a
    signal, a write still under way in the directory it replaces) is finished by the next call, whatever the
    work dir then holds. With `later` (a process ending at once while its checkpoint may still be written) the
    decision is recorded and the moves are left to the next `nnx-train`."""
    if aside is None:
        return False
    _undo_moving(aside.parent)
    if not aside.is_dir():
        return False
    record = aside / _PUTTING_BACK
    if not record.is_file():
        from nnx_cli.integrity import steps

        checkpoints = aside.parent / "checkpoints"
        # a step of the new run's own, renamed into place: not an unfinished one (Orbax writes commit_success.txt
        # into its temporary directory before the rename), a damaged one set aside, nor one being pruned
        committed = any((checkpoints / str(step) / "commit_success.txt").is_file() for step in steps(checkpoints))
        if committed and not put_back:
            if delete:
                shutil.rmtree(aside, ignore_errors=True)
            return False
        names = set_aside_names(aside)
        _write_json(record, {"names": names, "back": [name for name in names if os.path.lexists(aside / name)]})
    if not later:
        _put_back(aside, record)
    return True


def _put_back(aside: Path, record: Path) -> None:
    """The put-back `record` decided: each name the earlier run had comes back in place of the new run's; the
    names it lacked lose what the new run wrote there. A name already back is left alone."""
    decided = json.loads(record.read_text())
    workdir = aside.parent
    for name in decided["names"]:
        old, new = aside / name, workdir / name
        if name in decided["back"] and not os.path.lexists(old):
            continue  # put back already
        if new.is_dir() and not new.is_symlink():
            shutil.rmtree(new)
        else:
            new.unlink(missing_ok=True)
        if os.path.lexists(old):
            old.rename(new)
    record.unlink()
    record.with_name(record.name + ".partial").unlink(missing_ok=True)  # a record's write cut short, if any
    aside.rmdir()


def lock_workdir(workdir: Path) -> IO:
    """Hold `<workdir>/.lock` so that a second `nnx-train` on the same work dir stops at once.

    The lock lives as long as the returned file stays open, and the operating
    system drops it when the process ends, however it ends.
    """
    f = open(workdir / ".lock", "a+")  # noqa: SIM115 (held open: the lock lasts as long as the file)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise UserError(
            f"work dir {str(workdir)!r} is in use by another nnx-train (pid {holder}); wait for it to finish or pass "
            "another --workdir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@dataclasses.dataclass
class Run:
    workdir: Path
    checkpoints: Path
    step: int | None  # the step asked for (a step dir, --step, --best); None: the newest usable one
    cfg: Config


BEST = "best.json"  # in the checkpoints dir: the best step by `checkpoint.keep_best`'s eval metric


def open_run(target: str | Path, overrides: Sequence[str] = (), step: int | None = None, best: bool = False) -> Run:
    """Resolve a work dir, its `checkpoints/` dir or one step dir to its checkpoints and its config.

    `step` (or the step dir named, or with `best` the best step kept by
    `checkpoint.keep_best`) picks a checkpoint; by default the newest usable
    one is chosen later (`nnx_cli.restore.choose`). Raises UserError when
    there is no checkpoint or no config to be found.
    """
    from nnx_cli.integrity import steps as list_steps

    path = Path(target)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist{closest_dir(path)}; expected a work dir written by nnx-train")
    if (path / "checkpoints").is_dir():
        checkpoints = path / "checkpoints"
    elif path.name.isdigit() and (path / "state").is_dir():
        if step is not None and step != int(path.name):
            raise UserError(
                f"--step {step} contradicts the step dir {str(path)!r}; pass the work dir with --step, or the step "
                "dir alone"
            )
        checkpoints, step = path.parent, int(path.name)
    else:
        checkpoints = path
    steps = list_steps(checkpoints) if checkpoints.is_dir() else []
    if not steps:
        aside = next((path / name for name in (ASIDE, _MOVING) if (path / name).is_dir()), None)
        if aside is not None:
            raise UserError(
                f"no checkpoint found in {str(path)!r}: an `nnx-train --no-resume` that stopped before its first "
                f"checkpoint left the earlier run in {str(aside)!r}; nnx-train on this work dir without "
                "--no-resume puts it back"
            )
        if path.is_file() and path.suffix in (".yaml", ".yml"):
            where = (f"its work dir, {str(path.parent)!r}" if (path.parent / "checkpoints").is_dir() else
                     f"the work dir its run wrote (the config's workdir, else runs/{path.stem}, or the --workdir it "
                     "was trained with)")  # fmt: skip
            raise UserError(f"{str(path)!r} is a config file; pass {where}")
        if path.is_file():
            raise UserError(f"{str(path)!r} is a file; pass a work dir of nnx-train (it holds checkpoints/)")
        quarantined = re.fullmatch(r"(\d+)\.corrupt-\d+", path.name)
        if quarantined:
            raise UserError(
                f"{str(path)!r} is step {quarantined[1]} moved aside when it failed its checksums; it is kept for "
                f"you to inspect, not read; pass the work dir {str(path.parent.parent)!r} for its intact steps"
            )
        if (path / "adapter_config.json").is_file():
            raise UserError(
                f"{str(path)!r} is a PEFT adapter, not a run of nnx-train; a run starts from it with "
                f"checkpoint.init_from: {path} (and model.pretrained: its base model)"
            )
        raise UserError(
            f"no checkpoint found in {str(path)!r}; train first with nnx-train, or point at a work dir that has "
            "checkpoints/"
        )
    # an empty step dir (a save that never began writing) holds nothing to read
    available = ", ".join(str(s) for s in steps if any((checkpoints / str(s)).iterdir())) or "none"
    if best:
        step = _best_step(checkpoints, step)
        if step not in steps:
            raise UserError(
                f"--best: {str(checkpoints / BEST)!r} records step {step}, which is no longer there (pruned by a "
                f"later run without checkpoint.keep_best, or removed); pass --step, available steps: {available}"
            )
    if step is not None and step not in steps:
        raise UserError(f"--step {step}: no such checkpoint in {str(checkpoints)!r}; available steps: {available}")
    workdir = checkpoints.parent
    config = workdir / "config.yaml"
    if not config.is_file():
        raise UserError(
            f"{str(config)!r} is missing: the commands that read a run rebuild its model from the config nnx-train "
            "saved there"
        )
    from nnx_cli.registry import add_import_paths

    info = read_run_info(workdir)
    add_import_paths(info.get("import_paths", {}))  # the run's own plug-ins, wherever we are
    damaged = (
        f"; it is the config the run's checkpoints were trained with: restore it, or run nnx-train with the run's "
        f"config file and --workdir {str(workdir)!r}, which resumes and writes it again"
    )
    from nnx_cli.config import read_yaml

    try:
        saved = read_yaml(config)  # the file itself: unreadable, not UTF-8, not YAML, not a mapping
    except UserError as e:
        raise UserError(f"{e}{damaged}") from None
    if not saved:  # read as the defaults, it said the checkpoint "does not match the model"
        raise UserError(f"{str(config)!r} is empty{damaged}")
    cfg = load_config(config, overrides)
    from nnx_cli.data.tokenizers import BYTES, PRETRAINED

    # the run's relative paths (its data, a tokenizer.json beside it, a .gguf base) from wherever we are
    for key in ("data.source", "data.tokenizer", "model.pretrained"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in (BYTES, PRETRAINED) and not any(o.strip().startswith(f"{key}=") for o in overrides):
            setattr(getattr(cfg, section), name, _source_where_trained(value, info.get("cwd")))
    _check_tokenizer(cfg.data.tokenizer, info.get("tokenizer"), workdir)
    return Run(workdir, checkpoints, step, cfg)


def _tokenizer_record(name: str) -> dict[str, str] | None:
    """What run.json keeps of `data.tokenizer` when it is `bytes` or a tokenizer.json file: its name and version
    (a hash of its definition). None for a model directory's (its files are checksummed with its weights), a Hub
    id's, or a file that cannot be read."""
    from nnx_cli.data.tokenizers import BYTES, load_tokenizer

    if name != BYTES and not Path(name).expanduser().is_file():
        return None
    try:
        return {"name": name, "version": load_tokenizer(name).version}
    except UserError:
        return None  # a command that needs it says why; one that does not (an export to HF) goes on


def _check_tokenizer(name: str, trained: dict[str, str] | None, workdir: Path) -> None:
    """A UserError when `data.tokenizer` now tokenizes otherwise than the run's did: evaluating or generating
    with another vocabulary gave numbers and text of no meaning, with exit 0."""
    if trained is None:
        return
    now = _tokenizer_record(name)
    if now is None and name != trained["name"] and not Path(name).expanduser().is_file():
        # a model directory's or Hub id's tokenizer for a run of bytes or a tokenizer.json: it decoded the ids as
        # its own, with exit 0 (a tokenizer.json that cannot be read is said where it is read)
        raise UserError(
            f"config key 'data.tokenizer': {name!r} is not the tokenizer the run in {str(workdir)!r} trained with "
            f"({trained['name']!r}): its ids mean other text to the model; drop the override, or give the run's "
            "tokenizer"
        )
    if now is None or now["version"] == trained["version"]:
        return
    raise UserError(
        f"config key 'data.tokenizer': {name!r} is not the tokenizer the run in {str(workdir)!r} trained with "
        f"({trained['name']!r}, version {trained['version'][:12]}; this one is {now['version'][:12]}): its ids "
        "mean other text to the model; give the run's tokenizer (restore the file if it was replaced)"
    )


def closest_dir(path: Path) -> str:
    """` (did you mean 'runs/digits_vae'?)` for a directory beside the missing `path` with a close name, else ""."""
    siblings = [p.name for p in path.parent.iterdir() if p.is_dir()] if path.parent.is_dir() else []
    return did_you_mean(path.name, siblings, prefix=f"{path.parent}/" if str(path.parent) != "." else "")


def _source_where_trained(source: str, cwd: str | None) -> str:
    """A run's `data.source` (`data.tokenizer`, `model.pretrained`) given as a relative path is relative to where
    nnx-train ran (`run.json`'s `cwd`): from another directory it is that path, made absolute, when it is not found
    from here."""
    if not source or cwd is None or Path(source).is_absolute() or Path(source).exists():
        return source
    there = Path(cwd) / source
    return str(there) if there.exists() else source


def same_source(cfg_source: str, given: str, cwd: str | None) -> bool:
    """Whether `given` (a `data.source=` override) names the run's own local data (`cfg_source`, relative to the
    run's `cwd` when relative)."""
    ours = Path(_source_where_trained(cfg_source, cwd))
    return Path(given).exists() and ours.exists() and Path(given).resolve() == ours.resolve()


def _best_step(checkpoints: Path, step: int | None) -> int:
    if step is not None:
        raise UserError("--best and --step both pick a checkpoint: pass one of them")
    record = best_record(checkpoints)
    if record is None:
        raise UserError(
            f"--best: {str(checkpoints)!r} records no best step; train with checkpoint.keep_best="
            "'{metric: <eval metric>, mode: min}' (or max) to keep one"
        )
    return record["step"]


def best_record(checkpoints: Path) -> dict[str, Any] | None:
    """The best step kept by `checkpoint.keep_best` (`{"step", "metric", "mode", "value"}`), or None when there
    is none; a `best.json` that cannot be read is a UserError (taken for none, its step would be pruned)."""
    path = checkpoints / BEST
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        record["step"], record["value"] = int(record["step"]), float(record["value"])
        if not isinstance(record["metric"], str):
            raise TypeError(f"metric is {record['metric']!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        cause = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        raise UserError(
            f"{path} cannot be read ({cause}); it names the step checkpoint.keep_best keeps from pruning: restore "
            "it, or delete it to record the best anew (the steps it kept then follow checkpoint.keep)"
        ) from None
    return record


def write_best(checkpoints: Path, record: dict[str, Any]) -> None:
    _write_json(checkpoints / BEST, record)


# Keys that change how a run goes, not what it computes: a resume that changes them has the same config.
OPERATIONAL = (
    "workdir", "data.workers", "data.cache_dir", "data.on_device", "logging.loggers",
    "train.steps_per_dispatch", "train.profile", "checkpoint.async", "eval.harness",
)  # fmt: skip


def write_config(
    workdir: Path, config: dict[str, Any], step: int, say: Any = print, defaults: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Write the resolved `config.yaml`. Resuming at `step` with a config that differs from the saved one
    (beyond the operational keys, and keys the saved one lacks that hold their `defaults`) says what changed and
    keeps the earlier one as `config.<step>.yaml`. Returns the saved config it replaced (None on a fresh run):
    the one the steps so far ran with."""
    from nnx_cli.config import changes, dump_yaml, read_yaml

    path = workdir / "config.yaml"
    before = None
    if step > 0 and path.is_file():
        before = read_yaml(path)
        changed = changes(before, config, ignore=OPERATIONAL, defaults=defaults)
        if changed:
            kept = _free_name(workdir, f"config.{step}", ".yaml")
            dump_yaml(before, kept)
            say(f"the config changed since step {step}: {'; '.join(changed)} (the earlier one is kept as {kept})")
    dump_yaml(config, path)
    return before


def _free_name(directory: Path, stem: str, suffix: str) -> Path:
    """`directory/stem+suffix`, or with `-2`, `-3`, ... when that name is taken: nothing is overwritten."""
    path, n = directory / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = directory / f"{stem}-{n}{suffix}"
    return path


def write_run_info(workdir: Path, exp: Any) -> None:
    """`<workdir>/run.json`: what ran, where and with which versions (rewritten by each `nnx-train` of the work
    dir): package versions, devices, process count, the command line, git commits, plug-in import paths, the
    attention a language model runs, whether malloc asks for huge pages (:func:`nnx_cli.runtime.with_huge_pages`), and
    the model directory a run started from with the checksum of its weights."""
    import importlib.metadata
    import platform
    import sys

    import jax

    from nnx_cli.registry import import_paths
    from nnx_cli.runtime import huge_pages_active

    versions = {}
    for package in ("nnx", "jax", "jaxlib", "optax", "orbax-checkpoint", "datasets", "grain", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    devices = jax.devices()
    info = {
        "command": sys.argv,
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "packages": versions,
        "platform": devices[0].platform,
        "devices": [getattr(d, "device_kind", str(d)) for d in devices],
        "process_count": jax.process_count(),
        "mesh": dict(exp.mesh.shape),
        "git": {"nnx": _git_commit(Path(__file__).resolve().parent), "cwd": _git_commit(Path.cwd())},
        "import_paths": import_paths(),
        "huge_pages": huge_pages_active(),  # glibc's malloc asking for transparent huge pages (nnx_cli.runtime)
    }
    tokenizer = _tokenizer_record(exp.cfg.data.tokenizer) if exp.cfg.model.name == "transformer_lm" else None
    if tokenizer is not None:  # compared by the commands that read the run (_check_tokenizer)
        info["tokenizer"] = tokenizer
    attention = exp.attention()
    if attention is not None:  # which attention ran (model.attention resolved on this platform)
        info["attention"] = attention
    if getattr(exp, "pretrained", None) is not None:  # what the run started from, and the weights' checksum
        pretrained = exp.pretrained
        info["pretrained"] = {
            "source": pretrained.source,
            "directory": str(pretrained.directory),
            "architecture": pretrained.family.architecture,
            "files": [p.name for p in pretrained.weights.paths()],
            "checksum": pretrained.checksum,
        }
    _write_json(workdir / "run.json", info)


def _git_commit(directory: Path) -> str | None:
    """The commit of the git checkout `directory` is in, `+dirty` when it has changes; None outside one."""
    import subprocess

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def update_run_info(workdir: Path, extra: dict[str, Any]) -> None:
    """Add `extra` (such as the run's timings) to `run.json`."""
    _write_json(workdir / "run.json", {**read_run_info(workdir), **extra})


def read_run_info(workdir: Path) -> dict[str, Any]:
    """`run.json` of a work dir ({} for one written before it existed)."""
    path = workdir / "run.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=str) + "\n")
    partial.replace(path)
