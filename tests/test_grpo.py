"""GRPO: prompt rows, completions and rewards, advantages and the three losses against TRL 1.16's own GRPOTrainer
(tests/fixtures/make_grpo_fixtures.py), sampling with the key-value cache against the model's full forward, the
built-in rewards, and the mistakes a config, a row or a reward function can make."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_support import FIXTURES, fixture, goldens

from nnx_cli import steps
from nnx_cli.config import load_config
from nnx_cli.data.tokenizers import load_tokenizer, stop_ids
from nnx_cli.errors import UserError
from nnx_cli.experiment import setup
from nnx_cli.hf import peft
from nnx_cli.objectives import grpo, rewards, rollouts

RECORD = json.loads((FIXTURES / "grpo.json").read_text())
GOLDENS = goldens("grpo")
BATCH = RECORD["batch"]
RTOL = 1e-4  # measured: below 3e-6


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def experiment(tmp_path: Path, rows: list[dict] = RECORD["prompts"], from_adapter: bool = False, **objective):
    """A GRPO run's setup on the llama fixture with adapters like the fixture PEFT adapter's (`from_adapter`:
    starting from it, as TRL does), as the fixture's trainer was configured (4 generations of at most 6 tokens at
    temperature 0.7)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    options = {"name": "grpo", "rewards": ["exact_match", {"name": "regex", "pattern": "a"}], "num_generations": 4,
               "max_new_tokens": 6, "temperature": 0.7, "reward_weights": [1.0, 0.5], **objective}  # fmt: skip
    config = {
        "model": {"name": "transformer_lm", "pretrained": str(fixture("llama")), "lora": {"rank": 4, "alpha": 8}},
        "data": {
            "source": str(tmp_path / "prompts.jsonl"),
            "format": "prompt",
            "seq_len": 63,
            "eval_split": None,
            "cache_dir": str(tmp_path / "cache"),
        },
        "objective": options,
        "train": {"batch_size": 2, "steps": 4, "log_every": 2, "eval_every": 2},
        "checkpoint": {"every_steps": 2, **({"init_from": str(FIXTURES / "llama_lora")} if from_adapter else {})},
    }
    (tmp_path / "grpo.yaml").write_text(json.dumps(config))
    return setup(load_config(tmp_path / "grpo.yaml", []))


def fixture_drawn() -> dict[str, np.ndarray]:
    """The fixture's completions as `sample_completions` returns them, with their prompts."""
    ids, eos = BATCH["completion_ids"], RECORD["batch"]["eos"]
    width = max(len(p) for p in BATCH["prompt_ids"])
    prompts = np.zeros((len(ids), width), np.int32)
    for i, p in enumerate(BATCH["prompt_ids"]):
        prompts[i, : len(p)] = p
    completions = np.zeros((len(ids), RECORD["max_new_tokens"]), np.int32)
    for i, c in enumerate(ids):
        completions[i, : len(c)] = c
    return {
        "completions": completions,
        "lengths": np.array([len(c) for c in ids], np.int32),
        "stopped": np.array([c[-1] in eos for c in ids]),
        "prompts": prompts,
        "prompt_lengths": np.array([len(p) for p in BATCH["prompt_ids"]], np.int32),
    }


# Prompt rows and completions, as TRL builds them
# ------------------------------------------------------------------------------


def test_prompt_ids_are_the_text_with_the_tokenizers_leading_specials_or_the_chat_template(tmp_path):
    rows = [*RECORD["prompts"], {"prompt": RECORD["chat_prompt"], "answer": "x"}]
    exp = experiment(tmp_path, rows, rewards=["exact_match"], reward_weights=None)
    stored = exp.train.read(np.arange(3))
    ids = [stored["tokens"][i, : stored["lengths"][i]].tolist() for i in range(3)]
    assert ids == [BATCH["prompt_ids"][0], BATCH["prompt_ids"][4], RECORD["chat_prompt_ids"]]


