"""DPO: preference rows, the reference model and the metrics, against what `transformers` and `peft` compute
(tests/fixtures/make_dpo_fixtures.py), and the mistakes a config or a row can make."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_support import FIXTURES, fixture, goldens

from nnx_cli import steps
from nnx_cli.config import DataConfig, load_config
from nnx_cli.data import examples
from nnx_cli.errors import UserError
from nnx_cli.experiment import setup
from nnx_cli.hf import peft
from nnx_cli.hf.export import merged
from nnx_cli.objectives.dpo import pair_losses, sequence_logps

RECORD = json.loads((FIXTURES / "dpo.json").read_text())
GOLDENS = goldens("dpo")
RTOL = 2e-3  # what the spec asks; measured: below 1e-5


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_config(tmp_path: Path, rows: list[dict], **options) -> DataConfig:
    source = write_jsonl(tmp_path / "pairs.jsonl", rows)
    settings = {"format": "preference", "tokenizer": "pretrained", "seq_len": 255, "eval_split": None,
                "packing": False, **options}  # fmt: skip
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **settings)


def rows_of(cfg: DataConfig, family: str = "llama") -> dict[str, np.ndarray]:
    return examples.load_example_splits(cfg, seed=0, pretrained=str(fixture(family))).train.stored()


def sequences_of(rows: dict[str, np.ndarray]) -> list[tuple[list[int], list[int]]]:
    """Every sequence of the rows, as (tokens, targets), in order."""
    out = []
    for r in range(len(rows["tokens"])):
        for s in range(1, int(rows["segments"][r].max()) + 1):
            where = rows["segments"][r] == s
            out.append((rows["tokens"][r][where].tolist(), rows["targets"][r][where].tolist()))
    return out


def golden_sequences(family: str, form: str) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(len(RECORD[f"{family}_{form}"])):
        for side in ("chosen", "rejected"):
            ids = GOLDENS[f"{family}_{form}_{i}_{side}_ids"].tolist()
            prompt = int(GOLDENS[f"{family}_{form}_{i}_{side}_prompt_length"])
            out.append((ids, [0] * prompt + [1] * (len(ids) - prompt)))
    return out


# Rows
# ------------------------------------------------------------------------------


def test_standard_pairs_are_the_prompt_with_its_specials_then_the_response_and_the_end_token(tmp_path):
    rows = rows_of(data_config(tmp_path, RECORD["llama_standard"]))
    assert sequences_of(rows) == golden_sequences("llama", "standard")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_conversational_pairs_are_the_rendered_prompt_then_the_assistant_turn_through_its_end(tmp_path, family):
    rows = rows_of(data_config(tmp_path, RECORD[f"{family}_conversational"]), family)
    assert sequences_of(rows) == golden_sequences(family, "conversational")


def test_a_pair_is_two_segments_of_one_row_chosen_first_and_rows_pack_whole_pairs(tmp_path):
    pairs = RECORD["llama_standard"] * 3
    packed = rows_of(data_config(tmp_path, pairs, packing=True))
    alone = rows_of(data_config(tmp_path, pairs, packing=False))
    assert len(alone["tokens"]) == len(pairs) and {int(r.max()) for r in alone["segments"]} == {2}
    assert len(packed["tokens"]) < len(pairs)
    assert sequences_of(packed) == sequences_of(alone) == golden_sequences("llama", "standard") * 3
    for row in packed["segments"]:  # whole pairs only: an even number of sequences in every row
        assert int(row.max()) % 2 == 0


def test_pairs_whose_responses_are_the_same_are_said_to_teach_nothing(tmp_path, capsys):
    """They trained at a loss of log 2 with a reward accuracy of rounding noise, without a word."""
    same = {"prompt": "Who keeps the bridge?", "chosen": " The old guard.", "rejected": " The old guard."}
    rows_of(data_config(tmp_path, [*RECORD["llama_standard"], same, same]))
    said = capsys.readouterr().err
    assert f"2 of {len(RECORD['llama_standard']) + 2} pairs have the same chosen and rejected response" in said


def test_each_sequence_is_cut_at_half_a_row_and_a_pair_with_no_response_left_is_left_out(tmp_path, capsys):
    long = {"prompt": "Who keeps the bridge? " * 4, "chosen": " The old guard.", "rejected": " No one."}
    cfg = data_config(tmp_path, [*RECORD["llama_standard"], long], seq_len=63)
    rows = rows_of(cfg)
    assert [len(ids) for ids, _ in sequences_of(rows)] == [28, 32, 26, 32]  # the rejected ones cut at 32 tokens
    said = capsys.readouterr().err
    assert "3 of 3 pairs have a sequence (prompt and response) longer than 32 tokens" in said
    assert "1 of 3 pairs have a response with no token left after the cut and were left out" in said


@pytest.mark.parametrize("options, key", [({"max_len": 12, "seq_len": 127}, "data.max_len above 12"),
                                          ({"seq_len": 31}, "data.seq_len above 31")])  # fmt: skip
def test_a_training_split_whose_every_pair_is_left_out_names_the_key_that_cut_them(tmp_path, options, key):
    long = {"prompt": "Who keeps the bridge? " * 4, "chosen": " The old guard.", "rejected": " No one."}
    with pytest.raises(UserError, match=rf"training split has no examples: .*; a {key} keeps longer ones"):
        rows_of(data_config(tmp_path, [long, long], **options))


def test_an_eval_split_whose_every_pair_is_left_out_is_an_error_naming_the_way_out(tmp_path):
    long = {"prompt": "Who keeps the bridge? " * 4, "chosen": " The old guard.", "rejected": " No one."}
    cfg = data_config(tmp_path, [*RECORD["llama_standard"] * 4, long], seq_len=63, eval_split="test")
    with pytest.raises(UserError, match=r"eval split 'test' has no target token to measure: every pair was left "
                       r"out .* or set data.eval_split: null"):  # fmt: skip
        examples.load_example_splits(cfg, seed=0, pretrained=str(fixture("llama")))


# The reference model and the numbers
# ------------------------------------------------------------------------------


def experiment(tmp_path: Path, pairs: list[dict], beta: float = 0.1, loss: str = "sigmoid", lora: bool = True,
               *extra: str):  # fmt: skip
    """The setup of a DPO run on `pairs` from the llama fixture, with adapters like the fixture PEFT adapter's."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    overrides = ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}", f"data.source={source}",
                 "data.format=preference", "data.seq_len=255", "data.packing=false", "data.eval_split=null",
                 f"data.cache_dir={tmp_path / 'cache'}", "train.batch_size=1", "objective.name=dpo",
                 f"objective.beta={beta}", f"objective.loss={loss}", *extra]  # fmt: skip
    if lora:
        overrides.append("model.lora={rank: 4, alpha: 8}")
    return setup(load_config(None, overrides))


