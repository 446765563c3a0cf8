"""Which checkpoint a command uses: the newest step that verifies, can be read and holds finite values.

Every command that reads a work dir (`nnx-train` resuming, `nnx-eval`,
`nnx-inspect`, `nnx-generate`) goes through :func:`choose`. A step whose
files no longer match their checksums, that Orbax cannot read, or that
restores to NaN or infinity is reported on one line and the next older step
is tried. A step written before checksums existed is used, with a warning,
when it restores and is finite. Only `nnx-train`, which holds the work dir's
lock, moves bad steps away (`<step>.corrupt-<n>`, see
`integrity.quarantine`) so that they are not tried again; the read-only
commands change nothing::

    found = choose(ckpt_dir, lambda step: read_state(checkpointer, step, target), say=console.print)
    if found.step is None: ...            # no checkpoint, or none usable (found.rejected says why)
    step, state = found.step, found.value
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import jax

from nnx_cli import integrity
from nnx_cli.checkpoint import Unreadable
from nnx_cli.errors import UserError

T = TypeVar("T")


class Unusable(Exception):
    """A checkpoint that restored but cannot be used (non-finite values); the message says why."""


@dataclasses.dataclass
class Found(Generic[T]):
    step: int | None  # None: no usable step
    value: T | None
    rejected: list[tuple[int, str]]  # newer steps that could not be used, and why


def choose(
    directory: Path,
    read: Callable[[int], T],
    *,
    step: int | None = None,
    say: Callable[[str], None] = print,
    pick: str = "pick another --step",
) -> Found[T]:
    """The newest usable step of `directory` (or exactly `step`) and what `read(step)` returned.

    `read` restores what the command needs and raises `Unreadable` or
    `Unusable` for a bad step. With `step` given, a bad step is a UserError
    naming what failed, and how to `pick` another; otherwise each bad step is said on one line and the
    next older one is tried; `Found.step` is None when no step is usable.
    """
    candidates = [step] if step is not None else list(reversed(integrity.steps(directory)))
    rejected: list[tuple[int, str]] = []
    tried: set[int] = set()
    while candidates:
        candidate = candidates.pop(0)
        tried.add(candidate)
        step_dir = directory / str(candidate)
        try:
            check = integrity.verify(step_dir)
            problem = check.problem if check.status is integrity.Status.DAMAGED else None
            if problem is None:
                try:
                    value = read(candidate)
                except (Unreadable, Unusable) as e:
                    problem = str(e).removeprefix(f"checkpoint {step_dir.absolute()} ")
                else:
                    if check.status is integrity.Status.NO_CHECKSUMS:
                        say(
                            f"warning: checkpoint {step_dir} has no checksums to verify (written before nnx-train "
                            "kept them, or stopped before sealing it); it restores and is finite, so it is used"
                        )
                    return Found(candidate, value, rejected)
        except Exception:  # a file gone while it was hashed, metadata read half-pruned: the step went meanwhile
            if step_dir.exists():
                raise
            problem = "it was removed while read (a run still training pruned it)"
        if step is not None:
            raise UserError(f"checkpoint {step_dir} cannot be used: {problem}; {pick}")
        if not step_dir.exists():  # removed while read: a run still training pruned it, and may have written newer
            candidates = [s for s in reversed(integrity.steps(directory)) if s not in tried]
            continue
        say(f"checkpoint {step_dir} cannot be used: {problem}; trying the one before it")
        rejected.append((candidate, problem))
    return Found(None, None, rejected)


def quarantine(directory: Path, rejected: list[tuple[int, str]], say: Callable[[str], None]) -> None:
    """Move the rejected steps aside (`<step>.corrupt-<n>`), never deleting or overwriting anything.

    For `nnx-train` only (it holds the work dir's lock), on process 0.
    """
    for step, _ in rejected:
        moved = integrity.quarantine(directory / str(step))
        say(f"moved the unusable checkpoint {directory / str(step)} to {moved}")


def read_state(checkpointer: Any, step: int, target: Any) -> Any:
    """Restore the train state at `step` into `target`; `Unusable` when it holds NaN or infinity."""
    from nnx_cli import steps

    state = checkpointer.restore(step, target)
    if not bool(jax.jit(steps.all_finite)(state)):
        raise Unusable(f"checkpoint {checkpointer.directory / str(step)} restores to non-finite values")
    return state


def no_usable_step(directory: Path, rejected: list[tuple[int, str]], fix: str) -> UserError:
    """The error when a work dir has checkpoints but none can be used: each with its reason, and `fix`."""
    reasons = "; ".join(f"{step}: {problem}" for step, problem in rejected)
    return UserError(f"no usable checkpoint in {directory} ({reasons}); {fix}")


def from_run(
    run: Any, read: Callable[[Any, int], T], say: Callable[[str], None], pick: str = "pick another --step"
) -> tuple[int, T]:
    """For the read-only commands: the run's requested step, or its newest usable one, and `read(checkpointer,
    step)`. Nothing in the work dir changes."""
    from nnx_cli.checkpoint import Checkpointer

    reader = Checkpointer(run.checkpoints, read_only=True)
    try:
        found = choose(run.checkpoints, lambda step: read(reader, step), step=run.step, say=say, pick=pick)
    finally:
        reader.close()
    if found.step is None:
        raise no_usable_step(
            run.checkpoints,
            found.rejected,
            "train again with nnx-train --no-resume in that work dir (it sets them aside, and deletes them once the "
            "new run has a checkpoint), or in a new --workdir",
        )
    return found.step, found.value