def test_reward_functions_get_each_rows_columns_and_the_prompt_as_the_source_holds_it(tmp_path):
    rows = [{"prompt": RECORD["chat_prompt"], "answer": "4", "level": 2}, {"prompt": "2 + 2 =", "answer": "4"}]
    exp = experiment(tmp_path, rows, rewards=["exact_match"], reward_weights=None)
    prompts, columns = exp.train.columns([1, 0])
    assert prompts == ["2 + 2 =", RECORD["chat_prompt"]]
    assert columns == {"answer": ["4", "4"], "level": [None, 2]}


def test_completions_are_decoded_without_the_prompt_and_without_their_end_token_as_trl_decodes_them():
    tokenizer = load_tokenizer("pretrained", str(fixture("llama")))
    assert rollouts.completion_texts(tokenizer, fixture_drawn()) == BATCH["texts"]
    assert stop_ids(tokenizer, chat=True) == tuple(BATCH["eos"])  # generation_config's and the tokenizer's eos


def test_a_special_token_drawn_mid_completion_is_no_text_for_the_rewards_as_in_trl():
    tokenizer = load_tokenizer("pretrained", str(fixture("llama")))
    drawn = fixture_drawn()
    i = int(np.argmin(drawn["lengths"]))  # room for one more token
    bos = tokenizer.encode("")[0]  # the begin-of-text id the post-processor adds
    row = drawn["completions"][i].tolist()
    drawn["completions"][i] = [*row[:1], bos, *row[1:-1]]
    drawn["lengths"][i] += 1
    assert tokenizer.decode_all([bos]) != ""  # written out unless left out
    assert rollouts.completion_texts(tokenizer, drawn)[i] == BATCH["texts"][i]


def test_tokens_tokenizer_config_names_special_are_left_out_even_where_tokenizer_json_has_them_as_plain(tmp_path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "a": 3, "b": 4}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # no added tokens: <s> is a plain word
    word_level.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    word_level.decoder = decoders.Fuse()
    word_level.save(str(tmp_path / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 5}))
    tokenizer = load_tokenizer("pretrained", str(tmp_path))
    assert tokenizer.decode_all([3, 0, 4, 2, 3]) == "a<s>b<unk>a"
    drawn = {"completions": np.array([[3, 0, 4, 2, 3, 1]]), "lengths": np.array([6]), "stopped": np.array([True])}
    assert rollouts.completion_texts(tokenizer, drawn) == ["aba"]


def test_a_long_prompt_keeps_its_last_tokens_to_leave_room_for_the_completion(tmp_path, capsys):
    long = {"prompt": "Who keeps the bridge and the mill by the river? " * 6, "answer": "e"}
    exp = experiment(tmp_path, [*RECORD["prompts"], long], rewards=["exact_match"], reward_weights=None)
    whole = load_tokenizer("pretrained", str(fixture("llama"))).encode(long["prompt"]).tolist()
    limit = 64 - 6  # data.seq_len + 1 - objective.max_new_tokens
    assert len(whole) > limit and exp.train.width == limit
    assert exp.train.read([2])["tokens"][0].tolist() == whole[-limit:]
    assert "1 of 3 prompts are longer than 58 tokens and keep their last 58" in capsys.readouterr().err


# Advantages, reward metrics and losses against TRL
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, scale", [("dapo", "group"), ("batch_scale", "batch"), ("no_scale", "none")])
def test_advantages_are_rewards_normalised_within_each_prompts_group_as_trl_does(name, scale):
    total = grpo.total_rewards(GOLDENS["rewards"], RECORD["weights"])
    advantages = grpo.group_advantages(total, RECORD["generations"], scale)
    np.testing.assert_allclose(advantages, GOLDENS[f"{name}_advantages"], rtol=1e-5, atol=1e-6)
    assert advantages[3] == 0.0  # every function said None: no advantage


def test_the_advantage_is_the_reward_less_its_group_mean_over_its_std_plus_1e_4():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, np.nan], np.float32)
    out = grpo.group_advantages(rewards, 4)
    std = np.std([1.0, 0.0, 0.0, 0.0], ddof=1)
    np.testing.assert_allclose(out[:4], (np.array([1.0, 0, 0, 0]) - 0.25) / (std + 1e-4), rtol=1e-6)
    np.testing.assert_array_equal(out[4:], 0.0)  # equal rewards: zero; None: zero


