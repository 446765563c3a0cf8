"""Metric loggers: where a run's train logs and evals go (`logging.loggers`).

The training loop resolves the configured names before it touches the work
dir, opens the loggers once the run's start step is known, and calls them::

    factories = resolve_loggers(["jsonl", "console", "tensorboard"])  # unknown / not installed: UserError
    loggers = open_loggers(factories, LoggerRun(workdir, config, start_step, total_steps, "nelbo", console))
    loggers.tick(step)                                                 # every step: moves a live bar
    loggers.log(step, "train", {"nelbo": 98.1, "learning_rate": 1e-3, "steps_per_s": 40.2})
    loggers.log(step, "eval", {"nelbo": 97.5})
    loggers.close()

Shipped (`LOGGERS`):

- `jsonl`: `<workdir>/metrics.jsonl`, one `{"step", "split", "metrics", "time"}`
  object per line;
- `console`: a live progress bar on a terminal, plain lines otherwise, and a
  table per eval;
- `tensorboard`: event files in `<workdir>/tensorboard/` (`pip install tensorboardX`),
  scalars tagged `train/<metric>` and `eval/<metric>`;
- `wandb`: a Weights & Biases run (`pip install wandb`), offline when there is
  no network or no login, its files in `<workdir>/wandb/`.

A resumed run starts again at the restored step, and every shipped logger
hides what the interrupted run logged past it, so no curve has a step twice
or goes back: `jsonl` drops those lines, `tensorboard` purges those events,
`wandb` (whose history cannot be rewritten) skips steps its run already has.

Your own logger is `package.module:Class` in the list, imported from the
current directory: a class (or function) called with the :class:`LoggerRun`
whose result has `log(step, split, metrics)` and `close()` (see
:class:`MetricLogger`) and, optionally, `tick(step)`. Pip packages it needs,
listed as `requires = ("name", "name>=1.2")` on the class, are checked when
the config is resolved::

    # my_logger.py, beside the config; logging.loggers: [jsonl, my_logger:Printer]
    class Printer:
        def __init__(self, run):
            self.total = run.total_steps

        def log(self, step, split, metrics):
            print(f"{split} {step}/{self.total}", dict(metrics))

        def close(self):
            pass
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from nnx_cli.errors import RunError, UserError, first_line
from nnx_cli.registry import Registry, is_reference
from nnx_cli.report import format_metrics, json_metrics, metrics_table

__all__ = [
    "LOGGERS",
    "ConsoleLogger",
    "JsonlLogger",
    "LoggerFactory",
    "LoggerRun",
    "Loggers",
    "MetricLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "open_loggers",
    "resolve_loggers",
]

_KEY = "logging.loggers"
# Train metrics the loop adds beside the model's: shown as rates on the console, not as metrics.
_RATES = {"steps_per_s": "steps/s", "examples_per_s": "examples/s", "tokens_per_s": "tokens/s"}


@runtime_checkable
class MetricLogger(Protocol):
    """What the training loop calls. `split` is `"train"`, `"eval"` or `"harness"`.

    Train metrics are means since the previous train log and also carry
    `learning_rate`, `grad_norm`, `steps_per_s`, `examples_per_s` (and
    `tokens_per_s` for text); eval metrics are means over the eval split;
    harness metrics are lm-evaluation-harness results (`eval.harness`), named
    `<task>/<metric>`.
    A logger may also have `tick(step)`, called after every step.
    """

    def log(self, step: int, split: str, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggerRun:
    """What a logger knows about the run it logs.

    - `workdir`: the run's work dir (it exists);
    - `config`: the resolved config, as written to `config.yaml`;
    - `start_step`: 0, or on resume the restored checkpoint's step (what was
      logged past it belongs to a run that no checkpoint holds);
    - `total_steps`: the step the run ends at;
    - `loss_metric`: the model's loss metric (`nelbo`, `loss`);
    - `console`: where messages go (stderr; quiet on all processes but the first);
    - `previous_config`: on resume, the config the steps so far ran with (None: the same as `config`).

    >>> run = LoggerRun(Path("runs/vae"), {"seed": 0}, start_step=0, total_steps=1000, loss_metric="nelbo")
    """

    workdir: Path
    config: Mapping[str, Any]
    start_step: int
    total_steps: int
    loss_metric: str
    console: Console = field(default_factory=lambda: Console(stderr=True, markup=False))
    previous_config: Mapping[str, Any] | None = None


LoggerFactory = Callable[[LoggerRun], MetricLogger]


def _check_factory(obj: Any, name: str) -> None:
    """A `package.module:attr` logger must be callable with one LoggerRun; a class must have log and close."""
    try:
        inspect.signature(obj).bind(None)
    except (TypeError, ValueError):
        raise UserError(
            f"config key {_KEY!r}: {name!r} is not a class or function taking one argument (the LoggerRun); "
            "a logger is built as Logger(run)"
        ) from None
    missing = [m for m in ("log", "close") if isinstance(obj, type) and not callable(getattr(obj, m, None))]
    if missing:
        raise UserError(
            f"config key {_KEY!r}: {name!r} has no {' or '.join(missing)} method; a logger needs "
            "log(step, split, metrics) and close() (see nnx_cli.loggers.MetricLogger)"
        )


LOGGERS: Registry[LoggerFactory] = Registry("logger", _KEY, check=_check_factory)


def resolve_loggers(names: Sequence[str]) -> dict[str, LoggerFactory]:
    """The factories of `logging.loggers`, in order; call before the run writes anything.

    Unknown names, names given twice, logger classes without `log` or
    `close`, and loggers whose packages are missing, too old or fail to
    import are UserErrors saying what to fix or `pip install`.

    >>> resolve_loggers(["jsonl", "console"])
    {'jsonl': <class 'nnx_cli.loggers.JsonlLogger'>, 'console': <class 'nnx_cli.loggers.ConsoleLogger'>}
    """
    factories: dict[str, LoggerFactory] = {}
    for name in names:
        if name in factories:
            raise UserError(f"config key {_KEY!r} lists {name!r} twice; list each logger once")
        factory = LOGGERS.get(name)
        for requirement in getattr(factory, "requires", ()):
            _check_requirement(requirement, f"logger {name!r}")
        for module in getattr(factory, "imports", ()):  # installed but broken: found now, not once the run has begun
            _import(module, name)
        factories[name] = factory
    return factories


def open_loggers(factories: Mapping[str, LoggerFactory], run: LoggerRun) -> Loggers:
    """Build every logger for `run`; if one fails, those already built are closed.

    >>> loggers = open_loggers(resolve_loggers(["jsonl"]), run)
    """
    opened: list[MetricLogger] = []
    named: list[str] = []
    try:
        for name, factory in factories.items():
            try:
                logger = factory(run)
            except SystemExit as e:  # the run ended with the plug-in's own code and no word
                if not is_reference(name):
                    raise
                raise UserError(
                    f"config key {_KEY!r}: {name!r} called sys.exit({e.code!r}) while opening; a logger raises "
                    "to stop the run"
                ) from None
            except Exception as e:
                if not is_reference(name) or isinstance(e, UserError):
                    raise
                raise UserError(
                    f"config key {_KEY!r}: {name!r} raised {type(e).__name__} while opening: {first_line(e)}; "
                    "fix it, or drop it from the list"
                ) from None
            if not isinstance(logger, MetricLogger):
                raise UserError(
                    f"config key {_KEY!r}: {name!r} made a {type(logger).__name__}, which lacks "
                    "log(step, split, metrics) or close(); see nnx_cli.loggers.MetricLogger"
                )
            opened.append(logger)
            named.append(name)
    except BaseException:
        with contextlib.suppress(Exception):  # the first failure is the one to report
            Loggers(opened).close()
        raise
    return Loggers(opened, named)


class Loggers:
    """Several loggers as one: each call goes to every logger, in order.

    `names` are the loggers' names in `logging.loggers`: a `package.module:attr`
    logger whose `log` or `tick` raises stops the run with a RunError naming it
    (the checkpoints written so far are kept).

    >>> loggers = Loggers([JsonlLogger(run), ConsoleLogger(run)], ["jsonl", "console"])
    >>> loggers.log(100, "train", {"loss": 0.31})
    """

    def __init__(self, loggers: Sequence[MetricLogger], names: Sequence[str] | None = None):
        self.loggers = list(loggers)
        self.names = list(names) if names is not None else [type(logger).__name__ for logger in self.loggers]
        self._ticks = [
            (name, logger.tick)
            for name, logger in zip(self.names, self.loggers)
            if callable(getattr(logger, "tick", None))
        ]

    def log(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        for name, logger in zip(self.names, self.loggers):
            with _plugin_call(name, "log", step):
                logger.log(step, split, metrics)

    def tick(self, step: int) -> None:
        for name, tick in self._ticks:
            with _plugin_call(name, "tick", step):
                tick(step)

    def close(self) -> None:
        """Close every logger (even when one fails: the first failure is raised after); a second call does nothing."""
        loggers, self.loggers, self._ticks = self.loggers, [], []
        failure: BaseException | None = None
        for name, logger in zip(self.names, loggers):
            try:
                logger.close()
            except BaseException as e:
                if failure is None and isinstance(e, Exception) and is_reference(name):
                    failure = RunError(
                        f"logger {name!r} (config key {_KEY!r}) raised {type(e).__name__} in close(): "
                        f"{first_line(e)}; the checkpoints written are kept"
                    )
                failure = failure or e
        if failure is not None:
            raise failure


@contextlib.contextmanager
def _plugin_call(name: str, method: str, step: int) -> Any:
    """A `package.module:attr` logger's exception as a one-line RunError naming it; shipped loggers' pass through."""
    try:
        yield
    except SystemExit as e:  # the run ended with the plug-in's own code and no word
        if not is_reference(name):
            raise
        raise RunError(
            f"logger {name!r} (config key {_KEY!r}) called sys.exit({e.code!r}) in {method}() at step {step}; "
            "training stopped, the checkpoints written so far are kept"
        ) from None
    except Exception as e:
        if not is_reference(name) or isinstance(e, (UserError, RunError)):
            raise
        raise RunError(
            f"logger {name!r} (config key {_KEY!r}) raised {type(e).__name__} in {method}() at step {step}: "
            f"{first_line(e)}; training stopped, the checkpoints written so far are kept"
        ) from None


# --------------------------------------------------------------------------- jsonl


class JsonlLogger:
    """`<workdir>/metrics.jsonl`: one `{"step", "split", "metrics", "time"}` object per line.

    Strict JSON: a NaN or infinite metric is `null`. Opened at a resumed
    step, it first cuts the file back to what an uninterrupted run would have
    written by then: the lines past that step go (and a torn last line), and
    so do the end-of-run lines at that step that fall off their interval
    (`train.log_every`, `train.eval_every`), such as the last train log of a
    run stopped between two logs. So the file always describes the run that
    the checkpoints hold, and a resumed run's file reads like an
    uninterrupted one's.
    """

    def __init__(self, run: LoggerRun):
        self.path = run.workdir / "metrics.jsonl"
        if self.path.exists():
            lines = self.path.read_text(errors="replace").splitlines()  # bytes not UTF-8: no JSON, dropped as torn
            kept = [line for line in lines if _kept(line, run)]
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(line + "\n" for line in kept))
            partial.replace(self.path)

    def log(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        record = {"step": step, "split": split, "metrics": json_metrics(metrics), "time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


def _intervals(config: Mapping[str, Any]) -> dict[str, int]:
    """Steps between the records of each split under `config`."""
    train = config.get("train") or {}
    harness = (config.get("eval") or {}).get("harness") or {}
    every = {
        "train": train.get("log_every", 1),
        "eval": train.get("eval_every", 1),
        "harness": harness.get("every_steps") or train.get("eval_every", 1),
    }
    return {split: n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1 for split, n in every.items()}


def _kept(line: str, run: LoggerRun) -> bool:
    try:
        record = json.loads(line)
        step, split = record["step"], record["split"]
    except (ValueError, KeyError, TypeError):
        return False  # a torn last line from a killed run
    if step < run.start_step:
        return True
    return step == run.start_step and _on_interval(run, split)


def _on_interval(run: LoggerRun, split: str) -> bool:
    """Whether a record of `split` at the resumed step is a regular one, kept: on its interval under this run's
    config or the earlier one's (by this run's alone, a resume with another train.log_every deleted the records
    of its step). Off both, it is the last record of a run stopped between two: the steps it covers are counted
    again in the resumed run's next record."""
    configs = [run.config, *([run.previous_config] if run.previous_config else [])]
    return any(run.start_step % _intervals(c).get(split, 1) == 0 for c in configs)


