"""Optional ``flax.serialization`` support for nnx types.

With flax installed, ``flax.serialization.to_state_dict`` / ``from_state_dict``
(and so ``to_bytes`` / ``from_bytes``, msgpack) work on every ``Pytree``
(``TrainState`` included), ``State`` and ``Node`` container::

    from flax import serialization
    data = serialization.to_bytes(model.get_state())
    state = serialization.from_bytes(model.get_state(), data)

Importing flax would make ``import nnx`` noticeably slower, so nnx never does.
Types :func:`register` their handlers here; they reach flax at once when
``flax.serialization`` is already imported, else right after it is (see
:class:`_ImportHook`).
"""

import functools
import importlib.abc
import importlib.util
import sys
import typing as tp

# A handler takes the flax.serialization module as its first argument.
ToStateDict = tp.Callable[[tp.Any, tp.Any], tp.Any]
FromStateDict = tp.Callable[[tp.Any, tp.Any, tp.Any], tp.Any]

_handlers: list[tuple[type, ToStateDict, FromStateDict]] = []


def register(cls: type, to_state_dict: ToStateDict, from_state_dict: FromStateDict) -> None:
    """Serializes ``cls`` with ``to_state_dict(serialization, obj)`` and ``from_state_dict(serialization, obj, state)``.

    Example: ``register(State, _state_to_dict, _state_from_dict)``.
    """
    _handlers.append((cls, to_state_dict, from_state_dict))
    serialization = sys.modules.get("flax.serialization")
    if serialization is not None:
        _register_with(serialization, cls, to_state_dict, from_state_dict)


def register_all() -> None:
    """Registers every handler with ``flax.serialization`` (imports it)."""
    from flax import serialization

    for handler in _handlers:
        _register_with(serialization, *handler)


def _register_with(serialization: tp.Any, cls: type, to_state_dict: ToStateDict, from_state_dict: FromStateDict):
    serialization.register_serialization_state(
        cls,
        functools.partial(to_state_dict, serialization),
        functools.partial(from_state_dict, serialization),
        override=True,
    )


def restore_fields(
    serialization: tp.Any, owner: str, targets: tp.Mapping[str, tp.Any], state: tp.Mapping[str, tp.Any]
) -> dict[str, tp.Any]:
    """``{name: from_state_dict(target, state[name])}``; ``state`` must have exactly the names of ``targets``.

    ``owner`` names what is restored (``"an instance of TrainState"``) in the
    errors for missing or unknown fields.
    """
    state = dict(state)
    restored = {}
    for name, target in targets.items():
        if name not in state:
            raise ValueError(
                f"Missing field {name!r} in state dict while restoring {owner} at path "
                f"{serialization.current_path()}: the state dict was saved from something built differently. "
                "Restore into a target built like the one that was saved."
            )
        restored[name] = serialization.from_state_dict(target, state.pop(name), name=name)
    if state:
        raise ValueError(
            f"Unknown field(s) {sorted(state)} in state dict while restoring {owner} at path "
            f"{serialization.current_path()}: the target has no such fields. Restore into a target built like "
            "the one that was saved."
        )
    return restored


class _ImportHook(importlib.abc.MetaPathFinder):
    """Registers the handlers as soon as ``flax.serialization`` is imported.

    It wraps the module's ``exec_module`` to register every handler right
    after ``flax.serialization`` has run, then leaves ``sys.meta_path``.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != "flax.serialization":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        def exec_and_register(module):
            del loader.exec_module  # back to the class's method (loaders may be shared)
            loader.exec_module(module)
            for handler in _handlers:
                _register_with(module, *handler)

        loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


if "flax.serialization" not in sys.modules:
    sys.meta_path.insert(0, _ImportHook())
