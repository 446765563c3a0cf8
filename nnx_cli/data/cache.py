"""An on-disk cache of arrays: built once, committed atomically, memory-mapped by every later run.

Decoded images and tokenized text are kept as `.npy` files in one directory
per (source, split, options, source fingerprint). A directory is built under
an exclusive file lock into a private temporary directory, then renamed into
place, so a concurrent run waits for it and an interrupted build leaves
nothing that looks finished::

    entry = get_or_build(cache_root(cfg.cache_dir), "mnist-train", {"source": ..., "fingerprint": ...}, build)
    images = entry.array("images")      # np.memmap, read-only: pages come from disk as they are used

`build(directory)` writes the arrays into `directory` (with
`np.lib.format.open_memmap` for arrays larger than memory) and returns a
JSON-able dict that is kept as the entry's `meta`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import UserError

VERSION = 1  # bump when the layout of an entry changes: old entries are then simply not found
_META = "meta.json"


def cache_root(cache_dir: str | None = None) -> Path:
    """`data.cache_dir`, else `nnx/` under the `datasets` cache (`HF_DATASETS_CACHE`, `HF_HOME/datasets`, ...)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser() / "nnx"
    hf_home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(hf_home).expanduser() / "datasets" / "nnx"


def cache_key(parts: dict[str, Any]) -> str:
    """A short stable hash of `parts` (JSON-able): what makes two cache entries the same."""
    text = json.dumps({"version": VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def local_fingerprint(path: str | Path) -> str:
    """A hash of the sizes and modification times of a local file, or of every file under a directory.

    Cheap (no file is read) and changed by any edit that touches a file, so
    it stands for the content in cache keys of local sources.

    >>> local_fingerprint("data/train.parquet")  # doctest: +SKIP
    'c5d7f0e1a2b3c4d5'
    """
    path = Path(path).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
    digest = hashlib.sha256(os.fsencode(path))  # a name that is not UTF-8 (from a zip, a Windows copy) as its bytes
    for file in files:
        stat = file.stat()
        digest.update(
            os.fsencode(f"\0{file.relative_to(path) if file != path else ''}\0{stat.st_size}\0{stat.st_mtime_ns}")
        )
    return digest.hexdigest()[:16]


def _hidden(file: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in file.relative_to(root).parts)


class Entry:
    """A committed cache directory: its arrays (memory-mapped) and its `meta`."""

    def __init__(self, path: Path):
        self.path = path
        self.meta: dict[str, Any] = json.loads((path / _META).read_text())

    def array(self, name: str) -> np.ndarray:
        return np.load(self.path / f"{name}.npy", mmap_mode="r")

    def has(self, name: str) -> bool:
        return (self.path / f"{name}.npy").is_file()


def get_or_build(root: Path, name: str, parts: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Entry:
    """The entry `root/<name>-<key of parts>`, built by `build` the first time it is asked for."""
    final = root / f"{name}-{cache_key(parts)}"
    if (final / _META).is_file():
        return Entry(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the data cache {str(root)!r} ({e.strerror or e}); set data.cache_dir") from None
    with _locked(root / f"{final.name}.lock"):
        if (final / _META).is_file():  # another process built it while this one waited
            return Entry(final)
        for stale in root.glob(f"{final.name}.partial-*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = root / f"{final.name}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            meta = build(partial)
            (partial / _META).write_text(json.dumps({"parts": parts, **meta}, default=str))
            _fsync_tree(partial)
            os.rename(partial, final)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return Entry(final)


def find_alias(root: Path, parts: dict[str, Any]) -> Path | None:
    """The committed entry an earlier run recorded for `parts` (:func:`record_alias`), or None.

    An alias names an entry by what can be known without opening the source (a local source's path and
    :func:`local_fingerprint`, the options), where the entry's own key needs the opened dataset's fingerprint:
    a warm run then need not import `datasets` at all.
    """
    try:
        target = root / _alias(root, parts).read_text().strip()
    except OSError:
        return None
    return target if (target / _META).is_file() else None


def record_alias(root: Path, parts: dict[str, Any], entry: Path) -> None:
    """Record `entry` (a committed directory under `root`) under `parts`; best effort: a cache that cannot be
    written only loses the shortcut."""
    alias = _alias(root, parts)
    partial = alias.with_name(f"{alias.name}.partial-{os.getpid()}")
    with contextlib.suppress(OSError):
        partial.write_text(Path(entry).name)
        os.replace(partial, alias)


def _alias(root: Path, parts: dict[str, Any]) -> Path:
    return root / f"alias-{cache_key(parts)}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits while another process builds the same entry
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fsync_tree(directory: Path) -> None:
    """Flush the entry's files before the rename commits it (a power cut never leaves a torn entry)."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
