"""`nnx-train CONFIG [KEY=VALUE ...]`: train a model from a YAML config (a file, or a shipped config's name).

The recipe, top to bottom in :func:`_train`::

    exp = setup(cfg)                                 # 1. model, optimizer, data, mesh, shardings: resolved, checked
    session = open_session(exp, workdir, resume)     # 2. the work dir locked; a checkpoint restored or a fresh state
    loop, feed, dispatch, hooks = prepare(exp, ...)  # 3. the loop's state, its inputs, the jitted steps, the hooks
    loops.run(loop, feed, dispatch, hooks)           # 4. per dispatch: k train steps, then the hooks that are due
    session.close()                                  # 5. loggers and checkpoints closed, the lock released

Writes config.yaml, run.json, checkpoints/<step>/, metrics.jsonl,
images/<step>.png (image models) and samples/<step>.txt (language models)
into the work dir.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import signal
import sys
from pathlib import Path
from typing import IO, Any

import typer

from nnx_cli import distributed as _distributed
from nnx_cli import loggers, runtime, watchdog
from nnx_cli.commands import configs
from nnx_cli.config import Config, load_config, read_yaml, to_dict
from nnx_cli.distributed import Signals
from nnx_cli.errors import EXIT_INTERRUPTED, UserError, report_errors, run_app
from nnx_cli.runtime import PHASES

_STOP_VOTE_EVERY = 10  # multi-process runs agree on Ctrl-C / SIGTERM about this often (in steps)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def train(
    config: Path = typer.Argument(
        ..., metavar="CONFIG", help="YAML config file, or a shipped config's name (nnx-configs ls).", show_default=False
    ),
    overrides: list[str] | None = typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        help="Config overrides, e.g. train.steps=200 optimizer.learning_rate=3e-4.",
        show_default=False,
    ),
    workdir: str | None = typer.Option(  # a string: an empty one (an unset shell variable) is not "."
        None,
        metavar="<path>",
        help="Where checkpoints and logs go (default: the config's workdir, else runs/<config stem>).",
    ),
    resume: bool = typer.Option(
        True,
        "--resume/--no-resume",
        help="Continue from the latest checkpoint in the work dir; --no-resume starts over, deleting the old "
        "checkpoints, metrics, images and samples once the new run commits its first checkpoint (a run that stops "
        "before that puts them back).",
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
    with Signals() as signals:
        config = configs.find(config)  # a path that exists, else a shipped config's name
        cfg = load_config(config, overrides or [])
        raw = read_yaml(config)
        if not raw:  # an empty file (or comments only): a truncated copy, or the wrong file
            print(f"notice: config file {str(config)!r} sets no keys: every key takes its default (nnx-configs ls "
                  "lists configs to start from)", file=sys.stderr, flush=True)  # fmt: skip
        elif _empty_data(raw, overrides or []):  # a data section left empty (its keys commented out), or data=null
            print(f"notice: data.source is not set: training on the default, {cfg.data.source} (scikit-learn's 8x8 "
                  "digits)", file=sys.stderr, flush=True)  # fmt: skip
        if workdir is not None and not workdir.strip():
            raise UserError("--workdir is empty: give it a directory, or leave it out for the config's own")
        where = Path(workdir) if workdir is not None else Path(cfg.workdir or Path("runs") / config.stem)
        _check_config_outside(config, where)
        raise SystemExit(
            run(cfg, where, resume=resume, distributed=(coordinator, num_processes, process_id), signals=signals)
        )


def _empty_data(raw: dict, overrides: list[str]) -> bool:
    """Whether the data section is there but sets nothing: in the file (`data:` with its keys commented out) or
    as an override (`data=null`, `data={}`), unless another override names the source. A config without a data
    section means the default, as the recipes' do not."""
    if any(o.startswith("data.source=") for o in overrides):
        return False
    emptied = [o for o in overrides if o.startswith("data=")]
    if emptied:
        return emptied[-1].partition("=")[2].strip() in ("null", "~", "{}", "")
    return "data" in raw and not raw["data"]


