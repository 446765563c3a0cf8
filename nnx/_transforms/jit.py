"""``nnx.jit``: ``jax.jit`` for functions whose first argument is a Module.

The compiled function is pure in ``(leaves, signature, *args)``: the Module's
state as a flat list of arrays and, as a static argument, its structure. The
flat state is cached between calls (see :mod:`.state_cache`), and the state
that comes back is written into the Module's attributes in place.
"""

import functools
import inspect
import operator
import typing as tp

import jax

from nnx import tracers
from nnx._transforms.lifting import check_arguments, check_module, merge_ctx, partition_ctx, reconcile
from nnx._transforms.state_cache import FlatState, Signature, StateCache
from nnx.module import Module, _check_trace

F = tp.TypeVar("F", bound=tp.Callable[..., tp.Any])

_UNSPECIFIED = object()


def _check_output(out: tp.Any) -> None:
    """Raises ``TypeError`` for a Module among the outputs of a jitted function (once, as it is traced)."""
    for leaf in jax.tree.leaves(out):
        if isinstance(leaf, Module):
            raise TypeError(
                f"nnx.jit: the function returned a Module ({type(leaf).__name__}); return arrays or a State "
                "(module.get_state()). Changes made inside to the Module passed in are written back to it already"
            )


class _Jitted:
    """``f(module, *args, **kwargs)`` compiled by ``jax.jit``, state written back.

    JAX compiles once per structure (``Signature``). A call on an unchanged
    Module does no graph walk: one jitted call on the cached leaves and one
    pass writing the new leaves back into the Module's attributes.
    """

    def __init__(self, fun: tp.Callable[..., tp.Any], stateful: bool, jit_kwargs: dict):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._stateful = stateful
        self._structured = "in_shardings" in jit_kwargs or "out_shardings" in jit_kwargs
        pure = functools.partial(_Jitted._pure, self)
        # Named after the user's function in HLO dumps and profiles (no
        # __wrapped__: jax.jit must see the pure signature, not the user's).
        pure.__name__ = getattr(fun, "__name__", "fun")  # type: ignore[attr-defined]
        self._jitted = jax.jit(pure, **jit_kwargs)
        self._cache = StateCache()

    def _pure(self, leaves: tp.Any, signature: Signature, *args, **kwargs):
        # ``leaves`` is the flat list, or the State itself when shardings are
        # given for it (they are written against the State's structure).
        state = leaves if self._structured else signature.treedef.unflatten(leaves)
        with tracers.nnx_trace():
            module = signature.moduledef.merge(state)
            out = self._fun(module, *args, **merge_ctx(kwargs))
            _check_output(out)
            if not self._stateful:
                return out
            state, moduledef = module.partition()
        if self._structured:  # the structure rides along: no leaves, so out_shardings gets None for it
            return out, state, moduledef
        new_leaves, treedef = jax.tree.flatten(state)
        if treedef == signature.treedef and moduledef == signature.moduledef:
            return out, new_leaves  # same structure: the fast write-back applies
        # New attributes, submodules or static fields: the structure comes back
        # too (a ModuleDef has no leaves, so this costs nothing at run time).
        return out, state, moduledef

    def _state_argument(self, flat: FlatState) -> tp.Any:
        """What ``_pure`` receives as ``leaves`` for the Module's state."""
        return flat.signature.treedef.unflatten(flat.leaves) if self._structured else flat.leaves

    def __call__(self, module: Module, *args, **kwargs):
        if not isinstance(module, Module):
            check_module("nnx.jit", module)
        if "ctx" in kwargs:
            kwargs = partition_ctx(kwargs)
        if args or kwargs:
            check_arguments("nnx.jit", args, kwargs)
        flat = self._cache.get(module)
        if not self._stateful:
            return self._jitted(self._state_argument(flat), flat.signature, *args, **kwargs)
        _check_trace(module)
        if self._structured:
            out, new, moduledef = self._jitted(self._state_argument(flat), flat.signature, *args, **kwargs)
            leaves, treedef = jax.tree.flatten(new)
            same = treedef == flat.signature.treedef and moduledef == flat.signature.moduledef
            if same and flat.slots is not None:
                flat.write_back(leaves)
            else:  # new or deleted attributes, swapped submodules, changed static fields: as without shardings
                reconcile(module, moduledef.merge(new))
                self._cache.forget(module)
            return out
        result = self._jitted(flat.leaves, flat.signature, *args, **kwargs)
        if len(result) == 2:
            out, leaves = result
            if flat.slots is not None:
                flat.write_back(leaves)
                return out
            module.update_state(flat.signature.treedef.unflatten(leaves))
        else:
            out, state, moduledef = result
            reconcile(module, moduledef.merge(state))
        self._cache.forget(module)
        return out

    def lower(self, module: Module, *args, **kwargs):
        """``jax.jit(...).lower`` for the given Module and arguments."""
        check_arguments("nnx.jit", args, kwargs)
        flat = FlatState(module)
        return self._jitted.lower(self._state_argument(flat), flat.signature, *args, **partition_ctx(kwargs))

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"nnx.jit({getattr(self._fun, '__qualname__', self._fun)!r})"


