"""Checksums of checkpoint steps: sealed after Orbax commits, verified before a step is trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from cli_support import env, free_port

from nnx_cli import integrity
from nnx_cli.checkpoint import Checkpointer
from nnx_cli.integrity import Status

HERE = Path(__file__).parent


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {"kernel": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), "bias": jnp.zeros((32,))},
        "step": jnp.asarray(seed, jnp.int32),
    }


def write_steps(directory: Path, *steps: int, checksums: bool = True) -> Path:
    ckpt = Checkpointer(directory, checksums=checksums)
    for step in steps:
        ckpt.save(step, state(step))
    ckpt.close()
    return directory


def data_file(step_dir: Path) -> Path:
    """One array data file that process 0 wrote (what the issue's user found flipped)."""
    return sorted((step_dir / "state" / "ocdbt.process_0" / "d").iterdir())[0]


def relative(path: Path, step_dir: Path) -> str:
    return path.relative_to(step_dir).as_posix()


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def step_dir(tmp_path: Path) -> Path:
    return write_steps(tmp_path / "ckpt", 400) / "400"


def test_a_saved_step_verifies(step_dir: Path):
    result = integrity.verify(step_dir)
    assert result.ok, str(result)
    assert result.files == len([p for p in step_dir.rglob("*") if p.is_file()]) - 1  # all but the checksums
    assert str(result).startswith(f"{step_dir}: ok (")


def test_the_checksums_cover_every_file_the_step_holds(step_dir: Path):
    record = json.loads(integrity.checksums_file(step_dir, 0).read_text())
    on_disk = {relative(p, step_dir) for p in step_dir.rglob("*") if p.is_file()}
    assert set(record["files"]) == on_disk - {"nnx-checksums.process_0.json"}
    assert {"_CHECKPOINT_METADATA", "state/_METADATA", "state/_sharding", "state/manifest.ocdbt"} <= set(
        record["files"]
    )


def test_a_flipped_byte_in_array_data_is_named_by_its_path(step_dir: Path):
    damaged = data_file(step_dir)
    flip_byte(damaged)
    result = integrity.verify(step_dir)
    assert result.status is Status.DAMAGED
    assert result.problem == f"{relative(damaged, step_dir)}: content differs from its checksum (xxh3_128)"
    assert "\n" not in str(result)


def test_a_damaged_sharding_file_is_named_by_its_path(step_dir: Path):
    flip_byte(step_dir / "state" / "_sharding", offset=10)
    assert integrity.verify(step_dir).problem.startswith("state/_sharding: content differs")


def test_a_truncated_file_is_reported_with_both_sizes(step_dir: Path):
    damaged = data_file(step_dir)
    size = damaged.stat().st_size
    damaged.write_bytes(damaged.read_bytes()[:-3])
    assert integrity.verify(step_dir).problem == (
        f"{relative(damaged, step_dir)}: {size - 3} bytes, but {size} when it was written"
    )


def test_an_empty_step_directory_is_damaged_saying_it_is_empty(tmp_path: Path):
    """It counted as a step without checksums, and restoring it failed with Orbax's KeyError ('Unknown key:
    state. Available keys: dict_keys([])') as the reason."""
    (tmp_path / "60").mkdir()
    check = integrity.verify(tmp_path / "60")
    assert check.status is Status.DAMAGED and check.problem == "empty: nothing was saved in it"


def test_a_missing_file_is_reported(step_dir: Path):
    (step_dir / "state" / "manifest.ocdbt").unlink()
    assert integrity.verify(step_dir).problem == "state/manifest.ocdbt: missing"


def test_a_file_added_after_the_step_was_written_is_reported(step_dir: Path):
    (step_dir / "state" / "notes.txt").write_text("hello")
    assert integrity.verify(step_dir).problem == (
        "state/notes.txt: not in the checksums (added after the step was written)"
    )


def test_a_step_written_without_checksums_is_not_called_damaged(tmp_path: Path):
    step_dir = write_steps(tmp_path / "ckpt", 400, checksums=False) / "400"
    result = integrity.verify(step_dir)
    assert result.status is Status.NO_CHECKSUMS
    assert not result.ok


def test_a_step_sealed_by_only_some_processes_is_damaged(step_dir: Path):
    integrity.seal(step_dir, process=0, process_count=2)
    assert integrity.verify(step_dir).problem == (
        "nnx-checksums.process_1.json: missing (only 1 of 2 processes sealed the step)"
    )


def test_unreadable_checksums_are_reported(step_dir: Path):
    integrity.checksums_file(step_dir, 0).write_text("{not json")
    assert integrity.verify(step_dir).problem.startswith("nnx-checksums.process_0.json: unreadable (")


def rewrite_checksums(step_dir: Path, old: str, new: str) -> None:
    """Change the checksum file's text in place, as a flipped byte there would."""
    path = integrity.checksums_file(step_dir, 0)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_checksums_of_another_format_are_unreadable(step_dir: Path):
    rewrite_checksums(step_dir, '"format": 1', '"format": 7')
    assert integrity.verify(step_dir).problem == (
        "nnx-checksums.process_0.json: unreadable (ValueError: format 7, expected 1)"
    )


def test_checksums_naming_another_process_than_their_file_are_unreadable(step_dir: Path):
    rewrite_checksums(step_dir, '"process": 0', '"process": 4')
    assert integrity.verify(step_dir).problem == (
        "nnx-checksums.process_0.json: unreadable (ValueError: process 4, but the file is named for process 0)"
    )


def test_checksums_counting_fewer_processes_than_the_one_that_wrote_them_are_unreadable(step_dir: Path):
    rewrite_checksums(step_dir, '"process_count": 1', '"process_count": 0')
    assert integrity.verify(step_dir).problem == (
        "nnx-checksums.process_0.json: unreadable (ValueError: process_count 0, but the file is named for process 0)"
    )


def test_a_recorded_size_too_large_for_a_number_is_unreadable_not_a_crash(step_dir: Path):
    size = integrity.checksums_file(step_dir, 0).read_text().split('"size": ')[1].split(",")[0]
    rewrite_checksums(step_dir, f'"size": {size},', f'"size": 9e{"9" * len(size)},')  # float("9e999") is inf
    assert integrity.verify(step_dir).problem.startswith("nnx-checksums.process_0.json: unreadable (OverflowError: ")


def test_files_belong_to_the_process_named_in_their_path():
    assert integrity.owner("state/ocdbt.process_3/d/1f2e") == 3
    assert integrity.owner("state/array_metadatas/process_1") == 1
    assert integrity.owner("state/_METADATA") == 0
    assert integrity.owner("_CHECKPOINT_METADATA") == 0


def test_the_newest_intact_step_skips_damaged_newer_steps_and_says_why(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 200, 400, 600)
    flip_byte(data_file(directory / "600"))
    (directory / "400" / "state" / "_METADATA").unlink()
    step, damaged = integrity.newest_intact(directory)
    assert step == 200
    assert [(r.step_dir.name, r.problem.split(":")[0]) for r in damaged] == [
        ("600", relative(data_file(directory / "600"), directory / "600")),
        ("400", "state/_METADATA"),
    ]


def test_the_newest_intact_step_restores_to_what_was_saved(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 200, 400)
    flip_byte(data_file(directory / "400"))
    step, _ = integrity.newest_intact(directory)
    restored = Checkpointer(directory, read_only=True).restore_raw(step)
    np.testing.assert_array_equal(restored["params"]["kernel"], np.asarray(state(200)["params"]["kernel"]))


def test_steps_without_checksums_count_as_intact_unless_asked_not_to(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 200, 400, checksums=False)
    assert integrity.newest_intact(directory)[0] == 400
    step, unsealed = integrity.newest_intact(directory, trust_unsealed=False)
    assert step is None
    assert [r.status for r in unsealed] == [Status.NO_CHECKSUMS, Status.NO_CHECKSUMS]


def test_a_quarantined_step_is_renamed_and_no_longer_listed_by_orbax(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 200, 400)
    moved = integrity.quarantine(directory / "400")
    assert moved == directory / "400.corrupt-1"
    assert (moved / "state" / "_METADATA").is_file()  # nothing deleted
    assert Checkpointer(directory, read_only=True).all_steps() == [200]
    assert integrity.steps(directory) == [200]


def test_quarantine_never_overwrites_an_earlier_quarantined_step(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 400)
    integrity.quarantine(directory / "400")
    write_steps(directory, 400)
    assert integrity.quarantine(directory / "400") == directory / "400.corrupt-2"
    assert sorted(p.name for p in directory.iterdir()) == ["400.corrupt-1", "400.corrupt-2"]


def test_prune_keeps_the_newest_steps(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 100, 200, 300, 400)
    assert integrity.prune(directory, keep=2) == [100, 200]
    assert Checkpointer(directory, read_only=True).all_steps() == [300, 400]


def test_prune_never_deletes_the_best_step(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 100, 200, 300, 400)
    assert integrity.prune(directory, keep=2, protect={100}) == [200]
    assert integrity.steps(directory) == [100, 300, 400]


def test_prune_passes_over_the_steps_saved_for_a_best_since_bettered(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 100, 150, 200, 250, 300)
    assert integrity.prune(directory, keep=2, protect={200}, passed_over={150}) == [100, 150]
    assert integrity.steps(directory) == [200, 250, 300]  # the newest two besides 150, and the best


def test_prune_deletes_nothing_older_than_the_newest_verified_step(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 100, 200, 300, 400)
    flip_byte(data_file(directory / "400"))
    flip_byte(data_file(directory / "300"))
    assert integrity.prune(directory, keep=1) == [100]  # 200 is the newest step that verifies: it stays
    assert integrity.steps(directory) == [200, 300, 400]


def test_prune_deletes_nothing_while_no_step_verifies(tmp_path: Path):
    directory = write_steps(tmp_path / "ckpt", 100, 200, 300, checksums=False)
    assert integrity.prune(directory, keep=1) == []
    assert integrity.steps(directory) == [100, 200, 300]


def test_a_two_process_checkpoint_is_sealed_by_each_process_over_the_files_it_wrote(tmp_path: Path):
    directory = tmp_path / "ckpt"
    coordinator = f"127.0.0.1:{free_port()}"
    worker = [sys.executable, str(HERE / "two_process_checkpoint.py"), coordinator, "2"]
    procs = [
        subprocess.Popen([*worker, str(i), str(directory)], env=env(tmp_path, devices=2), stderr=subprocess.PIPE)
        for i in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.decode()[-3000:]
    step_dir = directory / "1"
    records = [json.loads(integrity.checksums_file(step_dir, i).read_text()) for i in range(2)]
    second = set(records[1]["files"])
    assert second and all(("process_1" in rel) for rel in second)
    assert {integrity.owner(rel) for rel in records[0]["files"]} == {0}
    assert set(records[0]["files"]) | second == {
        relative(p, step_dir) for p in step_dir.rglob("*") if p.is_file() and not p.name.startswith("nnx-checksums")
    }
    assert integrity.verify(step_dir).ok
    assert integrity.verify(step_dir, process=1).files == len(second)


def test_each_process_can_verify_its_own_share(tmp_path: Path):
    step_dir = write_steps(tmp_path / "ckpt", 400) / "400"
    integrity.seal(step_dir, process=0, process_count=2)
    own = integrity.verify(step_dir, process=0)
    assert own.ok and own.files > 0
    assert integrity.verify(step_dir, process=1).problem == "nnx-checksums.process_1.json: missing"


def test_the_checksum_file_is_replaced_atomically(step_dir: Path):
    before = os.stat(integrity.checksums_file(step_dir, 0)).st_ino
    integrity.seal(step_dir, process=0, process_count=1)
    assert os.stat(integrity.checksums_file(step_dir, 0)).st_ino != before  # a new file renamed over the old
    assert [p.name for p in step_dir.iterdir() if p.name.startswith("nnx-checksums")] == [
        "nnx-checksums.process_0.json"
    ]
