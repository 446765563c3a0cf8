"""Weights out: nnx-export's model directories and PEFT adapters, against what transformers and peft wrote."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_user_error, cli
from hf_support import fixture, goldens
from safetensors import safe_open

from nnx_cli import hf
from nnx_cli.config import load_config
from nnx_cli.errors import UserError
from nnx_cli.experiment import setup
from nnx_cli.hf import export as exporting
from nnx_cli.hf import peft
from nnx_cli.hf.tokenizer import PretrainedTokenizer
from nnx_cli.hf.weights import Weights

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe", "olmoe"]
WINDOWED = ["gemma2", "gemma3", "phi3", "mistral_window", "qwen2_window"]


def tensors(directory: Path, single: str = "model.safetensors") -> dict[str, np.ndarray]:
    """Every tensor of a directory's safetensors (one file or shards), as stored."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def relative_error(logits, golden) -> float:
    return float(np.abs(np.asarray(logits)[..., : golden.shape[-1]] - golden).max() / np.abs(golden).max())


@pytest.mark.parametrize("name", FAMILIES + WINDOWED)
def test_an_imported_model_exports_to_the_tensors_and_config_transformers_wrote(tmp_path, name):
    exp = setup(hf.model_dir_config(fixture(name), []), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    files = exporting.export(exp, arrays, tmp_path / "out", adapter=False, dtype=None, tokenizer=tokenizer)
    theirs, ours = tensors(fixture(name)), tensors(tmp_path / "out")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and np.array_equal(ours[key], value), key  # bit for bit, as stored
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (fixture(name) / "config.json").read_text()
    )
    copied = {f.name for f in fixture(name).iterdir() if not f.name.startswith("model")}
    assert copied <= set(files) and {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= copied
    for file in copied:
        assert (tmp_path / "out" / file).read_bytes() == (fixture(name) / file).read_bytes(), file


@pytest.mark.parametrize("name", [*FAMILIES, "gemma2", "gemma3", "phi3"])
def test_a_reimported_export_computes_the_transformers_logits(tmp_path, name):
    exp = setup(hf.model_dir_config(fixture(name), []), data=None)  # llama: three shards in, one file out
    arrays = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    exporting.export(exp, arrays, tmp_path / "out", adapter=False, dtype=None, tokenizer=tokenizer)
    again = setup(hf.model_dir_config(tmp_path / "out", []), data=None)
    gold = goldens(name)
    logits = again.moduledef.merge(again.load_pretrained()).logits(gold["input_ids"])
    assert relative_error(logits, gold["logits"]) < 1e-4


def test_safetensors_are_written_byte_for_byte_as_safetensors_writes_them(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {"b.weight": rng.normal(size=(3, 5)), "a.bias": rng.normal(size=(7,)), "c": rng.normal(size=(2, 2, 3))}
    shapes = {name: arrays[name].shape for name in sorted(arrays)}
    for dtype, cast in [("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)]:
        save_file({k: v.astype(cast) for k, v in arrays.items()}, str(tmp_path / "theirs"), metadata={"format": "pt"})
        fortran = ((name, np.asfortranarray(arrays[name])) for name in shapes)  # not C-contiguous: written in C order
        assert exporting.write_safetensors(tmp_path, shapes, fortran, dtype) == ["model.safetensors"]
        assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "theirs").read_bytes(), dtype


def test_shards_above_the_limit_come_with_an_index(tmp_path):
    exp = setup(hf.model_dir_config(fixture("mistral"), []), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    maps, layers = exp.pretrained.maps, exp.pretrained.options["num_layers"]
    files = exporting.write_safetensors(tmp_path, hf.families.layout(maps, layers), hf.weights.tensors_of(arrays, maps),
                                        "float32", shard_bytes=20_000)  # fmt: skip
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files[:-1])
    assert files[0] == f"model-00001-of-{len(files) - 1:05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors(fixture("mistral")).values())
    assert Weights.open(tmp_path).files.keys() == tensors(fixture("mistral")).keys()
    for name, value in tensors(tmp_path).items():
        np.testing.assert_array_equal(value, tensors(fixture("mistral"))[name])


# LoRA: a PEFT adapter in, adapters and merged weights out
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def adapted():
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}",
                             "data.text_key=text", "model.lora={rank: 4, alpha: 8}"])  # fmt: skip
    exp = setup(cfg, data=None)
    adapters = peft.load(exp, fixture("llama_lora"))
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
    files = exporting.export(exp, arrays, tmp_path / "adapter", adapter=True, dtype=None, tokenizer=tokenizer)
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    theirs, ours = tensors(fixture("llama_lora")), tensors(tmp_path / "adapter")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    described = (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"])
    assert described == ("LORA", "CAUSAL_LM", 4, 8.0)
    assert config["base_model_name_or_path"] == exp.cfg.model.pretrained and config["fan_in_fan_out"] is False
    assert sorted(config["target_modules"]) == sorted(json.loads((fixture("llama_lora.json")).read_text())["targets"])


def test_an_exported_adapter_imports_to_the_same_adapters(adapted, tmp_path):
    exp, adapters, base = adapted
    arrays = {p: np.asarray(v.value) for p, v in (adapters | base).items()}
    exporting.export(exp, arrays, tmp_path / "adapter", adapter=True, dtype=None, tokenizer=None)
    again = peft.load(exp, tmp_path / "adapter")
    assert again.keys() == adapters.keys()
    for path in adapters:
        np.testing.assert_array_equal(np.asarray(again[path].value), np.asarray(adapters[path].value), err_msg=path)


def test_merged_adapters_export_the_weights_peft_merges(adapted, tmp_path):
    exp, adapters, base = adapted
    arrays = {p: np.asarray(v.value) for p, v in (adapters | base).items()}
    tokenizer = hf.pretrained_tokenizer(str(fixture("llama")))
    exporting.export(exp, arrays, tmp_path / "merged", adapter=False, dtype=None, tokenizer=tokenizer)
    again = setup(hf.model_dir_config(tmp_path / "merged", []), data=None)
    gold = goldens("llama_lora")
    logits = again.moduledef.merge(again.load_pretrained()).logits(gold["input_ids"])
    assert relative_error(logits, gold["merged_logits"]) < 1e-4


def test_an_adapter_merged_into_a_16_bit_base_keeps_an_update_finer_than_the_base_holds():
    import ml_dtypes

    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(2, 64, 32)).astype(ml_dtypes.bfloat16)  # stacked layers, as a base read as stored
    a, b = rng.normal(size=(2, 64, 4)).astype(np.float32) * 1e-4, rng.normal(size=(2, 4, 32)).astype(np.float32)
    params = {"layers/scan_module/mlp/up/kernel": kernel, "layers/scan_module/mlp/up/lora/a": a,
              "layers/scan_module/mlp/up/lora/b": b}  # fmt: skip
    merged = np.asarray(exporting.merged(params, scale=2.0)["layers/scan_module/mlp/up/kernel"])
    assert merged.dtype == np.float32
    expected = kernel.astype(np.float32) + np.einsum("lir,lro->lio", a, b) * 2
    np.testing.assert_allclose(merged, expected, rtol=1e-6, atol=1e-9)
    assert (merged.astype(ml_dtypes.bfloat16) == kernel).mean() > 0.5  # rounded back, most of the update is gone


