"""The training loop and its hooks, called directly (no subprocess): dispatch plans, steps per dispatch,
the jitted steps, the hooks' intervals and the recipe `nnx_cli.commands.train.run` itself."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_support import cli, optimized_flags

from nnx_cli import hooks, loop, steps
from nnx_cli.checkpoint import Checkpointer
from nnx_cli.commands import train
from nnx_cli.config import load_config
from nnx_cli.errors import RunError, UserError
from nnx_cli.experiment import setup
from nnx_cli.models import VAE
from nnx_cli.runtime import PHASES

TINY = ["model.hidden_sizes=[32]", "model.latent_size=4", "data.binarize=0.5", "train.batch_size=32"]


def tiny(*overrides: str):
    return load_config(None, [*TINY, *overrides])


def final_params(workdir: Path) -> dict:
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    return ckpt.restore_raw(ckpt.latest_step())["params"]


def assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def model_metrics(workdir: Path) -> list[tuple[int, str, dict]]:
    """Step, split and the model's own metrics (not timings) of each metrics.jsonl record."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["split"], {k: r["metrics"][k] for k in ("nelbo", "kl", "recon")}) for r in records]


class Recorder:
    """A metric logger that keeps what it is given (a real logger plug-in, not a mock)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, dict]] = []

    def log(self, step: int, split: str, metrics: dict) -> None:
        self.records.append((step, split, dict(metrics)))

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- dispatch plans


def test_an_explicit_steps_per_dispatch_must_divide_every_interval():
    intervals = {"train.log_every": 100, "train.eval_every": 1000, "checkpoint.every_steps": 250}
    assert loop.steps_per_dispatch(50, intervals, params=10) == 50
    with pytest.raises(UserError, match=r"'train\.steps_per_dispatch' \(20\) must divide checkpoint\.every_steps"):
        loop.steps_per_dispatch(20, intervals, params=10)


def test_auto_steps_per_dispatch_divides_the_intervals_and_shrinks_for_big_models():
    intervals = {"train.log_every": 200, "train.eval_every": 4680, "checkpoint.every_steps": 2340}
    small = loop.steps_per_dispatch("auto", intervals, params=20_000)
    assert small == 20  # the greatest common divisor of the intervals
    assert loop.steps_per_dispatch("auto", intervals, params=5_000_000) == 4  # 20M / 5M = 4 divides 20
    assert loop.steps_per_dispatch("auto", intervals, params=1_000_000_000) == 1


# --------------------------------------------------------------------------- the steps


def test_k_steps_in_one_dispatch_equal_k_single_steps_bit_for_bit():
    exp = setup(tiny("train.steps=20"))
    layout_rows = exp.train.read(exp.train.epoch_keys(0)[:320])
    batches = {k: v.reshape(10, 32, *v.shape[1:]) for k, v in layout_rows.items()}
    dispatch = jax.jit(
        lambda s, m, xs: steps.train_dispatch(
            exp.moduledef, exp.tx, exp.loss_metric, 0, exp.train.prepare, None, s, m, xs
        )
    )
    one = (exp.init_state(), steps.empty_sums(exp.metric_names))
    for i in range(10):
        one = dispatch(*one, {k: v[i : i + 1] for k, v in batches.items()})[:2]
    ten = dispatch(exp.init_state(), steps.empty_sums(exp.metric_names), batches)[:2]
    assert_same(one, ten)


def test_eval_step_ignores_padded_rows():
    exp = setup(tiny("train.steps=1"))
    state = exp.init_state()
    batch = next(exp.eval.eval_batches(32))
    half = dict(batch, mask=np.arange(32) < 16)
    garbage = dict(half, image=np.where(half["mask"][:, None, None, None], batch["image"], 16 - batch["image"]))

    def sums(b):
        zeros = {k: np.float32(0.0) for k in exp.metric_names}
        return steps.eval_step(exp.moduledef, 0, exp.eval.prepare, state, b, jnp.int32(0), zeros)

    assert sums(garbage) == sums(half)
    assert sums(half)["nelbo"] < sums(batch)["nelbo"]


class FlatOnly(VAE):
    """A model whose metrics only work on flat inputs: it cannot run on the digits' [8, 8, 1] images."""

    def metrics(self, batch, ctx):
        return {"nelbo": batch["image"] @ jnp.ones((64,))}


def test_a_model_that_cannot_run_on_the_data_is_a_user_error_before_training():
    with pytest.raises(
        UserError, match=r"model 'test_cli_loop:FlatOnly' cannot run on batches of \{'image': \[32, 8, 8, 1\]"
    ):
        setup(tiny("model.name=test_cli_loop:FlatOnly", "train.steps=1"))


