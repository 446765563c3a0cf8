"""Where a run's data comes from, and what the training loop reads.

`data.source` (a Hub id, a local file or directory, `sklearn:digits`, your
own function) is opened by :mod:`nnx_cli.data.sources`.
Images (:mod:`nnx_cli.data.images`) are decoded once into a uint8 cache,
text (:mod:`nnx_cli.data.text`: `data.text_key`, or plain-text files) is tokenized
once into a token stream, and fine-tuning examples
(:mod:`nnx_cli.data.examples`, `data.format: chat | completion | preference`)
into rows with loss targets, and prompts to sample from
(:mod:`nnx_cli.data.prompts`, `data.format: prompt`) into token ids; all are
memory-mapped by every later run
(:mod:`nnx_cli.data.cache`). The loop reads them through the interface in
:mod:`nnx_cli.data.base`, fed by :mod:`nnx_cli.data.pipeline`::

    train = train_split(cfg)      # a TrainSplit: epoch keys from (seed, epoch), stored rows, prepare
    evals = eval_split(cfg)       # an EvalSplit, read in order
"""

from __future__ import annotations

from pathlib import Path

from nnx_cli.config import Config
from nnx_cli.data.base import DataSpec, EvalSplit, TrainSplit
from nnx_cli.data.sources import DIGITS, PLAIN_TEXT

__all__ = ["DIGITS", "PLAIN_TEXT", "DataSpec", "EvalSplit", "TrainSplit", "eval_split", "known_spec",
           "spec_from_config", "train_split"]  # fmt: skip

# Shapes of well-known datasets, so `nnx-inspect` never has to read them.
_KNOWN = {
    "digits": ((8, 8, 1), 10),
    "mnist": ((28, 28, 1), 10),
    "fashion_mnist": ((28, 28, 1), 10),
    "kmnist": ((28, 28, 1), 10),
}


def known_spec(source: str) -> DataSpec | None:
    """The input shape of a well-known dataset from its name alone, else None.

    >>> known_spec("ylecun/mnist")
    DataSpec(input_shape=(28, 28, 1), num_classes=10)
    """
    name = "digits" if source == DIGITS else Path(source.rstrip("/")).name.lower().replace("-", "_")
    shape = _KNOWN.get(name)
    return DataSpec(*shape) if shape else None


def spec_from_config(cfg: Config) -> DataSpec | None:
    """The input spec without reading data: a text config's from its tokenizer and `data.seq_len`; else
    `model.input_shape` if set, or a known dataset's."""
    from nnx_cli.data import text

    if text.is_text(cfg.data):
        vocab_size = cfg.model.options.get("vocab_size") or cfg.model.num_classes
        return text.text_spec(cfg.data, vocab_size=vocab_size, pretrained=cfg.model.pretrained)
    known = known_spec(cfg.data.source)
    if cfg.model.input_shape is None:
        return known
    num_classes = cfg.model.num_classes if cfg.model.num_classes is not None else known.num_classes if known else None
    return DataSpec(tuple(cfg.model.input_shape), num_classes)


def train_split(cfg: Config) -> TrainSplit:
    """The training split of `cfg.data`, addressed by `(cfg.seed, epoch)`."""
    from nnx_cli.data import examples, images, prompts, text

    if cfg.data.format == prompts.PROMPT:
        return prompts.load_prompt_splits(cfg, ("train",)).train
    if examples.is_examples(cfg.data):
        return examples.load_example_splits(cfg.data, cfg.seed, ("train",), pretrained=cfg.model.pretrained).train
    if text.is_text(cfg.data):
        return text.load_text_splits(cfg.data, cfg.seed, splits=("train",), pretrained=cfg.model.pretrained).train
    return images.image_train_split(cfg.data, cfg.seed)


def eval_split(cfg: Config) -> EvalSplit:
    """The evaluation split of `cfg.data`, read in order."""
    from nnx_cli.data import examples, images, prompts, text

    if cfg.data.format == prompts.PROMPT:
        return prompts.load_prompt_splits(cfg, ("eval",)).eval
    if examples.is_examples(cfg.data):
        return examples.load_example_splits(cfg.data, cfg.seed, ("eval",), pretrained=cfg.model.pretrained).eval
    if text.is_text(cfg.data):
        return text.load_text_splits(cfg.data, cfg.seed, splits=("eval",), pretrained=cfg.model.pretrained).eval
    return images.image_eval_split(cfg.data)
