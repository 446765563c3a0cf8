"""Config files as YAML: a strict loader (no key twice, `3e-4` as a number), atomic writes, override values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from nnx_cli.errors import UserError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loader that also reads `3e-4` (no dot) as a float, like YAML 1.2,
    and rejects a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (dict, list)):  # `{{ x }}`: a Jinja template, unquoted, reads as a mapping in a mapping
                raise yaml.constructor.ConstructorError(
                    None, None, "a key that is a mapping or a list (quote text that holds {{ or [)",
                    key_node.start_mark,
                )  # fmt: skip
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class Unparsed(str):
    """An override value that is not valid YAML, kept as its text (a Jinja template `{{ ... }}` is one), with why
    it did not parse: a key that wanted something else reports both."""

    problem: str


yaml.SafeDumper.add_representer(Unparsed, yaml.representer.SafeRepresenter.represent_str)  # saved as the text it is


def parse_value(text: str) -> Any:
    """Parse one override value as YAML: `3` -> 3, `3e-4` -> 0.0003, `[1, 2]` -> [1, 2]; text that is not YAML
    stays text (:class:`Unparsed`)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        value = Unparsed(text)  # type checks report it, with the reason
        value.problem = getattr(e, "problem", None) or "invalid YAML"
        return value


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`; a missing, unreadable or malformed file is a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"config file {str(path)!r} does not exist"
            if not path.exists()
            else f"config path {str(path)!r} is not a file"
        )
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise UserError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {str(path)!r}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def dump_yaml(data: dict[str, Any], path: str | Path) -> None:
    """Write `data` as YAML, atomically: a reader never sees half a file."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(yaml.safe_dump(data, sort_keys=False))
    partial.replace(path)
