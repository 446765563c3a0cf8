"""`dpo`: direct preference optimisation (Rafailov et al., 2023), and IPO (Azar et al., 2023), on preference pairs.

Definitions (spec posttrain.md). A response's log-probability `log pi(y|x)`
is the sum of the log-softmax of the model's logits at each of its tokens and
the end token after it. With `r_c = beta (log pi(y_c|x) - log pi_ref(y_c|x))`
for the chosen response, `r_r` likewise for the rejected one and the margin
`m = r_c - r_r`, the loss of a pair is

- `sigmoid`: `-log sigmoid(m)`;
- `ipo`: `(h - 1/(2 beta))^2`, `h` the same log-ratio difference built from
  log-probabilities averaged over each response's tokens (TRL's IPO).

Metrics, means over pairs: `loss`, `reward_chosen` (`r_c`), `reward_rejected`
(`r_r`), `reward_margin` (`m`), `reward_accuracy` (the share with `m > 0`).
`pi_ref` is the model the run started from, never updated.

Batches are `data.format: preference` rows (:mod:`nnx_cli.data.examples`):
pair `j` of a row is segments `2j + 1` (prompt and chosen response) and
`2j + 2` (prompt and rejected), the responses marked as targets. Per row the
metrics are means over its pairs and `weight` counts them, so the trainer's
weighted averages are means over pairs whether rows hold one pair or several::

    dpo = DPO(beta=0.1, loss="sigmoid")
    dpo.metrics(model, batch, ctx, reference)["reward_margin"]      # [B]
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

import nnx
from nnx_cli.config import Config
from nnx_cli.errors import UserError

Batch = dict[str, jax.Array]


def sequence_logps(model: nnx.Module, batch: Batch, ctx: nnx.Context | None) -> tuple[jax.Array, jax.Array]:
    """The log-probability of each segment's target tokens under `model`, and their number: `[B, S]` each,
    `S = 2 (T // 2) + 1` slots for the segment ids a row of `T + 1` tokens can hold (slot 0: padding, empty)."""
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    segments = jnp.asarray(batch["segments"], jnp.int32)
    targets = tokens[:, 1:]
    # a target counts when marked, and when it continues the same (real) sequence as the token before it
    counts = batch["targets"][:, 1:].astype(bool) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    losses, _ = model.token_losses(
        tokens[:, :-1], targets, ctx, positions=batch["positions"][:, :-1], segments=segments[:, :-1]
    )
    token_logps = -losses
    slots = 2 * (targets.shape[1] // 2) + 1
    ids = jnp.where(counts, segments[:, 1:], 0)

    def per_segment(values: jax.Array) -> jax.Array:
        return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=slots))(values, ids)

    return per_segment(jnp.where(counts, token_logps, 0.0)), per_segment(counts.astype(jnp.float32))


def pair_losses(
    policy: tuple[jax.Array, jax.Array], reference: jax.Array, beta: float, loss: str
) -> dict[str, jax.Array]:
    """Per-pair loss and rewards from per-segment sums (:func:`sequence_logps`): `policy` is `(logps, counts)`,
    `reference` the reference's logps; the pairs are the segment slots `(1, 2), (3, 4), ...`. Adds `real`: the
    slots that hold a pair."""
    logps, counts = policy
    chosen, rejected = logps[:, 1::2] - reference[:, 1::2], logps[:, 2::2] - reference[:, 2::2]  # log-ratios
    n_chosen, n_rejected = counts[:, 1::2], counts[:, 2::2]
    reward_chosen, reward_rejected = beta * chosen, beta * rejected
    margin = reward_chosen - reward_rejected
    if loss == "ipo":
        h = chosen / jnp.maximum(n_chosen, 1.0) - rejected / jnp.maximum(n_rejected, 1.0)
        losses = jnp.square(h - 1.0 / (2.0 * beta))
    else:
        losses = -jax.nn.log_sigmoid(margin)
    return {
        "loss": losses,
        "reward_chosen": reward_chosen,
        "reward_rejected": reward_rejected,
        "reward_margin": margin,
        "reward_accuracy": (margin > 0).astype(jnp.float32),
        "real": (n_chosen > 0) & (n_rejected > 0),
    }


class DPO:
    """The DPO objective; see the module docstring."""

    name: ClassVar[str] = "dpo"
    needs_reference: ClassVar[bool] = True
    data_formats: ClassVar[tuple[str, ...] | None] = ("preference",)
    loss_metric = "loss"

    def __init__(self, beta: float, loss: str = "sigmoid"):
        self.beta = beta
        self.loss = loss

    def check(self, cfg: Config, model_cls: type) -> None:
        if cfg.data.format not in self.data_formats:
            raise UserError(
                f"objective dpo learns from preference pairs: set data.format=preference (rows {{prompt, chosen, "
                f"rejected}}), not {cfg.data.format}"
            )
        if cfg.data.train_on_prompt:
            raise UserError(
                "config key 'data.train_on_prompt' is true, but objective dpo scores the responses only; drop it"
            )
        if not callable(getattr(model_cls, "token_losses", None)):
            raise UserError(
                f"objective dpo needs a language model that gives token logits (transformer_lm); model "
                f"{cfg.model.name!r} does not"
            )

    def metrics(self, model: nnx.Module, batch: Batch, ctx: nnx.Context, reference: nnx.Module | None) -> Batch:
        """Per row: the means over its pairs of the loss and rewards, and `weight`, its number of pairs."""
        assert reference is not None, "dpo needs its reference model"
        policy = sequence_logps(model, batch, ctx)
        reference_logps, _ = sequence_logps(reference, batch, None)
        pairs = pair_losses(policy, jax.lax.stop_gradient(reference_logps), self.beta, self.loss)
        real = pairs.pop("real")
        weight = jnp.sum(real, axis=-1, dtype=jnp.float32)
        out = {k: jnp.sum(jnp.where(real, v, 0.0), axis=-1) / jnp.maximum(weight, 1.0) for k, v in pairs.items()}
        return {**out, "weight": weight}
