import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx


class Count(nnx.Variable):
    pass


class Counter(nnx.Module):
    """A linear layer that counts its calls."""

    def __init__(self, din: int, dout: int, *, ctx: nnx.Context):
        self.linear = nnx.Linear(din, dout, ctx=ctx)
        self.count = Count(0)

    def __call__(self, x):
        self.count += 1
        return self.linear(x)


def _counter() -> Counter:
    return Counter(2, 3, ctx=nnx.context(0))


X = jnp.ones((4, 2))


# nnx.jit
# ------------------------------------------------------------------------------


def test_jit_writes_state_changes_back():
    model = _counter()

    @nnx.jit
    def f(model, x):
        return model(x)

    y = f(model, X)
    assert y.shape == (4, 3)
    assert model.count == 1
    f(model, X)
    assert model.count == 2


def test_jit_writes_new_parameter_values_back():
    model = _counter()

    @nnx.jit
    def zero_kernel(model):
        model.linear.kernel = jnp.zeros_like(model.linear.kernel)

    zero_kernel(model)
    np.testing.assert_array_equal(model.linear.kernel, np.zeros((2, 3)))
    assert isinstance(vars(model.linear)["kernel"], nnx.Param)


def test_jit_stateless_leaves_the_module_untouched():
    model = _counter()
    kernel = model.linear.kernel

    @functools.partial(nnx.jit, stateful=False)
    def f(model, x):
        model.linear.kernel = jnp.zeros_like(model.linear.kernel)
        return model(x)

    f(model, X)
    assert model.count == 0
    assert model.linear.kernel is kernel


def test_jit_writes_back_new_attributes_such_as_intermediates():
    model = _counter()

    @nnx.jit
    def f(model, x):
        y = model(x)
        model.sow(nnx.Intermediate, "y", y)
        return y

    y = f(model, X)
    assert isinstance(vars(model)["y"], nnx.Intermediate)
    np.testing.assert_allclose(model.y[0], y)


def test_jit_does_not_retrace_for_the_same_structure():
    traces = []

    @nnx.jit
    def f(model, x):
        traces.append(1)
        return model(x)

    model = _counter()
    for _ in range(4):
        f(model, X)
    f(_counter(), X)
    f(model.clone(), X)
    assert len(traces) == 1


def test_jit_retraces_once_when_the_structure_changes():
    traces = []

    @nnx.jit
    def f(model, x):
        traces.append(1)
        return model(x)

    model = _counter()
    f(model, X)
    f(model, X)
    before = len(traces)
    model.extra = nnx.Param(jnp.zeros(()))
    f(model, X)
    f(model, X)
    assert len(traces) == before + 1


def test_jit_sees_assignments_made_between_calls():
    model = _counter()

    @nnx.jit
    def f(model, x):
        return model(x)

    f(model, X)
    model.linear.kernel = jnp.zeros((2, 3))
    model.linear.bias = jnp.ones((3,))
    np.testing.assert_allclose(f(model, X), np.ones((4, 3)))


def test_jit_sees_a_container_given_a_new_value_in_place_between_calls():
    """A State's entries are the Module's own containers: setting `.value` on one changes the Module. The cache
    of the last call's leaves took it for unchanged (its attribute still held the same container), computed with
    the old value and wrote it back over the new one."""
    model = _counter()

    @nnx.jit
    def f(model, x):
        return model(x)

    f(model, X)
    model.get_state()["linear/kernel"].value = jnp.zeros((2, 3))
    np.testing.assert_allclose(f(model, X), np.broadcast_to(model.linear.bias, (4, 3)))
    np.testing.assert_array_equal(model.linear.kernel, np.zeros((2, 3)))


def test_jit_returned_states_taken_earlier_do_not_change():
    model = _counter()

    @nnx.jit
    def f(model, x):
        model.linear.kernel = model.linear.kernel + 1.0
        return model(x)

    before = model.get_state()
    kernel = before["linear/kernel"].value
    f(model, X)
    assert before["linear/kernel"].value is kernel
    np.testing.assert_allclose(model.linear.kernel, kernel + 1.0)


def test_jit_merges_a_context_passed_as_ctx():
    model = nnx.Dropout(0.5)

    @nnx.jit
    def f(model, x, *, ctx):
        return model(x, deterministic=False, ctx=ctx)

    ctx = nnx.context(dropout=0)
    a = f(model, jnp.ones((100,)), ctx=ctx)
    b = f(model, jnp.ones((100,)), ctx=ctx)
    assert 0 < int((a == 0).sum()) < 100
    assert not np.array_equal(a, b)  # the stream advances between calls


