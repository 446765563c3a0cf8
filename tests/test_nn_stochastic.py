"""Dropout: modes, masking, and agreement with flax.linen."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx
from nnx.nn.stochastic import Dropout


def ctx(seed=0, **flags):
    # rbg keys compile much faster than threefry keys on CPU.
    return nnx.context(dropout=jax.random.key(seed, impl="rbg"), flags=flags)


X = jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, (8, 16)), jnp.float32)


def test_dropout_needs_no_context_to_construct():
    dropout = Dropout(0.5)
    assert dropout.rate == 0.5
    assert dropout.broadcast_dims == ()
    assert dropout.deterministic is None


def test_dropout_has_no_state():
    state, _ = Dropout(0.5).partition()
    assert len(state) == 0


def test_dropout_deterministic_returns_input_unchanged():
    assert Dropout(0.5)(X, deterministic=True) is X


def test_dropout_rate_zero_returns_input_unchanged():
    assert Dropout(0.0)(X, deterministic=False) is X


def test_dropout_rate_one_returns_zeros_without_context():
    y = Dropout(1.0)(X, deterministic=False)
    np.testing.assert_array_equal(y, np.zeros_like(X))


def test_dropout_training_zeroes_or_rescales_each_element():
    y = Dropout(0.25)(X, deterministic=False, ctx=ctx())
    kept = y != 0
    np.testing.assert_allclose(y[kept], X[kept] / 0.75, rtol=1e-6)
    assert 0.5 < float(jnp.mean(kept)) < 0.95


def test_dropout_matches_flax_for_the_same_key():
    key = ctx(3).make_rng("dropout")
    expected = linen.Dropout(0.5).apply({}, X, deterministic=False, rng=key)
    y = Dropout(0.5)(X, deterministic=False, ctx=ctx(3))
    np.testing.assert_array_equal(y, expected)


def test_dropout_draws_a_new_mask_on_each_call():
    dropout, context = Dropout(0.5), ctx()
    a = dropout(X, deterministic=False, ctx=context)
    b = dropout(X, deterministic=False, ctx=context)
    assert not np.array_equal(a, b)


def test_dropout_same_seed_gives_same_mask():
    a = Dropout(0.5)(X, deterministic=False, ctx=ctx(1))
    b = Dropout(0.5)(X, deterministic=False, ctx=ctx(1))
    np.testing.assert_array_equal(a, b)


def test_dropout_broadcast_dims_share_the_mask():
    y = Dropout(0.5, broadcast_dims=(0,))(X, deterministic=False, ctx=ctx())
    dropped = np.asarray(y == 0)
    assert dropped.any() and not dropped.all()
    assert (dropped == dropped[:1]).all()


@pytest.mark.parametrize("broadcast_dims", [(0,), (1,), (0, 1)])
def test_dropout_broadcast_dims_match_flax(broadcast_dims):
    key = ctx(5).make_rng("dropout")
    expected = linen.Dropout(0.3, broadcast_dims=broadcast_dims).apply({}, X, deterministic=False, rng=key)
    y = Dropout(0.3, broadcast_dims=broadcast_dims)(X, deterministic=False, ctx=ctx(5))
    np.testing.assert_array_equal(y, expected)


def test_dropout_call_argument_beats_attribute():
    y = Dropout(0.5, deterministic=False)(X, deterministic=True, ctx=ctx())
    assert y is X


def test_dropout_attribute_beats_context_flag():
    y = Dropout(0.5, deterministic=True)(X, ctx=ctx(deterministic=False))
    assert y is X


def test_dropout_uses_context_flag_when_nothing_else_is_set():
    assert Dropout(0.5)(X, ctx=ctx(deterministic=True)) is X
    y = Dropout(0.5)(X, ctx=ctx(deterministic=False))
    assert (y == 0).any()


def test_dropout_without_mode_raises_with_hint():
    with pytest.raises(ValueError, match="deterministic"):
        Dropout(0.5)(X)
    with pytest.raises(ValueError, match="deterministic"):
        Dropout(0.5)(X, ctx=ctx())


def test_dropout_training_without_context_raises():
    with pytest.raises(ValueError, match="dropout"):
        Dropout(0.5)(X, deterministic=False)


def test_dropout_training_without_dropout_stream_raises():
    with pytest.raises(ValueError, match="Unknown Rng Stream: dropout"):
        Dropout(0.5)(X, deterministic=False, ctx=nnx.context(0))


def test_dropout_inside_jit_with_partitioned_context():
    dropout = Dropout(0.5)

    @jax.jit
    def apply(x, pure_ctx):
        return dropout(x, deterministic=False, ctx=pure_ctx.merge())

    y = apply(X, ctx().partition())
    assert (y == 0).any()
    kept = y != 0
    np.testing.assert_allclose(y[kept], X[kept] * 2.0, rtol=1e-6)


def test_dropout_under_nnx_jit_takes_context_keyword():
    apply = nnx.jit(lambda m, x, *, ctx: m(x, deterministic=False, ctx=ctx))
    a = apply(Dropout(0.5), X, ctx=ctx(2))
    b = apply(Dropout(0.5), X, ctx=ctx(2))
    assert (a == 0).any()
    np.testing.assert_array_equal(a, b)
