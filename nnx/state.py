"""State: the flat, immutable mapping from paths to nodes.

A ``State`` maps path strings (attribute names joined with ``/``, such as
``'encoder/linear1/kernel'``) to nodes, keys sorted. It is a pytree whose key
path for each entry is its path, so it goes through ``jax.jit``,
``jax.grad`` and ``jax.tree.map`` unchanged in structure::

    >>> import jax
    >>> import nnx
    >>> ctx = nnx.context(0)
    >>> model = nnx.Sequence([nnx.Linear(2, 3, ctx=ctx), nnx.BatchNorm(3, ctx=ctx)])
    >>> state = model.get_state()
    >>> list(state)
    ['0/bias', '0/kernel', '1/bias', '1/mean', '1/scale', '1/var']
    >>> doubled = jax.tree.map(lambda x: x * 2, state)  # still Params and BatchStats
    >>> params, rest = state.partition(nnx.Param, ...)
    >>> list(rest)
    ['1/mean', '1/var']
    >>> (params | rest) == state
    True
"""

import typing as tp

import jax.tree_util as jtu

from nnx import _flax_serialization, nodes, partitioning, reprlib

Path = str
Node = tp.Any


class State(tp.Mapping[Path, Node], reprlib.Representable):
    """An immutable flat mapping from path strings to nodes, keys sorted."""

    __slots__ = ("_mapping",)
    _mapping: dict[Path, Node]

    def __init__(
        self,
        mapping: tp.Mapping[Path, Node] | tp.Iterable[tuple[Path, Node]] = (),
        /,
    ):
        items = mapping.items() if isinstance(mapping, tp.Mapping) else mapping
        object.__setattr__(self, "_mapping", dict(sorted(items)))

    @classmethod
    def _from_sorted(cls, mapping: dict[Path, Node]) -> "State":
        """Wraps a dict whose keys are already sorted (internal fast path)."""
        state = object.__new__(cls)
        object.__setattr__(state, "_mapping", mapping)
        return state

    def __getitem__(self, path: Path) -> Node:
        return self._mapping[path]

    def __iter__(self) -> tp.Iterator[Path]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)

    def __contains__(self, path: object) -> bool:
        return path in self._mapping

    def __setattr__(self, name: str, value: tp.Any) -> None:
        raise AttributeError("State is immutable; build a new one with State.merge, | or -")

    def __reduce__(self):
        return (State, (self._mapping,))

    def __nnx_repr__(self):
        yield reprlib.Object(type(self), start="({", end="})", value_sep=": ")
        for path, value in self._mapping.items():
            yield reprlib.Attr(repr(path), value)

    @tp.overload
    def partition(self, first: partitioning.Filter, /) -> "State": ...

    @tp.overload
    def partition(
        self,
        first: partitioning.Filter,
        second: partitioning.Filter,
        /,
        *filters: partitioning.Filter,
    ) -> tuple["State", ...]: ...

    def partition(self, *filters: partitioning.Filter):
        """Splits the state by ``filters``; every entry must be matched.

        Each entry goes to the first filter that matches it. Returns one
        ``State`` for one filter, else a tuple in the order of ``filters``. Use
        ``...`` as the last filter to catch everything else.
        """
        if not filters:
            return self
        states, remainder = _split(self._mapping, filters)
        if remainder:
            raise ValueError(
                f"Non-exhaustive filters, got a non-empty remainder: "
                f"{list(remainder)}.\nUse `...` as the last filter to match all "
                "remaining elements."
            )
        return states[0] if len(states) == 1 else states

    def filter(self, *filters: partitioning.Filter):
        """Like :meth:`partition`, but entries no filter matches are dropped."""
        if not filters:
            raise TypeError("State.filter needs at least one filter")
        states, _ = _split(self._mapping, filters)
        return states[0] if len(states) == 1 else states

    @staticmethod
    def merge(state: "State", /, *states: "State") -> "State":
        """Combines states (or mappings of paths) into one; on a shared path the later state wins."""
        state, *rest = (_as_state(s) for s in (state, *states))
        if not rest:
            return state
        mapping = dict(state._mapping)
        for other in rest:
            mapping.update(other._mapping)
        return State(mapping)

    def __or__(self, other: tp.Any) -> "State":
        if not isinstance(other, tp.Mapping):
            return NotImplemented
        if not other:
            return self
        return State.merge(self, other)

    def __ror__(self, other: tp.Any) -> "State":
        if not isinstance(other, tp.Mapping):
            return NotImplemented
        return State.merge(other, self)

    def __sub__(self, other: tp.Any) -> "State":
        if not isinstance(other, tp.Mapping):
            return NotImplemented
        if not other:
            return self
        return State._from_sorted({k: v for k, v in self._mapping.items() if k not in other})


def _as_state(value: tp.Any) -> State:
    """A State, or a mapping of paths as one; anything else is a TypeError naming it."""
    if isinstance(value, State):
        return value
    if isinstance(value, tp.Mapping):
        return State(value)
    raise TypeError(f"State.merge takes States (or mappings of paths to values), got {type(value).__name__}")


def _split(
    mapping: dict[Path, Node], filters: tp.Sequence[partitioning.Filter]
) -> tuple[tuple[State, ...], dict[Path, Node]]:
    partitioning.check_ellipsis_last(filters)
    predicates = [partitioning.to_predicate(f) for f in filters]
    buckets: list[dict[Path, Node]] = [{} for _ in predicates]
    remainder: dict[Path, Node] = {}
    for path, value in mapping.items():
        for predicate, bucket in zip(predicates, buckets):
            if predicate(path, value):
                bucket[path] = value
                break
        else:
            remainder[path] = value
    return tuple(map(State._from_sorted, buckets)), remainder


def _state_flatten_with_keys(state: State):
    mapping = state._mapping
    return [(jtu.DictKey(path), value) for path, value in mapping.items()], tuple(mapping)


def _state_flatten(state: State):
    mapping = state._mapping
    return tuple(mapping.values()), tuple(mapping)


def _state_unflatten(paths: tuple[Path, ...], values) -> State:
    return State._from_sorted(dict(zip(paths, values)))


jtu.register_pytree_with_keys(State, _state_flatten_with_keys, _state_unflatten, flatten_func=_state_flatten)
nodes.register_node_type(State)


def _to_state_dict(serialization: tp.Any, state: State) -> dict[Path, tp.Any]:
    """A flat dict keyed by path, like the State itself."""
    return {path: serialization.to_state_dict(value) for path, value in state._mapping.items()}


def _from_state_dict(serialization: tp.Any, state: State, state_dict: tp.Mapping[Path, tp.Any]) -> State:
    return State._from_sorted(_flax_serialization.restore_fields(serialization, "a State", state._mapping, state_dict))


_flax_serialization.register(State, _to_state_dict, _from_state_dict)
