"""What glibc's transparent huge pages (`nnx_cli.runtime.with_huge_pages`) do to a training step on a CPU.

XLA's CPU runtime takes a step's temporaries from malloc and gives them back after it. glibc serves large
blocks asked for by a thread other than the main one with fresh `mmap`s whatever its settings, so every step
faults its temporaries in again, in 4 KiB pages zeroed by the kernel. With `glibc.malloc.hugetlb=1` malloc asks
for transparent huge pages on those blocks (where the kernel's mode is `madvise`): 2 MiB pages, about 500 times
fewer faults.

Each measurement is a process of its own (glibc reads its tunables when a process starts), the trainer's own
`steps.train_step` from `benchmarks/profile_step.py` on one shape, `--steps` steps timed after two unmeasured;
A (huge pages) and B (4 KiB pages) alternate A B B A, `--pairs` times. Prints one line per process (median step,
minor page faults and system CPU seconds a step), then the medians and the A/B ratio. Run it on an idle machine:
the load average is printed before and after.

    python benchmarks/huge_pages.py [--shape smollm2|gpt2|heldout] [--lora] [--batch 4] [--seq-len 256]
                                    [--layers 30] [--steps 4] [--pairs 1] [--tiny]

`--tiny` (2 layers, sequence 64, one step) smoke-tests the script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(args: argparse.Namespace) -> dict:
    """This process's figures for `args.steps` steps (run by the child processes)."""
    sys.path.insert(0, str(HERE))
    import profile_step

    step, state, sums, batch, _ = profile_step.make_step(
        args.shape, args.lora, args.batch, args.seq_len, args.layers, {"dtype": "float32"}
    )
    _, state = profile_step.time_steps(step, state, sums, batch, 2)
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds, state = profile_step.time_steps(step, state, sums, batch, args.steps)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "step_ms": statistics.median(seconds) * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / args.steps,
        "system_s": (after.ru_stime - before.ru_stime) / args.steps,
    }


def child(args: argparse.Namespace, huge: bool) -> dict:
    from nnx_cli import runtime

    environment = {k: v for k, v in os.environ.items() if k != "NNX_HUGE_PAGES"}
    environment["GLIBC_TUNABLES"] = ":".join(  # the user's other tunables stay, on both sides
        item for item in environment.get("GLIBC_TUNABLES", "").split(":") if item and "hugetlb" not in item
    )
    if huge:  # what a command starts again with
        environment = runtime.huge_pages_environment(
            environment, runtime.transparent_huge_pages(), runtime.glibc_version()
        )
        if environment is None:
            raise SystemExit("this machine takes no huge pages on request (kernel mode, glibc < 2.35, or a relaunch)")
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2", choices=("smollm2", "gpt2", "heldout"))
    parser.add_argument("--lora", action="store_true", help="LoRA rank 16 on all seven projections (else full)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=1, help="A B B A this many times")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.seq_len, args.steps, args.batch = 2, 64, 1, 2
    if args.child:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        print(json.dumps(measure(args)))
        return
    what = "LoRA r16" if args.lora else "full fine-tuning"
    print(f"{args.shape}, {what}, batch {args.batch}, sequence {args.seq_len}, float32, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for huge in [True, False, False, True] * args.pairs:
        start = time.perf_counter()
        figures = child(args, huge)
        runs[huge].append(figures)
        print(f"  {'A huge pages' if huge else 'B 4 KiB pages'}: step {figures['step_ms']:,.0f} ms, "
              f"{figures['faults']:,.0f} minor faults and {figures['system_s']:.3f} s of system CPU a step "
              f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    a, b = (statistics.median(r["step_ms"] for r in runs[h]) for h in (True, False))
    print(f"median step: A {a:,.0f} ms, B {b:,.0f} ms, A/B {a / b:.3f}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
