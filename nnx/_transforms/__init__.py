"""The lifted transforms behind :mod:`nnx.transforms`, one file per idea.

* ``lifting``: what every lifted transform shares (argument checks, a
  ``ctx=`` Context crossing the transform);
* ``state_cache``: a Module's flat state kept between ``nnx.jit`` calls;
* ``jit``, ``grad``: the function transforms;
* ``wrapper``: Modules built around a layer constructor (the base of
  ``Scan`` and ``Remat``);
* ``scan``, ``remat``: ``jax.lax.scan`` and ``jax.checkpoint``.

Import the public names from ``nnx.transforms`` (or ``nnx``), not from here.
"""