@pytest.mark.parametrize("name", ["llama", "gpt2", "phi3", "mixtral", "qwen3_moe", "gemma2"])
def test_a_base_read_lazily_with_merged_adapters_gives_the_tensors_of_the_base_loaded_whole(name):
    from nnx_cli.hf.weights import lazy, tensors_of

    exp = setup(hf.model_dir_config(fixture(name), []), data=None)
    abstract = exp.frozen_target()
    eager = {path: np.asarray(v.value) for path, v in exp.load_pretrained(abstract).items()}
    readers = lazy(exp.pretrained.weights, exp.pretrained.maps, {path: v.value for path, v in abstract.items()})
    rng = np.random.default_rng(0)
    adapters = {}  # an adapter on every kernel, as merged() finds them: a [in..., rank], b [rank, out...]
    for path, value in eager.items():
        m = next(m for m in exp.pretrained.maps if path.endswith(m.path))
        if path.endswith("/kernel") and ("/moe/" in f"/{path}") == (m.experts > 0):  # a router takes none
            lead, split = int(path.startswith("layers/scan_module/")) + int(m.experts > 0), m.split
            shape = value.shape[lead:]
            adapters[path[: -len("kernel")] + "lora/a"] = rng.normal(size=(*value.shape[:lead], *shape[:split], 2))
            adapters[path[: -len("kernel")] + "lora/b"] = rng.normal(size=(*value.shape[:lead], 2, *shape[split:]))
    assert adapters
    for plain, read in ((eager, readers), (exporting.merged(eager | adapters, 0.5),
                                           exporting.merged(readers | adapters, 0.5))):  # fmt: skip
        expected = dict(tensors_of(plain, exp.pretrained.maps))
        got = dict(tensors_of(read, exp.pretrained.maps))
        assert got.keys() == expected.keys()
        for tensor in expected:
            np.testing.assert_allclose(got[tensor], expected[tensor], rtol=1e-6, atol=1e-6, err_msg=tensor)


