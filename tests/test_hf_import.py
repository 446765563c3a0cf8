"""Hugging Face model directories in: config.json as options, weights streamed into shardings, broken inputs.

Equality with `transformers` itself is checked against golden fixtures in test_hf_equality.py; here the
directories are written by the tests (`hf_support.write_model_dir`), which is enough to check the plumbing:
every tensor lands where the family's table says, sharded or not, and every broken input is one clear error.
"""

from __future__ import annotations

import http.server
import json
import resource
import shutil
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from cli_support import assert_user_error, cli
from hf_support import GPT2_CONFIG, LLAMA_CONFIG, fixture, write_model_dir

from nnx_cli import hf
from nnx_cli.config import load_config
from nnx_cli.errors import UserError
from nnx_cli.experiment import setup
from nnx_cli.hf import families, weights
from nnx_cli.hf.weights import Weights, convert


@pytest.fixture(autouse=True)
def _fresh_cache():
    hf.open_pretrained.cache_clear()
    hf.pretrained_tokenizer.cache_clear()
    hf.resolve.cache_clear()
    yield


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "llama"
    write_model_dir(path, LLAMA_CONFIG, shards=2)
    return path


def options(config: dict) -> dict:
    return families.options_of(config, "config.json")


def loaded(directory: Path, *overrides: str) -> dict[str, np.ndarray]:
    exp = setup(hf.model_dir_config(directory, list(overrides)), data=None)
    return {path: np.asarray(p.value) for path, p in exp.load_pretrained().items()}


# config.json -> options
# --------------------------------------------------------------------------------------------------------------


def test_a_llama_config_gives_llama_options():
    got = options(LLAMA_CONFIG)
    assert got["num_kv_heads"] == 2 and got["head_dim"] == 8 and got["mlp"] == "swiglu"
    assert (got["positions"], got["norm"], got["bias"], got["tie_embeddings"]) == ("rope", "rmsnorm", False, False)


