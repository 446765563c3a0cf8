"""GGUF out and in: nnx-export --format gguf against llama.cpp's own converter, and .gguf files as TARGET.

tests/fixtures/make_gguf_fixtures.py ran llama.cpp's `convert_hf_to_gguf.py` on the tiny model directories and
recorded every metadata key and every tensor (shape, type, a digest of its bytes) of its output at f32 and q8_0,
and the greedy tokens llama.cpp draws from its f32 file (`gguf/goldens.json`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_user_error, cli
from hf_support import FIXTURES, fixture, goldens

from nnx_cli import hf
from nnx_cli.errors import RunError, UserError
from nnx_cli.experiment import setup
from nnx_cli.gguf import export, families, ollama, read

GGUF = FIXTURES.parent / "gguf"
GOLDENS = json.loads((GGUF / "goldens.json").read_text())
NAMES = sorted(k for k in GOLDENS if not k.startswith("_"))
SENTENCEPIECE = ("gemma2", "gemma3", "phi3")  # their converter input had tokenizer.model
VARIANTS = ("qwen3_moe", "olmoe")  # gguf/<name>/: hf/<name> changed into what llama.cpp runs
# GGUF holds transformers' whole function (Phi-3's within its window: llama.cpp, and nnx reading the file, attend
# over the whole context)
EXACT = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "phi3"]
LONG = 16


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the directories .gguf files stand for


def source_dir(name: str, tmp: Path, *, sentencepiece_model: bool = True) -> Path:
    """The model directory the converter was given (same name: general.name comes from it)."""
    directory = tmp / "in" / name
    shutil.copytree(GGUF / name if name in VARIANTS else fixture(name), directory)
    if sentencepiece_model and name in SENTENCEPIECE:
        shutil.copy2(GGUF / name / "tokenizer.model", directory / "tokenizer.model")
    return directory


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def summary(path: Path) -> dict:
    """What make_gguf_fixtures.py records of a GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            value = np.asarray(value, np.float32).tolist()
        if isinstance(value, list) and len(value) > LONG:
            value = {"length": len(value), "sha256": digest(json.dumps(value, ensure_ascii=False).encode())}
        metadata[key] = [[t.name for t in field.types], value]
    tensors = {
        t.name: [[int(n) for n in t.shape], t.tensor_type.name, digest(np.ascontiguousarray(t.data).tobytes())]
        for t in reader.tensors
    }
    return {"metadata": metadata, "tensors": tensors}


def assert_same(ours: dict, theirs: dict) -> None:
    assert sorted(ours["tensors"]) == sorted(theirs["tensors"])
    for name, value in theirs["tensors"].items():
        assert ours["tensors"][name] == value, name  # shape, type and bytes
    assert sorted(ours["metadata"]) == sorted(theirs["metadata"])
    for key, value in theirs["metadata"].items():
        assert ours["metadata"][key] == value, key


# Out: what llama.cpp's converter writes
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("name", NAMES)
def test_a_model_directory_exports_as_llama_cpps_converter_writes_it(tmp_path, name, dtype):
    written = export.write(export.from_model_dir(source_dir(name, tmp_path)), tmp_path / "out.gguf", dtype)
    assert_same(summary(tmp_path / "out.gguf"), GOLDENS[name][dtype])
    assert written["dtype"] == dtype and written["tensors"] == len(GOLDENS[name][dtype]["tensors"])


def test_an_exported_file_is_readable_as_the_umask_allows_not_private_to_its_writer(tmp_path):
    # staged with mkstemp (0600) and renamed: a llama.cpp server run as another user must still read it
    umask = os.umask(0o022)
    try:
        export.write(export.from_model_dir(source_dir("llama", tmp_path)), tmp_path / "out.gguf", "f32")
    finally:
        os.umask(umask)
    assert (tmp_path / "out.gguf").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_without_tokenizer_model_the_sentencepiece_pieces_are_rebuilt_from_tokenizer_json(tmp_path, name):
    directory = source_dir(name, tmp_path, sentencepiece_model=False)
    export.write(export.from_model_dir(directory), tmp_path / "out.gguf", "f32")
    assert_same(summary(tmp_path / "out.gguf"), GOLDENS[name]["f32"])


def test_q8_0_keeps_norms_router_and_rows_not_a_whole_number_of_blocks_out_of_q8_0():
    types = {n: v[1] for n, v in GOLDENS["qwen3_moe"]["q8_0"]["tensors"].items() if n.startswith("blk.0.")}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_gate_exps.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.ffn_down_exps.weight"] == "F16"  # rows of 24 values: no whole block of 32


