"""Activations, initializers and dtype helpers."""

import re

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx
from nnx.nn import activations, dtypes, initializers

ACTIVATIONS = (
    "celu elu gelu glu hard_sigmoid hard_silu hard_swish hard_tanh leaky_relu "
    "log_sigmoid log_softmax logsumexp normalize one_hot relu relu6 selu sigmoid "
    "silu soft_sign softmax softplus standardize swish tanh"
).split()


# Activations


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_is_exported_from_module_and_package(name):
    assert callable(getattr(activations, name))
    assert getattr(nnx, name) is getattr(activations, name)


@pytest.mark.parametrize("name", sorted(set(ACTIVATIONS) - {"normalize", "tanh"}))
def test_activation_is_the_jax_nn_function(name):
    assert getattr(activations, name) is getattr(jax.nn, name)


def test_tanh_is_jax_numpy_tanh():
    assert activations.tanh is jnp.tanh


def test_normalize_is_the_old_name_of_standardize():
    x = jnp.array([[1.0, 2.0, 3.0, 6.0]])
    np.testing.assert_allclose(activations.normalize(x), jax.nn.standardize(x))


# Initializers


@pytest.mark.parametrize("factory", [initializers.zeros, initializers.ones])
def test_zeros_and_ones_are_factories(factory):
    init = factory()
    assert callable(init)
    value = init(jax.random.key(0), (2, 3))
    assert value.shape == (2, 3)
    assert value.dtype == jnp.float32


def test_zeros_initializer_fills_zeros_in_requested_dtype():
    value = initializers.zeros()(jax.random.key(0), (4,), jnp.bfloat16)
    assert value.dtype == jnp.bfloat16
    np.testing.assert_array_equal(value, np.zeros(4))


def test_ones_initializer_fills_ones():
    np.testing.assert_array_equal(initializers.ones()(jax.random.key(0), (3,)), np.ones(3))


def test_initializers_accept_raw_uint32_keys():
    assert initializers.zeros()(jax.random.PRNGKey(0), (2,)).shape == (2,)


@pytest.mark.parametrize(
    "name",
    "constant delta_orthogonal glorot_normal glorot_uniform he_normal he_uniform "
    "kaiming_normal kaiming_uniform lecun_normal lecun_uniform normal orthogonal "
    "truncated_normal uniform variance_scaling xavier_normal xavier_uniform".split(),
)
def test_jax_initializers_are_reexported(name):
    assert getattr(initializers, name) is getattr(jax.nn.initializers, name)


@pytest.mark.parametrize(
    "make, said",
    [
        (
            lambda: nnx.Linear(2, 3, bias_init=initializers.zeros, ctx=nnx.context(0)),
            "bias_init=nnx.initializers.zeros()",
        ),
        (lambda: nnx.Conv(2, 3, 3, kernel_init=initializers.lecun_normal, ctx=nnx.context(0)), "lecun_normal()"),
        (lambda: nnx.Embed(4, 3, embedding_init=initializers.normal, ctx=nnx.context(0)), "normal()"),
        (
            lambda: nnx.LayerNorm(3, scale_init=initializers.ones_init, ctx=nnx.context(0)),
            "scale_init=nnx.initializers.ones()",
        ),
    ],
)
def test_a_layer_given_an_uncalled_initializer_factory_says_to_call_it(make, said):
    """zeros failed with 'takes 0 positional arguments'; lecun_normal made a Param holding a function."""
    with pytest.raises(TypeError, match=rf"is the function that makes an initializer: pass .*{re.escape(said)}"):
        make()


def test_a_layer_without_a_context_says_ctx_must_be_one():
    with pytest.raises(TypeError, match=r"draws its kernel from ctx=, which must be an nnx.Context .* got NoneType"):
        nnx.Linear(2, 3, ctx=None)


def test_initializer_type_alias_is_exported():
    assert initializers.Initializer is jax.nn.initializers.Initializer


def test_package_exposes_initializers_module():
    assert nnx.initializers is initializers


# dtypes


def test_canonicalize_dtype_infers_from_arguments():
    assert dtypes.canonicalize_dtype(jnp.ones(2, jnp.bfloat16)) == jnp.bfloat16
    assert dtypes.canonicalize_dtype(jnp.ones(2, jnp.bfloat16), jnp.ones(2)) == jnp.float32


def test_canonicalize_dtype_ignores_none_arguments():
    assert dtypes.canonicalize_dtype(None, jnp.ones(2, jnp.bfloat16), None) == jnp.bfloat16


def test_canonicalize_dtype_promotes_integers_to_float_when_inexact():
    assert dtypes.canonicalize_dtype(jnp.ones(2, jnp.int32)) == jnp.float32
    assert dtypes.canonicalize_dtype(jnp.ones(2, jnp.int32), inexact=False) == jnp.int32


def test_canonicalize_dtype_returns_explicit_dtype():
    assert dtypes.canonicalize_dtype(jnp.ones(2), dtype=jnp.bfloat16) == jnp.bfloat16


def test_canonicalize_dtype_rejects_explicit_integer_dtype_when_inexact():
    with pytest.raises(ValueError, match="inexact"):
        dtypes.canonicalize_dtype(jnp.ones(2), dtype=jnp.int32)
    assert dtypes.canonicalize_dtype(jnp.ones(2), dtype=jnp.int32, inexact=False) == jnp.int32


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((np.ones(2, np.int8), np.ones(2, np.float16)), {}),
        ((np.ones(2, np.int32),), {}),
        ((np.ones(2, np.int32),), {"inexact": False}),
        ((np.ones(2, np.float32), None), {"dtype": jnp.bfloat16}),
        ((np.ones(2, np.complex64), np.ones(2, np.float32)), {}),
    ],
)
def test_dtypes_match_flax(args, kwargs):
    assert dtypes.canonicalize_dtype(*args, **kwargs) == linen.dtypes.canonicalize_dtype(*args, **kwargs)
    ours = dtypes.promote_dtype(*args, **kwargs)
    theirs = linen.dtypes.promote_dtype(*args, **kwargs)
    assert [None if x is None else x.dtype for x in ours] == [None if x is None else x.dtype for x in theirs]


def test_promote_dtype_casts_all_arguments_and_keeps_none():
    x, none, w = dtypes.promote_dtype(jnp.ones(2, jnp.bfloat16), None, jnp.ones(2))
    assert none is None
    assert x.dtype == w.dtype == jnp.float32


def test_promote_dtype_uses_explicit_dtype():
    x, w = dtypes.promote_dtype(jnp.ones(2), jnp.ones(3), dtype=jnp.bfloat16)
    assert x.dtype == w.dtype == jnp.bfloat16
