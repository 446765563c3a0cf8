"""The head and the cross-entropy computed in chunks of positions or in blocks of the vocabulary
(`models/transformer/loss.py`) equal the whole logits' loss, accuracy and gradients; the model, DPO and GRPO read
their losses through it.

Either split is forced on small shapes by passing `chunk` or `block`, or, through the model, by setting
`loss.CHUNK_BYTES` (by default the platform's, `loss.chunk_bytes`) and choosing `loss.blocks_apply`'s answer (a
CPU takes vocabulary blocks unless a mesh shards the vocabulary).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from xla_support import DEPLOYED, converted_sizes, loop_instructions

import nnx
from nnx_cli import steps
from nnx_cli.models.transformer import TransformerLM
from nnx_cli.models.transformer import loss as loss_module
from nnx_cli.models.transformer.dense import as_stored, sliceable
from nnx_cli.models.transformer.loss import block_rows, blocks_apply, chunk_length, is_argmax, token_cross_entropy
from nnx_cli.objectives import dpo, grpo

BATCH, LENGTH, EMBED, VOCAB, REAL = 2, 11, 16, 256, 250  # 11 positions: chunks of 4 leave a ragged last one


def normal(shape, seed, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def problem(tied: bool, dtype=jnp.float32):
    """Hidden states, a head (table or kernel) and targets, a third of them the argmax of their row."""
    h = normal((BATCH, LENGTH, EMBED), 0).astype(dtype)
    head = normal((VOCAB, EMBED) if tied else (EMBED, VOCAB), 1, 0.5)
    logits = jnp.einsum("bte,ve->btv" if tied else "bte,ev->btv", h.astype(jnp.float32), head)[..., :REAL]
    drawn = jnp.asarray(np.random.default_rng(2).integers(0, REAL, (BATCH, LENGTH)), jnp.int32)
    targets = jnp.where(jnp.arange(LENGTH) % 3 == 0, jnp.argmax(logits, -1), drawn)
    return h, head, targets


def reference(h, head, targets, tied, softcap=None, temperature=1.0):
    """The whole logits' loss and accuracy, written out: what the model computed before chunking."""
    logits = jnp.einsum("bte,ve->btv" if tied else "bte,ev->btv", h, head.astype(h.dtype),
                        preferred_element_type=jnp.float32)  # fmt: skip
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(jnp.arange(VOCAB) < REAL, logits, -1e30) / temperature
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets), is_argmax(logits, targets)


OPTIONS = {"plain": {}, "soft-capped": {"softcap": 3.0}, "temperature": {"temperature": 0.7}}
SPLITS = {
    "positions": {"chunk": 4, "keep": False},  # the head's gradient computes each chunk's logits again
    "vocabulary": {"block": 100, "keep": False},  # 256 padded ids: blocks 0-99, 100-199, 156-255
}
GRADIENT_SPLITS = {  # the head's gradient from the logits' gradient that the forward pass kept
    **SPLITS,
    "positions-kept": {"chunk": 4, "keep": True},
    "vocabulary-kept": {"block": 100, "keep": True},
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied-table", "head-kernel"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_split_loss_and_accuracy_equal_the_whole_logits(split, tied, options):
    h, head, targets = problem(tied)
    got = jax.jit(lambda h, w: token_cross_entropy(h, w, targets, tied=tied, vocab_size=REAL, **split, **options))
    loss, hit = got(h, head)
    want_loss, want_hit = reference(h, head, targets, tied, **options)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(hit, want_hit)
    assert 0 < np.mean(hit) < 1


@pytest.mark.parametrize("tied", [True, False], ids=["tied-table", "head-kernel"])
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("split", GRADIENT_SPLITS.values(), ids=GRADIENT_SPLITS.keys())
def test_split_gradients_equal_autodiff_of_the_whole_logits(split, tied, options):
    h, head, targets = problem(tied)
    weights = normal((BATCH, LENGTH), 3)  # each token's upstream gradient, as a masked mean makes them

    def total(f):
        return jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w)[0] * weights), (0, 1)))(h, head)

    got = total(lambda h, w: token_cross_entropy(h, w, targets, tied=tied, vocab_size=REAL, **split, **options))
    want = total(lambda h, w: reference(h, w, targets, tied, **options))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-table", "head-kernel"])
