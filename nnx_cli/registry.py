"""Plug-in points: a registry of names, plus `package.module:attr` references.

Models, data sources, optimizers and metric loggers are all found the same
way. A config names either something a registry knows (`vae`, `tensorboard`)
or a `package.module:attr` reference, which is imported from the current
directory first (as uvicorn does), so a file beside the config plugs in with
no `PYTHONPATH`::

    MODELS = Registry("model", "model.name")
    MODELS.register("vae", VAE)
    MODELS.get("vae")                  # VAE
    MODELS.get("my_models:Wide")       # imports ./my_models.py, returns its Wide
    import_paths()                     # {"my_models": "/home/me/project"}

`import_paths()` records where each reference was imported from; a run keeps
it in `run.json`, and `nnx-eval` run from another directory calls
`add_import_paths` with it so the same reference resolves again.

Options from a config section are bound to a plug-in's signature with
:func:`bind_options`: unknown keys, missing required keys and (where the
annotations allow) wrong types are all `UserError`s naming the config key.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from nnx_cli.errors import UserError, did_you_mean

T = TypeVar("T")

_REFERENCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_imported: dict[str, str] = {}


def is_reference(name: str) -> bool:
    """Whether `name` has the form `package.module:attr`."""
    return bool(_REFERENCE.match(name))


class Registry(Mapping[str, T], Generic[T]):
    """Names of one kind of plug-in (`kind`, set by config key `key`) -> objects.

    `check(obj, name)` (optional) validates what a `package.module:attr`
    reference resolves to and raises `UserError` when it does not fit.
    """

    def __init__(self, kind: str, key: str, check: Callable[[Any, str], None] | None = None):
        self.kind = kind
        self.key = key
        self._check = check
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T) -> T:
        self._entries[name] = obj
        return obj

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str, default: Any = None) -> T:  # type: ignore[override]
        """The object registered as `name`, or the one a `package.module:attr` reference names.

        Anything else is a UserError naming the config key, the closest
        registered name and the registered names.
        """
        if name in self._entries:
            return self._entries[name]
        if is_reference(name):
            obj = load_reference(name, self.key)
            if self._check is not None:
                self._check(obj, name)
            return obj
        raise UserError(
            f"config key {self.key!r}: unknown {self.kind} {name!r}{did_you_mean(name, self._entries)}; "
            f"known: {', '.join(self._entries)}, or 'package.module:attr' for your own"
        )


def load_reference(reference: str, key: str, shown: str | None = None) -> Any:
    """Import `package.module:attr` (the current directory first on the path) and return the attribute; errors
    name it as `shown` (what the config said, when it spelled it otherwise)."""
    module_name, _, attr = reference.partition(":")
    given = shown or reference
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # kept: worker processes and later imports see the same modules
    pinned = _pinned.get(module_name.split(".")[0])
    if pinned is not None and pinned in sys.path:  # a run's own plug-in, before a namesake in this directory
        sys.path.remove(pinned)
        sys.path.insert(0, pinned)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"config key {key!r}: cannot import module {module_name!r} for {given!r}: {e}") from None
    except Exception as e:  # the module itself failed while importing
        raise UserError(
            f"config key {key!r}: importing {module_name!r} for {given!r} failed: {type(e).__name__}: {e}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserError(
                f"config key {key!r}: module {module_name!r} has no attribute {attr!r}{_shadowed(module_name, cwd)}"
            )
    _record(module_name, module)
    return obj


def _shadowed(module_name: str, cwd: str) -> str:
    """Why a file in `cwd` named like the module was not the one imported (`json.py` beside the config is not
    the standard library's `json`), or `""` when there is no such file or it was the one imported."""
    top = module_name.split(".")[0]
    local = next((p for p in (Path(cwd, f"{top}.py"), Path(cwd, top)) if p.exists()), None)
    file = getattr(sys.modules.get(top), "__file__", None)
    if local is None or (file is not None and Path(file).resolve().is_relative_to(Path(cwd).resolve())):
        return ""
    which = "the standard library's" if top in sys.stdlib_module_names else "an installed"
    where = f" ({file})" if file else ""
    return (
        f": {which} module {top!r}{where} was imported instead of your {local.name}, "
        f"so rename {local.name} (and {top!r} in the reference) to a name of its own"
    )


_pinned: dict[str, str] = {}  # top-level module -> the directory a run recorded for it (add_import_paths)


def _record(module_name: str, module: Any) -> None:
    """Remember the sys.path entry `module_name` was imported from."""
    file = getattr(module, "__file__", None)
    if not file:
        return
    parts = module_name.split(".")
    path = Path(file).resolve()
    depth = len(parts) if path.name == "__init__.py" else len(parts) - 1
    _imported[parts[0]] = str(path.parents[depth])


def import_paths() -> dict[str, str]:
    """Top-level module name -> the directory each `package.module:attr` reference was imported from."""
    return dict(_imported)


def add_import_paths(paths: Mapping[str, str]) -> None:
    """Put the directories a run imported its references from back on the path (for nnx-eval and friends): each
    module is then imported from the directory the run recorded, even where the current directory holds a file
    of the same name (it took that one: other code, other numbers, without a word)."""
    for name, directory in paths.items():
        if Path(directory).is_dir() and directory not in sys.path:  # one on the path already (site-packages) stays
            sys.path.insert(0, directory)
            _pinned[name] = directory


def bind_options(
    fn: Callable,
    options: Mapping[str, Any],
    *,
    prefix: str,
    what: str,
    skip: Iterable[str] = (),
    fixed: Iterable[str] = (),
    fill_defaults: bool = False,
    check_types: bool = False,
    hint: str = "",
) -> dict[str, Any]:
    """Check config `options` against `fn`'s keyword parameters; return the keywords to call it with.

    - `prefix`: the config path of the options (`"model."`), `what`: the
      plug-in in messages (`"model 'vae'"`, `"optax.adamw"`);
    - `skip`: parameters the caller passes itself (`ctx`, `learning_rate`);
      `fixed`: other keys of the same config section, offered as suggestions;
    - `fill_defaults`: also return the defaults of parameters not given (a
      tuple default becomes a list, as YAML writes it), so a saved config
      is complete;
    - `check_types`: check each given value against the annotation.

    >>> bind_options(lambda *, width=4: None, {"width": 8}, prefix="model.", what="model 'm'")
    {'width': 8}
    """
    from nnx_cli.config import check_type

    skip = {"self", *skip}
    params = {
        n: p
        for n, p in signature(fn).parameters.items()
        if n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    for key in options:
        if key not in params:
            raise UserError(
                f"unknown config key {prefix + key!r} for {what}{did_you_mean(key, [*params, *fixed], prefix)}; "
                f"options: {', '.join(params) or 'none'}{hint}"
            )
    hints = _type_hints(fn) if check_types else {}
    out = {}
    for name, value in options.items():
        _check_finite(value, prefix + name)
    for name, p in params.items():
        if name in options and not check_types:
            _check_number(options[name], p, prefix + name, what)
        if name in options:
            out[name] = check_type(options[name], hints.get(name, Any), prefix + name) if check_types else options[name]
        elif p.default is p.empty:
            raise UserError(f"config key {prefix + name!r} is required by {what}")
        elif fill_defaults:
            out[name] = list(p.default) if isinstance(p.default, tuple) else p.default
    return out


def _check_number(value: Any, parameter: inspect.Parameter, path: str, what: str) -> None:
    """Text where a library function (optax's, whose annotations are aliases) takes a number: its default is one, or
    its annotation names one. The call failed later with a TypeError that named no key."""
    if not isinstance(value, str):
        return
    default = parameter.default
    annotation = str(parameter.annotation).replace("typing.", "")
    numeric = (isinstance(default, (int, float)) and not isinstance(default, bool)) or (
        default in (parameter.empty, None)
        and "float" in annotation
        and not any(word in annotation for word in ("str", "Callable"))
    )
    if numeric:
        raise UserError(f"config key {path!r} must be a number for {what}, got {value!r}")


def _check_finite(value: Any, path: str) -> None:
    """YAML's .nan and .inf are numbers to YAML; no option means anything by them (null is "none")."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key {path!r} must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}[{i}]")


def signature(fn: Callable) -> inspect.Signature:
    """`fn`'s signature (a class: its `__init__`'s), or an empty one where Python cannot tell."""
    try:
        return inspect.signature(fn.__init__ if isinstance(fn, type) else fn)
    except (TypeError, ValueError):
        return inspect.Signature()


def _type_hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # annotations that do not resolve: options go unchecked, as plain Python would
        return {}
