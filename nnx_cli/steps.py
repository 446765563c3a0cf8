"""The pure functions a run jits: init, train step, eval step, image step.

The train state is a plain dict pytree::

    {"step": int32[], "params": State, "opt_state": optax state, "rest": State}

`params` is what trains, `rest` every non-`Param` collection (batch
statistics, ...). A model with low-rank adapters (`nnx.LoRAParam`) trains
those alone: `params` holds the adapters, the optimizer state exists for
them only, and the parameters they adapt sit under `"frozen"`, where no
gradient is taken and from where no checkpoint writes them (they come back
from the base model). The model is partitioned once; each step runs
`moduledef.apply(params, [frozen,] rest)` on pure states. A quantised base
(`nnx.QuantizedParam`, `model.quantize`) is always frozen, adapters or not.

What a step minimises is the run's objective (:mod:`nnx_cli.objectives`):
per-row metrics of the model on a batch, the same step for every objective.
An objective that needs a reference model (pi_ref, DPO's) gets the model the
run started from, frozen: under adapters the same weights with the adapters
off; otherwise a copy of the starting parameters the state keeps under
`"reference"`, never trained and never checkpointed (a resumed run reads it
again from where the run started).

A model's metrics may include `weight`, a per-example weight of the
averages (the target tokens of a fine-tuning row): training minimises the
weighted mean of the loss and evals report weighted means, so they are per
target token. Randomness is a function of `(seed, stream, index)`: training step
`s` uses `(seed, 0, s)`, eval batch `i` uses `(seed, 1, i)`, so a resumed
run draws exactly the keys an uninterrupted one would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnx
from nnx_cli import sharding
from nnx_cli.errors import UserError, did_you_mean, first_line
from nnx_cli.models.transformer.residuals import packs
from nnx_cli.objectives import Objective, resolve

TrainState = dict[str, Any]
_TRAIN, _EVAL, _IMAGES = 0, 1, 2
FROZEN = "frozen"
"""The train state's key for the parameters that adapters adapt: never trained, never checkpointed."""
REFERENCE = "reference"
"""The train state's key for a copy of the starting parameters, when the objective's reference needs one."""
WEIGHT = "weight"
"""The metric that weights the others' averages (see the module docstring)."""


def init_state(
    build: Callable[[nnx.Context], nnx.Module], tx: optax.GradientTransformation, seed: int, reference: bool = False
) -> tuple[nnx.ModuleDef, TrainState]:
    """Build the model and optimizer state. Run it under `jax.eval_shape` for shapes only.

    `reference`: also keep the parameters that train, as they start, under :data:`REFERENCE`."""
    model = build(nnx.context(seed))
    if len(model.filter(nnx.LoRAParam)) or len(model.filter(nnx.QuantizedParam)):  # adapters train, the rest frozen
        (params, frozen, rest), moduledef = model.partition(nnx.LoRAParam, nnx.Param, ...)
        extra = {FROZEN: frozen}
    else:
        (params, rest), moduledef = model.partition(nnx.Param, ...)
        extra = {}
    if reference:
        extra[REFERENCE] = params
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params), "rest": rest}
    return moduledef, {**state, **extra}


def jit_drawing(fun: Callable, **jit_kwargs: Any) -> Callable:
    """`jax.jit(fun, **jit_kwargs)` for a program that draws initial values and runs once per process.

    On a CPU it is compiled at XLA's optimisation level 0 whatever `XLA_FLAGS` say: a program that runs once
    gains nothing from an optimised backend (the test LM's initialiser compiles in 1.4 s instead of 3.9), and
    its values no longer depend on the flags (the optimised backend rounds some draws another way). So a run,
    its resumption (which draws the reference or a frozen base again) and the test suite's processes (which
    compile at level 0) all start from the same values. Every program that draws from the seed goes through
    here, or a resumed run would not find the values it started from. Call the result outside any transformation
    (JAX takes compiler options at the top level only); under `jax.eval_shape` use :func:`init_state` itself."""
    if nnx.spmd.platform() == "cpu":
        jit_kwargs["compiler_options"] = {"xla_backend_optimization_level": 0}
    return jax.jit(fun, **jit_kwargs)


