"""What every family's file shares: :class:`Config` (checked `config.json` lookups), :class:`TensorMap` and
:class:`Family`, the rotary and sliding-window options several families read, and the layout of a family's tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from nnx_cli.errors import UserError


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one of our parameters is made from one Hugging Face tensor.

    Our parameter (without its `layers` axis) is read as a matrix: its first
    `split` axes fold into rows, the rest into columns. The tensor is read as
    the same matrix, transposed first when `transpose` (PyTorch's `Linear`
    stores `[out, in]`; GPT-2's `Conv1D` already `[in, out]`), a 1-D tensor as
    one row, starting `offset` columns in (GPT-2 fuses q, k and v in one
    tensor). Our matrix may be larger than the tensor's (the padded
    vocabulary): the rest is zeros.

    `name` holds `{i}` for the layer index of a per-layer parameter (of the
    blocks in `layers`, or of every block), and `{e}` for the expert index of
    one of `experts` stacked along our parameter's leading axis (after the
    `layers` axis), each expert a tensor of its own.
    """

    path: str  # ours, relative to a block for per-layer parameters: "attention/query/kernel"
    name: str  # theirs: "model.layers.{i}.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # theirs, as config.json implies
    split: int
    transpose: bool = False
    offset: int = 0
    experts: int = 0  # >0: our parameter stacks this many experts' tensors ("...experts.{e}.w1.weight")
    layers: tuple[int, ...] | None = None  # the blocks that have this parameter (None: every block)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    def names(self, num_layers: int) -> list[str]:
        """Every tensor name this map reads, its layers' and experts' indices filled in."""
        layers = (self.layers if self.layers is not None else range(num_layers)) if self.per_layer else [None]
        experts = range(self.experts) if self.experts else [None]
        return [self.name.format(i=i, e=e) for i in layers for e in experts]


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: its `config.json` keys as options, its tensors as our parameters."""

    architecture: str
    options: Callable[[Config], dict[str, Any]]
    tensors: Callable[[Mapping[str, Any], Collection[str]], list[TensorMap]]
    ignored: tuple[str, ...] = ()  # tensor-name suffixes that are buffers, not weights
    note: str = ""  # what the list of supported families adds after its architecture: "(text)"


class Config:
    """A parsed `config.json` whose lookups name the file and the key when they fail."""

    def __init__(self, data: Mapping[str, Any], path: str):
        self.data, self.path = data, path

    def error(self, key: str, problem: str) -> UserError:
        return UserError(f"{self.path}: key {key!r} {problem}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.error(key, f"must be a positive integer, got {value!r}" if key in self.data else "is missing")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(key, f"must be a number, got {value!r}")
        return float(value)

    def optional_float(self, key: str, default: float | None) -> float | None:
        """A number, or None when config.json says null; `default` (the family's class default) when absent."""
        if key not in self.data:
            return default
        value = self.data[key]
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
            raise self.error(key, f"must be a positive number or null, got {value!r}")
        return None if value is None else float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def refuse(self, key: str, allowed: Callable[[Any], bool], why: str) -> None:
        """`key` must be absent or pass `allowed`; otherwise an option we do not support."""
        if key in self.data and not allowed(self.data[key]):
            raise self.error(key, f"is {self.data[key]!r}: {why} is not supported")


# Rotary settings: old-style `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`
# ------------------------------------------------------------------------------


def _rope(c: Config, default_theta: float = 10000.0) -> dict[str, Any]:
    parameters = c.get("rope_parameters")
    _check_one_rope_setting(c, parameters)
    key = "rope_parameters" if isinstance(parameters, Mapping) else "rope_scaling"
    scaling = parameters if isinstance(parameters, Mapping) else c.get("rope_scaling")
    theta = c.float("rope_theta", default_theta)
    if isinstance(parameters, Mapping) and "rope_theta" in parameters:
        theta = float(parameters["rope_theta"])
    return {"rope_theta": theta, "rope_scaling": _rope_scaling(c, key, scaling)}


def _check_one_rope_setting(c: Config, parameters: Any) -> None:
    """A UserError for `rope_scaling` beside transformers 5's `rope_parameters` (a model card's long-context
    block added to a config that transformers 5 saved): transformers then takes `rope_scaling` over the
    parameters, and reading the parameters alone computed another rotation without a word."""
    if isinstance(parameters, Mapping) and c.get("rope_scaling") is not None:
        raise c.error(
            "rope_scaling",
            "is given beside rope_parameters, which transformers 5 would replace with it: put its rope_type and "
            "factors into rope_parameters (the full_attention entry for Gemma 3) and remove rope_scaling",
        )


def _rope_scaling(c: Config, key: str, scaling: Any) -> dict[str, Any] | None:
    """`model.rope_scaling` of a rotary setting `config.json` gives under `key`: None (the default rotation),
    llama3's or linear's; another `rope_type` is a UserError naming the key."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise c.error(key, f"must be a mapping or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        if not isinstance(scaling.get("factor"), (int, float)):
            raise c.error(key, "of type linear lacks factor")
        return {"type": "linear", "factor": scaling["factor"]}
    if kind != "llama3":
        raise c.error(key, f"has rope type {kind!r}: only the default, llama3 and linear rotary scalings are supported")
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [n for n in names if not isinstance(scaling.get(n), (int, float))]
    if missing:
        raise c.error(key, f"of type llama3 lacks {', '.join(missing)}")
    return {"type": "llama3", **{n: scaling[n] for n in names}}


# Sliding windows: which layers attend within how many positions
# ------------------------------------------------------------------------------

_TYPES = ("full_attention", "sliding_attention")


def _layer_types(c: Config, num_layers: int, default: list[str]) -> list[str]:
    """`layer_types` of config.json, checked (one of each entry's kinds per layer), or `default` when absent."""
    types = c.get("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != num_layers or any(t not in _TYPES for t in types):
        raise c.error(
            "layer_types", f"must list {num_layers} layer kinds, each one of {', '.join(_TYPES)}; got {types!r}"
        )
    return types


def _window(c: Config, default: int | None) -> int | None:
    """`sliding_window`: a positive integer or null; `default` (the family's class default) when absent."""
    if "sliding_window" not in c.data:
        return default
    return None if c.data["sliding_window"] is None else c.int("sliding_window")


def _windows(c: Config, types: list[str], default: int | None) -> dict[str, Any]:
    """The `sliding_window` and `layer_types` options of layers `types` (none when no layer slides: the options of
    a family's checkpoints without windows stay as they were)."""
    if "sliding_attention" not in types:
        return {}
    window = _window(c, default)
    if window is None:
        raise c.error("sliding_window", "is null, but layer_types has sliding_attention layers, whose window it gives")
    return {"sliding_window": window, "layer_types": None if all(t == "sliding_attention" for t in types) else types}


_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # GPT-2's and Gemma's activations


def parameter_count(maps: list[TensorMap], num_layers: int) -> int:
    """Elements of the tensors `maps` read (GPT-2's fused q, k, v counted once)."""
    return sum(math.prod(shape) for shape in layout(maps, num_layers).values())


def layout(maps: list[TensorMap], num_layers: int) -> dict[str, tuple[int, ...]]:
    """`{tensor name: shape}` of the tensors `maps` write, in name order (as `weights.tensors_of` yields them)."""
    shapes = {name: m.shape for m in maps for name in m.names(num_layers)}
    return dict(sorted(shapes.items()))