@pytest.mark.parametrize(
    "lora, message",
    [
        ("{rank: 8, alpha: 8}", r"adapter_config.json: r is 4, but model.lora.rank is 8"),
        ("{rank: 4, alpha: 16}", r"adapter_config.json: lora_alpha is 8, but model.lora.alpha is 16.0"),
        ("{rank: 4, alpha: 8, targets: [q, v]}", r"adapter_config.json: target_modules is \['q', 'k', 'v', 'o'"),
    ],
    ids=["rank", "alpha", "targets"],
)
def test_an_adapter_that_does_not_match_model_lora_names_the_key(lora, message):
    from nnx_cli.errors import UserError

    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}",
                             "data.text_key=text", f"model.lora={lora}"])  # fmt: skip
    with pytest.raises(UserError, match=message):
        peft.load(setup(cfg, data=None), fixture("llama_lora"))


def test_an_adapter_with_per_module_ranks_or_alphas_is_refused(tmp_path):
    from nnx_cli.errors import UserError

    shutil.copytree(fixture("llama_lora"), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": {"q_proj": 2}}))
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}",
                             "data.text_key=text", "model.lora={rank: 4, alpha: 8}"])  # fmt: skip
    with pytest.raises(UserError, match=r"alpha_pattern gives some modules another lora_alpha \({'q_proj': 2}\)"):
        peft.load(setup(cfg, data=None), tmp_path / "adapter")


def test_gpt2_adapters_on_q_k_v_export_as_one_exact_block_adapter_on_c_attn(tmp_path):
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('gpt2')}", "data.text_key=text",
                             "data.seq_len=64", "model.lora={rank: 2, alpha: 3, targets: [q, v, o, up]}"])  # fmt: skip
    exp = setup(cfg, data=None)
    rng = np.random.default_rng(0)
    adapters = {p: rng.normal(size=v.value.shape).astype(np.float32) for p, v in exp.abstract["params"].items()}
    base = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    exporting.export(exp, adapters | base, tmp_path / "adapter", adapter=True, dtype=None, tokenizer=None)
    exporting.export(exp, adapters | base, tmp_path / "merged", adapter=False, dtype=None, tokenizer=None)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["c_attn", "attn.c_proj", "mlp.c_fc"] and config["fan_in_fan_out"] is True
    assert (config["r"], config["rank_pattern"], config["alpha_pattern"]) == (2, {"c_attn": 4}, {"c_attn": 6.0})
    ours, merged, stored = tensors(tmp_path / "adapter"), tensors(tmp_path / "merged"), tensors(fixture("gpt2"))
    assert len(ours) == 2 * 3 * 2  # layers x modules x (A, B)
    for i in range(2):
        a = {t: adapters[f"layers/scan_module/attention/{t}/lora/a"][i] for t in ("query", "value")}
        b = {t: adapters[f"layers/scan_module/attention/{t}/lora/b"][i].reshape(2, -1) for t in ("query", "value")}
        zeros = np.zeros((32, 32), np.float32)
        expected = np.concatenate([a["query"] @ b["query"], zeros, a["value"] @ b["value"]], axis=1) * 1.5
        name = f"base_model.model.transformer.h.{i}.attn.c_attn."
        # peft's update, as Conv1D's [in, out]
        update = (ours[name + "lora_B.weight"] @ ours[name + "lora_A.weight"]).T * 6.0 / 4
        np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-6)
        weight = f"transformer.h.{i}.attn.c_attn.weight"
        np.testing.assert_allclose(merged[weight] - stored[weight], expected, rtol=1e-4, atol=1e-5)