def model_states(state: TrainState, params: Any = None, rest: Any = None, *, bits: bool = False) -> tuple[Any, ...]:
    """The states `moduledef.apply` takes: `params` (default: the state's), the frozen ones if any, `rest`.
    Frozen parameters held as their bits (:func:`frozen_as_bits`) are given in bfloat16 again (free inside a
    jitted function, a copy outside one), or as they are held with `bits` (for a jitted function that calls
    :func:`stored` on them itself)."""
    frozen = (state[FROZEN] if bits else stored(state[FROZEN]),) if FROZEN in state else ()
    return (state["params"] if params is None else params, *frozen, state["rest"] if rest is None else rest)


def parameters(state: TrainState) -> nnx.State:
    """Every parameter of the model, frozen ones included: what decoding runs on. Those the state holds as their
    bits (a 16-bit base on a CPU, :func:`frozen_as_bits`) come back in bfloat16, each in the bits' own memory on
    one CPU device (:func:`_bfloat16_view`), else a copy.

    The Samples hook decodes on these with each eval: converted, they were a copy of the 16-bit base beside the
    train state, on top of the decoder's own per-layer copy of it."""
    return state["params"] | jax.tree.map(_bfloat16_view, state[FROZEN]) if FROZEN in state else state["params"]


def _bfloat16_view(x: Any) -> Any:
    """A concrete `uint16` array (bfloat16 bits) on one CPU device as a bfloat16 array in the same memory
    (:func:`.sharding.same_memory`); anything else through :func:`stored`. The view is only read, and dropped
    before the state it shares memory with is given to the next step."""
    if x.dtype != jnp.uint16 or isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return stored(x)
    view = sharding.same_memory(x, jnp.bfloat16)
    return stored(x) if view is None else view


def frozen_as_bits(frozen: Any) -> Any:
    """On a CPU, `frozen` (a train state's frozen parameters, given up by the caller) as a step holds it: every
    array in a buffer of XLA's own, and where that CPU widens bfloat16 (:func:`.residuals.packs`: up to JAX
    0.10) its bfloat16 arrays (a 16-bit base, `model.quantize`) as their bits, `uint16`; elsewhere `frozen` as it
    is. Undone by :func:`stored`.

    XLA's CPU backend up to JAX 0.10 has no bfloat16 `dynamic-slice`: a step slices a layer's kernels out of their
    stack, and the loss blocks of the embedding table, as bits (:func:`.dense.frozen_kernels_as_bits`). Given bfloat16
    parameters, the step copied each stack and the table into bits every step (680 MB at Qwen2.5-0.5B's
    shapes, at the step's peak); given the bits, XLA folds the conversion there and back away and slices the
    parameters as they are: the step's temporaries 1,664 -> 979 MiB, a 4-bit base's step 0.84x the time (the
    loss in vocabulary blocks, which a 16-bit table did not take for that copy).

    The loader hands the base over in memory of its own (no copy on a CPU), and a step can only donate XLA's
    buffers: given such an array, a donated step would copy it every time. So each array is converted, or
    copied, on its own and the given one let go as soon as it is (the memory of one array more at a time)."""
    if nnx.spmd.platform() != "cpu":
        return frozen
    return jax.tree.map(_held if packs() else _owned, frozen)


def owned(tree: Any) -> Any:
    """On a CPU, `tree`'s arrays (given up by the caller) each in a buffer of XLA's own: the loader's arrays
    (memory of its own, see :func:`frozen_as_bits`) copied one at a time and let go, XLA's passed on as they
    are. Elsewhere `tree` as it is."""
    return jax.tree.map(_owned, tree) if nnx.spmd.platform() == "cpu" else tree


@functools.partial(jax.jit, donate_argnums=0)
def _held(x: jax.Array) -> jax.Array:
    # donated: a buffer of XLA's own is reused (bits or not); one the loader made from its own memory is copied
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


_owned = jax.jit(lambda x: x, donate_argnums=0)


def stored(tree: Any) -> Any:
    """`tree` with its `uint16` arrays (bfloat16 bits, :func:`frozen_as_bits`) in bfloat16 again."""
    return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x, tree)


def trainable(state: TrainState) -> TrainState:
    """The state without its frozen parameters (nor the reference's copy): what a checkpoint holds."""
    return {k: v for k, v in state.items() if k not in (FROZEN, REFERENCE)}