def test_qwen2_has_qkv_biases_and_qwen3_query_key_norms_and_its_own_head_dim():
    qwen2 = options({**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = options({**LLAMA_CONFIG, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert (qwen2["qkv_bias"], qwen2["qk_norm"]) == (True, False)
    assert (qwen3["qkv_bias"], qwen3["qk_norm"], qwen3["head_dim"]) == (False, True, 16)


def test_mixtral_has_its_experts_in_every_layer_with_the_top_k_renormalised():
    config = json.loads((fixture("mixtral") / "config.json").read_text())
    got = options(config)
    assert got["moe"] == {"num_experts": 4, "top_k": 2, "mlp_dim": 48, "normalize": True, "dense_layers": []}
    assert got["router_aux_loss_coef"] == 0.02 and got["qk_norm"] is False


def test_olmoe_normalises_all_query_heads_together_and_all_key_heads_together():
    got = options(json.loads((fixture("olmoe") / "config.json").read_text()))
    assert (got["qk_norm"], got["qk_norm_scope"], got["head_dim"]) == (True, "projection", 8)
    assert got["moe"] == {"num_experts": 8, "top_k": 2, "mlp_dim": 24, "normalize": False, "dense_layers": []}
    maps = {m.path: m for m in families.FAMILIES["OlmoeForCausalLM"].tensors(got, [])}
    assert maps["attention/query_norm/scale"].shape == (32,) and maps["attention/key_norm/scale"].shape == (16,)


def test_each_family_file_is_registered_for_loading_and_for_gguf_alike():
    """A family is one file of `nnx_cli/hf/families/`: its FAMILIES and ARCHES entries, gathered through MODULES."""
    from nnx_cli.gguf import families as gguf

    for module in families.MODULES:
        for name, family in module.FAMILIES.items():
            assert families.FAMILIES[name] is family and family.architecture == name
            assert name in families.SUPPORTED and name in families._SUPPORTED_TEXT  # the errors list it
        assert all(gguf.ARCHES[name] is arch and name in module.FAMILIES for name, arch in module.ARCHES.items())
    assert len(families.FAMILIES) == sum(len(module.FAMILIES) for module in families.MODULES)  # no name twice


@pytest.mark.parametrize(
    "step, only, dense", [(1, [], []), (2, [], [0, 2]), (1, [3], [3]), (2, [1, 3], [0, 1, 2, 3]), (3, [0], [0, 1, 3])]
)
def test_qwen3_moe_keeps_a_dense_mlp_in_the_layers_decoder_sparse_step_and_mlp_only_layers_name(step, only, dense):
    config = json.loads((fixture("qwen3_moe") / "config.json").read_text())
    got = options({**config, "num_hidden_layers": 4, "decoder_sparse_step": step, "mlp_only_layers": only})
    assert got["moe"]["dense_layers"] == dense  # transformers: experts where (i + 1) % step == 0, i not in only
    assert (got["moe"]["mlp_dim"], got["mlp_dim"], got["moe"]["normalize"], got["qk_norm"]) == (24, 64, False, True)


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("mixtral", {"router_jitter_noise": 0.1}, r"'router_jitter_noise' is 0.1: router jitter noise"),
        ("mixtral", {"num_experts_per_tok": 5}, r"'num_experts_per_tok' is 5, more than the 4 experts"),
        ("qwen3_moe", {"mlp_only_layers": "all"}, r"'mlp_only_layers' must be a list of layer indices"),
        ("qwen3_moe", {"num_local_experts": 0}, r"'num_local_experts' must be a positive integer, got 0"),
        ("olmoe", {"clip_qkv": 8.0}, r"'clip_qkv' is 8.0: clipping q, k and v \(clip_qkv\) is not supported"),
    ],
    ids=["jitter", "top-k", "mlp-only-layers", "no-experts", "clip-qkv"],
)  # fmt: skip
def test_what_a_mixture_of_experts_cannot_be_is_named(name, change, message):
    config = json.loads((fixture(name) / "config.json").read_text())
    with pytest.raises(UserError, match=message):
        options({**config, **change})


@pytest.mark.parametrize(
    "name, change, window",
    [
        ("mixtral", {}, None),  # MixtralConfig: no window unless config.json sets one
        ("mixtral", {"sliding_window": 8}, 8),
        ("qwen3_moe", {"sliding_window": 8}, None),  # use_sliding_window false: transformers drops the window
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, 8),
        ("qwen3_moe", {"use_sliding_window": True}, 4096),  # Qwen3MoeConfig's default window
    ],
    ids=["mixtral-none", "mixtral-window", "qwen3-moe-unused", "qwen3-moe-window", "qwen3-moe-default"],
)  # fmt: skip
def test_mixtures_of_experts_slide_every_layer_by_the_window_transformers_reads(name, change, window):
    config = {k: v for k, v in json.loads((fixture(name) / "config.json").read_text()).items() if k != "sliding_window"}
    got = options({**config, **change})
    assert got.get("sliding_window") == window and got.get("layer_types") is None  # None: every layer slides


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
        {"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ],
    ids=["rope_type", "type", "rope_parameters"],
)  # fmt: skip
def test_llama3_rope_scaling_reads_in_every_form_transformers_writes(rope):
    got = options({**LLAMA_CONFIG, **rope})
    assert got["rope_theta"] == 500000.0
    assert got["rope_scaling"] == {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip


def test_a_mistral_window_slides_every_layer_and_qwen_windows_start_at_max_window_layers():
    mistral = options({**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert (mistral["sliding_window"], mistral["layer_types"]) == (4096, None)  # null: every layer
    qwen = {**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3, "sliding_window": 64}
    assert "sliding_window" not in options({**qwen, "use_sliding_window": False})  # transformers drops the window
    windowed = options({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert windowed["sliding_window"] == 64
    assert windowed["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert "sliding_window" not in options(LLAMA_CONFIG)  # the options of a family without windows stay as before


GEMMA2 = {**LLAMA_CONFIG, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4, "head_dim": 16}


def test_gemma_configs_give_gemma_options_with_transformers_defaults_for_missing_keys():
    got = options(GEMMA2)
    assert (got["norm"], got["mlp"], got["post_norms"], got["scale_embeddings"]) == ("gemma_rmsnorm", "geglu", True,
                                                                                     True)  # fmt: skip
    assert (got["query_scale"], got["attention_softcap"], got["logit_softcap"]) == (256.0, 50.0, 30.0)
    assert got["sliding_window"] == 4096 and got["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert got["tie_embeddings"] is False and got["qk_norm"] is False  # LLAMA_CONFIG unties them
    uncapped = options({**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (uncapped["attention_softcap"], uncapped["logit_softcap"]) == (None, None)
    gemma3 = options({**GEMMA2, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7})
    assert gemma3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
    assert (gemma3["qk_norm"], gemma3["attention_softcap"], gemma3["logit_softcap"]) == (True, None, None)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    ],
    ids=["rope_local_base_freq", "rope_parameters"],
)  # fmt: skip
def test_gemma3_reads_its_local_and_global_rotary_settings_in_both_forms(rope):
    got = options({**GEMMA2, "architectures": ["Gemma3ForCausalLM"], "rope_theta": None, **rope})
    assert (got["rope_theta"], got["rope_local_theta"]) == (1e6, 1e4)
    assert got["rope_scaling"] == {"type": "linear", "factor": 8.0}


@pytest.mark.parametrize(
    "rope",
    [{"partial_rotary_factor": 0.5}, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}],
)
def test_phi3_rotates_the_partial_rotary_factor_of_each_head(rope):
    got = options({**LLAMA_CONFIG, "architectures": ["Phi3ForCausalLM"], "sliding_window": 2047, **rope})
    assert (got["head_dim"], got["rotary_dim"], got["sliding_window"], got["layer_types"]) == (8, 4, 2047, None)


def test_phi3_fused_projections_split_into_our_kernels(tmp_path):
    config = {**LLAMA_CONFIG, "architectures": ["Phi3ForCausalLM"], "num_key_value_heads": 2}
    tensors = write_model_dir(tmp_path / "phi3", config)
    params = loaded(tmp_path / "phi3")
    qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]  # [q | k | v, embed]: 32 + 16 + 16 rows
    for name, rows in (("query", slice(0, 32)), ("key", slice(32, 48)), ("value", slice(48, 64))):
        got = params[f"layers/scan_module/attention/{name}/kernel"][1]
        np.testing.assert_array_equal(got, qkv[rows].T.reshape(32, -1, 8))
    gate_up = tensors["model.layers.0.mlp.gate_up_proj.weight"]  # [gate | up, embed]
    np.testing.assert_array_equal(params["layers/scan_module/mlp/gate/kernel"][0], gate_up[:64].T)
    np.testing.assert_array_equal(params["layers/scan_module/mlp/fc/kernel"][0], gate_up[64:].T)


def test_gpt2_config_gives_learned_positions_layernorm_and_biases():
    got = options(GPT2_CONFIG)
    assert (got["positions"], got["norm"], got["mlp"], got["bias"]) == ("learned", "layernorm", "gelu", True)
    assert got["max_positions"] == 64 and got["tie_embeddings"] is True


def test_llama3_scaling_slows_long_wavelengths_and_keeps_short_ones():
    from nnx_cli.models.transformer_lm import rope_frequencies

    scaling = (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
               ("original_max_position_embeddings", 64.0))  # fmt: skip
    plain, scaled = np.asarray(rope_frequencies(16)), np.asarray(rope_frequencies(16, scaling=scaling))
    wavelength = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wavelength < 16], plain[wavelength < 16])
    np.testing.assert_allclose(scaled[wavelength > 64], plain[wavelength > 64] / 8, rtol=1e-6)
    between = (wavelength > 16) & (wavelength < 64)
    assert between.any() and np.all((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8))


# Loading
# --------------------------------------------------------------------------------------------------------------


def test_every_parameter_is_read_from_its_tensor_stacked_or_per_layer(llama_dir):
    weights = Weights.open(llama_dir)
    stacked, unrolled = loaded(llama_dir), loaded(llama_dir, "model.scan_layers=false")
    query = weights.read("model.layers.1.self_attn.q_proj.weight", (slice(None), slice(None)))
    np.testing.assert_array_equal(stacked["layers/scan_module/attention/query/kernel"][1], query.T.reshape(32, 4, 8))
    np.testing.assert_array_equal(unrolled["layers/1/attention/query/kernel"], query.T.reshape(32, 4, 8))
    down = weights.read("model.layers.0.mlp.down_proj.weight", (slice(None), slice(None)))
    np.testing.assert_array_equal(stacked["layers/scan_module/mlp/proj/kernel"][0], down.T)
    head = weights.read("lm_head.weight", (slice(None), slice(None)))
    np.testing.assert_array_equal(stacked["head/kernel"][:, :300], head.T)
    assert not stacked["head/kernel"][:, 300:].any() and not stacked["embedding/embedding"][300:].any()  # padding


def test_gpt2_fused_attention_splits_into_query_key_and_value(tmp_path):
    tensors = write_model_dir(tmp_path / "gpt2", GPT2_CONFIG)
    params = loaded(tmp_path / "gpt2")
    fused = tensors["h.1.attn.c_attn.weight"]  # [embed, 3 * embed]: q | k | v
    for i, name in enumerate(("query", "key", "value")):
        got = params[f"layers/scan_module/attention/{name}/kernel"][1]
        np.testing.assert_array_equal(got, fused[:, 32 * i : 32 * (i + 1)].reshape(32, 4, 8))
    np.testing.assert_array_equal(params["position_embedding/embedding"], tensors["wpe.weight"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_load_exactly_as_float32(tmp_path, dtype):
    tensors = write_model_dir(tmp_path / dtype, LLAMA_CONFIG, dtype=dtype)
    params = loaded(tmp_path / dtype)
    expected = tensors["model.layers.0.mlp.gate_proj.weight"].astype(np.float32).T
    np.testing.assert_array_equal(params["layers/scan_module/mlp/gate/kernel"][0], expected)


def test_transposed_bfloat16_blocks_convert_exactly_in_tiles():
    source = np.random.default_rng(0).normal(size=(300, 200)).astype(ml_dtypes.bfloat16)
    out = np.empty((200, 300), np.float32)
    convert(source.view(np.uint16).T, out)
    np.testing.assert_array_equal(out, source.T.astype(np.float32))


def test_bfloat16_copied_into_the_upper_halves_of_fresh_pages_is_exact_straight_and_transposed():
    source = np.random.default_rng(0).normal(size=(700, 600)).astype(ml_dtypes.bfloat16)
    raw = source.view(np.uint16)
    for view, expected in ((raw, source), (raw.T, source.T)):
        out = weights._aligned(view.shape)  # over 1 MiB: its own memory map, faulted in at once
        convert(view, out, zeroed=True)
        np.testing.assert_array_equal(out, expected.astype(np.float32))


@pytest.mark.parametrize("stored", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("target", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_parameters_hold_their_own_types_bits_and_round_any_other(stored, target):
    source = (np.random.default_rng(0).normal(size=(300, 200)) * 1e3).astype(stored)  # some past float16's grid
    raw = source.view(np.uint16) if stored == ml_dtypes.bfloat16 else source
    for view, expected in ((raw, source), (raw.T, source.T)):
        out = np.zeros(view.shape, target)
        convert(view, out, zeroed=True)
        np.testing.assert_array_equal(out.view(np.uint16), expected.astype(np.float32).astype(target).view(np.uint16))


def test_parameters_over_a_mebibyte_are_faulted_in_ahead_and_filled_layer_by_layer(tmp_path):
    config = {**LLAMA_CONFIG, "hidden_size": 256, "intermediate_size": 1152, "num_attention_heads": 8}
    tensors = write_model_dir(tmp_path / "wide", config, dtype="bfloat16")  # each layer's MLP kernel: 1.1 MiB
    params = loaded(tmp_path / "wide")
    for i in range(config["num_hidden_layers"]):
        expected = tensors[f"model.layers.{i}.mlp.down_proj.weight"].astype(np.float32).T
        np.testing.assert_array_equal(params["layers/scan_module/mlp/proj/kernel"][i], expected)
    np.testing.assert_array_equal(
        params["embedding/embedding"][:300], tensors["model.embed_tokens.weight"].astype(np.float32)
    )
    assert not [t for t in threading.enumerate() if t.name.startswith("nnx-load")]  # none left running


def test_a_prefaulted_buffer_is_written_without_a_page_fault_and_a_stop_releases_its_waiters():
    def faults_writing(buffer: np.ndarray) -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buffer[...] = 1.0
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    ahead, fresh = weights._aligned((4096, 512), populate=False), weights._aligned((4096, 512), populate=False)
    with weights._Prefault([ahead]) as memory:
        memory.wait(ahead, ahead[-1])
        assert faults_writing(ahead) < 8 < 2048 <= faults_writing(fresh)  # 8 MiB: 2048 pages of 4 KiB
    unstarted = weights._Prefault([weights._aligned((4096, 512), populate=False)])
    unstarted._stop = True
    with unstarted as memory:  # stops at once, before faulting anything in: a wait still returns
        memory.wait(unstarted._mapped[0], unstarted._mapped[0][-1])


def test_loading_onto_8_devices_places_each_shard_and_matches_one_device(llama_dir, tmp_path):
    script = f"""
import json, numpy as np
from nnx_cli import hf
from nnx_cli.experiment import setup
exp = setup(hf.model_dir_config({str(llama_dir)!r}, ["sharding.mesh.data=4", "sharding.mesh.model=2"]), data=None)
params = exp.load_pretrained()
np.savez({str(tmp_path / "eight.npz")!r}, **{{k.replace("/", "|"): np.asarray(v.value) for k, v in params.items()}})
print(json.dumps({{k: list(v.value.sharding.spec) for k, v in params.items()}}))
"""
    result = cli_python(script, tmp_path, devices=8)
    specs = json.loads(result.stdout.strip().splitlines()[-1])
    assert specs["layers/scan_module/attention/query/kernel"] == [None, "data", "model", None]
    assert specs["layers/scan_module/attention/key/kernel"] == [None, "data", "model", None]  # kv_heads on model
    eight = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "eight.npz").items()}
    one = loaded(llama_dir)
    assert eight.keys() == one.keys()
    for path in one:
        np.testing.assert_array_equal(eight[path], one[path], err_msg=path)


def cli_python(script: str, cwd: Path, devices: int | None = None):
    import subprocess
    import sys

    from cli_support import env

    result = subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=env(cwd, devices), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result


# Broken model directories: one error naming what is wrong, nothing written
# --------------------------------------------------------------------------------------------------------------


def broken(tmp_path: Path, llama_dir: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(llama_dir, target)
    return target


def check(target: Path, *overrides: str) -> None:
    cfg = load_config(
        None, ["model.name=transformer_lm", f"model.pretrained={target}", "data.text_key=text", *overrides]
    )
    setup(cfg, data=None)


def test_a_directory_without_config_json_is_named(tmp_path, llama_dir):
    target = broken(tmp_path, llama_dir)
    (target / "config.json").unlink()
    with pytest.raises(UserError, match=r"config.json' does not exist"):
        check(target)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["BertForMaskedLM"]}, r"'BertForMaskedLM', which is not supported; supported: Llama"),
        ({"architectures": ["Qwen2ForCausalLM"], "layer_types": ["sliding_attention", "full_attention"]},
         r"'layer_types' has sliding_attention layers while use_sliding_window is false"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"'rope_scaling' has rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"'hidden_act' is 'gelu': an activation other than silu"),
        ({"auto_map": {"AutoModelForCausalLM": "m.M"}}, r"'auto_map' asks to run the model directory's own code "
         r"\(trust_remote_code\), which nnx never does; its architectures name the built-in LlamaForCausalLM, which "
         r"nnx reads as transformers does without trust_remote_code: delete the auto_map entry from config.json"),
        ({"architectures": ["EvilForCausalLM"], "auto_map": {"AutoModelForCausalLM": "m.M"}},
         r"'auto_map' asks to run the model directory's own code \(trust_remote_code\), which nnx never does; "
         r"supported families: Llama"),
        ({"architectures": "LlamaForCausalLM"}, r"'architectures' is a string; it should be a list"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, r"'Gemma3ForConditionalGeneration', which is not"),
        ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
          "long_factor": [2.0] * 4}}, r"'rope_scaling' has rope type 'longrope'"),
        ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True},
         r"'use_bidirectional_attention' is True: bidirectional attention is not supported"),
        ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"}, r"'hidden_activation' is 'gelu'"),
        ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": None}, r"'sliding_window' is null, but layer"),
    ],
    ids=["architecture", "sliding-window", "rope-type", "activation", "remote-code-built-in", "remote-code",
         "architectures-string", "multimodal", "longrope",
         "bidirectional", "gemma-activation", "window-missing"],
)  # fmt: skip
def test_unsupported_architectures_and_options_name_the_key_and_the_families(tmp_path, llama_dir, change, message):
    target = broken(tmp_path, llama_dir)
    (target / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **change}))
    with pytest.raises(UserError, match=message):
        check(target)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"])
