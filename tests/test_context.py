import jax
import numpy as np
import pytest

import nnx
from nnx.contextlib import _stable_hash, to_rng_predicate


def test_stable_hash_is_a_deterministic_uint32():
    assert _stable_hash((0, 1)) == _stable_hash((0, 1))
    assert _stable_hash((0, 1)) != _stable_hash((1, 0))
    assert 0 <= _stable_hash((3,)) < 2**32


def test_make_rng_advances_the_counter_and_keeps_the_key():
    key0 = jax.random.PRNGKey(0)
    ctx = nnx.context(key0)
    assert ctx._rngs["params"].count == 0
    key1 = ctx.make_rng("params")
    key2 = ctx.make_rng("params")
    assert ctx._rngs["params"].count == 2
    assert ctx._rngs["params"].key is key0
    assert not np.equal(key0, key1).all()
    assert not np.equal(key1, key2).all()


def test_same_seed_gives_same_keys_in_every_context():
    a, b = nnx.context(params=3), nnx.context(params=3)
    np.testing.assert_array_equal(a.make_rng("params"), b.make_rng("params"))


def test_typed_and_raw_keys_are_accepted():
    raw = nnx.context(jax.random.PRNGKey(0)).make_rng("params")
    typed = nnx.context(jax.random.key(0)).make_rng("params")
    np.testing.assert_array_equal(raw, jax.random.key_data(typed))


def test_integer_scalar_array_is_a_seed():
    from_array = nnx.context(np.int32(3), dropout=jax.numpy.uint32(4))
    from_int = nnx.context(3, dropout=4)
    np.testing.assert_array_equal(from_array.make_rng("params"), from_int.make_rng("params"))
    np.testing.assert_array_equal(from_array.make_rng("dropout"), from_int.make_rng("dropout"))


def test_unknown_stream_raises_naming_the_streams_there_are_and_how_to_add_it():
    with pytest.raises(ValueError, match=r"Unknown Rng Stream: dropout \(this Context has streams: params, noise; "):
        nnx.context(0, noise=1).make_rng("dropout")
    with pytest.raises(ValueError, match=r"streams: none; add it with nnx.context\(..., dropout=SEED\)"):
        nnx.context().make_rng("dropout")


def test_flags():
    ctx = nnx.context(0, flags={"deterministic": True})
    assert ctx.has_flag("deterministic") and ctx.get_flag("deterministic") is True
    assert not ctx.has_flag("train") and ctx.get_flag("train") is None
    assert ctx.has_rng("params") and not ctx.has_rng("dropout")


def test_fork_extends_the_count_path_and_never_collides():
    ctx1 = nnx.context(jax.random.PRNGKey(0))
    ctx2 = ctx1.partition().merge()
    assert ctx2._rngs["params"].count == 0
    assert ctx2._rngs["params"].count_path == (0,)
    assert ctx1._rngs["params"].count == 1
    assert not np.equal(ctx1.make_rng("params"), ctx2.make_rng("params")).all()


def test_merging_the_same_partition_twice_gives_identical_streams():
    ctx = nnx.context(dropout=0)
    keys, contextdef = ctx.partition()
    assert "dropout" in keys
    assert contextdef._rng_counts == (("dropout", (0,)),)
    key2 = contextdef.merge(keys).make_rng("dropout")
    key3 = contextdef.merge(keys).make_rng("dropout")
    assert np.equal(key2, key3).all()
    assert not np.equal(ctx.make_rng("dropout"), key2).all()


def test_partition_without_forking_hands_over_the_streams_as_they_are():
    fresh = nnx.context(params=0, dropout=1, flags={"deterministic": False})
    merged = fresh.copy().partition(fork=False).merge()
    for name in ("params", "dropout"):
        for _ in range(2):
            np.testing.assert_array_equal(merged.make_rng(name), fresh.make_rng(name))
    assert merged.get_flag("deterministic") is False
    with pytest.raises(ValueError, match=r"without forking: streams \['dropout', 'params'\] have drawn"):
        fresh.partition(fork=False)


def test_pure_context_crosses_jit_without_retracing():
    traces = 0

    @jax.jit
    def f(pure_ctx):
        nonlocal traces
        traces += 1
        return pure_ctx.merge().make_rng("params")

    ctx = nnx.context(0)
    k1, k2 = f(ctx.partition()), f(ctx.partition())
    assert traces == 1
    assert not np.equal(k1, k2).all()


def test_a_jitted_function_draws_the_keys_of_each_fork_whichever_fork_compiled_it():
    """The static half is shared by forks at every count (one compile); the keys drawn inside depend on the fork's
    key alone, so a run resumed at fork 5 draws what the uninterrupted run drew there, and eager code agrees."""

    @jax.jit
    def draw(pure_ctx):
        ctx = pure_ctx.merge()
        return ctx.make_rng("dropout"), ctx.partition().merge().make_rng("dropout")

    def eager(pure_ctx):
        ctx = pure_ctx.merge()
        return ctx.make_rng("dropout"), ctx.partition().merge().make_rng("dropout")

    run = nnx.context(dropout=0)
    uninterrupted = [draw(run.partition()) for _ in range(6)]
    resumed = nnx.context(dropout=0)
    for _ in range(5):
        resumed.partition()
    again = jax.jit(draw.__wrapped__)(resumed.partition())  # compiled for fork 5
    for got, want in zip(again, uninterrupted[5]):
        np.testing.assert_array_equal(got, want)
    check = nnx.context(dropout=0)
    for keys in uninterrupted:
        for got, want in zip(eager(check.partition()), keys):
            np.testing.assert_array_equal(got, want)


def test_outer_context_cannot_be_used_inside_jit():
    ctx = nnx.context(0)

    @jax.jit
    def f():
        with pytest.raises(nnx.TraceContextError, match="Cannot use Context from a different trace level"):
            ctx.make_rng("params")
        with pytest.raises(nnx.TraceContextError, match="Cannot use Context from a different trace level"):
            ctx.partition()
        return 0

    f()


def test_outer_context_without_the_stream_raises_the_trace_error_first():
    ctx = nnx.context()

    @jax.jit
    def f():
        with pytest.raises(nnx.TraceContextError, match="Cannot use Context from a different trace level"):
            ctx.make_rng("params")
        return 0

    f()


def test_context_leaked_out_of_jit_cannot_be_used():
    leaked = None

    @jax.jit
    def g():
        nonlocal leaked
        leaked = nnx.context(1)
        return 0

    g()
    with pytest.raises(nnx.TraceContextError, match="Cannot use Context from a different trace level"):
        leaked.make_rng("params")


@pytest.mark.parametrize(
    "filter, expected",
    [
        (None, []),
        (..., ["a", "b", "c"]),
        ("b", ["b"]),
        (lambda name: name != "a", ["b", "c"]),
        (["a", "c"], ["a", "c"]),
        ({"a": True, "b": False, ...: False}, ["a"]),
    ],
)
def test_rng_filters(filter, expected):
    predicate = to_rng_predicate(filter)
    assert [n for n in "abc" if predicate(n)] == expected
