"""Model families: a Hugging Face `config.json` as `transformer_lm` options, and its tensors as our parameters.

Llama, Mistral, Qwen2, Qwen3, GPT-2, Gemma 2, Gemma 3 and Phi-3 are one
model with a few switches (spec hf.md, "Architectures"). For each family a table says which
`config.json` keys give which option, and which Hugging Face tensor fills
which of our parameters and how (a :class:`TensorMap`: transposed or not,
how its rows and columns fold into our axes)::

    family = family_of(config, "/models/Qwen2.5-0.5B/config.json")
    options = family.options(config)        # {"num_layers": 24, "num_kv_heads": 2, "qkv_bias": True, ...}
    maps = family.tensors(options, names)    # one TensorMap per parameter of the model

Nothing is read from a model directory but JSON: a `config.json` with
`auto_map` (code of its own) is refused, never run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from nnx_cli.errors import UserError

LLAMA, MISTRAL, QWEN2, QWEN3, GPT2 = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GPT2LMHeadModel",
)
GEMMA2, GEMMA3, PHI3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"
MIXTRAL, QWEN3_MOE, OLMOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"
SUPPORTED = (LLAMA, MISTRAL, QWEN2, QWEN3, GPT2, GEMMA2, GEMMA3, PHI3, MIXTRAL, QWEN3_MOE, OLMOE)
_SUPPORTED_TEXT = "LlamaForCausalLM (Llama 2/3/3.x, SmolLM, TinyLlama), MistralForCausalLM, Qwen2ForCausalLM, "
_SUPPORTED_TEXT += "Qwen3ForCausalLM, GPT2LMHeadModel, Gemma2ForCausalLM, Gemma3ForCausalLM (text), Phi3ForCausalLM, "
_SUPPORTED_TEXT += "MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM"
SHAPE_OPTIONS = (
    "num_layers", "num_heads", "num_kv_heads", "head_dim", "embed_dim", "mlp_dim", "vocab_size", "max_positions",
    "mlp", "qkv_bias", "qk_norm", "bias", "norm", "norm_eps", "positions", "rope_theta", "rope_scaling",
    "tie_embeddings",
    # Gemma, Phi-3 and sliding windows
    "sliding_window", "layer_types", "rope_local_theta", "rotary_dim", "query_scale", "attention_softcap",
    "logit_softcap", "post_norms", "scale_embeddings",
    # mixtures of experts
    "moe", "qk_norm_scope",
)  # fmt: skip
"""The options a model directory's `config.json` decides; a YAML may repeat them but not change them."""


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


def family_of(data: Mapping[str, Any], path: str) -> Family:
    """The family `config.json` names in `architectures[0]`; an unknown one or remote code is a UserError."""
    config = Config(data, path)
    if "auto_map" in data:
        raise config.error(
            "auto_map",
            "asks to run the model directory's own code (trust_remote_code), which nnx never does; "
            f"supported families: {_SUPPORTED_TEXT}",
        )
    architectures = data.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise config.error("architectures", f"is missing or empty; supported families: {_SUPPORTED_TEXT}")
    if architectures[0] not in FAMILIES:
        raise config.error(
            "architectures", f"names {architectures[0]!r}, which is not supported; supported: {_SUPPORTED_TEXT}"
        )
    return FAMILIES[architectures[0]]


