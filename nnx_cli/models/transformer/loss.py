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
    d W = sum_t (d loss_t / d z_t)^T (g_t h_t)                            # kept, or recomputed chunk by chunk

`G` (`[B, T, E]` float32) is written by the forward pass while each chunk's
logits are at hand, so the backward pass gives `h` its gradient with no
product at all. The head's own gradient takes the logits' gradient that the
forward pass rounded to the compute dtype for `G`'s product, kept where it
fits (:func:`keep_bytes`: on a GPU, GPT-2 small's 1.6 GB at 16 x 1,024
tokens; on a CPU, full fine-tuning's 192 MiB at SmolLM2's 49,152 ids and
4 x 256 tokens), or else recomputes each chunk's logits: one product over
the vocabulary and two passes over float32 logits more. When the head is
frozen (LoRA, QLoRA) nothing asks for either and XLA drops them, the kept
gradient included. Without a gradient (evaluation) the forward pass
computes the loss only. Small logits (a byte vocabulary, the test models)
are computed whole, as plain autodiff would (:func:`chunk_length`).

On a CPU the same loss is computed over blocks of the vocabulary instead
(:func:`blocks_apply`; every position in each block, each block of the head
converted to the compute dtype alone):
XLA's CPU multiplies all positions by a block of 4,096 rows of the table
three to four times faster than a chunk of positions by the whole table.
One pass over the blocks keeps each position's running maximum `m`, sum
`s = sum exp(y - m)` and `A = sum exp(y - m) dy/dz w` (rescaled by
`exp(m_old - m_new)` as the maximum grows, the online softmax of flash
attention), so that `G = A / s - dy/dz_t w_t` at the end: no block's logits
are computed twice for `h`'s gradient either. Where it fits, the pass keeps
each block's `exp(y - m) dy/dz` with that block's `m`, and the head's
gradient is their product with the positions scaled by `g exp(m - log Z)`,
the targets' rows added once (a full fine-tuning step at SmolLM2-135M's
shapes in 0.94x the time of computing each block's logits again, at a
Qwen2-like one with an untied head 0.96x). A 16-bit
head is sliced as its bits (a training step is given a frozen 16-bit base as
its bits, so that XLA's CPU slices it as it is). A mesh that shards the
vocabulary keeps the chunks of positions (a block of a sharded table would
live on one device).

The technique is Liger-Kernel's fused linear cross-entropy (Hsu et al.,
2024) and Wijmans et al.'s "Cut Your Losses in Large-Vocabulary Language
Models" (2024), written here in JAX with a scan over chunks or blocks.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

import nnx
from nnx_cli.models.transformer.attention import MASKED_LOGIT, soft_cap
from nnx_cli.models.transformer.dense import as_stored, constrain, sliceable

CHUNK_BYTES: int | None = None
"""The float32 logits of one chunk of positions (every row of the batch): about this many bytes; logits no larger
than this are computed whole. None: the platform's, :func:`chunk_bytes`."""


KEEP_BYTES: int | None = None
"""The most bytes of the logits' gradient (in the compute dtype) that the forward pass over chunks or blocks keeps
for the head's gradient, which then needs no second product over them. None: the platform's, :func:`keep_bytes`."""