def test_q8_0_blocks_hold_32_values_and_one_float16_scale(tmp_path):
    from gguf import GGUFReader

    export.write(export.from_model_dir(source_dir("llama", tmp_path)), tmp_path / "out.gguf", "q8_0")
    tensor = next(t for t in GGUFReader(tmp_path / "out.gguf").tensors if t.name == "blk.0.ffn_up.weight")
    blocks = np.asarray(tensor.data).reshape(-1, 34)  # 2 bytes of scale, 32 int8 values
    scales, values = blocks[:, :2].copy().view(np.float16).astype(np.float32), blocks[:, 2:].view(np.int8)
    original = hf.weights.Weights.open(fixture("llama")).read("model.layers.0.mlp.up_proj.weight", (slice(None),) * 2)
    np.testing.assert_allclose(scales * values, original.reshape(-1, 32), atol=float(scales.max()) / 2 + 1e-7)
    assert np.abs(values).max() == 127


def _hard_values(dtype: type) -> np.ndarray:
    """Rows a conversion gets wrong if it rounds differently from gguf-py anywhere: halves (ties of q8_0's
    rounding), subnormals, values past float16's range, zero blocks, and scales (`max / 127`) whose reciprocal
    rounds differently from `127 / max`."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 1024)) * rng.uniform(1e-3, 1e3, (96, 1))
    x[0, :32] = 0
    x[1] = np.arange(1024) * 0.5 - 256
    x[2] = rng.integers(-127, 128, 1024) + 0.5
    x[3, :64] = rng.choice([1e-39, -3e-41, 6e-8, 1e-45, 0.0, 3e38, -3e38, 65520.0, 70000.0], 64)
    x[4] = rng.integers(-254, 255, 1024) / 2 * 0.37
    return x.astype(dtype) if dtype != np.float16 else np.clip(x, -6e4, 6e4).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0"])
def test_xlas_conversions_are_gguf_pys_bit_for_bit(qtype, dtype):
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    data = _hard_values(dtype)
    assert data.size >= export._ON_DEVICE  # converted by XLA
    changes = [families.Change(), families.Change(shift=True), families.Change(transpose=True),
               families.Change(heads=4)]  # fmt: skip
    for change in changes:
        with np.errstate(all="ignore"):
            theirs = np.ascontiguousarray(gguf.quants.quantize(change.apply(data), kind))
        ours = export._quantized(data, kind, gguf, change)
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), change
        assert ours.tobytes() == theirs.tobytes(), change


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "BF16"])
def test_large_tensors_quantised_a_few_rows_at_a_time_are_the_bytes_of_one_call(monkeypatch, qtype):
    import gguf

    monkeypatch.setattr(export, "_CHUNK", 4096)  # 16 rows of 64 at a time
    rows = np.random.default_rng(0).standard_normal((300, 64)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    chunked, whole = export._quantized(rows, kind, gguf), gguf.quants.quantize(rows, kind)
    assert chunked.tobytes() == np.ascontiguousarray(whole).tobytes()


def test_a_run_exports_as_its_hugging_face_export_does(tmp_path):
    """LoRA adapters merged, from a run: the same file as the GGUF export of the run's Hugging Face export."""
    from nnx_cli.config import load_config
    from nnx_cli.hf import export as hf_export
    from nnx_cli.hf import peft

    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}",
                             "data.text_key=text", "model.lora={rank: 4, alpha: 8}"])  # fmt: skip
    exp = setup(cfg, data=None)
    arrays = {
        p: np.asarray(v.value) for p, v in (peft.load(exp, fixture("llama_lora")) | exp.load_pretrained()).items()
    }
    tokenizer = hf.pretrained_tokenizer(str(fixture("llama")))
    (tmp_path / "files").mkdir()
    run = export.from_run(exp, arrays, tokenizer, tmp_path / "files", name="llama")
    export.write(run, tmp_path / "run.gguf", "q8_0")
    hf_export.export(exp, arrays, tmp_path / "llama", adapter=False, dtype="float32", tokenizer=tokenizer)
    export.write(export.from_model_dir(tmp_path / "llama"), tmp_path / "hf.gguf", "q8_0")
    ours, theirs = summary(tmp_path / "run.gguf"), summary(tmp_path / "hf.gguf")
    assert_same(ours, theirs)
    merged_q = theirs["tensors"]["blk.0.attn_q.weight"][2]
    assert merged_q != GOLDENS["llama"]["q8_0"]["tensors"]["blk.0.attn_q.weight"][2]  # the adapters moved it


