"""Dtype canonicalisation and promotion for layers.

Layers take an optional computation ``dtype``. When it is ``None`` the dtype is
inferred from the inputs and parameters with JAX's promotion rules; when it is
given, everything is cast to it.

Example::

  >>> import jax.numpy as jnp
  >>> from nnx.nn import dtypes
  >>> dtypes.canonicalize_dtype(jnp.ones(2, jnp.int32))
  dtype('float32')
  >>> x, w = dtypes.promote_dtype(jnp.ones(2, jnp.bfloat16), jnp.ones(2))
  >>> x.dtype, w.dtype
  (dtype('float32'), dtype('float32'))
"""

from __future__ import annotations

import typing as tp

import jax.numpy as jnp

Dtype = tp.Any


def canonicalize_dtype(*args: tp.Any, dtype: Dtype | None = None, inexact: bool = True) -> Dtype:
    """Returns the dtype that ``args`` should be computed in.

    Args:
      *args: array-like values; ``None`` entries are ignored.
      dtype: an explicit dtype. When given it is returned (after validation) and
        no inference takes place.
      inexact: require a floating or complex dtype. An inferred integer or bool
        dtype is promoted with ``float32``; an explicit non-inexact ``dtype``
        raises ``ValueError``.

    Returns:
      The computation dtype.
    """
    if dtype is None:
        arrays = [jnp.asarray(x) for x in args if x is not None]
        dtype = jnp.result_type(*arrays)
        if inexact and not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(
            f"Dtype must be inexact (floating or complex), got {dtype}. Pass a "
            "floating dtype such as jnp.float32, or use inexact=False."
        )
    return dtype


def promote_dtype(*args: tp.Any, dtype: Dtype | None = None, inexact: bool = True) -> list[tp.Any]:
    """Casts all ``args`` to one common dtype.

    The dtype is chosen by :func:`canonicalize_dtype` with the same arguments.
    ``None`` entries are passed through unchanged, so optional parameters such
    as a missing bias can be promoted together with the rest.

    Returns:
      A list with one array (or ``None``) per argument.
    """
    dtype = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
    return [None if x is None else jnp.asarray(x, dtype) for x in args]
