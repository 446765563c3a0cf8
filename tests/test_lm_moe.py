"""`transformer_lm` with `model.moe`: routing, the two dispatches, the load-balancing loss, dense layers, LoRA.

Equality with `transformers` (Mixtral, Qwen3-MoE) is checked against golden fixtures in test_hf_equality.py; here
the layer is checked against its definition: every token's output is the weighted sum of its top-k experts'.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_support import DEPLOYED, converted_sizes, loop_instructions

import nnx
from nnx_cli.models.transformer import TransformerLM, architecture, lora_options
from nnx_cli.models.transformer.moe import (
    MoE,
    _block_products,
    load_balancing_loss,
    route,
    router_statistics,
    sort_by_expert,
    weighted_sum,
)

SEQ_LEN, VOCAB = 16, 257
LLAMA = dict(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, mlp_dim=48, positions="rope", norm="rmsnorm",
             mlp="swiglu", bias=False, dropout=0.0)  # fmt: skip
EXPERTS = {"num_experts": 4, "top_k": 2, "mlp_dim": 24}


def build(**options) -> TransformerLM:
    """A small mixture of experts; each configuration is built once and cloned for every caller."""
    return _build(json.dumps({**LLAMA, "moe": EXPERTS, **options}, sort_keys=True)).clone()


@functools.cache
def _build(options: str) -> TransformerLM:
    return TransformerLM((SEQ_LEN,), VOCAB, **json.loads(options), ctx=nnx.context(0))


def windows(batch: int = 3, seed: int = 1) -> dict[str, jax.Array]:
    return {"tokens": jax.random.randint(jax.random.key(seed), (batch, SEQ_LEN + 1), 0, VOCAB)}


def metrics(model: TransformerLM, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    params, moduledef = model.partition()
    return jax.jit(lambda p, b: moduledef.apply(p).metrics(b, None)[0])(params, batch)


def a_layer(implementation: str, lora: dict | None = None, **moe) -> MoE:
    """One expert layer, built on its own."""
    options = {k: v for k, v in LLAMA.items() if k not in ("positions", "dropout")}
    arch = architecture(**options, head_dim=None, qkv_bias=False, qk_norm=False, norm_eps=1e-5, positions="rope",
                        rope_theta=1e4, rope_scaling=None, dropout=0.0, attention_dropout=0.0, remat="none",
                        scan_layers=False, dtype="float32", lora=lora, moe={**EXPERTS, **moe})  # fmt: skip
    return MoE(arch, implementation=implementation, ctx=nnx.context(0))


def apply(layer: MoE, x: jax.Array) -> jax.Array:
    params, moduledef = layer.partition()
    return jax.jit(lambda p, x: moduledef.apply(p)(x, deterministic=True)[0][0])(params, x)


def experts_by_definition(moe: MoE, x: jax.Array) -> jax.Array:
    """Every expert on every token, then each token's top-k outputs weighted: what the dispatch must equal."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, chosen, _ = route(tokens @ moe.router.kernel, moe.top_k, moe.normalize)
    gate = jnp.einsum("td,edf->tef", tokens, moe.gate.kernel)
    up = jnp.einsum("td,edf->tef", tokens, moe.fc.kernel)
    every = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, moe.proj.kernel)
    picked = jnp.take_along_axis(every, chosen[:, :, None], axis=1)
    return jnp.sum(picked * weights[:, :, None], axis=1).reshape(x.shape)


@pytest.mark.parametrize("implementation", ["blocks", "ragged"])
@pytest.mark.parametrize("normalize", [True, False])
def test_each_token_gets_the_weighted_sum_of_its_top_k_experts(implementation, normalize):
    layer = a_layer(implementation, normalize=normalize)
    x = jax.random.normal(jax.random.key(2), (3, 10, 32))
    np.testing.assert_allclose(apply(layer, x), experts_by_definition(layer, x), atol=1e-6)