def options_of(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The `transformer_lm` options of a parsed `config.json` (`path` names it in errors)."""
    return family_of(data, path).options(Config(data, path))


# Rotary settings: old-style `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`
# ------------------------------------------------------------------------------


def _rope(c: Config, default_theta: float = 10000.0) -> dict[str, Any]:
    parameters = c.get("rope_parameters")
    key = "rope_parameters" if isinstance(parameters, Mapping) else "rope_scaling"
    scaling = parameters if isinstance(parameters, Mapping) else c.get("rope_scaling")
    theta = c.float("rope_theta", default_theta)
    if isinstance(parameters, Mapping) and "rope_theta" in parameters:
        theta = float(parameters["rope_theta"])
    return {"rope_theta": theta, "rope_scaling": _rope_scaling(c, key, scaling)}


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


def _llama_windows(c: Config, architecture: str, num_layers: int) -> dict[str, Any]:
    """Mistral and Mixtral slide every layer by `sliding_window` when it is set (Mistral's default 4096, Mixtral's
    none); Qwen3-MoE every layer with `use_sliding_window`; Qwen2 and Qwen3 with `use_sliding_window` the layers
    `layer_types` names (by default those from `max_window_layers` on), as transformers reads them."""
    if architecture == MISTRAL:  # transformers' MistralConfig slides by 4096 unless config.json says null
        kind = "sliding_attention" if _window(c, 4096) is not None else "full_attention"
        return _windows(c, [kind] * num_layers, 4096)
    if architecture == MIXTRAL:  # MixtralConfig slides every layer only when config.json sets the window
        kind = "sliding_attention" if _window(c, None) is not None else "full_attention"
        return _windows(c, [kind] * num_layers, None)
    if architecture == QWEN3_MOE:  # Qwen3MoeConfig slides every layer by sliding_window with use_sliding_window
        on = c.bool("use_sliding_window", False) and _window(c, 4096) is not None
        return _windows(c, ["sliding_attention" if on else "full_attention"] * num_layers, 4096)
    if architecture in (QWEN2, QWEN3):
        if not c.bool("use_sliding_window", False):
            types = _layer_types(c, num_layers, ["full_attention"] * num_layers)
            if "sliding_attention" in types:
                raise c.error("layer_types", "has sliding_attention layers while use_sliding_window is false")
            return {}
        first = c.int("max_window_layers", 28) if c.get("max_window_layers") != 0 else 0
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return _windows(c, _layer_types(c, num_layers, default), 4096)
    return {}


# The Llama family: Llama, Mistral, Qwen2, Qwen3
# ------------------------------------------------------------------------------


def _llama_options(architecture: str) -> Callable[[Config], dict[str, Any]]:
    def options(c: Config) -> dict[str, Any]:
        c.refuse("hidden_act", lambda v: v == "silu", "an activation other than silu")
        c.refuse("mlp_bias", lambda v: not v, "a bias on the MLP projections")
        if architecture != QWEN2:
            c.refuse("attention_bias", lambda v: not v, "a bias on the attention projections")
        heads, embed = c.int("num_attention_heads"), c.int("hidden_size")
        layers = c.int("num_hidden_layers")
        return {
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": c.int("num_key_value_heads", heads),
            "head_dim": c.int("head_dim", embed // heads),
            "embed_dim": embed,
            "mlp_dim": c.int("intermediate_size"),
            "vocab_size": c.int("vocab_size"),
            "mlp": "swiglu",
            "qkv_bias": architecture == QWEN2,
            "qk_norm": architecture in (QWEN3, QWEN3_MOE),
            "bias": False,
            "norm": "rmsnorm",
            "norm_eps": c.float("rms_norm_eps", 1e-6),
            "positions": "rope",
            **_rope(c),
            "tie_embeddings": c.bool("tie_word_embeddings", False),
            **_llama_windows(c, architecture, layers),
        }

    return options


def _llama_tensors(o: Mapping[str, Any], names: Collection[str]) -> list[TensorMap]:
    embed, vocab, mlp = o["embed_dim"], o["vocab_size"], o["mlp_dim"]
    q, kv = o["num_heads"] * o["head_dim"], o["num_kv_heads"] * o["head_dim"]
    layer = "model.layers.{i}."
    maps = [
        TensorMap("embedding/embedding", "model.embed_tokens.weight", (vocab, embed), split=1),
        TensorMap("final_norm/scale", "model.norm.weight", (embed,), split=0),
        TensorMap("attention_norm/scale", layer + "input_layernorm.weight", (embed,), split=0),
        TensorMap("mlp_norm/scale", layer + "post_attention_layernorm.weight", (embed,), split=0),
        TensorMap("attention/query/kernel", layer + "self_attn.q_proj.weight", (q, embed), split=1, transpose=True),
        TensorMap("attention/key/kernel", layer + "self_attn.k_proj.weight", (kv, embed), split=1, transpose=True),
        TensorMap("attention/value/kernel", layer + "self_attn.v_proj.weight", (kv, embed), split=1, transpose=True),
        TensorMap("attention/out/kernel", layer + "self_attn.o_proj.weight", (embed, q), split=2, transpose=True),
        TensorMap("mlp/gate/kernel", layer + "mlp.gate_proj.weight", (mlp, embed), split=1, transpose=True),
        TensorMap("mlp/fc/kernel", layer + "mlp.up_proj.weight", (mlp, embed), split=1, transpose=True),
        TensorMap("mlp/proj/kernel", layer + "mlp.down_proj.weight", (embed, mlp), split=1, transpose=True),
    ]
    if o["qkv_bias"]:
        maps += [
            TensorMap("attention/query/bias", layer + "self_attn.q_proj.bias", (q,), split=0),
            TensorMap("attention/key/bias", layer + "self_attn.k_proj.bias", (kv,), split=0),
            TensorMap("attention/value/bias", layer + "self_attn.v_proj.bias", (kv,), split=0),
        ]
    if o["qk_norm"]:
        maps += [
            TensorMap("attention/query_norm/scale", layer + "self_attn.q_norm.weight", (o["head_dim"],), split=0),
            TensorMap("attention/key_norm/scale", layer + "self_attn.k_norm.weight", (o["head_dim"],), split=0),
        ]
    if not o["tie_embeddings"]:
        maps.append(TensorMap("head/kernel", "lm_head.weight", (vocab, embed), split=1, transpose=True))
    return maps


# GPT-2
# ------------------------------------------------------------------------------

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def _gpt2_options(c: Config) -> dict[str, Any]:
    c.refuse("activation_function", lambda v: v in _TANH_GELUS, "an activation other than the tanh GELU")
    c.refuse("scale_attn_by_inverse_layer_idx", lambda v: not v, "attention scaled by the inverse layer index")
    c.refuse("scale_attn_weights", lambda v: v, "unscaled attention")
    embed = c.int("n_embd")
    return {
        "num_layers": c.int("n_layer"),
        "num_heads": c.int("n_head"),
        "num_kv_heads": None,
        "head_dim": None,
        "embed_dim": embed,
        "mlp_dim": c.int("n_inner", 4 * embed),
        "vocab_size": c.int("vocab_size"),
        "max_positions": c.int("n_positions"),
        "mlp": "gelu",
        "qkv_bias": False,
        "qk_norm": False,
        "bias": True,
        "norm": "layernorm",
        "norm_eps": c.float("layer_norm_epsilon", 1e-5),
        "positions": "learned",
        "tie_embeddings": c.bool("tie_word_embeddings", True),
    }


def _gpt2_tensors(o: Mapping[str, Any], names: Collection[str]) -> list[TensorMap]:
    embed, vocab, mlp = o["embed_dim"], o["vocab_size"], o["mlp_dim"]
    # transformers saves GPT2LMHeadModel's body under "transformer."; the original Hub files have no prefix
    top = "transformer." if any(n.startswith("transformer.") for n in names) else ""
    layer = top + "h.{i}."
    maps = [
        TensorMap("embedding/embedding", top + "wte.weight", (vocab, embed), split=1),
        TensorMap("position_embedding/embedding", top + "wpe.weight", (o["max_positions"], embed), split=1),
        TensorMap("final_norm/scale", top + "ln_f.weight", (embed,), split=0),
        TensorMap("final_norm/bias", top + "ln_f.bias", (embed,), split=0),
    ]
    for ours, theirs in (("attention_norm", "ln_1"), ("mlp_norm", "ln_2")):
        maps += [
            TensorMap(f"{ours}/scale", f"{layer}{theirs}.weight", (embed,), split=0),
            TensorMap(f"{ours}/bias", f"{layer}{theirs}.bias", (embed,), split=0),
        ]
    for i, ours in enumerate(("query", "key", "value")):  # c_attn is [q | k | v] along its output columns
        maps += [
            TensorMap(
                f"attention/{ours}/kernel", layer + "attn.c_attn.weight", (embed, 3 * embed), 1, False, i * embed
            ),
            TensorMap(f"attention/{ours}/bias", layer + "attn.c_attn.bias", (3 * embed,), 0, False, i * embed),
        ]
    maps += [
        TensorMap("attention/out/kernel", layer + "attn.c_proj.weight", (embed, embed), split=2),
        TensorMap("attention/out/bias", layer + "attn.c_proj.bias", (embed,), split=0),
        TensorMap("mlp/fc/kernel", layer + "mlp.c_fc.weight", (embed, mlp), split=1),
        TensorMap("mlp/fc/bias", layer + "mlp.c_fc.bias", (mlp,), split=0),
        TensorMap("mlp/proj/kernel", layer + "mlp.c_proj.weight", (mlp, embed), split=1),
        TensorMap("mlp/proj/bias", layer + "mlp.c_proj.bias", (embed,), split=0),
    ]
    if not o["tie_embeddings"]:
        maps.append(TensorMap("head/kernel", "lm_head.weight", (vocab, embed), split=1, transpose=True))
    return maps


# Gemma 2 and Gemma 3 (text)
# ------------------------------------------------------------------------------
# Llama's layout with Gemma's switches: embeddings scaled by sqrt(hidden), RMSNorms of (1 + w), norms after
# attention and MLP too, a GeGLU MLP, attention logits scaled by query_pre_attn_scalar ** -0.5, sliding layers
# by layer_types; Gemma 2 soft-caps attention and final logits, Gemma 3 has q/k norms and a rotary base of its
# own for sliding layers. Defaults are those of transformers' config classes, for keys config.json leaves out.


def _gemma_options(architecture: str) -> Callable[[Config], dict[str, Any]]:
    gemma3 = architecture == GEMMA3

    def options(c: Config) -> dict[str, Any]:
        c.refuse("hidden_activation", lambda v: v in _TANH_GELUS, "an activation other than the tanh GELU")
        c.refuse("attention_bias", lambda v: not v, "a bias on the attention projections")
        c.refuse("use_bidirectional_attention", lambda v: not v, "bidirectional attention")
        layers = c.int("num_hidden_layers")
        period = c.int("sliding_window_pattern", 6) if gemma3 else 2  # the layer kinds' default pattern
        default = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
        rope = _gemma3_rope(c) if gemma3 else _rope(c)
        return {
            "num_layers": layers,
            "num_heads": c.int("num_attention_heads"),
            "num_kv_heads": c.int("num_key_value_heads", 4),
            "head_dim": c.int("head_dim", 256),
            "embed_dim": c.int("hidden_size"),
            "mlp_dim": c.int("intermediate_size"),
            "vocab_size": c.int("vocab_size"),
            "mlp": "geglu",
            "qkv_bias": False,
            "qk_norm": gemma3,
            "bias": False,
            "norm": "gemma_rmsnorm",
            "norm_eps": c.float("rms_norm_eps", 1e-6),
            "positions": "rope",
            **rope,
            "tie_embeddings": c.bool("tie_word_embeddings", True),
            **_windows(c, _layer_types(c, layers, default), 4096),
            "query_scale": c.float("query_pre_attn_scalar", 256.0),
            # transformers' Gemma 3 reads attn_logit_softcapping but never applies it
            "attention_softcap": None if gemma3 else c.optional_float("attn_logit_softcapping", 50.0),
            "logit_softcap": c.optional_float("final_logit_softcapping", None if gemma3 else 30.0),
            "post_norms": True,
            "scale_embeddings": True,
        }

    return options


def _gemma3_rope(c: Config) -> dict[str, Any]:
    """Gemma 3's two rotary settings: full layers at `rope_theta` (1e6) with `rope_scaling`, sliding layers at
    `rope_local_base_freq` (1e4) unscaled; or the same per layer kind in transformers 5's `rope_parameters`."""
    parameters = c.get("rope_parameters")
    if isinstance(parameters, Mapping) and set(parameters) & set(_TYPES):
        full, local = parameters.get("full_attention") or {}, parameters.get("sliding_attention") or {}
        if _rope_scaling(c, "rope_parameters", local) is not None:
            raise c.error("rope_parameters", "scales the rotation of sliding_attention layers, which is not supported")
        return {
            "rope_theta": float(full.get("rope_theta", c.float("rope_theta", 1e6))),
            "rope_scaling": _rope_scaling(c, "rope_parameters", full),
            "rope_local_theta": float(local.get("rope_theta", c.float("rope_local_base_freq", 1e4))),
        }
    return {**_rope(c, default_theta=1e6), "rope_local_theta": c.float("rope_local_base_freq", 1e4)}


def _gemma_tensors(o: Mapping[str, Any], names: Collection[str]) -> list[TensorMap]:
    """Llama's tensors, with the norm after attention and the MLP's norms before and after it."""
    embed, layer = o["embed_dim"], "model.layers.{i}."
    maps = [m for m in _llama_tensors(o, names) if m.path != "mlp_norm/scale"]
    for ours, theirs in (("post_attention_norm", "post_attention_layernorm"), ("mlp_norm", "pre_feedforward_layernorm"),
                         ("post_mlp_norm", "post_feedforward_layernorm")):  # fmt: skip
        maps.append(TensorMap(f"{ours}/scale", f"{layer}{theirs}.weight", (embed,), split=0))
    return maps


# Phi-3
# ------------------------------------------------------------------------------
# Llama with q, k and v fused in one qkv_proj and gate and up in one gate_up_proj (split on the way in, fused
# on the way out: each of our kernels is a block of columns of theirs), a rotation of the first
# partial_rotary_factor of each head, and a sliding window on every layer when sliding_window is set.


def _phi3_options(c: Config) -> dict[str, Any]:
    c.refuse("hidden_act", lambda v: v == "silu", "an activation other than silu")
    heads, embed, layers = c.int("num_attention_heads"), c.int("hidden_size"), c.int("num_hidden_layers")
    head_dim = c.int("head_dim", embed // heads)
    parameters = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), Mapping) else {}
    factor = parameters.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise c.error("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    rotary = int(head_dim * factor)
    if rotary % 2:
        raise c.error("partial_rotary_factor", f"rotates {rotary} features of each head, an odd number")
    window = "sliding_attention" if _window(c, None) is not None else "full_attention"
    return {
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": c.int("num_key_value_heads", heads),
        "head_dim": head_dim,
        "embed_dim": embed,
        "mlp_dim": c.int("intermediate_size"),
        "vocab_size": c.int("vocab_size"),
        "mlp": "swiglu",
        "qkv_bias": False,
        "qk_norm": False,
        "bias": False,
        "norm": "rmsnorm",
        "norm_eps": c.float("rms_norm_eps", 1e-5),
        "positions": "rope",
        **_rope(c),
        "tie_embeddings": c.bool("tie_word_embeddings", False),
        **_windows(c, [window] * layers, None),
        **({"rotary_dim": rotary} if rotary != head_dim else {}),
    }


def _phi3_tensors(o: Mapping[str, Any], names: Collection[str]) -> list[TensorMap]:
    embed, vocab, mlp = o["embed_dim"], o["vocab_size"], o["mlp_dim"]
    q, kv = o["num_heads"] * o["head_dim"], o["num_kv_heads"] * o["head_dim"]
    layer = "model.layers.{i}."
    qkv, gate_up = (layer + "self_attn.qkv_proj.weight", (q + 2 * kv, embed)), (layer + "mlp.gate_up_proj.weight",
                                                                              (2 * mlp, embed))  # fmt: skip
    maps = [
        TensorMap("embedding/embedding", "model.embed_tokens.weight", (vocab, embed), split=1),
        TensorMap("final_norm/scale", "model.norm.weight", (embed,), split=0),
        TensorMap("attention_norm/scale", layer + "input_layernorm.weight", (embed,), split=0),
        TensorMap("mlp_norm/scale", layer + "post_attention_layernorm.weight", (embed,), split=0),
        TensorMap("attention/query/kernel", *qkv, split=1, transpose=True, offset=0),
        TensorMap("attention/key/kernel", *qkv, split=1, transpose=True, offset=q),
        TensorMap("attention/value/kernel", *qkv, split=1, transpose=True, offset=q + kv),
        TensorMap("attention/out/kernel", layer + "self_attn.o_proj.weight", (embed, q), split=2, transpose=True),
        TensorMap("mlp/gate/kernel", *gate_up, split=1, transpose=True, offset=0),
        TensorMap("mlp/fc/kernel", *gate_up, split=1, transpose=True, offset=mlp),
        TensorMap("mlp/proj/kernel", layer + "mlp.down_proj.weight", (embed, mlp), split=1, transpose=True),
    ]
    if not o["tie_embeddings"]:
        maps.append(TensorMap("head/kernel", "lm_head.weight", (vocab, embed), split=1, transpose=True))
    return maps


# Mixtures of experts: Mixtral, Qwen3-MoE
# ------------------------------------------------------------------------------


def _mixtral_options(c: Config) -> dict[str, Any]:
    """Mistral's attention (every layer sliding by `sliding_window` when it is set), a mixture of
    `num_local_experts` in every layer, the top-k weights always renormalised."""
    c.refuse("router_jitter_noise", lambda v: not v, "router jitter noise")
    options = _llama_options(MIXTRAL)(c)
    experts = c.int("num_local_experts")
    options["moe"] = {"num_experts": experts, "top_k": _top_k(c, experts), "mlp_dim": c.int("intermediate_size"),
                      "normalize": True, "dense_layers": []}  # fmt: skip
    options["router_aux_loss_coef"] = c.float("router_aux_loss_coef", 0.001)
    return options


def _qwen3_moe_options(c: Config) -> dict[str, Any]:
    """Qwen3's attention (every layer sliding by `sliding_window` with `use_sliding_window`); experts
    `moe_intermediate_size` wide in the layers `decoder_sparse_step` picks (`i + 1` a multiple of it) outside
    `mlp_only_layers`, which keep a dense MLP `intermediate_size` wide."""
    options = _llama_options(QWEN3_MOE)(c)
    key = "num_experts" if "num_experts" in c.data else "num_local_experts"  # transformers 5 saves the second
    experts = c.int(key)
    layers, step = options["num_layers"], c.int("decoder_sparse_step", 1)
    only = c.get("mlp_only_layers", [])
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise c.error("mlp_only_layers", f"must be a list of layer indices, got {only!r}")
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    options["moe"] = {"num_experts": experts, "top_k": _top_k(c, experts), "mlp_dim": c.int("moe_intermediate_size"),
                      "normalize": c.bool("norm_topk_prob", False), "dense_layers": dense}  # fmt: skip
    options["router_aux_loss_coef"] = c.float("router_aux_loss_coef", 0.001)
    return options


def _olmoe_options(c: Config) -> dict[str, Any]:
    """Llama's attention with one RMSNorm over all query heads and one over all key heads (`clip_qkv` refused),
    `num_experts` experts `intermediate_size` wide in every layer."""
    c.refuse("clip_qkv", lambda v: v is None, "clipping q, k and v (clip_qkv)")
    options = _llama_options(OLMOE)(c)
    experts = c.int("num_experts") if "num_experts" in c.data else c.int("num_local_experts")
    options.update(qk_norm=True, qk_norm_scope="projection")
    options["moe"] = {"num_experts": experts, "top_k": _top_k(c, experts), "mlp_dim": c.int("intermediate_size"),
                      "normalize": c.bool("norm_topk_prob", False), "dense_layers": []}  # fmt: skip
    options["router_aux_loss_coef"] = c.float("router_aux_loss_coef", 0.01)
    return options


def _top_k(c: Config, experts: int) -> int:
    top_k = c.int("num_experts_per_tok")
    if top_k > experts:
        raise c.error("num_experts_per_tok", f"is {top_k}, more than the {experts} experts")
    return top_k


_QK_NORMS = ("attention/query_norm/scale", "attention/key_norm/scale")
_EXPERT_NAMES = {  # our expert projection: (Mixtral's, Qwen3-MoE's) tensor within an expert
    "gate": ("w1", "gate_proj"),
    "fc": ("w3", "up_proj"),
    "proj": ("w2", "down_proj"),
}


def _moe_tensors(architecture: str) -> Callable[[Mapping[str, Any], Collection[str]], list[TensorMap]]:
    """The Llama family's tensors, with `block_sparse_moe.` (Mixtral) or `mlp.` (Qwen3-MoE) holding the router
    `gate` and the experts `experts.{e}.<w1|gate_proj ...>` of the expert layers, each expert's tensors stacked
    into ours; dense layers keep their `mlp.` tensors."""

    def tensors(o: Mapping[str, Any], names: Collection[str]) -> list[TensorMap]:
        moe, layers, embed = o["moe"], o["num_layers"], o["embed_dim"]
        experts, hidden = moe["num_experts"], moe.get("mlp_dim") or o["mlp_dim"]
        dense = tuple(moe.get("dense_layers") or ())
        sparse = tuple(i for i in range(layers) if i not in dense)
        maps = []
        for m in _llama_tensors(o, names):
            if m.path in _QK_NORMS and o.get("qk_norm_scope") == "projection":  # OLMoE's: [heads * head_dim]
                heads = o["num_heads"] if m.path.startswith("attention/query") else o["num_kv_heads"]
                maps.append(dataclasses.replace(m, shape=(heads * o["head_dim"],)))
            elif not m.path.startswith("mlp/"):
                maps.append(m)
            elif dense:
                maps.append(dataclasses.replace(m, layers=dense))
        prefix = "model.layers.{i}." + ("block_sparse_moe." if architecture == MIXTRAL else "mlp.")
        which = 0 if architecture == MIXTRAL else 1
        maps.append(TensorMap("moe/router/kernel", prefix + "gate.weight", (experts, embed), split=1, transpose=True,
                              layers=sparse))  # fmt: skip
        for ours, theirs in _EXPERT_NAMES.items():
            shape = (embed, hidden) if ours == "proj" else (hidden, embed)
            name = f"{prefix}experts.{{e}}.{theirs[which]}.weight"
            maps.append(TensorMap(f"moe/{ours}/kernel", name, shape, split=1, transpose=True, experts=experts,
                                  layers=sparse))  # fmt: skip
        return maps

    return tensors


FAMILIES = {
    **{
        name: Family(name, _llama_options(name), _llama_tensors, ignored=("rotary_emb.inv_freq",))
        for name in (LLAMA, MISTRAL, QWEN2, QWEN3)
    },
    GPT2: Family(GPT2, _gpt2_options, _gpt2_tensors, ignored=(".attn.bias", ".attn.masked_bias")),
    GEMMA2: Family(GEMMA2, _gemma_options(GEMMA2), _gemma_tensors),
    GEMMA3: Family(GEMMA3, _gemma_options(GEMMA3), _gemma_tensors),
    PHI3: Family(PHI3, _phi3_options, _phi3_tensors, ignored=("rotary_emb.inv_freq",)),
    MIXTRAL: Family(MIXTRAL, _mixtral_options, _moe_tensors(MIXTRAL), ignored=("rotary_emb.inv_freq",)),
    QWEN3_MOE: Family(QWEN3_MOE, _qwen3_moe_options, _moe_tensors(QWEN3_MOE), ignored=("rotary_emb.inv_freq",)),
    OLMOE: Family(OLMOE, _olmoe_options, _moe_tensors(OLMOE), ignored=("rotary_emb.inv_freq",)),
}


def parameter_count(maps: list[TensorMap], num_layers: int) -> int:
    """Elements of the tensors `maps` read (GPT-2's fused q, k, v counted once)."""
    return sum(math.prod(shape) for shape in layout(maps, num_layers).values())


def layout(maps: list[TensorMap], num_layers: int) -> dict[str, tuple[int, ...]]:
    """`{tensor name: shape}` of the tensors `maps` write, in name order (as `weights.tensors_of` yields them)."""
    shapes = {name: m.shape for m in maps for name in m.names(num_layers)}
    return dict(sorted(shapes.items()))


# Out again: options as a family's config.json, adapters as PEFT tensors
# ------------------------------------------------------------------------------

_LLAMA_SHAPE = {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
_GPT2_SHAPE = {"positions": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
_UNWRITTEN = {"rope_local_theta": None, "rotary_dim": None, "query_scale": None, "attention_softcap": None,
              "logit_softcap": None, "post_norms": False, "scale_embeddings": False}  # fmt: skip
"""Options a run from scratch exports with at these values only: Gemma's and Phi-3's (their runs from a checkpoint
export as the family they came from)."""


def run_architecture(options: Mapping[str, Any], pretrained: Any) -> str:
    """The family a run exports as: the one its `model.pretrained` is, else the one its options describe."""
    return pretrained.family.architecture if pretrained is not None else architecture_of(options)


PEFT_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}  # fmt: skip
"""Our projections' module names in the Llama family, as PEFT names its adapters' targets."""


def architecture_of(options: Mapping[str, Any]) -> str:
    """The family whose architecture `options` (a `transformer_lm`'s, resolved) describe; options no family has
    are a UserError naming them."""

    def differ(shape: Mapping[str, Any]) -> list[str]:
        return [f"{k}: {options.get(k)!r} (the family's is {v!r})" for k, v in shape.items() if options.get(k) != v]

    llama, gpt2 = differ(_LLAMA_SHAPE), differ(_GPT2_SHAPE)
    unwritten = [f"{k}: {options.get(k)!r}" for k, v in _UNWRITTEN.items() if options.get(k, v) != v]
    if options.get("moe"):
        return _moe_architecture(options, llama, unwritten)
    if not llama:
        if options.get("qkv_bias") and options.get("qk_norm"):
            raise UserError("model.qkv_bias and model.qk_norm together are in no Hugging Face family (Qwen2 has the "
                            "first, Qwen3 the second): it cannot be exported")  # fmt: skip
        if unwritten:
            raise UserError(f"options no family nnx-export writes from scratch has: {'; '.join(unwritten)} (runs "
                            "from a Gemma or Phi-3 checkpoint export as their family)")  # fmt: skip
        qwen = QWEN2 if options.get("qkv_bias") else QWEN3 if options.get("qk_norm") else None
        if options.get("sliding_window") is not None and qwen is None:
            if options.get("layer_types") is not None:
                raise UserError(f"model.layer_types {options['layer_types']!r}: sliding and full layers together are "
                                "in no Llama-shaped family without q/k/v biases or q/k norms (Mistral slides every "
                                "layer)")  # fmt: skip
            return MISTRAL
        return qwen or LLAMA
    if not gpt2:
        extra = [f"{k}: {options.get(k)!r}" for k in ("qkv_bias", "qk_norm") if options.get(k)]
        extra += [f"sliding_window: {options['sliding_window']!r}"] if options.get("sliding_window") else []
        extra += unwritten
        if options.get("num_kv_heads") not in (None, options.get("num_heads")):
            extra.append(f"num_kv_heads: {options['num_kv_heads']} (GPT-2 has one key-value head per query head)")
        if options.get("head_dim") not in (None, options["embed_dim"] // options["num_heads"]):
            extra.append(f"head_dim: {options['head_dim']} (GPT-2's is embed_dim / num_heads)")
        if not extra:
            return GPT2
        raise UserError(f"options no Hugging Face family has: {'; '.join(extra)}; GPT2LMHeadModel is the closest")
    closest, name = (llama, "the Llama family (rope, rmsnorm, swiglu, bias false)") if len(llama) <= len(gpt2) else (
        gpt2, "GPT-2 (learned positions, layernorm, gelu, bias true)")  # fmt: skip
    raise UserError(f"options no Hugging Face family has: {'; '.join(closest)}; the closest is {name}")


def config_json(options: Mapping[str, Any], *, vocab_size: int, context: int, bos: int | None, eos: int | None,
                dtype: str) -> dict[str, Any]:  # fmt: skip
    """A `config.json` for a model trained from scratch with `options` (see :func:`architecture_of`)."""
    architecture = architecture_of(options)
    heads, embed = options["num_heads"], options["embed_dim"]
    mlp = options.get("mlp_dim") or 4 * embed
    ids = {"bos_token_id": bos, "eos_token_id": eos}
    if architecture == GPT2:
        return {
            "architectures": [GPT2], "model_type": "gpt2", "n_embd": embed, "n_layer": options["num_layers"],
            "n_head": heads, "n_inner": mlp, "n_positions": options.get("max_positions") or context,
            "n_ctx": options.get("max_positions") or context, "vocab_size": vocab_size,
            "layer_norm_epsilon": options.get("norm_eps", 1e-5), "activation_function": "gelu_new",
            "tie_word_embeddings": options.get("tie_embeddings", True), "scale_attn_weights": True, **ids,
            "dtype": dtype,
        }  # fmt: skip
    scaling = options.get("rope_scaling")
    rope = {"rope_theta": float(options.get("rope_theta", 10000.0))}
    rope["rope_scaling"] = None if scaling is None else {
        "rope_type": scaling.get("type", "llama3"), **{k: v for k, v in scaling.items() if k != "type"}
    }  # fmt: skip
    model_type = {LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3", MIXTRAL: "mixtral",
                  QWEN3_MOE: "qwen3_moe", OLMOE: "olmoe"}[architecture]  # fmt: skip
    config = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": embed, "intermediate_size": mlp,
        "num_hidden_layers": options["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": options.get("num_kv_heads") or heads,
        "head_dim": options.get("head_dim") or embed // heads, "vocab_size": vocab_size,
        "max_position_embeddings": context, "rms_norm_eps": options.get("norm_eps", 1e-5), **rope,
        "tie_word_embeddings": options.get("tie_embeddings", True), "hidden_act": "silu", **ids, "dtype": dtype,
    }  # fmt: skip
    window = options.get("sliding_window")
    if architecture == LLAMA:
        config.update({"attention_bias": False, "mlp_bias": False})
    elif architecture == MISTRAL:
        config["sliding_window"] = window
    elif architecture in (MIXTRAL, QWEN3_MOE, OLMOE):
        config.update(_moe_config(options, architecture))
    elif window is None:
        config.update({"use_sliding_window": False, "sliding_window": None})
    else:  # Qwen's sliding layers: those layer_types names (all when null)
        types = options.get("layer_types") or ["sliding_attention"] * options["num_layers"]
        first = types.index("sliding_attention")
        config.update({"use_sliding_window": True, "sliding_window": window, "max_window_layers": first,
                       "layer_types": list(types)})  # fmt: skip
    if architecture == QWEN3:
        config["attention_bias"] = False
    return config


def _moe_architecture(options: Mapping[str, Any], llama: list[str], unwritten: list[str]) -> str:
    """Qwen3-MoE with q/k norms of each head (any top-k weighting, dense layers), OLMoE with q/k norms of each
    projection (experts in every layer), else Mixtral (renormalised top-k, no dense layers); experts need the
    Llama family's shape, and a window slides every layer (OLMoE has none)."""
    moe = options["moe"]
    if llama:
        raise UserError(f"options no Hugging Face family has: {'; '.join(llama)}; mixtures of experts are of the "
                        "Llama family (rope, rmsnorm, swiglu, bias false)")  # fmt: skip
    if unwritten:
        raise UserError(f"options no mixture of experts nnx-export writes from scratch has: {'; '.join(unwritten)}")
    if options.get("sliding_window") is not None and options.get("layer_types") is not None:
        raise UserError(f"model.layer_types {options['layer_types']!r}: sliding and full layers together are in no "
                        "mixture of experts' family (Mixtral and Qwen3-MoE slide every layer)")  # fmt: skip
    if options.get("qkv_bias"):
        raise UserError("model.qkv_bias with model.moe is in no Hugging Face family (Mixtral and Qwen3-MoE have no "
                        "q/k/v biases): it cannot be exported")  # fmt: skip
    if options.get("qk_norm") and options.get("qk_norm_scope", "head") == "projection":
        if moe.get("dense_layers"):
            raise UserError("model.moe.dense_layers with model.qk_norm_scope projection is in no Hugging Face family "
                            "(OLMoE has experts in every layer): it cannot be exported")  # fmt: skip
        if options.get("sliding_window") is not None:
            raise UserError(f"model.sliding_window {options['sliding_window']} with model.qk_norm_scope projection "
                            "is in no Hugging Face family (OLMoE has no window): it cannot be exported")  # fmt: skip
        if options.get("head_dim") not in (None, options["embed_dim"] // options["num_heads"]):
            raise UserError(f"model.head_dim {options['head_dim']} with model.qk_norm_scope projection is in no "
                            "Hugging Face family (OLMoE's heads are embed_dim / num_heads): it cannot be "
                            "exported")  # fmt: skip
        return OLMOE
    if options.get("qk_norm"):
        return QWEN3_MOE
    if not moe.get("normalize", True) or moe.get("dense_layers"):
        raise UserError("model.moe with normalize false or dense_layers, without model.qk_norm, is in no Hugging "
                        "Face family (Mixtral renormalises the top-k weights and has experts in every layer; "
                        "Qwen3-MoE has q/k norms): it cannot be exported")  # fmt: skip
    return MIXTRAL


def _moe_config(options: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The `config.json` keys of the experts (see :func:`config_json`)."""
    moe = options["moe"]
    width = moe.get("mlp_dim") or options.get("mlp_dim") or 4 * options["embed_dim"]
    window = options.get("sliding_window")  # on every layer (architecture_of saw to it)
    common = {"num_experts_per_tok": moe["top_k"], "router_aux_loss_coef": options.get("router_aux_loss_coef", 0.001),
              "sliding_window": window}  # fmt: skip
    if architecture == MIXTRAL:
        return {**common, "num_local_experts": moe["num_experts"], "intermediate_size": width,
                "router_jitter_noise": 0.0}  # fmt: skip
    if architecture == OLMOE:
        return {"num_experts_per_tok": moe["top_k"], "router_aux_loss_coef": options.get("router_aux_loss_coef", 0.01),
                "num_experts": moe["num_experts"], "intermediate_size": width, "clip_qkv": None,
                "norm_topk_prob": moe.get("normalize", True), "attention_bias": False}  # fmt: skip
    return {**common, "num_experts": moe["num_experts"], "moe_intermediate_size": width,
            "norm_topk_prob": moe.get("normalize", True), "decoder_sparse_step": 1,
            "mlp_only_layers": list(moe.get("dense_layers") or []), "attention_bias": False,
            "use_sliding_window": window is not None}  # fmt: skip


def lora_tensors(options: Mapping[str, Any], rank: int, targets: Collection[str]) -> list[TensorMap]:
    """PEFT's tensors of LoRA adapters on a Llama-family model: `lora_A.weight` `[rank, in]` and `lora_B.weight`
    `[out, rank]` per adapted projection, read as our `a` `[in..., rank]` and `b` `[rank, out...]` (a mixture of
    experts' dense MLP projections in its dense layers only)."""
    embed, mlp = options["embed_dim"], options["mlp_dim"]
    q, kv = options["num_heads"] * options["head_dim"], options["num_kv_heads"] * options["head_dim"]
    sizes = {"q": (embed, q), "k": (embed, kv), "v": (embed, kv), "o": (q, embed),
             "gate": (embed, mlp), "up": (embed, mlp), "down": (mlp, embed)}  # fmt: skip
    ours = {"q": "attention/query", "k": "attention/key", "v": "attention/value", "o": "attention/out",
            "gate": "mlp/gate", "up": "mlp/fc", "down": "mlp/proj"}  # fmt: skip
    maps = []
    for target in targets:
        (fan_in, fan_out), path = sizes[target], ours[target]
        in_rank = 2 if target == "o" else 1  # the output projection reads (heads, head_dim)
        name = f"base_model.model.model.layers.{{i}}.{PEFT_MODULES[target]}"
        dense = options.get("moe") and path.startswith("mlp/")
        layers = tuple(options["moe"].get("dense_layers") or ()) if dense else None  # a MoE's dense MLP layers
        maps += [
            TensorMap(f"{path}/lora/a", f"{name}.lora_A.weight", (rank, fan_in), in_rank, True, layers=layers),
            TensorMap(f"{path}/lora/b", f"{name}.lora_B.weight", (fan_out, rank), 1, True, layers=layers),
        ]
    return maps