class NoLoss(VAE):
    """Metrics without the loss_metric (nelbo) it names."""

    def metrics(self, batch, ctx):
        return {"bound": -super().metrics(batch, ctx)["nelbo"]}


class OneArray(VAE):
    """metrics() returning the loss itself, not a dict."""

    def metrics(self, batch, ctx):
        return super().metrics(batch, ctx)["nelbo"]


class ShortMetric(VAE):
    """A metric over three rows of the batch."""

    def metrics(self, batch, ctx):
        found = super().metrics(batch, ctx)
        return {**found, "kl": found["kl"][:3]}


class MeanMetric(VAE):
    """A metric as the batch's mean: an eval's padding rows counted in it (the eval's numbers were wrong)."""

    def metrics(self, batch, ctx):
        found = super().metrics(batch, ctx)
        return {**found, "kl": found["kl"].mean()}


class BrokenImages(VAE):
    """images() that raises."""

    def images(self, batch, ctx):
        raise RuntimeError("no grid today")


class StackedImages(VAE):
    """images() with a leading axis too many."""

    def images(self, batch, ctx):
        return super().images(batch, ctx)[None]


@pytest.mark.parametrize(
    "model, message",
    [
        ("BrokenImages", r"its images\(\) cannot run on an eval batch: RuntimeError: no grid today"),
        (
            "StackedImages",
            r"its images\(\) must give one array of images, \[N, H, W, C\] or \[N, H, W\] in \[0, 1\]; "
            r"got shape \[1, ",
        ),
        ("NoLoss", r"its loss_metric 'nelbo' is none of the metrics it gives \(bound\); return it from metrics"),
        ("OneArray", r"its metrics must be a dict of name -> per-example array, got ShapeDtypeStruct"),
        ("ShortMetric", r"metric 'kl' has shape \[3\]; metrics are per example: \[32\] for a batch of 32 rows"),
        ("MeanMetric", r"metric 'kl' has shape \[\]; metrics are per example: \[32\] for a batch of 32 rows \(the "),
    ],
)
def test_metrics_or_images_a_run_cannot_use_are_a_user_error_before_training(model: str, message: str):
    """They were a KeyError at step 1, a TypeError in set-up, or a traceback at the first eval, which lost the steps
    since the last checkpoint."""
    with pytest.raises(UserError, match=rf"^model 'test_cli_loop:{model}': {message}"):
        setup(tiny(f"model.name=test_cli_loop:{model}", "train.steps=1"))


# --------------------------------------------------------------------------- hooks


def test_log_hook_reports_means_learning_rate_gradient_norm_and_speed():
    schedule = "{name: linear, init_value: 1.0, end_value: 0.0, transition_steps: 4}"
    exp = setup(tiny("train.steps=4", f"optimizer.learning_rate={schedule}"))
    recorder = Recorder()
    state = exp.init_state()
    run = loop.Loop(exp, state, steps.empty_sums(exp.metric_names), step=0, total=4)
    log = hooks.LogMetrics(2, recorder, hooks.Guard(None, Path("unused")), batch_size=32)
    began, compiled = time.perf_counter(), PHASES.seconds.get("compile", 0.0)
    batch = exp.train.read(exp.train.epoch_keys(0)[:64])
    for i in range(2):
        rows = exp.train.prepare({k: v[i * 32 : (i + 1) * 32] for k, v in batch.items()})
        run.state, run.sums, _ = steps.train_step(exp.moduledef, exp.tx, "nelbo", 0, run.state, run.sums, rows)
        run.step += 1
    jax.block_until_ready(run.sums)
    own = time.perf_counter() - began - (PHASES.seconds.get("compile", 0.0) - compiled)  # the steps less compiling
    aside = {"compile": 0.5 * own, "eval": 0.3 * own, "checkpoint": 0.1 * own}  # as in a run's first interval
    for phase, seconds in aside.items():
        PHASES.add(phase, seconds)
    try:
        log(run)
    finally:
        for phase, seconds in aside.items():
            PHASES.add(phase, -seconds)
    [(step, split, metrics)] = recorder.records
    assert (step, split) == (2, "train")
    assert set(metrics) >= {"nelbo", "recon", "kl", "learning_rate", "grad_norm", "steps_per_s", "examples_per_s"}
    assert metrics["learning_rate"] == pytest.approx(0.75)  # the rate of update 1 (0-based) of 4, from 1 to 0
    assert metrics["steps_per_s"] > 4 / own  # about 2 / (0.1 * own): what is left once everything aside is out
    assert metrics["grad_norm"] > 0 and metrics["examples_per_s"] == pytest.approx(32 * metrics["steps_per_s"])
    assert int(run.sums["count"]) == 0  # sums restart after each log


