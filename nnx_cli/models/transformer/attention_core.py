"""The attention core, `softmax(q k^T * scale + mask) v`, with a hand-written backward pass that saves no weights.

:func:`attention_core` takes queries `[batch, length, heads, head_dim]` and keys
and values `[batch, length, kv_heads, head_dim]` (grouped-query attention when
`kv_heads < heads`) and attends causally; the masks and variants are its
arguments, so that a new one drops in here:

    o = attention_core(q, k, v)                                  # causal
    o = attention_core(q, k, v, segments=segments)               # and within each packed example
    o = attention_core(q, k, v, window=4096, softcap=50.0)       # a sliding window, soft-capped scores
    o = attention_core(q, k, v, window=jnp.where(sliding, 4096, 1 << 30))   # a window known at run time

Left to autodiff, attention saves its weights `[batch, heads, length, length]`
for the backward pass, and under the layer scan every layer's copy is
stacked into one zero-filled `[layers, ...]` buffer: the largest residual of
a training step. Here the forward pass keeps only its output and the
log-sum-exp of each query's scores; the backward pass recomputes the weights
from them (one more `q k^T`, as flash attention does) and writes each
gradient in the layout its matmul reads.

Queries are taken in blocks of `block` positions (a static loop): a block
attends only to the keys its causal (and sliding-window) mask can reach,
which skips most of the masked half of the work on long sequences and bounds
the scores held at once to `[batch, heads, block, length]`. By default a
sequence of up to 128 positions is one block, and a longer one is cut into
blocks of an eighth of it, at least 128 queries: eight blocks skip 44% of a
causal product, and eight loop iterations keep the program small. At
SmolLM2-135M's length 256, two blocks of 128 took a LoRA step 0.93-0.96x and
a full fine-tuning step 0.97x the time of one block of 256 (2 CPU cores, A B
B A in one process), for 0.45 s more compiling (3.15 against 2.7 s). On 2 CPU
cores, a LoRA step of a Qwen2-shaped model at length 1,024 ran 8% faster
with blocks of 256 than of 512, and LoRA and full fine-tuning steps about 3%
faster again with 128 and the query gradient below. A traced window (a scan
over layers that slide and layers that do not) masks the same keys but skips
none: which keys are out of reach is then unknown at trace time. Scores and
softmax are float32; the forward weighted sum multiplies the values by the
unnormalised weights in the inputs' dtype and divides after, as cuDNN's
flash attention does (:func:`unnormalized_softmax`); the backward pass runs
in float32.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

MASKED = -1e30
"""The score of a key a query may not see (finite: a masked score minus the maximum stays finite)."""


class _Static(typing.NamedTuple):
    """What shapes the computation, beside the arrays: hashable, so that it can be a static argument."""

    groups: int  # query heads per key-value head
    scale: float
    window: int | None
    softcap: float | None
    block: int
    out: Callable[[jax.Array], jax.Array] | None  # applied to the `[B, T, H, D]` output (attention_core's `out`)


def attention_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segments: jax.Array | None = None,
    window: int | jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    block: int | None = None,
    out: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """Causal softmax attention of `q` `[B, T, H, D]` over `k`, `v` `[B, T, K, D]` (`H` a multiple of `K`).

    Args:
      segments: `[B, T]` example ids of packed rows: a query sees only keys of its own id.
      window: a query at position `i` sees keys `i - window + 1 .. i` only (a sliding window); a Python int, or
        an integer array (traced: the mask only, no key skipped).
      softcap: scores pass through `softcap * tanh(score / softcap)` before the mask (Gemma 2).
      scale: multiplies `q k^T` (default `1 / sqrt(D)`).
      block: queries per block (see the module docstring; default: the whole length up to 128, else an eighth
        of it, at least 128); any positive size gives the same result.
      out: applied to the output inside the backward rule's scope (a sharding constraint), so that the array
        returned is the one kept for the backward pass: the output projection keeps its input too, and under
        the layer scan two arrays of the same values were two stacked residuals.

    Returns `[B, T, H, D]` in `v`'s dtype.
    """
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    limit = None if window is None or isinstance(window, int) else jnp.asarray(window, jnp.int32)
    block = max(1, min(block or (t if t <= 128 else max(128, t // 8)), t))
    static = _Static(heads // kv_heads, 1.0 / math.sqrt(d) if scale is None else float(scale),
                     None if limit is not None else window, softcap, block, out)  # fmt: skip
    # [B, K, G, T, D]: the query heads that share a key-value head sit together, positions along rows
    grouped = q.reshape(b, t, kv_heads, static.groups, d).transpose(0, 2, 3, 1, 4)
    if segments is not None:
        segments = jnp.asarray(segments, jnp.int32)
    return _core(grouped, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segments, limit, static)


def _blocks(length: int, static: _Static) -> list[tuple[int, int, int]]:
    """`(first query, end of queries, first key)` of each block: keys run from the first one a query of the
    block may see (0, or the window's start) to the block's last query."""
    out = []
    for start in range(0, length, static.block):
        end = min(start + static.block, length)
        first_key = 0 if static.window is None else max(0, start - static.window + 1)
        out.append((start, end, first_key))
    return out


def _visible(start: int, end: int, first_key: int, segments, limit, static: _Static, transposed: bool):
    """Which keys `first_key .. end - 1` the queries `start .. end - 1` see: `[B|1, 1, G * rows, keys]`, rows
    ordered (group, query); `transposed`: `[B|1, 1, keys, G * rows]`. `limit`: a traced window, or None."""
    queries = jnp.tile(jnp.arange(start, end), static.groups)
    keys = jnp.arange(first_key, end)
    queries, keys = (queries[None, :], keys[:, None]) if transposed else (queries[:, None], keys[None, :])
    mask = keys <= queries
    if static.window is not None:
        mask = mask & (queries - keys < static.window)
    if limit is not None:
        mask = mask & (queries - keys < limit)
    mask = mask[None, None]
    if segments is None:
        return mask
    query_ids = jnp.tile(segments[:, start:end], (1, static.groups))[:, None]
    key_ids = segments[:, first_key:end][:, None]
    same = (
        key_ids[..., :, None] == query_ids[..., None, :]
        if transposed
        else query_ids[..., :, None] == key_ids[..., None, :]
    )
    return mask & same


def unnormalized_softmax(scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`exp(scores - max)` over the last axis and its sum, in float32: the softmax is their quotient.

    Attention everywhere here (the core, the weights written out, decoding) multiplies the values by these
    weights rounded to the values' dtype (the largest is exactly 1) and divides the float32 product by the
    sum, as flash-attention kernels (cuDNN's) do: every way through a model then rounds alike, and bfloat16
    logits decoded from a cache agree with a full pass that took cuDNN's kernel. (Normalising before the
    rounding instead put the two 0.65 apart on a bfloat16 test model whose logits spread 11.4, six times
    what two ways through the same kernel differ by.)

        weights, total = unnormalized_softmax(scores)
        o = jnp.einsum("qk,kd->qd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32) / total
    """
    peak = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    weights = jnp.exp(scores - peak)
    return weights, jnp.sum(weights, axis=-1, keepdims=True)


def _dot(a: jax.Array, b: jax.Array, contract_a: int, contract_b: int, dtype=jnp.float32) -> jax.Array:
    """A matmul batched over the two leading axes (batch, key-value head)."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((0, 1), (0, 1))), preferred_element_type=dtype)


def _scores(a: jax.Array, b: jax.Array, static: _Static) -> tuple[jax.Array, jax.Array | None]:
    """Float32 `a b^T * scale`, soft-capped; and the tanh the cap's derivative needs (None without a cap)."""
    s = _dot(a, b, 3, 3) * static.scale
    if static.softcap is None:
        return s, None
    tanh = jnp.tanh(s / static.softcap)
    return static.softcap * tanh, tanh


def _rows(q: jax.Array, start: int, end: int) -> jax.Array:
    """The queries `start .. end - 1` of `q` `[B, K, G, T, D]` as rows `[B, K, G * (end - start), D]`."""
    b, kv, g, _, d = q.shape
    return q[:, :, :, start:end].reshape(b, kv, g * (end - start), d)


def _forward(q, k, v, segments, limit, static: _Static) -> tuple[jax.Array, jax.Array]:
    """The output `[B, T, H, D]` and the log-sum-exp of each query's scores `[B, K, G, T]`."""
    b, kv, g, t, d = q.shape
    outputs, lses = [], []
    for start, end, first_key in _blocks(t, static):
        s, _ = _scores(_rows(q, start, end), k[:, :, first_key:end], static)
        s = jnp.where(_visible(start, end, first_key, segments, limit, static, transposed=False), s, MASKED)
        peak = jnp.max(s, axis=-1, keepdims=True)
        p, total = unnormalized_softmax(s)  # exp(s - peak) and its sum
        o = _dot(p.astype(v.dtype), v[:, :, first_key:end], 3, 2) / total
        outputs.append(o.astype(v.dtype).reshape(b, kv, g, end - start, d))
        lses.append((peak + jnp.log(total)).reshape(b, kv, g, end - start))
    o, lse = (outputs[0], lses[0]) if len(outputs) == 1 else (jnp.concatenate(outputs, 3), jnp.concatenate(lses, 3))
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)
    return (o if static.out is None else static.out(o)), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _core(q: jax.Array, k: jax.Array, v: jax.Array, segments, limit, static: _Static) -> jax.Array:
    return _forward(q, k, v, segments, limit, static)[0]