@pytest.mark.parametrize("form, chat", [("conversational", True), ("standard", False)])
def test_eval_samples_of_a_dpo_run_reply_to_its_sample_prompts_and_stop_where_its_responses_end(tmp_path, form, chat):
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.hooks import eval_prompts
    from nnx_cli.lm import encode_prompt, eval_sample_stops

    question = "When does the fiddler come?"
    exp = experiment(tmp_path, RECORD[f"llama_{form}"], 0.1, "sigmoid", True, f"train.sample_prompts=[{question!r}]")
    tokenizer = load_tokenizer("pretrained", str(fixture("llama")))
    # conversational pairs: a user turn and the opening of the reply, as nnx-generate --chat writes them
    assert eval_prompts(exp) == [encode_prompt(tokenizer, question, chat, None)]
    sequences = sequences_of(rows_of(exp.cfg.data))
    ends = {tokens[max(i for i, t in enumerate(targets) if t)] for tokens, targets in sequences}  # each response's last
    assert ends <= set(eval_sample_stops(exp.cfg.data.format, tokenizer)["stop_tokens"])


def pair_metrics(exp, state, also: tuple[tuple[float, str], ...] = ()) -> dict:
    """The DPO metrics of each pair of the training rows (one pair per row), as the trainer computes them; and
    for each `(beta, loss)` of `also`, the loss and rewards from the same log-probabilities (`pair_losses`)."""

    def metrics(state: steps.TrainState, rows: dict) -> tuple[dict, tuple, jax.Array]:
        model = exp.moduledef.merge(*steps.model_states(state))
        ctx = steps._context(0, 1, jnp.int32(0), training=False)
        reference = steps.reference_model(exp.moduledef, state)
        batch = exp.train.prepare(rows)
        logps = sequence_logps(model, batch, None), sequence_logps(reference, batch, None)[0]
        return exp.objective.metrics(model, batch, ctx, reference), logps

    rows = exp.train.read(np.arange(len(exp.train)))
    out, (policy, reference) = jax.jit(metrics)(state, rows)
    out = {k: np.asarray(v) for k, v in out.items()}
    for beta, loss in also:
        pairs = pair_losses(policy, reference, beta, loss)
        out[beta, loss] = {k: np.asarray(v)[:, 0] for k, v in pairs.items() if k != "real"} | {"weight": 1.0}
    return out


