"""Normalisation layers: LayerNorm (GPT-2) and RMSNorm (Llama, and the per-head query and key norms of Qwen3).

:func:`make_norm` builds the one `model.norm` names, over `embed_dim`; a new
kind is a class here, a case there, and a name in `options.NORMS`. Gemma's
RMSNorm (`gemma_rmsnorm`) stores its scale as an offset from one and
multiplies by `1 + w`: the parameter is the tensor Gemma checkpoints hold,
so weights go in and out unchanged.
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


def make_norm(arch: Architecture, ctx: nnx.Context) -> nnx.Module:
    """The norm `arch.norm` names over `arch.embed_dim` features: `rmsnorm`, `gemma_rmsnorm` (scaled by
    `1 + w`), or `layernorm` (with a bias when `arch.bias`)."""
    if arch.norm in ("rmsnorm", "gemma_rmsnorm"):
        return RMSNorm(arch.embed_dim, epsilon=arch.norm_eps, offset=rms_offset(arch), dtype=arch.dtype, ctx=ctx)
    return nnx.LayerNorm(
        arch.embed_dim,
        epsilon=arch.norm_eps,
        dtype=arch.dtype,
        use_bias=arch.bias,
        scale_init=nnx.with_logical_partitioning(nnx.initializers.ones(), ("embed",)),
        bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), ("embed",)),
        ctx=ctx,
    )
