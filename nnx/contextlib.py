"""RNG streams and flags: the ``Context`` passed to layers as ``ctx=``.

``nnx.context(0)`` makes a Context with one stream, ``params``, seeded with 0;
name more streams with keywords and add boolean flags::

    >>> import jax.numpy as jnp
    >>> import nnx
    >>> ctx = nnx.context(0, dropout=1, flags={'deterministic': False})
    >>> ctx
    Context(rngs=['params', 'dropout'], flags={'deterministic': False})
    >>> key = ctx.make_rng('dropout')
    >>> bool(jnp.all(key == ctx.make_rng('dropout')))  # each call a new key
    False
    >>> ctx.get_flag('deterministic')
    False

Every ``make_rng`` call returns a new key, derived deterministically from the
stream's key and a counter path with a stable hash (identical across
processes and runs), and advances the counter.

``ctx.partition()`` turns a Context into a pure pytree ``(keys, contextdef)``
that can cross ``jax.jit``; ``.merge()`` rebuilds it inside. Partitioning
forks every stream, so keys drawn inside and outside never collide. A fork's
counter path is folded into its key, which is data: the static half
(``ContextDef``) of forks at any count compares equal (it holds stream names
and flags), so a jitted function taking a ``PureContext`` compiles once, and
draws the same keys whichever fork it was compiled for.
"""

import builtins
import dataclasses
import hashlib
import typing as tp

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from nnx import errors, tracers

KeyArray = jax.Array
Counts = tuple[int, ...]


def _stable_hash(data: Counts | str) -> int:
    """A uint32 hash of ``data`` that is identical in every process and run."""
    if isinstance(data, str):
        text = data
    else:
        text = " ".join(str(x) for x in data)
    digest = hashlib.blake2s(text.encode()).digest()
    return int.from_bytes(digest[:4], byteorder="big")


def _fold_in(key: KeyArray, data: int) -> KeyArray:
    return jax.random.fold_in(key, np.uint32(data))


@dataclasses.dataclass
class RngStream:
    """One named stream: a root key and the counter state derived from it.

    ``count_path[:base]`` is the part of the counter path already folded into ``key`` (a fork's): keys are
    derived from ``key`` and the rest, so a forked stream draws the same keys whether rebuilt in a trace
    compiled for this fork or for another one (the absolute path is static; ``key`` is data).
    """

    key: KeyArray
    count: int = 0
    count_path: Counts = ()
    base: int = 0

    def _next(self) -> int:
        """The stable hash of the counter path to the current count, past what ``key`` holds."""
        return _stable_hash(self.count_path[self.base :] + (self.count,))

    def fork(self) -> "RngStream":
        """A child stream whose keys never collide with this stream's."""
        key = _fold_in(self.key, self._next())
        count_path = self.count_path + (self.count,)
        self.count += 1
        return RngStream(key, 0, count_path, len(count_path))


class ContextDef:
    """The static half of a partitioned Context: stream names and flags.

    Two ContextDefs with the same stream names and flags are equal, so a jitted
    function receiving a fresh ``PureContext`` at every call does not retrace
    (an unforked stream's counter path not yet folded into its key counts too).
    """

    __slots__ = ("_bases", "_flags", "_rng_counts")

    def __init__(
        self,
        rng_counts: tuple[tuple[str, Counts], ...],
        flags: tuple[tuple[str, bool], ...],
        bases: tuple[int, ...] | None = None,
    ):
        self._rng_counts = rng_counts
        self._flags = flags
        self._bases = tuple(len(path) for _, path in rng_counts) if bases is None else bases

    def _key(self):
        """What the rebuilt streams' keys depend on besides the key arrays: a forked stream's counter path is
        folded into its key (:class:`RngStream`), so forks at any count compare equal."""
        names = tuple(name for name, _ in self._rng_counts)
        rest = tuple(path[base:] for (_, path), base in zip(self._rng_counts, self._bases))
        return names, rest, self._flags

    def __eq__(self, other) -> bool:
        return isinstance(other, ContextDef) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"ContextDef(rngs={self._key()[0]}, flags={dict(self._flags)})"

    def merge(self, keys: tp.Mapping[str, KeyArray]) -> "Context":
        """Rebuilds the Context from its keys."""
        rngs = {
            name: RngStream(keys[name], 0, count_path, base)
            for (name, count_path), base in zip(self._rng_counts, self._bases)
        }
        return Context(rngs, dict(self._flags))


