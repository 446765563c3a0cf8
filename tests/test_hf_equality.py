"""Equality with `transformers`: golden fixtures of tiny random models of each family (tests/fixtures).

In float32 the logits equal `transformers`' to 1e-4 of the largest logit, and greedy generation gives the
same tokens; the same on 8 devices split FSDP x tensor-parallel; in bfloat16 within a stated tolerance.
Prompts and chats tokenize as `transformers` tokenizes them. The families with sliding windows (Gemma 2 and
3, Phi-3, Mistral and Qwen2 with windows) have windows of 8 tokens, inputs three windows long, and four
prompts whose greedy runs of 24 tokens cross their windows in prefill and in the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from cli_support import cli, env
from hf_support import FIXTURES, fixture, goldens

from nnx_cli import hf
from nnx_cli.experiment import setup
from nnx_cli.hf import chat
from nnx_cli.lm import encode_prompt, stops

WINDOWED = ["gemma2", "gemma3", "phi3", "mistral_window", "qwen2_window"]
FAMILIES = ["llama", "llama2", "mistral", "qwen2", "qwen3", "gpt2", *WINDOWED]
CHATS = ["llama", "llama2", "mistral", "qwen2", "qwen3", "gemma2", "phi3"]
FLOAT32 = 1e-4  # of the largest golden logit
BFLOAT16 = 0.025  # bfloat16 keeps 8 bits of mantissa: measured 0.75-1.1% of the largest logit, 2 layers deep


def model_of(name: str, *overrides: str):
    exp = setup(hf.model_dir_config(fixture(name), list(overrides)), data=None)
    return exp.moduledef.merge(exp.load_pretrained())


def relative_error(logits: np.ndarray, golden: np.ndarray) -> float:
    vocab = golden.shape[-1]
    return float(np.abs(np.asarray(logits)[..., :vocab] - golden).max() / np.abs(golden).max())


@pytest.mark.parametrize("name", FAMILIES)
def test_float32_logits_equal_transformers(name):
    gold = goldens(name)
    model = model_of(name)
    assert relative_error(model.logits(gold["input_ids"]), gold["logits"]) < FLOAT32


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3"])
def test_float32_logits_of_unrolled_layers_equal_transformers(name):
    gold = goldens(name)
    model = model_of(name, "model.scan_layers=false")
    assert relative_error(model.logits(gold["input_ids"]), gold["logits"]) < FLOAT32


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_logits_agree_with_transformers_float32_within_tolerance(name):
    gold = goldens(name)
    model = model_of(name, "model.dtype=bfloat16")
    error = relative_error(model.logits(gold["input_ids"]), gold["logits"])
    assert error < BFLOAT16, error


@pytest.mark.parametrize("name", FAMILIES)
def test_prompts_tokenize_as_transformers_tokenizes_them(name):
    gold = goldens(name)
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    prompts = json.loads((FIXTURES / f"{name}.json").read_text())["prompts"]
    for i, prompt in enumerate(prompts):
        assert encode_prompt(tokenizer, prompt, chat=False, system=None) == gold[f"prompt_ids_{i}"].tolist()
    # capitals in contractions, digit runs, a decomposed accent, runs of spaces: where the families' splits differ
    probe = str(gold["probe_text"])
    assert encode_prompt(tokenizer, probe, chat=False, system=None) == gold["probe_ids"].tolist()


@pytest.mark.parametrize("name", CHATS)
def test_chat_templates_render_and_tokenize_as_transformers(name):
    gold, record = goldens(name), json.loads((FIXTURES / f"{name}.json").read_text())
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    specials = chat.special_tokens(tokenizer)
    prompt = chat.render(
        tokenizer.chat_template, record["messages"], add_generation_prompt=True, special_tokens=specials
    )
    full = chat.render(tokenizer.chat_template, record["conversation"], add_generation_prompt=False,
                       special_tokens=specials)  # fmt: skip
    assert (prompt, full) == (record["chat_prompt_text"], record["chat_full_text"])
    assert tokenizer.encode_plain(prompt).tolist() == gold["chat_prompt_ids"].tolist()
    assert tokenizer.encode_plain(full).tolist() == gold["chat_full_ids"].tolist()


@pytest.mark.parametrize("name", [f for f in FAMILIES if f not in WINDOWED])
def test_greedy_generation_gives_transformers_tokens(name):
    from nnx_cli import decoding

    gold = goldens(name)
    exp = setup(hf.model_dir_config(fixture(name), ["model.scan_layers=false"]), data=None)
    decoder = decoding.Decoder(exp.moduledef, exp.load_pretrained())
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    drawn = decoder.generate([gold["prompt_ids_0"].tolist()], max_tokens=20, temperature=0, **stops(tokenizer))
    drawn.finish()
    tokens = drawn.samples[0] + ([drawn.stopped_by[0]] if drawn.stopped_by[0] is not None else [])
    assert tokens == gold["greedy_0"].tolist()


@pytest.mark.parametrize("name", WINDOWED)
def test_greedy_runs_of_four_prompts_that_cross_the_window_give_transformers_tokens(name):
    from nnx_cli import decoding

    gold, record = goldens(name), json.loads((FIXTURES / f"{name}.json").read_text())
    prompts = [gold[f"prompt_ids_{i}"].tolist() for i in range(len(record["prompts"]))]
    assert min(map(len, prompts)) < 8 < max(map(len, prompts))  # prefill within and past the window
    exp = setup(hf.model_dir_config(fixture(name), []), data=None)
    decoder = decoding.Decoder(exp.moduledef, exp.load_pretrained())  # one batch: per-row lengths and rings
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    drawn = decoder.generate(prompts, max_tokens=24, temperature=0, **stops(tokenizer)).finish()
    for i in range(len(prompts)):
        tokens = drawn.samples[i] + ([drawn.stopped_by[i]] if drawn.stopped_by[i] is not None else [])
        assert tokens == gold[f"greedy_{i}"].tolist(), i


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2"])  # every family in process above; three by command
def test_nnx_generate_json_tokens_equal_transformers_greedy_tokens(tmp_path, name):
    gold = goldens(name)
    prompt = json.loads((FIXTURES / f"{name}.json").read_text())["prompts"][1]
    tokens = "24" if name in WINDOWED else "20"
    result = cli("nnx-generate", fixture(name), "--prompt", prompt, "--temperature", "0", "--max-tokens", tokens,
                 "--json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == [gold["greedy_1"].tolist()]


def test_logits_on_8_devices_split_fsdp_by_tensor_parallel_equal_transformers(tmp_path):
    script = """
