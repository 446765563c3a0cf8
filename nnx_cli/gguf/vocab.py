"""A model directory's tokenizer as GGUF metadata: `tokenizer.ggml.*` and the chat template, as llama.cpp reads it.

llama.cpp tokenizes with one of two models, and this writes what llama.cpp's converter writes for each:

- `gpt2`: byte-level BPE (Llama 3, Qwen, GPT-2, Mistral's byte-level fixtures): every token of `tokenizer.json`
  by id (ids the tokenizer lacks up to the model's vocabulary as unused `[PAD<id>]`), its type (normal, control for
  special tokens, user-defined for other added tokens), the merges, and the pre-tokenizer's name, recognised here
  by its split regex (:data:`PRE_TOKENIZERS`; llama.cpp names each split rule it implements).
- `llama`: SentencePiece (Gemma, Phi-3, Llama 2, Mistral v0.1): the pieces of `tokenizer.model` with their scores
  and types. A directory with only `tokenizer.json` (a byte-fallback BPE over `▁`-joined text, as transformers
  converts SentencePiece models) gets the pieces it was converted from: the same tokens in id order, normal ones
  scored minus their id (SentencePiece's BPE merges by score, and such a vocabulary is in merge order).

Then the special tokens (bos, eos, unk, sep, pad, ... from `tokenizer_config.json`, the post-processor and
`config.json`), whether bos/eos/sep are added, and the chat template::

    vocab = Vocab.read(model_dir, vocab_size=151936, architecture="Qwen2ForCausalLM")
    vocab.write(writer)          # a gguf.GGUFWriter
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import struct
from pathlib import Path
from typing import Any

from nnx_cli.errors import UserError
from nnx_cli.gguf import require

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    ("split", LLAMA3_REGEX, "bytelevel"): "llama-bpe",  # Llama 3, 3.1, 3.2
    ("split", QWEN2_REGEX, "bytelevel"): "qwen2",  # Qwen 1.5, 2, 2.5, 3
    ("bytelevel-regex",): "gpt-2",  # GPT-2, OLMoE and any byte-level BPE on GPT-2's own regex
    ("digits", "bytelevel-regex"): "smollm",  # SmolLM: digits alone, then GPT-2's regex
    ("bytelevel",): "gpt-2",  # no split at all: only a vocabulary without merges (nnx's bytes tokenizer) fits it
}
"""tokenizer.json's pre-tokenizer, as a key of its steps, to the name llama.cpp gives its split rule."""

_SENTENCEPIECE_FAMILIES = (
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
)  # fmt: skip
"""The families whose llama.cpp converter reads a SentencePiece tokenizer (the others' is byte-level BPE)."""
_SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
         "pad": "padding_token_id", "mask": "mask_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}  # fmt: skip
"""Special token kinds as `tokenizer.ggml.*` keys (llama.cpp has no key for cls; `seperator` is its spelling)."""
NO_MERGE = "a 1"
"""The merge a gpt2 vocabulary without merges is written with (see :meth:`Vocab.write`): it never applies."""


