"""`transformer_lm`: layouts, remat, bfloat16, the padded vocabulary, logical axes, a 7B config, option checks."""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from xla_support import DEPLOYED

import nnx
from nnx_cli import steps
from nnx_cli.config import ModelConfig
from nnx_cli.data import DataSpec
from nnx_cli.models import MODELS, model_factory
from nnx_cli.models.transformer_lm import TransformerLM

SEQ_LEN, VOCAB = 16, 257
SMALL = dict(num_layers=2, num_heads=2, embed_dim=32, dropout=0.0)


def evaluation() -> nnx.Context:
    return nnx.context(flags={"deterministic": True})  # made where it is used: a Context belongs to its trace


def build(**options) -> TransformerLM:
    """A small model; each configuration is built once (building compiles) and cloned for every caller."""
    return _build(tuple(sorted({**SMALL, **options}.items()))).clone()


@functools.cache
def _build(options: tuple) -> TransformerLM:
    return TransformerLM((SEQ_LEN,), VOCAB, **dict(options), ctx=nnx.context(0))


def windows(batch: int = 4, seed: int = 1) -> dict[str, jax.Array]:
    return {"tokens": jax.random.randint(jax.random.key(seed), (batch, SEQ_LEN + 1), 0, VOCAB)}


@jax.jit
def _metrics(pure: nnx.Pure, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return pure.call.metrics(batch, evaluation())


def metrics(model: TransformerLM, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return _metrics(model.partition(), batch)


def test_transformer_lm_is_registered():
    assert MODELS.get("transformer_lm") is TransformerLM


def test_scanned_and_unrolled_layers_give_the_same_loss_for_the_same_weights():
    scanned, unrolled = build(scan_layers=True), build(scan_layers=False)
    stacked = scanned.filter(nnx.Param)
    moved = {}
    for path, param in stacked.items():
        if path.startswith("layers/scan_module/"):
            for i in range(SMALL["num_layers"]):
                moved[path.replace("scan_module", str(i))] = param.value[i]
        else:
            moved[path] = param.value
    target = unrolled.filter(nnx.Param)
    assert set(moved) == set(target)  # the same per-block layout
    assert all(moved[path].shape == target[path].value.shape for path in target)
    unrolled.update_state(nnx.State({path: p.replace(value=moved[path]) for path, p in target.items()}))

    batch = windows()
    np.testing.assert_allclose(metrics(scanned, batch)["loss"], metrics(unrolled, batch)["loss"], rtol=1e-6)


def test_unstack_layers_gives_the_unrolled_layout_and_the_same_logits():
    scanned = build(scan_layers=True)
    unstacked = scanned.unstack_layers()
    assert unstacked.filter(nnx.Param).keys() == build(scan_layers=False).filter(nnx.Param).keys()
    tokens = windows()["tokens"][:, :-1]
    logits = jax.jit(lambda pure, t: pure.call.logits(t))
    np.testing.assert_allclose(logits(scanned.partition(), tokens), logits(unstacked.partition(), tokens), atol=1e-5)


def _loss_and_grads(model: TransformerLM, batch: dict[str, jax.Array]):
    params, moduledef = model.partition(nnx.Param)

    def loss(params):
        return jnp.mean(moduledef.apply(params).metrics(batch, evaluation())[0]["loss"])

    step = jax.jit(jax.value_and_grad(loss)).lower(params).compile(compiler_options=DEPLOYED)
    return step(params), step.memory_analysis().temp_size_in_bytes


def test_remat_changes_memory_not_results():
    batch = {"tokens": jax.random.randint(jax.random.key(1), (32, SEQ_LEN + 1), 0, VOCAB)}
    runs = {remat: _loss_and_grads(build(remat=remat), batch) for remat in ("none", "dots", "full")}
    (loss, grads), memory = runs["none"]
    for remat in ("dots", "full"):
        (remat_loss, remat_grads), remat_memory = runs[remat]
        np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), remat_grads, grads)
        assert remat_memory < memory, (remat, remat_memory, memory)
    assert runs["full"][1] < runs["dots"][1]  # dots keeps the matmul results that full recomputes


