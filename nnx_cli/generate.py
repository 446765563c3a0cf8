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

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import typer

from nnx_cli.errors import UserError, report_errors, run_app

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)

# Samples written at each eval during training (`samples/<step>.txt`).
EVAL_SAMPLE_TOKENS = 200
EVAL_PROMPTS = 2


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
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the text."),
) -> None:
    """Continue a prompt with a trained language model."""
    from nnx_cli import hf, runtime
    from nnx_cli.workdir import open_run

    template = None
    if not prompt:
        raise UserError("--prompt is empty: give some text to continue")
    if num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {num_samples}")
    if system is not None and not chat:
        raise UserError("--system adds a system turn to a chat: pass --chat too")
    runtime.configure()
    if hf.is_model_dir(target):
        if step is not None:
            raise UserError(f"--step picks a checkpoint of a run; {str(target)!r} is a model directory")
        restored_step, decoder, tokenizer = load_model_dir(target, overrides or [])
    else:
        run = open_run(target, overrides or [], step)
        restored_step, decoder, tokenizer = load(run)
        template = run_chat_template(run.cfg, tokenizer) if chat else None
    prompt_ids = encode_prompt(tokenizer, prompt, chat, system, template)
    options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    drawn = _Timed(decoder.generate([prompt_ids] * num_samples, **stops(tokenizer, chat), **options))
    shown = "" if chat else prompt  # a chat shows the reply alone, not the template around the prompt
    stream = sys.stdout.isatty() and not as_json and num_samples == 1
    if stream:
        _stream(drawn, shown, tokenizer)
    drawn.finish()
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
        for i, text in enumerate(texts):
            print(("" if num_samples == 1 else f"--- sample {i}\n") + shown + text, flush=True)


def run_chat_template(cfg: Any, tokenizer: Any) -> str | None:
    """The chat template a run trained with: its `data.chat_template` when set, else None (the tokenizer's)."""
    from nnx_cli.data import examples

    return examples.chat_template(cfg.data, tokenizer) if cfg.data.chat_template is not None else None


def encode_prompt(
    tokenizer: Any, prompt: str, chat: bool, system: str | None, template: str | None = None
) -> list[int]:
    """The prompt's token ids: as the tokenizer encodes text, or with `chat` rendered by a chat template as a
    user turn (`template`: a run's `data.chat_template`; by default the tokenizer's)."""
    if chat:
        from nnx_cli.data import chat as chats

        template = template or getattr(tokenizer, "chat_template", None)
        if template is None:
            where = getattr(tokenizer, "directory", None)
            raise UserError(
                "--chat needs a chat template, and "
                + (f"model directory {str(where)!r} has none" if where else "this run's tokenizer has none")
                + " (chat_template.jinja, or chat_template in tokenizer_config.json); drop --chat to continue text"
            )
        messages = chats.prompt_messages(prompt, system)
        text = chats.render(
            template, messages, add_generation_prompt=True, special_tokens=chats.special_tokens(tokenizer)
        )
        ids = getattr(tokenizer, "encode_plain", tokenizer.encode)(text)
    else:
        ids = tokenizer.encode(prompt)
    if len(ids) == 0:
        raise UserError(f"--prompt {prompt!r} encodes to no tokens with the model's tokenizer")
    return [int(t) for t in ids]


def stops(tokenizer: Any, chat: bool = False) -> dict[str, Any]:
    """Where samples stop: a model directory's tokenizer at its end-of-sequence ids (and end of turn in a chat),
    as `transformers` does; others at the end-of-document token. Unlike `data.tokenizers.stop_ids` (sampling
    that must end: GRPO's, lm-eval's), a model directory that names no end-of-sequence id stops nowhere, as in
    `transformers`, and the end of a document is `Decoder.generate`'s own stop reason."""
    stop_ids = getattr(tokenizer, "chat_stop_ids" if chat else "stop_ids", None)
    if stop_ids is not None:
        return {"end_of_document": None, "stop_tokens": stop_ids}
    return {"end_of_document": tokenizer.eod_id}


def eval_sample_stops(data_format: str, tokenizer: Any) -> dict[str, Any]:
    """Where the samples written at each eval stop (:func:`stops`): a reply, for a run on examples (chats,
    completions, preference pairs), ends where its training targets did, at the end of the turn or the
    tokenizer's end-of-sequence token, even where the model directory's generation config does not list it; a
    continuation of documents at the end of a document."""
    return stops(tokenizer, chat=data_format != "text")


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


def load_model_dir(target: Path, overrides: list[str]) -> tuple[None, Any, Any]:
    """A model directory's (or Hub id's) weights read onto this process's first device, as a `decoding.Decoder`,
    and its tokenizer. The layers are read unrolled (decoding reads one layer's weights at a time), or stacked
    when their kernels are stored in 4 bits (dequantised one layer at a time: `TransformerLM.for_decoding`)."""
    import jax

    import nnx
    from nnx_cli import decoding, hf, steps
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.experiment import setup

    cfg = hf.model_dir_config(target, overrides)
    exp = setup(cfg, data=None, place=False)
    if not any(isinstance(v, nnx.QuantizedParam) for v in steps.parameters(exp.abstract).values()):
        cfg = hf.model_dir_config(target, overrides, scan_layers=False)
        exp = setup(cfg, data=None, place=False)
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    every = steps.parameters(exp.abstract)  # a quantised base's are frozen
    place = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), every)
    params = exp.load_pretrained(place)
    return None, decoding.Decoder(exp.moduledef, params), load_tokenizer(cfg.data.tokenizer, cfg.model.pretrained)