@dataclasses.dataclass
class Vocab:
    """What `tokenizer.ggml.*` says of a tokenizer."""

    model: str  # "gpt2" | "llama"
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = dataclasses.field(default_factory=list)
    special: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> id, in the order they were found
    add: dict[str, bool] = dataclasses.field(default_factory=dict)  # add_bos_token, ...
    chat_template: str | list | None = None
    add_space_prefix: bool | None = None
    normalizer: dict[str, bool] = dataclasses.field(default_factory=dict)  # lowercase, strip_accents

    @classmethod
    def read(cls, directory: Path, vocab_size: int, architecture: str) -> Vocab:
        """The tokenizer of model directory `directory` (`tokenizer.model` or `tokenizer.json`, and
        `tokenizer_config.json`, `config.json`) for a model of `vocab_size` rows of `architecture`."""
        files = _Files(directory)
        json_model = (files.tokenizer or {}).get("model", {})
        llama_arch = architecture in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
        prefix = files.config_value("add_prefix_space") if llama_arch else None
        spm_style = json_model.get("type") == "BPE" and bool(json_model.get("byte_fallback"))
        sentencepiece = architecture in _SENTENCEPIECE_FAMILIES and (
            (directory / "tokenizer.model").is_file() or spm_style
        )
        if architecture == "Phi3ForCausalLM" and files.tokenizer_config.get("tokenizer_class") == "GPT2Tokenizer":
            sentencepiece = False  # Phi-4's
        if sentencepiece:
            vocab = _sentencepiece(files, vocab_size, phi3=architecture == "Phi3ForCausalLM")
            if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
                prefix = False
        else:
            vocab = _bpe(files, vocab_size)
        vocab.add_space_prefix = prefix if isinstance(prefix, bool) else None
        _special_tokens(vocab, files, n_vocab=len(vocab.tokens) if sentencepiece else None)
        if llama_arch and vocab_size == 49152:  # llama.cpp's converter: granite's and SmolLM's add no bos
            vocab.add["bos"] = False
        return vocab

    def write(self, writer: Any) -> None:
        """Add the `tokenizer.*` keys to `writer` (a `gguf.GGUFWriter`)."""
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        # the element type given, as add_token_list & co. would infer it: the writer then does not check the type
        # of each of 150,000 entries (a third of the time the tokenizer takes to write)
        gguf = require()
        keys, kinds = gguf.Keys.Tokenizer, gguf.GGUFValueType
        array = functools.partial(writer.add_key_value, vtype=kinds.ARRAY)
        array(keys.LIST, self.tokens, sub_type=kinds.STRING)
        if self.scores is not None:
            array(keys.SCORES, self.scores, sub_type=kinds.FLOAT32)
        array(keys.TOKEN_TYPE, self.types, sub_type=kinds.INT32)
        merges = self.merges
        if self.model == "gpt2" and not merges:
            # llama.cpp refuses a gpt2 vocabulary without merges ("cannot find tokenizer merges in model file"), and
            # gguf-py cannot write an empty array: one merge that can never apply, of a letter and a digit, which
            # every split rule of PRE_TOKENIZERS puts in different words (nnx's bytes tokenizer has no merges)
            merges = [NO_MERGE]
        if merges:
            array(keys.MERGES, merges, sub_type=kinds.STRING)
        for kind, token in self.special.items():
            if kind in _KEYS:
                writer.add_uint32(f"tokenizer.ggml.{_KEYS[kind]}", token)
        for kind, value in self.add.items():
            writer.add_bool(f"tokenizer.ggml.add_{kind}_token", value)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)
        for name, value in self.normalizer.items():
            writer.add_bool(f"tokenizer.ggml.normalizer.{name}", value)


class _Files:
    """The tokenizer files of a model directory, parsed (missing ones empty); bad JSON is a UserError."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.tokenizer = self._json("tokenizer.json")
        self.tokenizer_config = self._json("tokenizer_config.json") or {}
        self.config = self._json("config.json") or {}

    def _json(self, name: str) -> Any:
        path = self.directory / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not readable JSON ({e})") from None

    def config_value(self, key: str) -> Any:
        return self.tokenizer_config.get(key)

    def added_tokens(self) -> list[dict[str, Any]]:
        return (self.tokenizer or {}).get("added_tokens", [])


def _looks_special(token: str) -> bool:
    """Added tokens llama.cpp's converter marks as control tokens though the tokenizer does not call them special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))  # fullwidth bars: DeepSeek's
        or (token.startswith("<unused") and token.endswith(">"))
    )


# Byte-level BPE
# ------------------------------------------------------------------------------------------------------------------


