"""What every lifted transform shares: checking its Module argument, and a
``ctx=`` Context crossing the transform as pure ``(keys, contextdef)``."""

import typing as tp

from nnx import contextlib
from nnx.module import _MODULE_STATE, Module, _check_trace, _dict


def check_module(transform: str, module: tp.Any) -> None:
    """Raises ``TypeError`` unless ``module`` (the first argument of a function given to ``transform``) is a Module."""
    if not isinstance(module, Module):
        raise TypeError(
            f"{transform} expects a Module as the first argument of the "
            f"transformed function, got {type(module).__name__}. For functions "
            f"of arrays only, use jax.{transform.split('.')[1]} directly."
        )


def check_arguments(transform: str, args: tuple, kwargs: dict[str, tp.Any] | None = None) -> None:
    """Raises ``TypeError`` for a Context among the positional ``args`` (only ``ctx=`` crosses ``transform``) and
    for a Module among ``args`` or ``kwargs`` (only the first argument is lifted): either would otherwise reach
    JAX as an argument it cannot read."""
    for i, arg in enumerate(args):
        if isinstance(arg, contextlib.Context):
            raise TypeError(
                f"{transform}: argument {i + 1} after the Module is a Context; pass it as the keyword argument ctx= "
                f"(def f(module, ..., *, ctx)), which {transform} splits on the way in and rebuilds inside"
            )
        if isinstance(arg, Module):
            _second_module(transform, f"argument {i + 1} after the first Module", arg)
    for name, arg in (kwargs or {}).items():
        if isinstance(arg, Module):
            _second_module(transform, f"keyword argument {name}=", arg)


def _second_module(transform: str, where: str, module: Module) -> tp.NoReturn:
    raise TypeError(
        f"{transform}: {where} is a Module ({type(module).__name__}); only the first argument is lifted. Hold the "
        f"Modules in one (nnx.Dict(a=..., b=...)) and pass that, or pass this one's state (module.get_state())"
    )


def partition_ctx(kwargs: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """Replaces a ``ctx=`` Context by its pure ``(keys, contextdef)`` form."""
    ctx = kwargs.get("ctx")
    if isinstance(ctx, contextlib.Context):
        kwargs = dict(kwargs)
        kwargs["ctx"] = ctx.partition()
    return kwargs


def merge_ctx(kwargs: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """Inverse of :func:`partition_ctx`, called inside the transform."""
    ctx = kwargs.get("ctx")
    if isinstance(ctx, contextlib.PureContext):
        kwargs = dict(kwargs)
        kwargs["ctx"] = ctx.merge()
    return kwargs


def reconcile(target: Module, fresh: Module) -> None:
    """Makes ``target`` look like ``fresh``, keeping ``target``'s submodules.

    ``fresh`` was built from what a transform returned (state and structure).
    Attributes are copied over (new ones added, missing ones deleted);
    submodules of the same type at the same place are updated in place rather
    than replaced, so references to them stay valid. Sharing is preserved.
    """
    targets: dict[int, Module] = {}  # id(fresh module) -> module standing for it
    used: set[int] = set()  # ids of existing modules already updated

    def adopt(module: Module) -> None:
        for _, sub in module.modules():
            targets.setdefault(id(sub), sub)

    def update(target: Module, fresh: Module) -> None:
        _check_trace(target)
        targets[id(fresh)] = target
        used.add(id(target))
        attributes, new = _dict(target), _dict(fresh)
        for name in [n for n in attributes if n not in new]:
            del attributes[name]
        for name, value in new.items():
            if name == _MODULE_STATE:
                continue
            if isinstance(value, Module):
                if id(value) in targets:
                    attributes[name] = targets[id(value)]
                    continue
                current = attributes.get(name)
                if type(current) is type(value) and id(current) not in used:
                    update(current, value)
                else:
                    adopt(value)
                    attributes[name] = value
            else:
                attributes[name] = value

    update(target, fresh)
