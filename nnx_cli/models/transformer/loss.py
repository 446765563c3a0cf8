"""The output head and the cross-entropy in one: each target's loss without the `[B, T, vocab]` logits.

A language model's training step multiplies the final hidden states `h`
`[B, T, E]` by the head (the tied embedding table `[V, E]` or a kernel
`[E, V]`) into float32 logits, takes the log-softmax at each target, and in
the backward pass writes the logits' gradient, as large again. With a large
vocabulary these dominate the step's memory: 1.2 GB of logits and gradient
at Qwen2.5's 151,936 ids, sequence 512, batch 2, more than a 4-bit 0.5B
model's weights. :func:`token_cross_entropy` computes the head and the loss
a chunk of positions at a time (every row of the batch in each, so a batch
sharded over devices stays so), and keeps per token only what the backward
pass needs::

    d loss_t / d z_t = (softmax(y_t) - onehot(target_t)) * dy/dz       # y: z soft-capped, masked, / temperature
    d h_t = g_t * G_t,   G_t = (d loss_t / d z_t) @ W                     # G computed in the forward pass
    d W = sum_t g_t (d loss_t / d z_t)^T h_t                              # recomputed chunk by chunk

`G` (`[B, T, E]` float32) is written by the forward pass while each chunk's
logits are at hand, so the backward pass gives `h` its gradient with no
product at all; the head's own gradient recomputes each chunk's logits, and
when the head is frozen (LoRA, QLoRA) nothing asks for it and XLA drops that
loop. Without a gradient (evaluation) the forward pass computes the loss
only. Small logits (a byte vocabulary, the test models) are computed whole,
as plain autodiff would (:func:`chunk_length`).

The technique is Liger-Kernel's fused linear cross-entropy (Hsu et al.,
2024) and Wijmans et al.'s "Cut Your Losses in Large-Vocabulary Language
Models" (2024), written here in JAX with a scan over chunks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from nnx_cli.models.transformer.attention import MASKED_LOGIT, soft_cap
from nnx_cli.models.transformer.dense import constrain

CHUNK_BYTES = 64 << 20
"""The float32 logits of one chunk of positions (every row of the batch): about this many bytes. Logits no larger
than this are computed whole."""


class _Head(NamedTuple):
    """What a chunk's logits are made of, besides the arrays (static under jit)."""

    tied: bool  # the head is a table `[V, E]`; False: a kernel `[E, V]`
    vocab_size: int  # ids at and above this are padding: never the target, never the argmax
    softcap: float | None
    temperature: float


