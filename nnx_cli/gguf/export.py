"""Writing a GGUF file: a model's tensors, hyper-parameters and tokenizer, as llama.cpp's converter writes them.

A :class:`Source` is a model to write: its `config.json`, the directory holding its tokenizer files, and its
tensors under their Hugging Face names, yielded one at a time in name order. :func:`from_model_dir` makes one of a
Hugging Face model directory (tensors read from its safetensors), :func:`from_run` of a run's parameters (LoRA
adapters merged). :func:`write` then plans the file from the names and shapes alone (the GGUF header comes first),
and streams each tensor through its family's changes (:mod:`nnx_cli.gguf.families`) and its quantisation into a
temporary file beside `out`, renamed into place at the end::

    source = from_model_dir(Path("/models/Qwen2.5-0.5B-Instruct"))
    write(source, Path("qwen.gguf"), "q8_0")

Only the tensor being written (or, for a mixture of experts, one layer's experts of one projection) is held beside
what the source holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import RunError, UserError, cannot_write, check_can_create
from nnx_cli.gguf import families, require
from nnx_cli.gguf.vocab import Vocab
from nnx_cli.tensorfiles import usual_mode

DTYPES = ("f32", "f16", "bf16", "q8_0")
SAME_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # the names --dtype takes without --format gguf
_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's LlamaFileType
_KEEP_F32 = ("ffn_gate_inp.weight", "position_embd.weight", "token_types.weight")
"""Tensors llama.cpp's converter keeps in float32 at every file type (the router, learned positions)."""


@dataclasses.dataclass
class Source:
    """A model to write (see the module's doc)."""

    config: dict[str, Any]
    files: Path  # config.json's directory: the tokenizer files (and a model card)
    shapes: dict[str, tuple[int, ...]]  # Hugging Face tensor name -> shape, in name order
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]  # (name, array) in the order of `shapes`
    name: str  # general.name when the model card has none
    card: Path | None  # the directory whose README.md / config.json give general.* metadata
    stored: str = "float32"  # the weights' dtype as stored (what `--dtype` defaults to)

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]


def check_out(out: Path, overwrite: bool) -> None:
    """`--out` must be a new file (or an existing one with `overwrite`), never a directory."""
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a directory; give the path of the .gguf file to write")
    if (out.exists() or out.is_symlink()) and not overwrite:  # a link to nowhere too: the rename would replace it
        raise UserError(f"--out {str(out)!r} exists; pass --overwrite to replace it (nothing was written)")
    if out.is_symlink() or (out.exists() and not out.is_file()):  # the new file is renamed onto --out, which
        what = "a symbolic link" if out.is_symlink() else "not a regular file"  # replaced a link, or /dev/full
        raise UserError(f"--out {str(out)!r} is {what}, which --overwrite would replace, not write through; give "
                        "the path of a regular file (nothing was written)")  # fmt: skip
    check_can_create(out, "--out")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not a GGUF type nnx writes; use one of {', '.join(DTYPES)}")


def default_dtype(stored: str) -> str:
    """The 16-bit type closest to the weights as stored: bf16 for bfloat16 weights, else f16 (as llama.cpp's
    converter's `auto`)."""
    return "bf16" if stored == "bfloat16" else "f16"


# Sources
# ------------------------------------------------------------------------------------------------------------------


def from_model_dir(directory: Path) -> Source:
    """A Hugging Face model directory: its config.json and tokenizer files, its tensors read from the safetensors
    as they are stored (a bfloat16 tensor is widened to float32, what llama.cpp's converter computes in, as it is
    converted)."""
    from nnx_cli.hf import families as hf_families
    from nnx_cli.hf import open_pretrained, read_config, resolve_target

    resolve_target(directory)  # a Hub id that cannot be had is said of the TARGET
    pretrained = open_pretrained(str(directory))
    config = read_config(pretrained.directory)
    shapes = hf_families.layout(pretrained.maps, pretrained.options["num_layers"])
    weights, stored = pretrained.weights, pretrained.stored_float
    dtype = "float32" if stored is None else np.dtype(stored).name

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        import ml_dtypes

        for name in shapes:
            raw = weights.view(name)  # float32 and float16 as stored; bfloat16 is widened to float32 as converted
            yield name, raw.view(ml_dtypes.bfloat16) if raw.dtype == np.uint16 else raw
            del raw

    return Source(config, pretrained.directory, shapes, tensors, pretrained.directory.name, pretrained.directory,
                  dtype)  # fmt: skip


