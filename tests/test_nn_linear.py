"""Linear, Conv and Embed: shapes, defaults, and agreement with flax.linen."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx
from nnx.nn import initializers
from nnx.nn.linear import Conv, Embed, Linear


def ctx(seed=0):
    # rbg keys compile much faster than threefry keys on CPU (a new parameter
    # shape costs ~0.2 s instead of ~1.5 s), which keeps these tests quick.
    return nnx.context(jax.random.key(seed, impl="rbg"))


def random(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def params_of(module, *names):
    """The module's parameters as a flax.linen ``params`` dict."""
    return {name: getattr(module, name) for name in names}


def flax_param_shapes(flax_module, x):
    """Parameter shapes flax.linen would create, without running its init."""
    variables = jax.eval_shape(flax_module.init, jax.random.key(0), x)
    return jax.tree.map(lambda a: a.shape, variables["params"])


# Linear


def test_linear_param_shapes_and_default_bias():
    layer = Linear(3, 4, ctx=ctx())
    assert layer.kernel.shape == (3, 4)
    assert layer.bias.shape == (4,)
    np.testing.assert_array_equal(layer.bias, np.zeros(4))


def test_linear_params_are_param_containers():
    layer = Linear(3, 4, ctx=ctx())
    params = layer.filter(nnx.Param)
    assert set(params) == {"kernel", "bias"}
    assert all(isinstance(p, nnx.Param) for p in params.values())


def test_linear_without_bias_has_none_bias():
    layer = Linear(3, 4, use_bias=False, ctx=ctx())
    assert layer.bias is None
    x = random((2, 3))
    np.testing.assert_allclose(layer(x), x @ layer.kernel, rtol=1e-6)


def test_linear_without_bias_keeps_bias_as_param_none():
    params = Linear(3, 4, use_bias=False, ctx=ctx()).filter(nnx.Param)
    assert isinstance(params["bias"], nnx.Param)
    assert params["bias"].value is None


def test_linear_same_seed_gives_same_kernel():
    a = Linear(3, 4, ctx=ctx())
    b = Linear(3, 4, ctx=ctx())
    c = Linear(3, 4, ctx=ctx(1))
    np.testing.assert_array_equal(a.kernel, b.kernel)
    assert not np.allclose(a.kernel, c.kernel)


def test_linear_accepts_raw_uint32_key():
    layer = Linear(3, 4, ctx=nnx.context(jax.random.PRNGKey(0)))
    assert layer.kernel.shape == (3, 4)


def test_linear_param_shapes_match_flax_dense():
    x = random((2, 3))
    layer = Linear(3, 4, ctx=ctx())
    assert flax_param_shapes(linen.Dense(4), x) == {"kernel": (3, 4), "bias": (4,)}
    assert (layer.kernel.shape, layer.bias.shape) == ((3, 4), (4,))


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_matches_flax_dense(use_bias):
    x = random((2, 5, 3))
    layer = Linear(3, 4, use_bias=use_bias, bias_init=initializers.normal(1.0), ctx=ctx())
    params = params_of(layer, "kernel", "bias") if use_bias else params_of(layer, "kernel")
    expected = linen.Dense(4, use_bias=use_bias).apply({"params": params}, x)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-6)


def test_linear_rejects_inputs_with_wrong_feature_size():
    layer = Linear(3, 4, ctx=ctx())
    with pytest.raises(ValueError, match="in_features=3"):
        layer(jnp.ones((2, 5)))


def test_linear_uses_custom_initializers():
    layer = Linear(
        3,
        4,
        kernel_init=initializers.ones(),
        bias_init=initializers.constant(0.5),
        ctx=ctx(),
    )
    np.testing.assert_array_equal(layer.kernel, np.ones((3, 4)))
    np.testing.assert_array_equal(layer(jnp.ones((2, 3))), np.full((2, 4), 3.5))


def test_linear_param_dtype_sets_parameter_dtype():
    layer = Linear(3, 4, param_dtype=jnp.bfloat16, ctx=ctx())
    assert layer.kernel.dtype == jnp.bfloat16
    assert layer.bias.dtype == jnp.bfloat16


def test_linear_dtype_sets_computation_dtype():
    layer = Linear(3, 4, dtype=jnp.bfloat16, ctx=ctx())
    assert layer.kernel.dtype == jnp.float32
    assert layer(jnp.ones((2, 3))).dtype == jnp.bfloat16


