"""Checksums of checkpoint step directories: written once Orbax has committed a step, checked before one is trusted.

Orbax commits a step by renaming a finished directory, so a step that exists
was written completely; it says nothing about what happens to the bytes
afterwards. Here every process of the run hashes the files it wrote into
`<checkpoints>/<step>/` and records them in `nnx-checksums.process_<i>.json`
there; :func:`verify` reads everything back and names the first file that is
missing, extra, truncated or changed.

Who wrote what (seen in real two-process checkpoints): process `i` writes
`state/ocdbt.process_<i>/**` and `state/array_metadatas/process_<i>`; process 0
writes everything else (`_CHECKPOINT_METADATA`, `state/_METADATA`,
`state/_sharding`, `state/manifest.ocdbt`, `state/d/*`, `commit_success.txt`).
So a file belongs to process `i` when one of its path components is
`process_<i>` or ends in `.process_<i>`, and to process 0 otherwise::

    seal(ckpt_dir / "400")                          # on every process, once step 400 is committed
    print(verify(ckpt_dir / "400"))                 # ".../400: ok (12 files, 8.1 MB)" or the first damaged file
    step, damaged = newest_intact(ckpt_dir)         # the step to resume from, and the newer ones that failed
    for result in damaged:
        quarantine(result.step_dir)                 # 600 -> 600.corrupt-1: Orbax no longer lists it
    prune(ckpt_dir, keep=3, protect={best_step})    # keep-N, only behind a verified step
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import xxhash

ALGORITHM = "xxh3_128"
_FORMAT = 1
_CHECKSUMS = re.compile(r"nnx-checksums\.process_(\d+)\.json")
_CHECKSUMS_PREFIX = "nnx-checksums."  # the checksum files and their temporary files: not checkpoint data
_OWNED = re.compile(r"(?:.+\.)?process_(\d+)")  # a path component that names the process that wrote it
_STEP = re.compile(r"0|[1-9]\d*")  # Orbax's step directory names (no prefix, no padding)
_PRUNING = ".pruning"
_BUFFER = 8 << 20  # bytes per read: large sequential reads are what disks and network file systems do best


class Status(enum.Enum):
    OK = "ok"
    NO_CHECKSUMS = "no checksums"  # written before checksums existed, or the run ended before sealing the step
    DAMAGED = "damaged"


@dataclasses.dataclass(frozen=True)
class Verification:
    """What :func:`verify` found in one step directory; `str()` is a one-line report."""

    step_dir: Path
    status: Status
    problem: str = ""  # the first thing wrong: a path relative to the step dir and what is wrong with it
    files: int = 0  # files hashed
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def __str__(self) -> str:
        if self.ok:
            return f"{self.step_dir}: ok ({self.files} files, {self.bytes / 1e6:.1f} MB)"
        return f"{self.step_dir}: {self.problem}"


def owner(relpath: str) -> int:
    """The process that writes `relpath` (relative to a step directory) in a multi-process run.

    >>> owner("state/ocdbt.process_3/d/1f2e"), owner("state/array_metadatas/process_1"), owner("state/_METADATA")
    (3, 1, 0)
    """
    for part in relpath.split("/"):
        match = _OWNED.fullmatch(part)
        if match:
            return int(match.group(1))
    return 0


def checksums_file(step_dir: Path, process: int) -> Path:
    return Path(step_dir) / f"nnx-checksums.process_{process}.json"


def seal(step_dir: str | Path, *, process: int | None = None, process_count: int | None = None) -> Path:
    """Hash the files this process wrote in `step_dir` and record them there, atomically.

    Call it on every process once Orbax has committed the step (the
    :class:`~nnx_cli.checkpoint.Checkpointer` does). `process` and
    `process_count` default to JAX's. Example::

        seal("runs/digits/checkpoints/400")  # -> runs/digits/checkpoints/400/nnx-checksums.process_0.json
    """
    if process is None or process_count is None:
        import jax

        process, process_count = jax.process_index(), jax.process_count()
    step_dir = Path(step_dir)
    mine = [rel for rel in _data_files(step_dir) if owner(rel) == process]
    digests = _hash_all(step_dir, mine)
    record = {
        "format": _FORMAT,
        "algorithm": ALGORITHM,
        "process": process,
        "process_count": process_count,
        "files": {rel: {"size": size, ALGORITHM: digest} for rel, (size, digest) in zip(mine, digests)},
    }
    target = checksums_file(step_dir, process)
    write_atomically(target, json.dumps(record, indent=1, sort_keys=True).encode())
    return target


def checksum_files(step_dir: str | Path) -> list[Path]:
    """The checksum files of `step_dir` (one per process that sealed it; none: never sealed)."""
    return sorted(Path(step_dir).glob("nnx-checksums.process_*.json"))


def verify(step_dir: str | Path, *, process: int | None = None) -> Verification:
    """Re-hash a step directory against its checksums; the first problem found, in one line.

    Checks, in this order, each stopping at the first problem: every process's
    checksum file is there and readable; every listed file is there; no file
    is there that is not listed; sizes (cheap: a truncated file is found
    before anything is read); contents. With `process`, only that process's
    files (each process of a run can check its own share). Example::

        print(verify("runs/digits/checkpoints/400"))
        # runs/digits/checkpoints/400: state/ocdbt.process_0/d/5e1c...: content differs from its checksum (xxh3_128)
    """
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return Verification(step_dir, Status.DAMAGED, "not a directory")
    if not any(step_dir.iterdir()):
        return Verification(step_dir, Status.DAMAGED, "empty: nothing was saved in it")
    expected = _recorded(step_dir, process)
    if isinstance(expected, Verification):
        return expected
    damaged = functools.partial(Verification, step_dir, Status.DAMAGED)
    present = {rel for rel in _data_files(step_dir) if process is None or owner(rel) == process}
    for rel in sorted(expected.keys() - present):
        return damaged(f"{rel}: missing")
    for rel in sorted(present - expected.keys()):
        return damaged(f"{rel}: not in the checksums (added after the step was written)")
    order = sorted(expected)
    for rel in order:
        size, recorded = (step_dir / rel).stat().st_size, expected[rel]["size"]
        if size != recorded:
            return damaged(f"{rel}: {size} bytes, but {recorded} when it was written")
    for rel, (_, digest) in zip(order, _hash_all(step_dir, order)):
        if digest != expected[rel][ALGORITHM]:
            return damaged(f"{rel}: content differs from its checksum ({ALGORITHM})")
    return Verification(step_dir, Status.OK, files=len(order), bytes=sum(expected[rel]["size"] for rel in order))


def _recorded(step_dir: Path, process: int | None) -> dict[str, dict] | Verification:
    """The files the checksum files list ({path: {"size", ALGORITHM}}), or why there is no such list."""
    found = {
        int(m.group(1)): path
        for path in step_dir.iterdir()
        if (m := _CHECKSUMS.fullmatch(path.name)) and (process is None or int(m.group(1)) == process)
    }
    if not found and (process is None or not any(_CHECKSUMS.fullmatch(p.name) for p in step_dir.iterdir())):
        return Verification(
            step_dir,
            Status.NO_CHECKSUMS,
            "no checksums (written before checkpoints were checksummed, or the run stopped before sealing it)",
        )
    if not found:
        return Verification(step_dir, Status.DAMAGED, f"{checksums_file(Path(), process).name}: missing")
    expected: dict[str, dict] = {}
    counts = set()
    for number, path in sorted(found.items()):
        try:
            record = json.loads(path.read_bytes())
            # every field is checked: a checksum file changed anywhere must not vouch for the step
            if record.get("format") != _FORMAT:
                raise ValueError(f"format {record.get('format')!r}, expected {_FORMAT}")
            if record.get("algorithm") != ALGORITHM:
                raise ValueError(f"algorithm {record.get('algorithm')!r}, expected {ALGORITHM!r}")
            if record.get("process") != number:
                raise ValueError(f"process {record.get('process')!r}, but the file is named for process {number}")
            count = int(record["process_count"])
            if not number < count:
                raise ValueError(f"process_count {count}, but the file is named for process {number}")
            counts.add(count)
            for rel, entry in record["files"].items():
                expected[rel] = {"size": int(entry["size"]), ALGORITHM: str(entry[ALGORITHM])}
        except (OSError, ValueError, OverflowError, KeyError, TypeError, AttributeError) as e:
            return Verification(step_dir, Status.DAMAGED, f"{path.name}: unreadable ({type(e).__name__}: {e})")
    if process is None:
        count, *others = sorted(counts)
        if others:
            return Verification(step_dir, Status.DAMAGED, f"checksum files disagree on the process count ({counts})")
        missing = [i for i in range(count) if i not in found]
        if missing:
            return Verification(
                step_dir,
                Status.DAMAGED,
                f"{checksums_file(Path(), missing[0]).name}: missing "
                f"(only {len(found)} of {count} processes sealed the step)",
            )
    return expected


def steps(directory: str | Path) -> list[int]:
    """The committed steps in a checkpoints directory, ascending (what Orbax's `all_steps()` lists)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if _STEP.fullmatch(p.name) and p.is_dir())


def newest_intact(
    directory: str | Path, *, trust_unsealed: bool = True, below: int | None = None
) -> tuple[int | None, list[Verification]]:
    """The newest step (below step `below` when given) that verifies, and the verifications of the newer steps
    that did not.

    A step without checksums (written before they existed, or by a run that
    stopped between Orbax's commit and the seal) counts as intact with
    `trust_unsealed`: Orbax committed it, there is nothing to check it against. Example::

        step, damaged = newest_intact("runs/digits/checkpoints")
        # 400, [Verification(600: "state/_sharding: content differs from its checksum (xxh3_128)")]
    """
    rejected = []
    for step in reversed([s for s in steps(directory) if below is None or s < below]):
        result = verify(Path(directory) / str(step))
        if result.ok or (trust_unsealed and result.status is Status.NO_CHECKSUMS):
            return step, rejected
        rejected.append(result)
    return None, rejected


def quarantine(step_dir: str | Path) -> Path:
    """Rename a bad step directory to `<step>.corrupt-<n>` (the first free n), out of Orbax's sight.

    Nothing is overwritten or deleted: the bytes stay for whoever wants to look. Example::

        quarantine("runs/digits/checkpoints/600")  # -> runs/digits/checkpoints/600.corrupt-1
    """
    step_dir = Path(step_dir)
    n = 1
    while (target := step_dir.with_name(f"{step_dir.name}.corrupt-{n}")).exists():
        n += 1
    os.rename(step_dir, target)
    _fsync_dir(step_dir.parent)
    return target


def prune(
    directory: str | Path,
    keep: int,
    *,
    protect: Iterable[int] = (),
    trusted: Iterable[int] = (),
    passed_over: Iterable[int] = (),
) -> list[int]:
    """Delete old steps beyond the newest `keep`, but only those older than a step that verifies.

    Steps in `protect` (the best one, with `checkpoint.keep_best`) are never
    deleted; those in `passed_over` (saved for `keep_best` alone) do not count among the newest `keep`, and go as
    the others do once no longer protected. No step is deleted while no newer one verifies: a run whose newest
    checkpoints are damaged (or unsealed) keeps its older ones. A deleted step is
    first renamed out of Orbax's sight, so a crash mid-delete leaves no
    half-deleted step that looks committed. Returns the deleted steps. Call it
    on one process. When there is something to delete it re-hashes the newest
    step that verifies, unless that step is in `trusted` (a step this process
    sealed moments ago from the files on disk, in a single-process run). Example::

        prune("runs/digits/checkpoints", keep=2, protect={200})  # -> [100, 300], of 100..500
    """
    directory = Path(directory)
    for leftover in directory.glob(f"*{_PRUNING}"):  # a delete that a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    all_steps = steps(directory)
    counted = [s for s in all_steps if s not in set(passed_over)]
    kept = set(counted[-keep:] if keep > 0 else []) | set(protect)
    if not set(all_steps) - kept:
        return []
    trusted = set(trusted)
    verified = next((s for s in reversed(all_steps) if s in trusted or verify(directory / str(s)).ok), None)
    if verified is None:
        return []
    doomed = [s for s in all_steps if s < verified and s not in kept]
    for step in doomed:
        moved = directory / f"{step}{_PRUNING}"
        os.rename(directory / str(step), moved)
        shutil.rmtree(moved)
    if doomed:
        _fsync_dir(directory)
    return doomed


def _data_files(step_dir: Path) -> list[str]:
    """Every file under `step_dir` except the checksum files, as sorted '/'-separated relative paths."""
    out = []
    for root, dirs, files in os.walk(step_dir):
        dirs.sort()
        rel_root = os.path.relpath(root, step_dir)
        for name in files:
            if rel_root == "." and name.startswith(_CHECKSUMS_PREFIX):
                continue
            out.append(name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/"))
    return sorted(out)


def _hash_all(step_dir: Path, relpaths: list[str], workers: int | None = None) -> list[tuple[int, str]]:
    """(size, hex digest) of each file, in order; several files at once (reads and hashing release the GIL)."""
    workers = workers or min(4, os.cpu_count() or 1)
    if workers == 1 or len(relpaths) < 2:
        return [_hash_file(step_dir / rel) for rel in relpaths]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda rel: _hash_file(step_dir / rel), relpaths))


def _hash_file(path: Path) -> tuple[int, str]:
    digest = xxhash.xxh3_128()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def write_atomically(target: Path, data: bytes) -> None:
    """Write to a temporary file next to `target`, fsync it, rename it over `target`, fsync the directory."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
