"""Text datasets for language models: token streams cached on disk, read as windows of `seq_len + 1` tokens.

A text dataset is one with `data.text_key` set: the column of documents of
`data.source` (a Hub id, a local directory of parquet/jsonl/txt files, or one
`.txt`/`.md`/`.jsonl`/`.parquet` file). Plain text needs no `data.text_key`: a
`.txt` or `.md` file is one document, and so is each file of a directory of
them, in the order of their paths (:func:`fill_text_key`). Each split's
documents are tokenized once with `data.tokenizer`, each followed by the
end-of-document id, and stored as one uint16 stream
(uint32 for vocabularies above 65,536 ids) in the data cache, keyed by the
source, split, column, tokenizer and its version, and a fingerprint of the
source (sizes and modification times of local files; `datasets`' own
fingerprint of a Hub split). Later runs memory-map the stream: nothing is
read or tokenized again, and a stream larger than memory works.

The stream is written a task (about 4 MiB of text) at a time, so a corpus
larger than memory tokenizes too; a single document must fit in memory, and
one longer than a million characters is tokenized in pieces cut after
newlines. A Hugging Face tokenizer runs on its own threads and, for splits
over 32 MiB of text with `data.workers` > 0, in that many worker processes;
`bytes` always runs in this process (about 150 MB/s, faster than workers).
A terminal shows a progress bar.

Training windows (the keys are window start offsets; see `nnx_cli.data.base`):
epoch `e` draws an offset `o` in `[0, seq_len]` and then a permutation from
`np.random.default_rng((seed, e))`, and visits the windows starting at
`o, o + seq_len, o + 2 * seq_len, ...` in that permuted order. Each window's
last token is the next window's first, so every token is a target once. An
epoch has as many windows as fit at the largest offset, the same for every
epoch. Evaluation reads every window from offset 0 in order, dropping the last
partial one.

A source with a single split (a lone file, a directory of text files none of
whose names says a split, a save_to_disk of one Dataset) asked for an eval
split it lacks holds out the last 10% of that split's token stream as the eval
split and trains on the first 90% (a one-line notice says so): the end of a
book, or of a directory's last files::

    splits = load_text_splits(cfg.data, seed=0)
    keys = splits.train.epoch_keys(0)[:64]
    batch = splits.train.read(keys)               # {"tokens": uint16 [64, seq_len + 1]}
    inputs = splits.train.prepare(batch)          # in the step: int32 tokens
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_cli.config import DataConfig
from nnx_cli.data.base import DataSpec
from nnx_cli.data.cache import cache_root, get_or_build, local_fingerprint
from nnx_cli.data.sources import PLAIN_TEXT, is_plain_text, open_dataset
from nnx_cli.data.sources import notice as _notice
from nnx_cli.data.tokenizers import BytesTokenizer, HFTokenizer, load_tokenizer, tokenizer_vocab_size
from nnx_cli.errors import UserError, did_you_mean

HOLDOUT_FRACTION = 0.1  # of a single split's tokens, held out as its eval split
_TASK_BYTES = 4 << 20  # text per tokenization task
_PARALLEL_MIN_BYTES = 32 << 20  # smaller splits are tokenized in this process: starting workers costs more
_PIECE_CHARS = 1 << 20  # longer documents are tokenized in pieces of about this many characters


# --------------------------------------------------------------------------- windows


class _Windows:
    """A token stream read as windows of `seq_len + 1` tokens, keyed by their start offsets."""

    def __init__(self, tokens: np.ndarray, seq_len: int, spec: DataSpec):
        self.tokens = tokens
        self.seq_len = seq_len
        self.spec = spec

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The windows starting at `keys`: `{"tokens": [len(keys), seq_len + 1]}` in the stream's dtype."""
        windows = np.lib.stride_tricks.sliding_window_view(self.tokens, self.seq_len + 1)
        return {"tokens": windows[np.asarray(keys, dtype=np.int64)]}

    def stored(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens}

    def read_on_device(self, stored: dict[str, jax.Array], keys: jax.Array) -> dict[str, jax.Array]:
        tokens = stored["tokens"]
        window = jax.vmap(lambda start: jax.lax.dynamic_slice_in_dim(tokens, start, self.seq_len + 1))
        return {"tokens": window(keys)}

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {**rows, "tokens": rows["tokens"].astype(jnp.int32)}


