"""The `model` section: which model, its shapes, a pretrained directory, and its own options (open)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnx_cli.config.schema import setting
from nnx_cli.errors import UserError


@dataclass
class ModelConfig:
    """Which model, its shapes, a pretrained directory; the other keys are the model's own options."""

    name: str = setting(
        "vae",
        "a registered model (`vae`, `mlp_classifier`, `cnn_classifier`, `transformer_lm`) or `package.module:Class`",
    )
    input_shape: list[int] | None = setting(
        None, "one example's shape; null: from the data (written back into the saved config)", values="sizes >= 1"
    )
    num_classes: int | None = setting(None, "classes (the vocabulary size for text); null: from the data")
    pretrained: str | None = setting(
        None, "a Hugging Face model directory or Hub id: options, weights and tokenizer from there"
    )
    options: dict[str, Any] = field(default_factory=dict)  # the model constructor's keywords: every other key

    open_section = True

    def check(self) -> None:
        if self.input_shape is not None and (not self.input_shape or min(self.input_shape) < 1):
            raise UserError(f"config key 'model.input_shape' must be a list of positive sizes, got {self.input_shape}")