@pytest.mark.parametrize("split", GRADIENT_SPLITS.values(), ids=GRADIENT_SPLITS.keys())
def test_bfloat16_hidden_states_give_float32_losses_and_gradients_as_close_as_autodiffs(split, tied):
    h, head, targets = problem(tied, jnp.bfloat16)
    weights = normal((BATCH, LENGTH), 3)
    options = {"softcap": 3.0, "temperature": 0.7}

    def run(f, h):
        return jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(f(h, w)[0] * weights), (0, 1)))(h, head)

    chunked = lambda h, w: token_cross_entropy(h, w, targets, tied=tied, vocab_size=REAL, **split, **options)  # noqa: E731
    ours = run(chunked, h)
    autodiff = run(lambda h, w: reference(h, w, targets, tied, **options), h)
    exact = run(lambda h, w: reference(h, w, targets, tied, **options), h.astype(jnp.float32))  # float32 throughout
    assert token_cross_entropy(h, head, targets, tied=tied, vocab_size=REAL, **split)[0].dtype == jnp.float32
    assert ours[1][0].dtype == jnp.bfloat16 and ours[1][1].dtype == jnp.float32
    np.testing.assert_allclose(ours[0], autodiff[0], rtol=1e-5)
    for g, a, e in zip(ours[1], autodiff[1], exact[1], strict=True):
        scale = np.max(np.abs(e))
        error = np.max(np.abs(np.asarray(g, np.float32) - e)) / scale
        assert error < max(2 * np.max(np.abs(np.asarray(a, np.float32) - e)) / scale, 1e-2)


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_a_target_tied_with_another_id_at_the_maximum_counts_as_the_argmax(split):
    h, head, targets = problem(tied=True)
    top = int(targets[0, 0])  # position 0 targets its row's argmax
    twin = top + 1 if top + 1 < REAL else top - 1
    head = head.at[twin].set(head[top])
    targets = targets.at[0, 0].set(max(top, twin))  # jnp.argmax would name the other
    _, hit = token_cross_entropy(h, head, targets, tied=True, vocab_size=REAL, **split)
    assert hit[0, 0]


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_padded_ids_are_never_the_argmax_and_take_no_probability(split):
    h, head, targets = problem(tied=True)
    head = head.at[REAL:].set(100.0 * h[0, 0])  # the padded ids' logits would dominate every position
    loss, hit = token_cross_entropy(h, head, targets, tied=True, vocab_size=REAL, **split)
    want_loss, want_hit = reference(h, head.at[REAL:].set(0.0), targets, tied=True)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(hit, want_hit)


