"""The Llama family: Llama, Mistral, Qwen2 and Qwen3, their `config.json` as options, their tensors as our
parameters, and as llama.cpp runs them (`llama`, `qwen2`, `qwen3`). The other families build on it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from nnx_cli.hf.families.base import Config, Family, TensorMap, _layer_types, _rope, _window, _windows
from nnx_cli.hf.families.llamacpp import Arch, HParams, _common

LLAMA, MISTRAL, QWEN2, QWEN3 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"

Windows = Callable[[Config, int], dict[str, Any]]
"""The `sliding_window` and `layer_types` options of a config.json with this many layers."""


def _mistral_windows(c: Config, num_layers: int) -> dict[str, Any]:
    """Mistral slides every layer by `sliding_window` when it is set (by default 4096), as transformers reads it."""
    # transformers' MistralConfig slides by 4096 unless config.json says null
    kind = "sliding_attention" if _window(c, 4096) is not None else "full_attention"
    return _windows(c, [kind] * num_layers, 4096)


def _qwen_windows(c: Config, num_layers: int) -> dict[str, Any]:
    """Qwen2 and Qwen3 slide, with `use_sliding_window`, the layers `layer_types` names (by default those from
    `max_window_layers` on), as transformers reads them."""
    if not c.bool("use_sliding_window", False):
        types = _layer_types(c, num_layers, ["full_attention"] * num_layers)
        if "sliding_attention" in types:
            raise c.error("layer_types", "has sliding_attention layers while use_sliding_window is false")
        return {}
    first = c.int("max_window_layers", 28) if c.get("max_window_layers") != 0 else 0
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return _windows(c, _layer_types(c, num_layers, default), 4096)


def _llama_options(
    architecture: str,
    windows: Windows | None = None,
    qk_norm: bool = False,
    norm_eps: float = 1e-6,
    rope_theta: float = 10000.0,
) -> Callable[[Config], dict[str, Any]]:
    """The options of a Llama-shaped `architecture`: q, k and v biases for Qwen2, q/k norms with `qk_norm`, the
    sliding windows `windows` reads (none without); `norm_eps` and `rope_theta` where config.json leaves them out
    (transformers' defaults for the family)."""

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
            "qk_norm": qk_norm,
            "bias": False,
            "norm": "rmsnorm",
            "norm_eps": c.float("rms_norm_eps", norm_eps),
            "positions": "rope",
            **_rope(c, default_theta=rope_theta),
            "tie_embeddings": c.bool("tie_word_embeddings", False),
            **(windows(c, layers) if windows is not None else {}),
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


FAMILIES = {
    LLAMA: Family(LLAMA, _llama_options(LLAMA), _llama_tensors, ignored=("rotary_emb.inv_freq",),
                  note="(Llama 2/3/3.x, SmolLM, TinyLlama)"),
    MISTRAL: Family(MISTRAL, _llama_options(MISTRAL, _mistral_windows), _llama_tensors,
                    ignored=("rotary_emb.inv_freq",)),
    QWEN2: Family(QWEN2, _llama_options(QWEN2, _qwen_windows), _llama_tensors, ignored=("rotary_emb.inv_freq",)),
    QWEN3: Family(QWEN3, _llama_options(QWEN3, _qwen_windows, qk_norm=True), _llama_tensors,
                  ignored=("rotary_emb.inv_freq",)),
}  # fmt: skip


# As llama.cpp runs it
# ------------------------------------------------------------------------------

_LLAMA_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama(hp: HParams, w: Any) -> None:
    _common(hp, w)
    w.add_vocab_size(hp.get("vocab_size"))
    w.add_rope_dimension_count(hp.get("head_dim") or hp.get("hidden_size") // hp.get("num_attention_heads"))


ARCHES = {
    LLAMA: Arch("llama", _llama, _LLAMA_BLOCK, permute=True),
    MISTRAL: Arch("llama", _llama, _LLAMA_BLOCK, permute=True),
    QWEN2: Arch("qwen2", _common, _LLAMA_BLOCK),
    QWEN3: Arch("qwen3", _common, _LLAMA_BLOCK),
}
