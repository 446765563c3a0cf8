"""The `objective` section: what training minimises. `sft` (the default) is the model's own loss; `dpo` learns
from preference pairs; `grpo` from rewards of completions it samples. Each objective's keys are a dataclass of
their own, checked and completed with their defaults here, so the saved config says every value the run used::

    objective: {name: dpo, beta: 0.1, loss: sigmoid}      # loss: sigmoid | ipo
    objective: {name: grpo, rewards: [my_rewards.correct], num_generations: 8, max_new_tokens: 256}

A new objective is a dataclass of its options in :data:`OPTIONS` and a module in `nnx_cli/objectives/`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nnx_cli.config.schema import build, setting, show
from nnx_cli.errors import UserError, did_you_mean

FLOAT32_MAX = 3.4028234663852886e38  # float(np.finfo(np.float32).max): rewards and their weights stay below


@dataclass
class SFTOptions:
    """`sft`: no options; the model's own metrics, minimising its loss metric."""


DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class DPOOptions:
    """`dpo`: direct preference optimisation (Rafailov et al., 2023) on `data.format: preference` pairs."""

    beta: float = setting(
        0.1, "how far the policy may move from the reference: rewards are beta times log-ratios", values="> 0"
    )
    loss: str = setting(
        "sigmoid",
        "sigmoid: `-log sigmoid(margin)`; ipo: `(h - 1/(2 beta))^2` on per-token log-ratios",
        choices=DPO_LOSSES,
    )

    def check(self) -> None:
        if not self.beta > 0:
            raise UserError(f"config key 'objective.beta' must be a positive number, got {show(self.beta)}")
        if self.loss not in DPO_LOSSES:
            raise UserError(f"config key 'objective.loss' must be sigmoid or ipo for dpo, got {show(self.loss)}")


GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class GRPOOptions:
    """`grpo`: group relative policy optimisation (Shao et al., 2024) on `data.format: prompt` rows, with rewards
    computed by functions of the completions it samples; the losses as TRL 1.16 defines them."""

    rewards: list[str | dict[str, Any]] = setting(
        factory=list,
        help="reward functions: `module.function` from the current directory, or a built-in (`exact_match`, "
        "`regex`, `math_answer`) as a name or a mapping with its options",
        values="at least one (required)",
    )
    reward_weights: list[float] | None = setting(None, "one weight per reward; null: all 1")
    num_generations: int = setting(8, "completions per prompt (`train.batch_size` counts prompts)", values=">= 2")
    max_new_tokens: int = setting(256, "tokens a completion has at most, its end token included", values=">= 1")
    temperature: float = setting(1.0, "sampling temperature; log-probabilities are taken at it too", values="> 0")
    beta: float = setting(0.0, "weight of the KL to the reference model (0: no reference is held)", values=">= 0")
    epsilon: float = setting(
        0.2, "clipping of the probability ratio to `[1 - epsilon, 1 + epsilon_high]`", values=">= 0"
    )
    epsilon_high: float | None = setting(None, "the upper clip; null: `epsilon`", values=">= 0")
    loss: str = setting(
        "dapo",
        "grpo: each completion's token mean, then their mean; dr_grpo: the token sum / (completions x "
        "max_new_tokens); dapo: the token sum / the batch's tokens",
        choices=GRPO_LOSSES,
    )
    num_iterations: int = setting(
        1, "optimizer steps on each batch of completions (ratios leave 1 after the first)", values=">= 1"
    )
    scale_rewards: str = setting(
        "group",
        "advantages divided by the std of the prompt's group, of the batch, or by nothing",
        choices=SCALE_REWARDS,
    )
    mask_truncated_completions: bool = setting(False, "completions cut at `max_new_tokens` count in no loss")

    def check(self) -> None:
        if not self.rewards:
            raise UserError(
                "config key 'objective.rewards' is empty: grpo needs at least one reward function, e.g. "
                "objective.rewards=[my_rewards.correct] (module.function, imported from the current directory)"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise UserError(
                f"config key 'objective.reward_weights' has {len(self.reward_weights)} weights for "
                f"{len(self.rewards)} rewards: give one per reward, or null for all 1"
            )
        for i, weight in enumerate(self.reward_weights or []):
            if not abs(weight) <= FLOAT32_MAX:  # NaN, inf, and what float32 sums make infinite
                raise UserError(
                    f"config key 'objective.reward_weights[{i}]' must be a finite number within float32's range "
                    f"(about 3.4e38), got {show(weight)}"
                )
        if self.num_generations < 2:
            raise UserError(
                f"config key 'objective.num_generations' must be at least 2 (advantages compare the completions of "
                f"a prompt), got {show(self.num_generations)}"
            )
        for name in ("max_new_tokens", "num_iterations"):
            if getattr(self, name) < 1:
                raise UserError(f"config key 'objective.{name}' must be a positive integer, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise UserError(
                f"config key 'objective.temperature' must be positive (grpo samples), got {show(self.temperature)}"
            )
        if self.beta < 0:
            raise UserError(f"config key 'objective.beta' must be 0 (no KL term) or more, got {show(self.beta)}")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise UserError(f"config key 'objective.{name}' must be 0 or more, got {show(value)}")
        if self.loss not in GRPO_LOSSES:
            raise UserError(
                f"config key 'objective.loss' must be {', '.join(GRPO_LOSSES[:-1])} or {GRPO_LOSSES[-1]} for grpo, "
                f"got {show(self.loss)}"
            )
        if self.scale_rewards not in SCALE_REWARDS:
            raise UserError(
                f"config key 'objective.scale_rewards' must be group, batch or none, got {show(self.scale_rewards)}"
            )


OPTIONS: dict[str, type] = {"sft": SFTOptions, "dpo": DPOOptions, "grpo": GRPOOptions}
"""Each objective's options, by `objective.name`."""


@dataclass
class ObjectiveConfig:
    """What training minimises; the other keys are the objective's own options."""

    name: str = setting(
        "sft",
        "sft: the model's own loss; dpo: preference pairs; grpo: rewards of completions it samples",
        choices=tuple(OPTIONS),
    )
    options: dict[str, Any] = field(default_factory=dict)  # the objective's own keys (beta, loss, ...)

    open_section = True

    def check(self) -> None:
        """Check the options against the objective's schema and complete them with its defaults."""
        self.options = dataclasses.asdict(self.settings())

    def settings(self) -> Any:
        """The options as the objective's dataclass (:data:`OPTIONS`), checked."""
        schema = OPTIONS.get(self.name)
        if schema is None:
            raise UserError(
                f"config key 'objective.name' must be one of {', '.join(OPTIONS)}, got {show(self.name)}"
                f"{did_you_mean(self.name, list(OPTIONS))}"
            )
        known = [f.name for f in dataclasses.fields(schema)]
        for key in self.options:
            if key not in known:
                takes = f"it takes {', '.join(known)}" if known else "it takes no other key"
                raise UserError(
                    f"unknown config key 'objective.{key}' for objective {self.name!r}"
                    f"{did_you_mean(key, known, 'objective.')}; {takes}"
                )
        settings = build(schema, self.options, "objective")
        check = getattr(settings, "check", None)
        if check is not None:
            check()
        return settings
