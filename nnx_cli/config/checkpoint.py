"""The `checkpoint` section: how often, how many kept, asynchronous writes, where fine-tuning starts from."""

from __future__ import annotations

from dataclasses import dataclass, field

from nnx_cli.config.schema import positive
from nnx_cli.errors import UserError


@dataclass
class CheckpointConfig:
    every_steps: int = 1000
    keep: int = 3
    async_: bool = field(default=True, metadata={"key": "async"})
    init_from: str | None = None  # a work dir or step dir: start from its parameters (fine-tuning)
    keep_best: dict[str, str] | None = None  # {metric: nelbo, mode: min}: also keep the best eval

    def check(self) -> None:
        positive("checkpoint.every_steps", self.every_steps)
        positive("checkpoint.keep", self.keep)
        best = self.keep_best
        if best is not None and (set(best) != {"metric", "mode"} or best["mode"] not in ("min", "max")):
            raise UserError(
                "config key 'checkpoint.keep_best' must be {metric: <eval metric>, mode: min or max} or null, "
                f"got {best}"
            )