def test_reward_metrics_leave_out_nones_as_trl_does():
    lengths = np.array([len(c) for c in BATCH["completion_ids"]])
    metrics = grpo.reward_metrics(GOLDENS["rewards"], RECORD["weights"], ["vowels", "answer_in"], lengths)
    expected = {k: BATCH[k] for k in ("reward", "reward_std", "reward/vowels", "reward/answer_in", "completion_length")}
    assert metrics == pytest.approx(expected, rel=1e-6)


@pytest.fixture(scope="module")
def moved_policy(tmp_path_factory) -> dict:
    """The fixture's batch as rows, and the per-token log-probabilities TRL's `_compute_loss` saw: of the policy
    after it moved (the adapters' B scaled by 1.5), of the one that sampled, and of the reference, in a run that
    started from the fixture PEFT adapter (TRL's reference is then a copy of it, as ours is); the run's own
    objective (dapo, beta 0.04, two iterations) computes its metrics from them."""
    exp = experiment(tmp_path_factory.mktemp("grpo"), from_adapter=True, **CONFIG_OPTIONS["dapo_beta"])
    state = exp.init_state()
    state["params"] = state[steps.REFERENCE] = peft.load(exp, FIXTURES / "llama_lora")
    moved = jax.tree_util.tree_map_with_path(
        lambda path, x: x * RECORD["scale_b"] if path[0].key.endswith("/b") else x, state["params"]
    )
    drawn = fixture_drawn()
    rows = grpo.training_rows(drawn["prompts"], drawn["prompt_lengths"], drawn["completions"], drawn["lengths"],
                              GOLDENS["dapo_beta_advantages"], np.ones(8, bool), "dapo", 6, {})  # fmt: skip
    temperature = exp.objective.options.temperature

    @jax.jit
    def logps(state: steps.TrainState, moved: steps.TrainState, rows: dict) -> tuple:
        sampler = exp.moduledef.merge(*steps.model_states(state))
        policy = exp.moduledef.merge(*steps.model_states(state, moved))
        reference = steps.reference_model(exp.moduledef, state)
        old = grpo.token_logps(sampler, rows, None, temperature)
        ctx = steps._context(0, 1, jnp.int32(0), training=False)
        metrics = exp.objective.metrics(policy, {**rows, "old_logps": old}, ctx, reference)
        each = [grpo.token_logps(m, rows, None, temperature) for m in (policy, sampler, reference)]
        return {k: jnp.mean(v) for k, v in metrics.items()}, each

    metrics, each = logps(state, moved, rows)
    return {"drawn": drawn, "metrics": metrics, "logps": each}


CONFIG_OPTIONS = {
    name: {"loss" if k == "loss_type" else k: v for k, v in options.items()}
    for name, options in RECORD["configs"].items()
}


def test_the_runs_objective_computes_trls_loss_kl_and_clip_ratio(moved_policy):
    ours = {k: float(v) for k, v in moved_policy["metrics"].items()}
    theirs = RECORD["dapo_beta"]
    assert ours == pytest.approx({"loss": theirs["loss"], "kl": theirs["kl"], "clip_ratio": theirs["clip_ratio"]},
                                 rel=RTOL)  # fmt: skip


