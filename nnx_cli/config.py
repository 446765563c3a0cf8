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
"""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nnx_cli.errors import UserError, did_you_mean

# --------------------------------------------------------------------------- schema


@dataclass
class ModelConfig:
    name: str = "vae"  # registry name, or "package.module:Class"
    input_shape: list[int] | None = None  # null: from the dataset
    num_classes: int | None = None  # null: from the dataset
    pretrained: str | None = None  # a Hugging Face model directory or Hub id: options and weights from there
    options: dict[str, Any] = field(default_factory=dict)  # constructor keywords

    open_section = True


@dataclass
class DataConfig:
    source: str = "sklearn:digits"  # Hub id, local dir/file, or sklearn:digits
    train_split: str = "train"
    eval_split: str | None = "test"
    image_key: str = "image"
    label_key: str | None = "label"
    binarize: float | None = None  # threshold on [0, 1] pixels; null keeps grey levels
    text_key: str | None = None  # the column of documents; setting it makes this a text dataset
    tokenizer: str = "bytes"  # bytes, pretrained (model.pretrained's; its default), a Hub id, or a tokenizer.json
    seq_len: int = 256  # tokens per training window (text)
    workers: int | None = None  # input-pipeline worker processes; null: the machine's cores, 0: none
    cache_dir: str | None = None  # decoded / tokenized caches; null: under the `datasets` cache
    on_device: bool | str = "auto"  # keep the training split on the devices: auto, true or false
    format: str = "text"  # text (documents in data.text_key) | chat | completion: examples (text_key unused)
    messages_key: str = "messages"  # chat: the column of {role, content} message lists
    prompt_key: str = "prompt"  # completion: the prompt ...
    completion_key: str = "completion"  # ... and what the model should learn to answer
    train_on_prompt: bool = False  # chat/completion: loss on every token, not only the answers
    max_len: int | None = None  # chat/completion: longer examples are cut (counted, said); null: seq_len + 1
    packing: bool = True  # chat/completion: whole examples fill each row; false: one example per row
    chat_template: str | None = None  # chat: a Jinja file or text; null: the model directory's


@dataclass
class OptimizerConfig:
    name: str | None = None  # any optax optimizer by name, or package.module:make; null: adam, or the chain
    learning_rate: float | dict[str, Any] = 1e-3  # or {name: <optax schedule>, ...}
    clip_grad_norm: float | None = None
    weight_decay_mask: str = "all"  # all, or kernels: decay parameters of two or more dimensions only
    chain: list[dict[str, Any]] | None = None  # optax pieces [{name: scale_by_adam, b2: 0.99}, ...]
    options: dict[str, Any] = field(default_factory=dict)  # optax keywords

    open_section = True


@dataclass
class TrainConfig:
    batch_size: int = 128  # global batch
    epochs: int | None = 30
    steps: int | None = None  # overrides epochs when set
    log_every: int = 100
    eval_every: int = 1000
    eval_batch_size: int | None = None  # null: batch_size
    eval_max_batches: int | None = None  # null: the whole eval split
    steps_per_dispatch: int | str = "auto"  # optimizer steps per jitted call
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    deterministic: bool = False  # GPU: deterministic kernels, for exact resumption
    profile: list[int] | None = None  # [start_step, num_steps]: a JAX profiler trace into the work dir
    sample_prompts: list[str] | None = None  # language models: prompts sampled at each eval


@dataclass
class ShardingConfig:
    mesh: dict[str, int] = field(default_factory=lambda: {"data": -1, "model": 1})
    rules: list[list[Any]] | None = None  # null: the model's default rules


@dataclass
class CheckpointConfig:
    every_steps: int = 1000
    keep: int = 3
    async_: bool = field(default=True, metadata={"key": "async"})
    init_from: str | None = None  # a work dir or step dir: start from its parameters (fine-tuning)
    keep_best: dict[str, str] | None = None  # {metric: nelbo, mode: min}: also keep the best eval


@dataclass
class LoggingConfig:
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "console"])  # also tensorboard, wandb, pkg.mod:Class


@dataclass
class Config:
    seed: int = 0
    workdir: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loader that also reads `3e-4` (no dot) as a float, like YAML 1.2,
    and rejects a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
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


def parse_value(text: str) -> Any:
    """Parse one override value as YAML: `3` -> 3, `3e-4` -> 0.0003, `[1, 2]` -> [1, 2]."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text  # not YAML: keep the raw string, type checks report it


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


