"""Ready-made Modules and the TrainState pytree.

* :class:`Dict`: a Module that is a mapping (``d.a`` and ``d['a']``);
* :class:`Sequence`: a Module holding a list; calling it chains the elements;
* :class:`TrainState`: parameters, optimizer state and step as one pytree.
"""

import functools
import inspect
import typing as tp

import jax.numpy as jnp
import optax

from nnx import pytreelib
from nnx._call_proxy import CallProxy
from nnx.contextlib import Context
from nnx.module import _MODULE_STATE, Module, ModuleDef, Pure, _dict
from nnx.state import State

A = tp.TypeVar("A")
M = tp.TypeVar("M", bound=Module)


class Dict(Module, tp.Mapping[str, A]):
    """A Module that is a Mapping of names to values (submodules, nodes, ...).

    Example::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> ctx = nnx.context(0)
        >>> heads = nnx.Dict(cls=nnx.Linear(8, 10, ctx=ctx), reg=nnx.Linear(8, 1, ctx=ctx))
        >>> x = jnp.ones((2, 8))
        >>> heads.cls(x).shape, heads['reg'](x).shape
        ((2, 10), (2, 1))
        >>> list(heads.filter(nnx.Param))
        ['cls/bias', 'cls/kernel', 'reg/bias', 'reg/kernel']
    """

    def __init__(self, /, *args: tp.Any, **kwargs: A):
        for name, value in dict(*args, **kwargs).items():
            setattr(self, name, value)

    def __getitem__(self, key: str) -> A:
        if key == _MODULE_STATE or key not in _dict(self):
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: A) -> None:
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self, key)

    def __iter__(self) -> tp.Iterator[str]:
        return (name for name in _dict(self) if name != _MODULE_STATE)

    def __len__(self) -> int:
        return len(_dict(self)) - 1

    def __contains__(self, key: object) -> bool:
        return key != _MODULE_STATE and key in _dict(self)

    # Modules compare and hash by identity, not by content like a Mapping.
    __eq__ = object.__eq__
    __hash__ = object.__hash__


@functools.lru_cache(maxsize=1024)
def _accepts_ctx(function: tp.Callable[..., tp.Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "ctx" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def _takes_ctx(f: tp.Callable[..., tp.Any]) -> bool:
    target = type(f).__call__ if isinstance(f, Module) else f
    try:
        return _accepts_ctx(target)
    except TypeError:  # unhashable callable
        return _accepts_ctx.__wrapped__(target)


class Sequence(Module, tp.Generic[A]):
    """A Module holding a sequence; calling it chains the elements.

    Each element's output feeds the next: a tuple is splatted as positional
    arguments, a dict as keyword arguments. ``ctx=`` is forwarded to the
    elements that accept it. An empty Sequence is the identity of its one
    argument::

        >>> import jax.numpy as jnp
        >>> import nnx
        >>> ctx = nnx.context(0)
        >>> mlp = nnx.Sequence([nnx.Linear(2, 8, ctx=ctx), nnx.relu, nnx.Linear(8, 1, ctx=ctx)])
        >>> mlp(jnp.ones((4, 2))).shape
        (4, 1)
        >>> len(mlp), list(mlp.filter(nnx.Param))[:2]
        (3, ['0/bias', '0/kernel'])
    """

    def __init__(self, iterable: tp.Iterable[A]):
        length = 0
        for i, value in enumerate(iterable):
            setattr(self, str(i), value)
            length = i + 1
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> A:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]  # type: ignore[return-value]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"Sequence index {index} out of range for length {n}")
        return getattr(self, str(index % n))

    def __iter__(self) -> tp.Iterator[A]:
        return (getattr(self, str(i)) for i in range(len(self)))

    def __call__(self, *args: tp.Any, ctx: Context | None = None, **kwargs: tp.Any) -> tp.Any:
        if not len(self):  # a chain of nothing: what it is given (it returned None)
            if len(args) != 1 or kwargs:
                raise TypeError("an empty Sequence returns its input: call it with one positional argument")
            return args[0]
        output: tp.Any = None
        for i, f in enumerate(self):
            if not callable(f):
                raise TypeError(f"Sequence[{i}] is not callable: {f!r}")
            if i > 0:
                if isinstance(output, tuple):
                    args, kwargs = output, {}
                elif isinstance(output, dict):
                    args, kwargs = (), dict(output)
                else:
                    args, kwargs = (output,), {}
            if ctx is not None and _takes_ctx(f):
                kwargs = {**kwargs, "ctx": ctx}
            output = f(*args, **kwargs)
        return output


class TrainState(pytreelib.Pytree, tp.Generic[M]):
    """Parameters, optimizer state and step of a model as one pytree.

    ``params``, ``opt_state = tx.init(params)`` and ``step`` are children;
    ``tx`` and ``moduledef`` are static. Extra keyword arguments that are nodes
    (a ``State`` of batch stats, ``nnx.Node(...)``) are children, others static,
    and ``state.apply('params', 'batch_stats')(x)`` runs the model on the named
    ones. A whole training step::

        >>> import jax, jax.numpy as jnp, optax
        >>> import nnx
        >>> model = nnx.Linear(2, 1, ctx=nnx.context(0))
        >>> params, moduledef = model.partition(nnx.Param)
        >>> state = nnx.TrainState(moduledef, params=params, tx=optax.sgd(0.1))
        >>> x, y = jnp.ones((8, 2)), jnp.zeros((8, 1))
        >>> def loss_fn(params):
        ...   pred, _ = state.moduledef.apply(params)(x)
        ...   return jnp.mean((pred - y) ** 2)
        >>> @jax.jit
        ... def train_step(state):
        ...   return state.apply_gradients(jax.grad(loss_fn)(state.params))
        >>> before = loss_fn(state.params)
        >>> state = train_step(state)
        >>> int(state.step), bool(loss_fn(state.params) < before)
        (1, True)
    """

    def __init__(
        self,
        moduledef: ModuleDef[M],
        *,
        params: State,
        tx: optax.GradientTransformation,
        step: int | tp.Any = 0,
        **extra: tp.Any,
    ):
        self.moduledef = moduledef
        self.tx = tx
        self.params = pytreelib.TreeNode(params)
        self.opt_state = pytreelib.TreeNode(tx.init(params))
        self.step = pytreelib.TreeNode(jnp.asarray(step))
        for name, value in extra.items():
            setattr(self, name, value)

    if tp.TYPE_CHECKING:

        def __getattr__(self, name: str) -> tp.Any: ...

    def apply(self, state: State | str, *states: State | str) -> CallProxy[tuple[tp.Any, Pure[State, M]]]:
        """Runs the model functionally on the named (or given) states."""
        resolved = [self._state_named(s) if isinstance(s, str) else s for s in (state, *states)]
        return self.moduledef.apply(*resolved)

    def _state_named(self, name: str) -> State:
        value = getattr(self, name)
        if not isinstance(value, State):
            raise TypeError(
                f"TrainState.apply({name!r}): {name!r} holds a {type(value).__name__}, not a State; name the "
                "States the model runs on (params, and extra keyword arguments given as States)"
            )
        return value

    def apply_gradients(self, grads: State, **updates: tp.Any) -> "TrainState[M]":
        """A new TrainState with the optimizer step applied and ``step + 1``."""
        param_updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, param_updates)
        return self.replace(params=params, opt_state=opt_state, step=self.step + 1, **updates)
