"""Datasets as in-memory arrays, and the batches a run draws from them.

`data.source` is one of:

- `sklearn:digits`: the 8x8 digits shipped inside scikit-learn (offline);
- a local directory or file: parquet/arrow/csv/json files or a
  `save_to_disk` directory, all read through `datasets`;
- a Hugging Face Hub id such as `ylecun/mnist`, loaded and cached by
  `datasets.load_dataset`.

Images are decoded once into a float32 array `[N, H, W, C]` in `[0, 1]`
(binarized when `data.binarize` is set), labels into int32 `[N]`. Batch `i`
of epoch `e` comes from a permutation seeded by `(seed, e)`, so any step's
batch can be rebuilt after a restart::

    split = load_split(cfg.data, "train")
    batches = Batches(split, batch_size=128, seed=0)
    batch = batches.get(step=1234)          # {"image": ..., "label": ...}

The splits of the new training loop (:mod:`nnx_cli.data.base`) replace
these: images decoded once into a uint8 cache in :mod:`nnx_cli.data.images`,
whole dispatches fed by Grain or kept on the devices in
:mod:`nnx_cli.data.pipeline`.
"""

from __future__ import annotations

import dataclasses
import io
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.config import Config, DataConfig
from nnx_cli.data.base import DataSpec, EvalSplit, TrainSplit
from nnx_cli.data.cache import local_fingerprint
from nnx_cli.errors import UserError, did_you_mean

DIGITS = "sklearn:digits"
_DIGITS_TRAIN = 1500  # first 1500 of 1797 images train, the rest test

# Shapes of well-known datasets, so `nnx-inspect` never has to read them.
_KNOWN = {
    "digits": ((8, 8, 1), 10),
    "mnist": ((28, 28, 1), 10),
    "fashion_mnist": ((28, 28, 1), 10),
    "kmnist": ((28, 28, 1), 10),
}
_FILE_BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".txt": "text",
}


@dataclasses.dataclass
class Split:
    """One split decoded into arrays: `images` float32 `[N, ...]`, `labels` int32 `[N]` or None."""

    images: np.ndarray
    labels: np.ndarray | None
    num_classes: int | None

    def __len__(self) -> int:
        return len(self.images)

    @property
    def spec(self) -> DataSpec:
        return DataSpec(tuple(self.images.shape[1:]), self.num_classes)

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"image": self.images}
        if self.labels is not None:
            out["label"] = self.labels
        return out


def known_spec(source: str) -> DataSpec | None:
    """The input shape of a well-known dataset from its name alone, else None.

    >>> known_spec("ylecun/mnist")
    DataSpec(input_shape=(28, 28, 1), num_classes=10)
    """
    name = "digits" if source == DIGITS else Path(source.rstrip("/")).name.lower().replace("-", "_")
    shape = _KNOWN.get(name)
    return DataSpec(*shape) if shape else None


def spec_from_config(cfg: Config) -> DataSpec | None:
    """The input spec without reading data: a text config's from its tokenizer and `data.seq_len`; else
    `model.input_shape` if set, or a known dataset's."""
    from nnx_cli.data import text

    if text.is_text(cfg.data):
        return text.text_spec(cfg.data, vocab_size=cfg.model.options.get("vocab_size") or cfg.model.num_classes)
    known = known_spec(cfg.data.source)
    if cfg.model.input_shape is None:
        return known
    num_classes = cfg.model.num_classes if cfg.model.num_classes is not None else known.num_classes if known else None
    return DataSpec(tuple(cfg.model.input_shape), num_classes)


# --------------------------------------------------------------------------- loading


def load_split(cfg: DataConfig, split: str, key: str = "data.train_split") -> Split:
    """Load and decode one split of `cfg.source`; `key` names the config key for errors."""
    if cfg.source == DIGITS:
        split_data = _digits(split, key)
    elif cfg.source.startswith("sklearn:"):
        raise UserError(
            f"config key 'data.source': unknown scikit-learn dataset {cfg.source!r}; only {DIGITS!r} is shipped"
        )
    else:
        split_data = _from_datasets(cfg, split, key)
    if cfg.binarize is not None:
        split_data.images = (split_data.images > cfg.binarize).astype(np.float32)
    return split_data


def _digits(split: str, key: str) -> Split:
    pixels, labels = _digits_arrays()
    images = (pixels.reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]
    labels = labels.astype(np.int32)
    parts = {"train": slice(0, _DIGITS_TRAIN), "test": slice(_DIGITS_TRAIN, None)}
    if split not in parts:
        raise UserError(f"config key {key!r}: {DIGITS} has splits 'train' and 'test', not {split!r}")
    return Split(images[parts[split]], labels[parts[split]], 10)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: pixels `[1797, 64]` in 0..16 and labels.

    Read straight from the CSV that scikit-learn ships, which is what
    `sklearn.datasets.load_digits` parses too, without importing scikit-learn
    and SciPy (seconds of start-up for every run and every process).
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1]
    from sklearn.datasets import load_digits  # a layout we do not know: let scikit-learn find it

    digits = load_digits()
    return digits.data, digits.target


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith(("/", "./", "../", "~", ".\\"))
        or Path(source).suffix in _FILE_BUILDERS
        or source.count("/") > 1
    )


