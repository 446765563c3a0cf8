"""The three console scripts, run as a user runs them: real subprocesses, real files.

One small digits VAE is trained once (the reference run); the fault tests
interrupt copies of it and check that resuming ends with exactly its
parameters.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_support import assert_user_error, cli, cli_device_memory, final_state, start, wait_for_checkpoint

from nnx_cli.checkpoint import Checkpointer

STEPS = 240
# Big enough hidden layers that a step takes a few milliseconds: the fault tests must catch runs mid-way.
RUN_CONFIG = f"""
seed: 3
model: {{name: vae, hidden_sizes: [768, 768], latent_size: 8}}
data: {{source: "sklearn:digits", binarize: 0.5}}
optimizer: {{name: adam, learning_rate: 1.0e-3}}
train: {{batch_size: 64, steps: {STEPS}, log_every: 20, eval_every: 120}}
checkpoint: {{every_steps: 40, keep: 10}}
"""


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (the lock file aside: it only names the last holder)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == STEPS
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's directory holding the run config."""
    root = tmp_path_factory.mktemp("project")
    (root / "run.yaml").write_text(RUN_CONFIG)
    return root


@pytest.fixture(scope="module")
def reference(project: Path) -> Path:
    """The uninterrupted run: trained once, shared by the tests."""
    result = cli("nnx-train", "run.yaml", "--workdir", "ref", cwd=project)
    assert result.returncode == 0, result.stderr
    return project / "ref"


# --------------------------------------------------------------------------- a user's session


def test_train_writes_config_checkpoints_metrics_and_image_grids(reference: Path):
    assert (reference / "config.yaml").is_file()
    assert sorted(int(p.name) for p in (reference / "checkpoints").iterdir()) == list(range(40, STEPS + 1, 40))
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert {tuple(sorted(r)) for r in records} == {("metrics", "split", "step", "time")}
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(20, STEPS + 1, 20))
    assert [r["step"] for r in records if r["split"] == "eval"] == [120, 240]
    assert set(records[-1]["metrics"]) == {"nelbo", "recon", "kl"}
    assert sorted(p.name for p in (reference / "images").iterdir()) == ["120.png", "240.png"]


