"""The `logging` section: where metrics go."""

from __future__ import annotations

from dataclasses import dataclass

from nnx_cli.config.schema import setting


@dataclass
class LoggingConfig:
    """Where metrics go."""

    loggers: list[str] = setting(
        factory=lambda: ["jsonl", "console"],
        help="`jsonl` (`metrics.jsonl`), `console`, `tensorboard`, `wandb`, or `package.module:Class`",
    )
