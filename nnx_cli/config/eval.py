"""The `eval` section: evaluations beside the eval split's loss, run during training.

`eval.harness` runs lm-evaluation-harness tasks on the model being trained
every `every_steps` steps and at the end, and logs their metrics with the
others (split `harness`: `metrics.jsonl`, TensorBoard, W&B, the console)::

    eval:
      harness: {tasks: [arc_easy, hellaswag], every_steps: 500, limit: 200}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nnx_cli.config.schema import positive, setting, show
from nnx_cli.errors import UserError


@dataclass
class HarnessConfig:
    """lm-evaluation-harness tasks run on the model being trained (`pip install -e ".[eval]"`)."""

    tasks: list[str] = setting(factory=list, help="lm-eval tasks or groups run during training; empty: none")
    every_steps: int | None = setting(
        None, "steps between harness evals (and one at the end); null: `train.eval_every`", values=">= 1"
    )
    limit: int | float | None = setting(
        None, "examples per task, or a fraction of them below 1; null: all", values="> 0; a fraction below 1"
    )
    num_fewshot: int | None = setting(None, "few-shot examples; null: each task's own", values=">= 0")
    batch_size: int = setting(32, "rows per model call", values=">= 1")
    include_path: str | None = setting(None, "a directory of your own task YAMLs")
    apply_chat_template: bool = setting(False, "prompts as chat turns, in the model's chat template")

    def check(self) -> None:
        positive("eval.harness.every_steps", self.every_steps, allow_none=True)
        positive("eval.harness.batch_size", self.batch_size)
        if any(not name.strip() for name in self.tasks):
            raise UserError(f"config key 'eval.harness.tasks' holds an empty name: {self.tasks}")
        limit = self.limit
        if limit is not None and (limit <= 0 or (isinstance(limit, float) and limit >= 1 and not limit.is_integer())):
            raise UserError(
                f"config key 'eval.harness.limit' must be a number of examples or a fraction in (0, 1), got "
                f"{show(limit)}"
            )
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UserError(f"config key 'eval.harness.num_fewshot' must be 0 or more, got {self.num_fewshot}")


@dataclass
class EvalConfig:
    """Evaluations beside the eval split's metrics, run during training."""

    harness: HarnessConfig = field(default_factory=HarnessConfig)

    def check(self) -> None:
        self.harness.check()