def _text_batches(steps: int, batch: int) -> np.ndarray:
    """Windows of a first-order Markov text over 16 letters: learnable, but not down to zero loss."""
    rng = np.random.default_rng(0)
    transitions = rng.dirichlet(np.full(16, 0.3), size=16)
    text = [0]
    for _ in range(20_000):
        text.append(rng.choice(16, p=transitions[text[-1]]))
    stream = np.asarray(text, np.int32) + ord("a")
    starts = rng.integers(0, len(stream) - SEQ_LEN - 1, size=(steps, batch))
    return stream[starts[..., None] + np.arange(SEQ_LEN + 1)]


def _mean_loss(moduledef: nnx.ModuleDef, params: nnx.State, tokens: jax.Array) -> jax.Array:
    return jnp.mean(moduledef.apply(params).metrics({"tokens": tokens}, evaluation())[0]["loss"])


def _first_gradient(dtype: str, tokens: np.ndarray) -> np.ndarray:
    """The gradient of the mean loss at the initial parameters, flattened."""
    params, moduledef = build(dtype=dtype, tie_embeddings=False).partition(nnx.Param)
    grads = jax.jit(jax.grad(functools.partial(_mean_loss, moduledef)))(params, tokens)
    return np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])


def _train(dtype: str, batches: np.ndarray) -> tuple[TransformerLM, float]:
    """Adam over `batches`; returns the model and the mean loss of the last 10 steps."""
    # Untied embeddings leave the unigram plateau smoothly; tied ones wait a number of steps that small
    # rounding differences change, which would compare two points of a phase transition.
    model = build(dtype=dtype, tie_embeddings=False)
    params, moduledef = model.partition(nnx.Param)
    tx = optax.adam(1e-2)

    loss = functools.partial(_mean_loss, moduledef)

    @jax.jit
    def train(params, batches):
        def step(carry, tokens):
            params, opt_state = carry
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), value

        (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), batches)
        return params, jnp.mean(losses[-10:])

    params, final = train(params, batches)
    return moduledef.merge(params), float(final)


def test_bfloat16_computes_in_bfloat16_keeps_float32_params_and_trains_like_float32():
    batches = _text_batches(100, 16)
    model16, loss16 = _train("bfloat16", batches)
    _, loss32 = _train("float32", batches)
    assert all(p.value.dtype == jnp.float32 for p in model16.filter(nnx.Param).values())
    assert model16.logits(batches[0, :, :-1]).dtype == jnp.float32  # the loss side is float32
    hidden = jax.eval_shape(lambda: model16.embedding(jnp.zeros((1, 4), jnp.int32)))
    assert hidden.dtype == jnp.bfloat16
    # both learned more than the letter frequencies
    assert math.isfinite(loss16) and max(loss16, loss32) < 0.85 * math.log(16), (loss16, loss32)
    # Where the two runs' losses end is no measure: 100 steps at this rate cross plateaus at points that rounding
    # moves (over ten data seeds they ended 0.02% to 10% apart, bfloat16 as often lower as higher). Their first
    # gradients are: bfloat16's within 1.5% of float32's.
    g16, g32 = _first_gradient("bfloat16", batches[0]), _first_gradient("float32", batches[0])
    assert np.linalg.norm(g16 - g32) <= 0.03 * np.linalg.norm(g32)


def test_the_trainers_steps_train_and_evaluate_a_transformer_lm():
    options = {**SMALL, "tie_embeddings": False, "bits_per_byte": True}
    build = model_factory(ModelConfig(name="transformer_lm", options=options), DataSpec((SEQ_LEN,), VOCAB, "bytes"))
    tx = optax.adam(1e-2)
    moduledef, state = steps.init_state(build, tx, seed=0)
    batches = _text_batches(31, 8)
    held_out = {"tokens": batches[-1], "mask": np.ones(8, bool)}
    names = steps.check_step(moduledef, tx, "transformer_lm", jax.eval_shape(lambda: state), {"tokens": batches[0]})
    assert sorted(names) == ["accuracy", "bits_per_byte", "loss"]
    train = jax.jit(functools.partial(steps.train_step, moduledef, tx, "loss", 0))
    zeros = {k: np.float32(0.0) for k in names}
    evaluate = jax.jit(functools.partial(steps.eval_step, moduledef, 0, lambda rows: rows))
    before = evaluate(state, held_out, jnp.int32(0), zeros)
    sums = steps.empty_sums(names)
    for tokens in batches[:-1]:
        state, sums, _ = train(state, sums, {"tokens": tokens})
    after = evaluate(state, held_out, jnp.int32(0), zeros)
    assert int(sums["count"]) == 30 and int(sums["bad_step"]) == -1
    assert float(after["loss"]) < 0.8 * float(before["loss"])
    assert float(after["bits_per_byte"]) == pytest.approx(float(after["loss"]) / math.log(2), rel=1e-5)  # all bytes


