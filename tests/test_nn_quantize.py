"""`nnx.QuantizedKernel` and the 4-bit functions of `nnx.nn.quantize`, against bitsandbytes' own output.

The goldens (`tests/fixtures/hf/bnb_ops.npz`) are what `bitsandbytes.functional.quantize_4bit` and
`dequantize_4bit` 0.50.2 make of float32, bfloat16 and float16 weights in PyTorch's `[out, in]` layout
(tests/fixtures/make_qlora_fixtures.py).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_support import FIXTURES
from xla_support import DEPLOYED

import nnx
from nnx.nn import quantize as q

GOLDENS = dict(np.load(FIXTURES / "bnb_ops.npz"))
CASES = [(w, t, d) for w in ("f32", "bf16", "f16") for t in ("nf4", "fp4") for d in ("single", "double")]


def weight(name: str) -> np.ndarray:
    w = GOLDENS[f"{name}_weight"]
    return w.view(ml_dtypes.bfloat16) if name == "bf16" else w


def test_codebooks_are_bitsandbytes_maps():
    for ours, theirs in ((q.code("nf4"), "nf4_map"), (q.code("fp4"), "fp4_map"), (q.dynamic_code(), "dynamic_map")):
        assert np.array_equal(ours.view(np.uint32), GOLDENS[theirs].view(np.uint32))  # bit for bit: +0, not -0


@pytest.mark.parametrize("name,kind,double", CASES)
def test_quantize_4bit_equals_bitsandbytes(name, kind, double):
    key = f"{name}_{kind}_{double}"
    packed, absmax = q.quantize_4bit(weight(name), kind, 64)
    assert np.array_equal(packed, GOLDENS[f"{key}_packed"])
    if double == "single":
        assert np.array_equal(absmax, GOLDENS[f"{key}_absmax"])
        return
    codes, nested, offset = q.double_quantize(absmax)
    assert np.array_equal(codes, GOLDENS[f"{key}_absmax"])
    assert np.array_equal(nested, GOLDENS[f"{key}_nested_absmax"])
    assert offset == GOLDENS[f"{key}_offset"]


@pytest.mark.parametrize("name,kind,double", CASES)
def test_dequantize_4bit_equals_bitsandbytes(name, kind, double):
    key = f"{name}_{kind}_{double}"
    absmax = GOLDENS[f"{key}_absmax"]
    if double == "double":
        absmax = q.undo_double_quantize(absmax, GOLDENS[f"{key}_nested_absmax"], GOLDENS[f"{key}_offset"])
    shape = weight(name).shape
    assert np.array_equal(
        q.dequantize_4bit(GOLDENS[f"{key}_packed"], absmax, kind, shape), GOLDENS[f"{key}_dequantized_f32"]
    )
    if double == "double":
        bf16 = q.dequantize_4bit(GOLDENS[f"{key}_packed"], absmax, kind, shape, ml_dtypes.bfloat16)
        assert np.array_equal(bf16.view(np.uint16), GOLDENS[f"{key}_dequantized_bf16"])


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("name,kind,double", CASES)
def test_kernel_layout_holds_bitsandbytes_arrays(name, kind, double, copies):
    """Our [in, out] kernel quantised is bitsandbytes' [out, in] weight quantised, transposed. Sixteen copies
    of the weight's rows (each row's blocks as they were, so bitsandbytes' codes and block scales are its own
    as many times) make a kernel large enough for NumPy's input to be quantised by XLA."""
    key = f"{name}_{kind}_{double}"
    tiles = -(-q._XLA_SIZE // weight(name).size) if copies else 1
    w = np.tile(weight(name), (tiles, 1))
    assert (w.size >= q._XLA_SIZE) == copies
    parts = q.quantize_kernel(w.T, kind, 64, double == "double")
    assert not any(isinstance(v, jax.Array) for v in parts.values())  # NumPy in, NumPy out
    flat = q.to_bitsandbytes(parts)
    assert np.array_equal(flat["packed"], np.tile(GOLDENS[f"{key}_packed"], tiles))
    if tiles == 1 or double == "single":  # double-quantised, the copies' scales fall into other nested blocks
        assert np.array_equal(flat["absmax"], np.tile(GOLDENS[f"{key}_absmax"], tiles))


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_numpy_kernels_quantised_by_xla_get_numpys_codes_at_the_edges(kind, tiny, monkeypatch):
    """A large kernel given as NumPy is quantised by XLA: the same codes and scales as NumPy's own formula at
    each level's midpoint (a value there rounds down), just beside it, at the extremes and in an all-zero block.
    A kernel holding a subnormal value (which XLA's CPU would flush to zero: FP4 has a code for +0 and one for
    -0) is quantised by NumPy."""
    midpoints, _ = q._bounds(kind)
    above = np.where(midpoints == 0, np.float32(2.0**-90), np.nextafter(midpoints, np.float32(2)))
    edges = np.concatenate([midpoints, above, [-1.0, 1.0, 0.0, -0.0, 1e-45 if tiny else 0.0]])
    blocks = np.zeros((q._XLA_SIZE // 64, 64), np.float32)
    blocks[: len(edges) // 64 + 1, :] = 0.5  # scaled by 1 (each of these blocks holds a 1.0 or a -1.0 below)
    blocks.reshape(-1)[: len(edges)] = edges
    blocks[0, -1], blocks[1, -1] = 1.0, -1.0
    blocks[5:] = np.random.default_rng(0).standard_normal((len(blocks) - 5, 64)) * 0.02
    blocks[-1] = 0.0
    w = blocks.reshape(-1, 256).T  # [in, out], bitsandbytes' blocks down its columns
    assert q._has_tiny(w) == tiny
    ours = q.quantize_kernel(w, kind, 64, double_quant=True)
    monkeypatch.setattr(q, "_XLA_SIZE", w.size + 1)
    numpys = q.quantize_kernel(w, kind, 64, double_quant=True)
    for part in numpys:
        assert np.array_equal(ours[part], numpys[part]), part


@pytest.mark.parametrize("name,kind,double", CASES)
def test_quantized_kernel_dequantizes_as_bitsandbytes(name, kind, double):
    key = f"{name}_{kind}_{double}"
    nested = (GOLDENS[f"{key}_nested_absmax"], GOLDENS[f"{key}_offset"]) if double == "double" else ()
    parts = q.from_bitsandbytes(GOLDENS[f"{key}_packed"], GOLDENS[f"{key}_absmax"], weight(name).shape, *nested)
    out_features, in_features = weight(name).shape
    kernel = nnx.QuantizedKernel(in_features, out_features, type=kind, double_quant=double == "double")
    for part, value in parts.items():
        setattr(kernel, part, jnp.asarray(value))
    assert np.array_equal(np.asarray(kernel.dequantize(jnp.float32)), GOLDENS[f"{key}_dequantized_f32"].T)


def test_quantizing_with_jax_gives_the_codes_numpy_gives():
    w = weight("f32").T
    ours = q.quantize_kernel(w, "nf4", 64, double_quant=True)
    theirs = jax.jit(lambda w: q.quantize_kernel(w, "nf4", 64, double_quant=True, xp=jnp))(w)
    assert np.array_equal(np.asarray(theirs["codes"]), ours["codes"])
    assert np.array_equal(np.asarray(theirs["absmax"]), ours["absmax"])


def test_the_reciprocal_of_a_block_scale_is_correctly_rounded_without_a_division():
    """The quantiser's reciprocal with JAX (long division of the significand in integers: a GPU divides float32
    within 2 ulp) equals IEEE division for every significand at the smallest, middle and largest exponents it
    takes, and where the scaled values of a weight sit on the codes' boundaries."""
    reciprocal = jax.jit(lambda a: q._reciprocal(a, jnp))
    significands = np.arange(1 << 23, dtype=np.uint32)
    for exponent in (1, 127, 252):
        a = ((np.uint32(exponent) << 23) | significands).view(np.float32)
        np.testing.assert_array_equal(np.asarray(reciprocal(a)).view(np.uint32), (np.float32(1) / a).view(np.uint32))
    w = weight("bf16").astype(np.float32).reshape(-1, 64)
    absmax = np.abs(w).max(axis=-1)
    np.testing.assert_array_equal(np.asarray(reciprocal(absmax)), np.float32(1) / absmax)


def test_quantized_kernel_from_a_value_keeps_its_shape_and_axes():
    def build(w):
        return nnx.QuantizedKernel(128, (3, 32), batch=(2,), value=w, in_axes=("embed",), out_axes=("heads", "kv"),
                                   batch_axes=("expert",))  # fmt: skip

    w = jax.random.normal(jax.random.key(0), (2, 128, 3, 32)) * 0.1
    state, moduledef = jax.eval_shape(lambda: build(w).partition())
    kernel = moduledef.merge(state)
    assert kernel.shape == (2, 128, 3, 32)
    assert state["codes"].value.shape == (2, 64, 96) and state["absmax"].value.shape == (2, 2, 96)
    assert state["codes"].sharding == ("expert", "embed", "heads")
    assert state["absmax"].sharding == ("expert", None, "heads")
    assert state["nested_absmax"].sharding == ("expert", None)
    error = np.abs(np.asarray(jax.jit(lambda w: build(w).dequantize())(w)) - np.asarray(w)).max()
    assert 0 < error < 0.2 * np.abs(np.asarray(w)).max()


def test_quantized_kernel_rejects_an_input_size_off_its_blocks():
    with pytest.raises(ValueError, match="multiple of its block size"):
        nnx.QuantizedKernel(96, 8, block=64)


def test_quantized_kernel_rejects_an_unknown_type():
    with pytest.raises(ValueError, match="nf4, fp4"):
        nnx.QuantizedKernel(64, 8, type="int4")


@pytest.fixture(scope="module")
def kernel():
    w = np.asarray(jax.random.normal(jax.random.key(1), (128, 48))) * 0.05
    kernel = nnx.QuantizedKernel(128, 48)
    for part, value in q.quantize_kernel(w).items():
        setattr(kernel, part, jnp.asarray(value))
    return kernel


def test_product_equals_matmul_by_the_dequantized_kernel(kernel):
    x = jax.random.normal(jax.random.key(2), (5, 128))
    expected = x @ kernel.dequantize(jnp.float32)
    np.testing.assert_allclose(kernel(x, dtype=jnp.float32), expected, rtol=1e-6, atol=1e-6)


def test_product_gradient_is_that_of_the_dequantized_kernel(kernel):
    x = jax.random.normal(jax.random.key(2), (5, 128))
    w = kernel.dequantize(jnp.float32)
    ours = jax.grad(lambda x: jnp.sum(jnp.sin(kernel(x, dtype=jnp.float32))))(x)
    plain = jax.grad(lambda x: jnp.sum(jnp.sin(x @ w)))(x)
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)


def test_backward_pass_keeps_no_dequantized_kernel(kernel):
    x = jax.random.normal(jax.random.key(2), (5, 128))
    _, backward = jax.vjp(lambda x: jnp.sum(jnp.sin(kernel(x, dtype=jnp.float32))), x)
    saved = [leaf.shape for leaf in jax.tree.leaves(backward)]  # the residuals the backward pass closes over
    assert kernel.codes.shape in saved
    assert (128, 48) not in saved


def test_grad_over_a_quantized_kernel_names_its_integer_part_and_the_filter_that_leaves_it_out():
    class Model(nnx.Module):
        def __init__(self):
            self.kernel = nnx.QuantizedKernel(128, 8, value=jnp.ones((128, 8)))
            self.bias = nnx.Param(jnp.zeros(8))

        def __call__(self, x):
            return self.kernel(x, dtype=jnp.float32) + self.bias

    model, x = Model(), jnp.ones((2, 128))
    loss = lambda model, x: jnp.sum(model(x) ** 2)  # noqa: E731
    with pytest.raises(TypeError, match=r"'kernel/absmax' \(nnx.QuantizedParam, uint8\) cannot be differentiated"):
        nnx.grad(loss)(model, x)
    grads = nnx.grad(loss, wrt=nnx.All(nnx.Param, nnx.Not(nnx.QuantizedParam)))(model, x)
    assert list(grads.keys()) == ["bias"]


def test_product_runs_in_bfloat16(kernel):
    x = jax.random.normal(jax.random.key(2), (5, 128))
    y = kernel(x, dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), x @ kernel.dequantize(jnp.float32), rtol=0.05, atol=0.02)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("type, block, double", [("nf4", 64, True), ("fp4", 128, False)])
def test_one_row_on_a_cpu_is_multiplied_from_the_codes_by_the_float32_weights(type, block, double):
    """A batch-1 decoding step's product reads the codes through a table of the row's products with each
    byte's two values: no dequantised kernel, in 16 bits or wider, and the weights dequantize_4bit gives in
    float32 (not rounded to the compute dtype, as a product of many rows rounds them). Its gradient is the
    dequantised kernel's."""
    w = np.asarray(jax.random.normal(jax.random.key(1), (512, 2048))) * 0.05
    kernel = nnx.QuantizedKernel(512, 2048, type=type, block=block, double_quant=double)
    for part, value in q.quantize_kernel(w, type, block, double).items():
        setattr(kernel, part, jnp.asarray(value))
    parts, kerneldef = kernel.partition()
    x = jax.random.normal(jax.random.key(2), (1, 512), jnp.bfloat16)

    def product(parts, x):
        return kerneldef.merge(parts)(x, dtype=jnp.bfloat16, out_dtype=jnp.float32)

    compiled = jax.jit(product).lower(parts, x).compile(compiler_options=DEPLOYED)
    exact = kernel.dequantize(jnp.float32)
    np.testing.assert_allclose(compiled(parts, x), x.astype(jnp.float32) @ exact, rtol=1e-5, atol=1e-5)
    # the shares, float32 [256, 2048], and the block scales: what a bfloat16 copy of the kernel alone takes
    assert compiled.memory_analysis().temp_size_in_bytes <= 1.1 * 512 * 2048 * 2
    hlo = compiled.as_text()
    assert "bf16[512,2048]" not in hlo and "f32[512,2048]" not in hlo  # no dequantised kernel, 16 or 32 bits

    x32 = x.astype(jnp.float32)
    ours = jax.grad(lambda x: jnp.sum(jnp.sin(kerneldef.merge(parts)(x, dtype=jnp.float32))))(x32)
    theirs = jax.grad(lambda x: jnp.sum(jnp.sin(x @ exact)))(x32)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_4bit_kernel_promotes_an_integer_input_to_float32_as_linear_does():
    """It dequantised into the input's int32: the product of every weight truncated (6.0 off at this size)."""
    kernel = nnx.QuantizedKernel(64, 8, value=jax.random.normal(jax.random.key(0), (64, 8)))
    x = jnp.arange(4 * 64).reshape(4, 64) % 3
    y = kernel(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, kernel(x.astype(jnp.float32)))


def test_an_input_of_the_wrong_width_is_a_value_error_naming_in_features():
    kernel = nnx.QuantizedKernel(128, 16, value=jnp.ones((128, 16)))
    with pytest.raises(ValueError, match=r"in_features=\(128,\), got shape \(2, 64\)"):  # a dot_general error before
        kernel(jnp.ones((2, 64)))