@pytest.mark.parametrize("transform", ["jit", "grad", "remat"])
def test_a_context_passed_positionally_is_a_type_error_saying_to_pass_it_as_ctx(transform: str):
    """It reached JAX, whose error said only that a Context is no array and to mark the argument static."""

    def loss(model, x, ctx):
        return jnp.sum(model(x))

    lifted = getattr(nnx, transform)(loss)
    with pytest.raises(TypeError, match=rf"^nnx.{transform}: argument 2 after the Module is a Context; pass it as "):
        lifted(_counter(), X, nnx.context(0))
    if transform == "jit":
        with pytest.raises(TypeError, match="argument 2 after the Module is a Context"):
            lifted.lower(_counter(), X, nnx.context(0))


@pytest.mark.parametrize("transform", ["jit", "grad"])
def test_a_second_module_is_a_type_error_saying_only_the_first_is_lifted(transform: str):
    """It reached JAX, whose error said only that it could not read the argument as an array."""

    def loss(model, other=None, *, extra=None):
        return jnp.sum(model(X))

    lifted = getattr(nnx, transform)(loss)
    with pytest.raises(
        TypeError, match=rf"^nnx.{transform}: argument 1 after the first Module is a Module \(Counter\)"
    ):
        lifted(_counter(), _counter())
    with pytest.raises(TypeError, match=r"keyword argument extra= is a Module \(Counter\); only the first argument"):
        lifted(_counter(), extra=_counter())


def test_jit_returning_a_module_is_a_type_error_saying_what_to_return():
    with pytest.raises(TypeError, match=r"^nnx.jit: the function returned a Module \(Counter\); return arrays or"):
        nnx.jit(lambda model: (model(X), model))(_counter())


def test_jit_static_argnums_count_the_module_as_argument_zero():

    @functools.partial(nnx.jit, static_argnums=2)
    def f(model, x, times):
        assert isinstance(times, int)
        for _ in range(times):
            x = x + model.linear.bias
        return x

    model = _counter()
    model.linear.bias = jnp.ones((3,))
    np.testing.assert_allclose(f(model, jnp.zeros((3,)), 3), np.full((3,), 3.0))


def test_jit_works_as_a_method_decorator():

    class Model(nnx.Module):
        def __init__(self):
            self.count = Count(jnp.asarray(0))

        @nnx.jit
        def step(self, x):
            self.count += 1
            return x * 2

    model = Model()
    assert model.step(3.0) == 6.0
    assert model.count == 1


def test_jit_rejects_a_first_argument_that_is_not_a_module():
    with pytest.raises(TypeError, match="expects a Module"):
        nnx.jit(lambda x: x)(jnp.ones(()))


def test_jit_raises_when_mutating_a_module_captured_from_outside():
    outer = _counter()

    @nnx.jit
    def f(model, x):
        outer.count = 10
        return model(x)

    with pytest.raises(nnx.TraceContextError, match="Cannot mutate Module from different trace level"):
        f(_counter(), X)


def test_jit_raises_on_an_outer_module_inside_jax_jit():
    model = _counter()
    f = nnx.jit(lambda model, x: model(x))

    @jax.jit
    def g(x):
        return f(model, x)

    with pytest.raises(nnx.TraceContextError):
        g(X)


def test_jit_inside_jit_updates_the_inner_module():
    step = nnx.jit(lambda model, x: model(x))

    @nnx.jit
    def outer(model, x):
        step(model, x)
        return step(model, x)

    model = _counter()
    outer(model, X)
    assert model.count == 2


# nnx.grad
# ------------------------------------------------------------------------------


def _loss(model, x):
    return jnp.sum(model(x))


def test_grad_returns_a_state_keyed_by_path_and_typed_like_the_state():
    model = _counter()
    grads = nnx.grad(_loss)(model, X)
    assert isinstance(grads, nnx.State)
    assert set(grads) == {"linear/bias", "linear/kernel"}
    assert isinstance(grads["linear/kernel"], nnx.Param)
    np.testing.assert_allclose(grads["linear/bias"].value, np.full((3,), 4.0))
    np.testing.assert_allclose(grads["linear/kernel"].value, np.full((2, 3), 4.0))


def test_grad_writes_non_differentiated_updates_back():
    model = _counter()
    nnx.grad(_loss)(model, X)
    assert model.count == 1


def test_grad_stateless_leaves_the_module_untouched():
    model = _counter()
    nnx.grad(_loss, stateful=False)(model, X)
    assert model.count == 0


class ParamTimesStat(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.asarray(2.0))
        self.b = nnx.BatchStat(jnp.asarray(3.0))

    def __call__(self):
        return self.a * self.b


