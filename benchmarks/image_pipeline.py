"""MNIST through the image pipeline: decode time, cache hits and host-feed throughput.

Each figure is compared with the previous release's path (benchmarks/baseline_loader.py), measured in the same run:
`load_split` (every PNG decoded into float32 on every run) and `Batches` +
`prefetch` (one batch per step gathered in a thread).

    python benchmarks/image_pipeline.py [--data ../shared/data/mnist] [--steps 3000] [--workers 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import baseline_loader

from nnx_cli.config import DataConfig
from nnx_cli.data import sources
from nnx_cli.data.images import image_train_split, load_images
from nnx_cli.data.pipeline import dispatches, host_feed


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fresh_open() -> None:
    """Forget the `datasets` objects this process opened, as a new run would (their arrow cache stays)."""
    sources._cache.clear()


def decode(cfg: DataConfig, workers: int) -> None:
    baseline = seconds(lambda: baseline_loader.load_split(cfg, "train"))
    print(f"today's load_split (float32, in process): {baseline:6.2f} s")
    with tempfile.TemporaryDirectory() as cache:
        for w in (0, workers):
            fresh_open()
            build = seconds(
                lambda w=w: load_images(DataConfig(**{**vars(cfg), "workers": w, "cache_dir": cache}), "train")
            )
            print(f"decode into the cache, {w} workers:       {build:6.2f} s  ({baseline / build:.2f}x today's)")
            fresh_open()
            hit = seconds(
                lambda w=w: load_images(DataConfig(**{**vars(cfg), "workers": w, "cache_dir": cache}), "train")
            )
            print(f"cache hit (datasets reopened):           {hit:6.2f} s  ({baseline / hit:.0f}x today's)")
            for entry in Path(cache).iterdir():  # the next worker count decodes again
                if entry.is_dir():
                    shutil.rmtree(entry)


def rate(records, steps_per_record: int) -> tuple[float, float]:
    """(seconds to the first record, batches/s after it): worker start-up apart from the steady state."""
    start = time.perf_counter()
    next(records)
    first = time.perf_counter()
    count = sum(1 for _ in records)
    return first - start, count * steps_per_record / (time.perf_counter() - first)


def throughput(cfg: DataConfig, steps: int, workers: int) -> None:
    with tempfile.TemporaryDirectory() as cache:
        cfg = DataConfig(**{**vars(cfg), "cache_dir": cache, "workers": 0})
        split = image_train_split(cfg, seed=0)
        old = baseline_loader.Batches(baseline_loader.load_split(cfg, "train"), 128, seed=0)
        _, baseline = rate(baseline_loader.prefetch(old.get, range(steps)), 1)
        print(f"today's Batches + prefetch:       {baseline:8.0f} batches/s (float32)")
        for k in (1, 10):
            for w in (0, workers):
                start, ours = rate(host_feed(split, 128, dispatches(0, steps, k), workers=w), k)
                print(
                    f"Grain host feed K={k:<2} {w} workers: {ours:8.0f} batches/s ({ours / baseline:.2f}x today's), "
                    f"first record after {start:.2f} s"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cfg = DataConfig(source=args.data)
    fresh_open()
    sources.open_dataset(args.data)  # the `datasets` arrow cache, built once, is common to every path measured
    decode(cfg, args.workers)
    throughput(cfg, args.steps, args.workers)


if __name__ == "__main__":
    main()
