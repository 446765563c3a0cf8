"""`nnx-plot`: curves from metrics.jsonl files the tests write, drawn by matplotlib into real images."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_support import cli
from PIL import Image

from nnx_cli.commands.plot import build_figure, default_metric, plot, read_metrics, run_names, save_figure
from nnx_cli.errors import UserError


def _write_metrics(workdir: Path, scale: float = 1.0, steps: int = 100, model: str | None = "vae") -> Path:
    """A work dir as nnx-train leaves it: train logs every 10 steps, an eval every 50."""
    workdir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(10, steps + 1, 10):
        train = {"kl": 5.0 + step / 100, "nelbo": scale * (100 + 200 * math.exp(-step / 40)), "learning_rate": 1e-3}
        lines.append({"step": step, "split": "train", "metrics": train, "time": 1.0 * step})
        if step % 50 == 0:
            lines.append({"step": step, "split": "eval", "metrics": {"kl": 6.0, "nelbo": scale * 110}, "time": 1.0})
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if model is not None:
        (workdir / "config.yaml").write_text(f"seed: 0\nmodel:\n  name: {model}\n")
    return workdir


def _labels(figure) -> list[str]:
    return [line.get_label() for line in figure.axes[0].get_lines()]


def test_two_runs_are_overlaid_with_train_as_lines_and_eval_as_markers(tmp_path: Path):
    runs = {
        "small": read_metrics(_write_metrics(tmp_path / "small")),
        "big": read_metrics(_write_metrics(tmp_path / "big", 0.5)),
    }
    figure = build_figure(runs, "nelbo")
    assert _labels(figure) == ["small train", "small eval", "big train", "big eval"]
    small_train, small_eval, big_train, _ = figure.axes[0].get_lines()
    assert small_train.get_linestyle() == "-" and small_eval.get_linestyle() == "None"
    assert small_eval.get_marker() == "o"
    assert list(small_train.get_xdata()) == list(range(10, 101, 10)) and list(small_eval.get_xdata()) == [50, 100]
    assert small_train.get_color() == small_eval.get_color() != big_train.get_color()
    ax = figure.axes[0]
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "nelbo"
    assert [text.get_text() for text in ax.get_legend().get_texts()] == _labels(figure)


def test_nnx_plot_writes_a_png_of_several_runs_into_the_current_directory(tmp_path: Path):
    _write_metrics(tmp_path / "a" / "vae")
    _write_metrics(tmp_path / "b" / "vae", scale=0.8)
    result = cli("nnx-plot", "a/vae", "b/vae", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "plot.png"
    png = tmp_path / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] >= 800 and image.size[1] >= 500


def test_one_run_is_plotted_into_its_work_dir(tmp_path: Path, capsys: pytest.CaptureFixture):
    workdir = _write_metrics(tmp_path / "run")
    plot([workdir], metric="kl", out=None)
    assert capsys.readouterr().out.strip() == str(workdir / "plot.png")
    assert (workdir / "plot.png").stat().st_size > 10_000


def test_out_chooses_the_file_and_its_format(tmp_path: Path, capsys: pytest.CaptureFixture):
    workdir = _write_metrics(tmp_path / "run")
    plot([workdir], metric=None, out=tmp_path / "figures" / "curves.svg")
    assert (tmp_path / "figures" / "curves.svg").read_text().lstrip().startswith("<?xml")


def test_out_with_an_unknown_extension_is_a_user_error(tmp_path: Path):
    figure = build_figure({"run": read_metrics(_write_metrics(tmp_path / "run"))}, "nelbo")
    with pytest.raises(UserError, match=r"--out '.*curves\.pnj': the extension names the image format; use one of"):
        save_figure(figure, tmp_path / "curves.pnj")


def test_a_write_that_fails_keeps_the_image_that_was_there_and_leaves_no_partial_file(tmp_path: Path):
    workdir = _write_metrics(tmp_path / "run")
    assert cli("nnx-plot", "run", cwd=tmp_path).returncode == 0
    before = (workdir / "plot.png").read_bytes()
    _write_metrics(workdir, scale=3.0)  # new curves, and a disk that takes 4 KB per file (EFBIG past it)
    failed = cli("nnx-plot", "run", cwd=tmp_path, file_size_limit=4096)
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.strip().startswith("error: cannot write run/plot.png (File too large)"), failed.stderr
    assert (workdir / "plot.png").read_bytes() == before
    assert sorted(p.name for p in workdir.iterdir()) == ["config.yaml", "metrics.jsonl", "plot.png"]


def test_out_that_is_a_directory_or_under_a_file_is_a_user_error(tmp_path: Path):
    figure = build_figure({"run": read_metrics(_write_metrics(tmp_path / "run"))}, "nelbo")
    with pytest.raises(UserError, match=r"--out '.*run' is a directory; give the image's file name"):
        save_figure(figure, tmp_path / "run")
    with pytest.raises(UserError, match=r"metrics\.jsonl is a file, not a directory"):
        save_figure(figure, tmp_path / "run" / "metrics.jsonl" / "plot.png")


def test_a_run_with_no_finite_value_of_the_metric_is_named_in_a_warning(tmp_path: Path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    lines = [
        '{"step": 10, "split": "train", "metrics": {"loss": NaN}}',
        '{"step": 20, "split": "train", "metrics": {"loss": null}}',
    ]
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = cli("nnx-plot", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning: run 'run' logs no finite value of 'loss' (2 records, all NaN or infinite)" in result.stderr


def test_runs_with_equal_names_are_told_apart_by_their_parent_dirs(tmp_path: Path):
    names = run_names([tmp_path / "sweep1" / "vae", tmp_path / "sweep2" / "vae", tmp_path / "cnn"])
    assert names == ["sweep1/vae", "sweep2/vae", "cnn"]


def test_the_same_work_dir_twice_is_numbered(tmp_path: Path):
    assert run_names([tmp_path / "vae", tmp_path / "vae"]) == ["vae", "vae (2)"]


def test_default_metric_is_the_loss_metric_of_the_model_in_config_yaml(tmp_path: Path):
    workdir = _write_metrics(tmp_path / "run", model="vae")  # kl is logged first; the VAE minimises nelbo
    assert default_metric(workdir, read_metrics(workdir)) == "nelbo"


def test_lines_and_a_config_that_are_not_utf8_are_passed_over_like_torn_ones(tmp_path: Path):
    """A damaged block of metrics.jsonl or config.yaml (bytes that are not UTF-8) was a UnicodeDecodeError."""
    workdir = _write_metrics(tmp_path / "run", model="vae")
    whole = read_metrics(workdir)
    with (workdir / "metrics.jsonl").open("ab") as f:
        f.write(b"\xff\xfe\n")
    (workdir / "config.yaml").write_bytes(b"\x00\xff\xfe garbage")
    assert read_metrics(workdir) == whole
    assert default_metric(workdir, whole) == "kl"  # no model named: the first metric logged


def test_lines_that_hold_no_record_before_the_last_are_left_out_saying_which(tmp_path: Path, capsys):
    """They were dropped without a word (a torn last line is a killed run's, and nnx-train's resume removes it;
    others are damage or hand edits)."""
    workdir = _write_metrics(tmp_path / "run")
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    (workdir / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:], '{"step": 110, "spl']))
    assert read_metrics(workdir) == read_metrics(_write_metrics(tmp_path / "whole"))
    said = capsys.readouterr().err
    assert said.count("notice:") == 1
    assert (
        f"left out 2 of its {len(lines) + 2} lines, which hold no metrics record (line numbers 2, {len(lines) + 2})"
        in said
    )
    (workdir / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 110, "spl']))  # torn last line alone
    read_metrics(workdir)
    assert capsys.readouterr().err == ""


def test_default_metric_without_a_config_is_the_first_metric_logged(tmp_path: Path):
    workdir = _write_metrics(tmp_path / "run", model=None)
    assert default_metric(workdir, read_metrics(workdir)) == "kl"


def test_a_metric_typo_exits_2_suggesting_the_closest_and_listing_the_available(tmp_path: Path):
    _write_metrics(tmp_path / "run")
    result = cli("nnx-plot", "run", "--metric", "nelbp", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --metric 'nelbp' is not logged by run 'run' (did you mean 'nelbo'?); "
        "available: kl, nelbo, learning_rate"
    )
    short = cli("nnx-plot", "run", "--metric", "learn", cwd=tmp_path)  # a prefix of one metric only
    assert short.returncode == 2 and "(did you mean 'learning_rate'?)" in short.stderr, short.stderr


def test_non_finite_values_are_gaps_in_the_curve(tmp_path: Path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    records = [{"step": s, "split": "train", "metrics": {"loss": None if s == 20 else 1.0 / s}} for s in (10, 20, 30)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (line,) = build_figure({"run": read_metrics(workdir)}, "loss").axes[0].get_lines()
    assert [math.isnan(y) for y in line.get_ydata()] == [False, True, False]


def test_a_work_dir_without_metrics_jsonl_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match=r"metrics\.jsonl' not found: .* did not list 'jsonl' in logging\.loggers"):
        read_metrics(tmp_path)


def test_an_empty_metrics_jsonl_is_a_user_error(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"metrics\.jsonl' holds no metrics yet"):
        read_metrics(tmp_path)


def test_records_a_hand_edit_broke_are_left_out_or_a_user_error_not_a_traceback(tmp_path: Path):
    """Metrics all empty: an IndexError; a list value: numpy's ValueError; a string step: a categorical axis; a
    harness file not UTF-8 or with a list for a task: a UnicodeDecodeError and a TypeError (all exit 1)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "split": "train", "metrics": {}}\n')
    with pytest.raises(UserError, match="its metrics records hold no metric values to plot"):
        default_metric(empty, read_metrics(empty))
    odd = tmp_path / "odd"
    odd.mkdir()
    lines = [{"step": 1, "metrics": {"loss": [1, 2], "acc": "high"}}, {"step": "a", "metrics": {"loss": 3.0}},
             {"step": 2, "split": "train", "metrics": {"loss": 1.0}}]  # fmt: skip
    (odd / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (odd / "evals").mkdir()
    (odd / "evals" / "harness.jsonl").write_bytes(
        b'{"step": 2, "task": "arc", "metrics": {"acc": 0.5}}\n\xff\xfe\n'
        b'{"step": 2, "task": ["arc"], "metrics": {"acc": 0.7}}\n'
    )
    records = read_metrics(odd)
    assert [(r["step"], r["metrics"]) for r in records] == [(1, {}), (2, {"loss": 1.0}), (2, {"arc/acc": 0.5})]
    plot([odd], metric=None, out=tmp_path / "odd.png")
    assert (tmp_path / "odd.png").is_file()
    (empty / "metrics.jsonl").write_text("garbage\nmore garbage\n")
    with pytest.raises(UserError, match="holds no metrics record: none of its lines is one"):
        read_metrics(empty)


def test_a_missing_work_dir_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match=r"work dir '.*nowhere' does not exist"):
        read_metrics(tmp_path / "nowhere")
    _write_metrics(tmp_path / "digits_vae")  # a typo of a run beside it is named, as nnx-eval names it
    with pytest.raises(UserError, match=r"work dir '.*digits_vea' does not exist \(did you mean '.*/digits_vae'\?\)"):
        read_metrics(tmp_path / "digits_vea")


