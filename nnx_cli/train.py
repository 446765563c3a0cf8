"""`nnx-train CONFIG [KEY=VALUE ...]`: train a model from a YAML config.

The run, top to bottom in `run`: config -> data -> model + optimizer -> mesh
and placed state (fresh or restored) -> jitted steps -> loop with logs,
evals and checkpoints -> final checkpoint. Writes config.yaml,
checkpoints/<step>/, metrics.jsonl and images/<step>.png into the work dir.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import typer

from nnx_cli.config import Config, dump_yaml, load_config, to_dict
from nnx_cli.errors import EXIT_INTERRUPTED, RunError, UserError, first_line, report_errors, run_app

_MAX_IN_FLIGHT = 2  # steps dispatched ahead of the one being computed
_STOP_VOTE_EVERY = 10  # multi-process runs agree on Ctrl-C / SIGTERM this often (in steps)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def train(
    config: Path = typer.Argument(..., metavar="CONFIG", help="YAML config file.", show_default=False),
    overrides: list[str] | None = typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        help="Config overrides, e.g. train.steps=200 optimizer.learning_rate=3e-4.",
        show_default=False,
    ),
    workdir: Path | None = typer.Option(
        None, help="Where checkpoints and logs go (default: the config's workdir, else runs/<config stem>)."
    ),
    resume: bool = typer.Option(
        True,
        "--resume/--no-resume",
        help="Continue from the latest checkpoint in the work dir; "
        "--no-resume deletes the old checkpoints, metrics and images first.",
    ),
    coordinator: str | None = typer.Option(
        None,
        envvar="JAX_COORDINATOR_ADDRESS",
        help="Multi-process: HOST:PORT where process 0 runs the jax.distributed coordinator.",
    ),
    num_processes: int | None = typer.Option(
        None, envvar="JAX_NUM_PROCESSES", help="Multi-process: number of processes."
    ),
    process_id: int | None = typer.Option(
        None, envvar="JAX_PROCESS_ID", help="Multi-process: this process's index, 0 to N-1."
    ),
) -> None:
    """Train the model a config describes, writing checkpoints and metrics to the work dir."""
    with _Signals() as signals:
        cfg = load_config(config, overrides or [])
        workdir = workdir or Path(cfg.workdir or Path("runs") / config.stem)
        raise SystemExit(
            run(cfg, workdir, resume=resume, distributed=(coordinator, num_processes, process_id), signals=signals)
        )


def main() -> None:
    run_app(app)


class _Signals:
    """What SIGINT and SIGTERM do during a run.

    Until the training loop starts nothing would be lost, so a signal ends the
    process at once (exit 130). In the loop the first signal asks to stop
    after the current step, which writes a checkpoint; a second one ends the
    process at once (the last committed checkpoint stays intact: Orbax commits
    by renaming a finished directory).

    In a multi-process run every process must stop after the same step (a
    process that ran one step more would wait forever in its collectives), so
    the processes compare flags every `_STOP_VOTE_EVERY` steps.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.in_loop = False

    def __enter__(self) -> _Signals:
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.in_loop or self.signal is not None:
            _exit_now(signum)
        self.signal = signum

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def agreed(self, step: int) -> bool:
        """Whether to stop after `step`; the same answer on every process."""
        import jax

        if jax.process_count() == 1:
            return self.signal is not None
        if step % _STOP_VOTE_EVERY:
            return False
        from jax.experimental import multihost_utils

        votes = multihost_utils.process_allgather(np.int32(self.signal or 0))
        self.signal = self.signal or int(votes.max()) or None
        return self.signal is not None


def _exit_now(signum: int) -> None:
    """Leave without unwinding: raising into JAX's compiler or Orbax's threads can crash the interpreter."""
    sys.stdout.flush()
    print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)


