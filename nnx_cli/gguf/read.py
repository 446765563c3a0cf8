"""A `.gguf` file as a model nnx runs: the Hugging Face model directory it stands for, made once and cached.

`nnx-generate`, `nnx-eval` and `nnx-inspect` take a GGUF file as TARGET, and `model.pretrained` may name one, for
the families nnx exports (:data:`nnx_cli.gguf.families.ARCHES`). The file is read with the `gguf` package's reader
and turned back into what llama.cpp's converter started from: `config.json` from the `<arch>.*` keys (the
function llama.cpp computes: Gemma's sliding layers in llama.cpp's pattern, its attention scale, Qwen3-MoE's
renormalised experts, no window for Mistral, Qwen or Phi-3), the tensors under their Hugging Face names and
layouts (query and key rows permuted back, Gemma's norms less one, experts unstacked, q8_0 dequantised) in
`model.safetensors` (float32), and the tokenizer (`tokenizer.json` rebuilt from `tokenizer.ggml.*`, the chat
template, the stop tokens)::

    directory = model_dir(Path("qwen.gguf"))   # ~/.cache/nnx/gguf/qwen-<checksum>/, built the first time

The directory is built beside the cache's others and renamed into place, so it is whole or absent; a file that is
not GGUF, or is cut short, is a UserError naming it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import UserError
from nnx_cli.gguf import families, require
from nnx_cli.gguf.vocab import BYTE, CONTROL, LLAMA3_REGEX, QWEN2_REGEX, UNKNOWN, UNUSED, USER_DEFINED

_VERSION = "2"  # of the directories this writes: a change makes new ones (2: Phi-3 without its window)
_HF = {
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "gpt2": "GPT2LMHeadModel",
}  # fmt: skip
_END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
                "<|end_of_text|>", "</s>")  # fmt: skip
"""Control tokens llama.cpp ends a generation at, besides the end-of-sequence token the file names."""


def is_gguf(target: str | Path) -> bool:
    """Whether `target` names a GGUF file (by its extension, or its first four bytes)."""
    path = Path(target).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "nnx" / "gguf"


def model_dir(path: str | Path) -> Path:
    """The Hugging Face model directory GGUF file `path` stands for, built into the cache the first time."""
    import xxhash

    path = Path(path).expanduser().absolute()
    stat = path.stat()
    where = path.resolve()  # one file by two paths (`../m.gguf` from a folder below) is converted once
    key = xxhash.xxh3_64(f"{_VERSION}\n{where}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache_root() / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as e:  # XDG_CACHE_HOME a file, a read-only home
        raise UserError(
            f"{path}: cannot create the cache it is converted into, {str(target.parent)!r} ({e.strerror or e}); "
            "set XDG_CACHE_HOME to a writable directory"
        ) from None
    try:
        _build(path, staging)
        try:
            staging.rename(target)
        except OSError:  # another process built it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def open_file(path: Path) -> Any:
    """The `gguf.GGUFReader` of `path`; a UserError naming the file when it is not GGUF or is cut short."""
    gguf = require()
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors on a bad or short file
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); is it cut short?") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise UserError(f"{path}: truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes:,} of a "
                            f"{size:,}-byte file")  # fmt: skip
    return reader


def _build(path: Path, directory: Path) -> None:
    from nnx_cli.tensorfiles import write_safetensors

    reader = open_file(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    name = fields.get("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    architecture = _architecture(path, name, tensors)
    arch = families.ARCHES[architecture]
    config = _config(path, architecture, name, fields, tensors)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hp = families.HParams(config)
    reverse = _reverse(arch, config["num_hidden_layers"] if "num_hidden_layers" in config else config["n_layer"])
    shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, tuple[str, int | None]] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.name not in reverse:
            raise UserError(f"{path}: tensor {t.name!r} is not part of a {name} model nnx knows")
        hf_name, experts = reverse[t.name]
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order
        if experts:
            for e in range(shape[0]):
                shapes[hf_name.format(e=e)] = _hf_shape(arch, hf_name, shape[1:])
                sources[hf_name.format(e=e)] = (t.name, e)
        else:
            shapes[hf_name] = _hf_shape(arch, hf_name, shape)
            sources[hf_name] = (t.name, None)
    shapes = dict(sorted(shapes.items()))

    def stream() -> Any:
        cache: dict[str, np.ndarray] = {}
        for hf_name in shapes:
            gguf_name, expert = sources[hf_name]
            if gguf_name not in cache:
                cache.clear()
                cache[gguf_name] = _dequantized(tensors[gguf_name])
            data = cache[gguf_name] if expert is None else cache[gguf_name][expert]
            yield hf_name, _untransform(arch, hp, hf_name, data)

    write_safetensors(directory, shapes, stream(), "float32")
    _tokenizer(path, directory, fields, config)


def _architecture(path: Path, name: Any, tensors: Mapping[str, Any]) -> str:
    if name == "llama":
        return "MixtralForCausalLM" if any("_exps." in t for t in tensors) else "LlamaForCausalLM"
    if name not in _HF:
        raise UserError(
            f"{path}: general.architecture is {name!r}; nnx reads the GGUF files of llama, qwen2, qwen3, qwen3moe, "
            "olmoe, gemma2, gemma3, phi3 and gpt2 models"
        )
    return _HF[name]


def _dequantized(tensor: Any) -> np.ndarray:
    """A tensor's values as float32, in numpy's order of its GGUF shape (q8_0, f16 and bf16 widened)."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type == GGMLQuantizationType.F32:
        return np.asarray(tensor.data, np.float32).reshape(shape)
    try:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise UserError(f"tensor {tensor.name!r} is {tensor.tensor_type.name}; nnx reads f32, f16, bf16 and q8_0 "
                        "GGUF files") from None  # fmt: skip
    return np.asarray(values, np.float32).reshape(shape)


