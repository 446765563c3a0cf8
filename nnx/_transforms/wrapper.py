"""Modules built around a layer constructor: the base of ``Scan`` and ``Remat``.

``nnx.Scan(Block, **options)`` does not build anything: it checks the options
and returns a constructor, and calling that constructor with ``Block``'s
arguments builds the wrapper, which builds (and holds) the layer. Calling the
wrapper, or ``wrapper.call.some_method(...)``, runs the layer's method under
the wrapper's transform.
"""

import functools
import inspect
import typing as tp

from nnx._call_proxy import CallProxy
from nnx.module import _MODULE_STATE, Module, ModuleMeta, _dict

M = tp.TypeVar("M", bound=Module)


class LiftedMeta(ModuleMeta):
    """``Wrapper(module_constructor, **options)`` returns a constructor.

    The options are checked right away (their names against ``__init__``'s,
    then ``cls._check_options``), so a wrong one fails where the wrapper is
    declared, not where it is first built.
    """

    def __call__(cls, module_constructor, /, *args, **options):
        _check_option_names(cls, args, options)
        cls._check_options(*args, **options)
        create = super().__call__

        def constructor(*init_args, **init_kwargs):
            return create(module_constructor, init_args, init_kwargs, *args, **options)

        functools.update_wrapper(constructor, module_constructor, updated=())
        return constructor


def _check_option_names(cls: type, args: tuple, options: dict[str, tp.Any]) -> None:
    """A TypeError naming the options ``cls`` takes when ``args`` / ``options`` do not fit its ``__init__``."""
    signature = inspect.signature(cls.__init__)
    try:
        signature.bind(None, None, (), {}, *args, **options)
    except TypeError as e:
        names = list(signature.parameters)[4:]  # after self, module_constructor, module_init_args/kwargs
        raise TypeError(f"nnx.{cls.__name__}: {e}; its options are {', '.join(names)}") from None


class LiftedModule(Module, tp.Generic[M], metaclass=LiftedMeta):
    """A Module that runs the methods of the layer it holds under a transform.

    Subclasses take ``(module_constructor, module_init_args,
    module_init_kwargs, **options)`` in ``__init__`` and implement
    :meth:`_run`; they may override :meth:`_check_options`.
    """

    @staticmethod
    def _check_options(*args: tp.Any, **options: tp.Any) -> None:
        """Validates the options when the wrapper is declared."""

    def _run(self, fun: tp.Callable[..., tp.Any], args: tuple, kwargs: dict[str, tp.Any]) -> tp.Any:
        """Runs ``fun(layer, *args, **kwargs)`` under the transform."""
        raise NotImplementedError

    def __call__(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        return self.call(*args, **kwargs)

    @property
    def call(self) -> M:
        """Runs any method of the layer under the transform: ``m.call.decode(...)``."""

        def run(reach, *args, **kwargs):
            return self._run(lambda layer, *a, **k: reach(layer)(*a, **k), args, kwargs)

        return CallProxy(run)  # type: ignore[return-value]


def decorates_init(f: tp.Callable[..., tp.Any], is_init: bool | None) -> bool:
    """Whether a method decorator is applied to ``__init__`` (``is_init`` overrides the name)."""
    return f.__name__ == "__init__" if is_init is None else is_init


def adopt(target: Module, source: Module) -> None:
    """Moves every attribute of ``source`` (built from pure state) onto ``target``."""
    attributes = _dict(target)
    for name, value in _dict(source).items():
        if name != _MODULE_STATE:
            attributes[name] = value
