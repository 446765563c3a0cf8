"""A checkpoint that cannot be written (the disk fills up mid-run) ends the run cleanly.

The full disk is a 1 MB tmpfs mounted here where that is allowed (root, with
`mount`), else a per-file size limit (RLIMIT_FSIZE) in the saving process,
under which writes fail with EFBIG the same way; the size limit is also tried
on its own. All are real failed writes, in Orbax's background thread when the
save is asynchronous.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_support import env

from nnx_cli import integrity
from nnx_cli.checkpoint import Checkpointer

HERE = Path(__file__).parent


def mount_small_disk(path: Path) -> bool:
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    except OSError:  # no mount command
        return False
    return mounted.returncode == 0


@pytest.fixture(scope="module", params=["async-full-disk", "sync-full-disk", "async-file-size-limit"])
def failed_save(request, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, str]:
    """(checkpoints dir, the saving process, the cause to expect), after a save that did not fit."""
    disk = tmp_path_factory.mktemp("disk")
    mounted = request.param.endswith("full-disk") and mount_small_disk(disk)
    directory = disk / "checkpoints"
    command = [sys.executable, str(HERE / "save_until_full.py"), str(directory)]
    if request.param.startswith("sync"):
        command.append("--sync")
    if not mounted:
        command += ["--file-size-limit", str(1 << 20)]
    result = subprocess.run(command, env=env(disk), capture_output=True, text=True, timeout=120)
    yield directory, result, "No space left on device" if mounted else "File too large"
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_save_that_does_not_fit_ends_the_run_with_one_line_naming_the_step_and_the_cause(failed_save):
    directory, result, cause = failed_save
    assert result.returncode == 1, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"error: cannot write checkpoint {directory / '2'} ({cause}); "), message
    assert f"the latest is {directory / '1'}" in message


def test_no_trace_of_the_failed_step_remains(failed_save):
    directory, _, _ = failed_save
    assert sorted(p.name for p in directory.iterdir()) == ["1"]


def test_the_checkpoint_before_the_failed_save_verifies_and_restores(failed_save):
    directory, _, _ = failed_save
    assert integrity.verify(directory / "1").ok
    ckpt = Checkpointer(directory, read_only=True)
    assert ckpt.all_steps() == [1]
    np.testing.assert_array_equal(ckpt.restore_raw(1)["w"], np.arange(1000, dtype=np.float32))