def test_a_run_from_scratch_with_the_bytes_tokenizer_exports_its_256_bytes_and_end_of_text(tmp_path):
    from nnx_cli.config import load_config
    from nnx_cli.data.tokenizers import BytesTokenizer

    options = ["model.name=transformer_lm", "model.num_layers=2", "model.num_heads=4", "model.embed_dim=32",
               "model.dropout=0.0", "data.text_key=text", "data.seq_len=32"]  # fmt: skip
    exp = setup(load_config(None, options), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.init_state()["params"].items()}
    (tmp_path / "files").mkdir()
    source = export.from_run(exp, arrays, BytesTokenizer(), tmp_path / "files", name="scratch")
    export.write(source, tmp_path / "scratch.gguf", "f32")
    fields = summary(tmp_path / "scratch.gguf")["metadata"]
    assert fields["general.architecture"][1] == "gpt2" and fields["general.name"][1] == "scratch"
    assert fields["tokenizer.ggml.tokens"][1]["length"] == 257 and fields["tokenizer.ggml.eos_token_id"][1] == 256
    assert fields["tokenizer.ggml.merges"][1] == ["a 1"]  # llama.cpp refuses a gpt2 vocabulary without merges
    tokenizer, reference_tokenizer = hf.pretrained_tokenizer(str(tmp_path / "scratch.gguf")), BytesTokenizer()
    for text in ["a1b2 x9", "the quick brown fox", "héllo wörld ✓\n\n  tabs\tand 123456"]:
        expected = list(reference_tokenizer.encode(text))
        assert list(tokenizer.encode(text)) == expected, text
        assert tokenizer.decode(expected) == text
    exp_again = setup(hf.model_dir_config(tmp_path / "scratch.gguf", []), data=None)
    ids = np.asarray([list(b"the quick brown fox")], np.int32)
    reference = np.asarray(exp.moduledef.merge(exp.init_state()["params"]).logits(ids))[..., :257]
    again = np.asarray(exp_again.moduledef.merge(exp_again.load_pretrained()).logits(ids))[..., :257]
    assert np.abs(again - reference).max() / np.abs(reference).max() < 1e-5


def test_a_run_from_scratch_on_a_tokenizer_json_that_adds_a_begin_token_tells_llama_cpp_to_add_none(tmp_path):
    """The run tokenized without the post-processor's <|begin_of_text|>; llama.cpp added it to every prompt."""
    from nnx_cli.config import load_config
    from nnx_cli.data.tokenizers import load_tokenizer

    source = fixture("llama") / "tokenizer.json"
    options = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=16",
               "data.text_key=text", "data.seq_len=16", f"data.tokenizer={source}"]  # fmt: skip
    exp = setup(load_config(None, options), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.init_state()["params"].items()}
    (tmp_path / "files").mkdir()
    run_tokenizer = load_tokenizer(str(source))
    export.write(export.from_run(exp, arrays, run_tokenizer, tmp_path / "files", name="s"), tmp_path / "s.gguf", "f32")
    fields = summary(tmp_path / "s.gguf")["metadata"]
    assert fields["tokenizer.ggml.add_bos_token"][1] is False and fields["tokenizer.ggml.add_eos_token"][1] is False
    text = "The river ran past the old mill."
    assert list(hf.pretrained_tokenizer(str(tmp_path / "s.gguf")).encode(text)) == list(run_tokenizer.encode(text))


LLAMA_SHAPE = ["model.positions=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=false"]


def scratch(tmp_path, *options: str) -> export.Source:
    """A run from scratch on the bytes tokenizer with `options`, its initial parameters as the weights."""
    from nnx_cli.config import load_config
    from nnx_cli.data.tokenizers import BytesTokenizer

    base = ["model.name=transformer_lm", "model.num_layers=2", "model.num_heads=4", "model.embed_dim=32",
            "model.dropout=0.0", "data.text_key=text", "data.seq_len=32"]  # fmt: skip
    exp = setup(load_config(None, [*base, *options]), data=None)
    arrays = {p: np.asarray(v.value) for p, v in exp.init_state()["params"].items()}
    (tmp_path / "files").mkdir()
    return export.from_run(exp, arrays, BytesTokenizer(), tmp_path / "files", name="scratch")


def test_a_gpt2_run_with_an_mlp_width_of_its_own_writes_that_width_and_reads_back(tmp_path):
    export.write(scratch(tmp_path, "model.mlp_dim=96"), tmp_path / "scratch.gguf", "f32")
    assert summary(tmp_path / "scratch.gguf")["metadata"]["gpt2.feed_forward_length"][1] == 96  # not 4 x 32
    exp = setup(hf.model_dir_config(tmp_path / "scratch.gguf", []), data=None)
    assert exp.cfg.model.options["mlp_dim"] == 96


