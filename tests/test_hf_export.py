"""Weights out: nnx-export's model directories and PEFT adapters, against what transformers and peft wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_user_error, cli
from hf_support import fixture, goldens
from safetensors import safe_open

from nnx_cli import hf
from nnx_cli.config import load_config
from nnx_cli.experiment import setup
from nnx_cli.hf import export as exporting
from nnx_cli.hf.weights import Weights
from nnx_cli.train import _adapters_from

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]


def tensors(directory: Path, single: str = "model.safetensors") -> dict[str, np.ndarray]:
    """Every tensor of a directory's safetensors (one file or shards), as stored."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def relative_error(logits, golden) -> float:
    return float(np.abs(np.asarray(logits)[..., : golden.shape[-1]] - golden).max() / np.abs(golden).max())


@pytest.mark.parametrize("name", FAMILIES)
def test_an_imported_model_exports_to_the_tensors_and_config_transformers_wrote(tmp_path, name):
    exp = setup(hf.model_dir_config(fixture(name), []), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    files = exporting.export(exp, arrays, tmp_path / "out", adapter=False, dtype=None, tokenizer=tokenizer, say=print)
    theirs, ours = tensors(fixture(name)), tensors(tmp_path / "out")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and np.array_equal(ours[key], value), key  # bit for bit, as stored
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (fixture(name) / "config.json").read_text()
    )
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files)


def test_a_reimported_export_computes_the_transformers_logits(tmp_path):
    exp = setup(hf.model_dir_config(fixture("llama"), []), data=None)  # three shards in, one file out
    arrays = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture("llama")))
    exporting.export(exp, arrays, tmp_path / "out", adapter=False, dtype="float32", tokenizer=tokenizer, say=print)
    again = setup(hf.model_dir_config(tmp_path / "out", []), data=None)
    gold = goldens("llama")
    logits = again.moduledef.merge(again.load_pretrained()).logits(gold["input_ids"])
    assert relative_error(logits, gold["logits"]) < 1e-4


def test_shards_above_the_limit_come_with_an_index(tmp_path):
    exp = setup(hf.model_dir_config(fixture("mistral"), []), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    maps = exp.pretrained.maps
    files = exporting.write_safetensors(tmp_path, hf.weights.tensors_of(arrays, maps), "float32", shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files[:-1])
    assert Weights.open(tmp_path).files.keys() == tensors(fixture("mistral")).keys()


# LoRA: a PEFT adapter in, adapters and merged weights out
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def adapted():
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}",
                             "data.text_key=text", "model.lora={rank: 4, alpha: 8}"])  # fmt: skip
    exp = setup(cfg, data=None)
    adapters = _adapters_from(exp, fixture("llama_lora"))
    return exp, adapters, exp.load_pretrained()


def test_a_peft_adapter_imports_with_the_logits_peft_computes(adapted):
    exp, adapters, base = adapted
    gold = goldens("llama_lora")
    logits = exp.moduledef.merge(adapters, base, exp.abstract["rest"]).logits(gold["input_ids"])
    assert relative_error(logits, gold["logits"]) < 1e-4


def test_adapters_export_as_the_peft_files_they_came_from(adapted, tmp_path):
    exp, adapters, base = adapted
    arrays = {p: np.asarray(v.value) for p, v in (adapters | base).items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture("llama")))
    exporting.export(exp, arrays, tmp_path / "adapter", adapter=True, dtype=None, tokenizer=tokenizer, say=print)
    theirs, ours = tensors(fixture("llama_lora")), tensors(tmp_path / "adapter")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(config["target_modules"]) == sorted(json.loads((fixture("llama_lora.json")).read_text())["targets"])


def test_merged_adapters_export_the_weights_peft_merges(adapted, tmp_path):
    exp, adapters, base = adapted
    arrays = {p: np.asarray(v.value) for p, v in (adapters | base).items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture("llama")))
    exporting.export(exp, arrays, tmp_path / "merged", adapter=False, dtype=None, tokenizer=tokenizer, say=print)
    again = setup(hf.model_dir_config(tmp_path / "merged", []), data=None)
    gold = goldens("llama_lora")
    logits = again.moduledef.merge(again.load_pretrained()).logits(gold["input_ids"])
    assert relative_error(logits, gold["merged_logits"]) < 1e-4


def test_an_adapter_that_does_not_match_model_lora_names_the_key(tmp_path):
    from nnx_cli.errors import UserError

    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}",
                             "data.text_key=text", "model.lora={rank: 8, alpha: 8}"])  # fmt: skip
    with pytest.raises(UserError, match=r"adapter_config.json: r is 4, but model.lora.rank is 8"):
        _adapters_from(setup(cfg, data=None), fixture("llama_lora"))


# From scratch, through the command line
# --------------------------------------------------------------------------------------------------------------

RUNS = {"llama": "num_kv_heads: 2, positions: rope, norm: rmsnorm, mlp: swiglu, bias: false, tie_embeddings: false"}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog; héllo wörld ✓".split()
    (root / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 9)) for _ in range(200)))
    for name, options in RUNS.items():
        (root / f"{name}.yaml").write_text(
            f"model: {{name: transformer_lm, num_layers: 2, num_heads: 4, embed_dim: 32, dropout: 0.0, {options}}}\n"
            "data: {source: text.txt, text_key: text, seq_len: 32, eval_split: null}\n"
            "train: {batch_size: 8, steps: 2, eval_every: 100}\n"
        )
        result = cli("nnx-train", f"{name}.yaml", "--workdir", name, cwd=root, timeout=240)
        assert result.returncode == 0, result.stderr
    return root


