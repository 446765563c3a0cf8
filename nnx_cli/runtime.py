"""How JAX runs under the command-line tools: the persistent compilation cache, deterministic GPU kernels.

Compiling is most of a short run's time, and the same config compiles the
same programs every time, so every command keeps JAX's persistent
compilation cache on: in `$XDG_CACHE_HOME/nnx/jax` (`~/.cache/nnx/jax`) by
default, in the directory `NNX_COMPILATION_CACHE` names, or nowhere with
`NNX_COMPILATION_CACHE=off`. Its thresholds are lowered so that the small
programs of small models are cached too.
"""

from __future__ import annotations

import os
from pathlib import Path

_ENV = "NNX_COMPILATION_CACHE"


def compilation_cache_dir() -> Path | None:
    """Where compiled programs are kept (None: `NNX_COMPILATION_CACHE=off`)."""
    setting = os.environ.get(_ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "none"):
        return None
    if setting:
        return Path(setting).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "nnx" / "jax"


def preload(*modules: str) -> None:
    """Import `modules` in a background thread: a module needed later loads while the main thread waits on
    the devices (an import of it in the main thread meanwhile waits for this one, it is not repeated)."""
    import importlib
    import threading

    def load() -> None:
        for name in modules:
            importlib.import_module(name)

    threading.Thread(target=load, name="nnx-preload", daemon=True).start()


def configure(*, deterministic: bool = False) -> None:
    """Set up JAX for a command: the compilation cache, and with `deterministic` XLA's deterministic GPU ops.

    Call it before the first computation (deterministic ops must be chosen
    before the GPU backend starts).
    """
    import jax

    if deterministic and "--xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    PHASES.listen_to_compiles()
    directory = compilation_cache_dir()
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    cache_compilations(directory)


def cache_compilations(directory: str | Path) -> None:
    """Keep every compiled program in JAX's persistent cache in `directory`, however small or quick to compile
    (JAX's own thresholds skip those: most of a small model's)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_COMPILE_EVENTS = (  # tracing, lowering, and XLA compiling or loading from the persistent cache
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class Phases:
    """Where a command's time goes: named phases in seconds, plus JAX's own tracing and compiling.

    `with phases("data"): ...` adds the block's wall time to "data";
    compiling (tracing, lowering, XLA, or loading from the persistent cache)
    is summed from JAX's monitoring events into "compile", wherever it
    happens. `started` is when the command's process started, so "import" is
    the time before the command's code ran.
    """

    def __init__(self) -> None:
        import time

        self.seconds: dict[str, float] = {}
        self.started = _process_start() or time.time()
        self._listening = False

    def listen_to_compiles(self) -> None:
        import jax

        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._listening = True

    def _on_event(self, event: str, duration: float, **kwargs: object) -> None:
        if event in _COMPILE_EVENTS:
            self.add("compile", duration)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def __call__(self, name: str) -> _Timed:
        return _Timed(self, name)

    def since_start(self) -> float:
        import time

        return time.time() - self.started


class _Timed:
    """A block's wall time, less the compiling done inside it (which goes to "compile")."""

    def __init__(self, phases: Phases, name: str):
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        import time

        self.start = time.perf_counter()
        self.compiled = self.phases.seconds.get("compile", 0.0)

    def __exit__(self, *exc: object) -> None:
        import time

        compiled = self.phases.seconds.get("compile", 0.0) - self.compiled
        self.phases.add(self.name, time.perf_counter() - self.start - compiled)


def _process_start() -> float | None:
    """When this process started, on the `time.time()` clock, from /proc where there is one."""
    import time

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # starttime: clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


PHASES = Phases()


def timings() -> dict[str, float]:
    """The phases of this command so far, in seconds: import, data, compile, train, eval, checkpoint, other, total.

    Each phase is net of the compiling done in it: `train` is the loop's
    time outside evals, checkpoints and compiling; `other` is what remains (checking the config, building
    the model abstractly, placing the state, logging).
    """
    s = PHASES.seconds
    train = s.get("loop", 0.0) - s.get("eval", 0.0) - s.get("checkpoint", 0.0)  # each net of its compiling
    out = {name: s.get(name, 0.0) for name in ("import", "data", "compile")}
    out.update(train=max(train, 0.0), eval=s.get("eval", 0.0), checkpoint=s.get("checkpoint", 0.0))
    total = PHASES.since_start()
    out["other"] = max(total - sum(out.values()), 0.0)
    out["total"] = total
    return {k: round(v, 3) for k, v in out.items()}


def breakdown() -> str:
    """`timings()` as one line: `2.5 s: import 0.9, data 0.1, compile 0.4, train 0.6, ...`."""
    t = timings()
    return f"{t.pop('total'):.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items())
