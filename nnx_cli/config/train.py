"""The `train` section: batch, length of the run, how often to log and evaluate, how steps are dispatched."""

from __future__ import annotations

from dataclasses import dataclass

from nnx_cli.config.schema import positive, show
from nnx_cli.errors import UserError


@dataclass
class TrainConfig:
    batch_size: int = 128  # global batch
    epochs: int | None = 30
    steps: int | None = None  # overrides epochs when set
    log_every: int = 100
    eval_every: int = 1000
    eval_batch_size: int | None = None  # null: batch_size
    eval_max_batches: int | None = None  # null: the whole eval split
    steps_per_dispatch: int | str = "auto"  # optimizer steps per jitted call
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    deterministic: bool = False  # GPU: deterministic kernels, for exact resumption
    profile: list[int] | None = None  # [start_step, num_steps]: a JAX profiler trace into the work dir
    sample_prompts: list[str] | None = None  # language models: prompts sampled at each eval

    def check(self) -> None:
        for key in ("batch_size", "log_every", "eval_every", "grad_accum_steps"):
            positive(f"train.{key}", getattr(self, key))
        for key in ("eval_batch_size", "steps", "epochs", "eval_max_batches"):
            positive(f"train.{key}", getattr(self, key), allow_none=True)
        if self.steps is None and self.epochs is None:
            raise UserError("config keys 'train.steps' and 'train.epochs' are both null: set one of them")
        if self.batch_size % self.grad_accum_steps:
            raise UserError(
                f"config key 'train.batch_size' ({self.batch_size}) must be divisible by train.grad_accum_steps "
                f"({self.grad_accum_steps}): each optimizer step averages that many equal micro-batches"
            )
        dispatch = self.steps_per_dispatch
        if dispatch != "auto" and (isinstance(dispatch, str) or dispatch < 1):
            raise UserError(
                f"config key 'train.steps_per_dispatch' must be auto or a positive integer, got {show(dispatch)}"
            )
        if self.profile is not None and (len(self.profile) != 2 or self.profile[0] < 0 or self.profile[1] < 1):
            raise UserError(
                "config key 'train.profile' must be [start_step, num_steps] with num_steps >= 1, or null; "
                f"got {self.profile}"
            )
