"""Typed config sections: a dataclass per section, built from plain data with every mismatch named.

Each section is a dataclass whose annotations are the schema (`int | None`,
`list[list[Any]]`, a nested section ...). :func:`build` checks raw YAML data
against it key by key; :func:`check_type` checks one value and names the
innermost key or list item at fault::

    build(TrainConfig, {"steps": "ten"}, "train")
    # UserError: config key 'train.steps' must be an integer or null, got 'ten' (str)

A section class with `open_section = True` (`model`, `optimizer`) collects
unknown keys into its `options` field instead of refusing them.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any

from nnx_cli.errors import UserError, did_you_mean


def fields(cls: type) -> dict[str, dataclasses.Field]:
    """YAML key -> dataclass field (the `options` catch-all is not a key)."""
    return {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if f.name != "options"}


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unknown_key_hint(key: str, names: Iterable[str], section: str) -> str:
    """The closest valid key of `section` ("" at the top level), or all of them when none is close."""
    names = list(names)
    return (
        did_you_mean(key, names, section + "." if section else "")
        or f"; valid keys{' in ' + repr(section) if section else ''}: {', '.join(names)}"
    )


def build(cls: type, raw: Any, path: str) -> Any:
    """An instance of the section `cls` from the mapping `raw` found at the dotted `path`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"config key {path or '<top level>'!r} must be a mapping, got {show(raw)}")
    known = fields(cls)
    types_ = hints(cls)
    kwargs: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in raw.items():
        key = str(key)
        dotted = f"{path}.{key}" if path else key
        f = known.get(key)
        if f is None:
            if getattr(cls, "open_section", False):
                options[key] = value
                continue
            raise UserError(f"unknown config key {dotted!r}{unknown_key_hint(key, known, path)}")
        hint = types_[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = build(hint, value, dotted)
        else:
            kwargs[f.name] = check_type(value, hint, dotted)
    if getattr(cls, "open_section", False):
        kwargs["options"] = options
    return cls(**kwargs)


def check_type(value: Any, hint: Any, path: str) -> Any:
    """Check `value` against the annotation `hint`; return it (ints widened to floats).

    A mismatch is a UserError naming the innermost key or list item at fault:
    `sharding.mesh.data=abc` is reported for `sharding.mesh.data`.
    """
    ok, out = _match(value, hint)
    if not ok:
        path, value, hint = _culprit(value, hint, path)
        raise UserError(f"config key {path!r} must be {describe(hint)}, got {show(value)}")
    return out


def _culprit(value: Any, hint: Any, path: str) -> tuple[str, Any, Any]:
    """The deepest (path, value, hint) that does not match, for a precise message."""
    options = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    for option in options:
        origin, args = typing.get_origin(option), typing.get_args(option)
        if origin is dict and isinstance(value, dict) and args:
            for k, v in value.items():
                if not _match(v, args[1])[0]:
                    return _culprit(v, args[1], f"{path}.{k}")
        if origin in (list, collections.abc.Sequence) and isinstance(value, (list, tuple)) and args:
            for i, v in enumerate(value):
                if not _match(v, args[0])[0]:
                    return _culprit(v, args[0], f"{path}[{i}]")
    return path, value, hint


def _match(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return True, value
    if hint is type(None):
        return value is None, None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, out = _match(value, arg)
            if ok:
                return True, out
        return False, None
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else None
    if hint is str:
        return isinstance(value, str), value
    if origin in (list, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False, None
        out = []
        for item in value:
            ok, item = _match(item, args[0] if args else Any)
            if not ok:
                return False, None
            out.append(item)
        return True, out
    if origin is dict:
        if not isinstance(value, dict):
            return False, None
        out_d = {}
        for k, v in value.items():
            ok, v = _match(v, args[1] if args else Any)
            if not ok or not isinstance(k, str):
                return False, None
            out_d[k] = v
        return True, out_d
    return isinstance(value, hint), value


def allows_mapping(hint: Any) -> bool:
    if typing.get_origin(hint) is dict:
        return True
    return any(allows_mapping(a) for a in typing.get_args(hint))


_NAMES = {
    bool: ("a boolean", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
    Any: ("a value", "values"),
}


def describe(hint: Any, plural: bool = False) -> str:
    """`int` -> "an integer", `list[list[Any]]` -> "a list of lists", `float | None` -> "a number or null"."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a, plural) for a in args)
    if origin in (list, collections.abc.Sequence):
        inner = f" of {describe(args[0], plural=True)}" if args and args[0] is not Any else ""
        return ("lists" if plural else "a list") + inner
    if origin is dict:
        return "mappings" if plural else "a mapping"
    one, many = _NAMES.get(hint, (getattr(hint, "__name__", str(hint)),) * 2)
    return many if plural else one


def show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})" if value is not None else "null"


def positive(path: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise UserError(f"config key {path!r} must be a positive integer, got {show(value)}")