def _reverse(arch: families.Arch, layers: int) -> dict[str, tuple[str, bool]]:
    """GGUF tensor name -> (the Hugging Face name, with `{e}` for a stack of experts; whether it is one)."""
    out = {theirs: (hf, False) for hf, theirs in arch.globals.items()}
    for i in range(layers):
        for hf, theirs in arch.block.items():
            out[f"blk.{i}.{theirs}"] = (f"{arch.layer_prefix}{i}.{hf}", False)
        for hf, theirs in arch.experts.items():
            out[f"blk.{i}.{theirs}"] = (f"{arch.layer_prefix}{i}.{hf}", True)
    return out


def _hf_shape(arch: families.Arch, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(shape)) if arch.transpose and name.endswith(arch.transpose) else shape


def _untransform(arch: families.Arch, hp: families.HParams, name: str, data: np.ndarray) -> np.ndarray:
    """The inverse of :meth:`families.Arch.transform`."""
    if arch.norm_shift and name.endswith("norm.weight"):
        data = data - np.float32(1)
    if arch.permute and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        heads = hp.first("num_key_value_heads") if ".k_proj." in name else hp.first("num_attention_heads")
        data = families.unpermute(data, heads)
    if arch.transpose and name.endswith(arch.transpose):
        data = data.T
    return np.ascontiguousarray(data)


# config.json
# ------------------------------------------------------------------------------------------------------------------


