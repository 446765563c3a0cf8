"""The `data` section: where examples come from, how they are read, tokenized and laid out."""

from __future__ import annotations

from dataclasses import dataclass

from nnx_cli.config.schema import positive, show
from nnx_cli.errors import UserError


@dataclass
class DataConfig:
    source: str = "sklearn:digits"  # Hub id, local dir/file, or sklearn:digits
    train_split: str = "train"
    eval_split: str | None = "test"
    image_key: str = "image"
    label_key: str | None = "label"
    binarize: float | None = None  # threshold on [0, 1] pixels; null keeps grey levels
    text_key: str | None = None  # the column of documents; setting it makes this a text dataset
    tokenizer: str = "bytes"  # bytes, pretrained (model.pretrained's; its default), a Hub id, or a tokenizer.json
    seq_len: int = 256  # tokens per training window (text)
    workers: int | None = None  # input-pipeline worker processes; null: the machine's cores, 0: none
    cache_dir: str | None = None  # decoded / tokenized caches; null: under the `datasets` cache
    on_device: bool | str = "auto"  # keep the training split on the devices: auto, true or false
    format: str = "text"  # text (documents in data.text_key) | chat | completion | preference | prompt
    messages_key: str = "messages"  # chat: the column of {role, content} message lists
    prompt_key: str = "prompt"  # completion, preference, prompt: the prompt ...
    completion_key: str = "completion"  # ... and what the model should learn to answer
    train_on_prompt: bool = False  # chat/completion: loss on every token, not only the answers
    max_len: int | None = None  # chat/completion: longer examples are cut (counted, said); null: seq_len + 1
    # (preference: each sequence, at most (seq_len + 1) // 2)
    packing: bool = True  # chat/completion: whole examples fill each row; false: one example per row
    chat_template: str | None = None  # chat: a Jinja file or text; null: the model directory's

    def check(self) -> None:
        positive("data.seq_len", self.seq_len)
        if self.format not in ("text", "chat", "completion", "preference", "prompt"):
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
