"""Filters: which entries of a State a call selects.

A filter is one of:

* a type: matches values that are instances of it (``nnx.Param``);
* ``...``: matches everything (use it last to catch the rest);
* ``None``: matches nothing;
* a predicate ``(path: str, value) -> bool``;
* a tuple or list of filters: matches what any of them matches.

Combine them with :class:`Not`, :class:`All` and :class:`Any`. For example,
every parameter outside the first layer::

    >>> import nnx
    >>> ctx = nnx.context(0)
    >>> model = nnx.Sequence([nnx.Linear(2, 3, ctx=ctx), nnx.BatchNorm(3, ctx=ctx)])
    >>> outside = nnx.All(nnx.Param, lambda path, node: not path.startswith('0/'))
    >>> list(model.filter(outside))
    ['1/bias', '1/scale']
    >>> list(model.filter(nnx.Not(nnx.Param)))
    ['1/mean', '1/var']

A string is not a filter: variable kinds are types (``nnx.Param``), not
collection names.
"""

import builtins
import dataclasses
import typing as tp

import jax
import numpy as np

if tp.TYPE_CHECKING:
    ellipsis = builtins.ellipsis
else:
    ellipsis = tp.Any

Path = str
Predicate = tp.Callable[[Path, tp.Any], bool]
FilterLiteral = tp.Union[type, ellipsis, None, Predicate]  # noqa: UP007 (a runtime alias)
Filter = tp.Union[FilterLiteral, tp.Sequence["Filter"]]  # noqa: UP007 (a runtime alias)


def to_predicate(filter: Filter) -> Predicate:
    """Turns any filter into a predicate ``(path, value) -> bool``."""
    if isinstance(filter, str):
        raise TypeError(
            f"A string is not a filter, got {filter!r}. Filter by type "
            "(e.g. nnx.Param) or with a predicate (path, value) -> bool."
        )
    if isinstance(filter, type):
        return OfType(filter)
    if filter is ...:
        return Everything()
    if filter is None:
        return Nothing()
    if callable(filter):
        return filter
    if isinstance(filter, (tuple, list)):
        return Any(*filter)
    raise TypeError(
        f"Invalid filter of type {type(filter).__name__!r}: {filter!r}. A filter is a type (nnx.Param), ..., "
        "None, a predicate (path, value) -> bool, or a tuple of filters."
    )


@dataclasses.dataclass(frozen=True)
class OfType:
    """Matches values that are instances of ``type``."""

    type: type | tuple[type, ...]

    def __call__(self, path: Path, value: tp.Any) -> bool:
        return isinstance(value, self.type)


class _Combination:
    """``Any`` and ``All``: one predicate per filter, joined by ``_join`` (``any`` or ``all``)."""

    _join: tp.ClassVar[tp.Callable[[tp.Iterable[bool]], bool]]

    def __init__(self, *filters: Filter):
        self.predicates = tuple(map(to_predicate, filters))

    def __call__(self, path: Path, value: tp.Any) -> bool:
        return type(self)._join(predicate(path, value) for predicate in self.predicates)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.predicates}"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.predicates == other.predicates

    def __hash__(self) -> int:
        return hash((type(self), self.predicates))


class Any(_Combination):
    """Matches what any of ``filters`` matches."""

    _join = builtins.any


class All(_Combination):
    """Matches what all of ``filters`` match."""

    _join = builtins.all


class Not:
    """Matches what ``filter`` does not."""

    def __init__(self, filter: Filter):
        self.predicate = to_predicate(filter)

    def __call__(self, path: Path, value: tp.Any) -> bool:
        return not self.predicate(path, value)

    def __repr__(self) -> str:
        return f"Not({self.predicate!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Not) and self.predicate == other.predicate

    def __hash__(self) -> int:
        return hash((Not, self.predicate))


@dataclasses.dataclass(frozen=True)
class Everything:
    """Matches everything (the predicate form of ``...``)."""

    def __call__(self, path: Path, value: tp.Any) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Nothing:
    """Matches nothing (the predicate form of ``None``)."""

    def __call__(self, path: Path, value: tp.Any) -> bool:
        return False


buffers = OfType((jax.Array, np.ndarray))
"""Matches plain array values (``jax.Array`` and ``numpy.ndarray``)."""


def check_ellipsis_last(filters: tp.Sequence[Filter]) -> None:
    for i, filter in enumerate(filters[:-1]):
        if filter is ...:
            raise ValueError(
                f"Ellipsis `...` can only be used as the last filter, got it at index {i} of {len(filters)} filters."
            )
