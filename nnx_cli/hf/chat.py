"""Chat templates moved to :mod:`nnx_cli.data.chat` (the data side renders conversations; hf reads model
directories); this name stays for existing imports."""

from nnx_cli.data.chat import (
    Message,
    TemplateFailed,
    assistant_spans,
    check_messages,
    compile_template,
    prompt_messages,
    render,
    span_targets,
    special_tokens,
)

__all__ = [
    "Message",
    "TemplateFailed",
    "assistant_spans",
    "check_messages",
    "compile_template",
    "prompt_messages",
    "render",
    "span_targets",
    "special_tokens",
]
