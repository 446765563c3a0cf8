"""Causal self-attention: grouped-query heads, rotary positions, the masks, and the key-value cache for decoding.

Three ways through the same projections:

- `__call__`: a whole sequence, causal, or within each packed example when
  given `segments`; a fused kernel where one runs (:func:`fused_attention`),
  the attention weights written out when they take dropout;
- `prefill`: a prompt, whose keys and values fill the cache `init_cache` added;
- `decode`: one token per row at per-row positions, attending to the cache.

A new attention variant (sliding windows, soft-capped logits, other masks)
belongs here, with its option in `options.Architecture`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import nnx
from nnx_cli.models.transformer.dense import LAYERS, Dense, constrain
from nnx_cli.models.transformer.norms import RMSNorm
from nnx_cli.models.transformer.options import Architecture
from nnx_cli.models.transformer.rotary import rope_frequencies, rotate

MASKED_LOGIT = -1e30
"""The float32 logit of what must never be picked (a key a query may not see, a padded vocabulary id): far below
any real logit, finite even divided by a small temperature."""


def fused_attention(dtype: Any, head_dim: int) -> str:
    """`cudnn` where JAX's cuDNN attention runs (GPU, 16-bit floats, head_dim a multiple of 8 up to 128), else `xla`."""
    fused = jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
    return "cudnn" if fused and head_dim % 8 == 0 and head_dim <= 128 else "xla"


class Attention(nnx.Module):
    """Causal self-attention with `num_heads` query heads sharing `num_kv_heads` key-value heads (grouped-query
    attention; multi-head when equal); `init_cache` gives it a key-value cache for `prefill` and `decode`."""

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        embed, heads, kv_heads, head_dim = arch.embed_dim, arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = dict(std=0.02, dtype=arch.dtype, use_bias=arch.bias or arch.qkv_bias, ctx=ctx)
        kv_axes = (arch.kv_axis, "kv")
        self.query = Dense((embed,), (heads, head_dim), ("embed",), ("heads", "kv"), lora=arch.adapter("q"), **qkv)
        self.key = Dense((embed,), (kv_heads, head_dim), ("embed",), kv_axes, lora=arch.adapter("k"), **qkv)
        self.value = Dense((embed,), (kv_heads, head_dim), ("embed",), kv_axes, lora=arch.adapter("v"), **qkv)
        self.out = Dense(
            (heads, head_dim),
            (embed,),
            ("heads", "kv"),
            ("embed",),
            std=arch.out_std,
            dtype=arch.dtype,
            use_bias=arch.bias,
            lora=arch.adapter("o"),
            ctx=ctx,
        )
        if arch.qk_norm:
            norm = dict(epsilon=arch.norm_eps, axis="kv", dtype=arch.dtype, ctx=ctx)
            self.query_norm = RMSNorm(head_dim, **norm)
            self.key_norm = RMSNorm(head_dim, **norm)
        self.arch = arch
        self.dtype = arch.dtype
        self.implementation = fused_attention(arch.dtype, head_dim)
        self.attention_dropout = nnx.Dropout(arch.attention_dropout)
        self.dropout = nnx.Dropout(arch.dropout)

    def _project(
        self, x: jax.Array, positions: jax.Array, deterministic: bool = True, ctx: nnx.Context | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        train = dict(deterministic=deterministic, ctx=ctx)
        q = constrain(self.query(x, **train), ("batch", "length", "heads", "kv"))
        kv_axes = ("batch", "length", self.arch.kv_axis, "kv")
        k, v = constrain(self.key(x, **train), kv_axes), constrain(self.value(x, **train), kv_axes)
        if self.arch.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        if self.arch.rope:
            frequencies = rope_frequencies(self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)
            q, k = rotate(q, positions, frequencies), rotate(k, positions, frequencies)
        return q, k, v

    def _causal(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        deterministic: bool,
        ctx: nnx.Context | None,
        segments: jax.Array | None = None,
    ):
        """Causal attention; with `segments` `[batch, length]` (packed examples), only within equal segment ids."""
        same = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
        if deterministic or self.attention_dropout.rate == 0.0:
            implementation = self.implementation if q.shape[1] > 1 and same is None else "xla"
            return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, implementation=implementation)
        # Dropout on the attention weights: neither fused kernel offers it, so the XLA form is written out.
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        if same is not None:
            causal = causal & same
        weights = jax.nn.softmax(jnp.where(causal, logits, MASKED_LOGIT), axis=-1)
        weights = self.attention_dropout(weights, deterministic=False, ctx=ctx)
        return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)

    def _output(self, o: jax.Array, deterministic: bool, ctx: nnx.Context | None) -> jax.Array:
        o = constrain(o, ("batch", "length", "heads", "kv"))
        return self.dropout(self.out(o, deterministic=deterministic, ctx=ctx), deterministic=deterministic, ctx=ctx)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> jax.Array:
        q, k, v = self._project(x, positions, deterministic, ctx)
        return self._output(self._causal(q, k, v, deterministic, ctx, segments), deterministic, ctx)

    # --- decoding with a key-value cache ------------------------------------

    def init_cache(self, batch_size: int, max_len: int, layers: int | None = None) -> None:
        """Zero keys and values `[batch, kv_heads, max_len, head_dim]` (with a leading `layers` axis when stacked).

        Heads come before positions so that one query's attention reads each head's keys contiguously.
        """
        shape = (batch_size, self.arch.num_kv_heads, max_len, self.arch.head_dim)
        axes = ("batch", self.arch.kv_axis, "length", "kv")
        if layers is not None:
            shape, axes = (layers, *shape), (LAYERS, *axes)
        zeros = nnx.with_logical_constraint(jnp.zeros(shape, self.dtype), axes)
        self.cached_key = nnx.Cache(zeros, sharding=axes)
        self.cached_value = nnx.Cache(zeros, sharding=axes)

    def prefill(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Attention over a prompt `x` `[batch, length, embed]` at positions `0..length-1`; caches keys and values."""
        q, k, v = self._project(x, positions)
        for name, new in (("cached_key", k), ("cached_value", v)):
            cached = getattr(self, name)
            setattr(self, name, lax.dynamic_update_slice_in_dim(cached, new.swapaxes(1, 2).astype(cached.dtype), 0, 2))
        return self._output(self._causal(q, k, v, True, None), True, None)

    def decode(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """One token per row, `x` `[batch, 1, embed]` at `positions` `[batch, 1]`: caches it, attends to the cache."""
        q, k, v = self._project(x, positions)
        batch, _, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        # One (row, head) index pair per written vector: XLA makes this a cheaper scatter than rows alone.
        rows, each_head, at = jnp.arange(batch)[:, None], jnp.arange(kv_heads)[None, :], positions
        self.cached_key = self.cached_key.at[rows, each_head, at].set(k[:, 0].astype(self.dtype))
        self.cached_value = self.cached_value.at[rows, each_head, at].set(v[:, 0].astype(self.dtype))
        grouped = q[:, 0].reshape(batch, kv_heads, heads // kv_heads, head_dim)  # query heads by their key-value head
        scores = jnp.einsum("bkgd,bktd->bkgt", grouped, self.cached_key, preferred_element_type=jnp.float32)
        visible = jnp.arange(self.cached_key.shape[2]) <= positions  # [batch, max_len]
        scores = jnp.where(visible[:, None, None, :], scores / math.sqrt(head_dim), MASKED_LOGIT)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        o = jnp.einsum("bkgt,bktd->bkgd", weights, self.cached_value).reshape(batch, heads, head_dim)
        return self._output(o[:, None], True, None)
