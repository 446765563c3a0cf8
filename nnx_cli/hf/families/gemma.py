"""Gemma 2 and Gemma 3 (text): their `config.json` as options, their tensors as our parameters, and as llama.cpp
runs them (`gemma2`, `gemma3`).

Llama's layout with Gemma's switches: embeddings scaled by sqrt(hidden), RMSNorms of (1 + w), norms after
attention and MLP too, a GeGLU MLP, attention logits scaled by query_pre_attn_scalar ** -0.5, sliding layers
by layer_types; Gemma 2 soft-caps attention and final logits, Gemma 3 has q/k norms and a rotary base of its
own for sliding layers. Defaults are those of transformers' config classes, for keys config.json leaves out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from nnx_cli.hf.families.base import (
    _TANH_GELUS,
    _TYPES,
    Config,
    Family,
    TensorMap,
    _check_one_rope_setting,
    _layer_types,
    _rope,
    _rope_scaling,
    _windows,
)
from nnx_cli.hf.families.llama import _LLAMA_BLOCK, _llama_tensors
from nnx_cli.hf.families.llamacpp import Arch, HParams, _common

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"


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
        _check_one_rope_setting(c, parameters)  # `_rope` checks the other forms
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


FAMILIES = {
    GEMMA2: Family(GEMMA2, _gemma_options(GEMMA2), _gemma_tensors),
    GEMMA3: Family(GEMMA3, _gemma_options(GEMMA3), _gemma_tensors, note="(text)"),
}


# As llama.cpp runs them
# ------------------------------------------------------------------------------

_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _gemma2(hp: HParams, w: Any) -> None:
    w.add_context_length(hp.get("max_position_embeddings"))
    w.add_embedding_length(hp.get("hidden_size"))
    w.add_block_count(hp.get("num_hidden_layers"))
    w.add_feed_forward_length(hp.get("intermediate_size"))
    w.add_head_count(hp.get("num_attention_heads"))
    w.add_head_count_kv(hp.get("num_key_value_heads", hp.get("num_attention_heads")))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps"))
    w.add_key_length(hp.get("head_dim"))
    w.add_value_length(hp.get("head_dim"))
    w.add_attn_logit_softcapping(hp.get("attn_logit_softcapping"))
    w.add_final_logit_softcapping(hp.get("final_logit_softcapping"))
    w.add_sliding_window(hp.get("sliding_window"))


def _gemma3(hp: HParams, w: Any) -> None:
    _common(hp, w)
    w.add_context_length(hp.get("max_position_embeddings", 131072))
    w.add_head_count(hp.get("num_attention_heads", 8))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
    w.add_key_length(hp.get("head_dim", 256))
    w.add_value_length(hp.get("head_dim", 256))
    w.add_rope_freq_base(hp.global_rope.get("rope_theta", 1_000_000.0))
    if softcap := hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(softcap)
    if hp.get("sliding_window_pattern") != 1:
        w.add_sliding_window(hp.get("sliding_window"))
    w.add_head_count_kv(hp.get("num_key_value_heads", 4))


ARCHES = {
    GEMMA2: Arch("gemma2", _gemma2, _GEMMA_BLOCK, norm_shift=True, skip=("lm_head.weight",)),
    GEMMA3: Arch("gemma3", _gemma3, _GEMMA_BLOCK, norm_shift=True),
}