def test_rope_scaling_beside_rope_parameters_is_refused_not_read_as_the_parameters_alone(architecture):
    """A model card's long-context block (`rope_scaling`) added to a config.json that transformers 5 saved (with
    `rope_parameters`): transformers takes rope_scaling, nnx read the parameters alone and computed another
    rotation, accepting even a yarn scaling it refuses elsewhere."""
    parameters = {"rope_theta": 1000000.0, "rope_type": "default"}
    if architecture == "Gemma3ForCausalLM":
        parameters = {
            "full_attention": parameters,
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        }
    config = {**LLAMA_CONFIG, "architectures": [architecture], "rope_parameters": parameters}
    options(config)  # the parameters alone read as before
    for scaling in ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}):
        with pytest.raises(UserError, match=r"'rope_scaling' is given beside rope_parameters, which transformers 5 "
                                            r"would replace with it: put its rope_type"):  # fmt: skip
            options({**config, "rope_scaling": scaling})
    assert options({**config, "rope_scaling": None}) == options(config)


@pytest.mark.parametrize(
    "architecture, experts, norm_eps, rope_theta",
    [("LlamaForCausalLM", {}, 1e-6, 10000.0), ("MixtralForCausalLM", {"num_local_experts": 4}, 1e-5, 1e6),
     ("OlmoeForCausalLM", {"num_experts": 4}, 1e-5, 10000.0)],
)  # fmt: skip
def test_keys_config_json_leaves_out_take_transformers_defaults_for_the_family(architecture, experts, norm_eps,
                                                                               rope_theta):  # fmt: skip
    """Every family took Llama's rms_norm_eps (1e-6) and rope_theta (1e4); Mixtral's are 1e-5 and 1e6, OLMoE's
    epsilon 1e-5 (transformers' MixtralConfig and OlmoeConfig)."""
    config = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("rms_norm_eps", "rope_theta")}
    read = options({**config, "architectures": [architecture], "num_experts_per_tok": 2, **experts})
    assert (read["norm_eps"], read["rope_theta"]) == (norm_eps, rope_theta)


