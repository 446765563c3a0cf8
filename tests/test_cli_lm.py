"""Language models from a config, as a user runs them: a text file, `transformer_lm`, samples, `nnx-generate`.

The text is written by the tests (users have no ../shared); one small byte-level
model is trained once and shared.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_support import (
    assert_user_error,
    cli,
    cli_device_memory,
    final_state,
    optimized_flags,
    start,
    wait_for_checkpoint,
)

from nnx_cli import integrity
from nnx_cli.checkpoint import Checkpointer

STEPS = 100
# The 100-step runs (the shared reference and the killed run compared with it) train for long enough that XLA's
# optimised backend saves more than it costs: 5.6 s of compiling and 2.2 s of training, against 2.8 s and 7.3 s.
OPTIMIZED = {"XLA_FLAGS": optimized_flags()}
CONFIG = f"""
seed: 2
model: {{name: transformer_lm, num_layers: 2, num_heads: 4, embed_dim: 64, dropout: 0.0}}
data: {{source: book.txt, text_key: text, tokenizer: bytes, seq_len: 64, eval_split: validation}}
optimizer: {{name: adamw, learning_rate: 3.0e-3, weight_decay: 0.1, weight_decay_mask: kernels}}
train: {{batch_size: 32, steps: {STEPS}, log_every: 25, eval_every: {STEPS // 2}, eval_max_batches: 4}}
checkpoint: {{every_steps: 25, keep: 10}}
"""


def book() -> str:
    """A small text with structure a model can learn: numbered verses of a few repeated word patterns."""
    rng = np.random.default_rng(0)
    words = ["the", "king", "queen", "shall", "speak", "of", "love", "and", "war", "my", "lord", "night", "day"]
    lines = []
    for i in range(2500):
        lines.append(f"{i % 7}. " + " ".join(rng.choice(words, size=rng.integers(4, 9))) + ".")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm")
    (root / "book.txt").write_text(book())
    (root / "lm.yaml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def reference(project: Path) -> Path:
    result = cli("nnx-train", "lm.yaml", "--workdir", "ref", cwd=project, timeout=300, extra_env=OPTIMIZED)
    assert result.returncode == 0, result.stderr
    return project / "ref"


def records(workdir: Path, split: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_a_byte_level_model_learns_from_a_text_file(reference: Path):
    train = records(reference, "train")
    assert train[-1]["metrics"]["loss"] < 0.6 * train[0]["metrics"]["loss"]
    assert {"tokens_per_s", "learning_rate", "grad_norm"} <= set(train[-1]["metrics"])


def test_the_eval_reports_loss_perplexity_accuracy_and_bits_per_byte(reference: Path):
    final = records(reference, "eval")[-1]["metrics"]
    assert set(final) == {"loss", "perplexity", "accuracy", "bits_per_byte"}
    assert final["perplexity"] == pytest.approx(np.exp(final["loss"]), rel=1e-6)
    assert 0.0 < final["accuracy"] < 1.0


def test_a_lone_text_file_holds_out_its_last_tenth_for_eval(reference: Path, project: Path):
    from nnx_cli.config import load_config
    from nnx_cli.data import eval_split, train_split

    cfg = load_config(project / "lm.yaml", [f"data.source={project / 'book.txt'}", f"data.cache_dir={project / 'c'}"])
    train, held_out = train_split(cfg), eval_split(cfg)
    total = len(train.stored()["tokens"]) + len(held_out.stored()["tokens"])
    assert len(held_out.stored()["tokens"]) == total - (total - int(total * 0.1))


def test_eval_finds_a_runs_relative_source_from_anywhere_and_the_same_source_given_again_is_its_held_out_split(
    reference: Path, project: Path, tmp_path: Path
):
    def evaluate(*args: str, cwd: Path) -> dict:
        result = cli("nnx-eval", *args, "--json", cwd=cwd)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["metrics"]

    here = evaluate("ref", cwd=project)
    assert here == pytest.approx(records(reference, "eval")[-1]["metrics"], rel=1e-5)
    elsewhere = evaluate(str(reference), cwd=tmp_path)  # book.txt is relative to the project
    again = evaluate("ref", f"data.source={project / 'book.txt'}", cwd=project)
    assert elsewhere == pytest.approx(here, rel=1e-6) and again == pytest.approx(here, rel=1e-6)
    table = cli("nnx-eval", "ref", cwd=project)
    assert "book.txt [validation]" in table.stderr  # the split is printed, not read as markup


def test_each_eval_writes_samples_of_fixed_prompts(reference: Path):
    samples = sorted(p.name for p in (reference / "samples").iterdir())
    assert samples == sorted([f"{STEPS // 2}.txt", f"{STEPS}.txt"])
    text = (reference / "samples" / f"{STEPS}.txt").read_text()
    assert text.startswith("--- sample 0\n") and "--- sample 1\n" in text


def test_train_sample_tokens_bounds_each_sample_and_zero_writes_none(project: Path):
    """`train.sample_tokens`: at most that many tokens after each prompt (here bytes: one character each, the
    default prompts the first 16 bytes of the eval split); 0 draws no samples at all."""
    short = ["train.steps=4", "train.eval_every=4", "train.log_every=2", "checkpoint.every_steps=4"]
    for workdir, tokens in (("three", 3), ("none", 0)):
        result = cli("nnx-train", "lm.yaml", "--workdir", workdir, *short, f"train.sample_tokens={tokens}",
                     cwd=project, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr
    blocks = (project / "three" / "samples" / "4.txt").read_text().split("--- sample ")[1:]
    assert len(blocks) == 2 and all(len(b.split("\n", 1)[1].rstrip("\n")) <= 16 + 3 for b in blocks)
    assert not (project / "none" / "samples").exists()
    assert records(project / "none", "eval")  # the eval ran, without samples
    again = cli("nnx-train", "lm.yaml", "--workdir", "three", *short, "train.sample_tokens=0", "--no-resume",
                cwd=project, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert not (project / "three" / "samples").exists()  # --no-resume deleted the samples of the run before
    bad = cli("nnx-train", "lm.yaml", "--workdir", "bad", "train.sample_tokens=-1", cwd=project)
    assert bad.returncode == 2 and "train.sample_tokens" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "prompts, fragment",
    [
        ('["' + "x" * 80 + '"]', "prompt 0 has 80 tokens, more than the model's context of 64"),
        ('["hi", ""]', "prompt 1 ('') encodes to no tokens"),
    ],
)
def test_a_sample_prompt_that_cannot_be_drawn_on_stops_the_run_before_it_starts(project: Path, prompts, fragment):
    result = cli("nnx-train", "lm.yaml", "--workdir", "bad_prompts", f"train.sample_prompts={prompts}", cwd=project)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]  # after the notice of the held-out split
    assert message.startswith("error: config key 'train.sample_prompts': ") and fragment in message, message
    assert not (project / "bad_prompts").exists()  # found before anything was written, not at the first eval


def test_a_killed_run_resumes_to_the_same_parameters_evals_and_samples(reference: Path, project: Path):
    """Killed the moment the checkpoint of an eval step commits: that step's eval and samples were written
    before it (a resumed run never repeats a committed step's eval)."""
    proc = start("nnx-train", "lm.yaml", "--workdir", "killed", cwd=project, extra_env=OPTIMIZED)
    wait_for_checkpoint(project / "killed", STEPS // 2, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert Checkpointer(project / "killed" / "checkpoints", read_only=True).latest_step() < STEPS
    result = cli("nnx-train", "lm.yaml", "--workdir", "killed", cwd=project, timeout=300, extra_env=OPTIMIZED)
    assert result.returncode == 0, result.stderr
    a, b = final_state(project / "killed"), final_state(reference)
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    evals = [[(r["step"], r["metrics"]) for r in records(run, "eval")] for run in (project / "killed", reference)]
    assert evals[0] == evals[1] and [step for step, _ in evals[0]] == [STEPS // 2, STEPS]
    for step in (STEPS // 2, STEPS):
        last = Path("samples", f"{step}.txt")
        assert (project / "killed" / last).read_text() == (reference / last).read_text()


def test_generate_continues_a_prompt_and_the_seed_fixes_the_text(reference: Path, project: Path):
    def sample(*extra: str) -> dict:
        result = cli("nnx-generate", "ref", "--prompt", "3. the", "--max-tokens", "20", "--json", *extra, cwd=project)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    first, again, other = sample("--seed", "1"), sample("--seed", "1"), sample("--seed", "2")
    assert first["step"] == STEPS and first["prompt"] == "3. the" and first["samples"] == again["samples"]
    assert first["samples"] != other["samples"] and first["tokens_per_s"] > 0
    batch = sample("--seed", "1", "--num-samples", "3")
    assert len(batch["samples"]) == 3 and batch["samples"][0] == first["samples"][0]  # sample 0's keys either way


def test_generate_best_uses_the_step_keep_best_recorded(reference: Path, project: Path):
    import shutil

    shutil.copytree(reference, project / "with_best")
    record = {"step": STEPS // 2, "metric": "loss", "mode": "min", "value": 1.0}
    (project / "with_best" / "checkpoints" / "best.json").write_text(json.dumps(record))
    args = ["--prompt", "3. the", "--max-tokens", "4", "--json"]
    result = cli("nnx-generate", "with_best", "--best", *args, cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == STEPS // 2
    assert_user_error(cli("nnx-generate", "ref", "--best", *args, cwd=project), "records no best step")


def test_greedy_generation_that_fills_the_context_stops_there_truncated(reference: Path, project: Path):
    result = cli(
        "nnx-generate",
        "ref",
        "--prompt",
        "1. my lord",
        "--temperature",
        "0",
        "--max-tokens",
        "500",
        "--json",
        cwd=project,
    )
    report = json.loads(result.stdout)
    assert report["truncated"] is True and report["stop_reasons"] == ["context"]
    assert len(report["prompt"]) + len(report["samples"][0].encode()) == 64 + 1  # seq_len, plus the last drawn
    assert "notice:" not in result.stderr  # --json says it in its own fields
    shown = cli("nnx-generate", "ref", "--prompt", "1. my lord", "--temperature", "0", "--max-tokens", "500",
                cwd=project)  # fmt: skip
    assert shown.returncode == 0 and shown.stdout.rstrip("\n") == report["prompt"] + report["samples"][0]
    assert "notice: the sample stopped at the model's context of 64 tokens, before --max-tokens 500" in shown.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x" * 80], "more than the model's context of 64"),
        (["--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt", "hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--prompt", "hi", "--step", "7"], "--step 7: no such checkpoint"),
        (["--prompt", "hi", "--seed", str(2**64)], f"--seed must be 0 to 2**32 - 1, got {2**64}"),
        (["--prompt", "hi", "--seed", "-1"], "--seed must be 0 to 2**32 - 1, got -1"),
        (["--prompt", os.fsdecode(b"ab\xff\xfe")], "--prompt is not UTF-8 text (a byte at 2 is not)"),
    ],
    ids=["empty", "long", "top-p", "temperature", "max-tokens", "step", "seed-big", "seed-negative", "not-utf8"],
)
def test_generate_rejects_bad_input_with_one_line(reference: Path, project: Path, args: list[str], fragment: str):
    assert_user_error(cli("nnx-generate", "ref", *args, cwd=project), fragment)


def test_generate_out_of_memory_names_its_own_knobs_not_trainings(reference: Path, project: Path):
    """Each sample's key-value cache: 2 layers x 64 positions x 64 features, keys and values, in float32."""
    samples = 4 * cli_device_memory() // (2 * 64 * 64 * 2 * 4)
    result = cli("nnx-generate", "ref", "--prompt", "the", "--num-samples", str(samples), "--max-tokens", "4",
                 cwd=project, memory_limit=True)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: out of device memory (could not allocate "), message
    # learned positions: the cache holds the whole context (it said 3 prompt + 4 new, and to ask for fewer)
    assert f"the key-value cache holds up to {samples} x the model's whole context (64) positions" in message, message
    assert message.endswith("ask for fewer with --num-samples") and "train.batch_size" not in message


def test_samples_out_of_memory_at_an_eval_name_the_sample_knobs_and_keep_the_step(project: Path):
    """The eval's samples ran out of memory with the training step's advice (train.batch_size, model.remat)."""
    tokens = 4 * cli_device_memory() // (2 * 2 * 64 * 2 * 4)  # 2 prompts x 2 layers x 64 features, k and v, float32
    overrides = ("model.positions=rope", "train.steps=1", "train.eval_max_batches=1", f"train.sample_tokens={tokens}")
    result = cli("nnx-train", "lm.yaml", *overrides, "--workdir", "samples-oom", cwd=project, memory_limit=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: out of device memory (could not allocate "), message
    assert "the eval's samples need a key-value cache of 2 x (" in message, message
    assert f" prompt + {tokens} new) positions" in message and "lower train.sample_tokens" in message, message
    assert "train.batch_size" not in message
    assert Checkpointer(project / "samples-oom" / "checkpoints", read_only=True).latest_step() == 1


def test_generate_of_an_image_model_is_a_user_error(project: Path):
    (project / "vae.yaml").write_text("model: {name: vae, hidden_sizes: [8], latent_size: 2}\ntrain: {steps: 2}\n")
    assert cli("nnx-train", "vae.yaml", "--workdir", "vae", cwd=project).returncode == 0
    assert_user_error(cli("nnx-generate", "vae", "--prompt", "hi", cwd=project), "not a language model")


def test_fine_tuning_starts_from_another_runs_parameters(reference: Path, project: Path):
    result = cli(
        "nnx-train", "lm.yaml", "train.steps=1", "optimizer.learning_rate=0.0", "checkpoint.init_from=ref",
        "--workdir", "tuned", cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"parameters initialised from ref/checkpoints/{STEPS}" in result.stderr
    tuned, ref = final_state(project / "tuned"), final_state(reference)
    assert tuned["step"] == 1
    for x, y in zip(jax.tree.leaves(tuned["params"]), jax.tree.leaves(ref["params"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)  # weight decay * lr 0 = 0


def test_fine_tuning_from_a_run_of_another_shape_names_the_parameter(reference: Path, project: Path):
    result = cli(
        "nnx-train", "lm.yaml", "model.embed_dim=32", "checkpoint.init_from=ref", "--workdir", "x", cwd=project
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]  # after the notice of the held-out eval split
    assert message.startswith("error: config key 'checkpoint.init_from': the parameters of checkpoint ")
    assert "do not fit this model: " in message
    assert "is float32[384, 64] there but float32[384, 32] in this model" in message
    assert not (project / "x").exists()  # the work dir it made, its lock and checkpoints/ too, are gone


def test_fine_tuning_from_a_run_that_no_resume_sets_aside_or_a_damaged_step_says_what_to_do(
    reference: Path, project: Path
):
    """--no-resume with init_from in its own work dir set that run aside, then said it had no checkpoint (and
    blamed an earlier --no-resume); a damaged step dir said to pick another --step, a flag nnx-train lacks."""
    import shutil

    shutil.copytree(reference, project / "own")

    def refused(result, *fragments: str) -> None:  # after the notice of the held-out eval split
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        message = result.stderr.strip().splitlines()[-1]
        assert message.startswith("error: ") and all(f in message for f in fragments), message

    result = cli("nnx-train", "lm.yaml", "--no-resume", "checkpoint.init_from=own", "--workdir", "own", cwd=project)
    refused(result, "config key 'checkpoint.init_from' ('own') is inside the work dir that --no-resume")
    assert integrity.steps(project / "own" / "checkpoints") == integrity.steps(reference / "checkpoints")
    step = integrity.steps(reference / "checkpoints")[-1]
    shutil.copytree(reference, project / "damaged")
    state = project / "damaged" / "checkpoints" / str(step) / "state"
    target = sorted(p for p in state.rglob("*") if p.is_file() and p.stat().st_size > 100)[0]
    data = bytearray(target.read_bytes())
    data[50] ^= 0xFF
    target.write_bytes(bytes(data))
    result = cli(
        "nnx-train", "lm.yaml", f"checkpoint.init_from=damaged/checkpoints/{step}", "--workdir", "y", cwd=project
    )
    refused(
        result,
        f"config key 'checkpoint.init_from': checkpoint damaged/checkpoints/{step} cannot be used",
        "point checkpoint.init_from at another step dir, or at the run's work dir for its newest usable step",
    )


def test_inspect_of_a_text_config_reads_no_data_and_shows_the_mesh_split(project: Path):
    result = cli(
        "nnx-inspect", "lm.yaml", "data.source=/nowhere/at/all.txt", "sharding.mesh.data=4", "sharding.mesh.model=2",
        "--json", "--filter", "Param", cwd=project,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    entries = {e["path"]: e for e in json.loads(result.stdout)["entries"]}
    kernels = [e for path, e in entries.items() if path.endswith("kernel") and "mlp" in e["sharding"]]
    assert kernels and all(e["sharding"][0] == "layers" for e in kernels)
    assert {tuple(e["mesh_axes"][1:]) for e in kernels} <= {("data", "model"), ("model", "data")}


def test_inspect_says_which_attention_runs(project: Path):
    result = cli("nnx-inspect", "lm.yaml", "data.source=/nowhere.txt", "--json", "--filter", "Param", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["attention"].startswith("core (auto on ")  # float32: the core anywhere


def test_cudnn_attention_where_it_cannot_run_is_a_user_error(project: Path):
    result = cli("nnx-inspect", "lm.yaml", "data.source=/nowhere.txt", "model.attention=cudnn", cwd=project)
    assert_user_error(result, "config key 'model.attention': cudnn cannot run here", "use auto, core or xla")


def test_a_language_model_on_data_not_read_as_text_says_to_name_its_column(project: Path):
    """Without data.text_key a JSON Lines source was read as images: 'has no column image', or from nnx-inspect
    'set model.input_shape'."""
    (project / "docs.jsonl").write_text('{"content": "the king shall speak"}\n' * 50)
    for command in ("nnx-train", "nnx-inspect"):
        result = cli(command, "lm.yaml", "data.source=docs.jsonl", "data.text_key=null", cwd=project)
        assert_user_error(result, "model.name 'transformer_lm' is a language model, but data.source 'docs.jsonl' "
                          "is not read as text: set data.text_key")  # fmt: skip
    assert not (project / "runs").exists()


def test_run_json_says_which_attention_ran(reference: Path):
    ran = json.loads((reference / "run.json").read_text())["attention"]
    assert ran.startswith("core (auto on ")


def test_a_run_read_with_another_tokenizer_than_it_trained_with_is_refused(reference: Path, project: Path):
    """`nnx-eval RUN data.tokenizer=other.json` on a run trained on bytes printed a loss of 7e29 with exit 0, and
    nnx-generate wrote empty samples: the ids mean other text to the model."""
    from hf_support import fixture

    assert json.loads((reference / "run.json").read_text())["tokenizer"] == {"name": "bytes", "version": "utf8-1"}
    other = fixture("qwen2") / "tokenizer.json"
    for command, more in (("nnx-eval", []), ("nnx-generate", ["--prompt", "the king"])):
        result = cli(command, "ref", f"data.tokenizer={other}", *more, cwd=project)
        assert_user_error(result, f"config key 'data.tokenizer': '{other}' is not the tokenizer the run in 'ref' "
                          "trained with ('bytes', version utf8-1; this one is ")  # fmt: skip
    # a model directory's tokenizer: it generated with exit 0, decoding the byte ids as its own
    result = cli("nnx-generate", "ref", f"data.tokenizer={fixture('llama')}", "--prompt", "the king", cwd=project)
    assert_user_error(result, f"config key 'data.tokenizer': '{fixture('llama')}' is not the tokenizer the run in "
                      "'ref' trained with ('bytes'): its ids mean other text to the model")  # fmt: skip


def test_a_7b_parameter_model_inspects_in_seconds_without_parameter_memory(project: Path):
    big = ["model.num_layers=32", "model.num_heads=32", "model.embed_dim=4096", "data.seq_len=2048"]
    result = cli("nnx-inspect", "lm.yaml", *big, "data.source=/nowhere.txt", "--json", cwd=project, timeout=60)
    assert result.returncode == 0, result.stderr
    assert 6.0e9 < json.loads(result.stdout)["total_params"] < 8.0e9


@pytest.fixture(scope="module")
def on_meshes(project: Path) -> tuple[Path, Path]:
    """20 steps on 1 device and on 8 (FSDP over data=4 x tensor parallel over model=2): only `sharding` differs."""
    short = ["train.steps=20", "train.log_every=10", "train.eval_every=20", "checkpoint.every_steps=20"]
    one = cli("nnx-train", "lm.yaml", *short, "--workdir", "one", cwd=project, timeout=300)
    assert one.returncode == 0, one.stderr
    mesh = ["sharding.mesh.data=4", "sharding.mesh.model=2"]
    eight = cli("nnx-train", "lm.yaml", *short, *mesh, "--workdir", "eight", cwd=project, devices=8, timeout=300)
    assert eight.returncode == 0, eight.stderr
    return project / "one", project / "eight"


def test_eight_devices_with_fsdp_and_tensor_parallel_train_like_one(on_meshes: tuple[Path, Path]):
    one, eight = on_meshes
    for a, b in zip(records(one, "train") + records(one, "eval"), records(eight, "train") + records(eight, "eval")):
        for name in ("loss", "accuracy"):
            assert a["metrics"][name] == pytest.approx(b["metrics"][name], rel=1e-4, abs=1e-4)


def test_the_eight_device_checkpoint_keeps_kernels_split_over_both_axes(on_meshes: tuple[Path, Path]):
    _, eight = on_meshes
    ckpt = Checkpointer(eight / "checkpoints", read_only=True)
    params = ckpt.metadata(ckpt.latest_step())["params"]
    specs = {
        "/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.sharding.partition_spec)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if hasattr(leaf, "sharding") and leaf.sharding is not None
    }
    split_both = [name for name, spec in specs.items() if "data" in spec and "model" in spec]
    assert any("mlp" in name for name in split_both) and any("attention" in name for name in split_both), specs


def test_a_model_trained_on_eight_devices_samples_in_one_process(on_meshes: tuple[Path, Path], project: Path):
    _, eight = on_meshes
    result = cli("nnx-generate", eight, "--prompt", "2. the", "--max-tokens", "8", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 20


def test_generate_and_export_name_a_damaged_step_on_one_line_and_use_the_one_before(reference: Path, project: Path):
    """As nnx-train and nnx-eval do: one line per bad step, however long its path (it was folded at 80
    columns when stderr is no terminal)."""
    import shutil

    run = project / "damaged" / ("a-long-directory-name-" * 3)
    shutil.copytree(reference, run)
    data = max((run / "checkpoints" / str(STEPS) / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # every bit flipped
    generated = cli("nnx-generate", run, "--prompt", "3. the", "--max-tokens", "2", "--json", cwd=project)
    exported = cli("nnx-export", run, "--out", project / "damaged" / "hf", cwd=project)
    for result in (generated, exported):
        assert result.returncode == 0, result.stderr
        [line] = [line for line in result.stderr.splitlines() if "cannot be used" in line]
        assert line.endswith("content differs from its checksum (xxh3_128); trying the one before it"), line
    assert json.loads(generated.stdout)["step"] == STEPS * 3 // 4


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.vocab_size=3", r"'model.vocab_size' is 3, fewer rows than the tokenizer's 257 ids"),
        ("model.num_classes=100", r"'model.num_classes' is 100, fewer rows than the tokenizer's 257 ids"),
        (f"model.pretrained={Path(__file__).parent / 'fixtures' / 'hf' / 'llama'}",
         r"'data.tokenizer' is bytes, but model.pretrained was trained on its own tokenizer's ids"),
    ],
    ids=["vocab-size", "num-classes", "pretrained-with-bytes"],
)  # fmt: skip
def test_a_vocabulary_that_does_not_fit_the_tokenizer_is_refused_at_set_up(project: Path, override, message):
    """A model with fewer rows than the tokenizer's ids trained at a loss of 1e30 and failed at its first eval;
    a pretrained model fed byte ids failed sampling and exported its own tokenizer beside them."""
    from nnx_cli.config import load_config
    from nnx_cli.errors import UserError
    from nnx_cli.experiment import setup

    options = [f"data.source={project / 'book.txt'}", f"data.cache_dir={project / 'c'}", override]
    config: Path | None = project / "lm.yaml"
    if "pretrained" in override:  # the model's shape from its config.json
        config, options = None, [*options, "model.name=transformer_lm", "data.text_key=text", "data.tokenizer=bytes"]
    with pytest.raises(UserError, match=message):
        setup(load_config(config, options), data="train")
