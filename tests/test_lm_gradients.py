"""transformer_lm's hand-written backward passes equal autodiff of the formulas they stand for.

The model's projections, SwiGLU, GeGLU, RMSNorm (Gemma's `1 + w` too) and LayerNorm define their own gradients so
that a training step saves fewer activations and writes no transposed copies of them; these tests hold those
gradients to autodiff's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_support import DEPLOYED

import nnx
from nnx_cli.models.transformer import dense
from nnx_cli.models.transformer.dense import Dense, matmul
from nnx_cli.models.transformer.mlp import activation, gated, geglu, swiglu
from nnx_cli.models.transformer.norms import LayerNorm, layer_norm, rms_norm
from nnx_cli.models.transformer_lm import TransformerLM


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def assert_same_gradients(ours, formula, *args):
    """Equal values, and equal gradients of a random projection of the output with respect to every argument."""
    cotangent = random(jnp.shape(ours(*args)), 99)
    np.testing.assert_allclose(ours(*args), formula(*args), rtol=1e-5, atol=1e-6)
    argnums = tuple(range(len(args)))

    def gradients(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums))(*args)

    got, want = gradients(ours), gradients(formula)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x_shape, kernel_shape, in_rank",
    [((2, 3, 5), (5, 4), 1), ((2, 3, 5), (5, 2, 4), 1), ((2, 3, 2, 4), (2, 4, 5), 2)],
    ids=["dense", "into-heads", "out-of-heads"],
)
def test_matmul_gradients_equal_autodiff_of_the_contraction(x_shape, kernel_shape, in_rank):
    formula = lambda x, kernel: jnp.tensordot(x, kernel, axes=in_rank)  # noqa: E731
    assert_same_gradients(lambda x, kernel: matmul(x, kernel, in_rank), formula, random(x_shape, 0),
                          random(kernel_shape, 1))  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 24])
def test_a_bfloat16_matmul_and_its_gradients_are_the_float32_contractions_rounded(tokens):
    """In 16 bits every product (the pass, and both gradients) is accumulated in float32 and rounded once. On a
    CPU none widens the kernel to a float32 copy first, which XLA does for a 16-bit product with a 16-bit result
    (and for any one-row product): the 2.5x faster form of XLA's CPU product."""
    x, kernel = random((tokens, 256), 0).astype(jnp.bfloat16), random((256, 1024), 1).astype(jnp.bfloat16)
    cotangent = random((tokens, 1024), 2).astype(jnp.bfloat16)

    def formula(x, kernel):
        return jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32)).astype(jnp.bfloat16)

    def value_and_gradients(f):
        value, backward = jax.vjp(f, x, kernel)
        return [value, *backward(cotangent)]

    ours, want = value_and_gradients(lambda x, kernel: matmul(x, kernel, 1)), value_and_gradients(formula)
    for got, expected in zip(ours, want, strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(got.astype(jnp.float32), expected.astype(jnp.float32), rtol=1e-2, atol=1e-2)

    with jax.default_device(jax.devices("cpu")[0]):
        value_and_input_gradient = jax.jit(lambda x, k: jax.vjp(lambda x: matmul(x, k, 1), x)[1](cotangent))
        temps = (
            value_and_input_gradient.lower(x, kernel)
            .compile(compiler_options=DEPLOYED)
            .memory_analysis()
            .temp_size_in_bytes
        )
    assert temps < kernel.size * 4  # a float32 copy of the kernel


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("on_a_cpu", [True, False], ids=["cpu-product", "gpu-product"])
def test_a_float32_kernel_multiplied_in_bfloat16_gets_its_gradient_in_float32_unrounded(on_a_cpu, monkeypatch):
    """A bfloat16 model's float32 weight is narrowed for the product, and its gradient `x^T g` comes back in
    float32 as accumulated: rounded to bfloat16 first, it was about 0.4% off. The input's gradient is the
    product with the narrowed kernel. Both on the CPU's product and on the one a GPU takes."""
    monkeypatch.setattr(dense, "cpu_products", lambda: on_a_cpu)
    x, kernel = random((24, 64), 0).astype(jnp.bfloat16), random((64, 2, 32), 1)
    cotangent = random((24, 2, 32), 2).astype(jnp.bfloat16)
    y, backward = jax.vjp(lambda x, kernel: matmul(x, kernel, 1), x, kernel)
    dx, dw = backward(cotangent)
    narrow = kernel.astype(jnp.bfloat16).astype(jnp.float32)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    np.testing.assert_allclose(y.astype(jnp.float32), jnp.tensordot(x.astype(jnp.float32), narrow, 1), rtol=1e-2)
    want = jnp.einsum("ti,tho->iho", x.astype(jnp.float32), cotangent.astype(jnp.float32))
    np.testing.assert_allclose(dw, want, rtol=1e-5, atol=1e-5)
    got_dx = jnp.einsum("tho,iho->ti", cotangent.astype(jnp.float32), narrow)
    np.testing.assert_allclose(dx.astype(jnp.float32), got_dx, rtol=1e-2, atol=1e-2)


def _scan_temps(x, kernels, argnums):
    """XLA's temporaries for the gradient (with respect to `argnums`) of a scan of projections into heads."""

    def layers(x, kernels):
        def layer(h, kernel):
            return matmul(h, kernel, 1).reshape(h.shape) * 0.5, None

        return jnp.sum(jax.lax.scan(layer, x, kernels)[0].astype(jnp.float32))

    program = jax.jit(jax.grad(layers, argnums)).lower(x, kernels).compile(compiler_options=DEPLOYED)
    return program.memory_analysis().temp_size_in_bytes


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize(
    "dtype, on_a_cpu", [("float32", True), ("bfloat16", True), ("bfloat16", False)], ids=["f32", "bf16", "bf16-gpu"]
)
def test_a_scanned_projection_keeps_its_kernel_as_given_not_a_stacked_copy(dtype, on_a_cpu, monkeypatch):
    """Under the layer scan the backward pass reads each layer's slice of the stacked kernel. A reshaped
    (`[in, heads, kv]` as `[in, heads * kv]`) or narrowed (float32 as bfloat16) kernel is a new array, which
    the scan stacked as a residual: a copy of every such weight in each step."""
    monkeypatch.setattr(dense, "cpu_products", lambda: on_a_cpu)
    x, kernels = random((32, 256), 0).astype(dtype), random((8, 256, 4, 64), 1)
    assert _scan_temps(x, kernels, (0, 1)) < kernels.nbytes // 2


@pytest.mark.usefixtures("on_the_cpu")
def test_a_bfloat16_projections_bias_is_added_in_float32_and_its_gradient_is_the_float32_sum():
    """The bias is added to the 16-bit product in float32 and rounded once, and its gradient is the float32 sum of
    the output gradient over the tokens. Added in bfloat16 the sum was a 16-bit one, which XLA's CPU computes
    in windows of 32 rows, and which missed the float32 sum by about 1% at 2,048 tokens."""
    layer = Dense((32,), (256,), ("embed",), ("mlp",), std=0.1, dtype=jnp.bfloat16, ctx=nnx.context(0))
    x, bias, cotangent = random((2, 1024, 32), 0).astype(jnp.bfloat16), random((256,), 1), random((2, 1024, 256), 2)
    cotangent = cotangent.astype(jnp.bfloat16)

    layer.bias = nnx.Param(bias)
    params, moduledef = layer.partition(nnx.Param)

    def project(params):
        return moduledef.merge(params)(x)

    y, backward = jax.vjp(project, params)
    (kernel,) = [w.value for path, w in params.items() if "kernel" in path]
    product = matmul(x, kernel.astype(jnp.bfloat16), 1)
    np.testing.assert_array_equal(y, (product.astype(jnp.float32) + bias).astype(jnp.bfloat16))
    (grads,) = backward(cotangent)
    (d_bias,) = [g.value for path, g in grads.items() if "bias" in path]
    assert d_bias.dtype == jnp.float32
    np.testing.assert_allclose(d_bias, jnp.sum(cotangent.astype(jnp.float32), axis=(0, 1)), rtol=1e-5, atol=1e-4)
    program = jax.jit(lambda p: jax.vjp(project, p)[1](cotangent)).lower(params).compile().as_text()
    assert "reduce-window" not in program


def test_swiglu_gradients_equal_autodiff_of_silu_times_up():
    assert_same_gradients(swiglu, lambda gate, up: jax.nn.silu(gate) * up, random((6, 7), 0), random((6, 7), 1))


def test_geglu_gradients_equal_autodiff_of_tanh_gelu_times_up():
    formula = lambda gate, up: jax.nn.gelu(gate, approximate=True) * up  # noqa: E731
    assert_same_gradients(geglu, formula, 2.0 * random((6, 7), 0), random((6, 7), 1))


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_a_bfloat16_gated_activation_rounds_once_forward_and_backward(kind):
    """In bfloat16 the activation is computed in float32 and rounded once, then multiplied by `up` (PyTorch's
    order), and each gradient is the float32 one rounded once: written in bfloat16, XLA's CPU rounded after
    every operation of the formula, some gradients off by half their size. (On the CPU device wherever the suite
    runs: a GPU's XLA may keep the rounded activation wider inside its fusion.)"""
    act = jax.nn.silu if kind == "swiglu" else jax.nn.gelu
    gate, up, cotangent = (3.0 * random((64, 256), 0), random((64, 256), 1), random((64, 256), 2))
    gate16, up16, cotangent16 = (a.astype(jnp.bfloat16) for a in (gate, up, cotangent))
    y, backward = jax.vjp(lambda g, u: gated(g, u, kind), gate16, up16)
    np.testing.assert_array_equal(y, act(gate16.astype(jnp.float32)).astype(jnp.bfloat16) * up16)
    _, exact = jax.vjp(lambda g, u: act(g) * u, *(a.astype(jnp.float32) for a in (gate16, up16)))
    for ours, want in zip(backward(cotangent16), exact(cotangent16.astype(jnp.float32)), strict=True):
        assert ours.dtype == jnp.bfloat16
        np.testing.assert_allclose(ours.astype(jnp.float32), want, rtol=2**-8, atol=1e-5)
    np.testing.assert_array_equal(activation(up16, "gelu"), jax.nn.gelu(up16.astype(jnp.float32)).astype(jnp.bfloat16))


def test_rms_norm_gradients_equal_autodiff_of_its_formula():
    def formula(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale

    ours = lambda x, scale: rms_norm(x, scale, 1e-5, jnp.float32)  # noqa: E731
    assert_same_gradients(ours, formula, random((2, 3, 8), 0), 1.0 + 0.1 * random((8,), 1))


def test_gemma_rms_norm_gradients_equal_autodiff_of_its_formula_with_one_plus_w():
    def formula(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1.0 + scale)

    ours = lambda x, scale: rms_norm(x, scale, 1e-6, jnp.float32, 1.0)  # noqa: E731
    assert_same_gradients(ours, formula, random((2, 3, 8), 0), 0.1 * random((8,), 1))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_layer_norm_gradients_equal_autodiff_of_its_formula(bias):
    def formula(x, scale, bias):
        centred = x - jnp.mean(x, axis=-1, keepdims=True)
        y = centred / jnp.sqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + 1e-5) * scale
        return y if bias is None else y + bias

    ours = lambda x, scale, bias=None: layer_norm(x, scale, bias, 1e-5, jnp.float32)  # noqa: E731
    args = [3.0 * random((2, 3, 8), 0) + 1.0, 1.0 + 0.1 * random((8,), 1)] + ([0.1 * random((8,), 2)] if bias else [])
    assert_same_gradients(ours, lambda x, scale, bias=None: formula(x, scale, bias), *args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_layer_norm_values_and_parameters_are_nnx_layer_norms(dtype):
    """The transformer's LayerNorm is `nnx.LayerNorm`'s values bit for bit, with the same parameters drawn from the
    same stream: GPT-2 checkpoints, seeds and golden logits carry over."""
    ours = LayerNorm(16, epsilon=1e-5, dtype=dtype, ctx=nnx.context(0))
    theirs = nnx.LayerNorm(16, epsilon=1e-5, dtype=dtype, ctx=nnx.context(0))
    assert list(ours.partition(nnx.Param)[0]) == list(theirs.partition(nnx.Param)[0])
    ours.scale, ours.bias = 1.0 + 0.1 * random((16,), 1), 0.1 * random((16,), 2)
    theirs.scale, theirs.bias = ours.scale, ours.bias
    x = (3.0 * random((4, 5, 16), 0) + 2.0).astype(dtype)
    got, want = jax.jit(lambda x: ours(x))(x), jax.jit(lambda x: theirs(x))(x)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("norm", [layer_norm, rms_norm], ids=["layernorm", "rmsnorm"])
def test_a_norm_keeps_only_its_input_and_per_row_statistics_for_the_backward_pass(norm):
    """Of the arrays the backward pass keeps, only `x` itself (in its own dtype) has `x`'s size: autodiff of
    LayerNorm's formula kept three float32 ones (centred, squared, normalised), each stacked by the layer scan."""
    x = random((4, 32, 64), 0).astype(jnp.bfloat16)
    args = (random((64,), 1), random((64,), 2)) if norm is layer_norm else (random((64,), 1),)
    _, backward = jax.vjp(lambda x, *a: norm(x, *a, 1e-5, jnp.bfloat16), x, *args)
    large = [r for r in jax.tree.leaves(backward) if r.size >= x.size]
    assert [(r.shape, r.dtype) for r in large] == [(x.shape, x.dtype)]


@pytest.mark.parametrize("norm, lora", [("rmsnorm", True), ("rmsnorm", False), ("layernorm", False)],
                         ids=["rmsnorm-lora", "rmsnorm-full", "layernorm-full"])  # fmt: skip
def test_a_layer_keeps_its_norms_inputs_and_remakes_their_outputs_for_the_backward_pass(norm, lora):
    """In training a layer's norms and the projections that read them run rematerialised: the backward pass
    keeps each norm's input (the residual stream, `[batch, length, embed]`) and remakes its output for the
    projections' gradients, where it kept that output too (`[tokens, embed]`, two more arrays a layer: 135 MiB
    of a SmolLM2-135M LoRA step's 913 in float32)."""
    layers, batch, length, embed = 3, 2, 8, 48
    model = TransformerLM((length,), 97, num_layers=layers, num_heads=4, head_dim=8, embed_dim=embed, mlp_dim=80,
                          norm=norm, mlp="swiglu" if norm == "rmsnorm" else "gelu", dropout=0.0,
                          lora={"rank": 4} if lora else None, ctx=nnx.context(0))  # fmt: skip
    (params, rest), moduledef = model.partition(nnx.LoRAParam if lora else nnx.Param, ...)
    tokens = jnp.arange(batch * length).reshape(batch, length) % 97

    def loss(params):
        ctx = nnx.context(dropout=0, flags={"deterministic": False})
        return jnp.mean(moduledef.merge(params, rest).metrics({"tokens": tokens}, ctx)["loss"])

    backward = jax.eval_shape(lambda params: jax.vjp(loss, params)[1], params)  # what it keeps, traced
    positions = batch * (length - 1)  # the inputs' positions
    stream = sorted(r.shape for r in jax.tree.leaves(backward) if r.ndim > 1 and r.shape[0] == layers
                    and r.size == layers * positions * embed)  # fmt: skip
    assert stream == [(layers, batch, length - 1, embed)] * 2  # the block's input and the attention half's sum
