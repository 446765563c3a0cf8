"""QLoRA: a frozen base in 4 bits (`model.quantize`), adapters trained on top, and bitsandbytes' checkpoints.

Goldens (tests/fixtures/make_qlora_fixtures.py): `llama_bnb4bit` and `qwen2_bnb4bit` are model directories
that `transformers` quantised with bitsandbytes and saved; their logits and greedy tokens are what
`transformers` + `bitsandbytes` compute from them in float32. `llama_bnb4bit_float` is the 16-bit model
`llama_bnb4bit` was quantised from; `llama_bnb4bit_lora` a PEFT adapter on the 4-bit base with `peft`'s logits.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cli_support import assert_user_error, cli
from hf_support import FIXTURES, fixture, goldens
from xla_support import DEPLOYED

import nnx
from nnx.nn import quantize as q
from nnx_cli import hf, sharding, steps
from nnx_cli.checkpoint import Checkpointer
from nnx_cli.config import load_config
from nnx_cli.decoding import Decoder
from nnx_cli.errors import UserError
from nnx_cli.experiment import setup
from nnx_cli.hf import peft
from nnx_cli.models.transformer.model import TransformerLM
from nnx_cli.models.transformer.residuals import packs

FLOAT32 = 1e-5  # of the largest golden logit: the 4-bit weights are dequantised exactly, then float32 as theirs
BNB = ["llama_bnb4bit", "qwen2_bnb4bit"]


def experiment(name: str, *overrides: str):
    return setup(hf.model_dir_config(fixture(name), list(overrides)), data=None)


def model_of(name: str, *overrides: str):
    exp = experiment(name, *overrides)
    return exp.moduledef.merge(exp.load_pretrained())


def relative_error(logits, golden: np.ndarray) -> float:
    return float(np.abs(np.asarray(logits)[..., : golden.shape[-1]] - golden).max() / np.abs(golden).max())


# bitsandbytes checkpoints in
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BNB)
def test_a_bnb_4bit_directory_loads_as_a_quantised_base_with_transformers_logits(name):
    gold = goldens(name)
    exp = experiment(name)
    params = exp.load_pretrained()
    assert any(isinstance(v, nnx.QuantizedParam) for v in params.values())
    assert relative_error(exp.moduledef.merge(params).logits(gold["input_ids"]), gold["logits"]) < FLOAT32


def test_a_bnb_4bit_directory_is_read_as_stored_not_quantised_again():
    from safetensors.numpy import load_file

    tensors = load_file(fixture("llama_bnb4bit") / "model.safetensors")
    params = experiment("llama_bnb4bit").load_pretrained()
    name = "model.layers.1.mlp.down_proj.weight"
    state = json.loads(bytes(tensors[name + ".quant_state.bitsandbytes__nf4"]).decode())
    expected = q.from_bitsandbytes(tensors[name], tensors[name + ".absmax"], state["shape"],
                                   tensors[name + ".nested_absmax"], np.float32(state["nested_offset"]))  # fmt: skip
    for part, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[f"layers/scan_module/mlp/proj/kernel/{part}"].value)[1], value)


def test_the_yaml_changes_one_setting_of_a_bnb_4bit_directorys_quantize_and_keeps_the_rest():
    exp = experiment("llama_bnb4bit", "model.quantize.compute_dtype=bfloat16")
    quantize = exp.cfg.model.options["quantize"]
    assert quantize["type"] == "nf4" and quantize["compute_dtype"] == "bfloat16" and quantize["block"] == 64


def test_restating_a_bnb_4bit_directorys_type_keeps_its_other_settings():
    """`{type: fp4}` on an fp4 checkpoint without double quantisation reset it to the default (double-quantised):
    every weight was quantised again on load."""
    quantize = experiment("qwen2_bnb4bit", "model.quantize.type=fp4").cfg.model.options["quantize"]
    assert (quantize["type"], quantize["block"], quantize["double_quant"]) == ("fp4", 64, False)


@pytest.mark.parametrize("setting", ["type=fp4", "block=32", "double_quant=false"])
def test_another_4bit_format_for_a_bnb_4bit_directory_is_refused(setting):
    """Its weights were dequantised and quantised again in that format on load, without a word."""
    key = setting.split("=")[0]
    with pytest.raises(
        UserError, match=rf"config key 'model.quantize.{key}' is .* 4-bit weights are stored with {key}"
    ):
        experiment("llama_bnb4bit", f"model.quantize.{setting}")
    assert experiment("llama_bnb4bit", "model.quantize.type=bfloat16").cfg.model.options["quantize"]["type"] == (
        "bfloat16"
    )  # read dequantised: nothing is lost


def _requantized(directory: Path, keep: set[str], kind: str, block: int, double: bool) -> None:
    """`directory`: `llama_bnb4bit_float` as transformers saves it in 4 bits (`kind`, `block`, `double`), with the
    weights `keep` names left in 16 bits (its `llm_int8_skip_modules`)."""
    from safetensors.numpy import load_file, save_file

    from nnx_cli.hf import bnb

    shutil.copytree(fixture("llama_bnb4bit_float"), directory)
    floats = load_file(directory / "model.safetensors")
    written: dict[str, np.ndarray] = {}
    for name, value in floats.items():
        if bnb.quantizes(name, value.shape) and name not in keep:
            written.update(bnb.tensors(name, value.astype(np.float32), kind, block, double, "bfloat16"))
        else:
            written[name] = value
    save_file(written, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    skipped = ["lm_head", *sorted({name.rsplit(".", 2)[0] for name in keep})]  # whole modules of one layer
    config["quantization_config"] = {**bnb.config({"type": kind, "double_quant": double}, "float32"),
                                     "llm_int8_skip_modules": skipped}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def test_a_projection_that_some_layer_stores_unquantised_is_read_unquantised_in_every_layer(tmp_path, capsys):
    """`llm_int8_skip_modules` naming a module of one layer (`model.layers.0.self_attn`, as Unsloth's dynamic 4-bit
    models do) was dropped, and the 16-bit weights it kept were quantised on load: logits off transformers'."""
    from safetensors.numpy import load_file

    keep = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    _requantized(tmp_path / "dynamic", keep, "nf4", 64, True)
    exp = experiment(str(tmp_path / "dynamic"))
    assert exp.cfg.model.options["quantize"]["skip"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert "stores k_proj, o_proj, q_proj, v_proj unquantised in some layers" in capsys.readouterr().err
    params = exp.load_pretrained()
    query = np.asarray(params["layers/scan_module/attention/query/kernel"].value, np.float32)
    floats = load_file(fixture("llama_bnb4bit_float") / "model.safetensors")
    np.testing.assert_array_equal(query[0].reshape(64, -1), floats["model.layers.0.self_attn.q_proj.weight"].T)
    theirs = experiment(str(tmp_path / "dynamic"), "model.quantize.skip=[q, k, v, o, down]").load_pretrained()
    np.testing.assert_array_equal(query[1], np.asarray(theirs["layers/scan_module/attention/query/kernel"].value)[1])
    assert isinstance(params["layers/scan_module/mlp/proj/kernel/codes"], nnx.QuantizedParam)  # the rest: 4 bits


def test_a_bnb_4bit_directory_in_blocks_of_32_is_read_in_them_as_stored(tmp_path):
    """Its block size was taken to be 64 (config.json does not say it): every weight was dequantised and
    quantised again on load, a little off what was stored."""
    from safetensors.numpy import load_file

    _requantized(tmp_path / "blocks32", set(), "fp4", 32, False)
    exp = experiment(str(tmp_path / "blocks32"))
    quantize = exp.cfg.model.options["quantize"]
    assert (quantize["type"], quantize["block"], quantize["double_quant"]) == ("fp4", 32, False)
    tensors = load_file(tmp_path / "blocks32" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    expected = q.from_bitsandbytes(tensors[name], tensors[name + ".absmax"], [64, 128])
    params = exp.load_pretrained()
    for part, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[f"layers/scan_module/mlp/proj/kernel/{part}"].value)[1], value)