class TextTrainSplit(_Windows):
    """Training windows of a token stream, epoch `e` drawn from `(seed, e)` (see the module docstring).

    >>> split = TextTrainSplit(np.arange(100, dtype=np.uint16), seq_len=8, seed=0, spec=DataSpec((8,), 257))
    >>> len(split), split.read(split.epoch_keys(0)[:2])["tokens"].shape
    (11, (2, 9))
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, spec: DataSpec):
        super().__init__(tokens, seq_len, spec)
        self.seed = seed
        self.num_windows = (len(tokens) - 1 - seq_len) // seq_len  # windows that fit at offset seq_len
        if self.num_windows < 1:
            raise UserError(
                f"config key 'data.seq_len' ({seq_len}): the training split has {len(tokens)} tokens, too few for "
                f"one window of seq_len + 1 tokens at every offset (at least {2 * seq_len + 1} needed); lower "
                "data.seq_len or train on more text"
            )

    def __len__(self) -> int:
        return self.num_windows

    def steps_per_epoch(self, batch_size: int) -> int:
        if batch_size > self.num_windows:
            raise UserError(
                f"config key 'train.batch_size' ({batch_size}) is larger than the training split ({self.num_windows} "
                f"windows of {self.seq_len + 1} tokens); lower train.batch_size or data.seq_len"
            )
        return self.num_windows // batch_size

    def epoch_offset(self, epoch: int) -> int:
        """Where epoch `epoch` lays out its windows: in `[0, seq_len]`."""
        return int(np.random.default_rng((self.seed, epoch)).integers(0, self.seq_len + 1))

    def epoch_keys(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, epoch))
        offset = rng.integers(0, self.seq_len + 1)  # drawn first: epoch_offset repeats this draw
        return offset + rng.permutation(self.num_windows).astype(np.int64) * self.seq_len


class TextEvalSplit(_Windows):
    """Every window of a token stream from offset 0, in order; the last partial window is dropped.

    >>> split = TextEvalSplit(np.arange(100, dtype=np.uint16), seq_len=8, spec=DataSpec((8,), 257))
    >>> len(split), split.keys()[:3].tolist()
    (12, [0, 8, 16])
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, spec: DataSpec):
        super().__init__(tokens, seq_len, spec)
        self.num_windows = max(len(tokens) - 1, 0) // seq_len

    def __len__(self) -> int:
        return self.num_windows

    def keys(self) -> np.ndarray:
        """The start offsets of every window, in order."""
        return np.arange(self.num_windows, dtype=np.int64) * self.seq_len

    def eval_batches(self, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, self.num_windows, batch_size):
            windows = np.arange(start, start + batch_size)[rows]
            real = windows < self.num_windows
            tokens = np.zeros((len(windows), self.seq_len + 1), self.tokens.dtype)
            tokens[real] = self.read(windows[real] * self.seq_len)["tokens"]
            yield {"tokens": tokens, "mask": real}


# --------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class TextSplits:
    """The splits `load_text_splits` was asked for; None for one not asked for (or `data.eval_split: null`)."""

    train: TextTrainSplit | None
    eval: TextEvalSplit | None
    spec: DataSpec


def is_text(cfg: DataConfig) -> bool:
    """Whether `cfg` describes text for a language model: documents (`data.text_key` is set) or fine-tuning
    examples (`data.format` chat, completion or preference) or prompts to sample completions of."""
    return cfg.text_key is not None or cfg.format in ("chat", "completion", "preference", "prompt")


def fill_text_key(cfg: DataConfig) -> None:
    """Plain text needs no `data.text_key`: a `.txt` or `.md` file, or a directory of them
    (:func:`~nnx_cli.data.sources.is_plain_text`), as `data.source` of documents (`data.format: text`) is read
    from its one column, `text`.

    >>> cfg = DataConfig(source="book.txt")      # doctest: +SKIP
    >>> fill_text_key(cfg); cfg.text_key         # doctest: +SKIP
    'text'
    """
    if cfg.text_key is None and cfg.format == "text" and is_plain_text(cfg.source):
        cfg.text_key = "text"