def test_an_olmoe_run_writes_its_own_norm_epsilon(tmp_path):
    moe = ["model.moe={num_experts: 4, top_k: 2, normalize: false}", "model.qk_norm=true",
           "model.qk_norm_scope=projection", "model.tie_embeddings=false", "model.norm_eps=0.001"]  # fmt: skip
    export.write(scratch(tmp_path, *LLAMA_SHAPE, *moe), tmp_path / "olmoe.gguf", "f32")
    fields = summary(tmp_path / "olmoe.gguf")["metadata"]
    assert fields["general.architecture"][1] == "olmoe"
    assert fields["olmoe.attention.layer_norm_rms_epsilon"][1] == pytest.approx(0.001)  # the converter writes 1e-5


@pytest.mark.parametrize(
    "options, message",
    [
        (["model.qk_norm=true", "model.qk_norm_scope=projection"], "qk_norm_scope projection .* without experts"),
        (["model.qkv_bias=true", "model.rope_scaling={type: llama3, factor: 8.0, low_freq_factor: 1.0, "
          "high_freq_factor: 4.0, original_max_position_embeddings: 16}"],
         "the run's model options: llama3 rotary scaling on a Qwen2ForCausalLM; .* its qwen2 would run without it"),
        (["model.moe={num_experts: 4, top_k: 2, normalize: false}", "model.qk_norm=true",
          "model.qk_norm_scope=projection"], "an OLMoE whose output head is its embedding .* needs a head of its own"),
    ],
    ids=["dense-projection-qk-norm", "qwen2-llama3-rope", "tied-olmoe"],
)  # fmt: skip
def test_runs_llama_cpp_would_compute_otherwise_are_refused(tmp_path, options, message):
    with pytest.raises(UserError, match=message):
        export.write(scratch(tmp_path, *LLAMA_SHAPE, *options), tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()


def test_expert_weighting_llama_cpp_does_otherwise_is_noted():
    from nnx_cli.gguf import families

    olmoe = families.differences("OlmoeForCausalLM", families.HParams({"norm_topk_prob": True}))
    qwen = families.differences("Qwen3MoeForCausalLM", families.HParams({"norm_topk_prob": False}))
    assert "not renormalised to sum to 1 (norm_topk_prob)" in olmoe[0]
    assert "renormalises the weights of this Qwen3-MoE's chosen experts" in qwen[0]
    assert families.differences("Qwen3MoeForCausalLM", families.HParams({"norm_topk_prob": True})) == []


def test_a_phi3_window_shorter_than_its_context_is_noted_as_llama_cpp_ignores_it():
    from nnx_cli.gguf import families

    noted = families.differences("Phi3ForCausalLM", families.HParams({"sliding_window": 2047,
                                                                     "max_position_embeddings": 4096}))  # fmt: skip
    assert "without its sliding window of 2047 positions" in noted[0]
    wide = {"sliding_window": 262144, "max_position_embeddings": 131072}  # Phi-3.5-mini's: no window in effect
    assert families.differences("Phi3ForCausalLM", families.HParams(wide)) == []


# In: a .gguf file as a model
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXACT)
def test_an_exported_file_reads_back_to_the_logits_transformers_computes(tmp_path, name):
    export.write(export.from_model_dir(fixture(name)), tmp_path / f"{name}.gguf", "f32")
    exp = setup(hf.model_dir_config(tmp_path / f"{name}.gguf", []), data=None)
    gold = goldens(name)
    logits = np.asarray(exp.moduledef.merge(exp.load_pretrained()).logits(gold["input_ids"]))
    within = json.loads((fixture(name) / "config.json").read_text()).get("sliding_window") if name == "phi3" else None
    logits, expected = logits[:, :within, : gold["logits"].shape[-1]], gold["logits"][:, :within]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5


def test_a_q8_0_file_reads_back_close_to_the_float32_logits(tmp_path):
    export.write(export.from_model_dir(fixture("qwen3")), tmp_path / "qwen3.gguf", "q8_0")
    exp = setup(hf.model_dir_config(tmp_path / "qwen3.gguf", []), data=None)
    gold = goldens("qwen3")
    logits = np.asarray(exp.moduledef.merge(exp.load_pretrained()).logits(gold["input_ids"]))
    error = np.abs(logits[..., : gold["logits"].shape[-1]] - gold["logits"]).max() / np.abs(gold["logits"]).max()
    assert 1e-4 < error < 0.05  # rounded to 8 bits, not lost


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "olmoe", *SENTENCEPIECE])
def test_an_exported_files_tokenizer_encodes_and_renders_chats_as_the_model_directorys(tmp_path, name):
    from nnx_cli.data import chat

    directory = source_dir(name, tmp_path, sentencepiece_model=False)
    export.write(export.from_model_dir(directory), tmp_path / f"{name}.gguf", "f32")
    ours, theirs = hf.pretrained_tokenizer(str(tmp_path / f"{name}.gguf")), hf.pretrained_tokenizer(str(fixture(name)))
    record = json.loads((FIXTURES / f"{name}.json").read_text())
    for text in [*record["prompts"], record.get("probe_text", "")]:
        assert list(ours.encode(text)) == list(theirs.encode(text)), text
        assert ours.decode(list(theirs.encode(text))) == theirs.decode(list(theirs.encode(text)))
    assert set(theirs.stop_ids) <= set(ours.stop_ids)
    if theirs.chat_template is not None:
        messages = chat.prompt_messages("When does the fiddler come?")
        render = [chat.render(t.chat_template, messages, add_generation_prompt=True,
                              special_tokens=chat.special_tokens(t)) for t in (ours, theirs)]  # fmt: skip
        assert render[0] == render[1]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "phi3"])
