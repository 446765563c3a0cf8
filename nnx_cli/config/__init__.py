"""The experiment config: schema with defaults, YAML loading, overrides, validation.

A config is one YAML file; every section has defaults, so the smallest config
is `{}`. Command-line overrides are dotted paths with YAML values::

    cfg = load_config("configs/digits_vae.yaml", ["train.steps=200", "optimizer.learning_rate=3e-4"])
    cfg.train.steps            # 200
    to_dict(cfg)               # the fully resolved config, as written to <workdir>/config.yaml

Every mistake is a :class:`~nnx_cli.errors.UserError` that names the file or
the dotted key, says what was expected and, for unknown keys, suggests the
closest valid one. The `model` and `optimizer` sections are open: keys beyond
the fixed ones are keyword arguments of the model constructor or optax
function, checked against their signatures when the run is built.

One module per section (`model.py`, `data.py`, `train.py`, ...): a
dataclass whose annotations are its schema and whose `check()` holds the
range checks its types cannot express. A new section is a new module and a
field of :class:`Config`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nnx_cli.config.checkpoint import CheckpointConfig
from nnx_cli.config.data import DataConfig
from nnx_cli.config.eval import EvalConfig, HarnessConfig
from nnx_cli.config.logging import LoggingConfig
from nnx_cli.config.model import ModelConfig
from nnx_cli.config.objective import ObjectiveConfig
from nnx_cli.config.optimizer import OptimizerConfig
from nnx_cli.config.schema import (
    SECTIONS,
    allows_mapping,
    build,
    check_type,
    fields,
    hints,
    setting,
    unknown_key_hint,
)
from nnx_cli.config.sharding import ShardingConfig
from nnx_cli.config.train import TrainConfig
from nnx_cli.config.yaml_io import dump_yaml, parse_value, read_yaml
from nnx_cli.errors import UserError

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "HarnessConfig",
    "LoggingConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimizerConfig",
    "ShardingConfig",
    "TrainConfig",
    "apply_overrides",
    "changes",
    "check_type",
    "dump_yaml",
    "from_dict",
    "load_config",
    "merge",
    "parse_value",
    "read_yaml",
    "to_dict",
]


@dataclass
class Config:
    """The whole experiment: two keys of its own and one section per part of a run."""

    seed: int = setting(0, "parameters, batch order and RNG keys all derive from it", values="0 to 2**32 - 1")
    workdir: str | None = setting(None, "where checkpoints, metrics and samples go; null: `runs/<config stem>`")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


SECTIONS.update({name: hint for name, hint in hints(Config).items() if dataclasses.is_dataclass(hint)})


# --------------------------------------------------------------------------- overrides


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b.c=VALUE` override written into it.

    Paths are checked against the schema first, so `train.setps=3` fails with
    "did you mean 'train.steps'?". Inside open sections and mapping-valued keys
    (`sharding.mesh.data=4`, `optimizer.learning_rate.peak_value=1e-3`) any key
    is accepted here and checked when the config is validated or used.
    """
    raw = deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"override {item!r} must look like KEY=VALUE, for example train.steps=100")
        parts = key.split(".")
        _check_override_path(parts, item)
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                # e.g. learning_rate=1e-3 then learning_rate.name=...: start a fresh mapping
                child = node[part] = {}
            node = child
        value = parse_value(text)
        if _unspaced_mapping(value):
            fixed = re.sub(r"([:,])(?=\S)", r"\1 ", text.strip())
            raise UserError(
                f"override {item!r}: YAML reads 'a:b' in a mapping as one key without a value; put a space after "
                f"each ':', e.g. {key}={fixed!r}"
            )
        node[parts[-1]] = value
    return raw


def _unspaced_mapping(value: Any) -> bool:
    """Whether `value` is a mapping YAML made of `{a:b,c:d}` (keys holding ':', without values)."""
    if isinstance(value, dict):
        return any((isinstance(k, str) and ":" in k and v is None) or _unspaced_mapping(v) for k, v in value.items())
    return False


