"""What survives what: damaged checkpoints, a full disk, a changed config, the best step, as a user meets them.

One small digits run (checkpoints every 20 steps) is trained once; each test
damages a copy of its work dir and runs the commands on it.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_user_error, cli, final_state, start

from nnx_cli import integrity
from nnx_cli.errors import interrupt_outside_collections

STEPS = 80
CONFIG = f"""
seed: 5
model: {{name: vae, hidden_sizes: [64], latent_size: 4}}
data: {{source: "sklearn:digits", binarize: 0.5}}
optimizer: {{name: adam, learning_rate: 1.0e-3}}
train: {{batch_size: 64, steps: {STEPS}, log_every: 20, eval_every: 40}}
checkpoint: {{every_steps: 20, keep: 10}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    (root / "run.yaml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def reference(project: Path) -> Path:
    result = cli("nnx-train", "run.yaml", "--workdir", "ref", cwd=project)
    assert result.returncode == 0, result.stderr
    return project / "ref"


def copy(reference: Path, name: str) -> Path:
    target = reference.parent / name
    shutil.copytree(reference, target)
    return target


def flip(path: Path, offset: int | None = None) -> None:
    """Flip every bit of a few bytes in the middle of `path`, as a failing disk or a stray write would."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    for i in range(at, min(at + 4, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def data_file(step_dir: Path) -> Path:
    """The largest array data file Orbax wrote for the train state."""
    return max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)


def assert_same_params(a: Path, b: Path) -> None:
    x, y = final_state(a), final_state(b)
    assert x["step"] == y["step"]
    for u, v in zip(jax_leaves(x["params"]), jax_leaves(y["params"])):
        np.testing.assert_array_equal(u, v)


def jax_leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


def test_output_to_a_terminal_that_closed_is_dropped_and_the_command_goes_on():
    """Writes to the terminal of a dropped SSH session fail with EIO; a run (whose product is files) must not end
    on the first log line after it, as it did on a BrokenPipeError before a reader that left was handled."""
    code = """if True:
        import os
        from nnx_cli.errors import _Reader
        master, slave = os.openpty()
        tty = _Reader(open(slave, "w"), keep_going=True)
        tty.write("step 1\\n"); tty.flush()
        os.close(master)  # the terminal goes away
        for step in range(2, 50):
            tty.write(f"step {step}\\n" * 100); tty.flush()
        print("went on to step", step, flush=True)
    """
    import sys

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "went on to step 49\n", result
    assert "Traceback" not in result.stderr


def test_a_reader_that_leaves_early_costs_a_run_nothing(reference: Path, project: Path):
    """`nnx-train run.yaml 2>&1 | head -1`: the run goes on to its last step with its output discarded and ends
    0 with the parameters of a run read to the end. A command whose product is what it prints (nnx-inspect)
    ends when its reader does, 0, without a traceback."""
    train = start("nnx-train", "run.yaml", "--workdir", "piped", cwd=project)
    assert train.stderr.readline()
    train.stderr.close()
    train.stdout.close()
    assert train.wait(timeout=300) == 0
    assert_same_params(project / "piped", reference)

    inspect = start("nnx-inspect", str(reference), cwd=project)
    inspect.stdout.close()  # before the table is written: the command is still importing
    assert inspect.wait(timeout=120) == 0
    assert "Traceback" not in inspect.stderr.read()


def test_every_checkpoint_is_sealed_with_checksums(reference: Path):
    for step in range(20, STEPS + 1, 20):
        assert integrity.verify(reference / "checkpoints" / str(step)).ok


def test_eval_reports_a_flipped_byte_and_falls_back_to_the_step_before(reference: Path, project: Path):
    run = copy(reference, "flipped_eval")
    flip(data_file(run / "checkpoints" / "80"))
    result = cli("nnx-eval", "flipped_eval", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 60
    [line] = [line for line in result.stderr.splitlines() if "cannot be used" in line]
    assert "flipped_eval/checkpoints/80 cannot be used: state/" in line and "content differs from its checksum" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["20", "40", "60", "80"]


def test_eval_of_a_damaged_step_asked_for_by_number_is_exit_2_naming_the_file(reference: Path, project: Path):
    run = copy(reference, "flipped_step")
    damaged = data_file(run / "checkpoints" / "80")
    flip(damaged)
    result = cli("nnx-eval", "flipped_step", "--step", "80", cwd=project)
    assert_user_error(result, "checkpoints/80 cannot be used", str(damaged.relative_to(run / "checkpoints" / "80")))


def test_a_damaged_sharding_file_falls_back_too(reference: Path, project: Path):
    run = copy(reference, "sharding")
    flip(run / "checkpoints" / "80" / "state" / "_sharding", offset=0)
    result = cli("nnx-eval", "sharding", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 60 and "state/_sharding: content differs" in result.stderr


def test_train_resumes_from_the_newest_good_step_moves_the_bad_one_aside_and_ends_exactly(
    reference: Path, project: Path
):
    run = copy(reference, "flipped_train")
    flip(data_file(run / "checkpoints" / "80"))
    result = cli("nnx-train", "run.yaml", "--workdir", "flipped_train", cwd=project)
    assert result.returncode == 0, result.stderr
    assert "resumed from flipped_train/checkpoints/60" in result.stderr
    assert "moved the unusable checkpoint flipped_train/checkpoints/80 to" in result.stderr
    assert (run / "checkpoints" / "80.corrupt-1").is_dir()  # kept, never deleted
    assert integrity.verify(run / "checkpoints" / "80").ok
    assert_same_params(run, reference)


def test_a_step_without_checksums_is_used_with_a_warning_and_sealed_when_training_resumes(
    reference: Path, project: Path
):
    run = copy(reference, "unsealed")
    for seal in (run / "checkpoints" / "80").glob("nnx-checksums*"):
        seal.unlink()
    result = cli("nnx-eval", "unsealed", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 80 and "has no checksums to verify" in result.stderr
    assert integrity.verify(run / "checkpoints" / "80").status is integrity.Status.NO_CHECKSUMS  # eval reads only
    # nnx-train, which holds the work dir, seals the step it resumes from: damage from then on is found
    resumed = cli("nnx-train", "run.yaml", "--workdir", "unsealed", cwd=project)
    assert resumed.returncode == 0, resumed.stderr
    assert "sealed checkpoint unsealed/checkpoints/80 with the checksums" in resumed.stderr
    assert integrity.verify(run / "checkpoints" / "80").ok
    flip(data_file(run / "checkpoints" / "80"))
    assert integrity.verify(run / "checkpoints" / "80").status is integrity.Status.DAMAGED


def test_when_no_step_is_usable_train_stops_with_exit_2_listing_them(reference: Path, project: Path):
    run = copy(reference, "all_bad")
    for step in range(20, STEPS + 1, 20):
        flip(data_file(run / "checkpoints" / str(step)))
    result = cli("nnx-train", "run.yaml", "train.steps=100", "--workdir", "all_bad", cwd=project)
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: no usable checkpoint in all_bad/checkpoints (80: ")
    assert all(f"{step}: state/" in message for step in (20, 40, 60, 80))
    assert not (run / "checkpoints" / "100").exists()  # it did not silently start over
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["20", "40", "60", "80"]  # nothing moved
    again = cli("nnx-train", "run.yaml", "train.steps=100", "--workdir", "all_bad", cwd=project)
    assert again.returncode == 2 and "error: no usable checkpoint" in again.stderr  # nor does the second run
    # the read-only commands give the advice nnx-train takes (they said "resume training", which it refuses)
    evaluated = cli("nnx-eval", "all_bad", cwd=project)
    assert evaluated.returncode == 2 and "error: no usable checkpoint in all_bad/checkpoints" in evaluated.stderr
    assert "nnx-train --no-resume" in evaluated.stderr and "resume training" not in evaluated.stderr


def test_a_resume_with_a_changed_config_says_what_changed_and_keeps_the_earlier_one(reference: Path, project: Path):
    run = copy(reference, "changed")
    result = cli(
        "nnx-train", "run.yaml", "train.steps=100", "optimizer.learning_rate=5e-4", "train.steps_per_dispatch=5",
        "--workdir", "changed", cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "the config changed" in line]
    assert line.startswith("the config changed since step 80: optimizer.learning_rate: 0.001 -> 0.0005; ")
    assert "train.steps: 80 -> 100" in line and "steps_per_dispatch" not in line
    import yaml

    assert yaml.safe_load((run / "config.80.yaml").read_text())["optimizer"]["learning_rate"] == 0.001
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["learning_rate"] == 0.0005


def test_an_operational_change_is_not_a_config_change(reference: Path, project: Path):
    copy(reference, "operational")
    result = cli(
        "nnx-train", "run.yaml", "train.steps=100", "data.workers=0", "logging.loggers=[jsonl]",
        "--workdir", "operational", cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "the config changed since step 80: train.steps: 80 -> 100" in result.stderr
    assert "workers" not in result.stderr and "loggers" not in result.stderr


def train_keeping_one_and_the_best(project: Path, workdir: str, mode: str) -> dict:
    """A run with checkpoint.keep=1 and keep_best on nelbo in `mode`; its best.json."""
    result = cli(
        "nnx-train", "run.yaml", "checkpoint.keep=1", f"checkpoint.keep_best={{metric: nelbo, mode: {mode}}}",
        "--workdir", workdir, cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads((project / workdir / "checkpoints" / "best.json").read_text())


def test_keep_best_keeps_the_best_eval_step_beyond_keep_and_eval_best_uses_it(project: Path):
    record = train_keeping_one_and_the_best(project, "best", "max")
    evals = [json.loads(line) for line in (project / "best" / "metrics.jsonl").read_text().splitlines()]
    worst = max((r for r in evals if r["split"] == "eval"), key=lambda r: r["metrics"]["nelbo"])  # mode max
    assert record["step"] == worst["step"] == 40 and record["value"] == pytest.approx(worst["metrics"]["nelbo"])
    assert integrity.steps(project / "best" / "checkpoints") == [40, 80]  # keep=1, plus the best
    report = json.loads(cli("nnx-eval", "best", "--best", "--json", cwd=project).stdout)
    assert report["step"] == 40 and report["metrics"]["nelbo"] == pytest.approx(worst["metrics"]["nelbo"], rel=1e-6)


def test_a_best_json_that_cannot_be_read_stops_the_run_before_it_prunes_the_best_step(project: Path):
    train_keeping_one_and_the_best(project, "best_torn", "max")
    best = project / "best_torn" / "checkpoints" / "best.json"
    best.write_text('{"step": 40, "metric": "nel')  # torn: the best step would be pruned as any other
    result = cli(
        "nnx-train", "run.yaml", "checkpoint.keep=1", "checkpoint.keep_best={metric: nelbo, mode: max}",
        "train.steps=120", "--workdir", "best_torn", cwd=project,
    )  # fmt: skip
    assert_user_error(result, "best_torn/checkpoints/best.json cannot be read (JSONDecodeError", "restore it, or")
    assert integrity.steps(project / "best_torn" / "checkpoints") == [40, 80]
    assert_user_error(cli("nnx-eval", "best_torn", "--best", cwd=project), "best.json cannot be read")


def test_a_best_step_that_a_later_eval_replaces_is_pruned_by_the_end_of_the_run(project: Path):
    record = train_keeping_one_and_the_best(project, "best_last", "min")
    assert record["step"] == 80  # the last eval is the best: it is both the newest and the best step
    assert integrity.steps(project / "best_last" / "checkpoints") == [80]  # not 40, the best until that eval


def test_steps_saved_for_keep_best_alone_go_once_bettered_and_never_displace_the_newest_periodic_ones(project: Path):
    """Evals every 10 steps, checkpoints every 20, keep 2: each better eval between two periodic steps is saved for
    keep_best. Those steps counted among the newest two: step 70, best until step 80's eval, outlived the periodic
    step 60 (the run ended with 70 and 80)."""
    result = cli(
        "nnx-train", "run.yaml", "checkpoint.keep=2", "train.eval_every=10", "train.steps_per_dispatch=1",
        "checkpoint.keep_best={metric: nelbo, mode: min}", "--workdir", "best_between", cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads((project / "best_between" / "checkpoints" / "best.json").read_text())
    evals = [json.loads(line) for line in (project / "best_between" / "metrics.jsonl").read_text().splitlines()]
    nelbo = {r["step"]: r["metrics"]["nelbo"] for r in evals if r["split"] == "eval"}
    assert record["step"] == min(nelbo, key=nelbo.get)
    assert any(step % 20 for step in nelbo if nelbo[step] == min(nelbo[s] for s in nelbo if s <= step))  # saved
    assert integrity.steps(project / "best_between" / "checkpoints") == sorted({60, 80, record["step"]})


def test_keep_best_names_an_eval_metric(project: Path):
    result = cli(
        "nnx-train", "run.yaml", "checkpoint.keep_best={metric: nlebo, mode: min}", "--workdir", "x", cwd=project
    )
    assert_user_error(result, "'checkpoint.keep_best.metric'", "did you mean 'nelbo'")


def _small_disk(path: Path) -> bool:
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)]).returncode == 0
    except OSError:
        return False


def test_a_full_disk_is_exit_1_naming_the_directory_and_the_run_resumes_once_there_is_room(
    reference: Path, project: Path, tmp_path: Path
):
    """A real full disk (a 4 MB tmpfs where mounting is allowed), else a file-size limit making writes fail."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _small_disk(disk)
    try:
        first = cli("nnx-train", project / "run.yaml", "train.steps=40", "--workdir", disk / "run", cwd=project)
        assert first.returncode == 0, first.stderr
        if mounted:
            (disk / "filler").write_bytes(b"")
            with open(disk / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass
                f.truncate(f.tell() - (64 << 10))  # room for the config and logs, not for a checkpoint
        full = cli(
            "nnx-train", project / "run.yaml", "--workdir", disk / "run", cwd=project,
            extra_env={"NNX_COMPILATION_CACHE": "off"}, file_size_limit=None if mounted else 64 << 10,
        )  # fmt: skip
        assert full.returncode == 1, full.stderr
        assert "Traceback" not in full.stderr
        message = full.stderr.strip().splitlines()[-1]
        cause = "No space left on device" if mounted else "File too large"
        assert message.startswith(f"error: cannot write checkpoint {disk / 'run' / 'checkpoints' / '60'} ({cause})")
        assert integrity.verify(disk / "run" / "checkpoints" / "40").ok
        (disk / "filler").unlink(missing_ok=True)
        again = cli("nnx-train", project / "run.yaml", "--workdir", disk / "run", cwd=project)
        assert again.returncode == 0, again.stderr
        assert_same_params(disk / "run", reference)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_disk_where_python_names_no_file_is_one_line_and_exit_1(code, capsys):
    """A write() or flush() that fails (appending to metrics.jsonl, run.json, the lock's pid) raises an OSError
    without a file name: it was a traceback, and is the one line every failed write gives."""
    from nnx_cli.errors import WRITE_FIXES, report_errors

    def append() -> None:
        raise OSError(code, os.strerror(code))

    with pytest.raises(SystemExit) as stopped:
        report_errors(append)()
    assert stopped.value.code == 1
    message = f"error: cannot write to disk ({os.strerror(code)}); {WRITE_FIXES[code]}, then run again\n"
    assert capsys.readouterr().err == message
    with pytest.raises(OSError):  # other failures without a file are not guessed at
        report_errors(lambda: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied")))()


def test_running_out_of_host_memory_is_one_line_and_exit_1(capsys):
    """numpy's MemoryError (nnx-generate --num-samples 99999999999 asked for hundreds of GB) was a traceback."""
    from nnx_cli.errors import report_errors

    def allocate() -> None:
        raise MemoryError("Unable to allocate 745. GiB for an array with shape (99999999999, 2) and data type int32")

    with pytest.raises(SystemExit) as stopped:
        report_errors(allocate)()
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: out of host memory") and err.count("\n") == 1


def test_a_ctrl_c_inside_a_garbage_collector_callback_is_raised_after_it_not_lost():
    """JAX runs a callback at every collection; Python's own handler raised the KeyboardInterrupt inside it,
    where it is printed as ignored, and a command that was compiling went on to the end (exit 0)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_outside_collections()
    seen: list[str] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start" and not seen:
            seen.append("in the callback")
            signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode: inside this callback
            for _ in range(10_000):
                pass
            seen.append("callback done")

    gc.callbacks.append(callback)
    try:
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            seen.append("collected")
            time.sleep(5)
        assert seen == ["in the callback", "callback done", "collected"]
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, previous)


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


def test_a_ctrl_c_raised_again_while_the_collection_still_runs_waits_for_its_end():
    """Deferred from the collector's callback, the second SIGINT came 50 ms later, while the same (slow, on a
    loaded machine) collection ran a weakref callback, where Python printed it as ignored and it was lost."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_outside_collections()
    seen: list[str] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start" and not seen:
            seen.append("in the callback")
            signal.raise_signal(signal.SIGINT)

    def slow_weakref_callback(ref: weakref.ref) -> None:
        until = time.monotonic() + 0.3  # the deferred SIGINT comes in here, during the collection
        while time.monotonic() < until:
            pass
        seen.append("weakref callback done")

    garbage = _Cyclic()
    ref = weakref.ref(garbage, slow_weakref_callback)
    del garbage
    gc.callbacks.append(callback)
    try:
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            seen.append("collected")
            time.sleep(5)
        assert seen == ["in the callback", "weakref callback done", "collected"]
        assert ref() is None
    finally:
        gc.callbacks.remove(callback)
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_weakref_callback_is_raised_after_it_not_lost():
    """Outside a collection too (the last reference dropped), Python ignores what a weakref callback raises."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_outside_collections()
    seen: list[str] = []

    def weakref_callback(ref: weakref.ref) -> None:
        seen.append("in the callback")
        signal.raise_signal(signal.SIGINT)

    gc.disable()  # only the reference count frees it
    try:
        dropped = _Cyclic.__new__(_Cyclic)
        ref = weakref.ref(dropped, weakref_callback)
        with pytest.raises(KeyboardInterrupt):
            del dropped
            seen.append("dropped")
            time.sleep(5)
        assert seen == ["in the callback", "dropped"]
        assert ref() is None
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_the_imports_ends_the_process_after_them_with_one_line_and_130(tmp_path: Path):
    """Stopped part-way, jaxlib's extension raised an ImportError with a page of traceback, or crashed."""
    script = (
        "import os, signal\n"
        "from nnx_cli.errors import interrupts_after\n"
        "with interrupts_after():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    import jax.numpy\n"
        "    print('imported', flush=True)\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (130, "imported\n", "interrupted\n")


class _StderrMidWrite:
    """sys.stderr while the main thread is inside one of its writes: a second write from a signal handler raises,
    as Python's buffered writer does."""

    def write(self, text: str) -> int:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name=2>")

    flush = write


def test_a_signal_that_comes_inside_a_write_of_stderr_still_says_what_it_does(capfd, monkeypatch):
    """A Ctrl-C during a line of nnx-train's set-up ended in `RuntimeError: reentrant call` (a traceback, exit 1:
    with --no-resume, the earlier run not put back); in the loop it would have lost the stop it asked for."""
    from nnx_cli import distributed

    signals = distributed.Signals()
    signals.in_loop = True
    monkeypatch.setattr(sys, "stderr", _StderrMidWrite())
    signals._handle(signal.SIGINT, None)
    assert signals.signal == signal.SIGINT
    assert capfd.readouterr().err == (
        "SIGINT: stopping after the steps under way to write a checkpoint (SIGINT again stops at once, without one)\n"
    )
