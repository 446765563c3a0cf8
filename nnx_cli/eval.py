"""`nnx-eval TARGET [KEY=VALUE ...]`: evaluate a checkpoint on the eval split.

TARGET is a work dir, its `checkpoints/` dir or one step dir. The model is
rebuilt from the work dir's `config.yaml`, the checkpoint (latest, or
`--step N`) restored, and the eval split averaged with the same keys as the
evals during training. `--json` prints exactly one JSON object on stdout:
`{"step": N, "metrics": {...}}`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import typer

from nnx_cli.errors import UserError, report_errors, run_app

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
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Evaluate a trained checkpoint and print its metrics."""
    import jax

    from nnx_cli import checkpoint, data, models, optim, report, sharding, steps
    from nnx_cli.workdir import open_run

    run = open_run(target, overrides or [], step)
    cfg = run.cfg
    if not cfg.data.eval_split:
        raise UserError(
            "config key 'data.eval_split' is null: there is no split to evaluate; pass data.eval_split=<split>"
        )
    eval_split = data.load_split(cfg.data, cfg.data.eval_split, "data.eval_split")

    build = models.model_factory(cfg.model, data.spec_from_config(cfg) or eval_split.spec)
    tx = optim.build_optimizer(cfg.optimizer, total_steps=None)  # the state's structure is all a restore needs
    moduledef, abstract = jax.eval_shape(lambda: steps.init_state(build, tx, cfg.seed))
    mesh = sharding.make_mesh(cfg.sharding)
    rules = sharding.axis_rules(cfg.sharding)
    state_shardings = sharding.state_shardings(abstract, mesh, rules)
    target_state = sharding.with_shardings(abstract, state_shardings)
    ckpt = checkpoint.Checkpointer(run.checkpoints, read_only=True)
    state = ckpt.restore(run.step, target_state)
    ckpt.close()

    layout = sharding.eval_batch_layout(mesh, rules, cfg.train)
    eval_step = jax.jit(
        functools.partial(steps.eval_step, moduledef, cfg.seed),
        in_shardings=(state_shardings, layout.sharding, sharding.replicated(mesh)),
        out_shardings=sharding.replicated(mesh),
    )
    batches = (layout.place(b) for b in data.eval_batches(eval_split, layout.size, layout.rows))
    metrics = steps.evaluate(eval_step, state, batches, len(eval_split))

    if as_json:
        print(json.dumps({"step": run.step, "metrics": report.json_metrics(metrics)}))
    else:
        from rich.console import Console

        report.stderr_console().print(
            f"{run.checkpoints / str(run.step)} on {cfg.data.source} [{cfg.data.eval_split}], {len(eval_split)} "
            "examples",
            markup=False,
            highlight=False,
        )
        Console().print(report.metrics_table(f"eval at step {run.step}", metrics))


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
