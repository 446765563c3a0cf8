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

Each family's :class:`Arch` lives in its own file of :mod:`nnx_cli.hf.families`, beside how nnx reads it; the
classes in :mod:`nnx_cli.hf.families.llamacpp` (below both packages, which import nothing of this one). Here:
:data:`ARCHES` gathered from those files, llama3's `rope_freqs`, and what llama.cpp computes differently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnx_cli.errors import UserError
from nnx_cli.hf.families import MODULES
from nnx_cli.hf.families.llamacpp import Arch, Change, HParams, permute, unpermute

__all__ = ["ARCHES", "Arch", "Change", "HParams", "arch_of", "differences", "permute", "rope_freqs", "unpermute"]


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


ARCHES = {name: arch for module in MODULES for name, arch in module.ARCHES.items()}
"""Every family nnx loads that llama.cpp runs, by `config.json`'s `architectures[0]` (each family file's `ARCHES`)."""


def differences(architecture: str, hp: HParams) -> list[str]:
    """Where llama.cpp will compute something else than transformers does with this config.json (its converter
    writes these models all the same): windows it does not apply, attention scales it does not read."""
    notes = []
    window = hp.get("sliding_window")
    slides = (
        (architecture in ("MistralForCausalLM", "MixtralForCausalLM") and window)
        or (
            architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
            and hp.get("use_sliding_window")
        )
        # Phi-3's window (2,047 of Phi-3-mini-4k's 4,096): llama.cpp keeps its key but masks nothing by it
        or (architecture == "Phi3ForCausalLM" and window and window < hp.get("max_position_embeddings", window + 1))
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
    normalize = hp.get("norm_topk_prob")
    if architecture == "OlmoeForCausalLM" and normalize:
        notes.append("llama.cpp's olmoe weighs this OLMoE's chosen experts by their router probabilities as they are, "
                     "not renormalised to sum to 1 (norm_topk_prob): it computes other logits")  # fmt: skip
    if architecture == "Qwen3MoeForCausalLM" and not normalize:
        notes.append("llama.cpp's qwen3moe renormalises the weights of this Qwen3-MoE's chosen experts to sum to 1, "
                     "which it does not (norm_topk_prob false): it computes other logits")  # fmt: skip
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
    if arch.name != "llama" and str(hp.global_rope.get("rope_type", "")).lower() == "llama3":
        raise UserError(
            f"{where}: llama3 rotary scaling on a {architecture}; llama.cpp applies it to its llama architecture only "
            f"(as rope_freqs.weight), and its {arch.name} would run without it"
        )
    return arch, hp
