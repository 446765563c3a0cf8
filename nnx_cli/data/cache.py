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
JSON-able dict that is kept as the entry's `meta`, with the shape and dtype of
each array under `arrays`.

An entry is derived data, so one found damaged (a deleted or truncated array, a
broken `meta.json`) is said on stderr and built again, replacing it the way a
fresh build is committed. The check is cheap: `meta.json` is parsed and every
array's header is read and compared with the meta and with the file's size; no
array is read.
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
        try:
            self.meta: dict[str, Any] = _read_meta(path)
        except _Damaged as e:
            raise _unusable(path, str(e)) from None

    def array(self, name: str) -> np.ndarray:
        try:
            return _open_array(self.path / f"{name}.npy")
        except _Damaged as e:
            raise _unusable(self.path, str(e)) from None

    def has(self, name: str) -> bool:
        return (self.path / f"{name}.npy").is_file()


def get_or_build(root: Path, name: str, parts: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Entry:
    """The entry `root/<name>-<key of parts>`, built by `build` the first time it is asked for."""
    final = root / f"{name}-{cache_key(parts)}"
    if (final / _META).is_file() and damage(final) is None:
        return Entry(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the data cache {str(root)!r} ({e.strerror or e}); set data.cache_dir") from None
    cause = None
    try:
        with _locked(root / f"{final.name}.lock"):
            if os.path.lexists(final):
                cause = damage(final)
                if cause is None:  # another process built (or rebuilt) it while this one waited
                    return Entry(final)
                from nnx_cli.data.base import notice

                notice(
                    ("cache", str(final), cause),
                    f"notice: the data cache entry {final} is damaged ({cause}); building it again",
                )
            for stale in [*root.glob(f"{final.name}.partial-*"), *root.glob(f"{final.name}.damaged-*")]:
                _remove(stale)  # left by a build that was killed
            partial = root / f"{final.name}.partial-{os.getpid()}"
            partial.mkdir()
            try:
                meta = build(partial)
                arrays = {"arrays": _describe(partial)}
                (partial / _META).write_text(json.dumps({"parts": parts, **meta, **arrays}, default=str))
                _fsync_tree(partial)
                if os.path.lexists(final):  # damaged: moved aside, replaced, then deleted
                    damaged = root / f"{final.name}.damaged-{os.getpid()}"
                    os.rename(final, damaged)
                    os.rename(partial, final)
                    _remove(damaged)
                else:
                    os.rename(partial, final)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
    except (OSError, UserError) as e:
        if cause is None:  # not a rebuild: as a fresh build always failed
            raise
        raise _unusable(final, cause, f"cannot be built again: {_reason(e)}") from None
    return Entry(final)


def damage(path: Path) -> str | None:
    """What is wrong with the committed entry `path`, in a few words, or None if it can be used.

    Cheap: `meta.json` is parsed and each array's header read and checked against the meta's shape and dtype
    and against the file's size; no array is read. An entry committed before `arrays` was kept in the meta has
    the arrays that are there checked.
    """
    try:
        meta = _read_meta(path)
        arrays = meta.get("arrays")
        if arrays is None:
            for file in sorted(path.glob("*.npy")):
                _open_array(file)
            return None
        if not isinstance(arrays, dict):
            raise _Damaged(f"{_META} has no valid 'arrays'")
        for name, want in arrays.items():
            array = _open_array(path / f"{name}.npy")
            got = {"shape": list(array.shape), "dtype": array.dtype.str}
            if want != got:
                raise _Damaged(f"{name}.npy holds {got['dtype']} {got['shape']} where {_META} says {want}")
    except _Damaged as e:
        return str(e)
    return None


class _Damaged(Exception):
    """Why an entry cannot be read (its message: a few words for a notice)."""


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / _META).read_text())
    except FileNotFoundError:
        raise _Damaged(f"no {_META}") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _Damaged(f"unreadable {_META}: {_reason(e)}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("parts"), dict):
        raise _Damaged(f"{_META} is not an entry's meta")
    return meta


def _open_array(file: Path) -> np.ndarray:
    """`file` memory-mapped read-only, checked to be as long as its header says (`np.load` accepts a longer one)."""
    try:
        array = np.load(file, mmap_mode="r")
        size = file.stat().st_size
    except FileNotFoundError:
        raise _Damaged(f"no {file.name}") from None
    except (OSError, ValueError, EOFError) as e:  # a torn header, a file shorter than its array
        raise _Damaged(f"unreadable {file.name}: {_reason(e)}") from None
    if isinstance(array, np.memmap) and size != array.offset + array.nbytes:
        raise _Damaged(f"{file.name} has {size} bytes, its header says {array.offset + array.nbytes}")
    return array


def _describe(directory: Path) -> dict[str, dict[str, Any]]:
    """The shape and dtype of each array a build wrote, kept in the meta to check the entry by."""
    out = {}
    for file in sorted(directory.glob("*.npy")):
        try:
            array = np.load(file, mmap_mode="r")
        except ValueError:  # an array that cannot be memory-mapped (of Python objects) is not checked
            continue
        out[file.name.removesuffix(".npy")] = {"shape": list(array.shape), "dtype": array.dtype.str}
    return out


def _unusable(path: Path, cause: str, what: str = "cannot be used") -> UserError:
    return UserError(f"the data cache entry {path} is damaged ({cause}) and {what}; delete it and run again")


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


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
    return target if (target / _META).is_file() and damage(target) is None else None


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