def test_grad_wrt_selects_what_is_differentiated():
    grads = nnx.grad(lambda m: m(), wrt=nnx.BatchStat)(ParamTimesStat())
    assert list(grads) == ["b"]
    assert isinstance(grads["b"], nnx.BatchStat)
    assert grads["b"].value == 2.0


def test_grad_wrt_everything_differentiates_every_node():
    """`wrt=...` raised that `...` can only be the last filter (it was put before the rest's `...`)."""
    grads = nnx.grad(lambda m: m(), wrt=...)(ParamTimesStat())
    assert {path: float(g.value) for path, g in grads.items()} == {"a": 3.0, "b": 2.0}


def test_grad_wrt_a_predicate_freezes_part_of_the_model():

    class Model(nnx.Module):
        def __init__(self, *, ctx):
            self.backbone = nnx.Linear(2, 2, ctx=ctx)
            self.head = nnx.Linear(2, 1, ctx=ctx)

        def __call__(self, x):
            return self.head(self.backbone(x))

    trainable = nnx.All(nnx.Param, lambda path, _: not path.startswith("backbone"))
    grads = nnx.grad(lambda m: jnp.sum(m(X)), wrt=trainable)(Model(ctx=nnx.context(0)))
    assert set(grads) == {"head/bias", "head/kernel"}


def test_grad_of_a_plain_array_node_is_a_node():

    class Model(nnx.Module):
        def __init__(self):
            self.w = jnp.asarray(3.0)

        def __call__(self):
            return self.w**2

    grads = nnx.grad(lambda m: m(), wrt=nnx.buffers)(Model())
    assert type(grads["w"]) is nnx.Node
    assert grads["w"].value == 6.0


def test_grad_has_aux_returns_grads_and_aux():
    grads, aux = nnx.grad(lambda m, x: (_loss(m, x), "aux"), has_aux=True)(_counter(), X)
    assert aux == "aux"
    assert set(grads) == {"linear/bias", "linear/kernel"}


def test_grad_has_aux_with_a_function_returning_only_the_loss_says_it_must_return_a_pair():
    with pytest.raises(TypeError, match=r"nnx.grad\(has_aux=True\): _loss must return a pair \(loss, aux\), got"):
        nnx.grad(_loss, has_aux=True)(_counter(), X)


def test_grad_merges_a_context_passed_as_ctx():

    def loss(model, x, *, ctx):
        noise = jax.random.normal(ctx.make_rng("noise"), x.shape)
        return jnp.sum(model(x + noise))

    grads = nnx.grad(loss)(_counter(), X, ctx=nnx.context(noise=0))
    assert grads["linear/kernel"].value.shape == (2, 3)


def test_grad_raises_when_mutating_a_module_captured_from_outside():
    outer = _counter()

    def loss(model):
        outer.count = 5
        return jnp.sum(model(X))

    with pytest.raises(nnx.TraceContextError, match="Cannot mutate Module from different trace level"):
        nnx.grad(loss)(_counter())