def test_linear_infers_dtype_from_inputs_and_params():
    layer = Linear(3, 4, ctx=ctx())
    assert layer(jnp.ones((2, 3), jnp.bfloat16)).dtype == jnp.float32
    assert layer(jnp.ones((2, 3), jnp.int32)).dtype == jnp.float32


@pytest.mark.parametrize(
    "dtype, param_dtype, input_dtype",
    [
        (None, jnp.bfloat16, jnp.float32),
        (None, jnp.bfloat16, jnp.bfloat16),
        (None, jnp.float32, jnp.int32),
        (jnp.float16, jnp.bfloat16, jnp.float32),
    ],
    ids=str,
)
def test_linear_dtype_promotion_matches_flax_dense(dtype, param_dtype, input_dtype):
    x = jnp.arange(6).reshape(2, 3).astype(input_dtype)
    layer = Linear(
        3,
        4,
        dtype=dtype,
        param_dtype=param_dtype,
        bias_init=initializers.normal(1.0),
        ctx=ctx(),
    )
    expected = linen.Dense(4, dtype=dtype, param_dtype=param_dtype).apply(
        {"params": params_of(layer, "kernel", "bias")}, x
    )
    y = layer(x)
    assert y.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(expected, np.float32), rtol=1e-2)


def test_linear_calls_custom_dot_general():
    calls = []

    def dot_general(lhs, rhs, dimension_numbers, precision=None):
        calls.append(dimension_numbers)
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)

    layer = Linear(3, 4, dot_general=dot_general, ctx=ctx())
    layer(jnp.ones((2, 3)))
    assert calls == [(((1,), (0,)), ((), ()))]


def test_linear_kernel_with_metadata_carries_sharding():
    layer = Linear(
        3,
        4,
        kernel_init=nnx.with_metadata(initializers.lecun_normal(), sharding=("din", "dout")),
        ctx=ctx(),
    )
    params = layer.partition(nnx.Param)[0]
    assert params["kernel"].sharding == ("din", "dout")
    assert params["bias"].sharding is None
    assert layer.kernel.shape == (3, 4)


def test_linear_kernel_with_logical_partitioning_carries_sharding():
    layer = Linear(
        3,
        4,
        kernel_init=nnx.with_logical_partitioning(initializers.lecun_normal(), ("din", "dout")),
        ctx=ctx(),
    )
    spec = nnx.get_partition_spec(layer.partition(nnx.Param)[0])
    assert spec["kernel"] == jax.sharding.PartitionSpec("din", "dout")
    assert layer(jnp.ones((2, 3))).shape == (2, 4)


def test_linear_grad_is_keyed_by_parameter_name():
    layer = Linear(3, 4, ctx=ctx())
    x = random((2, 3))
    grads = nnx.grad(lambda m, x: jnp.sum(m(x)))(layer, x)
    np.testing.assert_allclose(grads["kernel"].value, np.tile(x.sum(0)[:, None], (1, 4)), rtol=1e-6)
    np.testing.assert_allclose(grads["bias"].value, np.full(4, 2.0))


def test_linear_works_under_jit_through_partition_and_merge():
    layer = Linear(3, 4, ctx=ctx())
    state, moduledef = layer.partition()
    x = random((2, 3))

    @jax.jit
    def forward(state, x):
        return moduledef.merge(state)(x)

    np.testing.assert_allclose(forward(state, x), layer(x), rtol=1e-6)


# Conv


def test_conv_kernel_shape_is_window_in_out():
    conv = Conv(4, 5, (3, 2), ctx=ctx())
    assert conv.kernel.shape == (3, 2, 4, 5)
    assert conv.bias.shape == (5,)


def test_conv_int_kernel_size_means_1d():
    conv = Conv(3, 4, 3, ctx=ctx())
    assert conv.kernel.shape == (3, 3, 4)
    assert conv(jnp.ones((2, 9, 3))).shape == (2, 9, 4)


def test_conv_feature_groups_divide_kernel_input_axis():
    conv = Conv(4, 6, (3,), feature_group_count=2, ctx=ctx())
    assert conv.kernel.shape == (3, 2, 6)