def chunk_length(batch: int, length: int, vocab: int) -> int:
    """Positions per chunk: `length` (one chunk) when `[batch, length, vocab]` float32 logits fit in
    :data:`CHUNK_BYTES`, else about that many bytes of logits per chunk, the chunks equal (`length` 512 over
    10 chunks of 52 rather than 9 of 53 and one of 35).

        chunk_length(2, 512, 151936)    # 52: ten chunks of 63 MB instead of 623 MB of logits
        chunk_length(8, 256, 384)       # 256: a byte vocabulary's 3 MB of logits, whole
    """
    most = max(1, CHUNK_BYTES // (4 * batch * vocab))
    if most >= length:
        return length
    chunks = -(-length // most)
    return -(-length // chunks)


def token_cross_entropy(
    h: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    tied: bool,
    vocab_size: int,
    softcap: float | None = None,
    temperature: float = 1.0,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each target's cross-entropy `[B, T]` (float32) under the logits `h @ head`, and whether it is their argmax.

    `h` `[B, T, E]` are the final (normed) hidden states in the compute dtype; `head` the tied embedding table
    `[V, E]` (`tied`) or a head's kernel `[E, V]`, in any dtype (multiplied in `h`'s, accumulated in float32).
    The logits are soft-capped (`softcap * tanh(logits / softcap)`), the padded ids from `vocab_size` up
    masked, then divided by `temperature`; the loss is `logsumexp(logits) - logits[target]`, as
    `optax.softmax_cross_entropy_with_integer_labels`'s, and `is_argmax` counts a target tied at the maximum.
    `chunk` positions at a time (None: :func:`chunk_length`'s choice); one chunk is plain autodiff::

        loss, hit = token_cross_entropy(h, table, targets, tied=True, vocab_size=151936)
        loss.shape, hit.dtype       # (B, T), bool
    """
    spec = _Head(bool(tied), int(vocab_size), None if softcap is None else float(softcap), float(temperature))
    batch, length = targets.shape
    vocab = head.shape[0 if tied else 1]
    chunk = chunk_length(batch, length, vocab) if chunk is None else min(int(chunk), length)
    targets = jnp.asarray(targets, jnp.int32)
    if chunk >= length:
        logits = _logits(h, head.astype(h.dtype), spec)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets), is_argmax(logits, targets)
    return _chunked(h, head, targets, spec, chunk)


def head_logits(h: jax.Array, head: jax.Array, *, tied: bool, vocab_size: int, softcap: float | None) -> jax.Array:
    """The float32 logits `[..., V]` of `h` `[..., E]` that :func:`token_cross_entropy` computes the loss of (no
    temperature): one 2D product over the tokens, contracting the table's own rows when `tied` (its gradient is
    then `g^T h`, with no transposed copy of `g`)."""
    return _logits(h, head.astype(h.dtype), _Head(tied, vocab_size, softcap, 1.0))


def _product(h: jax.Array, head: jax.Array, spec: _Head) -> jax.Array:
    """`h @ head` `[..., V]`, accumulated in float32."""
    rows = h.reshape(-1, h.shape[-1])
    contract = (((1,), (1 if spec.tied else 0,)), ((), ()))
    logits = lax.dot_general(rows, head, contract, preferred_element_type=jnp.float32).reshape(*h.shape[:-1], -1)
    return constrain(logits, ("batch", "length", "vocab"))


def _finish(logits: jax.Array, spec: _Head) -> jax.Array:
    """The product's logits soft-capped, the padded ids masked, divided by the temperature."""
    logits = soft_cap(logits, spec.softcap)
    if logits.shape[-1] != spec.vocab_size:  # nothing padded: a select over every logit would change none
        logits = jnp.where(jnp.arange(logits.shape[-1]) < spec.vocab_size, logits, MASKED_LOGIT)
    return logits if spec.temperature == 1.0 else logits / spec.temperature


def _logits(h: jax.Array, head: jax.Array, spec: _Head) -> jax.Array:
    return _finish(_product(h, head, spec), spec)


def is_argmax(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Whether each target's logit is the largest of its row: `argmax(logits) == target`, where a target tied
    with another id at the maximum also counts as predicted.

    The maximum is the one the cross-entropy computes anyway, so this costs
    a gather: `jnp.argmax`'s paired (value, index) reduction over the
    vocabulary ran several times slower than the whole cross-entropy, and
    its exact first-index tie-break cost another pass over the logits and
    200 MB of memory at SmolLM2 shapes.
    """
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return target_logit >= jnp.max(logits, axis=-1)


def _chunk(h: jax.Array, head: jax.Array, targets: jax.Array, spec: _Head) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One chunk `h` `[B, C, E]`: each target's loss, whether it is the argmax, and the loss's gradient with
    respect to the product `h @ head` `[B, C, V]` (float32; XLA computes only what is used)."""
    product = _product(h, head, spec)
    logits = _finish(product, spec)
    top = jnp.max(logits, axis=-1)
    normalizer = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)  # a select, not a gather: vocab may be sharded
    grad = jnp.exp(logits - normalizer[..., None]) - is_target
    if spec.softcap is not None:  # d(cap tanh(z / cap)) / dz = 1 - tanh^2; padded ids have no gradient either way
        grad = grad * (1.0 - jnp.square(jnp.tanh(product / spec.softcap)))
    if spec.temperature != 1.0:
        grad = grad / spec.temperature
    return normalizer - target_logit, target_logit >= top, grad


def _split(x: jax.Array, chunk: int) -> jax.Array:
    """`[B, T, ...]` -> `[chunks, B, chunk, ...]`, the length padded with zeros to a whole number of chunks."""
    batch, length = x.shape[:2]
    chunks = -(-length // chunk)
    x = jnp.pad(x, [(0, 0), (0, chunks * chunk - length)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(batch, chunks, chunk, *x.shape[2:]), 1, 0)


def _join(x: jax.Array, length: int) -> jax.Array:
    """`[chunks, B, chunk, ...]` -> `[B, length, ...]`, the padding dropped (:func:`_split`'s inverse)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(h: jax.Array, head: jax.Array, targets: jax.Array, spec: _Head, chunk: int) -> tuple[jax.Array, jax.Array]:
    """The loss and `is_argmax`, chunk by chunk (no gradient asked: nothing else)."""
    weights = head.astype(h.dtype)

    def body(_, xs):
        loss, hit, _ = _chunk(xs[0], weights, xs[1], spec)
        return None, (loss, hit)

    _, (loss, hit) = lax.scan(body, None, (_split(h, chunk), _split(targets, chunk)))
    length = targets.shape[1]
    return _join(loss, length), _join(hit, length)


def _chunked_forward(h, head, targets, spec, chunk):
    """The loss and `is_argmax`, and `G`: the gradient with respect to `h` of each token's loss."""
    weights = head.astype(h.dtype)
    contract = (((1,), (0 if spec.tied else 1,)), ((), ()))

    def body(_, xs):
        loss, hit, grad = _chunk(xs[0], weights, xs[1], spec)
        rows = grad.astype(h.dtype).reshape(-1, grad.shape[-1])
        to_h = lax.dot_general(rows, weights, contract, preferred_element_type=jnp.float32)
        return None, (loss, hit, to_h.reshape(*grad.shape[:-1], -1))

    _, (loss, hit, to_h) = lax.scan(body, None, (_split(h, chunk), _split(targets, chunk)))
    length = targets.shape[1]
    return (_join(loss, length), _join(hit, length)), (_join(to_h, length), h, head, targets)


def _chunked_backward(spec, chunk, saved, cotangents):
    """`h`'s gradient `g G`; the head's, `sum_t g_t grad_t^T h_t`, with each chunk's logits computed again."""
    to_h, h, head, targets = saved
    g = cotangents[0]
    weights = head.astype(h.dtype)

    def body(total, xs):
        h_chunk, targets_chunk, g_chunk = xs
        _, _, grad = _chunk(h_chunk, weights, targets_chunk, spec)
        rows = (grad * g_chunk[..., None]).astype(h.dtype).reshape(-1, grad.shape[-1])
        hs = h_chunk.reshape(-1, h.shape[-1])
        if spec.tied:  # [V, E]
            part = lax.dot_general(rows, hs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:  # [E, V]
            part = lax.dot_general(hs, rows, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return constrain(total + part, axes), None

    axes = ("vocab", "embed") if spec.tied else ("embed", "vocab")  # the sum sharded as the head is
    zeros = constrain(jnp.zeros(head.shape, jnp.float32), axes)
    d_head, _ = lax.scan(body, zeros, (_split(h, chunk), _split(targets, chunk), _split(g, chunk)))
    d_h = (g[..., None] * to_h).astype(h.dtype)
    return d_h, d_head.astype(head.dtype), None


_chunked.defvjp(_chunked_forward, _chunked_backward)
