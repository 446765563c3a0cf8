"""The `optimizer` section: an optax optimizer or chain by name, its schedule and options (open)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnx_cli.config.schema import setting, show
from nnx_cli.errors import UserError


@dataclass
class OptimizerConfig:
    """What updates the parameters: an optax optimizer, your own factory or a chain; other keys are its keywords."""

    name: str | None = setting(
        None,
        "any optax optimizer by name (`adam`, `adamw`, `sgd`, `lion`, ...) or `package.module:make`; null: adam, "
        "or the chain",
    )
    learning_rate: float | dict[str, Any] = setting(
        1e-3,
        "a number, or an optax schedule `{name: warmup_cosine_decay, peak_value: ..., ...}` (a missing "
        "`decay_steps` is the run length)",
    )
    clip_grad_norm: float | None = setting(None, "clip the gradients to this global norm; null: no clipping")
    weight_decay_mask: str = setting(
        "all",
        "which parameters weight decay applies to: all, or kernels (two or more dimensions)",
        choices=("all", "kernels"),
    )
    chain: list[dict[str, Any]] | None = setting(
        None, "optax pieces instead of `name`: `[{name: scale_by_adam, b2: 0.99}, {name: scale_by_learning_rate}]`"
    )
    options: dict[str, Any] = field(default_factory=dict)  # the optax function's keywords: every other key

    open_section = True

    def check(self) -> None:
        rate = self.learning_rate
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate < 0:
            raise UserError(
                "config key 'optimizer.learning_rate' must be zero or more (a negative rate climbs the loss), got "
                f"{show(rate)}"
            )
        clip = self.clip_grad_norm
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip <= 0:
            raise UserError(
                f"config key 'optimizer.clip_grad_norm' must be a positive number, or null for no clipping, got "
                f"{show(clip)}"
            )
        if self.weight_decay_mask not in ("all", "kernels"):
            raise UserError(
                f"config key 'optimizer.weight_decay_mask' must be all or kernels, got {show(self.weight_decay_mask)}"
            )