def test_truncated_weights_name_the_file_and_the_tensor(tmp_path, llama_dir):
    target = broken(tmp_path, llama_dir)
    shard = sorted(target.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(UserError, match=rf"{shard.name}: not a readable safetensors file .*truncated, tensor '"):
        check(target)


def test_an_unparsable_header_names_the_file(tmp_path, llama_dir):
    target = broken(tmp_path, llama_dir)
    shard = sorted(target.glob("model-*.safetensors"))[0]
    shard.write_bytes(len(b"{not json").to_bytes(8, "little") + b"{not json")
    with pytest.raises(UserError, match=rf"{shard.name}: not a readable safetensors file"):
        check(target)


def rewrite(target: Path, edit) -> None:
    """Rewrite a one-file model directory's tensors with `edit(tensors)`."""
    from safetensors.numpy import load_file, save_file

    tensors = {}
    for shard in sorted(target.glob("model-*.safetensors")):
        tensors.update(load_file(str(shard)))
        shard.unlink()
    (target / "model.safetensors.index.json").unlink()
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"'model.layers.1.mlp.up_proj.weight' is missing"),
        (lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}),
         r"unexpected tensor 'model.layers.0.extra.weight'"),
        (lambda t: t.update({"model.norm.weight": np.zeros(31, np.float32)}),
         r"tensor 'model.norm.weight' has shape \[31\], but config.json implies \[32\]"),
        (lambda t: t.update({"model.norm.weight": np.zeros(32, np.int32)}), r"'model.norm.weight' is stored as I32"),
    ],
    ids=["missing", "unexpected", "misshapen", "integer"],
)  # fmt: skip
def test_missing_unexpected_and_misshapen_tensors_name_the_file_and_the_tensor(tmp_path, llama_dir, edit, message):
    target = broken(tmp_path, llama_dir)
    rewrite(target, edit)
    with pytest.raises(UserError, match=rf"model.safetensors: .*{message}"):
        check(target)