def reference_model(moduledef: nnx.ModuleDef, state: TrainState) -> nnx.Module:
    """pi_ref, the model the run started from, frozen (no gradient reaches it): the parameters kept under
    :data:`REFERENCE`, else, under adapters, the same weights with the adapters off (zero: their update is
    exactly zero, so the model computes what its base computes)."""
    if REFERENCE in state:
        params = state[REFERENCE]
    elif FROZEN in state:
        params = jax.tree.map(jnp.zeros_like, state["params"])
    else:
        raise ValueError("the train state keeps no reference: build it with init_state(..., reference=True)")
    return moduledef.merge(*model_states(state, jax.lax.stop_gradient(params)))


def _model_metrics(
    moduledef: nnx.ModuleDef, objective: Objective, state: TrainState, states: tuple, batch: Any, ctx: nnx.Context
) -> tuple[dict[str, jax.Array], nnx.State]:
    """The objective's per-row metrics of the model built from `states`, and the model's state after the call."""
    model = moduledef.merge(*states)
    reference = reference_model(moduledef, state) if objective.needs_reference else None
    metrics = objective.metrics(model, batch, ctx, reference)
    updates, _ = model.partition()
    return metrics, updates


def _means(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Batch means of per-example metrics, weighted by `weight` when the model gives one."""
    weight = metrics.pop(WEIGHT, None)
    if weight is None:
        return {k: jnp.mean(v) for k, v in metrics.items()}
    total = jnp.maximum(jnp.sum(weight), 1.0)
    return {k: jnp.sum(v * weight) / total for k, v in metrics.items()}


def _context(seed: int, stream: int, index: jax.Array, training: bool) -> nnx.Context:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), index)
    sample, dropout = jax.random.split(key)
    return nnx.context(
        sample=sample, dropout=dropout, flags={"deterministic": not training, "use_running_average": not training}
    )


def empty_sums(metric_names: list[str]) -> dict[str, Any]:
    """The train-metric accumulator between two log lines: metric sums, the gradient norm's sum, a step count,
    and the first step whose loss was not finite (-1: none)."""
    return {  # numpy: the first dispatch takes them to the devices (no computation of their own to compile)
        "metrics": {k: np.zeros((), np.float32) for k in metric_names},
        "grad_norm": np.zeros((), np.float32),
        "count": np.zeros((), np.int32),
        "bad_step": np.full((), -1, np.int32),
    }


def train_step(
    moduledef: nnx.ModuleDef,
    tx: optax.GradientTransformation,
    objective: Objective | str,
    seed: int,
    state: TrainState,
    sums: dict[str, Any],
    batch: dict[str, jax.Array],
    accum: int = 1,
) -> tuple[TrainState, dict[str, Any], jax.Array]:
    """One optimizer step on `batch`; adds the batch-mean metrics to `sums`.

    `objective` says what to minimise (:mod:`nnx_cli.objectives`); a metric
    name stands for the model's own metrics, minimising that one.

    With `accum > 1` the batch is split into that many micro-batches (rows
    `i, i + accum, ...` form micro-batch `i`, so each keeps its share of every
    device's rows) whose gradients are averaged, one at a time: the memory of
    one micro-batch, the result of the whole batch up to float rounding.
    `sums["bad_step"]` records the first step whose loss was not finite. The
    loss is also returned on its own: a small output the loop can wait on.
    """
    step = state["step"]
    objective = resolve(objective)

    def loss_fn(params: nnx.State, rest: nnx.State, batch: Any, index: jax.Array) -> tuple[jax.Array, Any]:
        ctx = _context(seed, _TRAIN, index, training=True)  # inside: a Context is bound to its trace
        metrics, updates = _model_metrics(moduledef, objective, state, model_states(state, params, rest), batch, ctx)
        means = _means(metrics)
        _, rest = updates.partition(nnx.Param, ...)
        return means[objective.loss_metric], (means, rest)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum == 1:
        (loss, (means, rest)), grads = grad_fn(state["params"], state["rest"], batch, step)
    else:
        loss, means, rest, grads = _accumulate(grad_fn, state, batch, accum)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    sums = {
        "metrics": {k: sums["metrics"][k] + means[k] for k in sums["metrics"]},
        "grad_norm": sums["grad_norm"] + optax.tree.norm(grads),
        "count": sums["count"] + 1,
        "bad_step": jnp.where((sums["bad_step"] < 0) & ~jnp.isfinite(loss), step, sums["bad_step"]),
    }
    new = {"step": step + 1, "params": params, "opt_state": opt_state, "rest": rest}
    return {**state, **new}, sums, loss


def _accumulate(grad_fn: Callable, state: TrainState, batch: dict[str, jax.Array], accum: int) -> tuple:
    """Mean loss, metrics and gradients over `accum` micro-batches, computed one after another in a scan."""
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)
    step = state["step"]

    def body(carry: tuple, xs: tuple) -> tuple:
        rest, total = carry
        (loss, (means, rest)), grads = grad_fn(state["params"], rest, xs[0], step * accum + xs[1])
        return (rest, jax.tree.map(jnp.add, total, (loss, means, grads))), None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, state["params"], state["rest"], first, step)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (loss, (means, _)), grads = zeros
    (rest, total), _ = jax.lax.scan(body, (state["rest"], (loss, means, grads)), (micro, jnp.arange(accum)))
    loss, means, grads = jax.tree.map(lambda x: x / accum, total)
    return loss, means, rest, grads


def train_dispatch(
    moduledef: nnx.ModuleDef,
    tx: optax.GradientTransformation,
    objective: Objective | str,
    seed: int,
    prepare: Callable[[dict[str, jax.Array]], dict[str, jax.Array]],
    read: Callable[[Any, jax.Array], dict[str, jax.Array]] | None,
    state: TrainState,
    sums: dict[str, Any],
    xs: Any,
    stored: Any = None,
    accum: int = 1,
) -> tuple[TrainState, dict[str, Any], jax.Array]:
    """`k` optimizer steps in one `lax.scan`: the unit the loop dispatches; also returns whether the new
    parameters are all finite (one pass over them per dispatch, fused into the same program).

    `xs` holds, stacked along a leading axis of length `k`, either the stored
    rows of `k` batches (host-fed) or, with `read` and `stored` (the split on
    the devices), their example keys; `prepare` turns stored rows into model
    inputs. On CPU the result is bit-identical to `k` single steps.
    """

    def body(carry: tuple[TrainState, dict[str, Any]], x: Any) -> tuple[tuple[TrainState, dict[str, Any]], jax.Array]:
        batch = prepare(read(stored, x) if read is not None else x)
        state, sums, loss = train_step(moduledef, tx, objective, seed, *carry, batch, accum)
        return (state, sums), loss

    (state, sums), _ = jax.lax.scan(body, (state, sums), xs)
    return state, sums, all_finite(state["params"])


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every array in `tree` is finite (a norm would overflow first).

    A full pass over the arrays: the loop runs it on the parameters only
    before a checkpoint or an eval, not every step.
    """
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def check_step(
    moduledef: nnx.ModuleDef,
    tx: optax.GradientTransformation,
    model_name: str,
    abstract: TrainState,
    batch: dict[str, Any],
    objective: Objective | None = None,
) -> list[str]:
    """Trace the objective's metrics (default: the model's own) and the optimizer update on shapes alone;
    return the metric names.

    Nothing is computed or allocated. A model that cannot run on the data's
    batches, or an optimizer that cannot update the parameters (say, an
    option of the wrong type), is a UserError here, before a run touches its
    work dir, rather than a traceback at the first step.
    """
    ctx = lambda: _context(0, _EVAL, jnp.zeros((), jnp.int32), training=False)  # noqa: E731
    objective = resolve(objective)
    try:
        metrics = jax.eval_shape(
            lambda s, b: _model_metrics(moduledef, objective, s, model_states(s), b, ctx())[0], abstract, batch
        )
    except UserError:
        raise
    except Exception as e:
        shapes = {k: list(v.shape) for k, v in batch.items()}
        raise UserError(
            f"model {model_name!r} cannot run on batches of {shapes}: {type(e).__name__}: {first_line(e)}"
        ) from None
    _check_metrics(metrics, objective.loss_metric, batch, model_name)
    try:
        jax.eval_shape(lambda s: tx.update(s["params"], s["opt_state"], s["params"]), abstract)
    except Exception as e:
        raise UserError(
            f"config section 'optimizer': the optimizer cannot update the parameters: {type(e).__name__}: "
            f"{first_line(e)}"
        ) from None
    return list(metrics)


def _check_metrics(metrics: Any, loss_metric: str | None, batch: Any, model_name: str) -> None:
    """A UserError for metrics a step cannot use: not a dict, without the loss, or not one value per example (the
    loss was a KeyError at step 1, and a metric of the wrong length failed at the first eval, losing the steps
    since the last checkpoint)."""
    where = f"model {model_name!r}"
    if not isinstance(metrics, Mapping):
        raise UserError(
            f"{where}: its metrics must be a dict of name -> per-example array, got {type(metrics).__name__}"
        )
    if loss_metric is not None and loss_metric not in metrics:  # None: the metrics of an eval
        names = ", ".join(map(str, metrics)) or "none"
        raise UserError(
            f"{where}: its loss_metric {loss_metric!r} is none of the metrics it gives ({names})"
            f"{did_you_mean(loss_metric, [str(n) for n in metrics])}; return it from metrics(), or name another"
        )
    leading = {x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)}
    if len(leading) != 1:
        return
    (rows,) = leading
    for name, value in metrics.items():
        shape = tuple(getattr(value, "shape", ()))
        if shape != (rows,):  # a scalar, a mean taken over the batch, counted an eval's padding rows
            raise UserError(
                f"{where}: metric {name!r} has shape {list(shape)}; metrics are per example: [{rows}] for a "
                f"batch of {rows} rows (the mean and the eval's sums are taken over them, leaving out the rows that "
                "only pad an eval's last batch)"
            )


def eval_step(
    moduledef: nnx.ModuleDef,
    seed: int,
    prepare: Callable[[dict[str, jax.Array]], dict[str, jax.Array]],
    state: TrainState,
    batch: dict[str, jax.Array],
    index: jax.Array,
    totals: dict[str, jax.Array],
    objective: Objective | None = None,
) -> dict[str, jax.Array]:
    """`totals` plus the sums of the per-example metrics (the objective's; default: the model's own) over the rows
    `batch["mask"]` marks as real (weighted by the `weight` metric when there is one, whose own sum is then kept
    too)."""
    ctx = _context(seed, _EVAL, index, training=False)
    metrics, _ = _model_metrics(moduledef, resolve(objective), state, model_states(state), prepare(batch), ctx)
    weight = metrics.pop(WEIGHT, None)
    if weight is None:
        return {k: totals[k] + jnp.sum(jnp.where(batch["mask"], v, 0.0)) for k, v in metrics.items()}
    weight = jnp.where(batch["mask"], weight, 0.0)
    out = {k: totals[k] + jnp.sum(jnp.where(batch["mask"], v * weight, 0.0)) for k, v in metrics.items()}
    return {**out, WEIGHT: totals[WEIGHT] + jnp.sum(weight)}


def images_step(
    moduledef: nnx.ModuleDef,
    seed: int,
    prepare: Callable[[dict[str, jax.Array]], dict[str, jax.Array]],
    state: TrainState,
    batch: dict[str, jax.Array],
) -> jax.Array:
    """The model's `images` (reconstructions, samples) for a PNG grid."""
    ctx = _context(seed, _IMAGES, jnp.zeros((), jnp.int32), training=False)
    images, _ = moduledef.apply(*model_states(state)).images(prepare(batch), ctx)
    return images


def evaluate(
    run_eval: Callable[..., dict[str, jax.Array]], state: TrainState, batches: Any, count: int, zeros: Any
) -> dict[str, float]:
    """Average the jitted `eval_step` sums over the eval batches (starting from `zeros`, one per metric):
    per-example means over `count` real rows, or weighted means when `zeros` holds a `weight` total."""
    totals = zeros
    for i, batch in enumerate(batches):
        totals = run_eval(state, batch, np.int32(i), totals)
    totals = jax.device_get(totals)
    denominator = max(float(totals.pop(WEIGHT)), 1e-9) if WEIGHT in totals else count
    return {k: float(v) / denominator for k, v in totals.items()}
