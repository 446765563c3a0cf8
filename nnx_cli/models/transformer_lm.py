"""`transformer_lm`: a decoder-only Transformer language model, with a key-value cache for decoding.

One model for the families people train today: GPT-2 (learned positions,
LayerNorm, biases, a tanh-GELU MLP) and the Llama family (Llama 2/3, Mistral,
Qwen2/3, SmolLM: rotary positions, RMSNorm, no biases, a SwiGLU MLP,
grouped-query attention) differ by a few switches (spec hf.md, "Architectures")::

    model = TransformerLM((256,), 257, num_layers=6, num_heads=6, embed_dim=384, ctx=nnx.context(0))   # GPT
    llama = TransformerLM((256,), 32000, num_layers=4, num_heads=8, num_kv_heads=2, embed_dim=512,
                          positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, ctx=nnx.context(0))
    batch = {"tokens": jnp.zeros((8, 257), jnp.int32)}    # windows of seq_len + 1 tokens
    metrics = model.metrics(batch, nnx.context(dropout=0, flags={"deterministic": False}))
    metrics["loss"].shape                                 # (8,): mean nats per token of each window

Pre-norm blocks: `h + attention(norm(h))`, then `h + mlp(norm(h))`. The
rotary convention is Hugging Face Llama's (the two halves of each head turn
together), so imported weights need no permutation. The vocabulary is
padded to a multiple of 128 (257 -> 384) for sharding and alignment; the
padded ids get a large negative logit (in float32) wherever logits come out,
so the loss, accuracy and sampling never pick them.

Decoding: `init_cache(batch_size, max_len)` adds `nnx.Cache` keys and values
(`num_kv_heads` of them per layer) to every attention layer (stacked along
`layers` when scanned), `prefill` runs a prompt through and fills them,
`decode` takes one token per row at per-row positions. `nnx_cli.decoding`
drives these from jitted pure functions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from jax import lax

import nnx
from nnx_cli.models.layers import check_rate, check_sizes

Batch = dict[str, jax.Array]

VOCAB_MULTIPLE = 128
"""The embedding and output vocabulary is padded to a multiple of this."""

MASKED_LOGIT = -1e30
"""The float32 logit of padded vocabulary ids: far below any real logit, finite even divided by a small temperature."""

_BYTES = 256  # ids below this are bytes (the `bytes` tokenizer); bits_per_byte counts only those targets
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls, recompute attention
}
_LAYERS = "layers"
_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def padded_vocab_size(vocab_size: int) -> int:
    """`vocab_size` rounded up to a multiple of :data:`VOCAB_MULTIPLE` (257 -> 384)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


# Options
# ------------------------------------------------------------------------------


PROJECTIONS = {"q": "query", "k": "key", "v": "value", "o": "out", "gate": "gate", "up": "fc", "down": "proj"}
"""The projections LoRA can adapt, by the short names `model.lora.targets` uses, and their module names here."""

_TARGET_ALIASES = {
    **{short: [short] for short in PROJECTIONS},
    **{name: [short] for short, name in PROJECTIONS.items()},  # our module names
    **{f"{short}_proj": [short] for short in ("q", "k", "v", "o", "gate", "up", "down")},  # Hugging Face Llama's
    "c_attn": ["q", "k", "v"],  # GPT-2's fused projection, and its others
    "c_fc": ["up"],
    "c_proj": ["o", "down"],
    "attn.c_proj": ["o"],
    "mlp.c_proj": ["down"],
}


