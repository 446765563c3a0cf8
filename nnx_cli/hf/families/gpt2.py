"""GPT-2: its `config.json` as options, its tensors (q, k and v fused in `c_attn`, `Conv1D` weights stored
`[in, out]`) as our parameters, and as llama.cpp runs it (`gpt2`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from nnx_cli.hf.families.base import _TANH_GELUS, Config, Family, TensorMap
from nnx_cli.hf.families.llamacpp import Arch, HParams

GPT2 = "GPT2LMHeadModel"


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


FAMILIES = {GPT2: Family(GPT2, _gpt2_options, _gpt2_tensors, ignored=(".attn.bias", ".attn.masked_bias"))}


# As llama.cpp runs it
# ------------------------------------------------------------------------------

_GPT2_BLOCK = {
    f"{theirs}.{kind}": f"{ours}.{kind}"
    for theirs, ours in {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    }.items()
    for kind in ("weight", "bias")
}
_GPT2_GLOBALS = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}


def _gpt2(hp: HParams, w: Any) -> None:
    w.add_block_count(hp.get("n_layer"))
    w.add_context_length(hp.first("n_ctx", "n_positions"))  # transformers 5 no longer writes n_ctx
    w.add_embedding_length(hp.get("n_embd"))
    w.add_feed_forward_length(hp.get("n_inner") or 4 * hp.get("n_embd"))  # the converter's 4 x, unless n_inner
    w.add_head_count(hp.get("n_head"))
    w.add_layer_norm_eps(hp.get("layer_norm_epsilon", 1e-5))


ARCHES = {
    GPT2: Arch(
        "gpt2",
        _gpt2,
        _GPT2_BLOCK,
        globals=_GPT2_GLOBALS,
        layer_prefix="transformer.h.",
        transpose=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight"),
    ),
}