def test_phi3_adapters_export_as_exact_block_adapters_on_its_fused_projections(tmp_path):
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('phi3')}", "data.text_key=text",
                             "model.lora={rank: 2, alpha: 3, targets: [qkv_proj, up, down_proj]}"])  # fmt: skip
    exp = setup(cfg, data=None)
    assert exp.cfg.model.options["lora"]["targets"] == ["qkv_proj", "up", "down_proj"]  # Phi's names and ours
    rng = np.random.default_rng(0)
    adapters = {p: rng.normal(size=v.value.shape).astype(np.float32) for p, v in exp.abstract["params"].items()}
    base = {p: np.asarray(v.value) for p, v in exp.load_pretrained().items()}
    exporting.export(exp, adapters | base, tmp_path / "adapter", adapter=True, dtype=None, tokenizer=None)
    exporting.export(exp, adapters | base, tmp_path / "merged", adapter=False, dtype="float32", tokenizer=None)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["qkv_proj", "gate_up_proj", "down_proj"]
    patterns = {"qkv_proj": 6}, {"qkv_proj": 9.0}  # q, k and v in one module of rank 6 and alpha 9: alpha / r kept
    assert (config["r"], config["rank_pattern"], config["alpha_pattern"]) == (2, *patterns)
    ours, merged, stored = tensors(tmp_path / "adapter"), tensors(tmp_path / "merged"), tensors(fixture("phi3"))
    for i in range(2):
        layer = f"model.layers.{i}."
        a = {t: adapters[f"layers/scan_module/{t}/lora/a"][i].reshape(32, 2) for t in
             ("attention/query", "attention/key", "attention/value", "mlp/fc")}  # fmt: skip
        b = {t: adapters[f"layers/scan_module/{t}/lora/b"][i].reshape(2, -1) for t in a}
        delta = {t: (a[t] @ b[t]).T * 1.5 for t in a}  # [out, in], as PyTorch stores it
        qkv = np.concatenate([delta["attention/query"], delta["attention/key"], delta["attention/value"]])
        gate_up = np.concatenate([np.zeros_like(delta["mlp/fc"]), delta["mlp/fc"]])  # gate first, not adapted
        for module, expected, scale in (("self_attn.qkv_proj", qkv, 9.0 / 6), ("mlp.gate_up_proj", gate_up, 1.5)):
            name = f"base_model.model.{layer}{module}."
            update = ours[name + "lora_B.weight"] @ ours[name + "lora_A.weight"] * scale  # peft's update
            np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-6)
            weight = layer + module + ".weight"
            np.testing.assert_allclose(merged[weight] - stored[weight].astype(np.float32), expected, atol=1e-5)


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
    exporting.export(exp, arrays, tmp_path / "gpt2", adapter=False, dtype=None, tokenizer=BytesTokenizer())
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["vocab_size"] == 257
    assert "transformer.h.0.attn.c_attn.weight" in tensors(tmp_path / "gpt2")  # as save_pretrained names them
    ids = np.asarray([list(b"the quick brown fox")], np.int32)
    theirs = setup(hf.model_dir_config(tmp_path / "gpt2", []), data=None)
    reference = np.asarray(exp.moduledef.merge(params).logits(ids))[..., :257]
    assert relative_error(theirs.moduledef.merge(theirs.load_pretrained()).logits(ids), reference) < 1e-4


