"""Several processes as one run: joining `jax.distributed`, barriers, and agreeing on when to stop.

A run of N processes (one per host, or one per GPU under SLURM) is the same
program on every process: each feeds its own rows of every global batch, and
every process must run exactly the same steps, or a collective waits forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import EXIT_INTERRUPTED, UserError, first_line


def init(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process run through `jax.distributed.initialize`.

    Either from the flags (or `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
    `JAX_PROCESS_ID`), where JAX fills in what a cluster manager it knows
    provides; or, with no flags, inside a SLURM or Open MPI job of more than
    one task, entirely from that job's environment. Otherwise a single process.
    """
    import jax

    from nnx_cli import watchdog

    if coordinator is None and num_processes is None and process_id is None:
        if cluster_tasks() > 1:
            jax.distributed.initialize()
            watchdog.start()
        return
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not (host and port.isdigit()):
            raise UserError(
                f"--coordinator {coordinator!r} must be HOST:PORT, for example 10.0.0.1:1234 (the address of process 0)"
            )
        if not 1 <= int(port) <= 65535:  # above it: a traceback from the port check; 0: waited for ever
            raise UserError(f"--coordinator {coordinator}: the port must be in 1-65535 (the same for every process)")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        raise UserError(
            f"--process-id {process_id} is out of range: processes are numbered 0 to N-1 for --num-processes N "
            f"({num_processes})"
        )
    if coordinator is not None and process_id == 0:
        _check_port_free(coordinator)
    try:
        with _signals_end_the_wait(), _said_while_waiting(coordinator, num_processes):
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=JOIN_TIMEOUT_S,
            )
    except ValueError as e:  # JAX found no cluster manager to fill in what is missing
        raise UserError(
            f"cannot start a multi-process run ({e}): pass all of --coordinator HOST:PORT, --num-processes N and "
            f"--process-id I, or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
        ) from None
    except Exception as e:  # the coordinator could not be reached, or not every process joined in time
        raise UserError(f"cannot join the multi-process run at --coordinator {coordinator}: {first_line(e)}") from None
    _check_device_counts()
    watchdog.start()  # a process that fails from here on stops the others within seconds


def _check_device_counts() -> None:
    """A UserError, on every process, when the processes hold different numbers of devices: JAX's collectives
    across processes need the same number on each, and the first one ended in a reshape traceback."""
    import collections

    import jax

    counts = collections.Counter(device.process_index for device in jax.devices())
    if len(set(counts.values())) > 1:
        from jax._src import distributed

        # every process leaves `jax.distributed` together before any ends: process 0 ending takes the coordination
        # service with it, and a peer still connected to it aborted in C++ (exit 134), even after a barrier passed
        # together, when it was slower to exit than process 0. The shutdown is itself a barrier of the service (a
        # collective of the devices is what cannot run), after which no process polls the service any more.
        distributed.global_state.shutdown()
        held = ", ".join(f"process {p} has {n}" for p, n in sorted(counts.items()))
        raise UserError(
            f"the processes of this run hold different numbers of devices ({held}); give each the same number "
            "(CUDA_VISIBLE_DEVICES, or XLA_FLAGS=--xla_force_host_platform_device_count on CPUs)"
        )


JOIN_TIMEOUT_S = 300  # how long `jax.distributed.initialize` waits for every process (JAX's default)
SAY_WAITING_AFTER_S = 10.0  # a join taking longer than this says what it waits for


