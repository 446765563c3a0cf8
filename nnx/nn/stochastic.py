"""Stochastic layers: :class:`Dropout`."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from nnx.contextlib import Context
from nnx.module import Module
from nnx.nn._options import resolve_flag

Array = jax.Array


class Dropout(Module):
    """Randomly zeroes inputs with probability ``rate`` and rescales the rest.

    Like ``flax.linen.Dropout``: in training mode each element is kept with
    probability ``1 - rate`` and divided by ``1 - rate`` so the expectation is
    unchanged; in deterministic mode the input is returned as is. The mode is
    the first non-``None`` of the ``deterministic`` call argument, the attribute
    of the same name, and the ``deterministic`` flag of the ``ctx`` passed to
    the call. The mask is drawn from the context's ``dropout`` stream.

    Example::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> dropout = nnx.Dropout(0.5)
      >>> x = jnp.ones((2, 4))
      >>> y = dropout(x, deterministic=False, ctx=nnx.context(dropout=0))  # train
      >>> train = nnx.context(dropout=1, flags={"deterministic": False})
      >>> y = dropout(x, ctx=train)                     # mode from the flag
      >>> dropout(x, deterministic=True)                # eval
      Array([[1., 1., 1., 1.],
             [1., 1., 1., 1.]], dtype=float32)

    Args:
      rate: the probability of dropping an element (not the keep rate).
      broadcast_dims: axes along which the same mask is shared (e.g. ``(0,)``
        to drop the same features for every example).
      deterministic: default mode; ``None`` leaves it to the call.
    """

    def __init__(
        self,
        rate: float,
        broadcast_dims: Sequence[int] = (),
        deterministic: bool | None = None,
    ):
        self.rate = rate
        self.broadcast_dims = tuple(broadcast_dims)
        self.deterministic = deterministic

    def __call__(
        self,
        inputs: Array,
        *,
        deterministic: bool | None = None,
        ctx: Context | None = None,
    ) -> Array:
        """Applies dropout to ``inputs``.

        Args:
          inputs: the array to mask.
          deterministic: overrides the attribute and the context flag.
          ctx: context providing the ``dropout`` stream (required in training
            mode) and optionally the ``deterministic`` flag.
        """
        deterministic = resolve_flag(
            "deterministic",
            deterministic,
            self.deterministic,
            ctx,
            "Dropout needs to know whether it is deterministic: pass "
            "`deterministic=True/False` to the call or to the constructor, or pass "
            "a context with the flag, e.g. "
            "`ctx=nnx.context(dropout=0, flags={'deterministic': False})`.",
        )

        if self.rate == 0.0 or deterministic:
            return inputs
        # A zero keep probability would divide by zero (and give nan gradients).
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        if ctx is None:
            raise ValueError(
                "Dropout in training mode (deterministic=False) needs random keys: "
                "pass a context with a 'dropout' stream, e.g. "
                "`ctx=nnx.context(dropout=0)`."
            )

        keep_prob = 1.0 - self.rate
        mask_shape = list(inputs.shape)
        for axis in self.broadcast_dims:
            mask_shape[axis] = 1
        mask = jax.random.bernoulli(ctx.make_rng("dropout"), p=keep_prob, shape=mask_shape)
        mask = jnp.broadcast_to(mask, inputs.shape)
        return lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))
