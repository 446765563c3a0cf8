"""A Hugging Face model directory as the TARGET of every command, and as the start of a training run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_user_error, cli
from hf_support import LLAMA_CONFIG, fixture, write_model_dir

from nnx_cli.hf.tokenizer import PretrainedTokenizer
from nnx_cli.lm import eval_sample_stops

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A model directory with a ChatML template and end-of-turn stop, and a text to evaluate and train on."""
    root = tmp_path_factory.mktemp("hfcli")
    model = root / "model"
    write_model_dir(model, LLAMA_CONFIG)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(model / "tokenizer.json"))
    end = tokenizer.token_to_id("<|im_end|>")
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 0]}))
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over the lazy dog a king and a queen".split()
    (root / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(300)))
    return root


def run(project: Path, *args: str, expect: int = 0):
    result = cli(*args, cwd=project, timeout=240)
    assert result.returncode == expect, result.stderr
    return result


def test_inspect_counts_the_parameters_transformers_counts_and_reads_no_tensor(project, tmp_path):
    result = run(project, "nnx-inspect", "model", "--json")
    report = json.loads(result.stdout)
    vocab, embed, layers = 300, 32, 2
    per_layer = 2 * embed + embed * 32 + 2 * embed * 16 + 32 * embed + 3 * embed * 64  # norms, q, k, v, o, mlp
    assert report["total_params"] == 2 * vocab * embed + embed + layers * per_layer
    assert report["vocab_padding"] == 2 * (384 - vocab) * embed
    keys = next(e for e in report["entries"] if e["path"].endswith("attention/key/kernel"))
    assert keys["sharding"] == ["layers", "embed", "kv_heads", "kv"]  # 2 key-value heads for 4 query heads
    split = json.loads(run(project, "nnx-inspect", "model", "sharding.mesh.model=2", "--json").stdout)
    keys = next(e for e in split["entries"] if e["path"].endswith("attention/key/kernel"))
    assert keys["mesh_axes"] == [None, "data", "model", None]


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_inspect_counts_the_parameters_transformers_counts_for_post_norms_and_fused_projections(tmp_path, name):
    from hf_support import FIXTURES, fixture

    report = json.loads(run(tmp_path, "nnx-inspect", str(fixture(name)), "--json").stdout)
    counted = json.loads((FIXTURES / f"{name}.json").read_text())["num_parameters"]  # model.num_parameters()
    assert report["total_params"] == counted and report["vocab_padding"] > 0  # padded rows counted apart


def test_greedy_generation_equals_the_argmax_of_full_forward_passes(project):
    result = run(project, "nnx-generate", "model", "--prompt", "the king", "--temperature", "0",
                 "--max-tokens", "6", "--json")  # fmt: skip
    out = json.loads(result.stdout)
    assert out["step"] is None and len(out["tokens"][0]) >= 1

    from nnx_cli import hf
    from nnx_cli.experiment import setup

    exp = setup(hf.model_dir_config(project / "model", []), data=None)
    model = exp.moduledef.merge(exp.load_pretrained())
    tokenizer = hf.pretrained_tokenizer(str(project / "model"))
    prompt = [int(t) for t in tokenizer.encode("the king")]
    logits = np.asarray(model.logits(np.asarray([prompt + out["tokens"][0]])))[0]  # causal: one pass sees each prefix
    assert np.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist() == out["tokens"][0]


def test_chat_wraps_the_prompt_in_the_template_and_stops_at_the_end_of_the_turn(project):
    from nnx_cli import hf
    from nnx_cli.lm import encode_prompt

    tokenizer = hf.pretrained_tokenizer(str(project / "model"))
    ids = encode_prompt(tokenizer, "hello", chat=True, system="be brief")
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert ids == [int(t) for t in tokenizer.encode_plain(text)]
    assert tokenizer.token_id("<|im_end|>") in tokenizer.chat_stop_ids
    result = run(project, "nnx-generate", "model", "--chat", "--system", "be brief", "--prompt", "hello",
                 "--temperature", "0", "--max-tokens", "5", "--json")  # fmt: skip
    out = json.loads(result.stdout)
    assert out["stop_reasons"][0] in ("max_tokens", "stop_token")


