"""Each family as llama.cpp runs it: its architecture name, hyper-parameter keys and tensor names.

One :class:`Arch` per Hugging Face architecture (`config.json`'s `architectures[0]`), in :data:`ARCHES`. It says
what llama.cpp's converter does with that family: the `<arch>.*` keys it writes from `config.json`, the name of
each tensor (a block's tensor by its name within the layer), and the few ways a tensor changes on the way (the
query and key rows permuted for llama.cpp's Llama rotary, Gemma's norms stored as `1 + w`, GPT-2's `Conv1D`
weights transposed, experts stacked into one tensor per projection)::

    arch = ARCHES["Qwen2ForCausalLM"]
    arch.name                                                  # "qwen2"
    arch.tensor_name("model.layers.3.self_attn.q_proj.bias")   # ("blk.3.attn_q.bias", None)

A family llama.cpp does not run, or a `config.json` it would run differently (a Qwen3-MoE with dense layers), is
refused by :meth:`Arch.check` with a UserError.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from nnx_cli.errors import UserError

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
_GEMMA_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_PHI3_BLOCK = {
    **_LLAMA_BLOCK,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
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
_LLAMA_GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GPT2_GLOBALS = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}


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
    """A Hugging Face family as llama.cpp runs it (see the module's doc)."""

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


def _llama(hp: HParams, w: Any) -> None:
    _common(hp, w)
    w.add_vocab_size(hp.get("vocab_size"))
    w.add_rope_dimension_count(hp.get("head_dim") or hp.get("hidden_size") // hp.get("num_attention_heads"))


def _qwen3_moe(hp: HParams, w: Any) -> None:
    _common(hp, w)
    if (width := hp.get("moe_intermediate_size")) is not None:
        w.add_expert_feed_forward_length(width)


def _olmoe(hp: HParams, w: Any) -> None:
    _common(hp, w)
    w.add_layer_norm_rms_eps(1e-5)  # what llama.cpp's converter writes for every OLMoE


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


def _gpt2(hp: HParams, w: Any) -> None:
    w.add_block_count(hp.get("n_layer"))
    w.add_context_length(hp.first("n_ctx", "n_positions"))  # transformers 5 no longer writes n_ctx
    w.add_embedding_length(hp.get("n_embd"))
    w.add_feed_forward_length(4 * hp.get("n_embd"))
    w.add_head_count(hp.get("n_head"))
    w.add_layer_norm_eps(hp.get("layer_norm_epsilon", 1e-5))


def rope_freqs(hp: HParams) -> np.ndarray | None:
    """`rope_freqs.weight`: llama3 rotary scaling as llama.cpp applies it, a factor dividing each frequency (None
    for the other rotary settings, which are keys)."""
    rope = hp.global_rope
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp.get("hidden_size") // hp.get("num_attention_heads")
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.astype(np.float32):
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


# What llama.cpp does not run
# ------------------------------------------------------------------------------------------------------------------


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


def _check_phi3(hp: HParams, where: str) -> None:
    if hp.rope.get("long_factor") or str(hp.rope.get("rope_type", "")).lower() in ("su", "longrope", "yarn"):
        raise UserError(f"{where}: Phi-3's long-context rotary scaling is not supported by nnx's GGUF export")


ARCHES = {
    "LlamaForCausalLM": Arch("llama", _llama, _LLAMA_BLOCK, permute=True),
    "MistralForCausalLM": Arch("llama", _llama, _LLAMA_BLOCK, permute=True),
    "MixtralForCausalLM": Arch("llama", _llama, _MIXTRAL_BLOCK, experts=_MIXTRAL_EXPERTS, permute=True),
    "Qwen2ForCausalLM": Arch("qwen2", _common, _LLAMA_BLOCK),
    "Qwen3ForCausalLM": Arch("qwen3", _common, _LLAMA_BLOCK),
    "Qwen3MoeForCausalLM": Arch("qwen3moe", _qwen3_moe, _MOE_BLOCK, experts=_MOE_EXPERTS, check=_check_qwen3_moe),
    "OlmoeForCausalLM": Arch("olmoe", _olmoe, _MOE_BLOCK, experts=_MOE_EXPERTS, check=_check_olmoe),
    "Gemma2ForCausalLM": Arch("gemma2", _gemma2, _GEMMA_BLOCK, norm_shift=True, skip=("lm_head.weight",)),
    "Gemma3ForCausalLM": Arch("gemma3", _gemma3, _GEMMA_BLOCK, norm_shift=True),
    "Phi3ForCausalLM": Arch("phi3", _phi3, _PHI3_BLOCK, check=_check_phi3),
    "GPT2LMHeadModel": Arch(
        "gpt2",
        _gpt2,
        _GPT2_BLOCK,
        globals=_GPT2_GLOBALS,
        layer_prefix="transformer.h.",
        transpose=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight"),
    ),
}
"""Every family nnx loads that llama.cpp runs, by `config.json`'s `architectures[0]`."""


def differences(architecture: str, hp: HParams) -> list[str]:
    """Where llama.cpp will compute something else than transformers does with this config.json (its converter
    writes these models all the same): windows it does not apply, attention scales it does not read."""
    notes = []
    window = hp.get("sliding_window")
    slides = (architecture in ("MistralForCausalLM", "MixtralForCausalLM") and window) or (
        architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and hp.get("use_sliding_window")
    )
    if slides:
        notes.append(f"llama.cpp runs this {architecture} without its sliding window of {window} positions: the same "
                     f"model up to {window} tokens of context, not beyond")  # fmt: skip
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        layers, heads, embed = hp.get("num_hidden_layers"), hp.get("num_attention_heads"), hp.get("hidden_size")
        head_dim = hp.get("head_dim", 256)
        big = layers == (62 if architecture == "Gemma3ForCausalLM" else 46)
        used = embed // heads if big else head_dim
        scalar = hp.get("query_pre_attn_scalar", 256)
        if scalar != used:
            notes.append(f"llama.cpp scales this {architecture}'s attention by {used} ** -0.5, not by its "
                         f"query_pre_attn_scalar {scalar} ** -0.5: it computes other logits")  # fmt: skip
    return notes


def arch_of(architecture: str, config: Mapping[str, Any], where: str) -> tuple[Arch, HParams]:
    """The :class:`Arch` of `architecture` and its checked hyper-parameters; a UserError for what llama.cpp does
    not run (`where` names config.json in the message)."""
    if architecture not in ARCHES:
        raise UserError(
            f"{where}: {architecture} has no GGUF export (llama.cpp runs {', '.join(sorted(ARCHES))} of the families "
            "nnx loads)"
        )
    arch, hp = ARCHES[architecture], HParams(config)
    if arch.check is not None:
        arch.check(hp, where)
    return arch, hp
