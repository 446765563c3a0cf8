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
import gc
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax
from jax.sharding import NamedSharding, PartitionSpec

from nnx_cli import steps
from nnx_cli.errors import UserError
from nnx_cli.sharding import put_replicated

_MAX_IN_FLIGHT = 2  # dispatches queued ahead of the one being computed
_AUTO_MAX_STEPS = 100  # auto never puts more steps than this in one dispatch
_COLLECT_ABOVE = 1 << 28  # a train state of this many bytes or more: collect Python's garbage after its first dispatch
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
    finite: Any = None  # whether the parameters were all finite after the last dispatch (a device scalar)

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
    first = True
    for hook in hooks:  # the few that act before the first dispatch (a profile of its steps)
        if hasattr(hook, "begin"):
            _call(hook, hook.begin, loop, hooks)
    for k, xs in feed:
        loop.state, loop.sums, loop.finite = dispatch(loop.state, loop.sums, xs)
        loop.step += k
        if first:
            first = False
            if sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(loop.state)) >= _COLLECT_ABOVE:
                gc.collect()  # tracing a large step leaves cyclic garbage that held 1.9 GB until a full collection
        in_flight.append(loop.finite)
        if len(in_flight) > _MAX_IN_FLIGHT:  # bound async dispatch: keeps collectives on few CPU cores from starving
            in_flight.popleft().block_until_ready()
        for hook in hooks:
            if loop.step % hook.every == 0 and loop.step < loop.total:
                _call(hook, hook.__call__, loop, hooks)
        if loop.stop_signal is not None:
            break
    close = getattr(feed, "close", None)
    if close is not None:
        close()  # input workers stop before the final hooks run
    for hook in hooks:
        _call(hook, hook.end, loop, hooks)
    return loop


def _call(hook: Hook, method: Any, loop: Loop, hooks: Sequence[Hook]) -> None:
    """`method` of `hook` at this step; where it fails (an eval whose reward function or harness task raised),
    the hooks that can (`rescue`: the checkpoint) first keep the step it trained, so the failure loses none."""
    from nnx_cli.runtime import PHASES

    try:
        with PHASES(getattr(hook, "phase", "train")):
            method(loop)
    except Exception:
        for other in hooks:
            if other is not hook and hasattr(other, "rescue"):
                other.rescue(loop)
        raise


def steps_per_dispatch(setting: int | str, intervals: dict[str, int], params: int, total: int = 0) -> int:
    """`train.steps_per_dispatch`: an explicit K must divide every interval (exit 2 otherwise); auto is the
    largest divisor of the intervals' (and the run length's) greatest common divisor that keeps a dispatch
    small for the model's size: at most 100 steps, and at most 20M parameter-steps."""
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
    g = math.gcd(*intervals.values(), total) if total else math.gcd(*intervals.values())
    return max(d for d in range(1, min(g, cap) + 1) if g % d == 0)


def inputs(exp: Any, layout: Any, plan: list[tuple[int, int]]) -> tuple[Iterator[tuple[int, Any]], Any]:
    """The dispatch inputs of `plan` (`(k, inputs)` pairs) and the jitted dispatch that takes them.

    With `data.on_device` (auto: when the stored split fits, see
    `pipeline.keep_on_device`) the training split is put on the devices once,
    and each dispatch gets only the int32 keys of its `k` batches; otherwise
    Grain reads the stored rows of each dispatch in `data.workers` processes
    and they are placed on the devices two dispatches ahead. An objective that
    makes its own batches gives its own feed and dispatch (GRPO: sampled
    completions, `layout` unused).
    """
    from nnx_cli.data import pipeline

    if hasattr(exp.objective, "inputs"):  # an objective that makes its own batches (GRPO samples them)
        return exp.objective.inputs(exp, plan, steps)
    split, cfg = exp.train, exp.cfg
    common = (steps.train_dispatch, exp.moduledef, exp.tx, exp.objective, cfg.seed, split.prepare)
    scalar = NamedSharding(exp.mesh, PartitionSpec())
    shardings = (exp.shardings, scalar)
    accum = cfg.train.grad_accum_steps
    if pipeline.keep_on_device(cfg.data.on_device, split, layout.sharding):
        stored = pipeline.place_stored(split, layout.sharding)
        fn = functools.partial(*common, split.read_on_device, accum=accum)
        jitted = jax.jit(
            fn,
            in_shardings=(*shardings, scalar, jax.tree.map(lambda a: a.sharding, stored)),
            out_shardings=(*shardings, scalar),
            donate_argnums=(0, 1),
        )
        keys = pipeline.BatchKeys(split, layout.size)
        feed = ((k, put_replicated(keys.dispatch(s, k), exp.mesh)) for s, k in plan)
        return feed, lambda state, sums, xs: jitted(state, sums, xs, stored)
    fn = functools.partial(*common, None, accum=accum)
    jitted = jax.jit(
        fn,
        in_shardings=(*shardings, layout.stacked_sharding),
        out_shardings=(*shardings, scalar),
        donate_argnums=(0, 1),
    )
    workers = pipeline.worker_count(cfg.data.workers)
    return _paired(plan, pipeline.device_feed(split, layout, plan, workers=workers)), jitted


def _paired(plan: list[tuple[int, int]], feed: Iterator[Any]) -> Iterator[tuple[int, Any]]:
    """`(k, inputs)` per dispatch; closing it (the loop does, also when it stops early) stops the workers."""
    try:
        yield from zip((k for _, k in plan), feed)
    finally:
        feed.close()