def test_chat_without_a_template_and_system_without_chat_are_user_errors(project, tmp_path):
    assert_user_error(cli("nnx-generate", "model", "--system", "x", "--prompt", "hi", cwd=project), "--chat")
    bare = tmp_path / "bare"
    write_model_dir(bare, LLAMA_CONFIG)
    result = cli("nnx-generate", bare, "--chat", "--prompt", "hi", cwd=project)
    assert_user_error(result, "--chat needs a chat template", "has none")


def test_eval_of_a_model_directory_on_a_text_equals_eval_of_a_run_that_has_not_moved(project):
    direct = json.loads(run(project, "nnx-eval", "model", "data.source=text.txt", "data.seq_len=32", "--json").stdout)
    assert direct["step"] is None and direct["metrics"]["perplexity"] == pytest.approx(
        np.exp(direct["metrics"]["loss"]), rel=1e-6
    )
    config = project / "ft.yaml"
    config.write_text(
        "model: {name: transformer_lm, pretrained: model}\n"
        "data: {source: text.txt, text_key: text, seq_len: 32, eval_split: train}\n"
        "optimizer: {name: sgd, learning_rate: 0.0}\n"
        "train: {batch_size: 8, steps: 1, eval_every: 1}\n"
    )
    run(project, "nnx-train", "ft.yaml", "--workdir", "ft")
    info = json.loads((project / "ft" / "run.json").read_text())["pretrained"]
    assert info["directory"] == str(project / "model") and info["checksum"].startswith("xxh3_128:")
    records = [json.loads(line) for line in (project / "ft" / "metrics.jsonl").read_text().splitlines()]
    evaluated = next(r for r in records if r["split"] == "eval")  # after one step at learning rate 0
    assert evaluated["metrics"]["loss"] == pytest.approx(direct["metrics"]["loss"], rel=1e-5)


def test_a_markdown_file_trains_a_pretrained_model_without_text_key_as_eval_reads_it(project):
    (project / "notes.md").write_text("# Notes\n\n" + (project / "text.txt").read_text())
    (project / "plain.yaml").write_text(
        "model: {name: transformer_lm, pretrained: model}\n"
        "data: {source: notes.md, seq_len: 32, eval_split: train}\n"
        "optimizer: {name: sgd, learning_rate: 0.0}\n"
        "train: {batch_size: 8, steps: 1, eval_every: 1}\n"
    )
    run(project, "nnx-train", "plain.yaml", "--workdir", "plain")
    records = [json.loads(line) for line in (project / "plain" / "metrics.jsonl").read_text().splitlines()]
    trained = next(r for r in records if r["split"] == "eval")  # after one step at learning rate 0
    direct = json.loads(run(project, "nnx-eval", "model", "data.source=notes.md", "data.seq_len=32", "--json").stdout)
    assert trained["metrics"]["loss"] == pytest.approx(direct["metrics"]["loss"], rel=1e-5)


def test_eval_of_a_model_directory_needs_a_text(project):
    assert_user_error(cli("nnx-eval", "model", cwd=project), "needs a text to evaluate on", "data.source=")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
def test_inspect_of_a_mixture_of_experts_counts_what_transformers_counts_and_shows_the_expert_axis(tmp_path, name):
    from hf_support import fixture

    from nnx_cli.hf.weights import Weights

    weights = Weights.open(fixture(name))
    shapes = {n: weights.info(n)[1] for n in weights.files}
    result = cli("nnx-inspect", fixture(name), "sharding.mesh.expert=2", "sharding.mesh.data=-1", "--json",
                 cwd=tmp_path, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["total_params"] == sum(int(np.prod(s)) for s in shapes.values())  # every tensor transformers saved
    experts = sum(int(np.prod(s)) for n, s in shapes.items() if ".experts." in n)
    config = json.loads((fixture(name) / "config.json").read_text())
    share = config["num_experts_per_tok"] / config.get("num_local_experts", config.get("num_experts"))
    assert report["active_params"] == report["total_params"] - round(experts * (1 - share))
    gate = next(e for e in report["entries"] if e["path"].endswith("moe/gate/kernel"))
    assert gate["sharding"][-3:] == ["expert", "embed", "mlp"] and gate["mesh_axes"][-3:] == ["expert", "data", "model"]


@pytest.mark.parametrize("data_format, stops_at_eos", [("text", False), ("chat", True), ("preference", True)])
def test_eval_samples_of_examples_stop_at_the_tokenizers_end_of_sequence_the_generation_config_omits(
    tmp_path, data_format, stops_at_eos
):
    model = tmp_path / "llama"
    shutil.copytree(fixture("llama"), model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [4]}))
    tokenizer = PretrainedTokenizer(model)
    eos = tokenizer.token_id(tokenizer.eos_token)
    assert eos != 4
    stops = eval_sample_stops(data_format, tokenizer)["stop_tokens"]
    assert 4 in stops and (eos in stops) == stops_at_eos


