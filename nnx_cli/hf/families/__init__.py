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

One file per family, each with its `config.json` reading, its tensor maps and its
names in llama.cpp: :mod:`.llama` (Llama, Mistral, Qwen2, Qwen3), :mod:`.gpt2`,
:mod:`.gemma` (Gemma 2 and 3), :mod:`.phi3`, :mod:`.moe` (Mixtral, Qwen3-MoE,
OLMoE). What they share is in :mod:`.base` (:class:`Config`, :class:`TensorMap`,
:class:`Family`, rotary and window options) and :mod:`.llamacpp` (the GGUF
:class:`~.llamacpp.Arch` and its hyper-parameters); the way out again (options as a
`config.json`, PEFT's tensors) in :mod:`.writing`.

To add a family, write one file beside these (:mod:`.phi3` is a small one to copy) holding its
architecture name (`config.json`'s `architectures[0]`) as a constant; a function `(Config) -> options`
(:meth:`Config.refuse` what the model does not support; a new shape option also goes into
:data:`SHAPE_OPTIONS`); a function `(options, tensor names) -> list[TensorMap]`; and its two entries,
`FAMILIES = {NAME: Family(NAME, options, tensors)}` and `ARCHES = {NAME: Arch(...)}` (llama.cpp's
architecture, its block's tensor names, a writer of its hyper-parameters; `{}` when llama.cpp does not run
it). Register it by adding the module to :data:`MODULES`: :data:`FAMILIES`, :data:`SUPPORTED`, the errors'
list of families and `nnx_cli.gguf.families.ARCHES` gather their entries from there. Beyond loading it, a
run trained from scratch exports as the family through a branch of :mod:`.writing`, and a `.gguf` file of
it reads back through :mod:`nnx_cli.gguf.read` (and its tokenizer through :mod:`nnx_cli.gguf.vocab`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nnx_cli.hf.families import gemma, gpt2, llama, moe, phi3
from nnx_cli.hf.families.base import Config, Family, TensorMap, layout, parameter_count
from nnx_cli.hf.families.gemma import GEMMA2, GEMMA3
from nnx_cli.hf.families.gpt2 import GPT2
from nnx_cli.hf.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from nnx_cli.hf.families.moe import MIXTRAL, OLMOE, QWEN3_MOE
from nnx_cli.hf.families.phi3 import PHI3
from nnx_cli.hf.families.writing import PEFT_MODULES, architecture_of, config_json, lora_tensors, run_architecture

__all__ = [
    "FAMILIES",
    "GEMMA2",
    "GEMMA3",
    "GPT2",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "MODULES",
    "OLMOE",
    "PEFT_MODULES",
    "PHI3",
    "QWEN2",
    "QWEN3",
    "QWEN3_MOE",
    "SHAPE_OPTIONS",
    "SUPPORTED",
    "Config",
    "Family",
    "TensorMap",
    "architecture_of",
    "config_json",
    "family_of",
    "layout",
    "lora_tensors",
    "options_of",
    "parameter_count",
    "run_architecture",
]

MODULES = (llama, gpt2, gemma, phi3, moe)
"""The family files, in the order the supported families are listed: each has `FAMILIES` and `ARCHES`."""
FAMILIES = {name: family for module in MODULES for name, family in module.FAMILIES.items()}
"""Every family nnx loads, by `config.json`'s `architectures[0]`."""
SUPPORTED = tuple(FAMILIES)
_SUPPORTED_TEXT = ", ".join(f"{name} {family.note}" if family.note else name for name, family in FAMILIES.items())
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


def family_of(data: Mapping[str, Any], path: str) -> Family:
    """The family `config.json` names in `architectures[0]`; an unknown one or remote code is a UserError."""
    config = Config(data, path)
    architectures = data.get("architectures")
    if "auto_map" in data:
        named = architectures[0] if isinstance(architectures, list) and architectures else None
        fix = (
            f"; its architectures name the built-in {named}, which nnx reads as transformers does without "
            "trust_remote_code: delete the auto_map entry from config.json to read it so"
            if named in FAMILIES
            else f"; supported families: {_SUPPORTED_TEXT}"
        )
        raise config.error(
            "auto_map", f"asks to run the model directory's own code (trust_remote_code), which nnx never does{fix}"
        )
    if isinstance(architectures, str):
        raise config.error(
            "architectures", f"is a string; it should be a list of class names, e.g. [{architectures!r}]"
        )
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
