"""Random damage to checkpoints, over and over: is every damaged step caught, and does every resumed run end exact?

Trains `configs/digits_vae.yaml` (checkpoints every 50 steps, all kept)
twice: a reference run of 300 steps without interruption, and a partial run
stopped at step 200 (checkpoints 50, 100, 150, 200). Each trial then copies
the partial run and damages it as a failing disk or a stray write would:
one random checkpoint step, one random file in it, 1 to 4 consecutive bytes
at a random offset, each XORed with a random non-zero mask (so every byte
really changes). The step is the newest with probability 1/2 (the step
every command reaches first: falling back and moving it aside are
exercised), otherwise one of the older ones (which only `--step` reaches:
the commands must leave it alone). Any file of the step is a candidate: array data, Orbax's
metadata, `_sharding`, manifests, `commit_success.txt`, and the checksum
file `nnx-checksums.process_0.json` itself; a damaged checksum file no
longer vouches for its step, so the step must be rejected like one with
damaged data. The one draw that is drawn again is a change to the checksum
file that leaves its JSON saying exactly the same (whitespace turned into
other whitespace): the step is then exactly what was written, and there is
nothing to detect. On the damaged copy:

* `nnx-eval RUN --step S` of the damaged step S exits 2 with one `error:`
  line naming the step and, for any file but the checksum file, the file;
* `nnx-eval RUN --json` exits 0; when S is the newest step it reports S on
  one line and evaluates the step before it, otherwise it evaluates the
  newest step and reports nothing (the commands only check the steps they use);
* `nnx-train` of the full config resumes from the newest intact step (when
  S was the newest, it moves S to `S.corrupt-1` and writes S again), and its
  final train state (parameters, optimizer state, step: every array) is
  bit-identical to the reference run's.

A trial counts as detected when both evals behave as above, and as resumed
exactly when the training run does. One line per trial, then a summary;
the exit status is 1 unless every trial was detected and resumed exactly.
Trials are seeded per (seed, trial), so `--trials 3` runs the first three of
`--trials 20`. The compilation cache is kept between invocations (`--cache`),
so a second invocation skips compiling. `--without-checksums` runs the same
trials with the checksum files deleted first: what Orbax and the finite
check catch on their own, the baseline the checksums are measured against::

    python benchmarks/checkpoint_stress.py [--trials 20] [--seed 0] [--keep DIR] [--without-checksums]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "digits_vae.yaml"
EVERY, PARTIAL, FULL = 50, 200, 300
OVERRIDES = [f"checkpoint.every_steps={EVERY}", "checkpoint.keep=100"]
CHECKSUMS = re.compile(r"nnx-checksums\.process_\d+\.json")


@dataclasses.dataclass(frozen=True)
class Damage:
    """Bytes `offset`.. of `file` (relative to the step dir of `step`) XORed with `masks`."""

    step: int
    file: str
    offset: int
    masks: tuple[int, ...]

    def apply(self, step_dir: Path) -> None:
        path = step_dir / self.file
        data = bytearray(path.read_bytes())
        for i, mask in enumerate(self.masks):
            data[self.offset + i] ^= mask
        path.write_bytes(bytes(data))

    def __str__(self) -> str:
        name = re.sub(r"([0-9a-f]{8})[0-9a-f]{24}$", r"\1…", self.file)  # Orbax's 32-hex-digit data file names
        return f"step {self.step:3d} {name:<40} +{self.offset:<6d} x{len(self.masks)}"


@dataclasses.dataclass
class Outcome:
    detected: bool = False
    exact: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)  # what was seen, in order
    failures: list[str] = dataclasses.field(default_factory=list)  # expectations not met


def draw(rng: np.random.Generator, checkpoints: Path) -> tuple[Damage, int]:
    """A random damage to one of the steps in `checkpoints`, and how many draws were discarded (see the docstring)."""
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    discarded = 0
    while True:
        step = steps[-1] if rng.random() < 0.5 else int(rng.choice(steps[:-1]))
        step_dir = checkpoints / str(step)
        files = sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())
        file = str(rng.choice(files))
        data = (step_dir / file).read_bytes()
        count = int(rng.integers(1, min(4, len(data)) + 1))
        offset = int(rng.integers(0, len(data) - count + 1))
        masks = tuple(int(m) for m in rng.integers(1, 256, size=count))
        damage = Damage(step, file, offset, masks)
        if not (CHECKSUMS.fullmatch(Path(file).name) and _says_the_same(data, damage)):
            return damage, discarded
        discarded += 1


def _says_the_same(data: bytes, damage: Damage) -> bool:
    changed = bytearray(data)
    for i, mask in enumerate(damage.masks):
        changed[damage.offset + i] ^= mask
    try:
        return json.loads(bytes(changed)) == json.loads(data)
    except ValueError:
        return False


def command(name: str, *args: str | Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NNX_COMPILATION_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([str(BIN / name), *map(str, args)], env=env, capture_output=True, text=True, timeout=600)


def train(workdir: Path, steps: int, cache: Path) -> subprocess.CompletedProcess:
    return command("nnx-train", CONFIG, f"train.steps={steps}", *OVERRIDES, "--workdir", workdir, cache=cache)


def train_state(workdir: Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """A step of a work dir (default: the newest) and its whole train state, flattened to {key path: array}."""
    import jax

    from nnx_cli.checkpoint import Checkpointer

    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    try:
        step = ckpt.latest_step() if step is None else step
        flat = jax.tree_util.tree_flatten_with_path(ckpt.restore_raw(step))[0]
    finally:
        ckpt.close()
    return step, {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """The key paths whose arrays are not bit-identical (shape, dtype and every byte)."""
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()]


def detector(problem: str) -> str:
    """Which check caught the damage, from the reason `nnx_cli.restore` gives."""
    if re.search(r"nnx-checksums\.process_\d+\.json: ", problem):
        return "checksum file"
    if re.search(r": (content differs from its checksum|missing$|not in the checksums|\d+ bytes, but)", problem):
        return "checksums"
    if "non-finite" in problem:
        return "finite check"
    return "restore"


def trial(damage: Damage, run: Path, steps: list[int], reference: dict[str, np.ndarray], cache: Path) -> Outcome:
    out = Outcome()
    checkpoints = run / "checkpoints"
    damaged_dir = checkpoints / str(damage.step)
    newest = damage.step == steps[-1]
    intact = [s for s in steps if s != damage.step][-1]

    # (a) detection: the damaged step asked for by number, then the newest usable step
    asked = command("nnx-eval", run, "--step", damage.step, cache=cache)
    message = asked.stderr.strip()
    prefix = f"error: checkpoint {damaged_dir} cannot be used: "
    if asked.returncode != 2 or "\n" in message or not message.startswith(prefix):
        out.failures.append(f"eval --step {damage.step}: exit {asked.returncode} ({_last_line(asked.stderr)})")
    else:
        problem = message.removeprefix(prefix).removesuffix("; pick another --step")
        caught_by = detector(problem)
        reason = problem.split(": ", 1)[-1] if caught_by.startswith("checksum") else problem
        out.notes.append(f"{caught_by}: {reason if len(reason) <= 100 else reason[:99] + '…'}")
        if caught_by == "checksums" and not problem.startswith(f"{damage.file}: "):
            out.failures.append(f"eval --step {damage.step} names another file: {problem}")
    latest = command("nnx-eval", run, "--json", cache=cache)
    reports = [line for line in latest.stderr.splitlines() if "cannot be used" in line]
    expected = [f"checkpoint {damaged_dir} cannot be used: "] if newest else []
    evaluated = json.loads(latest.stdout)["step"] if latest.returncode == 0 and latest.stdout.strip() else None
    if latest.returncode != 0 or evaluated != intact:
        out.failures.append(f"eval evaluated step {evaluated}, not {intact} (exit {latest.returncode})")
    elif len(reports) != len(expected) or not all(r.startswith(e) for r, e in zip(reports, expected)):
        out.failures.append(f"eval reported {reports}, expected {len(expected)} line(s) about step {damage.step}")
    else:
        out.notes.append(f"eval {'fell back to' if newest else 'used'} {evaluated}")
    out.detected = not out.failures

    # (b) resumption: the full run, from the newest intact step, ending where the reference ended
    before = len(out.failures)
    resumed = train(run, FULL, cache)
    if resumed.returncode != 0:
        out.failures.append(f"nnx-train: exit {resumed.returncode} ({_last_line(resumed.stderr)})")
    else:
        start = re.search(r"^resumed from (.+)$", resumed.stderr, re.MULTILINE)
        origin = Path(start.group(1)).name if start else "nothing"
        moved = checkpoints / f"{damage.step}.corrupt-1"
        said_moved = f"moved the unusable checkpoint {damaged_dir} to {moved}" in resumed.stderr
        out.notes.append(f"resumed from {origin}" + (f", moved {damage.step} to {moved.name}" if said_moved else ""))
        if origin != str(intact):
            out.failures.append(f"nnx-train resumed from {origin}, not {intact}")
        if newest and not (said_moved and moved.is_dir()):
            out.failures.append(f"nnx-train did not move step {damage.step} to {moved.name}")
        if not newest and (moved.exists() or "moved the unusable" in resumed.stderr):
            out.failures.append("nnx-train moved a step it did not need")
        step, state = train_state(run)
        different = differences(state, reference)
        if step != FULL or different:
            out.failures.append(f"final step {step}, {len(different)} array(s) differ from the reference's")
        else:
            out.notes.append("bit-exact")
    out.exact = len(out.failures) == before
    return out


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:200] if lines else "no output"


def prepare(work: Path, cache: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Train the reference and the partial run; the partial run's work dir and the reference's final state."""
    runs = {"reference": (work / "reference", FULL), "partial": (work / "partial", PARTIAL)}
    for label, (workdir, steps) in runs.items():
        start = time.perf_counter()
        result = train(workdir, steps, cache)
        if result.returncode != 0:
            raise SystemExit(f"the {label} run failed:\n{result.stderr}")
        print(f"{label} run: {steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
    ref_step, reference = train_state(work / "reference")
    if ref_step != FULL:
        raise SystemExit(f"the reference run's newest step is {ref_step}, expected {FULL}")
    # the premise of every trial: the partial run is the reference run's beginning, to the bit
    partial_step, partial = train_state(work / "partial")
    if partial_step != PARTIAL or differences(partial, train_state(work / "reference", PARTIAL)[1]):
        raise SystemExit(f"the partial run's step {PARTIAL} differs from the reference's: nothing to compare against")
    print(f"partial run's step {PARTIAL} = reference run's step {PARTIAL}, bit for bit", flush=True)
    return work / "partial", reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(tempfile.gettempdir()) / "nnx-checkpoint-stress-cache",
        help="compilation cache, kept between invocations (default: %(default)s)",
    )
    parser.add_argument(
        "--without-checksums",
        action="store_true",
        help="the baseline: delete every step's checksum files before damaging it, to see what Orbax's reads and "
        "the finite check catch on their own (expect misses and exit status 1)",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="work here and keep every trial's run (default: a temp dir)"
    )
    args = parser.parse_args()

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nnx-checkpoint-stress-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        partial, reference = prepare(work.absolute(), args.cache)
        steps = sorted(int(p.name) for p in (partial / "checkpoints").iterdir() if p.name.isdigit())
        detected = exact = discarded = 0
        for i in range(args.trials):
            run = work.absolute() / f"trial-{i + 1:02d}"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(partial, run)
            if args.without_checksums:
                for sealed in (run / "checkpoints").glob("*/nnx-checksums.*"):
                    sealed.unlink()
            damage, skipped = draw(np.random.default_rng([args.seed, i]), run / "checkpoints")
            discarded += skipped
            damage.apply(run / "checkpoints" / str(damage.step))
            began = time.perf_counter()
            outcome = trial(damage, run, steps, reference, args.cache)
            detected += outcome.detected
            exact += outcome.exact
            verdict = " | ".join(outcome.notes + [f"FAILED: {f}" for f in outcome.failures])
            print(f"trial {i + 1:2d}: {damage} | {verdict} ({time.perf_counter() - began:.1f} s)", flush=True)
            if args.keep is None:
                shutil.rmtree(run)
    total = args.trials
    print(
        f"detected {detected}/{total}, resumed exactly {exact}/{total} "
        f"({discarded} draw(s) that left a checksum file saying the same were drawn again; "
        f"{time.perf_counter() - start:.0f} s in all)"
    )
    sys.exit(0 if detected == exact == total else 1)


if __name__ == "__main__":
    main()
