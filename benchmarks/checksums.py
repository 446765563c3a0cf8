"""How fast checkpoint checksums are: seal and verify of a real Orbax step, against plain reads of the same files.

Writes one checkpoint of `--mb` megabytes of float32 parameters, then times,
with the files in the page cache ("warm") and evicted from it ("cold", where
the kernel honours POSIX_FADV_DONTNEED): reading every file (the baseline),
`integrity.verify`, and `integrity.seal`. Prints MB/s and the ratio to the
baseline read.

    python benchmarks/checksums.py [--mb 512] [--dir /tmp]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from nnx_cli import integrity
from nnx_cli.checkpoint import Checkpointer


def files(step_dir: Path) -> list[Path]:
    return [p for p in step_dir.rglob("*") if p.is_file()]


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[Path]) -> None:
    buffer = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def timed(fn, paths: list[Path], cold: bool) -> float:
    if cold:
        evict(paths)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: the temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = args.mb * (1 << 20) // 4 // 1024
        rng = np.random.default_rng(0)
        state = {f"layer{i}": jnp.asarray(rng.standard_normal((rows // 8, 1024)), jnp.float32) for i in range(8)}
        ckpt = Checkpointer(Path(tmp) / "ckpt", checksums=False)
        ckpt.save(1, state)
        ckpt.close()
        step_dir = Path(tmp) / "ckpt" / "1"
        paths = files(step_dir)
        size = sum(p.stat().st_size for p in paths)
        print(f"checkpoint: {len(paths)} files, {size / 1e6:.0f} MB, {integrity.ALGORITHM}, {os.cpu_count()} CPUs")
        integrity.seal(step_dir, process=0, process_count=1)
        paths = files(step_dir)
        for cold in (False, True):
            base = min(timed(lambda: read_all(paths), paths, cold) for _ in range(3))
            verify = min(timed(lambda: integrity.verify(step_dir), paths, cold) for _ in range(3))
            seal = min(
                timed(lambda: integrity.seal(step_dir, process=0, process_count=1), paths, cold) for _ in range(3)
            )
            label = "cold" if cold else "warm"
            print(f"{label}: read {size / base / 1e6:7.0f} MB/s")
            print(f"{label}: verify {size / verify / 1e6:5.0f} MB/s  ({verify / base:.2f}x the read)")
            print(f"{label}: seal {size / seal / 1e6:7.0f} MB/s  ({seal / base:.2f}x the read)")


if __name__ == "__main__":
    main()
