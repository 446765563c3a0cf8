"""Where a run's data comes from: `data.source` opened through `datasets`.

`data.source` is one of:

- `sklearn:digits`: the 8x8 digits shipped inside scikit-learn (offline);
- a local directory or file: parquet/arrow/csv/json/jsonl/txt files (the
  extension in any case) or a `save_to_disk` directory, all read through
  `datasets`; text files are read as UTF-8;
- a Hugging Face Hub id such as `ylecun/mnist`, loaded and cached by
  `datasets.load_dataset`;
- your own `package.module:fn` (see :mod:`nnx_cli.data.images`).

Every kind of data (:mod:`nnx_cli.data.images`, :mod:`nnx_cli.data.text`,
:mod:`nnx_cli.data.examples`, :mod:`nnx_cli.data.prompts`) opens its source
here::

    ds = open_dataset("data/notes.txt")     # DatasetDict({"train": Dataset(["text"])}): one row, the whole file
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import logging
import os
import re
import shlex
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.data.base import notice
from nnx_cli.data.cache import local_fingerprint
from nnx_cli.errors import UserError, did_you_mean, first_line

DIGITS = "sklearn:digits"
DIGITS_TRAIN = 1500  # first 1500 of 1797 images train, the rest test
FILE_BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".txt": "text",
    ".md": "text",
}
PLAIN_TEXT = (".txt", ".md")  # a file of these is one document, in the column `text`
_DECODED = (".txt", ".md", ".csv", ".json", ".jsonl")  # what `datasets` decodes as UTF-8 text


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: pixels `[1797, 64]` in 0..16 and labels.

    Read straight from the CSV that scikit-learn ships, which is what
    `sklearn.datasets.load_digits` parses too, without importing scikit-learn
    and SciPy (seconds of start-up for every run and every process).
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1]
    from sklearn.datasets import load_digits  # a layout we do not know: let scikit-learn find it

    digits = load_digits()
    return digits.data, digits.target


def check_local_source(source: str) -> None:
    """A UserError where `source` is meant as a local path that does not exist (it looks like one, see
    `_looks_like_path`, or a file or directory beside it has a close name, which it names)."""
    path = Path(source).expanduser()
    if path.exists():
        return
    beside = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
    closest = did_you_mean(path.name, beside, prefix=f"{path.parent}/" if str(path.parent) != "." else "")
    if _looks_like_path(source) or closest:  # `user/name` with no such directory beside it is a Hub id
        raise UserError(f"config key 'data.source': local dataset {source!r} does not exist{closest}")


def _looks_like_path(source: str) -> bool:
    """Whether `source` is meant as a local path, not a Hub dataset id (`user/name`, which ends in no slash)."""
    return (
        source.startswith(("/", "./", "../", "~", ".\\"))
        or source.endswith(("/", "\\"))
        or _suffix(Path(source)) in FILE_BUILDERS
        or source.count("/") > 1
    )


_cache: dict[str, tuple[str | None, Any]] = {}


def open_dataset(source: str) -> Any:
    """The `datasets` object (a DatasetDict, or a Dataset for save_to_disk of one split).

    Plain text (:func:`is_plain_text`) is read by `datasets`' `text` builder
    a document per file, in a column `text`: the whole file is one row, not
    a row per line. A directory's files are its `train` split in the order
    of their paths, unless their names say which split they are (`train.txt`,
    `test.md`, `validation/...`), as `datasets` reads any directory. Files a
    directory holds that `datasets` leaves out (another format than the one it
    reads, a name that says no split beside names that do) are named in a
    warning.
    """
    path = Path(source).expanduser()
    signature = local_fingerprint(path) if path.exists() else None
    if source in _cache and _cache[source][0] == signature:  # a local source edited since is read again
        return _cache[source][1]
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported as one UserError below
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # "Repo card metadata block was not found"
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    if path.is_file() and _blank(path):  # datasets' json builder ends in a bare StopIteration, or "no data"
        raise UserError(f"config key 'data.source': {source!r} is an empty file; it holds no rows to read")
    try:
        if path.exists():
            if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
                ds = datasets.load_from_disk(str(path))
            elif is_plain_text(source) and path.is_file():
                ds = datasets.load_dataset("text", sample_by="document", data_files=_pattern(path))
            elif is_plain_text(source):
                ds = _load_directory(source, path, "text", sample_by="document", data_dir=_pattern(path))
            elif path.is_dir():
                if _pattern(path.resolve()) != str(path.resolve()):
                    raise UserError(
                        f"config key 'data.source': `datasets` reads the path of directory {source!r} as a pattern, "
                        "where [ ] * ? are wildcards; rename the directory (or the one above it holding those "
                        "characters)"
                    )
                ds = _load_directory(source, path, str(path))
            elif _suffix(path) in FILE_BUILDERS:
                ds = datasets.load_dataset(FILE_BUILDERS[_suffix(path)], data_files=_pattern(path))
            else:
                raise UserError(
                    f"config key 'data.source': cannot read {source!r}; expected a directory or a "
                    f"{'/'.join(FILE_BUILDERS)} file"
                )
        elif _looks_like_path(source):
            check_local_source(source)
        else:
            with _said_if_slow(
                f"notice: loading Hub dataset {source!r} is taking a while: without a network it waits for the "
                "Hub's time-outs (HF_DATASETS_OFFLINE=1 reads the local cache alone)"
            ):
                ds = datasets.load_dataset(source)
    except UserError:
        raise
    except (ConnectionError, OSError) as e:
        if path.exists():
            raise UserError(f"config key 'data.source': cannot read local dataset {source!r}: {e}") from None
        raise UserError(
            f"config key 'data.source': {source!r} is no file or directory under {os.getcwd()} (a relative path is "
            f"read from where the command runs), and as a Hub dataset it cannot be loaded: the Hugging Face Hub "
            f"cannot be reached and the dataset is not in the local cache ({type(e).__name__}). Run once with "
            f"network access so `datasets` caches it, or download it and set data.source to the local copy, e.g. "
            f"data.source=/path/to/{source.rsplit('/', 1)[-1]} (a directory of parquet files or a save_to_disk "
            "directory)"
        ) from None
    except Exception as e:  # datasets raises many types for bad inputs; all are the user's data
        raise _load_error(source, path, e) from None
    _check_json_decodes(source, path)
    _cache[source] = (signature, ds)
    return ds


def _check_json_decodes(source: str, path: Path) -> None:
    """A UserError when a local JSON file of `source` is not UTF-8: pyarrow's JSON reader loads its bytes without
    a word, and reading its rows later ended in a UnicodeDecodeError traceback (CSV and text fail at the load)."""
    if not path.exists() or (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return
    json_files = [path] if path.is_file() else [f for f in path.rglob("*.json*") if f.is_file()]
    if not any(_suffix(f) in (".json", ".jsonl") for f in json_files):
        return
    found = _first_undecodable(path)
    if found is not None:
        raise UserError(_not_utf8(source, path, None, found))


@contextlib.contextmanager
def _said_if_slow(message: str, seconds: float = 5.0) -> Iterator[None]:
    """Print `message` to stderr if the block is still running after `seconds`."""
    timer = threading.Timer(seconds, lambda: print(message, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _suffix(path: Path) -> str:
    """The extension that picks the builder, in any case: `BOOK.TXT` is text as `book.txt` is."""
    return path.suffix.lower()


def _pattern(path: Path) -> str:
    """`path` as a `datasets` data-files pattern that matches only itself: `datasets` globs `data_files` and
    `data_dir`, so `draft[v2].txt` would otherwise look for `draftv.txt` and `draft2.txt`."""
    return glob.escape(str(path))


def _load_directory(source: str, path: Path, *args: Any, **kwargs: Any) -> Any:
    """`datasets.load_dataset(*args, **kwargs)` of directory `path`, warning of the files it leaves out."""
    import datasets

    builder = datasets.load_dataset_builder(*args, **kwargs)  # lists the files it will read, reads none
    read = {Path(f).resolve() for files in (builder.config.data_files or {}).values() for f in files}
    if read:
        _warn_left_out(source, path, read, [str(split) for split in builder.config.data_files])
    builder.download_and_prepare()  # what load_dataset does with the builder, without listing the files again
    return builder.as_dataset()


def _warn_left_out(source: str, path: Path, read: set[Path], splits: list[str]) -> None:
    """One line per reason that `datasets` leaves files of directory `path` out: another format than the one it
    reads (it reads one per directory, the most common), or a name saying no split where other names do."""
    from datasets import data_files

    skipped = set(getattr(data_files, "FILES_TO_IGNORE", ()))  # README.md, dataset_info.json, ...: not data
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and not _hidden(f.relative_to(path))]
    left = [f for f in files if f.resolve() not in read and f.name not in skipped]
    formats = {_format(f) for f in read}
    other_format = [f for f in left if _format(f) not in formats]
    unsplit = [f for f in left if _format(f) in formats]
    if other_format:
        suffixes = "/".join(sorted({_suffix(f) for f in read}))
        _warn(
            source,
            f"warning: config key 'data.source': `datasets` reads one format from directory {source!r}, its "
            f"{suffixes} files, and leaves out {_names(other_format, path)}; convert {_them(other_format)} to that "
            f"format or move {_them(other_format)} out of the directory",
        )
    cards = [f for f in files if f.name in skipped and _format(f) in formats]  # README.md among .md documents
    if cards:
        _warn(
            source,
            f"warning: config key 'data.source': `datasets` takes {_names(cards, path)} in directory {source!r} for "
            f"the dataset's card, not a document, and leaves {_them(cards)} out; rename {_them(cards)} to train on "
            f"{_them(cards)}",
        )
    if unsplit:
        _warn(
            source,
            f"warning: config key 'data.source': `datasets` reads directory {source!r} as splits "
            f"({', '.join(splits)}) named by its files and leaves out {_names(unsplit, path)}, whose "
            f"{'name says' if len(unsplit) == 1 else 'names say'} no split; rename {_them(unsplit)} (train-*, "
            f"test-*, ...) or move {_them(unsplit)} out of the directory",
        )


def _format(file: Path) -> str:
    """The builder that reads `file` (`.txt` and `.md` are both text), else its extension (`.png`)."""
    return FILE_BUILDERS.get(_suffix(file), _suffix(file))


def _names(files: list[Path], root: Path, most: int = 5) -> str:
    names = ", ".join(str(f.relative_to(root)) for f in files[:most])
    return names + (f" and {len(files) - most} more" if len(files) > most else "")


def _them(files: list[Path]) -> str:
    return "it" if len(files) == 1 else "them"


def _warn(source: str, message: str) -> None:
    notice((source, message), message)


def announce_download(what: str) -> None:
    """Say (once per process, on process 0) that `what` is not in the local Hugging Face cache and the Hub is
    being asked for it: without a network that waits about 25 s for the Hub's time-outs, which would otherwise
    pass without a word. Offline (HF_HUB_OFFLINE) the lookup fails at once and nothing is said."""
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        notice(("hub", what), f"notice: {what} is not in the local Hugging Face cache: asking the Hub for it")


def _load_error(source: str, path: Path, error: Exception) -> UserError:
    """Why `source` cannot be loaded, in words: the cause `datasets` wraps (a DatasetGenerationError says only
    that something failed) and, for text that is not UTF-8, which file, where, and how to convert it."""
    from datasets.exceptions import DatasetGenerationError

    chain = _chain(error)
    undecodable = next((link for link in chain if isinstance(link, UnicodeDecodeError)), None)
    if undecodable is not None:
        return UserError(_not_utf8(source, path, undecodable))
    cause = next((link for link in chain if not isinstance(link, DatasetGenerationError)), error)
    empty = _empty_saved_splits(path)
    if empty:  # datasets cannot load a saved split of no rows (an IndexError deep in its tables)
        return UserError(
            f"config key 'data.source': the split{'s' if len(empty) > 1 else ''} {', '.join(map(repr, empty))} of "
            f"{source!r} hold{'' if len(empty) > 1 else 's'} no rows, and `datasets` cannot load a saved split "
            "without any: save it without that split, or give it rows"
        )
    configs = (
        re.search(r"available configs: \[([^\]]*)\]", str(cause)) if "Config name is missing" in str(cause) else None
    )
    if "corresponds to no data" in str(cause):  # a CSV of its header alone, a JSON file holding []
        return UserError(f"config key 'data.source': {source!r} holds no rows to read")
    if configs is not None:  # the list was on a line after the first, which alone was said
        return UserError(
            f"config key 'data.source': {source!r} holds several configs ({configs.group(1)}), and nnx reads one: "
            "set data.source to the files of one of them (for a local directory, its folder or files)"
        )
    if path.is_file() and FILE_BUILDERS.get(_suffix(path)) == "json":  # Arrow's row counts start at its blocks
        bad = _first_line_not_json(path)
        if bad is not None:
            line, why = bad
            return UserError(
                f"config key 'data.source': line {line:,} of {source!r} is not JSON ({why}); a JSON Lines file "
                "holds one JSON object a line: fix or remove that line"
            )
    return UserError(
        f"config key 'data.source': cannot load dataset {source!r}: {type(cause).__name__}: {first_line(cause)}"
    )


def _blank(path: Path, most: int = 1 << 20) -> bool:
    """Whether file `path` holds nothing but whitespace (read only when under `most` bytes)."""
    size = path.stat().st_size
    return size == 0 or (size < most and not path.read_bytes().strip())


def _first_line_not_json(path: Path) -> tuple[int, str] | None:
    """The 1-based number of the first non-blank line of JSON Lines file `path` that is not JSON, and why; None
    when each is, or when a `.json` file is no JSON Lines file (one document over many lines: its first line is
    no JSON of its own)."""
    import json

    first = _suffix(path) != ".jsonl"
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as e:
                    return None if first else (number, str(e).split(":")[0])
                first = False
    return None


def _empty_saved_splits(path: Path) -> list[str]:
    """The splits of a `save_to_disk` directory that were saved with no data file (no rows)."""
    import json

    found = []
    for state in sorted(path.glob("*/state.json")) if path.is_dir() else []:
        try:
            if not json.loads(state.read_text()).get("_data_files", [None]):
                found.append(state.parent.name)
        except (OSError, ValueError):
            continue
    return found


def _chain(error: BaseException) -> list[BaseException]:
    """`error`, then what it was raised from or while handling, and so on."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def _not_utf8(
    source: str, path: Path, error: UnicodeDecodeError | None, found: tuple[Path, int, int, int] | None = None
) -> str:
    """The message for a source that is not UTF-8: the file, offset and line of its first bad byte (`found`, else
    looked for), and how to convert it."""
    if found is None:
        found = _first_undecodable(path) if path.exists() else None
    if found is None:  # a Hub dataset, or a file that decodes after all: say what `datasets` said
        return (
            f"config key 'data.source': cannot load dataset {source!r}: a file of it is not UTF-8 text ({error}); "
            "convert it to UTF-8, e.g. with iconv -f latin1 -t utf-8"
        )
    file, offset, byte, line = found
    shown = source if file == path else str(Path(source) / file.relative_to(path))
    encoding = "utf-16" if byte in (0xFF, 0xFE) and offset == 0 else "latin1"  # a UTF-16 byte-order mark
    named = shlex.quote(shown)
    if file == path:
        converted = shlex.quote(str(Path(shown).with_suffix(f".utf8{Path(shown).suffix}")))
        how = f"iconv -f {encoding} -t utf-8 {named} > {converted}, then data.source={converted}"
    else:
        how = f"iconv -f {encoding} -t utf-8 {named} > {named}.utf8 && mv {named}.utf8 {named}"
    return (
        f"config key 'data.source': {shown!r} is not UTF-8 text (byte 0x{byte:02x} at offset {offset:,}, line "
        f"{line:,}), and `datasets` reads text as UTF-8; convert it from its encoding ({encoding}, say): {how}"
    )