def load(run: Any) -> tuple[int, Any, Any]:
    """The run's newest usable (or requested) step, a `decoding.Decoder` over its parameters on this
    process's first device, and its tokenizer. A run that is not a language model is a UserError."""
    import jax

    from nnx_cli import decoding
    from nnx_cli.data.tokenizers import load_tokenizer

    exp = language_model(run, "nnx-generate samples from")
    step, params = restore_parameters(run, exp, jax.local_devices()[0])
    tokenizer = load_tokenizer(run.cfg.data.tokenizer, run.cfg.model.pretrained)
    return step, decoding.Decoder(exp.moduledef, params), tokenizer


def language_model(run: Any, what: str, place: bool = False) -> Any:
    """The run's experiment (no data; with `place`, its mesh and shardings); a run that is not a language model
    is a UserError saying `what` the command does with `transformer_lm` runs."""
    from nnx_cli.data.text import is_text
    from nnx_cli.experiment import setup

    if not is_text(run.cfg.data):
        raise UserError(
            f"{str(run.workdir)!r} holds a {run.cfg.model.name!r} model trained on images, not a language model; "
            f"{what} transformer_lm runs"
        )
    exp = setup(run.cfg, data=None, place=place)
    if not hasattr(exp.model_cls, "init_cache"):
        raise UserError(
            f"model {run.cfg.model.name!r} is not a language model with a key-value cache; {what} transformer_lm runs"
        )
    return exp


def restore_parameters(run: Any, exp: Any, device: Any, *, export: bool = False) -> tuple[int, Any]:
    """Every parameter of the run's newest usable (or requested) step on `device`: an adapter run's adapters
    with the base parameters they adapt (whose weights must be those they were trained on).

    `export`: the base as an export, which writes each parameter once, wants it: its float32 parameters in the
    16-bit type its files store them in when they all share one (nothing is lost), and, read from a model
    directory without 4-bit kernels, each a reader of its tensors (:meth:`.hf.Pretrained.lazy`) rather than
    an array: the export never holds the base model."""
    import jax

    from nnx_cli import restore, steps
    from nnx_cli.report import stderr_console

    here = jax.sharding.SingleDeviceSharding(device)
    place = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here), tree)  # noqa: E731
    console = stderr_console()

    def read(ckpt: Any, s: int) -> Any:
        exp.check_base(ckpt.manifest(s), ckpt.directory / str(s))  # adapters: the base weights they were made on
        return ckpt.restore_params(s, place(exp.abstract["params"]))

    exp.hash_base()
    step, params = restore.from_run(run, read, lambda m: console.print(m, highlight=False))
    if steps.FROZEN in exp.abstract:  # adapters: their base parameters too
        frozen = place(exp.abstract[steps.FROZEN])
        stored = exp.pretrained.stored_float if export and exp.pretrained is not None else None
        if stored is not None:
            frozen = jax.tree.map(lambda a: a.update(dtype=stored) if a.dtype == np.float32 else a, frozen)
        four_bit = any(path.endswith("/codes") for path, _ in frozen.items())  # an nnx.QuantizedKernel's
        if export and exp.pretrained is not None and not four_bit:
            return step, params | exp.pretrained.lazy(frozen)
        params = params | exp.frozen_params(frozen)
    return step, params


def _stream(drawn: Any, prompt: str, tokenizer: Any) -> None:
    """Print the prompt, then each token of the first sample as it is drawn."""
    from nnx_cli import decoding

    print(prompt, end="", flush=True)
    if hasattr(tokenizer, "to_bytes"):
        text = decoding.Utf8Decoder()
        for tokens in drawn:
            print(text.decode(tokens[:1]), end="", flush=True)
        print(text.flush(), flush=True)
        return
    shown = ""
    for _ in drawn:
        current = tokenizer.decode(drawn.samples[0])
        print(current[len(shown) :], end="", flush=True)
        shown = current
    print(flush=True)


def eval_prompts(exp: Any) -> list[list[int]]:
    """The prompts of the samples written at each eval: `train.sample_prompts`, encoded (a run on conversations,
    chats or conversational preference pairs, renders each as a user turn and the opening of the reply, as
    `nnx-generate --chat` does); by default the first tokens of the eval split and of its middle."""
    from nnx_cli.data import examples
    from nnx_cli.data.tokenizers import load_tokenizer

    if exp.cfg.train.sample_prompts:
        chat = examples.is_conversational(exp.cfg.data)
        tokenizer = load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained)
        template = run_chat_template(exp.cfg, tokenizer) if chat else None
        return [encode_prompt(tokenizer, p, chat, None, template) for p in exp.cfg.train.sample_prompts]
    if examples.is_examples(exp.cfg.data):  # the start of eval examples, up to where their first answer begins
        rows = exp.eval.stored()
        prompts = []
        for row in sorted({0, len(rows["tokens"]) // 2})[:EVAL_PROMPTS]:
            first = rows["segments"][row] == 1
            answer = np.flatnonzero(first & (rows["targets"][row] > 0))
            end = int(answer[0]) if len(answer) else int(first.sum())
            prompts.append([int(t) for t in rows["tokens"][row][: max(end, 1)]])
        return prompts
    stream = exp.eval.stored()["tokens"]
    length = max(1, min(32, exp.cfg.data.seq_len // 4))
    starts = [0, len(stream) // 2][:EVAL_PROMPTS]
    return [[int(t) for t in stream[s : s + length]] for s in starts]


def write_eval_samples(path: Path, prompts: list[list[int]], drawn: Any, tokenizer: Any) -> None:
    """`samples/<step>.txt`: each prompt and its continuation."""
    from nnx_cli.decoding import text_of

    blocks = []
    for i, (prompt, sample) in enumerate(zip(prompts, drawn.samples)):
        blocks.append(f"--- sample {i}\n{text_of(tokenizer, prompt)}{text_of(tokenizer, sample)}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(blocks))
    partial.replace(path)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
