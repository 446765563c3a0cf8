"""The `sharding` section: the device mesh's axes and the logical-axis rules that place arrays on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nnx_cli.config.schema import setting
from nnx_cli.errors import UserError


@dataclass
class ShardingConfig:
    """The device mesh, and the rules that map each array's logical axes onto it."""

    mesh: dict[str, int] = setting(
        factory=lambda: {"data": -1, "model": 1},
        help="mesh axes and their sizes; -1: all the devices the other axes leave",
        values="sizes >= 1, at most one -1",
    )
    rules: list[list[Any]] | None = setting(
        None,
        "`[logical_axis, mesh_axis or null]` pairs, by priority (a list of mesh axes splits over several); null: "
        "the model's default rules",
    )

    def check(self) -> None:
        for axis, size in self.mesh.items():
            if size != -1 and size < 1:
                raise UserError(
                    f"config key 'sharding.mesh.{axis}' must be a positive size or -1 (all remaining devices), "
                    f"got {size}"
                )
        if sum(1 for size in self.mesh.values() if size == -1) > 1:
            raise UserError(
                f"config key 'sharding.mesh': at most one axis may be -1 (the rest of the devices), got {self.mesh} "
                "(the default mesh is {data: -1, model: 1}: give each other axis its size)"
            )
        for i, rule in enumerate(self.rules or []):
            pair = len(rule) == 2
            several = pair and isinstance(rule[1], list)
            targets = rule[1] if several else [rule[1]] if pair else None
            if (
                not pair
                or not isinstance(rule[0], str)
                or targets is None
                or (several and not targets)
                or not all((a is None and not several) or (isinstance(a, str) and a in self.mesh) for a in targets)
            ):
                raise UserError(
                    f"config key 'sharding.rules[{i}]' must be [logical_axis, mesh_axis or null] (or a list of mesh "
                    f"axes) with mesh axes from {sorted(self.mesh)}, got {rule!r}"
                )
            repeated = next((a for a in targets if targets.count(a) > 1), None)
            if repeated is not None:  # JAX's DuplicateSpecError, as a traceback
                raise UserError(f"config key 'sharding.rules[{i}]' names mesh axis {repeated!r} twice: {rule!r}")
