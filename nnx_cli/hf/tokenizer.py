"""A model directory's tokenizer (`data.tokenizer: pretrained`): its special tokens, stop tokens and chat template.

The directory's `tokenizer.json` tokenizes as `transformers` does: the
post-processor's special tokens (Llama's `<|begin_of_text|>`, Mistral's
`<s>`) wrap each document and prompt, so `encode(text)` equals
`AutoTokenizer.from_pretrained(dir)(text).input_ids`. Generation stops where
`transformers`' `generate` does (the `eos_token_id`s of
`generation_config.json`, else of `config.json`); a chat also stops at the
tokenizer's `eos_token` (the end of a turn: `<|im_end|>`, `<|eot_id|>`)::

    tok = PretrainedTokenizer("/models/Qwen2.5-0.5B-Instruct")
    tok.encode("Hello")                  # ids, special tokens included
    tok.stop_ids, tok.chat_stop_ids      # (151645, 151643), ...
    tok.chat_template                    # the Jinja source, or None
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.data.tokenizers import HFTokenizer
from nnx_cli.errors import UserError

PRETRAINED = "pretrained"
_TEMPLATE_FILE = "chat_template.jinja"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string, or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _template_tokens(settings: dict[str, Any]) -> dict[str, Any]:
    """The special tokens a chat template sees by name, as `transformers` passes them: those the directory
    names (a template naming one it does not gets nothing, not the text `None`), and the additional ones."""
    tokens: dict[str, Any] = {k: text for k in _NAMED if (text := _token_text(settings.get(k))) is not None}
    extra = settings.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return tokens


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _rebuilt_as_llama(settings: dict[str, Any], config: dict[str, Any], path: Path) -> bool:
    """Whether `transformers`' AutoTokenizer builds this directory's tokenizer as its `LlamaTokenizer`, which keeps
    tokenizer.json's vocabulary, merges and post-processor and replaces the rest: a `model_type: llama` directory
    whose tokenizer_config.json names `LlamaTokenizer` (Llama 2, TinyLlama), unless its tokenizer.json is
    byte-level (Llama 3 names that class too). Other model types naming it (Mistral, Phi-3) get tokenizer.json
    as it is."""
    named = settings.get("tokenizer_class") or config.get("tokenizer_class")
    if config.get("model_type") != "llama" or not isinstance(named, str):
        return False
    return named.removesuffix("Fast") == "LlamaTokenizer" and '"ByteLevel"' not in path.read_text()


def _as_llama_tokenizer(tokenizer: Any, settings: dict[str, Any]) -> None:
    """`tokenizer` as `transformers`' LlamaTokenizer rebuilds it: no normalizer; a `▁` for each space and one
    before the text (`legacy: false`, the default: before its first piece only, none after a special token;
    `legacy: true`: before every piece; `add_prefix_space: false`: none); decoding back, that first `▁` dropped."""
    from tokenizers import decoders, pre_tokenizers

    prefix = settings.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if settings.get("legacy", False) else "first") if prefix else "never"
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)


class PretrainedTokenizer(HFTokenizer):
    """The tokenizer of a Hugging Face model directory; see the module docstring."""

    def __init__(self, directory: str | Path):
        import tokenizers

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise UserError(
                f"config key 'data.tokenizer': pretrained, but model directory {str(directory)!r} has no "
                "tokenizer.json (the `tokenizers` format); save one with transformers' "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR), or set data.tokenizer"
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions for unreadable files
            raise UserError(f"{path}: not a readable tokenizer.json ({type(e).__name__}: {e})") from None
        settings = _read_json(directory / "tokenizer_config.json")
        # older directories name their special tokens only in special_tokens_map.json, which transformers reads too
        named = _read_json(directory / "special_tokens_map.json")
        settings = {**named, **{k: v for k, v in settings.items() if v is not None}}
        config = _read_json(directory / "config.json")
        if _rebuilt_as_llama(settings, config, path):
            _as_llama_tokenizer(tokenizer, settings)
        split = bool(settings.get("split_special_tokens"))
        if split:  # as transformers reads it: a special token's text in a text is that text, not the token
            tokenizer.encode_special_tokens = True
        super().__init__(PRETRAINED, tokenizer)
        self.directory = directory
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        self.template_tokens = _template_tokens(settings)
        self.special_ids = self._special_ids(settings)
        self.chat_template = self._template(settings)
        self.prefix, self.suffix = self._specials()
        # where transformers' generate stops: generation_config.json's ids when the file is there (config.json's
        # are not read then), else config.json's; never the tokenizer's eos_token, which ends a chat turn
        generation = directory / "generation_config.json"
        stops = _ids((_read_json(generation) if generation.is_file() else config).get("eos_token_id"))
        eos = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        if self.eod_id >= self._base_vocab and eos is not None:  # no end-of-text token: documents end with eos
            self.eod_id, self.vocab_size = eos, self._base_vocab
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        self.chat_stop_ids: tuple[int, ...] = tuple(dict.fromkeys([*stops, *([eos] if eos is not None else [])]))
        definition = hashlib.sha256(f"{self.prefix}{self.suffix}{' split' if split else ''}".encode()).hexdigest()[:8]
        self.version = f"{self.version}-specials-{definition}"
        if self.suffix[-1:] == [self.eod_id]:  # streams built before ended such documents twice
            self.version += "-one-end"

    def _template(self, settings: dict[str, Any]) -> str | None:
        """`chat_template.jinja` (what current transformers writes), else tokenizer_config.json's `chat_template`."""
        file = self.directory / _TEMPLATE_FILE
        if file.is_file():
            return file.read_text()
        template = settings.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def _special_ids(self, settings: dict[str, Any]) -> frozenset[int]:
        """The ids `transformers` counts special: tokenizer_config.json's named special tokens and those its
        `added_tokens_decoder` marks special, which transformers registers as special with the tokenizer even
        when tokenizer.json does not (a word-level vocabulary's `<s>` is a plain token there)."""
        names = [settings.get(k) for k in _NAMED]
        extra = settings.get("additional_special_tokens") or settings.get("extra_special_tokens") or []
        names += list(extra.values()) if isinstance(extra, dict) else list(extra) if isinstance(extra, list) else []
        ids = {self._tokenizer.token_to_id(t) for t in map(_token_text, names) if t is not None}
        added = settings.get("added_tokens_decoder")
        if isinstance(added, dict):
            ids |= {int(k) for k, v in added.items() if str(k).isdigit() and isinstance(v, dict) and v.get("special")}
        return frozenset(i for i in ids if i is not None)

    def decode_all(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` as `transformers` decodes them; with `skip_special_tokens`, without any of
        `special_ids` either."""
        if skip_special_tokens and self.special_ids:
            ids = [i for i in np.asarray(ids).tolist() if i not in self.special_ids]
        return super().decode_all(ids, skip_special_tokens=skip_special_tokens)

    @property
    def document_prefix(self) -> list[int]:
        return self.prefix

    @property
    def document_suffix(self) -> list[int]:
        """What follows a document before its end-of-document id: the post-processor's suffix, less that id
        where the post-processor ends a text with it already (one end token per document, as transformers
        tokenizes a document)."""
        return self.suffix[:-1] if self.suffix[-1:] == [self.eod_id] else self.suffix

    def encode(self, text: str) -> np.ndarray:
        """The ids of `text` with the post-processor's special tokens, as `transformers` tokenizes it."""
        return np.asarray([*self.prefix, *super().encode(text).tolist(), *self.suffix], dtype=np.int64)

    def encode_plain(self, text: str) -> np.ndarray:
        """The ids of `text` alone (a rendered chat template holds its special tokens as text already)."""
        return super().encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Plain ids of each text: a text stream adds `document_prefix` and `document_suffix` per document."""
        return super().encode_batch(texts)

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"])


def check_vocabulary(tokenizer: PretrainedTokenizer, vocab_size: int, directory: Path) -> None:
    """The tokenizer's ids must fit the model's embedding (`vocab_size` of config.json)."""
    size = tokenizer._base_vocab
    if size > vocab_size:
        raise UserError(
            f"{directory / 'tokenizer.json'}: the tokenizer has {size:,} tokens, more than the {vocab_size:,} rows of "
            f"the model's embedding (vocab_size in {directory / 'config.json'}); they do not belong together"
        )
