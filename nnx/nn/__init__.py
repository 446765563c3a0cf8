"""Layers, initializers, activations and dtype helpers.

The layers mirror their ``flax.linen`` counterparts (same parameter shapes,
defaults and numerics) as :class:`nnx.Module` subclasses.
"""

from nnx.nn import activations as activations
from nnx.nn import dtypes as dtypes
from nnx.nn import initializers as initializers
from nnx.nn import quantize as quantize
from nnx.nn.linear import Conv as Conv
from nnx.nn.linear import Embed as Embed
from nnx.nn.linear import Linear as Linear
from nnx.nn.normalization import BatchNorm as BatchNorm
from nnx.nn.normalization import LayerNorm as LayerNorm
from nnx.nn.stochastic import Dropout as Dropout