def test_the_log_hook_restarts_the_sums_when_a_logger_fails_with_the_record():
    """A logger plug-in raising in log() stopped the run with the logged steps' sums still held: the step's rescue
    checkpoint kept them, and the resumed run, which keeps the record at that step, counted those steps twice."""

    class Failing(Recorder):
        def log(self, step: int, split: str, metrics: dict) -> None:
            super().log(step, split, metrics)
            raise RuntimeError("the server went away")

    exp = setup(tiny("train.steps=2"))
    run = loop.Loop(exp, exp.init_state(), steps.empty_sums(exp.metric_names), step=0, total=2)
    rows = exp.train.prepare(exp.train.read(exp.train.epoch_keys(0)[:32]))
    run.state, run.sums, _ = steps.train_step(exp.moduledef, exp.tx, "nelbo", 0, run.state, run.sums, rows)
    run.step = 1
    failing = Failing()
    with pytest.raises(RuntimeError, match="the server went away"):
        hooks.LogMetrics(1, failing, hooks.Guard(None, Path("unused")), batch_size=32)(run)
    assert [step for step, _, _ in failing.records] == [1] and int(run.sums["count"]) == 0


def test_guard_names_the_step_and_the_last_good_checkpoint(tmp_path: Path):
    """The loss of step 3 is computed from the parameters of step 2: a checkpoint of step 2 is finite but gave it,
    and resuming from it failed again (it was named the last good one)."""
    exp = setup(tiny("train.steps=3"))
    ckpt = Checkpointer(tmp_path / "checkpoints", async_=False)
    state = exp.init_state()
    ckpt.save(1, state)
    guard = hooks.Guard(ckpt, Path("run", "checkpoints"))

    def stopped(bad_step: int, step: int) -> str:
        sums = dict(steps.empty_sums(exp.metric_names), bad_step=jnp.int32(bad_step))
        with pytest.raises(RunError) as raised:
            guard.check(loop.Loop(exp, state, sums, step=step, total=3))
        guard._checked = None
        return str(raised.value)

    assert stopped(2, 3) == (
        "the loss became non-finite at step 3 (training stopped at step 3); the last good checkpoint is "
        "run/checkpoints/1"
    )  # step 2's parameters were not saved: step 1's are good
    assert stopped(0, 1).endswith("; the last good checkpoint is run/checkpoints/1")  # the data, or lr, of step 1
    ckpt.save(2, state)
    ckpt.wait()
    assert stopped(2, 3) == (
        "the loss became non-finite at step 3 (training stopped at step 3); the checkpoint run/checkpoints/2 holds "
        "the parameters that gave that loss, and the last good checkpoint is run/checkpoints/1 (move "
        "run/checkpoints/2 out of run/checkpoints to resume from it, with a lower optimizer.learning_rate or an "
        "optimizer.clip_grad_norm)"
    )
    nan_params = jax.tree.map(lambda x: x * jnp.nan, state["params"])
    with pytest.raises(RunError, match="the parameters are non-finite at step 2"):
        guard.check(loop.Loop(exp, dict(state, params=nan_params), steps.empty_sums(exp.metric_names), step=2, total=2))
    ckpt.close()


def test_hooks_run_at_their_intervals_and_evals_once_at_the_end(tmp_path: Path):
    recorder = Recorder()
    exp = setup(tiny("train.steps=12"))

    class Every:
        def __init__(self, every: int):
            self.every, self.calls, self.ended = every, [], False

        def __call__(self, run: loop.Loop) -> None:
            self.calls.append(run.step)

        def end(self, run: loop.Loop) -> None:
            self.ended = True

    every3 = Every(3)  # reached only where a dispatch of 2 steps ends on a multiple of 3
    every4 = Every(4)
    evaluate = hooks.Evaluate(6, lambda state: {"x": 1.0}, recorder, hooks.Guard(None, tmp_path))
    run = loop.Loop(exp, exp.init_state(), steps.empty_sums(exp.metric_names), step=0, total=12)
    feed = ((2, None) for _ in range(6))
    loop.run(run, feed, lambda state, sums, xs: (state, sums, jnp.ones((), bool)), [every3, every4, evaluate])
    assert every4.calls == [4, 8] and every3.calls == [6] and every4.ended
    assert [r[0] for r in recorder.records] == [6, 12]  # the eval at 12 is the final one, run once


