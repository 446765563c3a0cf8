"""nnx.LoRA: its gradients, written out by hand as 2D matmuls, against plain autodiff of the same formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_support import DEPLOYED

import nnx


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def adapter(in_features, out_features, **options):
    """A LoRA whose `b` is random (it starts at zero), so that every gradient carries something; its pure parts."""
    lora = nnx.LoRA(in_features, out_features, rank=2, alpha=6, ctx=nnx.context(jax.random.key(0, impl="rbg")),
                    **options)  # fmt: skip
    lora.b = nnx.LoRAParam(random(lora.b.shape, 1))
    return lora.partition(nnx.LoRAParam, ...)


@pytest.mark.parametrize(
    "in_features, out_features, x_shape",
    [(6, 5, (3, 4, 6)), ((2, 3), 5, (4, 2, 3)), (6, (2, 3), (2, 2, 6))],
    ids=["dense", "heads-in", "heads-out"],
)
def test_lora_gradients_equal_autodiffs_of_its_formula(in_features, out_features, x_shape):
    (params, rest), moduledef = adapter(in_features, out_features)
    x = random(x_shape, 2)
    cotangent = random(moduledef.apply(params, rest)(x)[0].shape, 3)
    in_rank = params["a"].value.ndim - 1

    def ours(x, params):
        return jnp.sum(moduledef.apply(params, rest)(x)[0] * cotangent)

    def formula(x, params):  # x @ a @ b * (alpha / rank), contracting x's trailing axes
        low = jnp.tensordot(x, params["a"].value, axes=in_rank)
        return jnp.sum(jnp.tensordot(low, params["b"].value, axes=1) * 3.0 * cotangent)

    np.testing.assert_allclose(ours(x, params), formula(x, params), rtol=1e-5)
    got, want = jax.grad(ours, argnums=(0, 1))(x, params), jax.grad(formula, argnums=(0, 1))(x, params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_lora_in_bfloat16_keeps_float32_gradients_close_to_float32s():
    x = random((5, 16), 2)

    def grads(dtype):
        (params, rest), moduledef = adapter(16, 8, dtype=dtype)
        loss = lambda p: jnp.sum(moduledef.apply(p, rest)(x)[0].astype(jnp.float32) ** 2)  # noqa: E731
        return jax.tree.leaves(jax.grad(loss)(params))

    for low, high in zip(grads(jnp.bfloat16), grads(jnp.float32), strict=True):
        assert low.dtype == jnp.float32  # the parameters stay float32, so do their gradients
        np.testing.assert_allclose(low, high, rtol=0.05, atol=0.02 * float(jnp.max(jnp.abs(high))))


def _weight(kernel):
    """`LoRA.adapt`'s weight from its source: here the flat `[in, out]` kernel itself."""
    return kernel


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(
    "in_features, out_features, x_shape",
    [(6, 20, (3, 4, 6)), (20, 6, (3, 4, 20)), ((2, 3), 5, (4, 2, 3))],
    ids=["wider-out", "wider-in", "heads-in"],  # out_features an int: the kernel is the flat [in, out]
)
def test_adapt_is_the_base_product_plus_the_update_with_their_gradients(in_features, out_features, x_shape, dropout):
    """`LoRA.adapt` computes `x @ W + lora(x)` as one product (the update inside the base product where the
    output is the wider side): the same value, and the gradients autodiff gives that sum, dropout included (the
    same key masks both). The weight `W` gets its gradient only when said to train."""
    (params, rest), moduledef = adapter(in_features, out_features, dropout=dropout)
    x = random(x_shape, 2)
    fan_in, tokens = int(np.prod(in_features)), x_shape[: len(x_shape) - len(np.atleast_1d(in_features))]
    kernel = random((fan_in, out_features), 4)
    cotangent = random((*tokens, out_features), 3)
    deterministic = dropout == 0.0

    def ours(x, params, kernel, trainable):
        lora = moduledef.merge(params, rest)
        y = lora.adapt(x, _weight, kernel, trainable=trainable, deterministic=deterministic, ctx=nnx.context(dropout=7))
        return jnp.sum(y * cotangent)

    def apart(x, params, kernel):
        lora = moduledef.merge(params, rest)
        base = jnp.tensordot(x, kernel.reshape(*np.atleast_1d(in_features), -1), axes=lora.in_rank)
        return jnp.sum((base + lora(x, deterministic=deterministic, ctx=nnx.context(dropout=7))) * cotangent)

    np.testing.assert_allclose(ours(x, params, kernel, False), apart(x, params, kernel), rtol=1e-5)
    want = jax.grad(apart, argnums=(0, 1, 2))(x, params, kernel)
    for trainable in (True, False):
        got = jax.grad(ours, argnums=(0, 1, 2))(x, params, kernel, trainable)
        for g, w in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[2], want[2] if trainable else np.zeros_like(want[2]), rtol=1e-5, atol=1e-6)


