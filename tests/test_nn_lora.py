"""nnx.LoRA: its gradients, written out by hand as 2D matmuls, against plain autodiff of the same formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
