"""Causal self-attention: grouped-query heads, rotary positions, the masks, and the key-value cache for decoding.

Three ways through the same projections:

- `__call__`: a whole sequence, causal, or within each packed example when
  given `segments`, the way `model.attention` chooses (:func:`choose_attention`):
  :func:`.attention_core.attention_core` (no attention weights saved for the
  backward pass), the weights written out for XLA (and whenever they take
  dropout), or cuDNN's fused kernel;
- `prefill`: a prompt, whose keys and values fill the cache `init_cache` added;
- `decode`: one token per row at per-row positions, attending to the cache.

Sliding windows (Mistral, Gemma, Phi-3): a query at position `i` sees the
keys at `i - window + 1 .. i` (:func:`visible`, as `transformers` counts).
The cache of a sliding layer is a ring of `window` slots, position `p` in
slot `p % window`: memory stops growing at the window, and prompts longer
than it keep their last `window` keys. Layers may differ (Gemma alternates
sliding and full layers, and Gemma 3 turns them at different rotary bases):
each method takes its layer's index, a Python int for unrolled layers, or
traced when scanned over layers that differ (:func:`layer_window`,
:func:`layer_frequencies`).

A new attention variant belongs here, with its option in `options.Architecture`
(and in the core, when it changes the scores or the mask).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

import nnx
from nnx_cli.models.transformer.attention_core import attention_core, unnormalized_softmax
from nnx_cli.models.transformer.dense import LAYERS, Dense, constrain
from nnx_cli.models.transformer.norms import RMSNorm, rms_offset
from nnx_cli.models.transformer.options import Architecture
from nnx_cli.models.transformer.rotary import rope_frequencies, rotate

MASKED_LOGIT = -1e30
"""The float32 logit of what must never be picked (a key a query may not see, a padded vocabulary id): far below
any real logit, finite even divided by a small temperature."""

NO_WINDOW = 1 << 30
"""The window of a full-attention layer where the layer's kind is only known at run time (scanned layers of both
kinds): longer than any sequence."""

Layer = int | jax.Array | None
"""A layer's index: a Python int (unrolled layers), traced (scanned layers that differ), or None (not needed)."""


# How attention runs
# ------------------------------------------------------------------------------


def choose_attention(arch: Architecture, platform: str | None = None) -> tuple[str, str]:
    """`model.attention` resolved on `platform` (default: JAX's): `core`, `xla` or `cudnn`, and why, in words.

    - `auto`: cuDNN's fused kernel on a GPU where it takes the dtype and the head size (16-bit floats; a head
      of a multiple of 8, up to 128 features, 256 from Hopper on), else the core;
    - `core`: :func:`attention_core`, which saves no weights for the backward pass;
    - `xla`: the weights written out, the rest left to XLA and autodiff (which saves them: memory grows with
      the square of the length);
    - `cudnn`: cuDNN's kernel (`jax.nn.dot_product_attention`); a ValueError naming `model.attention` where
      it cannot run.

    The core and `xla` take every variant; cuDNN's kernel runs what it can, the rest in the core
    (:func:`cudnn_fallbacks`)::

        choose_attention(arch, "gpu")   # ('cudnn', 'auto on gpu') for a bfloat16 model with heads of 64
    """
    platform = platform or nnx.spmd.platform()
    refusal = _cudnn_refusal(arch, platform)
    if arch.attention == "auto":
        return ("core", f"auto on {platform}: {refusal}") if refusal else ("cudnn", f"auto on {platform}")
    if arch.attention == "cudnn" and refusal:
        raise ValueError(f"model.attention: cudnn cannot run here: {refusal}; use auto, core or xla")
    return arch.attention, "model.attention"


def _cudnn_refusal(arch: Architecture, platform: str) -> str | None:
    """Why cuDNN's kernel cannot run `arch`'s attention on `platform` (None: it can)."""
    if platform != "gpu":
        return f"cuDNN's kernel runs on NVIDIA GPUs, not on {platform}"
    if arch.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN's kernel takes 16-bit floats, not {jnp.dtype(arch.dtype).name} (model.dtype)"
    limit = _cudnn_head_limit()
    if arch.head_dim % 8 or arch.head_dim > limit:
        return f"cuDNN's kernel takes heads of a multiple of 8 features up to {limit}, not {arch.head_dim}"
    return None