def test_conv_rejects_in_features_not_divisible_by_groups():
    with pytest.raises(ValueError, match="feature_group_count"):
        Conv(3, 6, (3,), feature_group_count=2, ctx=ctx())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(padding="VALID"),
        dict(padding="CIRCULAR"),
        dict(padding="REFLECT"),
        dict(padding=1),
        dict(padding=[(1, 2), 0]),
        dict(strides=2),
        dict(strides=(2, 1), padding="VALID"),
        dict(input_dilation=2, padding=1),
        dict(kernel_dilation=(2, 1), padding="CIRCULAR"),
        dict(use_bias=False),
    ],
    ids=repr,
)
def test_conv_2d_matches_flax(kwargs):
    x = random((2, 7, 6, 4))
    conv = Conv(4, 5, (3, 2), **kwargs, bias_init=initializers.normal(1.0), ctx=ctx())
    names = ("kernel", "bias") if conv.bias is not None else ("kernel",)
    expected = linen.Conv(5, (3, 2), **kwargs).apply({"params": params_of(conv, *names)}, x)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kernel_size, kwargs",
    [
        ((3, 3), dict(strides=(2, 1), kernel_dilation=(1, 2), feature_group_count=2)),
        ((2, 2), dict(strides=2, padding="CIRCULAR", feature_group_count=4)),
        ((3, 3), dict(input_dilation=(2, 1), padding=((1, 1), (0, 2)))),
        ((3, 3), dict(padding="SAME", strides=3, kernel_dilation=2)),
        ((3,), dict(padding="CAUSAL", strides=2)),
        ((2, 2, 2), dict(strides=(1, 2, 1), padding="VALID")),
    ],
    ids=repr,
)
def test_conv_strides_dilation_and_groups_match_flax(kernel_size, kwargs):
    x = random((2,) + (7,) * len(kernel_size) + (4,))
    conv = Conv(4, 8, kernel_size, **kwargs, bias_init=initializers.normal(1.0), ctx=ctx())
    expected = linen.Conv(8, kernel_size, **kwargs).apply({"params": params_of(conv, "kernel", "bias")}, x)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


def test_conv_2d_mask_matches_flax():
    x = random((2, 6, 6, 4))
    mask = jnp.asarray(np.random.default_rng(1).integers(0, 2, (3, 3, 4, 8)), jnp.float32)
    conv = Conv(4, 8, (3, 3), mask=mask, bias_init=initializers.normal(1.0), ctx=ctx())
    expected = linen.Conv(8, (3, 3), mask=mask).apply({"params": params_of(conv, "kernel", "bias")}, x)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [dict(param_dtype=jnp.bfloat16), dict(dtype=jnp.bfloat16), dict(dtype=jnp.float16, param_dtype=jnp.bfloat16)],
    ids=str,
)
def test_conv_dtype_promotion_matches_flax(kwargs):
    x = random((2, 6, 6, 4))
    conv = Conv(4, 8, (3, 3), **kwargs, bias_init=initializers.normal(1.0), ctx=ctx())
    expected = linen.Conv(8, (3, 3), **kwargs).apply({"params": params_of(conv, "kernel", "bias")}, x)
    y = conv(x)
    assert y.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)


def test_conv_param_shapes_match_flax():
    x = random((2, 7, 6, 4))
    conv = Conv(4, 6, (3, 2), feature_group_count=2, ctx=ctx())
    expected = flax_param_shapes(linen.Conv(6, (3, 2), feature_group_count=2), x)
    assert expected == {"kernel": conv.kernel.shape, "bias": conv.bias.shape}


def test_conv_grouped_matches_flax():
    x = random((2, 9, 4))
    conv = Conv(4, 6, (3,), feature_group_count=2, ctx=ctx())
    expected = linen.Conv(6, (3,), feature_group_count=2).apply({"params": params_of(conv, "kernel", "bias")}, x)
    np.testing.assert_allclose(conv(x), expected, rtol=1e-5, atol=1e-5)


def test_conv_causal_padding_matches_flax():
    x = random((2, 9, 3))
    conv = Conv(3, 4, (3,), padding="CAUSAL", kernel_dilation=2, ctx=ctx())
    y = conv(x)
    assert y.shape == (2, 9, 4)
    expected = linen.Conv(4, (3,), padding="CAUSAL", kernel_dilation=2).apply(
        {"params": params_of(conv, "kernel", "bias")}, x
    )
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # Causal: the first output only sees the first input.
    np.testing.assert_allclose(y[:, 0], conv(x.at[:, 1:].set(0.0))[:, 0], rtol=1e-6)


