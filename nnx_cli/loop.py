"""The training loop: jitted dispatches of `k` steps over pure state, and hooks at their intervals.

    loop = Loop(exp, state, sums, step=start, total=exp.total_steps)
    run(loop, feed, hooks)      # for each dispatch: k train steps; then every hook whose interval it reached

A hook (:class:`Hook`) runs after every dispatch that ends on a multiple of
its `every` steps, and once more at the end (`end`), also when a signal stops
the run early. Logging, evaluation, checkpoints, image grids and the stop
vote are all hooks (`nnx_cli/hooks.py`).

The unit of work is one dispatch: `k` optimizer steps in one `lax.scan`
(`train.steps_per_dispatch`), so the host stays ahead of the devices. Every
hook interval is a multiple of `k`; a run whose start or end falls between
multiples takes single steps there.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from nnx_cli import steps
from nnx_cli.errors import UserError

_MAX_IN_FLIGHT = 2  # dispatches queued ahead of the one being computed
_AUTO_MAX_STEPS = 100  # auto never puts more steps than this in one dispatch
_AUTO_PARAM_STEPS = 20_000_000  # ... nor more than this many parameters x steps


@dataclasses.dataclass
class Loop:
    """What the hooks see and change: the state and where the run is."""

    exp: Any  # nnx_cli.experiment.Experiment
    state: steps.TrainState
    sums: dict[str, Any]
    step: int
    total: int
    start: int = 0
    stop_signal: int | None = None  # set by the stop vote: the run ends after this dispatch

    def __post_init__(self) -> None:
        self.start = self.step


class Hook(Protocol):
    """Something the loop does every `every` steps (a multiple of the steps per dispatch), and at the end."""

    every: int

    def __call__(self, loop: Loop) -> None: ...

    def end(self, loop: Loop) -> None: ...


def run(loop: Loop, feed: Iterable[tuple[int, Any]], dispatch: Any, hooks: Sequence[Hook]) -> Loop:
    """Run the dispatches `feed` yields (`(k, inputs)`) through `dispatch`, then the hooks; then `end` them."""
    in_flight: collections.deque = collections.deque()
    for k, xs in feed:
        loop.state, loop.sums, loss = dispatch(loop.state, loop.sums, xs)
        loop.step += k
        in_flight.append(loss)
        if len(in_flight) > _MAX_IN_FLIGHT:  # bound async dispatch: keeps collectives on few CPU cores from starving
            in_flight.popleft().block_until_ready()
        for hook in hooks:
            if loop.step % hook.every == 0 and loop.step < loop.total:
                hook(loop)
        if loop.stop_signal is not None:
            break
    for hook in hooks:
        hook.end(loop)
    return loop


def plan(start: int, total: int, k: int) -> Iterator[int]:
    """Dispatch lengths from step `start` to `total`: `k` steps each, aligned to multiples of `k`, single
    steps where the start or the end falls between multiples."""
    step = start
    while step < total:
        n = k if step % k == 0 and step + k <= total else 1
        yield n
        step += n


def steps_per_dispatch(setting: int | str, intervals: dict[str, int], params: int) -> int:
    """`train.steps_per_dispatch`: an explicit K must divide every interval (exit 2 otherwise); auto is the
    largest divisor of their greatest common divisor that keeps a dispatch small for the model's size."""
    if setting != "auto":
        k = int(setting)
        for key, every in intervals.items():
            if every % k:
                raise UserError(
                    f"config key 'train.steps_per_dispatch' ({k}) must divide {key} ({every}): logs, evals, "
                    "checkpoints and the stop check happen between dispatches; pick a divisor, or auto"
                )
        return k
    cap = max(1, min(_AUTO_MAX_STEPS, _AUTO_PARAM_STEPS // max(params, 1)))
    g = math.gcd(*intervals.values())
    return max(d for d in range(1, min(g, cap) + 1) if g % d == 0)


def host_feed(
    split: Any, layout: Any, start: int, total: int, k: int, batch_size: int, *, prefetch: int = 2
) -> Iterator[tuple[int, Any]]:
    """Dispatch inputs read on the host: this process's rows of `n` batches, stacked and placed on the devices.

    Batch `i` of epoch `e` holds the examples `split.epoch_keys(e)[i * B:(i + 1) * B]`.
    """
    from nnx_cli.data import prefetch as _prefetch

    per_epoch = split.steps_per_epoch(batch_size)
    keys = _EpochKeys(split)

    def produce(item: tuple[int, int]) -> tuple[int, Any]:
        step, n = item
        rows = [split.read(keys.batch(s, per_epoch, batch_size)[layout.rows]) for s in range(step, step + n)]
        stacked = {name: np.stack([r[name] for r in rows]) for name in rows[0]}
        return n, layout.place(stacked, stacked=True)

    return _prefetch(produce, list(_starts(start, total, k)), size=prefetch)


def _starts(start: int, total: int, k: int) -> Iterator[tuple[int, int]]:
    step = start
    for n in plan(start, total, k):
        yield step, n
        step += n


class _EpochKeys:
    """`split.epoch_keys(e)` for the epoch at hand, computed once per epoch."""

    def __init__(self, split: Any):
        self.split = split
        self.epoch: int | None = None
        self.keys: np.ndarray | None = None

    def batch(self, step: int, per_epoch: int, batch_size: int) -> np.ndarray:
        epoch, i = divmod(step, per_epoch)
        if epoch != self.epoch:
            self.epoch, self.keys = epoch, self.split.epoch_keys(epoch)
        assert self.keys is not None
        return self.keys[i * batch_size : (i + 1) * batch_size]


def compile_dispatch(exp: Any, layout: Any) -> Any:
    """The jitted dispatch `(state, sums, xs) -> (state, sums, loss)`; it compiles once per distinct number of
    steps in `xs` (at most two: K, and single steps)."""
    scalar = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
    fn = functools.partial(
        steps.train_dispatch,
        exp.moduledef,
        exp.tx,
        exp.loss_metric,
        exp.cfg.seed,
        exp.train.prepare,
        None,
        accum=exp.cfg.train.grad_accum_steps,
    )
    jitted = jax.jit(
        fn,
        in_shardings=(exp.shardings, scalar, layout.stacked_sharding),
        out_shardings=(exp.shardings, scalar, scalar),
        donate_argnums=(0, 1),
    )
    return jitted
