"""CallProxy: ``proxy(...)``, ``proxy.method(...)`` or ``proxy.sub[0](...)``.

The functional API (``model.apply``, ``moduledef.apply``, ``pure.call``) and
the lifted Modules (``scan.call``, ``remat.call``) all let the user pick what
to call on a Module that does not exist yet: it is built, cloned or traced
when the call happens. A ``CallProxy`` records the attribute and item accesses
and hands them to ``run`` as one function, ``reach(module)``, that finds the
chosen callable on the Module ``run`` builds::

    def run(reach, *args, **kwargs):
        module = moduledef.merge(state)
        return reach(module)(*args, **kwargs), module

    out, module = CallProxy(run).encoder.layers[0](x)   # runs module.encoder.layers[0](x)
"""

import typing as tp

A = tp.TypeVar("A")


class CallProxy(tp.Generic[A]):
    """Records ``.name`` and ``[key]`` steps; calling it calls ``run(reach, *args, **kwargs)``."""

    __slots__ = ("_run", "_path")

    def __init__(self, run: tp.Callable[..., A], path: tuple[tuple[bool, tp.Any], ...] = ()):
        self._run = run
        self._path = path

    def __getattr__(self, name: str) -> "CallProxy[A]":
        if name.startswith("__"):
            raise AttributeError(name)
        return CallProxy(self._run, self._path + ((True, name),))

    def __getitem__(self, key: tp.Any) -> "CallProxy[A]":
        return CallProxy(self._run, self._path + ((False, key),))

    def __call__(self, *args: tp.Any, **kwargs: tp.Any) -> A:
        return self._run(self._reach, *args, **kwargs)

    def _reach(self, module: tp.Any) -> tp.Callable[..., tp.Any]:
        target = module
        for is_attribute, key in self._path:
            target = getattr(target, key) if is_attribute else target[key]
        return target
