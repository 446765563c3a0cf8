"""Model families: a Hugging Face `config.json` as `transformer_lm` options, and its tensors as our parameters.

Llama, Mistral, Qwen2, Qwen3 and GPT-2 are one model with a few switches
(spec hf.md, "Architectures"). For each family a table says which
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
SUPPORTED = (LLAMA, MISTRAL, QWEN2, QWEN3, GPT2)
_SUPPORTED_TEXT = "LlamaForCausalLM (Llama 2/3/3.x, SmolLM, TinyLlama), MistralForCausalLM, Qwen2ForCausalLM, "
_SUPPORTED_TEXT += "Qwen3ForCausalLM, GPT2LMHeadModel"
SHAPE_OPTIONS = (
    "num_layers", "num_heads", "num_kv_heads", "head_dim", "embed_dim", "mlp_dim", "vocab_size", "max_positions",
    "mlp", "qkv_bias", "qk_norm", "bias", "norm", "norm_eps", "positions", "rope_theta", "rope_scaling",
    "tie_embeddings",
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

    `name` holds `{i}` for the layer index of a per-layer parameter.
    """

    path: str  # ours, relative to a block for per-layer parameters: "attention/query/kernel"
    name: str  # theirs: "model.layers.{i}.self_attn.q_proj.weight"
    shape: tuple[int, ...]  # theirs, as config.json implies
    split: int
    transpose: bool = False
    offset: int = 0

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name


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


def _rope(c: Config) -> dict[str, Any]:
    parameters = c.get("rope_parameters")
    key = "rope_parameters" if isinstance(parameters, Mapping) else "rope_scaling"
    scaling = parameters if isinstance(parameters, Mapping) else c.get("rope_scaling")
    theta = c.float("rope_theta", 10000.0)
    if isinstance(parameters, Mapping) and "rope_theta" in parameters:
        theta = float(parameters["rope_theta"])
    if scaling is None:
        return {"rope_theta": theta, "rope_scaling": None}
    if not isinstance(scaling, Mapping):
        raise c.error(key, f"must be a mapping or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if kind != "llama3":
        raise c.error(key, f"has rope type {kind!r}: only the default and llama3 rotary scalings are supported")
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [n for n in names if not isinstance(scaling.get(n), (int, float))]
    if missing:
        raise c.error(key, f"of type llama3 lacks {', '.join(missing)}")
    return {"rope_theta": theta, "rope_scaling": {"type": "llama3", **{n: scaling[n] for n in names}}}


# The Llama family: Llama, Mistral, Qwen2, Qwen3
# ------------------------------------------------------------------------------


def _llama_options(architecture: str) -> Callable[[Config], dict[str, Any]]:
    def options(c: Config) -> dict[str, Any]:
        c.refuse("hidden_act", lambda v: v == "silu", "an activation other than silu")
        c.refuse("mlp_bias", lambda v: not v, "a bias on the MLP projections")
        if architecture != QWEN2:
            c.refuse("attention_bias", lambda v: not v, "a bias on the attention projections")
        if architecture == MISTRAL:
            c.refuse("sliding_window", lambda v: v is None, "sliding-window attention")
        if architecture in (QWEN2, QWEN3):
            c.refuse("use_sliding_window", lambda v: not v, "sliding-window attention")
        heads, embed = c.int("num_attention_heads"), c.int("hidden_size")
        return {
            "num_layers": c.int("num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": c.int("num_key_value_heads", heads),
            "head_dim": c.int("head_dim", embed // heads),
            "embed_dim": embed,
            "mlp_dim": c.int("intermediate_size"),
            "vocab_size": c.int("vocab_size"),
            "mlp": "swiglu",
            "qkv_bias": architecture == QWEN2,
            "qk_norm": architecture == QWEN3,
            "bias": False,
            "norm": "rmsnorm",
            "norm_eps": c.float("rms_norm_eps", 1e-6),
            "positions": "rope",
            **_rope(c),
            "tie_embeddings": c.bool("tie_word_embeddings", False),
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


FAMILIES = {
    **{
        name: Family(name, _llama_options(name), _llama_tensors, ignored=("rotary_emb.inv_freq",))
        for name in (LLAMA, MISTRAL, QWEN2, QWEN3)
    },
    GPT2: Family(GPT2, _gpt2_options, _gpt2_tensors, ignored=(".attn.bias", ".attn.masked_bias")),
}


def parameter_count(maps: list[TensorMap], num_layers: int) -> int:
    """Elements of the tensors `maps` read (GPT-2's fused q, k, v counted once)."""
    seen: dict[str, int] = {}
    for m in maps:
        seen[m.name] = math.prod(m.shape) * (num_layers if m.per_layer else 1)
    return sum(seen.values())


def layout(maps: list[TensorMap], num_layers: int) -> dict[str, tuple[int, ...]]:
    """`{tensor name: shape}` of the tensors `maps` write, in name order (as `weights.tensors_of` yields them)."""
    shapes = {m.name.format(i=i): m.shape for m in maps for i in (range(num_layers) if m.per_layer else [None])}
    return dict(sorted(shapes.items()))


# Out again: options as a family's config.json, adapters as PEFT tensors
# ------------------------------------------------------------------------------

_LLAMA_SHAPE = {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
_GPT2_SHAPE = {"positions": "learned", "norm": "layernorm", "mlp": "gelu", "bias": True}
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
    if not llama:
        if options.get("qkv_bias") and options.get("qk_norm"):
            raise UserError("model.qkv_bias and model.qk_norm together are in no Hugging Face family (Qwen2 has the "
                            "first, Qwen3 the second): it cannot be exported")  # fmt: skip
        return QWEN2 if options.get("qkv_bias") else QWEN3 if options.get("qk_norm") else LLAMA
    if not gpt2:
        extra = [f"{k}: {options.get(k)!r}" for k in ("qkv_bias", "qk_norm") if options.get(k)]
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
        "rope_type": "llama3", **{k: v for k, v in scaling.items() if k != "type"}
    }  # fmt: skip
    model_type = {LLAMA: "llama", QWEN2: "qwen2", QWEN3: "qwen3"}[architecture]
    config = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": embed, "intermediate_size": mlp,
        "num_hidden_layers": options["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": options.get("num_kv_heads") or heads,
        "head_dim": options.get("head_dim") or embed // heads, "vocab_size": vocab_size,
        "max_position_embeddings": context, "rms_norm_eps": options.get("norm_eps", 1e-5), **rope,
        "tie_word_embeddings": options.get("tie_embeddings", True), "hidden_act": "silu", **ids, "dtype": dtype,
    }  # fmt: skip
    if architecture == LLAMA:
        config.update({"attention_bias": False, "mlp_bias": False})
    else:
        config.update({"use_sliding_window": False, "sliding_window": None})
        if architecture == QWEN3:
            config["attention_bias"] = False
    return config


def lora_tensors(options: Mapping[str, Any], rank: int, targets: Collection[str]) -> list[TensorMap]:
    """PEFT's tensors of LoRA adapters on a Llama-family model: `lora_A.weight` `[rank, in]` and `lora_B.weight`
    `[out, rank]` per adapted projection, read as our `a` `[in..., rank]` and `b` `[rank, out...]`."""
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
        maps += [
            TensorMap(f"{path}/lora/a", f"{name}.lora_A.weight", (rank, fan_in), split=in_rank, transpose=True),
            TensorMap(f"{path}/lora/b", f"{name}.lora_B.weight", (fan_out, rank), split=1, transpose=True),
        ]
    return maps