def test_conv_mask_zeroes_masked_kernel_entries():
    x = random((2, 9, 3))
    mask = jnp.zeros((3, 3, 4)).at[1].set(1.0)
    conv = Conv(3, 4, (3,), mask=mask, bias_init=initializers.normal(1.0), ctx=ctx())
    params = params_of(conv, "kernel", "bias")
    y = conv(x)
    expected = linen.Conv(4, (3,), mask=mask).apply({"params": params}, x)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    # Only the centre tap is left: a pointwise linear map.
    np.testing.assert_allclose(y, x @ params["kernel"][1] + params["bias"], rtol=1e-5, atol=1e-5)


def test_conv_rejects_mask_of_wrong_shape():
    with pytest.raises(ValueError, match="same shape as the kernel"):
        Conv(3, 4, (3,), mask=jnp.ones((2, 3, 4)), ctx=ctx())


def test_conv_accepts_unbatched_input():
    conv = Conv(4, 5, (3, 2), ctx=ctx())
    x = random((7, 6, 4))
    y = conv(x)
    assert y.shape == (7, 6, 5)
    np.testing.assert_allclose(y, conv(x[None])[0], rtol=1e-6)


def test_conv_accepts_several_batch_axes():
    conv = Conv(3, 4, (3,), ctx=ctx())
    x = random((2, 2, 9, 3))
    y = conv(x)
    assert y.shape == (2, 2, 9, 4)
    np.testing.assert_allclose(y[1, 2], conv(x[1, 2]), rtol=1e-5, atol=1e-6)


def test_conv_kernel_with_metadata_carries_sharding():
    conv = Conv(
        3,
        4,
        (3,),
        kernel_init=nnx.with_metadata(initializers.lecun_normal(), sharding=(None, "din", "dout")),
        ctx=ctx(),
    )
    assert conv.partition(nnx.Param)[0]["kernel"].sharding == (None, "din", "dout")


def test_conv_with_list_arguments_runs_under_nnx_jit():
    conv = Conv(3, 4, [3], strides=[1], padding=[[1, 1]], kernel_dilation=[1], ctx=ctx())
    hash(conv.get_module_def())
    x = random((2, 9, 3))
    y = nnx.jit(lambda m, x: m(x))(conv, x)
    np.testing.assert_allclose(y, conv(x), rtol=1e-5, atol=1e-6)


def test_conv_rejects_inputs_with_wrong_channel_count():
    conv = Conv(3, 4, (3,), ctx=ctx())
    with pytest.raises(ValueError, match="in_features=3"):
        conv(jnp.ones((2, 9, 4)))


def test_conv_mask_is_state_matched_by_buffers():
    mask = jnp.ones((3, 3, 4))
    conv = Conv(3, 4, (3,), mask=mask, ctx=ctx())
    (params, buffers), _ = conv.partition(nnx.Param, nnx.buffers)
    assert set(params) == {"kernel", "bias"}
    assert set(buffers) == {"mask"}


def test_conv_rejects_invalid_padding():
    conv = Conv(3, 4, (3,), padding=[(1, 2, 3)], ctx=ctx())
    with pytest.raises(ValueError, match="Invalid padding"):
        conv(jnp.ones((2, 9, 3)))


def test_conv_rejects_causal_padding_in_2d():
    conv = Conv(4, 5, (3, 2), padding="CAUSAL", ctx=ctx())
    with pytest.raises(ValueError, match="Causal padding"):
        conv(jnp.ones((2, 7, 6, 4)))


def test_conv_dtype_sets_computation_dtype():
    conv = Conv(3, 4, (3,), dtype=jnp.bfloat16, ctx=ctx())
    assert conv(jnp.ones((2, 9, 3))).dtype == jnp.bfloat16


# Embed


def test_embed_table_shape_and_lookup():
    embed = Embed(8, 4, ctx=ctx())
    assert embed.embedding.shape == (8, 4)
    indices = jnp.array([[1, 2, 3], [0, 7, 7]])
    y = embed(indices)
    assert y.shape == (2, 3, 4)
    np.testing.assert_array_equal(y[1, 1], embed.embedding[7])


