"""One process of a two-process run that saves step 1 of an array split over both, for tests/test_integrity.py.

python tests/two_process_checkpoint.py 127.0.0.1:PORT NUM_PROCESSES PROCESS_ID CHECKPOINT_DIR
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_cli.checkpoint import Checkpointer


def main() -> None:
    coordinator, num_processes, process_id, directory = sys.argv[1:]
    jax.distributed.initialize(coordinator, int(num_processes), int(process_id))
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    values = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
    state = {
        "split": jax.make_array_from_callback(values.shape, split, lambda index: values[index]),
        "replicated": jax.make_array_from_callback((16,), whole, lambda index: np.ones(16, np.float32)[index]),
    }
    ckpt = Checkpointer(directory)
    ckpt.save(1, state)
    ckpt.close()


if __name__ == "__main__":
    main()
