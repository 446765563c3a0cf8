"""What a harness evaluates: a run's checkpoint or a Hugging Face model directory, loaded onto the mesh.

A TARGET is what every command takes: a work dir, its `checkpoints/` dir or
one step dir (the newest usable step, `--step` or `--best`; a LoRA run's
adapters come with the base weights they adapt and are applied, not
merged), or a Hugging Face model directory or Hub id. Parameters are read
straight into the shardings of the target's mesh (`sharding.mesh`, by
default every device on the data axis)::

    target = load_target("runs/chat_lora")
    target.exp.moduledef, target.params, target.tokenizer, target.step, target.max_length
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

DEFAULT_MAX_LENGTH = 2048  # lm-eval's when a config.json names no context length
_CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")  # where lm-eval's hf model looks, in order


@dataclasses.dataclass
class Target:
    """A loaded model: its experiment (structure, mesh, rules), every parameter placed on the mesh, its tokenizer,
    the step (None for a model directory), the work dir (None for a model directory), the longest input it
    reads, the chat template it uses (None: none)."""

    name: str
    exp: Any
    params: Any
    tokenizer: Any
    step: int | None
    workdir: Path | None
    max_length: int
    chat_template: str | None


def load_target(
    target: str | Path, overrides: list[str] | None = None, *, step: int | None = None, best: bool = False,
    say: Any = None,
) -> Target:  # fmt: skip
    """Load `target` (see the module docstring); a UserError names what is wrong with it."""
    from nnx_cli import hf, runtime

    overrides = list(overrides or [])
    say = say or (lambda message: None)
    runtime.configure()
    if hf.is_model_dir(target):
        hf.check_no_step(target, step, best)
        return _model_dir(str(target), overrides)
    return _run(target, overrides, step, best, say)


def _model_dir(target: str, overrides: list[str]) -> Target:
    from nnx_cli import hf
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.experiment import setup

    cfg = hf.model_dir_config(target, overrides)
    exp = setup(cfg, data=None)
    params = exp.load_pretrained(exp.frozen_target())
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.pretrained)
    template = getattr(tokenizer, "chat_template", None)
    return Target(target, exp, params, tokenizer, None, None, max_length_of(exp), template)


def training_target(exp: Any, params: Any, workdir: Path | None, step: int) -> Target:
    """The model a training run is training, as a Target (its current parameters)."""
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.lm import chat_template_of

    tokenizer = load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained)
    template = chat_template_of(exp.cfg, tokenizer)
    return Target(str(workdir), exp, params, tokenizer, step, workdir, max_length_of(exp), template)


def _run(target: str | Path, overrides: list[str], step: int | None, best: bool, say: Any) -> Target:
    from nnx_cli import restore, sharding, steps
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.lm import chat_template_of, language_model
    from nnx_cli.workdir import open_run

    run = open_run(target, overrides, step, best=best)
    exp = language_model(run, "the harness evaluates", place=True)
    placed = sharding.with_shardings(exp.abstract, exp.shardings)

    def read(ckpt: Any, s: int) -> Any:
        exp.check_base(ckpt.manifest(s), ckpt.directory / str(s))  # adapters: the base weights they were made on
        return ckpt.restore_params(s, placed["params"])

    exp.hash_base()
    restored, params = restore.from_run(run, read, say)
    if steps.FROZEN in placed:  # adapters: their base parameters too
        params = params | exp.frozen_params(placed[steps.FROZEN])
    tokenizer = load_tokenizer(run.cfg.data.tokenizer, run.cfg.model.pretrained)
    template = chat_template_of(run.cfg, tokenizer)
    return Target(str(target), exp, params, tokenizer, restored, run.workdir, max_length_of(exp), template)


def max_length_of(exp: Any) -> int:
    """The longest input lm-eval's `hf` model would read from the same weights: for a model directory (or a run
    started from one) its config.json's `n_positions`, `max_position_embeddings` or `n_ctx`; for a run from
    scratch what its export's config.json says (the learned positions, or `data.seq_len` with rotary ones)."""
    if exp.pretrained is not None:
        config = json.loads((exp.pretrained.directory / "config.json").read_text())
        for key in _CONTEXT_KEYS:
            if isinstance(config.get(key), int):
                return int(config[key])
        return DEFAULT_MAX_LENGTH
    options = exp.cfg.model.options
    if options.get("positions", "learned") == "learned":
        return int(options.get("max_positions") or exp.cfg.data.seq_len)
    return int(exp.cfg.data.seq_len)
