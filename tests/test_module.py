import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx


class Count(nnx.Variable):
    pass


class Foo(nnx.Module):
    def __init__(self, c: float, *, ctx: nnx.Context):
        self.w = nnx.Param(jax.random.uniform(ctx.make_rng("params"), ()))
        self.c = jnp.asarray(c)

    def __call__(self, x, *, ctx: nnx.Context):
        return self.w * x + jax.random.normal(ctx.make_rng("e"), ()) + self.c


def test_a_module_argument_may_be_named_cls():
    class Head(nnx.Module):
        def __init__(self, cls: int):
            self.classes = cls

    assert Head(cls=10).classes == 10


def test_a_plain_list_or_dict_holding_modules_or_arrays_warns_that_it_is_static():
    """Its contents are no state: they did not train, and nnx.jit baked them in, with no word of it."""
    ctx = nnx.context(0)

    class Layers(nnx.Module):
        def __init__(self):
            self.sizes = [2, 3]  # static, as meant: no warning
            self.layers = [nnx.Linear(2, 2, ctx=ctx)]
            self.tables = {"a": jnp.ones(2)}

    with pytest.warns(UserWarning) as caught:
        model = Layers()
    assert [str(w.message).split(":")[0] for w in caught] == ["Layers.layers", "Layers.tables"]
    assert "Hold them in nnx.Sequence([...])" in str(caught[0].message)
    assert "Hold them in nnx.Dict({...})" in str(caught[1].message)
    assert list(model.get_state()) == []