def from_run(exp: Any, params: Mapping[str, Any], tokenizer: Any, files: Path, name: str) -> Source:
    """A run's parameters (host arrays by path, adapters included: merged here), as the family it exports as.
    `files` is an empty directory that receives the config.json and tokenizer files its Hugging Face export would
    have (a pretrained model's `tokenizer.model` too)."""
    from nnx_cli.hf import export as hf_export
    from nnx_cli.hf import families as hf_families
    from nnx_cli.hf import peft
    from nnx_cli.hf.weights import tensors_of
    from nnx_cli.models.transformer import lora_options

    cfg, pretrained = exp.cfg, exp.pretrained
    options = peft.model_options(cfg, pretrained)
    lora = lora_options(cfg.model.options.get("lora"), options.get("mlp", "gelu"), options.get("moe"))
    params = hf_export.dequantized(params, hf_export.quantized_kernels(exp))  # a 4-bit base (QLoRA): float32 again
    if lora is not None:
        params = hf_export.merged(params, lora.alpha / lora.rank)
    if pretrained is not None:
        from nnx_cli.hf import read_config

        config, maps = read_config(pretrained.directory), pretrained.maps
        stored = config.get("dtype") or config.get("torch_dtype") or "float32"
        if (pretrained.directory / "tokenizer.model").is_file():
            shutil.copy2(pretrained.directory / "tokenizer.model", files / "tokenizer.model")
    else:
        hf_families.architecture_of(options)  # options no family has: a UserError
        vocab = options["vocab_size"]
        eod = getattr(tokenizer, "eod_id", None)
        eos = eod if eod is not None and eod < vocab else None
        config = hf_families.config_json(options, vocab_size=vocab, context=cfg.data.seq_len, bos=None, eos=eos,
                                         dtype="float32")  # fmt: skip
        architecture = config["architectures"][0]
        names = ["transformer.wte.weight"] if architecture == hf_families.GPT2 else []
        family = hf_families.FAMILIES[architecture]
        maps = family.tensors(family.options(hf_families.Config(config, "config.json")), names)
        stored = "float32"
    (files / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf_export._write_tokenizer(files, cfg, pretrained, tokenizer, config)
    shapes = hf_families.layout(maps, options["num_layers"])
    card = pretrained.directory if pretrained is not None else None
    return Source(config, files, shapes, lambda: tensors_of(params, maps, release=True), name, card, stored)


# Writing
# ------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Planned:
    """One GGUF tensor: its Hugging Face sources (several for stacked experts), shape, type and size."""

    name: str
    sources: list[str]
    shape: tuple[int, ...]  # numpy order (the reverse of GGUF's)
    qtype: Any = None
    nbytes: int = 0


def write(source: Source, out: Path, dtype: str | None = None, *, overwrite: bool = False) -> dict[str, Any]:
    """Write `source` to `out` as a GGUF file of type `dtype` (:data:`DTYPES`; default :func:`default_dtype`).
    Returns what was written: `{"architecture", "dtype", "tensors", "bytes"}`. What makes it impossible is a
    UserError raised before `out` is touched; a failure while writing leaves `out` as it was (a write the disk
    refuses is a RunError naming `out` and why)."""
    gguf = require()
    check_dtype(dtype)
    check_out(out, overwrite)
    dtype = dtype or default_dtype(source.stored)
    # a run from scratch has no config.json of its own: the one in `files` is written from its options
    where = str(source.card / "config.json") if source.card is not None else "the run's model options"
    arch, hp = families.arch_of(source.architecture, source.config, where)
    vocab_size = source.config.get("vocab_size")
    vocab = Vocab.read(source.files, vocab_size=vocab_size, architecture=source.architecture)
    plan, extra = _plan(arch, hp, source, dtype, gguf)

    writer = gguf.GGUFWriter(path=None, arch=arch.name)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    total, shared, expert, count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, source.card, None, total)
    if metadata.name is None:
        metadata.name = source.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, count)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)
    quiet = logging.getLogger("gguf.gguf_writer")
    level, quiet.level = quiet.level, logging.ERROR  # Gemma 3's keys are written twice, as the converter does
    try:
        arch.hparams(hp, writer)
    finally:
        quiet.setLevel(level)
    writer.add_file_type(_FILE_TYPES[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.write(writer)

    # A new file in a private directory, not one made by mkstemp and reopened: gguf-py opens its path "wb", and
    # ext4 (auto_da_alloc) flushes a file truncated that way when it is closed, ~1 s of a 2 GB export's time
    with _writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    partial = staging / out.name
    try:
        with _writing(out):
            writer.write_header_to_file(path=partial)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
        _write_tensors(writer, arch, hp, source, plan, extra, gguf, out)
        with _writing(out):
            writer.close()
        usual_mode(partial)
        os.replace(partial, out)
    except BaseException:
        with contextlib.suppress(OSError):  # what is left in its buffer, on a full disk
            writer.close()
        partial.unlink(missing_ok=True)
        raise
    finally:
        staging.rmdir()
    return {"architecture": arch.name, "dtype": dtype, "tensors": len(plan), "bytes": out.stat().st_size,
            "notes": families.differences(source.architecture, hp)}  # fmt: skip


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """An OSError of the writes inside (a full disk, a file size limit) as a RunError naming `out` (exit 1, as a
    Hugging Face export's failed write is: the input was fine), in the same words."""
    try:
        yield
    except OSError as e:
        raise RunError(cannot_write(out, e)) from None


def _plan(arch: families.Arch, hp: families.HParams, source: Source, dtype: str,
          gguf: Any) -> tuple[list[_Planned], dict[str, np.ndarray]]:  # fmt: skip
    """The GGUF tensors in the order they are completed as the source yields its tensors (experts stacked once
    the last one has come), after the tensors made from the config (llama3's `rope_freqs`)."""
    extra = {}
    if arch.name == "llama" and (factors := families.rope_freqs(hp)) is not None:
        extra["rope_freqs.weight"] = factors
    plan = [_Planned(name, [], value.shape) for name, value in extra.items()]
    mapped = {name: arch.tensor_name(name) for name in source.shapes}
    expected: dict[str, int] = {}
    for target in (m[0] for m in mapped.values() if m is not None):
        expected[target] = expected.get(target, 0) + 1
    groups: dict[str, _Planned] = {}
    for name, shape in source.shapes.items():
        if mapped[name] is None:
            continue
        target, expert = mapped[name]
        if target not in groups:
            shape = tuple(reversed(shape)) if arch.transpose and name.endswith(arch.transpose) else tuple(shape)
            groups[target] = _Planned(target, [], shape)
        group = groups[target]
        group.sources.append(name)
        if len(group.sources) == expected[target]:
            if expert is not None:
                group.shape = (len(group.sources), *group.shape)
            plan.append(group)
    for t in plan:
        t.qtype = _qtype(t.name, t.shape, dtype, gguf)
        t.nbytes = math.prod(gguf.quant_shape_to_byte_shape(t.shape, t.qtype))
    return plan, extra


def _qtype(name: str, shape: tuple[int, ...], dtype: str, gguf: Any) -> Any:
    """The type llama.cpp's converter gives a tensor in a file of type `dtype`: vectors, norms, the router and
    learned positions stay float32; q8_0 falls back to f16 where a row is not a whole number of blocks."""
    q = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(_KEEP_F32) or not name.endswith(".weight"):
        return q.F32
    qtype = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[dtype]
    if qtype == q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0] != 0:
        return q.F16
    return qtype


def _write_tensors(writer: Any, arch: families.Arch, hp: families.HParams, source: Source, plan: list[_Planned],
                   extra: dict[str, np.ndarray], gguf: Any, out: Path) -> None:  # fmt: skip
    """Each planned tensor's data, in plan order, as the source's tensors arrive. The file is written on a thread
    of its own (:class:`_Background`), a tensor or two behind: the next tensors are made (an adapter merged,
    a kernel transposed) and converted by XLA while the last ones are written."""
    from nnx_cli.report import progress

    by_source = {s: t for t in plan for s in t.sources}
    parts: dict[str, dict[int, np.ndarray]] = {}  # stacked experts' tensors as they come, by expert
    total = sum(t.nbytes for t in plan)
    with (
        progress(total, "writing the GGUF file", at_least=10**8, in_bytes=True) as advance,
        _Background(writer, advance, out) as background,
    ):

        def emit(t: _Planned, data: np.ndarray, change: families.Change = families.Change()) -> None:
            background.put(_Converted(data, t.qtype, gguf, change))

        for name, data in extra.items():
            emit(by_name(plan, name), data)
        for name, data in source.tensors():
            t = by_source.get(name)
            if t is None:
                continue
            if len(t.sources) == 1:  # any float type: _Converted widens a bfloat16 one as it converts it
                emit(t, data, arch.change(name, hp))
                continue
            experts = parts.setdefault(t.name, {})
            experts[arch.tensor_name(name)[1]] = arch.transform(name, _numpy_float(data), hp)
            if len(experts) == len(t.sources):
                emit(t, np.stack([experts[e] for e in sorted(experts)]))
                del parts[t.name]


class _Background:
    """`writer.write_tensor_data` of each converted tensor given to :meth:`put`, in order, on a thread of its own
    (the write itself leaves Python's lock), at most `depth` tensors behind. What the thread raises is raised
    by the next :meth:`put`, or on leaving (a failed write as a RunError naming `out`); leaving on an error
    stops it at the next tensor."""

    def __init__(self, writer: Any, advance: Callable[[int], None] | None, out: Path, depth: int = 1):
        import queue
        import threading

        self.writer, self.advance, self.out = writer, advance, out
        self.queue: queue.Queue[_Converted | None] = queue.Queue(depth)
        self.error: BaseException | None = None
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="nnx-gguf-write", daemon=True)

    def __enter__(self) -> _Background:
        self.thread.start()
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.stop = kind is not None
        self.queue.put(None)
        self.thread.join()
        if self.error is not None and kind is None:
            raise self.error

    def put(self, converted: _Converted) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(converted)

    def _run(self) -> None:
        while (converted := self.queue.get()) is not None:
            if self.error is not None or self.stop:
                continue  # drained, unwritten, until told to end
            try:
                with _writing(self.out):
                    self.writer.write_tensor_data(converted)
                if self.advance is not None:
                    self.advance(converted.nbytes)
            except BaseException as e:  # raised in the caller's thread
                self.error = e


