import importlib

import pytest

import nnx

PUBLIC_NAMES = """
Container ContainerMetadata Node Static Variable Param BatchStat Cache
Intermediate with_metadata Context context dataclass field node_field
param_field static_field var_field TraceContextError Dict Sequence TrainState
Module ModuleDef Pure PureModule State initializers Linear Conv Embed BatchNorm
LayerNorm Dropout QuantizedKernel QuantizedParam dequantized_product is_node register_node_type All Not
buffers Pytree TreeNode
PARTITION_NAME get_partition_spec logical_axis_rules logical_to_mesh
with_logical_constraint with_logical_partitioning jit grad scan remat Scan Remat
celu elu gelu glu hard_sigmoid hard_silu hard_swish hard_tanh leaky_relu
log_sigmoid log_softmax logsumexp normalize one_hot relu relu6 selu sigmoid
silu soft_sign softmax softplus standardize swish tanh
""".split()

PUBLIC_MODULES = """
nnx.containers nnx.contextlib nnx.module nnx.state nnx.partitioning
nnx.pytreelib nnx.dataclasses nnx.helpers nnx.transforms nnx.spmd nnx.tracers
nnx.ids nnx.nodes nnx.reprlib nnx.errors nnx.nn.linear nnx.nn.normalization
nnx.nn.stochastic nnx.nn.quantize nnx.nn.activations nnx.nn.initializers nnx.nn.dtypes
""".split()


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_public_name_is_exported(name):
    assert getattr(nnx, name) is not None


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_is_importable(module):
    importlib.import_module(module)


@pytest.mark.parametrize("name", ["jit", "grad", "scan", "remat", "Scan", "Remat"])
def test_transforms_module_exports_each_lifted_transform(name):
    from nnx import transforms

    assert getattr(transforms, name) is getattr(nnx, name)


def test_pure_module_is_an_alias_of_pure():
    assert nnx.PureModule is nnx.Pure


def test_initializer_factories():
    import jax

    assert nnx.initializers.zeros()(jax.random.key(0), (2,)).tolist() == [0.0, 0.0]
    assert nnx.initializers.ones()(jax.random.key(0), (2,)).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("node", ["array", "ndarray", "node", "state", "pure", "pytree", "treenode"])
def test_node_types(node):
    import jax.numpy as jnp
    import numpy as np

    values = {
        "array": jnp.ones(1),
        "ndarray": np.ones(1),
        "node": nnx.Param(1),
        "state": nnx.State({}),
        "pure": nnx.Dict().partition(),
        "pytree": nnx.TrainState,
        "treenode": nnx.TreeNode(1),
    }
    value = values[node]
    if node == "pytree":

        class P(nnx.Pytree):
            pass

        value = P()
    assert nnx.is_node(value)


@pytest.mark.parametrize("value", [1, "a", [1], {"a": 1}, len, None])
def test_static_values_are_not_nodes(value):
    assert not nnx.is_node(value)


def test_register_node_type():
    class Custom:
        pass

    assert not nnx.is_node(Custom())
    nnx.register_node_type(Custom)
    assert nnx.is_node(Custom())
    assert list(nnx.Dict(c=Custom()).get_state()) == ["c"]
