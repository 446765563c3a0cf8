"""Fine-tuning examples: chats, prompt/completion pairs and preference pairs as token rows with loss masks,
packed or padded.

`data.format: chat` reads a list of `{role, content}` messages per row (`data.messages_key`), renders it with
the chat template (the model directory's, or `data.chat_template`: a file or the Jinja text) in Jinja's
sandbox, and marks as targets the tokens of the assistant turns, each through its end-of-turn token.
`data.format: completion` reads `data.prompt_key` and `data.completion_key` and marks the completion and the
end token that follows it. `data.train_on_prompt: true` marks every token. An example longer than
`data.max_len` (default: `seq_len + 1`, which is also the most a row holds) is cut there; how many were cut
is said once, never silently.

`data.format: preference` reads `{prompt, chosen, rejected}` rows (spec posttrain.md) for objectives that
compare two responses (DPO). A pair is one example of two sequences, the prompt with each response, in
consecutive segments of one row (chosen first: segments 1 and 2, then 3 and 4 for the next pair of the row);
the targets are each response's tokens. Standard rows hold text: the prompt with the tokenizer's leading
specials, the response without, then the end token, as a completion. Conversational rows (TRL's) hold
messages: the prompt rendered with the chat template, the response being the assistant turn through its
end-of-turn token, as chat targets. Each sequence is cut at `data.max_len`, at most half a row, so a pair
always fits one; a pair left with a response of no token is left out (said once).

Rows hold `seq_len + 1` tokens. With `data.packing` (the default) whole examples fill each row in order;
otherwise each example has a row of its own, padded. Each row is stored as::

    tokens     uint16/uint32 [seq_len + 1]   the examples' ids, then padding
    targets    uint8                          1 where predicting this token from the ones before it counts
    segments   int32                          1, 2, ... per example in the row; 0 for padding
    positions  int32                          each example's own positions from 0

`TransformerLM.metrics` attends within a segment only and averages the loss over target tokens, so a
packed example's loss equals its loss alone. Rows are built once per (source, split, options, template,
tokenizer) into the data cache and memory-mapped after::

    splits = load_example_splits(cfg.data, seed=0, pretrained=cfg.model.pretrained)
    batch = splits.train.read(splits.train.epoch_keys(0)[:8])    # {"tokens", "targets", "segments", "positions"}
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_cli.config import DataConfig
from nnx_cli.data import chat
from nnx_cli.data.base import DataSpec
from nnx_cli.data.cache import get_or_build
from nnx_cli.data.tokenizers import load_tokenizer
from nnx_cli.errors import UserError

CHAT, COMPLETION, PREFERENCE = "chat", "completion", "preference"
FORMATS = ("text", CHAT, COMPLETION, PREFERENCE)
CHOSEN, REJECTED = "chosen", "rejected"  # the responses of a preference row
HOLDOUT_FRACTION = 0.1  # of a single split's examples, held out as its eval split
_COLUMNS = ("tokens", "targets", "segments", "positions")
_LAYOUT = 2  # bump when the same options build other rows: old cache entries are then not found


# Templates and tokens
# ------------------------------------------------------------------------------


def chat_template(cfg: DataConfig, tokenizer: Any) -> str | None:
    """`data.chat_template` (a file, or the Jinja text itself), else the tokenizer's own (a model directory's)."""
    given = cfg.chat_template
    if given is None:
        return getattr(tokenizer, "chat_template", None)
    if "\n" not in given and _is_file(Path(given).expanduser()):
        path = Path(given).expanduser()
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"config key 'data.chat_template': cannot read {given!r} ({e})") from None
    if "{" in given:  # every template that uses its messages has a {{ ... }} or {% ... %}
        return given
    raise UserError(
        f"config key 'data.chat_template': {given!r} is neither a file nor a Jinja template; give the path of a "
        "template file (.jinja) or the template's text"
    )


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; False for text no file can be named (a one-line template longer than a file name
    may be: the operating system's error)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _pieces(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The ids of `text` (no special tokens added: a rendered template holds its own) and each token's
    characters `(start, end)`."""
    if hasattr(tokenizer, "to_bytes"):  # bytes: one token per UTF-8 byte
        ids, offsets = [], []
        for i, ch in enumerate(text):
            encoded = ch.encode("utf-8")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))
        return ids, offsets
    return tokenizer.encode_offsets(text)


