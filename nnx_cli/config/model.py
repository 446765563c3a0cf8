"""The `model` section: which model, its shapes, a pretrained directory, and its own options (open)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnx_cli.errors import UserError


@dataclass
class ModelConfig:
    name: str = "vae"  # registry name, or "package.module:Class"
    input_shape: list[int] | None = None  # null: from the dataset
    num_classes: int | None = None  # null: from the dataset
    pretrained: str | None = None  # a Hugging Face model directory or Hub id: options and weights from there
    options: dict[str, Any] = field(default_factory=dict)  # constructor keywords

    open_section = True

    def check(self) -> None:
        if self.input_shape is not None and (not self.input_shape or min(self.input_shape) < 1):
            raise UserError(f"config key 'model.input_shape' must be a list of positive sizes, got {self.input_shape}")
