"""Running the console scripts as a user does: real subprocesses, real files.

`cli()` and `start()` run a command through a fork server (tests/forkserver.py: a process of its own, the
imports already done) where it would run the same alone; `NNX_TESTS_FORKSERVER=0` turns the server off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from forkserver import ForkServer

from nnx_cli.checkpoint import Checkpointer

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent

CLI_PLATFORM = os.environ.get("NNX_TESTS_CLI_PLATFORM", "cpu")
"""Where the console scripts the tests start compute: `cpu` (the default), or `default` for JAX's own choice
(the accelerator, where there is one). The one switch for a GPU machine: the suite keeps its CLI runs on the
CPU there by default, because what they test (files, exit codes, resumption, the loop) does not depend on the
device, twelve workers' subprocesses each starting CUDA and compiling for it would cost minutes, and runs
compared with one another stay on one platform; the GPU's numbers are tested in-process (models, attention,
decoding, equality with transformers). Runs with simulated devices (`devices=`) are CPU runs either way."""


def env(tmp: Path, devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a CLI run: on :data:`CLI_PLATFORM` (the CPU unless set), no network, `devices` simulated
    CPU devices."""
    platform = {"JAX_PLATFORMS": "cpu"} if CLI_PLATFORM == "cpu" or devices is not None else {}
    out = {
        **os.environ,
        **platform,
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }
    if devices is not None:
        out["XLA_FLAGS"] = device_flags(devices)
    return out


def _session_flags(*without: str) -> list[str]:
    """The test session's `XLA_FLAGS` (conftest.py adds its own), less those starting with any of `without`."""
    return [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(without)]


CPU_MEMORY = 16 << 30
"""The address space a CLI run on the CPU gets when a test asks for :func:`cli_device_memory` (`cli(...,
memory_limit=True)`). What a CPU process may allocate is the operating system's call: a host that overcommits
memory (`vm.overcommit_memory=1`, common on GPU machines) grants any allocation and ends the process with its
OOM killer minutes later, once the pages are touched; a limit on the address space fails the allocation
itself, as a GPU's allocator does, on every host."""


def cli_device_memory() -> int:
    """Bytes of memory on the device a CLI run computes on: :data:`CPU_MEMORY` when it runs on the CPU (run it
    with `memory_limit=True`), else the memory the first accelerator reports."""
    import jax

    if CLI_PLATFORM == "cpu" or jax.default_backend() == "cpu":
        return CPU_MEMORY
    return jax.devices()[0].memory_stats()["bytes_limit"]


def device_flags(devices: int) -> str:
    """`XLA_FLAGS` of a subprocess with `devices` simulated CPU devices (and the test session's own flags)."""
    return " ".join([*_session_flags("--xla_force_host_platform"), f"--xla_force_host_platform_device_count={devices}"])


def optimized_flags() -> str:
    """The session's `XLA_FLAGS` without its fast-compile flags (conftest.py): for the long CLI runs, which
    spend their time executing rather than compiling. Runs compared with each other must all use it."""
    return " ".join(_session_flags("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters"))


def cli(
    name: str,
    *args: str,
    cwd: Path,
    timeout: float = 120,
    devices: int | None = None,
    extra_env: dict[str, str] | None = None,
    file_size_limit: int | None = None,
    memory_limit: bool = False,
) -> subprocess.CompletedProcess:
    """Run a console script; `file_size_limit` (bytes) makes larger writes fail with EFBIG, like a full disk;
    `memory_limit` gives a run on the CPU :data:`CPU_MEMORY` of address space (:func:`cli_device_memory`)."""
    environment = env(cwd, devices, **(extra_env or {}))
    memory = CPU_MEMORY if memory_limit and environment.get("JAX_PLATFORMS") == "cpu" else None
    server = None if file_size_limit or memory else _server()
    command = [
        server.shim(name) if server is not None and server.serves(name, environment) else str(BIN / name),
        *map(str, args),
    ]
    return subprocess.run(
        _limited(command, file_size_limit, memory),
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_SERVERS: list[ForkServer] = []


def _server() -> ForkServer | None:
    """This process's fork server, started on first use (None when NNX_TESTS_FORKSERVER=0)."""
    if os.environ.get("NNX_TESTS_FORKSERVER", "1") == "0":
        return None
    if not _SERVERS:
        import tempfile

        _SERVERS.append(ForkServer(env(Path(tempfile.gettempdir()))))
    return _SERVERS[0]


def _limited(command: list[str], file_size: int | None, memory: int | None) -> list[str]:
    """`command` under resource limits, set by a small Python that then execs it (no preexec_fn: that forks this
    multithreaded process). `file_size` (bytes): larger writes fail with EFBIG, SIGXFSZ ignored (its disposition
    is inherited across exec); `memory`: the address space."""
    limits = ["import os, resource, signal, sys"]
    if file_size:
        limits += ["signal.signal(signal.SIGXFSZ, signal.SIG_IGN)",
                   f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size}, {file_size}))"]  # fmt: skip
    if memory:
        limits.append(f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))")
    if len(limits) == 1:
        return command
    return [sys.executable, "-c", "; ".join([*limits, "os.execv(sys.argv[1], sys.argv[1:])"]), *command]


def start(
    name: str,
    *args: str,
    cwd: Path,
    devices: int | None = None,
    extra_env: dict[str, str] | None = None,
    own_pid: bool = False,
) -> subprocess.Popen:
    """A console script started, for a test to wait on, signal or kill (through the fork server, which passes
    SIGINT / SIGTERM / SIGHUP on to the command, and kills it with the shim on SIGKILL). With `own_pid`, the
    command is the process started (`.pid` is the command's), not a shim."""
    environment = env(cwd, devices, **(extra_env or {}))
    server = None if own_pid else _server()
    return subprocess.Popen(
        [
            server.shim(name) if server is not None and server.serves(name, environment) else str(BIN / name),
            *map(str, args),
        ],
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_checkpoint(workdir: Path, step: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    """Wait until checkpoint `step` is committed, while every process in `procs` still runs."""
    deadline = time.monotonic() + timeout
    while not (workdir / "checkpoints" / str(step) / "commit_success.txt").exists():
        for proc in procs:
            assert proc.poll() is None, f"training ended before step {step}: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"no checkpoint {step} after {timeout}s"
        time.sleep(0.01)


def final_state(workdir: Path) -> dict:
    """The latest checkpoint of a work dir as numpy arrays, with its step."""
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    step = ckpt.latest_step()
    return {"step": step, **ckpt.restore_raw(step)}


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message