def _check_config_outside(config: Path, workdir: Path) -> None:
    """A config file that is the work dir's `config.yaml` of no run yet is the user's own: the run would write its
    resolved config over it (comments and all). A run's own `config.yaml`, given to resume it, is fine."""
    own = workdir / "config.yaml"
    if own.exists() and own.resolve() == config.resolve() and not (workdir / "checkpoints").is_dir():
        raise UserError(
            f"CONFIG {str(config)!r} is the config.yaml of the work dir {str(workdir)!r}, which nnx-train writes "
            "the run's resolved config to: give your config another name, or train in another --workdir"
        )


def main() -> None:
    run_app(app, makes_files=True)


def run(
    cfg: Config,
    workdir: Path,
    *,
    resume: bool = True,
    distributed: tuple = (None, None, None),
    signals: Signals | None = None,
) -> int:
    """Train; return the exit status (0, or 130 when interrupted). Raises UserError / RunError.

    Everything the config can get wrong is found before the work dir is
    touched: a rejected run never deletes, overwrites or adds anything there.
    """
    signals = signals or Signals()
    runtime.configure(deterministic=cfg.train.deterministic)
    PHASES.add("import", PHASES.since_start())
    _distributed.init(*distributed)
    signals.reclaim()
    with watchdog.watching():  # several processes: one failing stops the others within seconds
        return _train(cfg, workdir, resume, signals)


def _train(cfg: Config, workdir: Path, resume: bool, signals: Signals) -> int:
    """The recipe (see the module docstring); returns the exit status."""
    import jax

    import nnx
    from nnx_cli import hooks
    from nnx_cli import loop as loops
    from nnx_cli.experiment import setup
    from nnx_cli.workdir import best_record, check_workdir, remove_if_empty, settle_aside, update_run_info

    created = check_workdir(workdir)  # before any data is read or downloaded
    try:
        exp = setup(cfg, data="train")
        factories = loggers.resolve_loggers(cfg.logging.loggers)  # an unknown or uninstalled logger stops us here
        harness_tasks = _harness_tasks(exp)  # so does an unknown harness task, or a missing lm-eval
        sample_prompts = hooks.eval_prompts(exp) if _writes_samples(exp) else None  # and an unusable prompt
        if sample_prompts is not None:
            hooks.check_sample_prompts(exp, sample_prompts)
        planned = plan(exp, harness_tasks)  # and steps per dispatch or batches the run cannot take
        _distributed.check_same(  # and processes started with other configs or data, which would wait for ever
            _agreed(exp), "start every process with the same config, overrides and data"
        )
        if resume and cfg.checkpoint.keep_best is not None:
            best_record(workdir / "checkpoints")  # and a best.json that cannot be read (its step would be pruned)
        if not resume:  # and an init_from in what --no-resume sets aside (it was not found there, then put back)
            _check_init_from_outside(cfg.checkpoint.init_from, workdir)
        session = open_session(exp, workdir, resume, made=bool(created))
    except BaseException:
        remove_if_empty(created)  # a run stopped before it wrote anything leaves no empty work dir (nor its lock)
        raise
    chosen: list[Any] = []  # the hooks, once prepared
    failed = False
    try:
        if session.start >= exp.total_steps:
            session.say(f"nothing to do: the work dir is already at step {session.start}, and the run is "
                        f"{exp.total_steps} steps long (raise train.steps or train.epochs to train on)")  # fmt: skip
            return 0
        loop, feed, dispatch, chosen = prepare(exp, session, signals, factories, planned, harness_tasks, sample_prompts)
        _put_back_at_signal_exit(session, chosen)
        attention = exp.attention()
        if attention is not None:
            session.say(f"attention: {attention}")
        session.say(f"set-up took {PHASES.since_start():.1f} s; training from step {loop.step} to {loop.total}")
        signals.in_loop = True
        runtime.preload("orbax.checkpoint")  # imports while the first steps run (the main thread mostly waits)
        with jax.set_mesh(exp.mesh), nnx.logical_axis_rules(exp.rules), PHASES("loop"):
            loops.run(loop, feed, dispatch, chosen)
    except BaseException:
        failed = True
        raise
    finally:
        session.close()
        # kept when this run stopped before its first checkpoint, else deleted; a Ctrl-C before that writes one,
        # and puts the earlier run back all the same
        save = _checkpoint_hook(chosen)
        put_back = settle_aside(session.aside, put_back=save is not None and save.first_at_stop)
        if session.forget_aside is not None:
            session.forget_aside()
        if put_back and failed:  # the error's "run again to resume" would resume the earlier run: say it is back
            session.say(f"--no-resume: this run wrote no checkpoint of its own, so the earlier run is back in "
                        f"{session.workdir} as it was (--no-resume again to start over)")  # fmt: skip
    where = session.workdir / "checkpoints" / str(loop.step)
    if loop.stop_signal is not None:
        name = signal.Signals(loop.stop_signal).name
        if put_back:
            session.say(f"interrupted by {name} before the new run's first checkpoint: the earlier run is back in "
                        f"{session.workdir} (--no-resume again to start over)")  # fmt: skip
        else:
            session.say(f"interrupted by {name}: checkpoint written at {where}")
        return EXIT_INTERRUPTED
    session.say(f"done: {loop.step} steps, checkpoint {where}; {runtime.breakdown()}")
    if session.lock is not None:
        update_run_info(workdir, {"timings": runtime.timings()})
    return 0


