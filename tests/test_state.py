import jax
import numpy as np
import pytest

import nnx


def make_state():
    return nnx.State({"b": nnx.Param(2), "a/x": nnx.BatchStat(1), "a/y": np.ones(2), "c": nnx.Node(3)})


def test_state_is_a_sorted_immutable_mapping():
    state = make_state()
    assert list(state) == ["a/x", "a/y", "b", "c"]
    with pytest.raises(AttributeError):
        state.foo = 1
    with pytest.raises(TypeError):
        state["b"] = 1  # type: ignore[index]


def test_state_key_paths_are_path_strings():
    state = nnx.State({"enc/w": np.float32(1.0), "b": np.float32(2.0)})
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == ["['b']", "['enc/w']"]


def test_state_round_trips_through_tree_map_and_jit():
    state = make_state()
    doubled = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s))(state)
    assert isinstance(doubled, nnx.State) and type(doubled["b"]) is nnx.Param
    assert doubled["b"].value == 4


def test_partition_is_exhaustive_and_ordered_by_filter():
    params, stats, rest = make_state().partition(nnx.Param, nnx.BatchStat, ...)
    assert (list(params), list(stats), list(rest)) == (["b"], ["a/x"], ["a/y", "c"])
    with pytest.raises(ValueError, match="^Non-exhaustive filters, got a non-empty remainder:"):
        make_state().partition(nnx.Param, nnx.BatchStat)


def test_first_matching_filter_wins():
    variables, params = make_state().partition(nnx.Variable, nnx.Param, ...)[:2]
    assert list(variables) == ["a/x", "b"] and len(params) == 0


def test_filter_drops_unmatched_entries():
    assert list(make_state().filter(nnx.Param)) == ["b"]
    assert list(make_state().filter(nnx.buffers)) == ["a/y"]


def test_ellipsis_not_last_raises():
    with pytest.raises(ValueError, match="can only be used as the last filter"):
        make_state().filter(..., nnx.Param)


def test_merge_or_and_sub():
    a = nnx.State({"x": 1, "y": 2})
    b = nnx.State({"y": 3, "z": 4})
    assert dict(nnx.State.merge(a, b)) == {"x": 1, "y": 3, "z": 4}
    assert dict(a | b) == {"x": 1, "y": 3, "z": 4}
    assert dict(a - b) == {"x": 1}


def test_repr_lists_paths():
    text = repr(make_state())
    assert text.startswith("State({") and "'a/x': " in text


def test_string_is_not_a_filter():
    with pytest.raises(TypeError):
        make_state().filter("params")


def test_filter_combinators():
    state = make_state()
    assert list(state.filter(nnx.Not(nnx.Variable))) == ["a/y", "c"]
    backbone_free = nnx.All(nnx.Variable, lambda path, node: not path.startswith("a"))
    assert list(state.filter(backbone_free)) == ["b"]
    assert list(state.filter((nnx.Param, nnx.BatchStat))) == ["a/x", "b"]
    assert list(state.filter(None)) == []
    from nnx.partitioning import Any, Everything, Nothing, OfType

    assert list(state.filter(Any(nnx.Param, OfType(nnx.Node)))) == ["a/x", "b", "c"]
    assert len(state.filter(Everything())) == 4 and len(state.filter(Nothing())) == 0


def test_params_outside_the_backbone():
    m = nnx.Dict(backbone=nnx.Dict(w=nnx.Param(1)), head=nnx.Dict(w=nnx.Param(2)))
    head = m.filter(nnx.All(nnx.Param, lambda path, node: not path.startswith("backbone")))
    assert list(head) == ["head/w"]


class TestPure:
    def make(self):
        return nnx.Dict(
            a=nnx.Sequence([nnx.Param(1), nnx.Param(2), nnx.Node(3)]), b=nnx.Dict(c=nnx.Param(1), d=nnx.BatchStat(2))
        )

    def test_pure_is_a_tuple_and_a_pytree(self):
        pure = state, moduledef = self.make().partition()
        assert isinstance(pure, tuple) and isinstance(pure, nnx.Pure)
        assert isinstance(state, nnx.State) and isinstance(moduledef, nnx.ModuleDef)
        assert len(jax.tree_util.tree_leaves(pure)) == 5
        m2 = pure.merge()
        assert isinstance(m2.a, nnx.Sequence) and len(m2.get_state()) == 5

    def test_filters_and_partition(self):
        pure = self.make().partition(nnx.Param, ...)
        assert isinstance(pure.states, tuple)
        assert len(pure.filter(nnx.Param)) == 3 and len(pure.filter(nnx.BatchStat)) == 1
        assert isinstance(pure.partition().states, nnx.State)
        assert isinstance(pure.partition(nnx.BatchStat, ...).states, tuple)
        assert len(pure.get_state()) == 5

    def test_pop_state(self):
        pure = self.make().partition()
        params, rest = pure.pop_state(nnx.Param)
        assert len(params) == 3 and isinstance(rest, nnx.Pure) and len(rest.states) == 2
        (params, stats), rest = pure.pop_state(nnx.Param, nnx.BatchStat)
        assert (len(params), len(stats), len(rest.states)) == (3, 1, 1)

    def test_apply_call_and_update_state(self):
        class Inc(nnx.Module):
            def __init__(self):
                self.n = nnx.BatchStat(0)

            def __call__(self, x):
                self.n += 1
                return x + self.n

        pure = Inc().partition()
        out, updated = pure.apply(1)
        assert out == 2 and updated.states["n"].value == 1
        assert pure.call(1) == 2
        pure2 = pure.update_state(nnx.State({"n": nnx.BatchStat(5)}))
        assert pure2.merge().n == 5


def test_state_round_trips_through_flax_msgpack_bytes():
    from flax import serialization

    state = nnx.Linear(2, 3, ctx=nnx.context(0)).get_state()
    target = jax.tree.map(np.zeros_like, state)
    restored = serialization.from_bytes(target, serialization.to_bytes(state))
    assert list(restored) == ["bias", "kernel"]
    assert all(type(restored[path]) is nnx.Param for path in restored)
    np.testing.assert_array_equal(restored["kernel"].value, state["kernel"].value)


def test_state_state_dict_is_flat_and_keyed_by_path():
    from flax import serialization

    state = nnx.State({"encoder/w": nnx.Param(np.ones(2)), "step": np.int32(3)})
    state_dict = serialization.to_state_dict(state)
    assert sorted(state_dict) == ["encoder/w", "step"]
    np.testing.assert_array_equal(state_dict["encoder/w"], np.ones(2))


def test_restoring_a_state_from_a_state_dict_without_one_of_its_paths_raises():
    from flax import serialization

    state = nnx.State({"a": nnx.Param(1.0), "b": nnx.Param(2.0)})
    with pytest.raises(ValueError, match="Missing field 'b' in state dict while restoring a State"):
        serialization.from_state_dict(state, {"a": 3.0})


def test_merge_and_the_operators_take_mappings_and_refuse_other_values_with_a_type_error():
    """A dict beside a State was an AttributeError about `_mapping`; a tuple given to merge came back as itself."""
    state = nnx.State({"a": 1})
    assert dict(state | {"b": 2}) == dict({"b": 2} | state) == {"a": 1, "b": 2}
    assert dict(nnx.State.merge(state, {"a": 3})) == {"a": 3} and dict(state - {"a": 0}) == {}
    with pytest.raises(TypeError, match="State.merge takes States .*got tuple"):
        nnx.State.merge((state,))
    with pytest.raises(TypeError, match="unsupported operand"):
        state | 3
