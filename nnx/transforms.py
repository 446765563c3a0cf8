"""Lifted transforms: JAX transforms that take Modules and write state back.

``jax.jit`` and friends work on pure functions of arrays. The lifted versions
here take a Module directly, run the function on a copy rebuilt inside the
transform (``partition`` outside, ``merge`` inside) and write every state
change made inside back to the Module you passed::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x) - y) ** 2)
    >>> @nnx.jit
    ... def train_step(model, x, y):
    ...   grads = nnx.grad(loss_fn)(model, x, y)  # a State keyed like the model
    ...   params = model.filter(nnx.Param)
    ...   model.update_state(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    >>> model = nnx.Linear(2, 1, ctx=nnx.context(0))
    >>> x, y = jnp.ones((8, 2)), jnp.zeros((8, 1))
    >>> before = loss_fn(model, x, y)
    >>> train_step(model, x, y)  # the model now holds the new parameters
    >>> bool(loss_fn(model, x, y) < before)
    True

* :func:`jit`: ``jax.jit``; compiled once per Module structure.
* :func:`grad`: ``jax.grad`` with respect to the nodes a filter selects.
* :class:`Scan` / :func:`scan`: ``jax.lax.scan`` over stacked layers.
* :class:`Remat` / :func:`remat`: ``jax.checkpoint``.

A ``Context`` passed as ``ctx=`` is partitioned on the way in and merged
inside, so layers can draw RNG keys in the transformed function.

Trace safety: the function runs at a new nnx trace level
(:func:`nnx.tracers.nnx_trace`). Only Modules passed in (and Modules created
inside) can be mutated there; mutating a Module captured from outside
raises ``TraceContextError`` ("Cannot mutate Module from different trace
level"). Pass every Module the function changes as an argument.

The implementation lives in ``nnx/_transforms/``, one file per transform;
import the names from here or from ``nnx``.
"""

from nnx._transforms.grad import grad
from nnx._transforms.jit import jit
from nnx._transforms.remat import Remat, remat
from nnx._transforms.scan import Scan, scan

__all__ = ["Remat", "Scan", "grad", "jit", "remat", "scan"]
