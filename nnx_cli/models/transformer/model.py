"""`TransformerLM`: the decoder-only language model, its metrics, and the decoding entry points.

Token and (learned) position embeddings (scaled by `sqrt(embed_dim)` with
`scale_embeddings`, as Gemma's are), a stack of blocks (scanned under one
`nnx.Scan` or unrolled), a final norm, and logits from the tied embedding or
a head (soft-capped with `logit_softcap`). The vocabulary is padded to a multiple of 128
(257 -> 384) for sharding and alignment; the padded ids get a large negative
logit (in float32) wherever logits come out, so the loss, accuracy and
sampling never pick them. The losses (`metrics`, `token_losses`: SFT, DPO,
GRPO) come from the head and the cross-entropy computed together in chunks of
positions when the logits would be large (:mod:`.loss`).

With `moe` (`model.moe`), blocks hold a mixture of experts instead of an
MLP (:mod:`.moe`); their routers' load-balancing loss (`aux_loss`) is a
metric, and training minimises `loss + router_aux_loss_coef * aux_loss`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

import nnx
from nnx.nn.quantize import two_rows
from nnx_cli.models.layers import check_sizes
from nnx_cli.models.transformer.attention import MASKED_LOGIT, Attention, soft_cap
from nnx_cli.models.transformer.block import Block
from nnx_cli.models.transformer.dense import (
    LAYERS,
    Dense,
    as_stored,
    constrain,
    frozen_kernels_as_bits,
    lookup,
    normal,
    sliceable,
)
from nnx_cli.models.transformer.loss import head_logits, token_cross_entropy
from nnx_cli.models.transformer.moe import GroupedDense, load_balancing_loss
from nnx_cli.models.transformer.norms import make_norm
from nnx_cli.models.transformer.options import Architecture, architecture

Batch = dict[str, jax.Array]

VOCAB_MULTIPLE = 128
"""The embedding and output vocabulary is padded to a multiple of this."""

_HEAD_CHUNK_BYTES = 4 << 20  # of the tied table per product when decoding on CPU: a chunk stays in cache
_BYTES = 256  # ids below this are bytes (the `bytes` tokenizer); bits_per_byte counts only those targets


def padded_vocab_size(vocab_size: int) -> int:
    """`vocab_size` rounded up to a multiple of :data:`VOCAB_MULTIPLE` (257 -> 384)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class TransformerLM(nnx.Module):
    """A decoder-only language model; its options are the `model` section of a text config.

    `input_shape` is `(seq_len,)`, `num_classes` the tokenizer's vocabulary
    size (`vocab_size` overrides it). Metrics of a batch `{"tokens": int32
    [B, seq_len + 1]}` are per window: `loss` (mean nats per token),
    `accuracy` and, with `bits_per_byte`, the loss in bits over byte
    targets only (end-of-document targets excluded)::

        model = TransformerLM((128,), 257, num_layers=2, num_heads=2, embed_dim=64, ctx=nnx.context(0))
        model.metrics({"tokens": tokens}, ctx)["loss"]      # [B]
        model.flops_per_token()                             # 6 N + 12 num_layers seq_len embed_dim

    The architecture options (`num_kv_heads`, `head_dim`, `mlp`, `qkv_bias`,
    `qk_norm`, `bias`, `norm_eps`, `rope_theta`, `rope_scaling`, and Gemma's,
    Phi-3's and Mistral's: `sliding_window`, `layer_types`, `rope_local_theta`,
    `rotary_dim`, `query_scale`, `attention_softcap`, `logit_softcap`,
    `post_norms`, `scale_embeddings`; see `options.architecture`) default to
    the GPT this model was first, so configs written before them keep their
    model. `max_positions` sizes the learned position table (null:
    `seq_len`; an imported GPT-2 has 1024 positions and may train on
    shorter windows).

    `scan_layers` stacks the blocks under one `nnx.Scan` (parameters get a
    leading `layers` axis); otherwise `layers` is an `nnx.Sequence` of blocks
    whose parameters have the same per-block layout. `remat` rematerialises
    each block in the backward pass (`full`: nothing saved; `dots`: weight
    matmul results saved) without changing parameter paths.

    `moe: {num_experts, top_k, mlp_dim, normalize, dense_layers}` makes the
    blocks a sparse mixture of experts (Mixtral, Qwen3-MoE): expert weights
    stacked along the logical axis `expert`, which the default rules put on a
    mesh axis `expert` when there is one. A stack that mixes dense and expert
    blocks (`dense_layers`) is unrolled whatever `scan_layers` says. The
    metrics gain `aux_loss`, the routers' load-balancing loss as
    `transformers` computes it; `loss` stays the cross-entropy (what
    perplexity and dense models report), while its gradient in training is
    that of `loss + router_aux_loss_coef * aux_loss`. `qk_norm_scope:
    projection` normalises all heads of the query (and of the key)
    projection together (OLMoE) where `head` (Qwen3) normalises each head.

    `attention` (`auto`, `core`, `xla`, `cudnn`) picks how attention runs
    (:func:`.attention.choose_attention`); :meth:`attention_summary` says
    which does on this platform, and what takes another way::

        model.attention_summary()   # 'core (auto on cpu)'

    Args:
        input_shape: `(seq_len,)`, one window (`data.seq_len`).
        num_classes: the tokenizer's vocabulary size.
        num_layers: blocks in the stack.
        num_heads: attention (query) heads.
        embed_dim: the width of the residual stream.
        mlp_dim: the MLP's hidden width; null: 4 x `embed_dim`.
        num_kv_heads: key-value heads (grouped-query attention; the cache shrinks with it); null: `num_heads`.
        head_dim: features per head; null: `embed_dim / num_heads`.
        mlp: `gelu` (GPT-2's tanh approximation), `swiglu` (gate, up, down) or `geglu` (Gemma's).
        qkv_bias: biases on the query, key and value projections (Qwen2), also without `bias`.
        qk_norm: an RMSNorm over the queries and keys (Qwen3; see `qk_norm_scope`).
        bias: biases on the other projections and on LayerNorm (false for the Llama family).
        norm_eps: the norms' epsilon.
        rope_theta: the rotary base.
        rope_scaling: `{type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}`
            or `{type: linear, factor}`; rotary positions only.
        max_positions: rows of the learned position table (a table longer than `data.seq_len`); null: `seq_len`.
        lora: low-rank adapters `{rank, alpha (rank), dropout (0), targets (every projection)}`; targets by our
            names `q k v o gate up down`, Hugging Face's `q_proj ...`, GPT-2's `c_attn c_proj c_fc`, Phi-3's
            `qkv_proj gate_up_proj`, and each expert's `experts`; null: none.
        moe: a mixture of SwiGLU experts in place of the MLP, `{num_experts, top_k, mlp_dim (null: mlp_dim),
            normalize (true), dense_layers ([])}`; null: a dense MLP in every layer.
        router_aux_loss_coef: the weight of the routers' load-balancing loss (`aux_loss`) in training.
        qk_norm_scope: what `qk_norm` normalises: `head` (each head, Qwen3) or `projection` (all heads at once,
            OLMoE).
        dropout: dropout on the embeddings and on each block's attention and MLP outputs (0 for `pretrained`).
        attention_dropout: dropout on the attention weights.
        positions: `learned` (a position table) or `rope` (rotary, Llama's convention).
        norm: `layernorm`, `rmsnorm` or `gemma_rmsnorm` (the scale stored as `w`, applied as `1 + w`).
        tie_embeddings: logits from the token embedding table; false: a head of its own.
        dtype: the compute dtype, `float32` or `bfloat16`; parameters, optimizer state and the loss stay float32.
        scan_layers: stack the blocks under one `nnx.Scan`: compile time independent of depth.
        remat: rematerialise each block in the backward pass: `none`, `full` (nothing saved) or `dots` (the
            weight matmuls' results saved).
        vocab_size: the vocabulary; null: `num_classes`, the tokenizer's.
        bits_per_byte: also report the loss in bits per byte (on by default with the `bytes` tokenizer).
        sliding_window: a sliding layer's query sees this many positions, its own included; null: none slides.
        layer_types: one of `sliding_attention`, `full_attention` per layer; null: every layer slides when
            `sliding_window` is set.
        rope_local_theta: the sliding layers' rotary base (Gemma 3); null: `rope_theta`.
        rotary_dim: rotate only each head's leading features (Phi-3); null: all of them.
        query_scale: attention logits scaled by `query_scale ** -0.5`; null: by `head_dim ** -0.5`.
        attention_softcap: attention logits squashed to `cap * tanh(logits / cap)` (Gemma 2); null: none.
        logit_softcap: the output logits squashed the same way (Gemma 2); null: none.
        quantize: the frozen base's storage under `lora` (QLoRA): `{type: nf4 | fp4 | bfloat16, block (64),
            double_quant (true), compute_dtype (null: `dtype`), skip ([])}`, bit-compatible with bitsandbytes; null:
            float32 (a bitsandbytes 4-bit `model.pretrained` sets it from its `quantization_config`).
        post_norms: norms after attention and after the MLP too, before the residual sums (Gemma).
        scale_embeddings: embeddings scaled by `sqrt(embed_dim)` (Gemma).
        attention: how attention runs: `auto` (cuDNN's fused kernel on a GPU where it can, else `core`), `core`
            (ours: no attention weights kept for the backward pass), `xla` (written out), `cudnn` (a GPU only).
        ctx: the `params` RNG stream.
    """

    loss_metric: ClassVar[str] = "loss"
    default_rules: ClassVar[list[list[str]]] = [
        ["batch", "data"],
        ["embed", "data"],
        ["heads", "model"],
        ["kv_heads", "model"],
        ["mlp", "model"],
        ["vocab", "model"],
        ["expert", "expert"],  # dropped where the mesh has no axis `expert` (sharding.default_rules)
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
        moe: dict[str, Any] | None = None,
        router_aux_loss_coef: float = 0.001,
        qk_norm_scope: str = "head",
        quantize: dict[str, Any] | None = None,
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
        sliding_window: int | None = None,
        layer_types: list[str] | None = None,
        rope_local_theta: float | None = None,
        rotary_dim: int | None = None,
        query_scale: float | None = None,
        attention_softcap: float | None = None,
        logit_softcap: float | None = None,
        post_norms: bool = False,
        scale_embeddings: bool = False,
        attention: str = "auto",
        ctx: nnx.Context,
    ):
        seq_len, vocab = _window_and_vocabulary(input_shape, num_classes, vocab_size)
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
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_theta=rope_local_theta,
            rotary_dim=rotary_dim,
            query_scale=query_scale,
            attention_softcap=attention_softcap,
            post_norms=post_norms,
            moe=moe,
            router_aux_loss_coef=router_aux_loss_coef,
            qk_norm_scope=qk_norm_scope,
            quantize=quantize,
            attention=attention,
        )
        if logit_softcap is not None and (not isinstance(logit_softcap, (int, float)) or logit_softcap <= 0):
            raise ValueError(f"model.logit_softcap must be null or a positive number, got {logit_softcap!r}")
        self.seq_len = seq_len
        self.max_positions = _max_positions(seq_len, max_positions, positions)
        self.vocab_size = vocab
        self.num_layers = num_layers
        self.embed_dim = embed_dim
        self.positions = positions
        self.bits_per_byte = bits_per_byte
        self.scan_layers = arch.scanned  # not when dense and expert blocks mix
        self.tie_embeddings = tie_embeddings
        self.scale_embeddings = scale_embeddings
        self.logit_softcap = None if logit_softcap is None else float(logit_softcap)
        self.layers_differ = arch.layers_differ
        self.moe = arch.moe
        self.aux_loss_coef = arch.router_aux_loss_coef
        self._build(arch, dropout, ctx)

    def _build(self, arch: Architecture, dropout: float, ctx: nnx.Context) -> None:
        """The layers, in the order they draw their initial parameters (which fixes every parameter's values)."""
        vocab, embed, compute = padded_vocab_size(self.vocab_size), self.embed_dim, arch.dtype
        stored = arch.storage()  # 16 bits when a quantised base asks
        self.embedding = nnx.Embed(
            vocab, embed, dtype=compute, param_dtype=stored, embedding_init=normal(0.02, ("vocab", "embed")), ctx=ctx
        )
        if self.positions == "learned":
            init = normal(0.02, ("length", "embed"))
            self.position_embedding = nnx.Embed(
                self.max_positions, embed, dtype=compute, param_dtype=stored, embedding_init=init, ctx=ctx
            )
        self.dropout = nnx.Dropout(dropout)
        self.layers = _stack(arch, self.num_layers, ctx)
        self.final_norm = make_norm(arch, ctx)
        if not self.tie_embeddings:
            self.head = Dense(
                (embed,),
                (vocab,),
                ("embed",),
                ("vocab",),
                std=0.02,
                dtype=compute,
                use_bias=False,
                out_dtype=jnp.float32,
                param_dtype=stored,
                ctx=ctx,
            )

    # --- the forward pass ---------------------------------------------------

    def _embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool, ctx: nnx.Context | None):
        h = lookup(self.embedding, tokens)
        if self.scale_embeddings:  # sqrt(embed_dim) in the compute dtype, as Gemma scales by a weight-dtype constant
            h = h * jnp.asarray(math.sqrt(self.embed_dim), h.dtype)
        if self.positions == "learned":
            h = h + lookup(self.position_embedding, positions)
        h = constrain(h, ("batch", "length", "embed"))
        return self.dropout(h, deterministic=deterministic, ctx=ctx)

    def _blocks(self, method: str, h: jax.Array, *args: Any, **kwargs: Any) -> tuple[jax.Array, Any]:
        """`h` through every block's `method`, each given its index: scanned over (when the layers differ), or a
        Python int; and the expert blocks' router statistics summed (None: none)."""
        if self.scan_layers:
            index = jnp.arange(self.num_layers) if self.layers_differ else None
            with frozen_kernels_as_bits(self.layers):
                h, statistics = getattr(self.layers.call, method)(h, index, *args, **kwargs)
            return h, jax.tree.map(lambda x: jnp.sum(x, axis=0), statistics)
        each = []
        for i, block in enumerate(self.layers):
            h, statistics = getattr(block, method)(h, i, *args, **kwargs)
            each.append(statistics)
        each = [s for s in each if s is not None]
        return h, jax.tree.map(lambda *x: sum(x), *each) if each else None

    def _logits(self, h: jax.Array) -> jax.Array:
        """Float32 logits over the padded vocabulary, padded ids masked.

        On one CPU device a tied table stored in another dtype than `h` (a 16-bit base's read in float32, as a
        bitsandbytes directory is at its default `model.dtype`; a float32 one in bfloat16) is multiplied a chunk
        of its rows at a time (:meth:`_tied_chunks`), each chunk converted alone, where one product over the
        table converted whole held that copy beside the logits: for [2, 128] tokens at Qwen2.5-0.5B's shapes,
        562 -> 319 MiB of temporaries (the bfloat16 table is still copied once, to its bits, unless given as
        them), and 282 -> 31 MiB for a float32 table in bfloat16."""
        h = self.final_norm(h)
        if self._chunks_apply() and self.embedding.embedding.dtype != h.dtype:
            return self._tied_chunks(h.reshape(-1, h.shape[-1])).reshape(*h.shape[:-1], -1)
        return head_logits(
            h, self._head(), tied=self.tie_embeddings, vocab_size=self.vocab_size, softcap=self.logit_softcap
        )

    def _head(self) -> jax.Array:
        """The head's weights: the tied embedding table `[vocab, embed]`, or the head's kernel `[embed, vocab]`."""
        return self.embedding.embedding if self.tie_embeddings else self.head.kernel

    def _token_losses(self, h: jax.Array, targets: jax.Array, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
        """Each target's cross-entropy `[B, T]` after the blocks' `h`, and whether it is the argmax, computed by
        :func:`.loss.token_cross_entropy`: in chunks of positions or blocks of the vocabulary when the logits
        would be large."""
        spec = {"tied": self.tie_embeddings, "vocab_size": self.vocab_size, "softcap": self.logit_softcap}
        return token_cross_entropy(self.final_norm(h), self._head(), targets, temperature=temperature, **spec)

    def _last_logits(self, h: jax.Array) -> jax.Array:
        """:meth:`_logits` of one position per row, `h` `[B, 1, embed]` -> `[B, padded vocab]` (prefill, decode).

        On one CPU device a tied table is read a chunk of its rows at a time (:meth:`_tied_chunks`): each row's
        logit is the same dot product as in `_logits` (the logits are bitwise equal), but the chunk's rows are
        still in cache for every row of `h`, where XLA's product over the whole table (544 MB for a Qwen2.5's
        151936 ids) read it from memory about once per row of `h`: the head 2-3x faster at batch 8 and about
        1.6x at batch 1. A GPU, a mesh (a sharded table) or a head of its own take `_logits` as it is (a head's
        `[embed, vocab]` kernel read in chunks of columns is slower). A bfloat16 table (a quantised base's)
        against bfloat16 rows is one product over the whole table as stored: XLA's CPU multiplies the two into
        float32 without widening either (one row repeated to two, :func:`nnx.nn.quantize.two_rows`), where
        float32 chunks of it would need its bits sliced, a copy every step.
        """
        if not self._chunks_apply():
            return self._logits(h)[:, 0]
        table = self.embedding.embedding
        h = self.final_norm(h[:, 0])
        if table.dtype == h.dtype == jnp.bfloat16:  # a quantised base's table, multiplied as it is stored
            spec = {"tied": True, "vocab_size": self.vocab_size, "softcap": self.logit_softcap}
            return head_logits(two_rows(h), table, **spec)[: h.shape[0]]
        return self._tied_chunks(h)

    def _chunks_apply(self) -> bool:
        """Whether the head may read the tied table in chunks of rows (:meth:`_tied_chunks`): on one CPU device."""
        return self.tie_embeddings and nnx.spmd.platform() == "cpu" and jax.sharding.get_abstract_mesh().empty

    def _tied_chunks(self, h: jax.Array) -> jax.Array:
        """The logits `[N, padded vocab]` of the normed rows `h` `[N, embed]` over the tied table, a chunk of
        `_HEAD_CHUNK_BYTES` of its rows per product in a loop, each chunk in `h`'s dtype. A bfloat16 table (a
        quantised base's) is sliced as its bits (:func:`.dense.sliceable`) where XLA's CPU has no bfloat16
        dynamic-slice (up to JAX 0.10) and would widen the whole table to float32 once, outside the loop."""
        table = self.embedding.embedding
        vocab, width = table.shape
        chunk = min(vocab, max(VOCAB_MULTIPLE, _HEAD_CHUNK_BYTES // (width * 4) // VOCAB_MULTIPLE * VOCAB_MULTIPLE))
        sliced = sliceable(table)

        def part(i: jax.Array, logits: jax.Array) -> jax.Array:
            start = jnp.minimum(i * chunk, vocab - chunk)  # the last chunk overlaps the one before: same values
            rows = as_stored(jax.lax.dynamic_slice_in_dim(sliced, start, chunk), table.dtype).astype(h.dtype)
            dot = jax.lax.dot_general(h, rows, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dot = jnp.where(
                start + jnp.arange(chunk) < self.vocab_size, soft_cap(dot, self.logit_softcap), MASKED_LOGIT
            )
            return jax.lax.dynamic_update_slice_in_dim(logits, dot, start, axis=1)  # finished: no second buffer

        return jax.lax.fori_loop(0, -(-vocab // chunk), part, jnp.zeros((h.shape[0], vocab), jnp.float32))

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
        return self._logits(self._hidden(tokens, ctx, positions, segments)[0])

    def token_losses(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        ctx: nnx.Context | None = None,
        *,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
        temperature: float = 1.0,
    ) -> tuple[jax.Array, jax.Array]:
        """The cross-entropy (float32) of each of `targets` `[B, T]`, the next tokens of `tokens` `[B, T]`, under
        the logits divided by `temperature`, and whether each target is their argmax (a tie counts), both
        `[B, T]`: `-log_softmax(logits(tokens) / temperature)[target]` without the `[B, T, vocab]` logits (and
        their gradient) in memory at once when they would be large (:mod:`.loss`). `ctx`, `positions` and
        `segments` as in :meth:`logits`::

            loss, hit = model.token_losses(batch["tokens"][:, :-1], batch["tokens"][:, 1:])
        """
        h, _ = self._hidden(tokens, ctx, positions, segments)
        return self._token_losses(h, jnp.asarray(targets, jnp.int32), temperature)

    def _hidden(
        self,
        tokens: jax.Array,
        ctx: nnx.Context | None = None,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The last block's output `[B, T, embed]` (before the final norm), and the routers' load-balancing loss
        over the real tokens (None without experts)."""
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
            h, statistics = self._blocks("__call__", h, positions, deterministic=deterministic, ctx=ctx)
        else:
            segments = jnp.asarray(segments, jnp.int32)
            h, statistics = self._blocks("__call__", h, positions, segments, deterministic=deterministic, ctx=ctx)
        aux = None if statistics is None else load_balancing_loss(statistics, self.moe.num_experts)
        return h, aux

    def _with_aux_loss(self, out: dict[str, jax.Array], aux: jax.Array | None) -> dict[str, jax.Array]:
        """`aux_loss` beside the metrics (the batch's, on every row), and its gradient, times the coefficient,
        in the loss's: `loss` keeps the cross-entropy's value."""
        if aux is None:
            return out
        rows = out["loss"].shape
        hidden = self.aux_loss_coef * (aux - jax.lax.stop_gradient(aux))  # zero, with aux's gradient
        return {**out, "loss": out["loss"] + hidden, "aux_loss": jnp.broadcast_to(aux, rows)}

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
        h, aux = self._hidden(tokens[:, :-1], ctx)
        token_loss, hit = self._token_losses(h, targets)
        out = {
            "loss": jnp.mean(token_loss, axis=-1),
            "accuracy": jnp.mean(hit, axis=-1, dtype=jnp.float32),
        }
        if self.bits_per_byte:
            is_byte = targets < _BYTES
            nats = jnp.sum(jnp.where(is_byte, token_loss, 0.0), axis=-1) / jnp.maximum(jnp.sum(is_byte, axis=-1), 1)
            out["bits_per_byte"] = nats / math.log(2)
        return self._with_aux_loss(out, aux)

    def _example_metrics(self, batch: Batch, ctx: nnx.Context) -> dict[str, jax.Array]:
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        segments = jnp.asarray(batch["segments"], jnp.int32)
        targets = tokens[:, 1:]
        # a target counts when marked, and when it continues the same (real) example as the token before it
        counts = batch["targets"][:, 1:].astype(bool) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
        h, aux = self._hidden(tokens[:, :-1], ctx, batch["positions"][:, :-1], segments[:, :-1])
        token_loss, hit = self._token_losses(h, targets)
        weight = jnp.sum(counts, axis=-1, dtype=jnp.float32)
        per_row = lambda x: jnp.sum(jnp.where(counts, x, 0.0), axis=-1) / jnp.maximum(weight, 1.0)  # noqa: E731
        out = {
            "loss": per_row(token_loss),
            "accuracy": per_row(hit.astype(jnp.float32)),
            "weight": weight,
        }
        return self._with_aux_loss(out, aux)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: `6 N + 12 num_layers seq_len embed_dim`, N the parameters outside the embeddings
        that a token uses (of the experts' weights, `top_k / num_experts`); a sliding layer counts
        `min(sliding_window, seq_len)` positions instead of `seq_len`.

        Works on a model built under `jax.eval_shape` (it reads shapes only).
        """
        arch = self._attentions()[0].arch  # the layers share one
        attended = sum(  # positions a token attends to, over the layers
            min(arch.sliding_window, self.seq_len) if arch.slides(i) else self.seq_len for i in range(self.num_layers)
        )
        return 6 * self.active_params() + 12 * attended * self.embed_dim

    def active_params(self) -> int:
        """The parameters outside the embeddings that one token computes with. Reads shapes only."""
        params = self.filter(nnx.Param)
        embeddings = ("embedding/embedding", "position_embedding/embedding")
        n = sum(weights(path, p) for path, p in params.items() if path not in embeddings)
        return n - self.idle_params()

    def idle_params(self, adapters: bool = True) -> int:
        """The parameters one token does not compute with: the experts it is not routed to, `1 - top_k /
        num_experts` of every expert block's weights, their LoRA adapters too unless not `adapters` (0 without
        experts). Reads shapes only."""
        if self.moe is None:
            return 0
        params = self.filter(nnx.Param if adapters else nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
        experts = sum(weights(path, p) for path, p in params.items() if _is_expert(path))
        return round(experts * (1 - self.moe.top_k / self.moe.num_experts))

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

    def attention_summary(self) -> str:
        """Which attention runs on this platform and why, and the variants that take another (one line)."""
        return self._attentions()[0].summary()

    def _attentions(self) -> list[Attention]:
        if self.scan_layers:
            return [self.layers.scan_module.attention]
        return [block.attention for block in self.layers]

    def init_cache(self, batch_size: int, max_len: int) -> None:
        """Adds zero `nnx.Cache` keys and values for `batch_size` rows of up to `max_len` positions to every layer
        (a sliding layer holds its window's, unless scanned among full layers: `Attention.init_cache`)."""
        limit = self.context_limit
        if limit is not None and max_len > limit:
            raise ValueError(f"a cache of {max_len} positions exceeds the learned positions of this model ({limit})")
        for i, attention in enumerate(self._attentions()):
            if self.scan_layers:
                attention.init_cache(batch_size, max_len, self.num_layers)
            else:
                attention.init_cache(batch_size, max_len, layer=i)

    def prefill(self, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        """Runs prompts `tokens` `[B, P]` (right-padded; row `b` has `lengths[b]` real tokens) into an empty cache.

        Returns the float32 logits `[B, padded vocab]` after each prompt's last real token.
        """
        tokens, lengths = jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        h, _ = self._blocks("prefill", self._embed(tokens, positions, True, None), positions, lengths)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)
        return self._last_logits(last)

    def decode(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Feeds one token per row (`tokens`, `positions`: `[B]`) through the cache; returns the logits `[B, vocab]`."""
        tokens, positions = jnp.asarray(tokens, jnp.int32)[:, None], jnp.asarray(positions, jnp.int32)[:, None]
        h, _ = self._blocks("decode", self._embed(tokens, positions, True, None), positions)
        return self._last_logits(h)

    def for_decoding(self, *, unstack: bool = True) -> TransformerLM:
        """This model as a decoding loop reads it best: its scanned layers unstacked (with `unstack`, and unless
        their kernels are stored in 4 bits), its float32 weights that multiply in 16 bits held in 16 bits
        (:meth:`in_compute_dtype`). A copy, or self when nothing changes.

        4-bit kernels stay stacked: under the scan each layer's codes are dequantised inside the layer's step,
        one layer's weights at a time, its slice of the stacked codes read by the dequantisation itself. Unrolled,
        XLA dequantises every layer's kernels ahead of their products and holds them all at once, a 16-bit copy
        of the base that 4 bits are there to avoid: a Qwen2.5-0.5B-shaped nf4 model's batch-1 step held 728 MiB
        of temporaries against 43, and took twice the time (419 against 189 ms, 2 CPU cores). A sampling loop
        compiled whole (GRPO's) gives up speed for it: unrolled, XLA dequantises once before the loop; stacked,
        at every step (8 prompts of 64 tokens, 16 new: 1,002 -> 314 MiB of temporaries, 3.1 -> 5.1 s;
        `benchmarks/decode_step.py`).
        """
        model = self
        if unstack and not any(isinstance(m, nnx.QuantizedKernel) for _, m in self.layers.modules()):
            model = model.unstack_layers()
        return model.in_compute_dtype()

    def unstack_layers(self) -> TransformerLM:
        """This model with its scanned layers split into an `nnx.Sequence` of blocks (a copy; self if unrolled).

        Decoding one token is cheaper on per-layer arrays: under jit, reading
        one layer out of the stacked ones copies its weights at every step.
        """
        if not self.scan_layers:
            return self
        model = self.clone()
        stacked, block_def = model.layers.scan_module.partition()
        stacked = nnx.spmd.remove_axis(stacked, 0, {nnx.PARTITION_NAME: LAYERS})
        blocks = [block_def.merge(jax.tree.map(lambda x, i=i: x[i], stacked)) for i in range(self.num_layers)]
        model.layers = nnx.Sequence(blocks)
        model.scan_layers = False
        return model

    def in_compute_dtype(self) -> TransformerLM:
        """This model with the float32 weights it multiplies in 16 bits (`model.dtype: bfloat16`: its kernels,
        and its embedding table) held in 16 bits: a copy, or self when there are none. The same values, each the
        rounding its product makes anyway.

        For decoding: a step rounds every such weight again (a pass over all of them for one token), most of a
        batch-1 step's time on a CPU. Not for training, whose float32 parameters the optimizer updates.
        """

        def widened(model: TransformerLM) -> Iterator[tuple[nnx.Module, str, Any]]:
            for _, module in model.modules():
                if isinstance(module, (Dense, GroupedDense)):
                    name, compute = "kernel", module.compute_dtype
                elif isinstance(module, nnx.Embed):
                    name, compute = "embedding", module.dtype
                else:
                    continue
                value = getattr(module, name)
                if isinstance(value, jax.Array) and value.dtype == jnp.float32 and jnp.dtype(compute).itemsize == 2:
                    yield module, name, compute

        if next(widened(self), None) is None:
            return self
        model = self.clone()
        for module, name, compute in list(widened(model)):
            setattr(module, name, getattr(module, name).astype(compute))
        return model


def _window_and_vocabulary(
    input_shape: Sequence[int], num_classes: int | None, vocab_size: int | None
) -> tuple[int, int]:
    """`(seq_len, vocab)`, checked: windows of `[seq_len]` tokens, a vocabulary from `vocab_size` or the data."""
    if len(input_shape) != 1:
        raise ValueError(
            f"model 'transformer_lm' reads token windows: input_shape must be [seq_len], got {list(input_shape)}"
        )
    vocab = vocab_size if vocab_size is not None else num_classes
    if vocab is None:
        raise ValueError("model.vocab_size is unknown: the data has no tokenizer; set model.vocab_size")
    (seq_len,) = check_sizes("input_shape", input_shape)
    check_sizes("vocab_size", [vocab], one=True)
    return seq_len, vocab


def _max_positions(seq_len: int, max_positions: int | None, positions: str) -> int:
    """The size of the learned position table (null: `seq_len`), which must hold a window."""
    max_positions = seq_len if max_positions is None else check_sizes("max_positions", [max_positions], one=True)[0]
    if positions == "learned" and seq_len > max_positions:
        raise ValueError(
            f"data.seq_len ({seq_len}) exceeds the model's {max_positions} learned positions "
            "(model.max_positions); lower data.seq_len"
        )
    return max_positions


def _stack(arch: Architecture, num_layers: int, ctx: nnx.Context) -> nnx.Module:
    """`num_layers` blocks: stacked under one `nnx.Scan` (a leading `layers` axis), or an `nnx.Sequence`."""
    if arch.scanned:  # blocks all alike (architecture() sees to it)
        return nnx.Scan(
            Block,
            variable_axes={nnx.Param: 0, nnx.Cache: 0},
            split_rngs=("params", "dropout"),
            length=num_layers,
            metadata_params={nnx.PARTITION_NAME: LAYERS},
        )(arch, sparse=arch.sparse(0), ctx=ctx)
    return nnx.Sequence([Block(arch, sparse=arch.sparse(i), ctx=ctx) for i in range(num_layers)])


def weights(path: str, variable: Any) -> int:
    """The number of weights parameter `variable` (at `path`) holds: its size, or for a 4-bit kernel's parts
    (`nnx.QuantizedParam`) two per byte of its `codes` and none in its scales."""
    if isinstance(variable, nnx.QuantizedParam):
        return 2 * math.prod(variable.value.shape) if path.endswith("/codes") else 0
    return math.prod(variable.value.shape)


def _is_expert(path: str) -> bool:
    """Whether parameter `path` is an expert's weight (or its adapter), not the router's."""
    return "/moe/" in f"/{path}" and "/moe/router/" not in f"/{path}"
