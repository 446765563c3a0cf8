"""Metric loggers, called as the training loop calls them, writing real files read back by their own readers."""

from __future__ import annotations

import io
import json
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_support import free_port
from rich.console import Console

from nnx_cli.errors import RunError, UserError
from nnx_cli.loggers import LoggerRun, open_loggers, resolve_loggers


def _run(workdir: Path, start: int = 0, total: int = 50, console: Console | None = None) -> LoggerRun:
    workdir.mkdir(parents=True, exist_ok=True)
    return LoggerRun(
        workdir,
        {"seed": 0, "model": {"name": "vae"}, "train": {"steps": total}},
        start_step=start,
        total_steps=total,
        loss_metric="nelbo",
        console=console or Console(file=io.StringIO()),
    )


def _log_run(names: list[str], run: LoggerRun, steps: list[int], *, eval_every: int = 20, scale: float = 1.0) -> None:
    """Log train metrics at `steps` and an eval at every multiple of `eval_every`, as the loop does."""
    loggers = open_loggers(resolve_loggers(names), run)
    for step in steps:
        loggers.tick(step)
        loggers.log(step, "train", {"nelbo": scale / step, "learning_rate": 1e-3})
        if step % eval_every == 0:
            loggers.log(step, "eval", {"nelbo": 2 * scale / step})
    loggers.close()


def _records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- jsonl


def test_jsonl_writes_one_record_per_log_with_step_split_metrics_and_time(tmp_path: Path):
    _log_run(["jsonl"], _run(tmp_path), [10, 20])
    records = _records(tmp_path)
    assert [(r["step"], r["split"]) for r in records] == [(10, "train"), (20, "train"), (20, "eval")]
    assert records[0]["metrics"] == {"nelbo": 0.1, "learning_rate": 1e-3}
    assert all(isinstance(r["time"], float) for r in records)


def test_jsonl_writes_non_finite_metrics_as_null(tmp_path: Path):
    loggers = open_loggers(resolve_loggers(["jsonl"]), _run(tmp_path))
    loggers.log(1, "train", {"nelbo": float("nan"), "kl": float("inf"), "recon": 1.5})
    loggers.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line)["metrics"] == {"nelbo": None, "kl": None, "recon": 1.5}
    assert "NaN" not in line and "Infinity" not in line


def test_jsonl_on_resume_drops_records_past_the_restored_step_a_torn_line_and_bytes_not_utf8(tmp_path: Path):
    _log_run(["jsonl"], _run(tmp_path), [10, 20, 30, 40])
    with (tmp_path / "metrics.jsonl").open("ab") as f:
        f.write(b'{"step": 45, "split": "train", "metrics": {"nelbo": 1.0\xff\xfe}}\n')  # a damaged block: not UTF-8
        f.write(b'{"step": 50, "spl')  # killed mid-write
    _log_run(["jsonl"], _run(tmp_path, start=20), [30, 40], scale=10.0)
    records = _records(tmp_path)
    assert [(r["step"], r["split"]) for r in records] == [
        (10, "train"),
        (20, "train"),
        (20, "eval"),
        (30, "train"),
        (40, "train"),
        (40, "eval"),
    ]
    assert records[3]["metrics"]["nelbo"] == pytest.approx(10.0 / 30)  # from the resumed run


def test_jsonl_on_resume_with_other_intervals_keeps_the_records_of_the_resumed_step(tmp_path: Path):
    """Resumed at step 10 with train.log_every and eval_every 4 (5 before), the records of step 10 went: the
    file was cut by the new intervals, not the ones its lines were written under."""

    def run(start: int, every: int, previous: int | None) -> LoggerRun:
        config = lambda n: {"train": {"log_every": n, "eval_every": n}}  # noqa: E731
        return LoggerRun(tmp_path, config(every), start, 20, "nelbo", Console(file=io.StringIO()),
                         previous_config=config(previous) if previous else None)  # fmt: skip

    _log_run(["jsonl"], run(0, 5, None), [5, 10], eval_every=5)
    with (tmp_path / "metrics.jsonl").open("a") as f:  # a run stopped at step 12, between two logs
        f.write(json.dumps({"step": 12, "split": "train", "metrics": {"nelbo": 1.0}, "time": 0.0}) + "\n")
    _log_run(["jsonl"], run(10, 4, 5), [12], eval_every=4)
    assert [(r["step"], r["split"]) for r in _records(tmp_path)] == [
        (5, "train"), (5, "eval"), (10, "train"), (10, "eval"), (12, "train"), (12, "eval")
    ]  # fmt: skip
    assert _records(tmp_path)[4]["metrics"]["nelbo"] == pytest.approx(1 / 12)  # the resumed run's, not the stray
    (tmp_path / "metrics.jsonl").write_text(  # a run stopped at 7 under log_every 5: its end-of-run log goes
        "".join(json.dumps({"step": s, "split": "train", "metrics": {}, "time": 0.0}) + "\n" for s in (5, 7))
    )
    open_loggers(resolve_loggers(["jsonl"]), run(7, 4, 5)).close()
    assert [r["step"] for r in _records(tmp_path)] == [5]


