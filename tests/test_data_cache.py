"""The on-disk array cache: built once, committed atomically, shared by concurrent runs."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from nnx_cli.data.cache import cache_key, cache_root, find_alias, get_or_build, local_fingerprint, record_alias
from nnx_cli.errors import UserError


def _build_slowly(directory: Path) -> dict:
    """A build that counts itself in a side file and takes long enough for a second process to wait."""
    with open(directory.parent / "builds.txt", "a") as f:
        f.write("x")
    time.sleep(0.5)
    np.save(directory / "values.npy", np.arange(10, dtype=np.uint8))
    return {"count": 10}


def _get(root: str) -> int:
    return int(get_or_build(Path(root), "numbers", {"n": 10}, _build_slowly).array("values").sum())


def test_an_entry_is_built_once_and_then_memory_mapped(tmp_path: Path):
    calls = []

    def build(directory: Path) -> dict:
        calls.append(directory)
        np.save(directory / "x.npy", np.arange(6, dtype=np.int32).reshape(2, 3))
        return {"rows": 2}

    first = get_or_build(tmp_path, "demo", {"source": "a"}, build)
    second = get_or_build(tmp_path, "demo", {"source": "a"}, build)
    assert len(calls) == 1 and first.path == second.path
    x = second.array("x")
    assert isinstance(x, np.memmap) and x.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert second.meta["rows"] == 2 and second.meta["parts"] == {"source": "a"}


def test_other_parts_make_another_entry(tmp_path: Path):
    def build(directory: Path) -> dict:
        np.save(directory / "x.npy", np.zeros(1))
        return {}

    a = get_or_build(tmp_path, "demo", {"fingerprint": "1"}, build)
    b = get_or_build(tmp_path, "demo", {"fingerprint": "2"}, build)
    assert a.path != b.path
    assert cache_key({"a": 1, "b": 2}) == cache_key({"b": 2, "a": 1})


def test_a_failed_build_leaves_no_entry_behind(tmp_path: Path):
    def build(directory: Path) -> dict:
        np.save(directory / "x.npy", np.zeros(3))
        raise RuntimeError("decoding failed")

    with pytest.raises(RuntimeError):
        get_or_build(tmp_path, "demo", {}, build)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


def test_concurrent_processes_build_once_and_all_read_it(tmp_path: Path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        sums = pool.map(_get, [str(tmp_path)] * 2)
    assert sums == [45, 45]
    assert (tmp_path / "builds.txt").read_text() == "x"


def test_the_default_root_is_under_the_datasets_cache(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cache_root() == tmp_path / "hf" / "datasets" / "nnx"
    assert cache_root("~/elsewhere") == Path("~/elsewhere").expanduser()


def test_a_local_fingerprint_changes_when_a_file_is_touched_but_not_for_hidden_files(tmp_path: Path):
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    before = local_fingerprint(tmp_path)
    (tmp_path / ".lock").write_text("")
    assert local_fingerprint(tmp_path) == before
    stat = (tmp_path / "train.jsonl").stat()
    os.utime(tmp_path / "train.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert local_fingerprint(tmp_path) != before
    assert local_fingerprint(tmp_path / "train.jsonl") != local_fingerprint(tmp_path)


def _build_two(directory: Path) -> dict:
    """A build writing two arrays, counted in a side file."""
    with open(directory.parent / "builds.txt", "a") as f:
        f.write("x")
    np.save(directory / "x.npy", np.arange(1000, dtype=np.int32).reshape(100, 10))
    np.save(directory / "y.npy", np.linspace(0, 1, 7))
    return {"rows": 100}


def _damaged_and_rebuilt(tmp_path: Path, capsys, damage) -> None:
    """Build an entry, `damage(its path)`, ask for it again: it is built again, with a notice, as a fresh build."""
    entry = get_or_build(tmp_path / "cache", "demo", {"source": "a"}, _build_two)
    damage(entry.path)
    capsys.readouterr()
    again = get_or_build(tmp_path / "cache", "demo", {"source": "a"}, _build_two)
    err = capsys.readouterr().err
    assert f"notice: the data cache entry {entry.path} is damaged (" in err and err.rstrip().endswith(
        "; building it again"
    )
    assert (tmp_path / "cache" / "builds.txt").read_text() == "xx" and again.path == entry.path
    fresh = get_or_build(tmp_path / "fresh", "demo", {"source": "a"}, _build_two)
    for name in ("x", "y"):
        np.testing.assert_array_equal(again.array(name), fresh.array(name))
        assert again.array(name).dtype == fresh.array(name).dtype
    assert again.meta == fresh.meta
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert left == sorted([entry.path.name, f"{entry.path.name}.lock", "builds.txt"])  # nothing damaged left behind
    get_or_build(tmp_path / "cache", "demo", {"source": "a"}, _build_two)
    assert (tmp_path / "cache" / "builds.txt").read_text() == "xx" and capsys.readouterr().err == ""


def test_a_truncated_array_is_built_again_with_a_notice(tmp_path: Path, capsys):
    _damaged_and_rebuilt(tmp_path, capsys, lambda path: os.truncate(path / "x.npy", 1000))


def test_an_array_truncated_into_its_header_is_built_again_with_a_notice(tmp_path: Path, capsys):
    _damaged_and_rebuilt(tmp_path, capsys, lambda path: os.truncate(path / "x.npy", 100))


def test_an_array_longer_than_its_header_says_is_built_again_with_a_notice(tmp_path: Path, capsys):
    def append(path: Path) -> None:
        with open(path / "y.npy", "ab") as f:
            f.write(b"\0" * 8)

    _damaged_and_rebuilt(tmp_path, capsys, append)


def test_a_deleted_array_is_built_again_with_a_notice(tmp_path: Path, capsys):
    _damaged_and_rebuilt(tmp_path, capsys, lambda path: (path / "y.npy").unlink())


def test_a_broken_meta_is_built_again_with_a_notice(tmp_path: Path, capsys):
    _damaged_and_rebuilt(tmp_path, capsys, lambda path: (path / "meta.json").write_text('{"parts": '))


def test_a_deleted_meta_is_built_again_with_a_notice(tmp_path: Path, capsys):
    _damaged_and_rebuilt(tmp_path, capsys, lambda path: (path / "meta.json").unlink())


def test_an_array_whose_shape_disagrees_with_the_meta_is_built_again_with_a_notice(tmp_path: Path, capsys):
    _damaged_and_rebuilt(tmp_path, capsys, lambda path: np.save(path / "x.npy", np.zeros((99, 10), np.int32)))


def test_a_damaged_entry_that_cannot_be_built_again_is_a_user_error_naming_it(tmp_path: Path):
    entry = get_or_build(tmp_path, "demo", {"source": "a"}, _build_two)
    (entry.path / "x.npy").unlink()

    def build(directory: Path) -> dict:
        raise UserError("dataset 'a' cannot be opened offline")

    with pytest.raises(
        UserError,
        match=r"^the data cache entry .*demo-.* is damaged \(no x\.npy\) and cannot be "
        r"built again: dataset 'a' cannot be opened offline; delete it and run again$",
    ):
        get_or_build(tmp_path, "demo", {"source": "a"}, build)


def test_an_alias_of_a_damaged_entry_is_not_found(tmp_path: Path):
    entry = get_or_build(tmp_path, "demo", {"source": "a"}, _build_two)
    record_alias(tmp_path, {"path": "a"}, entry.path)
    assert find_alias(tmp_path, {"path": "a"}) == entry.path
    os.truncate(entry.path / "x.npy", 1000)
    assert find_alias(tmp_path, {"path": "a"}) is None