def _shift_argnums(argnums: int | tp.Sequence[int] | None) -> tuple[int, ...]:
    """Maps argument indices of ``f(module, *args)`` onto ``_pure(leaves, signature, *args)``."""
    if argnums is None:
        return ()
    if isinstance(argnums, int):
        argnums = (argnums,)
    shifted = []
    for i in argnums:
        if i < 0:
            raise ValueError(
                f"Negative argnums are not supported by nnx.jit, got {i}; count from the Module, which is argument 0."
            )
        shifted.append(0 if i == 0 else i + 1)
    return tuple(shifted)


def _both_ways(
    fun: tp.Callable[..., tp.Any],
    argnums: int | tp.Sequence[int] | None,
    argnames: str | tp.Iterable[str] | None,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``argnums`` and ``argnames`` of ``fun(module, *args, **kwargs)``, each completed from the other through
    ``fun``'s signature, as ``jax.jit`` completes them: an argument made static (or donated) by position stays so
    when passed by keyword, and the reverse. ``jax.jit`` cannot do it here, since it sees the pure function."""
    nums = () if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(map(operator.index, argnums))
    names = () if argnames is None else (argnames,) if isinstance(argnames, str) else tuple(argnames)
    try:
        parameters = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): as given
        return nums, names
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = [p for p in parameters if p.kind in by_position]
    for i in nums:
        if 0 <= i < len(positional) and positional[i].kind in by_name and positional[i].name not in names:
            names += (positional[i].name,)
    for i, p in enumerate(positional):
        if p.name in names and p.kind in by_name and i not in nums:
            nums += (i,)
    return nums, names


def jit(
    fun: F | None = None,
    *,
    stateful: bool = True,
    in_shardings: tp.Any = _UNSPECIFIED,
    out_shardings: tp.Any = _UNSPECIFIED,
    static_argnums: int | tp.Sequence[int] | None = None,
    static_argnames: str | tp.Iterable[str] | None = None,
    donate_argnums: int | tp.Sequence[int] | None = None,
    donate_argnames: str | tp.Iterable[str] | None = None,
    keep_unused: bool = False,
    device: jax.Device | None = None,
    backend: str | None = None,
    inline: bool = False,
    compiler_options: dict[str, tp.Any] | None = None,
) -> F:
    """``jax.jit`` for functions whose first argument is a Module.

    ``fun(module, *args, **kwargs)`` runs compiled on a copy of ``module``
    built inside the trace. With ``stateful=True`` every state change made
    inside (new parameter values, updated batch statistics, new attributes
    such as sown intermediates) is written back to ``module`` after the call;
    with ``stateful=False`` the module is left untouched. A ``Context``
    passed as ``ctx=`` is forked on the way in and rebuilt inside, so each call
    draws new keys::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> @nnx.jit
        ... def forward(model, x, *, ctx):
        ...   return model(x, deterministic=False, ctx=ctx)
        >>> dropout, ctx = nnx.Dropout(0.5), nnx.context(dropout=0)
        >>> first = forward(dropout, jnp.ones((4, 4)), ctx=ctx)
        >>> second = forward(dropout, jnp.ones((4, 4)), ctx=ctx)  # compiled once, new mask
        >>> bool((first == second).all())
        False

    Calls with the same Module structure (same submodules, attributes and
    static fields) reuse the compiled function. Argument indices
    (``static_argnums``, ``donate_argnums``) count the Module as argument 0;
    donating 0 donates the Module's state buffers. For ``in_shardings`` /
    ``out_shardings``, the Module's entry is a tree of shardings matching its
    ``State`` (see :func:`nnx.get_partition_spec`); with ``stateful=True`` the
    output is ``(out, state)``.
    """
    if fun is None:
        return functools.partial(  # type: ignore[return-value]
            jit,
            stateful=stateful,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            keep_unused=keep_unused,
            device=device,
            backend=backend,
            inline=inline,
            compiler_options=compiler_options,
        )
    static_argnums, static_argnames = _both_ways(fun, static_argnums, static_argnames)
    donate_argnums, donate_argnames = _both_ways(fun, donate_argnums, donate_argnames)
    static = _shift_argnums(static_argnums)
    if 0 in static:
        raise ValueError("The Module (argument 0) cannot be static in nnx.jit.")
    jit_kwargs: dict[str, tp.Any] = dict(
        static_argnums=(1, *static),
        static_argnames=static_argnames or None,
        donate_argnums=_shift_argnums(donate_argnums) or None,
        donate_argnames=donate_argnames or None,
        keep_unused=keep_unused,
        device=device,
        backend=backend,
        inline=inline,
        compiler_options=compiler_options,
    )
    if in_shardings is not _UNSPECIFIED:
        jit_kwargs["in_shardings"] = in_shardings
    if out_shardings is not _UNSPECIFIED:
        # `(out, state)` as documented; the Module's structure, returned beside them, has no arrays to place
        pair = stateful and isinstance(out_shardings, (tuple, list)) and len(out_shardings) == 2
        jit_kwargs["out_shardings"] = (*out_shardings, None) if pair else out_shardings
    return _Jitted(fun, stateful, jit_kwargs)  # type: ignore[return-value]