def _say_best_unkept(session: Session, keep_best: dict[str, str] | None) -> None:
    """A resumed run whose config no longer keeps the step `best.json` records (`checkpoint.keep_best` left out, an
    override not given again, or another metric) says so: that step now goes once it falls out of
    `checkpoint.keep`'s newest, and `nnx-eval --best` with it."""
    from nnx_cli.workdir import best_record

    checkpoints = session.workdir / "checkpoints"
    try:
        record = best_record(checkpoints)
    except UserError:
        return  # unreadable: nothing it names is kept either way
    if record is None or not (checkpoints / str(record["step"])).is_dir():
        return
    if keep_best is not None and keep_best["metric"] == record["metric"]:
        return
    now = "is off" if keep_best is None else f"keeps the best {keep_best['metric']} now"
    session.say(
        f"notice: checkpoint.keep_best {now}: step {record['step']}, the best {record['metric']} so far (best.json), "
        "goes once it falls out of checkpoint.keep's newest; to keep it, set checkpoint.keep_best={metric: "
        f"{record['metric']}, mode: {record.get('mode', 'min')}}}"
    )


def _checkpoint_hook(chosen: list[Any]) -> Any:
    """The run's `hooks.Checkpoint` among the prepared hooks (None before they are)."""
    from nnx_cli import hooks

    return next((hook for hook in chosen if isinstance(hook, hooks.Checkpoint)), None)


def _put_back_at_signal_exit(session: Session, chosen: list[Any]) -> None:
    """A second signal while the first one's checkpoint is written ends the process at once: when that checkpoint
    is this `--no-resume` run's first, it does not replace the earlier run either (as after one signal), so the
    hook that runs at such an exit decides the put-back then (it left the earlier run for the next run to
    delete). Once a save has begun, the moves are left to the next `nnx-train`: the checkpoint may still be being
    written into the directory they would replace. Before that (a signal during the rest of the set-up) they are
    made at once, as the set-up's own hook makes them."""
    from nnx_cli.workdir import settle_aside

    save = _checkpoint_hook(chosen)
    if session.forget_aside is None or save is None:
        return
    session.forget_aside()
    session.forget_aside = _distributed.at_signal_exit(
        lambda: settle_aside(
            session.aside, delete=False, put_back=save.first_at_stop, later=save.first_at_stop or save.saves > 0
        )
    )


def _check_init_from_outside(init_from: str | None, workdir: Path) -> None:
    """A UserError when `checkpoint.init_from` is what a `--no-resume` run sets aside in its work dir (the work dir
    itself, or its checkpoints); an adapter directory kept elsewhere in the work dir is left where it is."""
    from nnx_cli.workdir import set_aside_names

    if init_from is None or not Path(init_from).exists():
        return
    source, target = Path(init_from).resolve(), workdir.resolve()
    aside = [target / name for name in set_aside_names(target)]
    if source == target or any(source == p or p in source.parents for p in aside):
        raise UserError(
            f"config key 'checkpoint.init_from' ({init_from!r}) is inside the work dir that --no-resume starts over "
            "in: its checkpoints are set aside, then deleted; copy that run elsewhere first, or pass another --workdir"
        )


# Keys each process of a run may set for itself: where it reads its data and cache from, how it loads it, where
# it logs (process 0 alone writes logs), whether it profiles.
_PER_PROCESS = ("workdir", "data.source", "data.workers", "data.cache_dir", "logging.loggers", "train.profile")