class PureContext(tuple[dict[str, KeyArray], ContextDef]):
    """A partitioned Context: a pytree tuple ``(keys, contextdef)``."""

    def __new__(cls, keys: dict[str, KeyArray], contextdef: ContextDef):
        return tuple.__new__(cls, (keys, contextdef))

    @property
    def keys(self) -> dict[str, KeyArray]:
        return self[0]

    @property
    def contextdef(self) -> ContextDef:
        return self[1]

    def merge(self) -> "Context":
        return self.contextdef.merge(self.keys)


jtu.register_pytree_with_keys(
    PureContext,
    lambda pc: (((jtu.GetAttrKey("keys"), pc[0]),), pc[1]),
    lambda contextdef, children: PureContext(children[0], contextdef),
    flatten_func=lambda pc: ((pc[0],), pc[1]),
)


class Context:
    """RNG streams and flags, passed to layers as ``ctx=``; made by :func:`context`.

    A layer draws its initial parameters from the ``params`` stream and its
    noise (dropout) from a stream named after it::

      >>> import jax.numpy as jnp
      >>> import nnx
      >>> ctx = nnx.context(0, dropout=1)
      >>> layer = nnx.Linear(4, 4, ctx=ctx)  # draws from 'params'
      >>> drop = nnx.Dropout(0.5)
      >>> y = drop(jnp.ones((2, 4)), deterministic=False, ctx=ctx)  # draws from 'dropout'
      >>> sorted({float(v) for v in y.ravel()})  # each value kept (doubled) or dropped
      [0.0, 2.0]
    """

    __slots__ = ("_rngs", "_flags", "_trace_state")

    def __init__(self, rngs: tp.Mapping[str, RngStream], flags: tp.Mapping[str, bool]):
        self._rngs = dict(rngs)
        self._flags = dict(flags)
        self._trace_state = tracers.TraceState()

    def _check_trace(self) -> None:
        if not self._trace_state.is_valid():
            raise errors.TraceContextError(
                "Cannot use Context from a different trace level: it was created "
                "outside (or inside) the current jax/nnx transform. Pass it in as "
                "an argument (ctx.partition() outside, .merge() inside) or use a "
                "lifted transform such as nnx.jit."
            )

    def has_rng(self, name: str) -> bool:
        return name in self._rngs

    def make_rng(self, name: str) -> KeyArray:
        """Returns a fresh key from stream ``name`` and advances its counter."""
        self._check_trace()
        if name not in self._rngs:
            have = ", ".join(self._rngs) or "none"
            raise ValueError(
                f"Unknown Rng Stream: {name} (this Context has streams: {have}; "
                f"add it with nnx.context(..., {name}=SEED))"
            )
        stream = self._rngs[name]
        key = _fold_in(stream.key, stream._next())
        stream.count += 1
        return key

    def has_flag(self, name: str) -> bool:
        return name in self._flags

    def get_flag(self, name: str) -> bool | None:
        """The flag's value, or ``None`` when it is not set."""
        return self._flags.get(name)

    def copy(self) -> "Context":
        """A Context at the current trace level sharing these streams and flags."""
        return Context(self._rngs, self._flags)

    def partition(self, *, fork: bool = True) -> PureContext:
        """Forks every stream into a pure ``(keys, contextdef)`` pytree.

        With ``fork=False`` the streams go as they are, for a Context none of
        whose streams has drawn a key yet (one a scan made for a layer, say)
        handed to a transform in its place: the merged Context draws exactly
        the keys this one would have drawn, so this one must draw no more.
        ``ValueError`` if a stream has drawn.
        """
        self._check_trace()
        if not fork:
            drawn = sorted(name for name, stream in self._rngs.items() if stream.count)
            if drawn:
                raise ValueError(f"Cannot partition a Context without forking: streams {drawn} have drawn keys")
        forks = {name: stream.fork() if fork else stream for name, stream in self._rngs.items()}
        keys = {name: stream.key for name, stream in forks.items()}
        rng_counts = tuple((name, stream.count_path) for name, stream in forks.items())
        bases = tuple(stream.base for stream in forks.values())
        return PureContext(keys, ContextDef(rng_counts, tuple(self._flags.items()), bases))

    def __repr__(self) -> str:
        return f"Context(rngs={list(self._rngs)}, flags={self._flags})"


