"""Every example runs, with small sizes, and does what it says."""

import importlib.util
import pathlib
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run(name: str, *argv: str) -> dict:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))


def test_functional_api_example_trains_and_counts_calls():
    result = run("functional_api", "--steps", "30", "--hidden", "16")
    assert result["count"] == 30
    assert np.mean(result["losses"][-5:]) < result["losses"][0]


def test_lifted_transforms_example_trains_a_classifier():
    result = run("lifted_transforms", "--steps", "40", "--hidden", "32")
    assert np.mean(result["losses"][-5:]) < result["losses"][0]
    assert result["accuracy"] > 0.2  # chance is 0.1


def test_train_state_example_counts_steps():
    result = run("train_state", "--steps", "3", "--features", "4", "--batch-size", "8")
    assert result["step"] == 3
    assert all(np.isfinite(result["losses"]))


def test_vae_example_lowers_the_negative_elbo():
    result = run("vae", "--steps", "30", "--hidden", "32", "--latent", "2")
    assert np.mean(result["losses"][-5:]) < result["losses"][0]
    assert result["samples"].shape == (4, 64)


def test_scan_over_layers_example_stacks_params_and_shares_batch_stats():
    result = run("scan_over_layers", "--steps", "3", "--depth", "3", "--features", "8")
    assert result["kernel_shape"] == (3, 8, 8)
    assert result["batch_stats_shape"] == (8,)


def test_transformer_example_cached_decoding_matches_the_full_forward():
    result = run(
        "transformer",
        "--steps",
        "2",
        "--features",
        "16",
        "--heads",
        "2",
        "--depth",
        "2",
        "--length",
        "6",
        "--batch-size",
        "4",
    )
    assert result["max_difference"] < 1e-4


def test_checkpointing_example_restores_the_same_model(tmp_path):
    result = run("checkpointing", "--steps", "2", "--hidden", "8", "--directory", str(tmp_path))
    assert result["same_outputs"]
    assert "bn/mean" in result["paths"]


def test_surgery_example_freezes_the_backbone():
    result = run("surgery", "--steps", "3", "--features", "8")
    assert result["frozen"]
    assert result["trainable"] == ["head/bias", "head/kernel"]
    assert result["head_shape"] == (8, 10)


def test_lora_example_trains_the_adapters_alone_and_merges_exactly():
    result = run("lora", "--steps", "300", "--hidden", "32")
    assert result["trainable"] == 2 * 32 * 4 and result["frozen"] == 2 * 32 + 32 * 32 + 32 + 32 + 1
    assert result["base_unchanged"] and result["optimizer_leaves"] == 1 + 2 * 2  # adam: a count, mu and nu of a and b
    assert np.mean(result["losses"][-10:]) < result["loss_before"] / 3
    assert result["merge_error"] < 1e-5


def test_preferences_example_writes_pairs_the_dpo_config_reads(tmp_path):
    from hf_support import fixture

    import nnx_cli.hf  # noqa: F401  (reads tokenizers of model directories)
    from nnx_cli.config import load_config
    from nnx_cli.data import examples

    result = run("preferences", str(tmp_path / "prefs"))
    seen = {row["prompt"][0]["content"] for row in result["train"]}
    assert len(result["train"]) == 160 and len(result["test"]) == 40
    assert not seen & {row["prompt"][0]["content"] for row in result["test"]}  # the test split asks other things
    cfg = load_config(EXAMPLES.parent / "configs" / "dpo_lora.yaml",
                      [f"data.source={tmp_path / 'prefs'}", f"data.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    splits = examples.load_example_splits(cfg.data, seed=0, pretrained=str(fixture("qwen2")))
    for split, pairs in ((splits.train, 160), (splits.eval, 40)):  # every pair, whole, as two sequences of a row
        assert sum(int(row.max()) for row in split.stored()["segments"]) == 2 * pairs


def test_math_prompts_example_writes_prompts_and_rewards_the_grpo_config_reads(tmp_path, monkeypatch):
    from hf_support import fixture

    import nnx_cli.hf  # noqa: F401  (reads tokenizers of model directories)
    from nnx_cli.config import load_config
    from nnx_cli.data import prompts
    from nnx_cli.objectives import rewards

    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of that name
    result = run("math_prompts", "data/math")
    asked = {row["prompt"][0]["content"] for row in result["train"]}
    assert len(result["train"]) == 200 and len(result["test"]) == 40
    assert not asked & {row["prompt"][0]["content"] for row in result["test"]}  # the test split asks other sums
    cfg = load_config(EXAMPLES.parent / "configs" / "grpo_lora.yaml",
                      [f"model.pretrained={fixture('qwen2')}", f"data.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    splits = prompts.load_prompt_splits(cfg)
    assert (len(splits.train), len(splits.eval)) == (200, 40)
    questions, columns = splits.eval.columns([0, 1])
    assert questions == [row["prompt"] for row in result["test"][:2]] and list(columns) == ["answer"]
    loaded = rewards.load(cfg.objective.options["rewards"])  # my_rewards.short from the current directory
    del sys.modules["my_rewards"]  # a later test's module of that name imports its own
    answer = result["test"][0]["answer"]
    right, wrong = f"That makes {answer}.", "Let me think about it for a long while. " * 8 + "It is 1000001."
    scores = [[r.fn(questions[:1] * 2, [right, wrong], answer=[answer] * 2)] for r in loaded]
    assert [r.name for r in loaded] == ["math_answer", "short"] and scores == [[[1.0, 0.0]], [[1.0, 0.0]]]
