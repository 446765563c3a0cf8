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
from typing import Any

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


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """The Jinja template of `source`, compiled in an immutable sandbox; a syntax error is a TemplateFailed."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
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


def special_tokens(tokenizer: Any) -> dict[str, str | None]:
    """The special tokens a template may name, from a `PretrainedTokenizer`."""
    return {"bos_token": getattr(tokenizer, "bos_token", None), "eos_token": getattr(tokenizer, "eos_token", None)}


def prompt_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """`nnx-generate --chat`: the prompt as a user turn, after a system turn when `system` is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