def test_chunks_hold_about_chunk_bytes_of_logits_in_equal_parts_and_small_logits_stay_whole():
    assert chunk_length(8, 256, 384) == 256  # a byte vocabulary: one chunk
    length = chunk_length(2, 512, 151936)  # Qwen2.5's vocabulary: 9.3 chunks' worth of logits
    chunks = -(-512 // length)
    assert 4 * 2 * length * 151936 <= loss_module.chunk_bytes()
    assert chunks == -(-4 * 2 * 512 * 151936 // loss_module.chunk_bytes())  # 10 of 64 MiB on a CPU
    assert chunks * length - 512 < chunks  # the chunks equal but for a position each


def test_the_logits_gradient_is_kept_within_a_sixteenth_of_the_devices_or_the_hosts_memory(monkeypatch):
    class Device:
        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return None if self.limit is None else {"bytes_limit": self.limit}

    monkeypatch.setattr(loss_module, "KEEP_BYTES", None)
    monkeypatch.setattr(nnx.spmd, "platform", lambda: "cpu")
    for host, kept in [(8 << 30, 1 << 29), (24 << 30, 1 << 30), (0, 0)]:  # 8 GB, this machine (capped), unknown
        monkeypatch.setattr(loss_module, "_host_bytes", lambda host=host: host)
        assert loss_module.keep_bytes() == kept
    monkeypatch.setattr(nnx.spmd, "platform", lambda: "gpu")
    for limit, kept in [(141 << 30, 4 << 30), (24 << 30, 3 << 29), (None, 0)]:  # an H200 (capped), 24 GB, unknown
        monkeypatch.setattr(jax, "local_devices", lambda limit=limit: [Device(limit)])
        assert loss_module.keep_bytes() == kept
    monkeypatch.setattr(loss_module, "KEEP_BYTES", 123)
    assert loss_module.keep_bytes() == 123


def test_vocabulary_blocks_hold_block_rows_ids_fewer_where_their_logits_would_pass_chunk_bytes():
    assert block_rows(1024, 151936) == loss_module.BLOCK_ROWS  # Qwen2.5, 2 x 512 positions: 16 MB of logits
    assert block_rows(16 * 1024, 50304) == loss_module.chunk_bytes() // (4 * 16 * 1024)  # GPT-2, 16 x 1,024
    assert block_rows(22, 300) == 300  # never more than the vocabulary
    cpu = jax.default_backend() == "cpu"  # a GPU multiplies chunks of positions by the whole table
    assert blocks_apply(2, 512, 151936) == cpu  # a CPU with no mesh: large logits a block of ids at a time
    assert not blocks_apply(2, 512, 384)  # a byte vocabulary's logits are computed whole


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("stored, computed", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
                         ids=["float32-table-in-bfloat16", "bfloat16-table-in-float32"])  # fmt: skip
def test_vocabulary_blocks_convert_a_table_stored_in_another_dtype_one_block_at_a_time(stored, computed):
    """A frozen float32 table computing in bfloat16 (LoRA on a float32 base), or a 16-bit one held as its bits
    computing in float32 (a 16-bit base read wider): each block of the table is converted alone, so the loss and
    its gradient hold no converted copy of the whole table (the chunks of positions convert it whole), and give
    the numbers of the table converted first."""
    vocab, embed = 32768, 128
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 16, embed)), computed)
    table = jnp.asarray(rng.standard_normal((vocab, embed)) * 0.1, stored)
    targets = jnp.asarray(rng.integers(0, vocab, (2, 16)), jnp.int32)
    held = sliceable(table)  # as a train step holds a frozen base

    def total(h, weights):
        return jnp.sum(token_cross_entropy(h, weights, targets, tied=True, vocab_size=vocab, block=4096)[0])

    step = jax.jit(jax.value_and_grad(lambda h, held: total(h, as_stored(held, stored))))
    temporaries = step.lower(h, held).compile(compiler_options=DEPLOYED).memory_analysis().temp_size_in_bytes
    assert temporaries < vocab * embed * jnp.dtype(computed).itemsize / 2  # the table converted whole: 8 or 16 MB
    (got, got_grad), (want, want_grad) = step(h, held), jax.jit(jax.value_and_grad(total))(h, table.astype(computed))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_grad, want_grad)


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.parametrize("split", GRADIENT_SPLITS.values(), ids=GRADIENT_SPLITS.keys())
def test_the_forward_pass_alone_multiplies_by_the_head_once_and_a_frozen_head_gets_no_gradient_loop(split):
    h, head, targets = problem(tied=True)

    def summed(**split):
        def loss(h, w):
            return jnp.sum(token_cross_entropy(h, w, targets, tied=True, vocab_size=REAL, **split)[0])

        return loss

    loss = summed(**split)
    dots = lambda text: len(re.findall(r" dot\(", text))  # noqa: E731
    loops = lambda text: len(re.findall(r" while\(", text))  # noqa: E731
    primal, frozen, trained = (_compiled(f, h, head) for f in (loss, jax.grad(loss), jax.grad(loss, (0, 1))))
    assert (loops(primal), dots(primal)) == (1, 1)  # the logits only
    assert (loops(frozen), dots(frozen)) == (1, 2)  # and G, in the same loop: `h`'s gradient needs no other
    if split.get("keep"):  # the head's gradient: a loop of products of the kept gradient and `h`, no logits
        # the blocks add each position's target row to it with a scatter, which XLA's CPU up to JAX 0.11 writes as
        # a loop of its own (0.12 does not)
        scatters = (0, 1) if "block" in split and jax.default_backend() == "cpu" else (0,)
        assert dots(trained) == 3 and loops(trained) - 2 in scatters
        # a frozen head keeps nothing: the program is the one that would compute the logits again
        assert frozen == _compiled(jax.grad(summed(**{**split, "keep": False})), h, head)
    else:
        assert (loops(trained), dots(trained)) == (2, 4)  # the head's gradient recomputes each chunk's logits


@pytest.mark.parametrize("tied", [True, False], ids=["tied-table", "head-kernel"])
def test_a_bfloat16_logits_gradient_kept_in_vocabulary_blocks_is_never_converted_whole_in_a_loop(tied):
    """XLA's CPU up to JAX 0.10 widens a bfloat16 stack to float32 and back, whole, in each step of the loop that
    updates it: the kept gradient's stack `[blocks, positions, rows]` costed its size at every block (on SmolLM2's
    shapes 77 ms of a 1.5 s step). It is stacked as its bits there; no loop converts anything that large."""
    h, head, targets = problem(tied, jnp.bfloat16)

    def loss(h, w):
        return jnp.sum(token_cross_entropy(h, w, targets, tied=tied, vocab_size=REAL, block=100, keep=True)[0])

    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(h, head).compile(compiler_options=DEPLOYED).as_text()
    stack = 3 * BATCH * LENGTH * 100  # three blocks of 100 ids, each position's logits' gradient
    assert [n for n in converted_sizes(loop_instructions(hlo)) if n >= stack] == []


