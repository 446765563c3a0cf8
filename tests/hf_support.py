"""Hugging Face model directories for tests: the golden fixtures made by `transformers`, and stand-ins.

`FIXTURES / <name>` are real model directories written by `transformers` (tests/fixtures/make_hf_fixtures.py),
with `<name>.npz` goldens beside them. `write_model_dir` writes a small directory of our own for tests of the
plumbing and of broken inputs: a random `transformer_lm` saved through the family's tensor table (the inverse
of loading), a `config.json` and a byte-level BPE `tokenizer.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "vocab_size": 300,
    "activation_function": "gelu_new",
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def fixture(name: str) -> Path:
    return FIXTURES / name


def goldens(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / f"{name}.npz"))


def tokenizer_json(path: Path, vocab_size: int = 280, specials: tuple[str, ...] = ("<|endoftext|>",)) -> None:
    """A byte-level BPE tokenizer trained on a little English text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = "the quick brown fox jumps over the lazy dog; a king and a queen speak of love and war by night and day"
    tokenizer.train_from_iterator([text] * 20, trainer)
    tokenizer.save(str(path))


def write_model_dir(
    path: Path, config: dict[str, Any], *, seed: int = 0, shards: int = 1, dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """A model directory for `config` with random weights (biases and norms too); returns its tensors."""
    import jax
    import ml_dtypes
    from safetensors.numpy import save_file

    import nnx
    from nnx_cli.hf import families
    from nnx_cli.hf.weights import to_tensors
    from nnx_cli.models.transformer_lm import TransformerLM

    path.mkdir(parents=True, exist_ok=True)
    family = families.family_of(config, "config.json")
    options = family.options(families.Config(config, "config.json"))
    shape = {k: v for k, v in options.items() if k != "vocab_size"}
    abstract = jax.eval_shape(
        lambda: TransformerLM((16,), options["vocab_size"], **shape, ctx=nnx.context(0)).filter(nnx.Param)
    )
    rng = np.random.default_rng(seed)
    params = {
        p: (rng.normal(0, 0.08, v.value.shape) + (1.0 if p.endswith("scale") else 0.0)).astype(np.float32)
        for p, v in abstract.items()
    }
    tensors = to_tensors(params, family.tensors(options, []))
    if dtype != "float32":
        cast = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
        tensors = {k: v.astype(cast) for k, v in tensors.items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(path / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_json(path / "tokenizer.json")
    return tensors