def test_greedy_tokens_from_an_exported_file_agree_with_llama_cpps(tmp_path, name, capsys):
    """llama.cpp's greedy run on the converter's file, against ours on our file (the same bytes): equal but at
    near ties of these random models, where float32 sums in another order may pick the other token. Phi-3 read
    back without its window of 8 positions, as llama.cpp runs it. (Not Gemma: llama.cpp scales its attention by
    head_dim, which these fixtures do not.)"""
    from nnx_cli import decoding

    export.write(export.from_model_dir(fixture(name)), tmp_path / f"{name}.gguf", "f32")
    exp = setup(hf.model_dir_config(tmp_path / f"{name}.gguf", [], scan_layers=False), data=None)
    decoder = decoding.Decoder(exp.moduledef, exp.load_pretrained())
    theirs = GOLDENS[name]["llama_cpp_greedy"]
    prompts = GOLDENS[name]["prompts"]
    drawn = decoder.generate(prompts, max_tokens=len(theirs[0]), temperature=0.0).finish()
    agree = [next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), len(t)) for s, t in zip(drawn.samples, theirs)]
    with capsys.disabled():
        print(f"\n{name}: nnx and llama.cpp agree on the first {agree} of {len(theirs[0])} greedy tokens")
    assert min(agree) >= 3 and max(agree) == len(theirs[0])