# --------------------------------------------------------------------------- console


def _plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_console_plain_lines_show_step_metrics_and_rates(tmp_path: Path):
    console, out = _plain_console()
    loggers = open_loggers(resolve_loggers(["console"]), _run(tmp_path, total=500, console=console))
    loggers.log(100, "train", {"nelbo": 98.5, "grad_norm": 1.25, "steps_per_s": 41.5, "examples_per_s": 5312.0})
    loggers.close()
    assert out.getvalue().strip() == "step 100/500 nelbo=98.5 grad_norm=1.25 (41.5 steps/s, 5,312 examples/s)"


def test_console_measures_steps_per_second_when_the_loop_gives_no_rates(tmp_path: Path):
    console, out = _plain_console()
    loggers = open_loggers(resolve_loggers(["console"]), _run(tmp_path, console=console))
    loggers.log(10, "train", {"nelbo": 3.0})
    loggers.close()
    line = out.getvalue().strip()
    assert line.startswith("step 10/50 nelbo=3 (") and line.endswith(" steps/s)")


def test_console_prints_a_table_for_each_eval(tmp_path: Path):
    console, out = _plain_console()
    loggers = open_loggers(resolve_loggers(["console"]), _run(tmp_path, console=console))
    loggers.log(20, "eval", {"nelbo": 97.25, "kl": 6.5})
    loggers.close()
    text = out.getvalue()
    assert "eval at step 20" in text and "97.25" in text and "kl" in text and "step 20/" not in text


def test_console_on_a_terminal_draws_a_progress_bar_instead_of_lines(tmp_path: Path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    _log_run(["console"], _run(tmp_path, total=40, console=console), [10, 20, 30, 40], eval_every=1000)
    text = out.getvalue()
    assert "40/40" in text and "nelbo 0.025" in text
    assert "step 10/40" not in text


# --------------------------------------------------------------------------- tensorboard


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def test_tensorboard_scalars_are_tagged_by_split_at_their_steps(tmp_path: Path):
    _log_run(["tensorboard"], _run(tmp_path), [10, 20, 30, 40])
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"train/nelbo", "train/learning_rate", "eval/nelbo"}
    assert [step for step, _ in scalars["train/nelbo"]] == [10, 20, 30, 40]
    assert scalars["eval/nelbo"] == [(20, pytest.approx(0.1)), (40, pytest.approx(0.05))]


def test_tensorboard_resumed_run_continues_the_curves_without_repeated_or_rewound_steps(tmp_path: Path):
    _log_run(["tensorboard"], _run(tmp_path), [10, 20, 30, 40])  # interrupted after step 40, checkpoint at 20
    _log_run(["tensorboard"], _run(tmp_path, start=20), [30, 40, 50], scale=10.0)
    scalars = _scalars(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["train/nelbo"]] == [10, 20, 30, 40, 50]
    assert [step for step, _ in scalars["eval/nelbo"]] == [20, 40]
    assert dict(scalars["train/nelbo"])[20] == pytest.approx(1 / 20)  # kept from the first run
    assert dict(scalars["train/nelbo"])[30] == pytest.approx(10 / 30)  # from the resumed run
    assert dict(scalars["eval/nelbo"])[40] == pytest.approx(20 / 40)


