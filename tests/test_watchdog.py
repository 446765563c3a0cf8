"""When one process of a multi-process run fails, the others stop within seconds, saying which one.

Real runs of tests/watchdog_worker.py: processes joined through
`jax.distributed` on 127.0.0.1, a loop of all-gathers over gloo (or of
sleeps, with no collective to fail), one process failing on cue.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cli_support import env, free_port

HERE = Path(__file__).parent
WITHIN_S = 15.0  # the survivors' deadline, from the moment the victim fails


def run(tmp_path: Path, *args: str, processes: int = 2, timeout: float = 60) -> list[dict]:
    """Start the processes, wait for all of them; what each said and when it ended."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "watchdog_worker.py"), coordinator, str(processes), str(i), *args],
            env=env(tmp_path, devices=1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < processes and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.02)
    outcomes = []
    for i, proc in enumerate(procs):
        if i not in ended:
            proc.kill()
        stdout, stderr = proc.communicate()
        outcomes.append({"status": proc.returncode, "stdout": stdout, "stderr": stderr, "ended": ended.get(i)})
    return outcomes


def failed_at(victim: dict) -> float:
    (line,) = [line for line in victim["stdout"].splitlines() if line.startswith("failing at ")]
    return float(line.split()[-1])


def error_line(outcome: dict) -> str:
    lines = [line for line in outcome["stderr"].splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, outcome["stderr"][-3000:]
    return lines[0]


def assert_stopped_in_time(survivor: dict, victim: dict, says: str) -> None:
    assert survivor["status"] == 1, survivor["stderr"][-3000:]
    assert says in error_line(survivor)
    assert survivor["ended"] - failed_at(victim) < WITHIN_S


def test_processes_that_all_finish_exit_normally(tmp_path):
    outcomes = run(tmp_path, "--steps", "30")
    assert [o["status"] for o in outcomes] == [0, 0], outcomes[0]["stderr"][-2000:] + outcomes[1]["stderr"][-2000:]
    assert not any("error:" in o["stderr"] for o in outcomes)


def test_a_process_that_raises_stops_the_others_with_its_error(tmp_path):
    survivor, victim = run(tmp_path, "--fail", "raise", "--victim", "1")
    assert_stopped_in_time(survivor, victim, "process 1 of 2 failed: RuntimeError: the victim raised on purpose")
    assert survivor["stderr"].rstrip().endswith("stopping process 0 too")
    assert victim["status"] == 1


def test_process_zero_exiting_stops_the_others_and_keeps_its_own_status(tmp_path):
    victim, survivor = run(tmp_path, "--fail", "exit", "--victim", "0")
    assert_stopped_in_time(survivor, victim, "process 0 of 2 failed: exited with status 3")
    assert victim["status"] == 3


def test_a_killed_process_stops_the_others(tmp_path):
    survivor, victim = run(tmp_path, "--fail", "kill", "--victim", "1")
    assert_stopped_in_time(survivor, victim, "process 1 of 2 stopped without a word (killed, or crashed)")


def test_killing_process_zero_stops_the_others_though_the_coordinator_dies_with_it(tmp_path):
    victim, survivor = run(tmp_path, "--fail", "kill", "--victim", "0")
    assert_stopped_in_time(survivor, victim, "process 0 of 2 stopped without a word (killed, or crashed)")


def test_a_killed_process_stops_the_others_outside_any_collective(tmp_path):
    survivor, victim = run(tmp_path, "--idle", "--fail", "kill", "--victim", "1")
    assert_stopped_in_time(survivor, victim, "process 1 of 2 stopped without a word")


def test_news_of_a_killed_process_reaches_every_other_process(tmp_path):
    *survivors, victim = run(tmp_path, "--idle", "--fail", "kill", "--victim", "2", processes=3)
    for survivor in survivors:
        assert_stopped_in_time(survivor, victim, "process 2 of 3 stopped without a word")
