"""What every kind of data (images, text, your own) gives the training loop.

A split is stored once, compactly (uint8 pixels, uint16 tokens), in arrays
that may be memory-mapped from the cache and larger than memory. The loop
never sees how: it asks a :class:`TrainSplit` for the *keys* of the examples
of a batch (row ids of images, start offsets of text windows), reads the
stored rows for those keys on the host (:meth:`TrainSplit.read`) or, when the
stored arrays live on the devices, inside the jitted step
(:meth:`TrainSplit.read_on_device`), and turns stored rows into model inputs
inside the jitted step (:meth:`TrainSplit.prepare`: scaling, binarizing,
casting), so the host moves the small stored form only.

Batch `i` of epoch `e` is `keys = split.epoch_keys(e)[i * B:(i + 1) * B]`:
a pure function of `(seed, e)`, so any step's batch can be rebuilt after a
restart and resumption stays exact. A process reads only its rows of each
global batch (`keys[rows]`), so the global batch does not depend on the
number of processes.

    keys = split.epoch_keys(epoch)[i * batch_size : (i + 1) * batch_size]
    stored = split.read(keys[rows])                 # {"image": uint8 [b, 28, 28, 1], "label": int32 [b]}
    batch = split.prepare(jax.device_put(stored))   # in the step: {"image": float32 in [0, 1], ...}
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its inputs.

    `input_shape`: one example (`(28, 28, 1)`; `(seq_len,)` for text);
    `num_classes`: label count, the vocabulary size for text, or None;
    `tokenizer`: the `data.tokenizer` of a text dataset, else None.
    """

    input_shape: tuple[int, ...]
    num_classes: int | None
    tokenizer: str | None = None


@runtime_checkable
class TrainSplit(Protocol):
    """A training split addressed by `(seed, epoch)`; see the module docstring."""

    spec: DataSpec

    def steps_per_epoch(self, batch_size: int) -> int:
        """Full batches per epoch (a last partial batch is dropped); the same for every epoch."""

    def epoch_keys(self, epoch: int) -> np.ndarray:
        """int64 keys of every example of epoch `epoch`, in training order (from `(seed, epoch)`)."""

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The stored rows for `keys`, on the host: `{column: array [len(keys), ...]}`."""

    def stored(self) -> dict[str, np.ndarray]:
        """The whole stored arrays (memory-maps), for placing the split on the devices."""

    def read_on_device(self, stored: dict[str, jax.Array], keys: jax.Array) -> dict[str, jax.Array]:
        """:meth:`read` inside a jitted function, from `stored()` placed on the devices."""

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Stored rows -> model inputs, inside the jitted step (for example uint8 -> float32 in [0, 1])."""


@runtime_checkable
class EvalSplit(Protocol):
    """An evaluation split, read in order."""

    spec: DataSpec

    def __len__(self) -> int:
        """Examples in the split (text: windows)."""

    def eval_batches(self, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
        """The split in order, in stored form, the last batch padded; `"mask"` marks real rows.
        Only `rows` of each batch (one process's share) are yielded."""

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """As :meth:`TrainSplit.prepare`."""


_noticed: set[tuple[str, ...]] = set()


def notice(key: tuple[str, ...], message: str) -> None:
    """Say `message` once per process, on process 0 only (every process of a run loads the same data)."""
    if key not in _noticed:
        _noticed.add(key)
        if jax.process_index() == 0:
            print(message, file=sys.stderr, flush=True)
