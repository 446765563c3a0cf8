"""A dataset far larger than its float32 budget: peak memory of the image pipeline, first and second run.

Generates (once; reused when it is already there) 20,000 greyscale 160x160
PNGs with labels as a parquet dataset (`train-*.parquet`, `test-*.parquet`,
columns `image` and `label`, as `ylecun/mnist` lays them out): 2.0 GB as
float32, 0.5 GB as the uint8 cache. Then runs the pipeline twice in fresh
processes (decode into the cache, then a cache hit) for 60 steps of batch
128, sampling the proportional set size (PSS) of the run and all its worker
processes from this process, and prints each run's time and peak beside the
dataset's float32 size, and beside the previous release's loader (`baseline_loader.load_split` +
`Batches`, which holds that whole) run the same way. Then the same twice
through `nnx-train` itself: `mlp_classifier` for 60 steps, first run (decode
into a new cache) and second run (cache hit), every setting at its default.

    python benchmarks/large_images.py --out /tmp/large-images [--workers 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZE = 160


def generate(out: Path, count: int = 20_000, size: int = SIZE, test: int = 1_000, seed: int = 0) -> Path:
    """Write `count` train and `test` test images (smooth random patterns, 10 classes) to `out` as parquet.

    Returns `out`; a directory that already holds the dataset is kept as it is.
    """
    import datasets
    from PIL import Image

    if (out / "train-00000-of-00001.parquet").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    for split, n in (("train", count), ("test", test)):

        def rows(n: int = n):
            for _ in range(n):
                label = int(rng.integers(10))
                fx, fy, phase = rng.uniform(1, 12, 2).tolist() + [rng.uniform(0, 6.3)]
                wave = np.sin(2 * np.pi * (fx * xx + phase)) * np.cos(2 * np.pi * fy * yy) + label / 5 - 1
                noise = rng.normal(0, 0.1, (size, size))
                pixels = np.clip((wave + noise) * 60 + 128, 0, 255).astype(np.uint8)
                yield {"image": Image.fromarray(pixels), "label": label}

        ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=tempfile.mkdtemp())
        ds.to_parquet(str(out / f"{split}-00000-of-00001.parquet"))
    return out


def _pss(pid: int) -> tuple[int, int]:
    """(PSS, PSS less file-backed pages) of one process, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[-1] == "kB":
                fields[parts[0]] = int(parts[1]) * 1024
    return fields["Pss:"], fields["Pss:"] - fields.get("Pss_File:", 0)


def _tree(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return [pid, *(p for kid in kids for p in _tree(kid))]


def tree_pss(pid: int) -> tuple[int, int]:
    """:func:`_pss` summed over `pid` and every process below it (a process that ends meanwhile counts 0)."""
    total = anon = 0
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for p in _tree(pid):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                both = _pss(p)
                total, anon = total + both[0], anon + both[1]
    return total, anon


def run(data: Path, cache: Path, workers: int, steps: int) -> None:
    """One run in this process: the training split from the cache (built if need be), `steps` placed batches."""
    import jax

    from nnx_cli.config import DataConfig
    from nnx_cli.data.images import image_train_split
    from nnx_cli.data.pipeline import device_feed, dispatches
    from nnx_cli.sharding import batch_layout

    split = image_train_split(DataConfig(source=str(data), workers=workers, cache_dir=str(cache)), seed=0)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    layout = batch_layout(mesh, [("batch", "data")], 128)
    plan = dispatches(0, steps, 1)
    for batch in device_feed(split, layout, plan, workers=workers):
        batch["image"].block_until_ready()


def run_today(data: Path, steps: int) -> None:
    """The baseline: today's `load_split` (the split decoded whole into float32) and `Batches` + `prefetch`."""
    import baseline_loader as today
    import jax

    from nnx_cli.config import DataConfig

    batches = today.Batches(today.load_split(DataConfig(source=str(data)), "train"), 128, seed=0)
    for batch in today.prefetch(lambda s: jax.device_put(batches.get(s)), range(steps)):
        batch["image"].block_until_ready()


def trainer_command(data: Path, cache: Path, workers: int, steps: int, workdir: Path) -> list[str]:
    """`nnx-train` of `mlp_classifier` on the dataset for `steps` steps of batch 128, as a user runs it."""
    overrides = [
        "model={name: mlp_classifier, hidden_sizes: [256]}", f"data.source={data}", f"data.cache_dir={cache}",
        f"data.workers={workers}", f"train.steps={steps}", "train.batch_size=128", "train.log_every=20",
        f"train.eval_every={steps}", "train.eval_max_batches=2", f"checkpoint.every_steps={steps}",
    ]  # fmt: skip
    config = workdir.parent / "large.yaml"
    config.write_text("{}\n")  # every key at its default but the overrides
    nnx_train = Path(sys.executable).parent / "nnx-train"
    return [str(nnx_train), str(config), *overrides, "--workdir", str(workdir), "--no-resume"]


def measure(
    data: Path, cache: Path, workers: int, steps: int, today: bool = False, trainer: Path | None = None
) -> tuple[float, int, int]:
    """(seconds, peak PSS, peak PSS less file-backed pages) of one run in a fresh process, sampled every 50 ms.

    File-backed pages (libraries, memory-mapped dataset and cache files) are
    page cache the kernel can drop under pressure; the rest cannot be.
    With `trainer` (a work dir), the run is `nnx-train` itself.
    """
    start = time.perf_counter()
    args = [sys.executable, __file__, "--run", "--out", str(data), "--cache", str(cache), "--workers", str(workers)]
    args += ["--steps", str(steps), *(["--today"] if today else [])]
    child = subprocess.Popen(trainer_command(data, cache, workers, steps, trainer) if trainer else args)
    peak = peak_anon = 0
    while child.poll() is None:
        total, anon = tree_pss(child.pid)
        peak, peak_anon = max(peak, total), max(peak_anon, anon)
        time.sleep(0.05)
    if child.returncode:
        raise SystemExit(f"the run failed with exit status {child.returncode}")
    return time.perf_counter() - start, peak, peak_anon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "nnx-large-images")
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--cache", type=Path, help="the array cache (default: a new temporary directory, so the first run decodes)"
    )
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--today", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run and args.today:
        return run_today(args.out, args.steps)
    if args.run:
        return run(args.out, args.cache, args.workers, args.steps)
    start = time.perf_counter()
    generate(args.out, args.count)
    print(f"dataset: {args.out} ({time.perf_counter() - start:.1f} s to generate or find)")
    float32 = args.count * SIZE * SIZE * 4
    runs = [("previous release's load_split + Batches", True, False)]
    runs += [("pipeline, first run (decodes into the cache)", False, False), ("pipeline, second run", False, False)]
    runs += [("nnx-train, first run (decodes)", False, True), ("nnx-train, second run (cache hit)", False, True)]
    with tempfile.TemporaryDirectory() as scratch:
        for name, today, trainer in runs:
            cache = args.cache or Path(scratch) / ("trainer-cache" if trainer else "cache")
            workdir = Path(scratch) / "run" if trainer else None
            seconds, peak, anon = measure(args.out, cache, args.workers, args.steps, today, workdir)
            print(
                f"{name}: {seconds:6.1f} s, peak PSS {peak / 2**20:5.0f} MiB ({peak / float32:.2f}x the "
                f"{float32 / 2**20:.0f} MiB float32 dataset), not file-backed {anon / 2**20:5.0f} MiB"
            )


if __name__ == "__main__":
    main()
