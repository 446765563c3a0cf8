"""Decoding with a key-value cache: equal to full passes, seeded sampling, stopping, one compilation, UTF-8 text."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_support import device_flags
from xla_support import DEPLOYED

import nnx
from nnx_cli import decoding
from nnx_cli.decoding import Decoder, Utf8Decoder, decode_bytes, generate, sample_tokens
from nnx_cli.errors import UserError
from nnx_cli.models import MLPClassifier
from nnx_cli.models.transformer.loss import head_logits
from nnx_cli.models.transformer.residuals import packs
from nnx_cli.models.transformer_lm import TransformerLM

SEQ_LEN, VOCAB = 32, 257
SMALL = dict(num_layers=2, num_heads=2, embed_dim=32, dropout=0.0)
PROMPTS = [[72, 105, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9]]  # different lengths in one batch


@functools.cache
def _model(options: tuple) -> TransformerLM:
    return TransformerLM((SEQ_LEN,), VOCAB, **dict(options), ctx=nnx.context(0))


def params_and_def(**options) -> nnx.Pure:
    """`(params, moduledef)` of a small model, built once per configuration (building compiles)."""
    return _model(tuple(sorted({**SMALL, **options}.items()))).partition(nnx.Param)


def lively(params: nnx.State) -> nnx.State:
    """Weights x10: logits spread like a trained model's (std ~10) and greedy tokens vary.

    At its initial scale a tied-embedding model's output is dominated by the input token's own embedding, so
    greedy decoding repeats the prompt's last token and agreeing with a full pass would prove little.
    """
    return jax.tree.map(lambda w: 10.0 * w, params)


@functools.cache
def decoder(**options) -> Decoder:
    params, moduledef = params_and_def(**options)
    return Decoder(moduledef, params)


def full_pass_argmax(moduledef: nnx.ModuleDef, params: nnx.State, sequence: list[int]) -> np.ndarray:
    """The argmax after each token of `sequence`, from one forward pass without a cache."""
    logits = jax.jit(lambda p, t: moduledef.apply(p).logits(t)[0])(params, jnp.asarray([sequence]))
    return np.asarray(jnp.argmax(logits[0], axis=-1))


@pytest.mark.parametrize(
    "options, unstack",
    [
        (dict(scan_layers=True), True),
        (dict(scan_layers=True), False),  # the cache stacked along `layers`, decoded through nnx.Scan
        (dict(scan_layers=False), True),
        (dict(positions="rope", norm="rmsnorm"), True),
        (dict(positions="rope", norm="rmsnorm", sliding_window=6), True),
        (dict(positions="rope", sliding_window=6, layer_types=("sliding_attention", "full_attention"),
              rope_local_theta=100.0), False),
        (dict(positions="rope", norm="gemma_rmsnorm", mlp="geglu", sliding_window=6, qk_norm=True, post_norms=True,
              layer_types=("full_attention", "sliding_attention"), query_scale=12.0, attention_softcap=5.0,
              logit_softcap=5.0, scale_embeddings=True, rotary_dim=8, tie_embeddings=False, scan_layers=False), True),
    ],
    ids=["scanned", "scanned-stacked-cache", "unrolled", "rope", "window", "window-layers-differ-stacked-cache",
         "gemma-options-unrolled"],
)  # fmt: skip
def test_greedy_decoding_equals_the_argmax_of_a_full_forward_pass(options, unstack):
    params, moduledef = params_and_def(**options)
    params = lively(params)
    run = Decoder(moduledef, params, unstack_layers=unstack).generate(PROMPTS, max_tokens=24, temperature=0).finish()
    for prompt, sample in zip(PROMPTS, run.samples):
        assert len(set(sample)) > 5
        predicted = full_pass_argmax(moduledef, params, (prompt + sample)[:SEQ_LEN])[len(prompt) - 1 :]
        compared = min(len(predicted), len(sample))  # predicted[i] is the argmax for sample[i]
        assert compared >= 20
        assert predicted[:compared].tolist() == sample[:compared]


def test_a_sliding_layers_cache_holds_its_window_and_a_full_layers_every_position():
    types = ("sliding_attention", "full_attention")
    params, moduledef = params_and_def(positions="rope", sliding_window=6, layer_types=types, scan_layers=False)
    model = moduledef.merge(params)
    model.init_cache(2, 64)
    slots = [block.attention.cached_value.shape[2] for block in model.layers]
    assert slots == [6, 64]  # a ring of the window's keys: memory stops growing with the context
    params, moduledef = params_and_def(positions="rope", sliding_window=6)  # scanned, every layer sliding
    every_layer = moduledef.merge(params)
    every_layer.init_cache(2, 64)
    attention = every_layer.layers.scan_module.attention
    assert attention.cached_value.shape == (2, 2, 2, 6, 16)  # [layers, batch, kv heads, slots, head_dim]
    assert attention.cached_key.shape == (2, 2, 2, 16, 6)  # keys transposed: [..., head_dim, slots]


def test_bfloat16_cached_logits_agree_with_a_full_pass_to_1_percent_of_their_spread():
    params, moduledef = params_and_def(dtype="bfloat16")
    params = lively(params)
    sequence = jax.random.randint(jax.random.key(3), (2, SEQ_LEN), 0, VOCAB)
    prompt = 5

    model = moduledef.merge(params)
    model.init_cache(2, SEQ_LEN)
    (cache, rest), cachedef = model.partition(nnx.Cache, ...)

    @jax.jit
    def prefill(cache, rest, tokens):
        model = cachedef.merge(cache, rest)
        return model.prefill(tokens, jnp.full((2,), prompt)), model.filter(nnx.Cache)

    @jax.jit  # one program for every position, as a decoder runs it
    def decode(cache, rest, tokens, position):
        model = cachedef.merge(cache, rest)
        return model.decode(tokens, jnp.full((2,), position)), model.filter(nnx.Cache)

    first, cache = prefill(cache, rest, sequence[:, :prompt])
    logits = [first]
    for i in range(prompt, SEQ_LEN):
        step, cache = decode(cache, rest, sequence[:, i], i)
        logits.append(step)
    cached = jnp.stack(logits, axis=1)[..., :VOCAB]
    full = jax.jit(lambda p, t: moduledef.apply(p).logits(t)[0][..., :VOCAB])(params, sequence)[:, prompt - 1 :]
    assert float(jnp.max(jnp.abs(cached - full))) <= 0.01 * float(jnp.std(full))


def test_one_row_at_a_time_decodes_to_the_argmax_of_a_full_forward_pass():
    params, moduledef = params_and_def(scan_layers=False)
    params = lively(params)
    for prompt in PROMPTS:  # batch 1: the tied head is read as one row against the table
        sample = Decoder(moduledef, params).generate([prompt], max_tokens=16, temperature=0).finish().samples[0]
        predicted = full_pass_argmax(moduledef, params, prompt + sample)[len(prompt) - 1 :]
        assert len(set(sample)) > 5
        assert predicted[: len(sample)].tolist() == sample


@pytest.mark.parametrize("rows,quantize", [(1, None), (3, None), (3, {"type": "bfloat16"})])
def test_the_tied_head_read_in_chunks_gives_the_logits_of_the_whole_table(rows, quantize):
    """Each logit is the same dot product over the embedding either way, equal to the last bit or nearly: one row
    against a chunk or the whole float32 table is a matrix-vector product, which some XLA versions (JAX 0.10.0,
    0.12) vectorise by the number of rows it reads, a unit in the last place or two apart. Also for a 16-bit base's
    table, which the chunks slice as its bits on a CPU that widens bfloat16."""
    model = TransformerLM((8,), 40_000, num_layers=1, num_heads=2, embed_dim=32, dropout=0.0, quantize=quantize,
                          ctx=nnx.context(0))  # fmt: skip
    h = jax.random.normal(jax.random.key(1), (rows, 1, 32))  # 40064 padded ids: two chunks, the last overlapping
    params, moduledef = model.partition(nnx.Param)
    chunked = jax.jit(lambda p, h: moduledef.merge(p)._last_logits(h))(params, h)
    whole = jax.jit(lambda p, h: whole_table_logits(moduledef.merge(p), h)[:, 0])(params, h)
    scale = float(jnp.max(jnp.abs(whole[:, : model.vocab_size])))  # rows read wrongly would be off by about this
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5 * scale)


def whole_table_logits(model: TransformerLM, h: jax.Array) -> jax.Array:
    """The logits of the final hidden states `h` as one product over the whole tied table (converted whole to
    `h`'s dtype)."""
    spec = {"tied": True, "vocab_size": model.vocab_size, "softcap": model.logit_softcap}
    return head_logits(model.final_norm(h), model.embedding.embedding, **spec)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("options", [{"quantize": {"type": "bfloat16"}}, {"dtype": "bfloat16"}],
                         ids=["bfloat16-table-in-float32", "float32-table-in-bfloat16"])  # fmt: skip
def test_a_full_pass_reads_a_table_stored_in_another_dtype_a_chunk_at_a_time(options):
    """A 16-bit base's tied table read in float32 (a bitsandbytes directory at its default `model.dtype`, as
    `nnx-eval` and the harness run it), or a float32 table in bfloat16: `logits` takes the table a chunk of rows
    at a time, each converted alone, with no converted copy of the whole table, and gives the logits of that
    copy bit for bit."""
    model = TransformerLM((8,), 40_000, num_layers=1, num_heads=2, embed_dim=256, dropout=0.0, ctx=nnx.context(0),
                          **options)  # fmt: skip
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 40_000)
    params, moduledef = model.partition(nnx.Param)
    logits = jax.jit(lambda p, t: moduledef.merge(p).logits(t))
    compiled = logits.lower(params, tokens).compile(compiler_options=DEPLOYED)
    table = model.embedding.embedding
    computed = jnp.float32 if table.dtype == jnp.bfloat16 else jnp.bfloat16
    assert compiled.memory_analysis().temp_size_in_bytes < table.size * jnp.dtype(computed).itemsize  # a copy
    whole = jax.jit(lambda p, t: whole_table_logits(moduledef.merge(p), moduledef.merge(p)._hidden(t)[0]))
    np.testing.assert_array_equal(compiled(params, tokens), whole(params, tokens))


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("rows", [1, 3])
def test_a_bfloat16_tied_head_is_multiplied_as_stored_when_decoding(rows):
    """A 16-bit base's table against bfloat16 rows: one product over the whole table as stored (XLA's CPU
    multiplies bfloat16 by bfloat16 into float32 without widening either; one row is repeated, since it widens a
    matrix-vector product's matrix), not the float32 chunks, whose slices of a bfloat16 table need its bits, a
    copy of the table in every decoding step. The logits of the float32 product of the same numbers."""
    model = TransformerLM((8,), 40_000, num_layers=1, num_heads=2, embed_dim=32, dropout=0.0, dtype="bfloat16",
                          quantize={"type": "bfloat16"}, ctx=nnx.context(0))  # fmt: skip
    h = jax.random.normal(jax.random.key(1), (rows, 1, 32), jnp.bfloat16)
    params, moduledef = model.partition(nnx.Param)
    compiled = (
        jax.jit(lambda p, h: moduledef.merge(p)._last_logits(h)).lower(params, h).compile(compiler_options=DEPLOYED)
    )
    table = model.embedding.embedding
    rows_in = model.final_norm(h[:, 0]).astype(jnp.float32)
    expected = (rows_in @ table.astype(jnp.float32).T)[:, :40_000]
    np.testing.assert_allclose(compiled(params, h)[:, :40_000], expected, rtol=1e-5, atol=1e-5)
    assert compiled.memory_analysis().temp_size_in_bytes < table.size * 2  # the table's bytes