def test_embed_matches_flax_call_and_attend():
    indices = jnp.array([[1, 2, 3], [4, 0, 7]])
    query = random((2, 4))
    embed = Embed(8, 4, ctx=ctx())
    variables = {"params": params_of(embed, "embedding")}
    flax_embed = linen.Embed(8, 4)
    assert flax_param_shapes(flax_embed, indices) == {"embedding": (8, 4)}
    np.testing.assert_array_equal(embed(indices), flax_embed.apply(variables, indices))
    np.testing.assert_allclose(embed.attend(query), flax_embed.apply(variables, query, method="attend"), rtol=1e-6)


@pytest.mark.parametrize(
    "dtype, param_dtype, query_dtype",
    [
        (None, jnp.bfloat16, jnp.float32),
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (jnp.float16, jnp.bfloat16, jnp.bfloat16),
    ],
    ids=str,
)
def test_embed_dtype_promotion_matches_flax_call_and_attend(dtype, param_dtype, query_dtype):
    indices = jnp.array([[1, 2], [7, 0]])
    query = random((3, 4)).astype(query_dtype)
    embed = Embed(8, 4, dtype=dtype, param_dtype=param_dtype, ctx=ctx())
    variables = {"params": params_of(embed, "embedding")}
    flax_embed = linen.Embed(8, 4, dtype=dtype, param_dtype=param_dtype)
    expected = flax_embed.apply(variables, indices)
    y = embed(indices)
    assert y.dtype == expected.dtype
    np.testing.assert_array_equal(y, expected)
    expected = flax_embed.apply(variables, query, method="attend")
    scores = embed.attend(query)
    assert scores.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(scores, np.float32), np.asarray(expected, np.float32), rtol=1e-2, atol=1e-2)


def test_embed_attend_gives_one_score_per_embedding():
    embed = Embed(8, 4, ctx=ctx())
    assert embed.attend(jnp.ones((2, 4))).shape == (2, 8)


def test_embed_with_metadata_carries_sharding():
    embed = Embed(
        8,
        4,
        embedding_init=nnx.with_metadata(initializers.normal(), sharding=("vocab", "embed")),
        ctx=ctx(),
    )
    assert embed.partition(nnx.Param)[0]["embedding"].sharding == ("vocab", "embed")


def test_embed_rejects_float_indices():
    embed = Embed(8, 4, ctx=ctx())
    with pytest.raises(ValueError, match="integer"):
        embed(jnp.array([1.0, 2.0]))


def test_embed_single_embedding_broadcasts():
    embed = Embed(1, 3, ctx=ctx())
    y = embed(jnp.zeros((2, 5), jnp.int32))
    assert y.shape == (2, 5, 3)
    np.testing.assert_array_equal(y[1, 4], embed.embedding[0])


def test_embed_dtype_casts_embeddings():
    embed = Embed(8, 4, dtype=jnp.bfloat16, ctx=ctx())
    assert embed(jnp.array([1, 2])).dtype == jnp.bfloat16


def test_a_bfloat16_embeds_table_gradient_sums_a_repeated_rows_gradients_in_float32():
    """A token repeated 2,048 times in a bfloat16 batch: its row's gradient is the float32 sum of its 2,048
    gradients, as a float32 table's is (converting the whole table first summed them in 16 bits, 12% off)."""
    embed = Embed(16, 8, dtype=jnp.bfloat16, ctx=ctx())
    params, moduledef = embed.partition(nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 4, (8, 1024)))
    cotangent = random((8, 1024, 8), 2).astype(jnp.bfloat16)
    _, backward = jax.vjp(lambda p: moduledef.merge(p)(tokens), params)
    (gradient,) = [g.value for g in backward(cotangent)[0].values()]
    want = jnp.zeros((16, 8)).at[tokens.reshape(-1)].add(cotangent.astype(jnp.float32).reshape(-1, 8))
    assert gradient.dtype == jnp.float32
    np.testing.assert_allclose(gradient, want, rtol=1e-5, atol=1e-4)


def test_embed_default_init_scales_by_features():
    # variance_scaling(1.0, "fan_in", "normal", out_axis=0): std 1/sqrt(features).
    embed = Embed(64, 16, ctx=ctx())
    assert abs(float(jnp.std(embed.embedding)) - 0.25) < 0.03
