"""Language-model runs and model directories as the commands read them back to draw text from.

- :func:`language_model` and :func:`restore_parameters`: a run's experiment, and every parameter of its newest
  usable (or requested) step, an adapter run's base included (`nnx-generate`, `nnx-export`, the harness);
- :func:`load` and :func:`load_model_dir`: a `decoding.Decoder` and its tokenizer, from a run or from a Hugging
  Face model directory;
- :func:`encode_prompt`, :func:`stops`: a prompt's tokens (as a chat turn with `chat`) and where samples stop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import UserError


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


def run_chat_template(cfg: Any, tokenizer: Any) -> str | None:
    """The chat template a run trained with: its `data.chat_template` when set, else None (the tokenizer's)."""
    from nnx_cli.data import examples

    return examples.chat_template(cfg.data, tokenizer) if cfg.data.chat_template is not None else None


def chat_template_of(cfg: Any, tokenizer: Any) -> str | None:
    """The chat template a run's model chats with: the run's `data.chat_template`, else its tokenizer's (None when
    neither has one)."""
    return run_chat_template(cfg, tokenizer) or getattr(tokenizer, "chat_template", None)


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
