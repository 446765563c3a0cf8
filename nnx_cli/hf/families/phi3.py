"""Phi-3: its `config.json` as options, its tensors as our parameters, and as llama.cpp runs it (`phi3`).

Llama with q, k and v fused in one qkv_proj and gate and up in one gate_up_proj (split on the way in, fused
on the way out: each of our kernels is a block of columns of theirs), a rotation of the first
partial_rotary_factor of each head, and a sliding window on every layer when sliding_window is set.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from nnx_cli.errors import UserError
from nnx_cli.hf.families.base import Config, Family, TensorMap, _rope, _window, _windows
from nnx_cli.hf.families.llama import _LLAMA_BLOCK
from nnx_cli.hf.families.llamacpp import Arch, HParams

PHI3 = "Phi3ForCausalLM"


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


FAMILIES = {PHI3: Family(PHI3, _phi3_options, _phi3_tensors, ignored=("rotary_emb.inv_freq",))}


# As llama.cpp runs it
# ------------------------------------------------------------------------------

_PHI3_BLOCK = {
    **_LLAMA_BLOCK,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}


def _phi3(hp: HParams, w: Any) -> None:
    embed, heads = hp.first("hidden_size", "n_embd"), hp.first("num_attention_heads", "n_head")
    w.add_context_length(hp.first("n_positions", "max_position_embeddings"))
    w.add_rope_scaling_orig_ctx_len(hp.rope["original_max_position_embeddings"])
    w.add_embedding_length(embed)
    w.add_feed_forward_length(hp.get("intermediate_size"))
    w.add_block_count(hp.get("num_hidden_layers"))
    w.add_head_count(heads)
    w.add_head_count_kv(hp.first("num_key_value_heads", "n_head_kv"))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps"))
    w.add_rope_dimension_count(int(hp.rope.get("partial_rotary_factor", 1.0) * embed) // heads)
    w.add_rope_freq_base(hp.global_rope["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)


def _check_phi3(hp: HParams, where: str) -> None:
    if hp.rope.get("long_factor") or str(hp.rope.get("rope_type", "")).lower() in ("su", "longrope", "yarn"):
        raise UserError(f"{where}: Phi-3's long-context rotary scaling is not supported by nnx's GGUF export")


ARCHES = {PHI3: Arch("phi3", _phi3, _PHI3_BLOCK, check=_check_phi3)}
