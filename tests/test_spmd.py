import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cli_support import device_flags
from jax.sharding import PartitionSpec

import nnx
from nnx import spmd


class Foo(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(nnx.with_logical_partitioning(lambda: jnp.ones((8, 2)), ("row", "col"))())

    def __call__(self, x):
        return x @ self.w


RULES = [("row", "model"), ("col", "data")]


# Rules and specs (one device)
# ------------------------------------------------------------------------------


def test_with_logical_partitioning_records_the_sharding_on_the_param():
    assert vars(Foo())["w"].sharding == ("row", "col")


def test_with_logical_partitioning_keeps_extra_metadata():
    init = nnx.with_logical_partitioning(lambda: jnp.ones(3), ("embed",), note="x")
    assert nnx.Param(init()).note == "x"


def test_reading_a_logically_partitioned_param_without_a_mesh_is_a_plain_array():
    foo = Foo()
    assert foo.w.shape == (8, 2)
    assert foo(jnp.ones((1, 8))).shape == (1, 2)


def test_logically_partitioned_modules_keep_jit_cache_hits():
    traces = []

    @nnx.jit
    def f(model, x):
        traces.append(1)
        return model(x)

    f(Foo(), jnp.ones((1, 8)))
    f(Foo(), jnp.ones((1, 8)))
    assert len(traces) == 1


def test_get_partition_spec_of_a_train_state():
    params, moduledef = Foo().partition()
    state = nnx.TrainState(moduledef, params=params, tx=optax.adam(1e-3))
    spec = nnx.get_partition_spec(state)
    assert spec.params["w"] == PartitionSpec("row", "col")
    assert spec.opt_state[0].mu["w"] == PartitionSpec("row", "col")
    assert spec.opt_state[0].nu["w"] == PartitionSpec("row", "col")
    assert spec.opt_state[0].count == PartitionSpec()


def test_get_partition_spec_of_nodes_without_sharding_is_replicated():
    state = nnx.State({"a": nnx.Param(jnp.ones(2)), "b": jnp.ones(3), "c": nnx.Node(1)})
    spec = nnx.get_partition_spec(state)
    assert dict(spec) == {"a": PartitionSpec(), "b": PartitionSpec(), "c": PartitionSpec()}


def test_logical_to_mesh_uses_the_active_rules():
    params, moduledef = Foo().partition()
    state = nnx.TrainState(moduledef, params=params, tx=optax.adam(1e-3))
    with nnx.logical_axis_rules(RULES):
        spec = nnx.logical_to_mesh(nnx.get_partition_spec(state))
    assert spec.params["w"] == PartitionSpec("model", "data")
    assert spec.opt_state[0].mu["w"] == PartitionSpec("model", "data")
    assert spec.opt_state[0].nu["w"] == PartitionSpec("model", "data")


def test_logical_to_mesh_takes_explicit_rules():
    spec = nnx.logical_to_mesh({"w": PartitionSpec("row", "col")}, RULES)
    assert spec["w"] == PartitionSpec("model", "data")


def test_logical_axis_rules_is_restored_after_the_block():
    with nnx.logical_axis_rules(RULES):
        with nnx.logical_axis_rules([("row", "data")]):
            assert spmd.get_logical_axis_rules() == (("row", "data"),)
        assert spmd.get_logical_axis_rules() == tuple(RULES)
    assert spmd.get_logical_axis_rules() == ()


def test_logical_to_mesh_axes_leaves_unmatched_names_unsharded():
    spec = spmd.logical_to_mesh_axes(("batch", "embed", None), [("batch", "data")])
    assert spec == PartitionSpec("data", None, None)


def test_logical_to_mesh_axes_uses_each_mesh_axis_once_in_rule_order():
    rules = [("heads", "model"), ("mlp", "model"), ("mlp", "data")]
    spec = spmd.logical_to_mesh_axes(("mlp", "heads"), rules)
    assert spec == PartitionSpec("data", "model")


def test_logical_to_mesh_axes_accepts_several_mesh_axes_per_name():
    spec = spmd.logical_to_mesh_axes(("batch",), [("batch", ("data", "model"))])
    assert spec == PartitionSpec(("data", "model"))


def test_logical_to_mesh_axes_of_none_is_none():
    assert spmd.logical_to_mesh_axes(None, RULES) is None


def test_logical_to_mesh_axes_rejects_repeated_names():
    with pytest.raises(ValueError, match="more than once"):
        spmd.logical_to_mesh_axes(("row", "row"), RULES)


def test_with_logical_constraint_is_a_no_op_without_a_mesh():
    x = jnp.ones((4, 4))
    with nnx.logical_axis_rules(RULES):
        assert nnx.with_logical_constraint(x, ("row", "col")) is x


def test_with_logical_constraint_is_a_no_op_without_rules():
    x = jnp.ones((4, 4))
    assert nnx.with_logical_constraint(x, ("row", "col")) is x


def test_a_rule_naming_an_axis_the_mesh_lacks_is_a_value_error_naming_it():
    """It was a bare KeyError: 'model' from inside the constraint."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    message = r"the mesh has no axis 'model' \(its axes: 'data'\); map the logical"
    rules = [("batch", "data"), ("mlp", "model")]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules), pytest.raises(ValueError, match=message):
        jax.jit(lambda x: nnx.with_logical_constraint(x, ("batch", "mlp")))(jnp.ones((4, 8)))


def test_logical_to_mesh_sharding_builds_named_shardings():
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    shardings = spmd.logical_to_mesh_sharding({"w": PartitionSpec("row", "col")}, mesh, RULES)
    expected = jax.sharding.NamedSharding(mesh, PartitionSpec("model", "data"))
    assert shardings["w"] == expected


# Several devices (8 simulated CPU devices in a subprocess)
# ------------------------------------------------------------------------------

_MULTI_DEVICE_SCRIPT = textwrap.dedent("""
    import json, warnings
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import nnx

    warnings.simplefilter('ignore', DeprecationWarning)  # `with mesh:`
    RULES = [('row', 'model'), ('col', 'data'), ('batch', 'data'),
             ('layers', None)]
    kernel_init = nnx.with_logical_partitioning(
        nnx.initializers.lecun_normal(), ('row', 'col'))

    class Model(nnx.Module):
      def __init__(self, *, ctx):
        self.linear = nnx.Linear(8, 4, kernel_init=kernel_init, ctx=ctx)
      def __call__(self, x):
        return self.linear(x)

    @jax.jit
    def create():
      return Model(ctx=nnx.context(0)).partition()

    def shard_shape(x):
      return list(x.sharding.shard_shape(x.shape))

    auto = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))
    explicit = jax.make_mesh((2, 4), ('data', 'model'))
    results = {'devices': jax.device_count()}

    with auto, nnx.logical_axis_rules(RULES):
      model = create().merge()
    results['with_mesh'] = shard_shape(model.linear.kernel)

    for name, mesh in (('set_mesh_auto', auto), ('set_mesh_explicit', explicit)):
      with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        model = create().merge()
      results[name] = shard_shape(model.linear.kernel)

    # nnx.jit with shardings from get_partition_spec + logical_to_mesh
    model = Model(ctx=nnx.context(0))
    state_spec = nnx.logical_to_mesh(
        nnx.get_partition_spec(model.get_state()), RULES)
    state_shardings = jax.tree.map(
        lambda p: NamedSharding(auto, p), state_spec,
        is_leaf=lambda x: isinstance(x, P))
    step = nnx.jit(lambda m, x: m(x),
                   in_shardings=(state_shardings, NamedSharding(auto, P('data'))),
                   out_shardings=(NamedSharding(auto, P('data')), state_shardings))
    y = step(model, jnp.ones((4, 8)))
    results['jit_in_shardings'] = shard_shape(model.linear.kernel)
    results['jit_out'] = shard_shape(y)

    # with_logical_constraint inside jax.jit, both mesh contexts
    constrain = jax.jit(lambda x: nnx.with_logical_constraint(x, ('batch', None)))
    with auto, nnx.logical_axis_rules(RULES):
      results['constraint_with_mesh'] = shard_shape(constrain(jnp.ones((8, 8))))
    with jax.set_mesh(explicit), nnx.logical_axis_rules(RULES):
      results['constraint_set_mesh'] = shard_shape(constrain(jnp.ones((8, 8))))

    # eagerly under jax.set_mesh: a partitioned parameter read, a call, a constraint (each a TypeError before:
    # an eager array constrained to the abstract mesh's sharding)
    eager = Model(ctx=nnx.context(0))
    with jax.set_mesh(auto), nnx.logical_axis_rules(RULES):
      results['eager_set_mesh'] = [shard_shape(eager.linear.kernel), list(eager(jnp.ones((4, 8))).shape),
                                   shard_shape(nnx.with_logical_constraint(jnp.ones((8, 8)), ('batch', None)))]

    # scanned layers: the 'layers' axis is named and left unsharded
    class Layer(nnx.Module):
      def __init__(self, *, ctx):
        self.linear = nnx.Linear(8, 8, kernel_init=kernel_init, ctx=ctx)
      def __call__(self, x, _):
        return self.linear(x), None
    Stack = nnx.Scan(Layer, variable_axes={nnx.Param: 0}, split_rngs='params',
                     length=4, metadata_params={nnx.PARTITION_NAME: 'layers'})
    @jax.jit
    def create_stack():
      return Stack(ctx=nnx.context(0)).partition()
    with jax.set_mesh(auto), nnx.logical_axis_rules(RULES):
      stack = create_stack().merge()
      y, _ = nnx.jit(lambda m, x: m(x, None))(stack, jnp.ones((2, 8)))
    kernel = vars(stack.scan_module.linear)['kernel']
    results['scan_sharding'] = list(kernel.sharding)
    results['scan_shard_shape'] = shard_shape(kernel.value)
    print('RESULTS' + json.dumps(results))