@pytest.mark.parametrize("name", [n for n in RECORD["configs"] if n not in ("batch_scale", "no_scale")])
def test_each_loss_its_kl_and_clip_ratio_equal_trls(moved_policy, name):
    options = {"num_iterations": 1, "beta": 0.0, "epsilon": 0.2, "mask_truncated_completions": False,
               **CONFIG_OPTIONS[name]}  # fmt: skip
    drawn = moved_policy["drawn"]
    keep = drawn["stopped"] | (not options["mask_truncated_completions"])
    rows = grpo.training_rows(drawn["prompts"], drawn["prompt_lengths"], drawn["completions"], drawn["lengths"],
                              GOLDENS[f"{name}_advantages"], keep, options["loss"], 6, {})  # fmt: skip
    policy, sampler, reference = moved_policy["logps"]
    old = sampler if options["num_iterations"] > 1 else policy  # one iteration: the policy sampled (ratio 1)
    epsilon = (options["epsilon"], options.get("epsilon_high") or options["epsilon"])
    beta = options["beta"]
    out = grpo.policy_loss(policy, old, reference if beta else None, rows, epsilon, beta)
    ours = {k: float(jnp.mean(v)) for k, v in out.items()}
    theirs = RECORD[name]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=RTOL)
    assert ours["clip_ratio"] == pytest.approx(theirs["clip_ratio"], rel=RTOL)
    assert ours.get("kl", 0.0) == pytest.approx(theirs["kl"], rel=RTOL)


def test_the_losses_aggregate_token_losses_as_defined():
    """One batch, two completions of 1 and 3 tokens, ratio 1: each loss's normalisation by hand."""
    prompts = np.array([[5, 6], [5, 6]], np.int32)
    completions = np.array([[7, 0, 0], [8, 9, 1]], np.int32)
    advantages = np.array([1.0, -0.5], np.float32)
    per_token = {"grpo": (-1.0 + 0.5) / 2, "dr_grpo": (-1.0 + 0.5 * 3) / (2 * 3), "dapo": (-1.0 + 0.5 * 3) / 4}
    for loss, expected in per_token.items():
        rows = grpo.training_rows(prompts, np.array([2, 2]), completions, np.array([1, 3]), advantages,
                                  np.array([True, True]), loss, 3, {})  # fmt: skip
        logps = jnp.zeros((2, 4))
        out = grpo.policy_loss(logps, logps, None, jax.tree.map(jnp.asarray, rows), (0.2, 0.2), 0.0)
        assert float(jnp.mean(out["loss"])) == pytest.approx(expected, rel=1e-6), loss
        assert np.asarray(rows["targets"]).sum() == 4


def test_clipping_keeps_the_pessimistic_side_and_counts_the_clipped_tokens():
    rows = jax.tree.map(
        jnp.asarray,
        grpo.training_rows(np.array([[5], [5]]), np.array([1, 1]), np.array([[7, 8], [7, 8]]), np.array([2, 2]),
                           np.array([1.0, -1.0]), np.array([True, True]), "dapo", 2, {}),
    )  # fmt: skip
    old = jnp.zeros((2, 2))
    new = jnp.log(jnp.array([[1.5, 1.1], [0.5, 0.9]]))  # ratios; epsilon 0.2
    out = grpo.policy_loss(new, old, None, rows, (0.2, 0.2), 0.0)
    expected = (-1.2 - 1.1 + 0.8 + 0.9) / 4  # positive advantage: capped at 1.2; negative: floored at 0.8
    assert float(jnp.mean(out["loss"])) == pytest.approx(expected, rel=1e-6)
    assert float(jnp.mean(out["clip_ratio"])) == pytest.approx(2 / 4)
    ref = old  # k3 of the policy against a reference, exp(d) - d - 1 with d = ref - logp, times the ratio
    kl = grpo.policy_loss(new, old, ref, rows, (0.2, 0.2), 0.1)["kl"]
    ratio = np.array([1.5, 1.1, 0.5, 0.9])
    d = -np.log(ratio)
    assert float(jnp.mean(kl)) == pytest.approx(np.mean((np.exp(d) - d - 1) * ratio), rel=1e-6)


# Sampling
# ------------------------------------------------------------------------------


