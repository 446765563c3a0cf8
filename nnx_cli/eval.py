"""`nnx-eval TARGET [KEY=VALUE ...]`: evaluate a checkpoint on the eval split.

TARGET is a work dir, its `checkpoints/` dir or one step dir. The model is
rebuilt from the work dir's `config.yaml`, the checkpoint (latest, or
`--step N`) restored, and the eval split averaged with the same keys as the
evals during training. `--json` prints exactly one JSON object on stdout:
`{"step": N, "metrics": {...}}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from nnx_cli.errors import report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def evaluate(
    target: Path = typer.Argument(
        ..., metavar="TARGET", help="Work dir, its checkpoints/ dir, or one step dir.", show_default=False
    ),
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Config overrides, e.g. data.source=/data/mnist.", show_default=False
    ),
    step: int | None = typer.Option(None, help="Checkpoint step (default: the latest)."),
    best: bool = typer.Option(False, "--best", help="The best step kept by checkpoint.keep_best."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Evaluate a trained checkpoint and print its metrics."""
    from nnx_cli import hooks, report, restore, runtime, sharding
    from nnx_cli.experiment import setup
    from nnx_cli.workdir import open_run

    run = open_run(target, overrides or [], step, best=best)
    runtime.configure(deterministic=run.cfg.train.deterministic)
    exp = setup(run.cfg, data="eval")
    console = report.stderr_console()

    def say(message: str) -> None:
        console.print(message, highlight=False, soft_wrap=True)

    step, state = restore.from_run(run, lambda ckpt, s: restore.read_state(ckpt, s, exp.restore_target()), say)
    layout = sharding.eval_batch_layout(exp.mesh, exp.rules, exp.cfg.train)
    metrics = hooks.evaluator(exp, layout, sharding.replicated(exp.mesh))(state)

    if as_json:
        print(json.dumps({"step": step, "metrics": report.json_metrics(metrics)}))
    else:
        from rich.console import Console

        console.print(
            f"{run.checkpoints / str(step)} on {exp.cfg.data.source} [{exp.cfg.data.eval_split}], "
            f"{len(exp.eval)} examples",
            markup=False,
            highlight=False,
        )
        Console().print(report.metrics_table(f"eval at step {step}", metrics))


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