def keep_bytes() -> int:
    """:data:`KEEP_BYTES` where set, else on a GPU or TPU a sixteenth of the device's memory and on a CPU a
    sixteenth of the host's, at most 4 GiB on a device and 1 GiB on a host."""
    if KEEP_BYTES is not None:
        return KEEP_BYTES
    if nnx.spmd.platform() == "cpu":
        return min(1 << 30, _host_bytes() // 16)
    stats = jax.local_devices()[0].memory_stats() or {}
    return min(4 << 30, stats.get("bytes_limit", 0) // 16)


def _host_bytes() -> int:
    """The host's physical memory in bytes (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


def chunk_bytes() -> int:
    """:data:`CHUNK_BYTES` where set, else 64 MiB on a CPU and 1 GiB on a GPU or TPU. On one H200, GPT-2 small's
    bfloat16 step at batch 16 x 1,024 (3.3 GB of float32 logits) took 56.1 ms in 52 chunks of 64 MiB and 48.4 ms
    in 4 of 1 GiB (`benchmarks/profile_step.py --shape gpt2 --loss-chunk-mb`): a chunk of 320 positions leaves
    the GPU's products small and 52 of them in a row; a CPU's caches favour the small ones."""
    if CHUNK_BYTES is not None:
        return CHUNK_BYTES
    return 64 << 20 if nnx.spmd.platform() == "cpu" else 1 << 30


class _Head(NamedTuple):
    """What a chunk's logits are made of, besides the arrays (static under jit)."""

    tied: bool  # the head is a table `[V, E]`; False: a kernel `[E, V]`
    vocab_size: int  # ids at and above this are padding: never the target, never the argmax
    softcap: float | None
    temperature: float


def chunk_length(batch: int, length: int, vocab: int) -> int:
    """Positions per chunk: `length` (one chunk) when `[batch, length, vocab]` float32 logits fit in
    :func:`chunk_bytes`, else about that many bytes of logits per chunk, the chunks equal (`length` 512 over
    10 chunks of 52 rather than 9 of 53 and one of 35).

        chunk_length(2, 512, 151936)    # on a CPU 52: ten chunks of 63 MB instead of 623 MB of logits
        chunk_length(8, 256, 384)       # 256: a byte vocabulary's 3 MB of logits, whole
    """
    most = max(1, chunk_bytes() // (4 * batch * vocab))
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
    block: int | None = None,
    keep: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each target's cross-entropy `[B, T]` (float32) under the logits `h @ head`, and whether it is their argmax.

    `h` `[B, T, E]` are the final (normed) hidden states in the compute dtype; `head` the tied embedding table
    `[V, E]` (`tied`) or a head's kernel `[E, V]`, in any dtype (multiplied in `h`'s, accumulated in float32).
    The logits are soft-capped (`softcap * tanh(logits / softcap)`), the padded ids from `vocab_size` up
    masked, then divided by `temperature`; the loss is `logsumexp(logits) - logits[target]`, as
    `optax.softmax_cross_entropy_with_integer_labels`'s, and `is_argmax` counts a target tied at the maximum.
    `chunk` positions at a time, or `block` vocabulary ids at a time (neither: blocks of :func:`block_rows` where
    :func:`blocks_apply`, else chunks of :func:`chunk_length`); one chunk is plain autodiff. Chunks and blocks
    `keep` the logits' gradient for the head's (None: where it fits :func:`keep_bytes`), else compute the logits
    again::

        loss, hit = token_cross_entropy(h, table, targets, tied=True, vocab_size=151936)
        loss.shape, hit.dtype       # (B, T), bool
    """
    spec = _Head(bool(tied), int(vocab_size), None if softcap is None else float(softcap), float(temperature))
    batch, length = targets.shape
    vocab = head.shape[0 if tied else 1]
    targets = jnp.asarray(targets, jnp.int32)
    if block is None and chunk is None and blocks_apply(batch, length, vocab):
        block = block_rows(batch * length, vocab)
    itemsize = jnp.dtype(h.dtype).itemsize
    if block is not None:
        rows = min(int(block), vocab)
        blocks = _Block(spec, rows, -(-vocab // rows))
        if keep is None:
            keep = itemsize * batch * length * blocks.count * rows <= keep_bytes()
        return _blocked(h, head, targets, blocks, bool(keep))
    chunk = chunk_length(batch, length, vocab) if chunk is None else min(int(chunk), length)
    if chunk >= length:
        logits = _logits(h, head.astype(h.dtype), spec)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets), is_argmax(logits, targets)
    if keep is None:
        keep = itemsize * batch * -(-length // chunk) * chunk * vocab <= keep_bytes()
    return _chunked(h, head, targets, spec, chunk, bool(keep))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(
    h: jax.Array, head: jax.Array, targets: jax.Array, spec: _Head, chunk: int, keep: bool
) -> tuple[jax.Array, jax.Array]:
    """The loss and `is_argmax`, chunk by chunk (no gradient asked: nothing else)."""
    weights = head.astype(h.dtype)

    def body(_, xs):
        loss, hit, _ = _chunk(xs[0], weights, xs[1], spec)
        return None, (loss, hit)

    _, (loss, hit) = lax.scan(body, None, (_split(h, chunk), _split(targets, chunk)))
    length = targets.shape[1]
    return _join(loss, length), _join(hit, length)


def _chunked_forward(h, head, targets, spec, chunk, keep):
    """The loss and `is_argmax`, and `G`: the gradient with respect to `h` of each token's loss; with `keep`, each
    chunk's gradient with respect to the logits too, in `h`'s dtype, as `G`'s product took it."""
    weights = head.astype(h.dtype)
    contract = (((1,), (0 if spec.tied else 1,)), ((), ()))

    def body(_, xs):
        loss, hit, grad = _chunk(xs[0], weights, xs[1], spec)
        grad = grad.astype(h.dtype)
        to_h = lax.dot_general(grad.reshape(-1, grad.shape[-1]), weights, contract, preferred_element_type=jnp.float32)
        return None, (loss, hit, to_h.reshape(*grad.shape[:-1], -1), grad if keep else None)

    _, (loss, hit, to_h, grads) = lax.scan(body, None, (_split(h, chunk), _split(targets, chunk)))
    length = targets.shape[1]
    return (_join(loss, length), _join(hit, length)), (_join(to_h, length), h, head, targets, grads)


def _chunked_backward(spec, chunk, keep, saved, cotangents):
    """`h`'s gradient `g G`; the head's, `sum_t grad_t^T (g_t h_t)`, chunk by chunk: from the kept gradients, or
    with each chunk's logits computed again."""
    to_h, h, head, targets, grads = saved
    g = cotangents[0]
    weights = head.astype(h.dtype)

    def body(total, xs):
        h_chunk, targets_chunk, g_chunk, grad = xs
        if grad is None:
            _, _, grad = _chunk(h_chunk, weights, targets_chunk, spec)
            rows = (grad * g_chunk[..., None]).astype(h.dtype).reshape(-1, grad.shape[-1])
            hs = h_chunk.reshape(-1, h.shape[-1])
        else:  # g scales the chunk's `[B, C, E]` positions, not its `[B, C, V]` kept gradient: a smaller pass
            rows = grad.reshape(-1, grad.shape[-1])
            hs = (g_chunk[..., None] * h_chunk).astype(h.dtype).reshape(-1, h.shape[-1])
        if spec.tied:  # [V, E]
            part = lax.dot_general(rows, hs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:  # [E, V]
            part = lax.dot_general(hs, rows, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return constrain(total + part, axes), None

    axes = ("vocab", "embed") if spec.tied else ("embed", "vocab")  # the sum sharded as the head is
    zeros = constrain(jnp.zeros(head.shape, jnp.float32), axes)
    d_head, _ = lax.scan(body, zeros, (_split(h, chunk), _split(targets, chunk), _split(g, chunk), grads))
    d_h = (g[..., None] * to_h).astype(h.dtype)
    return d_h, d_head.astype(head.dtype), None


_chunked.defvjp(_chunked_forward, _chunked_backward)


# Vocabulary blocks (a CPU, the vocabulary not sharded)
# ------------------------------------------------------------------------------

BLOCK_ROWS = 4096
"""Vocabulary ids per block of :func:`_blocked`. On two cores of the development machine, XLA's CPU multiplied
1,024 positions by 2,048-4,096 rows of a 896-wide bfloat16 table at 580-870 GFLOP/s (8,192-16,384 rows: 320-480),
where a chunk of 104 positions by the whole 151,936-row table ran at 150-300; benchmarks/chunked_loss.py times
whole train steps both ways."""


def block_rows(tokens: int, vocab: int) -> int:
    """Ids per vocabulary block for `tokens` positions: :data:`BLOCK_ROWS`, fewer when that many float32 logits
    per position would pass :func:`chunk_bytes`, never more than the vocabulary."""
    return max(1, min(vocab, BLOCK_ROWS, chunk_bytes() // (4 * tokens)))


def blocks_apply(batch: int, length: int, vocab: int) -> bool:
    """Whether :func:`token_cross_entropy` takes vocabulary blocks by default: on a CPU (where XLA multiplies a
    block of the table by every position several times faster than a chunk of positions by the whole table),
    when the logits would not fit in one chunk and no mesh axis shards the vocabulary (a block of a sharded table
    would live on one device). At Qwen2.5-0.5B's shapes the blocks took 0.55x the loss's time in float32 (and 50
    against 128 MiB of temporaries), 0.5-0.7x in bfloat16.

    A head stored in another dtype than the compute dtype (a float32 base computing in bfloat16, a 16-bit base read in
    float32) is sliced as stored and each block converted alone; the chunks of positions convert it whole (a LoRA step
    on a float32 base in bfloat16: 0.94x the time and 969 against 1,208 MiB of temporaries with blocks,
    `benchmarks/chunked_loss.py --time lora32`). XLA's CPU up to JAX 0.10 slices a 16-bit head only as its bits
    (:func:`.dense.sliceable`). A 16-bit head is a frozen base's (`model.quantize`), which a training step is given as
    its bits (`steps.frozen_as_bits`), so that costs nothing there; a 16-bit head given as it is (a model used outside
    the trainer) costs a copy of its bits (272 MB at those shapes)."""
    if nnx.spmd.platform() != "cpu" or 4 * batch * length * vocab <= chunk_bytes():
        return False
    from nnx.spmd import current_mesh, logical_to_mesh_axes

    mesh = current_mesh()
    spec = logical_to_mesh_axes(("vocab",))
    if mesh is None or mesh.empty or spec is None or spec[0] is None:
        return True
    axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    return all(mesh.shape[a] == 1 for a in axes)


class _Block(NamedTuple):
    """What :func:`_blocked` walks: the head, `rows` ids at a time (static under jit)."""

    head: _Head
    rows: int  # ids per block; the last block starts earlier (at vocab - rows) and skips the ids it repeats
    count: int  # blocks


class _BlockOf(NamedTuple):
    """One block of the head, as :func:`_block_logits` computes it."""

    start: jax.Array  # its first id (the last block starts at vocab - rows)
    ids: jax.Array  # `[rows]`
    fresh: jax.Array  # `[rows]`: not an id of an earlier block (the last block repeats some)
    w: jax.Array  # its rows (tied) or columns of the head, in the compute dtype
    product: jax.Array  # `x @ w` `[N, rows]`, float32
    logits: jax.Array  # the product finished: soft-capped, repeated and padded ids masked, over the temperature


def _block_start(j: jax.Array, spec: _Block, vocab: int) -> jax.Array:
    """The first id of block `j`: `j * rows`, the last block moved back to end at `vocab`."""
    return jnp.minimum(j * spec.rows, vocab - spec.rows)


def _block_logits(x: jax.Array, weights: jax.Array, j: jax.Array, spec: _Block, stored: Any) -> _BlockOf:
    """Block `j` of `weights` (:func:`.dense.sliceable`'s, of the head `stored` in that dtype), converted to
    `x`'s dtype alone: a head stored in another dtype is never converted whole."""
    start = _block_start(j, spec, weights.shape[0 if spec.head.tied else 1])
    w = lax.dynamic_slice_in_dim(weights, start, spec.rows, axis=0 if spec.head.tied else 1)
    w = as_stored(w, stored).astype(x.dtype)
    contract = (((1,), (1 if spec.head.tied else 0,)), ((), ()))
    product = lax.dot_general(x, w, contract, preferred_element_type=jnp.float32)
    ids = start + jnp.arange(spec.rows)
    fresh = ids >= j * spec.rows
    logits = soft_cap(product, spec.head.softcap)
    logits = jnp.where(fresh & (ids < spec.head.vocab_size), logits, MASKED_LOGIT)
    if spec.head.temperature != 1.0:
        logits = logits / spec.head.temperature
    return _BlockOf(start, ids, fresh, w, product, logits)


def _slope(product: jax.Array, head: _Head) -> jax.Array:
    """d logits / d product: the soft cap's `1 - tanh^2` over the temperature (1 without either)."""
    slope = jnp.ones_like(product) if head.softcap is None else 1.0 - jnp.square(jnp.tanh(product / head.softcap))
    return slope if head.temperature == 1.0 else slope / head.temperature


class _Kept(NamedTuple):
    """What the forward pass over the blocks keeps for the head's gradient (:func:`_blocked_pass`'s `keep`)."""

    d: jax.Array  # `[count, N, rows]`: each block's `exp(logits - m) slope` as A's product took it (compute dtype;
    # 16 bits as their bits where XLA's CPU would widen the stack each block's step: `dense.sliceable`)
    top: jax.Array  # `[count, N]`: the running maximum `m` that block was scaled by
    slope: jax.Array  # `[N]`: d logits / d product at each position's target


def _blocked_pass(h: jax.Array, head: jax.Array, targets: jax.Array, spec: _Block, gradient: bool, keep: bool):
    """One pass over the vocabulary blocks with a running maximum `m` and sum `s` of `exp(logits - m)` per
    position (the online softmax), and, with `gradient`, the running `A = sum exp(logits - m) slope w`, rescaled
    as `m` grows: `G = A / s - slope_target w_target` is then the gradient of each position's loss with respect
    to its `h`. Returns the loss, `is_argmax`, the log normalizer, G (None without `gradient`), `[N]`/`[N, E]`,
    and with `keep` each block's factor of A's product (:class:`_Kept`), from which the backward pass takes the
    head's gradient without computing the logits again."""
    x = h.reshape(-1, h.shape[-1])
    weights = sliceable(head)
    rows = targets.reshape(-1)
    n = rows.shape[0]

    def body(carry, j):
        m, s, a, logit, target = carry
        block = _block_logits(x, weights, j, spec, head.dtype)
        top = jnp.maximum(m, jnp.max(block.logits, axis=-1))
        rescale = jnp.exp(m - top)
        p = jnp.exp(block.logits - top[:, None])
        s = s * rescale + jnp.sum(p, axis=-1)
        is_target = (block.ids == rows[:, None]) & block.fresh  # selects, not gathers: once per target
        logit = logit + jnp.sum(jnp.where(is_target, block.logits, 0.0), axis=-1)
        if gradient:
            target = target + jnp.sum(jnp.where(is_target, block.product, 0.0), axis=-1)
            d = (p * _slope(block.product, spec.head)).astype(h.dtype)
            contract = (((1,), (0 if spec.head.tied else 1,)), ((), ()))
            a = a * rescale[:, None] + lax.dot_general(d, block.w, contract, preferred_element_type=jnp.float32)
            return (top, s, a, logit, target), (sliceable(d), top) if keep else None
        return (top, s, a, logit, target), None

    zeros = jnp.zeros((n,), jnp.float32)
    a = jnp.zeros((n, x.shape[1]) if gradient else (), jnp.float32)
    (top, s, a, logit, target), kept = lax.scan(body, (jnp.full((n,), -jnp.inf), zeros, a, zeros, zeros),
                                                jnp.arange(spec.count))  # fmt: skip
    normalizer = top + jnp.log(s)
    loss, hit = normalizer - logit, logit >= top
    if not gradient:
        return loss, hit, normalizer, None, None
    picked = as_stored(jnp.take(weights, rows, axis=0 if spec.head.tied else 1), head.dtype)
    picked = picked.astype(h.dtype).astype(jnp.float32)  # the target's row as the blocks multiply by it
    picked = picked if spec.head.tied else picked.T
    slope = _slope(target, spec.head)
    g = a / s[:, None] - slope[:, None] * picked
    return loss, hit, normalizer, g, _Kept(kept[0], kept[1], slope) if keep else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked(
    h: jax.Array, head: jax.Array, targets: jax.Array, spec: _Block, keep: bool
) -> tuple[jax.Array, jax.Array]:
    """The loss and `is_argmax` `[B, T]`, a block of the vocabulary at a time (no gradient asked: nothing else)."""
    loss, hit, _, _, _ = _blocked_pass(h, head, targets, spec, gradient=False, keep=False)
    return loss.reshape(targets.shape), hit.reshape(targets.shape)


def _blocked_forward(h, head, targets, spec, keep):
    loss, hit, normalizer, g, kept = _blocked_pass(h, head, targets, spec, gradient=True, keep=keep)
    return (loss.reshape(targets.shape), hit.reshape(targets.shape)), (g, h, head, targets, normalizer, kept)


def _blocked_backward(spec, keep, saved, cotangents):
    """`h`'s gradient `g G`; the head's from the kept blocks, or with each block's logits computed again (either
    dropped by XLA when the head is frozen)."""
    to_h, h, head, targets, normalizer, kept = saved
    g = cotangents[0].reshape(-1)
    x = h.reshape(-1, h.shape[-1])
    rows = targets.reshape(-1)
    d_h = (g[:, None] * to_h).astype(h.dtype).reshape(h.shape)
    if kept is not None:
        d_head = _kept_head_gradient(spec, kept, head.shape, x, rows, g, normalizer)
        return d_h, d_head.astype(head.dtype), None
    weights = sliceable(head)

    def body(total, j):
        block = _block_logits(x, weights, j, spec, head.dtype)
        p = jnp.exp(block.logits - normalizer[:, None]) - (block.ids == rows[:, None])
        d = (p * _slope(block.product, spec.head) * g[:, None]).astype(h.dtype)
        d = jnp.where(block.fresh, d, 0)  # an id of an earlier block: counted there
        if spec.head.tied:  # [rows, E]
            part = lax.dot_general(d, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:  # [E, rows]
            part = lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        axis = 0 if spec.head.tied else 1
        rows_of = lax.dynamic_slice_in_dim(total, block.start, spec.rows, axis=axis) + part
        return lax.dynamic_update_slice_in_dim(total, rows_of, block.start, axis=axis), None

    d_head, _ = lax.scan(body, jnp.zeros(head.shape, jnp.float32), jnp.arange(spec.count))
    return d_h, d_head.astype(head.dtype), None


def _kept_head_gradient(spec: _Block, kept: _Kept, shape: tuple[int, ...], x: jax.Array, rows: jax.Array,
                        g: jax.Array, normalizer: jax.Array) -> jax.Array:  # fmt: skip
    """The head's gradient (float32, of the head's `shape`) from the blocks the forward pass kept: block `j`'s
    logits' gradient is `d_j exp(m_j - normalizer) - onehot(target) slope_target`, so each block adds `d_j^T`
    times the positions `x` scaled by `g exp(m_j - normalizer)` (a pass over `[N, E]`, not over `d_j`'s
    `[N, rows]`), and the targets' term is added once at the end, a row (or column) per position."""
    axis = 0 if spec.head.tied else 1
    wide = x.astype(jnp.float32)

    def body(total, xs):
        j, d, top = xs
        d = as_stored(d, x.dtype)
        start = _block_start(j, spec, shape[axis])
        scaled = (wide * (g * jnp.exp(top - normalizer))[:, None]).astype(x.dtype)
        if spec.head.tied:  # [rows, E]
            part = lax.dot_general(d, scaled, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:  # [E, rows]
            part = lax.dot_general(scaled, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        rows_of = lax.dynamic_slice_in_dim(total, start, spec.rows, axis=axis) + part
        return lax.dynamic_update_slice_in_dim(total, rows_of, start, axis=axis), None

    total, _ = lax.scan(body, jnp.zeros(shape, jnp.float32), (jnp.arange(spec.count), kept.d, kept.top))
    targets = -(kept.slope * g)[:, None] * wide  # `[N, E]`: each position's target row's share
    return total.at[rows].add(targets) if spec.head.tied else total.at[:, rows].add(targets.T)


_blocked.defvjp(_blocked_forward, _blocked_backward)