def test_a_pretrained_model_needs_text_data(llama_dir):
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={llama_dir}"])
    with pytest.raises(UserError, match=r"'model.pretrained' is a language model, but the data is not text"):
        setup(cfg, data=None)


@pytest.mark.parametrize("suffix", [".txt", ".md"])
def test_a_plain_text_file_is_text_without_a_text_key(tmp_path, llama_dir, suffix):
    source = tmp_path / f"notes{suffix}"
    source.write_text("# Notes\n\nthe quick brown fox\n")
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={llama_dir}", f"data.source={source}"])
    setup(cfg, data=None)
    assert cfg.data.text_key == "text"  # the one column a plain-text file has


def test_a_data_file_with_columns_still_needs_its_text_key(tmp_path, llama_dir):
    source = tmp_path / "notes.jsonl"
    source.write_text('{"body": "the quick brown fox"}\n')
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={llama_dir}", f"data.source={source}"])
    with pytest.raises(UserError, match=r"the data is not text: set data.text_key"):
        hf.apply_pretrained(cfg)


def test_a_shape_key_that_disagrees_with_config_json_names_both_values(tmp_path, llama_dir):
    with pytest.raises(UserError, match=r"'model.num_layers' is 4, but .*config.json says 2"):
        check(llama_dir, "model.num_layers=4")
    check(llama_dir, "model.num_layers=2", "model.dtype=bfloat16", "model.remat=full")  # agreeing or free keys


