import jax
import numpy as np
import pytest

import nnx


def test_node_of_a_node_is_a_node_of_the_value():
    x = nnx.Node(nnx.Node(1))
    assert type(x) is nnx.Node
    assert x.value == 1


def test_a_container_takes_its_value_by_keyword_and_metadata_named_cls():
    p = nnx.Param(value=np.ones(2), cls="label")
    assert p.cls == "label" and p.value.shape == (2,)


def test_variable_of_a_variable_keeps_value_and_metadata():
    x = nnx.Param(nnx.Param(1, sharding=("a",)))
    assert x.value == 1
    assert x.sharding == ("a",)
    assert nnx.Variable(nnx.Variable(1)).value == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: nnx.BatchStat(nnx.Param(1)),
        lambda: nnx.Node(nnx.Variable(1)),
        lambda: nnx.Variable(nnx.Node(2)),
        lambda: nnx.Param(nnx.Param(1, sharding=("a",)), sharding=("b",)),
    ],
)
def test_incompatible_container_raises(make):
    with pytest.raises(ValueError, match="is not compatible with return type"):
        make()


def test_wrapping_a_container_in_another_type_says_to_pass_its_value():
    param = nnx.Param(1)
    with pytest.raises(ValueError, match=r"Pass the plain value instead, e.g. BatchStat\(x.value\)"):
        nnx.BatchStat(param)
    assert nnx.BatchStat(param.value).value == 1


def test_rewrapping_with_other_metadata_says_to_use_replace():
    param = nnx.Param(1, sharding=("a",))
    with pytest.raises(ValueError, match=r"use x.replace\(sharding=\('b',\)\)"):
        nnx.Param(param, sharding=("b",))
    assert param.replace(sharding=("b",)).sharding == ("b",)


def test_replace_unknown_key_lists_the_known_keys():
    with pytest.raises(ValueError, match=r"a Param has \['sharding', 'value'\]"):
        nnx.Param(1).replace(x=1)


def test_replace_returns_new_container_of_same_type():
    p = nnx.Param(1, sharding=("a",))
    q = p.replace(value=2)
    assert type(q) is nnx.Param and q.value == 2 and q.sharding == ("a",)
    assert p.value == 1
    assert p.replace(sharding=("b",)).sharding == ("b",)


def test_replace_unknown_key_raises():
    with pytest.raises(ValueError, match="Unknown metadata key 'x'"):
        nnx.Param(1).replace(x=1)


def test_replace_with_incompatible_container_raises():
    with pytest.raises(ValueError):
        nnx.Param(1).replace(value=nnx.BatchStat(2))
    assert nnx.Param(1).replace(value=nnx.Param(3)).value == 3


def test_equality_and_equivalence():
    assert nnx.Param(1) == nnx.Param(1)
    assert nnx.Param(1) != nnx.Param(2)
    assert nnx.Param(1) != nnx.BatchStat(1)
    assert nnx.Param(1).is_equivalent(nnx.Param(2))
    assert not nnx.Param(1, sharding=("a",)).is_equivalent(nnx.Param(1))
    assert not nnx.Param(1).is_equivalent(nnx.BatchStat(1))


def test_copy_is_a_distinct_equal_container():
    p = nnx.Param(1, sharding=("a",))
    q = p.copy()
    assert q is not p and q == p


def test_node_is_a_pytree_with_one_child_and_static_metadata():
    p = nnx.Param(3.0, sharding=("a",))
    [(path, leaf)], _ = jax.tree_util.tree_flatten_with_path(p)
    assert jax.tree_util.keystr(path) == ".value" and leaf == 3.0
    q = jax.tree.map(lambda x: x * 2, p)
    assert type(q) is nnx.Param and q.value == 6.0 and q.sharding == ("a",)


def test_user_defined_variable_subclass_is_a_pytree():
    class Count(nnx.Variable):
        pass

    c = jax.tree.map(lambda x: x + 1, Count(1))
    assert type(c) is Count and c.value == 2


def test_static_has_no_leaves_and_survives_tree_map():
    assert jax.tree_util.tree_leaves(nnx.Static(1)) == []
    assert jax.tree.map(lambda x: x + 1, nnx.Static(2)).value == 2


def test_user_defined_static_subclass_is_a_pytree_without_leaves():
    class Name(nnx.Static):
        pass

    name = jax.tree.map(lambda x: x + 1, Name("relu"))
    assert jax.tree_util.tree_leaves(Name("relu")) == []
    assert type(name) is Name and name.value == "relu"


def test_static_subclass_metadata_survives_jit():
    class Tagged(nnx.Static):
        def __init__(self, value, tag):
            nnx.Container.__init__(self, value, tag=tag)

    out = jax.jit(lambda tagged, x: (tagged, x + 1))(Tagged("relu", tag="act"), 1)[0]
    assert type(out) is Tagged and (out.value, out.tag) == ("relu", "act")


def test_static_with_unhashable_array_fails_under_jit():
    f = jax.jit(lambda x: x)
    with pytest.raises((ValueError, TypeError)):
        f(nnx.Static(np.ones((3, 3))))
        f(nnx.Static(np.ones((3, 3))))


@pytest.mark.parametrize("array", [np.ones((3, 3)), jax.numpy.ones(2)], ids=["numpy", "jax"])
def test_static_holding_an_array_fails_at_the_first_jitted_call_naming_the_field(array):
    with pytest.raises(TypeError, match=r"Static.value holds an array .* shape"):
        jax.jit(lambda x: x)(nnx.Static(array))


def test_with_metadata_attaches_metadata_to_initializer_result():
    init = nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=("din", "dout"))
    boxed = init(jax.random.key(0), (2, 3))
    assert isinstance(boxed, nnx.ContainerMetadata)
    p = nnx.Param(boxed)
    assert p.sharding == ("din", "dout") and p.value.shape == (2, 3)


def test_linear_kernel_init_with_metadata_gives_sharded_param():
    init = nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=("din", "dout"))
    layer = nnx.Linear(2, 3, kernel_init=init, ctx=nnx.context(0))
    params = layer.partition(nnx.Param, ...)[0][0]
    assert params["kernel"].sharding == ("din", "dout")


def test_unbox_fn_is_used_when_reading_from_a_module():
    m = nnx.Dict(a=nnx.Param(2.0, unbox_fn=lambda c: c.value * 10))
    assert m.a == 20.0
