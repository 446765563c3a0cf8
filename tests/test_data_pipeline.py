"""The input pipeline: whole dispatches read in Grain workers, or the split kept on the devices."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_support import device_flags
from image_support import png_parquet
from jax.sharding import NamedSharding, PartitionSpec

from nnx_cli.config import DataConfig
from nnx_cli.data.images import ImageArrays, ImageEvalSplit, ImageTrainSplit, image_train_split
from nnx_cli.data.pipeline import (
    BatchKeys,
    device_feed,
    dispatches,
    eval_feed,
    host_feed,
    keep_on_device,
    place_stored,
    stored_nbytes,
    worker_count,
)
from nnx_cli.errors import UserError
from nnx_cli.sharding import batch_layout

ROOT = Path(__file__).resolve().parent.parent


def small_split(n: int = 103, seed: int = 5) -> ImageTrainSplit:
    rng = np.random.default_rng(n)
    image = rng.integers(0, 256, size=(n, 3, 2, 1), dtype=np.uint8)
    return ImageTrainSplit(ImageArrays(image, np.arange(n, dtype=np.int32), 255.0, n), seed)


def expected_batch(split: ImageTrainSplit, batch_size: int, step: int, rows: slice = slice(None)) -> dict:
    """Batch `step` straight from the definition: `split.read(epoch_keys(e)[i*B:(i+1)*B][rows])`."""
    epoch, i = divmod(step, len(split) // batch_size)
    return split.read(split.epoch_keys(epoch)[i * batch_size : (i + 1) * batch_size][rows])


def test_workers_default_to_the_cores_and_0_means_none():
    assert worker_count(None) == len(os.sched_getaffinity(0)) and worker_count(0) == 0 and worker_count(3) == 3


def test_more_workers_than_four_a_core_are_capped_there_with_a_notice(capfd):
    """A typo's 100000 started one worker process per dispatch (a 24-step run: 76 s instead of 7)."""
    cores = len(os.sched_getaffinity(0))
    assert worker_count(4 * cores) == 4 * cores and capfd.readouterr().err == ""
    assert worker_count(100000) == 4 * cores
    assert f"notice: data.workers (100000) is more than four worker processes for each of this machine's {cores} " in (
        capfd.readouterr().err
    )


def test_dispatches_are_aligned_to_multiples_of_k_with_single_steps_around():
    assert dispatches(0, 10, 4) == [(0, 4), (4, 4), (8, 1), (9, 1)]
    assert dispatches(7, 9, 10) == [(7, 1), (8, 1)]
    assert dispatches(25, 47, 10) == [(s, 1) for s in range(25, 30)] + [(30, 10)] + [(s, 1) for s in range(40, 47)]


@pytest.mark.parametrize(("start", "k", "rows"), [(0, 1, slice(None)), (9, 4, slice(None)), (3, 5, slice(4, 12))])
def test_host_feed_records_stack_the_rows_of_each_steps_global_batch(start: int, k: int, rows: slice):
    split = small_split()  # 6 steps of 16 per epoch: these dispatches cross epochs
    plan = dispatches(start, start + 3 * k, k)
    for (step, steps), record in zip(plan, host_feed(split, 16, plan, rows=rows), strict=True):
        assert record["image"].shape[:2] == (steps, len(range(16)[rows]))
        for j in range(steps):
            for name, value in expected_batch(split, 16, step + j, rows).items():
                np.testing.assert_array_equal(record[name][j], value)


def test_host_feed_is_bit_identical_with_0_and_2_workers(tmp_path: Path):
    png_parquet(tmp_path / "digits.parquet", 300, shape=(8, 8))
    cfg = DataConfig(source=str(tmp_path / "digits.parquet"), image_key="img", cache_dir=str(tmp_path / "c"))
    split = image_train_split(cfg, seed=1)  # memory-mapped: workers reopen the cache
    plan = dispatches(5, 45, 3)
    alone = list(host_feed(split, 32, plan, workers=0))
    shared = list(host_feed(split, 32, plan, workers=2))
    assert len(alone) == len(shared) == len(plan)
    for a, b in zip(alone, shared):
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)