@pytest.mark.parametrize(
    "option, message",
    [
        ("model.sliding_window=2", r"'model.sliding_window' is 2, but .*config.json leaves it at None"),
        ("model.moe={num_experts: 2, top_k: 1}", r"'model.moe' is \{'num_experts': 2, 'top_k': 1\}, but .*leaves it"),
        ("model.logit_softcap=30.0", r"'model.logit_softcap' is 30.0, but .*config.json leaves it at None"),
    ],
)
def test_a_shape_key_that_config_json_leaves_at_its_default_is_refused(llama_dir, option, message):
    """A window on a Llama computed another function than its weights were trained for, silently (eval loss
    5.845 against 5.894); experts on a dense model failed later, naming a tensor."""
    with pytest.raises(UserError, match=message):
        check(llama_dir, option)
    check(llama_dir, "model.sliding_window=null", "model.attention=core", "model.max_positions=128")  # free keys


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, llama_dir):
    target = broken(tmp_path, llama_dir)
    (target / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "vocab_size": 200}))
    rewrite(target, lambda t: t.update({
        "model.embed_tokens.weight": t["model.embed_tokens.weight"][:200], "lm_head.weight": t["lm_head.weight"][:200],
    }))  # fmt: skip
    with pytest.raises(UserError, match=r"tokenizer.json: the tokenizer has 280 tokens, more than the 200 rows"):
        check(target)


