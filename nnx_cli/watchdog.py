"""Stop every process of a multi-process run soon after one of them fails.

On its own, JAX lets the others wait: in a collective until the peer's
connection drops, in a barrier until it times out, then at exit in
`jax.distributed.shutdown`'s barrier until the coordination service misses
the dead process's heartbeats (100 s by default). When process 0 dies, the
service dies with it and every other process aborts from C++ with a stack
trace.

Here every other process holds a TCP link to process 0 (its port is
exchanged through JAX's key-value store when the watchdog starts):

- a process that fails says so on its link ("failed: <message>"), and process
  0 passes it on to everyone else;
- a process that dies without a word (SIGKILL, a crash) is noticed by the
  other end at once: its kernel closes the link. TCP keepalive notices a
  host that vanished within about `timeout` seconds;
- a process that ends normally says "done" first.

A daemon thread reads the links, whatever the main thread is doing (in a
collective, a barrier, compiling). On a failure elsewhere, it prints one
`error:` line naming the failed process and ends the process with status 1
without JAX's exit barrier. A process that fails itself exits with its own
status, also without that barrier. Nothing here needs the coordination
service after start-up: it dies with process 0, and once it has, JAX's
client no longer answers.

A process publishes its own failure with :func:`fail`, or by leaving a
:func:`watching` block with an exception or a non-zero exit; a process that
exits without :func:`finish` (or the normal end of a `watching` block)
counts as failed::

    jax.distributed.initialize(coordinator, num_processes, process_id)
    watchdog.start()                 # every process, right after initialize; a no-op with one process
    with watchdog.watching():        # an exception or sys.exit(n) in here is published to the others
        train()
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import json
import os
import selectors
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from nnx_cli.errors import EXIT_INTERRUPTED, EXIT_RUN_FAILED, EXIT_USER_ERROR, RunError, UserError, first_line

_PORT_KEY = "nnx/watchdog/port"  # where process 0 listens for the other processes' links


@dataclasses.dataclass
class Watchdog:
    """One process's watchdog (see the module docstring).

    `client` is JAX's distributed client (for the port exchange at start only);
    `host` is where the other processes reach process 0: the coordinator's host.
    """

    client: Any
    process: int
    count: int
    host: str
    timeout: float = 10.0  # seconds of silence from a peer's host (TCP keepalive) before it counts as gone
    probe: float = 0.5  # seconds a failing process waits for a failure elsewhere that would explain its own
    linger: float = 2.0  # seconds process 0 stays up after a failure, until the others have left

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._stopping = threading.Lock()  # taken once, by the thread that ends the process
        self._failing = False
        self._finished = False
        self._status = EXIT_RUN_FAILED
        self._elsewhere: dict | None = None  # the first failure of another process: {"process", "what"}
        self._heard = threading.Event()  # set with `_elsewhere`
        self._links: dict[socket.socket, _Peer] = {}  # process 0: one per other process
        self._link: socket.socket | None = None  # the other processes: theirs to process 0

    # ------------------------------------------------------------------ what the program calls

    def start(self, connect_timeout: float = 300.0) -> Watchdog:
        """Link to process 0 (process 0: listen for the others), then watch in a daemon thread."""
        _delay_aborts()
        if self.process == 0:
            server = _listen()
            self.client.key_value_set(_PORT_KEY, str(server.getsockname()[1]))
            threading.Thread(target=self._serve, args=(server,), name="nnx-watchdog", daemon=True).start()
        else:
            port = int(self.client.blocking_key_value_get(_PORT_KEY, int(connect_timeout * 1000)))
            self._link = socket.create_connection((self.host, port), timeout=connect_timeout)
            self._link.settimeout(None)
            _keepalive(self._link, self.timeout)
            _send(self._link, {"hello": self.process})
            threading.Thread(target=self._follow, name="nnx-watchdog", daemon=True).start()
        atexit.register(self._at_exit)  # after JAX's own hook, so it runs before JAX's exit barrier
        return self

    def fail(self, message: str, status: int = EXIT_RUN_FAILED, *, probe: bool = True) -> None:
        """Tell the others "process i failed: message"; this process then exits with `status`.

        With `probe`, first wait up to `probe` seconds for news of a failure
        elsewhere that explains this one (a collective fails at once when a
        peer dies; process 0 hears of that death as fast): if some comes, this
        process stops at once with a line naming that peer instead.
        """
        with self._lock:
            if self._failing or self._finished:
                return
            self._failing, self._status = True, status
        if probe:
            self._heard.wait(self.probe)
        ours = f"failed: {message}"
        found = self._elsewhere
        if found is not None and found["what"] != ours:  # the same failure everywhere: each reports its own
            self._stop(self._describe(found), found["process"])
        if self.process == 0:
            self._broadcast({"stop": {"process": 0, "what": ours}})
        else:
            _send(self._link, {"failed": message})

    def finish(self) -> None:
        """This process ends normally: its link closing from now on is no failure."""
        with self._lock:
            if self._failing or self._finished:
                return
            self._finished = True
        if self.process == 0:
            self._broadcast({"done": True})
        else:
            _send(self._link, {"done": True})

    @contextlib.contextmanager
    def watching(self) -> Iterator[Watchdog]:
        """Publish the failure that leaves this block (an exception, or `sys.exit(n)` with n != 0); finish otherwise."""
        try:
            yield self
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_RUN_FAILED)
            if code == 0:
                self.finish()
            else:
                self.fail(f"exited with status {code}", code, probe=False)
            raise
        except KeyboardInterrupt:
            self.fail("interrupted", EXIT_INTERRUPTED, probe=False)
            raise
        except (UserError, RunError) as e:  # often met by every process alike: each waits to say its own (probe)
            self.fail(first_line(e), EXIT_USER_ERROR if isinstance(e, UserError) else EXIT_RUN_FAILED)
            raise
        except BaseException as e:
            self.fail(f"{type(e).__name__}: {first_line(e)}")
            raise
        else:
            self.finish()

    # ------------------------------------------------------------------ the threads

    def _serve(self, server: socket.socket) -> None:
        """Process 0: accept the links and read them; a failure on one is passed on to all the others."""
        selector = selectors.DefaultSelector()
        selector.register(server, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is server:
                    conn, _ = server.accept()
                    conn.settimeout(self.linger)  # reads only follow select(); this bounds sendall
                    _keepalive(conn, self.timeout)
                    with self._lock:
                        self._links[conn] = _Peer()
                    if self._finished:
                        _send(conn, {"done": True})
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                peer = self._links[conn]
                try:
                    data, lost = conn.recv(65536), False
                except OSError:  # ECONNRESET, or ETIMEDOUT: keepalive probes went unanswered
                    data, lost = b"", True
                for message in peer.read(data):
                    if "hello" in message and isinstance(message["hello"], int):
                        peer.process = message["hello"]
                    elif "done" in message:
                        peer.said = "done"
                    elif "failed" in message and peer.process is not None:
                        peer.said = "failed"
                        self._heard_of(peer.process, f"failed: {message['failed']}")
                if data:
                    continue
                selector.unregister(conn)
                conn.close()
                with self._lock:
                    del self._links[conn]
                    self._lock.notify_all()
                if peer.process is not None and peer.said is None:
                    why = f"its host stopped answering for {self.timeout:.0f} s" if lost else "killed, or crashed"
                    self._heard_of(peer.process, f"stopped without a word ({why})")

    def _heard_of(self, process: int, what: str) -> None:
        """Process 0: another process failed. Stop (unless failing already), in a thread of its own:
        this one must go on reading the links while process 0 waits for the others to leave."""
        with self._lock:
            if self._elsewhere is not None:
                return
            self._elsewhere = {"process": process, "what": what}
            failing = self._failing
        self._heard.set()
        if not failing:
            threading.Thread(target=self._stop, args=(self._describe(self._elsewhere), process), daemon=True).start()

    def _follow(self) -> None:
        """The other processes: read the link to process 0; it closing without "done" means process 0 is gone."""
        assert self._link is not None
        peer, lost = _Peer(), False
        while True:
            try:
                data = self._link.recv(65536)
            except OSError:
                data, lost = b"", True
            for message in peer.read(data):
                if "done" in message:
                    peer.said = "done"
                elif "stop" in message:
                    with self._lock:
                        self._elsewhere = self._elsewhere or message["stop"]
                        failing = self._failing
                    self._heard.set()
                    if not failing:
                        self._stop(self._describe(message["stop"]), message["stop"]["process"])
            if not data:
                break
        if peer.said is not None:
            return
        why = "its host stopped answering" if lost else "killed, or crashed"
        gone = {"process": 0, "what": f"stopped without a word ({why}), and the jax.distributed coordinator with it"}
        with self._lock:
            self._elsewhere = self._elsewhere or gone
            failing = self._failing
        self._heard.set()
        if not failing:
            self._stop(self._describe(gone), 0)

    def _stop(self, line: str, failed: int) -> NoReturn:
        """Print why and leave, without JAX's exit barrier. Process 0 first tells the others and
        waits (at most `linger` seconds) until they have left."""
        self._stopping.acquire()  # a second caller waits here for the first one's os._exit
        os.write(2, f"error: {line}; stopping process {self.process} too\n".encode())
        if self.process == 0:
            self._broadcast({"stop": self._elsewhere or {"process": failed, "what": line}}, skip=failed)
            self._await_departures()
        os._exit(EXIT_RUN_FAILED)

    def _at_exit(self) -> None:
        if self._finished:
            return  # a normal end: JAX's exit barrier is where every process meets
        self.fail("exited before the run finished")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if self.process == 0:
            self._await_departures()
        os._exit(self._status)

    def _broadcast(self, message: dict, skip: int | None = None) -> None:
        with self._lock:
            links = [conn for conn, peer in self._links.items() if peer.process != skip]
        for conn in links:
            _send(conn, message)

    def _await_departures(self) -> None:
        """Process 0: wait until the other processes' links have closed, at most `linger` seconds."""
        with self._lock:
            self._lock.wait_for(lambda: not self._links, timeout=self.linger)

    def _describe(self, found: dict) -> str:
        return f"process {found['process']} of {self.count} {found['what']}"


