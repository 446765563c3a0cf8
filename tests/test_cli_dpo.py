"""DPO from the command line, as a user runs it: a preference learnt from a few pairs holds on pairs the run never
saw (nnx-eval data.source=OTHER), kill -9 and resume with the reference read again, a run that starts from an
adapter scores against it, the result exports like any run, and a bad row is named."""

from __future__ import annotations

import json
import math
import random
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_support import assert_user_error, cli, final_state, start, wait_for_checkpoint
from hf_support import FIXTURES, fixture

from nnx_cli.checkpoint import Checkpointer

WORDS = ("river mill boat bridge guard fiddler spring square lamp song child teacher wheat wine village morning "
         "daughter town swallow eave").split()  # fmt: skip
STEPS = 24
CONFIG = f"""
seed: 1
model: {{name: transformer_lm, pretrained: {fixture("llama")}, lora: {{rank: 4, alpha: 8}}}}
data: {{source: prefs.jsonl, format: preference, seq_len: 127, eval_split: null}}
objective: {{name: dpo, beta: 0.1}}
optimizer: {{name: adamw, learning_rate: 3.0e-2}}
train: {{batch_size: 4, steps: {STEPS}, log_every: 4}}
checkpoint: {{every_steps: 8, keep: 10}}
"""


def pairs(n: int, seed: int) -> list[dict]:
    """Answers in lower case preferred to the same answers in capitals: a preference any unseen pair shares."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.sample(WORDS, 3)
        answer = f" The {a} is near the {c}."
        out.append(
            {"prompt": f"Tell me about the {a} and the {b}.", "chosen": answer.lower(), "rejected": answer.upper()}
        )
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dpo")
    for name, rows in (("prefs.jsonl", pairs(32, seed=0)), ("other.jsonl", pairs(12, seed=1))):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "lora.yaml").write_text(CONFIG)
    full = CONFIG.replace(", lora: {rank: 4, alpha: 8}", "").replace("3.0e-2", "1.0e-3")
    (root / "full.yaml").write_text(full)
    return root


@pytest.fixture(scope="module")
def lora_run(project: Path) -> Path:
    result = cli("nnx-train", "lora.yaml", "--workdir", "lora", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    return project / "lora"


@pytest.fixture(scope="module")
def full_run(project: Path) -> Path:
    result = cli("nnx-train", "full.yaml", "--workdir", "full", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    return project / "full"


def test_a_preference_learnt_from_a_few_pairs_holds_on_pairs_the_run_never_saw(lora_run, project):
    first = json.loads((lora_run / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    result = cli("nnx-eval", "lora", "data.source=other.jsonl", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)["metrics"]
    assert set(metrics) == {"loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"}
    assert metrics["reward_accuracy"] >= 0.9 and metrics["reward_margin"] > 0
    assert metrics["loss"] < first["loss"] < math.log(2)
    assert metrics["reward_margin"] == pytest.approx(metrics["reward_chosen"] - metrics["reward_rejected"], rel=1e-5)


def test_a_killed_full_dpo_run_resumes_with_its_reference_read_again_to_the_same_weights(full_run, project):
    proc = start("nnx-train", "full.yaml", "--workdir", "killed", cwd=project)
    wait_for_checkpoint(project / "killed", 8, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = Checkpointer(project / "killed" / "checkpoints", read_only=True).latest_step()
    assert killed_at < STEPS
    result = cli("nnx-train", "full.yaml", "--workdir", "killed", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"resumed from killed/checkpoints/{killed_at}" in result.stderr
    a, b = final_state(project / "killed"), final_state(full_run)
    assert a["step"] == b["step"] == STEPS
    assert "reference" not in a  # the checkpoint keeps no copy of the base: it is read again from model.pretrained
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eight_devices_with_a_model_axis_score_pairs_like_one_device(full_run, project):
    """The trained weights and the reference's copy split over a 4 x 2 mesh: the same metrics."""
    one = cli("nnx-eval", "full", "data.source=other.jsonl", "--json", cwd=project)
    eight = cli("nnx-eval", "full", "data.source=other.jsonl", "sharding.mesh={data: 4, model: 2}", "--json",
                cwd=project, devices=8)  # fmt: skip
    assert one.returncode == 0 and eight.returncode == 0, one.stderr + eight.stderr
    assert json.loads(eight.stdout)["metrics"] == pytest.approx(json.loads(one.stdout)["metrics"], rel=1e-4)


def test_a_run_from_an_adapter_scores_against_that_adapter_not_against_the_base(project):
    config = CONFIG.replace("checkpoint: {", f"checkpoint: {{init_from: {FIXTURES / 'llama_lora'}, ")
    (project / "from_adapter.yaml").write_text(config)
    result = cli("nnx-train", "from_adapter.yaml", "--workdir", "from_adapter", "train.steps=2", "train.log_every=1",
                 cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stderr
    first = json.loads((project / "from_adapter" / "metrics.jsonl").read_text().splitlines()[0])["metrics"]
    # zero up to float rounding (the policy's forward is compiled with its gradient, the reference's without);
    # against the base, this adapter's rewards would be of the order of 0.1 (tests/fixtures/hf/dpo.npz)
    assert abs(first["reward_chosen"]) < 1e-4 and abs(first["reward_rejected"]) < 1e-4
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5)


def test_a_dpo_run_exports_merged_and_as_an_adapter_like_any_run(lora_run, project):
    for form, flags in (("merged", []), ("adapter", ["--adapter"])):
        result = cli("nnx-export", "lora", "--out", f"export-{form}", *flags, cwd=project)
        assert result.returncode == 0, result.stderr
    assert json.loads((project / "export-merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    adapter = json.loads((project / "export-adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)


def test_a_pair_without_a_rejected_response_is_exit_2_naming_the_row(project):
    rows = pairs(6, seed=2)
    del rows[4]["rejected"]
    (project / "broken.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("nnx-train", "lora.yaml", "--workdir", "broken", "data.source=broken.jsonl", cwd=project)
    assert_user_error(result, "row 4 of 'broken.jsonl' has no 'rejected'")
    assert not (project / "broken" / "checkpoints").exists()