def text_spec(cfg: DataConfig, vocab_size: int | None = None, pretrained: str | None = None) -> DataSpec:
    """The DataSpec of a text config without reading data: `(seq_len,)` inputs and the tokenizer's vocabulary.

    `vocab_size` (from `model.vocab_size`) spares loading a Hub tokenizer; `pretrained` is `model.pretrained`,
    whose tokenizer `data.tokenizer: pretrained` means.

    >>> text_spec(DataConfig(source="notes.txt", text_key="text", seq_len=128))
    DataSpec(input_shape=(128,), num_classes=257, tokenizer='bytes')
    """
    vocab = vocab_size if vocab_size is not None else tokenizer_vocab_size(cfg.tokenizer, pretrained)
    return DataSpec((cfg.seq_len,), vocab, cfg.tokenizer)


def load_text_splits(
    cfg: DataConfig, seed: int, splits: Collection[str] = ("train", "eval"), pretrained: str | None = None
) -> TextSplits:
    """The training and/or eval windows of a text config, tokenizing each split into the cache the first time.

    `splits` names which to load: `"train"` (`data.train_split`) and/or
    `"eval"` (`data.eval_split`, None when that is null). A held-out eval
    split is left out of training whether or not it is loaded too.
    `pretrained` is `model.pretrained` (for `data.tokenizer: pretrained`).

    >>> splits = load_text_splits(DataConfig(source="notes.txt", text_key="text", seq_len=64), seed=0)  # doctest: +SKIP
    >>> splits.train.steps_per_epoch(batch_size=8), len(splits.eval)                            # doctest: +SKIP
    (120, 13)
    """
    if cfg.text_key is None:
        raise UserError("config key 'data.text_key' is not set; name the column of documents, e.g. data.text_key=text")
    unknown = set(splits) - {"train", "eval"}
    if unknown:
        raise ValueError(f"splits must be 'train' and/or 'eval', not {sorted(unknown)}")
    tokenizer = load_tokenizer(cfg.tokenizer, pretrained)
    spec = DataSpec((cfg.seq_len,), tokenizer.vocab_size, cfg.tokenizer)
    source = _Source(cfg)
    want_train, want_eval = "train" in splits, "eval" in splits and cfg.eval_split is not None
    train_tokens = eval_tokens = None
    if cfg.eval_split is not None and source.holds_out(cfg.eval_split):
        full = _token_stream(source, cfg.train_split, "data.train_split", tokenizer)
        cut = len(full) - int(len(full) * HOLDOUT_FRACTION)
        train_tokens, eval_tokens = full[:cut], full[cut:]
        _notice(
            (cfg.source, cfg.eval_split),
            f"notice: {cfg.source!r} has no split {cfg.eval_split!r}; its last {HOLDOUT_FRACTION:.0%} "
            f"({len(eval_tokens):,} token{'' if len(eval_tokens) == 1 else 's'}) is held out as {cfg.eval_split!r} "
            "and the first "
            f"{1 - HOLDOUT_FRACTION:.0%} trains",
        )
    else:
        if want_train:
            train_tokens = _token_stream(source, cfg.train_split, "data.train_split", tokenizer)
        if want_eval:
            eval_tokens = _token_stream(source, cfg.eval_split, "data.eval_split", tokenizer)
    if want_train:
        _require_text(train_tokens, tokenizer.eod_id, cfg, "data.train_split", cfg.train_split)
    if want_eval:
        _require_text(eval_tokens, tokenizer.eod_id, cfg, "data.eval_split", cfg.eval_split)
    train = TextTrainSplit(train_tokens, cfg.seq_len, seed, spec) if want_train else None
    evaluation = None
    if want_eval:
        evaluation = TextEvalSplit(eval_tokens, cfg.seq_len, spec)
        if len(evaluation) == 0:
            raise UserError(
                f"config key 'data.eval_split': split {cfg.eval_split!r} has {len(eval_tokens)} tokens, fewer than "
                f"one window of data.seq_len + 1 = {cfg.seq_len + 1}; lower data.seq_len, or give it more text "
                "(nnx-train: or set data.eval_split=null to train without evals)"
            )
    return TextSplits(train, evaluation, spec)


