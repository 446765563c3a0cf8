"""Objectives: what a training step minimises, given the model. One loop trains them all.

`nnx_cli/steps.py` is the only training step there is: it builds the model
from the train state, asks the run's objective for per-row metrics, and
minimises the batch mean of `objective.loss_metric` (weighted by a `weight`
metric when the objective gives one). Everything else a run has (resume,
sharding, logging, checkpoints, evals, export) is written once, around it.
An objective says:

- which data it trains on (`data_formats`: the `data.format` values whose
  rows it reads; :mod:`nnx_cli.data.examples` builds them),
- its loss and metrics (`metrics(model, batch, ctx, reference)`: per row,
  `[B]` each, inside the jitted step),
- what its reference model is (`needs_reference`: the step then passes
  pi_ref, the model the run started from, frozen: the same weights with the
  adapters off under LoRA, else a copy of the starting parameters kept in the
  train state beside them; see `steps.reference_model`)::

    objective = build(cfg, model_cls)           # from the `objective` section
    metrics = objective.metrics(model, batch, ctx, reference)    # {"loss": [B], ..., "weight": [B]}

`sft` (:class:`~nnx_cli.objectives.sft.SFT`) is the model's own metrics,
the run of every config without an `objective` section; `dpo`
(:class:`~nnx_cli.objectives.dpo.DPO`) learns from preference pairs; `grpo`
(:class:`~nnx_cli.objectives.grpo.GRPO`) from rewards of completions it
samples.

An objective that makes its own batches (GRPO samples them) also gives the
loop its feed and dispatch (`inputs(exp, plan, steps)`, in place of the data
pipeline's), the evals (`evaluator(exp, steps)`), the samples hook
(`samples(every, exp, directory, guard, steps)`) and the eval metric names;
`steps_per_batch` optimizer steps make one dispatch. The loop hands it
`steps`, the training step and the train state's accessors (:class:`Steps`:
the module :mod:`nnx_cli.steps`), since `steps` imports the objectives and
they never import it back.

Writing one: its options are a dataclass in `nnx_cli/config/objective.py`
(`OPTIONS`), its class a module here built in :func:`build`. Its metrics are
per row and may carry columns the data (or the objective's own code) put in
the batch: an objective that samples (GRPO) generates completions with
`nnx_cli.decoding` from `steps.parameters(state)`, scores them on the host,
and then runs `steps.train_step(moduledef, tx, objective, seed, state, sums,
batch)` once per update on rows holding the completions with their
advantages and old log-probabilities; whatever `metrics` returns (`reward`,
`kl`, ...) is averaged, logged, evaluated and checkpointed with the loop's
sums like any metric. `needs_reference` may be decided per instance (GRPO's
`beta > 0`); `steps.reference_model` gives pi_ref as a Module inside the step.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import optax

import nnx
from nnx_cli.config import Config


class Objective(Protocol):
    """What a training step minimises. See the module docstring."""

    name: str
    """`objective.name`."""
    needs_reference: bool
    """Whether `metrics` takes pi_ref (the step passes None otherwise)."""
    data_formats: tuple[str, ...] | None
    """The `data.format` values it trains on; None: whatever the model reads."""
    loss_metric: str
    """The metric training minimises: its batch mean (weighted by `weight` when given)."""

    def check(self, cfg: Config, model_cls: type) -> None:
        """Raise a UserError, naming the key, for a config this objective cannot train."""

    def metrics(
        self, model: nnx.Module, batch: dict[str, jax.Array], ctx: nnx.Context, reference: nnx.Module | None
    ) -> dict[str, jax.Array]:
        """Per-row metrics of `batch` (`[B]` each), `loss_metric` among them; an optional `weight` `[B]`
        weights the averages over rows (the targets, or the pairs, a row holds)."""


class Steps(Protocol):
    """What the loop hands an objective that makes its own batches: the training step and the train state's
    accessors, as :mod:`nnx_cli.steps` defines them (the loop passes that module)::

        state, sums, loss = steps.train_step(moduledef, tx, objective, seed, state, sums, rows)
    """

    def train_step(
        self,
        moduledef: nnx.ModuleDef,
        tx: optax.GradientTransformation,
        objective: Objective | str,
        seed: int,
        state: dict[str, Any],
        sums: dict[str, Any],
        batch: dict[str, jax.Array],
        accum: int = 1,
    ) -> tuple[dict[str, Any], dict[str, Any], jax.Array]:
        """One optimizer step on `batch`, its batch-mean metrics added to `sums`; the loss besides."""

    def model_states(self, state: dict[str, Any], params: Any = None, rest: Any = None, *, bits: bool = False
                     ) -> tuple[Any, ...]:  # fmt: skip
        """The states `moduledef.apply` (or `merge`) takes, from the train state (frozen parameters held as their
        bits as they are with `bits`: see `steps.frozen_as_bits`)."""

    def stored(self, tree: Any) -> Any:
        """`tree` with frozen parameters held as their bits in bfloat16 again (`steps.frozen_as_bits`)."""

    def all_finite(self, tree: Any) -> jax.Array:
        """Whether every element of every array in `tree` is finite."""


def build(cfg: Config, model_cls: type) -> Objective:
    """The objective of `cfg.objective`, checked against the rest of the config."""
    from nnx_cli.objectives.sft import SFT

    settings = cfg.objective.settings()
    if cfg.objective.name == "dpo":
        from nnx_cli.objectives.dpo import DPO

        objective: Objective = DPO(beta=settings.beta, loss=settings.loss)
    elif cfg.objective.name == "grpo":
        from nnx_cli.objectives.grpo import GRPO

        objective = GRPO(settings)
    else:
        objective = SFT(model_cls.loss_metric)
    objective.check(cfg, model_cls)
    return objective


def resolve(objective: Objective | str | None) -> Objective:
    """An objective as the steps take it: a metric name (or None, for evaluation) stands for the model's own
    metrics, minimising that one."""
    from nnx_cli.objectives.sft import SFT

    return SFT(objective) if objective is None or isinstance(objective, str) else objective
