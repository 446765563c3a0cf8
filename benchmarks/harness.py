"""lm-evaluation-harness tasks with nnx's backend against lm-eval's own `hf` model: requests per second.

A SmolLM2-135M-shaped model (random bfloat16 weights and a 4,000-token BPE tokenizer written here, loaded in
float32 by both sides) on two local tasks written here: `bench_choices`, a multiple-choice task of
`--questions` questions (contexts of 30-120 words, four choices of 1-8 words each: one log-likelihood request
per choice), and `bench_until`, `--prompts` greedy generations of up to 32 tokens to a stop string. Each task
is evaluated alone with `simple_evaluate` on both sides, on the same CPU: nnx twice in one process (the first
pass compiles, the second is what a longer evaluation runs at), lm-eval's `hf` model
(benchmarks/reference/lm_eval_hf.py, from a virtualenv with torch, transformers and lm-eval) at the same batch
size and at its default of 1. Printed: requests/s side by side and the ratios (target: at least 2x), and
whether the answers agree (the largest relative difference of a log-likelihood, the generations that are the
same text).

    python benchmarks/harness.py --reference /tmp/refvenv/bin/python [--questions 300] [--prompts 48]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load import write_model
from lora import SMOLLM2, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "benchmarks/reference/lm_eval_hf.py"
TASKS = ("bench_choices", "bench_until")
CHOICES = """task: bench_choices
dataset_path: json
dataset_kwargs: {data_files: {test: DATA/choices.jsonl}}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: answer
doc_to_choice: "{{choices}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
metadata: {version: 1.0}
"""
UNTIL = """task: bench_until
dataset_path: json
dataset_kwargs: {data_files: {test: DATA/until.jsonl}}
output_type: generate_until
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n\\n"], max_gen_toks: 32, do_sample: false}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
metadata: {version: 1.0}
"""


def write_tasks(directory: Path, questions: int, prompts: int) -> None:
    """The two tasks' data and YAMLs under `directory`."""
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(3000)]
    phrase = lambda lo, hi: " ".join(rng.choice(words, int(rng.integers(lo, hi + 1))))  # noqa: E731
    (directory / "data").mkdir(parents=True, exist_ok=True)
    rows = [{"question": phrase(30, 120), "choices": [phrase(1, 8) for _ in range(4)], "answer": int(rng.integers(4))}
            for _ in range(questions)]  # fmt: skip
    (directory / "data" / "choices.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"prompt": phrase(30, 120), "answer": phrase(1, 3)} for _ in range(prompts)]
    (directory / "data" / "until.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "tasks").mkdir(exist_ok=True)
    data = str(directory / "data")
    (directory / "tasks" / "bench_choices.yaml").write_text(CHOICES.replace("DATA", data))
    (directory / "tasks" / "bench_until.yaml").write_text(UNTIL.replace("DATA", data))


def ours(model: Path, tasks_dir: Path, batch_size: int) -> dict:
    """nnx's backend on each task alone, twice: `{task: {"seconds": [cold, warm], "requests", "responses"}}`."""
    from nnx_cli import harness
    from nnx_cli.harness.backend import NNXLM

    lm = NNXLM(str(model), batch_size=batch_size)
    out = {}
    for task in TASKS:
        loaded = harness.load_tasks([task], include_path=tasks_dir)
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            results = harness.evaluate(lm, loaded, log_samples=True, bootstrap_iters=0)
            seconds.append(time.perf_counter() - start)
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        out[task] = {
            "seconds": seconds,
            "requests": sum(len(s["resps"]) for s in samples),
            "responses": [[r[0] if isinstance(r[0], str) else float(r[0][0]) for r in s["resps"]] for s in samples],
        }
    return out


def theirs(reference: str, model: Path, tasks_dir: Path, batch_size: int, cwd: Path) -> dict:
    out = cwd / f"hf-{batch_size}.json"
    subprocess.run([reference, str(REFERENCE), str(model), str(tasks_dir), str(out), "--tasks", ",".join(TASKS),
                    "--batch-size", str(batch_size)], check=True, cwd=cwd)  # fmt: skip
    return json.loads(out.read_text())


def agreement(mine: dict, reference: dict) -> str:
    """How far the answers are apart: choices by the largest relative log-likelihood difference, generations by
    how many are the same text."""
    a = [x for row in mine["bench_choices"]["responses"] for x in row]
    b = [x for row in reference["bench_choices"]["responses"] for x in row]
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    same = sum(x == y for x, y in zip(mine["bench_until"]["responses"], reference["bench_until"]["responses"]))
    total = len(mine["bench_until"]["responses"])
    return f"log-likelihoods within {worst:.1e} relative; {same}/{total} generations identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch, transformers, lm-eval")
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--skip-batch-1", action="store_true", help="leave out lm-eval's default batch size of 1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nnx-harness-bench-") as tmp:
        cwd = Path(tmp)
        model = cwd / "smollm2-135m-shaped"
        count = write_model(model, SMOLLM2)
        rng = np.random.default_rng(0)
        write_tokenizer(model, " ".join(rng.choice([f"w{i}" for i in range(3000)], 200_000)), 4000)
        write_tasks(cwd, args.questions, args.prompts)
        tasks_dir = cwd / "tasks"
        print(f"model: SmolLM2-135M shapes ({count / 1e6:.1f} M parameters), float32 on the CPU; "
              f"{args.questions} questions x 4 choices, {args.prompts} generations of up to 32 tokens",
              flush=True)  # fmt: skip
        mine = ours(model, tasks_dir, args.batch_size)
        baselines = {args.batch_size: theirs(args.reference, model, tasks_dir, args.batch_size, cwd)}
        if not args.skip_batch_1 and args.batch_size != 1:
            baselines[1] = theirs(args.reference, model, tasks_dir, 1, cwd)
    print(f"\n| task | requests | nnx requests/s (first pass, compiling) | nnx requests/s | "
          f"{' | '.join(f'hf batch {b} requests/s | ratio' for b in baselines)} |")  # fmt: skip
    print("| --- " * (4 + 2 * len(baselines)) + "|")
    for task in TASKS:
        requests = mine[task]["requests"]
        cold, warm = (requests / s for s in mine[task]["seconds"])
        cells = []
        for result in baselines.values():
            rate = result[task]["requests"] / result[task]["seconds"]
            cells += [f"{rate:.3g}", f"{warm / rate:.2f}x"]
        print(f"| {task} | {requests} | {cold:.3g} | {warm:.3g} | {' | '.join(cells)} |")
    threads = next(iter(baselines.values()))["threads"]
    print(f"\nhf: torch with {threads} threads. Agreement with hf batch {args.batch_size}: "
          f"{agreement(mine, baselines[args.batch_size])}")  # fmt: skip


if __name__ == "__main__":
    main()