def test_top_k_weights_are_renormalised_only_when_asked():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    weights, experts, _ = route(logits, 2, normalize=False)
    assert experts.tolist() == [[0, 1]]
    np.testing.assert_allclose(weights, [[0.5, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(route(logits, 2, normalize=True)[0], [[0.625, 0.375]], rtol=1e-6)


def test_sorted_blocks_on_cpu_and_ragged_dot_give_the_same_outputs_and_gradients():
    x = jax.random.normal(jax.random.key(3), (2, 40, 32))  # 160 assignments: several blocks per expert

    def run(implementation):
        params, moduledef = a_layer(implementation).partition(nnx.Param)

        def loss(params, x):
            y, _ = moduledef.apply(params)(x, deterministic=True)[0]
            return jnp.sum(jnp.sin(y))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    (blocks, (blocks_params, blocks_x)), (ragged, (ragged_params, ragged_x)) = run("blocks"), run("ragged")
    np.testing.assert_allclose(blocks, ragged, rtol=1e-5)
    np.testing.assert_allclose(blocks_x, ragged_x, atol=1e-6)
    for path in ragged_params:
        np.testing.assert_allclose(blocks_params[path].value, ragged_params[path].value, atol=1e-6, err_msg=path)


def test_the_cpu_blocks_backward_pass_gives_the_gradients_autodiff_gives():
    """The block dispatch's own backward pass (which keeps only its operands) against autodiff of its scan, with
    an expert no row is sent to and blocks past the last in use."""
    experts = jax.random.randint(jax.random.key(4), (40, 2), 0, 3)  # expert 3 of 4 unused
    groups, sources, _ = sort_by_expert(experts, 4, "blocks")
    assert int(groups.used) < groups.block_experts.shape[0]
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (sources.shape[0], 32))
    w = jax.random.normal(keys[1], (4, 32, 24))
    g = jax.random.normal(keys[2], (sources.shape[0], 24))
    y, backward = jax.vjp(groups.matmul, x, w)
    want, want_backward = jax.vjp(
        lambda x, w: _block_products(groups.block, x, w, groups.block_experts, groups.used), x, w
    )
    np.testing.assert_array_equal(y, want)
    (dx, dw), (want_dx, want_dw) = backward(g), want_backward(g)
    np.testing.assert_allclose(dx, want_dx, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, atol=1e-5)
    assert np.abs(np.asarray(dw[3])).max() == 0


def test_a_bfloat16_block_loop_converts_no_whole_stack_and_sums_the_kernels_gradient_in_float32():
    """The CPU's block dispatch in bfloat16, forward and backward: no step of its loops converts a whole stack
    (the rows, their products, the experts' kernels or the sum of their gradient). XLA's CPU up to JAX 0.10
    widened a bfloat16 stack to float32 and back in each step of the loop that updated it, so that the loop's
    time grew with the square of its blocks, and widened the rows and their gradients to float32 whole for the
    loop that sums the kernel's gradient. That sum is in float32, rounded once."""
    experts = jax.random.randint(jax.random.key(4), (64, 2), 0, 8)
    groups, sources, _ = sort_by_expert(experts, 8, "blocks")
    rows = sources.shape[0]
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (rows, 32)).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (8, 32, 24)).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (rows, 24)).astype(jnp.bfloat16)
    program = jax.jit(lambda x, w, g: jax.vjp(groups.matmul, x, w)[1](g))
    hlo = program.lower(x, w, g).compile(compiler_options=DEPLOYED).as_text()
    smallest = min(rows * 24, rows * 32, 8 * 32 * 24)
    assert [n for n in converted_sizes(loop_instructions(hlo)) if n >= smallest] == []
    assert re.findall(rf"f32\[{rows},(?:24|32)\]\S* convert\(", hlo) == []  # nor a float32 copy of x or g ahead

    dx, dw = program(x, w, g)
    wide = [a.astype(jnp.float32) for a in (x, w, g)]
    want_dx, want_dw = jax.vjp(lambda x, w: _block_products(groups.block, x, w, groups.block_experts, groups.used),
                               *wide[:2])[1](wide[2])  # fmt: skip
    np.testing.assert_array_equal(dw, want_dw.astype(jnp.bfloat16))  # the float32 sum, rounded once
    np.testing.assert_allclose(dx.astype(jnp.float32), want_dx, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("implementation", ["blocks", "ragged"])
def test_training_remakes_the_expert_rows_and_activation_and_keeps_the_projections(implementation, capsys):
    """In training an expert block runs its norm, the router and the experts' gate and up projections
    rematerialised, and the activation before the down projection too, as a dense block runs its MLP: the
    backward pass keeps the gate and up outputs (`[rows, mlp]`) and remakes the norm's output `[tokens,
    embed]`, the grouped rows `[rows, embed]` and the activation. The gradients are those of a pass that
    remakes nothing."""
    model = build()
    model.layers.scan_module.moe.implementation = implementation
    params, moduledef = model.partition(nnx.Param)
    batch = windows()

    def loss(params, deterministic):
        out, _ = moduledef.apply(params).metrics(batch, nnx.context(dropout=0, flags={"deterministic": deterministic}))
        return jnp.mean(out["loss"])

    jax.ad_checkpoint.print_saved_residuals(functools.partial(loss, deterministic=False), params)
    kept = [re.match(r"\w+\[([\d,]*)\]", line) for line in capsys.readouterr().out.splitlines()]
    layers = [tuple(int(d) for d in m.group(1).split(",")) for m in kept if m and m.group(1)]
    shapes = [s[1:] for s in layers if s[0] == LLAMA["num_layers"]]  # what the layer scan stacks
    tokens, embed, mlp = 3 * SEQ_LEN, LLAMA["embed_dim"], EXPERTS["mlp_dim"]
    rows = sort_by_expert(jnp.zeros((tokens, EXPERTS["top_k"]), jnp.int32), EXPERTS["num_experts"], implementation)[1]
    rows = rows.shape[0]
    assert [s for s in shapes if s in ((tokens, embed), (rows, embed))] == []
    assert [s for s in shapes if s == (rows, mlp)] == [(rows, mlp)] * 2
    train = jax.jit(jax.value_and_grad(functools.partial(loss, deterministic=False)))(params)
    plain = jax.jit(jax.value_and_grad(functools.partial(loss, deterministic=True)))(params)
    np.testing.assert_allclose(train[0], plain[0], rtol=1e-6)
    for path in plain[1]:
        np.testing.assert_allclose(train[1][path].value, plain[1][path].value, atol=1e-6, err_msg=path)


def test_the_weighted_sum_keeps_the_experts_outputs_as_they_are_and_gives_autodiffs_gradients(capsys):
    keys = jax.random.split(jax.random.key(6), 3)
    weights = jax.nn.softmax(jax.random.normal(keys[0], (12, 2)))
    outputs = jax.random.normal(keys[1], (12, 2, 32)).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (12, 32))
    y, backward = jax.vjp(weighted_sum, weights, outputs)
    want, want_backward = jax.vjp(lambda w, o: jnp.einsum("tk,tke->te", w, o.astype(jnp.float32)), weights, outputs)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    (d_weights, d_outputs), (want_weights, want_outputs) = backward(g), want_backward(g)
    assert (d_weights.dtype, d_outputs.dtype) == (jnp.float32, jnp.bfloat16)
    np.testing.assert_allclose(d_weights, want_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_outputs.astype(jnp.float32), want_outputs.astype(jnp.float32), rtol=8e-3)
    jax.ad_checkpoint.print_saved_residuals(lambda w, o: jnp.sum(weighted_sum(w, o)), weights, outputs)
    assert "f32[12,2,32]" not in capsys.readouterr().out  # autodiff kept the outputs' float32 copy


