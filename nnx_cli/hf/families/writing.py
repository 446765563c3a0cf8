"""Out again: options as a family's `config.json` (:func:`config_json`, for a run trained from scratch), and LoRA
adapters as PEFT's tensors (:func:`lora_tensors`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from nnx_cli.errors import UserError
from nnx_cli.hf.families.base import TensorMap
from nnx_cli.hf.families.gpt2 import GPT2
from nnx_cli.hf.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from nnx_cli.hf.families.moe import MIXTRAL, OLMOE, QWEN3_MOE

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


def _as_computed(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` as the model computes with them: a window no layer of `layer_types` takes is none, one every
    layer takes needs no `layer_types`, and a `query_scale` or `rotary_dim` of the head's size is the default."""
    options = dict(options)
    types, window = options.get("layer_types"), options.get("sliding_window")
    if window is None or (types is not None and "sliding_attention" not in types):
        options["sliding_window"] = options["layer_types"] = None
    elif types is not None and all(t == "sliding_attention" for t in types):
        options["layer_types"] = None
    head_dim = options.get("head_dim") or options["embed_dim"] // options["num_heads"]
    for name in ("query_scale", "rotary_dim"):
        if options.get(name) is not None and options[name] == head_dim:
            options[name] = None
    return options


def architecture_of(options: Mapping[str, Any]) -> str:
    """The family whose architecture `options` (a `transformer_lm`'s, resolved) describe; options no family has
    are a UserError naming them."""
    options = _as_computed(options)

    def differ(shape: Mapping[str, Any]) -> list[str]:
        return [f"{k}: {options.get(k)!r} (the family's is {v!r})" for k, v in shape.items() if options.get(k) != v]

    llama, gpt2 = differ(_LLAMA_SHAPE), differ(_GPT2_SHAPE)
    unwritten = [f"{k}: {options.get(k)!r}" for k, v in _UNWRITTEN.items() if options.get(k, v) != v]
    if options.get("moe"):
        return _moe_architecture(options, llama, unwritten)
    if not llama:
        if options.get("qk_norm") and options.get("qk_norm_scope", "head") != "head":
            raise UserError(
                "model.qk_norm_scope projection (q/k norms over all heads at once) without experts is in no Hugging "
                "Face family nnx writes (Qwen3's normalise each head): it cannot be exported"
            )
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
    architecture, options = architecture_of(options), _as_computed(options)
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
