"""`nnx-plot WORKDIR [WORKDIR ...] [--metric M] [--out FILE.png]`: training curves from metrics.jsonl.

Each work dir's train logs are drawn as a line and its evals as markers in
the same colour; lm-evaluation-harness results (`<task>/<metric>`, logged by
`eval.harness` or recorded by `nnx-eval RUN --tasks` in
`evals/harness.jsonl`) are diamonds; several work dirs are overlaid, each
named after its directory (a run's metrics.jsonl may be given for its work dir). The default
metric is the model's loss metric (the model named in the first work dir's `config.yaml`), else
the first metric logged; a run that does not log it is left out, with a warning. The image
goes to `<workdir>/plot.png` for one work dir, `./plot.png` for several, or
`--out`; its path is printed. Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import typer
import yaml

from nnx_cli.errors import RunError, UserError, cannot_write, check_can_create, did_you_mean, report_errors, run_app
from nnx_cli.integrity import write_atomically

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)

Records = Sequence[Mapping[str, Any]]


@app.command()
@report_errors
def plot(
    workdirs: list[Path] = typer.Argument(
        ...,
        metavar="WORKDIR...",
        help="Work dirs of nnx-train runs (each holds a metrics.jsonl), or their metrics.jsonl files.",
        show_default=False,
    ),
    metric: str | None = typer.Option(None, help="Metric to draw (default: the model's loss metric)."),
    out: Path | None = typer.Option(
        None, help="Image to write (default: <workdir>/plot.png for one work dir, ./plot.png for several)."
    ),
) -> None:
    """Draw train and eval curves of one metric for one or more runs."""
    _matplotlib()
    workdirs = [run_dir(path) for path in workdirs]
    runs = {name: read_metrics(workdir) for name, workdir in zip(run_names(workdirs), workdirs)}
    metric = metric or default_metric(workdirs[0], next(iter(runs.values())))
    available = metric_names(record for records in runs.values() for record in records)
    if metric not in available:
        raise UserError(
            f"--metric {metric!r} is not logged by {_listing(runs)}{did_you_mean(metric, available)}; "
            f"available: {', '.join(available)}"
        )
    drawn = {name: records for name, records in runs.items() if metric in metric_names(records)}
    for name in (name for name in runs if name not in drawn):
        print(
            f"warning: run {name!r} does not log {metric!r} and is left out of the plot; it logs "
            f"{', '.join(metric_names(runs[name]))} (choose one with --metric)",
            file=sys.stderr,
        )
    for name, records in drawn.items():
        values = [record["metrics"][metric] for record in records if metric in record["metrics"]]
        if not any(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            print(
                f"warning: run {name!r} logs no finite value of {metric!r} ({len(values)} records, all NaN or "
                "infinite): its curve is empty",
                file=sys.stderr,
            )
    out = out or (workdirs[0] / "plot.png" if len(workdirs) == 1 else Path("plot.png"))
    save_figure(build_figure(drawn, metric), out)
    print(out)


def main() -> None:
    run_app(app, makes_files=True)


def run_dir(path: Path) -> Path:
    """The work dir `path` names: itself, or the directory of a `metrics.jsonl` file.

    >>> run_dir(Path("runs/vae/metrics.jsonl"))
    PosixPath('runs/vae')
    """
    if path.is_file() and path.name == "metrics.jsonl":
        return path.parent
    if path.exists() and not path.is_dir():
        raise UserError(
            f"{str(path)!r} is a file, not a work dir; pass the work dir of an nnx-train run (the directory that "
            "holds its metrics.jsonl)"
        )
    return path


def read_metrics(workdir: Path) -> list[dict[str, Any]]:
    """The records of `<workdir>/metrics.jsonl` (a torn line from a killed run is skipped); `workdir` may also
    be that file.

    >>> read_metrics(Path("runs/vae"))[0]
    {'step': 100, 'split': 'train', 'metrics': {'nelbo': 98.1, 'recon': 90.2, 'kl': 7.9}, 'time': 1795370000.0}
    """
    from nnx_cli.harness import read_records

    workdir = run_dir(workdir)
    path = workdir / "metrics.jsonl"
    if not workdir.is_dir():
        from nnx_cli.workdir import closest_dir

        raise UserError(
            f"work dir {str(workdir)!r} does not exist{closest_dir(workdir)}; pass the work dir of an nnx-train run"
        )
    harness = read_records(workdir)  # nnx-eval RUN --tasks: evals/harness.jsonl
    if not path.is_file() and not harness:
        raise UserError(
            f"{str(path)!r} not found: {str(workdir)!r} is not the work dir of an nnx-train run, or its run "
            "did not list 'jsonl' in logging.loggers"
        )
    # a line with bytes that are not UTF-8 (a damaged disk block) is not JSON: passed over like a torn one
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    parsed = [_record(line) for line in lines]
    damaged = [n for n, (line, record) in enumerate(zip(lines, parsed), 1) if record is None and line.strip()]
    if damaged and damaged != [len(lines)]:  # a torn last line is a killed run's; others are damage or edits
        where = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        print(f"notice: {path}: left out {len(damaged)} of its {len(lines)} lines, which hold no metrics record "
              f"(line numbers {where})", file=sys.stderr, flush=True)  # fmt: skip
    records = [record for record in parsed if record is not None] + harness
    if not records and damaged:
        raise UserError(f"{str(path)!r} holds no metrics record: none of its lines is one (is it damaged?)")
    if not records:
        raise UserError(
            f"{str(path)!r} holds no metrics yet: its run has not reached its first log (train.log_every steps)"
        )
    return records


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict):
        return None
    step, split = record.get("step"), record.get("split", "train")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(split, str):
        return None  # a step of another type was drawn on a categorical axis
    # values that are no number (a list, a string: hand edits) are left out; a list ended in numpy's traceback
    metrics = {k: v for k, v in record["metrics"].items() if v is None or _is_number(v)}
    return {**record, "metrics": metrics}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_names(workdirs: Sequence[Path]) -> list[str]:
    """Legend names: each work dir's name, with as many parent dirs as it takes to tell equal names apart.

    >>> run_names([Path("a/vae"), Path("b/vae"), Path("cnn")])
    ['a/vae', 'b/vae', 'cnn']
    """
    paths = [Path(os.path.abspath(w)) for w in workdirs]
    unique = list(dict.fromkeys(paths))
    depth = dict.fromkeys(unique, 1)

    def name(path: Path) -> str:
        return "/".join(path.parts[-depth[path] :]).lstrip("/") or str(path)

    while True:
        counts = Counter(name(p) for p in unique)
        clashing = [p for p in unique if counts[name(p)] > 1 and depth[p] < len(p.parts)]
        if not clashing:
            break
        for p in clashing:
            depth[p] += 1
    seen: Counter[Path] = Counter()
    names = []
    for p in paths:  # the same work dir given twice
        seen[p] += 1
        names.append(name(p) if seen[p] == 1 else f"{name(p)} ({seen[p]})")
    return names


def metric_names(records: Any) -> list[str]:
    """Metric names in the order they first appear: train metrics first, then eval-only ones."""
    records = list(records)
    names: dict[str, None] = {}
    for split_first in (True, False):
        for record in records:
            if (record.get("split") == "train") == split_first:
                names.update(dict.fromkeys(record["metrics"]))
    return list(names)


def default_metric(workdir: Path, records: Records) -> str:
    """The model's loss metric when the work dir's `config.yaml` names a model that defines one, else the first."""
    names = metric_names(records)
    if not names:  # records whose metrics are all empty (or none of them a number)
        raise UserError(f"{str(workdir)!r}: its metrics records hold no metric values to plot")
    loss = _loss_metric(workdir / "config.yaml")
    return loss if loss in names else names[0]


def _loss_metric(config_path: Path) -> str | None:
    try:
        model_name = yaml.safe_load(config_path.read_text())["model"]["name"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):  # ValueError: not UTF-8
        return None
    from nnx_cli.models import MODELS

    try:
        model = MODELS.get(str(model_name))
    except UserError:  # a `package.module:Class` that does not import from here: fall back to the first metric
        return None
    return getattr(model, "loss_metric", None)


def build_figure(runs: Mapping[str, Records], metric: str) -> Any:
    """A matplotlib Figure of `metric` against step: per run, train as a line and eval as markers.

    >>> figure = build_figure({"vae": read_metrics(Path("runs/vae"))}, "nelbo")
    >>> [line.get_label() for line in figure.axes[0].get_lines()]
    ['vae train', 'vae eval']
    """
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), dpi=150, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i % 10}"
        steps, values = _series(records, "train", metric)
        if steps:
            marker = "." if len(steps) == 1 else None  # one point: a line alone would not show
            ax.plot(steps, values, color=color, linewidth=1.6, marker=marker, label=f"{name} train")
        for split, marker in (("eval", "o"), ("harness", "D")):
            steps, values = _series(records, split, metric)
            if steps:
                ax.plot(
                    steps,
                    values,
                    color=color,
                    linestyle="none",
                    marker=marker,
                    markersize=6,
                    markeredgecolor="black",
                    markeredgewidth=0.6,
                    label=f"{name} {split}",
                )
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(metric if len(runs) > 1 else f"{metric}: {next(iter(runs))}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small", framealpha=0.9)
    return figure


def _series(records: Records, split: str, metric: str) -> tuple[list[int], list[float]]:
    """Steps and values of one metric in one split; a null (non-finite) value becomes NaN, a gap in the line."""
    points = [
        (record["step"], math.nan if record["metrics"][metric] is None else record["metrics"][metric])
        for record in records
        if record.get("split") == split and metric in record["metrics"]
    ]
    return [step for step, _ in points], [value for _, value in points]


def save_figure(figure: Any, out: Path) -> None:
    """Write `figure` to `out`, in the format its extension names (.png, .svg, .pdf, ...): drawn into a file
    beside it and renamed into place, so a write that fails (a full disk) leaves the image that was there."""
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a directory; give the image's file name (e.g. {out / 'plot.png'})")
    formats = figure.canvas.get_supported_filetypes()
    kind = out.suffix.lstrip(".").lower()
    if kind not in formats:
        raise UserError(
            f"--out {str(out)!r}: the extension names the image format; use one of "
            f"{', '.join('.' + f for f in sorted(formats))} (e.g. plot.png)"
        )
    check_can_create(out, "--out")
    image = io.BytesIO()
    figure.savefig(image, format=kind)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(out, image.getvalue())
    except OSError as e:
        raise RunError(cannot_write(out, e)) from None


def _listing(runs: Mapping[str, Records]) -> str:
    return f"run {next(iter(runs))!r}" if len(runs) == 1 else f"any of the runs {', '.join(map(repr, runs))}"


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "nnx-plot needs matplotlib, which is not installed: pip install 'matplotlib>=3.7' (the plot extra of nnx)"
        ) from None


if __name__ == "__main__":
    main()