def _write_classifier_metrics(workdir: Path) -> Path:
    """A classifier's work dir: it logs loss and accuracy, no nelbo."""
    workdir.mkdir(parents=True, exist_ok=True)
    records = [{"step": s, "split": "train", "metrics": {"loss": 1.0 / s, "accuracy": 0.5}} for s in (10, 20)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return workdir


def test_a_run_that_does_not_log_the_metric_is_named_in_a_warning(tmp_path: Path):
    _write_metrics(tmp_path / "vae")
    _write_classifier_metrics(tmp_path / "mlp")
    result = cli("nnx-plot", "vae", "mlp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == (
        "warning: run 'mlp' does not log 'nelbo' and is left out of the plot; it logs loss, accuracy "
        "(choose one with --metric)"
    )
    result = cli("nnx-plot", "vae", "mlp", "--metric", "accuracy", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("warning: run 'vae' does not log 'accuracy' and is left out of the plot")


def test_a_metric_no_run_logs_exits_2(tmp_path: Path):
    _write_metrics(tmp_path / "vae")
    _write_classifier_metrics(tmp_path / "mlp")
    result = cli("nnx-plot", "vae", "mlp", "--metric", "perplexity", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --metric 'perplexity' is not logged by any of the runs 'vae', 'mlp'")


def test_a_metrics_jsonl_file_stands_for_its_work_dir(tmp_path: Path):
    _write_metrics(tmp_path / "run")
    result = cli("nnx-plot", "run/metrics.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "run/plot.png" and (tmp_path / "run" / "plot.png").is_file()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == read_metrics(tmp_path / "run")


def test_another_file_for_a_work_dir_is_a_user_error(tmp_path: Path):
    workdir = _write_metrics(tmp_path / "run")
    with pytest.raises(UserError, match=r"config\.yaml' is a file, not a work dir; pass the work dir"):
        read_metrics(workdir / "config.yaml")
