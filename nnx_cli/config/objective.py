"""The `objective` section: what training minimises. `sft` (the default) is the model's own loss; `dpo` learns
from preference pairs. Each objective's keys are a dataclass of their own, checked and completed with their
defaults here, so the saved config says every value the run used::

    objective: {name: dpo, beta: 0.1, loss: sigmoid}      # loss: sigmoid | ipo

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


OPTIONS: dict[str, type] = {"sft": SFTOptions, "dpo": DPOOptions}
"""Each objective's options, by `objective.name`."""


@dataclass
class ObjectiveConfig:
    name: str = "sft"  # sft | dpo
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
