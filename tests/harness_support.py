"""The lm-evaluation-harness goldens (tests/fixtures/make_harness_fixtures.py) and how responses are compared.

`HARNESS` holds three local tasks over local JSONL data (`tasks/`, `data/`; the YAMLs name their data relative
to the directory lm-eval runs in) and, per model, what lm-eval's own `hf` model answered: every sample's
responses and each task's metrics.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().parent / "fixtures" / "harness"
TASKS = ("local_choices", "local_until", "local_rolling")
TOLERANCE = 1e-3  # relative, on every log-likelihood (float32 on both sides)


def golden(name: str) -> dict[str, Any]:
    return json.loads((HARNESS / f"{name}.json").read_text())


def copy_tasks(root: Path) -> Path:
    """The fixture tasks and their data under `root` (where lm-eval must run); returns the tasks directory."""
    shutil.copytree(HARNESS / "tasks", root / "tasks")
    shutil.copytree(HARNESS / "data", root / "data")
    return root / "tasks"


def read_samples(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """lm-eval's per-sample files (`samples_<task>_<date>.jsonl`) under `directory`, by task."""
    samples = {}
    for path in directory.rglob("samples_*.jsonl"):
        task = next(t for t in TASKS if path.name.startswith(f"samples_{t}_"))
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def _responses(task: str, sample: dict[str, Any]) -> list[Any]:
    """A sample's responses as plain values, whether in memory (tuples) or read back from lm-eval's files
    (strings)."""
    out = []
    for (response,) in sample["resps"]:
        if task == "local_choices":
            logprob, greedy = response
            out.append((float(logprob), str(greedy) == "True"))
        elif task == "local_rolling":
            out.append(float(response[0] if isinstance(response, (list, tuple)) else response))
        else:
            out.append(response)
    return out


def compare(samples: dict[str, list[dict[str, Any]]], expected: dict[str, Any]) -> float:
    """Assert every response equals the golden one (log-likelihoods within TOLERANCE relative, greedy flags and
    generated text exactly); returns the largest relative difference seen."""
    worst = 0.0
    for task, wanted in expected["samples"].items():
        got = sorted(samples[task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in got] == [s["doc_id"] for s in wanted], task
        for sample, gold in zip(got, wanted):
            ours = _responses(task, sample)
            assert len(ours) == len(gold["resps"]), (task, sample["doc_id"])
            for mine, theirs in zip(ours, gold["resps"]):
                where = f"{task} doc {sample['doc_id']}"
                if task == "local_choices":
                    worst = max(worst, _relative(mine[0], theirs[0]))
                    assert mine[1] == theirs[1], f"{where}: greedy {mine[1]} vs {theirs[1]}"
                elif task == "local_rolling":
                    worst = max(worst, _relative(mine, theirs))
                else:
                    assert mine == theirs, f"{where}: {mine!r} vs {theirs!r}"
    assert worst < TOLERANCE, worst
    return worst


def compare_metrics(metrics: dict[str, float], expected: dict[str, Any]) -> None:
    """`metrics` (`{"<task>/<metric>": value}`) equal the golden aggregates: accuracies and exact matches exactly,
    perplexities within TOLERANCE relative."""
    for task, values in expected["metrics"].items():
        for name, value in values.items():
            mine = metrics[f"{task}/{name}"]
            if "perplexity" in name or name == "bits_per_byte":
                assert _relative(mine, value) < TOLERANCE, (task, name, mine, value)
            else:
                assert math.isclose(mine, value, abs_tol=1e-9), (task, name, mine, value)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