def _cudnn_head_limit() -> int:
    """The largest head cuDNN's kernel takes: 256 features from Hopper (compute capability 9) on, else 128."""
    capability = getattr(jax.devices()[0], "compute_capability", None) if nnx.spmd.platform() == "gpu" else None
    try:
        return 256 if capability is not None and float(capability) >= 9.0 else 128
    except ValueError:
        return 128


def cudnn_fallbacks(arch: Architecture) -> list[str]:
    """The variants cuDNN's kernel does not take, which then run in the core: packed examples (segments; by the
    batch), soft-capped scores, and windows known only at run time (scanned layers that differ)."""
    out = ["packed examples"]
    if arch.attention_softcap is not None:
        out.append("soft-capped scores (model.attention_softcap)")
    if arch.scanned and arch.layers_differ:
        out.append("windows that differ between scanned layers")
    return out


# Masks, windows and soft-capping
# ------------------------------------------------------------------------------


def visible(
    q_positions: jax.Array,
    k_positions: jax.Array,
    *,
    window: int | jax.Array | None = None,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
) -> jax.Array:
    """Which keys each query attends to, `[batch, 1, queries, keys]` (bool, broadcast over heads).

    A key is visible when its position is at or before the query's (causal) and not below 0 (an empty cache
    slot), fewer than `window` positions back (a sliding window: the query at `i` sees `i - window + 1 .. i`),
    and, for packed examples, in the query's segment. Positions are `[batch or 1, queries]` and
    `[batch or 1, keys]`, segments the same; `window` may be traced::

        visible(jnp.arange(4)[None], jnp.arange(4)[None], window=2)[0, 0]   # the diagonal and the one below it
    """
    q, k = q_positions[:, :, None], k_positions[:, None, :]
    mask = (k <= q) & (k >= 0)
    if window is not None:
        mask = mask & (q - k < window)
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None]


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(logits / cap)`: logits squashed smoothly into `(-cap, cap)` (Gemma 2's attention and final
    logits); unchanged when `cap` is None."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def layer_window(arch: Architecture, layer: Layer) -> int | jax.Array | None:
    """The sliding window of layer `layer`: `arch.sliding_window` on a sliding layer, None on a full one; traced
    (:data:`NO_WINDOW` for a full layer) when `layer` is traced and the layers differ."""
    slides = arch.slides(layer if isinstance(layer, int) else None)
    if slides is not None:
        return arch.sliding_window if slides else None
    return jnp.where(jnp.asarray(arch.sliding_layers)[layer], arch.sliding_window, NO_WINDOW)


def layer_frequencies(arch: Architecture, layer: Layer) -> jax.Array:
    """The rotary frequencies of layer `layer`, over `rotary_dim` (or all) features: sliding layers turn at
    `rope_local_theta` unscaled when it is set (Gemma 3's local base), every other layer at `rope_theta` with
    `rope_scaling`."""
    dim = arch.rotary_dim or arch.head_dim
    full = rope_frequencies(dim, arch.rope_theta, arch.rope_scaling)
    if arch.rope_local_theta is None:
        return full
    local = rope_frequencies(dim, arch.rope_local_theta)
    slides = arch.slides(layer if isinstance(layer, int) else None)
    if slides is not None:
        return local if slides else full
    return jnp.where(jnp.asarray(arch.sliding_layers)[layer], local, full)


def _heads_out(o: jax.Array) -> jax.Array:
    """Attention's output `[batch, length, heads, head_dim]` constrained to its logical axes, before the out
    projection (one function, so that the core's static arguments are the same at every call)."""
    return constrain(o, ("batch", "length", "heads", "kv"))


class Attention(nnx.Module):
    """Causal self-attention with `num_heads` query heads sharing `num_kv_heads` key-value heads (grouped-query
    attention; multi-head when equal); `init_cache` gives it a key-value cache for `prefill` and `decode`.

    Every method takes `layer`, the index of the layer it is (see :data:`Layer`): what differs between layers
    (the window, the rotary base) is looked up by it.
    """

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        embed, heads, kv_heads, head_dim = arch.embed_dim, arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = dict(std=0.02, dtype=arch.dtype, use_bias=arch.bias or arch.qkv_bias, ctx=ctx)
        kv_axes = (arch.kv_axis, "kv")
        self.query = Dense((embed,), (heads, head_dim), ("embed",), ("heads", "kv"), lora=arch.adapter("q"),
                           quantize=arch.quantized("q"), **qkv)  # fmt: skip
        self.key = Dense((embed,), (kv_heads, head_dim), ("embed",), kv_axes, lora=arch.adapter("k"),
                         quantize=arch.quantized("k"), **qkv)  # fmt: skip
        self.value = Dense((embed,), (kv_heads, head_dim), ("embed",), kv_axes, lora=arch.adapter("v"),
                           quantize=arch.quantized("v"), **qkv)  # fmt: skip
        self.out = Dense(
            (heads, head_dim),
            (embed,),
            ("heads", "kv"),
            ("embed",),
            std=arch.out_std,
            dtype=arch.dtype,
            use_bias=arch.bias,
            lora=arch.adapter("o"),
            quantize=arch.quantized("o"),
            ctx=ctx,
        )
        if arch.qk_norm and arch.qk_norm_scope == "projection":  # OLMoE: all heads of a projection together
            norm = dict(epsilon=arch.norm_eps, axis=None, offset=rms_offset(arch), dtype=arch.dtype, ctx=ctx)
            self.query_norm = RMSNorm(heads * head_dim, **norm)
            self.key_norm = RMSNorm(kv_heads * head_dim, **norm)
        elif arch.qk_norm:
            norm = dict(epsilon=arch.norm_eps, axis="kv", offset=rms_offset(arch), dtype=arch.dtype, ctx=ctx)
            self.query_norm = RMSNorm(head_dim, **norm)
            self.key_norm = RMSNorm(head_dim, **norm)
        self.arch = arch
        self.dtype = arch.dtype
        self.scale = None if arch.query_scale is None else arch.query_scale**-0.5  # None: 1 / sqrt(head_dim)
        self.implementation, self.reason = choose_attention(arch)
        self.attention_dropout = nnx.Dropout(arch.attention_dropout)
        self.dropout = nnx.Dropout(arch.dropout)

    def _project(
        self, x: jax.Array, positions: jax.Array, layer: Layer = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of `x` at `positions`, normed and rotated, for inference."""
        return self._positioned(*self.projections(x), positions, layer)

    def projections(
        self, x: jax.Array, *, deterministic: bool = True, ctx: nnx.Context | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The query, key and value projections of `x` `[batch, length, embed]`, `[batch, length, heads,
        head_dim]` (keys and values with `kv_heads`), before any query-key norm or rotation (:meth:`attend` takes
        them from here)."""
        train = dict(deterministic=deterministic, ctx=ctx)
        batch, length = x.shape[:2]
        # One [tokens, embed] operand for the three projections: the backward pass keeps one copy of it, not three.
        tokens = x.reshape(batch * length, -1)
        project = lambda dense: dense(tokens, **train).reshape(batch, length, -1, self.arch.head_dim)  # noqa: E731
        q = constrain(project(self.query), ("batch", "length", "heads", "kv"))
        kv_axes = ("batch", "length", self.arch.kv_axis, "kv")
        return q, constrain(project(self.key), kv_axes), constrain(project(self.value), kv_axes)

    def _positioned(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, layer: Layer
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The projections normed (`qk_norm`) and rotated to their `positions` (rotary positions)."""
        if self.arch.qk_norm and self.arch.qk_norm_scope == "projection":
            flat = lambda norm, y: norm(y.reshape(*y.shape[:-2], -1)).reshape(y.shape)  # noqa: E731
            q, k = flat(self.query_norm, q), flat(self.key_norm, k)
        elif self.arch.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        if self.arch.rope:
            frequencies = layer_frequencies(self.arch, layer)
            q, k = rotate(q, positions, frequencies), rotate(k, positions, frequencies)
        return q, k, v

    def _scaled(self, logits: jax.Array) -> jax.Array:
        """Attention logits scaled (`/ sqrt(head_dim)`, or `* query_scale ** -0.5`) and soft-capped."""
        logits = logits / math.sqrt(self.arch.head_dim) if self.scale is None else logits * self.scale
        return soft_cap(logits, self.arch.attention_softcap)

    def summary(self) -> str:
        """Which attention runs and why, and what takes another way, in one line::

        'cudnn (auto on gpu); the core for packed examples'
        """
        out = f"{self.implementation} ({self.reason})"
        if self.implementation == "cudnn":
            out += f"; the core for {', '.join(cudnn_fallbacks(self.arch))}"
        if self.arch.attention_dropout > 0 and self.implementation != "xla":
            out += "; xla in training (attention dropout needs the weights written out)"
        return out

    def _causal(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        deterministic: bool,
        ctx: nnx.Context | None,
        segments: jax.Array | None = None,
        window: int | jax.Array | None = None,
    ):
        """Causal attention; with `segments` `[batch, length]` (packed examples), only within equal segment ids;
        with `window`, only over the last `window` positions. The output is constrained to its logical axes
        (cuDNN's by the kernel's own partitioning).

        As `self.implementation` says (:func:`choose_attention`); cuDNN's kernel where it takes the variant (no
        segments, no soft cap, a window known at trace time, more than one query), else :func:`attention_core`.
        Dropout on the weights needs them written out: then :meth:`_written_out` whatever the implementation.
        """
        # the operations' names carry the scope (benchmarks/profile_step.py's attention part) where their stack
        # frames do not: XLA's ops of a custom VJP under the layer scan name only the scan body's frame
        with jax.named_scope("attention"):
            dropout = not deterministic and self.attention_dropout.rate > 0.0
            if dropout or self.implementation == "xla":
                return _heads_out(self._written_out(q, k, v, segments, window, dropout, ctx))
            softcap = self.arch.attention_softcap
            fixed = window is None or isinstance(window, int)
            if self.implementation == "cudnn" and q.shape[1] > 1 and segments is None and softcap is None and fixed:
                local = None if window is None else (window - 1, 0)  # the kernel's own sliding window
                # not constrained again: the kernel keeps the array it returns (sharded as the queries, by its
                # partitioning rule), and so the out projection keeps that one too, not a constrained copy
                return jax.nn.dot_product_attention(
                    q, k, v, scale=self.scale, is_causal=True, local_window_size=local, implementation="cudnn"
                )
            # constrained inside the core's custom VJP: the array the out projection keeps is the core's own
            return attention_core(
                q, k, v, segments=segments, window=window, softcap=softcap, scale=self.scale, out=_heads_out
            )

    def _written_out(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        segments: jax.Array | None,
        window: int | jax.Array | None,
        dropout: bool,
        ctx: nnx.Context | None,
    ) -> jax.Array:
        """Attention with its weights `[batch, heads, queries, keys]` written out and the rest left to XLA and
        autodiff (which saves them for the backward pass): `model.attention: xla`, and dropout on the weights.
        Rounded as the core rounds (:func:`unnormalized_softmax`)."""
        batch, length, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)  # query heads by key-value head
        logits = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, preferred_element_type=jnp.float32)
        index = jnp.arange(length)[None]
        mask = visible(index, index, window=window, q_segments=segments, k_segments=segments)[:, :, None]
        weights, total = unnormalized_softmax(jnp.where(mask, self._scaled(logits), MASKED_LOGIT))
        if dropout:  # drawn over [batch, heads, queries, keys], as before the heads were grouped
            flat = weights.reshape(batch, heads, length, length)
            weights = self.attention_dropout(flat, deterministic=False, ctx=ctx).reshape(weights.shape)
        o = jnp.einsum("bkgqs,bskd->bkgqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32) / total
        return o.astype(v.dtype).transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim)

    def _output(self, o: jax.Array, deterministic: bool, ctx: nnx.Context | None) -> jax.Array:
        """The out projection of the heads `o`, constrained already (:func:`_heads_out`), and dropout."""
        return self.dropout(self.out(o, deterministic=deterministic, ctx=ctx), deterministic=deterministic, ctx=ctx)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
        layer: Layer = None,
    ) -> jax.Array:
        projected = self.projections(x, deterministic=deterministic, ctx=ctx)
        return self.attend(projected, positions, segments, deterministic=deterministic, ctx=ctx, layer=layer)

    def attend(
        self,
        projected: tuple[jax.Array, jax.Array, jax.Array],
        positions: jax.Array,
        segments: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
        layer: Layer = None,
    ) -> jax.Array:
        """The rest of the layer from the :meth:`projections` `projected` (what `Block` computes apart, so that
        the norm before them is recomputed for the backward pass instead of kept)."""
        q, k, v = self._positioned(*projected, positions, layer)
        window = layer_window(self.arch, layer)
        return self._output(self._causal(q, k, v, deterministic, ctx, segments, window), deterministic, ctx)

    # --- decoding with a key-value cache ------------------------------------

    def init_cache(self, batch_size: int, max_len: int, layers: int | None = None, layer: Layer = None) -> None:
        """Zero keys `[batch, kv_heads, head_dim, slots]` and values `[batch, kv_heads, slots, head_dim]` (with a
        leading `layers` axis when stacked).

        A full layer has a slot per position (`max_len`); a sliding layer a ring of `min(window, max_len)`.
        Stacked layers share one size: rings only when every layer slides. Heads come before positions so
        that one query's attention reads each head's keys contiguously; keys are stored transposed, so that
        both of decoding's products (`q·K` and `weights·V`) read their cache in the order a matrix product
        wants it (with keys as `[slots, head_dim]`, XLA's CPU product of a few query heads against them ran
        2-3x slower than the one against the values).
        """
        slides = self.arch.slides(layer if isinstance(layer, int) else None)
        slots = min(self.arch.sliding_window, max_len) if slides else max_len
        shape = (batch_size, self.arch.num_kv_heads, slots, self.arch.head_dim)
        axes = ("batch", self.arch.kv_axis, "length", "kv")
        if layers is not None:
            shape, axes = (layers, *shape), (LAYERS, *axes)
        swap = lambda t: (*t[:-2], t[-1], t[-2])  # noqa: E731  [..., slots, head_dim] -> [..., head_dim, slots]
        for name, cache_shape, cache_axes in (("cached_key", swap(shape), swap(axes)), ("cached_value", shape, axes)):
            zeros = nnx.with_logical_constraint(jnp.zeros(cache_shape, self.dtype), cache_axes)
            setattr(self, name, nnx.Cache(zeros, sharding=cache_axes))

    def prefill(
        self, x: jax.Array, positions: jax.Array, lengths: jax.Array | None = None, layer: Layer = None
    ) -> jax.Array:
        """Attention over a prompt `x` `[batch, length, embed]` at positions `0..length-1`; caches keys and values.

        A ring shorter than the prompt keeps each row's last keys: those of its `lengths` real tokens.
        """
        q, k, v = self._project(x, positions, layer=layer)
        slots = self.cached_value.shape[2]
        if x.shape[1] > slots:  # slot s: the row's latest real position p with p % slots == s (below 0: none yet)
            last = jnp.asarray(lengths, jnp.int32)[:, None] - 1
            held = last - (last - jnp.arange(slots)) % slots
            keep = jnp.clip(held, 0)[:, :, None, None]
            k_kept, v_kept = jnp.take_along_axis(k, keep, axis=1), jnp.take_along_axis(v, keep, axis=1)
        else:
            k_kept, v_kept = k, v
        k_kept, v_kept = k_kept.transpose(0, 2, 3, 1), v_kept.swapaxes(1, 2)  # as cached: [b, k, d, t], [b, k, t, d]
        self.cached_key = lax.dynamic_update_slice_in_dim(self.cached_key, k_kept.astype(self.dtype), 0, 3)
        self.cached_value = lax.dynamic_update_slice_in_dim(self.cached_value, v_kept.astype(self.dtype), 0, 2)
        window = layer_window(self.arch, layer)
        return self._output(self._causal(q, k, v, True, None, window=window), True, None)

    def decode(self, x: jax.Array, positions: jax.Array, layer: Layer = None) -> jax.Array:
        """One token per row, `x` `[batch, 1, embed]` at `positions` `[batch, 1]`: caches it, attends to the cache.

        Position `p` goes to slot `p % slots`: the same slot for a full cache, a ring for a sliding layer's.
        """
        q, k, v = self._project(x, positions, layer=layer)
        batch, _, heads, head_dim = q.shape
        kv_heads, slots = k.shape[2], self.cached_value.shape[2]
        # One (row, head) index pair per written vector: XLA makes this a cheaper scatter than rows alone.
        rows, each_head, at = jnp.arange(batch)[:, None], jnp.arange(kv_heads)[None, :], positions % slots
        self.cached_key = self.cached_key.at[rows, each_head, :, at].set(k[:, 0].astype(self.dtype))
        self.cached_value = self.cached_value.at[rows, each_head, at].set(v[:, 0].astype(self.dtype))
        grouped = q[:, 0].reshape(batch, kv_heads, heads // kv_heads, head_dim)  # query heads by their key-value head
        scores = jnp.einsum("bkgd,bkdt->bkgt", grouped, self.cached_key, preferred_element_type=jnp.float32)
        held = positions - (positions - jnp.arange(slots)) % slots  # [batch, slots]: the position in each slot
        mask = visible(positions, held, window=layer_window(self.arch, layer))  # [batch, 1, 1, slots]
        weights, total = unnormalized_softmax(jnp.where(mask, self._scaled(scores), MASKED_LOGIT))
        o = jnp.einsum(
            "bkgt,bktd->bkgd", weights.astype(self.dtype), self.cached_value, preferred_element_type=jnp.float32
        )
        o = (o / total).astype(self.dtype).reshape(batch, heads, head_dim)
        return self._output(_heads_out(o[:, None]), True, None)