def test_a_mixture_of_experts_from_scratch_exports_as_mixtral_with_the_same_logits(tmp_path):
    from nnx_cli.data.tokenizers import BytesTokenizer

    options = ["model.name=transformer_lm", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.embed_dim=32", "model.positions=rope", "model.norm=rmsnorm", "model.mlp=swiglu",
               "model.bias=false", "model.moe={num_experts: 4, top_k: 2, mlp_dim: 24}", "model.dropout=0.0",
               "data.text_key=text", "data.seq_len=32"]  # fmt: skip
    exp = setup(load_config(None, options), data=None)
    params = exp.init_state()["params"]
    arrays = {p: np.asarray(v.value) for p, v in params.items()}
    exporting.export(exp, arrays, tmp_path / "mixtral", adapter=False, dtype=None, tokenizer=BytesTokenizer())
    config = json.loads((tmp_path / "mixtral" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in tensors(tmp_path / "mixtral")
    ids = np.asarray([list(b"the quick brown fox")], np.int32)
    theirs = setup(hf.model_dir_config(tmp_path / "mixtral", []), data=None)
    reference = np.asarray(exp.moduledef.merge(params).logits(ids))[..., :257]
    assert relative_error(theirs.moduledef.merge(theirs.load_pretrained()).logits(ids), reference) < 1e-4


@pytest.mark.parametrize("name, architecture", [("llama", "LlamaForCausalLM")])
def test_a_run_from_scratch_exports_as_its_family_with_the_same_logits(project, name, architecture):
    result = cli("nnx-export", name, "--out", f"{name}-hf", cwd=project)
    assert result.returncode == 0, result.stderr
    out = project / f"{name}-hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture] and config.get("vocab_size") == 257  # no padding rows
    keys = ("num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "dtype")
    assert [config[k] for k in keys] == [2, 32, False, 256, "float32"]  # seq_len positions, end of document
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 256}
    import jax

    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    run = open_run(project / name)
    exp = language_model(run, "")
    _, params = restore_parameters(run, exp, jax.devices()[0])
    ids = np.asarray([list(b"the quick brown fox")], np.int32)
    theirs = setup(hf.model_dir_config(out, []), data=None)
    reference = np.asarray(exp.moduledef.merge(params).logits(ids))[..., :257]
    assert relative_error(theirs.moduledef.merge(theirs.load_pretrained()).logits(ids), reference) < 1e-4


@pytest.mark.parametrize(
    "options, architecture",
    [
        (dict(qkv_bias=True, rope_theta=1e6, tie_embeddings=True), "Qwen2ForCausalLM"),
        (dict(qk_norm=True, head_dim=16, norm_eps=1e-6), "Qwen3ForCausalLM"),
        (dict(rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=16)), "LlamaForCausalLM"),
        (dict(sliding_window=8), "MistralForCausalLM"),
        (dict(qkv_bias=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
         "Qwen2ForCausalLM"),
        (dict(moe=dict(num_experts=4, top_k=2, mlp_dim=48, normalize=True, dense_layers=[]), mlp_dim=48,
              router_aux_loss_coef=0.02), "MixtralForCausalLM"),  # intermediate_size: one width for all
        (dict(qk_norm=True, head_dim=16, router_aux_loss_coef=0.001,
              moe=dict(num_experts=8, top_k=2, mlp_dim=24, normalize=False, dense_layers=[0])), "Qwen3MoeForCausalLM"),
        (dict(qk_norm=True, qk_norm_scope="projection", router_aux_loss_coef=0.01, mlp_dim=24,
              moe=dict(num_experts=8, top_k=2, mlp_dim=24, normalize=False, dense_layers=[])), "OlmoeForCausalLM"),
    ],
    ids=["qwen2", "qwen3", "llama3-rope", "mistral-window", "qwen2-window", "mixtral", "qwen3-moe", "olmoe"],
)  # fmt: skip
def test_a_config_json_written_from_options_reads_back_as_those_options(options, architecture):
    from nnx_cli.hf import families

    llama = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, num_layers=2, num_heads=4, num_kv_heads=2,
                 embed_dim=32, mlp_dim=64, tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)  # fmt: skip
    config = families.config_json({**llama, **options}, vocab_size=300, context=64, bos=None, eos=256, dtype="float32")
    assert config["architectures"] == [architecture]
    read = families.options_of(json.loads(json.dumps(config)), "config.json")
    for key, value in {**llama, **options}.items():
        assert read[key] == value, key


@pytest.mark.parametrize(
    "options, architecture, window",
    [
        (dict(sliding_window=8, layer_types=["sliding_attention"] * 2), "MistralForCausalLM", 8),
        (dict(sliding_window=8, layer_types=["full_attention"] * 2), "LlamaForCausalLM", None),
        (dict(qkv_bias=True, sliding_window=8, layer_types=["full_attention"] * 2), "Qwen2ForCausalLM", None),
        (dict(qk_norm=True, sliding_window=8, layer_types=["sliding_attention"] * 2), "Qwen3ForCausalLM", 8),
        (dict(query_scale=8.0, rotary_dim=8), "LlamaForCausalLM", None),  # head_dim 32 / 4: the defaults
    ],
    ids=["every-layer-slides", "no-layer-slides", "qwen2-no-layer-slides", "qwen3-every-layer-slides", "defaults"],
)  # fmt: skip
def test_options_that_compute_as_a_family_does_export_as_it(options, architecture, window):
    """A window that every layer of layer_types takes, or none does, and a query scale or rotary width of the
    head's size are how the model computes anyway: no longer refused as mixed layers or as Gemma's options (or a
    traceback, for a window no Qwen layer took)."""
    from nnx_cli.hf import families
    from nnx_cli.models.transformer.options import architecture as model_architecture

    llama = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, num_layers=2, num_heads=4, num_kv_heads=2,
                 embed_dim=32, mlp_dim=64, tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)  # fmt: skip
    config = families.config_json({**llama, **options}, vocab_size=300, context=64, bos=None, eos=256, dtype="float32")
    assert config["architectures"] == [architecture]
    read = families.options_of(json.loads(json.dumps(config)), "config.json")
    assert read.get("sliding_window") == window and read.get("layer_types") is None
    assert read.get("query_scale") is None and read.get("rotary_dim") is None
    if "query_scale" not in options:  # the model's own reading of both option sets is the same
        common = dict(dropout=0.0, attention_dropout=0.0, remat="none", scan_layers=True, dtype="float32",
                      qkv_bias=False, qk_norm=False, head_dim=None, rope_scaling=None)  # fmt: skip
        model = {k: v for k, v in llama.items() if k != "tie_embeddings"}
        assert model_architecture(**{**common, **model, **options}) == model_architecture(
            **{**common, **model, **options, "sliding_window": window, "layer_types": None}
        )


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
    # the end token's text inside a text is its bytes, as the run read it: tokenizer_config.json says so to
    # transformers (split_special_tokens), and the directory read back as a pretrained tokenizer does the same
    assert json.loads((out / "tokenizer_config.json").read_text())["split_special_tokens"] is True
    text = f"a <|endoftext|> b{text}"
    assert PretrainedTokenizer(out).encode(text).tolist() == list(text.encode("utf-8"))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(positions="rope", norm="layernorm"), r"positions: 'rope' \(the family's is 'learned'\); the closest"),
        (dict(positions="learned", norm="rmsnorm"), r"norm: 'rmsnorm' \(the family's is 'layernorm'\)"),
        (dict(num_kv_heads=2), r"num_kv_heads: 2 \(GPT-2 has one key-value head per query head\)"),
        (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, qk_norm=True),
         r"model.qkv_bias and model.qk_norm together are in no Hugging Face family"),
        (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, logit_softcap=30.0, post_norms=True),
         r"no family nnx-export writes from scratch has: logit_softcap: 30.0; post_norms: True"),
        (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"]), r"sliding and full layers together are in no"),
        (dict(sliding_window=8), r"sliding_window: 8; GPT2LMHeadModel is the closest"),
        (dict(mlp="swiglu", moe=dict(num_experts=4, top_k=2)),
         r"positions: 'learned' \(the family's is 'rope'\).*; mixtures of experts are of the Llama family"),
        (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False,
              moe=dict(num_experts=4, top_k=2, normalize=False)),
         r"model.moe with normalize false or dense_layers, without model.qk_norm, is in no Hugging Face family"),
        (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=True, qk_norm_scope="projection",
              head_dim=16, moe=dict(num_experts=4, top_k=2)),
         r"model.head_dim 16 with model.qk_norm_scope projection is in no Hugging Face family"),
    ],
    ids=["rope-layernorm", "learned-rmsnorm", "gpt2-gqa", "qwen2-and-3", "gemma-switches", "llama-layer-kinds",
         "gpt2-window", "experts-gpt2", "experts-unnormalised", "olmoe-head-dim"],
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
    assert not list(project.glob(".taken*"))  # nothing left beside it either