def _to_stream(name: str, value: tp.Any) -> RngStream:
    if isinstance(value, RngStream):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return RngStream(jax.random.PRNGKey(int(value)))
    if isinstance(value, (jax.Array, np.ndarray)):
        if value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer):
            return RngStream(jax.random.PRNGKey(value))  # a seed, e.g. jnp.int32(0)
        return RngStream(jnp.asarray(value) if isinstance(value, np.ndarray) else value)
    raise TypeError(f"RNG stream {name!r} must be an int seed, a key array or an RngStream, got {type(value).__name__}")


def context(
    params: int | KeyArray | RngStream | None = None,
    *,
    flags: tp.Mapping[str, bool] | None = None,
    **rngs: int | KeyArray | RngStream,
) -> Context:
    """Creates a :class:`Context`.

    Args:
      params: seed, key or stream of the ``params`` stream (optional).
      flags: boolean flags such as ``{'deterministic': True}``.
      **rngs: more streams by name, each an int seed (a Python int or an
        integer scalar array), a key (raw ``uint32`` or typed) or an existing
        ``RngStream``.

    Example::

        >>> import nnx
        >>> ctx = nnx.context(0, dropout=1)
        >>> ctx.has_rng('dropout'), ctx.has_rng('noise')
        (True, False)
        >>> model = nnx.Linear(2, 3, ctx=ctx)
    """
    if params is not None:
        rngs = {"params": params, **rngs}
    streams = {name: _to_stream(name, value) for name, value in rngs.items()}
    return Context(streams, dict(flags or {}))


if tp.TYPE_CHECKING:
    ellipsis = builtins.ellipsis
else:
    ellipsis = tp.Any

RngPredicate = tp.Callable[[str], bool]
RngFilterLiteral = tp.Union[str, RngPredicate, ellipsis, None]  # noqa: UP007 (a runtime alias)
RngFilter = tp.Union[RngFilterLiteral, tp.Sequence[RngFilterLiteral], tp.Mapping[RngFilterLiteral, bool]]  # noqa: UP007 (a runtime alias)


def to_rng_predicate(filter: RngFilter) -> RngPredicate:
    """Turns an RNG filter (used by ``split_rngs``) into a name predicate.

    ``None`` matches no stream, ``...`` every stream, a string that stream, a
    callable is used as is, a sequence matches what any element matches and a
    mapping ``{filter: bool}`` what the filters marked ``True`` match.
    """
    if filter is None:
        return lambda _: False
    if filter is ...:
        return lambda _: True
    if isinstance(filter, str):
        return lambda name: name == filter
    if callable(filter):
        return filter
    if isinstance(filter, tp.Mapping):
        predicates = tuple(to_rng_predicate(f) for f, include in filter.items() if include)
        return lambda name: any(p(name) for p in predicates)
    if isinstance(filter, tp.Sequence):
        predicates = tuple(map(to_rng_predicate, filter))
        return lambda name: any(p(name) for p in predicates)
    raise TypeError(
        f"Invalid rng filter: {filter!r}. An rng filter is a stream name ('dropout'), ..., None, a predicate "
        "name -> bool, a sequence of filters, or a mapping {filter: bool}."
    )
