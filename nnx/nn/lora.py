"""Low-rank adapters: :class:`LoRA` and its Variable kind :class:`LoRAParam`.

LoRA (Hu et al., 2021) fine-tunes a frozen linear map ``W`` by learning a
low-rank update: ``y = x @ W + dropout(x) @ A @ B * (alpha / rank)``, with
``A`` drawn at random and ``B`` zero, so training starts from the frozen
model exactly. ``A`` and ``B`` are :class:`LoRAParam`, a ``Param`` of their
own kind, so one ``partition`` separates what trains from what stays::

    class Adapted(nnx.Module):
        def __init__(self, ctx):
            self.linear = nnx.Linear(64, 64, ctx=ctx)
            self.lora = nnx.LoRA(64, 64, rank=8, alpha=16, ctx=ctx)

        def __call__(self, x):
            return self.linear(x) + self.lora(x)

    (adapters, frozen, rest), moduledef = model.partition(nnx.LoRAParam, nnx.Param, ...)
    grads = jax.grad(lambda a: loss(moduledef.apply(a, frozen, rest)(x)[0]))(adapters)   # adapters only

A ``LoRAParam`` is also a ``Param``: filters and code that ask for every
parameter (counting them, decoding with them) still see the adapters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from nnx import spmd
from nnx.containers import Param, stored_value
from nnx.contextlib import Context
from nnx.module import Module
from nnx.nn import initializers
from nnx.nn.stochastic import Dropout

Array = jax.Array
Shape = int | Sequence[int]


class LoRAParam(Param):
    """A parameter of a low-rank adapter: it trains while the ``Param`` s it adapts stay frozen."""


def _shape(features: Shape) -> tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _low_rank(x: Array, a: Array, b: Array, scale: float) -> Array:
    """``x @ a @ b * scale`` for ``x`` ``[tokens, in]``, ``a`` ``[in, rank]``, ``b`` ``[rank, out]``."""
    return (x @ a @ b) * jnp.asarray(scale, x.dtype)


def _low_rank_forward(x: Array, a: Array, b: Array, scale: float) -> tuple[Array, tuple[Array, ...]]:
    low = x @ a
    return (low @ b) * jnp.asarray(scale, x.dtype), (x, a, b, low)


def _low_rank_backward(scale: float, saved: tuple[Array, ...], g: Array) -> tuple[Array, Array, Array]:
    # The weight gradients written out as 2D matmuls over [tokens, features], dB = low^T g and
    # dA = x^T (g B^T): left to autodiff, XLA writes large activation gradients transposed only to feed them.
    x, a, b, low = saved
    scale = jnp.asarray(scale, x.dtype)
    g_low = (g @ b.T) * scale
    return g_low @ a.T, x.T @ g_low, (low.T @ g) * scale


_low_rank.defvjp(_low_rank_forward, _low_rank_backward)


class LoRA(Module):
    """The low-rank update ``dropout(x) @ a @ b * (alpha / rank)`` of a linear map ``in_features -> out_features``.

    ``in_features`` and ``out_features`` may be shapes: the update contracts
    the trailing ``len(in_features)`` axes of ``x`` (an attention output
    kernel maps ``(heads, head_dim)`` to ``embed``). ``a`` has shape
    ``in_features + (rank,)`` and is drawn from a normal distribution with
    the variance of PyTorch's default ``Linear`` init (``1 / (3 fan_in)``),
    ``b`` has shape ``(rank,) + out_features`` and starts at zero, so the
    update starts at zero. Both are :class:`LoRAParam` s, kept in float32;
    the update computes in ``dtype`` (the input's by default).

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> lora = nnx.LoRA(4, 3, rank=2, alpha=4, ctx=nnx.context(0))
      >>> lora.a.shape, lora.b.shape
      ((4, 2), (2, 3))
      >>> lora(jnp.ones((5, 4))).shape    # zeros until b trains
      (5, 3)

    Args:
      in_features: input size (or trailing input shape).
      out_features: output size (or shape).
      rank: the rank of the update, at least 1.
      alpha: the update is scaled by ``alpha / rank`` (default ``rank``: by 1).
      dropout: drop probability on the input of the update (training only).
      in_axes: logical axis names of the input dimensions, for sharding
        (the rank dimension is never split).
      out_axes: logical axis names of the output dimensions.
      dtype: compute dtype.
      ctx: the ``params`` stream draws ``a``.
    """

    def __init__(
        self,
        in_features: Shape,
        out_features: Shape,
        *,
        rank: int,
        alpha: float | None = None,
        dropout: float = 0.0,
        in_axes: Sequence[str | None] | None = None,
        out_axes: Sequence[str | None] | None = None,
        dtype: Any = None,
        ctx: Context,
    ):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
        in_shape, out_shape = _shape(in_features), _shape(out_features)
        a_init = initializers.normal(1.0 / math.sqrt(3 * math.prod(in_shape)))
        b_init = initializers.zeros()
        if in_axes is not None and out_axes is not None:
            a_init = spmd.with_logical_partitioning(a_init, (*in_axes, None))
            b_init = spmd.with_logical_partitioning(b_init, (None, *out_axes))
        self.a = LoRAParam(a_init(ctx.make_rng("params"), (*in_shape, rank), jnp.float32))
        self.b = LoRAParam(b_init(ctx.make_rng("params"), (rank, *out_shape), jnp.float32))
        self.in_rank = len(in_shape)
        self.rank = rank
        self.alpha = float(rank if alpha is None else alpha)
        self.scale = self.alpha / rank
        self.dtype = dtype
        self.dropout = Dropout(dropout)

    def __call__(self, x: Array, *, deterministic: bool | None = True, ctx: Context | None = None) -> Array:
        dtype = self.dtype or x.dtype
        x = self.dropout(x, deterministic=deterministic, ctx=ctx)
        a, b = stored_value(self, "a"), stored_value(self, "b")  # not constrained: a scan would stack them again
        tokens, out_shape = x.shape[: x.ndim - self.in_rank], b.shape[1:]
        a = a.astype(dtype).reshape(-1, self.rank)
        y = _low_rank(x.astype(dtype).reshape(-1, a.shape[0]), a, b.astype(dtype).reshape(self.rank, -1), self.scale)
        return y.reshape(*tokens, *out_shape)

    def delta(self) -> Array:
        """The update as a full matrix, ``in_features + out_features``, in float32: what merging adds to ``W``."""
        return jnp.tensordot(self.a, self.b, axes=1) * self.scale
