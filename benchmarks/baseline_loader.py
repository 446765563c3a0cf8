"""The previous release's data loader, kept as the baseline the data benchmarks measure against.

Before the uint8 cache and the Grain pipeline (`nnx_cli.data.images`,
`nnx_cli.data.pipeline`), every run decoded a whole split into float32 host
memory (`load_split`) and drew batches from it with `Batches` and a
prefetch thread. Nothing in `nnx_cli` uses this module.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from typing import Any

import numpy as np

from nnx_cli.config import DataConfig
from nnx_cli.data.base import DataSpec
from nnx_cli.data.pipeline import prefetch  # noqa: F401 (the same prefetch thread as then, for the benchmarks)
from nnx_cli.data.sources import DIGITS, DIGITS_TRAIN, digits_arrays, open_dataset
from nnx_cli.errors import UserError, did_you_mean


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
    pixels, labels = digits_arrays()
    images = (pixels.reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]
    labels = labels.astype(np.int32)
    parts = {"train": slice(0, DIGITS_TRAIN), "test": slice(DIGITS_TRAIN, None)}
    if split not in parts:
        raise UserError(f"config key {key!r}: {DIGITS} has splits 'train' and 'test', not {split!r}")
    return Split(images[parts[split]], labels[parts[split]], 10)


def _from_datasets(cfg: DataConfig, split: str, key: str) -> Split:
    import datasets

    ds = open_dataset(cfg.source)
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
