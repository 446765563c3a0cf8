"""Language models on CPU: `nnx-train configs/tiny_lm.yaml` against the plain JAX + optax script `plain_lm.py`.

Both sides train the same byte-level GPT (2 layers, 4 heads, 128 wide,
context 64) from the same initial parameters (nnx-train's, handed to the
plain script) with the same recipe, batches and steps, and report the mean
token cross-entropy on the validation split's first 20 batches of 32
windows. Each run is a whole process, timed from outside (imports, data,
compiling, training, evaluating; for nnx-train also its mid-run eval,
samples and checkpoints). The targets: nnx-train's validation loss within
0.02 nats of the plain script's, and its wall time at most 1.1x.

Both keep JAX's persistent compilation cache in one directory per side, and
nnx-train its token cache, all in a temporary directory: one untimed run of
each fills them, so the timed runs are warm (nnx-train reads its tokens from
the cache; the plain script tokenizes at every start, and the time it takes
is reported so the ratio can be read either way). The machine's speed
drifts, so the timed runs alternate in ABBA order (plain, nnx, nnx, plain,
...) and the ratio is of summed wall times.

    python benchmarks/lm.py                                   # 1000 steps, 2 pairs, ../shared/data/shakespeare
    python benchmarks/lm.py --steps 100 --pairs 1 --no-check  # a quick smoke run

Exits 1 when a target is missed (not with `--no-check`). The last line is
the figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "tiny_lm.yaml"
DEFAULT_SOURCE = ROOT.parent / "shared" / "data" / "shakespeare"
MAX_LOSS_DIFFERENCE = 0.02
MAX_TIME_RATIO = 1.1
PHASES = ("import", "data", "compile", "train", "eval", "checkpoint", "other")


@dataclasses.dataclass
class Run:
    """One whole process: its wall time, validation loss and the time each phase took (as the side reports it)."""

    side: str
    seconds: float
    val_loss: float
    phases: dict[str, float]


def abba(pairs: int) -> list[str]:
    """The order of the timed runs: plain first in even pairs, nnx first in odd ones.

    >>> abba(2)
    ['plain', 'nnx', 'nnx', 'plain']
    """
    return [side for i in range(pairs) for side in (("plain", "nnx") if i % 2 == 0 else ("nnx", "plain"))]


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def write_initial_params(source: Path, path: Path) -> Path:
    """nnx-train's initial parameters for `configs/tiny_lm.yaml`, as an .npz in `plain_lm.py`'s names: both
    sides then start from the same parameters and read the same batches, so their losses differ by what each
    computes, not by the draw of the initialisation (worth about 0.02 nats here, the size of the target)."""
    import jax
    import numpy as np

    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup

    plain_lm = _load_benchmark("plain_lm")
    exp = setup(load_config(CONFIG, [f"data.source={source}"]), data=None)
    params = exp.init_state()["params"]
    tree = plain_lm.from_transformer_lm((p, np.asarray(getattr(v, "value", v))) for p, v in params.items())
    flat = {"/".join(k.key for k in keys): v for keys, v in jax.tree_util.tree_leaves_with_path(tree)}
    np.savez(path, **flat)
    return path


def _load_benchmark(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look up the module's annotations
    spec.loader.exec_module(module)
    return module


def run_plain(source: Path, steps: int, cache: Path, init: Path) -> Run:
    """`plain_lm.py` on `source` for `steps` steps from the parameters in `init`, programs kept in `cache`."""
    command = [sys.executable, str(ROOT / "benchmarks" / "plain_lm.py"), "--source", str(source), "--init", str(init)]
    command += ["--steps", str(steps), "--steps-per-call", str(math.gcd(steps, 100)), "--cache", str(cache)]
    seconds, out = _timed(command, dict(os.environ))
    report = json.loads(out.strip().splitlines()[-1])
    phases = {name: report[f"{name}_seconds"] for name in ("import", "data", "compile", "train", "eval")}
    phases["other"] = report["seconds"] - sum(phases.values())
    return Run("plain", seconds, report["val_loss"], phases)


def run_nnx(source: Path, steps: int, cache: Path, data_cache: Path, workdir: Path) -> Run:
    """`nnx-train configs/tiny_lm.yaml` on `source` in a fresh `workdir`; tokens in `data_cache`, programs in
    `cache`. The validation loss is the last eval in its metrics.jsonl, the phases its run.json timings."""
    command = [str(BIN / "nnx-train"), str(CONFIG), f"data.source={source}", f"data.cache_dir={data_cache}"]
    command += [f"train.steps={steps}", "--workdir", str(workdir), "--no-resume"]
    seconds, _ = _timed(command, {**os.environ, "NNX_COMPILATION_CACHE": str(cache)})
    timings = json.loads((workdir / "run.json").read_text()).get("timings", {})
    return Run("nnx", seconds, final_eval_loss(workdir / "metrics.jsonl"), {p: timings.get(p, 0.0) for p in PHASES})


def final_eval_loss(metrics: Path) -> float:
    """The loss of the last eval record in an nnx-train metrics.jsonl."""
    evals = [record for record in map(json.loads, metrics.read_text().splitlines()) if record["split"] == "eval"]
    if not evals:
        sys.exit(f"{metrics} has no eval record: nnx-train evaluated nothing")
    return evals[-1]["metrics"]["loss"]


def _row(label: str, run: Run) -> str:
    phases = " ".join(f"{run.phases.get(p, 0.0):6.1f}" if p in run.phases else f"{'':>6}" for p in PHASES)
    side = "plain JAX" if run.side == "plain" else "nnx-train"
    return f"{label:<8} {side:<10} {run.seconds:7.1f} {run.val_loss:9.4f}   {phases}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="the text dataset (Hugging Face layout)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--pairs", type=int, default=2, help="timed runs of each side, in ABBA order")
    parser.add_argument(
        "--no-check", dest="check", action="store_false", help="print the figures without enforcing the targets"
    )
    args = parser.parse_args()
    source = args.source.resolve()
    if not source.exists():
        parser.error(f"--source {args.source}: no such dataset; point it at a text dataset directory")

    header = f"{'run':<8} {'side':<10} {'wall s':>7} {'val loss':>9}   " + " ".join(f"{p:>6}" for p in PHASES)
    with tempfile.TemporaryDirectory(prefix="nnx-lm-bench-") as tmp:
        tmp_path = Path(tmp)
        plain_cache, nnx_cache, data_cache = tmp_path / "plain-jax", tmp_path / "nnx-jax", tmp_path / "tokens"
        init = write_initial_params(source, tmp_path / "init.npz")

        def run(side: str, n: int) -> Run:
            if side == "plain":
                return run_plain(source, args.steps, plain_cache, init)
            return run_nnx(source, args.steps, nnx_cache, data_cache, tmp_path / f"run-{n}")

        print(f"tiny_lm: {args.steps} steps, data {source}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(header, flush=True)
        for side in ("plain", "nnx"):  # untimed: fill the compilation caches and nnx-train's token cache
            print(_row("fill", run(side, 0)), flush=True)
        runs = []
        for n, side in enumerate(abba(args.pairs), start=1):
            runs.append(run(side, n))
            print(_row(f"pair {(n + 1) // 2}", runs[-1]), flush=True)
        load = os.getloadavg()

    plain = [r for r in runs if r.side == "plain"]
    nnx = [r for r in runs if r.side == "nnx"]
    plain_seconds = sum(r.seconds for r in plain)
    plain_untokenized = plain_seconds - sum(r.phases["data"] for r in plain)
    nnx_seconds = sum(r.seconds for r in nnx)
    ratio, ratio_untokenized = nnx_seconds / plain_seconds, nnx_seconds / plain_untokenized
    pair_ratios = [n.seconds / p.seconds for n, p in zip(nnx, plain)]  # run i of each side: the same pair
    train_ratio = sum(r.phases["train"] for r in nnx) / sum(r.phases["train"] for r in plain)
    plain_loss = sum(r.val_loss for r in plain) / len(plain)
    nnx_loss = sum(r.val_loss for r in nnx) / len(nnx)
    difference = nnx_loss - plain_loss
    print("(phases: nnx-train's run.json timings; the plain script's own: data is loading + tokenizing)")
    print(f"load average (1, 5, 15 min) at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'':<10} {'mean wall s':>11} {'val loss':>9}")
    print(f"{'plain JAX':<10} {plain_seconds / len(plain):11.1f} {plain_loss:9.4f}")
    print(f"{'nnx-train':<10} {nnx_seconds / len(nnx):11.1f} {nnx_loss:9.4f}")
    print(
        f"time ratio nnx-train / plain: {ratio:.3f} (target <= {MAX_TIME_RATIO}); against the plain script "
        f"without its tokenizing: {ratio_untokenized:.3f}"
    )
    print(
        f"per pair: {', '.join(f'{r:.3f}' for r in pair_ratios)}; training steps alone (train phases): "
        f"{train_ratio:.3f}"
    )
    print(f"val loss difference nnx-train - plain: {difference:+.4f} (target within {MAX_LOSS_DIFFERENCE})")
    figures = {
        "steps": args.steps,
        "pairs": args.pairs,
        "plain_runs": [r.seconds for r in plain],
        "nnx_runs": [r.seconds for r in nnx],
        "plain_val_loss": plain_loss,
        "nnx_val_loss": nnx_loss,
        "val_loss_difference": difference,
        "time_ratio": ratio,
        "time_ratio_without_tokenizing": ratio_untokenized,
        "pair_ratios": pair_ratios,
        "train_phase_ratio": train_ratio,
        "nnx_phases": {p: sum(r.phases[p] for r in nnx) / len(nnx) for p in PHASES},
        "plain_phases": {p: sum(r.phases[p] for r in plain) / len(plain) for p in plain[0].phases},
        "load_average": load,
    }
    print(json.dumps(figures))
    if args.check:
        missed = []
        if abs(difference) > MAX_LOSS_DIFFERENCE:
            missed.append(f"val loss difference {difference:+.4f} beyond {MAX_LOSS_DIFFERENCE}")
        if ratio > MAX_TIME_RATIO:
            missed.append(f"time ratio {ratio:.3f} > {MAX_TIME_RATIO}")
        if missed:
            sys.exit("FAILED: " + "; ".join(missed))
        print("OK")


if __name__ == "__main__":
    main()