def _padded_ids_dominate(model: TransformerLM) -> TransformerLM:
    """Make every padded id's logit the largest, were it not masked: h is a constant c, padded rows are 10 c."""
    direction = jnp.ones((model.embed_dim,))
    model.final_norm.scale = jnp.zeros_like(model.final_norm.scale)
    model.final_norm.bias = direction
    table = model.embedding.embedding
    model.embedding.embedding = table.at[VOCAB:].set(10.0 * direction)
    return model


def test_the_padded_vocabulary_is_masked_out_of_logits_loss_and_accuracy():
    model = _padded_ids_dominate(build())
    assert model.embedding.embedding.shape[0] == 384  # 257 padded to a multiple of 128
    batch = windows()
    logits = jax.jit(lambda pure, t: pure.call.logits(t))(model.partition(), batch["tokens"][:, :-1])
    assert int(jnp.argmax(logits, -1).max()) < VOCAB
    real = jax.nn.log_softmax(logits[..., :VOCAB], axis=-1)
    expected = -jnp.mean(jnp.take_along_axis(real, batch["tokens"][:, 1:, None], axis=-1)[..., 0], axis=-1)
    np.testing.assert_allclose(metrics(model, batch)["loss"], expected, rtol=1e-5)


def test_loss_and_accuracy_read_the_soft_capped_logits():
    capped = build(logit_softcap=1e-3)  # logits of about +-10, which a cap of 1e-3 squashes to two values
    capped.embedding.embedding = 100.0 * capped.embedding.embedding
    batch = windows()
    logits = jax.jit(lambda pure, t: pure.call.logits(t))(capped.partition(), batch["tokens"][:, :-1])[..., :VOCAB]
    assert float(jnp.max(jnp.abs(logits))) <= np.float32(1e-3)
    targets = batch["tokens"][:, 1:]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    out = metrics(capped, batch)
    np.testing.assert_allclose(out["loss"], -jnp.mean(target_logit - jax.nn.logsumexp(logits, -1), -1), rtol=1e-5)
    predicted = jnp.mean(target_logit >= jnp.max(logits, -1), axis=-1)  # targets tied at the cap count as predicted
    np.testing.assert_allclose(out["accuracy"], predicted, rtol=1e-6)
    assert float(jnp.min(out["accuracy"])) > 0.2  # about half the targets: those of positive logits (uncapped: 1/257)


def test_bits_per_byte_counts_byte_targets_only():
    model = build(bits_per_byte=True)
    tokens = np.asarray(windows()["tokens"]).copy()
    tokens[0, 1::3] = 256  # end-of-document targets in the first window
    tokens[1, 1:] = 256  # a window of nothing else
    out = metrics(model, {"tokens": jnp.asarray(tokens)})
    logits = jax.jit(lambda pure, t: pure.call.logits(t))(model.partition(), tokens[:, :-1])
    nats = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), tokens[:, 1:, None], axis=-1)[..., 0]
    is_byte = tokens[:, 1:] < 256
    for row in (0, 2):
        np.testing.assert_allclose(out["bits_per_byte"][row], nats[row][is_byte[row]].mean() / math.log(2), rtol=1e-5)
    assert out["bits_per_byte"][1] == 0.0
    np.testing.assert_allclose(out["loss"], nats.mean(-1), rtol=1e-5)  # the loss counts every target


def test_bits_per_byte_is_reported_only_when_asked():
    assert "bits_per_byte" not in metrics(build(), windows())