def check_against_goldens(metrics: dict[str, np.ndarray], form: str, beta: float, loss: str) -> None:
    rewards = GOLDENS[f"llama_{form}_beta{beta}_rewards"]
    np.testing.assert_allclose(metrics["reward_chosen"], rewards[:, 0], rtol=RTOL)
    np.testing.assert_allclose(metrics["reward_rejected"], rewards[:, 1], rtol=RTOL)
    np.testing.assert_allclose(metrics["reward_margin"], rewards[:, 0] - rewards[:, 1], rtol=RTOL)
    np.testing.assert_allclose(metrics["loss"], GOLDENS[f"llama_{form}_beta{beta}_{loss}_loss"], rtol=RTOL)
    np.testing.assert_array_equal(metrics["reward_accuracy"], rewards[:, 0] > rewards[:, 1])
    np.testing.assert_array_equal(metrics["weight"], 1.0)


@pytest.mark.parametrize("form", ["standard", "conversational"])
def test_lora_dpo_scores_the_adapters_against_the_same_weights_with_the_adapters_off(tmp_path, form):
    exp = experiment(tmp_path, RECORD[f"llama_{form}"])
    assert steps.REFERENCE not in exp.abstract  # no second copy of anything
    state = exp.init_state()
    state["params"] = peft.load(exp, FIXTURES / "llama_lora")  # adapters that moved: peft's policy
    others = ((0.5, "sigmoid"), (0.1, "ipo"), (0.5, "ipo"))
    metrics = pair_metrics(exp, state, also=others)
    check_against_goldens(metrics, form, 0.1, "sigmoid")  # the run's own: beta 0.1, sigmoid
    for beta, loss in others:
        check_against_goldens(metrics[beta, loss], form, beta, loss)


def test_fully_fine_tuned_dpo_scores_against_a_frozen_copy_of_the_starting_weights(tmp_path):
    exp = experiment(tmp_path, RECORD["llama_standard"], lora=False)
    state = exp.init_state()
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(state[steps.REFERENCE])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the copy: where the run starts
    adapted = experiment(tmp_path / "lora", RECORD["llama_standard"])
    base_and_adapters = adapted.init_state()[steps.FROZEN] | peft.load(adapted, FIXTURES / "llama_lora")
    weights = merged({p: np.asarray(v.value) for p, v in base_and_adapters.items()}, scale=8 / 4)  # peft's merge
    state["params"] = jax.tree_util.tree_map_with_path(lambda path, _: jnp.asarray(weights[path[0].key]),
                                                       state["params"])  # fmt: skip
    check_against_goldens(pair_metrics(exp, state), "standard", 0.1, "sigmoid")


def test_a_fresh_run_starts_at_zero_rewards_and_a_loss_of_log_2(tmp_path):
    for lora in (True, False):
        exp = experiment(tmp_path / str(lora), RECORD["llama_conversational"], lora=lora)
        metrics = pair_metrics(exp, exp.init_state())
        # the policy's and the reference's log-probabilities come from different programs (adapters whose product
        # is zero, or a frozen copy): equal on a CPU, 1.5e-6 apart on a GPU (sums of order 100 rounded to float32);
        # the loss, log(1 + exp(-margin)), moves by half the margin (7.7e-7 on an H200)
        np.testing.assert_allclose(metrics["reward_margin"], 0.0, atol=1e-5)
        np.testing.assert_allclose(metrics["loss"], math.log(2), atol=5e-6)


def test_metrics_are_means_over_pairs_however_rows_pack_them(tmp_path):
    pairs = [*RECORD["llama_standard"], RECORD["llama_standard"][0]]
    results = []
    for packing in (False, True):
        exp = experiment(tmp_path / str(packing), pairs, 0.1, "sigmoid", True, f"data.packing={packing}")
        state = exp.init_state()
        state["params"] = peft.load(exp, FIXTURES / "llama_lora")
        metrics = pair_metrics(exp, state)
        weight = metrics.pop("weight")
        metrics = {k: v for k, v in metrics.items() if isinstance(k, str)}
        assert len(weight) == (1 if packing else 3) and weight.sum() == 3
        results.append({k: float(np.sum(v * weight) / np.sum(weight)) for k, v in metrics.items()})
    rewards = GOLDENS["llama_standard_beta0.1_rewards"][[0, 1, 0]]
    expected = {
        "loss": GOLDENS["llama_standard_beta0.1_sigmoid_loss"][[0, 1, 0]].mean(),
        "reward_chosen": rewards[:, 0].mean(),
        "reward_rejected": rewards[:, 1].mean(),
        "reward_margin": (rewards[:, 0] - rewards[:, 1]).mean(),
        "reward_accuracy": (rewards[:, 0] > rewards[:, 1]).mean(),
    }
    for result in results:
        assert result == pytest.approx(expected, rel=RTOL)