""")


@pytest.fixture(scope="module")
def multi_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = device_flags(8)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _MULTI_DEVICE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(row for row in proc.stdout.splitlines() if row.startswith("RESULTS"))
    return json.loads(line[len("RESULTS") :])


def test_subprocess_sees_eight_devices(multi_device):
    assert multi_device["devices"] == 8


def test_model_created_under_jit_in_with_mesh_is_sharded_by_logical_names(multi_device):
    # kernel (8, 4): 'row' -> model (4 devices), 'col' -> data (2 devices)
    assert multi_device["with_mesh"] == [2, 2]


def test_model_created_under_jit_in_set_mesh_is_sharded_by_logical_names(multi_device):
    assert multi_device["set_mesh_auto"] == [2, 2]


def test_model_created_under_jit_in_set_mesh_with_explicit_axes_is_sharded(multi_device):
    assert multi_device["set_mesh_explicit"] == [2, 2]


def test_nnx_jit_takes_in_and_out_shardings_for_the_module_state(multi_device):
    assert multi_device["jit_in_shardings"] == [2, 2]
    assert multi_device["jit_out"] == [2, 4]


def test_with_logical_constraint_shards_inside_jit_in_both_mesh_contexts(multi_device):
    assert multi_device["constraint_with_mesh"] == [4, 8]
    assert multi_device["constraint_set_mesh"] == [4, 8]


def test_eager_reads_calls_and_constraints_under_set_mesh_use_its_devices(multi_device):
    """spec section 12: `with jax.set_mesh(mesh):` works as `with mesh:` does, outside jit too."""
    assert multi_device["eager_set_mesh"] == [[2, 2], [4, 4], [4, 8]]


def test_scanned_layers_are_sharded_with_the_layers_axis_name(multi_device):
    assert multi_device["scan_sharding"] == ["layers", "row", "col"]
    assert multi_device["scan_shard_shape"] == [4, 2, 4]


def test_the_platform_is_the_default_devices_where_one_is_chosen(monkeypatch):
    """Choices made per backend (XLA's CPU lowers a program differently) follow `jax.default_device`: on a GPU
    machine, programs placed on its CPU device are the CPU's, though `jax.default_backend()` names the GPU."""
    from nnx_cli.models.transformer.dense import cpu_products
    from nnx_cli.models.transformer.residuals import packs, widens_bfloat16

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU machine, as far as the backend says
    assert nnx.spmd.platform() == "gpu" and not packs() and not cpu_products()
    with jax.default_device(jax.devices("cpu")[0]):
        assert nnx.spmd.platform() == "cpu" and cpu_products() and packs() == widens_bfloat16()
    with jax.default_device("cpu"):
        assert nnx.spmd.platform() == "cpu"