def _check_override_path(parts: list[str], item: str) -> None:
    cls: Any = Config
    for depth, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return  # inside a free-form mapping
        known = fields(cls)
        if part not in known:
            if getattr(cls, "open_section", False):
                return
            path = ".".join(parts[: depth + 1])
            prefix = ".".join(parts[:depth])
            raise UserError(f"override {item!r}: unknown config key {path!r}{unknown_key_hint(part, known, prefix)}")
        hint = hints(cls)[known[part].name]
        cls = hint if dataclasses.is_dataclass(hint) else None
        if cls is None and depth < len(parts) - 1 and not allows_mapping(hint):
            path = ".".join(parts[: depth + 1])
            raise UserError(f"override {item!r}: {path!r} is a single value, it has no key {parts[depth + 1]!r}")


# --------------------------------------------------------------------------- validation


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read `path` (or start from defaults when None), apply overrides, validate.

    The file is laid over the defaults and the overrides over the file, so
    `sharding.mesh.data=4` keeps the default `model` axis.
    """
    try:
        given = read_yaml(path) if path is not None else {}
        raw = apply_overrides(merge(to_dict(Config()), given), overrides)
        _default_tokenizer(raw, apply_overrides(given, overrides))
        return from_dict(raw)
    except RecursionError:  # a YAML alias that contains itself (`a: &x [*x]`)
        raise UserError(f"config file {str(path)!r} nests without end (a YAML anchor that refers to itself)") from None


def _default_tokenizer(raw: dict[str, Any], given: dict[str, Any]) -> None:
    """`data.tokenizer` defaults to `pretrained` when `model.pretrained` is set and the config names no tokenizer."""
    model, data = given.get("model"), given.get("data")
    pretrained = isinstance(model, dict) and model.get("pretrained") is not None
    named = isinstance(data, dict) and "tokenizer" in data
    if pretrained and not named and isinstance(raw.get("data"), dict):
        raw["data"]["tokenizer"] = "pretrained"


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a validated :class:`Config` from nested plain data."""
    cfg = build(Config, raw, "")
    _check_values(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain nested data (open-section options inlined)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "options":
            out.update(deepcopy(value))
        elif dataclasses.is_dataclass(value):
            out[f.metadata.get("key", f.name)] = to_dict(value)
        else:
            out[f.metadata.get("key", f.name)] = deepcopy(value)
    return out


def _check_values(cfg: Config) -> None:
    """Range checks the types cannot express: the seed, then each section's own `check()`."""
    if not 0 <= cfg.seed < 2**32:
        raise UserError(f"config key 'seed' must be an integer from 0 to 2**32 - 1, got {cfg.seed}")
    for f in dataclasses.fields(cfg):
        check = getattr(getattr(cfg, f.name), "check", None)
        if check is not None:
            check()


def changes(
    before: dict[str, Any], after: dict[str, Any], ignore: Iterable[str] = (), defaults: dict[str, Any] | None = None
) -> list[str]:
    """`"key: old -> new"` for every dotted key whose value differs between two resolved configs.

    A key that `before` lacks and `after` holds at its value in `defaults` is no change: a config saved by an
    earlier release lacks the keys added since, whose defaults keep its meaning.

    >>> changes({"train": {"steps": 400}}, {"train": {"steps": 800}})
    ['train.steps: 400 -> 800']
    >>> changes({"model": {}}, {"model": {"bias": True}}, defaults={"model": {"bias": True}})
    []
    """
    flat_before, flat_after, flat_defaults = _flatten(before), _flatten(after), _flatten(defaults or {})
    out = []
    for key in sorted(flat_before.keys() | flat_after.keys()):
        if any(key == skip or key.startswith(skip + ".") for skip in ignore):
            continue
        if key not in flat_before and key in flat_defaults and flat_after.get(key) == flat_defaults[key]:
            continue
        old, new = flat_before.get(key, "(unset)"), flat_after.get(key, "(unset)")
        if old != new:
            out.append(f"{key}: {_short(old)} -> {_short(new)}")
    return out


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _short(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return text if len(text) <= 40 else text[:37] + "..."


def merge(base: Any, top: Any) -> Any:
    """`top` laid over `base`: mappings merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for k, v in top.items():
            out[k] = merge(base.get(k), v) if k in base else deepcopy(v)
        return out
    return deepcopy(top)


def deepcopy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: deepcopy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [deepcopy(v) for v in value]
    return value