def _require_text(tokens: np.ndarray, eod: int, cfg: DataConfig, key: str, split: str) -> None:
    """A UserError where a split's documents are all empty (its stream only ends documents): a run trained on
    it without a word, and its samples had no prompt. Most streams show text in their first block."""
    if np.any(tokens[: 1 << 16] != eod) or np.any(tokens != eod):
        return
    advice = "set data.eval_split=null to train without evals" if key == "data.eval_split" else "give it text"
    raise UserError(
        f"config key {key!r}: split {split!r} of {cfg.source!r} holds no text: its {len(tokens):,} documents in "
        f"column {cfg.text_key!r} are all empty, or data.tokenizer makes no token of their text; check "
        f"data.text_key and data.tokenizer, or {advice}"
    )


def splits_of(cfg: DataConfig) -> list[str]:
    """The split names of `data.source` (a lone file has the one split `train`)."""
    return _Source(cfg).splits()


class _Source:
    """`data.source` as far as token streams need it: its splits, their fingerprints and documents.

    A local source is fingerprinted from its files' sizes and modification
    times and is opened with `datasets` only to build a stream or, once, to
    list its splits (a lone file has the one split `train`); a Hub dataset is
    opened to read `datasets`' fingerprint of the split.
    """

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.path = Path(cfg.source).expanduser()
        self.local = self.path.exists()
        self.id = str(self.path.resolve()) if self.local else cfg.source
        self.cache = cache_root(cfg.cache_dir)

    def splits(self) -> list[str]:
        if not self.local:
            return list(self._dataset_dict())
        if self.path.is_file():
            return ["train"]
        parts = {"kind": "splits", "source": self.id, "fingerprint": local_fingerprint(self.path)}
        entry = get_or_build(
            self.cache, f"splits-{self.slug()}", parts, lambda _: {"splits": list(self._dataset_dict())}
        )
        return list(entry.meta["splits"])

    def holds_out(self, eval_split: str) -> bool:
        """Whether `eval_split` is the last part of the training split: a single-split source lacking it."""
        splits = self.splits()
        return eval_split not in splits and splits == [self.cfg.train_split]

    def fingerprint(self, split: str, key: str, columns: list[str] | None = None) -> str:
        if self.local:
            return local_fingerprint(self.path)
        return str(self.dataset(split, key, columns)._fingerprint)

    def dataset(self, split: str, key: str, columns: list[str] | None = None) -> Any:
        """The `datasets.Dataset` of `split`, with its text column checked (or, given `columns`, those columns
        selected: fine-tuning examples; prompts keep every column, the rewards read them)."""
        import datasets

        ds = self._dataset_dict()
        if split not in ds:
            raise UserError(
                f"config key {key!r}: dataset {self.cfg.source!r} has no split {split!r}"
                f"{did_you_mean(split, list(ds))}; available: {', '.join(ds)}"
                + (" (set data.eval_split=null to train without evals)" if key == "data.eval_split" else "")
            )
        ds = ds[split]
        if columns is not None:
            missing = [c for c in columns if c not in ds.column_names]
            if missing and self.cfg.format == "preference":
                raise UserError(
                    f"row 0 of {self.cfg.source!r} has no {missing[0]!r}, nor has any other row: preference rows "
                    f"hold {', '.join(map(repr, columns))}{did_you_mean(missing[0], ds.column_names)}; columns: "
                    + ", ".join(ds.column_names)
                )
            if missing and self.cfg.format == "prompt":
                raise UserError(
                    f"config key 'data.prompt_key': dataset {self.cfg.source!r} has no column {missing[0]!r}"
                    f"{did_you_mean(missing[0], ds.column_names)}; columns: {', '.join(ds.column_names)}"
                )
            if self.cfg.format == "prompt":  # every column goes to the reward functions
                return ds
            if missing:
                option = (  # the key of the column missing, not both ("data.prompt_key/completion_key")
                    "messages_key"
                    if self.cfg.format == "chat"
                    else "prompt_key"
                    if missing[0] == self.cfg.prompt_key
                    else "completion_key"
                )
                raise UserError(
                    f"config key 'data.{option}': dataset {self.cfg.source!r} has no column {missing[0]!r}"
                    f"{did_you_mean(missing[0], ds.column_names)}; columns: {', '.join(ds.column_names)}"
                )
            return ds.select_columns(columns)
        text_key, columns = self.cfg.text_key, list(ds.column_names)
        if text_key not in columns:
            txt = " (a .txt or .md file is one document in the column 'text')" if self._is_txt() else ""
            raise UserError(
                f"config key 'data.text_key': dataset {self.cfg.source!r} has no column {text_key!r}"
                f"{did_you_mean(text_key, columns)}; columns: {', '.join(columns)}{txt}"
            )
        feature = ds.features[text_key]
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            mixed = type(feature).__name__ == "Json"  # datasets' type for a JSON column of values of several types
            held = "values of several types (strings and others)" if mixed else str(feature)
            raise UserError(
                f"config key 'data.text_key': column {text_key!r} of {self.cfg.source!r} holds {held}, not text; "
                f"name a column of strings{' in every row' if mixed else ''}"
            )
        return ds.select_columns([text_key])

    def _dataset_dict(self) -> Any:
        import datasets

        ds = open_dataset(self.cfg.source)
        return ds if isinstance(ds, datasets.DatasetDict) else datasets.DatasetDict({"train": ds})

    def _is_txt(self) -> bool:
        return self.path.suffix.lower() in PLAIN_TEXT or (
            self.path.is_dir() and any(f.suffix.lower() in PLAIN_TEXT for f in self.path.rglob("*"))
        )

    def slug(self) -> str:
        name = self.path.resolve().name if self.local else self.cfg.source
        return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "source"