def run(
    cfg: Config,
    workdir: Path,
    *,
    resume: bool = True,
    distributed: tuple = (None, None, None),
    signals: _Signals | None = None,
) -> int:
    """Train; return the exit status (0, or 130 when interrupted). Raises UserError / RunError.

    Everything the config can get wrong is found before the work dir is
    touched: a rejected run never deletes, overwrites or adds anything there.
    """
    import jax

    import nnx
    from nnx_cli import checkpoint, data, models, optim, report, sharding, steps
    from nnx_cli.workdir import check_workdir, lock_workdir

    signals = signals or _Signals()
    _init_distributed(*distributed)
    is_main = jax.process_index() == 0
    console = report.stderr_console(quiet=not is_main)

    # 0. Names in the config and the work dir are checked before any data is read (or downloaded).
    model_cls = models.model_class(cfg.model.name)
    cfg.model.options = models.resolve_options(cfg.model)  # checked, defaults filled in: the saved config is complete
    optim.build_optimizer(cfg.optimizer, total_steps=cfg.train.steps)
    check_workdir(workdir)

    # 1. Data, decoded once into arrays.
    train_split = data.load_split(cfg.data, cfg.data.train_split, "data.train_split")
    eval_split = data.load_split(cfg.data, cfg.data.eval_split, "data.eval_split") if cfg.data.eval_split else None
    models.check_data(cfg.model, model_cls, train_split.spec, train_split.labels is not None, cfg.data.label_key)
    batches = data.Batches(train_split, cfg.train.batch_size, cfg.seed)
    total_steps = cfg.train.steps or cfg.train.epochs * batches.steps_per_epoch

    # 2. Model and optimizer, built abstractly and traced through one train step (nothing allocated).
    build = models.model_factory(cfg.model, train_split.spec)
    cfg.model.input_shape = cfg.model.input_shape or list(train_split.spec.input_shape)
    if cfg.model.num_classes is None:
        cfg.model.num_classes = train_split.spec.num_classes
    tx = optim.build_optimizer(cfg.optimizer, total_steps)
    moduledef, abstract = jax.eval_shape(lambda: steps.init_state(build, tx, cfg.seed))
    names = steps.check_step(moduledef, tx, cfg.model.name, abstract, jax.eval_shape(lambda: batches.get(0)))

    # 3. One mesh; the state's shardings come from the parameters' logical axes.
    mesh = sharding.make_mesh(cfg.sharding)
    rules = sharding.axis_rules(cfg.sharding)
    state_shardings = sharding.state_shardings(abstract, mesh, rules)
    scalar = sharding.replicated(mesh)
    train_layout = sharding.batch_layout(mesh, rules, cfg.train.batch_size)
    eval_layout = sharding.eval_batch_layout(mesh, rules, cfg.train)
    target = sharding.with_shardings(abstract, state_shardings)

    # 4. The work dir: one run at a time; a checkpoint to resume must fit the config; only then is anything written.
    ckpt_dir = workdir / "checkpoints"
    lock = lock_workdir(workdir) if is_main else None  # held until this function returns
    start = None
    if resume:  # the latest checkpoint, restored straight into its shardings (a mismatch is a UserError)
        ckpt = checkpoint.Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_=cfg.checkpoint.async_)
        start = ckpt.latest_step()
        if start is not None:
            state = ckpt.restore(start, target)
            console.print(f"resumed from {ckpt_dir / str(start)}", highlight=False)
    elif is_main:
        for old in (ckpt_dir, workdir / "images"):
            shutil.rmtree(old, ignore_errors=True)
        (workdir / "metrics.jsonl").unlink(missing_ok=True)
    _barrier("nnx-train: work dir ready")
    if not resume:
        ckpt = checkpoint.Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_=cfg.checkpoint.async_)
    if is_main:
        dump_yaml(to_dict(cfg), workdir / "config.yaml")

    # 5. Or a fresh state, created on the devices in its shardings.
    if start is None:
        start = 0
        state = jax.jit(lambda: steps.init_state(build, tx, cfg.seed)[1], out_shardings=state_shardings)()
    if start >= total_steps:
        console.print(f"nothing to do: the work dir is already at step {start} of {total_steps}", highlight=False)
        ckpt.close()
        return 0

    # 6. The jitted steps over pure state; the state keeps its shardings from step to step.
    loss_metric = model_cls.loss_metric
    train_step = jax.jit(
        functools.partial(steps.train_step, moduledef, tx, loss_metric, cfg.seed),
        in_shardings=(state_shardings, scalar, train_layout.sharding),
        out_shardings=(state_shardings, scalar, scalar),
        donate_argnums=(0, 1),
    )
    eval_step = jax.jit(
        functools.partial(steps.eval_step, moduledef, cfg.seed),
        in_shardings=(state_shardings, eval_layout.sharding, scalar),
        out_shardings=scalar,
    )
    has_images = hasattr(model_cls, "images") and len(train_split.spec.input_shape) == 3
    images_step = (
        jax.jit(functools.partial(steps.images_step, moduledef, cfg.seed), out_shardings=scalar) if has_images else None
    )

    log = report.MetricsLog(workdir / "metrics.jsonl", resume_step=start) if is_main else None
    progress = report.Progress(console, start, total_steps, loss_metric)

    def run_eval(step: int) -> None:
        """Every process computes (the arrays span all of them); process 0 writes."""
        if eval_split is None:
            return
        placed = (eval_layout.place(b) for b in data.eval_batches(eval_split, eval_layout.size, eval_layout.rows))
        metrics = steps.evaluate(eval_step, state, placed, len(eval_split))
        images = None
        if images_step is not None:
            first = eval_layout.place(next(data.eval_batches(eval_split, eval_layout.size, eval_layout.rows)))
            images = jax.device_get(images_step(state, first))
        if log is not None:
            log.write(step, "eval", metrics)
            progress.print(report.metrics_table(f"eval at step {step}", metrics))
            if images is not None:
                report.write_image_grid(images, workdir / "images" / f"{step}.png")

    params_finite = jax.jit(steps.all_finite)

    def check_finite(sums: dict[str, Any], step: int, *, params: bool = False) -> None:
        """Stop the run (RunError) once a loss, or with `params` the parameters, are not finite."""
        bad = int(sums["bad_step"])
        if bad >= 0:
            what = f"the loss became non-finite at step {bad + 1}"
        elif params and not bool(params_finite(state["params"])):
            what = f"the parameters are non-finite at step {step}"
        else:
            return
        ckpt.wait()
        last = ckpt.latest_step()
        kept = (
            f"the last good checkpoint is {ckpt_dir / str(last)}" if last is not None else "no checkpoint was written"
        )
        raise RunError(f"{what} (training stopped at step {step}); {kept}")

    # 7. The loop. Batch i of epoch e comes from (seed, e); keys from (seed, step).
    sums = steps.empty_sums(names)
    step = saved = start
    stopped = None
    signals.in_loop = True
    try:
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
            feed = data.prefetch(
                lambda s: train_layout.place(batches.get(s, train_layout.rows)), range(start, total_steps)
            )
            in_flight: collections.deque = collections.deque()
            for batch in feed:
                state, sums, loss = train_step(state, sums, batch)
                step += 1
                progress.tick(step)
                in_flight.append(loss)
                if (
                    len(in_flight) > _MAX_IN_FLIGHT
                ):  # bound async dispatch: keeps collectives on few CPU cores from starving
                    in_flight.popleft().block_until_ready()
                if step % cfg.train.log_every == 0 or step == total_steps:
                    host = jax.device_get(sums)
                    check_finite(host, step)
                    metrics = {k: v / max(int(host["count"]), 1) for k, v in host["metrics"].items()}
                    progress.log(step, metrics)
                    if log is not None:
                        log.write(step, "train", metrics)
                    sums = steps.empty_sums(names)
                if step % cfg.checkpoint.every_steps == 0 and step != total_steps:
                    check_finite(jax.device_get(sums), step, params=True)
                    ckpt.save(step, state)
                    saved = step
                if step % cfg.train.eval_every == 0 and step != total_steps:
                    check_finite(jax.device_get(sums), step, params=True)
                    run_eval(step)
                if signals.agreed(step):
                    stopped = signals.signal
                    break
            feed.close()
            check_finite(jax.device_get(sums), step, params=True)
            if step != saved:
                ckpt.save(step, state)
            ckpt.wait()
            if stopped is None:
                run_eval(step)
    finally:
        progress.close()
        ckpt.close()
        if lock is not None:
            lock.close()
    if stopped is not None:
        console.print(
            f"interrupted by {signal.Signals(stopped).name}: checkpoint written at {ckpt_dir / str(step)}",
            highlight=False,
        )
        return EXIT_INTERRUPTED
    console.print(f"done: {step} steps, checkpoint {ckpt_dir / str(step)}", highlight=False)
    return 0


