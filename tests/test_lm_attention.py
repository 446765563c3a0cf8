"""`model.attention`: which implementation runs on which platform, and each one giving the core's numbers.

The core (`attention_core`) is the reference. `xla` (the weights written out) runs everywhere and is compared
with it on every variant; cuDNN's kernel runs on NVIDIA GPUs only, where the same comparisons include it (in
bfloat16, the dtype it takes): on a CPU its cases are not generated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx
from nnx_cli.models.transformer import Attention, architecture
from nnx_cli.models.transformer.attention import choose_attention, cudnn_fallbacks
from nnx_cli.models.transformer_lm import TransformerLM

ON_GPU = jax.default_backend() == "gpu"
LENGTH = 12
PACKED = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [1] * LENGTH])  # two examples then padding; one

BASE = dict(
    num_layers=2, num_heads=4, num_kv_heads=None, head_dim=16, embed_dim=32, mlp_dim=None, mlp="gelu",
    qkv_bias=False, qk_norm=False, bias=True, norm="layernorm", norm_eps=1e-5, positions="rope", rope_theta=10000.0,
    rope_scaling=None, dropout=0.0, attention_dropout=0.0, remat="none", scan_layers=True, dtype="float32",
)  # fmt: skip
VARIANTS = {  # options, and whether the batch is packed
    "causal": ({}, False),
    "grouped-query": ({"num_kv_heads": 2}, False),
    "window": ({"sliding_window": 5}, False),
    "soft-cap": ({"attention_softcap": 2.0}, False),
    "packed": ({"num_kv_heads": 2}, True),
    "traced-window": ({"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}, False),
    "query-scale": ({"query_scale": 8.0, "num_kv_heads": 1}, False),
}
CASES = [("xla", name) for name in VARIANTS] + [("cudnn", name) for name in VARIANTS if ON_GPU]


def attend(implementation: str, variant: str, dtype: str):
    """`(output, gradient of a random projection of it with respect to the input)` of one attention layer of
    `variant` run by `implementation`, its parameters drawn from the same seed whatever the implementation."""
    options, packed = VARIANTS[variant]
    arch = architecture(**{**BASE, **options, "dtype": dtype, "attention": implementation})
    layer = Attention(arch, ctx=nnx.context(0))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, LENGTH, 32)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((2, LENGTH, 32)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH))
    segments = PACKED if packed else None

    def loss(x, index):  # `index` traced: the window of a layer that slides among layers that do not
        index = index if arch.layers_differ else 0
        y = layer(x.astype(arch.dtype), positions, segments, deterministic=True, layer=index)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (_, y), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x, jnp.asarray(0))
    return np.asarray(y, np.float32), np.asarray(dx, np.float32)


@pytest.mark.parametrize("implementation, variant", CASES, ids=[f"{i}-{v}" for i, v in CASES])
def test_each_implementation_gives_the_cores_output_and_gradients(implementation, variant):
    dtype = "bfloat16" if implementation == "cudnn" else "float32"
    (y, dx), (y_core, dx_core) = attend(implementation, variant, dtype), attend("core", variant, dtype)
    if dtype == "float32":
        np.testing.assert_allclose(y, y_core, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, dx_core, rtol=1e-4, atol=1e-5)
    else:  # a few bfloat16 roundings apart at most
        assert np.max(np.abs(y - y_core)) <= 0.02 * np.max(np.abs(y_core))
        assert np.max(np.abs(dx - dx_core)) <= 0.02 * np.max(np.abs(dx_core))


def arch_of(**options):
    return architecture(**{**BASE, **options})


def test_auto_takes_the_core_on_a_cpu():
    implementation, reason = choose_attention(arch_of(dtype="bfloat16"), "cpu")
    assert implementation == "core" and reason == "auto on cpu: cuDNN's kernel runs on NVIDIA GPUs, not on cpu"


def test_auto_takes_cudnn_on_a_gpu_for_16_bit_floats_and_the_core_for_float32():
    assert choose_attention(arch_of(dtype="bfloat16"), "gpu") == ("cudnn", "auto on gpu")
    implementation, reason = choose_attention(arch_of(dtype="float32"), "gpu")
    assert implementation == "core" and "16-bit floats, not float32" in reason


def test_auto_takes_the_core_for_heads_cudnn_cannot_take():
    implementation, reason = choose_attention(arch_of(dtype="bfloat16", head_dim=12), "gpu")
    assert implementation == "core" and "not 12" in reason


def test_an_explicit_choice_is_taken_as_given():
    assert choose_attention(arch_of(attention="xla"), "cpu") == ("xla", "model.attention")
    assert choose_attention(arch_of(attention="core", dtype="bfloat16"), "gpu") == ("core", "model.attention")


def test_cudnn_where_it_cannot_run_is_an_error_naming_the_option():
    with pytest.raises(ValueError, match=r"^model\.attention: cudnn cannot run here: .* use auto, core or xla$"):
        choose_attention(arch_of(attention="cudnn", dtype="bfloat16"), "cpu")
    with pytest.raises(ValueError, match="16-bit floats"):
        choose_attention(arch_of(attention="cudnn"), "gpu")


def test_an_unknown_attention_is_an_error_listing_the_choices():
    with pytest.raises(ValueError, match="model.attention must be one of auto, core, xla, cudnn"):
        arch_of(attention="flash")


def test_cudnns_fallbacks_name_the_variants_it_does_not_take():
    softcapped = arch_of(attention_softcap=50.0, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert cudnn_fallbacks(arch_of()) == ["packed examples"]
    assert cudnn_fallbacks(softcapped) == [
        "packed examples",
        "soft-capped scores (model.attention_softcap)",
        "windows that differ between scanned layers",
    ]


def test_the_model_says_which_attention_runs_and_why():
    model = TransformerLM((16,), 257, num_layers=1, num_heads=2, embed_dim=32, ctx=nnx.context(0))
    assert model.attention_summary().startswith("core (auto on ")  # float32: the core on any platform


def test_attention_dropout_is_said_to_write_the_weights_out_in_training():
    model = TransformerLM((16,), 257, num_layers=1, num_heads=2, embed_dim=32, attention_dropout=0.1,
                          ctx=nnx.context(0))  # fmt: skip
    assert model.attention_summary().endswith("; xla in training (attention dropout needs the weights written out)")


def test_xla_leaves_the_backward_pass_to_autodiff_where_the_core_brings_its_own():
    x = jnp.ones((1, LENGTH, 32))
    positions = jnp.arange(LENGTH)[None]

    def program(implementation: str) -> str:
        layer = Attention(arch_of(attention=implementation), ctx=nnx.context(0))
        return str(jax.make_jaxpr(lambda x: layer(x, positions, deterministic=True, layer=0))(x))

    # the projections around it bring their own (the 2D product's), whichever attention runs
    assert "bwd=_core_backward" in program("core") and "bwd=_core_backward" not in program("xla")


@pytest.mark.parametrize("training", ["full", "lora", "lora-bf16"])
def test_the_attention_output_is_kept_once_for_the_core_and_the_out_projection(training):
    """The backward passes of the core and of the out projection (its kernel's or its adapter's gradient) both
    read the attention's output: they keep one array of it, the one the core returned under its sharding
    constraint. The out projection kept a reshaped copy of its own, and an adapter another, which the layer scan
    stacked as residuals beside the core's (68 of a SmolLM2-shaped LoRA step's 981 MiB of temporaries)."""
    options = {**BASE, "num_layers": 1, "scan_layers": False, "num_kv_heads": 2, "embed_dim": 48}  # 4 x 16 != 48
    if training != "full":
        options.update(lora={"rank": 4}, dtype="bfloat16" if training == "lora-bf16" else "float32")
    model = TransformerLM((LENGTH,), 257, ctx=nnx.context(0), **options)
    trained = nnx.LoRAParam if training != "full" else nnx.Param
    (params, rest), moduledef = model.partition(trained, ...)
    tokens = jnp.arange(2 * LENGTH).reshape(2, LENGTH) % 257

    def loss(params):
        ctx = nnx.context(dropout=0, flags={"deterministic": False})
        return jnp.mean(moduledef.merge(params, rest).metrics({"tokens": tokens}, ctx)["loss"])

    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as nnx-train's
    with jax.set_mesh(mesh), nnx.logical_axis_rules(TransformerLM.default_rules):
        backward = jax.eval_shape(lambda params: jax.vjp(loss, params)[1], params)  # what it keeps, traced
    heads = 2 * (LENGTH - 1) * 4 * 16  # [batch, length, heads, head_dim] of the inputs' positions
    kept = [r.shape for r in jax.tree.leaves(backward) if r.size == heads]
    assert len(kept) == 2, kept  # the queries, grouped for the core, and the output