# --------------------------------------------------------------------------- token streams


def _token_stream(source: _Source, split: str, key: str, tokenizer: BytesTokenizer | HFTokenizer) -> np.ndarray:
    """The token stream of `split` (memory-mapped), tokenized into the cache the first time."""
    cfg = source.cfg
    parts = {
        "kind": "tokens",
        "source": source.id,
        "split": split,
        "text_key": cfg.text_key,
        "tokenizer": tokenizer.name,
        "tokenizer_version": tokenizer.version,
        "fingerprint": source.fingerprint(split, key),
    }

    def build(directory: Path) -> dict[str, Any]:
        return _build_stream(directory / "tokens.npy", source.dataset(split, key), tokenizer, _workers(cfg.workers))

    entry = get_or_build(source.cache, f"tokens-{source.slug()}-{split}", parts, build)
    return entry.array("tokens")


def _workers(setting: int | None) -> int:
    """`data.workers`: null is the cores this process may use."""
    if setting is not None:
        return setting
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stream_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _build_stream(path: Path, ds: Any, tokenizer: BytesTokenizer | HFTokenizer, workers: int) -> dict[str, Any]:
    """Tokenize every document of `ds` (one text column) into the .npy stream at `path`, a task at a time."""
    started = time.perf_counter()
    dtype = stream_dtype(tokenizer.vocab_size)
    text_bytes = ds.data.nbytes
    rows_per_task = max(1, int(_TASK_BYTES * len(ds) / max(text_bytes, 1)))
    tasks = [(start, min(start + rows_per_task, len(ds))) for start in range(0, len(ds), rows_per_task)]
    if isinstance(tokenizer, BytesTokenizer) or text_bytes < _PARALLEL_MIN_BYTES:
        workers = 0  # bytes run at ~150 MB/s here, faster than worker processes can be started and fed
    workers = min(workers, len(tasks))
    documents = 0
    with _NpyWriter(path, dtype) as out, _progress(len(ds), f"tokenizing {len(ds):,} documents") as advance:
        for (start, stop), (tokens, count) in zip(tasks, _tokenize_tasks(ds, tokenizer, dtype, tasks, workers)):
            out.write(tokens)
            documents += count
            advance(stop - start)
    return {
        "tokens": out.count,
        "documents": documents,
        "dtype": dtype.name,
        "workers": workers,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _tokenize_tasks(
    ds: Any, tokenizer: BytesTokenizer | HFTokenizer, dtype: np.dtype, tasks: list[tuple[int, int]], workers: int
) -> Iterator[tuple[np.ndarray, int]]:
    """`_tokenize_rows` of each task, in order; in `workers` processes with a bounded number in flight."""
    if workers <= 0:
        for task in tasks:
            yield _tokenize_rows(ds, tokenizer, dtype, *task)
        return
    # spawn, not fork: JAX's threads may already run in this process
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(ds, tokenizer, dtype)) as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_tokenize_task, task))
            if len(pending) >= 2 * workers:  # bounded: results wait for the writer in memory
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