def _check_port_free(coordinator: str) -> None:
    """A UserError when process 0 cannot serve the coordinator on the port of `coordinator`: JAX's server then
    logged one gRPC line and the process crashed (a segmentation fault), while the others waited five minutes."""
    import errno
    import socket

    port = int(coordinator.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a finished run left in TIME_WAIT is free
        try:
            probe.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (a privileged port, say): JAX says what it finds
            raise UserError(
                f"--coordinator {coordinator}: port {port} is in use on this machine (another run's coordinator?); "
                "give every process of this run another port"
            ) from None


@contextlib.contextmanager
def _said_while_waiting(coordinator: str | None, num_processes: int | None) -> Iterator[None]:
    """Say what a join waits for once it has taken `SAY_WAITING_AFTER_S`, and end the process with one line just
    before JAX's deadline: there JAX aborts the process with a C++ check failure and a stack trace (exit 134)."""
    import threading

    where = f" at --coordinator {coordinator}" if coordinator else ""
    count = f"the {num_processes} processes" if num_processes else "every process"

    def say_waiting() -> None:
        print(f"waiting for {count} of this run to join{where} (up to {JOIN_TIMEOUT_S} s)", file=sys.stderr,
              flush=True)  # fmt: skip

    def give_up() -> None:
        print(f"error: cannot join the multi-process run{where}: not every process joined within {JOIN_TIMEOUT_S} s; "
              "start each process with the same --coordinator and --num-processes, and its own --process-id",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(2)

    timers = [threading.Timer(SAY_WAITING_AFTER_S, say_waiting), threading.Timer(JOIN_TIMEOUT_S - 5, give_up)]
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        for timer in timers:
            timer.cancel()


@contextlib.contextmanager
def _signals_end_the_wait() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP at their default action while `jax.distributed.initialize` waits for every process to
    join: it waits in C++ (up to five minutes), where no Python handler runs, so Ctrl-C or a scheduler's SIGTERM
    would not stop a process whose peers never came."""
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in _handled()}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def cluster_tasks() -> int:
    """Processes in the SLURM or Open MPI job this process belongs to (1 outside one)."""
    for var in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):  # set for each task that srun / mpirun starts
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def barrier(name: str) -> None:
    """Wait until every process reaches this point (nothing to wait for in a single-process run)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def check_same(parts: dict[str, Any], fix: str) -> None:
    """Every process holds the same `parts` (JSON-able values by name): a UserError naming the parts that differ
    from process 0's. Processes that disagree on what to run (another train.steps on one command line, another
    copy of the data) compiled other programs, whose collectives then waited on each other for ever."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(parts)
    digests = [hashlib.sha256(json.dumps(parts[n], sort_keys=True, default=str).encode()).digest()[:4] for n in names]
    mine = np.frombuffer(b"".join(digests), np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(names))
    differ = {names[i]: [p for p in range(len(every)) if every[p, i] != every[0, i]] for i in range(len(names))}
    differ = {name: processes for name, processes in differ.items() if processes}
    if differ:
        # every process raises the same error: met here first, so that none hears of another's before its own
        # (the watchdog then stops it as a peer's failure, exit 1, where each should say its own, exit 2)
        barrier("nnx-train: processes compared")
        said = "; ".join(
            f"{name} on process{'es' * (len(p) > 1)} {', '.join(map(str, p))}" for name, p in differ.items()
        )
        raise UserError(f"the processes of this run disagree with process 0 on {said}: {fix}")


class SharedDirCheck:
    """That every process sees the same work dir: process 0 writes a mark in it, and after a barrier each
    process reports what it reads there (:meth:`check`). Checkpoints are written by every process together, into
    one directory; on hosts without a shared file system each process wrote into a directory of its own, and the
    run waited for ever after its first eval, without a word."""

    NAME = ".nnx-processes"

    def __init__(self, workdir: Path):
        import jax

        self.path = workdir / self.NAME
        self.active = jax.process_count() > 1
        if self.active and is_main():
            self.path.write_text(os.urandom(8).hex())

    def check(self) -> None:
        if not self.active:
            return
        try:
            mark = self.path.read_text()
        except OSError:
            mark = None
        try:
            check_same(
                {"what they find in the work dir": mark},
                f"put --workdir on a file system every process sees (NFS, Lustre, a bucket mount): process 0 wrote "
                f"{self.NAME} in {self.path.parent}, where the others do not find it; the processes write each "
                "checkpoint together, into one directory",
            )
        finally:
            if is_main():
                self.path.unlink(missing_ok=True)


def is_main() -> bool:
    """Whether this is process 0, the one that writes logs, metrics and images."""
    import jax

    return jax.process_index() == 0


class Signals:
    """What SIGINT, SIGTERM and SIGHUP (unless `nohup` ignores it) do during a run.

    Until the training loop starts nothing would be lost, so a signal ends the
    process at once (exit 130). In the loop the first signal asks to stop
    after the current dispatch, which writes a checkpoint; a second one ends
    the process at once (the last committed checkpoint stays intact: Orbax
    commits by renaming a finished directory).

    In a multi-process run every process must stop after the same step, so
    the processes compare flags (:meth:`agreed`) at fixed steps.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self.in_loop = False

    def __enter__(self) -> Signals:
        self._previous = {s: signal.signal(s, self._handle) for s in _handled()}
        return self

    def reclaim(self) -> None:
        """Take the signals back after `jax.distributed.initialize`: JAX's preemption notifier installs itself
        on SIGTERM there, and only logs it, so a SIGTERM (SLURM's, Kubernetes') would not stop the run."""
        if hasattr(self, "_previous"):
            for s in self._previous:
                signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.in_loop:
            exit_now(signum)
        if self.signal is not None:
            exit_now(signum, "again: stopped without a checkpoint of the steps since the last one")
        self.signal = signum
        # Said at once: the dispatch under way (many steps, or a compile) can take seconds to finish.
        say_at_signal(f"{name}: stopping after the steps under way to write a checkpoint ({name} again stops at "
                      "once, without one)")  # fmt: skip

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def agreed(self) -> bool:
        """Whether to stop now; the same answer on every process (call it at the same steps on all of them)."""
        import jax

        if jax.process_count() == 1:
            return self.signal is not None
        from jax.experimental import multihost_utils

        votes = multihost_utils.process_allgather(np.int32(self.signal or 0))
        self.signal = self.signal or int(votes.max()) or None
        return self.signal is not None


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _handled() -> list[signal.Signals]:
    """The signals a run stops on: Ctrl-C, SIGTERM (schedulers), and SIGHUP (the terminal or SSH session closed,
    which would otherwise kill the run without a checkpoint), unless SIGHUP is ignored (`nohup`): then it stays
    ignored."""
    return [s for s in _SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]


_AT_SIGNAL_EXIT: list[Callable[[], None]] = []


def at_signal_exit(undo: Callable[[], None]) -> Callable[[], None]:
    """Run `undo` if a signal ends the process at once (:func:`exit_now`, which skips every `finally`); returns
    the function that forgets it. `nnx-train --no-resume` puts the earlier run back this way."""
    _AT_SIGNAL_EXIT.append(undo)
    return lambda: _AT_SIGNAL_EXIT.remove(undo) if undo in _AT_SIGNAL_EXIT else None


def exit_now(signum: int, why: str = "") -> None:
    """Leave without unwinding: raising into JAX's compiler or Orbax's threads can crash the interpreter. `why`
    follows the signal's name in the message."""
    from nnx_cli import watchdog

    with contextlib.suppress(Exception):  # the signal may have come inside a write of stdout itself
        sys.stdout.flush()
    for undo in reversed(_AT_SIGNAL_EXIT):
        with contextlib.suppress(Exception):  # nothing may stop the exit
            undo()
    say_at_signal(f"interrupted by {signal.Signals(signum).name}{' ' + why if why else ''}")
    watchdog.fail(f"interrupted by {signal.Signals(signum).name}", EXIT_INTERRUPTED, probe=False)
    os._exit(EXIT_INTERRUPTED)


def say_at_signal(line: str) -> None:
    """Write `line` to stderr from a signal handler: through its file descriptor, after what its buffer holds. The
    handler runs between two bytecodes of the main thread, which may be inside a write or flush of sys.stderr
    itself: a print there raised `RuntimeError: reentrant call inside <_io.BufferedWriter name=2>`, a traceback
    and exit 1 in place of exit 130."""
    with contextlib.suppress(Exception):  # the interrupted write goes on once the handler returns, if it does
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))