@pytest.mark.parametrize(
    "options",
    [
        dict(scan_layers=True),
        dict(scan_layers=False, positions="rope", norm="rmsnorm", tie_embeddings=False),
    ],
    ids=["scanned", "unrolled-rope-rmsnorm-untied"],
)
def test_every_parameter_has_logical_axes_of_its_rank(options):
    params = jax.eval_shape(lambda: build(**options).filter(nnx.Param))
    names = {"vocab", "embed", "heads", "kv", "mlp", "layers", "length"}
    for path, param in params.items():
        assert param.sharding is not None and len(param.sharding) == param.value.ndim, (path, param.sharding)
        assert set(param.sharding) <= names, (path, param.sharding)
        assert (param.sharding[0] == "layers") == path.startswith("layers/scan_module/"), (path, param.sharding)


def test_initialisation_scales_residual_projections_and_zeroes_biases():
    model = TransformerLM((SEQ_LEN,), VOCAB, num_layers=8, num_heads=2, embed_dim=64, ctx=nnx.context(0))
    params = model.filter(nnx.Param)
    std = {path: float(jnp.std(p.value)) for path, p in params.items()}
    assert std["embedding/embedding"] == pytest.approx(0.02, rel=0.05)
    assert std["layers/scan_module/mlp/fc/kernel"] == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * 8)
    assert std["layers/scan_module/mlp/proj/kernel"] == pytest.approx(residual, rel=0.05)
    assert std["layers/scan_module/attention/out/kernel"] == pytest.approx(residual, rel=0.05)
    assert all(not jnp.any(p.value) for path, p in params.items() if path.endswith("/bias") and "norm" not in path)


def test_a_7b_config_builds_under_eval_shape_in_seconds_and_counts_its_flops():
    layers, width, seq_len, vocab = 32, 4096, 2048, 32000
    start = time.perf_counter()
    params, moduledef = jax.eval_shape(
        lambda: TransformerLM(
            (seq_len,), vocab, num_layers=layers, num_heads=32, embed_dim=width, ctx=nnx.context(0)
        ).partition(nnx.Param)
    )
    assert time.perf_counter() - start < 30
    assert all(isinstance(p.value, jax.ShapeDtypeStruct) for p in params.values())  # no parameter memory
    per_layer = 12 * width**2 + 13 * width  # q, k, v, out and a 4x MLP; their biases and two norms
    non_embedding = layers * per_layer + 2 * width  # and the final norm
    total = non_embedding + (vocab + seq_len) * width
    assert sum(math.prod(p.value.shape) for p in params.values()) == total
    assert 6.5e9 < total < 7e9
    model = moduledef.merge(params)
    assert model.flops_per_token() == 6 * non_embedding + 12 * layers * seq_len * width


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(positions="alibi"), r"model\.positions must be one of learned, rope; got 'alibi'"),
        (dict(norm="batchnorm"), r"model\.norm must be one of layernorm, rmsnorm"),
        (dict(remat="some"), r"model\.remat must be one of none, full, dots"),
        (dict(dtype="float16"), r"model\.dtype must be one of float32, bfloat16"),
        (dict(embed_dim=30, num_heads=4), r"model\.embed_dim \(30\) must be a multiple of model\.num_heads \(4\)"),
        (dict(num_layers=0), r"model\.num_layers must be positive, got 0"),
        (dict(mlp_dim=0), r"model\.mlp_dim must be positive, got 0"),
        (dict(mlp_dim=10**23), r"model\.mlp_dim must be below 2\*\*31 \(no array is that wide\)"),
        (dict(head_dim=2**31), r"model\.head_dim must be below 2\*\*31"),
        (dict(dropout=1.0), r"model\.dropout is a drop probability in \[0, 1\)"),
        (dict(attention_dropout=-0.1), r"model\.attention_dropout is a drop probability"),
        (dict(positions="rope", embed_dim=6, num_heads=2), r"model\.positions rope .* must be even"),
    ],
)
def test_bad_options_name_the_model_option(options, message):
    with pytest.raises(ValueError, match=message):
        build(**options)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(sliding_window=4, layer_types=["sliding_attention"]), r"model\.layer_types must be a list of 2 entries"),
        (dict(layer_types=["sliding_attention", "local"]), r"model\.layer_types has 'local'; each entry is one of"),
        (dict(layer_types=["sliding_attention", "full_attention"]), r"but model\.sliding_window is null"),
        (dict(sliding_window=0), r"model\.sliding_window must be positive"),
        (dict(positions="rope", rotary_dim=7), r"model\.rotary_dim .* must be even and at most the head size \(16\)"),
        (dict(rope_local_theta=100.0), r"model\.rope_local_theta applies to rotary positions"),
        (dict(query_scale=-1.0), r"model\.query_scale must be null or a positive number"),
        (dict(logit_softcap=0.0), r"model\.logit_softcap must be null or a positive number"),
        (dict(positions="rope", rope_scaling={"type": "linear", "factor": 0}), r"type linear needs a positive factor"),
    ],
)
def test_bad_window_rotary_and_soft_cap_options_name_the_model_option(options, message):
    with pytest.raises(ValueError, match=message):
        TransformerLM((SEQ_LEN,), VOCAB, **{**SMALL, **options}, ctx=nnx.context(0))