import json, sys, numpy as np
from nnx_cli import hf
from nnx_cli.experiment import setup
errors = {}
for name in sys.argv[1:]:
    exp = setup(hf.model_dir_config(f"tests/fixtures/hf/{name}", ["sharding.mesh.data=4", "sharding.mesh.model=2"]),
                data=None)
    params = exp.load_pretrained()
    gold = np.load(f"tests/fixtures/hf/{name}.npz")
    import jax, nnx
    from nnx_cli.sharding import axis_rules
    with jax.set_mesh(exp.mesh), nnx.logical_axis_rules(exp.rules):
        logits = jax.jit(lambda p, t: exp.moduledef.merge(p).logits(t))(params, gold["input_ids"])
    vocab = gold["logits"].shape[-1]
    errors[name] = float(np.abs(np.asarray(logits)[..., :vocab] - gold["logits"]).max() / np.abs(gold["logits"]).max())
    errors[name + "/devices"] = len(params["embedding/embedding"].value.sharding.device_set)
print(json.dumps(errors))
"""
    from cli_support import ROOT

    names = ["llama", "qwen2", "qwen3", "gpt2"]
    result = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, env=env(tmp_path, 8),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    for name in names:
        assert errors[name + "/devices"] == 8
        assert errors[name] < FLOAT32, (name, errors[name])


_SHARDED_WINDOWS = """
import json, sys, jax, numpy as np, nnx
from nnx_cli import hf
from nnx_cli.experiment import setup
errors = {}
for name, layers, dtype in (json.loads(a) for a in sys.argv[1:]):
    overrides = ["sharding.mesh.data=4", "sharding.mesh.model=2", f"model.scan_layers={layers}", f"model.dtype={dtype}"]
    exp = setup(hf.model_dir_config(f"tests/fixtures/hf/{name}", overrides), data=None)
    params = exp.load_pretrained()  # streamed into the shardings, stacked or per layer
    gold = np.load(f"tests/fixtures/hf/{name}.npz")
    with jax.set_mesh(exp.mesh), nnx.logical_axis_rules(exp.rules):
        logits = jax.jit(lambda p, t: exp.moduledef.merge(p).logits(t))(params, gold["input_ids"])
    vocab = gold["logits"].shape[-1]
    key = f"{name}/{layers}/{dtype}"
    errors[key] = float(np.abs(np.asarray(logits)[..., :vocab] - gold["logits"]).max() / np.abs(gold["logits"]).max())
    errors[key + "/devices"] = len(params["embedding/embedding"].value.sharding.device_set)
