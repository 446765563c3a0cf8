"""Where a run's data comes from: `data.source` opened through `datasets`.

`data.source` is one of:

- `sklearn:digits`: the 8x8 digits shipped inside scikit-learn (offline);
- a local directory or file: parquet/arrow/csv/json/jsonl/txt files or a
  `save_to_disk` directory, all read through `datasets`;
- a Hugging Face Hub id such as `ylecun/mnist`, loaded and cached by
  `datasets.load_dataset`;
- your own `package.module:fn` (see :mod:`nnx_cli.data.images`).

Every kind of data (:mod:`nnx_cli.data.images`, :mod:`nnx_cli.data.text`,
:mod:`nnx_cli.data.examples`, :mod:`nnx_cli.data.prompts`) opens its source
here::

    ds = open_dataset("data/notes.txt")     # DatasetDict({"train": Dataset(["text"])}): one row, the whole file
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.data.cache import local_fingerprint
from nnx_cli.errors import UserError

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


def _looks_like_path(source: str) -> bool:
    return (
        source.startswith(("/", "./", "../", "~", ".\\"))
        or Path(source).suffix in FILE_BUILDERS
        or source.count("/") > 1
    )


_cache: dict[str, tuple[str | None, Any]] = {}


def open_dataset(source: str) -> Any:
    """The `datasets` object (a DatasetDict, or a Dataset for save_to_disk of one split).

    Plain text (:func:`is_plain_text`) is read by `datasets`' `text` builder
    a document per file, in a column `text`: the whole file is one row, not
    a row per line. A directory's files are its `train` split in the order
    of their paths, unless their names say which split they are (`train.txt`,
    `test.md`, `validation/...`), as `datasets` reads any directory.
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
    try:
        if path.exists():
            if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
                ds = datasets.load_from_disk(str(path))
            elif is_plain_text(source):
                where = {"data_files": str(path)} if path.is_file() else {"data_dir": str(path)}
                ds = datasets.load_dataset("text", sample_by="document", **where)
            elif path.is_dir():
                ds = datasets.load_dataset(str(path))
            elif path.suffix in FILE_BUILDERS:
                ds = datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
            else:
                raise UserError(
                    f"config key 'data.source': cannot read {source!r}; expected a directory or a "
                    f"{'/'.join(FILE_BUILDERS)} file"
                )
        elif _looks_like_path(source):
            raise UserError(f"config key 'data.source': local dataset {source!r} does not exist")
        else:
            ds = datasets.load_dataset(source)
    except UserError:
        raise
    except (ConnectionError, OSError) as e:
        if path.exists():
            raise UserError(f"config key 'data.source': cannot read local dataset {source!r}: {e}") from None
        raise UserError(
            f"config key 'data.source': cannot load Hub dataset {source!r}: the Hugging Face Hub cannot be reached "
            f"and the dataset is not in the local cache ({type(e).__name__}). Run once with network access so "
            f"`datasets` caches it, or download it and set data.source to the local copy, e.g. "
            f"data.source=/path/to/{source.rsplit('/', 1)[-1]} (a directory of parquet files or a save_to_disk "
            "directory)"
        ) from None
    except Exception as e:  # datasets raises many types for bad inputs; all are the user's data
        raise UserError(f"config key 'data.source': cannot load dataset {source!r}: {type(e).__name__}: {e}") from None
    _cache[source] = (signature, ds)
    return ds


def is_plain_text(source: str) -> bool:
    """Whether `source` is plain text: a local `.txt` or `.md` file, or a directory whose files are all `.txt` or
    `.md` (hidden ones aside, which `datasets` skips too: a name starting with `.` or `__` anywhere in the path).

    >>> is_plain_text("notes.txt"), is_plain_text("sklearn:digits")   # doctest: +SKIP
    (True, False)
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path.suffix in PLAIN_TEXT
    if not path.is_dir():
        return False
    files = [f for f in path.rglob("*") if f.is_file() and not _hidden(f.relative_to(path))]
    return bool(files) and all(f.suffix in PLAIN_TEXT for f in files)


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "__")) for part in relative.parts)
