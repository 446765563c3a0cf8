"""Building blocks shared by the shipped models: linear layers with logical axes, option checks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import nnx


def linear(din: int, dout: int, axes: tuple[str, str], ctx: nnx.Context) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        kernel_init=nnx.with_logical_partitioning(nnx.initializers.lecun_normal(), axes),
        bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), (axes[1],)),
        ctx=ctx,
    )


def hidden_axes(count: int) -> list[str]:
    """Logical names of consecutive hidden layers: `hidden`, `mlp`, `hidden`, ... so that
    no kernel names one axis twice (hidden-to-hidden kernels are `(hidden, mlp)`)."""
    return [("hidden", "mlp")[i % 2] for i in range(count)]


def mlp(sizes: Sequence[int], axes: Sequence[str], ctx: nnx.Context) -> nnx.Sequence:
    """Linear layers `sizes[0] -> sizes[1] -> ...`; layer i has axes `(axes[i], axes[i + 1])`."""
    return nnx.Sequence(
        [linear(a, b, (axes[i], axes[i + 1]), ctx) for i, (a, b) in enumerate(itertools.pairwise(sizes))]
    )


def check_sizes(option: str, sizes: Sequence[int], one: bool = False) -> list[int]:
    """Layer sizes must be positive (a zero-width layer has nothing to learn) and below 2**31 (no array is wider).
    `one`: the option is a single size (its message names the number, not a list)."""
    got = sizes[0] if one else list(sizes)
    if any(size < 1 for size in sizes):
        raise ValueError(f"model.{option} must {'be positive' if one else 'hold positive sizes'}, got {got}")
    if any(size >= 2**31 for size in sizes):
        raise ValueError(
            f"model.{option} must {'be' if one else 'hold sizes'} below 2**31 (no array is that wide), got {got}"
        )
    return list(sizes)


def check_rate(option: str, rate: float) -> None:
    """A dropout rate is a probability in [0, 1)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"model.{option} is a drop probability in [0, 1), got {rate}")
