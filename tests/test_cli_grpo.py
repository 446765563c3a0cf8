"""GRPO from the command line, as a user runs it: LoRA adapters on a tiny model learn an easy character-level reward
from a user's module in the working directory, a run killed with -9 resumes to the same weights bit for bit, its
evals sample the same on eight devices as on one, it exports like any run (merged or as a PEFT adapter), and a
reward that does not import or fails mid-run is named (with its step) while every checkpoint before it stays."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_support import cli, final_state, start, wait_for_checkpoint
from hf_support import LLAMA_CONFIG, write_model_dir

from nnx_cli.checkpoint import Checkpointer

CHARS = "abcdefghijklmnopqrstuvwxyz .,?"
WORDS = "river mill boat bridge guard fiddler spring square lamp song child teacher wheat wine".split()
STEPS = 24
CONFIG = f"""
seed: 0
model: {{name: transformer_lm, pretrained: chars, lora: {{rank: 8, alpha: 16}}}}
data: {{source: prompts.jsonl, format: prompt, seq_len: 47, eval_split: test}}
objective: {{name: grpo, rewards: [my_rewards.vowels], num_generations: 4, max_new_tokens: 8}}
optimizer: {{name: adamw, learning_rate: 5.0e-2}}
train: {{batch_size: 2, steps: {STEPS}, log_every: 4, eval_every: 12}}
checkpoint: {{every_steps: 12, keep: 10}}
"""
REWARDS = '''
import os
import time

calls = 0


def vowels(prompts, completions, **columns):
    """The share of vowels among a completion's characters (0 for an empty one)."""
    time.sleep(float(os.environ.get("SLOW_REWARDS", 0)))
    return [sum(ch in "aeiou" for ch in c) / len(c) if c else 0.0 for c in completions]


def flaky(prompts, completions, level, **columns):
    """The row's level, but it fails the third time it is called."""
    global calls
    calls += 1
    if calls == 3:
        raise ValueError("the scoring service is down")
    return [float(x) for x in level]
