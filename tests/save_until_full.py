"""Save a small checkpoint, then one too big for the disk, the way `nnx-train` does; for
tests/test_checkpoint_write_failures.py. A failed save ends it like the CLI: one `error:` line, exit 1.

    python tests/save_until_full.py CHECKPOINT_DIR [--sync] [--file-size-limit BYTES]

With `--file-size-limit`, writes past that many bytes in one file fail with EFBIG
(as on a full disk, without needing a small file system to fill).
"""

from __future__ import annotations

import argparse
import resource
import signal

import jax.numpy as jnp
import numpy as np

from nnx_cli.checkpoint import Checkpointer
from nnx_cli.errors import report_errors

SMALL = np.arange(1000, dtype=np.float32)
BIG = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MB that do not compress


@report_errors
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--file-size-limit", type=int)
    args = parser.parse_args()

    ckpt = Checkpointer(args.directory, async_=not args.sync)
    ckpt.save(1, {"w": jnp.asarray(SMALL)})
    ckpt.wait()
    if args.file_size_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size_limit, args.file_size_limit))
    ckpt.save(2, {"w": jnp.asarray(BIG)})
    ckpt.close()


if __name__ == "__main__":
    main()
