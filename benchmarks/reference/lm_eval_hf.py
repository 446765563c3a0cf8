"""lm-eval's own `hf` model on local tasks, each timed: the baseline of benchmarks/harness.py.

Run with the python of a virtualenv that has torch, transformers and lm-eval (never nnx's)::

    python benchmarks/reference/lm_eval_hf.py MODEL_DIR TASKS_DIR OUT.json --tasks a,b --batch-size 32

Writes `{task: {"seconds", "requests", "responses", "metrics"}, "threads": N}`: the wall time of
`simple_evaluate` on that task alone (building its requests included, as on nnx's side), float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("tasks_dir")
    parser.add_argument("out")
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()

    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=args.tasks_dir, include_defaults=False)
    lm = HFLM(pretrained=args.model, dtype="float32", device="cpu", batch_size=args.batch_size)
    out: dict = {"threads": torch.get_num_threads()}
    for task in args.tasks.split(","):
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True,
                                          bootstrap_iters=0)  # fmt: skip
        seconds = time.perf_counter() - start
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        out[task] = {
            "seconds": seconds,
            "requests": sum(len(s["resps"]) for s in samples),
            "responses": [[r[0] if isinstance(r[0], str) else float(r[0][0]) for r in s["resps"]] for s in samples],
            "metrics": {k: v for k, v in results["results"][task].items() if isinstance(v, float)},
        }
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