def test_adapt_in_bfloat16_is_the_float32_sum_rounded_once():
    (params, rest), moduledef = adapter(32, 96, dtype=jnp.bfloat16)
    lora = moduledef.merge(params, rest)
    x, kernel = random((16, 32), 2).astype(jnp.bfloat16), random((32, 96), 4).astype(jnp.bfloat16)
    y = lora.adapt(x, _weight, kernel)
    assert y.dtype == jnp.bfloat16
    # the same sum in float32, from the same bfloat16 operands (the update's inner product rounded as it is)
    low = (x.astype(jnp.float32) @ lora.a.astype(jnp.bfloat16).astype(jnp.float32) * 3.0).astype(jnp.bfloat16)
    b = lora.b.astype(jnp.bfloat16).astype(jnp.float32)
    exact = x.astype(jnp.float32) @ kernel.astype(jnp.float32) + low.astype(jnp.float32) @ b
    ulp = 2.0 ** (np.floor(np.log2(np.abs(np.asarray(exact)))) - 7)
    assert np.all(np.abs(np.asarray(y, np.float32) - np.asarray(exact)) <= 0.5 * ulp + 1e-6)


@pytest.mark.usefixtures("on_the_cpu")
def test_adapt_on_a_cpu_keeps_no_float32_copy_of_a_wide_gradient():
    """XLA's CPU multiplied the update's 16-bit products apart from the base's by widening the `[tokens, out]`
    gradient to float32 (and wrote the update's `[tokens, out]` product in float32 besides); inside the base
    product, the step's temporaries stay under one such copy."""
    tokens, fan_in, fan_out = 512, 64, 2048
    (params, rest), moduledef = adapter(fan_in, fan_out, dtype=jnp.bfloat16)
    x, kernel = jnp.ones((tokens, fan_in), jnp.bfloat16), jnp.ones((fan_in, fan_out), jnp.bfloat16)
    g = jnp.ones((tokens, fan_out), jnp.bfloat16)

    def backward(x, params, g):
        _, vjp = jax.vjp(lambda x, p: moduledef.merge(p, rest).adapt(x, _weight, kernel), x, params)
        return vjp(g)

    temporaries = (
        jax.jit(backward).lower(x, params, g).compile(compiler_options=DEPLOYED).memory_analysis().temp_size_in_bytes
    )
    assert temporaries < tokens * fan_out * 4 / 2


def test_an_integer_input_is_promoted_to_float32_as_linear_promotes_it():
    """The update was computed in int32: a, b and the product truncated to integers."""
    lora = nnx.LoRA(4, 3, rank=2, ctx=nnx.context(0))
    lora.b = jnp.full_like(lora.b, 0.3)  # b starts at zero: a nonzero update
    x = jnp.arange(8).reshape(2, 4)
    y = lora(x)
    assert y.dtype == jnp.float32 and nnx.Linear(4, 3, ctx=nnx.context(0))(x).dtype == jnp.float32
    np.testing.assert_array_equal(y, lora(x.astype(jnp.float32)))


@pytest.mark.parametrize("method", ["call", "adapt"])
def test_an_input_of_the_wrong_width_says_which_shape_the_update_expects(method):
    lora = nnx.LoRA((2, 3), 4, rank=2, ctx=nnx.context(0))
    x = jnp.ones((5, 2, 4))
    with pytest.raises(ValueError, match=r"trailing axes have the shape in_features=\(2, 3\), got shape \(5, 2, 4\)"):
        lora(x) if method == "call" else lora.adapt(x, lambda w: w, jnp.ones((6, 4)))


def test_dropout_follows_the_contexts_deterministic_flag_and_is_off_when_nothing_says_training():
    """The argument defaulted to True, which hid the flag: a context saying training got no dropout."""
    lora = nnx.LoRA(4, 3, rank=2, dropout=0.9, ctx=nnx.context(0))
    lora.b = jnp.ones((2, 3))
    x = jnp.ones((64, 4))
    plain = x @ lora.a @ lora.b * lora.scale
    training = nnx.context(dropout=0, flags={"deterministic": False})
    assert not np.allclose(lora(x, ctx=training), plain)
    assert not np.allclose(lora.adapt(x, lambda w: w, jnp.zeros((4, 3)), ctx=training), plain)
    np.testing.assert_allclose(lora(x), plain, rtol=1e-6)
    np.testing.assert_allclose(lora(x, deterministic=True, ctx=training), plain, rtol=1e-6)
    evaluating = nnx.context(dropout=0, flags={"deterministic": True})
    np.testing.assert_allclose(lora(x, ctx=evaluating), plain, rtol=1e-6)