def _layers_of(scanned: TransformerLM, unrolled: TransformerLM) -> TransformerLM:
    """`unrolled` with `scanned`'s weights."""
    params = scanned.unstack_layers().filter(nnx.Param)
    unrolled.update_state(params)
    return unrolled


def test_a_sliding_window_hides_the_keys_further_back_than_the_window():
    # two layers whose queries see 4 positions (themselves included) see 7 tokens back in all
    model = build(positions="rope", sliding_window=4)
    model.update_state(jax.tree.map(lambda w: 3.0 * w, model.filter(nnx.Param)))  # logits that move visibly
    tokens = windows(2)["tokens"][:, :-1]
    changed = tokens.at[:, 0].set((tokens[:, 0] + 1) % VOCAB)
    logits = jax.jit(lambda pure, t: pure.call.logits(t))
    before, after = logits(model.partition(), tokens), logits(model.partition(), changed)
    moved = jnp.abs(after - before).max(axis=(0, 2))[:VOCAB]
    assert bool(jnp.all(moved[:7] > 0)) and float(moved[7:].max()) == 0.0
    unwindowed = _layers_of(model, build(positions="rope", scan_layers=False))
    same = jnp.abs(logits(unwindowed.partition(), tokens) - before).max(axis=(0, 2))
    assert float(same[:4].max()) < 1e-5 and float(same[4:].min()) > 1e-3  # the window ends at the 5th position


def test_packed_examples_with_a_sliding_window_compute_as_each_alone():
    model = build(positions="rope", sliding_window=3, layer_types=("sliding_attention", "full_attention"))
    tokens = windows(1)["tokens"][:, :SEQ_LEN]
    cut = 9
    segments = jnp.where(jnp.arange(SEQ_LEN) < cut, 1, 2)[None]
    positions = jnp.where(jnp.arange(SEQ_LEN) < cut, jnp.arange(SEQ_LEN), jnp.arange(SEQ_LEN) - cut)[None]
    packed = jax.jit(lambda pure, t, p, s: pure.call.logits(t, positions=p, segments=s))(
        model.partition(), tokens, positions, segments
    )
    alone = jax.jit(lambda pure, t: pure.call.logits(t))
    first, second = alone(model.partition(), tokens[:, :cut]), alone(model.partition(), tokens[:, cut:])
    np.testing.assert_allclose(packed[:, :cut], first, atol=1e-5)
    np.testing.assert_allclose(packed[:, cut:], second, atol=1e-5)


def test_flops_per_token_count_a_sliding_layers_window_not_the_sequence():
    full = build(positions="rope")
    mixed = build(positions="rope", sliding_window=3, layer_types=("sliding_attention", "full_attention"))
    width = SMALL["embed_dim"]
    assert mixed.active_params() == full.active_params()
    assert full.flops_per_token() - mixed.flops_per_token() == 12 * (SEQ_LEN - 3) * width
    wide = build(positions="rope", sliding_window=10 * SEQ_LEN)  # a window past the sequence is the sequence
    assert wide.flops_per_token() == full.flops_per_token()


def test_scanned_layers_of_both_kinds_compute_as_unrolled_ones():
    options = dict(positions="rope", sliding_window=3, layer_types=("sliding_attention", "full_attention"),
                   rope_local_theta=100.0, norm="gemma_rmsnorm", mlp="geglu", post_norms=True, qk_norm=True,
                   attention_softcap=2.0, logit_softcap=5.0, scale_embeddings=True, query_scale=8.0,
                   rotary_dim=8)  # fmt: skip
    scanned = build(**options)
    unrolled = _layers_of(scanned, build(**options, scan_layers=False))
    tokens = windows()["tokens"][:, :-1]
    logits = jax.jit(lambda pure, t: pure.call.logits(t))
    np.testing.assert_allclose(logits(scanned.partition(), tokens), logits(unrolled.partition(), tokens), atol=1e-5)
    batch = windows()
    np.testing.assert_allclose(metrics(scanned, batch)["loss"], metrics(unrolled, batch)["loss"], rtol=1e-6)