def test_a_batch_larger_than_the_split_is_a_user_error_before_any_worker_starts():
    with pytest.raises(UserError, match="train.batch_size"):
        host_feed(small_split(10), 16, dispatches(0, 4, 2), workers=2)


def test_device_feed_places_each_record_with_the_steps_axis_whole():
    split = small_split()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    layout = batch_layout(mesh, [("batch", "data")], 16)
    plan = dispatches(2, 12, 4)
    for (step, k), placed in zip(plan, device_feed(split, layout, plan), strict=True):
        assert placed["image"].sharding.spec == PartitionSpec(None, "data")
        for j in range(k):
            np.testing.assert_array_equal(np.asarray(placed["image"][j]), expected_batch(split, 16, step + j)["image"])


def test_device_resident_reads_give_the_host_batches():
    split = small_split()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    stored = place_stored(split, NamedSharding(mesh, PartitionSpec("data")))
    keys = BatchKeys(split, 16).dispatch(step=4, k=5)  # crosses into epoch 1

    @jax.jit
    def gather(stored, keys):
        return jax.lax.map(lambda step_keys: split.prepare(split.read_on_device(stored, step_keys)), keys)

    batches = gather(stored, keys)
    assert keys.dtype == np.int32 and keys.shape == (5, 16)
    for j in range(5):
        expected = expected_batch(split, 16, 4 + j)
        np.testing.assert_array_equal(np.asarray(batches["label"][j]), expected["label"])
        np.testing.assert_array_equal(np.asarray(batches["image"][j]), expected["image"] / np.float32(255))


def test_eval_feed_places_the_split_in_order_up_to_max_batches():
    image = np.arange(10 * 4, dtype=np.uint8).reshape(10, 2, 2, 1)
    split = ImageEvalSplit(ImageArrays(image, np.arange(10, dtype=np.int32), 255.0, 10))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    layout = batch_layout(mesh, [("batch", "data")], 4, "train.eval_batch_size")
    placed = list(eval_feed(split, layout))
    assert [int(b["mask"].sum()) for b in placed] == [4, 4, 2] and isinstance(placed[0]["image"], jax.Array)
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(b["image"])[np.asarray(b["mask"])] for b in placed]), image
    )
    assert len(list(eval_feed(split, layout, max_batches=2))) == 2


_EIGHT_DEVICES = """
import jax, numpy as np
from jax.sharding import PartitionSpec
from nnx_cli.data.images import ImageArrays, ImageTrainSplit
from nnx_cli.data.pipeline import BatchKeys, device_feed, dispatches, host_feed, keep_on_device, place_stored
from nnx_cli.sharding import batch_layout

assert jax.device_count() == 8
n = 1001  # not a multiple of the 4 ways of the data axis: the stored arrays are padded to 1004 rows
image = np.random.default_rng(0).integers(0, 256, (n, 4, 4, 1), np.uint8)
split = ImageTrainSplit(ImageArrays(image, np.arange(n, dtype=np.int32), 255.0, n), seed=3)
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
layout = batch_layout(mesh, [("batch", "data")], 64)
stored = place_stored(split, layout.sharding)
assert stored["image"].shape == (1004, 4, 4, 1) and stored["image"].sharding.spec[0] == "data"

@jax.jit
def gather(stored, keys):
    read = lambda k: jax.lax.with_sharding_constraint(split.read_on_device(stored, k), layout.sharding)
    return jax.lax.map(read, keys)

plan = dispatches(12, 20, 4)  # 15 steps per epoch: the first dispatch crosses into epoch 1
keys = BatchKeys(split, 64)
host = list(host_feed(split, 64, plan))
placed = list(device_feed(split, layout, plan))
for (step, k), record, on_host in zip(plan, placed, host):
    assert record["image"].shape == (k, 64, 4, 4, 1) and record["image"].sharding.spec == PartitionSpec(None, "data")
    resident = gather(stored, keys.dispatch(step, k))
    for name in ("image", "label"):
        np.testing.assert_array_equal(np.asarray(resident[name]), on_host[name])
        np.testing.assert_array_equal(np.asarray(record[name]), on_host[name])

# 1.5 GiB split 4 ways: each CPU device holds 384 MiB, within the 1 GiB a device without memory stats allows
huge = ImageTrainSplit(ImageArrays(np.broadcast_to(np.uint8(0), (1536, 1 << 20, 1, 1)), None, 255.0, None), 0)
assert keep_on_device("auto", huge, layout.sharding) and not keep_on_device("auto", huge)
print("ok")
"""


