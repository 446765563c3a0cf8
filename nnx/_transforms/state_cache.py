"""The cache behind ``nnx.jit``: a Module's flat state kept between calls.

:class:`FlatState` holds the leaves and where each one lives, so a call on an
unchanged Module does no graph walk; :class:`Signature` is the static half
of the call that ``jax.jit`` compiles against.
"""

import operator
import typing as tp
import weakref

import jax

from nnx import containers
from nnx.module import Module, ModuleDef, _dict, _owner
from nnx.state import State

_VALUE = operator.attrgetter("value")


class Signature:
    """The static half of a jitted call: the state's treedef and the ModuleDef.

    Equal by value (so an identical structure rebuilt later hits JAX's
    cache), with a precomputed hash and an identity shortcut (so the usual
    call, which passes the very same object, costs nothing to look up).
    """

    __slots__ = ("treedef", "moduledef", "_hash")

    def __init__(self, treedef: tp.Any, moduledef: ModuleDef[tp.Any]):
        self.treedef = treedef
        self.moduledef = moduledef
        self._hash = hash((treedef, moduledef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is Signature
            and self._hash == other._hash
            and self.treedef == other.treedef
            and self.moduledef == other.moduledef
        )


class FlatState:
    """A Module's state as flat leaves, cached between ``nnx.jit`` calls.

    Rebuilding the ``State`` (a walk of the whole object graph) at every call
    is the main per-call cost of a lifted ``jit``. Instead, the leaves and the
    attributes they came from are kept here, with a copy of every Module's
    attribute dict. While the copies still equal the dicts (checked at C
    speed; unchanged values compare by identity), nothing was assigned to the
    Modules since the last call; while each container still holds its cached
    leaf (``node.value = x`` changes a container in place, through a State
    entry, which is the container itself), the cached leaves are their state.
    """

    __slots__ = ("module", "dicts", "copies", "signature", "leaves", "slots", "nodes", "held")

    def __init__(self, module: Module):
        state, moduledef = module.partition()
        leaves, treedef = jax.tree.flatten(state)
        self.module = weakref.ref(module)  # the cache must not keep models alive
        self.dicts = tuple(_dict(m) for _, m in module.modules())
        self.copies = tuple(dict(d) for d in self.dicts)
        self.signature = Signature(treedef, moduledef)
        self.leaves = leaves
        self.nodes: list = []  # the containers holding leaves, in the leaves' order
        self.held: list = []  # the index in `leaves` of the leaf each of them holds
        self.slots = self._slots(module, state, leaves)

    def _slots(self, module: Module, state: State, leaves: list) -> list | None:
        """Where each leaf lives, or None if some node does not hold exactly one.

        ``slots[i] = (attributes, copy, name, container type, metadata)`` for
        leaf ``i``; type and metadata are None for a plain array attribute.
        """
        if len(leaves) != len(state):
            return None
        copy_of = {id(d): c for d, c in zip(self.dicts, self.copies)}
        slots = []
        for i, ((path, node), leaf) in enumerate(zip(state.items(), leaves)):
            if isinstance(node, containers.NodeBase):
                if node.value is not leaf:
                    return None
                metadata = containers._metadata(node)
                kind = type(node)
            elif node is leaf:
                kind = metadata = None
            else:
                return None
            owner, name = _owner(module, path)
            attributes = _dict(owner)
            slots.append((attributes, copy_of[id(attributes)], name, kind, metadata))
            if kind is not None:
                self.nodes.append(node)
                self.held.append(i)
        return slots

    def is_current(self) -> bool:
        try:
            if self.dicts != self.copies:
                return False
        except Exception:  # a changed value whose == is not a bool (arrays)
            return False
        if self.slots is None:  # where each leaf lives is not known: nor whether a container was given another
            return False
        held = map(self.leaves.__getitem__, self.held)
        return all(map(operator.is_, map(_VALUE, self.nodes), held))  # at C speed: a call's fixed cost

    def write_back(self, leaves: list) -> None:
        new_object = object.__new__
        nodes = self.nodes
        j = 0
        for (attributes, copy, name, kind, metadata), leaf in zip(self.slots, leaves):
            if kind is None:
                value = leaf
            else:  # what Container._with_value does, inlined: this loop is hot
                value = nodes[j] = new_object(kind)
                value.__dict__ = {"value": leaf, **metadata}
                j += 1
            attributes[name] = copy[name] = value
        self.leaves = leaves


class StateCache:
    """The ``FlatState`` of the last few Modules a jitted function was called with.

    Keyed by Module identity; an entry goes away with its Module (weak
    reference) or when the Module changed since the entry was made.
    """

    _MAX_MODULES = 8

    __slots__ = ("_flats",)

    def __init__(self):
        self._flats: dict[int, FlatState] = {}

    def get(self, module: Module) -> FlatState:
        """The cached flat state of ``module`` if still current, else a fresh one (cached)."""
        flat = self._flats.get(id(module))
        if flat is not None and flat.module() is module and flat.is_current():
            return flat
        flat = FlatState(module)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in flat.leaves):
            return flat  # a Module of an enclosing trace: do not keep its tracers
        if len(self._flats) >= self._MAX_MODULES:
            del self._flats[next(iter(self._flats))]
        key, flats = id(module), self._flats
        flat.module = weakref.ref(module, lambda _: flats.pop(key, None) if flats.get(key) is flat else None)
        flats[key] = flat
        return flat

    def forget(self, module: Module) -> None:
        """Drops the entry of ``module`` (its structure changed)."""
        self._flats.pop(id(module), None)
