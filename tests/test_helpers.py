import copy

import jax
import jax.numpy as jnp
import optax
import pytest

import nnx
from nnx import ids


def test_dict_is_a_mapping_module():
    d = nnx.Dict(a=nnx.Param(1), b=2)
    assert d.a == 1 and d["a"] == 1 and d["b"] == 2
    assert list(d) == ["a", "b"] and len(d) == 2 and "a" in d
    d["c"] = nnx.Param(3)
    assert d.c == 3
    assert nnx.Dict({"x": 1}).x == 1


def test_dict_takes_any_name_as_a_keyword_cls_and_self_included():
    heads = nnx.Dict(cls=nnx.Param(1), self=nnx.Param(2), reg=3)
    assert heads.cls == 1 and heads["self"] == 2 and list(heads) == ["cls", "self", "reg"]


def test_a_name_with_a_slash_is_refused_as_it_would_not_round_trip_through_a_state_path():
    with pytest.raises(ValueError, match=r"Dict: the attribute name 'a/b' holds '/', which joins the names of a State"):
        nnx.Dict({"a/b": nnx.Linear(1, 1, ctx=nnx.context(0))})
    layer = nnx.Linear(1, 1, ctx=nnx.context(0))
    with pytest.raises(ValueError, match="name it without one"):
        setattr(layer, "x/y", nnx.Param(1.0))


def test_train_state_apply_on_a_name_that_holds_no_state_says_so():
    params, moduledef = nnx.Linear(2, 1, ctx=nnx.context(0)).partition(nnx.Param)
    state = nnx.TrainState(moduledef, params=params, tx=optax.sgd(0.1), note="run 1")
    with pytest.raises(TypeError, match=r"TrainState.apply\('note'\): 'note' holds a str, not a State"):
        state.apply("params", "note")


def test_sequence_indexing_and_iteration():
    s = nnx.Sequence([nnx.Param(1), 2, 3])
    assert len(s) == 3 and s[0] == 1 and s[-1] == 3 and list(s) == [1, 2, 3]
    with pytest.raises(IndexError):
        s[3]


def test_sequence_chains_calls_and_forwards_ctx():
    seen = []

    def needs_ctx(x, *, ctx):
        seen.append(ctx)
        return x, 1

    s = nnx.Sequence([lambda x: x + 1, needs_ctx, lambda x, y: {"a": x, "b": y}, lambda a, b: a * 10 + b])
    ctx = nnx.context(0)
    assert s(1, ctx=ctx) == 21 and seen == [ctx]


def test_sequence_non_callable_element_raises():
    s = nnx.Sequence([lambda x: x, lambda x: x, 3])
    with pytest.raises(TypeError, match=r"Sequence\[2\] is not callable"):
        s(1)


def test_train_state_children_and_static_fields():
    m = nnx.Dict(a=nnx.Param(1), b=nnx.BatchStat(2))
    (params, batch_stats), moduledef = m.partition(nnx.Param, nnx.BatchStat)
    state = nnx.TrainState(
        moduledef,
        params=params,
        tx=optax.sgd(1.0),
        batch_stats=batch_stats,
        other=nnx.Node(100),
        int=200,
        static=nnx.Static(300),
    )
    leaves = jax.tree_util.tree_leaves(state)
    assert 1 in leaves and 2 in leaves and 100 in leaves
    assert 200 not in leaves and 300 not in leaves


def test_train_state_apply_and_apply_gradients():
    class Foo(nnx.Module):
        def __init__(self, *, ctx):
            self.linear = nnx.Linear(2, 4, ctx=ctx)
            self.batch_norm = nnx.BatchNorm(4, ctx=ctx)

        def __call__(self, x, train):
            return self.batch_norm(self.linear(x), use_running_average=not train)

    (params, batch_stats), moduledef = Foo(ctx=nnx.context(0)).partition(nnx.Param, nnx.BatchStat)
    state = nnx.TrainState(moduledef, params=params, tx=optax.sgd(1.0), batch_stats=batch_stats)
    y, updates = state.apply("params", "batch_stats")(jnp.ones((3, 2)), train=True)
    assert y.shape == (3, 4)
    grads = jax.tree.map(jnp.ones_like, state.params)
    new = jax.jit(lambda s, g: s.apply_gradients(g, batch_stats=updates.filter(nnx.BatchStat)))(state, grads)
    assert int(new.step) == 1
    kernel_before = state.params["linear/kernel"].value
    assert jnp.allclose(new.params["linear/kernel"].value, kernel_before - 1.0)


def test_uuids_are_unique_and_copies_are_new():
    a = ids.uuid()
    assert a == a and a != ids.uuid()
    assert copy.copy(a) != a and copy.deepcopy(a) != a
    assert len({a, a}) == 1


def test_train_state_round_trips_through_flax_msgpack_bytes():
    from flax import serialization

    params, moduledef = nnx.Linear(2, 3, ctx=nnx.context(0)).partition(nnx.Param)
    state = nnx.TrainState(moduledef, params=params, tx=optax.adam(0.1))
    state = state.apply_gradients(jax.tree.map(jnp.ones_like, params))
    fresh = nnx.TrainState(moduledef, params=jax.tree.map(jnp.zeros_like, params), tx=optax.adam(0.1))
    restored = serialization.from_bytes(fresh, serialization.to_bytes(state))
    assert int(restored.step) == 1
    assert jnp.array_equal(restored.params["kernel"].value, state.params["kernel"].value)
    assert jnp.array_equal(restored.opt_state[0].mu["kernel"].value, state.opt_state[0].mu["kernel"].value)


def test_an_empty_sequence_is_the_identity_of_its_one_argument():
    """It returned None: a model whose layer list came out empty computed nothing, silently."""
    empty = nnx.Sequence([])
    x = jnp.ones((2, 3))
    assert empty(x) is x
    with pytest.raises(TypeError, match="empty Sequence returns its input"):
        empty(x, x)