def test_sampling_with_the_cache_draws_what_the_full_forward_would_and_stops_after_an_end_token(tmp_path):
    exp = experiment(tmp_path, rewards=["exact_match"], reward_weights=None, max_new_tokens=12, temperature=1.0)
    state = exp.init_state()
    state["params"] = peft.load(exp, FIXTURES / "llama_lora")
    stored = exp.train.read(np.array([0, 1, 1]))
    key = jax.random.key(3)
    forward = jax.jit(lambda ids, n: exp.moduledef.merge(*steps.model_states(state)).logits(ids[None])[0, n - 1])
    expected = []  # row i draws token t with fold_in(fold_in(key, i), t), from the logits of the whole sequence
    for i in range(3):
        ids, n = np.zeros(32, np.int32), int(stored["lengths"][i])
        ids[:n] = stored["tokens"][i, :n]
        for t in range(12):
            ids[n + t] = jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, i), t), forward(ids, n + t))
        expected.append(ids[n : n + 12].tolist())
    stops = (1, expected[1][2])  # row 1 stops at its third token (and any row at that token, or at 1)
    drawn = jax.jit(
        lambda s, t, n: rollouts.sample_completions(exp.moduledef, steps.model_states(s), t, n, key,
                                                    max_new_tokens=12, temperature=1.0, stop_ids=stops)
    )(state, stored["tokens"], stored["lengths"])  # fmt: skip
    for i in range(3):
        end = next((t + 1 for t, token in enumerate(expected[i]) if token in stops), 12)
        assert int(drawn["lengths"][i]) == end
        assert drawn["completions"][i, :end].tolist() == expected[i][:end]
        assert bool(drawn["stopped"][i]) == (expected[i][end - 1] in stops)
        assert (drawn["completions"][i, end:] == 0).all()
    assert drawn["lengths"][1] <= 3 and drawn["stopped"][1]


# Reward functions
# ------------------------------------------------------------------------------


def test_built_in_rewards_score_exact_matches_patterns_and_math_answers():
    answers = {"answer": ["42", "42", "0.5", "1,000", "7", None]}
    completions = [" 42 ", "41", "so \\boxed{\\frac{1}{2}}", "#### 1000", "I count 7 apples and 8 pears.", "x"]
    prompts = [""] * 6
    assert rewards.exact_match()(prompts, completions, **answers) == [1.0, 0.0, 0.0, 0.0, 0.0, None]
    assert rewards.math_answer()(prompts, completions, **answers) == [1.0, 0.0, 1.0, 1.0, 0.0, None]
    assert rewards.regex(r"^\s*\d+\s*$")(prompts, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "given, expected",
    [("The answer is 12.", "12"), ("\\boxed{x^{2}}", "x^{2}"), ("3 apples, then 5", "5"), ("50%", "50%"),
     ("The answer is: 12", "12"), ("The answer is **12**.", "12"), ("The answer is 12, since 5+7=12.", "12"),
     ("So the answer is 12 apples.", "12"), ("#### 12 apples", "12"), ("#### 3\nso the answer is 4", "4"),
     ("ANSWER: -3/4", "-3/4"), ("The answer is **Paris**.", "Paris")],
)  # fmt: skip
def test_the_final_answer_of_a_solution(given, expected):
    assert rewards.final_answer(given) == expected


@pytest.mark.parametrize("a, b", [("1/2", "0.5"), ("50%", "0.5"), ("$1,200", "1200"), ("\\dfrac{3}{4}", "0.75")])
def test_math_answers_compare_as_numbers(a, b):
    assert rewards.same_answer(a, b)


