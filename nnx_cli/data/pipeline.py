"""The input pipeline: whole dispatches of batches read in Grain workers, or the split kept on the devices.

One jitted dispatch runs `k` optimizer steps, so the unit of input is a
dispatch, not an example. Two ways to feed it, chosen by
:func:`keep_on_device` from `data.on_device`
(`keep_on_device(cfg.data.on_device, split, layout.sharding)`):

- **Host feed** (:func:`host_feed`, :func:`device_feed`): the record of the
  dispatch `(s, k)` holds, stacked `[k, rows, ...]`, this process's rows of
  the global batches of steps `s .. s+k-1` in stored form (uint8 pixels).
  Records are read in `data.workers` Grain worker processes (0: a thread of
  this process), a bounded number ahead, and come out in order and
  bit-identical whatever the worker count; any start step works, so a resumed
  run reads exactly what an uninterrupted one would have::

      plan = dispatches(start, total_steps, steps_per_dispatch=10)
      for (step, k), batch in zip(plan, device_feed(split, layout, plan, workers=worker_count(cfg.data.workers))):
          state, ... = train_steps(state, batch)          # batch["image"]: uint8 [k, B, 28, 28, 1], sharded

- **Device-resident** (:func:`place_stored`, :class:`BatchKeys`): the stored
  arrays go to the devices once, sharded along the example axis (each device
  holds its share; XLA gathers a batch from the shards); a dispatch
  then moves only its int32 keys `[k, B]` (the same on every process) and the
  jitted step reads `split.read_on_device(stored, keys[j])`::

      stored = place_stored(split, layout.sharding)
      keys = BatchKeys(split, batch_size)
      state, ... = train_steps(state, stored, keys.dispatch(step, k))   # inside: split.read_on_device(...)

A split given to the host feed with workers is pickled into them: it must
pickle cheaply (memory-mapped arrays reopened by path, see
:class:`nnx_cli.data.images.ImageArrays`).
"""

from __future__ import annotations

import functools
import math
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_cli.data.base import EvalSplit, TrainSplit

if TYPE_CHECKING:
    from nnx_cli.sharding import BatchLayout

T = TypeVar("T")

_DEVICE_BUFFER = 2  # dispatches placed on the devices ahead of the one running
_CPU_FALLBACK_BYTES = 1 << 30  # on-device budget where a device reports no memory (CPU)


def worker_count(workers: int | None) -> int:
    """`data.workers`: None means one worker process per core this process may run on; 0 reads in this process.
    More than four a core is capped there, with a notice (a typo's 100000 started a process per dispatch, and a
    run of 24 steps took 76 s instead of 7).

    >>> worker_count(0)
    0
    """
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # a container may pin us to fewer
    count = len(cores) if cores else (os.cpu_count() or 1)
    if workers is None:
        return count
    if workers > 4 * count:
        from nnx_cli.data.base import notice

        notice(("workers", workers), f"notice: data.workers ({workers}) is more than four worker processes for each "
               f"of this machine's {count} cores; {4 * count} read the data")  # fmt: skip
        return 4 * count
    return workers


def map_ordered(fn: Callable[[Any], T], items: int | Sequence[Any], workers: int, buffer: int = 2) -> Iterator[T]:
    """`fn(item)` for each item (or each index of `range(items)`), in order, computed ahead by Grain.

    With `workers > 0`, `fn` is pickled into that many worker processes, each
    computing every `workers`-th item up to `buffer` ahead; with 0, one thread
    of this process computes up to `buffer` ahead. Errors raised by `fn`
    surface here with their own type.

    >>> list(map_ordered(abs, [-1, 2, -3], workers=0))
    [1, 2, 3]
    """
    it = iter(_grain_records(fn, items, workers, buffer))
    try:
        yield from it
    finally:
        it.close()


def _grain_records(fn: Callable[[Any], T], items: int | Sequence[Any], workers: int, buffer: int) -> Any:
    """The Grain `IterDataset` behind :func:`map_ordered`."""
    import grain

    items = range(items) if isinstance(items, int) else items
    ds = grain.MapDataset.source(items).map(fn)
    iter_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=buffer))
    workers = min(workers, len(items))
    if workers > 0:
        _absl_flags_readable()
        _quiet_resource_tracker()
        iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer))
        iter_ds = iter_ds.map(_out_of_shared_memory)
    return iter_ds


def _out_of_shared_memory(record: Any) -> Any:
    """Copy a worker's arrays out of Grain's shared-memory blocks, so each block is released at once (a block
    still referenced when the interpreter exits leaks), and what the caller keeps is plain numpy."""
    return jax.tree.map(lambda v: np.array(v) if isinstance(v, np.ndarray) else v, record)