def _end_token(tokenizer: Any) -> int:
    """What closes a completion: the tokenizer's end-of-sequence token when it names one, else end-of-document."""
    eos = getattr(tokenizer, "eos_token", None)
    found = tokenizer.token_id(eos) if eos is not None and hasattr(tokenizer, "token_id") else None
    return tokenizer.eod_id if found is None else found


def encode_chat(tokenizer: Any, template: str, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """A conversation's ids and target flags: 1 on the tokens of its assistant turns, through each turn's end.

    Qwen2.5's ChatML template, for example::

        conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        ids, targets = encode_chat(tok, tok.chat_template, conversation)
        tok.decode([i for i, t in zip(ids, targets) if t])     # 'Hello<|im_end|>'
    """
    text, spans = chat.assistant_spans(template, messages, chat.special_tokens(tokenizer))
    ids, offsets = _pieces(tokenizer, text)
    return ids, chat.span_targets(offsets, spans).tolist()


def encode_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """The prompt's ids (after the special tokens the tokenizer starts a text with: Llama's begin-of-text), the
    completion's and the end token; the completion and the end token are the targets."""
    plain = getattr(tokenizer, "encode_plain", tokenizer.encode)
    head = [int(t) for t in getattr(tokenizer, "document_prefix", ())] + [int(t) for t in plain(prompt)]
    tail = [int(t) for t in plain(completion)] + [_end_token(tokenizer)]
    return head + tail, [0] * len(head) + [1] * len(tail)


def encode_response(tokenizer: Any, template: str, prompt: list[dict[str, Any]], response: list[dict[str, Any]]
                    ) -> tuple[list[int], list[int]]:  # fmt: skip
    """A conversation's prompt and response as ids and target flags: 1 on the response's assistant turns, through
    each turn's end, as chat targets; the ids end with the last target (what the template writes after a turn's
    end adds nothing to its probability)."""
    specials = chat.special_tokens(tokenizer)
    text, spans = chat.assistant_spans(template, [*prompt, *response], specials)
    start = len(chat.render(template, prompt, add_generation_prompt=False, special_tokens=specials))
    ids, offsets = _pieces(tokenizer, text)
    targets = chat.span_targets(offsets, [(a, b) for a, b in spans if a >= start]).tolist()
    end = max((i + 1 for i, t in enumerate(targets) if t), default=len(ids))
    return ids[:end], targets[:end]


def encode_pair(cfg: DataConfig, tokenizer: Any, template: str | None, example: dict[str, Any]
                ) -> list[tuple[list[int], list[int]]]:  # fmt: skip
    """A preference row's two sequences (chosen, then rejected) as (ids, targets); a ValueError says what is wrong.

    Text rows are a completion each (`encode_completion`); message rows, a rendered prompt and an assistant
    turn (`encode_response`)."""
    prompt = example[cfg.prompt_key]
    responses = [example[CHOSEN], example[REJECTED]]
    if isinstance(prompt, str) and all(isinstance(r, str) for r in responses):
        return [encode_completion(tokenizer, prompt, response) for response in responses]
    if not (isinstance(prompt, list) and all(isinstance(r, list) for r in responses)):
        raise ValueError(
            f"{cfg.prompt_key!r}, {CHOSEN!r} and {REJECTED!r} must all be text, or all be lists of messages (the "
            "prompt's turns, and each response's assistant turn)"
        )
    if template is None:
        raise ValueError(
            "the row holds messages, but there is no chat template: the tokenizer has none and data.chat_template "
            "is not set"
        )
    messages = chat.check_messages(prompt, cfg.prompt_key)
    out = []
    for key, response in zip((CHOSEN, REJECTED), responses):
        turns = chat.check_messages(response, key)
        if not any(m["role"] == "assistant" for m in turns):
            raise ValueError(f"{key!r} holds no assistant turn")
        out.append(encode_response(tokenizer, template, messages, turns))
    return out


def encode_example(cfg: DataConfig, tokenizer: Any, template: str | None, example: dict[str, Any],
                   number: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """One row of the source as (ids, targets), before truncation; bad rows are a UserError naming `number`."""
    _check_row(cfg, example, number)
    try:
        if cfg.format == CHAT:
            ids, targets = encode_chat(
                tokenizer, template, chat.check_messages(example[cfg.messages_key], cfg.messages_key)
            )
        else:
            prompt, completion = example[cfg.prompt_key], example[cfg.completion_key]
            if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
                numbers = [k for k, v in ((cfg.prompt_key, prompt), (cfg.completion_key, completion))
                           if isinstance(v, (int, float)) and not isinstance(v, bool)]  # fmt: skip
                read = (  # a CSV column of numbers is read as numbers: the file cannot say they are text
                    f" ({' and '.join(map(repr, numbers))} read as numbers: a column of numbers in a CSV file is; "
                    "write the rows as JSON Lines with the numbers quoted as strings)"
                    if numbers
                    else ""
                )
                raise ValueError(
                    f"{cfg.prompt_key!r} and {cfg.completion_key!r} must be text, the completion not empty{read}"
                )
            ids, targets = encode_completion(tokenizer, prompt, completion)
    except (chat.TemplateFailed, ValueError) as e:
        raise UserError(f"row {number} of {cfg.source!r}: {e}") from None
    if cfg.train_on_prompt:
        targets = [0] + [1] * (len(ids) - 1)
    return ids, targets


def encode_parts(cfg: DataConfig, tokenizer: Any, template: str | None, example: dict[str, Any],
                 number: int) -> list[tuple[list[int], list[int]]]:  # fmt: skip
    """One row of the source as the sequences it becomes, each (ids, targets): one for chat and completion rows,
    two for a preference pair; bad rows are a UserError naming `number`."""
    if cfg.format != PREFERENCE:
        return [encode_example(cfg, tokenizer, template, example, number)]
    _check_row(cfg, example, number)
    try:
        return encode_pair(cfg, tokenizer, template, example)
    except (chat.TemplateFailed, ValueError) as e:
        raise UserError(f"row {number} of {cfg.source!r}: {e}") from None


def _check_row(cfg: DataConfig, example: dict[str, Any], number: int) -> None:
    """Every column the format reads is there; a UserError naming the row and the column otherwise."""
    missing = [k for k in _columns(cfg) if example.get(k) is None]
    if not missing:
        return
    if cfg.format == PREFERENCE:
        raise UserError(
            f"row {number} of {cfg.source!r} has no {missing[0]!r}: preference rows hold {cfg.prompt_key!r}, "
            f"{CHOSEN!r} and {REJECTED!r}; columns: " + ", ".join(k for k, v in example.items() if v is not None)
        )
    option = (
        "messages_key" if cfg.format == CHAT else "prompt_key" if missing[0] == cfg.prompt_key else "completion_key"
    )
    raise UserError(
        f"config key 'data.{option}': row {number} of {cfg.source!r} has no {missing[0]!r}; every row needs it (name "
        f"another column with data.{option}, or drop the rows without one)"
    )


# Rows
# ------------------------------------------------------------------------------


def pack(examples: Iterable[Sequence[tuple[Sequence[int], Sequence[int]]]], width: int, packing: bool = True
         ) -> Iterator[dict[str, np.ndarray]]:  # fmt: skip
    """Rows of `width` tokens holding `examples`, each whole in one row, in order. An example is a list of
    sequences (ids, targets), each a segment of its own: one for a chat or a completion, two for a pair.

    With `packing`, an example goes into the current row if it fits, else starts the next; without, each has a
    row of its own. `segments` number the sequences of a row from 1 (0: padding), `positions` count from 0
    within each sequence::

        examples = [[([5, 6], [0, 1])], [([7], [1])], [([8, 9], [0, 1])]]
        [row["segments"].tolist() for row in pack(examples, width=4)]
        # [[1, 1, 2, 0], [1, 1, 0, 0]]
    """
    row: dict[str, np.ndarray] | None = None
    fill = segment = 0
    for parts in examples:
        parts = [(ids, targets) for ids, targets in parts if len(ids)]
        n = sum(len(ids) for ids, _ in parts)
        if n > width:
            raise ValueError(f"an example of {n} tokens does not fit a row of {width}")
        if n == 0:
            continue
        if row is not None and (not packing or fill + n > width):
            yield row
            row = None
        if row is None:
            row = {name: np.zeros(width, np.int64) for name in _COLUMNS}
            fill = segment = 0
        for ids, targets in parts:
            k = len(ids)
            segment += 1
            row["tokens"][fill : fill + k] = ids
            row["targets"][fill : fill + k] = targets
            row["segments"][fill : fill + k] = segment
            row["positions"][fill : fill + k] = np.arange(k)
            fill += k
    if row is not None:
        yield row


def build_rows(cfg: DataConfig, tokenizer: Any, rows: Any, directory: Path, first_row: int = 0) -> dict[str, Any]:
    """Tokenize the examples of `rows` (a `datasets.Dataset`) and write them as rows (`<column>.npy`, flat: read
    them back with `.reshape(-1, seq_len + 1)`) into `directory`, a row at a time; row numbers in errors start
    at `first_row`. Returns the counts: examples, rows, truncated, without targets, tokens, target tokens."""
    from nnx_cli.data.text import _NpyWriter, stream_dtype

    width = cfg.seq_len + 1
    limit = sequence_limit(cfg)
    template = chat_template(cfg, tokenizer) if cfg.format in (CHAT, PREFERENCE) else None
    if cfg.format == CHAT and template is None:
        raise UserError(
            "config key 'data.format' is chat, but there is no chat template: the tokenizer has none (a model "
            "directory's chat_template.jinja or tokenizer_config.json) and data.chat_template is not set; set it "
            "to a template file or its Jinja text"
        )
    if template is not None:
        chat.compile_template(template)  # a template that does not parse is the template's fault, not a row's
    counts = {"examples": 0, "rows": 0, "truncated": 0, "without_targets": 0, "tokens": 0, "target_tokens": 0}
    counts["same"] = 0  # preference pairs whose chosen and rejected sequences are the same: they teach nothing

    def examples() -> Iterator[list[tuple[list[int], list[int]]]]:
        for offset, example in enumerate(_progress(rows, len(rows))):
            parts = encode_parts(cfg, tokenizer, template, example, first_row + offset)
            counts["examples"] += 1
            counts["same"] += cfg.format == PREFERENCE and parts[0] == parts[1]
            counts["truncated"] += any(len(ids) > limit for ids, _ in parts)
            parts = [(ids[:limit], targets[:limit]) for ids, targets in parts]
            empty = [not any(targets[1:]) for _, targets in parts]
            if cfg.format == PREFERENCE and any(empty):  # a pair needs both responses: it is left out
                counts["without_targets"] += 1
                continue
            counts["without_targets"] += all(empty)
            counts["tokens"] += sum(len(ids) for ids, _ in parts)
            counts["target_tokens"] += sum(sum(targets[1:]) for _, targets in parts)
            yield parts

    dtypes = {"tokens": stream_dtype(tokenizer.vocab_size), "targets": np.uint8, "segments": np.int32,
              "positions": np.int32}  # fmt: skip
    with contextlib.ExitStack() as stack:
        out = {name: stack.enter_context(_NpyWriter(directory / f"{name}.npy", dtypes[name])) for name in _COLUMNS}
        for row in pack(examples(), width, cfg.packing):
            for name in _COLUMNS:
                out[name].write(row[name])
            counts["rows"] += 1
    return counts


def sequence_limit(cfg: DataConfig) -> int:
    """The most tokens one sequence keeps: `data.max_len`, at most a row (`seq_len + 1`); for preference pairs,
    whose two sequences share a row, at most half of one."""
    width = cfg.seq_len + 1
    most = width // 2 if cfg.format == PREFERENCE else width
    return min(cfg.max_len or most, most)


def _progress(rows: Any, total: int) -> Iterator[dict[str, Any]]:
    """The rows, their progress shown for more than a few thousand (:func:`nnx_cli.report.progress`)."""
    from nnx_cli import report

    with report.progress(total, f"tokenizing {total:,} examples", at_least=5000) as advance:
        for row in rows:
            yield row
            advance(1)


# Splits
# ------------------------------------------------------------------------------


class _Rowwise:
    """Stored rows addressed by row number."""

    def __init__(self, arrays: dict[str, np.ndarray], spec: DataSpec):
        self.arrays = arrays
        self.spec = spec

    def __len__(self) -> int:
        return len(self.arrays["tokens"])

    def read(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        keys = np.asarray(keys, dtype=np.int64)
        return {name: array[keys] for name, array in self.arrays.items()}

    def stored(self) -> dict[str, np.ndarray]:
        return dict(self.arrays)

    def read_on_device(self, stored: dict[str, jax.Array], keys: jax.Array) -> dict[str, jax.Array]:
        return {name: jnp.take(array, keys, axis=0) for name, array in stored.items()}

    def prepare(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {
            "tokens": rows["tokens"].astype(jnp.int32),
            "targets": rows["targets"].astype(bool),
            "segments": rows["segments"].astype(jnp.int32),
            "positions": rows["positions"].astype(jnp.int32),
        }


class ExampleTrainSplit(_Rowwise):
    """Training rows; epoch `e` is a permutation of them from `(seed, e)`."""

    def __init__(self, arrays: dict[str, np.ndarray], seed: int, spec: DataSpec):
        super().__init__(arrays, spec)  # with at least one row: load_example_splits says why there is none
        self.seed = seed

    def steps_per_epoch(self, batch_size: int) -> int:
        if batch_size > len(self):
            raise UserError(
                f"config key 'train.batch_size' ({batch_size}) is larger than the training split ({len(self)} rows "
                f"of {self.arrays['tokens'].shape[1]} tokens); lower train.batch_size, or data.seq_len to pack less"
            )
        return len(self) // batch_size

    def epoch_keys(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self)).astype(np.int64)


class ExampleEvalSplit(_Rowwise):
    """Eval rows in order; the last batch is padded, with a `mask` of the real rows."""

    def eval_batches(self, batch_size: int, rows: slice = slice(None)) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(self), batch_size):
            index = np.arange(start, start + batch_size)[rows]
            real = index < len(self)
            batch = {name: np.zeros((len(index), *a.shape[1:]), a.dtype) for name, a in self.arrays.items()}
            for name, array in self.arrays.items():
                batch[name][real] = array[index[real]]
            yield {**batch, "mask": real}


@dataclasses.dataclass(frozen=True)
class ExampleSplits:
    train: ExampleTrainSplit | None
    eval: ExampleEvalSplit | None
    spec: DataSpec


def is_examples(cfg: DataConfig) -> bool:
    """Whether `cfg` describes fine-tuning examples (`data.format` chat, completion or preference)."""
    return cfg.format in (CHAT, COMPLETION, PREFERENCE)


def is_conversational(cfg: DataConfig) -> bool:
    """Whether `cfg` trains on conversations rendered by a chat template: chats, or preference pairs in TRL's
    conversational form (the first training row's prompt a list of messages: `datasets` gives a column one type)."""
    if cfg.format == CHAT:
        return True
    if cfg.format != PREFERENCE:
        return False
    from nnx_cli.data.text import _Source

    rows = _Source(cfg).dataset(cfg.train_split, "data.train_split", columns=_columns(cfg))
    return len(rows) > 0 and isinstance(rows[0][cfg.prompt_key], list)


def load_example_splits(
    cfg: DataConfig, seed: int, splits: Collection[str] = ("train", "eval"), pretrained: str | None = None
) -> ExampleSplits:
    """The training and/or eval rows of a chat or completion config, built into the cache the first time."""
    from nnx_cli.data.text import _notice, _Source

    tokenizer = load_tokenizer(cfg.tokenizer, pretrained)
    spec = DataSpec((cfg.seq_len,), tokenizer.vocab_size, cfg.tokenizer)
    source = _Source(cfg)
    want_train, want_eval = "train" in splits, "eval" in splits and cfg.eval_split is not None
    train = evaluation = None
    held_out = cfg.eval_split is not None and source.holds_out(cfg.eval_split)
    if held_out:
        rows = source.dataset(cfg.train_split, "data.train_split", columns=_columns(cfg))
        cut = len(rows) - max(1, int(len(rows) * HOLDOUT_FRACTION))
        _notice(
            (cfg.source, cfg.eval_split, "examples"),
            f"notice: {cfg.source!r} has no split {cfg.eval_split!r}; its last {len(rows) - cut:,} of {len(rows):,} "
            f"examples {'is' if len(rows) - cut == 1 else 'are'} held out as {cfg.eval_split!r}",
        )
        if want_train:
            train = _rows(cfg, tokenizer, source, cfg.train_split, "data.train_split", (0, cut), f"{cfg.train_split!r}")
        if want_eval:
            held = f"{cfg.eval_split!r} (held out of {cfg.train_split!r})"
            evaluation = _rows(cfg, tokenizer, source, cfg.train_split, "data.train_split", (cut, len(rows)), held)
    else:
        if want_train:
            train = _rows(cfg, tokenizer, source, cfg.train_split, "data.train_split", None, f"{cfg.train_split!r}")
        if want_eval:
            evaluation = _rows(cfg, tokenizer, source, cfg.eval_split, "data.eval_split", None, f"{cfg.eval_split!r}")
    if train is not None and not len(train["tokens"]):
        if held_out and cut == 0:  # it named data.seq_len
            raise UserError(
                f"the training split has no examples: {cfg.source!r} has {len(rows)} example"
                f"{'s' * (len(rows) != 1)}, all held out as {cfg.eval_split!r} (it has no split of that name); add "
                "examples, or set data.eval_split: null to train on them without evals"
            )
        key, limit = _limit(cfg)
        raise UserError(
            "the training split has no examples: its source split is empty, or every example was left out (the "
            f"notices above say why; a {key} above {limit} keeps longer ones)"
        )
    if train is not None:
        _check_targets(cfg, train, f"the training split {cfg.train_split!r}", "to learn from", "")
    if evaluation is not None:
        _check_targets(cfg, evaluation, f"the eval split {cfg.eval_split!r}", "to measure",
                       ", or set data.eval_split: null to train without evals")  # fmt: skip
    return ExampleSplits(
        ExampleTrainSplit(train, seed, spec) if train is not None else None,
        ExampleEvalSplit(evaluation, spec) if evaluation is not None else None,
        spec,
    )


def _check_targets(cfg: DataConfig, arrays: dict[str, np.ndarray], split: str, purpose: str, way_out: str) -> None:
    """A UserError when no row of `split` has a token the loss counts: a run would report a loss of 0 and learn
    nothing (the chat format trains on assistant turns only; a data.seq_len too short cuts every answer away)."""
    if np.any(arrays["targets"][:, 1:]):
        return
    rows = int(arrays["segments"].max(axis=1, initial=0).sum())  # examples: packed rows number theirs from 1
    key, limit = _limit(cfg)
    if cfg.format == PREFERENCE:
        why = "every pair was left out (the notices above say why)" if rows == 0 else "no pair has a response token"
    elif cfg.format == CHAT:
        why = (f"none of its {rows:,} conversations has an assistant turn within {key} ({limit}) tokens: the "
               "loss is on messages whose role is 'assistant' "
               "(rename roles like 'gpt' or 'model')")  # fmt: skip
    else:
        why = f"none of its {rows:,} examples has a completion token within {key} ({limit}) tokens"
    raise UserError(f"{split} has no target token {purpose}: {why}; raise {key} or fix the data{way_out}")


def _limit(cfg: DataConfig) -> tuple[str, int]:
    """The key that bounds an example's tokens, and its value: data.max_len when it is below a row (it was blamed
    on data.seq_len, which raising did not help)."""
    return ("data.max_len", cfg.max_len) if sequence_limit(cfg) == cfg.max_len else ("data.seq_len", cfg.seq_len)


def _columns(cfg: DataConfig) -> list[str]:
    if cfg.format == PREFERENCE:
        return [cfg.prompt_key, CHOSEN, REJECTED]
    return [cfg.messages_key] if cfg.format == CHAT else [cfg.prompt_key, cfg.completion_key]


def _rows(cfg: DataConfig, tokenizer: Any, source: Any, split: str, key: str, part: tuple[int, int] | None,
          name: str) -> dict[str, np.ndarray]:  # fmt: skip
    """The row arrays of `split` (or of its examples `part`), from the cache or built into it; `name` is how
    notices call them."""
    template = chat_template(cfg, tokenizer) if cfg.format in (CHAT, PREFERENCE) else None
    width = cfg.seq_len + 1
    parts = {
        "kind": "examples",
        "layout": _LAYOUT,
        "source": source.id,
        "split": split,
        "part": list(part) if part else None,
        "fingerprint": source.fingerprint(split, key, columns=_columns(cfg)),
        "format": cfg.format,
        "keys": _columns(cfg),
        "template": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "tokenizer": tokenizer.name,
        "tokenizer_version": tokenizer.version,
        "special_tokens": chat.special_tokens(tokenizer),  # what templates and completions end with
        "seq_len": cfg.seq_len,
        "max_len": sequence_limit(cfg),
        "packing": cfg.packing,
        "train_on_prompt": cfg.train_on_prompt,
    }

    def build(directory: Path) -> dict[str, Any]:
        rows = source.dataset(split, key, columns=_columns(cfg))
        if part is not None:
            rows = rows.select(range(*part))
        return build_rows(cfg, tokenizer, rows, directory, first_row=part[0] if part else 0)

    entry = get_or_build(source.cache, f"examples-{source.slug()}-{split}", parts, build)
    if entry.meta.get("truncated") or entry.meta.get("without_targets") or entry.meta.get("same"):
        _notice_truncation(cfg, name, entry.meta)
    return {column: entry.array(column).reshape(-1, width) for column in _COLUMNS}


def _notice_truncation(cfg: DataConfig, name: str, counts: dict[str, Any]) -> None:
    from nnx_cli.data.text import _notice

    limit = sequence_limit(cfg)
    said = []
    if cfg.format == PREFERENCE:
        if counts["truncated"]:
            said.append(f"{counts['truncated']:,} of {counts['examples']:,} pairs have a sequence (prompt and "
                        f"response) longer than {limit} tokens, cut there (data.max_len; at most half of "
                        "data.seq_len + 1)")  # fmt: skip
        if counts["without_targets"]:
            said.append(f"{counts['without_targets']:,} of {counts['examples']:,} pairs have a response with no "
                        "token left after the cut and were left out")  # fmt: skip
        if counts.get("same"):
            said.append(f"{counts['same']:,} of {counts['examples']:,} pairs have the same chosen and rejected "
                        "response: their loss stays at log 2, and they teach nothing")  # fmt: skip
        _notice((cfg.source, name, "truncated"), f"notice: {name}: " + "; ".join(said))
        return
    if counts["truncated"]:
        said.append(f"{counts['truncated']:,} of {counts['examples']:,} examples are longer than {limit} tokens and "
                    "were cut there (data.max_len, data.seq_len)")  # fmt: skip
    if counts["without_targets"]:
        said.append(f"{counts['without_targets']:,} of {counts['examples']:,} examples have no target token (none "
                    "left after the cut, or no assistant turn) and add nothing to the loss")  # fmt: skip
    _notice((cfg.source, name, "truncated"), f"notice: {name}: " + "; ".join(said))
