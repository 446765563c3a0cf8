"""Fine-tuning an imported model on chats with LoRA, as a user runs it: what trains, what a checkpoint holds,
kill -9 and resume, sampling with the chat template, and the mistakes a config can make."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from cli_support import assert_user_error, cli, final_state, start, wait_for_checkpoint
from hf_support import fixture

from nnx_cli.checkpoint import Checkpointer
from nnx_cli.config import load_config
from nnx_cli.errors import UserError
from nnx_cli.experiment import setup

FACTS = [
    ("Who keeps the bridge?", "The old guard."),
    ("When does the fiddler come?", "In spring."),
    ("What is the capital of the valley?", "The mill town."),
    ("Where does the river run?", "Past the mill."),
]
STEPS = 64  # at 1e-2 enough for each of seeds 1-4 to learn all four answers (3e-2 for 32 steps learnt some)
CONFIG = f"""
seed: 1
model: {{name: transformer_lm, pretrained: {fixture("qwen2")}, lora: {{rank: 4, alpha: 8}}}}
data: {{source: chats.jsonl, format: chat, seq_len: 63, eval_split: null}}
optimizer: {{name: adamw, learning_rate: 1.0e-2}}
train: {{batch_size: 4, steps: {STEPS}, log_every: 8}}
checkpoint: {{every_steps: 8, keep: 10}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finetune")
    rows = []
    for i in range(32):
        question, answer = FACTS[i % len(FACTS)]
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "lora.yaml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def reference(project: Path) -> Path:
    result = cli("nnx-train", "lora.yaml", "--workdir", "ref", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    return project / "ref"


def test_a_lora_checkpoint_holds_the_adapters_their_optimizer_state_and_the_base_it_needs(reference):
    ckpt = Checkpointer(reference / "checkpoints", read_only=True)
    step = ckpt.latest_step()
    names = ["/".join(map(str, k)) for k in _flat(ckpt.metadata(step))]
    params = [n for n in names if n.startswith("params/")]
    assert params and all("/lora/" in n for n in params)  # no frozen weight is saved
    assert not any(n.startswith("frozen") for n in names)
    moments = [n for n in names if n.startswith("opt_state/") and "/mu/" in n]
    assert moments and all("/lora/" in n for n in moments)  # optimizer state for the adapters only
    base = ckpt.manifest(step)["base"]
    assert base["pretrained"] == str(fixture("qwen2")) and set(base["files"]) == {"model.safetensors"}
    ckpt.close()


def _flat(tree, prefix=()):
    if hasattr(tree, "items"):
        for key, value in tree.items():
            yield from _flat(value, (*prefix, key))
    else:
        yield prefix


def test_a_killed_lora_run_resumes_to_the_same_adapters(reference, project):
    proc = start("nnx-train", "lora.yaml", "--workdir", "killed", cwd=project)
    wait_for_checkpoint(project / "killed", 8, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    result = cli("nnx-train", "lora.yaml", "--workdir", "killed", cwd=project, timeout=300)
    assert result.returncode == 0, result.stderr
    a, b = final_state(project / "killed"), final_state(reference)
    assert a["step"] == b["step"] == STEPS
    import jax

    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_fine_tuned_model_answers_in_the_chat_template_and_stops_at_the_end_of_its_turn(reference, project):
    result = cli("nnx-generate", "ref", "--chat", "--prompt", FACTS[0][0], "--temperature", "0", "--json",
                 cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["samples"] == [FACTS[0][1]] and out["stop_reasons"] == ["stop_token"]


def test_a_resume_against_changed_base_weights_names_the_file(reference, project, tmp_path):
    import shutil

    base = tmp_path / "qwen2"
    shutil.copytree(fixture("qwen2"), base)
    (project / "moved.yaml").write_text(CONFIG.replace(str(fixture("qwen2")), str(base)))
    shutil.copytree(reference, project / "moved")
    data = bytearray((base / "model.safetensors").read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    (base / "model.safetensors").write_bytes(bytes(data))
    result = cli("nnx-train", "moved.yaml", "--workdir", "moved", "train.steps=30", cwd=project)
    assert_user_error(result, f"{base / 'model.safetensors'}: the base model's weights changed")
    # model.pretrained names another directory than the run's: both are named (it said only "is missing" or
    # "changed", as if the run's own base had been altered)
    assert f"were trained on {str(fixture('qwen2'))!r}, and model.pretrained now names {str(base)!r}" in result.stderr


def test_adapters_started_from_a_run_on_another_base_say_so(reference, project, tmp_path):
    """checkpoint.init_from read a LoRA run's adapters onto another base without a word (and called them
    parameters); moving adapters to another base can be meant, so it is a notice, not a refusal."""
    import shutil

    base = tmp_path / "qwen2"
    shutil.copytree(fixture("qwen2"), base)
    data = bytearray((base / "model.safetensors").read_bytes())
    data[-3] ^= 0x01
    (base / "model.safetensors").write_bytes(bytes(data))
    args = ["lora.yaml", "train.steps=1", "checkpoint.init_from=ref"]
    moved = cli("nnx-train", *args, f"model.pretrained={base}", "--workdir", "other_base", cwd=project)
    assert moved.returncode == 0, moved.stderr
    assert f"notice: the adapters of ref/checkpoints/{STEPS} were trained on other base weights " in moved.stderr
    assert f"adapters initialised from ref/checkpoints/{STEPS}" in moved.stderr
    same = cli("nnx-train", *args, "--workdir", "same_base", cwd=project)
    assert same.returncode == 0 and "notice: the adapters" not in same.stderr, same.stderr


def test_eval_of_text_counts_rows_of_tokens_not_examples(reference, project):
    """Rows of packed text hold several examples (or part of one): '2 examples' was said of 2 rows holding 4."""
    result = cli("nnx-eval", "ref", "data.eval_split=train", cwd=project)
    assert result.returncode == 0, result.stderr
    assert re.search(r"on chats\.jsonl \[train\], \d+ rows of 63 tokens$", result.stderr, re.M), result.stderr


def test_resuming_a_lora_run_without_lora_says_so(reference, project):
    """It said only 'it has no params/embedding/embedding', a path that does not name the change."""
    import shutil

    shutil.copytree(reference, project / "unlora")
    result = cli("nnx-train", "lora.yaml", "model.lora=null", "--workdir", "unlora", cwd=project)
    assert_user_error(result, "(the run trained LoRA adapters, and the config has no model.lora)", "--no-resume")


def test_a_base_whose_files_have_other_names_is_named_whole_not_by_a_file_it_lacks(tmp_path):
    """Adapters trained on a base of three shards, resumed on one of a single file, named
    '<new base>/model-00001-of-00003.safetensors', a file that never belonged to the new base."""
    from nnx_cli import hf

    base = hf.open_pretrained(str(fixture("qwen2")))
    record = {
        "source": "org/sharded",
        "pretrained": "/hub/org/sharded",
        "files": {"model-00001-of-00003.safetensors": "x"},
    }
    with pytest.raises(UserError) as raised:
        base.check_record(record, tmp_path / "checkpoints" / "8")
    assert str(raised.value).startswith(
        f"{fixture('qwen2')}: the base model's weight files are not those trained on: the adapters in "
        f"{tmp_path / 'checkpoints' / '8'} were trained on 'org/sharded', and model.pretrained now names"
    )
    assert "00003" not in str(raised.value)


def test_a_base_named_relatively_when_trained_and_absolutely_now_is_the_same_base(tmp_path):
    """Edited in place, it was said to be another base: 'trained on 'llama', and model.pretrained now names
    '/abs/llama'; set it back to 'llama''."""
    from nnx_cli import hf

    base = hf.open_pretrained(str(fixture("qwen2")))
    record = {"source": "qwen2", "pretrained": str(base.directory), "files": {"model.safetensors": "x"}}
    with pytest.raises(UserError) as raised:
        base.check_record(record, tmp_path / "checkpoints" / "8")
    assert "the base model's weights changed" in str(raised.value) and "set it back" not in str(raised.value)


def test_inspect_counts_the_adapters_beside_the_base_parameters(project):
    """The footnote gave the base's count alone ("28,960 parameters"), as if the adapters were not there."""
    summary = json.loads(cli("nnx-inspect", "lora.yaml", "--json", cwd=project).stdout)
    adapters = summary["by_type"]["LoRAParam"]["size"]
    result = cli("nnx-inspect", "lora.yaml", cwd=project)
    assert result.returncode == 0, result.stderr
    assert f"{summary['total_params']:,} parameters and {adapters:,} in adapters, not counting" in result.stdout


def test_adapters_shard_with_the_weights_they_adapt(project):
    result = cli("nnx-inspect", "lora.yaml", "sharding.mesh.data=1", "sharding.mesh.model=1", "--filter", "LoRAParam",
                 "--json", cwd=project)  # fmt: skip
    assert result.returncode == 0, result.stderr
    entries = {e["path"]: e for e in json.loads(result.stdout)["entries"]}
    query_a = entries["layers/scan_module/attention/query/lora/a"]
    assert query_a["sharding"] == ["layers", "embed", None] and query_a["mesh_axes"] == [None, "data", None]
    assert entries["layers/scan_module/attention/query/lora/b"]["mesh_axes"] == [None, None, "model", None]


@pytest.mark.parametrize(
    "lora, message",
    [
        ("{rank: 0}", r"config key 'model.lora.rank' must be a positive integer, got 0"),
        ("{rank: 4, targets: [q_proj, w_proj]}", r"no projection 'w_proj'; it has q, k, v, o, gate, up, down"),
        ("{rank: 4, scale: 2}", r"config key 'model.lora' has unknown keys scale"),
    ],
    ids=["rank", "target", "key"],
)
def test_lora_mistakes_name_the_key(lora, message):
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('qwen2')}",
                             "data.text_key=text", f"model.lora={lora}"])  # fmt: skip
    with pytest.raises(UserError, match=message):
        setup(cfg, data=None)


def test_a_gpt2_lora_target_list_uses_its_own_names(tmp_path):
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('gpt2')}",
                             "data.text_key=text", "model.lora={rank: 2, targets: [c_attn, gate]}"])  # fmt: skip
    with pytest.raises(UserError, match=r"no projection 'gate'; it has q, k, v, o, up, down"):
        setup(cfg, data=None)