@dataclasses.dataclass(frozen=True)
class Lora:
    """`model.lora`, checked: rank, alpha, dropout, and the adapted projections by their short names."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


def lora_options(value: Mapping[str, Any] | None, mlp: str) -> Lora | None:
    """`model.lora`: null, or `{rank, alpha (default rank), dropout (0), targets (every projection the model has)}`;
    targets by our names (`q`, `query`), Hugging Face's (`q_proj`) or GPT-2's (`c_attn`)."""
    if value is None:
        return None
    has = [p for p in PROJECTIONS if mlp == "swiglu" or p != "gate"]
    if not isinstance(value, Mapping):
        raise ValueError(f"model.lora must be null or {{rank, alpha, dropout, targets}}, got {value!r}")
    unknown = sorted(set(value) - {"rank", "alpha", "dropout", "targets"})
    if unknown:
        raise ValueError(f"model.lora has unknown keys {', '.join(unknown)}; it takes rank, alpha, dropout, targets")
    rank = value.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"model.lora.rank must be a positive integer, got {rank!r}")
    alpha = value.get("alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"model.lora.alpha must be a positive number, got {alpha!r}")
    dropout = value.get("dropout", 0.0)
    check_rate("lora.dropout", dropout)
    names = value.get("targets", has)
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise ValueError(f"model.lora.targets must be a list of projection names, got {names!r}")
    targets: list[str] = []
    for name in names:
        shorts = _TARGET_ALIASES.get(name) if isinstance(name, str) else None
        missing = [t for t in shorts or [] if t not in has]
        if shorts is None or missing:
            raise ValueError(
                f"model.lora.targets: this model has no projection {name!r}; it has {', '.join(has)} (also as "
                f"{', '.join(PROJECTIONS[p] for p in has)} or {', '.join(p + '_proj' for p in has)})"
            )
        targets += [t for t in shorts if t not in targets]
    return Lora(rank, float(alpha), float(dropout), tuple(t for t in PROJECTIONS if t in targets))


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What shapes a block's function, resolved and checked from the `model` options (see :func:`architecture`).

    Static: it lives in the ModuleDef, so it is hashable (`rope_scaling` is
    a tuple of `(key, value)` pairs).
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp: str  # gelu (tanh approximation) | swiglu
    qkv_bias: bool  # biases on q, k, v (also when `bias`)
    qk_norm: bool  # RMSNorm over each head's queries and keys
    bias: bool  # biases on every other projection and on LayerNorm
    norm: str  # layernorm | rmsnorm
    norm_eps: float
    rope: bool
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    dropout: float
    attention_dropout: float
    out_std: float  # initial std of the residual output projections
    remat: str
    scanned: bool
    dtype: Any  # compute dtype
    lora: Lora | None = None  # low-rank adapters on the projections it names

    def adapter(self, projection: str) -> Lora | None:
        """The LoRA settings of `projection` (`q`, `k`, `v`, `o`, `gate`, `up`, `down`), or None."""
        return self.lora if self.lora is not None and projection in self.lora.targets else None

    @property
    def kv_axis(self) -> str:
        """The logical axis of key and value heads: `heads` when every query head has its own, else `kv_heads`."""
        return "heads" if self.num_kv_heads == self.num_heads else "kv_heads"


def _choice(option: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"model.{option} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _rope_scaling(value: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """`model.rope_scaling`: null, or `{type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}`."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") != "llama3":
        raise ValueError(
            f"model.rope_scaling must be null or {{type: llama3, {', '.join(_ROPE_SCALING_KEYS)}}}; got {value!r}"
        )
    missing = [k for k in _ROPE_SCALING_KEYS if not isinstance(value.get(k), (int, float))]
    unknown = sorted(set(value) - {"type", *_ROPE_SCALING_KEYS})
    if missing or unknown:
        problem = f"lacks numbers for {', '.join(missing)}" if missing else f"has unknown keys {', '.join(unknown)}"
        raise ValueError(f"model.rope_scaling of type llama3 {problem}; it takes {', '.join(_ROPE_SCALING_KEYS)}")
    if value["high_freq_factor"] <= value["low_freq_factor"] or value["factor"] <= 0:
        raise ValueError(
            "model.rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor; "
            f"got {value['factor']}, {value['low_freq_factor']}, {value['high_freq_factor']}"
        )
    return tuple((k, float(value[k])) for k in _ROPE_SCALING_KEYS)