def _config(path: Path, architecture: str, name: str, fields: Mapping[str, Any], tensors: Mapping[str, Any]
            ) -> dict[str, Any]:  # fmt: skip
    """The `config.json` of the function llama.cpp computes from the file."""

    def key(suffix: str, default: Any = None) -> Any:
        value = fields.get(f"{name}.{suffix}", default)
        return float(str(np.float32(value))) if isinstance(value, float) else value  # 1e-06, not 9.99999997e-07

    # without them the model has no shape: a KeyError or a division by zero further down, or a config.json
    # that failed later, named by the cache directory it was converted into
    for suffix in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv"):
        value = fields.get(f"{name}.{suffix}")
        if value is None and suffix == "attention.head_count_kv":  # optional: as many as the queries' heads
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            said = "missing" if value is None else f"{value!r}"
            raise UserError(f"{path}: GGUF key {name}.{suffix} is {said}; a {name} model needs a positive integer "
                            "there (the file was not written by a complete converter)")  # fmt: skip
    if "token_embd.weight" not in tensors:
        raise UserError(f"{path}: has no tensor token_embd.weight; it is not a whole {name} model")
    embedding = tensors["token_embd.weight"]
    vocab = int(embedding.shape[1])
    heads = key("attention.head_count")
    kv = key("attention.head_count_kv", heads)
    embed = key("embedding_length")
    ids = {
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
    }
    tied = "output.weight" not in tensors
    if architecture == "GPT2LMHeadModel":
        return {
            "architectures": [architecture], "model_type": "gpt2", "n_embd": embed, "n_layer": key("block_count"),
            "n_head": heads, "n_inner": int(tensors["blk.0.ffn_up.weight"].shape[1]),
            "n_positions": int(tensors["position_embd.weight"].shape[1]), "vocab_size": vocab,
            "layer_norm_epsilon": key("attention.layer_norm_epsilon", 1e-5), "activation_function": "gelu_new",
            "tie_word_embeddings": tied, "scale_attn_weights": True, **ids,
        }  # fmt: skip
    head_dim = key("attention.key_length") or embed // heads
    keys = tensors.get("blk.0.attn_k.weight")
    if fields.get(f"{name}.attention.head_count_kv") is None and keys is not None and keys.shape[1] != kv * head_dim:
        raise UserError(  # it failed later, naming the cache file a config.json of as many as the queries went into
            f"{path}: GGUF key {name}.attention.head_count_kv is missing, and its key projections hold "
            f"{int(keys.shape[1]) // head_dim} heads, not the {heads} of the queries it then means (the file was not "
            "written by a complete converter)"
        )
    feed_forward = key("feed_forward_length")
    if feed_forward is None:  # optional in llama.cpp: the width of the MLP's tensors
        up = tensors.get("blk.0.ffn_up.weight", tensors.get("blk.0.ffn_up_exps.weight"))
        feed_forward = int(up.shape[1]) if up is not None else None
    config: dict[str, Any] = {
        "architectures": [architecture], "hidden_size": embed, "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "intermediate_size": feed_forward, "max_position_embeddings": key("context_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6), "vocab_size": vocab,
        "rope_theta": key("rope.freq_base", 10000.0), "tie_word_embeddings": tied, "hidden_act": "silu", **ids,
    }  # fmt: skip
    if key("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    if "rope_freqs.weight" in tensors:
        config["rope_scaling"] = _llama3_scaling(_dequantized(tensors["rope_freqs.weight"]), config)
    if architecture in ("LlamaForCausalLM", "MixtralForCausalLM"):
        config.update(attention_bias=False, mlp_bias=False)
    if architecture == "MixtralForCausalLM":
        config.update(num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      sliding_window=None)  # fmt: skip
    elif architecture == "Qwen3MoeForCausalLM":  # llama.cpp renormalises the top-k weights, as Qwen3-MoE's models do
        config.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True,
                      mlp_only_layers=[], decoder_sparse_step=1, attention_bias=False)  # fmt: skip
    elif architecture == "OlmoeForCausalLM":  # llama.cpp does not renormalise them, as OLMoE does not
        config.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      norm_topk_prob=False, clip_qkv=None, attention_bias=False)  # fmt: skip
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        config.update(use_sliding_window=False, sliding_window=None)
        if architecture == "Qwen3ForCausalLM":
            config["attention_bias"] = False
    elif architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        config.update(_gemma(architecture, key, config, embed, heads, head_dim))
    elif architecture == "Phi3ForCausalLM":  # llama.cpp writes Phi-3's window and attends over the whole context
        config.update(partial_rotary_factor=key("rope.dimension_count") * heads / embed, sliding_window=None,
                      original_max_position_embeddings=key("rope.scaling.original_context_length"),
                      rope_scaling=None)  # fmt: skip
    return config