def test_jit_and_grad_train_step_updates_parameters():
    model = _counter()
    x, y = jnp.ones((8, 2)), jnp.zeros((8, 3))

    @nnx.jit
    def train_step(model, x, y):

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = loss_fn(model), nnx.grad(loss_fn)(model)
        params = model.filter(nnx.Param)
        model.update_state(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return loss

    losses = [float(train_step(model, x, y)) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert model.count == 10  # loss_fn ran twice per step


# Scan
# ------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, *, ctx: nnx.Context):
        self.linear = nnx.Linear(3, 3, ctx=ctx)
        self.node = jnp.ones((2,))

    def __call__(self, x, _):
        return nnx.gelu(self.linear(x)), None


def test_scan_stacks_the_layers_state_along_the_axis():
    mlp = nnx.Scan(Block, variable_axes={nnx.Param: 0}, split_rngs="params", length=5)(ctx=nnx.context(0))
    assert isinstance(mlp, nnx.Scan)
    assert mlp.scan_module.linear.kernel.shape == (5, 3, 3)
    assert mlp.scan_module.linear.bias.shape == (5, 3)
    assert mlp.scan_module.node.shape == (2,)  # carried, not stacked


def test_scan_splits_rngs_so_layers_differ():
    mlp = nnx.Scan(Block, variable_axes={nnx.Param: 0}, split_rngs="params", length=3)(ctx=nnx.context(0))
    kernels = mlp.scan_module.linear.kernel
    assert not np.allclose(kernels[0], kernels[1])


def test_scan_without_split_rngs_gives_every_layer_the_same_key():
    mlp = nnx.Scan(Block, variable_axes={nnx.Param: 0}, length=3)(ctx=nnx.context(0))
    kernels = mlp.scan_module.linear.kernel
    np.testing.assert_allclose(kernels[0], kernels[1])


def test_scan_call_applies_the_layers_in_sequence():
    mlp = nnx.Scan(Block, variable_axes={nnx.Param: 0}, split_rngs="params", length=4)(ctx=nnx.context(0))
    x = jnp.ones((1, 3))
    y, out = mlp(x, None)
    expected = x
    for i in range(4):
        layer = mlp.scan_module.linear
        expected = nnx.gelu(expected @ layer.kernel[i] + layer.bias[i])
    assert out is None
    np.testing.assert_allclose(y, expected, rtol=1e-5)


@pytest.mark.parametrize("carry", [..., nnx.Not(nnx.Intermediate)], ids=["carry-rest", "carry-named"])
def test_a_scanned_layer_that_sows_is_called_again_adding_one_stacked_entry_per_call(carry):
    """The first call stacks what each layer sowed; the second one carried it instead, and lax.scan refused the
    carry that the sow lengthened (or, with variable_carry naming what is carried, no filter covered it)."""

    class Sower(Block):
        def __call__(self, x, _):
            y, _ = super().__call__(x, _)
            self.sow(nnx.Intermediate, "h", y)
            return y, None

    scanned = nnx.Scan(Sower, variable_axes={nnx.Param: 0}, variable_carry=carry, split_rngs="params", length=4)
    mlp = scanned(ctx=nnx.context(0))
    x = jnp.ones((2, 3))
    mlp(x, None)
    y, _ = mlp(2 * x, None)
    first, second = mlp.scan_module.h
    assert first.shape == second.shape == (4, 2, 3)  # one entry per call, each stacked over the layers
    expected = 2 * x
    for i in range(4):
        expected = nnx.gelu(expected @ mlp.scan_module.linear.kernel[i] + mlp.scan_module.linear.bias[i])
        np.testing.assert_allclose(second[i], expected, rtol=1e-5)
    np.testing.assert_allclose(second[-1], y, rtol=1e-5)
    assert not np.allclose(first, second)


def test_scan_slices_xs_and_stacks_outputs():

    class Adder(nnx.Module):
        def __init__(self):
            self.unused = nnx.Param(jnp.zeros(()))

        def __call__(self, carry, x):
            return carry + x, carry * 2

    scan_adder = nnx.Scan(Adder)()
    carry, ys = scan_adder(jnp.asarray(0.0), jnp.arange(4.0))
    assert carry == 6.0
    np.testing.assert_allclose(ys, [0.0, 0.0, 2.0, 6.0])


def test_scan_in_axes_and_out_axes_move_the_scanned_axis():

    class Identity(nnx.Module):
        def __call__(self, carry, x):
            return carry, x * 2

    s = nnx.Scan(Identity, in_axes=1, out_axes=1)()
    _, ys = s(None, jnp.ones((2, 5)))
    assert ys.shape == (2, 5)


def test_scan_carry_state_is_threaded_and_broadcast_state_is_shared():

    class Layer(nnx.Module):
        def __init__(self, *, ctx):
            self.w = nnx.Param(jax.random.normal(ctx.make_rng("params"), ()))
            self.scale = nnx.BatchStat(jnp.asarray(2.0))
            self.count = Count(jnp.asarray(0))

        def __call__(self, x, _):
            self.count += 1
            return x * self.scale, None

    s = nnx.Scan(
        Layer,
        variable_axes={nnx.Param: 0},
        variable_broadcast=nnx.BatchStat,
        variable_carry=Count,
        split_rngs="params",
        length=3,
    )(ctx=nnx.context(0))
    y, _ = s(jnp.asarray(1.0), None)
    assert y == 8.0
    assert s.scan_module.count == 3
    assert s.scan_module.scale.shape == ()


def test_scan_splits_call_rngs_chosen_by_split_rngs():

    class Noise(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(jnp.zeros((3,)))

        def __call__(self, x, _, *, ctx):
            return x, jax.random.uniform(ctx.make_rng("noise"), ())

    split = nnx.Scan(Noise, variable_axes={nnx.Param: 0}, split_rngs="noise", length=3)()
    shared = nnx.Scan(Noise, variable_axes={nnx.Param: 0}, length=3)()
    _, a = split(None, None, ctx=nnx.context(noise=0))
    _, b = shared(None, None, ctx=nnx.context(noise=0))
    assert len(set(np.asarray(a).tolist())) == 3
    assert len(set(np.asarray(b).tolist())) == 1


def test_scan_writes_carried_batch_stats_back():

    class BNBlock(nnx.Module):
        def __init__(self, *, ctx):
            self.linear = nnx.Linear(3, 3, ctx=ctx)
            self.bn = nnx.BatchNorm(3, ctx=ctx)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x, _, *, ctx):
            x = self.dropout(self.bn(self.linear(x), ctx=ctx), ctx=ctx)
            return x, None

    mlp = nnx.Scan(
        BNBlock,
        variable_axes={nnx.Param: 0},
        split_rngs=("params", "dropout"),
        length=5,
    )(ctx=nnx.context(0))
    ctx = nnx.context(dropout=1, flags=dict(deterministic=False, use_running_average=False))
    y, _ = mlp(jnp.ones((4, 3)), None, ctx=ctx)
    assert y.shape == (4, 3)
    assert mlp.scan_module.bn.mean.shape == (3,)  # one BatchNorm shared by all
    assert not np.allclose(mlp.scan_module.bn.mean, 0.0)


def test_scan_call_scans_another_method():

    class Layer(nnx.Module):
        def __init__(self, *, ctx):
            self.w = nnx.Param(jnp.asarray(2.0))

        def double(self, x, _):
            return x * self.w, None

    s = nnx.Scan(Layer, variable_axes={nnx.Param: 0}, length=3)(ctx=nnx.context(0))
    y, _ = s.call.double(jnp.asarray(1.0), None)
    assert y == 8.0


def test_scan_writes_state_created_inside_back_stacked():

    class Sower(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2,)))

        def __call__(self, x, _):
            y = x * self.w
            self.sow(nnx.Intermediate, "y", y)
            return y, None

    s = nnx.Scan(Sower, variable_axes={nnx.Param: 0}, length=3)()
    s(jnp.ones((2,)), None)
    (ys,) = s.scan_module.y
    assert ys.shape == (3, 2)


