"""Tokenizers for text datasets (`data.tokenizer`): text <-> token ids, with an end-of-document id.

- `bytes` (built in, offline): the UTF-8 bytes of the text, ids 0-255, and
  end-of-document 256, so the vocabulary has 257 ids.
- `pretrained`: the tokenizer of the model directory `model.pretrained`,
  loaded by the factory that :mod:`nnx_cli.hf` (which reads model
  directories) provides when imported (:func:`provide_pretrained`); this
  package never imports `nnx_cli.hf`.
- A Hugging Face `tokenizers` tokenizer (a dependency of nnx): a
  local `tokenizer.json` (or a directory holding one), or a Hub id such as
  `gpt2`, whose `tokenizer.json` is downloaded once into the Hugging Face cache
  and read from there ever after (offline too). Its end-of-document id is its
  own `<|endoftext|>` / `</s>` / `<eos>` token when it has one, else one id
  past its vocabulary.

    >>> tok = load_tokenizer("bytes")
    >>> tok.encode("hé").tolist(), tok.eod_id, tok.vocab_size
    ([104, 195, 169], 256, 257)
    >>> tok.decode([104, 195, 169, 256])
    'hé'
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nnx_cli.errors import UserError

BYTES = "bytes"
PRETRAINED = "pretrained"
_KEY = "config key 'data.tokenizer'"
# End-of-document tokens of well-known tokenizers, in order of preference.
_EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What a text dataset and sampling need from a tokenizer.

    `version` changes whenever the same text could tokenize differently; it
    is part of the key of every cached token stream.
    """

    name: str
    version: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text`, without end-of-document or any other special token added."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text (a Hugging Face tokenizer runs them in parallel threads)."""

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`; end-of-document and ids outside the vocabulary are dropped."""


class BytesTokenizer:
    """UTF-8 bytes as ids 0-255; end-of-document is 256.

    >>> BytesTokenizer().to_bytes([0xE2, 0x82, 256, 0xAC])
    b'\\xe2\\x82\\xac'
    """

    name = BYTES
    version = "utf8-1"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def to_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """The raw bytes of `ids` (end-of-document and padded ids dropped); may end mid-character."""
        ids = np.asarray(ids)
        return ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.to_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`, with an end-of-document id.

    `name` is what `data.tokenizer` said; `version` hashes the tokenizer's
    full definition, so an edited tokenizer.json never reuses old tokens.
    """

    def __init__(self, name: str, tokenizer: Any):
        import tokenizers

        self.name = name
        self._tokenizer = tokenizer
        definition = tokenizer.to_str().encode()
        library = ".".join(tokenizers.__version__.split(".")[:2])
        self.version = f"tokenizers-{library}-{hashlib.sha256(definition).hexdigest()[:16]}"
        self._base_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        eod = next((i for t in _EOD_TOKENS if (i := tokenizer.token_to_id(t)) is not None), None)
        self.eod_id = self._base_vocab if eod is None else eod
        self.vocab_size = self._base_vocab + (eod is None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` (no special token added) and the characters `(start, end)` each token covers."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets)

    def to_json(self) -> str:
        """The tokenizer's whole definition, as a `tokenizer.json` holds it."""
        return self._tokenizer.to_str()

    def _specials(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text (Llama: `[bos]`, `[]`)."""
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        return [], []

    def adds_special_tokens(self) -> bool:
        """Whether the file's post-processor puts tokens around a text (Llama's begin-of-text), which a text
        stream tokenized from scratch never holds."""
        return any(self._specials())

    def token(self, i: int) -> str | None:
        """The token of id `i` (None past the file's vocabulary, as the end-of-document id added after it is)."""
        return self._tokenizer.id_to_token(i)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        keep = (ids >= 0) & (ids < self._base_vocab) & (ids != self.eod_id)
        return self._tokenizer.decode(ids[keep].tolist(), skip_special_tokens=False)

    def decode_all(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` as `transformers` decodes them: special tokens (end-of-document included) written
        out, or left out with `skip_special_tokens`; ids past the file's vocabulary are dropped."""
        ids = np.asarray(ids)
        keep = (ids >= 0) & (ids < self._base_vocab)
        return self._tokenizer.decode(ids[keep].tolist(), skip_special_tokens=skip_special_tokens)

    def __getstate__(self) -> dict[str, Any]:  # for worker processes: the definition, not the Rust object
        return {"name": self.name, "definition": self._tokenizer.to_str()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import tokenizers

        self.__init__(state["name"], tokenizers.Tokenizer.from_str(state["definition"]))


_pretrained: Callable[[str], HFTokenizer] | None = None


def provide_pretrained(factory: Callable[[str], HFTokenizer]) -> None:
    """Make `data.tokenizer: pretrained` load the tokenizer of model directory (or Hub id) `source` as
    `factory(source)`. :mod:`nnx_cli.hf` provides its own when imported: model directories are its business,
    and the data side asks for their tokenizers without importing it."""
    global _pretrained
    _pretrained = factory


def load_tokenizer(name: str, pretrained: str | None = None) -> BytesTokenizer | HFTokenizer:
    """The tokenizer `data.tokenizer` names: `bytes`, `pretrained` (the tokenizer of the model directory or Hub
    id `pretrained`, i.e. `model.pretrained`), a tokenizer.json path, or a Hub id.

    >>> load_tokenizer("bytes").vocab_size
    257
    >>> load_tokenizer("./my-tokenizer/tokenizer.json")   # doctest: +SKIP
    >>> load_tokenizer("pretrained", "/models/Qwen2.5-0.5B")   # doctest: +SKIP
    """
    if name == BYTES:
        return BytesTokenizer()
    if name == PRETRAINED:
        if pretrained is None:
            raise UserError(
                f"{_KEY} is pretrained, which means the tokenizer of model.pretrained, but model.pretrained is not "
                "set; set it, or name a tokenizer (bytes, a Hub id, a tokenizer.json)"
            )
        if _pretrained is None:
            raise RuntimeError(
                "data.tokenizer pretrained: no factory reads model directories; import nnx_cli.hf, which provides it"
            )
        return _pretrained(pretrained)
    if name.lower() in (BYTES, PRETRAINED) and not Path(name).expanduser().exists():
        raise UserError(f"{_KEY} is {name!r}, which is no file and no Hub id; did you mean {name.lower()!r}?")
    return _load_hf(name)


def _load_hf(name: str) -> HFTokenizer:
    path = _local_file(name)
    if path is None:
        return _from_hub(name)
    return _from_file(name, str(path), *_size_and_mtime(path))  # an edited file is read again


def tokenizer_vocab_size(name: str, pretrained: str | None = None) -> int:
    """The vocabulary size (end-of-document included) of `data.tokenizer`, reading no data.

    `bytes` needs nothing; a Hub tokenizer is downloaded into the Hugging Face
    cache the first time and read from there after.

    >>> tokenizer_vocab_size("bytes")
    257
    """
    if name == BYTES:
        return BytesTokenizer.vocab_size
    return load_tokenizer(name, pretrained).vocab_size


@functools.lru_cache(maxsize=8)
def _from_hub(repo_id: str) -> HFTokenizer:
    import_tokenizers(repo_id)
    path = _download(repo_id)
    return _from_file(repo_id, str(path), *_size_and_mtime(path))


@functools.lru_cache(maxsize=8)
def _from_file(name: str, path: str, size: int, mtime_ns: int) -> HFTokenizer:
    tokenizers = import_tokenizers(name)
    try:
        return HFTokenizer(name, tokenizers.Tokenizer.from_file(path))
    except Exception as e:  # the Rust side raises plain Exceptions for unreadable files
        raise UserError(
            f"{_KEY}: cannot read tokenizer file {path!r} ({type(e).__name__}: {e}); expected a tokenizer.json "
            "saved by the `tokenizers` library (Tokenizer.save) or by transformers (save_pretrained)"
        ) from None


def import_tokenizers(name: str) -> Any:
    """The `tokenizers` package; not installed is a UserError naming `data.tokenizer` `name` and how to install it."""
    try:
        import tokenizers
    except ImportError:
        instead = "" if name == PRETRAINED else " (or use data.tokenizer=bytes)"  # a model knows its own ids only
        raise UserError(
            f"{_KEY}: {name!r} is a Hugging Face tokenizer, which needs the `tokenizers` package (a dependency of "
            f"nnx that this environment lacks): pip install tokenizers{instead}"
        ) from None
    return tokenizers


def _size_and_mtime(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _local_file(name: str) -> Path | None:
    """The tokenizer.json `name` points at, None for a Hub id; a path that does not exist is an error."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{_KEY}: directory {name!r} has no tokenizer.json; point data.tokenizer at the file")
        return path / "tokenizer.json"
    if path.is_file():
        return path
    looks_local = name.startswith(("/", "./", "../", "~")) or path.suffix == ".json" or name.count("/") > 1
    if looks_local:
        raise UserError(
            f"{_KEY}: tokenizer file {name!r} does not exist; give the path to a tokenizer.json, a Hub id such as "
            "gpt2, or bytes"
        )
    return None


def _download(repo_id: str) -> Path:
    """The Hub tokenizer's tokenizer.json from the local Hugging Face cache, downloaded there the first time."""
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import logging

    logging.set_verbosity_error()  # failures are reported as one UserError below
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, "tokenizer.json", local_files_only=True))
    except (errors.LocalEntryNotFoundError, errors.HFValidationError, OSError, ValueError):
        pass  # not cached yet: fetch it
    from nnx_cli.data.sources import announce_download

    announce_download(f"Hub tokenizer {repo_id!r}")
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, "tokenizer.json"))
    except errors.HFValidationError:
        raise UserError(
            f"{_KEY}: {repo_id!r} is neither a tokenizer.json file nor a Hugging Face Hub id; give the path to a "
            "tokenizer.json, a Hub id such as gpt2, or bytes"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # offline, or the Hub cannot be reached (before EntryNotFound)
        raise UserError(
            f"{_KEY}: cannot load Hub tokenizer {repo_id!r}: the Hugging Face Hub cannot be reached and the tokenizer "
            f"is not in the local cache ({type(e).__name__}). Run once with network access so it is cached, or "
            f"download its tokenizer.json and set data.tokenizer to the local copy, e.g. "
            f"data.tokenizer=/path/to/tokenizer.json"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"{_KEY}: no tokenizer {repo_id!r} on the Hugging Face Hub and no local file of that name; give a Hub id "
            "such as gpt2, the path to a tokenizer.json, or bytes"
        ) from None
    except errors.EntryNotFoundError:
        raise UserError(
            f"{_KEY}: Hub repository {repo_id!r} has no tokenizer.json (the `tokenizers` format); save one with "
            f"transformers' AutoTokenizer.from_pretrained({repo_id!r}).save_pretrained(DIR) and set "
            "data.tokenizer=DIR/tokenizer.json"
        ) from None
    except (OSError, errors.HfHubHTTPError) as e:
        raise UserError(f"{_KEY}: cannot download Hub tokenizer {repo_id!r}: {type(e).__name__}: {e}") from None


def stop_ids(tokenizer: Any, chat: bool = False) -> tuple[int, ...]:
    """Where sampling that must end somewhere ends (GRPO's rollouts, lm-eval's `generate_until`): at a model
    directory's end-of-sequence ids (its generation config's, as `transformers` stops; with `chat`, also its
    tokenizer's `eos_token`, which ends a turn), else at the end-of-document token.

    `nnx-generate` and the samples written at each eval (`lm.stops`) differ in one case: a model
    directory that names no end-of-sequence id at all stops them nowhere, as `transformers`' `generate`.

    >>> stop_ids(BytesTokenizer())
    (256,)
    """
    ids = getattr(tokenizer, "chat_stop_ids" if chat else "stop_ids", None)
    return tuple(int(i) for i in ids) if ids else (int(tokenizer.eod_id),)
