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
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_cli.errors import UserError, check_can_create
from nnx_cli.hf import bnb, families, peft
from nnx_cli.hf.weights import tensors_of
from nnx_cli.report import progress
from nnx_cli.tensorfiles import SHARD_BYTES, numpy_dtype, usual_mode, write_safetensors  # noqa: F401 (re-exported)

DTYPES = ("float32", "bfloat16", "float16")
FOUR_BIT = ("nf4", "fp4")  # bitsandbytes' 4-bit types: the projections quantised, the rest in bfloat16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def check_out(out: Path) -> None:
    """`--out` must not exist, or be an empty directory: an export never overwrites anything. It is made beside
    `--out` and renamed into place, which neither a symbolic link nor a mount point (`docker -v dir:/out`) takes."""
    if out.is_symlink():
        raise UserError(f"--out {str(out)!r} is a symbolic link; give the directory it points to, or a new one "
                        "(nothing was written)")  # fmt: skip
    if out.is_dir() and os.path.ismount(out):
        raise UserError(f"--out {str(out)!r} is a mount point, which an export cannot be renamed onto; give a new "
                        f"directory inside it, such as {str(out / 'model')!r} (nothing was written)")  # fmt: skip
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; an export is a directory: give a new one (nothing was written)")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {str(out)!r} exists and is not empty; give a new directory (nothing was written)")
    check_can_create(out, "--out")


