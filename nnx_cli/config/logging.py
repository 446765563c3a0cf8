"""The `logging` section: where metrics go."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoggingConfig:
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "console"])  # also tensorboard, wandb, pkg.mod:Class