def test_tensorboard_resumed_where_a_run_stopped_between_two_logs_drops_that_record_as_metrics_jsonl_does(
    tmp_path: Path,
):
    """Stopped at step 35, the run logged its steps since 30 there; the resumed run's record at 40 counts them
    again, and metrics.jsonl drops the one at 35: TensorBoard kept it, a point of its own on the curve."""

    def run(start: int) -> LoggerRun:
        config = {"train": {"log_every": 10, "eval_every": 20}}
        return LoggerRun(tmp_path, config, start, 50, "nelbo", Console(file=io.StringIO()))

    _log_run(["jsonl", "tensorboard"], run(0), [10, 20, 30, 35])
    _log_run(["jsonl", "tensorboard"], run(35), [40, 50], scale=10.0)
    in_jsonl = [r["step"] for r in _records(tmp_path) if r["split"] == "train"]
    assert [step for step, _ in _scalars(tmp_path / "tensorboard")["train/nelbo"]] == in_jsonl == [10, 20, 30, 40, 50]


def test_tensorboard_where_its_directory_is_a_file_is_a_user_error(tmp_path: Path):
    """A traceback (FileExistsError), exit 1."""
    (tmp_path / "tensorboard").write_text("notes")
    with pytest.raises(UserError, match=r"tensorboard' should be a directory \(the TensorBoard logger's\); move it"):
        open_loggers(resolve_loggers(["tensorboard"]), _run(tmp_path))
    assert (tmp_path / "tensorboard").read_text() == "notes"


def test_tensorboard_fresh_run_replaces_the_event_files_of_an_earlier_one(tmp_path: Path):
    _log_run(["tensorboard"], _run(tmp_path), [10, 20, 30, 40])
    _log_run(["tensorboard"], _run(tmp_path, start=0), [10], scale=10.0)
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["train/nelbo"] == [(10, pytest.approx(1.0))]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


# --------------------------------------------------------------------------- wandb


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No W&B credentials, settings, mode or server from the machine; wandb's per-process settings reset after."""
    import wandb

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")  # a W&B server nobody runs
    wandb.teardown()
    yield
    wandb.teardown()


_LEVELDB_BLOCK, _LEVELDB_HEADER = 32768, 7  # wandb's .wandb files: LevelDB log records of protobufs


