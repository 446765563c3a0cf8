"""The reference pages are generated from the code (tools/gen_reference.py): every key and option is described
there, and the committed pages are what the generator writes now."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import typing
from pathlib import Path

import pytest

from nnx_cli.config import Config, from_dict, merge, to_dict
from nnx_cli.config.objective import OPTIONS
from nnx_cli.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module  # its dataclass needs its module registered
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_every_config_key_model_option_and_command_option_has_a_description():
    assert gen.undescribed() == [], "describe them in the code (setting(..., help), a docstring's Args:, help=)"


def test_the_generated_reference_pages_are_up_to_date():
    stale = gen.stale_pages()
    assert not stale, f"{', '.join(stale)} differ from the code: run `python tools/gen_reference.py`"


def test_no_commands_help_shows_markup_the_terminal_prints_as_typed():
    """--help prints a command's help as typed: backticks and reStructuredText's `::` showed in `nnx-configs
    --help` (its module docstring). Options are checked too."""
    for name, module in gen.console_scripts().items():
        command = gen._click_command(module)
        commands = [command, *getattr(command, "commands", {}).values()]
        texts = [c.help or "" for c in commands] + [p.help or "" for c in commands for p in c.params]
        for text in texts:
            assert "`" not in text and "::" not in text, f"{name}: {text!r}"


NAMES = [("text", "text"), ("str", "text"), ("integer", "integer"), ("int", "integer"), ("integer range", "integer"),
         ("int range", "integer"), ("float", "number")]  # fmt: skip


@pytest.mark.parametrize("name,ours", NAMES)
def test_options_are_named_alike_whatever_click_types_the_installed_typer_carries(name, ours):
    """click names its types text, integer, integer range; the click types Typer 0.27 carries itself are named
    str, int, int range (the command reference differed on a machine with it). The page names them ours."""
    import click

    class Named(click.ParamType):
        def __init__(self, type_name: str):
            self.name = type_name

    assert gen._param_type(click.Option(["--x"], type=Named(name))) == ours
    assert gen._param_type(click.Option(["--x"], type=Named(name), multiple=True)) == f"{ours}, repeated"


def test_the_config_reference_lists_every_key_the_schema_accepts():
    page = (ROOT / "docs/reference/config.md").read_text()

    def keys(data: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in data.items():
            dotted = prefix + key
            hint_is_section = isinstance(value, dict) and dotted not in ("sharding.mesh",)
            out += keys(value, dotted + ".") if hint_is_section and value else [dotted]
        return out

    resolved = to_dict(Config())
    for key in keys(resolved):
        assert f"`{key}`" in page, key
    for cls in OPTIONS.values():
        for f in dataclasses.fields(cls):
            assert f"`objective.{f.name}`" in page, f.name


def _choice_fields() -> list[tuple[str, str, object]]:
    """`(section path, key, choice)` for every choice a config key lists."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            for choice in f.metadata.get("choices", ()):
                out.append((prefix, f.metadata.get("key", f.name), choice))

    walk(Config, "")
    return out


def _config(prefix: str, key: str, value: object) -> dict:
    raw: dict = {}
    node = raw
    for part in prefix.rstrip(".").split(".") if prefix else []:
        node = node.setdefault(part, {})
    node[key] = value
    if prefix == "objective." and key == "name" and value == "grpo":
        node["rewards"] = ["exact_match"]
    return merge(to_dict(Config()), raw)


@pytest.mark.parametrize(("prefix", "key", "choice"), _choice_fields(), ids=lambda v: str(v))
def test_every_listed_choice_is_accepted(prefix: str, key: str, choice: object):
    from_dict(_config(prefix, key, choice))


@pytest.mark.parametrize(("prefix", "key"), sorted({(p, k) for p, k, _ in _choice_fields()}), ids=lambda v: str(v))
def test_a_value_outside_the_listed_choices_is_refused(prefix: str, key: str):
    with pytest.raises(UserError, match=key):
        from_dict(_config(prefix, key, "no-such-choice"))


def test_each_objectives_listed_choices_are_accepted_and_others_refused():
    for name, cls in OPTIONS.items():
        for f in dataclasses.fields(cls):
            for choice in f.metadata.get("choices", ()):
                raw = {"name": name, f.name: choice, **({"rewards": ["exact_match"]} if name == "grpo" else {})}
                from_dict(merge(to_dict(Config()), {"objective": raw}))
            if f.metadata.get("choices"):
                raw = {
                    "name": name,
                    f.name: "no-such-choice",
                    **({"rewards": ["exact_match"]} if name == "grpo" else {}),
                }
                with pytest.raises(UserError, match=f.name):
                    from_dict(merge(to_dict(Config()), {"objective": raw}))