class _Peer:
    """What one end of a link has read: JSON messages, one per line."""

    def __init__(self) -> None:
        self.process: int | None = None
        self.said: str | None = None  # "done" or "failed": the link may close now
        self._buffer = b""

    def read(self, data: bytes) -> list[dict]:
        """The complete messages in what was read so far (anything else on the port is ignored)."""
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        messages = []
        for line in lines:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict):
                    messages.append(message)
        return messages


def _send(conn: socket.socket | None, message: dict) -> None:
    if conn is None:
        return
    with contextlib.suppress(OSError):  # the other end is gone: its link tells its own story
        conn.sendall(json.dumps(message).encode() + b"\n")


_current: Watchdog | None = None


def start(*, timeout: float = 10.0) -> Watchdog | None:
    """Start this process's watchdog after `jax.distributed.initialize`; None in a single-process run.

    Every process of the run must call it (the others link to process 0 here)::

        jax.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=1)
        watchdog.start()
    """
    global _current
    import jax
    from jax._src import distributed

    state = distributed.global_state
    if jax.process_count() == 1 or state.client is None:
        return None
    if _current is None:
        host = state.coordinator_address.rpartition(":")[0].strip("[]")
        _current = Watchdog(state.client, jax.process_index(), jax.process_count(), host, timeout).start()
    return _current


