"""`benchmarks/plain_lm.py` trains what `nnx-train configs/tiny_lm.yaml` trains: tokens, batches, model math, decay."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnx
from nnx_cli.config import DataConfig
from nnx_cli.data.pipeline import BatchKeys
from nnx_cli.data.text import load_text_splits
from nnx_cli.models.transformer_lm import TransformerLM

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN, BATCH = 8, 4
LINES = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer", "Adieu, adieu!"]


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look up the module's annotations
    spec.loader.exec_module(module)
    return module


plain_lm = load_benchmark("plain_lm")


def works(count: int, seed: int) -> list[str]:
    """`count` documents of a few hundred characters each, one with non-ASCII text."""
    rng = np.random.default_rng(seed)
    return [
        "\n".join(LINES[i] for i in rng.integers(0, len(LINES), 8)) + ("\nÆ café" if n == 1 else "")
        for n in range(count)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A dataset in the Hugging Face layout of `../shared/data/shakespeare`: title/text, train and validation."""
    root = tmp_path_factory.mktemp("corpus")
    for split, count in (("train", 12), ("validation", 3)):
        texts = works(count, seed=len(split))
        table = datasets.Dataset.from_dict({"title": [f"{split}-{i}" for i in range(count)], "text": texts})
        table.to_parquet(str(root / f"{split}-00000-of-00001.parquet"))
    return root


def nnx_splits(corpus: Path, cache: Path):
    cfg = DataConfig(
        source=str(corpus), text_key="text", seq_len=SEQ_LEN, eval_split="validation", cache_dir=str(cache), workers=0
    )
    return load_text_splits(cfg, seed=3)


def test_plain_lm_tokenizes_each_split_as_nnx_train_does(corpus, tmp_path):
    splits = nnx_splits(corpus, tmp_path / "cache")
    table = datasets.load_dataset(str(corpus))
    np.testing.assert_array_equal(plain_lm.tokenize(table["train"]["text"]), splits.train.tokens)
    np.testing.assert_array_equal(plain_lm.tokenize(table["validation"]["text"]), splits.eval.tokens)


def test_plain_lm_trains_on_the_batches_nnx_train_reads_across_epochs(corpus, tmp_path):
    train = nnx_splits(corpus, tmp_path / "cache").train
    keys = BatchKeys(train, BATCH)
    steps = 3 * keys.steps_per_epoch + 1  # three epochs and a step into the fourth
    plain = plain_lm.batch_starts(len(train.tokens), SEQ_LEN, seed=3, batch_size=BATCH, first=0, count=steps)
    np.testing.assert_array_equal(plain, keys.dispatch(0, steps))


def test_plain_lm_computes_the_logits_of_transformer_lm_for_the_same_weights():
    def build() -> tuple[nnx.State, nnx.ModuleDef]:
        model = TransformerLM((SEQ_LEN,), 257, num_layers=2, num_heads=4, embed_dim=32, dropout=0.0, ctx=nnx.context(0))
        return model.partition(nnx.Param)

    moduledef = jax.eval_shape(build)[1]
    params = jax.jit(lambda: build()[0])()  # one program: building eagerly compiles every initialiser on its own
    tokens = jax.random.randint(jax.random.key(1), (3, SEQ_LEN), 0, 257)
    expected, _ = jax.jit(lambda p, t: moduledef.apply(p).logits(t))(params, tokens)
    plain = plain_lm.from_transformer_lm((path, param.value) for path, param in params.items())
    got = jax.jit(plain_lm.logits)(plain, tokens)
    assert jax.tree.structure(plain) == jax.tree.structure(
        plain_lm.init_params(jax.random.key(0), layers=2, heads=4, width=32, seq_len=SEQ_LEN)
    )
    np.testing.assert_allclose(got[..., :257], expected[..., :257], atol=1e-5)
    assert jnp.all(got[..., 257:] == expected[..., 257:])  # the padded ids masked alike


def test_plain_lm_initialises_like_transformer_lm():
    params = plain_lm.init_params(jax.random.key(0), layers=2, heads=4, width=128, seq_len=64)
    blocks = params["blocks"]
    assert float(jnp.std(params["embedding"])) == pytest.approx(0.02, rel=0.05)
    assert float(jnp.std(blocks["fc"]["kernel"])) == pytest.approx(0.02, rel=0.05)
    assert float(jnp.std(blocks["proj"]["kernel"])) == pytest.approx(0.02 / 2, rel=0.05)  # 1/sqrt(2 * 2 layers)
    assert float(jnp.std(blocks["out"]["kernel"])) == pytest.approx(0.02 / 2, rel=0.05)
    assert all(not jnp.any(b["bias"]) for b in blocks.values())


def test_plain_lm_decays_kernels_and_embeddings_but_not_biases_or_norms():
    mask = plain_lm.decay_mask(plain_lm.init_params(jax.random.key(0), layers=2, heads=4, width=32, seq_len=8))
    decayed = {jax.tree_util.keystr(path) for path, on in jax.tree_util.tree_leaves_with_path(mask) if on}
    assert decayed == {
        "['embedding']",
        "['position']",
        *(f"['blocks']['{n}']['kernel']" for n in ("query", "key", "value", "out", "fc", "proj")),
    }


def test_plain_lm_trains_and_prints_its_figures_as_one_json_line(corpus, tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "plain_lm.py"), "--source", str(corpus)]
    command += [
        "--steps",
        "4",
        "--steps-per-call",
        "2",
        "--seq-len",
        "16",
        "--width",
        "32",
        "--eval-batches",
        "2",
        "--warmup-steps",
        "2",
    ]
    result = subprocess.run(
        [*command, "--batch-size", "4", "--cache", str(tmp_path / "jax")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["steps"] == 4
    assert 0 < figures["val_loss"] < 2 * np.log(257)  # a cross-entropy over 257 ids, near log(257) this early
    assert figures["data_seconds"] + figures["compile_seconds"] + figures["train_seconds"] <= figures["seconds"]


def test_the_lm_benchmark_starts_the_plain_script_from_nnx_trains_parameters(corpus, tmp_path):
    lm = load_benchmark("lm")
    path = lm.write_initial_params(corpus, tmp_path / "init.npz")
    own = plain_lm.init_params(jax.random.key(0), layers=2, heads=4, width=128, seq_len=64)
    given = plain_lm.load_params(str(path), own)
    with np.load(path) as stored:
        np.testing.assert_array_equal(given["blocks"]["query"]["kernel"], stored["blocks/query/kernel"])
        assert len(stored.files) == len(jax.tree.leaves(own))
    assert not np.array_equal(given["embedding"], own["embedding"])  # nnx-train's draw, not the script's
    with pytest.raises(SystemExit, match="no blocks/fc/kernel of shape"):
        plain_lm.load_params(str(path), dict(own, blocks=dict(own["blocks"], fc={"kernel": jnp.zeros((2, 3))})))