def test_gemma_norms_scale_by_one_plus_their_weight_and_start_as_the_identity():
    model = build(positions="rope", norm="gemma_rmsnorm", qk_norm=True, post_norms=True, scan_layers=False)
    scales = {path: p.value for path, p in model.filter(nnx.Param).items() if path.endswith("/scale")}
    assert len(scales) == 1 + 2 * 6 and all(not jnp.any(v) for v in scales.values())  # zeros: 1 + 0
    norm = model.layers[0].attention_norm
    x = jax.random.normal(jax.random.key(0), (2, 32))
    norm.scale = jnp.full((32,), 0.5)
    expected = x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + norm.epsilon) * 1.5
    np.testing.assert_allclose(norm(x), expected, rtol=1e-6)


def test_input_shape_must_be_one_window_length():
    with pytest.raises(ValueError, match=r"input_shape must be \[seq_len\], got \[8, 8, 1\]"):
        TransformerLM((8, 8, 1), VOCAB, ctx=nnx.context(0))


def test_vocab_size_overrides_the_tokenizer_vocabulary():
    params = jax.eval_shape(lambda: build(vocab_size=1000).filter(nnx.Param))
    assert params["embedding/embedding"].value.shape == (1024, 32)  # 1000 padded to a multiple of 128


def test_dropout_makes_training_forward_passes_random_and_eval_deterministic():
    model = build(dropout=0.5, attention_dropout=0.5)
    batch = windows()

    @functools.partial(jax.jit, static_argnames="training")
    def loss(pure: nnx.Pure, key: jax.Array, training: bool) -> jax.Array:
        return pure.call.metrics(batch, nnx.context(dropout=key, flags={"deterministic": not training}))["loss"]

    train = [loss(model.partition(), jax.random.key(i), training=True) for i in (0, 1)]
    assert not np.allclose(train[0], train[1])
    evals = [loss(model.partition(), jax.random.key(i), training=False) for i in (0, 1)]
    np.testing.assert_array_equal(evals[0], evals[1])


@pytest.mark.usefixtures("on_the_cpu")
def test_scanned_blocks_keep_16_bit_residuals_as_bits_on_a_cpu_with_the_same_gradients(monkeypatch):
    """On a CPU whose XLA widens a bfloat16 stack to float32 (up to JAX 0.10) a scanned block's bfloat16 residuals
    are stacked as uint16: the loss and every gradient are bitwise those of the plain call, and the step's
    temporaries are smaller; where XLA stacks bfloat16 as it is (a GPU, the CPU from JAX 0.11 on) they are
    not, and nothing is packed there. (On the CPU device wherever the suite runs.)"""
    from nnx_cli.models.transformer import block
    from nnx_cli.models.transformer.residuals import widens_bfloat16

    model = build(dtype="bfloat16", dropout=0.1, num_layers=4, embed_dim=64)
    params, moduledef = model.partition(nnx.Param)
    batch = windows(batch=8)

    def loss(params, key):
        ctx = nnx.context(dropout=key, flags={"deterministic": False})
        return jnp.mean(moduledef.apply(params).metrics(batch, ctx)[0]["loss"])

    def run(pack: bool):
        monkeypatch.setattr(block, "packs", lambda: pack)
        step = jax.jit(jax.value_and_grad(loss)).lower(params, jax.random.key(3)).compile(compiler_options=DEPLOYED)
        return step(params, jax.random.key(3)), step.memory_analysis().temp_size_in_bytes

    (loss_packed, grads_packed), packed_bytes = run(True)
    (loss_plain, grads_plain), plain_bytes = run(False)
    np.testing.assert_array_equal(loss_packed, loss_plain)
    jax.tree.map(np.testing.assert_array_equal, grads_packed, grads_plain)
    assert (packed_bytes < plain_bytes) == widens_bfloat16(), (packed_bytes, plain_bytes)