def test_training_reduces_the_loss(reference: Path):
    train = [
        json.loads(line)["metrics"]["nelbo"]
        for line in (reference / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert train[-1] < 0.7 * train[0]


def test_saved_config_is_fully_resolved(reference: Path):
    import yaml

    saved = yaml.safe_load((reference / "config.yaml").read_text())
    assert saved["model"]["input_shape"] == [8, 8, 1]
    assert saved["train"]["steps"] == STEPS and saved["checkpoint"]["async"] is True
    sections = {"seed", "workdir", "model", "data", "optimizer", "train", "sharding", "checkpoint", "logging"}
    assert set(saved) == sections | {"objective", "eval"}
    assert saved["objective"] == {"name": "sft"}


def test_eval_json_is_one_object_matching_the_final_eval(reference: Path, project: Path):
    result = cli("nnx-eval", reference, "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    last_eval = [
        json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ][-1]
    assert report["step"] == STEPS
    assert report["metrics"] == pytest.approx(last_eval["metrics"], rel=1e-6)


def test_eval_of_an_earlier_step_dir(reference: Path, project: Path):
    result = cli("nnx-eval", reference / "checkpoints" / "120", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    evals = {
        json.loads(line)["step"]: json.loads(line)["metrics"]
        for line in (reference / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    }
    assert json.loads(result.stdout) == {"step": 120, "metrics": pytest.approx(evals[120], rel=1e-6)}


def test_eval_prints_a_table(reference: Path, project: Path):
    result = cli("nnx-eval", reference, cwd=project)
    assert result.returncode == 0 and "nelbo" in result.stdout and "eval at step 240" in result.stdout
    total = int(re.search(r"\], (\d+) examples$", result.stderr, re.M).group(1))
    # a capped eval says how much of the split it read (it gave the whole split's size)
    capped = cli("nnx-eval", reference, "train.eval_max_batches=1", cwd=project)
    assert capped.returncode == 0, capped.stderr
    counted = int(re.search(rf"the first (\d+) of {total} examples \(train.eval_max_batches=1\)", capped.stderr)[1])
    assert 0 < counted < total


def test_inspect_work_dir_counts_every_parameter(reference: Path, project: Path):
    result = cli("nnx-inspect", reference, "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    saved = Checkpointer(reference / "checkpoints", read_only=True).restore_raw(STEPS)["params"]
    assert report["total_params"] == sum(np.size(x) for x in jax.tree.leaves(saved))
    assert sum(e["size"] for e in report["entries"]) == report["total_size"]


def test_inspect_config_is_abstract_and_its_sizes_add_up(project: Path):
    # 2 x 20000 x 20000 hidden weights: 3.2 GB of float32 if it were allocated
    result = cli("nnx-inspect", "run.yaml", "model.hidden_sizes=[20000, 20000]", "--json", cwd=project, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["total_params"] > 800_000_000
    for type_name, totals in report["by_type"].items():
        entries = [e for e in report["entries"] if e["type"] == type_name]
        assert totals["size"] == sum(e["size"] for e in entries)
        assert totals["bytes"] == sum(e["bytes"] for e in entries)
    assert report["total_bytes"] == sum(t["bytes"] for t in report["by_type"].values())


PLUGINS = """
import json
import math
import optax
import nnx
from nnx_cli.models import MLPClassifier


class Wide(MLPClassifier):
    def __init__(self, input_shape, num_classes=None, *, width: int = 8, ctx: nnx.Context):
        super().__init__(input_shape, num_classes, hidden_sizes=[width, width], ctx=ctx)


def make(learning_rate, momentum=0.0):
    return optax.sgd(learning_rate, momentum=momentum)


class Recorder:
    def __init__(self, run):
        self.path = run.workdir / "recorded.jsonl"

    def log(self, step, split, metrics):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "split": split, **metrics}) + "\\n")

    def close(self):
        pass
"""


def test_a_model_optimizer_and_logger_from_the_current_directory_need_no_pythonpath(project: Path, tmp_path: Path):
    (project / "plugins.py").write_text(PLUGINS)
    result = cli(
        "nnx-train", "run.yaml", "model={name: 'plugins:Wide', width: 5}", "train.steps=40",
        "optimizer={name: 'plugins:make', learning_rate: 0.05, momentum: 0.9}",
        "logging.loggers=[jsonl, plugins:Recorder]", "--workdir", "plugged", cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    recorded = [json.loads(line) for line in (project / "plugged" / "recorded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recorded if r["split"] == "train"] == [20, 40] and "accuracy" in recorded[-1]
    elsewhere = tmp_path / "elsewhere"  # the run's own plug-ins are found from run.json, not the current directory
    elsewhere.mkdir()
    evaluated = cli("nnx-eval", project / "plugged", "--json", cwd=elsewhere)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["step"] == 40
    inspected = cli("nnx-inspect", project / "plugged", "--json", cwd=elsewhere)
    shapes = {e["path"]: e["shape"] for e in json.loads(inspected.stdout)["entries"]}
    assert shapes["hidden/1/kernel"] == [5, 5] and shapes["head/kernel"] == [5, 10]


def test_inspect_maps_logical_axes_to_the_mesh(project: Path):
    result = cli("nnx-inspect", "run.yaml", "--json", "--filter", "Param", cwd=project)
    entries = {e["path"]: e for e in json.loads(result.stdout)["entries"]}
    assert entries["encoder/0/kernel"]["sharding"] == ["embed", "hidden"]
    assert entries["encoder/0/kernel"]["mesh_axes"] == [None, "model"]
    assert all(e["sharding"] for e in entries.values())


def test_cnn_classifier_with_a_schedule_checkpoints_its_batch_statistics(project: Path):
    (project / "cnn.yaml").write_text(
        "model: {name: cnn_classifier, features: [8]}\n"
        "optimizer: {name: adamw, learning_rate: "
        "{name: warmup_cosine_decay, init_value: 0.0, peak_value: 1.0e-3, warmup_steps: 10}}\n"
        "train: {batch_size: 750, epochs: 20, log_every: 10, eval_every: 40}\n"
    )
    result = cli("nnx-train", "cnn.yaml", "--workdir", "cnn", cwd=project)
    assert result.returncode == 0, result.stderr
    rest = final_state(project / "cnn")["rest"]
    assert np.abs(rest["norms"]["0"]["mean"]).sum() > 0  # running mean moved away from its zero init
    report = json.loads(cli("nnx-eval", "cnn", "--json", cwd=project).stdout)
    assert set(report["metrics"]) == {"loss", "accuracy"} and 0.0 <= report["metrics"]["accuracy"] <= 1.0


LOGGERS = "logging.loggers=[jsonl, tensorboard]"


def test_no_resume_starts_over_once_the_new_run_commits_and_a_run_failing_before_that_puts_all_back(
    project: Path,
):
    # TensorBoard's event files too: a fresh run deleted them, and they were not put back
    first = cli("nnx-train", "run.yaml", LOGGERS, "train.steps=40", "--workdir", "fresh", cwd=project)
    assert first.returncode == 0, first.stderr

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(project / "fresh")): p.read_bytes()
                for p in sorted((project / "fresh").rglob("*")) if p.is_file() and p.name != ".lock"}  # fmt: skip

    before = files()
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in before), sorted(before)
    # non-finite from its first step: stopped before its first checkpoint, once the work dir was set up
    failed = cli("nnx-train", "run.yaml", LOGGERS, "train.steps=40", "optimizer.learning_rate=1.0e+30",
                 "--workdir", "fresh", "--no-resume", cwd=project)  # fmt: skip
    assert failed.returncode == 1 and "non-finite" in failed.stderr, failed.stderr
    assert files() == before and not (project / "fresh" / ".replaced").exists()
    assert "--no-resume: this run wrote no checkpoint of its own, so the earlier run is back in fresh as it was" in (
        failed.stderr
    )  # the error's "run again" would resume it: said, not left to be found out
    # Ctrl-C during its set-up ends the process at once (nothing unwinds): the earlier run goes back all the same
    proc = start("nnx-train", "run.yaml", LOGGERS, "train.steps=40", "--workdir", "fresh", "--no-resume", cwd=project)
    deadline = time.monotonic() + 60
    while not (project / "fresh" / ".replaced").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted by SIGINT" in stderr, stderr
    assert files() == before and not (project / "fresh" / ".replaced").exists()
    # Ctrl-C while training, before its first checkpoint: the checkpoint the interrupt writes does not replace the
    # earlier run (it did, deleting it, though the user had stopped the run before it replaced anything)
    long = ["train.steps=100000", "checkpoint.every_steps=50000", "train.eval_every=50000"]
    proc = start("nnx-train", "run.yaml", LOGGERS, *long, "--workdir", "fresh", "--no-resume", cwd=project)
    said = ""
    while "training from step 0" not in said and proc.poll() is None:
        said += proc.stderr.readline()
    time.sleep(0.5)  # some steps trained
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, said + stderr
    assert "interrupted by SIGINT before the new run's first checkpoint: the earlier run is back in fresh" in stderr
    assert files() == before and not (project / "fresh" / ".replaced").exists()
    again = cli("nnx-train", "run.yaml", LOGGERS, "train.steps=40", "--workdir", "fresh", "--no-resume", cwd=project)
    assert again.returncode == 0, again.stderr
    assert "resumed" not in again.stderr
    # it says what it sets aside (the earlier steps went without a word)
    assert "--no-resume: the earlier run (its checkpoints at step 40) is set aside in fresh/.replaced" in again.stderr
    steps = [
        json.loads(line)["step"]
        for line in (project / "fresh" / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert steps == [20, 40] and not (project / "fresh" / ".replaced").exists()


# --------------------------------------------------------------------------- faults lose nothing


_SECOND_SIGNAL = """import os, signal, sys

from nnx_cli import hooks
from nnx_cli.commands import launch

save = hooks.Checkpoint.__call__


def call(self, loop):
    save(self, loop)
    if loop.stop_signal is not None:  # the first signal's checkpoint, committed: then the second signal comes
        self.checkpointer.wait()
        os.kill(os.getpid(), signal.SIGINT)


hooks.Checkpoint.__call__ = call
sys.argv[0] = "nnx-train"
launch.train()
"""


def test_a_second_ctrl_c_while_a_no_resume_runs_first_checkpoint_is_written_keeps_the_earlier_run(
    reference: Path, project: Path
):
    """One Ctrl-C before a --no-resume run's first checkpoint puts the earlier run back; a second one while the
    first one's checkpoint was written left that checkpoint in place and the earlier run set aside, and the next
    nnx-train deleted the earlier run."""
    import subprocess
    import sys

    from cli_support import env

    shutil.copytree(reference, project / "second-signal")
    before = files(project / "second-signal")
    (project / "second_signal.py").write_text(_SECOND_SIGNAL)
    long = ["train.steps=100000", "checkpoint.every_steps=50000", "train.eval_every=50000"]
    proc = subprocess.Popen(
        [sys.executable, "second_signal.py", "run.yaml", *long, "--workdir", "second-signal", "--no-resume"],
        cwd=project, env=env(project), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    said = ""
    while "training from step 0" not in said and proc.poll() is None:
        said += proc.stderr.readline()
    time.sleep(0.5)  # in the loop (the line comes just before it)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted by SIGINT again" in stderr, said + stderr
    # the put-back is decided, and left to the next nnx-train: the checkpoint may still have been being written
    assert (project / "second-signal" / ".replaced" / ".putting-back").is_file()
    again = cli("nnx-train", "run.yaml", "--workdir", "second-signal", cwd=project)
    assert again.returncode == 0 and "nothing to do: the work dir is already at step 240" in again.stderr, again.stderr
    assert files(project / "second-signal") == before and not (project / "second-signal" / ".replaced").exists()


def test_sigkill_then_resume_ends_with_the_uninterrupted_parameters(reference: Path, project: Path):
    proc = start("nnx-train", "run.yaml", "--workdir", "killed", cwd=project)
    wait_for_checkpoint(project / "killed", 80, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = Checkpointer(project / "killed" / "checkpoints", read_only=True).latest_step()
    assert 80 <= resumed_from < STEPS
    result = cli("nnx-train", "run.yaml", "--workdir", "killed", cwd=project)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {Path('killed', 'checkpoints', str(resumed_from))}" in result.stderr
    assert_same_state(final_state(project / "killed"), final_state(reference))


def test_ctrl_c_writes_a_checkpoint_exits_130_and_resumes_exactly(reference: Path, project: Path):
    proc = start("nnx-train", "run.yaml", "--workdir", "interrupted", cwd=project)
    wait_for_checkpoint(project / "interrupted", 80, [proc])
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    stopped_at = Checkpointer(project / "interrupted" / "checkpoints", read_only=True).latest_step()
    assert 80 <= stopped_at <= STEPS
    assert f"checkpoint written at {Path('interrupted', 'checkpoints', str(stopped_at))}" in stderr
    said = "SIGINT: stopping after the steps under way to write a checkpoint (SIGINT again stops at once, without one)"
    assert stderr.index(said) < stderr.index("checkpoint written at"), (
        stderr
    )  # said at once: nothing showed for seconds
    result = cli("nnx-train", "run.yaml", "--workdir", "interrupted", cwd=project)
    assert result.returncode == 0, result.stderr
    assert_same_state(final_state(project / "interrupted"), final_state(reference))


def test_a_second_signal_in_the_loop_exits_at_once_saying_no_checkpoint_was_written():
    """It said only "interrupted by SIGINT", after a first Ctrl-C that had said nothing."""
    import subprocess
    import sys

    code = """if True:
        import os, signal
        from nnx_cli.distributed import Signals
        with Signals() as signals:
            signals.in_loop = True
            os.kill(os.getpid(), signal.SIGINT)
            print("still running", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            print("not reached", flush=True)
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130 and result.stdout == "still running\n", result
    assert result.stderr.splitlines() == [
        "SIGINT: stopping after the steps under way to write a checkpoint (SIGINT again stops at once, without one)",
        "interrupted by SIGINT again: stopped without a checkpoint of the steps since the last one",
    ]


def test_a_closed_terminal_stops_the_run_with_a_checkpoint_unless_nohup_ignores_it():
    """SIGHUP (the SSH session dropped) killed the run at its default action, without a checkpoint of the steps
    since the last one; under `nohup`, which ignores it, the run must go on."""
    import subprocess
    import sys

    code = """if True:
        import os, signal, sys
        from nnx_cli.distributed import Signals
        if sys.argv[1] == "nohup":
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with Signals() as signals:
            signals.in_loop = True
            os.kill(os.getpid(), signal.SIGHUP)
            print("stop asked by", signals.signal and signal.Signals(signals.signal).name, flush=True)
        print("after:", signal.getsignal(signal.SIGHUP).name, flush=True)
    """
    hung = subprocess.run([sys.executable, "-c", code, "tty"], capture_output=True, text=True, timeout=60)
    assert hung.returncode == 0 and hung.stdout.splitlines() == ["stop asked by SIGHUP", "after: SIG_DFL"]
    assert hung.stderr.startswith("SIGHUP: stopping after the steps under way to write a checkpoint"), hung.stderr
    kept = subprocess.run([sys.executable, "-c", code, "nohup"], capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0 and kept.stdout.splitlines() == ["stop asked by None", "after: SIG_IGN"]
    assert kept.stderr == ""


def test_training_to_n_then_resuming_to_2n_matches_training_to_2n(reference: Path, project: Path):
    first = cli("nnx-train", "run.yaml", f"train.steps={STEPS // 2}", "--workdir", "twice", cwd=project)
    assert first.returncode == 0, first.stderr
    second = cli("nnx-train", "run.yaml", "--workdir", "twice", cwd=project)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr
    assert_same_state(final_state(project / "twice"), final_state(reference))
    steps = [
        json.loads(line)["step"]
        for line in (project / "twice" / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert steps == list(range(20, STEPS + 1, 20))


def test_non_finite_loss_exits_1_naming_the_step_and_keeps_the_last_good_checkpoint(project: Path):
    result = cli(
        "nnx-train",
        "run.yaml",
        "optimizer.name=sgd",
        "optimizer.learning_rate=1e30",
        "checkpoint.every_steps=1",
        "train.log_every=1",
        "--workdir",
        "diverged",
        cwd=project,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "non-finite at step" in result.stderr
    ckpt = Checkpointer(project / "diverged" / "checkpoints", read_only=True)
    last = ckpt.latest_step()  # finite, but the parameters that gave the loss (checkpoints every step)
    assert f"non-finite at step {last + 1} " in result.stderr
    assert f"the checkpoint {Path('diverged', 'checkpoints', str(last))} holds the parameters that gave that" in (
        result.stderr
    )
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(ckpt.restore_raw(last)["params"]))  # kept, as it was


def test_no_eval_runs_on_parameters_that_went_non_finite(project: Path):
    result = cli(
        "nnx-train",
        "run.yaml",
        "optimizer.name=sgd",
        "optimizer.learning_rate=1e30",
        "train.eval_every=1",
        "train.log_every=1000",
        "--workdir",
        "diverged-eval",
        cwd=project,
    )
    assert result.returncode == 1, result.stderr
    bad = int(re.search(r"non-finite at step (\d+)", result.stderr).group(1))

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    records = [
        json.loads(line, parse_constant=strict)
        for line in (project / "diverged-eval" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if r["split"] == "eval"] == list(range(1, bad))


def test_a_second_run_on_a_busy_work_dir_stops_at_once(project: Path):
    first = start("nnx-train", "run.yaml", "train.steps=100000", "--workdir", "busy", cwd=project, own_pid=True)
    try:
        wait_for_checkpoint(project / "busy", 40, [first])
        assert_user_error(
            cli("nnx-train", "run.yaml", "--workdir", "busy", cwd=project),
            "'busy' is in use by another nnx-train",
            f"pid {first.pid}",
        )
    finally:
        first.kill()
        first.communicate()


def test_ctrl_c_before_training_starts_exits_130_without_a_traceback(project: Path):
    proc = start("nnx-train", "run.yaml", "--workdir", "early", cwd=project)
    while not (project / "early" / "config.yaml").exists():  # written once the config checks out, before compiling
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted by SIGINT" in stderr and "Traceback" not in stderr


# --------------------------------------------------------------------------- bad input: one message, exit 2


def test_a_rejected_run_leaves_the_work_dir_as_it_was(reference: Path, project: Path):
    shutil.copytree(reference, project / "kept")
    before = files(project / "kept")
    for bad in (["optimizer.b1=abc", "--no-resume"], ["model.latent_size=4"], ["sharding.mesh.data=3"]):
        result = cli("nnx-train", "run.yaml", *bad, "--workdir", "kept", cwd=project)
        assert_user_error(result)
    assert files(project / "kept") == before


def test_a_logger_class_without_log_is_rejected_before_the_work_dir_is_touched(reference: Path, project: Path):
    (project / "nnx_test_nolog.py").write_text("class NoLog:\n    def __init__(self, run):\n        pass\n")
    shutil.copytree(reference, project / "kept-nolog")
    before = files(project / "kept-nolog")
    result = cli("nnx-train", "run.yaml", "train.steps=480", "logging.loggers=[jsonl, nnx_test_nolog:NoLog]",
                 "--workdir", "kept-nolog", cwd=project)  # fmt: skip
    assert_user_error(result, "'logging.loggers': 'nnx_test_nolog:NoLog' has no log or close method")
    assert files(project / "kept-nolog") == before


def test_a_run_says_what_its_data_does_not_read_and_that_it_evaluates_on_its_training_split(project: Path):
    result = cli("nnx-train", "run.yaml", "train.steps=2", "train.eval_every=2", "data.eval_split=train",
                 "data.train_on_prompt=true", "--workdir", "notices", cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if line.startswith("notice:")]
    assert notices == [
        "notice: data.train_on_prompt is not read: it applies to data.format chat and completion",
        "notice: data.eval_split is the training split 'train': the evals score examples the run trains on, not "
        "held-out ones",
    ]


def test_a_config_that_is_the_work_dirs_config_yaml_is_not_written_over(reference: Path, project: Path, tmp_path: Path):
    """`nnx-train config.yaml --workdir .` wrote the run's resolved config over the user's file, comments and all;
    a run's own config.yaml, given to resume it, still works. An empty --workdir is no `.`."""
    mine = RUN_CONFIG + "# my notes\n"
    (tmp_path / "config.yaml").write_text(mine)
    result = cli("nnx-train", "config.yaml", "--workdir", ".", cwd=tmp_path)
    assert_user_error(result, "CONFIG 'config.yaml' is the config.yaml of the work dir '.', which nnx-train writes")
    assert (tmp_path / "config.yaml").read_text() == mine and not (tmp_path / "checkpoints").exists()
    (tmp_path / "run.yaml").write_text(RUN_CONFIG)  # `--workdir "$DIR"` with DIR unset trained in "."
    empty = cli("nnx-train", "run.yaml", "--workdir", "", cwd=tmp_path)
    assert_user_error(empty, "--workdir is empty: give it a directory, or leave it out for the config's own")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "run.yaml"]
    again = cli("nnx-train", "ref/config.yaml", "--workdir", "ref", cwd=project)
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr


def test_a_run_with_nothing_left_to_do_changes_nothing_in_the_work_dir(reference: Path, project: Path):
    shutil.copytree(reference, project / "finished")
    before = files(project / "finished")
    result = cli("nnx-train", "run.yaml", "train.steps=120", "optimizer.learning_rate=5e-4", "--workdir", "finished",
                 cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"nothing to do: the work dir is already at step {STEPS}, and the run is 120 steps long" in result.stderr
    assert files(project / "finished") == before  # config.yaml still says the steps it was trained with


def test_harness_tasks_on_an_image_run_say_it_is_no_language_model_before_fetching_any(reference: Path, project: Path):
    result = cli("nnx-eval", "ref", "--tasks", "hellaswag", cwd=project)
    assert_user_error(result, "holds a 'vae' model trained on images, not a language model; nnx-eval --tasks")


def test_usage_errors_are_one_line_too(project: Path):
    assert_user_error(cli("nnx-inspect", "run.yaml", "--depth", "abc", cwd=project), "'--depth'", "nnx-inspect --help")
    assert_user_error(cli("nnx-train", cwd=project), "Missing argument 'CONFIG'")


def test_inspect_depth_with_json_says_the_json_lists_every_entry(project: Path):
    """--depth shapes the table only: with --json it was ignored without a word."""
    both = cli("nnx-inspect", "run.yaml", "--depth", "1", "--json", cwd=project)
    assert both.returncode == 0 and json.loads(both.stdout)["entries"], both.stderr
    assert "notice: --depth groups the table's rows; --json lists every entry" in both.stderr


def test_evaluating_a_damaged_step_by_number_is_a_user_error(reference: Path, project: Path):
    shutil.copytree(reference, project / "damaged")
    shutil.rmtree(project / "damaged" / "checkpoints" / str(STEPS) / "state")
    result = cli("nnx-eval", "damaged", "--step", str(STEPS), cwd=project)
    assert_user_error(result, f"checkpoints/{STEPS} cannot be used", "missing")


def test_missing_config_file(project: Path):
    assert_user_error(cli("nnx-train", "nope.yaml", cwd=project), "nope.yaml", "does not exist")


def test_malformed_config_file(project: Path):
    (project / "broken.yaml").write_text("train: [1, 2\n")
    assert_user_error(cli("nnx-train", "broken.yaml", cwd=project), "broken.yaml", "not valid YAML")


def test_unknown_key_in_config_suggests_closest(project: Path):
    (project / "typo.yaml").write_text("optimizer:\n  nmae: adam\n")
    assert_user_error(cli("nnx-train", "typo.yaml", cwd=project), "'optimizer.nmae'", "did you mean 'optimizer.name'")


def test_unknown_override_key_suggests_closest(project: Path):
    assert_user_error(
        cli("nnx-train", "run.yaml", "train.setps=3", cwd=project), "'train.setps'", "did you mean 'train.steps'"
    )


def test_wrong_type_names_the_key(project: Path):
    assert_user_error(
        cli("nnx-train", "run.yaml", "train.batch_size=big", cwd=project), "'train.batch_size'", "integer"
    )


def test_unknown_model_name(project: Path):
    assert_user_error(
        cli("nnx-train", "run.yaml", "model.name=vea", "--workdir", "bad-model", cwd=project),
        "'model.name'",
        "did you mean 'vae'",
    )


def test_unknown_model_option_suggests_closest(project: Path):
    assert_user_error(
        cli("nnx-train", "run.yaml", "model.latent_sise=3", "--workdir", "bad-option", cwd=project),
        "'model.latent_sise'",
        "did you mean 'model.latent_size'",
    )


def test_unknown_optimizer_name(project: Path):
    assert_user_error(
        cli("nnx-train", "run.yaml", "optimizer.name=adamm", "--workdir", "bad-opt", cwd=project),
        "'optimizer.name'",
        "adamm",
    )


def test_missing_local_dataset(project: Path):
    assert_user_error(
        cli("nnx-train", "run.yaml", "data.source=./no/such/data", "--workdir", "bad-data", cwd=project),
        "data.source",
        "./no/such/data",
        "does not exist",
    )


def test_a_run_stopped_at_set_up_removes_the_empty_work_dir_it_made_and_keeps_one_that_was_there(project: Path):
    made = cli("nnx-train", "run.yaml", "data.source=./no/such/data", "--workdir", "new/runs/bad", cwd=project)
    assert_user_error(made, "data.source")
    assert not (project / "new").exists()
    (project / "was-there").mkdir()
    result = cli("nnx-train", "run.yaml", "logging.loggers=[tensorbord]", "--workdir", "was-there", cwd=project)
    assert_user_error(result)
    assert (project / "was-there").is_dir()


def test_unreachable_uncached_hub_dataset_says_how_to_use_a_local_copy(project: Path):
    result = cli("nnx-train", "run.yaml", "data.source=nnx-tests/not-cached", "--workdir", "bad-hub", cwd=project)
    assert_user_error(result, "data.source", "nnx-tests/not-cached", "cannot be reached", "local copy",
                      "data.source=/path/to/not-cached", f"is no file or directory under {project}")  # fmt: skip


def test_a_hub_dataset_slow_to_load_says_why_while_it_waits(capsys):
    """Online, `datasets` asks the Hub even for a cached dataset, and without a network its retries take about
    25 s: past a few seconds a line says what is waiting; a quick load says nothing."""
    from nnx_cli.data import sources

    with sources._said_if_slow("notice: slow", seconds=0.05):
        time.sleep(0.5)
    with sources._said_if_slow("notice: quick", seconds=0.5):
        pass
    time.sleep(0.7)
    assert capsys.readouterr().err == "notice: slow\n"


def test_resuming_with_a_different_model_is_a_user_error(project: Path):
    first = cli("nnx-train", "run.yaml", "train.steps=20", "--workdir", "changed", cwd=project)
    assert first.returncode == 0, first.stderr
    result = cli("nnx-train", "run.yaml", "train.steps=40", "model.latent_size=4", "--workdir", "changed", cwd=project)
    assert_user_error(result, "does not match", "--no-resume")
    assert Checkpointer(project / "changed" / "checkpoints", read_only=True).all_steps() == [20]
    evaluated = cli("nnx-eval", "changed", "model.latent_size=4", cwd=project)  # nnx-train's advice before
    assert_user_error(evaluated, "does not match", "drop the overrides of its model or optimizer")
    assert "--no-resume" not in evaluated.stderr


def test_eval_on_a_dir_without_checkpoints(project: Path):
    (project / "empty-run").mkdir()
    assert_user_error(cli("nnx-eval", "empty-run", cwd=project), "empty-run", "no checkpoint")


def test_inspect_of_an_unknown_dataset_asks_for_the_input_shape(project: Path):
    assert_user_error(cli("nnx-inspect", "run.yaml", "data.source=someone/unknown", cwd=project), "model.input_shape")


def test_running_out_of_memory_is_exit_1_naming_the_knobs(project: Path):
    width = math.isqrt(cli_device_memory())  # a [width, width] float32 kernel: four times the device's memory
    result = cli(
        "nnx-train",
        "run.yaml",
        f"model={{name: mlp_classifier, hidden_sizes: [{width}, {width}]}}",
        "--workdir",
        "huge",
        cwd=project,
        memory_limit=True,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: out of device memory (could not allocate "), message
    assert "train.batch_size" in message and "model.remat=full" in message and "sharding.mesh" in message


def test_the_readmes_plugin_example_trains(tmp_path: Path):
    """examples/plugins.py, copied into a project directory, used exactly as the README shows."""
    shutil.copy(Path(__file__).resolve().parent.parent / "examples" / "plugins.py", tmp_path / "plugins.py")
    (tmp_path / "cfg.yaml").write_text("train: {steps: 60, batch_size: 64, log_every: 20, eval_every: 60}\n")
    result = cli(
        "nnx-train", "cfg.yaml", "model.name=plugins:Wide", "model.width=128", "data.source=plugins:stripes",
        "optimizer.name=plugins:sgd_nesterov", "optimizer.learning_rate=0.05",
        "logging.loggers=[jsonl, plugins:Printer]", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = [line.split() for line in result.stdout.splitlines()]
    assert [(int(step), split) for step, split, _ in printed] == [
        (20, "train"),
        (40, "train"),
        (60, "train"),
        (60, "eval"),
    ]
    assert float(printed[-1][2]) < 0.1  # the stripes are easy to tell apart
