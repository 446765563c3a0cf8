"""The `optimizer` section: an optax alias, your own factory, or a chain of optax pieces.

Three ways to say what updates the parameters, each checked against the
signatures it calls before anything runs::

    optimizer:                      # 1. any optax optimizer by name; other keys are its keywords
      name: adamw
      weight_decay: 0.1
      weight_decay_mask: kernels    # decay only parameters of two or more dimensions
      learning_rate: {name: warmup_cosine_decay, init_value: 0.0, peak_value: 1.0e-3, warmup_steps: 100}
      clip_grad_norm: 1.0

    optimizer:                      # 2. your own factory, imported from the current directory
      name: my_optim:make           # make(learning_rate, **keywords) -> optax.GradientTransformation
      momentum: 0.9

    optimizer:                      # 3. a chain of optax pieces, as optax's own aliases are built
      learning_rate: 3.0e-4
      chain:
        - {name: clip_by_global_norm, max_norm: 1.0}
        - {name: scale_by_adam, b2: 0.99}
        - {name: add_decayed_weights, weight_decay: 0.1}
        - {name: scale_by_learning_rate}   # takes optimizer.learning_rate

A piece or factory with a `learning_rate` parameter the config leaves out
gets `optimizer.learning_rate`. A schedule is any optax schedule, named with
or without its `_schedule` suffix; a `decay_steps` it requires but the
config leaves out is the run's total number of steps.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from nnx_cli.config import OptimizerConfig
from nnx_cli.config.schema import show
from nnx_cli.errors import UserError, did_you_mean, first_line
from nnx_cli.registry import Registry, bind_options, signature

Schedule = float | Callable[[Any], Any]
DEFAULT = "adam"
_FIXED = ("name", "learning_rate", "clip_grad_norm", "weight_decay_mask", "chain")


# its update takes the loss, its gradient and the loss function: no trainer step gives them
_NEEDS_THE_LOSS = ("lbfgs",)


def optimizer_names() -> list[str]:
    """Every optax function whose first parameter is `learning_rate`, but those whose update needs the loss."""
    names = []
    for name in dir(optax):
        fn = getattr(optax, name)
        if name.startswith(("_", "scale_by")) or not inspect.isfunction(fn) or name.endswith("schedule"):
            continue
        if name in _NEEDS_THE_LOSS:
            continue
        params = list(signature(fn).parameters)
        if params and params[0] == "learning_rate":
            names.append(name)
    return names


def _check_factory(obj: Any, name: str) -> None:
    if not callable(obj):
        raise UserError(
            f"config key 'optimizer.name': {name!r} is not callable; expected a function returning an optax "
            "GradientTransformation"
        )


OPTIMIZERS: Registry[Callable[..., optax.GradientTransformation]] = Registry(
    "optax optimizer", "optimizer.name", check=_check_factory
)
for _name in optimizer_names():
    OPTIMIZERS.register(_name, getattr(optax, _name))


def schedules() -> dict[str, Callable[..., Any]]:
    """Optax schedules (the functions of `optax.schedules`), by name without their `_schedule` suffix; not
    `join_schedules`, whose arguments are schedules, which a config cannot give."""
    return {
        n.removesuffix("_schedule"): fn
        for n, fn in sorted(vars(optax.schedules).items())
        if inspect.isfunction(fn) and not n.startswith(("_", "inject_")) and n != "join_schedules"
    }


def schedule_names() -> list[str]:
    """Optax schedules, without their `_schedule` suffix."""
    return list(schedules())


def build_optimizer(cfg: OptimizerConfig, total_steps: int | None) -> optax.GradientTransformation:
    """The optax transformation the `optimizer` section describes (see :func:`build`)."""
    return build(cfg, total_steps)[0]


def build(cfg: OptimizerConfig, total_steps: int | None) -> tuple[optax.GradientTransformation, Schedule]:
    """The optimizer and its learning rate (a constant or a schedule of the step), for logging.

    With `total_steps=None` (run length unknown: checking a config, or
    restoring a checkpoint for eval) everything is validated and a schedule
    is replaced by a placeholder of the same kind, so the optimizer state has
    the structure of the real one.

    >>> tx, lr = build(OptimizerConfig(name="sgd", learning_rate=0.1, options={"momentum": 0.9}), 100)
    """
    learning_rate = build_schedule(cfg.learning_rate, total_steps)
    mask = _kernels_only if cfg.weight_decay_mask == "kernels" else None
    if cfg.chain is not None:
        if cfg.name is not None:
            raise UserError(
                f"config keys 'optimizer.name' ({cfg.name!r}) and 'optimizer.chain' are both set: the chain is the "
                "whole optimizer, so set optimizer.name to null (or drop the chain)"
            )
        if cfg.options:
            key = next(iter(cfg.options))
            raise UserError(
                f"config key 'optimizer.{key}' does not apply to a chain: give it to the chain piece it belongs to"
            )
        if not cfg.chain:
            raise UserError(
                "config key 'optimizer.chain' is empty: list the optax pieces that make the optimizer, for example "
                "[{name: scale_by_adam}, {name: scale_by_learning_rate}], or set it to null and name an optimizer"
            )
        pieces = [_piece(p, i, learning_rate, mask) for i, p in enumerate(cfg.chain)]
        tx = optax.chain(*(piece for _, piece in pieces))
        _check_chain([fn for fn, _ in pieces], mask is not None)
    else:
        name = resolved_name(cfg)
        if name in _NEEDS_THE_LOSS:
            raise UserError(
                f"config key 'optimizer.name': optax.{name} takes the loss, its gradient and the loss function at "
                "each update (a line search), which a training step does not give it; pick another optimizer"
            )
        tx = _call(OPTIMIZERS.get(name), dict(cfg.options), learning_rate, mask, "optimizer.", _describe(name))
    if cfg.clip_grad_norm is not None:
        if cfg.clip_grad_norm <= 0:
            raise UserError(f"config key 'optimizer.clip_grad_norm' must be positive or null, got {cfg.clip_grad_norm}")
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), tx)
    return tx, learning_rate


def resolved_name(cfg: OptimizerConfig) -> str | None:
    """`optimizer.name`, where null means adam unless a chain is given."""
    return cfg.name if cfg.name is not None or cfg.chain is not None else DEFAULT


def _describe(name: str) -> str:
    return name if ":" in name else f"optax.{name}"


def _call(
    fn: Callable, options: dict[str, Any], learning_rate: Schedule, mask: Callable | None, prefix: str, what: str
) -> optax.GradientTransformation:
    """Call an optimizer factory or chain piece with its config keywords, the learning rate and the decay mask."""
    params = signature(fn).parameters
    plugin = ":" in what  # a factory of the user's: its annotations are plain types (optax's are aliases)
    kwargs = bind_options(
        fn, options, prefix=prefix, what=what, skip=("learning_rate",), fixed=_FIXED, check_types=plugin
    )
    if "learning_rate" in params:
        kwargs["learning_rate"] = learning_rate
    elif plugin and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        from nnx_cli.data.sources import notice

        notice(("learning_rate", what), f"notice: {what} takes no learning_rate: optimizer.learning_rate is not used "
               "(the learning_rate logged is the config's)")  # fmt: skip
    if mask is not None:
        parameter = decay_mask_parameter(fn)
        if parameter is None:
            raise UserError(
                f"config key 'optimizer.weight_decay_mask' is kernels, but {what} takes no weight-decay mask; "
                "use an optimizer with weight decay (adamw, lion, ...) or add_decayed_weights in optimizer.chain"
            )
        if parameter in options:  # it was kept, and weight_decay_mask silently dropped
            raise UserError(
                f"config keys '{prefix}{parameter}' and 'optimizer.weight_decay_mask' both say which parameters "
                f"{what} decays; drop one"
            )
        kwargs[parameter] = mask
    try:
        tx = fn(**kwargs)
    except (TypeError, ValueError) as e:
        raise UserError(f"config section {prefix.rstrip('.')!r}: {what} rejected its arguments: {e}") from None
    except UserError:
        raise
    except Exception as e:  # a plug-in factory's own mistake
        raise UserError(
            f"config key {prefix + 'name'!r}: {what} raised {type(e).__name__}: {first_line(e)}; fix it, or name "
            "another optimizer"
        ) from None
    if not isinstance(tx, optax.GradientTransformation):
        raise UserError(
            f"config section {prefix.rstrip('.')!r}: {what} returned {type(tx).__name__}, not an optax "
            "GradientTransformation"
        )
    return tx


def _check_chain(functions: list[Callable], masked: bool) -> None:
    """For the chain of optax `functions`: no weight decay for `weight_decay_mask: kernels` is a UserError (the
    key did nothing); no piece that takes the learning rate gets a notice: `optimizer.learning_rate`, logged, is
    not used."""
    if masked and not any(decay_mask_parameter(fn) for fn in functions):
        raise UserError(
            "config key 'optimizer.weight_decay_mask' is kernels, but no piece of optimizer.chain has weight decay; "
            "add {name: add_decayed_weights, weight_decay: ...} (or use a piece with weight decay, such as adamw)"
        )
    if not any("learning_rate" in signature(fn).parameters for fn in functions):
        from nnx_cli.data.base import notice

        notice(("learning_rate", "chain"), "notice: no piece of optimizer.chain takes a learning_rate "
               "(scale_by_learning_rate does): optimizer.learning_rate is not used (the learning_rate logged is the "
               "config's), and the chain's own scaling sets the step")  # fmt: skip


def _piece(
    spec: dict[str, Any], index: int, learning_rate: Schedule, mask: Callable | None
) -> tuple[Callable, optax.GradientTransformation]:
    """One `optimizer.chain` entry, `{name: <optax function or package.module:fn>, **keywords}`: the function it
    names, and what it made."""
    key = f"optimizer.chain[{index}]"
    options = dict(spec)
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise UserError(
            f"config key {key!r} needs a 'name': an optax function such as scale_by_adam, or package.module:fn"
        )
    fn = _piece_function(name, key)
    return fn, _call(fn, options, learning_rate, mask if decay_mask_parameter(fn) else None, f"{key}.", _describe(name))


def _piece_function(name: str, key: str) -> Callable:
    """The function a chain piece names: an optax function, or `package.module:fn`."""
    if ":" in name:
        return Registry("chain piece", f"{key}.name", check=_check_factory).get(name)
    fn = getattr(optax, name, None)
    if not callable(fn) or name.startswith("_"):
        pieces = [n for n in dir(optax) if not n.startswith("_") and callable(getattr(optax, n))]
        raise UserError(f"config key '{key}.name': unknown optax function {name!r}{did_you_mean(name, pieces)}")
    return fn


def decay_mask_parameter(fn: Callable) -> str | None:
    """The parameter of an optax function that says which parameters its weight decay applies to: `mask` beside
    `weight_decay` (adamw, lion, add_decayed_weights, ...), adafactor's `weight_decay_mask`; None when it has no
    weight decay (`masked` and `freeze` take a mask of another meaning)."""
    params = signature(fn).parameters
    if "mask" in params and "weight_decay" in params:
        return "mask"
    return "weight_decay_mask" if "weight_decay_mask" in params else None


def _kernels_only(params: Any) -> Any:
    """The `kernels` weight-decay mask: True for weight matrices and embeddings, False for biases and norm
    scales. A parameter counts as a matrix with two or more dimensions besides the `layers` axis that stacks
    scanned layers, unless it is named `bias` or `scale` (an attention bias is `(heads, head_dim)`)."""

    def decays(path: tuple, node: Any) -> Any:
        value = getattr(node, "value", node)
        stacked = "layers" in (getattr(node, "sharding", None) or ())
        name = str(getattr(path[-1], "key", path[-1])).rsplit("/", 1)[-1]
        mask = name not in ("bias", "scale") and value.ndim - stacked >= 2
        return node.replace(value=mask) if hasattr(node, "replace") else mask

    return jax.tree_util.tree_map_with_path(decays, params, is_leaf=lambda x: hasattr(x, "value"))


def build_schedule(spec: float | dict[str, Any], total_steps: int | None) -> Schedule:
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
    fn = schedules().get(name.removesuffix("_schedule"))
    if fn is None:
        raise UserError(
            "config key 'optimizer.learning_rate.name': unknown optax schedule "
            f"{name!r}{did_you_mean(name, schedule_names())}"
        )
    params = signature(fn).parameters
    filled = (
        "decay_steps" in params
        and "decay_steps" not in spec
        and params["decay_steps"].default is inspect.Parameter.empty
    )
    if filled:
        spec["decay_steps"] = total_steps
    kwargs = bind_options(fn, spec, prefix="optimizer.learning_rate.", what=f"optax.{fn.__name__}", fixed=("name",))
    for key, value in kwargs.items():  # optax takes a negative count for a constant rate, with a log line at most
        counts = key.endswith("steps") or key == "transition_begin"
        if counts and isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise UserError(f"config key 'optimizer.learning_rate.{key}' counts steps: 0 or more, got {show(value)}")
    if total_steps is None:
        return optax.constant_schedule(0.0)
    try:
        schedule = fn(**kwargs)
    except (TypeError, ValueError) as e:
        warmup, decay = kwargs.get("warmup_steps"), kwargs.get("decay_steps")
        if isinstance(warmup, int) and isinstance(decay, int) and warmup >= decay:  # optax names decay - warmup
            what = f"the run length, {total_steps} steps, as the config leaves it out" if filled else "its own"
            fix = "raise train.steps" if filled else "raise optimizer.learning_rate.decay_steps"
            raise UserError(
                f"config key 'optimizer.learning_rate': warmup_steps ({warmup}) must be below decay_steps ({decay}: "
                f"{what}), which counts the warmup too; lower optimizer.learning_rate.warmup_steps or {fix}"
            ) from None
        raise UserError(
            f"config key 'optimizer.learning_rate': optax.{fn.__name__} rejected its arguments: {e}"
        ) from None
    _check_rates(schedule, total_steps)
    return schedule


def _check_rates(schedule: Schedule, total_steps: int) -> None:
    """A UserError when the schedule gives a negative or non-finite rate at some step of the run (a constant's
    sign is checked with the config): looked at on up to 4,097 steps, the first and the last among them."""
    steps = np.unique(np.linspace(0, max(total_steps - 1, 0), num=min(total_steps, 4097), dtype=np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an overflow is reported below, as a rate that is not finite
        rates = np.asarray(jax.jit(jax.vmap(schedule))(steps), dtype=np.float64)  # one program (onecycle: 3 s eager)
    bad = np.flatnonzero(~np.isfinite(rates) | (rates < 0))
    if bad.size:
        step, rate = int(steps[bad[0]]), float(rates[bad[0]])
        raise UserError(
            f"config key 'optimizer.learning_rate': the schedule gives {rate:g} at step {step + 1}; a learning rate "
            "must be a finite number, zero or more (a negative rate climbs the loss)"
        )


def learning_rate_at(schedule: Schedule, step: int) -> float:
    """The learning rate of update number `step` (0-based), as a Python float."""
    return float(schedule(step)) if callable(schedule) else float(schedule)