@contextlib.contextmanager
def watching() -> Iterator[Watchdog | None]:
    """:meth:`Watchdog.watching` of the started watchdog; nothing in a single-process run."""
    if _current is None:
        yield None
    else:
        with _current.watching() as dog:
            yield dog


def fail(message: str, status: int = EXIT_RUN_FAILED, *, probe: bool = True) -> None:
    """:meth:`Watchdog.fail` of the started watchdog; nothing in a single-process run."""
    if _current is not None:
        _current.fail(message, status, probe=probe)


def finish() -> None:
    """:meth:`Watchdog.finish` of the started watchdog; nothing in a single-process run."""
    if _current is not None:
        _current.finish()


def _listen() -> socket.socket:
    """A listening socket on every interface, on a free port (IPv6 and IPv4 where the host has both)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


def _keepalive(conn: socket.socket, timeout: float) -> None:
    """Let the kernel probe an idle link, so that a peer whose host vanished is noticed within ~`timeout` s."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probes = 3
    for name, value in (
        ("TCP_KEEPIDLE", max(1, int(timeout / 2))),
        ("TCP_KEEPINTVL", max(1, int(timeout / 2 / probes))),
        ("TCP_KEEPCNT", probes),
    ):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _delay_aborts() -> None:
    """Make `abort()` wait a few seconds before it ends the process.

    When process 0 dies, JAX's client thread in every other process logs a
    fatal error and calls abort() at once, racing this process's link thread,
    which would say which process failed and exit with status 1. With libc's
    `sleep` as the SIGABRT handler, abort() first sleeps 6 seconds (a handler
    receives its signal number, SIGABRT = 6, and sleep takes seconds), so the
    link thread wins; an abort for any other reason still ends the process,
    6 seconds later.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signal.SIGABRT, ctypes.cast(libc.sleep, ctypes.c_void_p))
    except (OSError, AttributeError):  # no C library to ask (Windows): aborts stay immediate
        pass
