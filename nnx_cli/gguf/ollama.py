"""`--ollama`: a `Modelfile` beside the GGUF file, so that `ollama create NAME -f Modelfile` runs it.

Ollama writes chat templates in Go's `text/template`, not Jinja. The model's Jinja template is translated by what
it does, not by its text: it is rendered for a few conversations, each role's text before and after a message's
content is read off the renderings, and the Go template built from those pieces is checked to render a longer
conversation exactly as the Jinja template does. A template that does something else (folds the system turn
into the first user turn, trims or rewrites contents) falls back to the same pieces for the roles it does write
plainly, the others written as user turns; one that cannot be read that way at all leaves `{{ .Prompt }}` (the
text as given). The stop tokens are the end of an assistant turn and the end-of-sequence token; the temperature is
the generation config's (`general.sampling.temp`), else Ollama's default 0.8::

    FROM ./qwen.gguf
    TEMPLATE \"\"\"{{- range .Messages }}...{{ end }}<|im_start|>assistant
    \"\"\"
    PARAMETER stop "<|im_end|>"
    PARAMETER temperature 0.8
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nnx_cli.errors import UserError

NAME = "Modelfile"
_ROLES = ("system", "user", "assistant")
_MARK = {"system": "\x01SYSTEM\x01", "user": "\x01USER\x01", "assistant": "\x01ASSISTANT\x01"}


def check_out(gguf_path: Path, overwrite: bool) -> None:
    """The Modelfile beside `gguf_path` must not exist (unless `overwrite`), nor be the GGUF file itself."""
    path = gguf_path.parent / NAME
    if gguf_path.name == NAME:  # the Modelfile was written over the model, and the export said it wrote both
        raise UserError(f"--out {str(gguf_path)!r}: --ollama writes its {NAME} beside the GGUF file; give the file "
                        "another name, such as model.gguf")  # fmt: skip
    if path.exists() and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it (nothing was written)")


def write(gguf_path: Path) -> Path:
    """Write `Modelfile` beside `gguf_path` from the file's own metadata; returns its path."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general.sampling"))}
    tokens = fields.get("tokenizer.ggml.tokens") or []
    types = fields.get("tokenizer.ggml.token_type") or []
    bos = _token(tokens, fields.get("tokenizer.ggml.bos_token_id"))
    eos = _token(tokens, fields.get("tokenizer.ggml.eos_token_id"))
    template = fields.get("tokenizer.chat_template")
    strip = bos if fields.get("tokenizer.ggml.add_bos_token", True) else None  # llama.cpp adds it itself
    go, end_of_turn = translate(template, bos, eos, strip) if isinstance(template, str) else ("{{ .Prompt }}", None)
    control = {t for t, kind in zip(tokens, types) if kind == 3}
    stops = [s for s in dict.fromkeys([end_of_turn, eos]) if s and s in control]
    temperature = fields.get("general.sampling.temp", 0.8)
    lines = [f"FROM ./{gguf_path.name}", f'TEMPLATE """{go}"""']
    lines += [f"PARAMETER stop {_quoted(s)}" for s in stops]
    lines.append(f"PARAMETER temperature {round(float(temperature), 4)}")
    path = gguf_path.parent / NAME
    partial = path.with_name(f".{NAME}.partial")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)
    return path


def _token(tokens: list[str], index: Any) -> str | None:
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def translate(template: str, bos: str | None, eos: str | None, strip: str | None) -> tuple[str, str | None]:
    """A Go template for Ollama doing what the Jinja chat `template` does, and the text that ends an assistant
    turn (a stop token); `strip` is a begin-of-sequence token the renderings start with and llama.cpp adds."""
    from nnx_cli.data.chat import TemplateFailed, render

    def text(roles: list[str], generation: bool, index: int = 0) -> str:
        messages = [{"role": r, "content": f"{_MARK[r]}{index + i}"} for i, r in enumerate(roles)]
        out = render(template, messages, add_generation_prompt=generation, special_tokens={"bos_token": bos,
                                                                                         "eos_token": eos})  # fmt: skip
        return out[len(strip) :] if strip and out.startswith(strip) else out

    try:
        pieces = _pieces(text)
    except (TemplateFailed, ValueError):
        return "{{ .Prompt }}", None
    if pieces is None:
        return "{{ .Prompt }}", None
    go = _go(pieces)
    return go, pieces["assistant"][1].strip() or None