def _agreed(exp: Any) -> dict[str, Any]:
    """What every process of a run must hold alike, by what a message calls it: the config's keys (but for
    `_PER_PROCESS`; the keys no schema names, a model's options, as one part per section), the run's length,
    and the rows of its data. The names are the same on every process, whatever its config holds."""
    config, schema = to_dict(exp.cfg), to_dict(Config())
    for key in _PER_PROCESS:
        section, _, name = key.partition(".")
        if name and isinstance(config.get(section), dict):
            config[section].pop(name, None)
        elif not name:
            config.pop(section, None)
    parts: dict[str, Any] = {}
    for section, known in schema.items():
        value = config.get(section)
        if not isinstance(known, dict) or not isinstance(value, dict):
            parts[f"config key {section!r}"] = value
            continue
        for key in known:
            if key in value:
                parts[f"config key '{section}.{key}'"] = value[key]
        parts[f"the other keys of config section {section!r}"] = {k: v for k, v in value.items() if k not in known}
    parts["the run's length (steps)"] = exp.total_steps
    parts["the rows of the training split"] = len(exp.train) if exp.train is not None else None
    parts["the rows of the eval split"] = len(exp.eval) if exp.eval is not None else None
    return parts


@dataclasses.dataclass
class Session:
    """A run's hold on its work dir: the lock, the checkpointer, the loggers, and where training starts."""

    workdir: Path
    checkpointer: Any
    lock: IO | None
    console: Any
    loggers: Any  # nnx_cli.loggers.Loggers: every logger of logging.loggers as one (none on processes > 0)
    start: int
    state: Any
    sums: Any
    aside: Path | None = None  # --no-resume: the earlier run, until this one commits a checkpoint (workdir.set_aside)
    forget_aside: Any = None  # drops the signal-exit hook that puts `aside` back
    previous: dict[str, Any] | None = None  # on resume, the config the steps so far ran with (config.yaml as saved)

    def say(self, message: str) -> None:
        self.console.print(message, highlight=False, soft_wrap=True)

    def close(self) -> None:
        try:
            self.loggers.close()
        finally:
            self.checkpointer.close()
        if self.lock is not None:
            self.lock.close()


def open_session(exp: Any, workdir: Path, resume: bool, made: bool = False) -> Session:
    """Lock the work dir, then resume from its newest usable checkpoint (which must fit the config) or start
    afresh; only then write the resolved config and run.json. `made`: this run created the work dir; if it fails
    here, its lock and empty `checkpoints/` go with it (`remove_if_empty` then takes the directory)."""
    from nnx_cli import report
    from nnx_cli.workdir import ASIDE, discard_unwritten, lock_workdir, set_aside, settle_aside

    is_main = _distributed.is_main()
    console = report.stderr_console(quiet=not is_main)
    lock = lock_workdir(workdir) if is_main else None  # held until the session closes
    if is_main and resume:  # a --no-resume run killed before its first checkpoint left the earlier run aside
        settle_aside(workdir / ASIDE)
    aside = set_aside(workdir) if is_main and not resume else None  # until this run commits a checkpoint
    # a signal before the loop (or a second one in it) ends the process at once: the earlier run goes back first
    forget = _distributed.at_signal_exit(functools.partial(settle_aside, aside, delete=False))
    if aside is not None:  # the earlier run's steps were deleted without a word
        from nnx_cli.integrity import steps as saved_steps

        held = saved_steps(aside / "checkpoints") if (aside / "checkpoints").is_dir() else []
        what = f"its checkpoints at step{'s' * (len(held) > 1)} {', '.join(map(str, held))}" if held else "its files"
        said = f"--no-resume: the earlier run ({what}) is set aside in {aside}, and deleted once this run writes "
        console.print(said + "its first checkpoint (put back if it stops before)", highlight=False, soft_wrap=True)
    try:
        session = _open(exp, workdir, resume, lock, console)
    except BaseException:
        forget()
        settle_aside(aside)
        if made and lock is not None:
            lock.close()
            discard_unwritten(workdir)
        raise
    session.aside, session.forget_aside = aside, forget
    return session