# --------------------------------------------------------------------------- overrides


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b.c=VALUE` override written into it.

    Paths are checked against the schema first, so `train.setps=3` fails with
    "did you mean 'train.steps'?". Inside open sections and mapping-valued keys
    (`sharding.mesh.data=4`, `optimizer.learning_rate.peak_value=1e-3`) any key
    is accepted here and checked when the config is validated or used.
    """
    raw = _deepcopy(raw)
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
        node[parts[-1]] = parse_value(text)
    return raw


def _check_override_path(parts: list[str], item: str) -> None:
    cls: Any = Config
    for depth, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return  # inside a free-form mapping
        fields = _fields(cls)
        if part not in fields:
            if getattr(cls, "open_section", False):
                return
            path = ".".join(parts[: depth + 1])
            prefix = ".".join(parts[:depth])
            raise UserError(f"override {item!r}: unknown config key {path!r}{_unknown_key_hint(part, fields, prefix)}")
        hint = _hints(cls)[fields[part].name]
        cls = hint if dataclasses.is_dataclass(hint) else None
        if cls is None and depth < len(parts) - 1 and not _allows_mapping(hint):
            path = ".".join(parts[: depth + 1])
            raise UserError(f"override {item!r}: {path!r} is a single value, it has no key {parts[depth + 1]!r}")


def _unknown_key_hint(key: str, fields: Iterable[str], section: str) -> str:
    """The closest valid key of `section` ("" at the top level), or all of them when none is close."""
    fields = list(fields)
    return (
        did_you_mean(key, fields, section + "." if section else "")
        or f"; valid keys{' in ' + repr(section) if section else ''}: {', '.join(fields)}"
    )


# --------------------------------------------------------------------------- validation


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read `path` (or start from defaults when None), apply overrides, validate.

    The file is laid over the defaults and the overrides over the file, so
    `sharding.mesh.data=4` keeps the default `model` axis.
    """
    try:
        given = read_yaml(path) if path is not None else {}
        raw = apply_overrides(_merge(to_dict(Config()), given), overrides)
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
    cfg = _build(Config, raw, "")
    _check_values(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain nested data (open-section options inlined)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "options":
            out.update(_deepcopy(value))
        elif dataclasses.is_dataclass(value):
            out[f.metadata.get("key", f.name)] = to_dict(value)
        else:
            out[f.metadata.get("key", f.name)] = _deepcopy(value)
    return out


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """YAML key -> dataclass field (the `options` catch-all is not a key)."""
    return {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls) if f.name != "options"}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"config key {path or '<top level>'!r} must be a mapping, got {_show(raw)}")
    fields = _fields(cls)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in raw.items():
        key = str(key)
        dotted = f"{path}.{key}" if path else key
        f = fields.get(key)
        if f is None:
            if getattr(cls, "open_section", False):
                options[key] = value
                continue
            raise UserError(f"unknown config key {dotted!r}{_unknown_key_hint(key, fields, path)}")
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, value, dotted)
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
        raise UserError(f"config key {path!r} must be {_describe(hint)}, got {_show(value)}")
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


def _allows_mapping(hint: Any) -> bool:
    if typing.get_origin(hint) is dict:
        return True
    return any(_allows_mapping(a) for a in typing.get_args(hint))


_NAMES = {
    bool: ("a boolean", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
    Any: ("a value", "values"),
}


def _describe(hint: Any, plural: bool = False) -> str:
    """`int` -> "an integer", `list[list[Any]]` -> "a list of lists", `float | None` -> "a number or null"."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a, plural) for a in args)
    if origin in (list, collections.abc.Sequence):
        inner = f" of {_describe(args[0], plural=True)}" if args and args[0] is not Any else ""
        return ("lists" if plural else "a list") + inner
    if origin is dict:
        return "mappings" if plural else "a mapping"
    one, many = _NAMES.get(hint, (getattr(hint, "__name__", str(hint)),) * 2)
    return many if plural else one


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})" if value is not None else "null"


def _check_values(cfg: Config) -> None:
    """Range checks the types cannot express, section by section."""
    if not 0 <= cfg.seed < 2**32:
        raise UserError(f"config key 'seed' must be an integer from 0 to 2**32 - 1, got {cfg.seed}")
    _check_train(cfg.train)
    _check_data(cfg.data)
    _check_sharding(cfg.sharding)
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    best = cfg.checkpoint.keep_best
    if best is not None and (set(best) != {"metric", "mode"} or best["mode"] not in ("min", "max")):
        raise UserError(
            f"config key 'checkpoint.keep_best' must be {{metric: <eval metric>, mode: min or max}} or null, got {best}"
        )
    if cfg.optimizer.weight_decay_mask not in ("all", "kernels"):
        raise UserError(
            "config key 'optimizer.weight_decay_mask' must be all or kernels, "
            f"got {_show(cfg.optimizer.weight_decay_mask)}"
        )
    if cfg.model.input_shape is not None and (not cfg.model.input_shape or min(cfg.model.input_shape) < 1):
        raise UserError(f"config key 'model.input_shape' must be a list of positive sizes, got {cfg.model.input_shape}")


def _positive(path: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise UserError(f"config key {path!r} must be a positive integer, got {_show(value)}")


def _check_train(t: TrainConfig) -> None:
    for key in ("batch_size", "log_every", "eval_every", "grad_accum_steps"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("eval_batch_size", "steps", "epochs", "eval_max_batches"):
        _positive(f"train.{key}", getattr(t, key), allow_none=True)
    if t.steps is None and t.epochs is None:
        raise UserError("config keys 'train.steps' and 'train.epochs' are both null: set one of them")
    if t.batch_size % t.grad_accum_steps:
        raise UserError(
            f"config key 'train.batch_size' ({t.batch_size}) must be divisible by train.grad_accum_steps "
            f"({t.grad_accum_steps}): each optimizer step averages that many equal micro-batches"
        )
    if t.steps_per_dispatch != "auto" and (isinstance(t.steps_per_dispatch, str) or t.steps_per_dispatch < 1):
        raise UserError(
            "config key 'train.steps_per_dispatch' must be auto or a positive integer, "
            f"got {_show(t.steps_per_dispatch)}"
        )
    if t.profile is not None and (len(t.profile) != 2 or t.profile[0] < 0 or t.profile[1] < 1):
        raise UserError(
            f"config key 'train.profile' must be [start_step, num_steps] with num_steps >= 1, or null; got {t.profile}"
        )


def _check_data(d: DataConfig) -> None:
    _positive("data.seq_len", d.seq_len)
    if d.format not in ("text", "chat", "completion"):
        raise UserError(f"config key 'data.format' must be text, chat or completion, got {_show(d.format)}")
    if d.max_len is not None and d.max_len < 2:
        raise UserError(f"config key 'data.max_len' must be at least 2 (a token and its successor), got {d.max_len}")
    if d.workers is not None and d.workers < 0:
        raise UserError(f"config key 'data.workers' must be 0 (no worker processes) or more, or null, got {d.workers}")
    if d.on_device not in ("auto", True, False):
        raise UserError(f"config key 'data.on_device' must be auto, true or false, got {_show(d.on_device)}")
    if d.binarize is not None and not 0.0 <= d.binarize <= 1.0:
        raise UserError(f"config key 'data.binarize' must be a threshold in [0, 1] or null, got {d.binarize}")


def _check_sharding(s: ShardingConfig) -> None:
    for axis, size in s.mesh.items():
        if size != -1 and size < 1:
            raise UserError(
                f"config key 'sharding.mesh.{axis}' must be a positive size or -1 (all remaining devices), got {size}"
            )
    if sum(1 for size in s.mesh.values() if size == -1) > 1:
        raise UserError("config key 'sharding.mesh': at most one axis may be -1")
    for i, rule in enumerate(s.rules or []):
        targets = rule[1] if len(rule) == 2 and isinstance(rule[1], list) else [rule[1]] if len(rule) == 2 else None
        if (
            len(rule) != 2
            or not isinstance(rule[0], str)
            or targets is None
            or not all(a is None or (isinstance(a, str) and a in s.mesh) for a in targets)
        ):
            raise UserError(
                f"config key 'sharding.rules[{i}]' must be [logical_axis, mesh_axis or null] with a mesh axis "
                f"from {sorted(s.mesh)}, got {rule!r}"
            )


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


def _merge(base: Any, top: Any) -> Any:
    """`top` laid over `base`: mappings merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for k, v in top.items():
            out[k] = _merge(base.get(k), v) if k in base else _deepcopy(v)
        return out
    return _deepcopy(top)


def _deepcopy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deepcopy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deepcopy(v) for v in value]
    return value
