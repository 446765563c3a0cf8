"""Exceptions raised by nnx."""


class TraceContextError(Exception):
    """An object was used at a JAX (or nnx) trace level other than its own.

    Modules and Contexts remember the trace level they were created at. Using
    one from inside a ``jax.jit``/``nnx.jit`` (or another transform) that it was
    not created in would leak tracers, so nnx refuses. Pass the object through
    the transform instead: partition it into pure state outside and merge it
    back inside, or use a lifted transform such as ``nnx.jit``.
    """