def test_sowing_a_value_assigns_a_tuple_into_its_variable_without_a_warning():
    model = nnx.Linear(2, 2, ctx=nnx.context(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.sow(nnx.Intermediate, "y", jnp.ones(2))
        model.sow(nnx.Intermediate, "y", jnp.ones(2))
    assert len(model.y) == 2


def test_module_state_is_attached_before_init():
    seen = []

    class Bar(nnx.Module):
        def __init__(self):
            seen.append(hasattr(self, "_module__state"))

    bar = Bar()
    assert seen == [True] and hasattr(bar, "_module__state")


def test_reading_a_container_attribute_returns_its_value():
    m = nnx.Dict(a=nnx.Param(1))
    assert m.a == 1
    assert isinstance(vars(m)["a"], nnx.Param)


def test_assignment_keeps_container_type_and_metadata():
    m = nnx.Dict(count=Count(0, sharding=("x",)))
    m.count += 1
    assert type(vars(m)["count"]) is Count
    assert vars(m)["count"].sharding == ("x",) and m.count == 1


def test_assigning_a_container_stores_a_copy():
    p = nnx.Param(1)
    m = nnx.Dict(a=p)
    assert vars(m)["a"] is not p and vars(m)["a"] == p


def test_state_taken_before_a_mutation_does_not_change():
    m = nnx.Dict(a=nnx.Param(1))
    state = m.get_state()
    m.a = 5
    assert state["a"].value == 1


def test_call_with_context():
    foo = Foo(c=1.0, ctx=nnx.context(0))
    assert isinstance(foo(x=2.0, ctx=nnx.context(e=1)), jax.Array)


def test_mutating_outer_module_inside_jit_raises():
    m = nnx.Dict(a=nnx.Param(1))

    @jax.jit
    def f():
        with pytest.raises(nnx.TraceContextError, match="Cannot mutate Module from different trace level"):
            m.a = 2
        return 0

    f()


def test_mutating_outer_module_inside_jax_grad_raises():
    # On current JAX, jax.grad opens a new trace: outer Modules are read-only there.
    m = nnx.Dict(a=nnx.Param(1.0))

    def f(x):
        with pytest.raises(nnx.TraceContextError):
            m.a = 2.0
        return x

    jax.grad(f)(1.0)


def test_pure_module_crosses_jit_and_comes_back_mutated():
    m = nnx.Dict(a=nnx.Param(1))

    @jax.jit
    def g(pure_module: nnx.PureModule[nnx.Dict[int]]):
        inner = pure_module.merge()
        inner.a += 1
        return inner.partition()

    m2 = g(m.partition()).merge()
    assert m2 is not m and m.a == 1 and m2.a == 2


def test_jit_does_not_retrace_for_the_same_structure():
    traces = 0
    m = nnx.Dict(a=nnx.Param(1))

    @jax.jit
    def g(pure_module):
        nonlocal traces
        traces += 1
        inner = pure_module.merge()
        inner.a += 1
        return inner.partition()

    m2 = g(m.partition()).merge()
    g(m.partition())
    g(m2.partition())
    assert traces == 1
    m2.b = nnx.Param(10)
    g(m2.partition())
    assert traces == 2


def test_shared_submodules_stay_shared_after_merge():
    m1 = nnx.Dict(a=nnx.Param(1), b=nnx.Param(2))
    m2 = nnx.Dict(x=m1, y=m1, z=nnx.Param(3))
    state, moduledef = m2.partition()
    assert list(state) == ["x/a", "x/b", "z"]
    m3 = moduledef.merge(state)
    assert m3["x"] is m3["y"] and m3["x"] is not m1


def test_shared_module_state_appears_at_first_sorted_path():
    shared = nnx.Dict(w=nnx.Param(1))
    m = nnx.Dict(b=shared, a=nnx.Dict(inner=shared))
    assert list(m.get_state()) == ["a/inner/w"]


def test_cycles_survive_partition_and_merge():
    class Cyclic(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(1)
            self.sub = self

    state, moduledef = Cyclic().partition()
    assert len(state) == 1
    m2 = moduledef.merge(state)
    assert m2 is m2.sub


def test_state_paths_are_slash_joined_and_sorted():
    m = nnx.Dict(
        encoder=nnx.Dict(linear1=nnx.Dict(kernel=nnx.Param(1)), b=nnx.Param(0)),
        a=nnx.Param(2),
    )
    assert list(m.get_state()) == ["a", "encoder/b", "encoder/linear1/kernel"]


def test_containers_at_several_paths_are_separate_state_entries():
    r1, r2 = nnx.Node(1), nnx.Node(2)
    m = nnx.Dict({"a": nnx.Sequence([r1, r2, 3]), "b": nnx.Dict({"c": r1, "d": r2})})
    state, _ = m.partition()
    assert len(state) == 4 and len(jax.tree_util.tree_leaves(state)) == 4


def test_arrays_are_nodes_and_other_values_are_static():
    m = nnx.Dict(a=nnx.Node(1), b=jnp.array(3), c=np.ones(2), d=[1, 2], e="s", f=7)
    state, moduledef = m.partition()
    assert list(state) == ["a", "b", "c"]
    m2 = moduledef.merge(state)
    assert m2.d == [1, 2] and m2.e == "s" and m2.f == 7


def test_partition_with_several_filters_returns_one_state_per_filter():
    m = nnx.Dict(a=nnx.Sequence([nnx.Param(1), nnx.BatchStat(2)]), b=nnx.Param(2), c=100)
    (params, rest), moduledef = m.partition(nnx.Param, ...)
    assert list(params) == ["a/0", "b"] and list(rest) == ["a/1"]
    m2 = moduledef.merge(params, rest)
    assert (m2.a[0], m2.a[1], m2.b, m2.c) == (1, 2, 2, 100)


def test_partition_with_one_filter_must_match_everything():
    m = nnx.Dict(a=nnx.Param(1), b=nnx.BatchStat(2))
    with pytest.raises(ValueError, match="Non-exhaustive filters, got a non-empty remainder"):
        m.partition(nnx.Param)
    assert list(m.partition(nnx.Variable).states) == ["a", "b"]


def test_ellipsis_must_be_the_last_filter():
    m = nnx.Dict(a=nnx.Param(1))
    with pytest.raises(ValueError, match="can only be used as the last filter"):
        m.partition(..., nnx.Param)


def test_filter_is_not_exhaustive():
    m = nnx.Dict(
        a=nnx.Sequence([nnx.Param(1), nnx.Param(2), nnx.Node(3)]), b=nnx.Dict(c=nnx.Param(1), d=nnx.BatchStat(2))
    )
    assert len(m.filter(nnx.Param)) == 3
    params, stats = m.filter(nnx.Param, nnx.BatchStat)
    assert (len(params), len(stats)) == (3, 1)
    assert len(m.filter(nnx.Not(nnx.Variable))) == 1


def test_get_state_and_get_module_def():
    m = nnx.Dict(a=nnx.Param(1), b=nnx.BatchStat(2))
    assert isinstance(m.get_state(), nnx.State) and len(m.get_state()) == 2
    assert m.get_module_def() == m.partition().moduledef


def test_module_def_is_hashable_and_equal_by_structure():
    a = nnx.Dict(x=nnx.Param(1), n=3).get_module_def()
    b = nnx.Dict(x=nnx.Param(5), n=3).get_module_def()
    c = nnx.Dict(x=nnx.Param(5), n=4).get_module_def()
    assert a == b and hash(a) == hash(b) and a != c
    assert jax.tree_util.tree_leaves(a) == []


def test_merge_builds_new_objects():
    m = nnx.Dict(a=nnx.Dict(b=nnx.Param(1)))
    m2 = m.partition().merge()
    assert m2 is not m and m2.a is not m.a


def test_update_state_writes_values_at_paths():
    m = nnx.Dict(a=nnx.Sequence([nnx.Param(1), nnx.BatchStat(3)]), b=nnx.Param(2), c=100)
    state = jax.tree.map(lambda x: x * 2, m.get_state())
    m.update_state(state)
    assert (m.a[0], m.a[1], m.b, m.c) == (2, 6, 4, 100)


def test_update_state_accepts_pure_module_and_tuples():
    m = nnx.Dict(a=nnx.Param(1), c=jnp.array(100))
    pure = jax.tree.map(lambda x: x * 2, m.partition(nnx.Param, ...))
    m.update_state(pure)
    assert (m.a, int(m.c)) == (2, 200)
    m.update_state(pure.states)
    m.update_state(nnx.Dict(a=nnx.Param(7)))
    assert m.a == 7


def test_update_state_creates_missing_attributes():
    m = nnx.Dict(a=nnx.Param(1))
    m.update_state(nnx.State({"y": nnx.Intermediate((3,))}))
    assert m.y == (3,)


def test_update_state_with_gradients():
    m = nnx.Dict(a=nnx.Sequence([nnx.Param(1.0), nnx.BatchStat(-10)]), b=nnx.Param(2.0), c=100)
    params = m.filter(nnx.Param)
    grads = jax.grad(lambda p: sum(2 * x for x in jax.tree_util.tree_leaves(p)))(params)
    m.update_state(grads)
    assert (m.a[0], m.a[1], m.b, m.c) == (2.0, -10, 2.0, 100)


def test_pop_state_removes_nodes():
    class Bar(nnx.Module):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "y", x + 1)
            return x + 1

    m = Bar()
    assert m(2) == 3 and m(10) == 11
    assert m.y == (3, 11)
    intermediates = m.pop_state(nnx.Intermediate)
    assert isinstance(intermediates["y"], nnx.Intermediate)
    assert intermediates["y"].value == (3, 11)
    assert not hasattr(m, "y")


def test_pop_state_with_several_filters_in_submodules():
    m = nnx.Dict(a=nnx.Dict(p=nnx.Param(1), s=nnx.BatchStat(2)), n=nnx.Node(3))
    params, stats = m.pop_state(nnx.Param, nnx.BatchStat)
    assert list(params) == ["a/p"] and list(stats) == ["a/s"]
    assert list(m.get_state()) == ["n"]


@pytest.mark.parametrize(
    "initial, error",
    [
        (10, "Expected 'y' to be a Variable, got int"),
        (nnx.Param(10), "Expected 'y' to be of type 'Intermediate', got 'Param'"),
        (nnx.Intermediate(10), "Expected 'y' to be a tuple, got int"),
    ],
)
def test_sow_errors(initial, error):
    m = nnx.Dict(y=initial)
    with pytest.raises(ValueError, match=error):
        m.sow(nnx.Intermediate, "y", 1)


def test_sow_onto_a_plain_attribute_says_to_delete_it_or_use_another_name():
    m = nnx.Dict(y=10)
    with pytest.raises(ValueError, match=r"Sow under another name, or delete the attribute first \(del module.y\)"):
        m.sow(nnx.Intermediate, "y", 1)


def test_sow_onto_another_variable_type_says_which_type_appends():
    m = nnx.Dict(y=nnx.Param(()))
    with pytest.raises(ValueError, match="Sow with Param to append to it"):
        m.sow(nnx.Intermediate, "y", 1)
    m.sow(nnx.Param, "y", 1)
    assert m.y == (1,)


def test_sow_onto_an_assigned_value_says_how_to_reset_it():
    m = nnx.Dict(y=nnx.Intermediate(10))
    with pytest.raises(ValueError, match=r"reset it to an empty tuple first \(module.y = \(\)\)"):
        m.sow(nnx.Intermediate, "y", 1)
    m.y = ()
    m.sow(nnx.Intermediate, "y", 1)
    assert m.y == (1,)


def test_clone_is_independent():
    m = nnx.Dict(a=nnx.Sequence([nnx.Param(1), nnx.Param(2), 3]), b=nnx.Dict(c=nnx.Param(1)))
    m2 = m.clone()
    assert m2 is not m and m2.a[0] == 1 and m2.a[2] == 3
    m2.b.c = 10
    assert m.b.c == 1


def test_apply_runs_on_a_clone():
    class Counter(nnx.Module):
        def __init__(self):
            self.count = Count(0)
            self.sub = nnx.Dict(n=Count(0))

        def __call__(self, x):
            self.count += 1
            return x * 2

        def twice(self, x):
            self.count += 2
            return x * 4

    m = Counter()
    out, m2 = m.apply(3)
    assert out == 6 and m2.count == 1 and m.count == 0
    out, m3 = m.apply.twice(1)
    assert out == 4 and m3.count == 2 and m.count == 0


def test_moduledef_apply_returns_output_and_updated_pure():
    foo = Foo(c=1.0, ctx=nnx.context(0))
    states, moduledef = foo.partition()
    assert isinstance(states["w"], nnx.Param) and isinstance(states["c"], jax.Array)
    y, updates = moduledef.apply(states)(x=2.0, ctx=nnx.context(e=1))
    assert isinstance(y, jax.Array) and isinstance(updates, nnx.Pure)


def test_moduledef_apply_reaches_submodules_and_items():
    class Inner(nnx.Module):
        def __init__(self):
            self.k = Count(0)

        def __call__(self, x):
            self.k += 1
            return x + 1

    m = nnx.Dict(enc=Inner(), seq=nnx.Sequence([Inner()]))
    state, moduledef = m.partition()
    y, (new_state, _) = moduledef.apply(state).enc(1)
    assert y == 2 and new_state["enc/k"].value == 1
    y, (new_state, _) = moduledef.apply(state).seq[0](1)
    assert y == 2 and new_state["seq/0/k"].value == 1


def test_for_each_visits_each_distinct_module_once():
    class Bar(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(1)

    class Baz(nnx.Module):
        def __init__(self, bar):
            self.bar1, self.bar2, self.b = bar, bar, nnx.Param(2)

    baz = Baz(Bar())

    def bump(bar):
        bar.a += 1

    baz.for_each(Bar, bump)
    assert baz.bar1.a == 2 and baz.bar2.a == 2

    def bump_b(m):
        m.b += 1

    baz.for_each(Baz, bump_b)
    assert baz.b == 3


def test_modules_are_hashable_by_identity():
    a, b = nnx.Dict(x=nnx.Param(1)), nnx.Dict(x=nnx.Param(1))
    assert a != b and len({a, b, a}) == 2


def test_repr_is_multiline_and_handles_cycles():
    class Cyclic(nnx.Module):
        def __init__(self):
            self.features = 3
            self.sub = self

    text = repr(Cyclic())
    assert text.startswith("Cyclic(\n") and "features=3" in text and "sub=..." in text


def test_dataclass_module_fields_are_wrapped():
    @nnx.dataclass
    class DC(nnx.Module):
        a: int = nnx.static_field()
        b: int = nnx.node_field()
        c: int = nnx.param_field()
        d: int = nnx.var_field(nnx.BatchStat)
        e: int = 0
        f: int = 0

    m = DC(a=1, b=2, c=3, d=4, e=5, f=nnx.Node(6))
    state, _ = m.partition()
    assert len(state) == 4
    assert state["b"] == nnx.Node(2)
    assert state["c"] == nnx.Param(3)
    assert state["d"] == nnx.BatchStat(4)
    assert state["f"] == nnx.Node(6)
    assert hash(m) == hash(m)


def test_dataclass_module_static_field_holding_an_array_is_not_state():
    @nnx.dataclass
    class DC(nnx.Module):
        table: jax.Array = nnx.static_field()
        w: jax.Array = nnx.param_field()

    m = DC(table=jnp.arange(3), w=jnp.ones(2))
    assert list(m.get_state()) == ["w"]
    assert (m.table == jnp.arange(3)).all()
    assert (m.clone().table == jnp.arange(3)).all()


def test_dataclass_param_field_gives_its_sharding_to_a_param_given_without_one():
    @nnx.dataclass
    class DC(nnx.Module):
        w: jax.Array = nnx.param_field(sharding=("embed",))
        v: jax.Array = nnx.param_field(sharding=("embed",))

    state = DC(w=nnx.Param(jnp.ones(2)), v=nnx.Param(jnp.ones(2), sharding=("mlp",))).get_state()
    assert state["w"].sharding == ("embed",)  # it was dropped: None
    assert state["v"].sharding == ("mlp",)  # the Param's own stays


def test_dataclass_field_rejects_incompatible_container():
    @nnx.dataclass
    class DC(nnx.Module):
        a: int = nnx.node_field()

    with pytest.raises(ValueError, match="is not compatible with return type"):
        DC(a=nnx.Param(1))
    assert DC(a=nnx.Node(1)).a == 1


def test_worked_example_from_the_spec():
    class Linear(nnx.Module):
        def __init__(self, din, dout, *, ctx: nnx.Context):
            self.w = nnx.Param(jax.random.uniform(ctx.make_rng("params"), (din, dout)))
            self.b = nnx.Param(jnp.zeros((dout,)))
            self.count = Count(0)

        def __call__(self, x):
            self.count += 1
            return x @ self.w + self.b

    model = Linear(12, 2, ctx=nnx.context(0))
    x, y = jnp.ones((8, 12)), jnp.ones((8, 2))
    (params, counts), moduledef = model.partition(nnx.Param, Count)

    @jax.jit
    def train_step(params, counts, x, y):
        def loss_fn(params):
            y_pred, (updates, _) = moduledef.apply(params, counts)(x)
            return jnp.mean((y_pred - y) ** 2), updates.filter(Count)

        grads, counts = jax.grad(loss_fn, has_aux=True)(params)
        params = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
        return params, counts

    params, counts = train_step(params, counts, x, y)
    model = moduledef.merge(params, counts)
    assert model.count == 1


def test_update_state_refuses_a_value_at_the_path_of_a_submodule():
    """It put the array in the submodule's place: the model lost its layer without a word."""

    class Wrapper(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 3, ctx=nnx.context(0))

    model = Wrapper()
    with pytest.raises(ValueError, match=r"Cannot update path 'lin': it is a submodule \(Linear\)"):
        model.update_state(nnx.State({"lin": jnp.zeros(3)}))
    assert isinstance(model.lin, nnx.Linear)