def quantized_kernels(exp: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The run's 4-bit kernels (`model.quantize`): `{path: (type, shape of one layer's kernel)}`."""
    import nnx
    from nnx_cli import steps

    model = exp.moduledef.merge(steps.parameters(exp.abstract))
    return {path: (m.type, m.shape) for path, m in model.modules() if isinstance(m, nnx.QuantizedKernel)}


def dequantized(params: Mapping[str, Any], kernels: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """The parameters with each 4-bit kernel's parts (`.../kernel/codes`, ...) replaced by the float32 kernel they
    hold (`kernels`: :func:`quantized_kernels`), dequantised one layer (and expert) at a time as it is read."""
    out = {p: v for p, v in params.items() if p.rpartition("/")[0] not in kernels}
    for path, (kind, shape) in kernels.items():
        parts = {p.rpartition("/")[2]: v for p, v in params.items() if p.rpartition("/")[0] == path}
        out[path] = _Dequantized(parts, kind, shape)
    return out


class _Dequantized:
    """A 4-bit kernel's float32 values, made when read: whole, or by an index into its stacked leading axes."""

    def __init__(self, parts: dict[str, Any], kind: str, shape: tuple[int, ...]):
        # One kernel's shape: an experts' kernel's own shape leads with the experts, which the codes stack as they
        # stack layers (each kernel's codes are a matrix of bytes, two 4-bit codes each).
        per_kernel = 2 * math.prod(np.shape(parts["codes"])[-2:])
        while len(shape) > 1 and math.prod(shape) > per_kernel:
            shape = shape[1:]
        self.parts, self.kind, self.kernel_shape = parts, kind, tuple(shape)
        self.lead = np.ndim(parts["codes"]) - 2
        self.shape = (*np.shape(parts["codes"])[: self.lead], *shape)

    def __getitem__(self, index: int | tuple[int, ...]) -> np.ndarray:
        from nnx.nn.quantize import dequantize_kernel

        index = index if isinstance(index, tuple) else (index,)
        parts = {name: np.asarray(value[index] if index else value) for name, value in self.parts.items()}
        lead = self.shape[len(index) : self.lead]
        return dequantize_kernel(parts, self.kind, np.float32, xp=np).reshape(*lead, *self.kernel_shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[()]
        return whole if dtype is None else whole.astype(dtype)


@jax.jit
def _merge(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """`kernel + a b scale`, in float32 whatever the kernel's dtype (rounded to a 16-bit base's, a small update
    would be lost; a writer rounds it to the dtype it writes): one pass over the kernel, on every core (numpy's
    product of a rank-8 adapter, then the scale and the sum, took a sixth of a 0.5B model's export)."""
    delta = jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
    return kernel.astype(jnp.float32) + delta * scale


def merged(params: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """The parameters with each adapted kernel replaced by `kernel + a b scale` (the adapter's `delta()`) and the
    adapters dropped. The sums are computed as each kernel is read (layer by layer when layers are stacked, expert
    by expert for experts' kernels), never all at once: the model is not held twice."""
    out = {p: v for p, v in params.items() if "/lora/" not in p}
    for path in params:
        if path.endswith("/lora/a"):
            dense = path.removesuffix("/lora/a")
            lead = int(path.startswith("layers/scan_module/")) + int("/moe/" in f"/{path}")  # layers, experts
            out[dense + "/kernel"] = _Merged(params[dense + "/kernel"], params[path],
                                             params[dense + "/lora/b"], scale, lead)  # fmt: skip
    return out


class _Merged:
    """`kernel + tensordot(a, b) scale`, made when read: whole (`np.asarray`), or by an index into its `lead`
    stacked axes (layers, experts: `[i]`, `[i, e]`), each of which has its own adapter."""

    def __init__(self, kernel: Any, a: Any, b: Any, scale: float, lead: int):
        self.kernel, self.a, self.b, self.scale, self.lead = kernel, a, b, np.float32(scale), lead
        self.shape = np.shape(kernel)

    def __getitem__(self, index: int | tuple[int, ...]) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        assert len(index) <= self.lead
        if len(index) < self.lead:
            return np.stack([self[(*index, i)] for i in range(self.shape[len(index)])])
        kernel = np.asarray(self.kernel[index])
        a, b = np.asarray(self.a[index], np.float32), np.asarray(self.b[index], np.float32)
        return np.asarray(jax.device_get(_merge(kernel, a, b, self.scale)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[()]
        return whole if dtype is None else whole.astype(dtype)

    def stored(self, index: tuple[int, ...]) -> np.ndarray | None:
        """`self[index]` as the tensor its kernel is read from (a :class:`.weights.Lazy` one, as the file lays it
        out: what `tensors_of` makes of it), the sum made in that layout in one pass (the update in float32, as
        the file's tensor is widened); None where the kernel is not such a reader or not the whole tensor."""
        reader = getattr(self.kernel, "stored", None)
        if reader is None or len(index) != self.lead:
            return None
        m, ours = self.kernel.m, self.shape[self.lead :]
        rows = math.prod(ours[: m.split])
        cols = math.prod(ours) // rows
        if math.prod(np.shape(self.a)[self.lead : -1]) != rows or len(m.shape) != 2:
            return None
        tensor = reader(index)
        if tensor.shape != ((cols, rows) if m.transpose else (rows, cols)):  # padded rows (a vocabulary)
            return None
        a = np.asarray(self.a[index], np.float32).reshape(rows, -1)
        b = np.asarray(self.b[index], np.float32).reshape(-1, cols)
        if m.transpose:  # [out, in]: the sum of its transposed update, b' a'
            a, b = b.T, a.T
        return np.asarray(jax.device_get(_merge(tensor, a, b, self.scale)))


def bytes_tokenizer(directory: Path, context: int) -> None:
    """`tokenizer.json` (and `tokenizer_config.json`) equivalent to the `bytes` tokenizer: byte `b` is id `b`
    (byte-level, no merges), `<|endoftext|>` is 256 and never read from a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    mapping = _byte_characters()
    vocab = {mapping[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    # split_special_tokens: `<|endoftext|>` written in a text is its bytes, as the bytes tokenizer reads it
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
                "model_max_length": context, "split_special_tokens": True}  # fmt: skip
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


def check(exp: Any, out: Path, *, adapter: bool, dtype: str | None) -> Any:
    """What makes an export impossible, as a UserError before anything is read or written: an unknown dtype, an
    adapter export of a run without adapters (or without the base they adapt), options no Hugging Face family
    has, a 4-bit export that would not load again, a non-empty `out`. Returns the run's `model.lora` (None without
    adapters)."""
    from nnx_cli.models.transformer import lora_options

    cfg, pretrained = exp.cfg, exp.pretrained
    options = peft.model_options(cfg, pretrained)
    lora = lora_options(cfg.model.options.get("lora"), options.get("mlp", "gelu"), options.get("moe"))
    if dtype is not None and dtype not in (*DTYPES, *FOUR_BIT):  # (a GGUF type is named as one by the command)
        raise UserError(f"--dtype must be one of {', '.join((*DTYPES, *FOUR_BIT))}, got {dtype!r}")
    if adapter:
        peft.check_exportable(cfg, pretrained, lora)
    elif pretrained is None:
        families.architecture_of(options)  # options no family has
    if dtype in FOUR_BIT and (adapter or options.get("positions") == "learned"):
        what = (
            "--adapter writes the adapters alone: drop --dtype, or --adapter to write the merged model in 4 bits"
            if adapter
            else "GPT-2's projections are Conv1D, not Linear"
        )
        raise UserError(f"--dtype {dtype} writes merged Linear weights in 4 bits, as bitsandbytes stores them; {what}")
    if dtype in FOUR_BIT:
        _check_blocks(options, dtype)
    check_out(out)
    return lora


def _check_blocks(options: Mapping[str, Any], dtype: str) -> None:
    """A 4-bit directory is read back as `model.quantize` in the blocks it is written in (the run's, else 64
    values), which must divide each projection's input size (as :func:`.models.transformer.architecture` checks):
    a UserError naming the first that it does not."""
    block = {"block": 64, **(options.get("quantize") or {})}["block"]
    embed, mlp_dim, moe = options["embed_dim"], options["mlp_dim"], options.get("moe")
    inputs = {"q": embed, "k": embed, "v": embed, "o": options["num_heads"] * options["head_dim"], "gate": embed,
              "up": embed, "down": mlp_dim}  # fmt: skip
    if moe:
        inputs |= {"expert_gate": embed, "expert_up": embed, "expert_down": moe.get("mlp_dim") or mlp_dim}
    for projection, size in inputs.items():
        if size % block:
            raise UserError(
                f"--dtype {dtype}: the {projection} projection's input size ({size}) is not a multiple of the 4-bit "
                f"block ({block}), so the directory would not load again; export with --dtype bfloat16 instead "
                "(nothing was written)"
            )


def export(exp: Any, params: Mapping[str, Any], out: Path, *, adapter: bool, dtype: str | None,
           tokenizer: Any) -> list[str]:  # fmt: skip
    """Write the run's weights (host arrays of every parameter, adapters included, by path) to `out`: a model
    directory, or with `adapter` a PEFT adapter. A 4-bit base (`model.quantize`) is dequantised, then merged; with
    `dtype` nf4 or fp4 the merged projections are quantised again and written as `transformers` saves a
    bitsandbytes 4-bit model. Returns the files written. What makes it impossible is a UserError raised before
    anything is written (see :func:`check`)."""
    lora = check(exp, out, adapter=adapter, dtype=dtype)
    options = peft.model_options(exp.cfg, exp.pretrained)
    params = dequantized(params, quantized_kernels(exp))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if adapter:
            files = _write_adapter(staging, exp, lora, params, dtype or "float32")
        else:
            files = _write_model(staging, exp, options, lora, params, dtype, tokenizer)
        if out.exists():
            out.rmdir()  # empty, checked above
        usual_mode(staging)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return files


def _write_adapter(directory: Path, exp: Any, lora: Any, params: Mapping[str, Any], dtype: str) -> list[str]:
    config, shapes, tensors = peft.adapter(exp, lora, params)
    (directory / peft.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    with _progress(shapes, dtype, f"writing {peft.WEIGHTS}") as advance:
        files = write_safetensors(directory, shapes, tensors, dtype, prefix="adapter_model", advance=advance)
    return [peft.CONFIG, *files]


def _write_model(directory: Path, exp: Any, options: dict, lora: Any, params: Mapping[str, Any], dtype: str | None,
                 tokenizer: Any) -> list[str]:  # fmt: skip
    cfg, pretrained = exp.cfg, exp.pretrained
    four_bit = dtype if dtype in FOUR_BIT else None
    dtype = "bfloat16" if four_bit else dtype
    if lora is not None:
        params = merged(params, lora.alpha / lora.rank)
    quantize = cfg.model.options.get("quantize")
    if pretrained is not None:  # the family it came from, its config.json as it was but for the dtype
        from nnx_cli.hf import read_config

        config = read_config(pretrained.directory)
        stored = config.pop("quantization_config", None)  # a 4-bit base is written dequantised: 16 bits by default
        dtype = dtype or ("bfloat16" if stored is not None or quantize is not None else _stored_dtype(config))
        config[_dtype_key(config)] = dtype
        maps = pretrained.maps
    else:
        dtype = dtype or "float32"
        vocab = options["vocab_size"]
        eod = getattr(tokenizer, "eod_id", None)
        config = families.config_json(options, vocab_size=vocab, context=cfg.data.seq_len, bos=None,
                                      eos=eod if eod is not None and eod < vocab else None, dtype=dtype)  # fmt: skip
        architecture = config["architectures"][0]
        names = ["transformer.wte.weight"] if architecture == families.GPT2 else []  # as save_pretrained names them
        family_options = families.FAMILIES[architecture].options(families.Config(config, "config.json"))
        maps = families.FAMILIES[architecture].tensors(family_options, names)
    shapes, tensors, dtypes = families.layout(maps, options["num_layers"]), tensors_of(params, maps), None
    if four_bit:  # in model.quantize's blocks when it has them
        settings = {"block": 64, "double_quant": True, **(quantize or {}), "type": four_bit}
        config["quantization_config"] = bnb.config(settings, settings.get("compute_dtype") or dtype)
        shapes, tensors, dtypes = _bnb_4bit(shapes, tensors, settings, dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with _progress(shapes, dtype, "writing the weights") as advance:
        files = write_safetensors(directory, shapes, tensors, dtype, advance=advance, dtypes=dtypes)
    return ["config.json", *files, *_write_tokenizer(directory, cfg, pretrained, tokenizer, config)]


def _bnb_4bit(shapes: Mapping[str, tuple[int, ...]], tensors: Iterable[tuple[str, Any]], settings: Mapping[str, Any],
              dtype: str) -> tuple[dict, Iterator[tuple[str, Any]], dict]:  # fmt: skip
    """The tensors of a model directory (`shapes`, and the `tensors` in that order) with each projection weight
    quantised as bitsandbytes does (`settings`: `model.quantize`): their shapes, the tensors, their dtypes."""
    kind, block, double = settings["type"], settings["block"], settings["double_quant"]
    layout: dict[str, tuple[tuple, str]] = {}
    for name, shape in shapes.items():
        quantized = bnb.quantizes(name, shape) and math.prod(shape) % block == 0
        layout |= bnb.layout(name, shape, kind, block, double) if quantized else {name: (shape, dtype)}

    def stream() -> Iterator[tuple[str, Any]]:
        for name, array in tensors:
            if name + ".absmax" in layout:  # in the dtype it is written in, then quantised, as transformers loads it
                yield from bnb.tensors(name, np.asarray(array).astype(numpy_dtype(dtype)), kind, block, double, dtype)
            else:
                yield name, array

    return {n: s for n, (s, _) in layout.items()}, stream(), {n: d for n, (_, d) in layout.items()}


def _progress(shapes: Mapping[str, tuple[int, ...]], dtype: str, description: str) -> Any:
    """A progress bar over the bytes `shapes` take in `dtype`, for exports above 100 MB."""
    total = sum(math.prod(s) for s in shapes.values()) * numpy_dtype(dtype).itemsize
    return progress(total, description, at_least=10**8, in_bytes=True)


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
    else:  # a tokenizer.json from scratch: the run's ids are its plain ones, never its post-processor's tokens
        definition = json.loads(tokenizer.to_json())
        if tokenizer.adds_special_tokens():
            definition["post_processor"] = None
        (directory / "tokenizer.json").write_text(json.dumps(definition, ensure_ascii=False))
        eod = tokenizer.token(tokenizer.eod_id)
        # and said so, for llama.cpp's converter: without the flags it adds a begin-of-text of its own
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod, "add_bos_token": False,
                    "add_eos_token": False}  # fmt: skip
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


def describe(out: Path) -> str:
    """What an export directory holds, in a few words: its architecture and dtype, or a PEFT adapter's rank."""
    if (out / peft.CONFIG).is_file():
        config = json.loads((out / peft.CONFIG).read_text())
        return f"PEFT LoRA adapter, rank {config['r']}, on {config['base_model_name_or_path']}"
    config = json.loads((out / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    quantized = config.get("quantization_config") or {}
    if quantized.get("load_in_4bit"):  # the projections in 4 bits, the rest (norms, embeddings) in `dtype`
        dtype = f"{quantized.get('bnb_4bit_quant_type', '4-bit')} projections, {dtype} elsewhere"
    return f"{config['architectures'][0]}, {dtype}"


def listing(files: list[str]) -> str:
    """The files written, shards shown as one range: `model-00001..00004-of-00004.safetensors`."""
    shards = [f for f in files if "-of-" in f]
    if len(shards) < 3:
        return ", ".join(files)
    first, last = shards[0], shards[-1]
    merged_name = first[: first.index("-of-")] + ".." + last[last.index("-of-") - 5 :]
    return ", ".join([merged_name if f == first else f for f in files if f == first or f not in shards])