def test_scan_metadata_params_add_the_layers_axis_outside_and_remove_it_inside():
    seen = []

    class Sharded(nnx.Module):
        def __init__(self, *, ctx):
            init = nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=("din", "dout"))
            self.linear = nnx.Linear(3, 3, kernel_init=init, ctx=ctx)

        def __call__(self, x, _):
            seen.append(self.get_state()["linear/kernel"].sharding)
            return self.linear(x), None

    s = nnx.Scan(
        Sharded,
        variable_axes={nnx.Param: 0},
        split_rngs="params",
        length=4,
        metadata_params={nnx.PARTITION_NAME: "layers"},
    )(ctx=nnx.context(0))

    def outside():
        return s.get_state()["scan_module/linear/kernel"].sharding

    assert outside() == ("layers", "din", "dout")
    s(jnp.ones((1, 3)), None)
    assert seen == [("din", "dout")]
    assert outside() == ("layers", "din", "dout")


def test_scan_metadata_params_insert_at_the_stacked_axis():

    class Sharded(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2, 3)), sharding=("a", "b"))

    s = nnx.Scan(
        Sharded,
        variable_axes={nnx.Param: 1},
        length=4,
        metadata_params={nnx.PARTITION_NAME: "layers"},
    )()
    assert s.scan_module.w.shape == (2, 4, 3)
    assert s.get_state()["scan_module/w"].sharding == ("a", "layers", "b")


def test_scan_variable_axes_without_length_raise():
    with pytest.raises(ValueError, match="length"):
        nnx.Scan(Block, variable_axes={nnx.Param: 0})(ctx=nnx.context(0))


def test_scan_variable_axes_without_length_raise_where_the_scan_is_declared():
    with pytest.raises(ValueError, match="length"):
        nnx.Scan(Block, variable_axes={nnx.Param: 0})


@pytest.mark.parametrize(
    "declare", [lambda: nnx.Scan(Block, variable_axis={nnx.Param: 0}, length=2), lambda: nnx.Remat(Block, polcy=None)]
)
def test_a_misspelt_option_fails_where_the_wrapper_is_declared_naming_the_options(declare):
    with pytest.raises(
        TypeError,
        match=r"unexpected keyword argument '(variable_axis|polcy)'; its options are (variable_axes|prevent_cse), ",
    ):
        declare()


class _Shared(nnx.Module):
    """A layer with a stacked weight and a statistic every layer reads: variable_broadcast."""

    def __init__(self, *, ctx):
        self.w = nnx.Param(jnp.ones(2))
        self.shared = nnx.BatchStat(jnp.full(2, 2.0))

    def __call__(self, carry, _):
        return carry + self.shared * self.w, None

    def bump(self, carry, _):
        self.shared = self.shared + 1
        return carry, None


def test_scan_layers_read_broadcast_state_and_assigning_to_it_is_refused():
    """An assignment to broadcast state was dropped without a word: the layers share it read-only."""
    scan = nnx.Scan(_Shared, variable_axes={nnx.Param: 0}, variable_broadcast=nnx.BatchStat, length=3)
    model = scan(ctx=nnx.context(0))
    carry, _ = nnx.jit(lambda m: m(jnp.zeros(2), None))(model)
    np.testing.assert_array_equal(carry, [6.0, 6.0])
    with pytest.raises(ValueError, match=r"^nnx.Scan: \['shared'\] is variable_broadcast state"):
        model.call.bump(jnp.zeros(2), None)