def decode_step_temporaries(decoder: Decoder) -> int:
    """XLA's temporaries of `decoder`'s batch-1 decoding step, on the leaves it holds."""
    model = decoder.moduledef.merge(decoder.params)
    model.init_cache(1, SEQ_LEN)
    (_, cache), cachedef = model.partition(nnx.Param, nnx.Cache)
    step = jax.jit(lambda c, leaves: cachedef.merge(decoding.from_leaves(decoder._layout, leaves), c).decode(
        jnp.asarray([1]), jnp.asarray([3])))  # fmt: skip
    return step.lower(cache, decoder._leaves).compile(compiler_options=DEPLOYED).memory_analysis().temp_size_in_bytes


@pytest.mark.usefixtures("on_the_cpu")
def test_a_decoder_holds_a_bfloat16_table_read_wider_as_its_bits_and_its_step_copies_no_table():
    """A 16-bit base's tied table against float32 rows (`model.dtype: float32`, a bitsandbytes directory's
    default): the head slices it in chunks and the lookup gathers from it, as bits on a CPU that widens bfloat16
    (up to JAX 0.10). Given the table in bfloat16, each step converted it to its bits, a copy of the table; the
    decoder holds the bits, in the table's own memory (from JAX 0.11 on, the table as it is), and decodes the
    tokens of a full pass. Against bfloat16 rows the head multiplies the
    table as stored: that decoder holds it in bfloat16 (given its bits, the step converted it back whole)."""
    options = {**SMALL, "embed_dim": 256}  # a table of 20 MB, five of the head's 4 MiB float32 chunks
    model = TransformerLM((SEQ_LEN,), 40_000, quantize={"type": "bfloat16"}, ctx=nnx.context(0), **options)
    params, moduledef = model.partition(nnx.Param)
    params = lively(params)
    decoder = Decoder(moduledef, params)
    tables = [v.value for path, v in decoder.params.items() if path.endswith("/embedding")]  # tokens, positions
    bits = [x for x in decoder._leaves if x.dtype == jnp.uint16]
    assert {t.dtype for t in tables} == {jnp.dtype(jnp.bfloat16)} and len(tables) == 2
    if packs():
        assert len(bits) == 2 and {b.unsafe_buffer_pointer() for b in bits} == {
            t.unsafe_buffer_pointer() for t in tables
        }
    else:  # JAX 0.11 on: the tables as they are
        assert not bits and {t.unsafe_buffer_pointer() for t in tables} <= {
            x.unsafe_buffer_pointer() for x in decoder._leaves
        }
    table_bytes = decoder.params["embedding/embedding"].value.nbytes
    assert decode_step_temporaries(decoder) < table_bytes / 2

    prompt = PROMPTS[0]
    (sample,) = decoder.generate([prompt], max_tokens=12, temperature=0).finish().samples
    assert len(set(sample)) > 5
    assert full_pass_argmax(moduledef, params, prompt + sample)[len(prompt) - 1 : -1].tolist() == sample

    narrow = TransformerLM((SEQ_LEN,), 40_000, quantize={"type": "bfloat16"}, dtype="bfloat16", ctx=nnx.context(0),
                           **options)  # fmt: skip
    decoder = Decoder(*reversed(narrow.partition(nnx.Param)))
    assert not [x for x in decoder._leaves if x.dtype == jnp.uint16]
    assert decode_step_temporaries(decoder) < table_bytes / 2


