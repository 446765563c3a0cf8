"""How JAX runs under the command-line tools: the persistent compilation cache, deterministic GPU kernels.

Compiling is most of a short run's time, and the same config compiles the
same programs every time, so every command keeps JAX's persistent
compilation cache on: in `$XDG_CACHE_HOME/nnx/jax` (`~/.cache/nnx/jax`) by
default, in the directory `NNX_COMPILATION_CACHE` names, or nowhere with
`NNX_COMPILATION_CACHE=off`. Its thresholds are lowered so that the small
programs of small models are cached too.

On Linux, the commands that compute (`nnx-train`, `nnx-eval`, `nnx-generate`,
`nnx-export`) start again at once, before importing anything, with glibc's
malloc asking the kernel for transparent huge pages (:func:`with_huge_pages`):
XLA's CPU runtime takes each step's temporaries from malloc afresh, and in
4 KiB pages a step of a 135M-parameter model faulted in 1.1 GB, 278,000
pages, every step. `NNX_HUGE_PAGES=off` leaves malloc as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

_ENV = "NNX_COMPILATION_CACHE"
_HUGE_PAGES = "NNX_HUGE_PAGES"
_TUNABLE = "glibc.malloc.hugetlb"
_RELAUNCHED = "NNX_RELAUNCHED"  # set in the environment of the process started again: never a second time


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


def with_huge_pages() -> None:
    """Start this process again (same PID, same arguments) with glibc's malloc asking for transparent huge pages,
    where that helps and has not been done: call it first thing in a command, before the heavy imports.

    glibc reads its tunables when a process starts, so only a new process image can take them. Where the
    kernel gives huge pages only on request (`madvise`, the common default), `glibc.malloc.hugetlb=1`
    makes malloc request them for its large blocks: a CPU training step then faults in a few hundred 2 MiB
    pages instead of some hundred thousand 4 KiB ones (`benchmarks/huge_pages.py`). Nothing happens with
    `NNX_HUGE_PAGES=off`, outside Linux and glibc 2.35 or later, where the kernel's setting is `always` or
    `never`, or where `GLIBC_TUNABLES` names the tunable already (the user's choice stands).
    """
    environment = huge_pages_environment(os.environ, transparent_huge_pages(), glibc_version())
    if environment is None:
        return
    if not sys.argv or not os.path.isfile(sys.argv[0]):  # `python -c ...`, an embedded interpreter: run as we are
        return
    original = list(getattr(sys, "orig_argv", []))  # with the interpreter's own options (`-X importtime`), if ours
    tail = original[len(original) - len(sys.argv) :] if len(original) > len(sys.argv) else []
    argv = [sys.executable, *(original[1:] if tail == sys.argv else sys.argv)]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, environment)
    except OSError:  # the interpreter cannot be started again: run as we are
        return


def huge_pages_environment(
    environ: Mapping[str, str], kernel: str | None, glibc: tuple[int, int] | None
) -> dict[str, str] | None:
    """`environ` with `glibc.malloc.hugetlb=1` added to `GLIBC_TUNABLES`, or None where it would change nothing
    (see :func:`with_huge_pages`). `kernel` is the kernel's transparent-huge-page mode, `glibc` its version."""
    if environ.get(_HUGE_PAGES, "").strip().lower() in ("off", "0", "false", "no") or _RELAUNCHED in environ:
        return None
    if kernel != "madvise" or glibc is None or glibc < (2, 35):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if _TUNABLE in _tunables(environ):
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{_TUNABLE}=1"])), _RELAUNCHED: "1"}


def huge_pages_active(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process's malloc asks for transparent huge pages (what `run.json` records)."""
    environ = os.environ if environ is None else environ
    if transparent_huge_pages() not in ("madvise", "always") or (glibc_version() or (0, 0)) < (2, 35):
        return False
    return _tunables(environ).get(_TUNABLE, "0") not in ("", "0")


def _tunables(environ: Mapping[str, str]) -> dict[str, str]:
    """`GLIBC_TUNABLES` (`name=value:name=value`) as a dict."""
    return dict(item.partition("=")[::2] for item in environ.get("GLIBC_TUNABLES", "").split(":") if item)


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`); None where it cannot be read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """The C library's version when it is glibc (None for musl, macOS, Windows)."""
    try:
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
    except (AttributeError, ValueError, OSError):
        return None
    parts = version.split(".")
    if name != "glibc" or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])
