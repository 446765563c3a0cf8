"""Image datasets, decoded once into a uint8 cache, as the splits the training loop reads.

A split is decoded the first time a run asks for it (in `data.workers`
processes, chunk by chunk, straight into a memory-mapped `.npy` file; the
workers import only :mod:`nnx_cli.pixels`, and start in well under a second) and
kept in the array cache (:mod:`nnx_cli.data.cache`), keyed by the source,
the split, `data.image_key`/`data.label_key` and the source's fingerprint.
Every later run memory-maps it: nothing is decoded again, and a dataset
larger than memory is never held whole. Pixels stay in their stored form
(uint8, uint16 as uint16, floats as float32); :meth:`ImageTrainSplit.prepare`
divides by the stored `scale` and applies `data.binarize` inside the jitted
step::

    train = image_train_split(cfg.data, seed=cfg.seed)   # ImageTrainSplit
    rows = train.read(train.epoch_keys(0)[:128])         # {"image": uint8 [128, 28, 28, 1], "label": int32 [128]}
    batch = train.prepare(jax.device_put(rows))          # {"image": float32 in [0, 1], "label": ...}

`data.source` is a Hugging Face Hub id, a local directory or file read
through `datasets` (as in :func:`nnx_cli.data.load_split`), a registered
source (`sklearn:digits`, kept in memory), or your own function given as
`package.module:fn`, imported from the current directory. `fn(split)`
returns a `datasets.Dataset` (decoded and cached like any other), a mapping
of numpy arrays (`image` `[N, ...]` uint8, or float in [0, 1]; optional
int `label` `[N]`), or an :class:`ImageArrays`; it raises `KeyError(split)`
for a split it does not have::

    # my_source.py, beside the config; then data.source=my_source:load
    import numpy as np
    def load(split: str) -> dict[str, np.ndarray]:
        rng = np.random.default_rng({"train": 0, "test": 1}[split])  # KeyError: no such split
        return {"image": rng.integers(0, 256, (512, 32, 32, 3), dtype=np.uint8), "label": rng.integers(0, 10, 512)}
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_cli.config import DataConfig
from nnx_cli.data.base import DataSpec
from nnx_cli.data.cache import cache_root, find_alias, get_or_build, local_fingerprint, record_alias
from nnx_cli.data.pipeline import worker_count
from nnx_cli.errors import UserError, did_you_mean, first_line
from nnx_cli.pixels import ArrowImages, DatasetImages, decoded
from nnx_cli.registry import Registry, is_reference

_SCALES = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0, np.dtype(np.float32): 1.0}
_CHUNK_BYTES = 4 << 20  # decoded pixels per worker task: big enough to amortize the hand-over, small to stay bounded
_PAGE = 4096  # bytes: training rows at least this long are read with pread, not through the memory map
_PROGRESS_FROM = 2_000  # images: decodes this long show their progress (some seconds on one core)
# The revision of what `_build` writes for the same rows, part of every cache key: bumped when it changes, so that
# an entry written by earlier code is decoded again instead of read. 2: labels that are not class indices are
# refused (1 cut fractional labels to integers and kept them in its entries). 3: palette and other indirect modes
# are decoded to their colours (2 kept a palette PNG's colour numbers as one grey channel).
_DECODER = 3


@dataclasses.dataclass(frozen=True)
class ImageArrays:
    """One split in stored form: `image` `[N, H, W, C]` (uint8, uint16 or float32), `label` int32 `[N]` or None.

    Model inputs are `image / scale` (255 for uint8, 65535 for uint16, 16 for
    scikit-learn's digits, 1 for floats). `path` is the cache entry the arrays
    are memory-mapped from (None: held in memory); a pickled copy reopens the
    maps there instead of carrying the pixels, so worker processes share them.

    >>> ImageArrays(np.zeros((4, 8, 8, 1), np.uint8), np.arange(4, dtype=np.int32), 255.0, 4).spec
    DataSpec(input_shape=(8, 8, 1), num_classes=4, tokenizer=None)
    """

    image: np.ndarray
    label: np.ndarray | None
    scale: float
    num_classes: int | None
    path: Path | None = None

    def __len__(self) -> int:
        return len(self.image)

    @property
    def spec(self) -> DataSpec:
        return DataSpec(tuple(self.image.shape[1:]), self.num_classes)

    def columns(self) -> dict[str, np.ndarray]:
        out = {"image": self.image}
        if self.label is not None:
            out["label"] = self.label
        return out

    @classmethod
    def from_cache(cls, path: Path) -> ImageArrays:
        """The arrays of a committed cache entry, memory-mapped read-only."""
        from nnx_cli.data.cache import Entry

        entry = Entry(Path(path))
        label = entry.array("label") if entry.has("label") else None
        return cls(entry.array("image"), label, entry.meta["scale"], entry.meta["num_classes"], entry.path)

    def __reduce__(self) -> Any:
        if self.path is not None:
            return (ImageArrays.from_cache, (self.path,))
        return (ImageArrays, (self.image, self.label, self.scale, self.num_classes))


# --------------------------------------------------------------------------- splits


def _prepare(rows: Mapping[str, jax.Array], scale: float, binarize: float | None) -> dict[str, jax.Array]:
    out = dict(rows)
    image = rows["image"]
    if not jnp.issubdtype(image.dtype, jnp.integer):
        grey = image.astype(jnp.float32) / jnp.float32(scale)
        out["image"] = (grey > binarize).astype(jnp.float32) if binarize is not None else grey
        return out
    levels = _grey_levels(np.dtype(image.dtype).name, scale)
    if binarize is None:
        out["image"] = jnp.take(jnp.asarray(levels), image.astype(jnp.int32), axis=0)
    else:  # the first stored level whose grey value passes the threshold: one integer comparison per pixel
        passes = levels > np.float32(binarize)
        first = int(np.argmax(passes)) if passes.any() else len(levels)
        out["image"] = (image.astype(jnp.int32) >= first).astype(jnp.float32)
    return out


@functools.lru_cache(maxsize=8)
def _grey_levels(dtype: str, scale: float) -> np.ndarray:
    """float32 `[level / scale for each stored level]`, rounded once from float64.

    A table rather than a division inside the step: XLA turns `x / 255` into
    `x * (1 / 255)`, which differs from the correctly rounded quotient in the
    last bit for half the levels (and could flip a binarize threshold).
    """
    return (np.arange(np.iinfo(dtype).max + 1) / scale).astype(np.float32)


class ImageTrainSplit:
    """A training split of images: keys are row ids, epoch `e` is a permutation from `(seed, e)`.

    Implements :class:`nnx_cli.data.base.TrainSplit`; pickles cheaply (a
    cached split reopens its memory maps), so Grain workers can read it.

    >>> split = ImageTrainSplit(ImageArrays(np.zeros((10, 2, 2, 1), np.uint8), None, 255.0, None), seed=0)
    >>> split.read(split.epoch_keys(0)[:4])["image"].shape
    (4, 2, 2, 1)
    """

    def __init__(self, arrays: ImageArrays, seed: int, binarize: float | None = None):
        self.arrays = arrays
        self.seed = seed
        self.binarize = binarize
        self.spec = arrays.spec

    def __len__(self) -> int:
        return len(self.arrays)

    def steps_per_epoch(self, batch_size: int) -> int:
        if batch_size > len(self):
            raise UserError(
                f"config key 'train.batch_size' ({batch_size}) is larger than the training split ({len(self)} examples)"
            )
        return len(self) // batch_size

    def epoch_keys(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self))

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        return {name: _read_rows(column, keys) for name, column in self.arrays.columns().items()}

    def stored(self) -> dict[str, np.ndarray]:
        return self.arrays.columns()

    def read_on_device(self, stored: dict[str, jax.Array], keys: jax.Array) -> dict[str, jax.Array]:
        return {name: jnp.take(column, keys, axis=0, mode="clip") for name, column in stored.items()}

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return _prepare(rows, self.arrays.scale, self.binarize)


def _read_rows(column: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """`column[keys]`; rows of a page or more of a memory-mapped `.npy` are read with `pread` instead.

    Touching a mapped row maps its neighbours too (the kernel faults pages
    around), so random rows read through the map would fill the process with
    several times the file pages they need. Read into a private buffer, rows
    leave the page cache to the kernel and the process holds only the batch.
    A row smaller than a page costs less to index than a system call.
    """
    row_bytes = column.itemsize * math.prod(column.shape[1:])
    if not isinstance(column, np.memmap) or column.filename is None or row_bytes < _PAGE:
        return column[keys]
    out = np.empty((len(keys), *column.shape[1:]), column.dtype)
    rows = out.reshape(len(keys), row_bytes // column.itemsize)
    fd = _read_only(column.filename)
    for i, key in enumerate(keys.tolist()):
        os.preadv(fd, [rows[i]], column.offset + key * row_bytes)
    return out


@functools.lru_cache(maxsize=32)
def _read_only(path: str) -> int:
    """One read-only descriptor per cache file and process (the process's memory maps hold the file open too)."""
    return os.open(path, os.O_RDONLY)


class ImageEvalSplit:
    """An evaluation split of images, read in order (:class:`nnx_cli.data.base.EvalSplit`).

    >>> split = ImageEvalSplit(ImageArrays(np.zeros((5, 2, 2, 1), np.uint8), None, 255.0, None))
    >>> [b["mask"].sum() for b in split.eval_batches(4)]
    [4, 1]
    """

    def __init__(self, arrays: ImageArrays, binarize: float | None = None):
        self.arrays = arrays
        self.binarize = binarize
        self.spec = arrays.spec

    def __len__(self) -> int:
        return len(self.arrays)

    def eval_batches(self, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
        columns = self.arrays.columns()
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            pad = batch_size - (stop - start)
            batch = {}
            for name, column in columns.items():
                part = np.asarray(column[start:stop])
                batch[name] = np.concatenate([part, np.zeros((pad, *part.shape[1:]), part.dtype)]) if pad else part
            batch["mask"] = np.arange(batch_size) < stop - start
            yield {name: value[rows] for name, value in batch.items()}

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return _prepare(rows, self.arrays.scale, self.binarize)


def image_train_split(cfg: DataConfig, seed: int) -> ImageTrainSplit:
    """`data.train_split` of `cfg.source`, decoded into the cache on first use."""
    return ImageTrainSplit(load_images(cfg, cfg.train_split, "data.train_split"), seed, cfg.binarize)


def image_eval_split(cfg: DataConfig) -> ImageEvalSplit | None:
    """`data.eval_split` of `cfg.source` (None when it is null), decoded into the cache on first use."""
    if not cfg.eval_split:
        return None
    return ImageEvalSplit(load_images(cfg, cfg.eval_split, "data.eval_split"), cfg.binarize)


# --------------------------------------------------------------------------- sources


def _check_source(obj: Any, name: str) -> None:
    if not callable(obj):
        raise UserError(f"config key 'data.source': {name!r} is a {type(obj).__name__}, not a function fn(split)")


SOURCES: Registry[Callable[[str], Any]] = Registry("data source", "data.source", _check_source)


def load_images(cfg: DataConfig, split: str, key: str = "data.train_split") -> ImageArrays:
    """One split of `cfg.source` in stored form: from the cache, decoded into it first if need be.

    `key` is the config key that named the split, for errors.

    >>> load_images(DataConfig(source="sklearn:digits"), "test").image.shape
    (297, 8, 8, 1)
    """
    fn = _source_function(cfg.source)
    if fn is None:
        shortcut = _local_alias(cfg, split)
        if shortcut is not None and (entry := find_alias(cache_root(cfg.cache_dir), shortcut)) is not None:
            return ImageArrays.from_cache(entry)  # unchanged local files decoded before: no `datasets` import
        from nnx_cli.data.sources import open_dataset

        ds = _dataset_split(open_dataset(cfg.source), cfg.source, split, key)
        arrays = _cached(ds, cfg, split, _source_id(cfg.source))
        if shortcut is not None:
            record_alias(cache_root(cfg.cache_dir), shortcut, arrays.path)
        return arrays
    result = _call_source(fn, cfg.source, split, key)
    if _is_dataset(result):
        return _cached(result, cfg, split, cfg.source)
    if isinstance(result, ImageArrays):
        return result
    if isinstance(result, Mapping) and cfg.image_key in result:
        return _from_mapping(result, cfg.source, cfg.image_key, cfg.label_key)
    got = f" with keys {', '.join(map(str, result))}" if isinstance(result, Mapping) else ""
    raise UserError(
        f"config key 'data.source': {cfg.source}({split!r}) returned a {type(result).__name__}{got}; expected a "
        f"datasets.Dataset, a mapping with an {cfg.image_key!r} array (data.image_key; and optionally "
        f"{cfg.label_key or 'label'!r}, data.label_key), or an ImageArrays"
    )


def _local_alias(cfg: DataConfig, split: str) -> dict[str, Any] | None:
    """What names a local source's decoded split without opening it (its files' sizes and times, the options
    that pick the columns), for :func:`nnx_cli.data.cache.find_alias`; None for a source on the Hub."""
    path = Path(cfg.source).expanduser()
    if not path.exists():
        return None
    return {
        "kind": "images-alias",
        "source": str(path.resolve()),
        "files": local_fingerprint(path),
        "split": split,
        "image_key": cfg.image_key,
        "label_key": cfg.label_key,
        "decoder": _DECODER,
    }


def _source_function(source: str) -> Callable[[str], Any] | None:
    """The function behind a registered name or a `package.module:fn` reference; None for `datasets` sources."""
    if source in SOURCES:
        return SOURCES[source]
    if source.startswith("sklearn:"):
        raise UserError(
            f"config key 'data.source': unknown scikit-learn dataset {source!r}; only 'sklearn:digits' is shipped"
        )
    if is_reference(source) and not Path(source).expanduser().exists():
        return SOURCES.get(source)
    return None


def _call_source(fn: Callable[[str], Any], source: str, split: str, key: str) -> Any:
    try:
        return fn(split)
    except KeyError as e:
        if e.args != (split,):  # the function's own KeyError: the source, not the split, is at fault
            raise UserError(
                f"config key 'data.source': data source {source!r} raised KeyError: {e} for split {split!r}"
            ) from None
        raise UserError(
            f"config key {key!r}: data source {source!r} has no split {split!r}"
            + (" (set data.eval_split=null to train without evals)" if key == "data.eval_split" else "")
        ) from None
    except UserError:
        raise
    except Exception as e:  # the user's own function failed: say so, not a traceback through the trainer
        raise UserError(
            f"config key 'data.source': data source {source!r} raised {type(e).__name__}: {first_line(e)} for split "
            f"{split!r}"
        ) from None


def _is_dataset(obj: Any) -> bool:
    if "datasets" not in sys.modules:  # a source that never imported `datasets` cannot have returned one
        return False
    import datasets

    if isinstance(obj, datasets.DatasetDict):
        raise UserError(
            f"config key 'data.source': the function returned a DatasetDict ({', '.join(obj)}); return the one "
            "Dataset of the split it is called with"
        )
    return isinstance(obj, datasets.Dataset)


def _source_id(source: str) -> str:
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def _dataset_split(ds: Any, source: str, split: str, key: str) -> Any:
    """Split `split` of what `sources.open_dataset` returned; a split it lacks is a UserError naming `key`."""
    import datasets

    if not isinstance(ds, datasets.DatasetDict):  # save_to_disk of one Dataset: a single split, "train"
        ds = datasets.DatasetDict({"train": ds})
    if split not in ds:
        raise UserError(
            f"config key {key!r}: dataset {source!r} has no split {split!r}"
            f"{did_you_mean(split, list(ds))}; available: {', '.join(ds)}"
            + (" (set data.eval_split=null to train without evals)" if key == "data.eval_split" else "")
        )
    return ds[split]


def _digits(split: str) -> ImageArrays:
    """scikit-learn's 8x8 digits (first 1500 train, the rest test), grey levels 0..16, in memory."""
    from nnx_cli.data.sources import DIGITS_TRAIN, digits_arrays

    parts = {"train": slice(0, DIGITS_TRAIN), "test": slice(DIGITS_TRAIN, None)}
    if split not in parts:
        raise KeyError(split)
    pixels, labels = digits_arrays()
    image = pixels.reshape(-1, 8, 8, 1).astype(np.uint8)[parts[split]]
    return ImageArrays(image, labels.astype(np.int32)[parts[split]], 16.0, 10)


SOURCES.register("sklearn:digits", _digits)


def _from_mapping(columns: Mapping[str, Any], source: str, image_key: str, label_key: str | None) -> ImageArrays:
    """A user source's `{image_key: ..., label_key: ...}` (`image`, `label` by default), checked and put in stored
    form (in memory)."""
    image = np.asarray(columns[image_key])
    what = f"config key 'data.source': {source}"
    if image.ndim < 2:
        raise UserError(f"{what} returned {image_key!r} of shape {image.shape}; expected [N, H, W, C] (or [N, H, W])")
    if image.ndim == 3:
        image = image[..., None]
    if np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
        if image.size and (image.min() < 0 or image.max() > 1):
            raise UserError(f"{what} returned float images outside [0, 1]; scale them, or return uint8 grey levels")
    elif image.dtype not in (np.uint8, np.uint16):
        raise UserError(f"{what} returned {image.dtype} images; expected uint8 (0..255), uint16, or floats in [0, 1]")
    label, num_classes = None, None
    if label_key is not None and columns.get(label_key) is not None:
        label = np.asarray(columns[label_key])
        if label.shape != (len(image),) or not np.issubdtype(label.dtype, np.integer):
            raise UserError(
                f"{what} returned {label_key!r} {label.dtype} {label.shape}; expected integers of shape ({len(image)},)"
            )
        label = label.astype(np.int32)
        num_classes = int(label.max()) + 1 if len(label) else None
    return ImageArrays(image, label, _SCALES[image.dtype], num_classes)


# --------------------------------------------------------------------------- decoding into the cache


def _cached(ds: Any, cfg: DataConfig, split: str, source_id: str) -> ImageArrays:
    """`ds` decoded into the cache (once per source, split, columns and fingerprint), memory-mapped."""
    columns = list(ds.column_names)
    if cfg.image_key not in columns:
        raise UserError(
            f"config key 'data.image_key': dataset {cfg.source!r} has no column {cfg.image_key!r}"
            f"{did_you_mean(cfg.image_key, columns)}; columns: {', '.join(columns)}"
        )
    label_key = cfg.label_key if cfg.label_key is not None and cfg.label_key in columns else None
    parts = {
        "kind": "images",
        "source": source_id,
        "split": split,
        "image_key": cfg.image_key,
        "label_key": label_key,
        "fingerprint": getattr(ds, "_fingerprint", None),
        "decoder": _DECODER,
    }
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"images-{Path(source_id.rstrip('/')).name}-{split}")[:80]
    workers = worker_count(cfg.workers)
    entry = get_or_build(
        cache_root(cfg.cache_dir), name, parts, lambda d: _build(d, ds, cfg.image_key, label_key, workers)
    )
    return ImageArrays.from_cache(entry.path)


def _build(directory: Path, ds: Any, image_key: str, label_key: str | None, workers: int) -> dict[str, Any]:
    """Write `image.npy` (and `label.npy`) into `directory`; return the entry's meta."""
    dtype, shape = _decode_into(directory / "image.npy", ds, image_key, workers)
    num_classes = None
    if label_key is not None:
        label = _class_indices(ds.with_format("numpy")[label_key][:], label_key)
        np.save(directory / "label.npy", label)
        feature = ds.features[label_key]
        num_classes = getattr(feature, "num_classes", None) or (int(label.max()) + 1 if len(label) else None)
    return {"scale": _SCALES[dtype], "num_classes": num_classes, "shape": list(shape)}


def _class_indices(values: Any, key: str) -> np.ndarray:
    """A label column as int32 class indices: integers, or floats that are whole numbers; anything else (text,
    fractions, missing labels) is a UserError (text was a traceback, fractions were cut to integers silently)."""
    labels = np.asarray(values)
    if labels.dtype.kind in "iub":
        return labels.astype(np.int32)
    if labels.dtype.kind == "f":
        missing = np.isnan(labels)
        if missing.any():
            problem = f"no label in row {int(np.argmax(missing))}"
        elif (labels != np.round(labels)).any():
            row = int(np.argmax(labels != np.round(labels)))
            problem = f"{labels[row]:g} in row {row}"
        else:
            return labels.astype(np.int32)
    else:
        flat = [v.item() if isinstance(v, np.generic) else v for v in labels.ravel()]
        row = next((i for i, v in enumerate(flat) if not isinstance(v, int)), 0)
        problem = f"no label in row {row}" if flat[row] is None else f"{flat[row]!r} in row {row}"
    raise UserError(
        f"config key 'data.label_key': column {key!r} has {problem}; labels are class indices, integers 0 to "
        "num_classes - 1 (datasets' class_encode_column makes them of a text column)"
    )


def _chunk_decoder(ds: Any, key: str, rows: int) -> ArrowImages | DatasetImages:
    """What decodes column `key` of `ds` a chunk of `rows` at a time: its Arrow cache files where they hold the
    dataset's rows as they are (then a worker imports none of `datasets`), else the dataset itself."""
    import datasets

    files = [f["filename"] for f in ds.cache_files]
    if isinstance(ds.features[key], datasets.Image) and files and ds._indices is None:
        arrow = ArrowImages(files, key, rows)
        try:
            same = arrow.table().column(key).equals(ds.data.table.column(key))
        except Exception:  # files datasets wrote in a form of its own: read through it
            same = False
        if same:
            return arrow
    return DatasetImages(ds, key, rows)


# What a column of encoded images or their files holds, by numpy dtype kind, in words.
_NOT_DECODED = {"U": "text (file paths?)", "S": "bytes (encoded images?)", "O": "Python objects ({bytes, path}?)"}


def _stored_dtype(pixels: np.ndarray, key: str) -> np.dtype:
    if pixels.dtype.kind in _NOT_DECODED:
        raise UserError(
            f"config key 'data.image_key': column {key!r} holds {_NOT_DECODED[pixels.dtype.kind]}, not decoded "
            f"images; make it an image column, and the paths or bytes are decoded: "
            f"ds = ds.cast_column({key!r}, datasets.Image()) before saving the dataset (or use an image folder)"
        )
    if pixels.ndim < 2 or not np.issubdtype(pixels.dtype, np.number):
        raise UserError(
            f"config key 'data.image_key': column {key!r} holds {pixels.dtype} values of shape {pixels.shape[1:]}, "
            "not images"
        )
    if np.issubdtype(pixels.dtype, np.floating):
        return np.dtype(np.float32)
    return np.dtype(np.uint16 if pixels.dtype == np.uint16 else np.uint8)


def _to_stored(pixels: np.ndarray, dtype: np.dtype, key: str) -> np.ndarray:
    """A decoded chunk as `dtype`; integer pixels that do not fit, or float ones outside [0, 1], are an error, not
    silently wrapped or trained on unscaled."""
    if np.issubdtype(pixels.dtype, np.floating) and pixels.size and (pixels.min() < 0 or pixels.max() > 1):
        raise UserError(
            f"config key 'data.image_key': column {key!r} holds float pixels from {pixels.min():g} to "
            f"{pixels.max():g}; float images are read as [0, 1]: scale them, or store uint8 grey levels"
        )
    if pixels.dtype == dtype:
        return pixels
    if dtype == np.uint8 and np.issubdtype(pixels.dtype, np.integer) and pixels.min() >= 0 and pixels.max() <= 255:
        return pixels.astype(np.uint8)
    if dtype == np.float32 and np.issubdtype(pixels.dtype, np.floating):
        return pixels.astype(np.float32)
    raise UserError(
        f"config key 'data.image_key': the images in column {key!r} mix pixel types ({dtype} and {pixels.dtype}, "
        f"values {pixels.min()}..{pixels.max()}); convert them to one mode (8-bit grey, RGB, ...) first"
    )


def _decode_into(path: Path, ds: Any, key: str, workers: int) -> tuple[np.dtype, tuple[int, ...]]:
    """Decode column `key` of `ds` into a new `.npy` file at `path`, in order, a chunk at a time; return
    the stored dtype and shape."""
    count = len(ds)
    if count == 0:
        raise UserError(f"config key 'data.image_key': the split has no rows, so column {key!r} holds no images")
    probe = _chunk_decoder(ds, key, rows=1)
    first, _ = probe(0)
    if first.ndim == 3:  # [1, H, W]: greyscale
        first = first[..., None]
    dtype = _stored_dtype(first, key)
    shape = first.shape[1:]
    probe.rows = max(1, min(1024, _CHUNK_BYTES // max(first.nbytes, 1)))
    chunks = -(-count // probe.rows)
    np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(count, *shape)).flush()  # header and size
    shapes: set[tuple[int, ...]] = set()
    with _progress(count, f"decoding {count} images in {min(workers, chunks)} processes") as advance:
        for index, (pixels, chunk_shapes) in enumerate(decoded(probe, chunks, workers)):
            shapes.update(tuple(s) for s in chunk_shapes)
            if pixels is None or len(shapes) > 1:
                continue  # the error below names every shape met
            pixels = pixels[..., None] if pixels.ndim == 3 else pixels
            # A map per chunk: written pages leave this process with it (to the page cache, written back from there).
            out = np.load(path, mmap_mode="r+")
            out[index * probe.rows : index * probe.rows + len(pixels)] = _to_stored(np.asarray(pixels), dtype, key)
            out.flush()
            del out
            advance(len(pixels))
    if len(shapes) > 1:
        # the same height and width: grey and colour images (or with and without alpha) mixed, not sizes
        fix = "convert them to one mode (all RGB, or all grey)" if len({s[:2] for s in shapes}) == 1 else "resize them"
        raise UserError(
            f"config key 'data.image_key': the images in column {key!r} come in {len(shapes)} shapes "
            f"({', '.join(map(str, sorted(shapes)[:3]))}, ...); {fix} to one shape first"
        )
    return dtype, (count, *shape)


def _progress(total: int, description: str) -> contextlib.AbstractContextManager[Callable[[int], None]]:
    from nnx_cli import report

    return report.progress(total, description, at_least=_PROGRESS_FROM)