def test_a_truncated_or_foreign_file_is_a_user_error(tmp_path):
    export.write(export.from_model_dir(fixture("llama")), tmp_path / "whole.gguf", "f32")
    data = (tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(UserError, match=r"cut\.gguf: not a readable GGUF file .*; is it cut short\?"):
        read.model_dir(tmp_path / "cut.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(UserError, match=r"header\.gguf: not a readable GGUF file"):
        read.model_dir(tmp_path / "header.gguf")
    (tmp_path / "foreign.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(UserError, match="not a GGUF file"):
        read.model_dir(tmp_path / "foreign.gguf")
    assert not list((tmp_path / "cache" / "nnx" / "gguf").iterdir())  # nothing half-built left


def test_one_file_reached_by_two_paths_is_converted_once(tmp_path):
    """`m.gguf`, then `../m.gguf` from a folder below: two conversions in the cache."""
    export.write(export.from_model_dir(fixture("llama")), tmp_path / "m.gguf", "f32")
    (tmp_path / "below").mkdir()
    assert read.model_dir(tmp_path / "m.gguf") == read.model_dir(tmp_path / "below" / ".." / "m.gguf")


def test_a_cache_that_cannot_be_created_is_one_line_naming_the_setting(tmp_path, monkeypatch):
    """XDG_CACHE_HOME a file ended in a NotADirectoryError traceback."""
    export.write(export.from_model_dir(fixture("llama")), tmp_path / "m.gguf", "f32")
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))
    with pytest.raises(UserError, match=r"m\.gguf: cannot create the cache .*\(Not a directory\); set XDG_CACHE_HOME"):
        read.model_dir(tmp_path / "m.gguf")


@pytest.mark.parametrize(
    "key, value, said",
    [("block_count", None, "missing"), ("head_count", 0, "0"), ("head_count_kv", 0, "0")],
    ids=["no-block-count", "no-heads", "no-kv-heads"],
)
def test_a_file_without_the_models_shape_names_its_gguf_key(tmp_path, monkeypatch, key, value, said):
    """A missing block_count ended in a KeyError, 0 heads in a division by zero."""
    import gguf

    def write_instead(writer: gguf.GGUFWriter, *_: object) -> None:
        if value is not None:
            writer.add_uint32(f"{writer.arch}.attention.{key}", value)

    monkeypatch.setattr(gguf.GGUFWriter, f"add_{key}", write_instead)
    export.write(export.from_model_dir(fixture("llama")), tmp_path / "odd.gguf", "f32")
    name = "block_count" if key == "block_count" else f"attention.{key}"
    with pytest.raises(UserError, match=rf"odd\.gguf: GGUF key llama\.{name} is {said}; a llama model needs"):
        read.model_dir(tmp_path / "odd.gguf")
    assert not list((tmp_path / "cache" / "nnx" / "gguf").iterdir())


def _written_without(monkeypatch, path, key: str, source: str = "llama") -> None:
    """`source` exported to `path` without GGUF key `key` (as an incomplete converter writes it)."""
    import gguf

    add = gguf.GGUFWriter.add_key_value

    def add_key_value(writer: gguf.GGUFWriter, name: str, *args: object, **kwargs: object) -> None:
        if name != key.replace("{arch}", writer.arch):
            add(writer, name, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", add_key_value)
    export.write(export.from_model_dir(fixture(source)), path, "f32")
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", add)


@pytest.mark.parametrize(
    "key, said",
    [
        # read as characters alone, without a word: other tokens than the file's own
        ("tokenizer.ggml.merges", r"GGUF key tokenizer.ggml.merges is missing; a gpt2 \(BPE\) vocabulary needs"),
        # it said "tokenizer.ggml.model is 'gpt2'; nnx reads gpt2 (BPE) and llama"
        ("tokenizer.ggml.tokens", r"GGUF key tokenizer.ggml.tokens is missing \(or empty\); the file holds no whole"),
        # it named a config.json in the cache, of as many key-value heads as query heads
        ("{arch}.attention.head_count_kv", r"GGUF key llama.attention.head_count_kv is missing, and its key "
         r"projections hold 2 heads, not the 4 of the queries"),
    ],
    ids=["no-merges", "no-tokens", "no-kv-heads"],
)  # fmt: skip
def test_a_file_without_what_its_model_needs_names_the_gguf_key(tmp_path, monkeypatch, key, said):
    _written_without(monkeypatch, tmp_path / "odd.gguf", key)
    with pytest.raises(UserError, match=rf"odd\.gguf: {said}"):
        read.model_dir(tmp_path / "odd.gguf")


def test_step_or_best_with_a_gguf_file_calls_it_a_gguf_file(tmp_path):
    """It was called a model directory."""
    export.write(export.from_model_dir(fixture("llama")), tmp_path / "m.gguf", "f32")
    result = cli("nnx-generate", tmp_path / "m.gguf", "--step", "3", "--prompt", "hi", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith(f"--step and --best pick a checkpoint of a run; '{tmp_path / 'm.gguf'}' is a "
                                          "GGUF file")  # fmt: skip


def test_a_file_without_the_mlp_width_reads_it_from_the_mlp_tensors(tmp_path, monkeypatch):
    """Optional in llama.cpp: its absence failed naming a config.json in the cache (intermediate_size None)."""
    _written_without(monkeypatch, tmp_path / "m.gguf", "{arch}.feed_forward_length")
    directory = read.model_dir(tmp_path / "m.gguf")
    expected = json.loads((fixture("llama") / "config.json").read_text())["intermediate_size"]
    assert json.loads((directory / "config.json").read_text())["intermediate_size"] == expected


# Refusals
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, message",
    [("qwen3_moe", "llama.cpp's qwen3moe has experts in every layer"), ("olmoe", "normalises the keys of all heads")],
)
def test_families_llama_cpp_does_not_run_as_they_are_are_refused(tmp_path, name, message):
    with pytest.raises(UserError, match=message):
        export.write(export.from_model_dir(fixture(name)), tmp_path / "out.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_no_file_and_an_existing_one_as_it_was(tmp_path):
    source = export.from_model_dir(fixture("llama"))
    tensors = source.tensors

    def failing():
        for i, item in enumerate(tensors()):
            if i == 5:
                raise OSError(28, "No space left on device")
            yield item

    (tmp_path / "out.gguf").write_bytes(b"before")
    source.tensors = failing
    with pytest.raises(OSError, match="No space"):
        export.write(source, tmp_path / "out.gguf", "f32", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"] and (tmp_path / "out.gguf").read_bytes() == b"before"


def test_a_write_failing_on_the_writing_thread_is_one_line_naming_the_file_and_leaves_none(tmp_path, monkeypatch):
    import gguf

    write, calls = gguf.GGUFWriter.write_tensor_data, []

    def failing(self, tensor, *args, **kwargs):
        calls.append(tensor.nbytes)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    out = tmp_path / "out.gguf"
    message = f"cannot write {out} (No space left on device); free space on that disk, then run again"
    with pytest.raises(RunError) as raised:  # a failed run (exit 1), as a Hugging Face export's failed write is
        export.write(export.from_model_dir(fixture("llama")), out, "q8_0")
    assert str(raised.value) == message
    assert list(tmp_path.iterdir()) == [] and len(calls) == 3  # nothing written after the failure


def test_a_disk_that_refuses_the_file_is_one_line_and_an_existing_file_is_kept(tmp_path):
    size = export.write(export.from_model_dir(fixture("llama")), tmp_path / "whole.gguf")["bytes"]
    (tmp_path / "whole.gguf").unlink()
    (tmp_path / "out.gguf").write_bytes(b"before")
    for limit in (1_000, size // 2, size - 100):  # writing the header, a tensor, the last bytes as the file closes
        result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--out", "out.gguf", "--overwrite",
                     cwd=tmp_path, file_size_limit=limit)  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            "error: cannot write out.gguf (File too large); raise the file size limit (ulimit -f), then run again"
        )
        assert (tmp_path / "out.gguf").read_bytes() == b"before" and not list(tmp_path.glob(".out.gguf*"))


def test_without_the_gguf_package_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(UserError, match=r"pip install 'gguf>=0.19' \(the gguf extra of nnx\)"):
        export.write(export.from_model_dir(fixture("llama")), Path("never.gguf"), "f32")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """hf/llama as q8_0 with its Modelfile, through the command line."""
    root = tmp_path_factory.mktemp("cli")
    result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--dtype", "q8_0", "--out", "llama.gguf",
                 "--ollama", cwd=root)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote llama.gguf and Modelfile (llama, q8_0, 22 tensors" in result.stderr
    return root


def test_the_command_line_refuses_bad_types_existing_files_and_unrunnable_families(exported):
    before = (exported / "llama.gguf").read_bytes()
    result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--out", "llama.gguf", cwd=exported)
    assert_user_error(result, "exists; pass --overwrite")
    result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--dtype", "q4_0", "--out", "x.gguf",
                 cwd=exported)  # fmt: skip
    assert_user_error(result, "--dtype 'q4_0' is not a GGUF type nnx writes")
    result = cli("nnx-export", fixture("qwen3_moe"), "--format", "gguf", "--out", "x.gguf", cwd=exported)
    assert_user_error(result, "has experts in every layer")
    # a model dir without --format gguf: it said there was no checkpoint in it, and to train first
    result = cli("nnx-export", fixture("llama"), "--out", "copy", cwd=exported)
    assert_user_error(result, "is a Hugging Face model (a model dir or Hub id), not a run", "with --format gguf")
    assert (exported / "llama.gguf").read_bytes() == before and not (exported / "x.gguf").exists()
    assert not (exported / "copy").exists()
    # a directory's path (it wrote a file named 'newdir'), and a link to nowhere (the rename replaced it)
    result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--out", "newdir/", cwd=exported)
    assert_user_error(result, "--out 'newdir/' names a directory", "(e.g. newdir/model.gguf)")
    assert not (exported / "newdir").exists()
    (exported / "dangling.gguf").symlink_to(exported / "nowhere" / "model.gguf")
    result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--out", "dangling.gguf", cwd=exported)
    assert_user_error(result, "--out 'dangling.gguf' exists; pass --overwrite")
    assert (exported / "dangling.gguf").is_symlink()


def test_a_dtype_named_as_for_a_hugging_face_export_is_taken_for_gguf(exported):
    """--dtype bfloat16 --format gguf was refused, naming bf16: the same type under the name the hf export takes."""
    result = cli("nnx-export", fixture("llama"), "--format", "gguf", "--dtype", "bfloat16", "--out", "bf.gguf",
                 cwd=exported)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote bf.gguf (llama, bf16, " in result.stderr


def test_nnx_generate_samples_from_a_gguf_file_and_refuses_a_foreign_one(exported):
    result = cli("nnx-generate", "llama.gguf", "--prompt", "The river ran past", "--temperature", "0",
                 "--max-tokens", "8", "--json", cwd=exported)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["tokens"][0]) >= 1
    (exported / "foreign.gguf").write_text("not a model")
    assert_user_error(cli("nnx-generate", "foreign.gguf", "--prompt", "x", cwd=exported), "not a GGUF file")


def test_overwrite_refuses_an_out_that_is_a_link_or_a_device_which_the_rename_would_replace(tmp_path):
    """`--out link.gguf --overwrite` replaced the link with a file (its target kept the old model); as root,
    `--out /dev/full --overwrite` replaced the device node with a regular file."""
    (tmp_path / "target.gguf").write_text("old")
    (tmp_path / "link.gguf").symlink_to(tmp_path / "target.gguf")
    with pytest.raises(UserError, match=r"--out '.*link.gguf' is a symbolic link, which --overwrite would replace"):
        export.check_out(tmp_path / "link.gguf", True)
    with pytest.raises(UserError, match=r"--out '/dev/null' is not a regular file"):
        export.check_out(Path("/dev/null"), True)
    export.check_out(tmp_path / "target.gguf", True)  # a regular file is replaced


def test_an_out_named_modelfile_is_refused_with_ollama_before_anything_is_written(tmp_path):
    """`--out Modelfile --ollama` wrote the Modelfile over the GGUF file it had just written, and exited 0."""
    for overwrite in (False, True):
        with pytest.raises(
            UserError, match="--ollama writes its Modelfile beside the GGUF file; give the file another"
        ):
            ollama.check_out(tmp_path / "Modelfile", overwrite)
    assert list(tmp_path.iterdir()) == []
    ollama.check_out(tmp_path / "model.gguf", False)


def test_the_modelfile_translates_the_chat_template_into_ollamas(exported):
    text = (exported / "Modelfile").read_text()
    assert text.startswith('FROM ./llama.gguf\nTEMPLATE """{{- range .Messages }}')
    assert '{{ if eq .Role "system" }}<|start_header_id|>system<|end_header_id|>\n\n{{ .Content }}<|eot_id|>' in text
    assert 'PARAMETER stop "<|eot_id|>"\nPARAMETER stop "<|end_of_text|>"\nPARAMETER temperature 0.8\n' in text


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}",
         '{{ else if eq .Role "assistant" }}<|assistant|>\n{{ .Content }}<|end|>\n{{ end }}{{ end }}<|assistant|>\n'),
        ("{{ raise_exception('no') }}", "{{ .Prompt }}"),
        ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
         "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
         '{{ if eq .Role "system" }}[user] {{ .Content }}\n'),  # system turns written as user turns
    ],
)  # fmt: skip
def test_chat_templates_translate_by_what_they_render(template, expected):
    go, _ = ollama.translate(template, "<s>", "</s>", None)
    assert expected in go


