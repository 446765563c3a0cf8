"""The `checkpoint` section: how often, how many kept, asynchronous writes, where fine-tuning starts from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nnx_cli.config.schema import positive, setting, show
from nnx_cli.errors import UserError, did_you_mean


@dataclass
class CheckpointConfig:
    """How often checkpoints are written, how many are kept, and where fine-tuning starts from."""

    every_steps: int = setting(1000, "steps between periodic checkpoints (a final one is written too)", values=">= 1")
    keep: int = setting(3, "periodic checkpoints kept, the newest", values=">= 1")
    async_: bool = setting(True, "write checkpoints in the background", name="async")
    init_from: str | None = setting(
        None, "a work dir, a step dir or a PEFT adapter directory: start from its parameters (fine-tuning)"
    )
    keep_best: dict[str, Any] | None = setting(
        None, "`{metric: nelbo, mode: min}`: also keep the best eval step (`nnx-eval --best`)", values="mode: min, max"
    )

    def check(self) -> None:
        positive("checkpoint.every_steps", self.every_steps)
        positive("checkpoint.keep", self.keep)
        best = self.keep_best
        unknown = sorted(set(best or {}) - {"metric", "mode"}, key=str)
        if unknown:  # it said the key "must be a string", as if it were one keep_best takes
            raise UserError(
                f"unknown config key 'checkpoint.keep_best.{unknown[0]}'"
                f"{did_you_mean(str(unknown[0]), ['metric', 'mode'], 'checkpoint.keep_best.')}; keep_best takes "
                "metric and mode"
            )
        for key in ("metric", "mode"):
            if best is not None and key in best and not isinstance(best[key], str):
                raise UserError(f"config key 'checkpoint.keep_best.{key}' must be a string, got {show(best[key])}")
        if best is not None and (set(best) != {"metric", "mode"} or best["mode"] not in ("min", "max")):
            raise UserError(
                "config key 'checkpoint.keep_best' must be {metric: <eval metric>, mode: min or max} or null, "
                f"got {best}"
            )