def test_scan_state_no_option_names_says_so_in_the_scans_terms():
    class Count(nnx.Variable):
        pass

    scan = nnx.Scan(_Shared, variable_axes={nnx.Param: 0}, variable_carry=Count, length=2)
    with pytest.raises(
        ValueError, match=r"^Non-exhaustive filters, got a non-empty remainder: \['shared'\]. nnx.Scan's"
    ):
        scan(ctx=nnx.context(0))


def test_scan_decorator_builds_stacked_layers_in_place_and_scans_the_call():

    class MLP(nnx.Module):
        @functools.partial(nnx.scan, variable_axes={nnx.Param: 0}, split_rngs="params", length=5)
        def __init__(self, *, ctx):
            self.features = 3
            self.linear = nnx.Linear(3, 3, ctx=ctx)
            self.bn = nnx.BatchNorm(3, ctx=ctx)
            self.dropout = nnx.Dropout(0.5)

        @functools.partial(nnx.scan, variable_axes={nnx.Param: 0}, split_rngs="dropout", length=5)
        def __call__(self, x, _, *, ctx):
            x = self.dropout(self.bn(self.linear(x), ctx=ctx), ctx=ctx)
            return nnx.gelu(x), None

    mlp = MLP(ctx=nnx.context(0))
    assert mlp.features == 3
    assert mlp.linear.kernel.shape == (5, 3, 3)
    assert mlp.bn.mean.shape == (3,)
    ctx = nnx.context(dropout=1, flags=dict(deterministic=False, use_running_average=False))
    y, out = mlp(jnp.ones((2, 3)), None, ctx=ctx)
    assert y.shape == (2, 3) and out is None


def test_scan_inside_jit_and_grad():
    mlp = nnx.Scan(Block, variable_axes={nnx.Param: 0}, split_rngs="params", length=3)(ctx=nnx.context(0))

    @nnx.jit
    def grads_of(model, x):
        return nnx.grad(lambda m: jnp.sum(m(x, None)[0]))(model)

    grads = grads_of(mlp, jnp.ones((1, 3)))
    assert grads["scan_module/linear/kernel"].value.shape == (3, 3, 3)


# Remat
# ------------------------------------------------------------------------------


def test_remat_holds_the_layer_and_matches_its_output_and_gradient():
    linear = nnx.Linear(3, 3, ctx=nnx.context(0))
    remat = nnx.Remat(nnx.Linear)(3, 3, ctx=nnx.context(0))
    assert isinstance(remat, nnx.Remat)
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(remat(x), linear(x))
    g_remat = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(remat)
    g_plain = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(linear)
    np.testing.assert_allclose(g_remat["remat_module/kernel"].value, g_plain["kernel"].value, rtol=1e-6)


def test_remat_uses_checkpoint_in_the_backward_pass():
    remat = nnx.Remat(nnx.Linear)(3, 3, ctx=nnx.context(0))
    x = jnp.ones((2, 3))
    jaxpr = jax.make_jaxpr(lambda s: jax.grad(lambda s: jnp.sum(s.merge()(x)))(s))(remat.partition())
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def test_remat_writes_state_back():
    remat = nnx.Remat(Counter)(2, 3, ctx=nnx.context(0))
    remat(X)
    assert remat.remat_module.count == 1


def test_remat_decorator_on_a_method():

    class Model(nnx.Module):
        def __init__(self, *, ctx):
            self.linear = nnx.Linear(2, 3, ctx=ctx)
            self.count = Count(jnp.asarray(0))

        @nnx.remat
        def __call__(self, x):
            self.count += 1
            return self.linear(x)

    model = Model(ctx=nnx.context(0))
    grads = nnx.grad(lambda m: jnp.sum(m(X)))(model)
    assert model.count == 1
    assert grads["linear/kernel"].value.shape == (2, 3)


def test_remat_inside_scan():

    class Layer(nnx.Module):
        def __init__(self, *, ctx):
            self.linear = nnx.Linear(3, 3, ctx=ctx)

        def __call__(self, x, _):
            return self.linear(x), None

    s = nnx.Scan(nnx.Remat(Layer), variable_axes={nnx.Param: 0}, split_rngs="params", length=4)(ctx=nnx.context(0))
    assert s.scan_module.remat_module.linear.kernel.shape == (4, 3, 3)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)), None)[0]))(s)
    assert grads["scan_module/remat_module/linear/kernel"].value.shape == (4, 3, 3)


