"""Errors the command-line tools turn into exit codes.

Everything a user can get wrong (a config file, an override, a path, a name)
raises :class:`UserError`; the entry points print its one-line message and exit
with status 2, never a traceback. A run that starts and then fails (for example
a non-finite loss) raises :class:`RunError` and exits with status 1.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import gc
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

EXIT_USER_ERROR = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Bad input: a config key, a value, a path or a name. Exit status 2."""


class RunError(Exception):
    """A run that started but could not finish. Exit status 1."""


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`" (did you mean 'train.steps'?)"` for the closest choice, or `""` if none is close.

    >>> did_you_mean("setps", ["steps", "epochs"], prefix="train.")
    " (did you mean 'train.steps'?)"
    >>> did_you_mean("acc", ["loss", "accuracy"])
    " (did you mean 'accuracy'?)"
    """
    choices = list(choices)
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not match and len(word) >= 2:  # an abbreviation: `acc` for `accuracy`, when only one choice starts so
        starting = [choice for choice in choices if choice.startswith(word)]
        match = starting if len(starting) == 1 else []
    return f" (did you mean {prefix + match[0]!r}?)" if match else ""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message: third-party errors can run to pages."""
    return (str(error).strip().splitlines() or [""])[0]


WRITE_FIXES = {  # errno of a failed write -> what to do about it
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
    errno.EACCES: "make the directory writable",
    errno.EPERM: "make the directory writable",
    errno.EROFS: "remount the file system read-write",
}


_ANY_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write that fails so needs no file name to be understood


def cannot_write(path: Any, error: BaseException) -> str:
    """A failed write in the words every command uses: `cannot write PATH (why); what to do, then run again`."""
    cause, code = write_cause(error)
    fix = f"; {WRITE_FIXES[code]}, then run again" if code in WRITE_FIXES else ""
    return f"cannot write {path} ({cause}){fix}"


def check_can_create(path: Path, flag: str) -> None:
    """`flag`'s `path`, not written yet, can be made where it is to go: the nearest folder above it that exists
    is a folder this process may write in (the file, or the folder made beside it and renamed into place, and any
    missing folders between). Checked before the work, so a long export does not fail at its first write."""
    parent = path.absolute().parent
    above = next(p for p in (parent, *parent.parents) if p.exists())
    if not above.is_dir():
        raise UserError(f"{flag} {str(path)!r}: {above} is a file, not a directory; give a path under a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(
            f"{flag} {str(path)!r}: cannot write in {above} (permission denied, or a read-only file system); give a "
            "path under a directory you can write to"
        )


def write_cause(error: BaseException) -> tuple[str, int | None]:
    """What went wrong, in words, and its errno when there is one.

    Python's own writes raise OSError; TensorStore's (the array data) raise
    ValueError("... [os_error_code='28']"), sometimes as the cause of another error.
    """
    link: BaseException | None = error
    seen: set[int] = set()
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno:
            return os.strerror(link.errno), link.errno
        match = re.search(r"os_error_code='?(\d+)", str(link))
        if match:
            code = int(match.group(1))
            return os.strerror(code), code
        link = link.__cause__ or link.__context__
    return f"{type(error).__name__}: {first_line(error)}", None


def report_errors(fn: F) -> F:
    """Run an entry point, turning our errors into a message and an exit status."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None
        except RunError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_RUN_FAILED) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        except OSError as e:  # a write into the work dir failed mid-run: disk full, permission lost, ...
            if e.errno not in WRITE_FIXES or (e.filename is None and e.errno not in _ANY_WRITE):
                raise
            where = e.filename if e.filename is not None else "to disk"  # write() and flush() name no file
            print(f"error: {cannot_write(where, e)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_RUN_FAILED) from None
        except MemoryError:  # the host's memory, not a device's (that is XLA's RESOURCE_EXHAUSTED below)
            print("error: out of host memory (an allocation failed): ask for less (a smaller batch, fewer samples, "
                  "a shorter sequence), or free memory on this machine", file=sys.stderr, flush=True)  # fmt: skip
            raise SystemExit(EXIT_RUN_FAILED) from None
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            print(f"error: {out_of_memory_message(e)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_RUN_FAILED) from None

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def interrupts_after() -> Iterator[None]:
    """A Ctrl-C (SIGINT) while the block runs ends the process once the block is done: `interrupted`, exit 130.

    For a command's imports: a KeyboardInterrupt part-way through JAX's leaves an extension half-initialised,
    which raises an ImportError with a page of traceback, or crashes. A SIGINT that the shell ignores
    (`cmd &` in a script, `nohup`) stays ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED)


