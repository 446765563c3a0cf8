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

With `--tasks NAMES` the target is evaluated on lm-evaluation-harness
tasks instead (`pip install 'nnx[eval]'`): comma-separated task or group
names (`hellaswag,arc_easy,mmlu`), the user's own task YAMLs from
`--include-path DIR`, `--num-fewshot K`, `--limit N` (examples per task, or
a fraction below 1), `--batch-size B` (rows per model call),
`--apply-chat-template` for chat models. A run's adapters are applied
without merging. The results table prints as lm-eval prints it;
`--output-path DIR` writes lm-eval's results file (and with `--log-samples`
its per-sample files) as its own command line does; a run's work dir gets
one line per task in `evals/harness.jsonl` (`nnx-plot RUN --metric
arc_easy/acc` draws it against the step). `--json` prints `{"step",
"metrics": {"<task>/<metric>": value, ...}, "results", "versions", "n-shot",
"higher_is_better"}`. An unknown task, a task YAML that does not parse, or a
task whose data cannot be fetched is exit 2 naming it.
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
    tasks: str | None = typer.Option(
        None,
        help="lm-evaluation-harness tasks or groups, comma-separated (e.g. hellaswag,arc_easy).",
        show_default=False,
        rich_help_panel="Harness",
    ),
    num_fewshot: int | None = typer.Option(
        None, help="Few-shot examples per prompt (default: each task's own).", rich_help_panel="Harness"
    ),
    limit: float | None = typer.Option(
        None, help="Examples per task: a count, or a fraction below 1 (default: all).", rich_help_panel="Harness"
    ),
    batch_size: int = typer.Option(32, help="Rows per model call.", rich_help_panel="Harness"),
    include_path: Path | None = typer.Option(
        None, help="A directory of your own task YAMLs.", show_default=False, rich_help_panel="Harness"
    ),
    output_path: Path | None = typer.Option(
        None,
        help="Where lm-eval's results files go (as its --output_path).",
        show_default=False,
        rich_help_panel="Harness",
    ),
    log_samples: bool = typer.Option(
        False,
        "--log-samples",
        help="With --output-path: every sample's prompt and responses too.",
        rich_help_panel="Harness",
    ),
    apply_chat_template: bool = typer.Option(
        False,
        "--apply-chat-template",
        help="Prompts as chat turns, in the model's chat template.",
        rich_help_panel="Harness",
    ),
) -> None:
    """Evaluate a trained checkpoint and print its metrics; with --tasks, on lm-evaluation-harness tasks
    (lm-eval, the eval extra), the results table as lm-eval prints it."""
    from nnx_cli import hf, hooks, report, restore, runtime, sharding
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup
    from nnx_cli.workdir import open_run, read_run_info, same_source

    console = report.stderr_console()

    def say(message: str) -> None:
        console.print(message, highlight=False, soft_wrap=True)

    harness = dict(num_fewshot=num_fewshot, limit=limit, include_path=include_path, output_path=output_path,
                   log_samples=log_samples, apply_chat_template=apply_chat_template)  # fmt: skip
    if tasks is not None:
        _harness(target, overrides or [], step, best, tasks, batch_size, as_json, say, **harness)
        return
    given = [f"--{k.replace('_', '-')}" for k, v in harness.items() if v not in (None, False)]
    if given or batch_size != 32:
        raise UserError(f"{', '.join(given) or '--batch-size'} goes with --tasks: name the harness tasks to run")
    if hf.is_model_dir(target):
        hf.check_no_step(target, step, best)
        runtime.configure()
        exp = setup(_model_dir_config(target, overrides or []), data="eval")
        step, state, what = None, exp.init_state(), str(exp.pretrained.directory)
    else:
        run = open_run(target, overrides or [], step, best=best)
        given = [o.partition("=")[2] for o in overrides or [] if o.startswith("data.source=")]
        own = (
            given
            and run.cfg.data.eval_split is not None
            and same_source(
                load_config(run.workdir / "config.yaml").data.source, given[-1], read_run_info(run.workdir).get("cwd")
            )
        )  # the run's own data: the split its evals used
        if given and not own:
            _whole_source_without_its_split(run.cfg, overrides or [])  # other data: all of it, unless split
        runtime.configure(deterministic=run.cfg.train.deterministic)
        exp = setup(run.cfg, data="eval")

        def read(ckpt: Any, s: int) -> Any:
            exp.check_base(ckpt.manifest(s), ckpt.directory / str(s))
            return restore.read_state(ckpt, s, exp.restore_target())

        exp.hash_base()
        step, state = restore.from_run(run, read, say)
        state, what = exp.with_reference(exp.with_frozen(state), say), str(run.checkpoints / str(step))
    sampling = hasattr(exp.objective, "evaluator")  # it lays out its own batches (GRPO's completions)
    layout = None if sampling else sharding.eval_batch_layout(exp.mesh, exp.rules, exp.cfg.train)
    metrics = hooks.evaluator(exp, layout, sharding.replicated(exp.mesh))(state)

    if as_json:
        print(json.dumps({"step": step, "metrics": report.json_metrics(metrics)}))
    else:
        from rich.console import Console

        from nnx_cli.data.text import is_text

        total = len(exp.eval)
        counted = total if layout is None else hooks.eval_count(exp, layout)
        # text is read in rows of data.seq_len tokens, which hold several examples when packed, or part of one
        tokens = f" of {exp.cfg.data.seq_len} tokens" if is_text(exp.cfg.data) else ""
        units, unit = (f"rows{tokens}", f"row{tokens}") if tokens else ("examples", "example")
        examples = f"{total} {units if total != 1 else unit}"
        if counted < total:
            examples = (
                f"the first {counted} of {total} {units} (train.eval_max_batches={exp.cfg.train.eval_max_batches})"
            )
        say(f"{what} on {exp.cfg.data.source} [{exp.cfg.data.eval_split}], {examples}")
        title = "eval of the pretrained model" if step is None else f"eval at step {step}"
        Console(markup=False).print(report.metrics_table(title, metrics))