def test_the_load_balancing_loss_is_switch_transformers_over_layers():
    experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [3, 0]])
    probabilities = jax.nn.softmax(jax.random.normal(jax.random.key(4), (4, 4)))
    one = router_statistics(experts, probabilities, None)
    two = jax.tree.map(lambda a: 2 * a, one)  # two identical layers: the same loss
    fraction = np.asarray([4, 2, 1, 1]) / 4  # of the 4 tokens, how many chose each expert
    expected = 4 * np.sum(fraction * np.mean(np.asarray(probabilities), axis=0))
    np.testing.assert_allclose(load_balancing_loss(one, 4), expected, rtol=1e-6)
    np.testing.assert_allclose(load_balancing_loss(two, 4), expected, rtol=1e-6)
    uniform = router_statistics(jnp.asarray([[0, 1], [2, 3]]), jnp.full((2, 4), 0.25), None)
    np.testing.assert_allclose(load_balancing_loss(uniform, 4), 2.0)  # balanced: top_k


def test_loss_keeps_the_cross_entropy_and_trains_on_it_plus_the_weighted_aux_loss():
    model = build()
    model.aux_loss_coef = coef = 0.5
    params, moduledef = model.partition(nnx.Param)
    batch = windows()

    def metric(name, params):
        out, _ = moduledef.apply(params).metrics(batch, nnx.context(flags={"deterministic": True}))
        return jnp.mean(out[name])

    def cross_entropy(params):
        logits = moduledef.apply(params).logits(batch["tokens"][:, :-1])[0]
        targets = jax.nn.one_hot(batch["tokens"][:, 1:], logits.shape[-1])
        return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))

    @jax.jit
    def both(params):
        loss, got = jax.value_and_grad(functools.partial(metric, "loss"))(params)
        want = jax.grad(lambda p: cross_entropy(p) + coef * metric("aux_loss", p))(params)
        return loss, cross_entropy(params), got, want, jax.grad(functools.partial(metric, "aux_loss"))(params)

    loss, ce, got, want, aux = both(params)
    np.testing.assert_allclose(loss, ce, rtol=1e-6)
    assert np.abs(np.asarray(aux["layers/scan_module/moe/router/kernel"].value)).max() > 0
    for path in want:
        np.testing.assert_allclose(got[path].value, want[path].value, atol=1e-6, err_msg=path)