def _pieces(text: Any) -> dict[str, tuple[str, str]] | None:
    """Each role's (before, after) its content, and the generation prompt under "generate", read off renderings;
    None when the user and assistant turns cannot be read that way.

    A user turn followed by the generation prompt shows `before`, then `after` + the prompt; the same turn alone
    shows where `after` ends (a template may add more there, such as an end-of-sequence token: the split is taken
    at the last line end or `<` within what the two share). Between a user and an assistant turn stand the user's
    `after` and the assistant's `before`; between an assistant and a user turn, the assistant's `after` and the
    user's `before`."""
    user = f"{_MARK['user']}0"
    before_user, tail = _split(text(["user"], True), user)
    _, alone = _split(text(["user"], False), user)
    if before_user is None:
        return None
    k = next((i for i, (a, b) in enumerate(zip(tail, alone)) if a != b), min(len(tail), len(alone)))
    while 0 < k < len(tail) and tail[k - 1] != "\n" and tail[k] != "<":
        k -= 1
    after_user, generate = tail[:k], tail[k:]
    three = text(["user", "assistant", "user"], True)
    if not three.startswith(before_user + user) or not three.endswith(f"{_MARK['user']}2{tail}"):
        return None
    middle = three[len(before_user + user) : len(three) - len(f"{_MARK['user']}2{tail}")]
    user_to_assistant, assistant_to_user = _split(middle, f"{_MARK['assistant']}1")
    if user_to_assistant is None or not user_to_assistant.startswith(after_user):
        return None
    if not assistant_to_user.endswith(before_user):
        return None
    pieces = {
        "user": (before_user, after_user),
        "assistant": (
            user_to_assistant[len(after_user) :],
            assistant_to_user[: len(assistant_to_user) - len(before_user)],
        ),
        "generate": (generate, ""),
    }
    try:
        before_system, rest = _split(text(["system", "user"], True), f"{_MARK['system']}0")
        ending = f"{before_user}{_MARK['user']}1{tail}"
        if before_system is not None and rest.endswith(ending):
            pieces["system"] = (before_system, rest[: len(rest) - len(ending)])
    except Exception:  # a template that refuses a system turn: written as a user turn
        pass
    for roles in (["system", "user", "assistant", "user", "assistant", "user"], ["user", "assistant", "user"]):
        candidate = {**pieces, "system": pieces.get("system", pieces["user"])}
        expected = "".join(f"{candidate[r][0]}{_MARK[r]}{i}{candidate[r][1]}" for i, r in enumerate(roles))
        try:
            if text(roles, True) == expected + generate:
                return candidate
        except Exception:
            pass
        pieces.pop("system", None)  # folded into the first user turn, or refused: system turns as user turns
    return None


def _split(rendered: str, mark: str) -> tuple[str | None, str]:
    if rendered.count(mark) != 1:
        return None, ""
    before, after = rendered.split(mark)
    return before, after


def _literal(text: str) -> str:
    """Text as it stands in a Go template (`{{` is the only thing it would read otherwise)."""
    return text.replace("{{", '{{ "{{" }}')


def _go(pieces: dict[str, tuple[str, str]]) -> str:
    branches = []
    for role in _ROLES:
        before, after = pieces[role]
        keyword = "if" if not branches else "else if"
        branches.append(f'{{{{ {keyword} eq .Role "{role}" }}}}{_literal(before)}{{{{ .Content }}}}{_literal(after)}')
    return "{{- range .Messages }}" + "".join(branches) + "{{ end }}{{ end }}" + _literal(pieces["generate"][0])
