"""``nnx.grad``: ``jax.grad`` with respect to the nodes a filter selects."""

import functools
import typing as tp

import jax

from nnx import containers, partitioning, tracers
from nnx._transforms.lifting import check_arguments, check_module, merge_ctx, partition_ctx, reconcile
from nnx.module import Module
from nnx.state import State

Filter = partitioning.Filter


def grad(
    fun: tp.Callable[..., tp.Any] | None = None,
    wrt: Filter = containers.Param,
    *,
    stateful: bool = True,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> tp.Callable[..., tp.Any]:
    """``jax.grad`` for functions whose first argument is a Module.

    Differentiates ``fun(module, *args, **kwargs)`` with respect to the nodes
    that ``wrt`` selects (``nnx.Param`` by default) and returns their
    gradients as a ``State`` keyed like the module's state, each gradient in
    the same container type as its node (a plain array node gives a ``Node``)::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> def loss_fn(model, x):
        ...   return jnp.mean(model(x) ** 2)
        >>> model = nnx.Linear(2, 1, ctx=nnx.context(0))
        >>> grads = nnx.grad(loss_fn)(model, jnp.ones((4, 2)))
        >>> list(grads), type(grads['kernel']).__name__  # d loss / d kernel, as a Param
        (['bias', 'kernel'], 'Param')

    ``wrt`` is any filter: ``nnx.All(nnx.Param, lambda path, _: not
    path.startswith('backbone'))`` freezes the backbone. With ``stateful=True``
    the other state changes made inside (batch statistics, counters) are
    written back to ``module``, and so are changes of its structure (a
    submodule made on first call, a deleted attribute), as ``nnx.jit``
    does. With ``has_aux=True``, ``fun`` returns ``(loss, aux)`` and the
    call returns ``(grads, aux)``. An integer node
    that ``wrt`` selects (the codes of an ``nnx.QuantizedKernel``) is a
    ``TypeError`` naming it, unless ``allow_int=True``.
    """
    if fun is None:
        return functools.partial(
            grad,
            wrt=wrt,
            stateful=stateful,
            has_aux=has_aux,
            holomorphic=holomorphic,
            allow_int=allow_int,
        )

    @functools.wraps(fun)
    def grad_fn(module: Module, *args, **kwargs):
        check_module("nnx.grad", module)
        check_arguments("nnx.grad", args, kwargs)
        kwargs = partition_ctx(kwargs)
        state, moduledef = module.partition()
        diff, rest = state.partition(partitioning.Everything() if wrt is ... else wrt, ...)  # `...` goes last
        if not allow_int:
            _check_differentiable(diff)
        differentiated = diff
        boxed = frozenset(path for path, value in diff.items() if not isinstance(value, containers.Container))
        if boxed:
            diff = State({path: containers.Node(value) if path in boxed else value for path, value in diff.items()})

        def pure(diff: State, rest: State, *args, **kwargs):
            if boxed:
                diff = State({path: value.value if path in boxed else value for path, value in diff.items()})
            with tracers.nnx_trace():
                inner = moduledef.merge(diff, rest)
                out = fun(inner, *args, **merge_ctx(kwargs))
                if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError(
                        f"nnx.grad(has_aux=True): {getattr(fun, '__name__', 'the function')} must return a pair "
                        f"(loss, aux), got {type(out).__name__}"
                    )
                loss, aux = out if has_aux else (out, None)
                if not stateful:
                    return loss, (aux, None, None)
                now, structure = inner.partition()
            return loss, (aux, now - diff, structure)  # the structure has no leaves: it passes as aux data does

        grads, (aux, updates, structure) = jax.grad(
            pure,
            argnums=0,
            has_aux=True,
            holomorphic=holomorphic,
            allow_int=allow_int,
        )(diff, rest, *args, **kwargs)
        if stateful and structure == moduledef:
            module.update_state(updates)
        elif stateful:  # new or deleted attributes, swapped submodules, changed static fields: as nnx.jit does
            reconcile(module, structure.merge(differentiated, updates))
        return (grads, aux) if has_aux else grads

    return grad_fn


def _check_differentiable(diff: State) -> None:
    """Name the first integer or boolean node that ``wrt`` selected: jax.grad would only name its dtype."""
    for path, value in diff.items():
        array = value.value if isinstance(value, containers.Container) else value
        dtype = getattr(array, "dtype", None)
        if dtype is not None and not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
            kind = type(value).__name__
            kind = f"nnx.{kind}" if type(value).__module__.split(".")[0] == "nnx" else kind
            narrow = (  # leaving its kind out would leave out every Param: it needs a kind of its own
                "hold it in a Variable kind of its own (class Count(nnx.Variable)) and differentiate wrt=nnx.Param"
                if issubclass(containers.Param, type(value))
                else f"narrow `wrt` (e.g. wrt=nnx.LoRAParam, or nnx.All(nnx.Param, nnx.Not({kind})))"
            )
            raise TypeError(
                f"nnx.grad: {path!r} ({kind}, {dtype}) cannot be differentiated, and `wrt` selects it; {narrow}, or "
                "pass allow_int=True"
            )