def test_padding_of_packed_examples_does_not_count_in_the_aux_loss():
    model = build()
    tokens = windows(1)["tokens"]
    alone = metrics(model, {"tokens": tokens[:, :12]})["aux_loss"]  # inputs: its first 11 tokens
    padded = jnp.concatenate([tokens[:, :11], jnp.zeros((1, 6), jnp.int32)], axis=1)
    segments = jnp.asarray([[1] * 11 + [0] * 6])
    batch = {"tokens": padded, "segments": segments, "positions": jnp.arange(17)[None] * (segments > 0),
             "targets": segments > 0}  # fmt: skip
    np.testing.assert_allclose(metrics(model, batch)["aux_loss"], alone, rtol=1e-5)


def test_dense_layers_among_expert_layers_are_unrolled_with_an_mlp_each():
    model = build(moe={**EXPERTS, "dense_layers": [1]}, num_layers=3)
    assert not model.scan_layers and [hasattr(b, "moe") for b in model.layers] == [True, False, True]
    assert model.layers[1].mlp.fc.kernel.shape == (32, 48) and model.layers[0].moe.fc.kernel.shape == (4, 32, 24)
    assert build().scan_layers  # alike: scanned


def test_a_sliding_window_holds_in_expert_blocks_decoded_through_its_ring_cache():
    from nnx_cli.decoding import Decoder

    params, moduledef = build(sliding_window=6).partition(nnx.Param)  # every layer slides: caches of 6 slots
    params = jax.tree.map(lambda w: 10.0 * w, params)  # logits spread as a trained model's: greedy tokens vary
    prompts = [[72, 105, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    run = Decoder(moduledef, params).generate(prompts, max_tokens=12, temperature=0).finish()
    sequences = [prompt + sample for prompt, sample in zip(prompts, run.samples)]
    padded = [s + [0] * (21 - len(s)) for s in sequences]  # one full pass for both (causal: the zeros come after)
    full = jax.jit(lambda p, t: moduledef.apply(p).logits(t)[0])(params, jnp.asarray(padded))
    for row, (prompt, sample) in enumerate(zip(prompts, run.samples)):
        assert len(sample) == 12 and len(set(sample)) > 3
        predicted = np.asarray(jnp.argmax(full[row], axis=-1))[len(prompt) - 1 : len(prompt) + 11]
        assert predicted.tolist() == sample  # 12 tokens past a window of 6: the ring kept the right keys


def test_expert_weights_carry_the_expert_axis_and_flops_count_the_routed_experts():
    model = build()
    params = model.filter(nnx.Param)
    assert params["layers/scan_module/moe/gate/kernel"].sharding == ("layers", "expert", "embed", "mlp")
    assert params["layers/scan_module/moe/proj/kernel"].sharding == ("layers", "expert", "mlp", "embed")
    experts = 2 * 3 * 4 * 32 * 24  # layers, projections, experts, embed, width
    assert model.idle_params() == experts // 2  # top 2 of 4
    body = sum(v.value.size for p, v in params.items() if p != "embedding/embedding")
    assert model.active_params() == body - experts // 2
    assert model.flops_per_token() == 6 * model.active_params() + 12 * 2 * SEQ_LEN * 32


def test_lora_adapts_attention_by_default_and_each_expert_on_request():
    assert lora_options({"rank": 2}, "swiglu", EXPERTS).targets == ("q", "k", "v", "o")  # no dense MLP to adapt
    dense_too = lora_options({"rank": 2}, "swiglu", {**EXPERTS, "dense_layers": [0]})
    assert dense_too.targets == ("q", "k", "v", "o", "gate", "up", "down")
    w = lora_options({"rank": 2, "targets": ["w1", "w2"]}, "swiglu", EXPERTS)
    assert w.targets == ("expert_gate", "expert_down")  # Mixtral's names
    model = build(lora={"rank": 2, "targets": ["q", "experts"]})
    adapters = model.filter(nnx.LoRAParam)
    experts = 2 * 3 * 4 * 32 * 24  # layers, projections, experts, embed, width
    assert model.idle_params(adapters=False) == experts // 2 < model.idle_params()  # the adapters of idle experts
    assert adapters["layers/scan_module/moe/gate/lora/a"].value.shape == (2, 4, 32, 2)  # layers, experts, in, rank
    assert adapters["layers/scan_module/moe/proj/lora/b"].value.shape == (2, 4, 2, 32)
    with pytest.raises(ValueError, match=r"this model has no projection 'gate'.*and each expert's expert_gate"):
        lora_options({"rank": 2, "targets": ["gate"]}, "swiglu", EXPERTS)


def test_expert_adapters_merge_exactly_into_each_experts_kernel():
    layer = a_layer("blocks", lora={"rank": 2, "targets": ["experts"]})
    for dense in (layer.gate, layer.fc, layer.proj):  # b starts at zero: make the update visible
        dense.lora.b = nnx.LoRAParam(jax.random.normal(jax.random.key(5), dense.lora.b.shape) * 0.1)
    x = jax.random.normal(jax.random.key(6), (2, 8, 32))
    adapted = apply(layer, x)
    for dense in (layer.gate, layer.fc, layer.proj):
        dense.kernel = nnx.Param(dense.kernel + dense.lora.delta())
        dense.lora = None
    np.testing.assert_allclose(adapted, apply(layer, x), atol=1e-5)
    assert np.abs(np.asarray(adapted) - np.asarray(apply(a_layer("blocks"), x))).max() > 1e-3  # it did adapt


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"num_experts": 2, "top_k": 3}, r"model.moe.top_k \(3\) must be at most model.moe.num_experts \(2\)"),
        ({"num_experts": 4}, r"model.moe.top_k must be a positive integer, got None"),
        ({"num_experts": 4, "top_k": 1, "dense_layers": [5]}, r"model.moe.dense_layers must list layer indices"),
        ({"num_experts": 4, "top_k": 1, "capacity": 2}, r"model.moe has unknown keys capacity"),
    ],
    ids=["top-k", "no-top-k", "dense-layers", "unknown"],
)  # fmt: skip
def test_moe_options_name_the_key_at_fault(moe, message):
    with pytest.raises(ValueError, match=message):
        TransformerLM((SEQ_LEN,), VOCAB, **{**LLAMA, "moe": moe}, ctx=nnx.context(0))


