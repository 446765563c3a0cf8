"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama, and the per-head query and key norms of Qwen3).

:func:`make_norm` builds the one `model.norm` names, over `embed_dim`; a new
kind is a class here, a case there, and a name in `options.NORMS`. Gemma's
RMSNorm (`gemma_rmsnorm`) stores its scale as an offset from one and
multiplies by `1 + w`: the parameter is the tensor Gemma checkpoints hold,
so weights go in and out unchanged.

Both norms write their own backward pass (:func:`layer_norm`, :func:`rms_norm`):
the training step keeps each norm's input and its per-row statistics and
recomputes the normalised values, where autodiff of the formula kept two or
three float32 arrays of the input's shape per norm and layer (the centred
input, its square, the normalised product), each written, stacked by the
layer scan and read back every step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import nnx
from nnx_cli.models.transformer.options import Architecture


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation (Zhang & Sennrich, 2019): `x / rms(x) * scale`, statistics in float32.

    `scale` has shape `(num_features,)` and the logical axis `axis` (`embed`;
    `kv` for the per-head query and key norms)::

        RMSNorm(384, dtype=jnp.bfloat16, ctx=ctx)(x)   # same shape as x, in bfloat16

    With `offset=1.0` (Gemma) the scale is stored as `w` and applied as
    `1 + w`, in float32; it starts at zero.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-5,
        axis: str = "embed",
        offset: float = 0.0,
        dtype: Any,
        ctx: nnx.Context,
    ):
        self.epsilon = epsilon
        self.offset = offset
        self.dtype = dtype
        init = nnx.with_logical_partitioning(nnx.initializers.zeros() if offset else nnx.initializers.ones(), (axis,))
        self.scale = nnx.Param(init(ctx.make_rng("params"), (num_features,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = nnx.containers.stored_value(self, "scale")  # not constrained: a scan would stack it again
        return rms_norm(x, scale, self.epsilon, self.dtype, self.offset)


def rms_offset(arch: Architecture) -> float:
    """What RMSNorm adds to its stored scale: 1 for `gemma_rmsnorm`, else 0."""
    return 1.0 if arch.norm == "gemma_rmsnorm" else 0.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, dtype: Any, offset: float = 0.0) -> jax.Array:
    """`x / sqrt(mean(x^2) + epsilon) * (offset + scale)` over the last axis, in float32, returned in `dtype`.

    The backward pass keeps `x` and the per-row `1 / rms` only and recomputes
    the normalised `x`: autodiff kept that too, one more `[tokens, features]`
    array per norm and layer.
    """
    return _rms_norm_forward(x, scale, epsilon, dtype, offset)[0]


def _inverse_rms(x32: jax.Array, epsilon: float) -> jax.Array:
    return lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)


def _rms_norm_forward(x: jax.Array, scale: jax.Array, epsilon: float, dtype: Any, offset: float):
    x32 = x.astype(jnp.float32)
    inverse = _inverse_rms(x32, epsilon)
    applied = scale if not offset else offset + scale
    return (x32 * inverse * applied).astype(dtype), (x, scale, inverse)


def _rms_norm_backward(epsilon: float, dtype: Any, offset: float, saved: tuple, g: jax.Array):
    x, scale, inverse = saved
    y = x.astype(jnp.float32) * inverse
    g = g.astype(jnp.float32)
    d_scale = jnp.sum(g * y, axis=tuple(range(g.ndim - 1)))  # d (offset + scale) / d scale = 1
    gy = g * (scale if not offset else offset + scale)
    # y = x r with r = (mean(x^2) + eps)^(-1/2): dx = r (gy - y mean(gy y))
    dx = inverse * (gy - y * jnp.mean(gy * y, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


class LayerNorm(nnx.Module):
    """Layer normalisation (Ba et al., 2016) over the last axis: `(x - mean) / sqrt(var + epsilon) * scale + bias`,
    statistics in float32, the values of :class:`nnx.LayerNorm` bit for bit (its parameters too: `scale`, and
    `bias` or None) with a backward pass that keeps only `x` and two numbers per row (:func:`layer_norm`)::

        LayerNorm(768, epsilon=1e-5, dtype=jnp.bfloat16, ctx=ctx)(x)   # same shape as x, in bfloat16
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, use_bias: bool = True, dtype: Any,
                 ctx: nnx.Context):  # fmt: skip
        self.epsilon = epsilon
        self.dtype = dtype
        ones = nnx.with_logical_partitioning(nnx.initializers.ones(), ("embed",))
        zeros = nnx.with_logical_partitioning(nnx.initializers.zeros(), ("embed",))
        self.scale = nnx.Param(ones(ctx.make_rng("params"), (num_features,), jnp.float32))
        self.bias = nnx.Param(zeros(ctx.make_rng("params"), (num_features,), jnp.float32) if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = nnx.containers.stored_value(self, "scale")  # not constrained: a scan would stack it again
        return layer_norm(x, scale, nnx.containers.stored_value(self, "bias"), self.epsilon, self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None, epsilon: float, dtype: Any) -> jax.Array:
    """`(x - mean) * (rsqrt(var + epsilon) * scale) + bias` over the last axis, in float32, returned in `dtype`;
    `var = mean(x^2) - mean^2` (clipped at zero) as :class:`nnx.LayerNorm` computes it, so the values are its own.

    The backward pass keeps `x`, the mean and `1 / sqrt(var + epsilon)` per row
    and recomputes the normalised `x`; autodiff kept three float32 arrays of
    `x`'s shape (the centred `x`, `x^2`, the normalised product).
    """
    return _layer_norm_forward(x, scale, bias, epsilon, dtype)[0]


def _layer_norm_forward(x: jax.Array, scale: jax.Array, bias: jax.Array | None, epsilon: float, dtype: Any):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x32), axis=-1, keepdims=True) - jnp.square(mean))
    inverse = lax.rsqrt(var + epsilon)
    y = (x32 - mean) * (inverse * scale)
    if bias is not None:
        y = y + bias
    return y.astype(dtype), (x, scale, bias, mean, inverse)


def _layer_norm_backward(epsilon: float, dtype: Any, saved: tuple, g: jax.Array):
    x, scale, bias, mean, inverse = saved
    y = (x.astype(jnp.float32) - mean) * inverse
    g = g.astype(jnp.float32)
    rows = tuple(range(g.ndim - 1))
    d_scale = jnp.sum(g * y, axis=rows)
    d_bias = None if bias is None else jnp.sum(g, axis=rows).astype(bias.dtype)
    gy = g * scale
    # y = (x - mean) r with r = (var + eps)^(-1/2): dx = r (gy - mean(gy) - y mean(gy y))
    dx = inverse * (gy - jnp.mean(gy, axis=-1, keepdims=True) - y * jnp.mean(gy * y, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_scale.astype(scale.dtype), d_bias


layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


def make_norm(arch: Architecture, ctx: nnx.Context) -> nnx.Module:
    """The norm `arch.norm` names over `arch.embed_dim` features: `rmsnorm`, `gemma_rmsnorm` (scaled by
    `1 + w`), or `layernorm` (with a bias when `arch.bias`)."""
    if arch.norm in ("rmsnorm", "gemma_rmsnorm"):
        return RMSNorm(arch.embed_dim, epsilon=arch.norm_eps, offset=rms_offset(arch), dtype=arch.dtype, ctx=ctx)
    return LayerNorm(arch.embed_dim, epsilon=arch.norm_eps, use_bias=arch.bias, dtype=arch.dtype, ctx=ctx)
