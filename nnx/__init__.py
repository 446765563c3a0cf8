"""nnx: neural networks for JAX as plain Python objects, with a pure functional API.

See the README for a tour; every public name is documented where it is defined.
"""

from nnx.containers import (
    BatchStat,
    Cache,
    Container,
    ContainerMetadata,
    Intermediate,
    Node,
    Param,
    Static,
    Variable,
    with_metadata,
)
from nnx.contextlib import Context, context
from nnx.dataclasses import (
    dataclass,
    field,
    node_field,
    param_field,
    static_field,
    var_field,
)
from nnx.errors import TraceContextError
from nnx.helpers import Dict, Sequence, TrainState
from nnx.module import Module, ModuleDef, Pure, PureModule
from nnx.nn import initializers
from nnx.nn.activations import (
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    logsumexp,
    normalize,
    one_hot,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softmax,
    softplus,
    standardize,
    swish,
    tanh,
)
from nnx.nn.linear import Conv, Embed, Linear
from nnx.nn.lora import LoRA, LoRAParam
from nnx.nn.normalization import BatchNorm, LayerNorm
from nnx.nn.quantize import QuantizedKernel, QuantizedParam, dequantized_product
from nnx.nn.stochastic import Dropout
from nnx.nodes import is_node, register_node_type
from nnx.partitioning import All, Not, buffers
from nnx.pytreelib import Pytree, TreeNode
from nnx.spmd import (
    PARTITION_NAME,
    get_partition_spec,
    logical_axis_rules,
    logical_to_mesh,
    with_logical_constraint,
    with_logical_partitioning,
)
from nnx.state import State
from nnx.transforms import Remat, Scan, grad, jit, remat, scan

__version__ = "0.1.0"
