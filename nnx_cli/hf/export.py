"""A run's weights out again, as a Hugging Face model directory (or a PEFT adapter) that others load.

Merged weights (`nnx-export RUN --out DIR`) are written in the layout of the family the run came from (its
`model.pretrained`), or that its options describe (a `transformer_lm` trained from scratch with Llama
options is a `LlamaForCausalLM`, with GPT-2's a `GPT2LMHeadModel`): `config.json`, `generation_config.json`,
safetensors (sharded with an index above 5 GB), and the tokenizer files (the `bytes` tokenizer as an
equivalent `tokenizer.json`). Adapters are merged into the weights they adapt (`W + A B alpha / rank`),
or written alone as a PEFT adapter (`--adapter`). The padded vocabulary rows are dropped.

Everything is written into a temporary directory beside `--out` and renamed into place at the end, so
`--out` is either the whole export or absent.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import UserError
from nnx_cli.hf import families, peft
from nnx_cli.hf.weights import tensors_of

SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained writes by default: larger models are sharded
DTYPES = ("float32", "bfloat16", "float16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def check_out(out: Path) -> None:
    """`--out` must not exist, or be an empty directory: an export never overwrites anything."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {str(out)!r} exists and is not empty; give a new directory (nothing was written)")


def merged(params: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """Each adapted kernel with its adapter's update added (`a b scale`, layer by layer for stacked layers),
    the adapters dropped."""
    out = {p: v for p, v in params.items() if "/lora/" not in p}
    for path in params:
        if path.endswith("/lora/a"):
            dense = path.removesuffix("/lora/a")
            a, b = params[path], params[dense + "/lora/b"]
            if path.startswith("layers/scan_module/"):
                delta = np.stack([np.tensordot(a[i], b[i], axes=1) for i in range(a.shape[0])])
            else:
                delta = np.tensordot(a, b, axes=1)
            out[dense + "/kernel"] = out[dense + "/kernel"] + delta * np.float32(scale)
    return out


def _cast(array: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    return array.astype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype])


