"""Time to result: where a whole `nnx-train` run's time goes, and how it compares with a plain JAX script.

For any config, runs `nnx-train CONFIG` with an empty compilation cache
(cold), then again with that cache filled (warm), and prints each run's
phases (import, data, compile, train, eval, checkpoint, other; from the
run's `run.json`) beside its wall time. With `--baseline plain_digits_vae.py`
(the default for `configs/digits_vae.yaml`) it then alternates warm runs of
the plain script and of `nnx-train` (ABBA, `--pairs` pairs, the machine's
speed drifts between runs) and prints the median ratio of their wall times::

    python benchmarks/time_to_result.py configs/digits_vae.yaml --pairs 4
    python benchmarks/time_to_result.py configs/mnist_vae.yaml data.source=../shared/data/mnist --no-baseline
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("import", "data", "compile", "train", "eval", "checkpoint", "other")


def nnx_train(config: str, overrides: list[str], workdir: Path, cache: Path) -> tuple[float, dict]:
    """One whole `nnx-train` process: its wall time and its timings from run.json."""
    env = {**os.environ, "NNX_COMPILATION_CACHE": str(cache)}
    command = [
        str(Path(sys.executable).parent / "nnx-train"),
        config,
        *overrides,
        "--workdir",
        str(workdir),
        "--no-resume",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"nnx-train failed:\n{result.stderr}")
    return seconds, json.loads((workdir / "run.json").read_text()).get("timings", {})


def plain(script: Path, cache: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, str(script), "--cache", str(cache)], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{script.name} failed:\n{result.stderr}")
    return time.perf_counter() - start


def show(label: str, wall: float, timings: dict) -> None:
    parts = ", ".join(f"{name} {timings.get(name, 0.0):.2f}" for name in PHASES)
    print(f"{label:<18} {wall:6.2f} s wall   ({parts})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--pairs", type=int, default=3, help="ABBA pairs against the baseline")
    parser.add_argument(
        "--baseline", default=None, help="plain script in benchmarks/ (digits_vae: plain_digits_vae.py)"
    )
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    baseline = args.baseline or ("plain_digits_vae.py" if Path(args.config).stem == "digits_vae" else None)
    with tempfile.TemporaryDirectory(prefix="nnx-ttr-") as tmp:
        tmp_path = Path(tmp)
        cache = tmp_path / "cache"
        wall, timings = nnx_train(args.config, args.overrides, tmp_path / "run", cache)
        show("nnx-train, cold", wall, timings)
        wall, timings = nnx_train(args.config, args.overrides, tmp_path / "run", cache)
        show("nnx-train, warm", wall, timings)
        if baseline is None or args.no_baseline:
            return
        plain_cache = tmp_path / "plain-cache"
        plain(HERE / baseline, plain_cache)  # fill its cache too
        ratios = []
        for i in range(args.pairs):
            first, second = ("plain", "nnx") if i % 2 == 0 else ("nnx", "plain")
            times = {}
            for who in (first, second):
                if who == "plain":
                    times[who] = plain(HERE / baseline, plain_cache)
                else:
                    times[who] = nnx_train(args.config, args.overrides, tmp_path / "run", cache)[0]
            ratios.append(times["nnx"] / times["plain"])
            print(f"pair {i + 1}: plain {times['plain']:.2f} s, nnx-train {times['nnx']:.2f} s: {ratios[-1]:.2f}x")
        median = statistics.median(ratios)
        print(f"median ratio nnx-train / {baseline}: {median:.2f}x over {args.pairs} pairs (target 1.5x)")


if __name__ == "__main__":
    main()