def _open(exp: Any, workdir: Path, resume: bool, lock: IO | None, console: Any) -> Session:
    """`open_session` once the work dir is locked (and, with --no-resume, the earlier run set aside)."""
    import jax
    import jax.numpy as jnp

    from nnx_cli import steps
    from nnx_cli.checkpoint import Checkpointer
    from nnx_cli.workdir import write_config, write_run_info

    is_main = _distributed.is_main()
    ckpt_dir = workdir / "checkpoints"
    # Decided before the barrier: once past it, another process's Checkpointer may create the directory.
    has_checkpoints = resume and ckpt_dir.is_dir()
    seen = _distributed.SharedDirCheck(workdir)  # process 0 leaves a mark in it for the others to find
    _distributed.barrier("nnx-train: work dir ready")
    seen.check()
    found = _resume(exp, ckpt_dir, console) if has_checkpoints else None
    keep = exp.cfg.checkpoint
    checkpointer = Checkpointer(ckpt_dir, keep=keep.keep, async_=keep.async_)  # after bad steps moved aside

    def say(message: str) -> None:
        console.print(message, highlight=False, soft_wrap=True)

    if found is not None:
        start, (state, sums) = found.step, found.value
        check_start = getattr(exp.objective, "check_start", None)  # before the config is written: nothing changes
        if check_start is not None:
            check_start(start)
        state = exp.with_reference(exp.with_frozen(state), say)
        say(f"resumed from {ckpt_dir / str(start)}")
    else:
        start, state, sums = 0, exp.init_state(), exp.empty_sums()
        if exp.cfg.checkpoint.init_from is not None:
            params, kind, where = exp.init_from_params(exp.cfg.checkpoint.init_from, say)
            say(f"{kind} initialised from {where}")
            state = dict(state, params=params)
            if steps.REFERENCE in state:  # the reference is where the run starts: a copy of its own
                state[steps.REFERENCE] = jax.tree.map(jnp.copy, params)
    previous = None  # on resume, the config the steps so far ran with: what the lines logged so far were under
    if is_main and start < exp.total_steps:  # a run with nothing to do leaves the config its steps were made with
        previous = write_config(
            workdir,
            to_dict(exp.cfg),
            start,
            say=say,
            defaults=_defaults(exp),
        )
        write_run_info(workdir, exp)
    return Session(workdir, checkpointer, lock, console, loggers.Loggers([]), start, state, sums, previous=previous)


def _defaults(exp: Any) -> dict[str, Any]:
    """Every key's default, model options included: a key that a config saved by an earlier release lacks and
    that holds its default now is not a change."""
    from nnx_cli import models

    defaults = to_dict(Config())
    defaults["model"].update(models.option_defaults(exp.model_cls))
    return defaults


def _resume(exp: Any, ckpt_dir: Path, console: Any) -> Any:
    """The newest usable checkpoint (`restore.Found`) in an existing `ckpt_dir`, or None when it has none; unusable
    newer steps are moved aside; a work dir whose checkpoints are all unusable is a UserError, and then nothing is
    moved: the same command run again refuses again, where an emptied directory would start over from step 0."""
    from nnx_cli import integrity, restore, steps
    from nnx_cli.checkpoint import LOOP, Checkpointer

    reader = Checkpointer(
        ckpt_dir, read_only=True, mismatch_fix="train in a new --workdir, or pass --no-resume to start over"
    )
    empty = _replicated(exp, steps.empty_sums(exp.metric_names))

    def read(step: int) -> tuple[Any, Any]:
        exp.check_base(reader.manifest(step), ckpt_dir / str(step))  # adapters: the base weights they were made on
        state = restore.read_state(reader, step, exp.restore_target())
        return state, reader.restore_item(step, LOOP, empty) or exp.empty_sums()

    def say(message: str) -> None:
        console.print(message, highlight=False, soft_wrap=True)

    try:
        with PHASES("checkpoint"):
            found = restore.choose(ckpt_dir, read, say=say)
    finally:
        reader.close()
    if found.step is not None and found.rejected and _distributed.is_main():
        restore.quarantine(ckpt_dir, found.rejected, say)
    # a step that restored and is finite but was never sealed (written before checksums, or a crash between
    # Orbax's commit and the seal) is sealed now, so that damage from here on is found, as on any other step;
    # every process seals its own files, so each decides before any of them writes one
    unsealed = found.step is not None and not integrity.checksum_files(ckpt_dir / str(found.step))
    _distributed.barrier("nnx-train: checkpoints checked")
    if unsealed:
        integrity.seal(ckpt_dir / str(found.step))
        say(f"sealed checkpoint {ckpt_dir / str(found.step)} with the checksums of the files it restored from")
    if found.step is None and found.rejected:
        raise restore.no_usable_step(
            ckpt_dir,
            found.rejected,
            "train in a new --workdir, or pass --no-resume to start over (it sets them aside, and deletes them once "
            "the new run has a checkpoint)",
        )
    return found if found.step is not None else None


