"""One process of a small multi-process JAX run under the watchdog, for tests/test_watchdog.py.

Every process runs `--steps` steps, each an all-gather across the processes
(or, with `--idle`, a short sleep: no collective to fail); the `--victim`
process fails at step `--fail-at` as `--fail` says, after printing
`failing at <time.time()>` on stdout.

    python tests/watchdog_worker.py 127.0.0.1:PORT NUM_PROCESSES PROCESS_ID --fail kill --victim 0
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from nnx_cli import watchdog


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("coordinator")
    parser.add_argument("num_processes", type=int)
    parser.add_argument("process_id", type=int)
    parser.add_argument("--fail", choices=["raise", "exit", "kill"])
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--fail-at", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()

    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    watchdog.start(timeout=args.timeout)
    with watchdog.watching():
        for step in range(args.steps):
            if args.idle:
                time.sleep(0.02)
            else:
                multihost_utils.process_allgather(np.int32(step))
            if args.fail and step == args.fail_at and args.process_id == args.victim:
                print(f"failing at {time.time()}", flush=True)
                if args.fail == "raise":
                    raise RuntimeError("the victim raised on purpose")
                if args.fail == "exit":
                    sys.exit(3)
                os.kill(os.getpid(), signal.SIGKILL)
    print(f"process {args.process_id} done", flush=True)


if __name__ == "__main__":
    main()
