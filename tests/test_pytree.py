import os
import subprocess
import sys
import textwrap
import typing as tp

import jax
import jax.numpy as jnp
import pytest

import nnx


class Point(nnx.Pytree):
    def __init__(self, x, y, name="p"):
        self.x = x
        self.y = y
        self.name = name


def test_nodes_are_children_and_the_rest_is_static():
    p = Point(jnp.array(1.0), jnp.array(2.0))
    assert jax.tree_util.tree_leaves(p) == [1.0, 2.0]
    q = jax.tree.map(lambda v: v * 2, p)
    assert float(q.x) == 2.0 and q.name == "p"


def test_a_pytree_argument_may_be_named_cls():
    class Labelled(nnx.Pytree):
        def __init__(self, x, cls):
            self.x = x
            self.cls = cls

    p = jax.tree.map(lambda v: v + 1, Labelled(jnp.array(1.0), cls="cat"))
    assert float(p.x) == 2.0 and p.cls == "cat"


def test_tree_node_marks_a_child():
    class P(nnx.Pytree):
        def __init__(self):
            self.x = 2
            self.y = nnx.TreeNode(3)

    p = P()
    assert jax.tree_util.tree_leaves(p) == [3]
    p = jax.tree.map(lambda v: v * 2, p)
    assert p.x == 2 and p.y == 6


def test_pytree_is_immutable_after_init():
    p = Point(jnp.array(1.0), jnp.array(2.0))
    with pytest.raises(AttributeError, match="is immutable, trying to update field"):
        p.name = "q"
    with pytest.raises(AttributeError, match="Cannot add new fields to an initialized Pytree"):
        p.z = 1
    with pytest.raises(AttributeError, match="is immutable, trying to update field 'x': fields cannot be deleted"):
        del p.x  # it emptied the tree's leaves, silently
    assert jax.tree.leaves(p) == [1.0, 2.0]


def test_replace_returns_a_modified_copy():
    p = Point(jnp.array(1.0), jnp.array(2.0))
    q = p.replace(name="q")
    assert q.name == "q" and p.name == "p"
    with pytest.raises(ValueError, match="Trying to replace unknown fields"):
        p.replace(zz=1)


def test_mutable_pytree_allows_assignment_but_not_new_fields():
    class M(nnx.Pytree, mutable=True):
        def __init__(self, x):
            self.x = x

    m = M(1)
    m.x = 2
    assert m.x == 2
    with pytest.raises(AttributeError, match="Cannot add new fields to"):
        m.y = 2


def test_field_order_is_sorted():
    class A(nnx.Pytree):
        def __init__(self, order):
            if order:
                self.a, self.b = jnp.array(1), jnp.array(2)
            else:
                self.b, self.a = jnp.array(2), jnp.array(1)

    assert jax.tree_util.tree_structure(A(True)) == jax.tree_util.tree_structure(A(False))
    assert jax.tree_util.tree_leaves(A(True)) == jax.tree_util.tree_leaves(A(False))


def test_generic_pytree():
    T = tp.TypeVar("T")

    class C(nnx.Pytree, tp.Generic[T]):
        def __init__(self, x: T):
            self.x = x

    assert C[int](3).x == 3


def test_dataclass_pytree():
    @nnx.dataclass
    class Foo(nnx.Pytree):
        a: int = nnx.node_field()
        b: int = nnx.field(default=2)

    foo = Foo(a=1)
    assert jax.tree_util.tree_leaves(foo) == [1]
    assert jax.jit(lambda m: m.a + m.b)(foo) == 3
    assert foo.replace(b=5).b == 5


def test_dataclass_pytree_static_field_holding_an_array_is_not_a_leaf():
    @nnx.dataclass
    class Foo(nnx.Pytree):
        table: jax.Array = nnx.static_field()
        x: jax.Array = nnx.field()

    foo = Foo(table=jnp.arange(3), x=jnp.ones(2))
    assert jax.tree_util.tree_leaves(foo) == [foo.x]
    assert (foo.table == jnp.arange(3)).all()


def test_dataclass_pytree_replace_of_an_unknown_field_raises_value_error():
    @nnx.dataclass
    class Foo(nnx.Pytree):
        a: int = nnx.node_field()

    with pytest.raises(ValueError, match="Trying to replace unknown fields"):
        Foo(a=1).replace(zz=1)


def test_frozen_dataclass_pytree_rejects_assignment():
    @nnx.dataclass(frozen=True)
    class Foo(nnx.Pytree):
        y: int = nnx.node_field()
        x: int = nnx.field(default=2)

    foo = jax.tree.map(lambda v: v * 2, Foo(y=3))
    assert (foo.x, foo.y) == (2, 6)
    with pytest.raises(AttributeError, match="cannot assign to field"):
        foo.x = 4


def test_flax_serialization_round_trip():
    from flax import serialization

    class Bar(nnx.Pytree):
        def __init__(self, a, b):
            self.a = a
            self.b = nnx.TreeNode(b)

    @nnx.dataclass
    class Foo(nnx.Pytree):
        bar: Bar
        c: int = nnx.node_field()
        d: int = nnx.field(default=4)

    foo = Foo(bar=Bar(a=1, b=2), c=3)
    state_dict = serialization.to_state_dict(foo)
    assert state_dict == {"bar": {"b": 2}, "c": 3}
    state_dict["bar"]["b"] = 5
    assert serialization.from_state_dict(foo, state_dict).bar.b == 5
    del state_dict["bar"]["b"]
    with pytest.raises(ValueError, match="Missing field"):
        serialization.from_state_dict(foo, state_dict)
    state_dict["bar"]["b"] = 5
    state_dict["x"] = 6
    with pytest.raises(ValueError, match="Unknown field"):
        serialization.from_state_dict(foo, state_dict)


def test_flax_serialization_works_for_classes_defined_before_flax_is_imported():
    # A fresh interpreter: in this one flax is already imported.
    script = textwrap.dedent("""
      import sys
      import jax.numpy as jnp, optax
      import nnx
      assert 'flax.serialization' not in sys.modules

      class Early(nnx.Pytree):
        def __init__(self):
          self.a = jnp.ones(2)
          self.name = 'static'

      params, moduledef = nnx.Linear(2, 3, ctx=nnx.context(0)).partition(nnx.Param)
      state = nnx.TrainState(moduledef, params=params, tx=optax.sgd(0.1))

      from flax import serialization
      assert list(serialization.to_state_dict(Early())) == ['a']
      assert sorted(serialization.to_state_dict(state)) == ['opt_state', 'params', 'step']
      assert sorted(serialization.to_state_dict(params)) == ['bias', 'kernel']
      restored = serialization.from_state_dict(state, {
          **serialization.to_state_dict(state), 'step': jnp.asarray(7)})
      assert int(restored.step) == 7
  """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