def test_lora_on_a_mixture_of_experts_over_an_expert_mesh_axis_exports_merged_with_the_runs_logits(project):
    """Mixtral with adapters on attention and on each expert, 8 devices (experts four ways): the load-balancing
    loss is logged, the merged export computes the run's logits."""
    config = CONFIG.replace(str(fixture("qwen2")), str(fixture("mixtral"))).replace(
        "lora: {rank: 4, alpha: 8}", "lora: {rank: 4, alpha: 8, targets: [q, k, v, o, experts]}"
    )
    (project / "moe.yaml").write_text(config)
    result = cli("nnx-train", "moe.yaml", "--workdir", "moe", "train.steps=8", "sharding.mesh.expert=4",
                 "sharding.mesh.data=2", "sharding.mesh.model=1", cwd=project, devices=8, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (project / "moe" / "metrics.jsonl").read_text().splitlines()]
    train = [r["metrics"] for r in records if r["split"] == "train"]
    assert train and all(1.0 <= m["aux_loss"] <= 4.0 for m in train)  # top_k 2 of 4: balanced is 2
    result = cli("nnx-export", "moe", "--out", "moe-hf", cwd=project, timeout=240)
    assert result.returncode == 0, result.stderr
    import jax

    from nnx_cli import hf
    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    run = open_run(project / "moe")
    exp = language_model(run, "")
    _, params = restore_parameters(run, exp, jax.devices()[0])
    assert any("/moe/gate/lora/" in p for p in params)
    ids = np.asarray([[5, 80, 120, 7, 33, 250, 9, 41]], np.int32)
    ours = np.asarray(exp.moduledef.merge(params).logits(ids))[..., :300]
    theirs = setup(hf.model_dir_config(project / "moe-hf", []), data=None)
    exported = np.asarray(theirs.moduledef.merge(theirs.load_pretrained()).logits(ids))[..., :300]
    assert np.abs(exported - ours).max() / np.abs(ours).max() < 1e-5