def architecture(
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    head_dim: int | None,
    embed_dim: int,
    mlp_dim: int | None,
    mlp: str,
    qkv_bias: bool,
    qk_norm: bool,
    bias: bool,
    norm: str,
    norm_eps: float,
    positions: str,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    dropout: float,
    attention_dropout: float,
    remat: str,
    scan_layers: bool,
    dtype: str,
    lora: Mapping[str, Any] | None = None,
) -> Architecture:
    """The model options checked (a ValueError names the `model.` key) and resolved into an :class:`Architecture`."""
    check_sizes("num_layers", [num_layers])
    check_sizes("num_heads", [num_heads])
    check_sizes("embed_dim", [embed_dim])
    mlp_dim = check_sizes("mlp_dim", [mlp_dim])[0] if mlp_dim is not None else 4 * embed_dim
    check_rate("dropout", dropout)
    check_rate("attention_dropout", attention_dropout)
    _choice("positions", positions, ("learned", "rope"))
    _choice("norm", norm, ("layernorm", "rmsnorm"))
    _choice("mlp", mlp, ("gelu", "swiglu"))
    _choice("dtype", dtype, tuple(_DTYPES))
    _choice("remat", remat, ("none", "full", "dots"))
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"model.embed_dim ({embed_dim}) must be a multiple of model.num_heads ({num_heads}), "
                "or set model.head_dim"
            )
        head_dim = embed_dim // num_heads
    check_sizes("head_dim", [head_dim])
    kv_heads = num_heads if num_kv_heads is None else check_sizes("num_kv_heads", [num_kv_heads])[0]
    if num_heads % kv_heads:
        raise ValueError(
            f"model.num_heads ({num_heads}) must be a multiple of model.num_kv_heads ({kv_heads}): each key-value "
            "head serves an equal group of query heads"
        )
    if positions == "rope" and head_dim % 2:
        raise ValueError(
            f"model.positions rope rotates pairs of features: the head size (model.head_dim, or embed_dim / "
            f"num_heads) ({head_dim}) must be even"
        )
    if norm_eps <= 0:
        raise ValueError(f"model.norm_eps must be positive, got {norm_eps}")
    if rope_theta <= 0:
        raise ValueError(f"model.rope_theta must be positive, got {rope_theta}")
    if rope_scaling is not None and positions != "rope":
        raise ValueError("model.rope_scaling applies to rotary positions: set model.positions=rope or drop it")
    return Architecture(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mlp_dim=mlp_dim,
        mlp=mlp,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        bias=bias,
        norm=norm,
        norm_eps=float(norm_eps),
        rope=positions == "rope",
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling(rope_scaling),
        dropout=dropout,
        attention_dropout=attention_dropout,
        out_std=0.02 / math.sqrt(2 * num_layers),
        remat=remat,
        scanned=scan_layers,
        dtype=_DTYPES[dtype],
        lora=lora_options(lora, mlp),
    )


# Layers
# ------------------------------------------------------------------------------


def _init(std: float, axes: tuple[str, ...]) -> Any:
    return nnx.with_logical_partitioning(nnx.initializers.normal(std), axes)


def _constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return nnx.with_logical_constraint(x, axes)