def _init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process run through `jax.distributed.initialize`.

    Either from the flags (or `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
    `JAX_PROCESS_ID`), where JAX fills in what a cluster manager it knows
    provides; or, with no flags, inside a SLURM or Open MPI job of more than
    one task, entirely from that job's environment. Otherwise a single process.
    """
    import jax

    if coordinator is None and num_processes is None and process_id is None:
        if _cluster_tasks() > 1:
            jax.distributed.initialize()
        return
    if coordinator is not None and not (coordinator.rpartition(":")[0] and coordinator.rpartition(":")[2].isdigit()):
        raise UserError(
            f"--coordinator {coordinator!r} must be HOST:PORT, for example 10.0.0.1:1234 (the address of process 0)"
        )
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        raise UserError(
            f"--process-id {process_id} is out of range: processes are numbered 0 to N-1 for --num-processes N "
            f"({num_processes})"
        )
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    except ValueError as e:  # JAX found no cluster manager to fill in what is missing
        raise UserError(
            f"cannot start a multi-process run ({e}): pass all of --coordinator HOST:PORT, --num-processes N and "
            f"--process-id I, or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
        ) from None
    except Exception as e:  # the coordinator could not be reached, or not every process joined in time
        raise UserError(f"cannot join the multi-process run at --coordinator {coordinator}: {first_line(e)}") from None


def _cluster_tasks() -> int:
    """Processes in the SLURM or Open MPI job this process belongs to (1 outside one)."""
    for var in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):  # set for each task that srun / mpirun starts
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def _barrier(name: str) -> None:
    """Wait until every process reaches this point (nothing to wait for in a single-process run)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


if __name__ == "__main__":
    main()
