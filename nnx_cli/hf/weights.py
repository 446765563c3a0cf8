"""Safetensors weights of a model directory: checked without reading a tensor, then streamed into place.

`model.safetensors`, or the shards `model.safetensors.index.json` names, are
opened with `safetensors.safe_open` (which memory-maps them and checks each
header against the file's size). :meth:`Weights.check` compares every tensor
with the family's table before anything is written anywhere: a missing,
unexpected or misshapen tensor, an unsupported dtype, a truncated file or a
header that does not parse is a UserError naming the file and the tensor.

:func:`load` then builds each parameter with `jax.make_array_from_callback`:
the callback of each device's shard reads only that shard's rows and
columns of the tensor (`get_slice`), converts them to float32 and, for
layers stacked along a `layers` axis, fills them in layer by layer. Host
memory peaks near one parameter's shard, not the model, and each process of
a multi-host run reads only what its devices hold::

    weights = Weights.open(model_dir)
    maps = weights.check(family, options)             # every tensor accounted for, nothing read yet
    params = load(weights, maps, abstract_params)     # a State of Param, each array in its NamedSharding
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from nnx.nn.quantize import quantize_kernel
from nnx_cli.errors import UserError
from nnx_cli.hf import bnb
from nnx_cli.hf.families import Family, TensorMap

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("F32", "BF16", "F16")
_LAYERS = "layers/scan_module/"
_HASH_BUFFER = 8 << 20
_BAND = 64  # columns of `out` per band of a transposed conversion
_MAPPED = 1 << 20  # bytes from which a parameter buffer is its own memory map
_PREFAULT = 4 << 20  # bytes of a buffer faulted in at a time ahead of the conversions


class Weights:
    """The tensors of a model directory: name -> the file holding it, its dtype and its shape."""

    def __init__(self, directory: Path, files: dict[str, Path]):
        self.directory = directory
        self.files = files  # tensor name -> file
        self._info: dict[str, tuple[str, tuple[int, ...]]] = {}  # tensor name -> (dtype, shape), from the headers
        self._starts: dict[str, int] = {}  # tensor name -> the byte where its data starts in its file
        self.bnb: bnb.Tensors | None = None  # the bitsandbytes 4-bit weights among them
        self._floats: dict[str, tuple[str, tuple[int, ...]]] = {}  # a 4-bit weight's (dtype, shape) as floats

    @classmethod
    def open(cls, directory: str | Path, single: str = SINGLE, index_name: str = INDEX) -> Weights:
        """Find the directory's safetensors files (`single`, or the shards `index_name` lists) and read their
        headers (no tensor data)."""
        directory = Path(directory)
        index = directory / index_name
        if index.is_file():
            files = _read_index(index)
        elif (directory / single).is_file():
            files = None
        else:
            raise UserError(
                f"model directory {str(directory)!r} has neither {single} nor {index_name}; nnx reads safetensors "
                "weights only (convert PyTorch .bin files with transformers' save_pretrained)"
            )
        weights = cls(directory, {})
        shards = sorted(set(files.values())) if files is not None else [single]
        for shard in shards:
            path = directory / shard
            with _open(path) as handle:  # checks the header against the file, or says what is wrong
                names = list(handle.keys())
            length, header = _header(path)
            for name in names:
                if files is not None and files.get(name) != shard:
                    raise UserError(
                        f"{path}: tensor {name!r} is not where {INDEX} says it is ({files.get(name, 'not listed')})"
                    )
                weights.files[name] = path
                weights._info[name] = (header[name]["dtype"], tuple(header[name]["shape"]))
                weights._starts[name] = 8 + length + header[name]["data_offsets"][0]
        if files is not None:
            missing = sorted(set(files) - set(weights.files))
            if missing:
                raise UserError(f"{index}: lists tensor {missing[0]!r} in {files[missing[0]]}, which lacks it")
        weights.bnb = bnb.Tensors(weights.files, weights.info, lambda name: np.asarray(weights._raw(name)))
        for name, state in weights.bnb.states.items():  # a 4-bit weight reads as the float weight it holds
            weights._floats[name] = (state.dtype, state.shape)
        return weights

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """`(dtype, shape)` of tensor `name` as its header says (`"BF16"`, `(896, 4864)`); of a bitsandbytes 4-bit
        weight, those of the float weight it holds (its quant state's)."""
        return self._floats.get(name) or self._info[name]

    def check(self, family: Family, options: Mapping[str, Any], tie_ignores_head: bool = True) -> list[TensorMap]:
        """The family's tensor maps for `options`, each tensor present with the shape `config.json` implies and a
        float dtype; every tensor in the files accounted for. Reads headers only."""
        num_layers = options["num_layers"]
        maps = family.tensors(options, self.files)
        expected: dict[str, tuple[int, ...]] = {name: m.shape for m in maps for name in m.names(num_layers)}
        for name, shape in expected.items():
            if name not in self.files:
                raise UserError(
                    f"{self._where(name)}: tensor {name!r} is missing (config.json describes a "
                    f"{family.architecture} that needs it)"
                )
            dtype, actual = self.info(name)
            if actual != shape:
                raise UserError(
                    f"{self.files[name]}: tensor {name!r} has shape {list(actual)}, but config.json implies "
                    f"{list(shape)}"
                )
            if dtype not in DTYPES:
                raise UserError(
                    f"{self.files[name]}: tensor {name!r} is stored as {dtype}; nnx reads float32, bfloat16 and float16"
                )
        for name in sorted(self.files):
            ignorable = name.endswith(family.ignored) or (
                tie_ignores_head and options.get("tie_embeddings") and name == "lm_head.weight"
            )
            if name not in expected and not ignorable and self.bnb.auxiliary(name) is None:
                raise UserError(
                    f"{self.files[name]}: unexpected tensor {name!r}: a {family.architecture} with this config.json "
                    "has no such weight"
                )
        return maps

    def _where(self, name: str) -> str:
        shards = sorted({str(p) for p in self.files.values()})
        return shards[0] if len(shards) == 1 else str(self.directory / INDEX)

    def view(self, name: str) -> np.ndarray:
        """Tensor `name` as a read-only memory map of its bytes, no copy: `uint16` for bfloat16 (the upper half of
        a float32), else its float dtype. Convert with :func:`convert`.

        `safetensors`' own `get_slice` copies every block into a new array; a view of the mapped file lets
        each block be converted straight into the parameter's buffer instead. Each view maps only its tensor,
        and its pages leave this process's memory once the view is dropped.
        """
        if name in self.bnb.states:  # a bitsandbytes 4-bit weight, dequantised
            return bnb.dequantized(self.bnb.states[name], lambda n: np.asarray(self._raw(n)), name)
        return self._raw(name)

    def _raw(self, name: str) -> np.ndarray:
        dtype, shape = self._info[name]
        return np.memmap(self.files[name], dtype=_RAW[dtype], mode="r", offset=self._starts[name], shape=shape)

    def read_rows(self, name: str, rows: slice, out: np.ndarray) -> bool:
        """Rows `rows` of 2-D tensor `name` (whole rows) read from its file straight into `out`, a C-contiguous
        array of the tensor's own type (its bits: `uint16` or bfloat16 for bfloat16), without mapping the file: the
        pages of a mapped tensor count in this process's memory until they are unmapped, an embedding's
        hundreds of MB at once. False (nothing read) when the tensor is stored in another type."""
        if name in self.bnb.states or not out.flags.c_contiguous:
            return False
        dtype, shape = self._info[name]
        if len(shape) != 2 or _BITS.get(out.dtype, out.dtype) != _RAW[dtype]:
            return False
        start, stop, _ = rows.indices(shape[0])
        assert out.size == (stop - start) * shape[1], (out.shape, rows, shape)
        where = self._starts[name] + start * shape[1] * out.itemsize
        with open(self.files[name], "rb", buffering=0) as f:
            target = memoryview(out.reshape(-1).view(np.uint8))
            while target.nbytes:
                done = os.preadv(f.fileno(), [target], where)
                if done <= 0:
                    raise UserError(f"{self.files[name]}: ends inside tensor {name!r} (a truncated file)")
                target, where = target[done:], where + done
        return True

    def quantized(self, name: str, type: str, block: int, double: bool) -> dict[str, np.ndarray] | None:
        """Tensor `name`'s `nnx.QuantizedKernel` parts as stored, when it is a bitsandbytes 4-bit weight quantised
        as `type`, `block`, `double` say (else None: it is read as floats and quantised here)."""
        state = self.bnb.states.get(name)
        if state is None or (state.type, state.block, state.double) != (type, block, double):
            return None
        return bnb.parts(state, lambda n: np.asarray(self._raw(n)), name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of tensor `name` (one slice per axis), as a new float32 array."""
        raw = self.view(name)[index]
        out = np.empty(raw.shape, np.float32)
        convert(raw, out)
        return out

    def paths(self) -> list[Path]:
        """The files the tensors come from, in order."""
        return sorted(set(self.files.values()))


_RAW = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8}
_BITS = {np.dtype(np.float16): np.float16, np.dtype(ml_dtypes.bfloat16): np.uint16}  # a 16-bit dtype's raw view


def convert(raw: np.ndarray, out: np.ndarray, zeroed: bool = False) -> None:
    """Write `raw` (a :meth:`Weights.view` block, any strides) into the float32 array `out` of the same shape (or
    into a 16-bit one: the bits as they are from a tensor stored in its type, else rounded from float32).

    bfloat16 is the upper half of a float32. Into an `out` that holds zeros (`zeroed`: fresh pages do), it is
    copied there as 16-bit values, the lower halves left as they are: about 0.7x the time of widening every
    value with a shift. A transposed view (PyTorch's `[out, in]` read as our `[in, out]`) is converted in
    bands of `_BAND` columns of `out`: each band reads one short run from each of `_BAND` rows of the tensor,
    few enough to stay in the first-level cache until their next runs are read (wider bands collide in the
    cache, narrower ones spend their time in NumPy's per-row overhead). That is about 1.6x faster than
    converting the whole view at once, and still about 2.5x the time of a straight conversion.
    """
    if out.dtype != np.float32 and raw.dtype != _BITS.get(out.dtype):  # to 16 bits from another type: rounded
        wide = np.empty(raw.shape, np.float32)
        convert(raw, wide)
        out[...] = wide.astype(out.dtype)
        return
    if out.dtype != np.float32:  # a 16-bit parameter from a tensor of its own type: its bits, copied
        half = out.view(raw.dtype)
    else:
        half = _upper_halves(out) if zeroed and raw.dtype == np.uint16 else None
    if raw.ndim == 2 and raw.shape[1] > _BAND and raw.strides[0] < raw.strides[1]:
        for start in range(0, raw.shape[1], _BAND):
            band = slice(start, start + _BAND)
            if half is not None:
                np.copyto(half[:, band], raw[:, band])
            else:
                _convert(raw[:, band], out[:, band])
    elif half is not None:
        np.copyto(half, raw)
    else:
        _convert(raw, out)


def _upper_halves(out: np.ndarray) -> np.ndarray | None:
    """The upper 16 bits of each float32 of `out`, as a `uint16` view (None when its last axis is strided)."""
    if out.ndim == 0 or out.strides[-1] != out.itemsize:
        return None
    return out.view(np.uint16)[..., 1 if sys.byteorder == "little" else 0 :: 2]


def _convert(raw: np.ndarray, out: np.ndarray) -> None:
    if raw.dtype == np.uint16:  # bfloat16 is the upper half of a float32: shift it there, one pass
        np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, raw, casting="safe")


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """The header's length and its JSON (what `safe_open` has already checked)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return length, json.loads(f.read(length))


def _open(path: Path) -> Any:
    """`safe_open` of one weights file (which checks its header against its size); a UserError naming the file
    when it is missing, truncated or unparsable."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise UserError(f"{path}: the weights file is missing")
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({_explain(path, e)})") from None


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{index}: not a readable safetensors index (expected a 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index}: 'weight_map' must map tensor names to shard file names")
    for shard in set(weight_map.values()):
        if Path(shard).name != shard:
            raise UserError(f"{index}: shard {shard!r} is not a file name in the model directory")
    return weight_map


def _explain(path: Path, error: Exception) -> str:
    """safetensors' reason, and for a truncated file the first tensor whose data lies past its end."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                return f"{reason}: the header claims {length} bytes and the file has {size}"
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        return reason
    tensors = sorted(
        ((n, t) for n, t in header.items() if n != "__metadata__" and isinstance(t, dict)),
        key=lambda item: item[1].get("data_offsets", [0, 0])[1],
    )
    for name, tensor in tensors:
        end = 8 + length + tensor.get("data_offsets", [0, 0])[1]
        if end > size:
            return f"{reason}: truncated, tensor {name!r} ends at byte {end:,} of a {size:,}-byte file"
    return reason


# Streaming the tensors into sharded parameters
# ------------------------------------------------------------------------------


def _layer_and_path(path: str) -> tuple[bool, int | None, str]:
    """`(stacked, layer, path within a block)` of one of our parameter paths; non-layer paths as they are."""
    if path.startswith(_LAYERS):
        return True, None, path[len(_LAYERS) :]
    parts = path.split("/")
    if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit():
        return False, int(parts[1]), "/".join(parts[2:])
    return False, None, path


def block(
    weights: Weights,
    m: TensorMap,
    layer: int | None,
    ours: tuple[int, ...],
    index: tuple[slice, ...],
    out: np.ndarray,
    expert: int | None = None,
) -> None:
    """Fill `out` (float32 or 16-bit, all zeros) with the block `index` of our (unstacked) parameter of shape
    `ours` (of one expert for a map of stacked experts), read from its tensor."""
    name = m.name.format(i=layer, e=expert)
    rows_shape, cols_shape = ours[: m.split], ours[m.split :]
    row_index, col_index = index[: m.split], index[m.split :]
    # Whole sub-rows and sub-columns: the leading axis of each side is sliced on disk, the others in memory.
    (r0, r1), row_inner = _span(rows_shape, row_index)
    (c0, c1), col_inner = _span(cols_shape, col_index)
    whole = all(s.indices(n) == (0, n, 1) for s, n in zip(row_inner + col_inner, rows_shape[1:] + cols_shape[1:]))
    direct = whole and out.flags.c_contiguous  # then `out` itself is the block's matrix: no copy
    matrix = out.reshape(r1 - r0, c1 - c0) if direct else np.zeros((r1 - r0, c1 - c0), out.dtype)
    theirs = m.shape if len(m.shape) == 2 else (1, m.shape[0])
    view_rows, view_cols = (theirs[1], theirs[0]) if m.transpose else theirs
    rr1, cc1 = min(r1, view_rows), min(c1 + m.offset, view_cols) - m.offset
    if rr1 > r0 and cc1 > c0:  # rows and columns past the tensor's (the padded vocabulary) stay zero
        rows, cols = slice(r0, rr1), slice(c0 + m.offset, cc1 + m.offset)
        whole_rows = len(m.shape) == 2 and not m.transpose and (cols.start, cols.stop, c1) == (0, view_cols, cc1)
        if not (whole_rows and weights.read_rows(name, rows, matrix[: rr1 - r0])):
            tensor = weights.view(name)
            if len(m.shape) == 1:
                raw = tensor[cols][None, :]
            else:
                raw = tensor[cols, rows].T if m.transpose else tensor[rows, cols]
            convert(raw, matrix[: rr1 - r0, : cc1 - c0], zeroed=True)
            del tensor, raw  # unmapped
    if not direct:
        blocked = matrix.reshape(*_block_shape(rows_shape, row_index), *_block_shape(cols_shape, col_index))
        inner = (slice(None), *row_inner, slice(None), *col_inner) if rows_shape else (slice(None), *col_inner)
        out[...] = blocked[inner] if rows_shape or cols_shape else blocked.reshape(())


def _span(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[tuple[int, int], tuple[slice, ...]]:
    """The flat range covering `index` with the trailing axes whole, and the slices of those axes left to apply."""
    if not shape:
        return (0, 1), ()
    inner = math.prod(shape[1:])
    start, stop, _ = index[0].indices(shape[0])
    return (start * inner, stop * inner), tuple(index[1:])


def _block_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    if not shape:
        return ()
    start, stop, _ = index[0].indices(shape[0])
    return (stop - start, *shape[1:])


def load(
    weights: Weights, maps: list[TensorMap], abstract: Any, progress: Any = None, quantize: Mapping | None = None
) -> Any:
    """A `State` of `Param`s shaped as `abstract` (whose values are `ShapeDtypeStruct`s carrying shardings),
    filled from the tensors `maps` names; `progress(n)` is called with each parameter's element count.

    The parts of a 4-bit kernel (`nnx.QuantizedParam`s `.../kernel/codes`, `absmax`, ...; `quantize` is
    `model.quantize`) are made together, one layer's (and expert's) weight at a time: a bitsandbytes weight
    quantised alike is taken as stored, any other is read as floats and quantised (:func:`quantized_parts`).

    Parameters are filled by a few threads at once (one per core, at most 4): the work is converting mapped
    pages into new float32 buffers, which NumPy does without the GIL, so a load goes about as many times
    faster as there are cores, and holds at most that many tensors beyond the parameters. The float32
    buffers are made first, and one more thread faults their pages in ahead of the conversions
    (:class:`_Prefault`)."""
    from concurrent.futures import ThreadPoolExecutor

    import nnx

    by_path = {m.path: m for m in maps}
    kernels: dict[str, dict[str, str]] = {}  # a 4-bit kernel's path -> {part: parameter path}
    for path in abstract:
        kernel, _, part = path.rpartition("/")
        if part in _PARTS and _layer_and_path(kernel)[2] in by_path:
            kernels.setdefault(kernel, {})[part] = path
        elif _layer_and_path(path)[2] not in by_path:
            raise UserError(f"no tensor of the model directory fills parameter {path!r}")  # a model/table mismatch
    parts_of = {path: kernel for kernel, parts in kernels.items() for path in parts.values()}
    # largest first, so that no thread is left with a big parameter at the end while the others are idle
    order = sorted(abstract, key=lambda p: -math.prod(abstract[p].value.shape))
    buffers = {path: _buffers(abstract[path].value) for path in order if path not in parts_of}
    out = {}
    with (
        _Prefault([b for path in order for b in buffers.get(path, {}).values()]) as memory,
        ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="nnx-load") as pool,
    ):
        jobs = {}
        for kernel, parts in kernels.items():
            stacked, layer, relative = _layer_and_path(kernel)
            specs = {part: abstract[path].value for part, path in parts.items()}
            job = pool.submit(_quantized, weights, by_path[relative], stacked, layer, specs, quantize or {})
            jobs |= {path: (job, part) for part, path in parts.items()}
        for path in order:
            if path not in parts_of:
                stacked, layer, relative = _layer_and_path(path)
                spec = abstract[path].value
                job = pool.submit(_array, weights, by_path[relative], stacked, layer, spec, buffers[path], memory)
                jobs[path] = (job, None)
        jobs = {path: jobs[path] for path in abstract}
        try:
            for path, (job, part) in jobs.items():  # in order: the first failure is the one raised
                value = job.result() if part is None else job.result()[part]
                out[path] = abstract[path].replace(value=value)
                if progress is not None:
                    progress(math.prod(abstract[path].value.shape))
        except BaseException:  # a bad tensor, or ctrl-c: nothing more is read
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return nnx.State(out) if not isinstance(abstract, dict) else out


def lazy(weights: Weights, maps: list[TensorMap], shapes: Mapping[str, Any]) -> dict[str, Lazy]:
    """The parameters `shapes` describes (path -> anything with `shape` and `dtype`), each a :class:`Lazy` reader
    of its tensors rather than an array: what an export that writes them once needs (no 4-bit kernels)."""
    by_path = {m.path: m for m in maps}
    out = {}
    for path, spec in shapes.items():
        stacked, layer, relative = _layer_and_path(path)
        if relative not in by_path:
            raise UserError(f"no tensor of the model directory fills parameter {path!r}")
        out[path] = Lazy(weights, by_path[relative], stacked, layer, tuple(spec.shape), np.dtype(spec.dtype))
    return out


class Lazy:
    """A parameter read from the model directory when indexed: a layer's (and an expert's) slice of a stacked one
    at a time, or whole (`np.asarray`), as :func:`load` would fill it. An export reads each layer as it writes
    it, and never holds the base model: its peak memory is a few tensors, not the model."""

    def __init__(self, weights: Weights, m: TensorMap, stacked: bool, layer: int | None, shape: tuple[int, ...],
                 dtype: np.dtype):  # fmt: skip
        self.weights, self.m, self.stacked, self.layer = weights, m, stacked, layer
        self.shape, self.dtype = shape, dtype
        self.lead = int(stacked) + int(m.experts > 0)  # the layers and experts axes, a tensor per index

    def __getitem__(self, index: int | tuple[int, ...]) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) < self.lead:
            return np.stack([self[(*index, i)] for i in range(self.shape[len(index)])])
        ours = self.shape[self.lead :]
        out = _aligned(ours, dtype=self.dtype)
        layer, expert = self._layer_expert(index)
        block(self.weights, self.m, layer, ours, tuple(slice(None) for _ in ours), out, expert=expert)
        return out

    def stored(self, index: tuple[int, ...]) -> np.ndarray:
        """The tensor `self[index]` is read from (an index into every `lead` axis), as the file lays it out, in
        this parameter's dtype: what :func:`tensors_of` makes of `self[index]` when that is the whole tensor
        (its own padded rows dropped), read in one pass with nothing transposed."""
        layer, expert = self._layer_expert(index)
        name = self.m.name.format(i=layer, e=expert)
        out = _aligned(self.weights.info(name)[1], dtype=self.dtype)
        if not (out.ndim == 2 and self.weights.read_rows(name, slice(None), out)):
            convert(self.weights.view(name), out)
        return out

    def _layer_expert(self, index: tuple[int, ...]) -> tuple[int | None, int | None]:
        assert len(index) == self.lead
        return (index[0] if self.stacked else self.layer), (index[-1] if self.m.experts else None)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[()]
        return whole if dtype is None else whole.astype(dtype)


def _keys(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[tuple[int, int, int], ...]:
    """The block `index` of an array of `shape` as `(start, stop, step)` per axis (devices holding the same
    block have the same key)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n) for s, n in zip(index, shape))


def _buffers(spec: Any) -> dict[tuple, np.ndarray]:
    """The float32 buffers, not yet faulted in, of the blocks of `spec` this process's devices hold (none for
    a 16-bit dtype: those buffers are made as they are filled)."""
    if spec.dtype != np.float32:
        return {}
    shape = tuple(spec.shape)
    out = {}
    for index in spec.sharding.addressable_devices_indices_map(shape).values():
        key = _keys(shape, index)
        if key not in out:
            out[key] = _aligned(tuple(stop - start for start, stop, _ in key), populate=False)
    return out


class _Prefault:
    """A thread that faults in the pages of fresh buffers (those of :func:`_aligned` made with
    `populate=False`), in order, a few MB at a time; :meth:`wait` until a buffer's first bytes are in.

    On two cores, the kernel's work of handing out 2 GB of fresh pages (a Qwen2.5-0.5B's float32 parameters)
    takes about as long as converting the tensors into them, and it contends with itself: two threads fault
    pages in hardly faster than one (0.45 s against 0.54 s for 1.9 GB). One thread faulting the pages in while
    the others only convert keeps both kinds of work going at once; the conversions wait for their pages
    rather than fault them in themselves (benchmarks/hf_load.py: 0.85-0.92 s to 0.79-0.81 s)."""

    def __init__(self, buffers: list[np.ndarray]):
        import threading

        self._mapped = [b for b in buffers if b.nbytes >= _MAPPED]
        self._done = {b.ctypes.data: 0 for b in self._mapped}  # buffer address -> bytes faulted in
        self._changed = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nnx-load-memory", daemon=True)

    def __enter__(self) -> _Prefault:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop = True
        self._thread.join()

    def _run(self) -> None:
        try:
            for buffer in self._mapped:
                flat = buffer.reshape(-1).view(np.uint8)
                for start in range(0, flat.nbytes, _PREFAULT):
                    if self._stop:
                        return
                    _populate(flat[start : start + _PREFAULT])
                    with self._changed:
                        self._done[buffer.ctypes.data] = min(flat.nbytes, start + _PREFAULT)
                        self._changed.notify_all()
        finally:  # stopped, or failed: nobody waits any more (an unpopulated page faults in when written)
            with self._changed:
                self._done = {address: math.inf for address in self._done}
                self._changed.notify_all()

    def wait(self, buffer: np.ndarray, part: np.ndarray) -> None:
        """Until the pages of `buffer` up to the end of `part` (a view into it) are faulted in."""
        end = part.ctypes.data + part.nbytes - buffer.ctypes.data
        with self._changed:
            self._changed.wait_for(lambda: self._done.get(buffer.ctypes.data, math.inf) >= end)


def _array(
    weights: Weights,
    m: TensorMap,
    stacked: bool,
    layer: int | None,
    spec: Any,
    buffers: dict[tuple, np.ndarray],
    memory: _Prefault,
) -> Any:
    import jax

    shape = tuple(spec.shape)
    lead = int(stacked) + int(m.experts > 0)  # the layers and experts axes, each a tensor per index
    ours = shape[lead:]
    done: dict[tuple, np.ndarray] = {}  # devices holding the same block share one read

    def fill(index: tuple[slice, ...]) -> np.ndarray:
        key = _keys(shape, index)
        index = tuple(slice(*k) for k in key)
        if key not in done:
            size = tuple(stop - start for start, stop, _ in key)
            buffer = buffers[key] if key in buffers else _aligned(size, dtype=spec.dtype)
            spans = [range(*k[:2]) for k in key[:lead]]
            layers = spans.pop(0) if stacked else [layer]
            experts = spans.pop(0) if m.experts else [None]
            for j, i in enumerate(layers):  # each layer's (and expert's) tensor straight into its slot
                for k, e in enumerate(experts):
                    where = (j,) * stacked + (k,) * (e is not None)
                    slot = buffer[where]
                    memory.wait(buffer, slot)
                    block(weights, m, i, ours, index[lead:], slot, expert=e)
            done[key] = buffer
        return done[key]

    return jax.make_array_from_callback(shape, spec.sharding, fill, dtype=spec.dtype)


_PARTS = ("codes", "absmax", "nested_absmax", "offset")  # of an nnx.QuantizedKernel


def _quantized(
    weights: Weights, m: TensorMap, stacked: bool, layer: int | None, specs: dict[str, Any], quantize: Mapping
) -> dict[str, Any]:
    """The parts of one 4-bit kernel (stacked over layers and experts as `specs` say), as arrays in their
    shardings: each layer's (and expert's) weight quantised on its own, then dropped."""
    import jax

    codes = specs["codes"].shape
    lead = int(stacked) + int(m.experts > 0)
    fan_in, fan_out = 2 * codes[-2], codes[-1]
    block_size = fan_in // specs["absmax"].shape[-2]
    kind, double = quantize.get("type", "nf4"), "nested_absmax" in specs
    host = {part: _aligned(spec.shape, dtype=spec.dtype) for part, spec in specs.items()}  # taken without a copy
    layers = range(codes[0]) if stacked else [layer]
    experts = range(m.experts) if m.experts else [None]
    flat = dataclasses.replace(m, split=1)  # the whole weight as one [in, out] matrix
    for j, i in enumerate(layers):
        for k, e in enumerate(experts):
            where = (j,) * stacked + (k,) * (e is not None)
            name = m.name.format(i=i, e=e)
            parts = (
                None
                if m.offset or m.shape != weights.info(name)[1]
                else weights.quantized(name, kind, block_size, double)
            )
            if parts is None:
                w = _aligned((fan_in, fan_out))
                block(weights, flat, i, (fan_in, fan_out), (slice(None), slice(None)), w, expert=e)
                parts = quantize_kernel(w, kind, block_size, double)
                del w
            for part, value in parts.items():
                host[part][where] = value
    assert lead == len(codes) - 2
    return {
        part: jax.make_array_from_callback(spec.shape, spec.sharding, lambda index, a=host[part]: a[index])
        for part, spec in specs.items()
    }


def _aligned(shape: tuple[int, ...], alignment: int = 64, populate: bool = True, dtype: Any = np.float32) -> np.ndarray:
    """An array of zeros (float32 unless `dtype` says) whose data starts on an `alignment`-byte boundary: on CPU,
    JAX then takes it as the device buffer without a copy (NumPy's own large arrays start 16 bytes into a page).

    Large ones are private anonymous memory maps (page-aligned, freed with the array), their pages faulted in
    by one call (:func:`_populate`; with `populate=False`, by :class:`_Prefault`), rather than NumPy
    allocations: NumPy asks the kernel for transparent huge pages, and on the 2-core virtual machine the
    benchmarks run on, fresh huge pages come from memory the host has not backed yet: faulting in a fresh 2 GB
    of them took 1.1-3.8 s against 0.45-0.6 s for ordinary pages (0.16 s once the host has backed them). A
    shared map (`mmap`'s default) is slower still: its pages fault in as shared memory, about 1.6x the cost of
    private ones."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if size >= _MAPPED:
        buffer = mmap.mmap(-1, size, **_PRIVATE)
        array = np.frombuffer(buffer, dtype)
        if populate:
            _populate(array)
        return array.reshape(shape)
    raw = np.zeros(size + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + size].view(dtype).reshape(shape)


_PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}  # not Windows
_POPULATE_WRITE = 23  # madvise(2) advice, Linux 5.14 and later


@functools.cache
def _madvise() -> Any:
    """libc's `madvise` through ctypes (which lets go of the GIL while it runs), or None off Linux."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def _populate(array: np.ndarray) -> None:
    """Fault in every page of the fresh map under `array` now, in one call: a third cheaper than faulting them
    one by one as the conversion first writes them. `mmap`'s own MAP_POPULATE would do the same while holding
    the GIL (every other loading thread then waits); `madvise(MADV_POPULATE_WRITE)` through ctypes does not.
    Where the kernel lacks it (before 5.14) the call fails and the pages fault in as they are written."""
    madvise = _madvise()
    if madvise is not None:
        madvise(array.ctypes.data, array.nbytes, _POPULATE_WRITE)


def tensors_of(
    params: Mapping[str, Any], maps: list[TensorMap], *, release: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters (path -> array, `layers` stacked or not) as the family's tensors, one at a time (name,
    array), in name order: the inverse of :func:`load`, padded vocabulary rows dropped. Only the tensor being
    yielded is held beside the parameters. `release`: each parameter is deleted from `params` (a dict) once its
    last tensor is yielded, so that a writer holding the only other reference frees it when written (the
    embedding, whose name comes before the layers', is gone before them)."""
    by_path = {m.path: m for m in maps}
    parts: dict[str, list[tuple[TensorMap, str, tuple[int, ...]]]] = {}  # tensor name -> (map, our path, index)
    for path, value in params.items():
        stacked, layer, relative = _layer_and_path(path)
        m = by_path[relative]
        for j, i in enumerate(range(np.shape(value)[0]) if stacked else [layer]):
            for k, e in enumerate(range(m.experts) if m.experts else [None]):
                index = (j,) * stacked + (k,) * (e is not None)
                parts.setdefault(m.name.format(i=i, e=e), []).append((m, path, index))
    last = {path: name for name in sorted(parts) for _, path, _ in parts[name]}  # path -> its last tensor
    for name in sorted(parts):
        m, path, index = parts[name][0]
        stored = getattr(params[path], "stored", None)  # a reader of the tensor itself (Lazy, a merge on one)
        tensor = stored(index) if stored is not None and len(parts[name]) == 1 and m.offset == 0 else None
        yield name, tensor if tensor is not None else _assembled(params, parts[name])
        tensor = None
        if release:
            for path in {path for _, path, _ in parts[name] if last[path] == name}:
                del params[path]


def _assembled(params: Mapping[str, Any], sources: list[tuple[TensorMap, str, tuple[int, ...]]]) -> np.ndarray:
    """One tensor of the family from the parts of our parameters `sources` names (map, path, index), contiguous:
    safetensors writes an array's buffer as it lies in memory, a transposed view included."""
    view = None
    for m, path, index in sources:
        ours = _part(params[path], index)
        theirs = m.shape if len(m.shape) == 2 else (1, m.shape[0])
        view_rows, view_cols = (theirs[1], theirs[0]) if m.transpose else theirs
        matrix = ours.reshape(math.prod(ours.shape[: m.split]), -1)
        if len(sources) == 1 and m.offset == 0 and matrix.shape == (view_rows, view_cols):
            view = matrix  # the whole tensor: no copy
            break
        if view is None:
            view = np.zeros((view_rows, view_cols), ours.dtype)
        cols = min(matrix.shape[1], view_cols - m.offset)
        view[:, m.offset : m.offset + cols] = matrix[:view_rows, :cols]
    if len(m.shape) == 1:
        return np.ascontiguousarray(view[0])
    return transposed(view) if m.transpose else np.ascontiguousarray(view)


def transposed(matrix: np.ndarray) -> np.ndarray:
    """`matrix.T`, contiguous. XLA's transpose, on every core, for large ones: numpy's copy of a transposed view
    reads across rows and is 2-3x slower (a third of a 0.5B model's export)."""
    if matrix.size < 1 << 16:
        return np.ascontiguousarray(matrix.T)
    return np.asarray(jax.device_get(_transpose(matrix)))


@jax.jit
def _transpose(matrix: jax.Array) -> jax.Array:
    return matrix.T


def _part(value: Any, index: tuple[int, ...]) -> np.ndarray:
    """`value[index]` (one layer's, one expert's) as a host array; a merged adapter makes only that part."""
    return np.asarray(value[index] if index else value)


def to_tensors(params: Mapping[str, Any], maps: list[TensorMap]) -> dict[str, np.ndarray]:
    """:func:`tensors_of`, all at once (small models, tests)."""
    return dict(tensors_of(params, maps))


# Checksums
# ------------------------------------------------------------------------------


def file_checksums(paths: list[Path]) -> dict[str, str]:
    """`{file name: xxh3-128 of its bytes}` of the weight files (about as fast as the disk reads: every read goes
    into one reused buffer, whose pages are faulted in once rather than once per read; 0.18 against 0.29 s for a
    1 GB file in the page cache)."""
    import xxhash

    sums = {}
    buffer = bytearray(_HASH_BUFFER)
    view = memoryview(buffer)
    for path in paths:
        digest = xxhash.xxh3_128()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                digest.update(view[:n])
        sums[path.name] = f"xxh3_128:{digest.hexdigest()}"
    return sums


def checksum(sums: dict[str, str]) -> str:
    """One checksum of all the files from their own (`file_checksums`)."""
    import xxhash

    text = "\n".join(f"{name} {value}" for name, value in sorted(sums.items()))
    return f"xxh3_128:{xxhash.xxh3_128(text.encode()).hexdigest()}"


def iter_tensors(weights: Weights) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of `weights`, whole, as float32 (for tests and tools; the model loads through `load`)."""
    for name in sorted(weights.files):
        _, shape = weights.info(name)
        yield name, weights.read(name, tuple(slice(None) for _ in shape))