def test_pair_losses_follow_their_definitions():
    # one row, two pairs: log-probabilities of (chosen, rejected) and their token counts, policy and reference
    logps = jnp.array([[0.0, -3.0, -9.0, -8.0, -5.0]])
    counts = jnp.array([[0.0, 3.0, 6.0, 4.0, 2.0]])
    reference = jnp.array([[0.0, -4.0, -8.0, -6.0, -7.0]])
    out = {k: np.asarray(v)[0] for k, v in pair_losses((logps, counts), reference, 0.5, "sigmoid").items()}
    np.testing.assert_allclose(out["reward_chosen"], [0.5, -1.0])
    np.testing.assert_allclose(out["reward_rejected"], [-0.5, 1.0])
    np.testing.assert_allclose(out["reward_margin"], [1.0, -2.0])
    np.testing.assert_allclose(out["loss"], [math.log1p(math.exp(-1.0)), math.log1p(math.exp(2.0))], rtol=1e-6)
    np.testing.assert_array_equal(out["reward_accuracy"], [1.0, 0.0])
    ipo = np.asarray(pair_losses((logps, counts), reference, 0.5, "ipo")["loss"])[0]
    h = np.array([1 / 3 - (-1) / 6, -2 / 4 - 2 / 2])  # log-ratios over their token counts
    np.testing.assert_allclose(ipo, (h - 1 / (2 * 0.5)) ** 2, rtol=1e-6)


# Mistakes
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"prompt": "Hi", "chosen": " yes"},
            r"row 1 of '.*pairs.jsonl' has no 'rejected': preference rows hold "
            r"'prompt', 'chosen' and 'rejected'; columns: prompt, chosen",
        ),
        ({"prompt": "Hi", "rejected": " no"}, r"row 1 of .* has no 'chosen'"),
        (
            {"prompt": [{"role": "user", "content": "Hi"}], "chosen": " yes", "rejected": " no"},
            r"row 1 of .*: 'prompt', 'chosen' and 'rejected' must all be text, or all be lists of messages",
        ),
    ],
    ids=["no-rejected", "no-chosen", "mixed"],
)
def test_a_bad_row_is_named(tmp_path, row, message):
    with pytest.raises(UserError, match=message):
        rows_of(data_config(tmp_path, [RECORD["llama_standard"][0], row]))


def test_a_conversational_response_without_an_assistant_turn_is_named(tmp_path):
    pair = dict(RECORD["llama_conversational"][1], rejected=[{"role": "user", "content": "Who?"}])
    with pytest.raises(UserError, match=r"row 1 of .*: 'rejected' holds no assistant turn"):
        rows_of(data_config(tmp_path, [RECORD["llama_conversational"][0], pair]))


def test_a_source_without_a_rejected_column_names_the_first_row(tmp_path):
    pairs = [{"prompt": p["prompt"], "chosen": p["chosen"]} for p in RECORD["llama_standard"]]
    with pytest.raises(UserError, match=r"row 0 of .* has no 'rejected', nor has any other row"):
        rows_of(data_config(tmp_path, pairs))


LLAMA = ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}", "data.source=pairs.jsonl"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*LLAMA, "data.format=preference"], r"data.format' is preference, .* set objective.name=dpo"),
        (
            [*LLAMA, "objective.name=dpo", "data.format=completion"],
            r"objective dpo learns from preference pairs: "
            r"set data.format=preference",
        ),
        ([*LLAMA, "objective.name=dpo", "data.format=preference", "data.train_on_prompt=true"], r"train_on_prompt"),
        (
            ["objective.name=dpo", "data.format=preference", "model.name=vae", "model.input_shape=[64]"],
            r"objective dpo needs a language model",
        ),
    ],
    ids=["sft-on-pairs", "dpo-on-completions", "train-on-prompt", "not-a-language-model"],
)
def test_an_objective_and_data_that_do_not_fit_are_named(overrides, message):
    with pytest.raises(UserError, match=message):
        setup(load_config(None, overrides), data=None)
