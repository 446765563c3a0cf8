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

from nnx_cli.config.schema import build, show
from nnx_cli.errors import UserError, did_you_mean


@dataclass
class SFTOptions:
    """`sft`: no options; the model's own metrics, minimising its loss metric."""


@dataclass
class DPOOptions:
    """`dpo`: direct preference optimisation (Rafailov et al., 2023) on `data.format: preference` pairs."""

    beta: float = 0.1  # how far the policy may move from the reference: rewards are beta times log-ratios
    loss: str = "sigmoid"  # sigmoid: -log sigmoid(margin); ipo: (h - 1/(2 beta))^2 on per-token log-ratios

    def check(self) -> None:
        if not self.beta > 0:
            raise UserError(f"config key 'objective.beta' must be a positive number, got {show(self.beta)}")
        if self.loss not in ("sigmoid", "ipo"):
            raise UserError(f"config key 'objective.loss' must be sigmoid or ipo for dpo, got {show(self.loss)}")


GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")


@dataclass
class GRPOOptions:
    """`grpo`: group relative policy optimisation (Shao et al., 2024) on `data.format: prompt` rows, with rewards
    computed by functions of the completions it samples; the losses as TRL 1.16 defines them."""

    rewards: list[str | dict[str, Any]] = field(default_factory=list)  # module.function, or a built-in (mapping)
    reward_weights: list[float] | None = None  # one per reward; null: all 1
    num_generations: int = 8  # completions per prompt (train.batch_size counts prompts)
    max_new_tokens: int = 256  # tokens a completion has at most, its end token included
    temperature: float = 1.0  # sampling temperature; log-probabilities are taken at it too
    beta: float = 0.0  # KL to the reference model (0: no reference is kept)
    epsilon: float = 0.2  # clipping of the probability ratio: [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # null: epsilon
    loss: str = "dapo"  # grpo (per-sequence means) | dr_grpo (sum / max_new_tokens) | dapo (per-token mean)
    num_iterations: int = 1  # optimizer steps on each batch of completions (ratios leave 1 after the first)
    scale_rewards: str = "group"  # advantages divided by the std of the prompt's group | batch | none
    mask_truncated_completions: bool = False  # completions cut at max_new_tokens count in no loss

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
        if self.num_generations < 2:
            raise UserError(
                f"config key 'objective.num_generations' must be at least 2 (advantages compare the completions of "
                f"a prompt), got {show(self.num_generations)}"
            )
        for key in ("max_new_tokens", "num_iterations"):
            if getattr(self, key) < 1:
                raise UserError(f"config key 'objective.{key}' must be a positive integer, got {getattr(self, key)}")
        if not self.temperature > 0:
            raise UserError(
                f"config key 'objective.temperature' must be positive (grpo samples), got {show(self.temperature)}"
            )
        if self.beta < 0:
            raise UserError(f"config key 'objective.beta' must be 0 (no KL term) or more, got {show(self.beta)}")
        for key in ("epsilon", "epsilon_high"):
            value = getattr(self, key)
            if value is not None and not value >= 0:
                raise UserError(f"config key 'objective.{key}' must be 0 or more, got {show(value)}")
        if self.loss not in GRPO_LOSSES:
            raise UserError(
                f"config key 'objective.loss' must be {', '.join(GRPO_LOSSES[:-1])} or {GRPO_LOSSES[-1]} for grpo, "
                f"got {show(self.loss)}"
            )
        if self.scale_rewards not in ("group", "batch", "none"):
            raise UserError(
                f"config key 'objective.scale_rewards' must be group, batch or none, got {show(self.scale_rewards)}"
            )


OPTIONS: dict[str, type] = {"sft": SFTOptions, "dpo": DPOOptions, "grpo": GRPOOptions}
"""Each objective's options, by `objective.name`."""


@dataclass
class ObjectiveConfig:
    name: str = "sft"  # sft | dpo | grpo
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