def test_broken_directories_stop_nnx_train_before_the_work_dir_is_written_and_run_no_code(tmp_path, llama_dir):
    target = broken(tmp_path, llama_dir)
    marker = tmp_path / "ran"
    (target / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (target / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "auto_map": {"AutoModel": "modeling_evil.M"}}))
    (tmp_path / "text.txt").write_text("the quick brown fox " * 200)
    config = tmp_path / "ft.yaml"
    config.write_text(
        f"model: {{name: transformer_lm, pretrained: {target}}}\ndata: {{source: text.txt, text_key: text}}\n"
    )
    result = cli("nnx-train", config, "--workdir", "run", cwd=tmp_path)
    assert_user_error(result, "auto_map", "never does")
    assert not marker.exists()
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


# The Hugging Face Hub cache
# --------------------------------------------------------------------------------------------------------------


def test_a_hub_id_offline_and_not_cached_says_so(tmp_path):
    result = cli("nnx-inspect", "nnx-test/not-cached", cwd=tmp_path)
    assert_user_error(result, "TARGET: 'nnx-test/not-cached'", "cannot be reached", "hf download", "give DIR",
                      f"is no work dir, model dir or GGUF file under {tmp_path} (a relative")  # fmt: skip
    assert "model.pretrained" not in result.stderr  # the user gave a TARGET, not that key