def _numpy_float(data: np.ndarray) -> np.ndarray:
    """`data` as numpy computes on it here (gguf-py, the experts' transforms): float16 and float32 as they are,
    anything else (bfloat16) widened to float32, exactly."""
    return np.asarray(data) if data.dtype in (np.float16, np.float32) else np.asarray(data, np.float32)


_CHUNK = 16 << 20  # bytes of float32 rows converted at a time
_ON_DEVICE = 1 << 16  # tensors of at least this many values are converted by XLA, smaller ones by gguf-py


class _Converted:
    """A tensor `data` changed (:class:`.families.Change`) and as `qtype`'s bytes: what `change.apply` then
    `gguf.quants.quantize` give, bit for bit. Large tensors are converted by XLA (:func:`_device_quantize`:
    several times faster than numpy, and on every core) a few rows at a time as they are written (quantising
    makes temporaries of its input's size, and an embedding is the largest tensor there is; blocks lie along
    rows, so the bytes are those of one call), the next rows' conversion running while the last are written.
    `gguf.GGUFWriter.write_tensor_data` takes it for the array (it asks `nbytes` and `tofile`)."""

    def __init__(self, data: np.ndarray, qtype: Any, gguf: Any, change: families.Change = families.Change()):
        q = gguf.GGMLQuantizationType
        self.kind = {q.F32: "f32", q.F16: "f16", q.BF16: "bf16", q.Q8_0: "q8_0"}.get(qtype)
        self.change = change
        self.ready: list[Any] = []  # converted chunks, or chunks whose conversion XLA has started
        self.waiting: list[np.ndarray] = []  # rows to convert
        if data.size < _ON_DEVICE or self.kind is None:
            self.ready = [np.ascontiguousarray(gguf.quants.quantize(change.apply(_numpy_float(data)), qtype))]
        elif self.kind == "f32" and change == families.Change() and data.dtype == np.float32:
            self.ready = [np.ascontiguousarray(data)]
        elif change.transpose or change.heads is not None:  # the rows themselves change: whole (small tensors)
            self.ready = [_device_quantize(np.asarray(data), change=change, kind=self.kind)]
        else:
            rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
            step = max(1, _CHUNK // (rows.shape[1] * 4))
            self.waiting = [rows[i : i + step] for i in range(0, rows.shape[0], step)]
            self.ready = [_device_quantize(self.waiting.pop(0), change=change, kind=self.kind)]  # started now
        shape = tuple(reversed(data.shape)) if change.transpose else tuple(data.shape)  # permuted rows keep it
        self.shape = shape if qtype in (q.F32, q.F16) else tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
        self.nbytes = math.prod(gguf.quant_shape_to_byte_shape(shape, qtype))

    def chunks(self) -> Iterator[np.ndarray]:
        """The bytes, a chunk of rows at a time, the next chunk's conversion started before this one is given."""
        while self.ready:
            if self.waiting:
                self.ready.append(_device_quantize(self.waiting.pop(0), change=self.change, kind=self.kind))
            yield _jax_get(self.ready.pop(0))

    def tofile(self, fp: Any) -> None:
        # the file's own write, not ndarray.tofile: tofile's short write is an OSError without its errno (a full
        # disk reads "1024 requested and 728 written"), the file's says why
        for chunk in self.chunks():
            fp.write(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))

    def array(self) -> np.ndarray:
        """The bytes as one array, of `gguf.quants.quantize`'s dtype and shape."""
        return np.concatenate([c.reshape(-1, c.shape[-1]) for c in self.chunks()]).reshape(self.shape)


