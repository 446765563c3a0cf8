"""Low-rank adapters: :class:`LoRA` and its Variable kind :class:`LoRAParam`.

LoRA (Hu et al., 2021) fine-tunes a frozen linear map ``W`` by learning a
low-rank update: ``y = x @ W + dropout(x) @ A @ B * (alpha / rank)``, with
``A`` drawn at random and ``B`` zero, so training starts from the frozen
model exactly. ``A`` and ``B`` are :class:`LoRAParam`, a ``Param`` of their
own kind, so one ``partition`` separates what trains from what stays::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> class Adapted(nnx.Module):
    ...   def __init__(self, ctx):
    ...     self.linear = nnx.Linear(64, 64, ctx=ctx)
    ...     self.lora = nnx.LoRA(64, 64, rank=8, alpha=16, ctx=ctx)
    ...
    ...   def __call__(self, x):
    ...     return self.linear(x) + self.lora(x)
    >>> model, x = Adapted(nnx.context(0)), jnp.ones((4, 64))
    >>> bool((model(x) == model.linear(x)).all())  # B starts at zero
    True
    >>> (adapters, frozen), moduledef = model.partition(nnx.LoRAParam, nnx.Param)
    >>> def loss(adapters):
    ...   y, _ = moduledef.apply(adapters, frozen)(x)
    ...   return jnp.mean(y ** 2)
    >>> list(jax.grad(loss)(adapters))  # the adapters' gradients only
    ['lora/a', 'lora/b']

A ``LoRAParam`` is also a ``Param``: filters and code that ask for every
parameter (counting them, decoding with them) still see the adapters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nnx import spmd
from nnx.containers import Param, stored_value
from nnx.contextlib import Context
from nnx.module import Module
from nnx.nn import initializers
from nnx.nn.quantize import no_gradient
from nnx.nn.stochastic import Dropout

Array = jax.Array
Shape = int | Sequence[int]


class LoRAParam(Param):
    """A parameter of a low-rank adapter: it trains while the ``Param`` s it adapts stay frozen."""


def _shape(features: Shape) -> tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


def _flat(x: Array, features: int) -> Array:
    """``x`` as ``[tokens, features]``."""
    return x.reshape(-1, features)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _low_rank(x: Array, a: Array, b: Array, scale: float) -> Array:
    """``x @ a @ b * scale``, ``[tokens, out]``, for ``x`` of any shape whose trailing axes hold ``in`` features
    (flattened here: the backward pass keeps ``x`` as given, the very array the base product keeps), ``a``
    ``[in, rank]``, ``b`` ``[rank, out]``."""
    return (_flat(x, a.shape[0]) @ a @ b) * jnp.asarray(scale, x.dtype)


def _low_rank_forward(x: Array, a: Array, b: Array, scale: float) -> tuple[Array, tuple[Array, ...]]:
    low = _flat(x, a.shape[0]) @ a
    return (low @ b) * jnp.asarray(scale, x.dtype), (x, a, b, low)


def _low_rank_backward(scale: float, saved: tuple[Array, ...], g: Array) -> tuple[Array, Array, Array]:
    # The weight gradients written out as 2D matmuls over [tokens, features], dB = low^T g and
    # dA = x^T (g B^T): left to autodiff, XLA writes large activation gradients transposed only to feed them.
    x_in, a, b, low = saved
    x = _flat(x_in, a.shape[0])
    scale = jnp.asarray(scale, x.dtype)
    g_low = (g @ b.T) * scale
    return (g_low @ a.T).reshape(x_in.shape), x.T @ g_low, (low.T @ g) * scale


_low_rank.defvjp(_low_rank_forward, _low_rank_backward)


def _f32_dot(p: Array, q: Array, contract: tuple[tuple[int], tuple[int]]) -> Array:
    return lax.dot_general(p, q, (contract, ((), ())), preferred_element_type=jnp.float32)


def _rows(m: Array) -> Array:
    """``m.T`` for a narrow ``m`` ``[n, rank]``, laid out row by row, as a product with the identity (exact).
    XLA folds a plain transpose into the product that reads it, as a contraction over the operand's leading
    axis, which its CPU backend multiplies in 16 bits only after widening both operands to float32 (the
    other operand is a ``[tokens, features]`` activation)."""
    return _f32_dot(jnp.eye(m.shape[1], dtype=m.dtype), m, ((1,), (1,))).astype(m.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _adapted(spec: tuple, weight: Callable, x: Array, x_lora: Array | None, source: Any, a: Array, b: Array) -> Array:
    return _adapted_forward(spec, weight, x, x_lora, source, a, b)[0]


def _adapted_forward(spec, weight, x_in, x_lora, source, a, b):
    scale, out_dtype, _ = spec
    x = _flat(x_in, a.shape[0])
    low = (_f32_dot(x if x_lora is None else x_lora, a, ((1,), (0,))) * scale).astype(x.dtype)  # x a s
    w = weight(source)
    if w.shape[1] > w.shape[0]:  # the update rides in the base product as `rank` more input features
        y = _f32_dot(jnp.concatenate([x, low], 1), jnp.concatenate([w, b], 0), ((1,), (0,)))
    else:
        y = _f32_dot(x, w, ((1,), (0,))) + _f32_dot(low, b, ((1,), (0,)))
    return y.astype(out_dtype or x.dtype), (x_in, x_lora, source, a, b, low)


def _adapted_backward(spec, weight, saved, g):
    scale, _, trainable = spec
    x_in, x_lora, source, a, b, low = saved
    x = _flat(x_in, a.shape[0])
    w = weight(source)
    g = g.astype(x.dtype)
    if w.shape[1] > w.shape[0]:
        dx_and_low = _f32_dot(g, jnp.concatenate([w, b], 0), ((1,), (1,)))
        dx, g_low = dx_and_low[:, : w.shape[0]], (dx_and_low[:, w.shape[0] :] * scale).astype(x.dtype)
    else:
        dx, g_low = _f32_dot(g, w, ((1,), (1,))), (_f32_dot(g, b, ((1,), (1,))) * scale).astype(x.dtype)
    dx_lora = _f32_dot(g_low, a, ((1,), (1,)))
    xl = x if x_lora is None else x_lora
    da_t = _f32_dot(_rows(g_low), xl, ((1,), (0,)))  # [rank, in]: the activation read as it is laid out
    # turned by a float32 product: XLA folds a plain transpose into da_t's product, a form its CPU has no
    # 16-bit product for (it failed to run, `BF16 x BF16 = F32`)
    da = _f32_dot(da_t, jnp.eye(da_t.shape[0], dtype=da_t.dtype), ((0,), (0,)))
    db = _f32_dot(_rows(low), g, ((1,), (0,)))
    if x_lora is None:
        dx, dxl = (dx + dx_lora).astype(x.dtype), None
    else:
        dx, dxl = dx.astype(x.dtype), dx_lora.astype(x_lora.dtype)
    dx = dx.reshape(x_in.shape)
    if trainable:  # a base held as a parameter: its gradient, which XLA drops when only the adapters train
        dsource = _f32_dot(x, g, ((0,), (0,))).reshape(source.shape).astype(source.dtype)
    else:
        dsource = jax.tree.map(no_gradient, source)
    return dx, dxl, dsource, da.astype(a.dtype), db.astype(b.dtype)


_adapted.defvjp(_adapted_forward, _adapted_backward)


def _check_input(x: Array, in_shape: tuple[int, ...]) -> None:
    if x.ndim < len(in_shape) or x.shape[x.ndim - len(in_shape) :] != in_shape:
        raise ValueError(
            f"LoRA expects inputs whose trailing axes have the shape in_features={in_shape}, got shape {x.shape}."
        )


def _deterministic(argument: bool | None, ctx: Context | None) -> bool:
    """LoRA's dropout switch: the argument, else the context's ``deterministic`` flag, else True. (A default of
    True for the argument hid the flag: a context saying training trained without the dropout configured.)"""
    if argument is not None:
        return argument
    flag = ctx.get_flag("deterministic") if ctx is not None else None
    return True if flag is None else bool(flag)


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

    def __call__(self, x: Array, *, deterministic: bool | None = None, ctx: Context | None = None) -> Array:
        """``x``'s update, ``dropout(x) @ a @ b * alpha / rank``. Dropout applies unless ``deterministic`` (the
        argument, else the context's ``deterministic`` flag, else True: no dropout when nothing says training)."""
        # x's dtype; an integer x in float32, as Linear promotes it (it truncated the update to integers)
        dtype = self.dtype or (x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32)
        x = self.dropout(x, deterministic=_deterministic(deterministic, ctx), ctx=ctx)
        a, b = stored_value(self, "a"), stored_value(self, "b")  # not constrained: a scan would stack them again
        _check_input(x, a.shape[:-1])
        tokens, out_shape = x.shape[: x.ndim - self.in_rank], b.shape[1:]
        a = a.astype(dtype).reshape(-1, self.rank)
        y = _low_rank(x.astype(dtype), a, b.astype(dtype).reshape(self.rank, -1), self.scale)
        return y.reshape(*tokens, *out_shape)

    def adapt(
        self,
        x: Array,
        weight: Callable[[Any], Array],
        source: Any,
        *,
        trainable: bool = False,
        out_dtype: Any = None,
        deterministic: bool | None = None,
        ctx: Context | None = None,
    ) -> Array:
        """The adapted map ``x @ W + self(x)``, for ``W = weight(source)`` ``[in, out]`` (flattened), as one
        product: the base's and the update's products accumulated in float32 and rounded once to ``out_dtype``
        (``x``'s by default).

        ``weight`` builds the base weight from ``source`` (a frozen kernel's stored form: 4-bit codes and
        scales, or 16-bit bits) in both passes, so only ``source`` is kept between them, never the weight it
        builds. Where the output is wider than the input, the update rides in the base product as ``rank``
        more input features (``[x, x a s] @ [W; b]``), and the backward pass takes the update's input gradient
        from the same product: the ``[tokens, out]`` activation and its gradient are read once, not twice.
        ``source`` gets no gradient unless ``trainable``. Made for XLA's CPU, whose separate 16-bit products
        for the update widen or write ``[tokens, out]`` activations in float32 (Qwen2.5-0.5B's MLP at 1,024
        tokens: 0.7-0.8x the time of the base and update computed apart)::

            >>> import jax.numpy as jnp
            >>> import nnx
            >>> lora = nnx.LoRA(64, 32, rank=4, ctx=nnx.context(0))
            >>> kernel = jnp.ones((64, 32))  # a frozen float32 kernel [in, out]
            >>> x = jnp.ones((4, 64), jnp.bfloat16)  # computes in x's dtype
            >>> y = lora.adapt(x, lambda w: w.astype(jnp.bfloat16), kernel)
            >>> y.shape, y.dtype
            ((4, 32), dtype(bfloat16))
        """
        xl = self.dropout(x, deterministic=_deterministic(deterministic, ctx), ctx=ctx)
        a, b = stored_value(self, "a"), stored_value(self, "b")
        _check_input(x, a.shape[:-1])
        tokens, out_shape = x.shape[: x.ndim - self.in_rank], b.shape[1:]
        a2, b2 = a.astype(x.dtype).reshape(-1, self.rank), b.astype(x.dtype).reshape(self.rank, -1)
        x_lora = None if xl is x else _flat(xl.astype(x.dtype), a2.shape[0])
        spec = (self.scale, None if out_dtype is None else jnp.dtype(out_dtype), trainable)
        y = _adapted(spec, weight, x, x_lora, source, a2, b2)  # x as given: kept as the base product keeps it
        return y.reshape(*tokens, *out_shape)

    def delta(self) -> Array:
        """The update as a full matrix, ``in_features + out_features``, in float32: what merging adds to ``W``."""
        return jnp.tensordot(self.a, self.b, axes=1) * self.scale
