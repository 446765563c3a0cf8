"""`transformer_lm`: a decoder-only Transformer language model (GPT), with a key-value cache for decoding.

Pre-norm blocks (causal multi-head self-attention, then a GELU MLP, each with
a residual connection), learned or rotary positions, LayerNorm or RMSNorm,
output projection tied to the token embedding by default::

    model = TransformerLM((256,), 257, num_layers=6, num_heads=6, embed_dim=384, ctx=nnx.context(0))
    batch = {"tokens": jnp.zeros((8, 257), jnp.int32)}    # windows of seq_len + 1 tokens
    metrics = model.metrics(batch, nnx.context(dropout=0, flags={"deterministic": False}))
    metrics["loss"].shape                                 # (8,): mean nats per token of each window

The vocabulary is padded to a multiple of 128 (257 -> 384) for sharding and
alignment; the padded ids get a large negative logit (in float32) wherever
logits come out, so the loss, accuracy and sampling never pick them.

Decoding: `init_cache(batch_size, max_len)` adds `nnx.Cache` keys and values
to every attention layer (stacked along `layers` when scanned), `prefill`
runs a prompt through and fills them, `decode` takes one token per row at
per-row positions. `nnx_cli.decoding` drives these from jitted pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def _choice(option: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"model.{option} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def padded_vocab_size(vocab_size: int) -> int:
    """`vocab_size` rounded up to a multiple of :data:`VOCAB_MULTIPLE` (257 -> 384)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


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
        ctx: nnx.Context,
    ):
        self.in_rank = len(in_shape)
        self.dtype = dtype
        self.out_dtype = out_dtype
        shape = (*in_shape, *out_shape)
        self.kernel = nnx.Param(_init(std, (*in_axes, *out_axes))(ctx.make_rng("params"), shape, jnp.float32))
        if use_bias:
            bias_init = nnx.with_logical_partitioning(nnx.initializers.zeros(), out_axes)
            self.bias = nnx.Param(bias_init(ctx.make_rng("params"), tuple(out_shape), jnp.float32))
        else:
            self.bias = None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.astype(self.dtype)
        contract = tuple(range(x.ndim - self.in_rank, x.ndim)), tuple(range(self.in_rank))
        y = lax.dot_general(x.astype(self.dtype), kernel, (contract, ((), ())), preferred_element_type=self.out_dtype)
        return y if self.bias is None else y + self.bias.astype(y.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation (Zhang & Sennrich, 2019): `x / rms(x) * scale`, statistics in float32.

    `scale` has shape `(num_features,)` and the logical axis `embed`::

        RMSNorm(384, dtype=jnp.bfloat16, ctx=ctx)(x)   # same shape as x, in bfloat16
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, dtype: Any, ctx: nnx.Context):
        self.epsilon = epsilon
        self.dtype = dtype
        init = nnx.with_logical_partitioning(nnx.initializers.ones(), ("embed",))
        self.scale = nnx.Param(init(ctx.make_rng("params"), (num_features,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return (y * self.scale).astype(self.dtype)


def _norm(kind: str, features: int, dtype: Any, ctx: nnx.Context) -> nnx.Module:
    if kind == "rmsnorm":
        return RMSNorm(features, dtype=dtype, ctx=ctx)
    return nnx.LayerNorm(
        features,
        epsilon=1e-5,
        dtype=dtype,
        scale_init=nnx.with_logical_partitioning(nnx.initializers.ones(), ("embed",)),
        bias_init=nnx.with_logical_partitioning(nnx.initializers.zeros(), ("embed",)),
        ctx=ctx,
    )


def rotate(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding (Su et al., 2021) of `x` `[batch, length, heads, head_dim]` at `positions`.

    Feature pair `(i, i + head_dim / 2)` turns by `position * 10000 ** (-2i / head_dim)`,
    in float32; `positions` is `[batch, length]`.
    """
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, :, None, None] * frequencies
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def _fused_attention(dtype: Any, head_dim: int) -> str:
    """`cudnn` where JAX's cuDNN attention runs (GPU, 16-bit floats, head_dim a multiple of 8 up to 128), else `xla`."""
    fused = jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
    return "cudnn" if fused and head_dim % 8 == 0 and head_dim <= 128 else "xla"


class Attention(nnx.Module):
    """Causal multi-head self-attention; `init_cache` gives it a key-value cache for `prefill` and `decode`."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        rope: bool,
        dropout: float,
        attention_dropout: float,
        out_std: float,
        dtype: Any,
        ctx: nnx.Context,
    ):
        head_dim = embed_dim // num_heads
        qkv = dict(std=0.02, dtype=dtype, ctx=ctx)
        self.query = Dense((embed_dim,), (num_heads, head_dim), ("embed",), ("heads", "kv"), **qkv)
        self.key = Dense((embed_dim,), (num_heads, head_dim), ("embed",), ("heads", "kv"), **qkv)
        self.value = Dense((embed_dim,), (num_heads, head_dim), ("embed",), ("heads", "kv"), **qkv)
        self.out = Dense(
            (num_heads, head_dim), (embed_dim,), ("heads", "kv"), ("embed",), std=out_std, dtype=dtype, ctx=ctx
        )
        self.rope = rope
        self.dtype = dtype
        self.implementation = _fused_attention(dtype, head_dim)
        self.attention_dropout = nnx.Dropout(attention_dropout)
        self.dropout = nnx.Dropout(dropout)

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        axes = ("batch", "length", "heads", "kv")
        q, k, v = (_constrain(p(x), axes) for p in (self.query, self.key, self.value))
        if self.rope:
            q, k = rotate(q, positions), rotate(k, positions)
        return q, k, v

    def _causal(self, q: jax.Array, k: jax.Array, v: jax.Array, deterministic: bool, ctx: nnx.Context | None):
        if deterministic or self.attention_dropout.rate == 0.0:
            implementation = self.implementation if q.shape[1] > 1 else "xla"
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        # Dropout on the attention weights: neither fused kernel offers it, so the XLA form is written out.
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, MASKED_LOGIT), axis=-1)
        weights = self.attention_dropout(weights, deterministic=False, ctx=ctx)
        return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)

    def _output(self, o: jax.Array, deterministic: bool, ctx: nnx.Context | None) -> jax.Array:
        o = _constrain(o, ("batch", "length", "heads", "kv"))
        return self.dropout(self.out(o), deterministic=deterministic, ctx=ctx)

    def __call__(
        self, x: jax.Array, positions: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None
    ) -> jax.Array:
        q, k, v = self._project(x, positions)
        return self._output(self._causal(q, k, v, deterministic, ctx), deterministic, ctx)

    def init_cache(self, batch_size: int, max_len: int, layers: int | None = None) -> None:
        """Zero keys and values `[batch, heads, max_len, head_dim]` (with a leading `layers` axis when stacked).

        Heads come before positions so that one query's attention reads each head's keys contiguously.
        """
        _, heads, head_dim = self.key.kernel.shape[-3:]
        shape, axes = (batch_size, heads, max_len, head_dim), ("batch", "heads", "length", "kv")
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
        # One (row, head) index pair per written vector: XLA makes this a cheaper scatter than rows alone.
        rows, each_head, at = jnp.arange(batch)[:, None], jnp.arange(heads)[None, :], positions
        self.cached_key = self.cached_key.at[rows, each_head, at].set(k[:, 0].astype(self.dtype))
        self.cached_value = self.cached_value.at[rows, each_head, at].set(v[:, 0].astype(self.dtype))
        scores = jnp.einsum("bhd,bhtd->bht", q[:, 0], self.cached_key, preferred_element_type=jnp.float32)
        visible = jnp.arange(self.cached_key.shape[2]) <= positions  # [batch, max_len]
        scores = jnp.where(visible[:, None, :], scores / math.sqrt(head_dim), MASKED_LOGIT)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        o = jnp.einsum("bht,bhtd->bhd", weights, self.cached_value)[:, None]
        return self._output(o, True, None)


class MLP(nnx.Module):
    """`Dense -> GELU -> Dense -> Dropout`, hidden width `mlp_dim`."""

    def __init__(self, embed_dim: int, mlp_dim: int, *, dropout: float, out_std: float, dtype: Any, ctx: nnx.Context):
        self.fc = Dense((embed_dim,), (mlp_dim,), ("embed",), ("mlp",), std=0.02, dtype=dtype, ctx=ctx)
        self.proj = Dense((mlp_dim,), (embed_dim,), ("mlp",), ("embed",), std=out_std, dtype=dtype, ctx=ctx)
        self.dropout = nnx.Dropout(dropout)

    def __call__(self, x: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None) -> jax.Array:
        h = _constrain(nnx.gelu(self.fc(x)), ("batch", "length", "mlp"))
        return self.dropout(self.proj(h), deterministic=deterministic, ctx=ctx)


class Block(nnx.Module):
    """A pre-norm Transformer block: `h + attention(norm(h))`, then `h + mlp(norm(h))`.

    Methods take `(h, _, positions)` and return `(h, None)`, the shape
    `nnx.Scan` threads through stacked layers (`_`: the unused scanned input).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        mlp_dim: int,
        *,
        norm: str,
        rope: bool,
        dropout: float,
        attention_dropout: float,
        out_std: float,
        remat: str,
        scanned: bool,
        dtype: Any,
        ctx: nnx.Context,
    ):
        self.attention_norm = _norm(norm, embed_dim, dtype, ctx)
        self.attention = Attention(
            embed_dim,
            num_heads,
            rope=rope,
            dropout=dropout,
            attention_dropout=attention_dropout,
            out_std=out_std,
            dtype=dtype,
            ctx=ctx,
        )
        self.mlp_norm = _norm(norm, embed_dim, dtype, ctx)
        self.mlp = MLP(embed_dim, mlp_dim, dropout=dropout, out_std=out_std, dtype=dtype, ctx=ctx)
        self.remat = remat
        self.scanned = scanned

    def _forward(
        self, h: jax.Array, positions: jax.Array, *, deterministic: bool, ctx: nnx.Context | None
    ) -> jax.Array:
        h = h + self.attention(self.attention_norm(h), positions, deterministic=deterministic, ctx=ctx)
        h = h + self.mlp(self.mlp_norm(h), deterministic=deterministic, ctx=ctx)
        return _constrain(h, ("batch", "length", "embed"))

    def __call__(
        self, h: jax.Array, _: Any, positions: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None
    ) -> tuple[jax.Array, None]:
        forward = type(self)._forward
        if self.remat != "none":
            # Under lax.scan, CSE cannot undo rematerialisation, and preventing it costs speed.
            forward = nnx.remat(forward, policy=_REMAT_POLICIES[self.remat], prevent_cse=not self.scanned)
        return forward(self, h, positions, deterministic=deterministic, ctx=ctx), None

    def prefill(self, h: jax.Array, _: Any, positions: jax.Array) -> tuple[jax.Array, None]:
        h = h + self.attention.prefill(self.attention_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h), deterministic=True), None

    def decode(self, h: jax.Array, _: Any, positions: jax.Array) -> tuple[jax.Array, None]:
        h = h + self.attention.decode(self.attention_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h), deterministic=True), None


class TransformerLM(nnx.Module):
    """A GPT-style language model; options are the `model` section of a text config (spec lm.md).

    `input_shape` is `(seq_len,)`, `num_classes` the tokenizer's vocabulary
    size (`vocab_size` overrides it). Metrics of a batch `{"tokens": int32
    [B, seq_len + 1]}` are per window: `loss` (mean nats per token),
    `accuracy` and, with `bits_per_byte`, the loss in bits over byte
    targets only (end-of-document targets excluded)::

        model = TransformerLM((128,), 257, num_layers=2, num_heads=2, embed_dim=64, ctx=nnx.context(0))
        model.metrics({"tokens": tokens}, ctx)["loss"]      # [B]
        model.flops_per_token()                             # 6 N + 12 num_layers seq_len embed_dim

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
        check_sizes("num_layers", [num_layers])
        check_sizes("num_heads", [num_heads])
        check_sizes("embed_dim", [embed_dim])
        mlp_dim = check_sizes("mlp_dim", [mlp_dim])[0] if mlp_dim is not None else 4 * embed_dim
        check_rate("dropout", dropout)
        check_rate("attention_dropout", attention_dropout)
        _choice("positions", positions, ("learned", "rope"))
        _choice("norm", norm, ("layernorm", "rmsnorm"))
        _choice("dtype", dtype, tuple(_DTYPES))
        _choice("remat", remat, ("none", "full", "dots"))
        if embed_dim % num_heads:
            raise ValueError(f"model.embed_dim ({embed_dim}) must be a multiple of model.num_heads ({num_heads})")
        if positions == "rope" and (embed_dim // num_heads) % 2:
            raise ValueError(
                f"model.positions rope rotates pairs of features: the head size embed_dim / num_heads "
                f"({embed_dim // num_heads}) must be even"
            )

        compute = _DTYPES[dtype]
        self.seq_len = seq_len
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
                seq_len, embed_dim, dtype=compute, embedding_init=_init(0.02, ("length", "embed")), ctx=ctx
            )
        self.dropout = nnx.Dropout(dropout)
        block = dict(
            norm=norm,
            rope=positions == "rope",
            dropout=dropout,
            attention_dropout=attention_dropout,
            out_std=0.02 / math.sqrt(2 * num_layers),
            remat=remat,
            scanned=scan_layers,
            dtype=compute,
        )
        if scan_layers:
            self.layers = nnx.Scan(
                Block,
                variable_axes={nnx.Param: 0, nnx.Cache: 0},
                split_rngs=("params", "dropout"),
                length=num_layers,
                metadata_params={nnx.PARTITION_NAME: _LAYERS},
            )(embed_dim, num_heads, mlp_dim, **block, ctx=ctx)
        else:
            self.layers = nnx.Sequence(
                [Block(embed_dim, num_heads, mlp_dim, **block, ctx=ctx) for _ in range(num_layers)]
            )
        self.final_norm = _norm(norm, embed_dim, compute, ctx)
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

    def _blocks(self, method: str, h: jax.Array, positions: jax.Array, **kwargs: Any) -> jax.Array:
        if self.scan_layers:
            h, _ = getattr(self.layers.call, method)(h, None, positions, **kwargs)
        else:
            for block in self.layers:
                h, _ = getattr(block, method)(h, None, positions, **kwargs)
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

    def logits(self, tokens: jax.Array, ctx: nnx.Context | None = None) -> jax.Array:
        """Next-token logits `[B, T, vocab]` (float32) of `tokens` `[B, T]`, `T <= seq_len` for learned positions.

        Dropout is on when `ctx` has the flag `deterministic=False` (and a `dropout` stream).
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        length = tokens.shape[1]
        if self.positions == "learned" and length > self.seq_len:
            raise ValueError(f"{length} tokens do not fit the learned positions of a model with seq_len {self.seq_len}")
        deterministic = ctx is None or ctx.get_flag("deterministic") is not False
        positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
        h = self._embed(tokens, positions, deterministic, ctx)
        h = self._blocks("__call__", h, positions, deterministic=deterministic, ctx=ctx)
        return self._logits(h)

    def metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        """Per window of `batch["tokens"]` `[B, seq_len + 1]`: `loss`, `accuracy` (and `bits_per_byte`), each `[B]`."""
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

    def flops_per_token(self) -> int:
        """Training FLOPs per token: `6 N + 12 num_layers seq_len embed_dim`, N the parameters outside the embeddings.

        Works on a model built under `jax.eval_shape` (it reads shapes only).
        """
        params = self.filter(nnx.Param)
        embeddings = ("embedding/embedding", "position_embedding/embedding")
        n = sum(math.prod(p.value.shape) for path, p in params.items() if path not in embeddings)
        return 6 * n + 12 * self.num_layers * self.seq_len * self.embed_dim

    # --- decoding with a key-value cache ------------------------------------

    @property
    def context_limit(self) -> int | None:
        """The most positions a sequence may use: `seq_len` with learned positions, None (unbounded) with RoPE."""
        return self.seq_len if self.positions == "learned" else None

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