def _bpe(files: _Files, vocab_size: int) -> Vocab:
    tokenizer = files.tokenizer
    if tokenizer is None or tokenizer.get("model", {}).get("type") != "BPE":
        raise UserError(
            f"{files.directory}: GGUF export needs the tokenizer as tokenizer.json (a BPE model) or tokenizer.model "
            "(SentencePiece); this directory has neither"
        )
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    added = {t["content"]: t for t in files.added_tokens()}
    for token in added.values():
        vocab.setdefault(token["content"], token["id"])
    if max(vocab.values()) >= vocab_size:
        raise UserError(
            f"{files.directory / 'tokenizer.json'}: token id {max(vocab.values())} is past the model's {vocab_size} "
            "embedding rows"
        )
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif token in added:
            if added[token].get("special") or _looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(token)
            types.append(NORMAL)
    merges = tokenizer["model"].get("merges") or []
    if merges and not isinstance(merges[0], str):  # transformers 4.45+ writes pairs; llama.cpp keeps "a b"
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m) for m in merges]
    vocab_out = Vocab("gpt2", _pre_name(files), tokens, types, merges=list(merges))
    vocab_out.normalizer = _normalizer_flags(tokenizer.get("normalizer"))
    return vocab_out


def _pre_name(files: _Files) -> str:
    """llama.cpp's name for tokenizer.json's pre-tokenizer (see :data:`PRE_TOKENIZERS`)."""
    pre = files.tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    key: list[str] = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split" and "Regex" in step.get("pattern", {}):
            key += ["split", step["pattern"]["Regex"]]
        elif kind == "ByteLevel":
            key.append("bytelevel-regex" if step.get("use_regex", True) else "bytelevel")
        elif kind == "Digits" and step.get("individual_digits"):
            key.append("digits")
        else:
            key.append(json.dumps(step, sort_keys=True))
    name = PRE_TOKENIZERS.get(tuple(key))
    if name == "gpt-2" and key == ["bytelevel"] and files.tokenizer["model"].get("merges"):
        name = None  # merges across what GPT-2's regex keeps apart: no llama.cpp split rule does that
    if name is None:
        raise UserError(
            f"{files.directory / 'tokenizer.json'}: its pre-tokenizer ({json.dumps(pre)[:200]}) is not one llama.cpp "
            f"implements under a name nnx knows ({', '.join(sorted(set(PRE_TOKENIZERS.values())))}): llama.cpp would "
            "tokenize text differently from the model's own tokenizer, so no GGUF file is written"
        )
    return name


def _normalizer_flags(normalizer: dict | None) -> dict[str, bool]:
    """The lowercase / strip-accents flags of tokenizer.json's normalizer (llama.cpp applies these two itself)."""
    flags: dict[str, bool] = {}
    if not normalizer:
        return flags
    kind = normalizer.get("type")
    if kind == "Lowercase":
        flags["lowercase"] = True
    elif kind == "StripAccents":
        flags["strip_accents"] = True
    elif kind == "BertNormalizer":
        flags.update({k: normalizer[k] for k in ("lowercase", "strip_accents") if k in normalizer})
    elif kind == "Sequence":
        for inner in normalizer.get("normalizers", []):
            flags.update(_normalizer_flags(inner))
    return flags


# SentencePiece
# ------------------------------------------------------------------------------------------------------------------


def _sentencepiece(files: _Files, vocab_size: int, phi3: bool) -> Vocab:
    path = files.directory / "tokenizer.model"
    pieces = read_sentencepiece(path) if path.is_file() else _pieces_of_json(files)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [UNUSED] * vocab_size
    for i, (piece, score, kind) in enumerate(pieces[:vocab_size]):
        tokens[i], scores[i] = piece, score
        types[i] = kind if kind in (UNKNOWN, CONTROL, UNUSED, BYTE) else NORMAL
    added_json = files.directory / "added_tokens.json"
    if added_json.is_file():
        for token, i in json.loads(added_json.read_text(encoding="utf-8")).items():
            if i < vocab_size:
                tokens[i], scores[i], types[i] = token, -1000.0, USER_DEFINED
    decoder = files.tokenizer_config.get("added_tokens_decoder", {})
    entries = [(int(i), t) for i, t in decoder.items()]
    if phi3:  # Phi-3's converter also takes tokenizer.json's added tokens
        entries += [(int(t["id"]), t) for t in files.added_tokens()]
    for i, token in entries:
        if i >= vocab_size:
            continue
        text = token["content"]
        if token.get("special") or (not phi3 and _looks_special(text)):
            types[i] = CONTROL
        else:
            text = text if phi3 else text.replace("\u2581", " ")
            types[i] = USER_DEFINED
        tokens[i], scores[i] = text, -1000.0
    return Vocab("llama", "default", tokens, types, scores=scores)


