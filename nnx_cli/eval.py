"""`nnx-eval TARGET [KEY=VALUE ...]`: evaluate a checkpoint, or a published model, on the eval split.

TARGET is a work dir, its `checkpoints/` dir or one step dir: the model is
rebuilt from the work dir's `config.yaml`, the checkpoint (latest, or
`--step N`) restored, and the eval split averaged with the same keys as the
evals during training. TARGET may also be a Hugging Face model directory or
Hub id with `data.source=TEXT`: the loss and perplexity of the pretrained
model on that text (its `data.eval_split`, by default `test`, or the whole
text when the source has no such split), before any training. `--json`
prints exactly one JSON object on stdout: `{"step": N, "metrics": {...}}`
(`"step": null` for a model directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from nnx_cli.errors import UserError, report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def evaluate(
    target: Path = typer.Argument(
        ...,
        metavar="TARGET",
        help="Work dir, its checkpoints/ dir, one step dir, or a Hugging Face model dir or Hub id.",
        show_default=False,
    ),
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Config overrides, e.g. data.source=/data/mnist.", show_default=False
    ),
    step: int | None = typer.Option(None, help="Checkpoint step (default: the latest)."),
    best: bool = typer.Option(False, "--best", help="The best step kept by checkpoint.keep_best."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Evaluate a trained checkpoint and print its metrics."""
    from nnx_cli import hf, hooks, report, restore, runtime, sharding
    from nnx_cli.experiment import setup
    from nnx_cli.workdir import open_run

    console = report.stderr_console()

    def say(message: str) -> None:
        console.print(message, highlight=False, soft_wrap=True)

    if hf.is_model_dir(target):
        if step is not None or best:
            raise UserError(f"--step and --best pick a checkpoint of a run; {str(target)!r} is a model directory")
        runtime.configure()
        exp = setup(_model_dir_config(target, overrides or []), data="eval")
        step, state, what = None, exp.init_state(), str(exp.pretrained.directory)
    else:
        run = open_run(target, overrides or [], step, best=best)
        if any(o.startswith("data.source=") for o in overrides or []):
            _whole_source_without_its_split(run.cfg, overrides or [])
        runtime.configure(deterministic=run.cfg.train.deterministic)
        exp = setup(run.cfg, data="eval")

        def read(ckpt: Any, s: int) -> Any:
            exp.check_base(ckpt.manifest(s), ckpt.directory / str(s))
            return restore.read_state(ckpt, s, exp.restore_target())

        step, state = restore.from_run(run, read, say)
        state, what = exp.with_reference(exp.with_frozen(state), say), str(run.checkpoints / str(step))
    layout = sharding.eval_batch_layout(exp.mesh, exp.rules, exp.cfg.train)
    metrics = hooks.evaluator(exp, layout, sharding.replicated(exp.mesh))(state)

    if as_json:
        print(json.dumps({"step": step, "metrics": report.json_metrics(metrics)}))
    else:
        from rich.console import Console

        say(f"{what} on {exp.cfg.data.source} [{exp.cfg.data.eval_split}], {len(exp.eval)} examples")
        title = "eval of the pretrained model" if step is None else f"eval at step {step}"
        Console().print(report.metrics_table(title, metrics))


def _model_dir_config(target: Path, overrides: list[str]) -> Any:
    """A model directory's config for evaluation: `data.source` must be given; its `data.eval_split` (default
    `test`) or, when the source has no such split, all of it; batches of 8 windows."""
    from nnx_cli import hf
    from nnx_cli.data import DIGITS

    cfg = hf.model_dir_config(target, overrides, train={"batch_size": 8})
    if cfg.data.source == DIGITS:
        raise UserError(
            "nnx-eval of a model directory needs a text to evaluate on: pass data.source=FILE (a .txt, .jsonl or "
            "parquet file, a directory of them, or a Hub dataset) and data.text_key if its column is not 'text'"
        )
    _whole_source_without_its_split(cfg, overrides)
    return cfg


def _whole_source_without_its_split(cfg: Any, overrides: list[str]) -> None:
    """A text source given to evaluate on is evaluated on its `data.eval_split`, or whole when it has no such split
    (its train split, else its first), unless the overrides name the split."""
    from nnx_cli.data.text import is_text, splits_of

    if is_text(cfg.data) and not any(o.startswith("data.eval_split=") for o in overrides):
        splits = splits_of(cfg.data)
        if cfg.data.eval_split not in splits:
            cfg.data.eval_split = cfg.data.train_split if cfg.data.train_split in splits else splits[0]


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
