"""The `data` section: where examples come from, how they are read, tokenized and laid out."""

from __future__ import annotations

from dataclasses import dataclass

from nnx_cli.config.schema import positive, setting, show
from nnx_cli.errors import UserError

FORMATS = ("text", "chat", "completion", "preference", "prompt")
"""What a row of `data.source` is: documents, chats, prompt/completion pairs, preference pairs, prompts."""


@dataclass
class DataConfig:
    """Where examples come from, and how they are read, tokenized and laid out in rows."""

    source: str = setting(
        "sklearn:digits",
        "a Hub dataset id, a local directory or file, `sklearn:digits` (8x8 digits, offline), or `package.module:fn`",
    )
    train_split: str = setting("train", "the split trained on")
    eval_split: str | None = setting(
        "test",
        "the split evaluated; null: no evals. A text or examples source with one split holds out its last 10% as "
        "this one (an image source needs a split of its own)",
    )
    image_key: str = setting("image", "images: the column of images")
    label_key: str | None = setting("label", "images: the column of labels; null: none")
    binarize: float | None = setting(
        None, "images: threshold on pixels scaled to [0, 1]; null keeps grey levels", values="0 to 1"
    )
    text_key: str | None = setting(None, "the column of documents; setting it makes the data text")
    tokenizer: str = setting(
        "bytes",
        "`bytes` (UTF-8 bytes and an end-of-document token, offline), `pretrained` (`model.pretrained`'s, the "
        "default there), a Hugging Face tokenizer's Hub id, or a `tokenizer.json`",
    )
    seq_len: int = setting(256, "tokens per training window (text and examples)", values=">= 1")
    workers: int | None = setting(
        None,
        "worker processes decoding and reading batches; null: the machine's cores; 0: none; at most four a core",
        values=">= 0",
    )
    cache_dir: str | None = setting(
        None, "where decoded images, token streams and example rows are cached; null: `nnx/` under the datasets cache"
    )
    on_device: bool | str = setting(
        "auto",
        "keep the training split on the devices; auto: when it takes at most a quarter of device memory (1 GiB "
        "where a device reports none)",
        choices=("auto", True, False),
    )
    format: str = setting(
        "text",
        "what a row is: documents (in `text_key`), chats, prompt/completion pairs, preference pairs (dpo) or "
        "prompts (grpo)",
        choices=FORMATS,
    )
    messages_key: str = setting("messages", "chat: the column of `{role, content}` message lists")
    prompt_key: str = setting("prompt", "completion, preference, prompt: the column of the prompt")
    completion_key: str = setting("completion", "completion: the column of the answer the model learns to give")
    train_on_prompt: bool = setting(False, "chat, completion: the loss on every token, not only on the answers")
    max_len: int | None = setting(
        None,
        "chat, completion: longer examples are cut (counted, said once); null: `seq_len + 1`. preference: each "
        "sequence, at most `(seq_len + 1) // 2`",
        values=">= 2",
    )
    packing: bool = setting(
        True,
        "chat, completion, preference: whole examples share each row, attention never crossing them; false: one "
        "example per row",
    )
    chat_template: str | None = setting(None, "chat: a Jinja file or the template's text; null: the model directory's")

    def check(self) -> None:
        positive("data.seq_len", self.seq_len)
        if self.format not in FORMATS:
            raise UserError(
                "config key 'data.format' must be text, chat or completion (documents, or examples to fine-tune on), "
                "preference (pairs, for objective.name=dpo) or prompt (prompts, for objective.name=grpo); got "
                f"{show(self.format)}"
            )
        if self.max_len is not None and self.max_len < 2:
            raise UserError(
                f"config key 'data.max_len' must be at least 2 (a token and its successor), got {self.max_len}"
            )
        if self.workers is not None and self.workers < 0:
            raise UserError(
                f"config key 'data.workers' must be 0 (no worker processes) or more, or null, got {self.workers}"
            )
        if self.on_device not in ("auto", True, False):
            raise UserError(f"config key 'data.on_device' must be auto, true or false, got {show(self.on_device)}")
        if self.binarize is not None and not 0.0 <= self.binarize <= 1.0:
            raise UserError(f"config key 'data.binarize' must be a threshold in [0, 1] or null, got {self.binarize}")