# Through the model
# ------------------------------------------------------------------------------


def small_model(**options) -> TransformerLM:
    options = {"num_layers": 1, "num_heads": 2, "embed_dim": 32, "positions": "rope", "norm": "rmsnorm",
               "dropout": 0.0, **options}  # fmt: skip
    return TransformerLM((LENGTH + 1,), 1000, **options, ctx=nnx.context(0))  # 1000 ids padded to 1024


def packed_batch() -> dict[str, jax.Array]:
    """Two rows of 13 tokens: packed examples (segments 1, 2, then padding), the second half of each marked."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 1000, (BATCH, LENGTH + 2))
    segments = np.array([[1] * 5 + [2] * 6 + [0] * 2, [1] * 9 + [2] * 3 + [0]])
    positions = np.concatenate([np.arange(np.sum(row == s)) for row in segments for s in (1, 2, 0)]).reshape(2, -1)
    targets = (positions >= 2) & (segments > 0)
    return {k: jnp.asarray(v, jnp.int32) for k, v in
            dict(tokens=tokens, segments=segments, positions=positions, targets=targets).items()}  # fmt: skip


def _metrics_and_gradients(model: TransformerLM, batch: dict[str, jax.Array]):
    params, moduledef = model.partition(nnx.Param)

    def loss(params):
        out = moduledef.apply(params).metrics(batch, None)[0]
        return jnp.sum(out["loss"] * out["weight"]), out

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


PATHS = ["positions", "vocabulary"]
KEPT_PATHS = ["positions-kept", "vocabulary-kept"]


def split_small(monkeypatch, path: str) -> None:
    """Logits of more than 3 positions split: chunks of 3 positions, or blocks of 279 of the 1,024 padded ids
    (`vocabulary`); their logits' gradient kept for the head's where the path ends in `-kept`."""
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 3 * BATCH * 1024 * 4)
    monkeypatch.setattr(loss_module, "KEEP_BYTES", 1 << 30 if path.endswith("-kept") else 0)
    monkeypatch.setattr(loss_module, "blocks_apply", lambda *shape: path.startswith("vocabulary"))


@pytest.mark.parametrize("path", [*PATHS, *KEPT_PATHS])
@pytest.mark.parametrize("options", [{}, {"tie_embeddings": False, "logit_softcap": 5.0}], ids=["tied", "head"])
def test_packed_examples_metrics_and_gradients_equal_the_whole_logits_ones(monkeypatch, options, path):
    model, batch = small_model(**options), packed_batch()
    (_, whole), whole_grads = _metrics_and_gradients(model, batch)
    split_small(monkeypatch, path)
    (_, chunked), chunked_grads = _metrics_and_gradients(model, batch)
    for name in ("loss", "accuracy", "weight"):
        np.testing.assert_allclose(chunked[name], whole[name], rtol=1e-5, err_msg=name)
    for path, g in whole_grads.items():
        np.testing.assert_allclose(chunked_grads[path].value, g.value, rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("path", PATHS)
def test_dpo_and_grpo_log_probabilities_equal_the_log_softmax_of_the_logits(monkeypatch, path):
    model, batch = small_model(tie_embeddings=False), packed_batch()
    split_small(monkeypatch, path)
    params, moduledef = model.partition(nnx.Param)
    tokens = batch["tokens"]
    logits = moduledef.merge(params).logits(
        tokens[:, :-1], positions=batch["positions"][:, :-1], segments=batch["segments"][:, :-1]
    )
    for temperature in (1.0, 0.7):
        want = jnp.take_along_axis(jax.nn.log_softmax(logits / temperature), tokens[:, 1:, None], -1)[..., 0]
        got = jax.jit(lambda p, b, t=temperature: grpo.token_logps(moduledef.merge(p), b, None, t))(params, batch)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    logps, counts = jax.jit(lambda p, b: dpo.sequence_logps(moduledef.merge(p), b, None))(params, batch)
    marked = batch["targets"][:, 1:].astype(bool) & (batch["segments"][:, 1:] == batch["segments"][:, :-1])
    each = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    for segment in (1, 2):
        where = marked & (batch["segments"][:, 1:] == segment)
        np.testing.assert_allclose(logps[:, segment], jnp.sum(jnp.where(where, each, 0.0), -1), rtol=1e-5)
        np.testing.assert_array_equal(counts[:, segment], jnp.sum(where, -1))
    assert logps.shape == (BATCH, 2 * (LENGTH + 1) // 2 + 1)


@pytest.mark.parametrize("path", [*PATHS, "vocabulary-kept"])
def test_a_lora_train_step_computes_no_gradient_of_the_frozen_head(monkeypatch, path):
    """The head's gradient, a `[vocab, embed]` product (a block of the vocabulary's rows at a time), is in a full
    fine-tuning step and not in a LoRA one."""
    split_small(monkeypatch, path)
    batch = {"tokens": packed_batch()["tokens"][:, : LENGTH + 1]}
    head_gradient = re.compile(rf"f32\[{279 if path.startswith('vocabulary') else 1024},32\]\{{[0-9,]*\}} dot\(")

    def step_text(**options) -> str:
        tx = optax.sgd(0.1)
        moduledef, state = steps.init_state(lambda ctx: small_model(**options), tx, 0)
        sums = steps.empty_sums(["loss", "accuracy"])
        step = lambda state, sums, b: steps.train_step(moduledef, tx, "loss", 0, state, sums, b)  # noqa: E731
        return _compiled(step, state, sums, batch)

    assert head_gradient.search(step_text())
    assert not head_gradient.search(step_text(lora={"rank": 4}))


# Several devices: a batch over `data`, the vocabulary over `model`
# ------------------------------------------------------------------------------

_EIGHT_DEVICES = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import nnx
    from nnx_cli.config import ShardingConfig
    from nnx_cli.models.transformer.loss import blocks_apply, token_cross_entropy
    from nnx_cli.sharding import axis_rules, make_mesh

    cfg = ShardingConfig(mesh={"data": 4, "model": 2}, rules=[["batch", "data"], ["embed", "data"], ["vocab", "model"]])
    mesh, rules = make_mesh(cfg), axis_rules(cfg)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((8, 12, 16)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((256, 16)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 250, (8, 12)), jnp.int32)
    g = jnp.asarray(rng.standard_normal((8, 12)), jnp.float32)

    def run(h, table, chunk, block=None, keep=None):
        def total(h, table):
            loss, hit = token_cross_entropy(h, table, targets, tied=True, vocab_size=250, softcap=4.0, chunk=chunk,
                                            block=block, keep=keep)
            return jnp.sum(loss * g), (loss, hit)
        return jax.jit(jax.value_and_grad(total, (0, 1), has_aux=True))(h, table)

    (_, (want, want_hit)), want_grads = run(h, table, None)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        h = jax.device_put(h, NamedSharding(mesh, P("data")))
        table = jax.device_put(table, NamedSharding(mesh, P("model", "data")))
        (_, (loss, hit)), grads = run(h, table, 5)
    print("loss", float(np.max(np.abs(loss - want))), bool(np.all(hit == want_hit)))
    print("grads", max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(grads, want_grads)))
    print("spec", tuple(loss.sharding.spec)[:1], tuple(grads[1].sharding.spec))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        _, grads = run(h, table, 5, keep=True)  # the head's gradient from the kept logits' gradient
    print("kept", max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(grads, want_grads)),
          tuple(grads[1].sharding.spec))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        print("blocks", blocks_apply(2, 512, 151936))  # the vocabulary over `model`: positions
        (_, (loss, hit)), grads = run(h, table, None, 100, keep=True)  # blocks, asked for: the same numbers
        _, recomputed = run(h, table, None, 100, keep=False)  # the head's gradient from each block's logits again
    print("blocked", float(np.max(np.abs(loss - want))), bool(np.all(hit == want_hit)),
          max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(grads, want_grads)),
          max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(recomputed, want_grads)))
    """
)


def test_chunks_keep_a_batch_sharded_over_data_and_a_vocabulary_over_model_on_eight_devices():
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "JAX_DEFAULT_MATMUL_PRECISION": os.environ["JAX_DEFAULT_MATMUL_PRECISION"],
    }  # conftest.py's policy
    out = subprocess.run([sys.executable, "-c", _EIGHT_DEVICES], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    error, same_hits = lines["loss"].split()
    assert float(error) < 1e-5 and same_hits == "True"
    assert float(lines["grads"]) < 1e-5
    assert lines["spec"] == "('data',) ('model', 'data')"  # the table's gradient sharded as the table
    error, spec = lines["kept"].split(" ", 1)
    assert float(error) < 1e-5 and spec == "('model', 'data')"
    assert lines["blocks"] == "False"  # a sharded vocabulary is taken in chunks of positions by default
    error, same_hits, kept, recomputed = lines["blocked"].split()
    assert float(error) < 1e-5 and same_hits == "True" and float(kept) < 1e-5 and float(recomputed) < 1e-5