def test_experts_are_swiglu_mlps():
    with pytest.raises(ValueError, match=r"model.moe: the experts are SwiGLU MLPs; set model.mlp=swiglu"):
        TransformerLM((SEQ_LEN,), VOCAB, **{**LLAMA, "mlp": "gelu", "moe": EXPERTS}, ctx=nnx.context(0))


def _expert_gradients_temps(implementation: str) -> int:
    """XLA's temporaries for the parameters' gradient of a scanned bfloat16 mixture whose experts (float32
    parameters) hold most of its weights."""
    wide = {"num_experts": 4, "top_k": 2, "mlp_dim": 1024}
    model = TransformerLM((SEQ_LEN,), VOCAB, **{**LLAMA, "num_layers": 4, "embed_dim": 64}, moe=wide,
                          dtype="bfloat16", ctx=nnx.context(0))  # fmt: skip
    model.layers.scan_module.moe.implementation = implementation
    params, moduledef = model.partition(nnx.Param)

    def loss(params, batch):
        return jnp.mean(moduledef.apply(params).metrics(batch, None)[0]["loss"])

    program = jax.jit(jax.grad(loss)).lower(params, windows(2)).compile()
    return program.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("implementation", ["blocks", "ragged"])
def test_a_scanned_bfloat16_mixture_keeps_no_bfloat16_copy_of_its_float32_experts(implementation):
    """The experts' float32 weights are narrowed to bfloat16 inside the product and again in its backward pass:
    narrowed before it, the copy was a residual the layer scan stacked, with the float32 copies XLA made of it
    (temporaries 3.4x the experts' float32 bytes with blocks, 1.9x ragged; 1.4x and 0.9x since, and the blocks
    0.97x since their backward pass keeps no slice of a kernel per block)."""
    experts_bytes = 4 * 3 * 4 * 64 * 1024 * 4  # layers x (gate, fc, proj) x experts x 64 x 1,024, float32
    assert _expert_gradients_temps(implementation) < 1.25 * experts_bytes