print(json.dumps(errors))
"""


def test_windowed_families_on_8_devices_equal_transformers_in_float32_and_bfloat16(tmp_path):
    from cli_support import ROOT

    runs = [("gemma2", "true", "float32"), ("gemma3", "false", "float32"), ("phi3", "true", "float32"),
            ("gemma2", "false", "bfloat16"), ("gemma3", "true", "bfloat16"), ("phi3", "true", "bfloat16")]  # fmt: skip
    result = subprocess.run([sys.executable, "-c", _SHARDED_WINDOWS, *map(json.dumps, runs)], cwd=ROOT,
                            env=env(tmp_path, 8), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    for name, layers, dtype in runs:
        key = f"{name}/{layers}/{dtype}"
        assert errors[key + "/devices"] == 8
        assert errors[key] < (FLOAT32 if dtype == "float32" else BFLOAT16), (key, errors[key])


# Mixtures of experts: Mixtral and OLMoE (scanned, every layer sparse), Qwen3-MoE (layer 0 dense, so unrolled)
# ------------------------------------------------------------------------------

MOE = ["mixtral", "qwen3_moe", "olmoe"]
MOE_TOKENS = 24  # greedy tokens after each of 4 prompts
SHARDED_MOE = ["qwen3_moe"]  # on 8 devices: 2 of its 8 experts each, beside a dense layer (one subprocess, kept short)


def greedy_runs(name: str, exp, params) -> list[list[int]]:
    """The greedy tokens after each of the fixture's prompts, all four decoded as one batch."""
    from nnx_cli import decoding

    gold, count = goldens(name), len(json.loads((FIXTURES / f"{name}.json").read_text())["prompts"])
    tokenizer = hf.pretrained_tokenizer(str(fixture(name)))
    prompts = [gold[f"prompt_ids_{i}"].tolist() for i in range(count)]
    drawn = decoding.Decoder(exp.moduledef, params).generate(prompts, max_tokens=MOE_TOKENS, temperature=0,
                                                             **stops(tokenizer))  # fmt: skip
    drawn.finish()
    return [s + ([stop] if stop is not None else []) for s, stop in zip(drawn.samples, drawn.stopped_by)]


@pytest.mark.parametrize("name", MOE)
def test_mixture_of_experts_float32_logits_equal_transformers(name):
    gold = goldens(name)
    assert relative_error(model_of(name).logits(gold["input_ids"]), gold["logits"]) < FLOAT32


@pytest.mark.parametrize("name", MOE)
def test_mixture_of_experts_bfloat16_logits_agree_with_transformers_float32_within_tolerance(name):
    gold = goldens(name)
    error = relative_error(model_of(name, "model.dtype=bfloat16").logits(gold["input_ids"]), gold["logits"])
    assert error < BFLOAT16, error


@pytest.mark.parametrize("name", MOE)
def test_mixture_of_experts_load_balancing_loss_equals_transformers(name):
    gold = goldens(name)
    tokens = np.concatenate([gold["input_ids"], gold["input_ids"][:, :1]], axis=1)  # any next token: not counted
    metrics = model_of(name).metrics({"tokens": tokens}, None)
    np.testing.assert_allclose(np.asarray(metrics["aux_loss"]), gold["aux_loss"], rtol=1e-5)


@pytest.mark.parametrize("name", MOE)
def test_mixture_of_experts_greedy_generation_gives_transformers_tokens_after_four_prompts(name):
    gold = goldens(name)
    exp = setup(hf.model_dir_config(fixture(name), ["model.scan_layers=false"]), data=None)
    runs = greedy_runs(name, exp, exp.load_pretrained())
    assert runs == [gold[f"greedy_{i}"].tolist() for i in range(len(runs))]
    assert len(runs) == 4 and max(map(len, runs)) == MOE_TOKENS


def test_experts_split_over_an_expert_mesh_axis_generate_the_tokens_of_one_device(tmp_path):
    script = """
import json, sys, jax, numpy as np
sys.path.insert(0, "tests")
from test_hf_equality import greedy_runs
from nnx_cli import hf
from nnx_cli.experiment import setup
out = {}
for name in sys.argv[1:]:
    exp = setup(hf.model_dir_config(f"tests/fixtures/hf/{name}", ["sharding.mesh.expert=4", "sharding.mesh.data=2",
                                    "model.scan_layers=false"]), data=None)
    params = exp.load_pretrained()
    kernel = next(v.value for p, v in params.items() if p.endswith("moe/gate/kernel"))  # [expert, embed, mlp]
    out[name] = {"tokens": greedy_runs(name, exp, params), "devices": len(kernel.sharding.device_set),
                 "experts_per_device": kernel.sharding.shard_shape(kernel.shape)[0], "experts": kernel.shape[0]}
print(json.dumps(out))
"""
    from cli_support import ROOT

    result = subprocess.run([sys.executable, "-c", script, *SHARDED_MOE], cwd=ROOT, env=env(tmp_path, 8),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name in SHARDED_MOE:
        gold = goldens(name)
        assert out[name]["tokens"] == [gold[f"greedy_{i}"].tolist() for i in range(4)], name  # one device's too
        assert out[name]["devices"] == 8
        assert out[name]["experts_per_device"] * 4 == out[name]["experts"]  # each device holds a quarter