@pytest.mark.parametrize("form", [[], ["--format", "gguf"]], ids=["hf", "gguf"])
def test_an_out_inside_the_runs_checkpoints_is_refused(project, form):
    """A file in a sealed step is one its checksums do not list: the step would become unusable."""
    from nnx_cli.checkpoint import Checkpointer

    step = Checkpointer(project / "llama" / "checkpoints", read_only=True).latest_step()
    out = Path("llama", "checkpoints", str(step), "x.gguf" if form else "x")
    result = cli("nnx-export", "llama", "--out", out, *form, cwd=project)
    assert_user_error(result, f"--out '{out}' is inside the run's checkpoints", "nothing was written")
    assert not (project / out).exists()


def test_adapter_export_of_a_run_without_lora_and_bad_dtypes_are_user_errors(project):
    assert_user_error(cli("nnx-export", "llama", "--out", "a", "--adapter", cwd=project), "has none (no model.lora)")
    assert_user_error(cli("nnx-export", "llama", "--out", "b", "--dtype", "int8", cwd=project), "--dtype must be")
    assert_user_error(cli("nnx-export", "llama", "--out", "c", "--dtype", "q8_0", cwd=project),
                      "--dtype 'q8_0' is a GGUF type: add --format gguf")  # fmt: skip
    assert_user_error(cli("nnx-export", "llama", "--out", "d", "--overwrite", cwd=project),
                      "--overwrite goes with --format gguf: add it, or drop --overwrite")  # fmt: skip
    assert not (project / "a").exists() and not (project / "b").exists() and not (project / "c").exists()


