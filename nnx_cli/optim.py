"""Optax optimizers and learning-rate schedules by name.

The `optimizer` section names any optax optimizer (a function of
`learning_rate`); its other keys are that function's keywords::

    optimizer:
      name: adamw
      weight_decay: 1.0e-4
      learning_rate: {name: warmup_cosine_decay, init_value: 0.0, peak_value: 1.0e-3, warmup_steps: 100}
      clip_grad_norm: 1.0

A schedule is any optax schedule, named with or without its `_schedule`
suffix; a `decay_steps` it requires but the config leaves out is the run's
total number of steps.
"""

from __future__ import annotations

import inspect as _pyinspect
from collections.abc import Callable
from typing import Any

import optax

from nnx_cli.config import OptimizerConfig
from nnx_cli.errors import UserError, did_you_mean
from nnx_cli.registry import bind_options, signature


def optimizer_names() -> list[str]:
    """Every optax function whose first parameter is `learning_rate`."""
    names = []
    for name in dir(optax):
        fn = getattr(optax, name)
        if name.startswith(("_", "scale_by")) or not _pyinspect.isfunction(fn) or name.endswith("schedule"):
            continue
        params = list(signature(fn).parameters)
        if params and params[0] == "learning_rate":
            names.append(name)
    return names


def schedule_names() -> list[str]:
    """Optax schedules, without their `_schedule` suffix."""
    return sorted(
        n.removesuffix("_schedule")
        for n in dir(optax)
        if n.endswith("_schedule") and not n.startswith("scale_by") and callable(getattr(optax, n))
    )


def build_optimizer(cfg: OptimizerConfig, total_steps: int | None) -> optax.GradientTransformation:
    """The optax transformation the `optimizer` section describes.

    With `total_steps=None` (run length unknown: checking a config, or
    restoring a checkpoint for eval) everything is validated and a schedule
    is replaced by a placeholder of the same kind, so the optimizer state has
    the structure of the real one.

    >>> tx = build_optimizer(OptimizerConfig(name="sgd", learning_rate=0.1, options={"momentum": 0.9}), 100)
    """
    names = optimizer_names()
    if cfg.name not in names:
        raise UserError(
            f"config key 'optimizer.name': unknown optax optimizer {cfg.name!r}{did_you_mean(cfg.name, names)}"
        )
    fn = getattr(optax, cfg.name)
    learning_rate = build_schedule(cfg.learning_rate, total_steps)
    kwargs = bind_options(
        fn,
        cfg.options,
        prefix="optimizer.",
        what=f"optax.{cfg.name}",
        skip=("learning_rate",),
        fixed=("name", "learning_rate", "clip_grad_norm"),
    )
    try:
        tx = fn(learning_rate=learning_rate, **kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(f"config section 'optimizer': optax.{cfg.name} rejected its arguments: {e}") from None
    if cfg.clip_grad_norm is not None:
        if cfg.clip_grad_norm <= 0:
            raise UserError(f"config key 'optimizer.clip_grad_norm' must be positive or null, got {cfg.clip_grad_norm}")
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), tx)
    return tx


def build_schedule(spec: float | dict[str, Any], total_steps: int | None) -> float | Callable[[Any], Any]:
    """A constant learning rate, or the optax schedule `{name: ..., **kwargs}` describes.

    `total_steps=None` checks the schedule and returns a placeholder schedule.
    """
    if not isinstance(spec, dict):
        return float(spec)
    spec = dict(spec)
    name = spec.pop("name", None)
    if not isinstance(name, str):
        raise UserError(
            "config key 'optimizer.learning_rate' is a mapping, so it needs a 'name' naming an optax schedule, "
            f"for example {{name: cosine_decay, init_value: 1.0e-3}}; known: {', '.join(schedule_names())}"
        )
    fn = getattr(optax, f"{name.removesuffix('_schedule')}_schedule", None)
    if fn is None:
        raise UserError(
            "config key 'optimizer.learning_rate.name': unknown optax schedule "
            f"{name!r}{did_you_mean(name, schedule_names())}"
        )
    params = signature(fn).parameters
    filled = (
        "decay_steps" in params
        and "decay_steps" not in spec
        and params["decay_steps"].default is _pyinspect.Parameter.empty
    )
    if filled:
        spec["decay_steps"] = total_steps
    kwargs = bind_options(fn, spec, prefix="optimizer.learning_rate.", what=f"optax.{fn.__name__}", fixed=("name",))
    if total_steps is None:
        return optax.constant_schedule(0.0)
    try:
        return fn(**kwargs)
    except (TypeError, ValueError) as e:
        note = f" (decay_steps is the run length, {total_steps} steps, when the config leaves it out)" if filled else ""
        raise UserError(
            f"config key 'optimizer.learning_rate': optax.{fn.__name__} rejected its arguments: {e}{note}"
        ) from None
