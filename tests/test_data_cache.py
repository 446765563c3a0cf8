"""The on-disk array cache: built once, committed atomically, shared by concurrent runs."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from nnx_cli.data.cache import cache_key, cache_root, get_or_build, local_fingerprint


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
