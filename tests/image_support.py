"""Small image datasets the tests write themselves: real PNGs, saved through `datasets`."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def png_dataset(n: int, shape: tuple[int, ...] = (6, 5), seed: int = 0, dtype: type = np.uint8, classes: int = 3):
    """A `datasets.Dataset` of `n` random PNG images (`img`) with ClassLabel labels (`digit`), and the pixels."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, np.iinfo(dtype).max + 1, size=(n, *shape), dtype=dtype)
    names = [str(c) for c in range(classes)]
    ds = datasets.Dataset.from_dict(
        {"img": [Image.fromarray(p) for p in pixels], "digit": [i % classes for i in range(n)]}
    )
    ds = ds.cast_column("img", datasets.Image()).cast_column("digit", datasets.ClassLabel(names=names))
    return ds, pixels


def png_parquet(
    path: Path, n: int, shape: tuple[int, ...] = (6, 5), seed: int = 0, dtype: type = np.uint8
) -> np.ndarray:
    """Write `png_dataset(...)` to the parquet file `path`; return its pixels."""
    ds, pixels = png_dataset(n, shape, seed, dtype)
    ds.to_parquet(str(path))
    return pixels
