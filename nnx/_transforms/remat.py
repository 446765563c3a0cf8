"""``nnx.Remat`` / ``nnx.remat``: rematerialised calls with ``jax.checkpoint``."""

import dataclasses
import functools
import typing as tp

import jax
import numpy as np

from nnx import tracers
from nnx._transforms.lifting import check_arguments, check_module, merge_ctx, partition_ctx
from nnx._transforms.wrapper import LiftedModule, decorates_init
from nnx.module import Module
from nnx.state import State

F = tp.TypeVar("F", bound=tp.Callable[..., tp.Any])
M = tp.TypeVar("M", bound=Module)


@dataclasses.dataclass(frozen=True)
class _RematOptions:
    """The options of :class:`Remat`; ``static_argnums`` is kept as a tuple."""

    prevent_cse: bool = True
    static_argnums: int | tp.Sequence[int] = ()
    policy: tp.Callable[..., bool] | None = None

    def __post_init__(self):
        argnums = self.static_argnums
        object.__setattr__(self, "static_argnums", (argnums,) if isinstance(argnums, int) else tuple(argnums))


def _all_arrays(tree: tp.Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def _remat_apply(
    options: _RematOptions,
    fun: tp.Callable[..., tp.Any],
    module: Module,
    args: tuple,
    kwargs: dict[str, tp.Any],
) -> tp.Any:
    """Runs ``fun(module, *args, **kwargs)`` under ``jax.checkpoint``."""
    check_module("nnx.remat", module)
    check_arguments("nnx.remat", args, kwargs)
    state, moduledef = module.partition()
    kwargs = partition_ctx(kwargs)
    # Keyword arguments holding arrays (a Context's keys) are traced; others
    # (flags such as train=True) stay Python values, as in a direct call.
    traced = {k: v for k, v in kwargs.items() if _all_arrays(v)}
    untraced = {k: v for k, v in kwargs.items() if k not in traced}

    def pure(state: State, traced: dict[str, tp.Any], *args):
        with tracers.nnx_trace():
            inner = moduledef.merge(state)
            out = fun(inner, *args, **merge_ctx({**untraced, **traced}))
            return inner.get_state(), out

    # Argument 0 is the state, 1 the keyword arguments: shift user indices by 2.
    static = tuple(i + 2 for i in options.static_argnums)
    state, out = jax.checkpoint(
        pure,
        prevent_cse=options.prevent_cse,
        static_argnums=static,
        policy=options.policy,
    )(state, traced, *args)
    module.update_state(state)
    return out


class Remat(LiftedModule[M]):
    """A layer whose calls are rematerialised (``jax.checkpoint``).

    ``nnx.Remat(Block, **options)`` is a constructor; the built module holds
    the layer as ``remat_module``, and calling it (or ``m.call.method(...)``)
    recomputes the layer's activations in the backward pass instead of
    storing them. State changes are written back. Composes with Scan:
    ``nnx.Scan(nnx.Remat(Block), variable_axes={nnx.Param: 0}, length=8)``.

    Options: ``prevent_cse``, ``static_argnums`` (indices into the call's
    positional arguments) and ``policy``, as in ``jax.checkpoint``::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> class Block(nnx.Module):
        ...   def __init__(self, d, *, ctx):
        ...     self.linear = nnx.Linear(d, d, ctx=ctx)
        ...   def __call__(self, x):
        ...     return nnx.relu(self.linear(x))
        >>> block = nnx.Remat(Block)(3, ctx=nnx.context(0))
        >>> grads = nnx.grad(lambda m: m(jnp.ones((2, 3))).sum())(block)
        >>> list(grads)
        ['remat_module/linear/bias', 'remat_module/linear/kernel']
    """

    def __init__(
        self,
        module_constructor: tp.Callable[..., M],
        module_init_args: tuple,
        module_init_kwargs: dict[str, tp.Any],
        *,
        prevent_cse: bool = True,
        static_argnums: int | tp.Sequence[int] = (),
        policy: tp.Callable[..., bool] | None = None,
    ):
        self.module_constructor = module_constructor
        self.options = _RematOptions(prevent_cse, static_argnums, policy)
        self.remat_module = module_constructor(*module_init_args, **module_init_kwargs)

    def _run(self, fun: tp.Callable[..., tp.Any], args: tuple, kwargs: dict[str, tp.Any]) -> tp.Any:
        return _remat_apply(self.options, fun, self.remat_module, args, kwargs)


def remat(
    f: F | None = None,
    *,
    prevent_cse: bool = True,
    static_argnums: int | tp.Sequence[int] = (),
    policy: tp.Callable[..., bool] | None = None,
    is_init: bool | None = None,
) -> F:
    """Decorator form of :class:`Remat` for a Module's methods.

    ``@nnx.remat`` on a method rematerialises its calls; on ``__init__`` it
    changes nothing (so it stacks under ``@nnx.scan`` on both methods).
    ``static_argnums`` index the method's arguments after ``self``.
    """
    if f is None:
        return functools.partial(  # type: ignore[return-value]
            remat,
            prevent_cse=prevent_cse,
            static_argnums=static_argnums,
            policy=policy,
            is_init=is_init,
        )
    if decorates_init(f, is_init):
        return f
    options = _RematOptions(prevent_cse, static_argnums, policy)

    @functools.wraps(f)
    def wrapper(self: Module, *args, **kwargs):
        return _remat_apply(options, f, self, args, kwargs)

    return wrapper  # type: ignore[return-value]
