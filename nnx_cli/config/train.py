"""The `train` section: batch, length of the run, how often to log and evaluate, how steps are dispatched."""

from __future__ import annotations

from dataclasses import dataclass

from nnx_cli.config.schema import positive, setting, show
from nnx_cli.errors import UserError


@dataclass
class TrainConfig:
    """How long a run trains, on what batches, and how often it logs, evaluates and dispatches."""

    batch_size: int = setting(
        128, "the global batch (prompts under grpo); an epoch's last partial batch is dropped", values=">= 1"
    )
    epochs: int | None = setting(30, "passes over the training split; `train.steps` wins when set", values=">= 1")
    steps: int | None = setting(None, "optimizer steps in the run; null: `train.epochs` of them", values=">= 1")
    log_every: int = setting(100, "steps between train logs", values=">= 1")
    eval_every: int = setting(1000, "steps between evals on the eval split (and one at the end)", values=">= 1")
    eval_batch_size: int | None = setting(None, "the eval batch; null: `train.batch_size`", values=">= 1")
    eval_max_batches: int | None = setting(
        None, "evaluate on the first N batches of the eval split; null: all of it", values=">= 1"
    )
    steps_per_dispatch: int | str = setting(
        "auto",
        "optimizer steps per jitted call (one `lax.scan`); must divide the intervals. auto: from the intervals, "
        "the run length and the model's size",
        values="auto or >= 1",
    )
    grad_accum_steps: int = setting(
        1, "micro-batches per optimizer step: the same result in less memory; must divide `batch_size`", values=">= 1"
    )
    deterministic: bool = setting(False, "GPU: XLA's deterministic kernels, for bit-exact resumption there")
    profile: list[int] | None = setting(
        None,
        "`[start_step, num_steps]`: a JAX profiler trace in `<workdir>/profile` (TensorBoard, Perfetto) of the "
        "dispatches that run those steps",
    )
    sample_prompts: list[str] | None = setting(
        None, "language models: prompts continued at each eval into `samples/<step>.txt`; null: the eval split's"
    )
    sample_tokens: int = setting(
        200, "language models: tokens drawn after each sample prompt at each eval; 0: no samples", values=">= 0"
    )

    def check(self) -> None:
        for name in ("batch_size", "log_every", "eval_every", "grad_accum_steps"):
            positive(f"train.{name}", getattr(self, name))
        for name in ("eval_batch_size", "steps", "epochs", "eval_max_batches"):
            positive(f"train.{name}", getattr(self, name), allow_none=True)
        for name in ("batch_size", "eval_batch_size"):
            if (getattr(self, name) or 0) >= 2**31:  # rows of one array: numpy refuses such a shape with a traceback
                raise UserError(f"config key 'train.{name}' must be below 2**31, got {getattr(self, name)}")
        if self.sample_tokens < 0:  # its type is the schema's check
            raise UserError(
                f"config key 'train.sample_tokens' must be 0 (no samples) or more, got {show(self.sample_tokens)}"
            )
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
