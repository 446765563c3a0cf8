"""A training run's work dir: checked and locked by `nnx-train`, found by `nnx-eval` and `nnx-inspect`.

Layout written by `nnx-train`::

    <workdir>/config.yaml          the fully resolved config (input shape included)
    <workdir>/checkpoints/<step>/  Orbax checkpoints
    <workdir>/metrics.jsonl        train logs and evals
    <workdir>/images/<step>.png    reconstructions and samples of image models
    <workdir>/.lock                held by the nnx-train writing the work dir
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from nnx_cli.config import Config, load_config
from nnx_cli.errors import UserError

_LAYOUT = {"checkpoints": "a directory", "images": "a directory", "metrics.jsonl": "a file", "config.yaml": "a file"}


def check_workdir(workdir: Path) -> None:
    """Make sure `nnx-train` can use `workdir` (creating it if needed), before any data is loaded."""
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"work dir {str(workdir)!r} is a file; pass --workdir with a directory")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create work dir {str(workdir)!r}: {e.strerror or e}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise UserError(f"work dir {str(workdir)!r} is not writable")
    for name, kind in _LAYOUT.items():
        path = workdir / name
        if path.exists() and path.is_dir() != (kind == "a directory"):
            raise UserError(f"{str(path)!r} should be {kind}; move it away or pass another --workdir")


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
    step: int
    cfg: Config


def open_run(target: str | Path, overrides: Sequence[str] = (), step: int | None = None) -> Run:
    """Resolve a work dir, its `checkpoints/` dir or one step dir to a checkpoint and its config.

    `step` (or the step dir named) picks a checkpoint; by default the latest.
    Raises UserError when there is no checkpoint or no config to be found.
    """
    from nnx_cli.checkpoint import Checkpointer

    path = Path(target)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist; expected a work dir written by nnx-train")
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
    steps = Checkpointer(checkpoints, read_only=True).all_steps() if checkpoints.is_dir() else []
    if not steps:
        raise UserError(
            f"no checkpoint found in {str(path)!r}; train first with nnx-train, or point at a work dir that has "
            "checkpoints/"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(
            f"--step {step}: no such checkpoint in {str(checkpoints)!r}; available steps: {', '.join(map(str, steps))}"
        )
    workdir = checkpoints.parent
    config = workdir / "config.yaml"
    if not config.is_file():
        raise UserError(
            f"{str(config)!r} is missing: nnx-eval and nnx-inspect rebuild the model from the config nnx-train saved "
            "there"
        )
    from nnx_cli.registry import add_import_paths

    add_import_paths(read_run_info(workdir).get("import_paths", {}))  # the run's own plug-ins, wherever we are
    return Run(workdir, checkpoints, step, load_config(config, overrides))


def write_run_info(workdir: Path, exp: Any) -> None:
    """`<workdir>/run.json`: what ran, where and with which versions (rewritten by each `nnx-train` of the work
    dir): package versions, devices, process count, the command line, git commits, plug-in import paths."""
    import importlib.metadata
    import platform
    import sys

    import jax

    from nnx_cli.registry import import_paths

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