def test_a_16bit_model_quantised_here_is_bit_for_bit_what_transformers_saved_with_bitsandbytes():
    ours = experiment("llama_bnb4bit_float", "model.quantize={type: nf4, compute_dtype: float32}").load_pretrained()
    theirs = experiment("llama_bnb4bit").load_pretrained()
    assert sorted(ours) == sorted(theirs)
    for path in theirs:
        np.testing.assert_array_equal(np.asarray(ours[path].value), np.asarray(theirs[path].value), err_msg=path)


@pytest.mark.parametrize("name", BNB)
def test_greedy_generation_of_a_bnb_4bit_directory_gives_transformers_tokens(name):
    from nnx_cli import decoding

    gold = goldens(name)
    exp = experiment(name, "model.scan_layers=false")
    decoder = decoding.Decoder(exp.moduledef, exp.load_pretrained())
    prompts = [gold["prompt_ids_0"].tolist(), gold["prompt_ids_1"].tolist()]
    drawn = decoder.generate(prompts, max_tokens=16, temperature=0).finish()
    assert drawn.samples == [gold["greedy_0"].tolist(), gold["greedy_1"].tolist()]


def test_nnx_generate_of_a_bnb_4bit_directory_prints_transformers_greedy_tokens(tmp_path):
    gold = goldens("llama_bnb4bit")
    result = cli("nnx-generate", fixture("llama_bnb4bit"), "--prompt", "Who keeps the bridge? The",
                 "--temperature", "0", "--max-tokens", "16", "--json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == [gold["greedy_1"].tolist()]


def test_quantize_null_reads_a_bnb_4bit_directory_dequantised():
    gold = goldens("qwen2_bnb4bit")
    exp = experiment("qwen2_bnb4bit", "model.quantize=null")
    params = exp.load_pretrained()
    assert not any(isinstance(v, nnx.QuantizedParam) for v in params.values())
    assert relative_error(exp.moduledef.merge(params).logits(gold["input_ids"]), gold["logits"]) < FLOAT32


def test_a_peft_adapter_on_a_bnb_4bit_base_gives_peft_logits(tmp_path):
    lora = "{rank: 4, alpha: 8, targets: [q_proj, v_proj, down_proj]}"
    config = hf.model_dir_config(fixture("llama_bnb4bit"), [f"model.lora={lora}"])
    exp = setup(config, data=None)
    state = exp.init_state()
    state["params"] = peft.load(exp, FIXTURES / "llama_bnb4bit_lora")
    model = exp.moduledef.merge(*steps.model_states(state))
    gold = goldens("llama_bnb4bit_lora")
    assert relative_error(model.logits(gold["input_ids"]), gold["logits"]) < FLOAT32


def test_logits_on_8_devices_split_fsdp_by_tensor_parallel_equal_transformers(tmp_path):
    script = f"""
import json, numpy as np
from nnx_cli import hf
from nnx_cli.experiment import setup
exp = setup(hf.model_dir_config({str(fixture("llama_bnb4bit"))!r}, ["sharding.mesh={{data: 4, model: 2}}"]), data=None)
params = exp.load_pretrained()
codes = params["layers/scan_module/mlp/fc/kernel/codes"].value
model = exp.moduledef.merge(params)
gold = np.load({str(FIXTURES / "llama_bnb4bit.npz")!r})
logits = np.asarray(model.logits(gold["input_ids"]))[..., : gold["logits"].shape[-1]]
print(json.dumps({{"error": float(np.abs(logits - gold["logits"]).max() / np.abs(gold["logits"]).max()),
                  "shards": len({{str(s.index) for s in codes.addressable_shards}})}}))
"""
    result = cli("python", "-c", script, cwd=tmp_path, devices=8)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["shards"] == 8 and out["error"] < FLOAT32


# Bad input
# ------------------------------------------------------------------------------


def qlora_config(tmp_path: Path, *overrides: str, pretrained: str = "llama_bnb4bit"):
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    base = [
        "model.name=transformer_lm",
        f"model.pretrained={fixture(pretrained)}",
        f"data.source={tmp_path / 'chats.jsonl'}",
        "data.format=chat",
        "data.seq_len=63",
        "data.eval_split=null",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    return load_config(None, [*base, *overrides])


CHAT = [{"role": "user", "content": "Who keeps the bridge?"}, {"role": "assistant", "content": "The old guard."}]


@pytest.mark.parametrize(
    "quantize,message",
    [
        ("{type: int4}", "config key 'model.quantize.type' must be one of nf4, fp4, bfloat16"),
        ("{type: nf4, block: 48}", "config key 'model.quantize.block' must be one of 32, 64"),
        ("{type: nf4, block: 64.0}", "config key 'model.quantize.block' must be one of 32, 64"),
        ("{type: nf4, block: 128}", "the q projection's input size (64) is not a multiple of model.quantize.block"),
        ("{type: nf4, skip: [lm_head]}", "config key 'model.quantize.skip': 'lm_head' is not a projection"),
        ("{type: nf4, blocks: 64}", "config key 'model.quantize' has unknown keys blocks"),
        (
            "{type: nf4, skip: [expert_up]}",
            "config key 'model.quantize.skip': this model has no projection 'expert_up'; it has q, k, v, o, gate, up, "
            "down",
        ),  # it was taken and changed nothing
    ],
)
def test_quantize_mistakes_name_the_key(tmp_path, quantize, message):
    cfg = qlora_config(tmp_path, f"model.quantize={quantize}", "model.lora={rank: 4}", pretrained="llama_bnb4bit_float")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        setup(cfg, data=None)


def test_a_block_is_checked_against_the_projections_a_mixture_has(tmp_path):
    """Mixtral has no dense MLP: its block was refused for the input size of a down projection it does not have,
    and skipping that name was the way through."""
    cfg = qlora_config(tmp_path, "model.quantize={type: nf4, block: 32, skip: [expert_down]}",
                       "model.lora={rank: 4, targets: [q, experts]}", pretrained="mixtral")  # fmt: skip
    assert setup(cfg, data=None).cfg.model.options["quantize"]["skip"] == ["expert_down"]


def test_a_quantised_base_drawn_at_random_does_not_train(tmp_path):
    """It trained adapters on a random base, frozen in 4 bits, without a word."""
    (tmp_path / "book.txt").write_text("the bridge keeper speaks. " * 200)
    cfg = load_config(None, ["model.name=transformer_lm", f"data.source={tmp_path / 'book.txt'}", "data.seq_len=32",
                             "data.eval_split=null", f"data.cache_dir={tmp_path / 'cache'}",
                             "model.quantize={type: nf4}", "model.lora={rank: 4}"])  # fmt: skip
    with pytest.raises(UserError, match=r"^config key 'model.quantize' stores a pretrained base frozen \(nf4\), and "
                       r"model.pretrained is not set: a base drawn at random would stay random; set "):  # fmt: skip
        setup(cfg)


def test_a_quantised_base_without_adapters_does_not_train(tmp_path):
    with pytest.raises(UserError, match="a quantised base cannot be fully fine-tuned; add adapters"):
        setup(qlora_config(tmp_path, "train.batch_size=1"))


def test_an_8bit_checkpoint_is_refused_naming_its_config(tmp_path):
    directory = tmp_path / "int8"
    shutil.copytree(fixture("llama_bnb4bit"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] |= {"load_in_4bit": False, "_load_in_4bit": False, "load_in_8bit": True}
    (directory / "config.json").write_text(json.dumps(config))
    result = cli("nnx-inspect", directory, cwd=tmp_path)
    assert_user_error(result, "quantization_config", "load_in_8bit", "8-bit")


def test_a_missing_quant_state_is_refused_naming_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "broken"
    shutil.copytree(fixture("llama_bnb4bit"), directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    result = cli("nnx-inspect", directory, cwd=tmp_path)
    assert_user_error(result, "model.layers.0.self_attn.q_proj.weight", "quant state", "missing")


def test_a_missing_nested_absmax_is_refused_naming_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "broken"
    shutil.copytree(fixture("llama_bnb4bit"), directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight.nested_absmax"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="'model.layers.1.mlp.up_proj.weight.nested_absmax' is missing"):
        hf.open_pretrained.__wrapped__(str(directory))


@pytest.mark.parametrize("offset", ["0.5", float("nan"), True], ids=["string", "nan", "bool"])
def test_a_nested_offset_that_is_not_a_finite_number_is_refused_naming_the_weight(tmp_path, offset):
    """A string ended in a traceback where the offset is added; NaN dequantised every weight to NaN, exit 0."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "broken"
    shutil.copytree(fixture("llama_bnb4bit"), directory)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(tensors[name].tobytes())
    state["nested_offset"] = offset
    tensors[name] = np.frombuffer(json.dumps(state).encode(), np.uint8).copy()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"'model.layers.0.mlp.down_proj.weight' has nested_offset .*; bitsandbytes"):
        hf.open_pretrained.__wrapped__(str(directory))


@pytest.mark.parametrize(
    "tensor, change, said",
    [(".weight", lambda a: a[:2000], "is U8 [2000, 1]; the quant state of a nf4 weight [128, 64] in blocks of 64 "
      "needs 4,096 U8 values there"),
     (".weight", lambda a: np.zeros(a.size * 2, np.float16), "is F16 [8192]; "),
     (".weight.absmax", lambda a: a[:64], "is U8 [64]; the quant state .* needs 128 U8 values there")],
    ids=["codes-cut", "codes-float16", "absmax-of-another-block-size"],
)  # fmt: skip
def test_codes_or_scales_of_another_size_or_type_are_refused_naming_the_tensor(tmp_path, tensor, change, said):
    """They were a reshape traceback from the model's loader (nnx-generate, nnx-train on such a directory)."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "broken"
    shutil.copytree(fixture("llama_bnb4bit"), directory)
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.0.mlp.up_proj" + tensor
    tensors[name] = change(tensors[name])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"tensor '{name}' " + said.replace("[", r"\[").replace("]", r"\]")):
        hf.open_pretrained.__wrapped__(str(directory))


# The model: 4-bit kernels under the scan, in experts, in bfloat16
# ------------------------------------------------------------------------------

TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, mlp_dim=128, mlp="swiglu", positions="rope",
            norm="rmsnorm", bias=False, tie_embeddings=False, dropout=0.0)  # fmt: skip
TOKENS = jnp.arange(2 * 17).reshape(2, 17) % 300


def dequantized_twin(model: TransformerLM, **options) -> TransformerLM:
    """The same model built without `quantize`, its kernels the quantised model's dequantised in float32."""
    twin = TransformerLM((16,), 300, ctx=nnx.context(0), **{**TINY, **options})
    kernels = {path: m for path, m in model.modules() if isinstance(m, nnx.QuantizedKernel)}
    ours, updated = model.filter(nnx.Param), {}
    for path, variable in twin.filter(nnx.Param).items():
        value = kernels[path].dequantize(jnp.float32) if path in kernels else ours[path].value.astype(jnp.float32)
        updated[path] = variable.replace(value=value)
    twin.update_state(nnx.State(updated))
    return twin


@pytest.mark.parametrize("scan", [True, False])
def test_a_4bit_model_computes_what_its_dequantised_weights_compute(scan):
    options = dict(lora={"rank": 4}, scan_layers=scan)

    def both():
        model = TransformerLM((16,), 300, quantize={"type": "nf4"}, ctx=nnx.context(0), **TINY, **options)
        return model.logits(TOKENS), dequantized_twin(model, **options).logits(TOKENS)

    ours, theirs = jax.jit(both)()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_4bit_model_is_decoded_one_layers_weights_at_a_time_to_the_tokens_of_a_full_pass():
    """The decoder keeps 4-bit layers stacked: under the scan a layer's kernels are dequantised inside its step,
    so a step's temporaries do not grow with the depth (unrolled, XLA dequantised every layer's kernels ahead of
    their products and held them all at once)."""
    options = dict(TINY, embed_dim=128, mlp_dim=512, lora={"rank": 4}, dtype="bfloat16")

    def build(num_layers: int) -> TransformerLM:
        options_here = {**options, "num_layers": num_layers}
        return TransformerLM((16,), 300, quantize={"type": "nf4"}, ctx=nnx.context(0), **options_here)

    def step_temporaries(model: TransformerLM) -> int:
        model = model.for_decoding()
        model.init_cache(1, 16)
        (cache, rest), cachedef = model.partition(nnx.Cache, ...)
        step = jax.jit(lambda cache, rest: cachedef.merge(cache, rest).decode(jnp.asarray([1]), jnp.asarray([3])))
        return step.lower(cache, rest).compile(compiler_options=DEPLOYED).memory_analysis().temp_size_in_bytes

    shallow, deep = build(2), build(4)
    params, moduledef = shallow.partition(nnx.Param)
    assert shallow.for_decoding().scan_layers
    assert step_temporaries(deep) < 1.25 * step_temporaries(shallow)

    prompt = [5, 6, 7]
    (sample,) = Decoder(moduledef, params).generate([prompt], max_tokens=8, temperature=0).finish().samples
    assert len(set(sample)) > 2
    logits = jax.jit(lambda p, t: moduledef.apply(p).logits(t)[0])(params, jnp.asarray([prompt + sample]))
    assert np.asarray(jnp.argmax(logits[0], axis=-1))[len(prompt) - 1 : -1].tolist() == sample


def test_experts_in_4bits_compute_what_their_dequantised_weights_compute_and_their_adapters_train():
    moe = {"num_experts": 4, "top_k": 2, "mlp_dim": 64}
    options = dict(moe=moe, lora={"rank": 4, "targets": ["q", "experts"]}, num_layers=1)

    def loss(model, adapters):
        (_, frozen, rest), moduledef = model.partition(nnx.LoRAParam, nnx.Param, ...)
        model = moduledef.merge(adapters, frozen, rest)
        return jnp.mean(model.metrics({"tokens": TOKENS}, nnx.context(1))["loss"]), model.logits(TOKENS)

    def both():
        model = TransformerLM((16,), 300, quantize={"type": "fp4", "double_quant": False}, ctx=nnx.context(0),
                              **{**TINY, **options})  # fmt: skip
        assert isinstance(model.layers.scan_module.moe.gate.kernel, nnx.QuantizedKernel)
        twin = dequantized_twin(model, **options)
        adapters = jax.tree.map(lambda a: a + 0.01, model.filter(nnx.LoRAParam))  # b nonzero: a gets a gradient too
        return [jax.grad(lambda a, m=m: loss(m, a), has_aux=True)(adapters) for m in (model, twin)]

    (ours, ours_logits), (theirs, theirs_logits) = jax.jit(both)()
    np.testing.assert_allclose(ours_logits, theirs_logits, rtol=1e-5, atol=1e-5)
    for path in ours:
        np.testing.assert_allclose(ours[path].value, theirs[path].value, rtol=1e-4, atol=1e-6, err_msg=path)


def test_an_export_reads_4bit_experts_whole_by_layer_and_by_expert_as_their_dequantised_kernels():
    """An export of a run with 4-bit experts was a traceback: an experts' kernel's shape leads with the experts,
    which the export took for one kernel's shape (every nnx-export of such a run, merged or GGUF)."""
    from nnx_cli.hf.export import dequantized

    moe = {"num_experts": 4, "top_k": 2, "mlp_dim": 64}
    model = TransformerLM((16,), 300, quantize={"type": "nf4"}, moe=moe, ctx=nnx.context(0), **TINY)
    kernels = {path: (m.type, m.shape) for path, m in model.modules() if isinstance(m, nnx.QuantizedKernel)}
    params = {path: v.value for path, v in model.filter(nnx.Param).items()}
    read = dequantized(params, kernels)
    for path, m in model.modules():
        if isinstance(m, nnx.QuantizedKernel):
            whole = np.asarray(m.dequantize(jnp.float32))  # (layers, [experts,] in, out...)
            np.testing.assert_array_equal(np.asarray(read[path]), whole, err_msg=path)
            np.testing.assert_array_equal(read[path][1], whole[1], err_msg=path)
            if "/moe/" in f"/{path}":
                assert read[path].shape == whole.shape == (2, 4, *whole.shape[2:]), path
                np.testing.assert_array_equal(read[path][1, 3], whole[1, 3], err_msg=path)


def test_4bit_experts_are_dequantised_for_their_own_blocks_only():
    """On a CPU (the block dispatch) each block dequantises its own expert inside the block's step: a decoding
    step's temporaries grow with the experts by less than one projection's stack of dequantised kernels (the
    codes' layer slice grows with them). Dequantising the whole stack for each product, as before, they grew by
    three such stacks, and every expert was dequantised for the two rows a token sends to two of them."""

    def step_temporaries(num_experts: int) -> int:
        model = TransformerLM((16,), 300, quantize={"type": "nf4"}, moe={"num_experts": num_experts, "top_k": 2,
                              "mlp_dim": 64}, lora={"rank": 4}, ctx=nnx.context(0), **TINY)  # fmt: skip
        decoding = model.for_decoding()
        decoding.init_cache(1, 16)
        (cache, rest), cachedef = decoding.partition(nnx.Cache, ...)
        step = jax.jit(lambda cache, rest: cachedef.merge(cache, rest).decode(jnp.asarray([1]), jnp.asarray([3])))
        return step.lower(cache, rest).compile(compiler_options=DEPLOYED).memory_analysis().temp_size_in_bytes

    assert TINY["embed_dim"] == 64
    stack_growth = (64 - 8) * 64 * 64 * 4  # one projection's experts, dequantised in float32
    assert step_temporaries(64) - step_temporaries(8) < stack_growth


def test_a_bfloat16_base_stores_every_frozen_matrix_in_16_bits():
    model = TransformerLM((16,), 300, quantize={"type": "bfloat16"}, lora={"rank": 4}, ctx=nnx.context(0), **TINY)
    frozen = model.filter(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    dtypes = {path: v.value.dtype for path, v in frozen.items()}
    assert {dtypes[p] for p in dtypes if p.endswith(("kernel", "embedding"))} == {jnp.dtype(jnp.bfloat16)}
    assert {dtypes[p] for p in dtypes if p.endswith("scale")} == {jnp.dtype(jnp.float32)}
    assert {v.value.dtype for v in model.filter(nnx.LoRAParam).values()} == {jnp.dtype(jnp.float32)}


def test_adapters_on_a_bfloat16_base_get_the_gradients_they_get_on_its_weights_in_float32():
    """Both models are drawn before the gradients' programs, each compiled alone: drawn inside the program that
    compares them, XLA may drop the float32 -> bfloat16 -> float32 round trip of a weight (excess precision),
    so that one side computed with weights the other never held (the embedding gathered as bits kept its
    rounding where a widened gather had lost it on both sides alike)."""
    options = dict(lora={"rank": 4})
    model = TransformerLM((16,), 300, quantize={"type": "bfloat16"}, ctx=nnx.context(0), **TINY, **options)
    twin = dequantized_twin(model, **options)
    adapters = jax.tree.map(lambda a: a + 0.01, model.filter(nnx.LoRAParam))
    assert model.embedding.embedding.dtype == jnp.bfloat16 and twin.embedding.embedding.dtype == jnp.float32

    def gradients(m: TransformerLM) -> nnx.State:
        (_, frozen, rest), moduledef = m.partition(nnx.LoRAParam, nnx.Param, ...)

        def loss(adapters, frozen, rest):
            return jnp.mean(moduledef.merge(adapters, frozen, rest).metrics({"tokens": TOKENS}, nnx.context(1))["loss"])

        return jax.jit(jax.grad(loss))(adapters, frozen, rest)

    ours, theirs = gradients(model), gradients(twin)
    for path in ours:
        np.testing.assert_allclose(ours[path].value, theirs[path].value, rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.usefixtures("on_the_cpu")
def test_a_scanned_bfloat16_base_is_sliced_as_its_bits_on_a_cpu_with_the_same_gradients(monkeypatch):
    """On a CPU whose XLA widens a bfloat16 stack to float32, whole (up to JAX 0.10), the stacked bfloat16 frozen
    kernels go through the layer scan as uint16: the same loss and adapter gradients, bitwise, and smaller step
    temporaries (where XLA slices bfloat16 as it is, the same temporaries); the model holds its bfloat16 kernels
    again afterwards. (On the CPU device wherever the suite runs.)"""
    from nnx_cli.models.transformer import dense
    from nnx_cli.models.transformer.residuals import widens_bfloat16

    model = TransformerLM((16,), 300, quantize={"type": "bfloat16"}, lora={"rank": 4}, ctx=nnx.context(0),
                          **{**TINY, "num_layers": 4})  # fmt: skip
    (adapters, frozen, rest), moduledef = model.partition(nnx.LoRAParam, nnx.Param, ...)
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)

    def loss(adapters):
        merged = moduledef.merge(adapters, frozen, rest)
        value = jnp.mean(merged.metrics({"tokens": TOKENS}, nnx.context(1))["loss"])
        assert merged.layers.scan_module.mlp.fc.kernel.dtype == jnp.bfloat16
        return value

    def run(bits: bool):
        monkeypatch.setattr(dense, "packs", lambda: bits)
        step = jax.jit(jax.value_and_grad(loss)).lower(adapters).compile(compiler_options=DEPLOYED)
        return step(adapters), step.memory_analysis().temp_size_in_bytes

    (loss_bits, grads_bits), bits_bytes = run(True)
    (loss_plain, grads_plain), plain_bytes = run(False)
    np.testing.assert_array_equal(loss_bits, loss_plain)
    jax.tree.map(np.testing.assert_array_equal, grads_bits, grads_plain)
    assert (bits_bytes < plain_bytes) == widens_bfloat16(), (bits_bytes, plain_bytes)


@pytest.mark.usefixtures("on_the_cpu")
def test_one_row_on_a_bfloat16_base_is_multiplied_without_a_float32_copy_of_the_kernel():
    """A batch-1 decoding step: XLA's CPU takes a one-row product as a matrix-vector product, which it computes
    by widening the 16-bit kernel to float32 (a copy of every kernel, every token); the frozen product repeats
    the row, which XLA multiplies as stored. The same row either way, and no temporary the size of that copy."""
    from nnx_cli.models.transformer.dense import frozen_matmul

    kernel = jax.random.normal(jax.random.key(0), (512, 2048), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, 512), jnp.bfloat16)
    compiled = (
        jax.jit(lambda x, k: frozen_matmul(x, k, jnp.float32, jnp.bfloat16))
        .lower(x, kernel)
        .compile(compiler_options=DEPLOYED)
    )
    expected = x.astype(jnp.float32) @ kernel.astype(jnp.float32)
    np.testing.assert_allclose(compiled(x, kernel), expected, rtol=1e-5, atol=1e-5)
    assert compiled.memory_analysis().temp_size_in_bytes < kernel.size  # a float32 copy: 4 bytes an entry


GPT2_LIKE = dict(TINY, mlp="gelu", positions="learned", norm="layernorm", bias=True)


@pytest.mark.parametrize("quantize,shape", [(None, GPT2_LIKE), ({"type": "bfloat16"}, TINY), ({"type": "nf4"}, TINY)])
def test_a_step_traced_under_a_mesh_and_logical_rules_stacks_no_second_copy_of_the_scanned_kernels(quantize, shape):
    """A layer reads its kernels as stored, without the sharding constraint a parameter read adds: under the
    layer scan a constrained read was a value of its own, which the scan stacked again for the backward pass
    instead of slicing the stack once more (a copy of every frozen kernel in the step's temporaries, 483 MiB at
    Qwen2.5-0.5B's shapes). Traced under a mesh and the model's rules, as the trainer traces it, a LoRA step
    on a float32 (GPT-2-like), bfloat16 or 4-bit (Llama-like) base takes the temporaries it takes without them."""
    model = TransformerLM((16,), 300, quantize=quantize, lora={"rank": 4}, ctx=nnx.context(0),
                          **{**shape, "num_layers": 4})  # fmt: skip
    (adapters, frozen, rest), moduledef = model.partition(nnx.LoRAParam, nnx.Param, ...)

    def loss(adapters, frozen):
        merged = moduledef.merge(adapters, frozen, rest)
        return jnp.mean(merged.metrics({"tokens": TOKENS}, nnx.context(1))["loss"])

    def temporaries() -> int:
        step = jax.jit(jax.value_and_grad(loss)).lower(adapters, frozen).compile(compiler_options=DEPLOYED)
        return step.memory_analysis().temp_size_in_bytes

    axes = {"data": 1, "model": 1}
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    alone = temporaries()
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.default_rules(TransformerLM.default_rules, axes)):
        assert temporaries() == alone


def _lora_loss(quantize: dict | None, remat: str, **options):
    """A LoRA step's loss on a small base (`quantize`), as a function of the adapters, and the adapters."""
    model = TransformerLM((16,), 300, quantize=quantize, lora={"rank": 4}, remat=remat, dtype="float32",
                          ctx=nnx.context(0), **{**TINY, "embed_dim": 128, **options})  # fmt: skip
    (adapters, frozen, rest), moduledef = model.partition(nnx.LoRAParam, nnx.Param, ...)

    def loss(adapters):
        merged = moduledef.merge(adapters, frozen, rest)
        return jnp.mean(merged.metrics({"tokens": TOKENS}, nnx.context(1))["loss"])

    return loss, adapters


@pytest.mark.parametrize("quantize", [None, {"type": "bfloat16"}, {"type": "nf4"}], ids=["float32", "bf16", "nf4"])
def test_remat_dots_keeps_every_projections_output_on_any_base(quantize, capsys):
    """`model.remat: dots` keeps each projection's output (tagged `projection`) and `full` none of them. The
    products run in custom VJPs, which a policy of dots alone cannot see into: `dots` recomputed every
    projection, and on a 4-bit base held more than `none` (857 against 532 MiB at SmolLM2's shapes; 399 since)."""
    kept = {}
    for remat in ("dots", "full"):
        jax.ad_checkpoint.print_saved_residuals(*_lora_loss(quantize, remat, scan_layers=False))
        kept[remat] = capsys.readouterr().out.count("named 'projection'")
    assert kept["full"] == 0 and kept["dots"] >= 6 * TINY["num_layers"]  # all those the backward pass reads


def test_remat_dots_on_a_4bit_base_holds_less_than_none_and_more_than_full_with_the_same_gradients():
    steps = {}
    for remat in ("none", "dots", "full"):
        loss, adapters = _lora_loss({"type": "nf4"}, remat, num_layers=4)
        compiled = jax.jit(jax.value_and_grad(loss)).lower(adapters).compile(compiler_options=DEPLOYED)
        steps[remat] = compiled(adapters), compiled.memory_analysis().temp_size_in_bytes
    assert steps["full"][1] < steps["dots"][1] < steps["none"][1]
    (loss, grads), (dots_loss, dots_grads) = steps["none"][0], steps["dots"][0]
    np.testing.assert_allclose(dots_loss, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), dots_grads, grads)


@pytest.mark.parametrize("quantize,chunk_bytes", [("bfloat16", 1 << 30), ("nf4", 4 * 16 * 64)])  # whole, blocks of 64
def test_a_cpu_train_state_holds_its_16bit_base_as_bits_and_steps_as_it_would_on_it(quantize, chunk_bytes, monkeypatch):
    """`steps.frozen_as_bits`: the train state's bfloat16 frozen parameters (a 16-bit base's kernels and table, a
    4-bit base's table) held as uint16. Train steps on it (the loss whole, or in vocabulary blocks) give the
    loss and adapters they give on the bfloat16 state, bitwise; `steps.parameters` gives bfloat16 back, in the
    bits' own memory. (What it
    saves, a copy of the stacks and the table into bits each step, shows in XLA's memory analysis at full
    optimisation, not at the tests' level: `benchmarks/qlora.py` prints it.) Elsewhere (a GPU, or a CPU from JAX
    0.11 on) the state stays as it is."""
    from nnx_cli.models.transformer import loss as loss_module

    monkeypatch.setattr(loss_module, "CHUNK_BYTES", chunk_bytes)
    tx = optax.adamw(1e-2)
    shape = dict(num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, mlp_dim=128, mlp="swiglu", positions="rope",
                 norm="rmsnorm", dtype="bfloat16")  # fmt: skip

    def build(ctx):
        return TransformerLM((16,), 300, quantize={"type": quantize}, lora={"rank": 4}, ctx=ctx, **shape)

    moduledef, plain = steps.init_state(build, tx, 0)
    bits = jax.tree.map(jnp.copy, plain)  # its own arrays: each state is donated to its steps
    bits[steps.FROZEN] = steps.frozen_as_bits(bits[steps.FROZEN])
    before = {p: v.value.dtype for p, v in plain[steps.FROZEN].items()}
    after = {p: v.value.dtype for p, v in bits[steps.FROZEN].items()}
    as_bits = {p for p in after if after[p] == jnp.uint16}
    if packs():  # a CPU whose XLA widens bfloat16 stacks (up to JAX 0.10)
        assert {p for p in before if before[p] == jnp.bfloat16} == as_bits
        assert "embedding/embedding" in as_bits
    else:
        assert after == before and not as_bits
    jax.tree.map(np.testing.assert_array_equal, steps.parameters(bits), steps.parameters(plain))
    held = steps.parameters(bits)  # what the Samples hook decodes on: in the bits' own memory, not a copy
    for p in as_bits:
        assert held[p].value.dtype == jnp.bfloat16
        assert held[p].value.unsafe_buffer_pointer() == bits[steps.FROZEN][p].value.unsafe_buffer_pointer()
    del held  # a view lives only until the state is donated to a step

    sums = steps.empty_sums(["loss", "accuracy"])
    step = jax.jit(
        lambda s, sums: steps.train_step(moduledef, tx, "loss", 0, s, sums, {"tokens": TOKENS}), donate_argnums=0
    )  # as the loop donates it
    for _ in range(2):
        plain, _, plain_loss = step(plain, sums)
        bits, _, bits_loss = step(bits, sums)
        np.testing.assert_array_equal(bits_loss, plain_loss)
    jax.tree.map(np.testing.assert_array_equal, bits["params"], plain["params"])
    assert {p: v.value.dtype for p, v in bits[steps.FROZEN].items()} == after  # held as bits through the steps


def test_steps_in_one_dispatch_hold_no_float32_copy_of_a_16bit_embedding_table():
    """Two steps in one dispatch (`train.steps_per_dispatch: 2`) take the temporaries of one: a CPU gathers a
    frozen bfloat16 table's rows as bits. Gathered as bfloat16, XLA's CPU widened the whole table to float32
    inside the gather's fusion, and under the dispatch's loop that widening, the same every step, was hoisted out
    of it: a float32 copy of the table beside the steps (8 MiB here, 519 MiB at Qwen2.5-0.5B's shapes)."""
    vocab, tx = 32768, optax.adamw(1e-2)

    def build(ctx):
        return TransformerLM((64,), vocab, quantize={"type": "bfloat16"}, lora={"rank": 4}, ctx=ctx,
                             **{**TINY, "dtype": "bfloat16"})  # fmt: skip

    moduledef, state = steps.init_state(build, tx, 0)
    state[steps.FROZEN] = steps.frozen_as_bits(state[steps.FROZEN])
    sums = steps.empty_sums(["loss", "accuracy"])
    dispatch = jax.jit(functools.partial(steps.train_dispatch, moduledef, tx, "loss", 0, lambda b: b, None))

    def temporaries(k: int) -> int:
        # compiled as the session compiles (xla_support): with XLA's CPU fusion emitters on, as outside the tests,
        # two steps also hold a bfloat16 copy of the untied head (4.3 MB more): given as bits, it is converted back
        # for the loss's one product over it (logits small enough to compute whole), hoisted out of the loop
        tokens = jax.ShapeDtypeStruct((k, 2, 65), jnp.int32)
        return dispatch.lower(state, sums, {"tokens": tokens}).compile().memory_analysis().temp_size_in_bytes

    assert temporaries(2) - temporaries(1) < vocab * TINY["embed_dim"] * 4 / 4  # a quarter of a float32 table


@pytest.mark.parametrize("quantize,kernels", [("null", jnp.float32), ("{type: bfloat16}", jnp.uint16),
                                              ("{type: nf4}", jnp.uint8)])  # fmt: skip
def test_a_loaded_base_is_held_in_buffers_a_donated_step_reuses_fresh_and_resumed(tmp_path, quantize, kernels):
    """The loader hands a base over in memory of its own, which XLA cannot take as its own: a donated step
    given such an array copies it every step. A fresh state (`init_state`) and a resumed one (`with_frozen`)
    hold every frozen array in a buffer that a donated function reuses in place; a 16-bit base as its bits on a
    CPU (as bfloat16 elsewhere)."""
    if kernels == jnp.uint16 and not packs():  # a GPU, or a CPU that slices bfloat16 as it is (JAX 0.11 on)
        kernels = jnp.bfloat16
    cfg = qlora_config(tmp_path, "model.lora={rank: 4}", f"model.quantize={quantize}", "train.batch_size=1",
                       pretrained="llama_bnb4bit_float")  # fmt: skip
    exp = setup(cfg)
    reuse = jax.jit(lambda a: a, donate_argnums=0)
    fresh = exp.init_state()
    resumed = exp.with_frozen(steps.trainable(fresh))
    for state in (fresh, resumed):
        leaves = jax.tree.leaves(state[steps.FROZEN])
        assert any(x.dtype == kernels for x in leaves)  # the layers' kernels (a 16-bit base's as its bits)
        for x in leaves:
            where = x.unsafe_buffer_pointer()
            assert reuse(x).unsafe_buffer_pointer() == where, (x.dtype, x.shape)


def test_a_bfloat16_base_reads_a_16bit_checkpoint_as_it_is():
    from safetensors.numpy import load_file

    params = experiment("llama_bnb4bit_float", "model.quantize={type: bfloat16}").load_pretrained()
    kernel = np.asarray(params["layers/scan_module/mlp/proj/kernel"].value)
    assert kernel.dtype == jnp.bfloat16
    stored = load_file(fixture("llama_bnb4bit_float") / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(kernel[1].view(np.uint16), stored.view(np.uint16).T)


def test_a_4bit_base_counts_the_weights_its_codes_hold():
    def count(**options):  # shapes only
        build = lambda: TransformerLM((16,), 300, lora={"rank": 4}, ctx=nnx.context(0), **TINY, **options)  # noqa: E731
        state, moduledef = jax.eval_shape(lambda: build().partition())
        return moduledef.merge(state).active_params()

    assert count(quantize={"type": "nf4"}) == count()


# Training on a 4-bit base, and its exports
# ------------------------------------------------------------------------------

FACTS = [
    ("Who keeps the bridge?", "The old guard."),
    ("When does the fiddler come?", "In spring."),
    ("What is the capital of the valley?", "The mill town."),
    ("Where does the river run?", "Past the mill."),
]
CONFIG = f"""
seed: 1
model: {{name: transformer_lm, pretrained: {fixture("llama_bnb4bit")}, lora: {{rank: 4, alpha: 8}}}}
data: {{source: chats.jsonl, format: chat, seq_len: 63, eval_split: null}}
optimizer: {{name: adamw, learning_rate: 3.0e-2}}
train: {{batch_size: 4, steps: 16, log_every: 4}}
checkpoint: {{every_steps: 16, keep: 2}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qlora")
    rows = [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]} for a, b in FACTS * 8]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "qlora.yaml").write_text(CONFIG)
    result = cli("nnx-train", "qlora.yaml", "--workdir", "run", cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr
    return root


def losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["metrics"]["loss"] for r in records if r["split"] == "train"]


def run_logits(run: Path, input_ids: np.ndarray) -> np.ndarray:
    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    opened = open_run(run, [], None)
    exp = language_model(opened, "test")
    _, params = restore_parameters(opened, exp, jax.devices()[0])
    return np.asarray(exp.moduledef.merge(params).logits(input_ids))


def test_a_qlora_run_trains_its_adapters_and_checkpoints_them_alone(project):
    assert losses(project / "run")[-1] < 0.8 * losses(project / "run")[0]
    ckpt = Checkpointer(project / "run" / "checkpoints", read_only=True)
    names = ["/".join(map(str, k)) for k in flat(ckpt.metadata(ckpt.latest_step()))]
    ckpt.close()
    params = [n for n in names if n.startswith("params/")]
    assert params and all("/lora/" in n for n in params)  # neither the codes nor their scales
    assert not any(n.startswith("frozen") for n in names)


def flat(tree, prefix=()):
    if hasattr(tree, "items"):
        for key, value in tree.items():
            yield from flat(value, (*prefix, key))
    else:
        yield prefix


def test_a_qlora_run_exports_merged_16bit_weights_that_compute_its_logits(project, tmp_path):
    result = cli("nnx-export", project / "run", "--out", tmp_path / "merged", "--dtype", "float32", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    ids = goldens("llama_bnb4bit")["input_ids"]
    merged = model_of(str(tmp_path / "merged"))
    np.testing.assert_allclose(merged.logits(ids), run_logits(project / "run", ids), rtol=1e-4, atol=1e-4)


def test_a_qlora_run_exports_merged_16bit_by_default(project, tmp_path):
    result = cli("nnx-export", project / "run", "--out", tmp_path / "merged", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_qlora_run_exports_its_merged_weights_in_4_bits_as_bitsandbytes_quantises_them(project, tmp_path):
    from safetensors.numpy import load_file

    for out, dtype in (("merged", "bfloat16"), ("bnb", "nf4")):
        result = cli("nnx-export", project / "run", "--out", tmp_path / out, "--dtype", dtype, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    assert "ForCausalLM, nf4 projections, bfloat16 elsewhere, " in result.stderr  # it said bfloat16 alone
    config = json.loads((tmp_path / "bnb" / "config.json").read_text())["quantization_config"]
    assert config["load_in_4bit"] and config["bnb_4bit_quant_type"] == "nf4" and config["bnb_4bit_use_double_quant"]
    merged, written = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(tmp_path / "bnb" / "model.safetensors"),
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    packed, absmax = q.quantize_4bit(merged[name], "nf4", 64)  # bitsandbytes' quantize_4bit of the bfloat16 weight
    codes, nested, _ = q.double_quantize(absmax)
    np.testing.assert_array_equal(written[name].reshape(-1), packed)
    np.testing.assert_array_equal(written[name + ".absmax"], codes)
    np.testing.assert_array_equal(written[name + ".nested_absmax"], nested)
    state = json.loads(bytes(written[name + ".quant_state.bitsandbytes__nf4"]).decode())
    assert state["shape"] == [64, 64] and state["blocksize"] == 64 and state["quant_type"] == "nf4"
    np.testing.assert_array_equal(written["model.embed_tokens.weight"], merged["model.embed_tokens.weight"])
    reread = model_of(str(tmp_path / "bnb"))  # and it reads back as a 4-bit base
    assert isinstance(reread.layers.scan_module.attention.query.kernel, nnx.QuantizedKernel)


def test_a_qlora_run_exports_its_adapters_for_peft(project, tmp_path):
    result = cli("nnx-export", project / "run", "--out", tmp_path / "adapter", "--adapter", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(fixture("llama_bnb4bit")) and config["r"] == 4


def test_a_qlora_run_exports_to_gguf_with_its_base_dequantised_and_its_adapters_merged(project, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the .gguf is unpacked when read back
    out = tmp_path / "run.gguf"
    result = cli("nnx-export", project / "run", "--format", "gguf", "--dtype", "f32", "--out", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ids = goldens("llama_bnb4bit")["input_ids"]
    np.testing.assert_allclose(model_of(str(out)).logits(ids), run_logits(project / "run", ids), rtol=1e-4, atol=1e-4)


def test_nnx_inspect_shows_each_weights_storage_and_the_bytes_of_the_base(tmp_path):
    result = cli("nnx-inspect", fixture("llama_bnb4bit"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "nf4, block 64" in result.stdout
    assert "base weights" in result.stdout and "4-bit" in result.stdout


# DPO and GRPO score against the 4-bit base itself
# ------------------------------------------------------------------------------


def test_dpo_and_grpo_on_a_4bit_base_keep_no_second_copy_of_it(tmp_path):
    (tmp_path / "prefs.jsonl").write_text(json.dumps({"prompt": "Who?", "chosen": " the guard", "rejected": " no"}))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Who keeps the bridge?", "answer": "guard"}))
    objectives = {
        "prefs.jsonl": ["data.format=preference", "objective.name=dpo"],
        "prompts.jsonl": ["data.format=prompt", "objective.name=grpo", "objective.rewards=[exact_match]",
                          "objective.num_generations=2", "objective.max_new_tokens=4"],
    }  # fmt: skip
    for source, options in objectives.items():
        base = [
            "model.name=transformer_lm",
            f"model.pretrained={fixture('llama_bnb4bit')}",
            "model.lora={rank: 4}",
            f"data.source={tmp_path / source}",
            "data.seq_len=31",
            "data.eval_split=null",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.batch_size=1",
        ]
        exp = setup(load_config(None, [*base, *options]))
        assert steps.REFERENCE not in exp.abstract
        frozen = exp.abstract[steps.FROZEN]
        assert any(isinstance(v, nnx.QuantizedParam) for v in frozen.values())
