"""Parameter initializers.

An initializer is a function ``(key, shape, dtype=float32) -> array``. This
module re-exports JAX's initializers and adds :func:`zeros` and :func:`ones`
*factories*: call them to get an initializer, like every other initializer
here (``lecun_normal()``, ``normal(0.02)``, ...).

Example::

  >>> import jax
  >>> from nnx.nn import initializers
  >>> init = initializers.zeros()
  >>> init(jax.random.key(0), (2, 3)).shape
  (2, 3)
  >>> w = initializers.lecun_normal()(jax.random.key(0), (4, 8))
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from jax.nn.initializers import Initializer as Initializer
from jax.nn.initializers import constant as constant
from jax.nn.initializers import delta_orthogonal as delta_orthogonal
from jax.nn.initializers import glorot_normal as glorot_normal
from jax.nn.initializers import glorot_uniform as glorot_uniform
from jax.nn.initializers import he_normal as he_normal
from jax.nn.initializers import he_uniform as he_uniform
from jax.nn.initializers import kaiming_normal as kaiming_normal
from jax.nn.initializers import kaiming_uniform as kaiming_uniform
from jax.nn.initializers import lecun_normal as lecun_normal
from jax.nn.initializers import lecun_uniform as lecun_uniform
from jax.nn.initializers import normal as normal
from jax.nn.initializers import orthogonal as orthogonal
from jax.nn.initializers import truncated_normal as truncated_normal
from jax.nn.initializers import uniform as uniform
from jax.nn.initializers import variance_scaling as variance_scaling
from jax.nn.initializers import xavier_normal as xavier_normal
from jax.nn.initializers import xavier_uniform as xavier_uniform

Shape = tp.Sequence[int]
Dtype = tp.Any


def _filled(fill: tp.Callable[[Shape, Dtype], jax.Array]) -> Initializer:
    """An initializer returning ``fill(shape, dtype)``; the key is not used."""

    def init(key: jax.Array, shape: Shape, dtype: Dtype = jnp.float32) -> jax.Array:
        del key
        return fill(shape, dtype)

    return init


def zeros() -> Initializer:
    """Returns an initializer that fills arrays with zeros.

    Example::

      >>> import jax
      >>> from nnx.nn import initializers
      >>> initializers.zeros()(jax.random.key(0), (2,))
      Array([0., 0.], dtype=float32)
    """

    return _filled(jnp.zeros)


def ones() -> Initializer:
    """Returns an initializer that fills arrays with ones.

    Example::

      >>> import jax
      >>> from nnx.nn import initializers
      >>> initializers.ones()(jax.random.key(0), (2,))
      Array([1., 1.], dtype=float32)
    """

    return _filled(jnp.ones)


# Aliases under the names flax.linen uses.
zeros_init = zeros
ones_init = ones


def draw(init: Initializer, argument: str, ctx: tp.Any, shape: Shape, dtype: Dtype) -> jax.Array:
    """``init(ctx.make_rng('params'), shape, dtype)``: a layer's initial parameter ``argument`` (``kernel_init``
    ...), where the two easy mistakes get a TypeError saying what to pass: a factory such as ``zeros`` or
    ``lecun_normal`` given uncalled (``zeros`` failed with "takes 0 positional arguments"; ``lecun_normal`` made
    a Param holding a function, which failed only when used), and a missing ``ctx``."""
    name = _FACTORY_NAMES.get(init) if isinstance(init, tp.Hashable) else None
    if name is not None:
        raise TypeError(
            f"{argument}=nnx.initializers.{name} is the function that makes an initializer: "
            f"pass {argument}=nnx.initializers.{name}() (with its options, if any)"
        )
    if not hasattr(ctx, "make_rng"):
        raise TypeError(
            f"the layer draws its {argument.removesuffix('_init')} from ctx=, which must be an nnx.Context "
            f"(ctx=nnx.context(0)), got {type(ctx).__name__}"
        )
    return init(ctx.make_rng("params"), tuple(shape), dtype)


__all__ = [
    "Initializer",
    "constant",
    "delta_orthogonal",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "ones_init",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
    "zeros_init",
]

# What draw refuses uncalled, by the name to call (not its flax.linen alias).
_FACTORY_NAMES = {globals()[name]: name for name in __all__ if name not in ("Initializer", "zeros_init", "ones_init")}