def read_sentencepiece(path: Path) -> list[tuple[str, float, int]]:
    """`(piece, score, type)` of each piece of a SentencePiece `tokenizer.model`, in id order.

    The file is a protobuf `ModelProto`; its pieces are field 1, each a message of `piece` (1), `score` (2, a
    float) and `type` (3). Read here without the protobuf or sentencepiece packages."""
    data = path.read_bytes()
    pieces = []
    try:
        for number, value in _fields(data):
            if number == 1:
                piece, score, kind = "", 0.0, NORMAL
                for inner, v in _fields(value):
                    if inner == 1:
                        piece = v.decode("utf-8")
                    elif inner == 2:
                        score = v
                    elif inner == 3:
                        kind = v
                pieces.append((piece, score, kind))
    except (IndexError, ValueError, struct.error, UnicodeDecodeError):
        raise UserError(f"{path}: not a SentencePiece model (its protobuf does not parse)") from None
    if not pieces:
        raise UserError(f"{path}: a SentencePiece model without pieces")
    return pieces


def _fields(data: bytes) -> Any:
    """(field number, value) of each field of a protobuf message: ints, floats (fixed32) and bytes."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = _varint(data, i)
        elif kind == 5:
            (value,) = struct.unpack_from("<f", data, i)
            i += 4
        elif kind == 1:
            (value,) = struct.unpack_from("<d", data, i)
            i += 8
        elif kind == 2:
            length, i = _varint(data, i)
            value, i = data[i : i + length], i + length
            if i > len(data):
                raise ValueError("truncated")
        else:
            raise ValueError(f"wire type {kind}")
        yield number, value


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _pieces_of_json(files: _Files) -> list[tuple[str, float, int]]:
    """The SentencePiece pieces a byte-fallback BPE `tokenizer.json` was converted from (see the module's doc)."""
    model = files.tokenizer["model"]
    special = {t["content"] for t in files.added_tokens() if t.get("special")}
    vocab = dict(model["vocab"])
    for token in files.added_tokens():
        vocab.setdefault(token["content"], token["id"])
    pieces = []
    for piece, i in sorted(vocab.items(), key=lambda item: item[1]):
        if i != len(pieces):
            raise UserError(f"{files.directory / 'tokenizer.json'}: token ids are not contiguous (no id {len(pieces)})")
        if piece == model.get("unk_token"):
            kind = UNKNOWN
        elif piece in special:
            kind = CONTROL
        elif _BYTE_PIECE.fullmatch(piece):
            kind = BYTE
        else:
            kind = NORMAL
        pieces.append((piece, -float(i) if kind == NORMAL else 0.0, kind))
    return pieces


# Special tokens, what is added, the chat template
# ------------------------------------------------------------------------------------------------------------------


def _special_tokens(vocab: Vocab, files: _Files, n_vocab: int | None) -> None:
    """Fill `vocab.special`, `vocab.add` and `vocab.chat_template` as llama.cpp's converter reads them: the
    post-processor says which tokens are added around a text, `tokenizer_config.json` names the special tokens
    (their ids from tokenizer.json's added tokens), and `config.json`'s `<kind>_token_id` fills what is left."""
    kinds = list(_SPECIAL_TYPES)
    config = dict(files.tokenizer_config) if files.tokenizer_config else None

    def found(kind: str, token: Any) -> None:
        if isinstance(token, bool) or not isinstance(token, int) or kind in vocab.special:
            return
        if token < 0:
            raise UserError(f"{files.directory}: special token {kind} has id {token}")
        if n_vocab is None or token < n_vocab:
            vocab.special[kind] = token

    if files.tokenizer is not None:
        _post_processor(vocab, files.tokenizer.get("post_processor"), config, kinds)
    if config:
        vocab.chat_template = _chat_template(files.directory, config)
        for kind in kinds:
            add = config.get(f"add_{kind}_token")
            if isinstance(add, bool) and kind not in vocab.add:
                vocab.add[kind] = add
            entry = config.get(f"{kind}_token")
            content = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(content, str):
                found(kind, next((t.get("id") for t in files.added_tokens() if t.get("content") == content), None))
    for kind in kinds:
        found(kind, files.config.get(f"{kind}_token_id"))


def _post_processor(vocab: Vocab, processor: dict | None, config: dict | None, kinds: list[str]) -> None:
    """What the post-processor adds around a text: bos first, eos last, a separator between a pair."""
    if not processor:
        return
    config = config if config is not None else {}
    bos, eos = config.get("bos_token"), config.get("eos_token")
    cls, sep = config.get("cls_token"), config.get("sep_token")
    if not bos and cls and config:
        config["bos_token"] = bos = cls
    if not eos and sep and config:
        config["eos_token"] = eos = sep
    for step in processor.get("processors", [processor]):
        kind = step.get("type")
        if kind == "ByteLevel":
            vocab.add.setdefault("bos", False)
            vocab.add.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            vocab.add.update(bos=True, eos=True, sep=True)
            if not cls and config:
                config["cls_token"] = cls = step.get("cls", [bos])[0]
            if not sep and config:
                config["sep_token"] = sep = step.get("sep", [eos])[0]
        elif kind == "TemplateProcessing":
            single, pair = step.get("single", []), step.get("pair", [])
            first = last = None
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                if first:
                    if not config:
                        bos = first
                    elif first not in (bos, cls):
                        if not bos:
                            config["bos_token"] = bos = first
                        if not cls:
                            config["cls_token"] = cls = first
                    vocab.add["bos"] = first in (bos, cls)
                last = single[-1].get("SpecialToken", {}).get("id")
                if last:
                    if not config:
                        eos = last
                    elif last != eos:
                        extra = "eot" if "eot" not in kinds else "eom" if "eom" not in kinds else None
                        if extra:
                            kinds.append(extra)
                            config[f"{extra}_token"] = eos
                        config["eos_token"] = eos = last
                    vocab.add["eos"] = last == eos
            if pair:
                start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
                stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
                middle = pair[slice(start, stop)]
                if middle and middle[0].get("Sequence", {}).get("id") == "A" and (
                    middle[-1].get("Sequence", {}).get("id") == "B") and (middle := middle[1:-1]):  # fmt: skip
                    add_sep = False
                    entry = middle[0].get("SpecialToken", {}).get("id")
                    if entry and entry in (sep, eos) and not last:
                        add_sep = True
                    if len(middle) == 2:
                        entry = middle[1].get("SpecialToken", {}).get("id")
                        if entry and entry in (sep, eos):
                            add_sep = True
                    vocab.add["sep"] = add_sep
                    if add_sep and not sep and config:
                        config["sep_token"] = eos


def _chat_template(directory: Path, config: dict) -> str | list | None:
    """`chat_template` of tokenizer_config.json, else `chat_template.jinja` (with any `additional_chat_templates/`,
    as a list of named templates), else `chat_template.json`."""
    alternative: Any = None
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        alternative = jinja.read_text(encoding="utf-8")
        more = sorted((directory / "additional_chat_templates").glob("*.jinja"))
        if more:
            alternative = [{"name": "default", "template": alternative}]
            alternative += [{"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in more]
    elif (directory / "chat_template.json").is_file():
        alternative = json.loads((directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    template = config.get("chat_template", alternative)
    return template if template is None or isinstance(template, (str, list)) else None