def _quantized(data: np.ndarray, qtype: Any, gguf: Any, change: families.Change = families.Change()) -> np.ndarray:
    """:class:`_Converted`'s bytes as one array (tests)."""
    return _Converted(data, qtype, gguf, change).array()


def _device_quantize(data: Any, *, change: families.Change, kind: str) -> Any:
    """:func:`_quantized`'s conversion in XLA, compiled once per shape, change and type, equal to gguf-py's bit for
    bit (tests/test_gguf.py compares them on values chosen to break it): float16 is a rounding conversion,
    bfloat16 gguf-py's own integer rounding (its NaNs made quiet), and q8_0 its formula (a scale of
    `max |x| / 127` per 32 values, stored in float16, and each `x * (1 / scale)` rounded half away from zero).
    The scales, one per 32 values, are divided by numpy: XLA turns a division by a broadcast scalar into a
    product with its reciprocal, which rounds differently."""
    import jax

    convert, block_max = _compiled()
    if kind != "q8_0":
        return convert(data, change, kind, None, None)
    data = jax.device_put(data)  # once, for both programs
    scale = _jax_get(block_max(data, change)) / np.float32(127)
    with np.errstate(divide="ignore", over="ignore"):  # a scale past float16's range is inf, as gguf-py's
        inverse = np.where(scale == 0, np.float32(0), np.float32(1) / scale)
        return convert(data, change, kind, scale.astype(np.float16), inverse)


