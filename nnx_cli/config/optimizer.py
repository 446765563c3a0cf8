"""The `optimizer` section: an optax optimizer or chain by name, its schedule and options (open)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnx_cli.config.schema import show
from nnx_cli.errors import UserError


@dataclass
class OptimizerConfig:
    name: str | None = None  # any optax optimizer by name, or package.module:make; null: adam, or the chain
    learning_rate: float | dict[str, Any] = 1e-3  # or {name: <optax schedule>, ...}
    clip_grad_norm: float | None = None
    weight_decay_mask: str = "all"  # all, or kernels: decay parameters of two or more dimensions only
    chain: list[dict[str, Any]] | None = None  # optax pieces [{name: scale_by_adam, b2: 0.99}, ...]
    options: dict[str, Any] = field(default_factory=dict)  # optax keywords

    open_section = True

    def check(self) -> None:
        if self.weight_decay_mask not in ("all", "kernels"):
            raise UserError(
                f"config key 'optimizer.weight_decay_mask' must be all or kernels, got {show(self.weight_decay_mask)}"
            )