def _quiet_resource_tracker() -> None:
    """Keep multiprocessing's resource tracker from warning of "leaked" semaphores and shared memory at exit.

    The commands end with `os._exit` (errors.exit_now), which skips the finalizers that unlink Grain's
    semaphores, and a block a worker creates and this process unlinks stays registered on Python < 3.13: the
    tracker unlinks all of them as the process ends (its job; /dev/shm is left empty), but warned of each. The
    flag reaches the tracker when it starts, with this process's warning options."""
    quiet = "ignore:resource_tracker:UserWarning"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)


def _absl_flags_readable() -> None:
    """Let Grain read its absl flags (their defaults) in a program that never parsed any: mp_prefetch
    reads one when JAX is loaded, and an unparsed flag is an error."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def dispatches(start: int, stop: int, steps_per_dispatch: int) -> list[tuple[int, int]]:
    """`(first_step, num_steps)` of each dispatch from step `start` up to `stop`: `steps_per_dispatch` steps
    each, aligned to its multiples (where hooks run), and single steps where the start or the end falls
    between multiples (so at most two shapes compile).

    >>> dispatches(5, 16, 4)
    [(5, 1), (6, 1), (7, 1), (8, 4), (12, 4)]
    """
    plan, step, k = [], start, steps_per_dispatch
    while step < stop:
        n = k if step % k == 0 and step + k <= stop else 1
        plan.append((step, n))
        step += n
    return plan


class BatchKeys:
    """The keys of the global batch of any step: batch `i` of epoch `e` is
    `split.epoch_keys(e)[i * batch_size : (i + 1) * batch_size]`.

    The epoch's keys are kept for the next call, so consecutive steps cost a
    slice each.

    >>> keys = BatchKeys(split, batch_size=128)
    >>> keys.dispatch(step=40, k=10).shape          # int32, for the device-resident mode
    (10, 128)
    """

    def __init__(self, split: TrainSplit, batch_size: int):
        self.split = split
        self.batch_size = batch_size
        self.steps_per_epoch = split.steps_per_epoch(batch_size)
        self._epoch: tuple[int, np.ndarray] | None = None

    def step(self, step: int) -> np.ndarray:
        """The keys of step `step`'s global batch, `[batch_size]`."""
        epoch, i = divmod(step, self.steps_per_epoch)
        cached = self._epoch
        if cached is None or cached[0] != epoch:
            cached = self._epoch = (epoch, self.split.epoch_keys(epoch))
        return cached[1][i * self.batch_size : (i + 1) * self.batch_size]

    def dispatch(self, step: int, k: int) -> np.ndarray:
        """The keys of steps `step .. step+k-1`, int32 `[k, batch_size]`."""
        return np.stack([self.step(step + j) for j in range(k)]).astype(np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_epoch": None}


class _ReadDispatch:
    """The record of one dispatch: this process's `rows` of its batches, read once, stacked `[k, rows, ...]`."""

    def __init__(self, split: TrainSplit, batch_size: int, rows: slice):
        self.keys = BatchKeys(split, batch_size)
        self.rows = rows

    def __call__(self, dispatch: tuple[int, int]) -> dict[str, np.ndarray]:
        step, k = dispatch
        keys = np.concatenate([self.keys.step(step + j)[self.rows] for j in range(k)])
        return {name: v.reshape(k, -1, *v.shape[1:]) for name, v in self.keys.split.read(keys).items()}


def host_feed(
    split: TrainSplit,
    batch_size: int,
    plan: Sequence[tuple[int, int]],
    rows: slice = slice(None),
    workers: int = 0,
    buffer: int = 2,
) -> Iterator[dict[str, np.ndarray]]:
    """One record per dispatch of `plan` (see :func:`dispatches`), in order, read `buffer` ahead per worker.

    The record of `(s, k)` is `{column: array [k, rows, ...]}`: for each step
    `s + j`, `split.read(keys[rows])` with `keys` the step's global batch.

    >>> record = next(host_feed(split, 128, dispatches(0, 100, 10)))
    >>> record["image"].shape, record["image"].dtype
    ((10, 128, 28, 28, 1), dtype('uint8'))
    """
    split.steps_per_epoch(batch_size)  # a batch larger than the split is an error here, not in a worker
    return map_ordered(_ReadDispatch(split, batch_size, rows), list(plan), workers, buffer)


def dispatch_sharding(batch_sharding: NamedSharding) -> NamedSharding:
    """The sharding of a host-feed record `[k, B, ...]`: steps unsplit, rows as `batch_sharding` splits a batch."""
    return NamedSharding(batch_sharding.mesh, PartitionSpec(None, *batch_sharding.spec))


def place_dispatch(record: dict[str, np.ndarray], layout: BatchLayout) -> dict[str, jax.Array]:
    """Put this process's `[k, rows, ...]` record on its devices as global `[k, layout.size, ...]` arrays."""
    sharding = dispatch_sharding(layout.sharding)
    if jax.process_count() == 1:
        return jax.device_put(record, sharding)
    return {
        name: jax.make_array_from_process_local_data(sharding, v, (v.shape[0], layout.size, *v.shape[2:]))
        for name, v in record.items()
    }


def device_feed(
    split: TrainSplit, layout: BatchLayout, plan: Sequence[tuple[int, int]], workers: int = 0, buffer: int = 2
) -> Iterator[dict[str, jax.Array]]:
    """:func:`host_feed` records placed on the devices (:func:`place_dispatch`), two dispatches ahead."""
    from grain.experimental import ThreadPrefetchIterDataset

    split.steps_per_epoch(layout.size)
    records = _grain_records(_ReadDispatch(split, layout.size, layout.rows), list(plan), workers, buffer)
    placed = ThreadPrefetchIterDataset(
        records.map(lambda r: place_dispatch(r, layout)), prefetch_buffer_size=_DEVICE_BUFFER
    )
    it = iter(placed)
    try:
        yield from it
    finally:
        it.close()


def eval_feed(split: EvalSplit, layout: BatchLayout, max_batches: int | None = None) -> Iterator[dict[str, jax.Array]]:
    """The eval split in order (`split.eval_batches`: stored form, padded, with `"mask"`), placed with
    `layout.place` one batch ahead; at most `max_batches` (`train.eval_max_batches`) batches.

    >>> for batch in eval_feed(eval_split, eval_layout):
    ...     sums = eval_step(state, eval_split.prepare(batch))   # prepare inside the jitted step
    """
    count = -(-len(split) // layout.size)
    count = count if max_batches is None else min(count, max_batches)
    batches = split.eval_batches(layout.size, layout.rows)
    return prefetch(lambda _: layout.place(next(batches)), range(count), size=1)


# --------------------------------------------------------------------------- device-resident


def _ways(sharding: NamedSharding) -> int:
    axes = sharding.spec[0] if len(sharding.spec) else None
    if axes is None:
        return 1
    return math.prod(sharding.mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def stored_nbytes(split: TrainSplit) -> int:
    """Bytes of the split's stored arrays (what :func:`place_stored` puts on the devices)."""
    return sum(v.nbytes for v in split.stored().values())


def keep_on_device(setting: bool | str, split: TrainSplit, batch_sharding: NamedSharding | None = None) -> bool:
    """`data.on_device`: true, false, or auto: on the devices when each device's share of the stored arrays
    takes at most a quarter of the memory it reports (`memory_stats()["bytes_limit"]`), or at most 1 GiB
    where it reports none (CPU).

    A device's share is the split divided by the ways `batch_sharding` (the
    training batch's) splits the example axis: XLA gathers a batch from each
    shard where the keys fall and sums the pieces (an all-reduce of one
    batch), so no device ever holds the whole split.

    >>> keep_on_device("auto", split, layout.sharding)          # MNIST: 47 MB of uint8
    True
    """
    if isinstance(setting, bool):
        return setting
    ways = _ways(batch_sharding) if batch_sharding is not None else 1
    share = -(-stored_nbytes(split) // ways)
    devices = batch_sharding.mesh.local_devices if batch_sharding is not None else jax.local_devices()
    for device in devices:
        stats = device.memory_stats() or {}
        if share > (stats["bytes_limit"] // 4 if stats.get("bytes_limit") else _CPU_FALLBACK_BYTES):
            return False
    return True


def place_stored(split: TrainSplit, batch_sharding: NamedSharding) -> dict[str, jax.Array]:
    """The split's stored arrays on the devices, split along the example axis like `batch_sharding` splits a
    batch.

    The example count is padded with zero rows up to a multiple of the shard
    count; the padding is never addressed (keys are below `len(split)`). Each
    process reads only the rows its devices hold, straight from the memory map.

    >>> stored = place_stored(split, layout.sharding)         # {"image": uint8 [60000, 28, 28, 1], ...}
    """
    ways = _ways(batch_sharding)
    sharding = NamedSharding(batch_sharding.mesh, PartitionSpec(batch_sharding.spec[0] if ways > 1 else None))
    placed = {}
    for name, column in split.stored().items():
        padded = -(-len(column) // ways) * ways
        read = functools.partial(_padded_rows, column, padded)
        placed[name] = jax.make_array_from_callback((padded, *column.shape[1:]), sharding, read)
    return placed


def _padded_rows(column: np.ndarray, padded: int, index: tuple[slice, ...]) -> np.ndarray:
    """Rows `index[0]` of `column` seen as padded with zero rows to `padded` rows."""
    start, stop, _ = index[0].indices(padded)
    rows = np.asarray(column[start : min(stop, len(column))])
    if stop <= len(column):
        return rows
    return np.concatenate([rows, np.zeros((stop - max(start, len(column)), *rows.shape[1:]), rows.dtype)])


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