def test_keep_best_without_an_eval_split_says_how_to_go_on():
    with pytest.raises(UserError, match=r"needs evals, but data.eval_split is null; .* set checkpoint.keep_best=null$"):
        setup(tiny("data.eval_split=null", "checkpoint.keep_best={metric: nelbo, mode: min}"))


@pytest.mark.parametrize("window", [[2, 2], [0, 2], [5, 1]])
def test_a_profile_window_inside_a_dispatch_traces_the_dispatches_that_hold_it(window, tmp_path: Path, capfd):
    """With 4 steps a dispatch, `train.profile: [2, 2]` traced nothing: the hook, called between dispatches, never
    saw a step inside the window (and one starting at 0 could begin only after the first dispatch)."""
    exp = setup(tiny("train.steps=8"))
    profile = hooks.Profile(4, *window, tmp_path / "profile")
    seen = []

    def dispatch(state, sums, xs):
        seen.append(profile.active)
        return state, sums, jnp.ones((), bool)

    run = loop.Loop(exp, exp.init_state(), steps.empty_sums(exp.metric_names), step=0, total=8)
    loop.run(run, ((4, None) for _ in range(2)), dispatch, [profile])
    assert seen == [window[0] < 4, window[0] >= 4] and not profile.active
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    said = f"profiling from step {4 * (window[0] >= 4)} to the end of the dispatch that reaches step {sum(window)}"
    assert said in capfd.readouterr().err
    with pytest.raises(UserError, match=r"'train.profile' \(\[8, 2\]\) starts after the run's last step \(8\)"):
        train._check_profile([8, 2], 8)


def test_a_best_step_saved_for_that_alone_never_takes_the_place_of_a_periodic_checkpoint(tmp_path: Path):
    """Evals every 2 steps, checkpoints every 4, keep 2, the best at step 14 and not beaten at 16: the run ended
    with 14 and 16, step 12 pruned, as if 14 were one of the newest two periodic checkpoints."""
    exp = setup(tiny("train.steps=16"))
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2, async_=False)
    guard = hooks.Guard(ckpt, tmp_path / "checkpoints")
    values = iter([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 3.5])  # steps 2, 4, ..., 16: the best at 14
    evaluate = hooks.Evaluate(2, lambda state: {"nelbo": next(values)}, Recorder(), guard)
    save = hooks.Checkpoint(4, ckpt, guard)
    best = hooks.KeepBest(evaluate, save, "nelbo", "min", start=0)
    run = loop.Loop(exp, exp.init_state(), steps.empty_sums(exp.metric_names), step=0, total=16)
    loop.run(run, ((2, None) for _ in range(8)), lambda state, sums, xs: (state, sums, jnp.ones((), bool)),
             [evaluate, best, save])  # fmt: skip
    ckpt.close()
    assert ckpt.all_steps() == [12, 14, 16]
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text())["step"] == 14


def test_keep_best_never_takes_a_non_finite_eval_value(tmp_path: Path):
    """A NaN eval loss became the best (every later value compares false to it) and best.json held NaN."""
    exp = setup(tiny("train.steps=12"))
    ckpt = Checkpointer(tmp_path / "checkpoints", async_=False)
    guard = hooks.Guard(ckpt, tmp_path / "checkpoints")
    values = iter([float("nan"), 5.0, 6.0])
    evaluate = hooks.Evaluate(4, lambda state: {"nelbo": next(values)}, Recorder(), guard)
    save = hooks.Checkpoint(100, ckpt, guard)
    best = hooks.KeepBest(evaluate, save, "nelbo", "min", start=0)
    run = loop.Loop(exp, exp.init_state(), steps.empty_sums(exp.metric_names), step=0, total=12)
    feed = ((4, None) for _ in range(3))
    loop.run(run, feed, lambda state, sums, xs: (state, sums, jnp.ones((), bool)), [evaluate, best, save])
    ckpt.wait()
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text()) == {
        "step": 8, "metric": "nelbo", "mode": "min", "value": 5.0, "only_for_best": True  # not a step of every 100
    }  # fmt: skip
    ckpt.close()


