"""A training run's work dir, as `nnx-eval` and `nnx-inspect` find it.

Layout written by `nnx-train`::

    <workdir>/config.yaml          the fully resolved config (input shape included)
    <workdir>/checkpoints/<step>/  Orbax checkpoints
    <workdir>/metrics.jsonl        train logs and evals
    <workdir>/images/<step>.png    reconstructions and samples of image models
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from nnx_cli.config import Config, load_config
from nnx_cli.errors import UserError


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
        checkpoints, step = path.parent, int(path.name) if step is None else step
    else:
        checkpoints = path
    steps = Checkpointer(checkpoints, read_only=True).all_steps() if checkpoints.is_dir() else []
    if not steps:
        raise UserError(f"no checkpoint found in {str(path)!r}; train first with nnx-train, or point at a work dir that has checkpoints/")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"--step {step}: no such checkpoint in {str(checkpoints)!r}; available steps: {', '.join(map(str, steps))}")
    workdir = checkpoints.parent
    config = workdir / "config.yaml"
    if not config.is_file():
        raise UserError(f"{str(config)!r} is missing: nnx-eval and nnx-inspect rebuild the model from the config nnx-train saved there")
    return Run(workdir, checkpoints, step, load_config(config, overrides))