def _gemma(architecture: str, key: Any, config: dict, embed: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma's keys as llama.cpp runs it: sliding layers in its pattern (every other layer for Gemma 2, five of
    each six for Gemma 3), attention scaled by head_dim ** -0.5 (embed / heads for the 27B models)."""
    layers = config["num_hidden_layers"]
    gemma3 = architecture == "Gemma3ForCausalLM"
    window = key("attention.sliding_window")
    period = 6 if gemma3 else 2
    types = ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(layers)]
    scalar = embed // heads if layers == (62 if gemma3 else 46) else head_dim
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar, "sliding_window": window,
        "layer_types": types if window else ["full_attention"] * layers, "attention_bias": False,
        "final_logit_softcapping": key("final_logit_softcapping"),
    }  # fmt: skip
    if gemma3:
        out.update(rope_local_base_freq=key("rope.freq_base_swa", 10000.0), attn_logit_softcapping=None,
                   sliding_window_pattern=period)  # fmt: skip
    else:
        out["attn_logit_softcapping"] = key("attn_logit_softcapping")
    return out


def _llama3_scaling(factors: np.ndarray, config: dict) -> dict[str, Any]:
    """llama3 rotary scaling parameters that make `factors` (rope_freqs.weight): the factor is the largest, the
    low and high frequency factors Llama 3's (1 and 4), and the original context what the factors between them
    say (any value between the wavelengths of the first divided and the last undivided frequency when none is)."""
    base, dim = config["rope_theta"], config["head_dim"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    wavelengths = 2 * math.pi / freqs.astype(np.float64)
    factor, low, high = float(factors.max()), 1.0, 4.0
    between = [(w, f) for w, f in zip(wavelengths, factors.astype(np.float64)) if 1.0 < f < factor]
    if between:
        w, f = between[0]
        smooth = (1 / f - 1 / factor) / (1 - 1 / factor)
        old = (smooth * (high - low) + low) * w
    else:
        undivided = [w for w, f in zip(wavelengths, factors) if f == 1.0] or [0.0]
        divided = [w for w, f in zip(wavelengths, factors) if f != 1.0] or [max(undivided) * 8]
        old = math.sqrt(max(max(undivided) * high, 1e-9) * min(divided) * low)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": old}  # fmt: skip
    again = families.rope_freqs(families.HParams({**config, "rope_scaling": scaling}))
    if again is None or not np.allclose(again, factors, rtol=1e-4):
        raise UserError("rope_freqs.weight is not a llama3 rotary scaling with Llama 3's frequency factors (1, 4)")
    return scaling


# The tokenizer
# ------------------------------------------------------------------------------------------------------------------


def _tokenizer(path: Path, directory: Path, fields: Mapping[str, Any], config: dict) -> None:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json of the file's
    `tokenizer.ggml.*` keys."""
    model = fields.get("tokenizer.ggml.model")
    tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [NORMAL_TYPE] * len(tokens))
    if model is None or not tokens:  # one message said the model it had was the one it could not read
        missing = "tokenizer.ggml.model" if model is None else "tokenizer.ggml.tokens"
        raise UserError(f"{path}: GGUF key {missing} is missing (or empty); the file holds no whole vocabulary")
    if model not in ("gpt2", "llama"):
        raise UserError(f"{path}: tokenizer.ggml.model is {model!r}; nnx reads gpt2 (BPE) and llama (SentencePiece)")
    add_bos = fields.get("tokenizer.ggml.add_bos_token", model == "llama")
    bos = _at(tokens, fields.get("tokenizer.ggml.bos_token_id"))
    eos = _at(tokens, fields.get("tokenizer.ggml.eos_token_id"))
    unk = _at(tokens, fields.get("tokenizer.ggml.unknown_token_id"))
    pad = _at(tokens, fields.get("tokenizer.ggml.padding_token_id"))
    if model == "gpt2":
        definition = _bpe_json(path, fields, tokens, types)
    else:
        definition = _sentencepiece_json(fields, tokens, types, unk)
    if add_bos and bos is not None:
        definition["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}},
        }  # fmt: skip
    (directory / "tokenizer.json").write_text(json.dumps(definition, ensure_ascii=False))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    settings.update({k: v for k, v in (("unk_token", unk), ("pad_token", pad)) if v is not None})
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    template = fields.get("tokenizer.chat_template")
    if isinstance(template, str):
        (directory / "chat_template.jinja").write_text(template)
    stops = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops += [i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL and t in _END_OF_TURN]
    stops = list(dict.fromkeys(s for s in stops if isinstance(s, int)))
    generation = {k: v for k, v in (("bos_token_id", config.get("bos_token_id")), ("eos_token_id", stops)) if v}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


