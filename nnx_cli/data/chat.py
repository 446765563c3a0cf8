"""Chat templates: a conversation rendered with a model's Jinja template, in a sandbox, as `transformers` does.

A template comes from the model directory (`chat_template.jinja`, else the
`chat_template` of `tokenizer_config.json`) or from `data.chat_template`. It
is rendered by Jinja's immutable sandbox (no attribute of Python internals,
no mutation of the data, nothing imported or executed beyond the template's
own expressions), with what `transformers` passes templates: `messages`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...),
`raise_exception` and `strftime_now`, and a `tojson` that keeps non-ASCII
text::

    text = render(template, [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                  special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from nnx_cli.errors import UserError

Message = Mapping[str, Any]


class TemplateFailed(UserError):
    """A template that does not render a conversation (its own `raise_exception`, or a Jinja error)."""


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.cache
def _generation_tag() -> type:
    """`{% generation %}...{% endgeneration %}`, which training templates (TRL's, some models') wrap around an
    assistant's reply for `transformers`' assistant masks: rendered as its body, as `transformers` renders it.
    The targets here come from the renderings of each turn, as for any template (`assistant_spans`)."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """The Jinja template of `source`, compiled in an immutable sandbox; a syntax error is a TemplateFailed."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_tag()]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except TemplateError as e:
        raise TemplateFailed(f"the chat template does not parse: {e}") from None


def render(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None] | None = None,
) -> str:
    """`messages` as the template writes them; with `add_generation_prompt`, followed by the opening of an
    assistant turn. A template that fails is a TemplateFailed with its message."""
    from jinja2 import TemplateError

    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, tools=None, documents=None,
            **dict(special_tokens or {}),
        )  # fmt: skip
    except TemplateError as e:
        raise TemplateFailed(f"the chat template failed: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise TemplateFailed(f"the chat template failed: {type(e).__name__}: {e}") from None


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens a template may name (`bos_token`, `eos_token`, `pad_token`, ...), from a
    `PretrainedTokenizer`: only those its directory names, so that a template naming another renders nothing
    there, as in `transformers`, rather than the text `None`."""
    return dict(getattr(tokenizer, "template_tokens", {}))


def prompt_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """`nnx-generate --chat`: the prompt as a user turn, after a system turn when `system` is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]


def assistant_spans(
    template: str, messages: Sequence[Message], special_tokens: Mapping[str, str | None] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered whole, and the character spans of its assistant turns (each through its
    end-of-turn token, without the whitespace the template puts after it).

    A turn's span starts where the template's generation prompt ends (the conversation up to that turn,
    rendered with `add_generation_prompt`) and ends where the conversation through that turn ends (without the
    eos a template may put after a conversation's last turn only, as Phi-3's does). A template that renders an
    earlier turn otherwise inside the conversation (Qwen3's drops the reasoning block of turns before the last
    question) has that turn marked as the conversation renders it: its text, then the end the template gives a
    turn (see `_end_inside`). Any other difference is a TemplateFailed.
    """
    full = render(template, messages, add_generation_prompt=False, special_tokens=special_tokens)
    eos = (special_tokens or {}).get("eos_token")
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(template, messages[:i], add_generation_prompt=True, special_tokens=special_tokens)
        through = render(template, messages[: i + 1], add_generation_prompt=False, special_tokens=special_tokens)
        ended = through.rstrip()
        if eos and ended.endswith(eos) and not full.startswith(through) and full.startswith(ended[: -len(eos)]):
            through = ended[: -len(eos)]  # the conversation's end, not the turn's (Phi-3: eos after the last <|end|>)
        if through.startswith(before) and full.startswith(through):
            end = len(through.rstrip())
        elif (end := _end_inside(full, before, through, message["content"])) is None:
            raise TemplateFailed(
                f"the chat template renders message {i} (assistant) differently inside the conversation than "
                "after its prompt, so its tokens cannot be told apart; use a template whose renderings extend one "
                "another (data.chat_template)"
            )
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def _end_inside(full: str, before: str, through: str, content: str) -> int | None:
    """Where an assistant turn ends inside the whole conversation `full`, for a template that renders the turn
    differently there than as the conversation's last (`through`): the conversation up to the turn's prompt
    (`before`) starts both, the turn's text follows in `full` after what the template put before it in `through`
    (or nothing: Qwen3's earlier turns lose their `<think>` block), then the turn's end as `through` writes it
    (`<|im_end|>`). None where the two differ in any other way."""
    content = content.strip()
    said = through.rfind(content)
    if not content or not full.startswith(before) or said < len(before):
        return None
    lead = through[len(before) : said]
    start = len(before) + (len(lead) if full.startswith(lead, len(before)) else 0)
    if not full.startswith(content, start):
        return None
    tail = through[said + len(content) :].rstrip()
    end = start + len(content)
    return end + len(tail) if full.startswith(tail, end) else None


def check_messages(messages: Any, key: str) -> list[dict[str, Any]]:
    """`messages` as a list of `{role, content, ...}` with text `role` and `content`; a ValueError says what is
    wrong. Keys a row leaves empty (`datasets` gives every message of a column the keys of all) are dropped."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{key!r} is not a non-empty list of messages")
    out = []
    for j, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            sharegpt = isinstance(message, Mapping) and {"from", "value"} <= set(message)
            hint = " (ShareGPT's {from, value}: rename from to role and value to content)" if sharegpt else ""
            raise ValueError(f"{key!r}[{j}] is not a {{role, content}} message{hint}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{key!r}[{j}] has no text 'content'")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def span_targets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 flags, 1 for each token whose characters (`offsets`, as `tokenizers` gives them) overlap a span.

    A token that holds the end of a prompt and the start of an answer (`": The"` as one token) is a target, as
    in `transformers`' assistant masks; a token of no width counts at its position::

        span_targets([(0, 5), (5, 9), (9, 12)], [(7, 12)])   # array([0, 1, 1], dtype=uint8)
    """
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not len(bounds):
        return np.zeros(0, np.uint8)
    length = int(max(bounds.max(), *(b for _, b in spans), 0)) + 1
    edges = np.zeros(length + 1, np.int64)
    for a, b in spans:
        edges[a] += 1
        edges[b] -= 1
    covered = np.concatenate([[0], np.cumsum(np.cumsum(edges)[:length] > 0)])  # covered[c]: span chars before c
    start, end = bounds[:, 0], np.maximum(bounds[:, 1], bounds[:, 0] + 1)
    return (covered[end] > covered[start]).astype(np.uint8)