def test_a_mistyped_work_dir_that_reads_as_a_hub_id_is_said_of_the_target_with_the_close_local_one(tmp_path):
    (tmp_path / "runs" / "digits_vae" / "checkpoints").mkdir(parents=True)
    for command in (
        ["nnx-eval", "run/digits_vae"],
        ["nnx-export", "run/digits_vae", "--format", "gguf", "--out", "x.gguf"],
    ):
        result = cli(*command, cwd=tmp_path)
        assert_user_error(result, "TARGET: 'run/digits_vae' is no work dir, model dir or GGUF file under",
                          "(did you mean 'runs/digits_vae'?)")  # fmt: skip


class _NoSuchFile(http.server.BaseHTTPRequestHandler):
    """A Hugging Face Hub whose repositories hold no file."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args) -> None:
        pass


def test_a_hub_id_not_cached_says_the_hub_is_asked_before_the_wait(tmp_path):
    """Online, an uncached id is looked up on the Hub: a line says so first (without a network the Hub client's
    retries take about 25 s); offline (the test above) the lookup fails at once and nothing is announced."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchFile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        result = cli("nnx-inspect", "nnx-test/not-there", cwd=tmp_path, extra_env=hub)
    finally:
        server.shutdown()
    assert result.returncode == 2 and "Traceback" not in result.stderr
    notice, error = result.stderr.strip().splitlines()
    assert (
        notice == "notice: Hub model 'nnx-test/not-there' is not in the local Hugging Face cache: asking the Hub for it"
    )
    assert error == "error: TARGET: Hub model 'nnx-test/not-there' has no config.json"
    offline = cli("nnx-inspect", "nnx-test/not-there", cwd=tmp_path)
    assert "notice" not in offline.stderr


def test_a_cached_hub_model_is_read_offline(tmp_path, llama_dir):
    snapshot = tmp_path / "hf" / "hub" / "models--nnx-test--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(llama_dir, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    result = cli("nnx-inspect", "nnx-test/tiny-llama", "--json", cwd=tmp_path)  # HF_HOME=tmp/hf, offline
    assert result.returncode == 0, result.stderr
    count = sum(int(np.prod(t.shape)) for t in write_model_dir(tmp_path / "again", LLAMA_CONFIG).values())
    assert json.loads(result.stdout)["total_params"] == count


def test_stops_are_generation_configs_ids_when_it_is_there_else_config_jsons_never_the_tokenizers(tmp_path):
    directory = tmp_path / "llama"
    shutil.copytree(fixture("llama"), directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    config = json.loads((directory / "config.json").read_text())

    def stops() -> tuple[tuple[int, ...], tuple[int, ...]]:
        hf.pretrained_tokenizer.cache_clear()
        tokenizer = hf.pretrained_tokenizer(str(directory))
        return tokenizer.stop_ids, tokenizer.chat_stop_ids

    eos = hf.pretrained_tokenizer(str(directory)).token_id(
        json.loads((directory / "tokenizer_config.json").read_text())["eos_token"]
    )
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": None}))
    assert stops() == ((), (eos,))  # transformers' generate reads no other file then: it stops nowhere
    (directory / "generation_config.json").unlink()
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": [7, 9]}))
    assert stops() == ((7, 9), (7, 9, eos))


def test_a_stored_head_of_other_values_is_read_untied_whatever_tie_word_embeddings_says(tmp_path, llama_dir, capfd):
    from safetensors.numpy import load_file, save_file

    target = broken(tmp_path, llama_dir)  # untied: its lm_head.weight differs from the embedding
    (target / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "tie_word_embeddings": True}))
    got, untied = loaded(target), loaded(llama_dir)
    assert np.array_equal(got["head/kernel"], untied["head/kernel"])  # as transformers 5 reads it
    assert "lm_head.weight of other values; it is read untied" in capfd.readouterr().err
    hf.open_pretrained.cache_clear()
    for shard in target.glob("*.safetensors"):  # the same head as the embedding: tied, one table
        tensors = load_file(shard)
        if "lm_head.weight" in tensors:
            tensors.pop("lm_head.weight")
            save_file(tensors, shard, metadata={"format": "pt"})
    tensors = {k: v for shard in target.glob("*.safetensors") for k, v in load_file(shard).items()}
    save_file(
        {"lm_head.weight": tensors["model.embed_tokens.weight"]}, target / "head.safetensors", metadata={"format": "pt"}
    )
    index = json.loads((target / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "head.safetensors"
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "head/kernel" not in loaded(target)