_cache: dict[str, tuple[str | None, Any]] = {}


def _open(source: str) -> Any:
    """The `datasets` object (a DatasetDict, or a Dataset for save_to_disk of one split).

    A `.txt` file, and each file of a directory of `.txt` files, is one row
    (one document) in a column `text`, not a row per line.
    """
    path = Path(source).expanduser()
    signature = local_fingerprint(path) if path.exists() else None
    if source in _cache and _cache[source][0] == signature:  # a local source edited since is read again
        return _cache[source][1]
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported as one UserError below
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    try:
        if path.exists():
            if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
                ds = datasets.load_from_disk(str(path))
            elif path.is_dir():
                ds = datasets.load_dataset(str(path), **_text_options(path))
            elif path.suffix in _FILE_BUILDERS:
                ds = datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), **_text_options(path))
            else:
                raise UserError(
                    f"config key 'data.source': cannot read {source!r}; expected a directory or a "
                    f"{'/'.join(_FILE_BUILDERS)} file"
                )
        elif _looks_like_path(source):
            raise UserError(f"config key 'data.source': local dataset {source!r} does not exist")
        else:
            ds = datasets.load_dataset(source)
    except UserError:
        raise
    except (ConnectionError, OSError) as e:
        if path.exists():
            raise UserError(f"config key 'data.source': cannot read local dataset {source!r}: {e}") from None
        raise UserError(
            f"config key 'data.source': cannot load Hub dataset {source!r}: the Hugging Face Hub cannot be reached "
            f"and the dataset is not in the local cache ({type(e).__name__}). Run once with network access so "
            f"`datasets` caches it, or download it and set data.source to the local copy, e.g. "
            f"data.source=/path/to/mnist (a directory of parquet files or a save_to_disk directory)"
        ) from None
    except Exception as e:  # datasets raises many types for bad inputs; all are the user's data
        raise UserError(f"config key 'data.source': cannot load dataset {source!r}: {type(e).__name__}: {e}") from None
    _cache[source] = (signature, ds)
    return ds