def _core_forward(q, k, v, segments, limit, static: _Static):
    o, lse = _forward(q, k, v, segments, limit, static)
    return o, (q, k, v, segments, limit, o, lse)


def _core_backward(static: _Static, saved: tuple, do: jax.Array):
    """Each block's weights recomputed from the saved log-sum-exp, transposed (`[keys, rows]`): the value and
    key gradients then read them as laid out. The query gradient contracts them over keys, their leading axis:
    it is computed transposed, `k^T ds` `[D, rows]` from keys laid out `[D, keys]`, because the product that
    reads the weights across their rows instead ran 3x slower on CPU (60 against 190 GFLOP/s). All in float32
    (16-bit inputs are widened: the weights and their gradients never round to 16 bits)."""
    q_in, k_in, v_in, segments, limit, o, lse = saved
    q, k, v = (x.astype(jnp.float32) for x in (q_in, k_in, v_in))
    b, kv, g, t, d = q.shape
    # delta_i = sum_j P_ij dP_ij = do_i . o_i: the softmax's backward, per query (o and do `[B, T, H, D]`)
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * o.astype(jnp.float32), axis=-1).reshape(b, t, kv, g).transpose(0, 2, 3, 1)
    do = do.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D], as the queries
    dq_blocks = []
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    keys_t = jnp.swapaxes(k, 2, 3)  # [B, K, D, T]
    for start, end, first_key in _blocks(t, static):
        rows, do_rows = _rows(q, start, end), _rows(do, start, end)
        keys, values = k[:, :, first_key:end], v[:, :, first_key:end]
        st, tanh = _scores(keys, rows, static)  # [B, K, keys, G * rows]
        visible = _visible(start, end, first_key, segments, limit, static, transposed=True)
        lse_rows = lse[:, :, :, start:end].reshape(b, kv, 1, -1)
        pt = jnp.where(visible, jnp.exp(st - lse_rows), 0.0)
        dv_block = _dot(pt, do_rows, 3, 2)  # [B, K, keys, D]
        dpt = _dot(values, do_rows, 3, 3)  # [B, K, keys, G * rows]
        dst = pt * (dpt - delta[:, :, :, start:end].reshape(b, kv, 1, -1))
        if tanh is not None:
            dst = dst * (1.0 - tanh * tanh)
        dst = dst * static.scale
        dk_block = _dot(dst, rows, 3, 2)  # [B, K, keys, D]
        dq_blocks.append(_dot(keys_t[:, :, :, first_key:end], dst, 3, 2).reshape(b, kv, d, g, end - start))
        if first_key == 0 and end == t:
            dk, dv = dk + dk_block, dv + dv_block
        else:
            dk = dk.at[:, :, first_key:end].add(dk_block)
            dv = dv.at[:, :, first_key:end].add(dv_block)
    dq = (dq_blocks[0] if len(dq_blocks) == 1 else jnp.concatenate(dq_blocks, axis=4)).transpose(0, 1, 3, 4, 2)
    no_segments = None if segments is None else jnp.zeros(segments.shape, jax.dtypes.float0)
    no_limit = None if limit is None else jnp.zeros(limit.shape, jax.dtypes.float0)
    return dq.astype(q_in.dtype), dk.astype(k_in.dtype), dv.astype(v_in.dtype), no_segments, no_limit


_core.defvjp(_core_forward, _core_backward)