def _writes_samples(exp: Any) -> bool:
    """Whether each eval writes samples of fixed prompts (`hooks.Samples`): a language model that decodes, with an
    eval split, `train.sample_tokens` > 0 and no objective that writes its own (GRPO's completions)."""
    return (
        exp.eval is not None
        and exp.spec.tokenizer is not None
        and hasattr(exp.model_cls, "init_cache")
        and not hasattr(exp.objective, "samples")
        and exp.cfg.train.sample_tokens > 0
    )


def _replicated(exp: Any, tree: Any) -> Any:
    import jax

    scalar = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=scalar), tree)


def _harness_tasks(exp: Any) -> Any:
    """`eval.harness.tasks` loaded (their data read), or None when there are none; a UserError for a missing
    lm-eval, a model that is no language model, several processes, or a task that cannot be loaded."""
    import jax

    options = exp.cfg.eval.harness
    if not options.tasks:
        return None
    from nnx_cli import harness

    harness.require_lm_eval("config key 'eval.harness'")
    if exp.spec.tokenizer is None or not hasattr(exp.model_cls, "init_cache"):
        raise UserError(
            f"config key 'eval.harness' evaluates language models; model {exp.cfg.model.name!r} on this data is not "
            "one (set eval.harness.tasks=[] to drop it)"
        )
    if jax.process_count() > 1:
        raise UserError("config key 'eval.harness' runs in single-process runs; evaluate with nnx-eval --tasks after")
    with harness.as_config_keys(), PHASES("data"):
        tasks = harness.load_tasks(options.tasks, options.include_path)
        harness.check_fewshot(tasks, options.num_fewshot)  # found at the first harness eval, it ended the run there
        if options.apply_chat_template:
            from nnx_cli.data.tokenizers import load_tokenizer
            from nnx_cli.lm import chat_template_of

            if chat_template_of(exp.cfg, load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained)) is None:
                raise UserError(
                    "config key 'eval.harness.apply_chat_template' needs a chat template, and the model has none "
                    "(chat_template.jinja, or chat_template in tokenizer_config.json, or data.chat_template)"
                )
        return tasks


def plan(exp: Any, harness_tasks: Any = None) -> tuple[int, Any, Any]:
    """The steps per dispatch, the batch layout and the eval batch layout (None where the objective samples its
    own batches); a UserError, before the work dir is touched, for steps per dispatch that do not divide the
    intervals and for batches the mesh cannot split or the training split cannot fill."""
    from nnx_cli import loop as loops
    from nnx_cli import sharding
    from nnx_cli.experiment import count_params

    cfg, t = exp.cfg, exp.cfg.train
    if hasattr(exp.objective, "inputs"):  # the objective makes its batches: one per dispatch
        _check_profile(t.profile, exp.total_steps)
        return exp.objective.steps_per_batch, None, None
    intervals = {
        "train.log_every": t.log_every,
        "train.eval_every": t.eval_every,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
    }
    if harness_tasks is not None:
        intervals["eval.harness.every_steps"] = cfg.eval.harness.every_steps or t.eval_every
    k = loops.steps_per_dispatch(t.steps_per_dispatch, intervals, count_params(exp.abstract), exp.total_steps)
    _check_profile(t.profile, exp.total_steps)
    layout = sharding.batch_layout(exp.mesh, exp.rules, t.batch_size)
    exp.train.steps_per_epoch(t.batch_size)
    eval_layout = sharding.eval_batch_layout(exp.mesh, exp.rules, t) if exp.eval is not None else None
    return k, layout, eval_layout


def _check_profile(profile: list[int] | None, total: int) -> None:
    """A `train.profile` window that starts after the run's last step is a UserError (it traced nothing)."""
    if profile is not None and profile[0] >= total:
        raise UserError(
            f"config key 'train.profile' ({profile}) starts after the run's last step ({total}): nothing would be "
            "traced; pick a start step within the run"
        )