@pytest.mark.parametrize(
    "command, extra",
    [("nnx-eval", ()), ("nnx-generate", ("--prompt", "hi")), ("nnx-inspect", ())],
    ids=["eval", "generate", "inspect"],
)
def test_a_mistyped_work_dir_is_exit_2_naming_the_closest_one_not_a_hub_id(command, extra, tmp_path):
    """`runs/digits_vea` beside the work dir `runs/digits_vae` has the shape of a Hub id (`org/name`) but means a
    work dir: the command says it does not exist and names the work dir it is closest to, without asking the Hub."""
    (tmp_path / "runs" / "digits_vae" / "checkpoints").mkdir(parents=True)
    result = cli(command, "runs/digits_vea", *extra, cwd=tmp_path)
    assert_user_error(result, "'runs/digits_vea' does not exist", "did you mean 'runs/digits_vae'")
    assert "Hub" not in result.stderr


def test_a_missing_yaml_path_is_a_missing_config_not_a_hub_id(tmp_path):
    assert_user_error(
        cli("nnx-inspect", "configs/mine.yaml", cwd=tmp_path), "config file 'configs/mine.yaml' does not exist"
    )


def test_an_id_beside_work_dirs_is_a_mistyped_path_and_beside_downloaded_models_a_hub_id(tmp_path, monkeypatch):
    from nnx_cli.hf import is_model_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "tiny_lm" / "checkpoints").mkdir(parents=True)
    write_model_dir(tmp_path / "meta-llama" / "Llama-3.2-1B", LLAMA_CONFIG)  # a download mirroring the Hub's names
    assert not is_model_dir("runs/tiny_ml")
    assert is_model_dir("meta-llama/Llama-3.2-3B")  # not here: the Hub's
    assert is_model_dir("meta-llama/Llama-3.2-1B")  # here: the directory
    assert is_model_dir("nobody/anything") and not is_model_dir("configs/run.yaml")


class _Drawn:
    """A generation whose tokens are given: what `nnx-generate`'s streaming reads (`samples`, one step a token)."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.samples = tokens, [[]]

    def __iter__(self):
        for token in self.tokens:
            self.samples[0].append(token)
            yield [token]


@pytest.mark.parametrize("family", ["llama2", "qwen2", "gemma2"])
def test_the_text_streamed_to_a_terminal_is_the_text_printed_to_a_pipe(family, capsys):
    """Characters split over tokens: each U+FFFD printed while one was incomplete stayed on the terminal, and the
    text after it was cut at the wrong place (`car ��` then `漢`...); with SentencePiece the continuation lost the
    space after the prompt (`The rivercar`)."""
    from nnx_cli.commands import generate
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.lm import encode_prompt

    tokenizer = load_tokenizer("pretrained", str(fixture(family)))
    prompt = encode_prompt(tokenizer, "The river", False, None, None)
    sample = encode_prompt(tokenizer, "The river car 漢字é", False, None, None)[len(prompt) :]
    assert any("\ufffd" in tokenizer.decode(sample[:i]) for i in range(len(sample)))  # it does split characters
    generate._stream(_Drawn(sample), "The river", generate._continuation(tokenizer, prompt))
    assert capsys.readouterr().out == "The river car 漢字é\n"
    assert "The river" + generate._continuation(tokenizer, prompt)(sample) == "The river car 漢字é"