def test_a_model_with_gpt2_options_exports_as_gpt2_with_the_same_logits(tmp_path):
    from nnx_cli.data.tokenizers import BytesTokenizer

    options = ["model.name=transformer_lm", "model.num_layers=2", "model.num_heads=4", "model.embed_dim=32",
               "model.dropout=0.0", "data.text_key=text", "data.seq_len=32"]  # fmt: skip
    exp = setup(load_config(None, options), data=None)
    params = exp.init_state()["params"]
    arrays = {p: np.asarray(v.value) for p, v in params.items()}
    exporting.export(exp, arrays, tmp_path / "gpt2", adapter=False, dtype=None, tokenizer=BytesTokenizer(), say=print)
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["vocab_size"] == 257
    assert "transformer.h.0.attn.c_attn.weight" in tensors(tmp_path / "gpt2")  # as save_pretrained names them
    ids = np.asarray([list(b"the quick brown fox")], np.int32)
    theirs = setup(hf.model_dir_config(tmp_path / "gpt2", []), data=None)
    reference = np.asarray(exp.moduledef.merge(params).logits(ids))[..., :257]
    assert relative_error(theirs.moduledef.merge(theirs.load_pretrained()).logits(ids), reference) < 1e-4


@pytest.mark.parametrize("name, architecture", [("llama", "LlamaForCausalLM")])
def test_a_run_from_scratch_exports_as_its_family_with_the_same_logits(project, name, architecture):
    result = cli("nnx-export", name, "--out", f"{name}-hf", cwd=project)
    assert result.returncode == 0, result.stderr
    out = project / f"{name}-hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and config.get("vocab_size") == 257  # no padding rows
    import jax

    from nnx_cli.generate import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    run = open_run(project / name)
    exp = language_model(run, "")
    _, params = restore_parameters(run, exp, jax.devices()[0])
    ids = np.asarray([list(b"the quick brown fox")], np.int32)
    theirs = setup(hf.model_dir_config(out, []), data=None)
    reference = np.asarray(exp.moduledef.merge(params).logits(ids))[..., :257]
    assert relative_error(theirs.moduledef.merge(theirs.load_pretrained()).logits(ids), reference) < 1e-4


def test_the_bytes_tokenizer_exports_as_an_equivalent_tokenizer_json(project):
    from tokenizers import Tokenizer

    out = project / "llama-hf"
    if not out.exists():
        assert cli("nnx-export", "llama", "--out", "llama-hf", cwd=project).returncode == 0
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    rng = np.random.default_rng(1)
    text = "".join(chr(c) for c in rng.integers(32, 0x2FFF, 300))
    assert tokenizer.encode(text, add_special_tokens=False).ids == list(text.encode("utf-8"))
    assert tokenizer.token_to_id("<|endoftext|>") == 256


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(positions="rope", norm="layernorm"), r"positions: 'rope' \(the family's is 'learned'\); the closest"),
        (dict(positions="learned", norm="rmsnorm"), r"norm: 'rmsnorm' \(the family's is 'layernorm'\)"),
        (dict(num_kv_heads=2), r"num_kv_heads: 2 \(GPT-2 has one key-value head per query head\)"),
        (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, qk_norm=True),
         r"model.qkv_bias and model.qk_norm together are in no Hugging Face family"),
    ],
    ids=["rope-layernorm", "learned-rmsnorm", "gpt2-gqa", "qwen2-and-3"],
)  # fmt: skip
def test_options_no_family_has_are_named(options, message):
    from nnx_cli.errors import UserError
    from nnx_cli.hf.families import architecture_of

    base = dict(positions="learned", norm="layernorm", mlp="gelu", bias=True, num_heads=4, embed_dim=32)
    with pytest.raises(UserError, match=message):
        architecture_of({**base, **options})


def test_a_non_empty_out_is_refused_and_left_as_it_was(project):
    (project / "taken").mkdir(exist_ok=True)
    (project / "taken" / "keep.txt").write_text("mine")
    assert_user_error(cli("nnx-export", "llama", "--out", "taken", cwd=project), "exists and is not empty")
    assert [p.name for p in (project / "taken").iterdir()] == ["keep.txt"]


def test_adapter_export_of_a_run_without_lora_and_bad_dtypes_are_user_errors(project):
    assert_user_error(cli("nnx-export", "llama", "--out", "a", "--adapter", cwd=project), "has none (no model.lora)")
    assert_user_error(cli("nnx-export", "llama", "--out", "b", "--dtype", "int8", cwd=project), "--dtype must be")
    assert not (project / "a").exists() and not (project / "b").exists()


def test_bfloat16_exports_store_bfloat16(project):
    result = cli("nnx-export", "llama", "--out", "llama-bf16", "--dtype", "bfloat16", cwd=project)
    assert result.returncode == 0, result.stderr
    with safe_open(str(project / "llama-bf16" / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