def _first_undecodable(path: Path) -> tuple[Path, int, int, int] | None:
    """The first file of `path` (a file, or the text files under a directory) that is not UTF-8, with the offset,
    value and line of its first bad byte; None if every file decodes."""
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for file in files:
        if file == path or (not _hidden(file.relative_to(path)) and _suffix(file) in _DECODED):
            found = _undecodable_byte(file)
            if found is not None:
                return (file, *found)
    return None


def _undecodable_byte(file: Path) -> tuple[int, int, int] | None:
    """The offset, value and line of the first byte of `file` that is not UTF-8, read a MiB at a time, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0
    with open(file, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = decoder.getstate()[0]  # the first bytes of a character the last chunk cut
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.object is pending + chunk
                return offset - len(pending) + e.start, e.object[e.start], lines + e.object[: e.start].count(b"\n") + 1
            if not chunk:
                return None
            offset, lines = offset + len(chunk), lines + chunk.count(b"\n")


def is_plain_text(source: str) -> bool:
    """Whether `source` is plain text: a local `.txt` or `.md` file, or a directory whose files are all `.txt` or
    `.md` (hidden ones aside, which `datasets` skips too: a name starting with `.` or `__` anywhere in the path).

    >>> is_plain_text("notes.txt"), is_plain_text("sklearn:digits")   # doctest: +SKIP
    (True, False)
    """
    path = Path(source).expanduser()
    if path.is_file():
        return _suffix(path) in PLAIN_TEXT
    if not path.is_dir():
        return False
    files = [f for f in path.rglob("*") if f.is_file() and not _hidden(f.relative_to(path))]
    return bool(files) and all(_suffix(f) in PLAIN_TEXT for f in files)


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "__")) for part in relative.parts)
