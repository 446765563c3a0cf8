"""`sft`: the model's own metrics, minimising its loss metric: how every model trains without post-training.

For a language model on chat or completion rows this is supervised
fine-tuning (the mean loss over target tokens); for a VAE, its negative
ELBO. The step computes exactly what it computed before objectives existed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax

import nnx
from nnx_cli.config import Config
from nnx_cli.errors import UserError


class SFT:
    """`model.metrics(batch, ctx)`, minimising `loss_metric` (the model class's)::

    SFT("loss").metrics(model, batch, ctx, None)    # {"loss": [B], "accuracy": [B], "weight": [B]}
    """

    name: ClassVar[str] = "sft"
    needs_reference: ClassVar[bool] = False
    data_formats: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, loss_metric: str | None):
        self.loss_metric = loss_metric

    def check(self, cfg: Config, model_cls: type) -> None:
        if cfg.data.format == "preference":
            raise UserError(
                "config key 'data.format' is preference, whose rows are pairs to prefer one of, but objective.name "
                "is sft; set objective.name=dpo to learn from them"
            )
        if cfg.data.format == "prompt":
            raise UserError(
                "config key 'data.format' is prompt, whose rows hold no answers to learn, but objective.name is sft; "
                "set objective.name=grpo (with objective.rewards) to learn from rewards of sampled completions"
            )

    def metrics(
        self, model: nnx.Module, batch: dict[str, jax.Array], ctx: nnx.Context, reference: Any = None
    ) -> dict[str, jax.Array]:
        return model.metrics(batch, ctx)
