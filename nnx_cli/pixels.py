"""An image column decoded into pixel arrays, a chunk of rows at a time: the work of the image cache's decoders.

:mod:`nnx_cli.data.images` decodes a split once, in worker processes (`data.workers`, one per core), each task
a chunk of rows. This module is what a worker imports: numpy, PIL and pyarrow, nothing of JAX, Grain or
`datasets` (a Grain worker importing JAX and unpickling a `datasets.Dataset` took seconds to start, more than
decoding MNIST's 70,000 PNGs takes on one core). :class:`ArrowImages` travels to a worker as the file names of
the dataset's Arrow cache and memory-maps them there; :class:`DatasetImages` carries the dataset itself, for
datasets that have no such files (built in memory, or a selection of rows)::

    chunks = ArrowImages(["train.arrow"], "image", rows=1024)
    pixels, shapes = chunks(0)          # uint8 [1024, 28, 28], [(28, 28)]
    for pixels, shapes in decoded(chunks, 59, workers=16): ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import io
import itertools
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from nnx_cli.errors import UserError, first_line

Chunk = tuple[np.ndarray | None, list[tuple[int, ...]]]
"""A decoded chunk: the stacked pixels when every image has the same shape (else None), and the shapes met."""


def _stacked(images: list[np.ndarray]) -> Chunk:
    shapes = sorted({p.shape for p in images})
    return (np.stack(images) if len(shapes) == 1 else None), shapes


# Modes whose pixel values are not colour levels: a palette's indices (pngquant's output, GIFs, masks), 1-bit
# booleans, print and other colour spaces. Each becomes the mode that holds what it shows.
_INDIRECT = {"P": "RGB", "PA": "RGBA", "1": "L", "CMYK": "RGB", "YCbCr": "RGB", "LAB": "RGB", "HSV": "RGB"}


def _direct(img: Any) -> Any:
    """`img` in a mode whose values are its colours (a palette with transparency keeps it, as RGBA)."""
    mode = _INDIRECT.get(img.mode)
    if mode is None:
        return img
    if img.mode == "P" and "transparency" in img.info:
        mode = "RGBA"
    return img.convert(mode)


def decode_image(data: bytes | None, path: str | None, key: str = "image", row: int = 0) -> np.ndarray:
    """One encoded image (PNG, JPEG, ... as PIL reads them), from its bytes or else its file, as an array; a
    missing or undecodable one is a UserError naming row `row` of column `key` (and its file)."""
    from PIL import Image

    if data is None and path is None:
        raise UserError(
            f"config key 'data.image_key': row {row} of column {key!r} holds no image; drop the rows without one"
        )
    try:
        with Image.open(io.BytesIO(data) if data is not None else path) as img:
            return np.asarray(_direct(img))
    except (OSError, SyntaxError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
        where = f"row {row} of column {key!r}" + (f" ({path})" if path else "")
        raise UserError(
            f"config key 'data.image_key': the image of {where} cannot be decoded ({type(e).__name__}: "
            f"{first_line(e)}); replace or remove it"
        ) from None


class ArrowImages:
    """Rows `[i * rows, (i + 1) * rows)` of an image column (`{bytes, path}` structs) read from Arrow stream
    files, the dataset's rows in order, memory-mapped on first use in each process."""

    def __init__(self, files: list[str], column: str, rows: int):
        self.files, self.column, self.rows = files, column, rows
        self._table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}  # the file names travel; each process maps them itself

    def table(self) -> Any:
        """The files as one pyarrow Table (memory-mapped: nothing is read until a row is)."""
        if self._table is None:
            import pyarrow as pa

            self._table = pa.concat_tables([pa.ipc.open_stream(pa.memory_map(f)).read_all() for f in self.files])
        return self._table

    def __call__(self, index: int) -> Chunk:
        images = self.table().column(self.column).slice(index * self.rows, self.rows).combine_chunks()
        data, paths = images.field("bytes").to_pylist(), images.field("path").to_pylist()
        valid = images.is_valid().to_pylist()  # a null image: no struct at all
        first = index * self.rows
        return _stacked([decode_image(d if ok else None, p if ok else None, self.column, first + i)
                         for i, (d, p, ok) in enumerate(zip(data, paths, valid, strict=True))])  # fmt: skip


class DatasetImages:
    """Rows `[i * rows, (i + 1) * rows)` of column `key` of a `datasets.Dataset`: images (`datasets.Image`)
    decoded, arrays as they are."""

    def __init__(self, ds: Any, key: str, rows: int):
        import datasets

        self.is_image = isinstance(ds.features[key], datasets.Image)
        self.ds = ds.cast_column(key, datasets.Image(decode=False)) if self.is_image else ds.with_format("numpy")
        self.key = key
        self.rows = rows

    def __call__(self, index: int) -> Chunk:
        stop = min((index + 1) * self.rows, len(self.ds))
        column = self.ds[index * self.rows : stop][self.key]
        if not self.is_image:
            pixels = np.asarray(column)
            return pixels, [pixels.shape[1:]]
        first = index * self.rows
        return _stacked([decode_image(*((item.get("bytes"), item.get("path")) if item else (None, None)), self.key,
                                      first + i) for i, item in enumerate(column)])  # fmt: skip


_TASK: Callable[[int], Any] | None = None  # a worker's task, set once when it starts


def _start(task: Callable[[int], Any]) -> None:
    global _TASK
    _TASK = task


def _run(index: int) -> Any:
    assert _TASK is not None
    return _TASK(index)


def decoded(task: Callable[[int], Chunk], chunks: int, workers: int) -> Iterator[Chunk]:
    """`task(i)` for each `i` in `range(chunks)`, in order: in `workers` spawned processes (each given `task`
    once, two chunks ahead of the caller per worker), or in this process with 0 workers or one chunk."""
    if workers == 0 or chunks == 1:
        yield from map(task, range(chunks))
        return
    workers = min(workers, chunks)
    spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX's threads
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn, initializer=_start, initargs=(task,))
    try:
        indices = iter(range(chunks))
        pending = collections.deque(pool.submit(_run, i) for i in itertools.islice(indices, 2 * workers))
        while pending:
            yield pending.popleft().result()
            for i in itertools.islice(indices, 1):
                pending.append(pool.submit(_run, i))
    finally:
        pool.shutdown(cancel_futures=True)