@pytest.mark.parametrize("implementation", ["blocks", "ragged"])
def test_float32_experts_in_bfloat16_get_the_gradients_of_their_bfloat16_values(implementation):
    """Narrowed inside the product, a float32 expert kernel gives the values it gives stored as its bfloat16
    rounding, and the gradients to bfloat16's precision (XLA may keep the float32 product's)."""
    layer = a_layer(implementation)
    layer.gate.compute_dtype = layer.fc.compute_dtype = layer.proj.compute_dtype = jnp.bfloat16
    rounded = layer.clone()
    for dense in (rounded.gate, rounded.fc, rounded.proj):
        dense.kernel = nnx.Param(dense.kernel.astype(jnp.bfloat16))
    x = jax.random.normal(jax.random.key(3), (2, 40, 32))

    def run(layer):
        params, moduledef = layer.partition(nnx.Param)

        def loss(params):
            y, _ = moduledef.apply(params)(x, deterministic=True)[0]
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))

        return jax.jit(jax.value_and_grad(loss))(params)

    (value, grads), (want, want_grads) = run(layer), run(rounded)
    np.testing.assert_array_equal(value, want)
    for path in grads:
        got, expected = grads[path].value, want_grads[path].value
        assert got.dtype == jnp.float32, path
        np.testing.assert_allclose(got, expected.astype(jnp.float32), rtol=1e-2, atol=1e-4, err_msg=path)
