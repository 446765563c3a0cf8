"""The attention core of transformer_lm: its output and hand-written gradients against plain softmax attention."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_cli.models.transformer.attention_core import attention_core


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def plain(q, k, v, *, segments=None, window=None, softcap=None):
    """Attention as the formula says it, each query head with its key-value head repeated, left to autodiff."""
    groups, length = q.shape[2] // k.shape[2], q.shape[1]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    query, key = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (key <= query) & (query - key < (window or length))
    if segments is not None:
        visible = visible & (segments[:, None, :, None] == segments[:, None, None, :])
    weights = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


PACKED = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])  # two examples then padding; one


ALL = {"segments": PACKED, "window": 4, "softcap": 1.5}


@pytest.mark.parametrize(
    "options, heads, kv_heads, block",
    [
        ({}, 6, 2, 512),
        ({"segments": PACKED}, 6, 2, 4),  # blocks of 4 queries: 4, 4, 1
        ({"window": 3}, 4, 4, 4),  # the later blocks skip the keys left of the window
        ({"softcap": 2.0}, 6, 2, 512),
        (ALL, 6, 2, 4),
        (ALL, 4, 4, 512),
        ({"window": jnp.asarray(3), "segments": PACKED}, 6, 2, 4),  # an array: masks, skips no key
    ],
    ids=[
        "causal",
        "segments-blocks",
        "window-blocks",
        "softcap",
        "all-blocks",
        "all-multi-head",
        "traced-window",
    ],
)
def test_attention_core_and_its_gradients_equal_plain_attention(options, heads, kv_heads, block):
    q, k, v = random((2, 9, heads, 8), 0), random((2, 9, kv_heads, 8), 1), random((2, 9, kv_heads, 8), 2)
    cotangent = random(q.shape, 3)
    ours = lambda q, k, v: jnp.sum(attention_core(q, k, v, block=block, **options) * cotangent)  # noqa: E731
    theirs = lambda q, k, v: jnp.sum(plain(q, k, v, **options) * cotangent)  # noqa: E731
    outputs = jax.jit(lambda q, k, v: (attention_core(q, k, v, block=block, **options), plain(q, k, v, **options)))
    np.testing.assert_allclose(*outputs(q, k, v), rtol=1e-5, atol=1e-6)
    gradients = jax.jit(lambda q, k, v: (jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(theirs, (0, 1, 2))(q, k, v)))
    for got, want in zip(*gradients(q, k, v), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_core_in_bfloat16_keeps_its_dtype_and_agrees_with_float32():
    q, k, v = random((2, 16, 4, 16), 0), random((2, 16, 2, 16), 1), random((2, 16, 2, 16), 2)
    low = jax.jit(attention_core)(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), jax.jit(attention_core)(q, k, v), atol=0.05)
    grads = jax.jit(jax.grad(lambda q: jnp.sum(attention_core(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)))))
    assert grads(q.astype(jnp.bfloat16)).dtype == jnp.bfloat16