def prepare(
    exp: Any,
    session: Session,
    signals: Signals,
    factories: dict[str, Any],
    planned: tuple[int, Any, Any],
    harness_tasks: Any = None,
    sample_prompts: list[list[int]] | None = None,
) -> tuple[Any, Any, Any, list[Any]]:
    """The loop's state, its feed of dispatch inputs, the jitted dispatch and the hooks, in the order they run;
    `planned` is what :func:`plan` gave for the run, `sample_prompts` are those of the samples each eval writes
    (`_writes_samples`), encoded and checked."""
    import jax

    from nnx_cli import hooks, sharding, steps
    from nnx_cli import loop as loops
    from nnx_cli.data import pipeline

    cfg, t = exp.cfg, exp.cfg.train
    if session.lock is not None:  # process 0 reports
        run = loggers.LoggerRun(
            session.workdir, to_dict(cfg), session.start, exp.total_steps, exp.loss_metric, session.console,
            previous_config=session.previous,
        )  # fmt: skip
        session.loggers = loggers.open_loggers(factories, run)
    k, layout, eval_layout = planned
    sampling = hasattr(exp.objective, "inputs")
    harness_every = cfg.eval.harness.every_steps or t.eval_every
    scalar = sharding.replicated(exp.mesh)
    feed, dispatch = loops.inputs(exp, layout, pipeline.dispatches(session.start, exp.total_steps, k))
    guard = hooks.Guard(session.checkpointer, session.workdir / "checkpoints")
    tokens = cfg.data.seq_len if exp.spec.tokenizer and not sampling else 0  # GRPO: rows of their own length
    log = hooks.LogMetrics(t.log_every, session.loggers, guard, batch_size=t.batch_size, tokens_per_example=tokens)
    save = hooks.Checkpoint(
        cfg.checkpoint.every_steps, session.checkpointer, guard, saved=session.start, base=exp.base_record()
    )
    # a step's checkpoint comes after everything else it writes (its eval, keep_best's record, images,
    # samples): a run killed before the checkpoint is committed does the step again, one killed after it has them
    # "compiled and running" as soon as the first dispatch is sent: before the first log line, which waits for it
    chosen, best = [hooks.FirstStep(k, session.say), log], None
    if exp.eval is not None:
        evaluate = hooks.Evaluate(t.eval_every, hooks.evaluator(exp, eval_layout, scalar), session.loggers, guard)
        chosen.append(evaluate)
        if cfg.checkpoint.keep_best is not None:
            keep = cfg.checkpoint.keep_best
            best = hooks.KeepBest(evaluate, save, keep["metric"], keep["mode"], session.start)
        if exp.has_images:
            images = session.workdir / "images" if session.lock is not None else None
            chosen.append(hooks.ImageGrid(t.eval_every, hooks.image_maker(exp, eval_layout, scalar), images, guard))
        if exp.spec.tokenizer is not None and hasattr(exp.model_cls, "init_cache"):
            samples = session.workdir / "samples" if session.lock is not None else None
            if hasattr(exp.objective, "samples"):  # completions with their rewards (GRPO)
                chosen.append(exp.objective.samples(t.eval_every, exp, samples, guard, steps))
            elif t.sample_tokens > 0:
                chosen.append(
                    hooks.Samples(t.eval_every, exp, samples, guard, sample_prompts or hooks.eval_prompts(exp))
                )
    if harness_tasks is not None:
        chosen.append(hooks.HarnessEval(harness_every, exp, harness_tasks, session.loggers, guard, session.workdir))
    chosen += [best, save] if best is not None else [save]
    if session.start > 0:
        _say_best_unkept(session, cfg.checkpoint.keep_best if exp.eval is not None else None)
    if t.profile is not None:
        chosen.append(hooks.Profile(k, t.profile[0], t.profile[1], session.workdir / "profile"))
    vote = k if jax.process_count() == 1 else k * math.ceil(_STOP_VOTE_EVERY / k)
    chosen.append(hooks.Tick(k, session.loggers))
    chosen.append(hooks.StopVote(vote, signals))
    loop = loops.Loop(exp, session.state, session.sums, step=session.start, total=exp.total_steps)
    return loop, feed, dispatch, chosen


if __name__ == "__main__":
    main()