NORMAL_TYPE = 1


def _at(tokens: list[str], index: Any) -> str | None:
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _added(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": kind != CONTROL, "special": kind == CONTROL}
        for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED, UNKNOWN)
    ]  # fmt: skip


_PRE = {
    "llama-bpe": [{"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
                  {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}],
    "qwen2": [{"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}],
    "gpt-2": [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}],
    "smollm": [{"type": "Digits", "individual_digits": True},
               {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}],
}  # fmt: skip


def _bpe_json(path: Path, fields: Mapping[str, Any], tokens: list[str], types: list[int]) -> dict[str, Any]:
    pre = fields.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE:
        raise UserError(f"{path}: tokenizer.ggml.pre is {pre!r}; nnx rebuilds {', '.join(_PRE)}")
    if fields.get("tokenizer.ggml.merges") is None:  # read as characters alone, without a word: other tokens
        raise UserError(
            f"{path}: GGUF key tokenizer.ggml.merges is missing; a gpt2 (BPE) vocabulary needs its merges (llama.cpp "
            "loads none without them)"
        )
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    # a merge whose parts or result are not tokens can make none (nnx writes one where there are no merges:
    # vocab.NO_MERGE), and `tokenizers` refuses it (some versions panic)
    pairs = (m.split(" ", 1) for m in fields.get("tokenizer.ggml.merges") or [])
    merges = [m for m in pairs if len(m) == 2 and m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    steps = _PRE[pre]
    return {
        "version": "1.0",
        "added_tokens": _added(tokens, types),
        "normalizer": {"type": "NFC"} if pre == "qwen2" else None,
        "pre_tokenizer": steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }  # fmt: skip


def _sentencepiece_json(fields: Mapping[str, Any], tokens: list[str], types: list[int],
                        unk: str | None) -> dict[str, Any]:  # fmt: skip
    """A byte-fallback BPE over `▁`-joined text, as transformers converts a SentencePiece BPE model: the merges
    are each piece's splits into two pieces, in the order of the piece's score."""
    scores = list(fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    normal = [(scores[i], i, t) for t, i in vocab.items() if types[i] in (NORMAL_TYPE, USER_DEFINED) and len(t) > 1]
    merges = []
    for _, _, piece in sorted(normal, key=lambda item: (-item[0], item[1])):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        found = [(vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab]
        merges += [[a, b] for _, _, a, b in sorted(found)]
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    normalizers = ([{"type": "Prepend", "prepend": "\u2581"}] if prefix else []) + [
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]  # fmt: skip
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]  # fmt: skip
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    pre = None if prefix else {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                               "invert": False}  # fmt: skip
    return {
        "version": "1.0",
        "added_tokens": _added(tokens, [BYTE if k == BYTE else k for k in types]),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": pre,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }  # fmt: skip