def test_a_reward_function_gets_prompts_completions_and_columns_by_name_and_none_is_left_out():
    seen = {}

    def fn(prompts, completions, answer, **columns):
        seen.update(prompts=prompts, completions=completions, answer=answer, **columns)
        return [1, None, 0.5]

    out = rewards.score([rewards.Reward("fn", "m.fn", fn)], ["p", "p", "q"], ["a", "b", "c"],
                        {"answer": [1, 1, 2], "level": ["x", "x", "y"]}, "at step 1")  # fmt: skip
    assert seen == {"prompts": ["p", "p", "q"], "completions": ["a", "b", "c"], "answer": [1, 1, 2],
                    "level": ["x", "x", "y"]}  # fmt: skip
    np.testing.assert_array_equal(out, [[1.0], [np.nan], [0.5]])


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            lambda prompts, completions, **_: 1 / 0,
            r"reward function 'm\.bad' raised ZeroDivisionError: division by "
            r"zero at step 7 \(scoring 2 completions\)",
        ),
        (
            lambda prompts, completions, **_: sys.exit(3),
            r"reward function 'm\.bad' called sys\.exit\(3\) at step 7 \(scoring 2 completions\); a reward function "
            r"returns its scores",
        ),
        (
            lambda prompts, completions, **_: [1.0],
            r"'m\.bad' returned 1 value for 2 completions at step 7; it must "
            r"return a list of one number \(or None\) per completion",
        ),
        (lambda prompts, completions, **_: 0.5, r"'m\.bad' returned 0\.5 for 2 completions at step 7"),
        (lambda prompts, completions, **_: [1.0, "yes"], r"'m\.bad' returned 'yes' \(str\) for completion 1 at step 7"),
        (
            lambda prompts, completions, **_: [float("nan"), 1.0],
            r"'m\.bad' returned nan for completion 0 at step 7; a reward must be a finite number within float32's "
            r"range \(about 3\.4e38\), or None",
        ),
        (  # a float64 that float32 holds as inf: it passed, and the advantages went NaN with numpy's warnings
            lambda prompts, completions, **_: [1.0, 1e300],
            r"'m\.bad' returned 1e\+300 for completion 1 at step 7; a reward must be a finite number within",
        ),
        (  # an int past any float: an OverflowError traceback
            lambda prompts, completions, **_: [1.0, 10**400],
            r"'m\.bad' returned 100000000000\.\.\. \(401 digits\) for completion 1 at step 7; a reward must be a",
        ),
    ],
    ids=["raises", "exits", "too-few", "not-a-list", "not-a-number", "nan", "beyond-float32", "beyond-any-float"],
)
def test_a_reward_function_that_raises_or_returns_the_wrong_values_is_named_with_the_step(fn, message):
    with pytest.raises(UserError, match=message):
        rewards.score([rewards.Reward("bad", "m.bad", fn)], ["p", "p"], ["a", "b"], {}, "at step 7")


@pytest.mark.parametrize("column", [5, None])
def test_a_built_in_rewards_column_that_is_no_name_is_refused_naming_the_key(column):
    """It failed at the first step, once the model had loaded, blaming the reward ('int' object is not iterable)."""
    with pytest.raises(UserError, match=r"config key 'objective.rewards\[0\].column' must be the name of a column"):
        rewards.load([{"name": "exact_match", "column": column}])


@pytest.mark.parametrize("column", ["completions", "prompts"])
def test_prompt_rows_with_a_column_named_as_what_rewards_are_given_are_refused(column):
    """Every reward failed at the first step: got multiple values for keyword argument 'completions'."""
    loaded = rewards.load([{"name": "regex", "pattern": "a"}])
    with pytest.raises(UserError, match=rf"the prompt rows of 'p.jsonl' have a column '{column}', the name of what"):
        rewards.check_columns(loaded, ["level", column], "p.jsonl")


def test_reward_names_are_imported_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def correct(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n"
    )
    monkeypatch.chdir(tmp_path)
    loaded = rewards.load(["my_rewards.correct", {"name": "regex", "pattern": "a", "label": "has_a"}])
    assert [r.name for r in loaded] == ["correct", "has_a"]
    assert loaded[0].fn(["p"], ["c"]) == [1.0]
    assert rewards.load(["my_rewards:correct"])[0].fn is loaded[0].fn


def test_a_reward_function_taking_its_arguments_by_position_only_is_refused_when_loaded(tmp_path, monkeypatch):
    """Rewards are called by name: `def f(prompts, completions, /, **kw)` failed at the first step, after the model
    had loaded (a missing positional argument)."""
    (tmp_path / "positional_rewards.py").write_text(
        "def by_position(prompts, completions, /, **kw):\n    return [1.0] * len(prompts)\n"
        "def with_default(prompts=None, /, completions=None, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError,
        match=r"config key 'objective.rewards\[1\]': reward function 'positional_rewards.by_position' takes prompts, "
        r"completions by position only \(before a /\); every reward is called with prompts, completions and",
    ):
        rewards.load(["exact_match", "positional_rewards.by_position"])
    assert rewards.load(["positional_rewards.with_default"])[0].takes is None  # a default: called without it, it works