@pytest.mark.parametrize("threshold, collected", [(0, True), (1 << 40, False)])
def test_a_large_state_collects_the_garbage_its_first_dispatch_left(monkeypatch, threshold, collected):
    """Tracing a large step leaves reference cycles that held 1.9 GB of a 0.5B model's run until Python's
    full collection happened to run: the loop collects once after the first dispatch of a state that large."""
    import gc

    exp = setup(tiny("train.steps=4"))
    run = loop.Loop(exp, exp.init_state(), steps.empty_sums(exp.metric_names), step=0, total=4)
    monkeypatch.setattr(loop, "_COLLECT_ABOVE", threshold)
    full = []

    def dispatch(state, sums, xs):
        return state, sums, jnp.ones((), bool)

    def watch(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(run.step)

    gc.disable()  # no collection but the loop's
    gc.callbacks.append(watch)
    try:
        loop.run(run, ((1, None) for _ in range(4)), dispatch, [])
    finally:
        gc.callbacks.remove(watch)
        gc.enable()
    assert full == ([1] if collected else [])


# --------------------------------------------------------------------------- the recipe, in process


def test_a_run_with_ten_steps_per_dispatch_ends_exactly_where_single_steps_do(tmp_path: Path):
    # as users run it: XLA's default code generation (the test session's fast-compile flags, conftest.py, fuse
    # the ten-step loop's body differently from the single step's, and its last bits differ)
    common = ["train.steps=40", "train.log_every=10", "train.eval_every=20", "checkpoint.every_steps=20"]
    (tmp_path / "vae.yaml").write_text("model: {name: vae}\n")
    for name, k in (("one", 1), ("ten", 10)):
        result = cli("nnx-train", "vae.yaml", *TINY, *common, f"train.steps_per_dispatch={k}", "--workdir", name,
                     cwd=tmp_path, extra_env={"XLA_FLAGS": optimized_flags()})  # fmt: skip
        assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()  # the first dispatch is said before its log line, which waits for it
    assert lines[1].startswith("steps 1-10 compiled and running") and lines[2].startswith("step 10/40 "), lines
    assert_same(final_params(tmp_path / "one"), final_params(tmp_path / "ten"))
    assert model_metrics(tmp_path / "ten") == model_metrics(tmp_path / "one")


def test_a_resumed_run_logs_the_same_model_metrics_as_an_uninterrupted_one(tmp_path: Path):
    common = ["train.log_every=10", "train.eval_every=30", "checkpoint.every_steps=5", "train.steps_per_dispatch=5"]
    assert train.run(tiny(*common, "train.steps=30"), tmp_path / "whole") == 0
    assert train.run(tiny(*common, "train.steps=15"), tmp_path / "parts") == 0  # stops between two logs
    assert train.run(tiny(*common, "train.steps=30"), tmp_path / "parts") == 0
    assert model_metrics(tmp_path / "parts") == model_metrics(tmp_path / "whole")
    # a run made longer once it ended on a log: its record at 20 is kept, so the one at 30 counts 21-30 only
    assert train.run(tiny(*common, "train.steps=20"), tmp_path / "longer") == 0
    assert train.run(tiny(*common, "train.steps=30"), tmp_path / "longer") == 0
    assert model_metrics(tmp_path / "longer") == model_metrics(tmp_path / "whole")


def test_a_finished_run_has_nothing_to_do(tmp_path: Path):
    assert train.run(tiny("train.steps=5"), tmp_path) == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    assert train.run(tiny("train.steps=5"), tmp_path) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_run_json_records_what_ran(tmp_path: Path):
    assert train.run(tiny("train.steps=2"), tmp_path) == 0
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["packages"]["jax"] == jax.__version__ and info["process_count"] == 1
    assert info["platform"] == jax.devices()[0].platform and len(info["devices"]) == jax.device_count()
    assert set(info) >= {"command", "git", "import_paths", "mesh", "python"}


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path):
    classifier = ["model={name: mlp_classifier, hidden_sizes: [32], dropout: 0.0}", "train.steps=10"]
    assert train.run(load_config(None, [*classifier, "train.batch_size=64"]), tmp_path / "big") == 0
    accum = [*classifier, "train.batch_size=64", "train.grad_accum_steps=4"]
    assert train.run(load_config(None, accum), tmp_path / "micro") == 0
    big, micro = final_params(tmp_path / "big"), final_params(tmp_path / "micro")
    for x, y in zip(jax.tree.leaves(big), jax.tree.leaves(micro)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(big), jax.tree.leaves(micro)))  # really split


def test_the_first_dispatch_of_one_step_is_named_as_one_step():
    """A run that dispatches one step at a time said "steps 70-70 compiled and running"."""
    import types

    said = []
    for start, step in [(69, 70), (0, 10)]:
        hooks.FirstStep(1, said.append)(types.SimpleNamespace(start=start, step=step))
    assert said[0].startswith("step 70 compiled and running, ") and said[1].startswith("steps 1-10 compiled")