# --------------------------------------------------------------------------- console


class ConsoleLogger:
    """Progress on the run's console: a live bar on a terminal, plain lines otherwise.

    On a terminal the bar shows step, loss, steps/s and the time left; it
    moves with every `tick` and starts at the first one, so messages printed
    while loggers open stay above it. Elsewhere (a log file, a pipe) each
    train log is one line::

        step 200/1000 nelbo=98.12 recon=91.3 kl=6.82 (41.3 steps/s, 5,286 examples/s)

    Each eval prints a table. The rates come from the `*_per_s` metrics, or
    are measured between train logs where the loop does not provide them.
    """

    def __init__(self, run: LoggerRun):
        self.console = run.console
        self.total = run.total_steps
        self.loss_name = run.loss_metric
        self.live = self.console.is_terminal
        self._start = run.start_step
        self._last_step, self._last_time = run.start_step, time.perf_counter()
        self._bar: RichProgress | None = None
        self._last_tick = 0.0

    def tick(self, step: int) -> None:
        """After every step: moves the live bar (no device sync; at most 10 redraws a second)."""
        if self.live and time.perf_counter() - self._last_tick > 0.1:
            self._last_tick = time.perf_counter()
            self._live_bar().update(self._task, completed=step)

    def log(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        if split != "train":
            self.console.print(metrics_table(f"{split} at step {step}", metrics), highlight=False, soft_wrap=True)
            return
        now = time.perf_counter()
        rates = {unit: metrics[name] for name, unit in _RATES.items() if name in metrics}
        if "steps/s" not in rates:
            rates = {"steps/s": (step - self._last_step) / max(now - self._last_time, 1e-9), **rates}
        self._last_step, self._last_time = step, now
        if self.live:
            loss = metrics.get(self.loss_name, math.nan)
            self._live_bar().update(
                self._task, completed=step, loss=f"{self.loss_name} {loss:.4g}", rate=f"{rates['steps/s']:.1f} steps/s"
            )
        else:
            shown = format_metrics({k: v for k, v in metrics.items() if k not in _RATES})
            rate_text = ", ".join(f"{_format_rate(v)} {unit}" for unit, v in rates.items())
            self.console.print(f"step {step}/{self.total} {shown} ({rate_text})", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _live_bar(self) -> RichProgress:
        if self._bar is None:
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task("train", total=self.total, completed=self._start, loss="", rate="")
            self._bar.start()
        return self._bar


def _format_rate(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


# --------------------------------------------------------------------------- tensorboard


class TensorBoardLogger:
    """Event files in `<workdir>/tensorboard/`: `tensorboard --logdir <workdir>/tensorboard`.

    Scalars are tagged `train/<metric>` and `eval/<metric>`; a fresh run also
    writes its config as text. A fresh run (step 0) deletes the event files
    of an earlier one; a resumed run starts a new file that purges what the
    interrupted run wrote past the restored step, and at it what
    metrics.jsonl drops there (TensorBoard's
    `SessionLog.START`, through `SummaryWriter(purge_step=)`), so its curves
    continue with no step twice.
    """

    requires = ("tensorboardX",)
    imports = ("tensorboardX",)  # imported when the loggers are resolved, before the run writes anything

    def __init__(self, run: LoggerRun):
        tensorboardx = _import("tensorboardX", "tensorboard")
        self.logdir = run.workdir / "tensorboard"
        if self.logdir.exists() and not self.logdir.is_dir():
            raise UserError(
                f"{str(self.logdir)!r} should be a directory (the TensorBoard logger's); move it away or pass "
                "another --workdir"
            )
        self.logdir.mkdir(parents=True, exist_ok=True)
        earlier = sorted(self.logdir.glob("events.out.tfevents.*"))
        if run.start_step == 0:
            for path in earlier:
                path.unlink()
            earlier = []
        # What the interrupted run wrote past the resumed step goes, and at that step what metrics.jsonl drops
        # too: the record of a run stopped between two logs, whose steps the resumed run's next record counts.
        kept = any(_on_interval(run, split) for split in ("train", "eval", "harness"))
        # TensorBoard reads a run's files in name order; names hold the time in whole seconds, so a
        # sequence number keeps a file written in the same second as the previous one after it.
        self._writer = tensorboardx.SummaryWriter(
            str(self.logdir),
            purge_step=(run.start_step + kept) if run.start_step > 0 else None,
            flush_secs=10,
            filename_suffix=f".{len(earlier):04d}",
        )
        if run.start_step == 0:
            config = yaml.safe_dump(dict(run.config), sort_keys=False)
            self._writer.add_text("config", "".join(f"    {line}\n" for line in config.splitlines()), 0)

    def log(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(f"{split}/{name}", float(value), step)
        if split != "train":
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# --------------------------------------------------------------------------- wandb


class WandbLogger:
    """A Weights & Biases run: metrics `train/<metric>` and `eval/<metric>` at each step.

    - Project `$WANDB_PROJECT` (default `nnx`), run name the work dir's name,
      the resolved config attached, the run's files under `<workdir>/wandb/`.
    - `$WANDB_MODE` (`online`, `offline`, `disabled`) decides where it goes;
      without it the run is online when W&B credentials are configured and
      the server answers, and offline otherwise (the reason is printed; upload
      later with `wandb sync <workdir>/wandb/offline-run-*`).
    - A resumed run continues the same W&B run: its id and the last step
      logged are kept in `<workdir>/wandb/nnx-run.json`. A W&B history cannot
      be rewound, so steps the run already has are skipped, not logged again.
    """

    requires = ("wandb>=0.31",)  # wandb.login(prompt=False)
    imports = ("wandb",)

    def __init__(self, run: LoggerRun):
        wandb = _import("wandb", "wandb")
        self._state_path = run.workdir / "wandb" / "nnx-run.json"
        previous = _read_state(self._state_path) if run.start_step > 0 else {}
        self._state = {"id": previous.get("id") or _new_run_id(), "step": previous.get("step", -1)}
        self._skip_through = self._state["step"]  # what the W&B run already holds
        mode, why_offline = _wandb_mode(wandb)
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "nnx",
                name=run.workdir.resolve().name,
                id=self._state["id"],
                resume="allow",
                dir=run.workdir,
                config=dict(run.config),
                mode=mode,
                settings=wandb.Settings(console="off"),  # no capture of stdout/stderr: the live bar owns them
            )
        except wandb.errors.Error as e:
            raise UserError(
                f"logger 'wandb' could not start its run: {first_line(e)} (set WANDB_MODE=offline to log offline)"
            ) from None
        _write_state(self._state_path, self._state)
        if why_offline:
            run.console.print(
                f"wandb: logging offline ({why_offline}); upload later with: wandb sync {Path(self._run.dir).parent}",
                highlight=False,
                soft_wrap=True,
            )

    def log(self, step: int, split: str, metrics: Mapping[str, float]) -> None:
        if step <= self._skip_through:
            return
        self._run.log({f"{split}/{name}": float(value) for name, value in metrics.items()}, step=step)
        if step > self._state["step"]:
            self._state["step"] = step
            _write_state(self._state_path, self._state)

    def close(self) -> None:
        self._run.finish()


def _wandb_mode(wandb: ModuleType) -> tuple[str, str]:
    """`(mode for wandb.init, why offline)`: `$WANDB_MODE` if set, else online only with a login and a network."""
    mode = os.environ.get("WANDB_MODE")
    if mode:  # passed on: wandb reads the environment once per process
        mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # older spellings
        if mode not in ("online", "offline", "disabled", "shared"):
            raise UserError(f"WANDB_MODE={mode!r} is not one of online, offline, disabled; fix or unset it")
        return mode, ""
    server = wandb.setup().settings.base_url
    if not _reachable(server):  # first: with no network, wandb.login spends seconds on retries
        return "offline", f"cannot reach {server}"
    if not wandb.login(prompt=False, verify=False):
        return "offline", "not logged in: run `wandb login` or set WANDB_API_KEY"
    return "online", ""


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to `url`'s host (or the proxy that serves it) opens within `timeout`."""
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxy_parts.hostname or host, proxy_parts.port or 80
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _new_run_id() -> str:
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(path: Path, state: Mapping[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(state) + "\n")
    partial.replace(path)


# --------------------------------------------------------------------------- optional packages


def _check_requirement(requirement: str, what: str) -> None:
    """`name` or `name>=version` is installed, or a UserError saying what to pip install."""
    import importlib.metadata

    name, _, minimum = (part.strip() for part in requirement.partition(">="))
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"config key {_KEY!r}: {what} needs the {name} package: pip install {name}") from None
    if minimum and _version(installed) < _version(minimum):
        raise UserError(
            f"config key {_KEY!r}: {what} needs {name}>={minimum}, found {installed}: pip install --upgrade "
            f"'{name}>={minimum}'"
        )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _import(module: str, logger: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"config key {_KEY!r}: logger {logger!r} needs the {module} package, which failed to import "
            f"({first_line(e)}): pip install --upgrade {module}"
        ) from None


LOGGERS.register("jsonl", JsonlLogger)
LOGGERS.register("console", ConsoleLogger)
LOGGERS.register("tensorboard", TensorBoardLogger)
LOGGERS.register("wandb", WandbLogger)
