"""Mixtures of experts: Mixtral, Qwen3-MoE and OLMoE, their `config.json` as options (the Llama family's with
`moe`), their experts' tensors stacked into our parameters, and as llama.cpp runs them (`llama`, `qwen3moe`,
`olmoe`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

from nnx_cli.errors import UserError
from nnx_cli.hf.families.base import Config, Family, TensorMap, _window, _windows
from nnx_cli.hf.families.llama import _LLAMA_BLOCK, _llama, _llama_options, _llama_tensors
from nnx_cli.hf.families.llamacpp import Arch, HParams, _common

MIXTRAL, QWEN3_MOE, OLMOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"


def _mixtral_windows(c: Config, num_layers: int) -> dict[str, Any]:
    """Mixtral slides every layer by `sliding_window` when it is set (by default none), as transformers reads it."""
    # MixtralConfig slides every layer only when config.json sets the window
    kind = "sliding_attention" if _window(c, None) is not None else "full_attention"
    return _windows(c, [kind] * num_layers, None)


def _qwen3_moe_windows(c: Config, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE slides every layer by `sliding_window` (by default 4096) with `use_sliding_window`."""
    # Qwen3MoeConfig slides every layer by sliding_window with use_sliding_window
    on = c.bool("use_sliding_window", False) and _window(c, 4096) is not None
    return _windows(c, ["sliding_attention" if on else "full_attention"] * num_layers, 4096)


def _mixtral_options(c: Config) -> dict[str, Any]:
    """Mistral's attention (every layer sliding by `sliding_window` when it is set), a mixture of
    `num_local_experts` in every layer, the top-k weights always renormalised."""
    c.refuse("router_jitter_noise", lambda v: not v, "router jitter noise")
    options = _llama_options(MIXTRAL, _mixtral_windows, norm_eps=1e-5, rope_theta=1e6)(c)  # MixtralConfig's
    experts = c.int("num_local_experts")
    options["moe"] = {"num_experts": experts, "top_k": _top_k(c, experts), "mlp_dim": c.int("intermediate_size"),
                      "normalize": True, "dense_layers": []}  # fmt: skip
    options["router_aux_loss_coef"] = c.float("router_aux_loss_coef", 0.001)
    return options


def _qwen3_moe_options(c: Config) -> dict[str, Any]:
    """Qwen3's attention (every layer sliding by `sliding_window` with `use_sliding_window`); experts
    `moe_intermediate_size` wide in the layers `decoder_sparse_step` picks (`i + 1` a multiple of it) outside
    `mlp_only_layers`, which keep a dense MLP `intermediate_size` wide."""
    options = _llama_options(QWEN3_MOE, _qwen3_moe_windows, qk_norm=True)(c)
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
    options = _llama_options(OLMOE, norm_eps=1e-5)(c)  # OlmoeConfig's
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
    MIXTRAL: Family(MIXTRAL, _mixtral_options, _moe_tensors(MIXTRAL), ignored=("rotary_emb.inv_freq",)),
    QWEN3_MOE: Family(QWEN3_MOE, _qwen3_moe_options, _moe_tensors(QWEN3_MOE), ignored=("rotary_emb.inv_freq",)),
    OLMOE: Family(OLMOE, _olmoe_options, _moe_tensors(OLMOE), ignored=("rotary_emb.inv_freq",)),
}


# As llama.cpp runs them
# ------------------------------------------------------------------------------

_MIXTRAL_BLOCK = {**_LLAMA_BLOCK, "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
_MIXTRAL_EXPERTS = {
    "block_sparse_moe.experts.{e}.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.{e}.w2.weight": "ffn_down_exps.weight",
    "block_sparse_moe.experts.{e}.w3.weight": "ffn_up_exps.weight",
}
_MOE_BLOCK = {**_LLAMA_BLOCK, "mlp.gate.weight": "ffn_gate_inp.weight"}
_MOE_EXPERTS = {
    "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight",
    "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight",
}


def _qwen3_moe(hp: HParams, w: Any) -> None:
    _common(hp, w)
    if (width := hp.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(width)


def _olmoe(hp: HParams, w: Any) -> None:
    _common(hp, w)
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-5))  # the converter writes 1e-5, every OLMoE's


def _check_qwen3_moe(hp: HParams, where: str) -> None:
    dense = hp.get("mlp_only_layers") or []
    if dense or hp.get("decoder_sparse_step", 1) != 1:
        raise UserError(
            f"{where}: a Qwen3-MoE with dense MLP layers (mlp_only_layers {dense}, decoder_sparse_step "
            f"{hp.get('decoder_sparse_step', 1)}); llama.cpp's qwen3moe has experts in every layer, so it cannot run "
            "this model"
        )


def _check_olmoe(hp: HParams, where: str) -> None:
    heads, kv = hp.get("num_attention_heads"), hp.get("num_key_value_heads", hp.get("num_attention_heads"))
    if kv != heads:
        raise UserError(
            f"{where}: an OLMoE with {kv} key-value heads for {heads} query heads; llama.cpp's olmoe normalises the "
            "keys of all heads together and shares none, so it cannot run this model"
        )
    if hp.get("tie_word_embeddings"):
        raise UserError(
            f"{where}: an OLMoE whose output head is its embedding (tie_word_embeddings); llama.cpp's olmoe needs a "
            "head of its own, so it cannot run this model (train it with model.tie_embeddings=false)"
        )


ARCHES = {
    MIXTRAL: Arch("llama", _llama, _MIXTRAL_BLOCK, experts=_MIXTRAL_EXPERTS, permute=True),
    QWEN3_MOE: Arch("qwen3moe", _qwen3_moe, _MOE_BLOCK, experts=_MOE_EXPERTS, check=_check_qwen3_moe),
    OLMOE: Arch("olmoe", _olmoe, _MOE_BLOCK, experts=_MOE_EXPERTS, check=_check_olmoe),
}