def _wandb_records(run_file: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    offset, chunks = _LEVELDB_HEADER, b""
    while offset + _LEVELDB_HEADER <= len(data):
        left = _LEVELDB_BLOCK - offset % _LEVELDB_BLOCK
        if left < _LEVELDB_HEADER:  # a block's zero-padded tail
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + _LEVELDB_HEADER])
        offset += _LEVELDB_HEADER
        if kind == 0:
            break
        chunks += data[offset : offset + length]
        offset += length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _wandb_offline_runs(workdir: Path) -> list[dict]:
    """Each offline run under the work dir, in the order they started: its run record and history rows."""
    import wandb

    wandb.teardown()  # as at the end of a process: wandb's service finishes writing the run files
    runs = []
    for run_dir in sorted((workdir / "wandb").glob("offline-run-*")):
        (run_file,) = run_dir.glob("run-*.wandb")
        out: dict = {"history": []}
        for record in _wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["run"] = record.run
            elif kind == "history":
                out["history"].append(
                    {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
        runs.append(out)
    return sorted(runs, key=lambda run: run["run"].start_time.ToNanoseconds())  # names sort by id within a second


def _wandb_steps(run: dict, key: str) -> list[int]:
    return [row["_step"] for row in run["history"] if key in row]


def test_wandb_without_a_login_logs_offline_under_the_work_dir(
    tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch
):
    console, out = _plain_console()
    with socket.create_server(("127.0.0.1", 0)) as server:  # reachable: only the missing login keeps it offline
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        _log_run(["wandb"], _run(tmp_path / "vae-digits", console=console), [10, 20, 30, 40])
    (run,) = _wandb_offline_runs(tmp_path / "vae-digits")
    assert run["run"].display_name == "vae-digits" and run["run"].project == "nnx"
    config = {item.key: json.loads(item.value_json) for item in run["run"].config.update}
    assert config["model"] == {"name": "vae"} and config["train"] == {"steps": 50}
    assert _wandb_steps(run, "train/nelbo") == [10, 20, 30, 40]
    assert _wandb_steps(run, "eval/nelbo") == [20, 40]
    assert "wandb: logging offline (not logged in" in out.getvalue()


def test_wandb_with_an_unreachable_server_logs_offline(
    tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # logged in, but the server (see wandb_env) does not answer
    console, out = _plain_console()
    _log_run(["wandb"], _run(tmp_path, console=console), [10, 20])
    (run,) = _wandb_offline_runs(tmp_path)
    assert _wandb_steps(run, "train/nelbo") == [10, 20]
    assert "wandb: logging offline (cannot reach http://127.0.0.1:" in out.getvalue()


def test_wandb_resumed_run_continues_the_same_run_without_repeating_steps(tmp_path: Path, wandb_env: None):
    _log_run(["wandb"], _run(tmp_path), [10, 20, 30, 40])  # interrupted after step 40, checkpoint at 20
    _log_run(["wandb"], _run(tmp_path, start=20), [30, 40, 50, 60], scale=10.0)
    first, resumed = _wandb_offline_runs(tmp_path)
    assert resumed["run"].run_id == first["run"].run_id
    assert _wandb_steps(first, "train/nelbo") == [10, 20, 30, 40]
    assert _wandb_steps(resumed, "train/nelbo") == [50, 60]  # 30 and 40 are in the W&B run already
    assert _wandb_steps(resumed, "eval/nelbo") == [60]


def test_wandb_fresh_run_in_a_used_work_dir_starts_a_new_wandb_run(tmp_path: Path, wandb_env: None):
    _log_run(["wandb"], _run(tmp_path), [10, 20])
    _log_run(["wandb"], _run(tmp_path, start=0), [10])
    first, second = _wandb_offline_runs(tmp_path)
    assert second["run"].run_id != first["run"].run_id
    assert _wandb_steps(second, "train/nelbo") == [10]


def test_wandb_project_comes_from_wandb_project(tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_PROJECT", "digits-sweep")
    _log_run(["wandb"], _run(tmp_path), [10])
    (run,) = _wandb_offline_runs(tmp_path)
    assert run["run"].project == "digits-sweep"


def test_wandb_mode_from_the_environment_is_respected(tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _log_run(["wandb"], _run(tmp_path), [10, 20])
    assert _wandb_offline_runs(tmp_path) == []
    assert not list((tmp_path / "wandb").glob("run-*"))


def test_an_unknown_wandb_mode_is_a_user_error(tmp_path: Path, wandb_env: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(UserError, match=r"WANDB_MODE='ofline' is not one of online, offline, disabled"):
        open_loggers(resolve_loggers(["wandb"]), _run(tmp_path))


# --------------------------------------------------------------------------- resolving names


def test_an_unknown_logger_is_a_user_error_suggesting_the_closest(tmp_path: Path):
    with pytest.raises(
        UserError, match=r"'logging\.loggers': unknown logger 'tensorbaord' \(did you mean 'tensorboard'"
    ):
        resolve_loggers(["jsonl", "tensorbaord"])


def test_a_logger_listed_twice_is_a_user_error():
    with pytest.raises(UserError, match=r"'logging\.loggers' lists 'jsonl' twice"):
        resolve_loggers(["jsonl", "console", "jsonl"])


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current directory, where `package.module:attr` loggers are imported from; the imports undone after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("nnx_test_"):
            del sys.modules[name]


_RECORDER = """
import json


class Recorder:
    def __init__(self, run):
        self.path = run.workdir / "recorded.jsonl"
        self.start = run.start_step

    def log(self, step, split, metrics):
        with self.path.open("a") as f:
            f.write(json.dumps([self.start, step, split, dict(metrics)]) + "\\n")

    def close(self):
        with self.path.open("a") as f:
            f.write("closed\\n")
"""


def test_a_logger_class_is_imported_from_the_current_directory(plugin_dir: Path):
    (plugin_dir / "nnx_test_recorder.py").write_text(_RECORDER)
    _log_run(["jsonl", "nnx_test_recorder:Recorder"], _run(plugin_dir / "run", start=10), [20])
    lines = (plugin_dir / "run" / "recorded.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines[:2]] == [
        [10, 20, "train", {"nelbo": 0.05, "learning_rate": 1e-3}],
        [10, 20, "eval", {"nelbo": 0.1}],
    ]
    assert lines[2] == "closed"
    assert len(_records(plugin_dir / "run")) == 2  # the jsonl logger beside it


def test_a_logger_whose_package_is_missing_names_what_to_pip_install(plugin_dir: Path):
    (plugin_dir / "nnx_test_needy.py").write_text(_RECORDER + '\n\nRecorder.requires = ("nnx-test-no-such-package",)\n')
    with pytest.raises(
        UserError, match=r"logger 'nnx_test_needy:Recorder' needs .*pip install nnx-test-no-such-package"
    ):
        resolve_loggers(["nnx_test_needy:Recorder"])


def test_a_logger_whose_package_is_too_old_names_the_upgrade(plugin_dir: Path):
    (plugin_dir / "nnx_test_picky.py").write_text(_RECORDER + '\n\nRecorder.requires = ("pytest>=999",)\n')
    with pytest.raises(UserError, match=r"needs pytest>=999, found .*pip install --upgrade 'pytest>=999'"):
        resolve_loggers(["nnx_test_picky:Recorder"])


def test_a_logger_that_does_not_take_the_run_is_a_user_error(plugin_dir: Path):
    (plugin_dir / "nnx_test_argless.py").write_text("class Logger:\n    def __init__(self):\n        pass\n")
    with pytest.raises(UserError, match=r"'nnx_test_argless:Logger' is not a class or function taking one argument"):
        resolve_loggers(["nnx_test_argless:Logger"])


def test_a_logger_class_without_log_is_a_user_error_when_the_names_are_resolved(plugin_dir: Path):
    (plugin_dir / "nnx_test_nolog.py").write_text("class NoLog:\n    def __init__(self, run):\n        pass\n\n"
                                                   "    def close(self):\n        pass\n")  # fmt: skip
    with pytest.raises(UserError, match=r"'logging\.loggers': 'nnx_test_nolog:NoLog' has no log method"):
        resolve_loggers(["jsonl", "nnx_test_nolog:NoLog"])


def test_a_shipped_logger_whose_package_fails_to_import_is_a_user_error_when_resolved(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # installed, but `import tensorboardX` fails
    with pytest.raises(UserError, match=r"logger 'tensorboard' needs the tensorboardX package, which failed to import"):
        resolve_loggers(["jsonl", "tensorboard"])


def test_a_logger_function_making_an_object_without_log_is_a_user_error_and_the_others_are_closed(plugin_dir: Path):
    (plugin_dir / "nnx_test_recorder2.py").write_text(_RECORDER)
    (plugin_dir / "nnx_test_mute.py").write_text("class Mute:\n    pass\n\n\ndef mute(run):\n    return Mute()\n")
    factories = resolve_loggers(["nnx_test_recorder2:Recorder", "nnx_test_mute:mute"])
    with pytest.raises(UserError, match=r"'nnx_test_mute:mute' made a Mute, which lacks log\(step, split, metrics\)"):
        open_loggers(factories, _run(plugin_dir / "run"))
    assert (plugin_dir / "run" / "recorded.jsonl").read_text() == "closed\n"


_RAISING = """
class Raising:
    def __init__(self, run):
        if run.start_step == 7:
            raise RuntimeError("no server")

    def log(self, step, split, metrics):
        raise KeyError(split)

    def close(self):
        pass
"""


def test_a_logger_that_raises_while_opening_is_a_user_error_naming_it_and_the_others_are_closed(plugin_dir: Path):
    (plugin_dir / "nnx_test_recorder4.py").write_text(_RECORDER)
    (plugin_dir / "nnx_test_raising.py").write_text(_RAISING)
    factories = resolve_loggers(["nnx_test_recorder4:Recorder", "nnx_test_raising:Raising"])
    with pytest.raises(
        UserError,
        match=r"^config key 'logging\.loggers': 'nnx_test_raising:Raising' raised RuntimeError while opening: no "
        r"server",
    ):
        open_loggers(factories, _run(plugin_dir / "run", start=7))
    assert (plugin_dir / "run" / "recorded.jsonl").read_text() == "closed\n"


def test_a_logger_calling_sys_exit_is_named_like_one_that_raises(plugin_dir: Path):
    """The run ended with the plug-in's own exit code and no word."""
    (plugin_dir / "nnx_test_exiting.py").write_text(
        "import sys\n\n\nclass Exiting:\n    def __init__(self, run):\n        if run.start_step == 7:\n"
        "            sys.exit(3)\n\n    def log(self, step, split, metrics):\n        sys.exit(4)\n\n"
        "    def close(self):\n        pass\n"
    )
    factories = resolve_loggers(["nnx_test_exiting:Exiting"])
    with pytest.raises(UserError, match=r"'nnx_test_exiting:Exiting' called sys.exit\(3\) while opening"):
        open_loggers(factories, _run(plugin_dir / "run", start=7))
    loggers = open_loggers(factories, _run(plugin_dir / "run"))
    with pytest.raises(RunError, match=r"'nnx_test_exiting:Exiting' .* called sys.exit\(4\) in log\(\) at step 20; "):
        loggers.log(20, "train", {"nelbo": 0.05})
    loggers.close()


def test_a_logger_whose_log_raises_stops_the_run_with_a_run_error_naming_it(plugin_dir: Path):
    (plugin_dir / "nnx_test_raising2.py").write_text(_RAISING)
    loggers = open_loggers(resolve_loggers(["jsonl", "nnx_test_raising2:Raising"]), _run(plugin_dir / "run"))
    with pytest.raises(
        RunError, match=r"^logger 'nnx_test_raising2:Raising' .* raised KeyError in log\(\) at step 20: 'train'"
    ):
        loggers.log(20, "train", {"nelbo": 0.05})
    loggers.close()
    assert len(_records(plugin_dir / "run")) == 1  # the jsonl logger before it got the record


def test_closing_closes_every_logger_even_when_one_fails_and_names_it(plugin_dir: Path):
    """A plug-in's failing close() ended a finished run in a traceback."""
    (plugin_dir / "nnx_test_failing.py").write_text(
        "class Failing:\n    def __init__(self, run):\n        pass\n\n    def log(self, step, split, metrics):\n"
        "        pass\n\n    def close(self):\n        raise OSError('disk full')\n"
    )
    (plugin_dir / "nnx_test_recorder3.py").write_text(_RECORDER)
    loggers = open_loggers(
        resolve_loggers(["nnx_test_failing:Failing", "nnx_test_recorder3:Recorder"]), _run(plugin_dir / "run")
    )
    with pytest.raises(
        RunError,
        match=r"^logger 'nnx_test_failing:Failing' \(config key 'logging.loggers'\) raised OSError in close\(\): "
        r"disk full; the checkpoints written are kept$",
    ):
        loggers.close()
    assert (plugin_dir / "run" / "recorded.jsonl").read_text() == "closed\n"


def test_a_metrics_table_is_as_wide_as_its_title():
    """nnx-eval of a model dir printed 'eval of the pretrained' and 'model' on two lines: the title wrapped at
    the width of a table of one short metric."""
    import io

    from rich.console import Console

    from nnx_cli.report import metrics_table

    out = io.StringIO()
    Console(file=out, width=200).print(metrics_table("eval of the pretrained model", {"loss": 1.0}))
    assert out.getvalue().splitlines()[0].rstrip() == "eval of the pretrained model"


def test_long_set_up_work_off_a_terminal_says_how_far_it_has_got(monkeypatch, capfd):
    """Decoding 12,000 images into a log file said nothing for 24 s: only a terminal showed a bar."""
    from nnx_cli import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0.0)
    with report.progress(12_000, "decoding 12,000 images", at_least=2_000) as advance:
        advance(3_000)
        advance(9_000)
    lines = capfd.readouterr().err.splitlines()
    assert [line.rsplit(",", 1)[0] for line in lines] == [
        "decoding 12,000 images: 3,000 of 12,000 (25%)",
        "decoding 12,000 images: 12,000 of 12,000 (100%)",
    ]
    with report.progress(1_999, "decoding 1,999 images", at_least=2_000) as advance:
        advance(1_999)
    assert capfd.readouterr().err == ""


def test_a_long_export_off_a_terminal_says_how_many_bytes_it_has_written(monkeypatch, capfd):
    """A multi-GB export under nohup or CI said nothing until its last line: only a terminal showed a bar."""
    from nnx_cli import report

    monkeypatch.setattr(report, "PROGRESS_EVERY_S", 0.0)
    with report.progress(3 * 10**9, "writing the weights", at_least=10**8, in_bytes=True) as advance:
        advance(10**9)
        advance(2 * 10**9)
    lines = capfd.readouterr().err.splitlines()
    assert [line.rsplit(",", 1)[0] for line in lines] == [
        "writing the weights: 1.00 GB of 3.00 GB (33%)",
        "writing the weights: 3.00 GB of 3.00 GB (100%)",
    ]
    with report.progress(10**7, "writing the weights", at_least=10**8, in_bytes=True) as advance:
        advance(10**7)
    assert capfd.readouterr().err == ""