@pytest.mark.parametrize("options", [dict(positions="learned"), dict(tie_embeddings=False, positions="rope")])
def test_decoding_holds_a_bfloat16_models_float32_weights_rounded_once_with_the_same_logits(options):
    """`model.dtype: bfloat16` over float32 parameters: the decoder holds the kernels and embedding tables in
    bfloat16, rounded once (each step rounded them all again), and decodes the very same logits."""
    model = TransformerLM((SEQ_LEN,), VOCAB, ctx=nnx.context(0), **{**SMALL, "dtype": "bfloat16", **options})
    model.update_state(lively(model.filter(nnx.Param)))
    held = model.in_compute_dtype()
    assert model.layers.scan_module.mlp.fc.kernel.dtype == jnp.float32  # the original untouched
    params = held.filter(nnx.Param).items()
    rounded = {path for path, v in params if path.endswith(("/kernel", "/embedding")) and v.value.dtype == jnp.bfloat16}
    assert rounded == {path for path, _ in params if path.endswith(("/kernel", "/embedding"))} and rounded
    params, moduledef = model.partition(nnx.Param)
    held_by_decoder = [
        v.value.dtype for path, v in Decoder(moduledef, params, unstack_layers=False).params.items() if path in rounded
    ]
    assert set(held_by_decoder) == {jnp.dtype(jnp.bfloat16)} and len(held_by_decoder) == len(rounded)

    def prefill_and_decode(model):
        model = model.unstack_layers()
        model.init_cache(2, SEQ_LEN)
        (cache, rest), cachedef = model.partition(nnx.Cache, ...)

        def run(cache, rest):
            model = cachedef.merge(cache, rest)
            first = model.prefill(jnp.asarray([[5, 6, 7], [8, 9, 0]]), jnp.asarray([3, 2]))
            return first, model.decode(jnp.asarray([1, 2]), jnp.asarray([3, 2]))

        return jax.jit(run)(cache, rest)

    for ours, theirs in zip(prefill_and_decode(held), prefill_and_decode(model), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    plain = TransformerLM((SEQ_LEN,), VOCAB, ctx=nnx.context(0), **SMALL)
    assert plain.in_compute_dtype() is plain  # float32: nothing to round


_SHARDED = textwrap.dedent("""
    import json, jax, nnx
    from nnx_cli.decoding import Decoder
    from nnx_cli.models.transformer_lm import TransformerLM

    model = TransformerLM((32,), 257, num_layers=2, num_heads=4, embed_dim=64, dropout=0.0, ctx=nnx.context(0))
    params, moduledef = model.partition(nnx.Param)
    params = jax.tree.map(lambda w: 10.0 * w, params)
    prompts = [[72, 105, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    one_device = Decoder(moduledef, params).generate(prompts, max_tokens=12, temperature=0).finish().samples
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as nnx-train's
    rules = TransformerLM.default_rules
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        layout = nnx.spmd.logical_to_mesh_sharding(nnx.get_partition_spec(params), mesh, rules)
        sharded = jax.device_put(params, layout)
        samples = Decoder(moduledef, sharded).generate(prompts, max_tokens=12, temperature=0).finish().samples
    kernel = sharded["layers/scan_module/mlp/fc/kernel"].value
    print("RESULTS" + json.dumps({"same": samples == one_device, "shards": len(kernel.sharding.device_set)}))
""")


def test_parameters_sharded_over_a_mesh_by_the_default_rules_decode_like_one_device():
    env = {**os.environ, "XLA_FLAGS": device_flags(8), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS"))[7:])
    assert results == {"same": True, "shards": 8}


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others():
    first, again, other = (
        decoder().generate(PROMPTS, max_tokens=16, temperature=1.0, seed=seed).finish().samples for seed in (0, 0, 1)
    )
    assert first == again
    assert first != other


def test_a_seed_may_be_given_as_its_key():
    as_int = decoder().generate(PROMPTS, max_tokens=6, seed=3).finish().samples
    assert decoder().generate(PROMPTS, max_tokens=6, seed=jax.random.key(3)).finish().samples == as_int
    assert decoder().generate(PROMPTS, max_tokens=6, seed=np.int64(3)).finish().samples == as_int


def test_a_batch_of_samples_equals_single_runs_with_their_sample_keys():
    options = dict(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    batched = decoder().generate([PROMPTS[1]] * 4, **options).finish().samples
    singles = [decoder().generate([PROMPTS[1]], first_sample=i, **options).finish().samples[0] for i in range(4)]
    assert batched == singles
    assert len({tuple(s) for s in batched}) > 1  # the samples differ from each other


def test_generation_that_fills_the_context_stops_truncated():
    prompt = list(range(1, 21))
    run = decoder().generate([prompt], max_tokens=100, temperature=1.0).finish()
    assert len(prompt) + len(run.samples[0]) == SEQ_LEN + 1  # the last token is drawn from a full context
    assert run.stop_reasons == ["context"] and run.truncated == [True]


def test_rotary_positions_generate_past_the_training_context():
    run = decoder(positions="rope").generate([list(range(1, 21))], max_tokens=40, temperature=1.0).finish()
    assert len(run.samples[0]) == 40
    assert run.stop_reasons == ["max_tokens"] and run.truncated == [False]


def test_the_end_of_document_token_stops_a_sample_and_is_left_out():
    drawn = decoder().generate(PROMPTS[:1], max_tokens=12, seed=5).finish().samples[0]
    index = next(i for i, token in enumerate(drawn) if i > 0 and token not in drawn[:i])  # its first appearance
    run = decoder().generate(PROMPTS[:1], max_tokens=12, seed=5, end_of_document=drawn[index]).finish()
    assert run.samples[0] == drawn[:index]
    assert run.stop_reasons == ["end_of_document"] and run.truncated == [False]


def test_tokens_are_yielded_as_they_are_drawn():
    run = decoder().generate(PROMPTS, max_tokens=5, temperature=1.0)
    steps = list(run)
    assert len(steps) == 5 and all(len(step) == len(PROMPTS) for step in steps)
    assert [[step[b] for step in steps] for b in range(len(PROMPTS))] == run.samples


def test_the_decode_step_compiles_once_for_every_token_and_prompt_in_a_bucket():
    params, moduledef = params_and_def(num_heads=4)  # a configuration no other test compiles
    before = dict(decoding.trace_counts)
    model = Decoder(moduledef, params)
    first = model.generate([[1, 2, 3]], max_tokens=20, temperature=0.7, seed=0).finish()
    assert decoding.trace_counts["decode"] - before.get("decode", 0) == 1  # the first step's inputs included
    second = model.generate([[9, 8, 7, 6, 5, 4]], max_tokens=20, temperature=1.3, top_k=5, seed=1).finish()
    assert len(first.samples[0]) == len(second.samples[0]) == 20
    assert decoding.trace_counts["decode"] - before.get("decode", 0) == 2  # one per top_k on/off, not per token
    assert decoding.trace_counts["prefill"] - before.get("prefill", 0) == 2
    model.generate([[5]], max_tokens=20, temperature=0.5, top_k=3, seed=2).finish()
    assert decoding.trace_counts["decode"] - before.get("decode", 0) == 2


def test_the_decode_step_compiles_once_for_weights_placed_on_a_mesh():
    """Weights placed with a sharding (as a restored or harness-loaded model's are): the first decode step's
    inputs come out of the jitted prefill, so the step does not compile again for the second token."""
    params, moduledef = params_and_def(num_heads=2, num_kv_heads=1)  # a configuration no other test compiles
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    before = dict(decoding.trace_counts)
    run = Decoder(moduledef, params).generate([[1, 2, 3], [4, 5]], max_tokens=6, temperature=0).finish()
    assert [len(s) for s in run.samples] == [6, 6]
    assert decoding.trace_counts["decode"] - before.get("decode", 0) == 1


def test_padded_vocabulary_ids_are_never_sampled():
    params, moduledef = params_and_def()
    model = moduledef.merge(params).clone()
    model.final_norm.scale = jnp.zeros_like(model.final_norm.scale)  # every position's output is one vector, c
    model.final_norm.bias = jnp.ones_like(model.final_norm.bias)
    model.embedding.embedding = model.embedding.embedding.at[VOCAB:].set(10.0)  # padded logits 10 |c|^2, were they real
    params, moduledef = model.partition(nnx.Param)
    for temperature in (0.0, 1.0, 5.0, 1e30):  # 1e30 brought the padded rows' -1e30 to -1, within the noise
        run = generate(moduledef, params, PROMPTS, max_tokens=8, temperature=temperature).finish()
        assert all(0 <= token < VOCAB for sample in run.samples for token in sample)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(512))
    padded = jnp.broadcast_to(jnp.array([0.0, 1.0, -1e30, -1e30]), (512, 4))
    for options in ({}, {"top_k": 3}, {"top_p": 0.999}):
        drawn = set(np.asarray(sample_tokens(padded, keys, 0, temperature=1e30, **options)).tolist())
        assert drawn == {0, 1}, options


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(512))
    logits = jnp.broadcast_to(jnp.arange(10.0), (512, 10))
    top_k = set(np.asarray(sample_tokens(logits, keys, 0, top_k=3)).tolist())
    assert top_k == {7, 8, 9}
    probs = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    top_p = set(np.asarray(sample_tokens(jnp.broadcast_to(probs, (512, 4)), keys, 0, top_p=0.7)).tolist())
    assert top_p == {0, 1}  # 0.5 < 0.7 needs the second; 0.8 covers it
    assert set(np.asarray(sample_tokens(logits, keys, 0, temperature=0)).tolist()) == {9}


def test_an_empty_prompt_is_a_user_error():
    with pytest.raises(UserError, match="prompt 1 is empty"):
        decoder().generate([[1], []], max_tokens=4)


def test_a_prompt_longer_than_the_context_is_a_user_error():
    with pytest.raises(UserError, match=r"prompt 0 has 33 tokens, more than the model's context of 32"):
        decoder().generate([[1] * 33], max_tokens=4)


def test_token_ids_outside_the_vocabulary_are_a_user_error():
    with pytest.raises(UserError, match=r"outside the vocabulary \[0, 257\): \[300\]"):
        decoder().generate([[1, 300]], max_tokens=4)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(max_tokens=4, temperature=-1.0), "temperature must be a finite number >= 0"),
        (dict(max_tokens=4, temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(max_tokens=4, top_k=-2), "top_k must be >= 0"),
        (dict(max_tokens=4, top_p=0.0), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_options_are_user_errors(options, message):
    with pytest.raises(UserError, match=message):
        decoder().generate(PROMPTS, **options)


def test_a_model_without_a_cache_is_a_user_error():
    params, moduledef = MLPClassifier((4,), 3, ctx=nnx.context(0)).partition(nnx.Param)
    with pytest.raises(UserError, match="MLPClassifier is not a language model with a key-value cache"):
        Decoder(moduledef, params)


def test_utf8_text_holds_back_an_unfinished_character():
    text = Utf8Decoder()
    encoded = list("né😀".encode())
    assert text.decode(encoded[:2]) == "n"  # 'n' and the first byte of 'é'
    assert text.decode(encoded[2:4]) == "é"  # and the first of the emoji
    assert text.decode(encoded[4:6]) == ""
    assert text.decode([encoded[6], None]) + text.flush() == "😀"


def test_utf8_text_replaces_invalid_bytes():
    assert decode_bytes([0x61, 0xFF, 0x62]) == "a\ufffdb"
    assert decode_bytes(list("é".encode())[:1]) == "\ufffd"  # cut off at the end
