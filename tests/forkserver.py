"""A fork server for the tests that run the console scripts: their imports paid once, not once per command.

A small run spends most of its time importing (JAX, Orbax, datasets, Grain, nnx_cli: about 2 s on two
cores). `python tests/forkserver.py SOCKET` imports them once and listens; a shim (:func:`write_shims`: the
documentation's shell has them first on its PATH, `cli_support.cli` runs them) hands a command's arguments,
working directory, environment and stdin / stdout / stderr to the server, which forks a process that runs
the command's real `main()` with them, and returns its exit status. The command runs in a fresh process of
its own as it would from the shell; only its imports are already done. JAX's backend is never initialised
in the server, so each command's devices (`XLA_FLAGS`) are its own; what the libraries read from the
environment when imported is the server's, so a command whose JAX settings (`JAX_*`) differ from the
server's must not come here (:meth:`ForkServer.serves`), and the Hugging Face libraries' cache locations are
read again from each command's environment. A command whose shim goes away (a test's timeout killed it) is
killed with its process group; its interrupt, termination and hangup signals are passed on to the command.

Protocol, per connection: the shim sends one JSON line `{"argv", "cwd", "env"}` with its three standard
file descriptors attached (SCM_RIGHTS); the server replies with one line, the exit status. With
`NNX_DOCS_CPU_LOG=FILE` in the tests' environment, each command's CPU seconds are appended to FILE: where
the documentation tests spend their time.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PRELOAD = (
    "jax",
    "jax.numpy",
    "optax",
    "orbax.checkpoint",
    "datasets",
    "grain",
    "safetensors",
    "tokenizers",
    "nnx",
    "nnx_cli.commands.train",
    "nnx_cli.commands.eval",
    "nnx_cli.commands.generate",
    "nnx_cli.commands.inspect",
    "nnx_cli.commands.export",
    "nnx_cli.commands.plot",
    "nnx_cli.experiment",
    "nnx_cli.steps",
    "nnx_cli.checkpoint",
    "nnx_cli.data",
    "nnx_cli.hf",
)


def console_scripts() -> dict[str, str]:
    """`[project.scripts]` of pyproject.toml: command -> `module:function`."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, flags=re.MULTILINE | re.DOTALL)
    out = {}
    for line in (section.group(1) if section else "").splitlines():
        match = re.match(r'^\s*([\w.-]+)\s*=\s*"([\w.:]+)"', line)
        if match:
            out[match.group(1)] = match.group(2)
    return out


_SHIM = """#!{python} -I
import json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect({socket!r})
request = json.dumps({{"argv": [{name!r}, *sys.argv[1:]], "cwd": os.getcwd(), "env": dict(os.environ)}})
socket.send_fds(s, [request.encode() + b"\\n"], [0, 1, 2])
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # passed on to the command
    signal.signal(signum, lambda signum, frame: s.send(bytes([signum])))
reply = s.makefile().readline()
sys.exit(int(reply) if reply.strip() else 1)
"""


def write_shims(directory: Path, socket_path: str) -> None:
    """An executable per console script in `directory` that runs the command through the server."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in console_scripts():
        path = directory / name
        path.write_text(_SHIM.format(python=sys.executable, socket=socket_path, name=name))
        path.chmod(0o755)


def _run(argv: list[str], cwd: str, env: dict[str, str]) -> None:
    """In the forked process: become the command and run it; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, so that the server can stop it with whatever it started
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for module in ("huggingface_hub.constants", "datasets.config"):  # their cache paths, from HF_HOME
            if module in sys.modules:
                importlib.reload(sys.modules[module])
        sys.argv = argv
        module_name, _, function = console_scripts()[os.path.basename(argv[0])].partition(":")
        getattr(importlib.import_module(module_name), function)()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(connection: socket.socket) -> None:
    """In a forked process per connection: fork the command, wait for it, reply with its status."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    buffer = message
    while not buffer.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            break
        buffer += more
    request = json.loads(buffer)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        sys.stdin = os.fdopen(0, "r", closefd=False)
        sys.stdout = os.fdopen(1, "w", closefd=False)
        sys.stderr = os.fdopen(2, "w", closefd=False)
        _run(request["argv"], request["cwd"], request["env"])
    for fd in fds:
        os.close(fd)
    exited = os.pidfd_open(pid)
    while True:
        readable, _, _ = select.select([connection, exited], [], [])
        if exited in readable:
            break
        signals = connection.recv(16)
        if not signals:  # the shim is gone (killed): so is the command
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os._exit(0)
        for signum in signals:  # the shim's signals, for the command
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if os.environ.get("NNX_DOCS_CPU_LOG"):  # where the time goes: one line per command, its CPU seconds
        with open(os.environ["NNX_DOCS_CPU_LOG"], "a", errors="backslashreplace") as log:  # argv may not be UTF-8
            log.write(f"{usage.ru_utime + usage.ru_stime:.2f} {' '.join(request['argv'])}\n")
    connection.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
    os._exit(0)


class ForkServer:
    """A server started from this process, with the environment `env`, and its shims in a directory of their own;
    stopped at exit::

        server = ForkServer(env)
        if server.serves("nnx-train", command_env):
            subprocess.run([server.shim("nnx-train"), "config.yaml"], env=command_env)
    """

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        self.base = Path(tempfile.mkdtemp(prefix="nnx-forkserver-"))
        self.bin, socket_path = self.base / "bin", str(self.base / "server.sock")
        self.process = subprocess.Popen([sys.executable, __file__, socket_path], env=self.env, stdout=subprocess.PIPE,
                                        text=True)  # fmt: skip
        atexit.register(self.stop)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the fork server did not start")
        write_shims(self.bin, socket_path)

    def serves(self, name: str, env: Mapping[str, str]) -> bool:
        """Whether console script `name` with environment `env` runs here as it would alone: one of the project's
        console scripts, with the same JAX settings (read when JAX is imported) as the server's."""
        keys = {k for k in (*env, *self.env) if k.startswith("JAX_")}
        return (self.bin / name).is_file() and all(env.get(k) == self.env.get(k) for k in keys)

    def shim(self, name: str) -> str:
        return str(self.bin / name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        shutil.rmtree(self.base, ignore_errors=True)


def main(socket_path: str) -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-connection processes are reaped by the kernel
    server = socket.socket(socket.AF_UNIX)
    server.bind(socket_path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        if os.fork() == 0:
            server.close()
            _serve(connection)
        connection.close()


if __name__ == "__main__":
    main(sys.argv[1])