def test_remat_decorator_under_scan_decorator():

    class MLP(nnx.Module):
        @functools.partial(nnx.scan, variable_axes={nnx.Param: 0}, split_rngs="params", length=4)
        @nnx.remat
        def __init__(self, *, ctx):
            self.linear = nnx.Linear(3, 3, ctx=ctx)

        @functools.partial(nnx.scan, variable_axes={nnx.Param: 0}, length=4)
        @nnx.remat
        def __call__(self, x, _):
            return self.linear(x), None

    mlp = MLP(ctx=nnx.context(0))
    assert mlp.linear.kernel.shape == (4, 3, 3)
    y, _ = mlp(jnp.ones((1, 3)), None)
    assert y.shape == (1, 3)


def test_scan_call_with_fewer_than_two_positional_arguments_raises():
    mlp = nnx.Scan(Block, variable_axes={nnx.Param: 0}, length=2)(ctx=nnx.context(0))
    with pytest.raises(TypeError, match="at least 2 positional arguments, got 1"):
        mlp(jnp.ones((1, 3)))


def test_plain_jax_grad_cannot_mutate_a_module_from_outside():
    # jax.grad opens a new trace on current JAX: use nnx.grad instead.
    model = _counter()

    def loss(params):
        model.count = 1
        return jnp.sum(params)

    with pytest.raises(nnx.TraceContextError):
        jax.grad(loss)(jnp.ones(3))


def test_jit_on_init_builds_the_module_with_static_attributes():
    calls = []

    class Foo(nnx.Module):
        @functools.partial(nnx.jit, static_argnums=(1, 2))
        def __init__(self, din: int, dout: int, *, ctx: nnx.Context):
            calls.append(1)
            self.w = nnx.Param(jax.random.normal(ctx.make_rng("params"), (din, dout)))
            self.din = din
            self.linear = nnx.Linear(din, dout, ctx=ctx)

    foo = Foo(2, 3, ctx=nnx.context(0))
    assert foo.w.shape == (2, 3) and isinstance(foo.w, jax.Array)
    assert foo.din == 2 and isinstance(foo.din, int)
    assert foo.linear.kernel.shape == (2, 3)
    Foo(2, 3, ctx=nnx.context(0))
    assert len(calls) == 1


def test_jit_writes_structure_changes_back_keeping_submodules():
    model = _counter()
    linear = model.linear

    @nnx.jit
    def f(model):
        model.linear.note = "static"
        model.extra = nnx.Linear(3, 1, ctx=nnx.context(0))
        del model.count

    f(model)
    assert model.linear is linear
    assert linear.note == "static"
    assert model.extra.kernel.shape == (3, 1)
    assert not hasattr(model, "count")


def test_jit_with_shardings_writes_structure_changes_back_as_without():
    """With in_shardings a changed static field and a deletion were silently lost, and a new submodule raised
    "Cannot reach path 'extra/bias'"."""
    model = _counter()
    linear = model.linear
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = jax.tree.map(lambda _: device, model.get_state())

    @nnx.jit(in_shardings=(placed,))
    def f(model):
        model.linear.note = "static"
        model.extra = nnx.Linear(3, 1, ctx=nnx.context(0))
        del model.count

    f(model)
    assert model.linear is linear and linear.note == "static"
    assert model.extra.kernel.shape == (3, 1) and not hasattr(model, "count")

    @nnx.jit(in_shardings=(jax.tree.map(lambda _: device, model.get_state()),),
             out_shardings=(device, jax.tree.map(lambda _: device, model.get_state())))  # fmt: skip
    def g(model):
        model.linear.note = "changed"
        model.extra.kernel = model.extra.kernel * 2
        return model.extra.kernel.sum()

    kernel = model.extra.kernel
    assert g(model) == pytest.approx(2 * float(kernel.sum()))
    assert linear.note == "changed" and jnp.array_equal(model.extra.kernel, 2 * kernel)