class Dense(nnx.Module):
    """`x @ kernel + bias`, contracting the trailing `len(in_shape)` axes of `x`.

    The kernel has shape `in_shape + out_shape` and logical axes
    `in_axes + out_axes` (attention's query kernel is `(embed, heads, kv)`,
    its output kernel `(heads, kv, embed)`); it is drawn from normal(`std`),
    the bias starts at zero. Computes in `dtype` (the result in `out_dtype`
    if given, e.g. float32 logits from bfloat16 inputs); parameters stay
    float32::

        query = Dense((384,), (6, 64), ("embed",), ("heads", "kv"), std=0.02, dtype=jnp.float32, ctx=ctx)
        query(jnp.ones((2, 10, 384))).shape   # (2, 10, 6, 64)
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        *,
        std: float,
        dtype: Any,
        use_bias: bool = True,
        out_dtype: Any = None,
        lora: Lora | None = None,
        ctx: nnx.Context,
    ):
        self.in_rank = len(in_shape)
        self.dtype = dtype
        self.out_dtype = out_dtype
        shape = (*in_shape, *out_shape)
        key = ctx.make_rng("params")
        self.kernel = nnx.Param(_init(std, (*in_axes, *out_axes))(key, shape, jnp.float32))
        if use_bias:
            bias_init = nnx.with_logical_partitioning(nnx.initializers.zeros(), out_axes)
            self.bias = nnx.Param(bias_init(ctx.make_rng("params"), tuple(out_shape), jnp.float32))
        else:
            self.bias = None
        if lora is not None:  # drawn from the kernel's key: the frozen weights are the same with or without it
            self.lora = nnx.LoRA(
                in_shape,
                out_shape,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                in_axes=in_axes,
                out_axes=out_axes,
                dtype=dtype,
                ctx=nnx.context(jax.random.fold_in(key, 1)),
            )
        else:
            self.lora = None

    def __call__(self, x: jax.Array, *, deterministic: bool = True, ctx: nnx.Context | None = None) -> jax.Array:
        kernel = self.kernel.astype(self.dtype)
        contract = tuple(range(x.ndim - self.in_rank, x.ndim)), tuple(range(self.in_rank))
        y = lax.dot_general(x.astype(self.dtype), kernel, (contract, ((), ())), preferred_element_type=self.out_dtype)
        if self.lora is not None:
            y = y + self.lora(x, deterministic=deterministic, ctx=ctx).astype(y.dtype)
        return y if self.bias is None else y + self.bias.astype(y.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation (Zhang & Sennrich, 2019): `x / rms(x) * scale`, statistics in float32.

    `scale` has shape `(num_features,)` and the logical axis `axis` (`embed`;
    `kv` for the per-head query and key norms)::

        RMSNorm(384, dtype=jnp.bfloat16, ctx=ctx)(x)   # same shape as x, in bfloat16
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, axis: str = "embed", dtype: Any, ctx: nnx.Context):
        self.epsilon = epsilon
        self.dtype = dtype
        init = nnx.with_logical_partitioning(nnx.initializers.ones(), (axis,))
        self.scale = nnx.Param(init(ctx.make_rng("params"), (num_features,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return (y * self.scale).astype(self.dtype)


def _norm(arch: Architecture, ctx: nnx.Context) -> nnx.Module:
    if arch.norm == "rmsnorm":
        return RMSNorm(arch.embed_dim, epsilon=arch.norm_eps, dtype=arch.dtype, ctx=ctx)
    return nnx.LayerNorm(
        arch.embed_dim,
        epsilon=arch.norm_eps,
        dtype=arch.dtype,
        use_bias=arch.bias,
        scale_init=nnx.with_logical_partitioning(nnx.initializers.ones(), ("embed",)),
        bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), ("embed",)),
        ctx=ctx,
    )


def rope_frequencies(
    head_dim: int, theta: float = 10000.0, scaling: tuple[tuple[str, Any], ...] | None = None
) -> jax.Array:
    """The float32 angular frequencies of rotary feature pairs: `theta ** (-2i / head_dim)`, `i < head_dim / 2`.

    With `scaling` of type llama3 (Meta's Llama 3.1 recipe), wavelengths longer
    than `original_max_position_embeddings / low_freq_factor` slow down by
    `factor`, those shorter than `... / high_freq_factor` stay, and those
    between blend the two smoothly.
    """
    half = head_dim // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return frequencies
    s = dict(scaling)
    original, low, high, factor = (
        s["original_max_position_embeddings"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["factor"],
    )
    wavelength = 2 * math.pi / frequencies
    slowed = jnp.where(wavelength > original / low, frequencies / factor, frequencies)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(between, blended, slowed)


def rotate(x: jax.Array, positions: jax.Array, frequencies: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (Su et al., 2021) of `x` `[batch, length, heads, head_dim]` at `positions`.

    Feature pair `(i, i + head_dim / 2)` turns by `position * frequencies[i]`
    (:func:`rope_frequencies`; by default `10000 ** (-2i / head_dim)`), in
    float32; `positions` is `[batch, length]`.
    """
    if frequencies is None:
        frequencies = rope_frequencies(x.shape[-1])
    angles = positions.astype(jnp.float32)[:, :, None, None] * frequencies
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def _fused_attention(dtype: Any, head_dim: int) -> str:
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
        self.implementation = _fused_attention(arch.dtype, head_dim)
        self.attention_dropout = nnx.Dropout(arch.attention_dropout)
        self.dropout = nnx.Dropout(arch.dropout)

    def _project(
        self, x: jax.Array, positions: jax.Array, deterministic: bool = True, ctx: nnx.Context | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        train = dict(deterministic=deterministic, ctx=ctx)
        q = _constrain(self.query(x, **train), ("batch", "length", "heads", "kv"))
        kv_axes = ("batch", "length", self.arch.kv_axis, "kv")
        k, v = _constrain(self.key(x, **train), kv_axes), _constrain(self.value(x, **train), kv_axes)
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
        o = _constrain(o, ("batch", "length", "heads", "kv"))
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

    def init_cache(self, batch_size: int, max_len: int, layers: int | None = None) -> None:
        """Zero keys and values `[batch, kv_heads, max_len, head_dim]` (with a leading `layers` axis when stacked).

        Heads come before positions so that one query's attention reads each head's keys contiguously.
        """
        shape = (batch_size, self.arch.num_kv_heads, max_len, self.arch.head_dim)
        axes = ("batch", self.arch.kv_axis, "length", "kv")
        if layers is not None:
            shape, axes = (layers, *shape), (_LAYERS, *axes)
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


class MLP(nnx.Module):
    """`proj(gelu(fc(x)))` (GELU, tanh approximation, as GPT-2), or with `mlp: swiglu` `proj(silu(gate(x)) * fc(x))`
    (Llama's gate, up and down projections), then dropout; hidden width `mlp_dim`."""

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        embed, hidden = arch.embed_dim, arch.mlp_dim
        dense = dict(dtype=arch.dtype, use_bias=arch.bias, ctx=ctx)
        self.fc = Dense((embed,), (hidden,), ("embed",), ("mlp",), std=0.02, lora=arch.adapter("up"), **dense)
        self.proj = Dense(
            (hidden,), (embed,), ("mlp",), ("embed",), std=arch.out_std, lora=arch.adapter("down"), **dense
        )
        if arch.mlp == "swiglu":
            self.gate = Dense((embed,), (hidden,), ("embed",), ("mlp",), std=0.02, lora=arch.adapter("gate"), **dense)
        self.gated = arch.mlp == "swiglu"
        self.dropout = nnx.Dropout(arch.dropout)

    def __call__(self, x: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None) -> jax.Array:
        train = dict(deterministic=deterministic, ctx=ctx)
        up = self.fc(x, **train)
        h = nnx.silu(self.gate(x, **train)) * up if self.gated else nnx.gelu(up)
        h = _constrain(h, ("batch", "length", "mlp"))
        return self.dropout(self.proj(h, **train), deterministic=deterministic, ctx=ctx)


class Block(nnx.Module):
    """A pre-norm Transformer block: `h + attention(norm(h))`, then `h + mlp(norm(h))`.

    Methods take `(h, _, positions)` and return `(h, None)`, the shape
    `nnx.Scan` threads through stacked layers (`_`: the unused scanned input).
    """

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        self.attention_norm = _norm(arch, ctx)
        self.attention = Attention(arch, ctx=ctx)
        self.mlp_norm = _norm(arch, ctx)
        self.mlp = MLP(arch, ctx=ctx)
        self.remat = arch.remat
        self.scanned = arch.scanned

    def _forward(
        self,
        h: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None,
    ) -> jax.Array:
        h = h + self.attention(self.attention_norm(h), positions, segments, deterministic=deterministic, ctx=ctx)
        h = h + self.mlp(self.mlp_norm(h), deterministic=deterministic, ctx=ctx)
        return _constrain(h, ("batch", "length", "embed"))

    def __call__(
        self,
        h: jax.Array,
        _: Any,
        positions: jax.Array,
        segments: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> tuple[jax.Array, None]:
        forward = type(self)._forward
        if self.remat != "none":
            # Under lax.scan, CSE cannot undo rematerialisation, and preventing it costs speed.
            forward = nnx.remat(forward, policy=_REMAT_POLICIES[self.remat], prevent_cse=not self.scanned)
        return forward(self, h, positions, segments, deterministic=deterministic, ctx=ctx), None

    def prefill(self, h: jax.Array, _: Any, positions: jax.Array) -> tuple[jax.Array, None]:
        h = h + self.attention.prefill(self.attention_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h), deterministic=True), None

    def decode(self, h: jax.Array, _: Any, positions: jax.Array) -> tuple[jax.Array, None]:
        h = h + self.attention.decode(self.attention_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h), deterministic=True), None


# The model
# ------------------------------------------------------------------------------


class TransformerLM(nnx.Module):
    """A decoder-only language model; options are the `model` section of a text config (spec lm.md, hf.md).

    `input_shape` is `(seq_len,)`, `num_classes` the tokenizer's vocabulary
    size (`vocab_size` overrides it). Metrics of a batch `{"tokens": int32
    [B, seq_len + 1]}` are per window: `loss` (mean nats per token),
    `accuracy` and, with `bits_per_byte`, the loss in bits over byte
    targets only (end-of-document targets excluded)::

        model = TransformerLM((128,), 257, num_layers=2, num_heads=2, embed_dim=64, ctx=nnx.context(0))
        model.metrics({"tokens": tokens}, ctx)["loss"]      # [B]
        model.flops_per_token()                             # 6 N + 12 num_layers seq_len embed_dim

    The architecture options (`num_kv_heads`, `head_dim`, `mlp`, `qkv_bias`,
    `qk_norm`, `bias`, `norm_eps`, `rope_theta`, `rope_scaling`) default to
    the GPT this model was first, so configs written before them keep their
    model. `max_positions` sizes the learned position table (null:
    `seq_len`; an imported GPT-2 has 1024 positions and may train on
    shorter windows).

    `scan_layers` stacks the blocks under one `nnx.Scan` (parameters get a
    leading `layers` axis); otherwise `layers` is an `nnx.Sequence` of blocks
    whose parameters have the same per-block layout. `remat` rematerialises
    each block in the backward pass (`full`: nothing saved; `dots`: weight
    matmul results saved) without changing parameter paths.
    """

    loss_metric: ClassVar[str] = "loss"
    default_rules: ClassVar[list[list[str]]] = [
        ["batch", "data"],
        ["embed", "data"],
        ["heads", "model"],
        ["kv_heads", "model"],
        ["mlp", "model"],
        ["vocab", "model"],
    ]

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int | None = None,
        *,
        num_layers: int = 6,
        num_heads: int = 6,
        embed_dim: int = 384,
        mlp_dim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        mlp: str = "gelu",
        qkv_bias: bool = False,
        qk_norm: bool = False,
        bias: bool = True,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        max_positions: int | None = None,
        lora: dict[str, Any] | None = None,
        dropout: float = 0.2,
        attention_dropout: float = 0.0,
        positions: str = "learned",
        norm: str = "layernorm",
        tie_embeddings: bool = True,
        dtype: str = "float32",
        scan_layers: bool = True,
        remat: str = "none",
        vocab_size: int | None = None,
        bits_per_byte: bool = False,
        ctx: nnx.Context,
    ):
        if len(input_shape) != 1:
            raise ValueError(
                f"model 'transformer_lm' reads token windows: input_shape must be [seq_len], got {list(input_shape)}"
            )
        vocab = vocab_size if vocab_size is not None else num_classes
        if vocab is None:
            raise ValueError("model.vocab_size is unknown: the data has no tokenizer; set model.vocab_size")
        (seq_len,) = check_sizes("input_shape", input_shape)
        check_sizes("vocab_size", [vocab])
        arch = architecture(
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            embed_dim=embed_dim,
            mlp_dim=mlp_dim,
            mlp=mlp,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            bias=bias,
            norm=norm,
            norm_eps=norm_eps,
            positions=positions,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            dropout=dropout,
            attention_dropout=attention_dropout,
            remat=remat,
            scan_layers=scan_layers,
            dtype=dtype,
            lora=lora,
        )
        max_positions = seq_len if max_positions is None else check_sizes("max_positions", [max_positions])[0]
        if positions == "learned" and seq_len > max_positions:
            raise ValueError(
                f"data.seq_len ({seq_len}) exceeds the model's {max_positions} learned positions "
                "(model.max_positions); lower data.seq_len"
            )

        compute = arch.dtype
        self.seq_len = seq_len
        self.max_positions = max_positions
        self.vocab_size = vocab
        self.num_layers = num_layers
        self.embed_dim = embed_dim
        self.positions = positions
        self.bits_per_byte = bits_per_byte
        self.scan_layers = scan_layers
        self.tie_embeddings = tie_embeddings
        self.embedding = nnx.Embed(
            padded_vocab_size(vocab), embed_dim, dtype=compute, embedding_init=_init(0.02, ("vocab", "embed")), ctx=ctx
        )
        if positions == "learned":
            self.position_embedding = nnx.Embed(
                max_positions, embed_dim, dtype=compute, embedding_init=_init(0.02, ("length", "embed")), ctx=ctx
            )
        self.dropout = nnx.Dropout(dropout)
        if scan_layers:
            self.layers = nnx.Scan(
                Block,
                variable_axes={nnx.Param: 0, nnx.Cache: 0},
                split_rngs=("params", "dropout"),
                length=num_layers,
                metadata_params={nnx.PARTITION_NAME: _LAYERS},
            )(arch, ctx=ctx)
        else:
            self.layers = nnx.Sequence([Block(arch, ctx=ctx) for _ in range(num_layers)])
        self.final_norm = _norm(arch, ctx)
        if not tie_embeddings:
            self.head = Dense(
                (embed_dim,),
                (padded_vocab_size(vocab),),
                ("embed",),
                ("vocab",),
                std=0.02,
                dtype=compute,
                use_bias=False,
                out_dtype=jnp.float32,
                ctx=ctx,
            )

    # --- the forward pass ---------------------------------------------------

    def _embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool, ctx: nnx.Context | None):
        h = self.embedding(tokens)
        if self.positions == "learned":
            h = h + self.position_embedding(positions)
        h = _constrain(h, ("batch", "length", "embed"))
        return self.dropout(h, deterministic=deterministic, ctx=ctx)

    def _blocks(self, method: str, h: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        if self.scan_layers:
            h, _ = getattr(self.layers.call, method)(h, None, *args, **kwargs)
        else:
            for block in self.layers:
                h, _ = getattr(block, method)(h, None, *args, **kwargs)
        return h

    def _logits(self, h: jax.Array) -> jax.Array:
        """Float32 logits over the padded vocabulary, padded ids masked."""
        h = self.final_norm(h)
        if self.tie_embeddings:  # `embedding.attend(h)`, accumulated and returned in float32
            table = self.embedding.embedding.astype(h.dtype)
            logits = jnp.einsum("...e,ve->...v", h, table, preferred_element_type=jnp.float32)
        else:
            logits = self.head(h)
        logits = _constrain(logits, ("batch", "length", "vocab"))
        return jnp.where(jnp.arange(logits.shape[-1]) < self.vocab_size, logits, MASKED_LOGIT)

    def logits(
        self,
        tokens: jax.Array,
        ctx: nnx.Context | None = None,
        *,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits `[B, T, vocab]` (float32) of `tokens` `[B, T]`, `T <= max_positions` when learned.

        Dropout is on when `ctx` has the flag `deterministic=False` (and a `dropout` stream). Packed examples
        give their own `positions` `[B, T]` (each example from 0) and `segments` `[B, T]` (an id per example):
        attention then stays within a segment, so each example is computed as if alone.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        length = tokens.shape[1]
        if self.positions == "learned" and length > self.max_positions:
            raise ValueError(f"{length} tokens do not fit the {self.max_positions} learned positions of this model")
        deterministic = ctx is None or ctx.get_flag("deterministic") is not False
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
        positions = jnp.asarray(positions, jnp.int32)
        h = self._embed(tokens, positions, deterministic, ctx)
        if segments is None:
            h = self._blocks("__call__", h, positions, deterministic=deterministic, ctx=ctx)
        else:
            segments = jnp.asarray(segments, jnp.int32)
            h = self._blocks("__call__", h, positions, segments, deterministic=deterministic, ctx=ctx)
        return self._logits(h)

    def metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        """Per window of `batch["tokens"]` `[B, seq_len + 1]`: `loss`, `accuracy` (and `bits_per_byte`), each `[B]`.

        Fine-tuning batches (chat, completion) also hold `targets` (which tokens count in the loss), `segments`
        and `positions` (packed examples) of the same shape: the metrics are then means over each row's target
        tokens, and `weight` (their number) makes the trainer's averages per target token.
        """
        if "segments" in batch:
            return self._example_metrics(batch, ctx)
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        targets = tokens[:, 1:]
        logits = self.logits(tokens[:, :-1], ctx)
        token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        out = {
            "loss": jnp.mean(token_loss, axis=-1),
            "accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == targets, axis=-1, dtype=jnp.float32),
        }
        if self.bits_per_byte:
            is_byte = targets < _BYTES
            nats = jnp.sum(jnp.where(is_byte, token_loss, 0.0), axis=-1) / jnp.maximum(jnp.sum(is_byte, axis=-1), 1)
            out["bits_per_byte"] = nats / math.log(2)
        return out

    def _example_metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        segments = jnp.asarray(batch["segments"], jnp.int32)
        targets = tokens[:, 1:]
        # a target counts when marked, and when it continues the same (real) example as the token before it
        counts = batch["targets"][:, 1:].astype(bool) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
        logits = self.logits(tokens[:, :-1], ctx, positions=batch["positions"][:, :-1], segments=segments[:, :-1])
        token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        weight = jnp.sum(counts, axis=-1, dtype=jnp.float32)
        per_row = lambda x: jnp.sum(jnp.where(counts, x, 0.0), axis=-1) / jnp.maximum(weight, 1.0)  # noqa: E731
        return {
            "loss": per_row(token_loss),
            "accuracy": per_row((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)),
            "weight": weight,
        }

    def flops_per_token(self) -> int:
        """Training FLOPs per token: `6 N + 12 num_layers seq_len embed_dim`, N the parameters outside the embeddings.

        Works on a model built under `jax.eval_shape` (it reads shapes only).
        """
        params = self.filter(nnx.Param)
        embeddings = ("embedding/embedding", "position_embedding/embedding")
        n = sum(math.prod(p.value.shape) for path, p in params.items() if path not in embeddings)
        return 6 * n + 12 * self.num_layers * self.seq_len * self.embed_dim

    def padding_params(self) -> int:
        """Parameters that only pad the vocabulary to a multiple of 128: zero rows of the embedding (and head)."""
        return (
            (padded_vocab_size(self.vocab_size) - self.vocab_size) * self.embed_dim * (1 if self.tie_embeddings else 2)
        )

    # --- decoding with a key-value cache ------------------------------------

    @property
    def context_limit(self) -> int | None:
        """The most positions a sequence may use: `max_positions` with learned positions, None (unbounded) with RoPE."""
        return self.max_positions if self.positions == "learned" else None

    def _attentions(self) -> list[Attention]:
        if self.scan_layers:
            return [self.layers.scan_module.attention]
        return [block.attention for block in self.layers]

    def init_cache(self, batch_size: int, max_len: int) -> None:
        """Adds zero `nnx.Cache` keys and values for `batch_size` rows of up to `max_len` positions to every layer."""
        limit = self.context_limit
        if limit is not None and max_len > limit:
            raise ValueError(f"a cache of {max_len} positions exceeds the learned positions of this model ({limit})")
        for attention in self._attentions():
            attention.init_cache(batch_size, max_len, self.num_layers if self.scan_layers else None)

    def prefill(self, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        """Runs prompts `tokens` `[B, P]` (right-padded; row `b` has `lengths[b]` real tokens) into an empty cache.

        Returns the float32 logits `[B, padded vocab]` after each prompt's last real token.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        h = self._blocks("prefill", self._embed(tokens, positions, True, None), positions)
        last = jnp.take_along_axis(h, (jnp.asarray(lengths, jnp.int32) - 1)[:, None, None], axis=1)
        return self._logits(last)[:, 0]

    def decode(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Feeds one token per row (`tokens`, `positions`: `[B]`) through the cache; returns the logits `[B, vocab]`."""
        tokens, positions = jnp.asarray(tokens, jnp.int32)[:, None], jnp.asarray(positions, jnp.int32)[:, None]
        h = self._blocks("decode", self._embed(tokens, positions, True, None), positions)
        return self._logits(h)[:, 0]

    def unstack_layers(self) -> TransformerLM:
        """This model with its scanned layers split into an `nnx.Sequence` of blocks (a copy; self if unrolled).

        Decoding one token is cheaper on per-layer arrays: under jit, reading
        one layer out of the stacked ones copies its weights at every step.
        """
        if not self.scan_layers:
            return self
        model = self.clone()
        stacked, block_def = model.layers.scan_module.partition()
        stacked = nnx.spmd.remove_axis(stacked, 0, {nnx.PARTITION_NAME: _LAYERS})
        blocks = [block_def.merge(jax.tree.map(lambda x, i=i: x[i], stacked)) for i in range(self.num_layers)]
        model.layers = nnx.Sequence(blocks)
        model.scan_layers = False
        return model