def test_a_lora_fine_tune_from_a_gguf_file_exports_to_gguf_with_the_adapters_merged(exported):
    (exported / "text.txt").write_text("\n".join(["the river ran past the old mill and the boats went by"] * 40))
    (exported / "tune.yaml").write_text(
        "model: {name: transformer_lm, pretrained: llama.gguf, lora: {rank: 4, alpha: 8}}\n"
        "data: {source: text.txt, text_key: text, seq_len: 16, eval_split: null}\n"
        "optimizer: {name: adamw, learning_rate: 0.05}\n"
        "train: {batch_size: 2, steps: 2, eval_every: 100}\n"
    )
    result = cli("nnx-train", "tune.yaml", "--workdir", "tune", cwd=exported, timeout=240)
    assert result.returncode == 0, result.stderr
    result = cli("nnx-export", "tune", "--format", "gguf", "--dtype", "f32", "--out", "tuned.gguf", cwd=exported)
    assert result.returncode == 0, result.stderr
    assert "wrote tuned.gguf (llama, f32, 22 tensors" in result.stderr and "tune/checkpoints/2" in result.stderr
    base, tuned = summary(exported / "llama.gguf"), summary(exported / "tuned.gguf")
    assert tuned["metadata"]["tokenizer.ggml.tokens"] == base["metadata"]["tokenizer.ggml.tokens"]
    assert tuned["tensors"]["blk.0.attn_q.weight"][1] == "F32"
    assert tuned["tensors"]["output_norm.weight"][2] == summary_f32_of(exported / "llama.gguf", "output_norm.weight")
    assert tuned["tensors"]["blk.0.attn_q.weight"][2] != summary_f32_of(exported / "llama.gguf", "blk.0.attn_q.weight")
    # the base's files are hashed beside the export: a changed one still stops it before a file is written
    moved = exported / "moved"
    shutil.copytree(exported / "tune", moved / "tune")
    data = bytearray((exported / "llama.gguf").read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor
    (moved / "llama.gguf").write_bytes(bytes(data))
    result = cli("nnx-export", "tune", "--format", "gguf", "--out", "tuned.gguf", cwd=moved)
    assert_user_error(result, "llama.gguf: the base model's weights changed since the adapters in")
    assert not (moved / "tuned.gguf").exists() and not list(moved.glob(".tuned.gguf*"))


def summary_f32_of(path: Path, name: str) -> str:
    """The digest of tensor `name` of a GGUF file, dequantised to float32 (what a fine-tune of it starts from)."""
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    return digest(read._dequantized(tensor).tobytes())