_worker: tuple[Any, ...] = ()


def _init_worker(ds: Any, tokenizer: BytesTokenizer | HFTokenizer, dtype: np.dtype) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker = (ds, tokenizer, dtype)


def _tokenize_task(start: int, stop: int) -> tuple[np.ndarray, int]:
    return _tokenize_rows(*_worker, start, stop)


def _tokenize_rows(
    ds: Any, tokenizer: BytesTokenizer | HFTokenizer, dtype: np.dtype, start: int, stop: int
) -> tuple[np.ndarray, int]:
    """Rows `[start, stop)` of `ds` as one token array, each document followed by end-of-document."""
    documents = [text for text in ds[start:stop][ds.column_names[0]] if text is not None]
    pieces, owner = [], []
    for i, text in enumerate(documents):
        for piece in _pieces(text):
            pieces.append(piece)
            owner.append(i)
    encoded = tokenizer.encode_batch(pieces)
    # A model directory's tokenizer wraps each document in its special tokens (Llama's begin-of-text).
    prefix = np.array(getattr(tokenizer, "document_prefix", ()), dtype=dtype)
    end = np.array([*getattr(tokenizer, "document_suffix", ()), tokenizer.eod_id], dtype=dtype)
    parts = []
    for i, ids in enumerate(encoded):
        if (i == 0 or owner[i - 1] != owner[i]) and len(prefix):
            parts.append(prefix)
        parts.append(ids.astype(dtype, copy=False))
        if i + 1 == len(encoded) or owner[i + 1] != owner[i]:
            parts.append(end)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype)), len(documents)


def _pieces(text: str, size: int = _PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters, cut after a newline that precedes a non-space character.

    Byte-level BPE tokenizers (GPT-2's and its kind) never merge across such
    a cut, so the pieces tokenize as the whole text does; `bytes` is exact
    anywhere. An empty text is one empty piece.
    """
    if not text:
        yield text
    start = 0
    while len(text) - start > size:
        cut = _cut(text, start + size // 2, start + size)
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def _cut(text: str, lo: int, hi: int) -> int:
    at = text.rfind("\n", lo, hi)
    while at != -1 and text[at + 1].isspace():
        at = text.rfind("\n", lo, at)
    return hi if at == -1 else at + 1


class _NpyWriter:
    """A 1-D .npy file written by appending: the header's length is rewritten in place at the end.

    numpy pads every header so that the length of a growing first axis fits
    in place, which is what lets the stream be written without knowing its
    length, and without holding it.
    """

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0

    def __enter__(self) -> _NpyWriter:
        self._file = open(self.path, "wb")
        self._header_size = self._file.write(self._header(0))
        return self

    def write(self, tokens: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.count += len(tokens)

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                header = self._header(self.count)
                if len(header) != self._header_size:
                    raise RuntimeError(f"the .npy header of {self.path} grew from {self._header_size} to {len(header)}")
                self._file.seek(0)
                self._file.write(header)
        finally:
            self._file.close()

    def _header(self, length: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buffer, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (length,)}
        )
        return buffer.getvalue()


def _progress(total: int, description: str) -> contextlib.AbstractContextManager[Callable[[int], None]]:
    from nnx_cli import report

    return report.progress(total, description)