def _jax_get(x: Any) -> np.ndarray:
    import jax

    return np.asarray(jax.device_get(x))


@functools.cache
def _compiled() -> tuple[Callable, Callable]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    def changed(data: Any, change: families.Change, kind: str) -> Any:
        if data.dtype == jnp.bfloat16:  # float32 first, exactly, as the weights reach gguf-py's caller
            data = data.astype(jnp.float32)
        x = change.apply(data)  # in the source's dtype, as gguf-py's caller changes it
        return x.astype(jnp.float32) if kind in ("bf16", "q8_0") else x

    def block_max(data: Any, change: families.Change) -> Any:
        return jnp.max(jnp.abs(changed(data, change, "q8_0").reshape(-1, 32)), axis=1, keepdims=True)

    def convert(data: Any, change: families.Change, kind: str, d: Any, inverse: Any) -> Any:
        x = changed(data, change, kind)
        if kind == "f32":
            return x.astype(jnp.float32)
        if kind == "f16":
            return x.astype(jnp.float16)
        if kind == "bf16":
            n = lax.bitcast_convert_type(x, jnp.uint32)
            u = functools.partial(jnp.asarray, dtype=jnp.uint32)
            n = jnp.where((n & u(0x7FFFFFFF)) > u(0x7F800000), (n & u(0xFFFF0000)) | u(64 << 16), n)  # NaNs quiet
            n = (n + (u(0x7FFF) + ((n >> 16) & u(1)))) >> 16  # to nearest even: no overflow once NaNs are quiet
            halves = lax.bitcast_convert_type(n.astype(jnp.uint16), jnp.uint8)  # [..., n, 2]
            return halves.reshape(*x.shape[:-1], -1)
        v = x.reshape(-1, 32) * inverse
        a = jnp.abs(v)
        whole = jnp.floor(a)
        rounded = jnp.sign(v) * (whole + jnp.floor(2 * (a - whole)))  # half away from zero, as C's roundf
        qs = lax.bitcast_convert_type(rounded.astype(jnp.int8), jnp.uint8)
        scales = lax.bitcast_convert_type(d, jnp.uint8).reshape(-1, 2)
        return jnp.concatenate([scales, qs], axis=1).reshape(*x.shape[:-1], -1)

    return jax.jit(convert, static_argnums=(1, 2)), jax.jit(block_max, static_argnums=(1,))


def human_size(size: float) -> str:
    """`123.4 MB`."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1000
    return f"{size:.1f} GB"


def by_name(plan: list[_Planned], name: str) -> _Planned:
    return next(t for t in plan if t.name == name)