'''


def write_char_model(directory: Path) -> None:
    """A random Llama-shaped model over characters: `<s>`, `</s>` (its end token), `<unk>`, then CHARS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    write_model_dir(directory, {**LLAMA_CONFIG, "vocab_size": 3 + len(CHARS), "max_position_embeddings": 64})
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo")
    write_char_model(root / "chars")
    rng = random.Random(0)
    rows = [{"prompt": f"tell me about the {' and the '.join(rng.sample(WORDS, 2))}.", "level": i % 3}
            for i in range(24)]  # fmt: skip
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "my_rewards.py").write_text(REWARDS)
    (root / "grpo.yaml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def run(project: Path) -> Path:
    result = cli("nnx-train", "grpo.yaml", "--workdir", "run", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    return project / "run"


def records(workdir: Path, split: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_resuming_at_a_step_that_num_iterations_does_not_divide_is_exit_2_and_changes_nothing(run, project):
    """It ended in a traceback (a GRPO dispatch is 5 steps from a multiple of 5; got 1 from step 24), exit 1."""
    import shutil

    shutil.copytree(run, project / "iterations")

    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in (project / "iterations").iterdir() if p.is_file() and p.name != ".lock"}

    before = files()
    result = cli("nnx-train", "grpo.yaml", "--workdir", "iterations", "objective.num_iterations=5", "train.steps=30",
                 "train.log_every=5", "train.eval_every=15", "checkpoint.every_steps=15", cwd=project)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: this run resumes at step 24, which objective.num_iterations (5) does not divide: each batch of "
        "completions trains 5 steps from a multiple of 5; resume with the num_iterations its steps so far had, or one "
        "that divides the step"
    )
    assert files() == before


def test_lora_adapters_learn_an_easy_reward_from_the_users_module_and_log_the_grpo_metrics(run):
    train, evals = records(run, "train"), records(run, "eval")
    assert set(train[0]["metrics"]) >= {"loss", "clip_ratio", "reward", "reward_std", "reward/vowels",
                                         "completion_length"}  # fmt: skip
    assert "kl" not in train[0]["metrics"]  # beta 0: no KL term, no reference
    first, last = train[0]["metrics"]["reward"], train[-1]["metrics"]["reward"]
    assert last > first + 0.1, (first, last)  # the untouched model's completions score about 0.2
    assert [r["step"] for r in evals] == [12, STEPS] and evals[-1]["metrics"]["reward"] > first + 0.1
    assert set(evals[0]["metrics"]) == {"reward", "reward_std", "reward/vowels", "completion_length"}
    shown = (run / "samples" / f"{STEPS}.txt").read_text()
    assert shown.startswith("--- prompt 0\ntell me about the ") and "--- completion 0.3: reward " in shown


def test_a_killed_grpo_run_resumes_to_the_same_weights(run, project, monkeypatch):
    monkeypatch.setenv("SLOW_REWARDS", "0.2")  # the killed run scores slowly: the kill lands before its end
    proc = start("nnx-train", "grpo.yaml", "--workdir", "killed", cwd=project)
    wait_for_checkpoint(project / "killed", 12, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = Checkpointer(project / "killed" / "checkpoints", read_only=True).latest_step()
    assert killed_at < STEPS
    monkeypatch.delenv("SLOW_REWARDS")
    result = cli("nnx-train", "grpo.yaml", "--workdir", "killed", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"resumed from killed/checkpoints/{killed_at}" in result.stderr
    a, b = final_state(project / "killed"), final_state(run)
    assert a["step"] == b["step"] == STEPS
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    logged = [
        {k: r["metrics"][k] for k in ("loss", "reward", "grad_norm")} for r in records(project / "killed", "train")
    ]
    assert logged[-1] == {k: records(run, "train")[-1]["metrics"][k] for k in ("loss", "reward", "grad_norm")}


def test_evals_sample_the_same_completions_on_eight_devices_as_on_one(run, project):
    """nnx-eval draws with the eval's keys: on eight devices it scores what the run's final eval scored."""
    result = cli("nnx-eval", "run", "sharding.mesh={data: 8, model: 1}", "--json", cwd=project, devices=8)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["metrics"] == pytest.approx(records(run, "eval")[-1]["metrics"], rel=1e-5)


def test_a_batch_of_completions_the_mesh_does_not_divide_names_the_key_with_its_own_value(run, project):
    """It said 'train.eval_batch_size' (12), the completions of the 3 prompts it was set to."""
    result = cli("nnx-eval", "run", "sharding.mesh={data: 8, model: 1}", "train.eval_batch_size=3", cwd=project,
                 devices=8)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config key 'train.eval_batch_size' (3) x objective.num_generations (4) = 12 completions must be "
        "divisible by the 8 ways the batch is split on the mesh {'data': 8, 'model': 1}"
    )


def test_a_grpo_run_exports_merged_and_as_an_adapter_like_any_run(run, project):
    for form, flags in (("merged", []), ("adapter", ["--adapter"])):
        result = cli("nnx-export", "run", "--out", f"export-{form}", *flags, cwd=project)
        assert result.returncode == 0, result.stderr
    merged = json.loads((project / "export-merged" / "config.json").read_text())
    assert merged["architectures"] == ["LlamaForCausalLM"] and (project / "export-merged" / "tokenizer.json").is_file()
    adapter = json.loads((project / "export-adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)


def test_a_reward_that_does_not_import_is_exit_2_naming_it_and_the_run_keeps_everything(run, project):
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    result = cli("nnx-train", "grpo.yaml", "--workdir", "run", "train.steps=36", "objective.rewards=[my_rewards.vowel]",
                 cwd=project)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config key 'objective.rewards[0]': module 'my_rewards' has no attribute 'vowel'"
    )
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


def test_a_reward_function_that_fails_in_an_eval_keeps_the_step_that_eval_was_of(project):
    """The eval runs before its step's checkpoint: a reward failing there lost the step, and a run's first eval
    failing left no checkpoint at all."""
    rewards = "objective.rewards=[my_rewards.vowels, my_rewards.flaky]"  # flaky: its third call, the eval's first
    result = cli("nnx-train", "grpo.yaml", "--workdir", "flaky_eval", rewards, "train.steps=2", "train.log_every=2",
                 "checkpoint.every_steps=2", "train.eval_every=2", cwd=project)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines[-2:] == [
        "checkpoint written at flaky_eval/checkpoints/2 before stopping",
        "error: reward function 'my_rewards.flaky' raised ValueError: the scoring service is down evaluating step 2 "
        "(scoring 8 completions)",
    ]
    assert Checkpointer(project / "flaky_eval" / "checkpoints", read_only=True).all_steps() == [2]


MORE_REWARDS = """
def graded(prompts, completions, grade, **columns):
    return [1.0] * len(completions)


def strict(prompts, completions):
    return [1.0] * len(completions)
"""
COLUMNS = [
    ("[{name: math_answer, column: levle}]", "config key 'objective.rewards[0]': reward 'math_answer' reads a column "
     "'levle' that the prompt rows of 'prompts.jsonl' lack (did you mean 'level'?); their columns: level (set "
     "{name: math_answer, column: ...})"),
    ("[my_rewards.vowels, more_rewards.graded]", "config key 'objective.rewards[1]': reward 'more_rewards.graded' "
     "reads a column 'grade' that the prompt rows of 'prompts.jsonl' lack; their columns: level"),
    ("[more_rewards.strict]", "config key 'objective.rewards[0]': reward function 'more_rewards.strict' has no "
     "parameter 'level', and every reward is called with prompts, completions and each column of the prompt rows "
     "by name (level); add **columns to its parameters"),
]  # fmt: skip


@pytest.mark.parametrize("rewards, message", COLUMNS, ids=["built-in", "parameter", "no-columns"])
def test_a_reward_that_cannot_take_the_prompt_rows_is_exit_2_before_the_run_starts(project, rewards, message):
    """It was found at the first step, after the model had loaded and the run had made its work dir."""
    (project / "more_rewards.py").write_text(MORE_REWARDS)
    result = cli("nnx-train", "grpo.yaml", "--workdir", "columns", f"objective.rewards={rewards}", cwd=project)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert not (project / "columns").exists()


def test_a_reward_function_that_fails_mid_run_is_exit_2_naming_it_and_its_step_and_keeps_the_checkpoints(project):
    rewards = "objective.rewards=[my_rewards.vowels, my_rewards.flaky]"
    result = cli("nnx-train", "grpo.yaml", "--workdir", "flaky", rewards, "train.steps=4", "checkpoint.every_steps=2",
                 "train.eval_every=4", cwd=project)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "error: reward function 'my_rewards.flaky' raised ValueError: the scoring service is down at step 3 (scoring 8 "
        "completions)"
    )
    assert Checkpointer(project / "flaky" / "checkpoints", read_only=True).all_steps() == [2]