def _text_options(path: Path) -> dict[str, Any]:
    """`datasets`' options for a `.txt` file or a directory of them: one row per file, not per line."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    suffixes = {p.suffix for p in files if p.suffix in _FILE_BUILDERS}
    return {"sample_by": "document"} if suffixes == {".txt"} else {}


def _from_datasets(cfg: DataConfig, split: str, key: str) -> Split:
    import datasets

    ds = _open(cfg.source)
    if not isinstance(ds, datasets.DatasetDict):  # save_to_disk of one Dataset: a single split, "train"
        ds = datasets.DatasetDict({"train": ds})
    if split not in ds:
        raise UserError(
            f"config key {key!r}: dataset {cfg.source!r} has no split {split!r}"
            f"{did_you_mean(split, list(ds))}; available: {', '.join(ds)}"
            + (" (set data.eval_split=null to train without evals)" if key == "data.eval_split" else "")
        )
    ds = ds[split]
    columns = list(ds.column_names)
    if cfg.image_key not in columns:
        raise UserError(
            f"config key 'data.image_key': dataset {cfg.source!r} has no column {cfg.image_key!r}"
            f"{did_you_mean(cfg.image_key, columns)}; columns: {', '.join(columns)}"
        )
    images = _decode_images(ds, cfg.image_key)
    labels, num_classes = None, None
    if cfg.label_key is not None and cfg.label_key in columns:
        labels = np.asarray(ds.with_format("numpy")[cfg.label_key][:]).astype(np.int32)
        feature = ds.features[cfg.label_key]
        num_classes = getattr(feature, "num_classes", None) or int(labels.max()) + 1
    return Split(images, labels, num_classes)


def _decode_images(ds: Any, key: str) -> np.ndarray:
    """Decode an image column once into float32 `[N, H, W, C]` in [0, 1]."""
    import datasets

    feature = ds.features[key]
    if isinstance(feature, datasets.Image):
        from PIL import Image

        column = ds.cast_column(key, datasets.Image(decode=False))[key]
        pixels = []
        for item in column:
            source = io.BytesIO(item["bytes"]) if item.get("bytes") is not None else item["path"]
            with Image.open(source) as img:
                pixels.append(np.asarray(img))
        shapes = {p.shape for p in pixels}
        if len(shapes) > 1:
            raise UserError(
                f"config key 'data.image_key': the images in column {key!r} come in {len(shapes)} shapes "
                f"({', '.join(map(str, sorted(shapes)[:3]))}, ...); resize them to one shape first"
            )
        array = np.stack(pixels)
    else:
        array = np.asarray(ds.with_format("numpy")[key][:])
    if array.ndim < 2 or not np.issubdtype(array.dtype, np.number):
        raise UserError(
            f"config key 'data.image_key': column {key!r} holds {array.dtype} values of shape {array.shape[1:]}, not "
            "images"
        )
    if array.ndim == 3:  # [N, H, W] greyscale
        array = array[..., None]
    if np.issubdtype(array.dtype, np.integer):  # 8-bit grey levels (16-bit for uint16 images)
        return (array / (65535.0 if array.dtype == np.uint16 else 255.0)).astype(np.float32)
    return array.astype(np.float32)


# --------------------------------------------------------------------------- batches


class Batches:
    """Training batches addressed by step: epoch `e` uses a permutation from `(seed, e)`.

    The last partial batch of an epoch is dropped, so every step sees exactly
    `batch_size` examples.
    """

    def __init__(self, split: Split, batch_size: int, seed: int):
        if batch_size > len(split):
            raise UserError(
                f"config key 'train.batch_size' ({batch_size}) is larger than the training split ({len(split)} "
                "examples)"
            )
        self.arrays = split.arrays()
        self.size = len(split)
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = self.size // batch_size
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None

    def indices(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(self.size)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm[i * self.batch_size : (i + 1) * self.batch_size]

    def get(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """The batch for `step`; only its `rows` (one process's share) are gathered."""
        idx = self.indices(step)[rows]
        return {k: v[idx] for k, v in self.arrays.items()}


def eval_batches(split: Split, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
    """The whole split in order, the last batch padded; `"mask"` marks real rows.

    Only `rows` of each batch (one process's share) are yielded.
    """
    arrays = split.arrays()
    for start in range(0, len(split), batch_size):
        stop = min(start + batch_size, len(split))
        pad = batch_size - (stop - start)
        batch = {
            k: np.concatenate([v[start:stop], np.zeros((pad, *v.shape[1:]), v.dtype)]) if pad else v[start:stop]
            for k, v in arrays.items()
        }
        batch["mask"] = np.arange(batch_size) < stop - start
        yield {k: v[rows] for k, v in batch.items()}


def prefetch(produce: Callable[[int], Any], steps: range, size: int = 2) -> Iterator[Any]:
    """Yield `produce(step)` for each step, computing up to `size` ahead in a thread.

    `produce` typically gathers a batch and puts it on the devices, so the
    transfer overlaps the running step. Errors in the thread surface here.
    """
    out: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()
    done = object()

    def work() -> None:
        try:
            for step in steps:
                item = produce(step)
                while not stop.is_set():
                    try:
                        out.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put((done, None))
        except BaseException as e:  # re-raised in the consumer
            out.put((done, e))

    thread = threading.Thread(target=work, name="nnx-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = out.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()


# --------------------------------------------------------------------------- the loop's interface (data.base)


def train_split(cfg: Config) -> TrainSplit:
    """The training split of `cfg.data`, addressed by `(cfg.seed, epoch)`."""
    from nnx_cli.data import text

    if text.is_text(cfg.data):
        return text.load_text_splits(cfg.data, cfg.seed, splits=("train",)).train
    return ArraySplit(load_split(cfg.data, cfg.data.train_split, "data.train_split"), cfg.seed)


def eval_split(cfg: Config) -> EvalSplit:
    """The evaluation split of `cfg.data`, read in order."""
    from nnx_cli.data import text

    if text.is_text(cfg.data):
        return text.load_text_splits(cfg.data, cfg.seed, splits=("eval",)).eval
    return ArraySplit(load_split(cfg.data, cfg.data.eval_split, "data.eval_split"), cfg.seed)


class ArraySplit:
    """A split held in memory as model-ready arrays, as a `data.base.TrainSplit` and `EvalSplit`."""

    def __init__(self, split: Split, seed: int):
        self.split = split
        self.seed = seed
        self.spec = split.spec

    def __len__(self) -> int:
        return len(self.split)

    def steps_per_epoch(self, batch_size: int) -> int:
        if batch_size > len(self.split):
            raise UserError(
                f"config key 'train.batch_size' ({batch_size}) is larger than the training split "
                f"({len(self.split)} examples)"
            )
        return len(self.split) // batch_size

    def epoch_keys(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.split))

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[keys] for k, v in self.split.arrays().items()}

    def stored(self) -> dict[str, np.ndarray]:
        return self.split.arrays()

    def read_on_device(self, stored: dict[str, Any], keys: Any) -> dict[str, Any]:
        import jax.numpy as jnp

        return {k: jnp.take(v, keys, axis=0) for k, v in stored.items()}

    def prepare(self, rows: dict[str, Any]) -> dict[str, Any]:
        return rows

    def eval_batches(self, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
        return eval_batches(self.split, batch_size, rows)
