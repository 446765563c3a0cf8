"""Safetensors files written tensor by tensor: what the Hugging Face export and the GGUF reader's stand-in model
directories write.

:func:`write_safetensors` writes each file's header first (every shape is known up front) and then each tensor's
bytes as it comes, so only the tensor being written is held in memory; above `shard_bytes` it shards the files
and writes the index `transformers` reads::

    write_safetensors(Path("out"), {"w": (2, 3)}, iter([("w", np.zeros((2, 3)))]), "bfloat16")   # ["model.safetensors"]

It sits outside `hf/` so that the GGUF reader, which the `hf` package itself calls for a `.gguf` TARGET, can write
one without importing `hf`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

SHARD_BYTES = 5 * 10**9  # what transformers' save_pretrained writes by default: larger models are sharded

_NUMPY = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16, "uint8": np.uint8}
_SAFETENSORS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8"}


def numpy_dtype(dtype: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(_NUMPY[dtype])


def write_safetensors(directory: Path, shapes: Mapping[str, tuple[int, ...]], tensors: Iterable[tuple[str, Any]],
                      dtype: str, *, shard_bytes: int = SHARD_BYTES, prefix: str = "model",
                      advance: Callable[[int], None] | None = None,
                      dtypes: Mapping[str, str] | None = None) -> list[str]:  # fmt: skip
    """Write `tensors` ((name, array) pairs in the order of `shapes`, each cast to `dtype`, or to its own in
    `dtypes`) as `prefix.safetensors`, or as shards `prefix-0000i-of-0000n.safetensors` with
    `prefix.safetensors.index.json` when they exceed `shard_bytes`. Each file's header is written first (the shapes
    are known) and then each tensor's bytes as it comes: only the tensor being written is held. `advance(n)` is
    called with each tensor's bytes. Returns the files written."""
    dtypes = {name: (dtypes or {}).get(name, dtype) for name in shapes}
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * numpy_dtype(dtypes[name]).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    count = len(shards)
    files = [f"{prefix}.safetensors"] if count == 1 else [
        f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]  # fmt: skip
    stream = iter(tensors)
    for file, names in zip(files, shards):
        _write_file(directory / file, {n: tuple(shapes[n]) for n in names}, stream, dtypes, advance)
    if count == 1:
        return files
    index = {
        "metadata": {
            "total_parameters": sum(math.prod(s) for s in shapes.values()),
            "total_size": sum(math.prod(s) * numpy_dtype(dtypes[n]).itemsize for n, s in shapes.items()),
        },
        "weight_map": {name: file for file, names in zip(files, shards) for name in names},
    }
    (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*files, f"{prefix}.safetensors.index.json"]


def _write_file(path: Path, shapes: dict[str, tuple[int, ...]], stream: Iterator[tuple[str, Any]],
                dtypes: Mapping[str, str], advance: Callable[[int], None] | None) -> None:  # fmt: skip
    """One safetensors file: an 8-byte little-endian header length, the JSON header (padded with spaces to a
    multiple of 8 bytes, as `safetensors` pads it), then the tensors' bytes back to back in header order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * numpy_dtype(dtypes[name]).itemsize
        header[name] = {"dtype": _SAFETENSORS[dtypes[name]], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for expected, shape in shapes.items():
                name, array = next(stream)
                array = np.asarray(array)
                if name != expected or array.shape != shape:  # a tensor table that disagrees with itself
                    raise AssertionError(f"tensor {name!r} {array.shape} came where {expected!r} {shape} belongs")
                target = numpy_dtype(dtypes[name])
                data = np.ascontiguousarray(array.astype(target, copy=False))  # a view's own bytes, in order
                f.write(data.reshape(-1).view(np.uint8).data)
                if advance is not None:
                    advance(data.nbytes)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e


def usual_mode(path: Path) -> None:
    """Give `path` (a file, or a directory and everything in it) the permissions that `open` and `mkdir` give
    under the process's umask. `tempfile.mkstemp` and `mkdtemp` make theirs private (0600 / 0700), and an export
    staged in one and renamed into place would keep that: a llama.cpp server run as another user could not read
    the file."""
    umask = os.umask(0)
    os.umask(umask)
    if path.is_dir():
        path.chmod(0o777 & ~umask)
        for child in path.rglob("*"):
            child.chmod((0o777 if child.is_dir() else 0o666) & ~umask)
    else:
        path.chmod(0o666 & ~umask)
