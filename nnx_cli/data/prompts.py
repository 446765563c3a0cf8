"""Prompts to sample completions of (`data.format: prompt`), for objectives that learn from rewards (GRPO).

A row holds a prompt (`data.prompt_key`, default `prompt`): text, tokenized
as the tokenizer does by default (its leading specials, such as Llama's
begin-of-text, then the text), or a list of chat messages, rendered with the
chat template and its generation prompt (the opening of the assistant's
turn). Every other column of the row (an answer to check, tests to run) is
kept as it is and given to the reward functions by name::

    {"prompt": "What is 7 * 6?", "answer": "42"}
    {"prompt": [{"role": "user", "content": "What is 7 * 6?"}], "answer": "42"}

A row holds its completion too while training, so a prompt has at most
`data.seq_len + 1 - objective.max_new_tokens` tokens (and at most
`data.max_len` when set); a longer one keeps its last tokens, where the
question and the generation prompt are, and how many were cut is said once.
The token ids are built once per (source, split, template, tokenizer) into
the data cache; a split stores them right-padded to its longest prompt::

    splits = load_prompt_splits(cfg, ("train",))
    stored = splits.train.read(splits.train.epoch_keys(0)[:8])    # {"tokens": [8, P], "lengths": [8]}
    prompts, columns = splits.train.columns(keys)                   # the rows as the reward functions get them
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_cli.config import Config, DataConfig
from nnx_cli.data import chat
from nnx_cli.data.base import DataSpec
from nnx_cli.data.cache import get_or_build
from nnx_cli.data.tokenizers import load_tokenizer
from nnx_cli.errors import UserError

PROMPT = "prompt"
_LAYOUT = 1  # bump when the same options build other ids: old cache entries are then not found


def encode_prompt(cfg: DataConfig, tokenizer: Any, template: str | None, prompt: Any) -> list[int]:
    """A prompt's token ids: text with the tokenizer's leading specials, or messages rendered with the chat
    template and its generation prompt. A ValueError says what is wrong."""
    if isinstance(prompt, str):
        plain = getattr(tokenizer, "encode_plain", tokenizer.encode)
        return [int(t) for t in getattr(tokenizer, "document_prefix", ())] + [int(t) for t in plain(prompt)]
    if not isinstance(prompt, list):
        raise ValueError(f"{cfg.prompt_key!r} must be text or a list of chat messages, not {type(prompt).__name__}")
    if template is None:
        raise ValueError(
            "the prompt holds messages, but there is no chat template: the tokenizer has none and "
            "data.chat_template is not set"
        )
    messages = chat.check_messages(prompt, cfg.prompt_key)
    text = chat.render(template, messages, add_generation_prompt=True, special_tokens=chat.special_tokens(tokenizer))
    return [int(t) for t in getattr(tokenizer, "encode_plain", tokenizer.encode)(text)]


def prompt_limit(cfg: Config) -> int:
    """The most tokens a prompt keeps: a row holds the prompt and its completion (`data.seq_len + 1` tokens,
    `objective.max_new_tokens` of them the completion's), and at most `data.max_len`."""
    new = cfg.objective.settings().max_new_tokens if cfg.objective.name == "grpo" else 0
    room = cfg.data.seq_len + 1 - new
    if room < 1:
        raise UserError(
            f"config key 'data.seq_len' ({cfg.data.seq_len}) leaves no room for a prompt: a row holds seq_len + 1 "
            f"tokens, the prompt and its completion of up to objective.max_new_tokens ({new}); raise data.seq_len"
        )
    return min(room, cfg.data.max_len) if cfg.data.max_len else room


def _build(cfg: DataConfig, tokenizer: Any, rows: Any, directory: Path, first_row: int) -> dict[str, Any]:
    """Tokenize every prompt of `rows` into `ids.npy` (flat) and `lengths.npy`; bad rows name their number."""
    from nnx_cli.data.text import _NpyWriter, stream_dtype

    template = _template(cfg, tokenizer)
    lengths = []
    with _NpyWriter(directory / "ids.npy", stream_dtype(tokenizer.vocab_size)) as out:
        for offset, prompt in enumerate(rows[cfg.prompt_key]):
            number = first_row + offset
            if prompt is None:
                raise UserError(
                    f"row {number} of {cfg.source!r} has no {cfg.prompt_key!r}: prompt rows hold "
                    f"{cfg.prompt_key!r} (text or chat messages) and any columns the rewards read"
                )
            try:
                ids = encode_prompt(cfg, tokenizer, template, prompt)
            except (chat.TemplateFailed, ValueError) as e:
                raise UserError(f"row {number} of {cfg.source!r}: {e}") from None
            if not ids:
                raise UserError(
                    f"row {number} of {cfg.source!r}: {cfg.prompt_key!r} encodes to no tokens; give it some text"
                )
            out.write(np.asarray(ids))
            lengths.append(len(ids))
    np.save(directory / "lengths.npy", np.asarray(lengths, np.int32))
    return {"prompts": len(lengths), "tokens": int(sum(lengths))}


def _template(cfg: DataConfig, tokenizer: Any) -> str | None:
    from nnx_cli.data.examples import chat_template

    template = chat_template(cfg, tokenizer)
    if template is not None:
        chat.compile_template(template)  # a template that does not parse is the template's fault, not a row's
    return template


class _Prompts:
    """Prompts as stored (`tokens` right-padded `[N, P]`, `lengths` `[N]`) and their source rows."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, rows: Any, prompt_key: str, spec: DataSpec):
        self.tokens, self.lengths, self.rows = tokens, lengths, rows
        self.prompt_key = prompt_key
        self.spec = spec

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """The stored width of a prompt: the longest one's tokens."""
        return self.tokens.shape[1]

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        keys = np.asarray(keys, np.int64)
        return {"tokens": self.tokens[keys], "lengths": self.lengths[keys]}

    def stored(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "lengths": self.lengths}

    def read_on_device(self, stored: dict[str, jax.Array], keys: jax.Array) -> dict[str, jax.Array]:
        return {name: jnp.take(array, keys, axis=0) for name, array in stored.items()}

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {"tokens": rows["tokens"].astype(jnp.int32), "lengths": rows["lengths"].astype(jnp.int32)}

    def columns(self, keys: Sequence[int]) -> tuple[list[Any], dict[str, list[Any]]]:
        """The prompts of rows `keys` as the source holds them (text, or messages), and every other column of
        those rows by name, as lists aligned with them."""
        picked = self.rows.select([int(k) for k in keys]).to_dict()
        prompts = picked.pop(self.prompt_key)
        if prompts and isinstance(prompts[0], list):  # datasets gives each message the keys of all: drop empty ones
            prompts = [[{k: v for k, v in m.items() if v is not None} for m in p] for p in prompts]
        return prompts, picked


class PromptTrainSplit(_Prompts):
    """Training prompts; epoch `e` is a permutation of them from `(seed, e)`."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, rows: Any, prompt_key: str, seed: int,
                 spec: DataSpec):  # fmt: skip
        super().__init__(tokens, lengths, rows, prompt_key, spec)
        self.seed = seed
        if len(self) == 0:
            raise UserError("the training split has no prompts")

    def steps_per_epoch(self, batch_size: int) -> int:
        if batch_size > len(self):
            raise UserError(
                f"config key 'train.batch_size' ({batch_size}) is larger than the training split ({len(self)} "
                "prompts); lower train.batch_size (it counts prompts, each sampled objective.num_generations times)"
            )
        return len(self) // batch_size

    def epoch_keys(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self)).astype(np.int64)


class PromptEvalSplit(_Prompts):
    """Eval prompts in order; the last batch is padded (a prompt of one token), with a `mask` of the real rows
    and their row numbers under `index`."""

    def eval_batches(self, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(self), batch_size):
            index = np.arange(start, start + batch_size)[rows]
            real = index < len(self)
            tokens = np.zeros((len(index), self.width), self.tokens.dtype)
            lengths = np.ones(len(index), np.int32)
            tokens[real], lengths[real] = self.tokens[index[real]], self.lengths[index[real]]
            yield {"tokens": tokens, "lengths": lengths, "mask": real, "index": np.where(real, index, 0)}


@dataclasses.dataclass(frozen=True)
class PromptSplits:
    train: PromptTrainSplit | None
    eval: PromptEvalSplit | None
    spec: DataSpec


def load_prompt_splits(cfg: Config, splits: Collection[str] = ("train", "eval")) -> PromptSplits:
    """The training and/or eval prompts of `cfg`, built into the cache the first time."""
    from nnx_cli.data.examples import HOLDOUT_FRACTION
    from nnx_cli.data.text import _notice, _Source

    data = cfg.data
    tokenizer = load_tokenizer(data.tokenizer, cfg.model.pretrained)
    spec = DataSpec((data.seq_len,), tokenizer.vocab_size, data.tokenizer)
    limit = prompt_limit(cfg)
    source = _Source(data)
    want_train, want_eval = "train" in splits, "eval" in splits and data.eval_split is not None
    parts: dict[str, tuple[str, str, tuple[int, int] | None, str]] = {}
    if data.eval_split is not None and source.holds_out(data.eval_split):
        rows = source.dataset(data.train_split, "data.train_split", columns=[data.prompt_key])
        cut = len(rows) - max(1, int(len(rows) * HOLDOUT_FRACTION))
        _notice(
            (data.source, data.eval_split, "prompts"),
            f"notice: {data.source!r} has no split {data.eval_split!r}; its last {len(rows) - cut:,} of {len(rows):,} "
            f"prompts are held out as {data.eval_split!r}",
        )
        if want_train:
            parts["train"] = (data.train_split, "data.train_split", (0, cut), repr(data.train_split))
        if want_eval:
            held = f"{data.eval_split!r} (held out of {data.train_split!r})"
            parts["eval"] = (data.train_split, "data.train_split", (cut, len(rows)), held)
    else:
        if want_train:
            parts["train"] = (data.train_split, "data.train_split", None, repr(data.train_split))
        if want_eval:
            parts["eval"] = (data.eval_split, "data.eval_split", None, repr(data.eval_split))
    loaded = {which: _prompts(data, tokenizer, source, *part, limit) for which, part in parts.items()}
    train = PromptTrainSplit(*loaded["train"], data.prompt_key, cfg.seed, spec) if "train" in loaded else None
    evaluation = PromptEvalSplit(*loaded["eval"], data.prompt_key, spec) if "eval" in loaded else None
    return PromptSplits(train, evaluation, spec)


def _prompts(cfg: DataConfig, tokenizer: Any, source: Any, split: str, key: str, part: tuple[int, int] | None,
             name: str, limit: int) -> tuple[np.ndarray, np.ndarray, Any]:  # fmt: skip
    """The prompts of `split` (or of its rows `part`), right-padded to the longest (cut at `limit`), their
    lengths, and the source rows."""
    from nnx_cli.data.text import _notice

    rows = source.dataset(split, key, columns=[cfg.prompt_key])
    if part is not None:
        rows = rows.select(range(*part))
    template = _template(cfg, tokenizer)
    entry = get_or_build(
        source.cache,
        f"prompts-{source.slug()}-{split}",
        {
            "kind": "prompts",
            "layout": _LAYOUT,
            "source": source.id,
            "split": split,
            "part": list(part) if part else None,
            "fingerprint": source.fingerprint(split, key, columns=[cfg.prompt_key]),
            "prompt_key": cfg.prompt_key,
            "template": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "tokenizer": tokenizer.name,
            "tokenizer_version": tokenizer.version,
            "special_tokens": chat.special_tokens(tokenizer),
        },
        lambda directory: _build(cfg, tokenizer, rows, directory, part[0] if part else 0),
    )
    ids, lengths = entry.array("ids"), np.asarray(entry.array("lengths"))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    kept = np.minimum(lengths, limit)
    tokens = np.zeros((len(lengths), int(kept.max(initial=1))), np.int32)
    for i, (start, n, k) in enumerate(zip(starts, lengths, kept)):
        tokens[i, :k] = ids[start + n - k : start + n]  # a long prompt keeps its end
    cut = int(np.sum(lengths > limit))
    if cut:
        _notice(
            (cfg.source, name, "truncated"),
            f"notice: {name}: {cut:,} of {len(lengths):,} prompts are longer than {limit} tokens and keep their last "
            f"{limit} (data.seq_len + 1 less objective.max_new_tokens, or data.max_len)",
        )
    with contextlib.suppress(AttributeError):
        rows = rows.with_format(None)
    return tokens, kept.astype(np.int32), rows