def test_a_4_bit_export_that_would_not_load_again_is_refused_before_anything_is_written(project):
    result = cli("nnx-export", "llama", "--out", "nf4", "--dtype", "nf4", cwd=project)
    assert_user_error(result, "--dtype nf4: the q projection's input size (32) is not a multiple of the 4-bit block "
                      "(64)", "--dtype bfloat16")  # fmt: skip
    assert not (project / "nf4").exists() and not list(project.glob(".nf4*"))


@pytest.mark.parametrize(
    "options, projection, size",
    [(["model.mlp_dim=96"], "down", 96), (["model.moe={num_experts: 4, top_k: 2, mlp_dim: 32}"], "expert_down", 32)],
)
def test_a_4_bit_export_names_the_projection_whose_input_is_not_whole_blocks(tmp_path, options, projection, size):
    from nnx_cli.errors import UserError

    llama = ["model.name=transformer_lm", "model.num_heads=4", "model.embed_dim=64", "model.positions=rope",
             "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=false", "data.text_key=text"]  # fmt: skip
    exp = setup(load_config(None, [*llama, *options]), data=None)
    with pytest.raises(UserError, match=rf"--dtype fp4: the {projection} projection's input size \({size}\) is not"):
        exporting.check(exp, tmp_path / "out", adapter=False, dtype="fp4")


def test_runs_that_no_hugging_face_model_describes_are_user_errors(tmp_path):
    def run(name: str, config: str) -> None:  # a config and an empty step: nnx-export refuses before restoring
        (tmp_path / name / "checkpoints" / "1").mkdir(parents=True)
        (tmp_path / name / "config.yaml").write_text(config)

    run("vae", "model: {name: vae, hidden_sizes: [8], latent_size: 2}\n")
    run("odd", "model: {name: transformer_lm, num_layers: 1, num_heads: 2, embed_dim: 8, positions: rope, "
               "norm: layernorm}\ndata: {text_key: text, seq_len: 16}\n")  # fmt: skip
    assert_user_error(cli("nnx-export", "vae", "--out", "a", cwd=tmp_path), "'vae' model trained on images")
    assert_user_error(cli("nnx-export", "odd", "--out", "a", cwd=tmp_path), "options no Hugging Face family has: "
                      "positions: 'rope' (the family's is 'learned')")  # fmt: skip
    assert not (tmp_path / "a").exists()


def test_an_adapter_export_needs_the_base_model_the_adapters_adapt(tmp_path):
    from nnx_cli.errors import UserError

    options = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=8",
               "data.text_key=text", "data.seq_len=16", "model.lora={rank: 2}"]  # fmt: skip
    with pytest.raises(UserError, match=r"--adapter writes an adapter for the base model.pretrained names"):
        exporting.check(setup(load_config(None, options), data=None), tmp_path / "a", adapter=True, dtype=None)


@pytest.mark.parametrize("targets, refused", [(None, True), (["q", "v"], False), (["up"], True)])
def test_an_adapter_of_the_dense_layers_mlp_in_a_mixture_of_experts_is_refused(tmp_path, targets, refused):
    """PEFT (0.21, transformers 5) puts a Qwen3-MoE adapter's mlp.gate_proj/up_proj/down_proj tensors on the
    sparse layers' fused experts and leaves the dense layers' MLP unadapted: logits as if it had not trained."""
    lora = "{rank: 2}" if targets is None else f"{{rank: 2, targets: [{', '.join(targets)}]}}"
    options = [
        f"model.pretrained={fixture('qwen3_moe')}",
        f"model.lora={lora}",
        "data.text_key=text",
        "data.seq_len=16",
    ]
    exp = setup(load_config(None, ["model.name=transformer_lm", *options]), data=None)
    assert exp.pretrained.options["moe"]["dense_layers"]
    if refused:
        message = r"--adapter: model.lora.targets adapts the MLP projections \((gate, up, down|up)\) of the dense"
        with pytest.raises(UserError, match=message):
            exporting.check(exp, tmp_path / "a", adapter=True, dtype=None)
    else:
        exporting.check(exp, tmp_path / "a", adapter=True, dtype=None)
    exporting.check(exp, tmp_path / "b", adapter=False, dtype=None)  # merged: what transformers reads as trained