@pytest.mark.parametrize(
    "entries, message",
    [
        (
            ["no_such_module.correct"],
            r"config key 'objective.rewards\[0\]': cannot import module 'no_such_module' for 'no_such_module.correct'",
        ),
        (["exact_mach"], r"unknown reward 'exact_mach' \(did you mean 'exact_match'\?\); built in: exact_match"),
        ([{"name": "regex"}], r"objective.rewards\[0\]': built-in reward regex: .*pattern"),
        (
            ["exact_match", {"name": "regex", "pattern": "("}],
            r"config key 'objective.rewards\[1\]': built-in reward regex: regex pattern '\(' does not compile",
        ),  # it named 'objective.rewards' alone
        (["exact_match", {"name": "exact_match", "column": "b"}], r"two rewards are logged as reward/exact_match"),
        ([{"name": "exact_match", "colum": "b"}], r"unknown config key 'objective.rewards\[0\].colum'"),
    ],
    ids=["no-module", "unknown-built-in", "no-pattern", "bad-pattern", "same-name", "unknown-option"],
)
def test_a_reward_that_cannot_be_loaded_is_named(entries, message):
    with pytest.raises(UserError, match=message):
        rewards.load(entries)


# Mistakes
# ------------------------------------------------------------------------------


def test_a_prompt_row_without_a_prompt_is_named(tmp_path):
    with pytest.raises(UserError, match=r"row 1 of '.*prompts.jsonl' has no 'prompt': prompt rows hold 'prompt'"):
        experiment(tmp_path, [RECORD["prompts"][0], {"answer": "a"}, RECORD["prompts"][1]])


LLAMA = ["model.name=transformer_lm", f"model.pretrained={fixture('llama')}", "data.source=prompts.jsonl"]
GRPO = [*LLAMA, "data.format=prompt", "objective.name=grpo", "objective.rewards=[exact_match]"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*LLAMA, "data.format=prompt"], r"data.format' is prompt, .* set objective.name=grpo"),
        (
            [*LLAMA, "data.format=completion", "objective.name=grpo", "objective.rewards=[exact_match]"],
            r"objective grpo samples completions of prompts: set data.format=prompt",
        ),
        ([*GRPO[:-1]], r"objective.rewards' is empty"),
        ([*GRPO, "objective.num_generations=1"], r"objective.num_generations' must be at least 2"),
        ([*GRPO, "objective.loss=ppo"], r"objective.loss' must be grpo, dr_grpo or dapo"),
        ([*GRPO, "objective.reward_weights=[1, 2]"], r"has 2 weights for 1 rewards"),
        ([*GRPO, "objective.reward_weights=[1e308]"], r"reward_weights\[0\]' must be a finite number within float32"),
        ([*GRPO, "objective.num_iterations=2", "train.log_every=5"], r"train.log_every' \(5\) must be a multiple"),
        ([*GRPO, "objective.top_p=0.9"], r"unknown config key 'objective.top_p'"),
    ],
    ids=[
        "sft-on-prompts",
        "grpo-on-text",
        "no-rewards",
        "one-generation",
        "unknown-loss",
        "weights",
        "weight-beyond-float32",
        "iterations",
        "unknown-key",
    ],
)
def test_a_grpo_config_that_cannot_run_is_named(overrides, message):
    with pytest.raises(UserError, match=message):
        setup(load_config(None, overrides), data=None)


def test_beta_zero_keeps_no_reference_and_beta_above_zero_reads_the_base_with_adapters_off(tmp_path):
    assert not experiment(tmp_path / "a", rewards=["exact_match"], reward_weights=None).objective.needs_reference
    exp = experiment(tmp_path / "b", rewards=["exact_match"], reward_weights=None, beta=0.1)
    assert exp.objective.needs_reference and steps.REFERENCE not in exp.abstract  # LoRA: no copy of anything
    assert "kl" in exp.metric_names
