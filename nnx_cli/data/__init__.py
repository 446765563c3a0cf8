"""Where a run's data comes from, and what the training loop reads.

`data.source` is one of:

- `sklearn:digits`: the 8x8 digits shipped inside scikit-learn (offline);
- a local directory or file: parquet/arrow/csv/json/jsonl/txt files or a
  `save_to_disk` directory, all read through `datasets`;
- a Hugging Face Hub id such as `ylecun/mnist`, loaded and cached by
  `datasets.load_dataset`;
- your own `package.module:fn` (see :mod:`nnx_cli.data.images`).

Images (:mod:`nnx_cli.data.images`) are decoded once into a uint8 cache,
text (:mod:`nnx_cli.data.text`, when `data.text_key` is set) is tokenized
once into a token stream, and fine-tuning examples
(:mod:`nnx_cli.data.examples`, `data.format: chat | completion | preference`)
into rows with loss targets, and prompts to sample from
(:mod:`nnx_cli.data.prompts`, `data.format: prompt`) into token ids; all are
memory-mapped by every later run
(:mod:`nnx_cli.data.cache`). The loop reads them through the interface in
:mod:`nnx_cli.data.base`, fed by :mod:`nnx_cli.data.pipeline`::

    train = train_split(cfg)      # a TrainSplit: epoch keys from (seed, epoch), stored rows, prepare
    evals = eval_split(cfg)       # an EvalSplit, read in order
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.config import Config
from nnx_cli.data.base import DataSpec, EvalSplit, TrainSplit
from nnx_cli.data.cache import local_fingerprint
from nnx_cli.errors import UserError

DIGITS = "sklearn:digits"
_DIGITS_TRAIN = 1500  # first 1500 of 1797 images train, the rest test

# Shapes of well-known datasets, so `nnx-inspect` never has to read them.
_KNOWN = {
    "digits": ((8, 8, 1), 10),
    "mnist": ((28, 28, 1), 10),
    "fashion_mnist": ((28, 28, 1), 10),
    "kmnist": ((28, 28, 1), 10),
}
_FILE_BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".txt": "text",
    ".md": "text",
}
PLAIN_TEXT = (".txt", ".md")  # a file of these is one document, in the column `text`


def known_spec(source: str) -> DataSpec | None:
    """The input shape of a well-known dataset from its name alone, else None.

    >>> known_spec("ylecun/mnist")
    DataSpec(input_shape=(28, 28, 1), num_classes=10)
    """
    name = "digits" if source == DIGITS else Path(source.rstrip("/")).name.lower().replace("-", "_")
    shape = _KNOWN.get(name)
    return DataSpec(*shape) if shape else None


def spec_from_config(cfg: Config) -> DataSpec | None:
    """The input spec without reading data: a text config's from its tokenizer and `data.seq_len`; else
    `model.input_shape` if set, or a known dataset's."""
    from nnx_cli.data import text

    if text.is_text(cfg.data):
        vocab_size = cfg.model.options.get("vocab_size") or cfg.model.num_classes
        return text.text_spec(cfg.data, vocab_size=vocab_size, pretrained=cfg.model.pretrained)
    known = known_spec(cfg.data.source)
    if cfg.model.input_shape is None:
        return known
    num_classes = cfg.model.num_classes if cfg.model.num_classes is not None else known.num_classes if known else None
    return DataSpec(tuple(cfg.model.input_shape), num_classes)


def train_split(cfg: Config) -> TrainSplit:
    """The training split of `cfg.data`, addressed by `(cfg.seed, epoch)`."""
    from nnx_cli.data import examples, images, prompts, text

    if cfg.data.format == prompts.PROMPT:
        return prompts.load_prompt_splits(cfg, ("train",)).train
    if examples.is_examples(cfg.data):
        return examples.load_example_splits(cfg.data, cfg.seed, ("train",), pretrained=cfg.model.pretrained).train
    if text.is_text(cfg.data):
        return text.load_text_splits(cfg.data, cfg.seed, splits=("train",), pretrained=cfg.model.pretrained).train
    return images.image_train_split(cfg.data, cfg.seed)


def eval_split(cfg: Config) -> EvalSplit:
    """The evaluation split of `cfg.data`, read in order."""
    from nnx_cli.data import examples, images, prompts, text

    if cfg.data.format == prompts.PROMPT:
        return prompts.load_prompt_splits(cfg, ("eval",)).eval
    if examples.is_examples(cfg.data):
        return examples.load_example_splits(cfg.data, cfg.seed, ("eval",), pretrained=cfg.model.pretrained).eval
    if text.is_text(cfg.data):
        return text.load_text_splits(cfg.data, cfg.seed, splits=("eval",), pretrained=cfg.model.pretrained).eval
    return images.image_eval_split(cfg.data)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
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
        or Path(source).suffix in _FILE_BUILDERS
        or source.count("/") > 1
    )


_cache: dict[str, tuple[str | None, Any]] = {}


def _open(source: str) -> Any:
    """The `datasets` object (a DatasetDict, or a Dataset for save_to_disk of one split).

    A `.txt` or `.md` file, and each file of a directory of `.txt` files, is
    one row (one document) in a column `text`, not a row per line.
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
            elif path.is_dir():
                ds = datasets.load_dataset(str(path), **_text_options(path))
            elif path.suffix in _FILE_BUILDERS:
                ds = datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), **_text_options(path))
            else:
                raise UserError(
                    f"config key 'data.source': cannot read {source!r}; expected a directory or a "
                    f"{'/'.join(_FILE_BUILDERS)} file"
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
            f"data.source=/path/to/mnist (a directory of parquet files or a save_to_disk directory)"
        ) from None
    except Exception as e:  # datasets raises many types for bad inputs; all are the user's data
        raise UserError(f"config key 'data.source': cannot load dataset {source!r}: {type(e).__name__}: {e}") from None
    _cache[source] = (signature, ds)
    return ds


def _text_options(path: Path) -> dict[str, Any]:
    """`datasets`' options for a plain-text file or a directory of them: one row per file, not per line."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    suffixes = {p.suffix for p in files if p.suffix in _FILE_BUILDERS}
    return {"sample_by": "document"} if suffixes and suffixes <= set(PLAIN_TEXT) else {}