def interrupt_outside_collections() -> None:
    """Make SIGINT raise KeyboardInterrupt as Python's own handler does, but never where Python would print it
    as ignored and go on: a garbage-collector callback, a `__del__`, a weakref callback (JAX runs a callback at
    every collection, and a command compiling collects often: a Ctrl-C then did nothing). While a collection
    runs, or in a `__del__`, it is raised again 50 ms later; one that still lands where Python ignores it (a
    weakref callback outside a collection) is raised again 50 ms after that. Left alone where SIGINT is ignored
    or already has a handler of the command's."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
        signal.default_int_handler
    ):
        if _track_collections not in gc.callbacks:
            gc.callbacks.insert(0, _track_collections)
        if not isinstance(sys.unraisablehook, _ReraiseInterrupts):
            sys.unraisablehook = _ReraiseInterrupts(sys.unraisablehook)
        signal.signal(signal.SIGINT, _interrupt)


_collecting = False  # between a collection's "start" and "stop", where the weakref callbacks it runs swallow errors


def _track_collections(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


def _interrupt_later(signum: int = signal.SIGINT) -> None:
    import _thread

    later = threading.Timer(0.05, _thread.interrupt_main, (signum,))
    later.daemon = True
    later.start()


def _interrupt(signum: int, frame: Any) -> None:
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    deferred = _collecting
    while frame is not None and not deferred:
        deferred = frame.f_code in callbacks or frame.f_code.co_name == "__del__"
        frame = frame.f_back
    if deferred:
        _interrupt_later(signum)
        return
    raise KeyboardInterrupt


class _ReraiseInterrupts:
    """`sys.unraisablehook` that, for a KeyboardInterrupt Python could not raise, interrupts again shortly
    instead of printing it as ignored; anything else goes to the hook it wraps."""

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def __call__(self, unraisable: Any) -> None:
        if unraisable.exc_type is KeyboardInterrupt:
            _interrupt_later()
            return
        self.wrapped(unraisable)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA running out of device memory (at compile or at run time)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def out_of_memory_message(error: BaseException, advice: str | None = None) -> str:
    """One line: what XLA could not allocate, and the knobs that need less memory (`advice`: a command's own,
    else a training run's)."""
    text = str(error)
    found = re.search(r"allocat(?:e|ing) (\d+) bytes", text)  # XLA's CPU and GPU runtimes
    sized = re.search(r"allocate ([\d.]+) ?([KMGT])i?B", text)  # a GPU allocator's "8.00GiB"
    if found:
        needed = f"could not allocate {int(found.group(1)) / 2**30:.1f} GiB"
    elif sized:
        size = float(sized.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[sized.group(2)]
        needed = f"could not allocate {size / 2**30:.1f} GiB"
    else:
        needed = first_line(error)
    return f"out of device memory ({needed}); " + (
        advice
        or "need less per device: lower train.batch_size (train.grad_accum_steps keeps the global batch), recompute "
        "activations with model.remat=full (language models), or split the model over more devices with "
        "sharding.mesh"
    )


_READER_GONE = (errno.EPIPE, errno.EIO)  # a pipe whose reader left; a terminal that closed (SSH dropped)


class _Reader:
    """`sys.stdout` or `sys.stderr`, once whoever reads it may go away (`nnx-train cfg 2>&1 | head`, or the
    terminal of a closed SSH session, whose writes fail with EIO).

    A command whose product is files (a run, an export, a figure) goes on with its output sent to the null
    device: the reader leaving loses no checkpoint. One whose product is what it prints (a table, samples) ends
    there, with status 0: the reader has what it wanted.
    """

    def __init__(self, stream: Any, keep_going: bool):
        self._stream = stream
        self._keep_going = keep_going

    def _gone(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # later writes (and the interpreter's last flush) go nowhere
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        if not self._keep_going:
            os._exit(0)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            if e.errno not in _READER_GONE:
                raise
            self._gone()
            with contextlib.suppress(OSError):
                self._stream.write(text)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            if e.errno not in _READER_GONE:
                raise
            self._gone()
            with contextlib.suppress(OSError):
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run_app(app: Any, *, makes_files: bool = False) -> None:
    """Run a Typer app; a usage error (unknown option, bad option value, missing
    argument) is one `error:` line and exit 2 like every other bad input.

    `makes_files`: whether the command's product is files (nnx-train, nnx-eval's records, nnx-export,
    nnx-plot) rather than what it prints; it decides what a closed standard output does (:class:`_Reader`).

    The command has closed everything it opened (checkpoints, loggers, input
    workers) by the time it returns, so the process then ends at once
    (:func:`exit_now`) rather than through the interpreter's slow teardown,
    where background threads of a failed write can still print tracebacks.
    """
    sys.stdout = _Reader(sys.stdout, makes_files)
    sys.stderr = _Reader(sys.stderr, makes_files)
    from typer import Abort

    try:
        from typer._click.exceptions import ClickException  # newer Typer vendors Click
    except ImportError:
        from click.exceptions import ClickException

    try:
        code = app(standalone_mode=False)
    except ClickException as e:
        name = e.ctx.command_path if getattr(e, "ctx", None) is not None else "the command"
        print(f"error: {e.format_message()} (see {name} --help)", file=sys.stderr, flush=True)
        code = e.exit_code
    except Abort:
        print("interrupted", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_RUN_FAILED)
    exit_now(code if isinstance(code, int) else 0)


def exit_now(code: int) -> None:
    """End the process with `code` now, output flushed. A multi-process run that ended well (or stopped by
    agreement) shuts `jax.distributed` down together; after a failure the watchdog has stopped the others."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (0, EXIT_INTERRUPTED) and "jax" in sys.modules:
        from jax._src import distributed

        if distributed.global_state.client is not None:
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to agree with
                distributed.global_state.shutdown()
    os._exit(code)
