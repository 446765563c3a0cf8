"""Each family as llama.cpp runs it, the machinery: :class:`Arch` (a family's names and changes), :class:`HParams`,
:class:`Change`, the query and key rows' :func:`permute`, and the hyper-parameter keys most families write.

Each family's file holds its own :class:`Arch` entries; :mod:`nnx_cli.gguf.families` gathers them in `ARCHES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from nnx_cli.errors import UserError

_LLAMA_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}  # the Llama family's tensors outside the layers, every family's but GPT-2's


class HParams:
    """A `config.json` as llama.cpp's converter reads it: `first(keys)` of several spellings, and the rotary
    settings gathered into `rope` (transformers 5's `rope_parameters`, or the older `rope_theta`/`rope_scaling`)."""

    def __init__(self, config: Mapping[str, Any]):
        self.data = dict(config)
        rope = self.data.get("rope_parameters", self.data.get("rope_scaling")) or {}
        self.rope: dict[str, Any] = dict(rope)
        if "full_attention" not in rope and "sliding_attention" not in rope:
            local = self.first("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                               "rope_local_base_freq")  # fmt: skip
            theta = self.first("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                               "rotary_emb_base")  # fmt: skip
            if local is not None:
                self.rope["sliding_attention"] = {"rope_theta": local}
            if "rope_theta" not in self.rope and theta is not None:
                self.rope["rope_theta"] = theta
            if "rope_type" not in self.rope and self.rope.get("type") is not None:
                self.rope["rope_type"] = self.rope["type"]
            for key in ("partial_rotary_factor", "original_max_position_embeddings"):
                if key not in self.rope and self.data.get(key) is not None:
                    self.rope[key] = self.data[key]

    def first(self, *keys: str) -> Any:
        """The value of the first of `keys` config.json has (None when it has none of them)."""
        return next((self.data[k] for k in keys if k in self.data), None)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def global_rope(self) -> dict[str, Any]:
        return self.rope.get("full_attention", self.rope)


@dataclasses.dataclass(frozen=True)
class Arch:
    """A Hugging Face family as llama.cpp runs it (see :mod:`nnx_cli.gguf.families`)."""

    name: str  # llama.cpp's architecture: "llama", "qwen2", ...
    hparams: Callable[[HParams, Any], None]  # writes the `<name>.*` keys with a gguf.GGUFWriter
    block: Mapping[str, str]  # a layer's tensors: Hugging Face name within the layer -> GGUF name within the block
    globals: Mapping[str, str] = dataclasses.field(default_factory=lambda: _LLAMA_GLOBALS)
    layer_prefix: str = "model.layers."
    experts: Mapping[str, str] = dataclasses.field(default_factory=dict)  # "...experts.{e}..." -> stacked GGUF name
    permute: bool = False  # q and k rows permuted for llama.cpp's Llama rotary (rotate interleaved pairs)
    norm_shift: bool = False  # Gemma: norms computed as 1 + w, which llama.cpp stores
    transpose: tuple[str, ...] = ()  # name suffixes stored [in, out] (GPT-2's Conv1D): transposed to [out, in]
    skip: tuple[str, ...] = ()  # Hugging Face tensors llama.cpp does not use
    check: Callable[[HParams, str], None] | None = None  # refuses what llama.cpp does not run (with config's path)

    def tensor_name(self, name: str) -> tuple[str, int | None] | None:
        """The GGUF name of Hugging Face tensor `name`, and for one expert's tensor its expert index (the GGUF
        tensor stacks them); None for tensors llama.cpp does not use."""
        if name in self.skip:
            return None
        if name in self.globals:
            return self.globals[name], None
        if name.startswith(self.layer_prefix):
            layer, _, rest = name[len(self.layer_prefix) :].partition(".")
            if layer.isdigit():
                if rest in self.block:
                    return f"blk.{layer}.{self.block[rest]}", None
                for pattern, stacked in self.experts.items():
                    head, _, tail = pattern.partition("{e}")
                    index = rest[len(head) : len(rest) - len(tail)]
                    if rest.startswith(head) and rest.endswith(tail) and index.isdigit():
                        return f"blk.{layer}.{stacked}", int(index)
        raise UserError(
            f"tensor {name!r} has no GGUF name in llama.cpp's {self.name} (nnx does not know where it goes)"
        )

    def change(self, name: str, hp: HParams) -> Change:
        """What :meth:`transform` does to Hugging Face tensor `name`: the same for every layer's tensor of a kind,
        so a compiled conversion serves them all."""
        heads = None
        if self.permute and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = hp.first("num_key_value_heads") if ".k_proj." in name else hp.first("num_attention_heads")
        return Change(
            transpose=bool(self.transpose) and name.endswith(self.transpose),
            heads=heads,
            shift=self.norm_shift and name.endswith("norm.weight"),
        )

    def transform(self, name: str, data: np.ndarray, hp: HParams) -> np.ndarray:
        """Hugging Face tensor `name` (float32, or float16 as stored) as llama.cpp stores it."""
        return self.change(name, hp).apply(data)


class Change(NamedTuple):
    """How a Hugging Face tensor becomes llama.cpp's: transposed (GPT-2's Conv1D), rows permuted for `heads`
    heads (Llama's query and key), shifted by one (Gemma's norms). :meth:`apply` works on numpy arrays and on
    traced JAX arrays alike."""

    transpose: bool = False
    heads: int | None = None
    shift: bool = False

    def apply(self, data: Any) -> Any:
        if self.transpose:
            data = data.T
        if self.heads is not None:
            data = permute(data, self.heads)
        if self.shift:
            data = data + data.dtype.type(1)
        return data


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query or key projection reordered from the rotation of halves (transformers' Llama) to the
    rotation of interleaved pairs (llama.cpp's Llama): within each head, rows `[0, d/2, 1, d/2 + 1, ...]`."""
    shape = weights.shape
    return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute`."""
    shape = weights.shape
    return weights.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


# Hyper-parameters
# ------------------------------------------------------------------------------------------------------------------


def _common(hp: HParams, w: Any) -> None:
    """The keys llama.cpp's converter writes for most text models."""
    w.add_block_count(hp.first("n_layers", "num_hidden_layers", "n_layer", "num_layers"))
    context = hp.first("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                       "model_max_length")  # fmt: skip
    if context is not None:
        w.add_context_length(context)
    if (embed := hp.first("hidden_size", "n_embd", "dim")) is not None:
        w.add_embedding_length(embed)
    ff = hp.first("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner",
                  "hidden_dim")  # fmt: skip
    if ff is not None:
        w.add_feed_forward_length(ff)
    if (heads := hp.first("num_attention_heads", "n_head", "n_heads")) is not None:
        w.add_head_count(heads)
    if (kv := hp.first("num_key_value_heads", "n_kv_heads")) is not None:
        w.add_head_count_kv(kv)
    rope = hp.global_rope
    kind = rope.get("rope_type")
    if kind == "linear" and rope.get("factor") is not None:
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if (theta := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (local := hp.rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if (eps := hp.first("rms_norm_eps", "norm_eps")) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := hp.first("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
        w.add_layer_norm_eps(eps)
    if (experts := hp.first("num_local_experts", "num_experts", "n_routed_experts")) is not None:
        w.add_expert_count(experts)
    if (used := hp.first("num_experts_per_tok", "num_experts_per_token", "top_k_experts")) is not None:
        w.add_expert_used_count(used)
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