def _harness(
    target: Path, overrides: list[str], step: int | None, best: bool, names: str, batch_size: int, as_json: bool,
    say: Any, *, num_fewshot: int | None, limit: float | None, include_path: Path | None, output_path: Path | None,
    log_samples: bool, apply_chat_template: bool,
) -> None:  # fmt: skip
    """`--tasks`: the target on lm-evaluation-harness tasks; the table (or JSON) printed, the results written."""
    from nnx_cli import harness, report

    harness.require_lm_eval("nnx-eval --tasks")
    if log_samples and output_path is None:
        raise UserError("--log-samples writes the samples under --output-path: pass it too")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        # 1.5 ran 1 example a task, 0 ran none; the config's eval.harness.limit refused both
        raise UserError(f"--limit must be a number of examples or a fraction in (0, 1), got {limit:g}")
    count = None if limit is None else int(limit) if limit >= 1 else limit
    from nnx_cli import hf

    if not hf.is_model_dir(target):  # a run of an image model is no target: said before any task data is fetched
        from nnx_cli.data.text import is_text
        from nnx_cli.workdir import open_run

        run = open_run(target, overrides, step, best=best)
        if not is_text(run.cfg.data):
            raise UserError(
                f"{str(run.workdir)!r} holds a {run.cfg.model.name!r} model trained on images, not a language model; "
                "nnx-eval --tasks evaluates transformer_lm runs (drop --tasks to evaluate it on its eval split)"
            )
    tasks = harness.load_tasks(names.split(","), include_path)  # before the model: a wrong name stops us at once
    from nnx_cli.harness.backend import NNXLM
    from nnx_cli.harness.target import load_target

    loaded = load_target(target, overrides, step=step, best=best, say=say)
    lm = NNXLM(loaded, batch_size=batch_size)
    tracker = harness.tracker(output_path)
    results = harness.evaluate(
        lm, tasks, num_fewshot=num_fewshot, limit=count, log_samples=log_samples,
        apply_chat_template=apply_chat_template, model_args=f"pretrained={target}", tracker=tracker,
    )  # fmt: skip
    if tracker is not None:
        harness.save_outputs(tracker, results, log_samples)
    if loaded.workdir is not None:
        harness.write_records(loaded.workdir, loaded.step, results, limit=count, target=str(target))
    if as_json:
        print(json.dumps({
            "step": loaded.step, "metrics": report.json_metrics(harness.flat_metrics(results, stderr=True)),
            **{k: results[k] for k in ("results", "groups", "versions", "n-shot", "higher_is_better") if k in results},
        }, default=str))  # fmt: skip
    else:
        where = loaded.name if loaded.step is None else f"{loaded.workdir} at step {loaded.step}"
        say(f"{where}: {', '.join(tasks.names)}" + (f", limit {count}" if count is not None else ""))
        print(harness.results_table(results), flush=True)


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
    run_app(app, makes_files=True)


if __name__ == "__main__":
    main()