def test_bfloat16_exports_store_bfloat16_into_an_empty_out(project):
    (project / "llama-bf16").mkdir()
    result = cli("nnx-export", "llama", "--out", "llama-bf16", "--dtype", "bfloat16", cwd=project)
    assert result.returncode == 0, result.stderr
    assert "wrote llama-bf16 (LlamaForCausalLM, bfloat16, " in result.stderr
    assert json.loads((project / "llama-bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # staged in a private mkdtemp directory and renamed: the export has the modes the umask gives, not 0700
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in (project / "llama-bf16").iterdir()} == {0o666 & ~umask}
    assert (project / "llama-bf16").stat().st_mode & 0o777 == 0o777 & ~umask
    with safe_open(str(project / "llama-bf16" / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    if (project / "llama-hf").exists():
        import ml_dtypes

        full = tensors(project / "llama-hf")
        for name, value in tensors(project / "llama-bf16").items():
            np.testing.assert_array_equal(value, full[name].astype(ml_dtypes.bfloat16), err_msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # llama's post-processor adds <|begin_of_text|>
def test_a_tokenizer_json_the_run_trained_with_exports_as_the_run_tokenized(tmp_path, family):
    from tokenizers import Tokenizer

    from nnx_cli.data.tokenizers import load_tokenizer

    source = fixture(family) / "tokenizer.json"
    options = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=16",
               "data.text_key=text", "data.seq_len=16", f"data.tokenizer={source}"]  # fmt: skip
    exp = setup(load_config(None, options), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.init_state()["params"].items()}
    tokenizer = load_tokenizer(str(source))
    files = exporting.export(exp, arrays, tmp_path / "out", adapter=False, dtype=None, tokenizer=tokenizer)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files)
    text = "The river ran past the old mill."
    ours, theirs = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")), Tokenizer.from_file(str(source))
    # transformers (and llama.cpp's converter) tokenize with the post-processor's tokens: none, as the run did
    assert ours.encode(text).ids == tokenizer.encode(text).tolist() == theirs.encode(text, add_special_tokens=False).ids
    settings = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == theirs.id_to_token(tokenizer.eod_id)


def test_out_that_is_a_file_or_a_directory_holding_files_is_refused_saying_which(tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"--out '.*afile' is a file; an export is a directory"):
        exporting.check_out(tmp_path / "afile")
    with pytest.raises(UserError, match=r"--out '.*full' exists and is not empty"):
        exporting.check_out(tmp_path / "full")
    exporting.check_out(tmp_path / "empty")  # an empty directory is written into


def test_out_that_is_a_symbolic_link_or_a_mount_point_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    """The export is made beside --out and renamed into place: a link to an empty directory, a dangling link
    and an empty mount point (`docker -v out:/out`) each ended in a traceback from the rename."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("link", "dangling"):
        with pytest.raises(UserError, match=rf"--out '.*{name}' is a symbolic link; give the directory it points to"):
            exporting.check_out(tmp_path / name)
    monkeypatch.setattr(exporting.os.path, "ismount", lambda path: str(path) == str(tmp_path / "empty"))
    with pytest.raises(UserError, match=r"--out '.*empty' is a mount point, .* such as '.*empty/model'"):
        exporting.check_out(tmp_path / "empty")


def test_out_under_a_file_is_refused_before_anything_is_read(tmp_path):
    """It failed at the first write, after the checkpoint was read and converted (exit 1, not 2)."""
    from nnx_cli.gguf import export as gguf_export

    (tmp_path / "afile").write_text("")
    for check in (exporting.check_out, lambda out: gguf_export.check_out(out, False)):
        with pytest.raises(UserError, match=r"--out '.*afile/sub/out': .*afile is a file, not a directory"):
            check(tmp_path / "afile" / "sub" / "out")
    exporting.check_out(tmp_path / "new" / "deeper" / "out")  # folders that do not exist yet are made