def write_safetensors(directory: Path, tensors: Iterator[tuple[str, np.ndarray]], dtype: str,
                      shard_bytes: int = SHARD_BYTES, prefix: str = "model") -> list[str]:  # fmt: skip
    """`prefix.safetensors`, or shards `prefix-0000i-of-0000n.safetensors` and their index when the tensors
    exceed `shard_bytes`; one shard is held in memory at a time. Returns the files written."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    spilled: list[Path] = []
    size = total = 0
    for name, array in tensors:
        array = _cast(array, dtype)
        if size and size + array.nbytes > shard_bytes:  # this shard is full: park it on disk under a temporary name
            spilled.append(directory / f".{prefix}-part-{len(spilled)}.safetensors")
            save_file(shards[-1], str(spilled[-1]), metadata={"format": "pt"})
            shards[-1], size = {}, 0
        shards[-1][name] = array
        size += array.nbytes
        total += array.nbytes
    if not spilled:
        save_file(shards[-1], str(directory / f"{prefix}.safetensors"), metadata={"format": "pt"})
        return [f"{prefix}.safetensors"]
    last = directory / f".{prefix}-part-{len(spilled)}.safetensors"
    save_file(shards[-1], str(last), metadata={"format": "pt"})
    spilled.append(last)
    count, weight_map, files = len(spilled), {}, []
    for i, part in enumerate(spilled):
        name = f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors"
        from safetensors import safe_open

        with safe_open(str(part), framework="numpy") as f:
            weight_map.update(dict.fromkeys(f.keys(), name))
        part.rename(directory / name)
        files.append(name)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files + [f"{prefix}.safetensors.index.json"]


def bytes_tokenizer(directory: Path, context: int) -> None:
    """`tokenizer.json` (and `tokenizer_config.json`) equivalent to the `bytes` tokenizer: byte `b` is id `b`
    (byte-level, no merges), `<|endoftext|>` is 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    mapping = _byte_characters()
    vocab = {mapping[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
                "model_max_length": context}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def _byte_characters() -> dict[int, str]:
    """The printable character byte-level tokenizers (GPT-2's) use for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def export(
    exp: Any,
    params: dict[str, np.ndarray],
    out: Path,
    *,
    adapter: bool,
    dtype: str | None,
    tokenizer: Any,
    say: Callable[[str], None],
) -> list[str]:
    """Write the run's weights (host arrays of every parameter, adapters included) to `out`; returns the files."""
    from nnx_cli.models.transformer_lm import lora_options

    cfg, pretrained = exp.cfg, exp.pretrained
    options = peft.model_options(cfg, pretrained)
    lora = lora_options(cfg.model.options.get("lora"), options.get("mlp", "gelu"))
    if adapter and lora is None:
        raise UserError("--adapter exports a run's LoRA adapters, and this run has none (no model.lora); drop it")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if adapter:
            files = _write_adapter(staging, cfg, pretrained, lora, params, dtype or "float32")
        else:
            files = _write_model(staging, exp, options, lora, params, dtype, tokenizer)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return files


def _write_adapter(directory: Path, cfg: Any, pretrained: Any, lora: Any, params: dict, dtype: str) -> list[str]:
    maps = peft.tensor_maps(cfg, pretrained, lora)
    adapters = {p: v for p, v in params.items() if "/lora/" in p}
    source = pretrained.source if pretrained is not None else None
    (directory / peft.CONFIG).write_text(json.dumps(peft.config(cfg, lora, source), indent=2) + "\n")
    files = write_safetensors(directory, tensors_of(adapters, maps), dtype, prefix="adapter_model")
    return [peft.CONFIG, *files]


def _write_model(directory: Path, exp: Any, options: dict, lora: Any, params: dict, dtype: str | None,
                 tokenizer: Any) -> list[str]:  # fmt: skip
    cfg, pretrained = exp.cfg, exp.pretrained
    if lora is not None:
        params = merged(params, lora.alpha / lora.rank)
    if pretrained is not None:
        from nnx_cli.hf import read_config

        config = read_config(pretrained.directory)
        dtype = dtype or _stored_dtype(config)
        config[_dtype_key(config)] = dtype
        maps, names = pretrained.maps, pretrained.weights.files
    else:
        dtype = dtype or "float32"
        vocab = options["vocab_size"]
        eod = getattr(tokenizer, "eod_id", None)
        config = families.config_json(options, vocab_size=vocab, context=cfg.data.seq_len, bos=None,
                                      eos=eod if eod is not None and eod < vocab else None, dtype=dtype)  # fmt: skip
        architecture = config["architectures"][0]
        names = ["transformer.wte.weight"] if architecture == families.GPT2 else []
        family_options = families.FAMILIES[architecture].options(families.Config(config, "config.json"))
        maps = families.FAMILIES[architecture].tensors(family_options, names)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = ["config.json", *write_safetensors(directory, tensors_of(params, maps), dtype)]
    files += _write_tokenizer(directory, cfg, pretrained, tokenizer, config)
    return files


def _dtype_key(config: dict[str, Any]) -> str:
    return "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"


def _stored_dtype(config: dict[str, Any]) -> str:
    value = config.get("dtype") or config.get("torch_dtype") or "float32"
    return value if value in DTYPES else "float32"


def _write_tokenizer(directory: Path, cfg: Any, pretrained: Any, tokenizer: Any, config: dict) -> list[str]:
    """The tokenizer files and `generation_config.json`."""
    from nnx_cli.data import examples

    written = []
    if pretrained is not None:
        for name in (*_TOKENIZER_FILES, "generation_config.json"):
            if (pretrained.directory / name).is_file():
                shutil.copy2(pretrained.directory / name, directory / name)
                written.append(name)
    elif hasattr(tokenizer, "to_bytes"):
        bytes_tokenizer(directory, cfg.data.seq_len)
        written += ["tokenizer.json", "tokenizer_config.json"]
    else:
        definition = tokenizer._tokenizer.to_str()
        (directory / "tokenizer.json").write_text(definition)
        eod = tokenizer._tokenizer.id_to_token(tokenizer.eod_id)
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod}
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
        written += ["tokenizer.json", "tokenizer_config.json"]
    if cfg.data.chat_template:  # the template the run was trained with
        (directory / "chat_template.jinja").write_text(examples.chat_template(cfg.data, tokenizer))
        written.append("chat_template.jinja")
    if not (directory / "generation_config.json").exists():
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        written.append("generation_config.json")
    return sorted(set(written))


def total_size(directory: Path) -> str:
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{size} B"
        size /= 1000
    return f"{math.floor(size)} GB"
