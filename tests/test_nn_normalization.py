"""BatchNorm and LayerNorm: parameters, running statistics, modes, and
agreement with flax.linen."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx
from nnx.nn import initializers
from nnx.nn.normalization import BatchNorm, LayerNorm


def ctx(seed=0, **flags):
    # rbg keys compile much faster than threefry keys on CPU.
    return nnx.context(jax.random.key(seed, impl="rbg"), flags=flags)


def random(shape, seed=0, loc=0.0, scale=1.0):
    x = np.random.default_rng(seed).normal(loc, scale, shape)
    return jnp.asarray(x, jnp.float32)


def random_scale_and_bias(module, features, seed=1):
    """Gives the module non-trivial scale and bias so comparisons mean something."""
    module.scale = random((features,), seed, loc=1.0)
    module.bias = random((features,), seed + 1)


# BatchNorm


def test_batchnorm_initial_params_and_stats():
    bn = BatchNorm(3, ctx=ctx())
    np.testing.assert_array_equal(bn.scale, np.ones(3))
    np.testing.assert_array_equal(bn.bias, np.zeros(3))
    np.testing.assert_array_equal(bn.mean, np.zeros(3))
    np.testing.assert_array_equal(bn.var, np.ones(3))


def test_batchnorm_stats_are_batchstat_and_params_are_param():
    bn = BatchNorm(3, ctx=ctx())
    params, stats = bn.filter(nnx.Param, nnx.BatchStat)
    assert set(params) == {"scale", "bias"}
    assert set(stats) == {"mean", "var"}
    assert all(isinstance(s, nnx.BatchStat) for s in stats.values())


def test_batchnorm_param_shapes_match_flax():
    x = random((4, 3))
    variables = jax.eval_shape(linen.BatchNorm(use_running_average=False).init, jax.random.key(0), x)
    bn = BatchNorm(3, ctx=ctx())
    assert jax.tree.map(lambda a: a.shape, variables["params"]) == {
        "scale": bn.scale.shape,
        "bias": bn.bias.shape,
    }
    assert jax.tree.map(lambda a: a.shape, variables["batch_stats"]) == {
        "mean": bn.mean.shape,
        "var": bn.var.shape,
    }


@pytest.mark.parametrize("axis", [-1, 1])
def test_batchnorm_training_matches_flax_output_and_running_stats(axis):
    x = random((4, 3, 5), loc=2.0, scale=3.0)
    features = x.shape[axis]
    bn = BatchNorm(features, axis=axis, momentum=0.9, ctx=ctx())
    random_scale_and_bias(bn, features)
    bn.mean = random((features,), 3)
    bn.var = random((features,), 4) ** 2
    variables = {
        "params": {"scale": bn.scale, "bias": bn.bias},
        "batch_stats": {"mean": bn.mean, "var": bn.var},
    }
    expected, updates = linen.BatchNorm(axis=axis, momentum=0.9).apply(
        variables, x, use_running_average=False, mutable=["batch_stats"]
    )
    y = bn(x, use_running_average=False)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bn.mean, updates["batch_stats"]["mean"], rtol=1e-6)
    np.testing.assert_allclose(bn.var, updates["batch_stats"]["var"], rtol=1e-6)


def test_batchnorm_evaluation_matches_flax_and_keeps_stats():
    x = random((8, 3))
    bn = BatchNorm(3, ctx=ctx())
    random_scale_and_bias(bn, 3)
    bn.mean = random((3,), 3)
    bn.var = random((3,), 4) ** 2
    mean, var = bn.mean, bn.var
    variables = {
        "params": {"scale": bn.scale, "bias": bn.bias},
        "batch_stats": {"mean": mean, "var": var},
    }
    expected = linen.BatchNorm(use_running_average=True).apply(variables, x)
    np.testing.assert_allclose(bn(x, use_running_average=True), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(bn.mean, mean)
    np.testing.assert_array_equal(bn.var, var)


def test_batchnorm_over_several_feature_axes_matches_flax_in_training():
    # flax lays parameters and statistics out in the features' shape; nnx flattens them.
    x = random((4, 3, 5, 2), loc=2.0, scale=3.0)
    bn = BatchNorm(15, axis=(1, 2), momentum=0.9, ctx=ctx())
    random_scale_and_bias(bn, 15)
    variables = {
        "params": {"scale": bn.scale.reshape(3, 5), "bias": bn.bias.reshape(3, 5)},
        "batch_stats": {"mean": bn.mean.reshape(3, 5), "var": bn.var.reshape(3, 5)},
    }
    expected, updates = linen.BatchNorm(axis=(1, 2), momentum=0.9).apply(
        variables, x, use_running_average=False, mutable=["batch_stats"]
    )
    np.testing.assert_allclose(bn(x, use_running_average=False), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bn.mean.reshape(3, 5), updates["batch_stats"]["mean"], rtol=1e-6)
    np.testing.assert_allclose(bn.var.reshape(3, 5), updates["batch_stats"]["var"], rtol=1e-6)


def test_batchnorm_over_several_feature_axes_matches_flax_in_evaluation():
    x = random((4, 3, 5, 2))
    bn = BatchNorm(15, axis=(1, 2), ctx=ctx())
    random_scale_and_bias(bn, 15)
    bn.mean = random((15,), 3)
    bn.var = random((15,), 4) ** 2
    variables = {
        "params": {"scale": bn.scale.reshape(3, 5), "bias": bn.bias.reshape(3, 5)},
        "batch_stats": {"mean": bn.mean.reshape(3, 5), "var": bn.var.reshape(3, 5)},
    }
    expected = linen.BatchNorm(axis=(1, 2), use_running_average=True).apply(variables, x)
    np.testing.assert_allclose(bn(x, use_running_average=True), expected, rtol=1e-5, atol=1e-5)


def test_batchnorm_with_the_wrong_number_of_features_says_which():
    bn = BatchNorm(15, axis=(1, 2), ctx=ctx())
    with pytest.raises(
        ValueError, match=r"feature axes \(1, 2\) hold 12 elements: build the layer with num_features=12"
    ):
        bn(jnp.ones((4, 3, 4, 2)), use_running_average=True)


def test_batchnorm_training_normalizes_the_batch():
    x = random((8, 3), loc=5.0, scale=2.0)
    y = BatchNorm(3, ctx=ctx())(x, use_running_average=False)
    np.testing.assert_allclose(jnp.mean(y, 0), np.zeros(3), atol=1e-4)
    np.testing.assert_allclose(jnp.std(y, 0), np.ones(3), atol=1e-3)


def test_batchnorm_call_argument_beats_attribute():
    bn = BatchNorm(3, use_running_average=True, ctx=ctx())
    bn(random((8, 3), loc=3.0), use_running_average=False)
    assert not np.allclose(bn.mean, 0.0)


def test_batchnorm_attribute_beats_context_flag():
    bn = BatchNorm(3, use_running_average=True, ctx=ctx())
    bn(random((8, 3), loc=3.0), ctx=ctx(use_running_average=False))
    np.testing.assert_array_equal(bn.mean, np.zeros(3))


def test_batchnorm_uses_context_flag_when_nothing_else_is_set():
    bn = BatchNorm(3, ctx=ctx())
    bn(random((8, 3), loc=3.0), ctx=ctx(use_running_average=False))
    assert not np.allclose(bn.mean, 0.0)
    mean = bn.mean
    bn(random((8, 3), loc=9.0), ctx=ctx(use_running_average=True))
    np.testing.assert_array_equal(bn.mean, mean)


def test_batchnorm_without_mode_raises_with_hint():
    bn = BatchNorm(3, ctx=ctx())
    with pytest.raises(ValueError, match="use_running_average"):
        bn(jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="use_running_average"):
        bn(jnp.ones((8, 3)), ctx=ctx())


def test_batchnorm_without_scale_and_bias():
    bn = BatchNorm(3, use_scale=False, use_bias=False, ctx=ctx())
    assert bn.scale is None and bn.bias is None
    x = random((8, 3))
    expected = linen.BatchNorm(use_scale=False, use_bias=False).apply(
        {"batch_stats": {"mean": bn.mean, "var": bn.var}}, x, use_running_average=True
    )
    np.testing.assert_allclose(bn(x, use_running_average=True), expected, rtol=1e-6)


def test_batchnorm_dtype_sets_output_dtype_but_stats_stay_float32():
    bn = BatchNorm(3, dtype=jnp.bfloat16, ctx=ctx())
    y = bn(random((8, 3)), use_running_average=False)
    assert y.dtype == jnp.bfloat16
    assert bn.mean.dtype == jnp.float32


# Computation dtype, parameter dtype, and inputs of a lower precision than both.
DTYPE_CASES = [
    (dict(dtype=jnp.bfloat16), jnp.float32),
    (dict(param_dtype=jnp.bfloat16), jnp.float32),
    (dict(), jnp.bfloat16),
]


@pytest.mark.parametrize("kwargs, input_dtype", DTYPE_CASES, ids=str)
def test_batchnorm_dtype_promotion_matches_flax(kwargs, input_dtype):
    x = random((8, 3), loc=2.0).astype(input_dtype)
    bn = BatchNorm(3, **kwargs, ctx=ctx())
    random_scale_and_bias(bn, 3)
    variables = {
        "params": {"scale": bn.scale, "bias": bn.bias},
        "batch_stats": {"mean": bn.mean, "var": bn.var},
    }
    expected, updates = linen.BatchNorm(**kwargs).apply(
        variables, x, use_running_average=False, mutable=["batch_stats"]
    )
    y = bn(x, use_running_average=False)
    assert y.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)
    assert bn.mean.dtype == updates["batch_stats"]["mean"].dtype
    np.testing.assert_allclose(bn.mean, updates["batch_stats"]["mean"], rtol=1e-5)
    np.testing.assert_allclose(bn.var, updates["batch_stats"]["var"], rtol=1e-5)


def test_batchnorm_custom_initializers():
    bn = BatchNorm(
        3,
        scale_init=initializers.constant(2.0),
        bias_init=initializers.constant(1.0),
        ctx=ctx(),
    )
    np.testing.assert_array_equal(bn.scale, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(bn.bias, [1.0, 1.0, 1.0])


def test_batchnorm_running_stats_stay_float32_with_low_precision_params():
    bn = BatchNorm(3, param_dtype=jnp.bfloat16, ctx=ctx())
    assert bn.scale.dtype == jnp.bfloat16
    bn(random((8, 3)), use_running_average=False)
    assert bn.mean.dtype == bn.var.dtype == jnp.float32


def test_batchnorm_updates_stats_inside_nnx_jit():
    x = random((8, 3), loc=2.0)
    eager = BatchNorm(3, ctx=ctx())
    jitted = BatchNorm(3, ctx=ctx())
    y = nnx.jit(lambda m, x: m(x, use_running_average=False))(jitted, x)
    np.testing.assert_allclose(y, eager(x, use_running_average=False), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted.mean, eager.mean, rtol=1e-6)
    np.testing.assert_allclose(jitted.var, eager.var, rtol=1e-6)


def test_batchnorm_axis_name_averages_stats_over_mapped_axis():
    x = random((2, 4, 3), loc=1.0, scale=2.0)  # 2 shards of a batch of 8
    bn = BatchNorm(3, axis_name="shards", momentum=0.0, ctx=ctx())
    (params, stats), moduledef = bn.partition(nnx.Param, nnx.BatchStat)

    def shard_step(x):
        y, (state, _) = moduledef.apply(params, stats)(x, use_running_average=False)
        return y, state

    y, state = jax.vmap(shard_step, axis_name="shards")(x)
    full = BatchNorm(3, momentum=0.0, ctx=ctx())
    expected = full(x.reshape(8, 3), use_running_average=False)
    np.testing.assert_allclose(y.reshape(8, 3), expected, rtol=1e-5, atol=1e-5)
    # Both shards end up with the statistics of the whole batch.
    np.testing.assert_allclose(state["mean"].value[0], full.mean, rtol=1e-5)
    np.testing.assert_allclose(state["mean"].value[1], full.mean, rtol=1e-5)


# LayerNorm


def test_layernorm_initial_params():
    ln = LayerNorm(5, ctx=ctx())
    params = ln.filter(nnx.Param)
    assert set(params) == {"scale", "bias"}
    np.testing.assert_array_equal(ln.scale, np.ones(5))
    np.testing.assert_array_equal(ln.bias, np.zeros(5))


def test_layernorm_matches_flax():
    x = random((2, 3, 5), loc=1.0, scale=4.0)
    ln = LayerNorm(5, ctx=ctx())
    random_scale_and_bias(ln, 5)
    expected = linen.LayerNorm().apply({"params": {"scale": ln.scale, "bias": ln.bias}}, x)
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-5)


def test_layernorm_reduction_and_feature_axes_match_flax():
    x = random((2, 3, 4, 5))
    ln = LayerNorm(5, reduction_axes=(1, 2), feature_axes=-1, epsilon=1e-3, ctx=ctx())
    random_scale_and_bias(ln, 5)
    expected = linen.LayerNorm(reduction_axes=(1, 2), feature_axes=-1, epsilon=1e-3).apply(
        {"params": {"scale": ln.scale, "bias": ln.bias}}, x
    )
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-5)


def test_layernorm_features_along_a_middle_axis_match_flax():
    x = random((2, 3, 5), loc=1.0)
    ln = LayerNorm(3, reduction_axes=-1, feature_axes=1, ctx=ctx())
    random_scale_and_bias(ln, 3)
    expected = linen.LayerNorm(reduction_axes=-1, feature_axes=1).apply(
        {"params": {"scale": ln.scale, "bias": ln.bias}}, x
    )
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-5)


def test_layernorm_over_several_feature_axes_matches_flax():
    # flax lays scale and bias out in the features' shape; nnx flattens them.
    x = random((2, 3, 5), loc=1.0)
    ln = LayerNorm(15, reduction_axes=(-2, -1), feature_axes=(-2, -1), ctx=ctx())
    random_scale_and_bias(ln, 15)
    params = {"scale": ln.scale.reshape(3, 5), "bias": ln.bias.reshape(3, 5)}
    expected = linen.LayerNorm(reduction_axes=(-2, -1), feature_axes=(-2, -1)).apply({"params": params}, x)
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, input_dtype", DTYPE_CASES, ids=str)
def test_layernorm_dtype_promotion_matches_flax(kwargs, input_dtype):
    x = random((2, 3, 5), loc=1.0).astype(input_dtype)
    ln = LayerNorm(5, **kwargs, ctx=ctx())
    random_scale_and_bias(ln, 5)
    expected = linen.LayerNorm(**kwargs).apply({"params": {"scale": ln.scale, "bias": ln.bias}}, x)
    y = ln(x)
    assert y.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)


def test_layernorm_normalizes_each_example():
    x = random((2, 3, 5), loc=3.0, scale=5.0)
    y = LayerNorm(5, ctx=ctx())(x)
    np.testing.assert_allclose(jnp.mean(y, -1), np.zeros((2, 3)), atol=1e-5)
    np.testing.assert_allclose(jnp.std(y, -1), np.ones((2, 3)), atol=1e-3)


def test_layernorm_with_the_wrong_number_of_features_says_which():
    ln = LayerNorm(6, ctx=ctx())
    with pytest.raises(ValueError, match=r"feature axes \(1,\) hold 5 elements: build the layer with num_features=5"):
        ln(jnp.ones((2, 5)))


def test_layernorm_without_scale_and_bias():
    ln = LayerNorm(5, use_scale=False, use_bias=False, ctx=ctx())
    assert ln.scale is None and ln.bias is None
    x = random((2, 3, 5))
    expected = linen.LayerNorm(use_scale=False, use_bias=False).apply({}, x)
    np.testing.assert_allclose(ln(x), expected, rtol=1e-5, atol=1e-6)


def test_layernorm_dtype_sets_output_dtype():
    ln = LayerNorm(5, dtype=jnp.bfloat16, ctx=ctx())
    assert ln(random((2, 3, 5))).dtype == jnp.bfloat16
    assert ln.scale.dtype == jnp.float32


def test_layernorm_param_dtype_sets_parameter_dtype():
    ln = LayerNorm(5, param_dtype=jnp.bfloat16, ctx=ctx())
    assert ln.scale.dtype == jnp.bfloat16


def test_layernorm_axis_name_normalizes_over_mapped_axis():
    # Features split in two shards along a mapped axis.
    x = random((2, 3, 4), loc=1.0, scale=2.0)
    ln = LayerNorm(4, axis_name="shards", use_scale=False, use_bias=False, ctx=ctx())
    y = jax.vmap(ln, axis_name="shards")(x)
    full = jnp.transpose(x, (1, 0, 2)).reshape(3, 8)
    expected = LayerNorm(8, use_scale=False, use_bias=False, ctx=ctx())(full)
    np.testing.assert_allclose(jnp.transpose(y, (1, 0, 2)).reshape(3, 8), expected, rtol=1e-5, atol=1e-5)
