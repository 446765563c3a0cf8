"""`nnx-generate TARGET --prompt TEXT`: continue a prompt with a trained or published language model.

TARGET is a work dir, its `checkpoints/` dir or one step dir of a
`transformer_lm` run, or a Hugging Face model directory or Hub id. A run's
config gives the model and the tokenizer; only the parameters of its newest
usable (or `--step`) checkpoint are restored, onto whatever devices exist (a
model trained on 8 devices samples on 1). A model directory's weights are
read straight onto this process's first device. Tokens are drawn from a
key-value cache, one jitted prefill per prompt-length bucket and one jitted
decode step reused for every token, and appear as they are drawn when stdout
is a terminal. `--chat` wraps the prompt in the model's chat template as a
user turn (after a `--system` turn) and stops at the end of the turn.
`--json` prints one object: `{"step", "prompt", "samples", "tokens",
"truncated", "stop_reasons", "tokens_per_s"}`; `"tokens"` holds each
sample's generated ids, the token that ended it included (as `transformers`'
`generate` returns them).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from nnx_cli.errors import RunError, UserError, is_out_of_memory, out_of_memory_message, report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)


@app.command()
@report_errors
def generate(
    target: Path = typer.Argument(
        ...,
        metavar="TARGET",
        help="Work dir, its checkpoints/ dir, one step dir, or a Hugging Face model dir or Hub id.",
        show_default=False,
    ),
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Config overrides, e.g. data.tokenizer=...", show_default=False
    ),
    prompt: str = typer.Option(..., help="The text to continue (with --chat: the user's message).", show_default=False),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template as a user turn."),
    system: str | None = typer.Option(None, help="With --chat: a system turn before the prompt.", show_default=False),
    max_tokens: int = typer.Option(200, help="Tokens to draw at most per sample."),
    temperature: float = typer.Option(1.0, help="Softmax temperature; 0 is greedy."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: all)."),
    top_p: float = typer.Option(1.0, help="Keep the smallest set of tokens whose probability reaches p (1: all)."),
    seed: int = typer.Option(0, help="Sample i draws with keys from (seed, i): the same seed, the same text."),
    num_samples: int = typer.Option(1, help="Samples drawn in parallel, as one batch."),
    step: int | None = typer.Option(None, help="Checkpoint step (default: the newest usable one)."),
    best: bool = typer.Option(False, "--best", help="The best step kept by checkpoint.keep_best."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the text."),
) -> None:
    """Continue a prompt with a trained language model."""
    from nnx_cli import hf, runtime
    from nnx_cli.lm import encode_prompt, load, load_model_dir, run_chat_template, stops
    from nnx_cli.workdir import open_run

    template = None
    if not prompt:
        raise UserError("--prompt is empty: give some text to continue")
    if num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {num_samples}")
    if not 0 <= seed < 2**32:  # as the config's seed
        raise UserError(f"--seed must be 0 to 2**32 - 1, got {seed}")
    for flag, text in (("--prompt", prompt), ("--system", system)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:  # bytes of the command line that are not UTF-8 arrive as lone surrogates
            raise UserError(f"{flag} is not UTF-8 text (a byte at {e.start} is not); give it in UTF-8") from None
    for flag, value, right, wanted in (
        ("--max-tokens", max_tokens, max_tokens >= 1, "at least 1"),
        ("--temperature", temperature, 0 <= temperature < float("inf"), "a finite number >= 0 (0 is greedy)"),
        ("--top-k", top_k, top_k >= 0, ">= 0 (0 turns it off)"),
        ("--top-p", top_p, 0 < top_p <= 1, "in (0, 1] (1 turns it off)"),
    ):
        if not right:  # named as the flag given, before any model is loaded
            raise UserError(f"{flag} must be {wanted}, got {value}")
    if system is not None and not chat:
        raise UserError("--system adds a system turn to a chat: pass --chat too")
    runtime.configure()
    if hf.is_model_dir(target):
        hf.check_no_step(target, step, best)
        restored_step, decoder, tokenizer = load_model_dir(target, overrides or [])
    else:
        run = open_run(target, overrides or [], step, best=best)
        restored_step, decoder, tokenizer = load(run)
        template = run_chat_template(run.cfg, tokenizer) if chat else None
    prompt_ids = encode_prompt(tokenizer, prompt, chat, system, template)
    options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    shown = "" if chat else prompt  # a chat shows the reply alone, not the template around the prompt
    after = _continuation(tokenizer, [] if chat else prompt_ids)
    stream = sys.stdout.isatty() and not as_json and num_samples == 1
    try:
        drawn = _Timed(decoder.generate([prompt_ids] * num_samples, **stops(tokenizer, chat), **options))
        if stream:
            _stream(drawn, shown, after)
        drawn.finish()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        learned = decoder.context_limit is not None  # learned positions end: the cache holds the whole context
        positions = (
            f"the model's whole context ({decoder.context_limit})"
            if learned
            else (f"({len(prompt_ids)} prompt + {max_tokens} new)")
        )
        fewer = "--num-samples" if learned else "--max-tokens or --num-samples, or shorten the prompt"
        raise RunError(out_of_memory_message(e, (
            f"the key-value cache holds up to {num_samples} x {positions} positions in every layer: ask for fewer "
            f"with {fewer}"
        ))) from None  # fmt: skip
    cut = sum(drawn.truncated)
    if cut and not as_json:  # --json says it in "truncated" and "stop_reasons"
        which = "the sample" if num_samples == 1 else f"{cut} of {num_samples} samples"
        print(f"notice: {which} stopped at the model's context of {decoder.context_limit} tokens, before "
              f"--max-tokens {max_tokens}", file=sys.stderr, flush=True)  # fmt: skip
    from nnx_cli.decoding import text_of

    texts = [text_of(tokenizer, sample) for sample in drawn.samples]
    if as_json:
        speed = drawn.tokens_per_s()
        tokens = [s + ([t] if t is not None else []) for s, t in zip(drawn.samples, drawn.stopped_by)]
        print(json.dumps({
            "step": restored_step, "prompt": prompt, "samples": texts, "tokens": tokens,
            "truncated": any(drawn.truncated), "stop_reasons": drawn.stop_reasons, "tokens_per_s": round(speed, 1),
        }))  # fmt: skip
    elif not stream:
        for i, sample in enumerate(drawn.samples):
            print(("" if num_samples == 1 else f"--- sample {i}\n") + shown + after(sample), flush=True)


def _continuation(tokenizer: Any, prompt_ids: list[int]) -> Callable[[list[int]], str]:
    """The text a sample adds after the prompt `prompt_ids`, as a function of the sample: decoded with the prompt
    and cut after its text (decoded once), so that a tokenizer that drops a first piece's space (SentencePiece's
    Metaspace) keeps the one between them (decoded alone, "The river" + "car" printed "The rivercar"); alone for
    bytes, or where the prompt's text is not the start of the whole's."""
    from nnx_cli.decoding import text_of

    if not prompt_ids or hasattr(tokenizer, "to_bytes"):
        return functools.partial(text_of, tokenizer)
    head = tokenizer.decode(prompt_ids)

    def after(sample: list[int]) -> str:
        whole = tokenizer.decode(prompt_ids + sample)
        return whole[len(head) :] if whole.startswith(head) else text_of(tokenizer, sample)

    return after


class _Timed:
    """A `decoding.Generation` that times its decode steps: tokens/s after the first token (which includes the
    prefill and, on a first run, compiling)."""

    def __init__(self, drawn: Any):
        self.drawn = drawn
        self.first: float | None = None
        self.last = 0.0
        self.steps = 0

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        tokens = next(self.drawn)
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.steps += sum(t is not None for t in tokens)
        self.last = now
        return tokens

    def finish(self) -> _Timed:
        for _ in self:
            pass
        return self

    def tokens_per_s(self) -> float:
        seconds = self.last - (self.first or self.last)
        return round(self.steps / seconds, 1) if seconds > 0 else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drawn, name)


def _stream(drawn: Any, prompt: str, after: Any) -> None:
    """Print the prompt, then the first sample's text (`after(tokens)`) as its tokens are drawn. A character whose
    bytes are not all drawn yet decodes as U+FFFD and is held back until they are: printed at once, it stayed
    on the terminal when the next token completed it, and the text printed after it was cut at the wrong place."""
    print(prompt, end="", flush=True)
    shown = ""
    for _ in drawn:
        current = after(drawn.samples[0]).rstrip("\ufffd")
        if current.startswith(shown):
            print(current[len(shown) :], end="", flush=True)
            shown = current
    whole = after(drawn.samples[0])  # the bytes left incomplete at the end show as U+FFFD, as in --json
    print(whole[len(shown) :] if whole.startswith(shown) else "", flush=True)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