def test_grad_writes_structure_changes_back_as_jit_does():
    """A submodule created inside raised "Cannot reach path"; a changed static field and a deletion were lost."""

    class Lazy(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.calls = 0
            self.cache = Count(0)

        def __call__(self, x):
            if not hasattr(self, "head"):
                self.head = nnx.Linear(2, 1, ctx=nnx.context(0))
            self.calls += 1
            if hasattr(self, "cache"):
                del self.cache
            return jnp.sum(self.head(self.w * x))

    model = Lazy()
    w = model.w
    assert list(nnx.grad(lambda m, x: m(x))(model, jnp.ones(2))) == ["w"]
    assert isinstance(model.head, nnx.Linear) and model.calls == 1 and not hasattr(model, "cache")
    head = model.head
    grads = nnx.grad(lambda m, x: m(x))(model, jnp.ones(2))
    assert sorted(grads) == ["head/bias", "head/kernel", "w"]
    assert model.head is head and model.calls == 2 and model.w is w


def test_a_module_made_on_one_thread_is_used_on_another_outside_any_transform():
    """Every thread but the first had a top level of its own: a data loader or writer thread could neither
    assign to a Module nor draw from a Context made on the main thread."""
    import threading

    model, ctx, seen = _counter(), nnx.context(0), []

    def worker():
        model.count += 1
        seen.append(ctx.make_rng("params"))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert model.count == 1 and len(seen) == 1

    @nnx.jit
    def f(inner):  # a level of a transform is still its own: another thread cannot use what is made there
        made = nnx.Linear(1, 1, ctx=nnx.context(0))
        errors = []
        worker = threading.Thread(target=lambda: errors.append(_mutate(made)))
        worker.start()
        worker.join()
        assert errors == ["TraceContextError"]

    f(model)


def _mutate(module: nnx.Module) -> str:
    try:
        module.extra = 1
    except nnx.TraceContextError as e:
        return type(e).__name__
    return "no error"


def test_remat_keeps_python_keyword_arguments_static():

    class Model(nnx.Module):
        def __init__(self, *, ctx):
            self.linear = nnx.Linear(2, 2, ctx=ctx)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x, *, train: bool, ctx=None):
            return self.dropout(self.linear(x), deterministic=not train, ctx=ctx)

    remat = nnx.Remat(Model)(ctx=nnx.context(0))
    y = remat(jnp.ones((1, 2)), train=True, ctx=nnx.context(dropout=0))
    assert y.shape == (1, 2)
    np.testing.assert_allclose(remat(jnp.ones((1, 2)), train=False), remat.remat_module(jnp.ones((1, 2)), train=False))


def test_scan_raises_when_a_layer_mutates_a_module_captured_from_outside():
    outer = _counter()

    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(()))

        def __call__(self, x, _):
            outer.count = 3
            return x, None

    s = nnx.Scan(Layer, variable_axes={nnx.Param: 0}, length=2)()
    with pytest.raises(nnx.TraceContextError, match="Cannot mutate Module from different trace level"):
        s(jnp.ones(()), None)


def test_jit_does_not_keep_modules_alive():
    import gc
    import weakref

    f = nnx.jit(lambda model, x: model(x))
    model = _counter()
    f(model, X)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_jit_static_arguments_stay_static_whether_passed_by_position_or_by_keyword():
    """As with jax.jit: static_argnums=2 passed as train=..., or static_argnames="train" passed by position,
    reached the function traced (a TracerBoolConversionError at the first `if`)."""

    def f(model, x, train):
        assert isinstance(train, bool)
        return model.linear.bias * x if train else x

    model = _counter()
    model.linear.bias = jnp.full((3,), 2.0)
    by_number, by_name = nnx.jit(f, static_argnums=2), nnx.jit(f, static_argnames="train")
    by_array = nnx.jit(f, static_argnums=np.array([2]))  # any sequence of indices, as jax.jit takes
    for jitted in (by_number, by_name, by_array):
        np.testing.assert_allclose(jitted(model, jnp.ones((3,)), train=True), np.full((3,), 2.0))
        np.testing.assert_allclose(jitted(model, jnp.ones((3,)), True), np.full((3,), 2.0))
        np.testing.assert_allclose(jitted(model, jnp.ones((3,)), False), np.ones((3,)))


def test_jit_static_argnames_keep_keyword_arguments_static():

    @functools.partial(nnx.jit, static_argnames="times")
    def f(model, x, *, times):
        assert isinstance(times, int)
        return x * times

    assert f(_counter(), jnp.ones(()), times=3) == 3.0


def test_remat_of_a_function_whose_first_argument_is_no_module_says_so():
    """It was an AttributeError from inside ('float' object has no attribute 'partition')."""
    with pytest.raises(TypeError, match=r"^nnx.remat expects a Module as the first argument"):
        nnx.remat(lambda a, x: x)(1.0, 2.0)


def test_grad_of_an_integer_param_does_not_suggest_a_filter_that_selects_nothing():
    """The hint was nnx.All(nnx.Param, nnx.Not(nnx.Param)): no Param at all."""
    model = nnx.Dict(a=nnx.Param(jnp.array(1)), b=nnx.Param(jnp.array(1.0)))
    with pytest.raises(TypeError, match=r"'a' \(nnx.Param, int32\) cannot be differentiated") as raised:
        nnx.grad(lambda m: m.b.value)(model)
    assert "nnx.Not(nnx.Param)" not in str(raised.value)
    assert "a Variable kind of its own" in str(raised.value)