def test_8_devices_gather_the_same_batches_resident_and_fed_and_count_a_devices_share(tmp_path: Path):
    env = {**os.environ, "XLA_FLAGS": device_flags(8), "JAX_PLATFORMS": "cpu"}
    (tmp_path / "eight.py").write_text(textwrap.dedent(_EIGHT_DEVICES))
    out = subprocess.run(
        [sys.executable, str(tmp_path / "eight.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_worker_processes_leave_no_shared_memory_and_no_leak_warning_when_a_command_exits_at_once(tmp_path: Path):
    script = """
import numpy as np
from nnx_cli.data.pipeline import map_ordered
from nnx_cli.errors import exit_now

if __name__ == "__main__":
    assert sum(float(x.sum()) for x in map_ordered(np.ones, [1000] * 8, workers=2)) == 8000
    exit_now(0)  # as every command ends: os._exit, no finalizers
"""
    (tmp_path / "run.py").write_text(script)

    def shared() -> set[str]:
        return {name for name in os.listdir("/dev/shm") if name.startswith(("psm_", "sem."))}

    before = shared()
    out = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr, out.stderr
    # /dev/shm is the whole machine's: the other workers' commands make and remove entries of their own meanwhile
    # (their data workers' semaphores). What this command left never goes; theirs go when they end.
    new, deadline = shared() - before, time.monotonic() + 120
    while new and time.monotonic() < deadline:
        time.sleep(0.5)
        new &= shared()
    assert not new


def test_on_device_true_and_false_are_taken_as_given():
    assert keep_on_device(True, small_split()) and not keep_on_device(False, small_split())


def test_on_device_auto_keeps_a_split_within_a_quarter_of_the_devices_memory_or_1_gib_on_a_cpu():
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats["bytes_limit"] // 4 if stats.get("bytes_limit") else 1 << 30  # a CPU reports none
    small = small_split()
    rows = limit // (1 << 20) + 1  # of 1 MiB each, a view of one byte: no memory taken
    large = ImageTrainSplit(ImageArrays(np.broadcast_to(np.uint8(0), (rows, 1 << 20, 1, 1)), None, 255.0, None), 0)
    assert stored_nbytes(large) > limit
    assert keep_on_device("auto", small) and not keep_on_device("auto", large)


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants. A thread or process that ends while it is read is passed over: a worker's
    threads come and go (the suite once failed on a thread gone between listing and opening it)."""
    kids = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"/proc/{pid}/task/{task}/children") as f,
            ):
                kids += [int(c) for c in f.read().split()]
    return [pid, *(p for kid in kids for p in _tree(kid))]


def pss_of_this_process_and_its_workers() -> int:
    total = 0
    for pid in _tree(os.getpid()):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a process that ended in between
            total += _pss(pid)
    return total


def test_iterating_the_host_feed_holds_far_less_than_the_float32_dataset(tmp_path: Path):
    """3,000 PNGs of 96x96: 110 MB as float32 (today's in-memory form), 28 MB as the uint8 cache.

    The baseline is taken once the two workers are up and have delivered a
    record (their start-up, imports included, is no function of the data).
    Over two epochs, PSS may grow by the cache pages the workers map (at most
    the uint8 size, a quarter of the float32 size) and the records in flight;
    the bound, half the float32 size, fails any pipeline that holds the
    decoded dataset as float32 in the main process or a worker.
    """
    png_parquet(tmp_path / "big.parquet", 3000, shape=(96, 96))
    cfg = DataConfig(source=str(tmp_path / "big.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    split = image_train_split(cfg, seed=0)
    float32_bytes = split.arrays.image.size * 4
    feed = host_feed(split, 100, dispatches(0, 60, 1), workers=2)
    next(feed)
    baseline = peak = pss_of_this_process_and_its_workers()
    for _ in feed:
        peak = max(peak, pss_of_this_process_and_its_workers())
    assert peak - baseline < float32_bytes / 2, f"grew {(peak - baseline) >> 20} MiB over {baseline >> 20} MiB"
