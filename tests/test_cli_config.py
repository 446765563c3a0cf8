"""The trainer's config: defaults, YAML files, KEY=VALUE overrides and their errors."""

from __future__ import annotations

import re

import pytest

from nnx_cli.config import Config, apply_overrides, from_dict, load_config, parse_value, to_dict
from nnx_cli.errors import UserError


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_empty_config_gets_every_default(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert to_dict(cfg) == to_dict(Config())
    assert cfg.data.source == "sklearn:digits"
    assert cfg.sharding.mesh == {"data": -1, "model": 1}


def test_nnx_train_on_a_config_that_sets_nothing_says_so(tmp_path):
    """An empty file (a truncated copy, the wrong file) trained the defaults without a word."""
    from cli_support import cli

    (tmp_path / "empty.yaml").write_text("# nothing set yet\n")
    result = cli("nnx-train", "empty.yaml", "train.steps=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "notice: config file 'empty.yaml' sets no keys: every key takes its default" in result.stderr
    (tmp_path / "set.yaml").write_text("train: {steps: 1}\ndata:\n  # source: my_images/\n")
    result = cli("nnx-train", "set.yaml", cwd=tmp_path)
    assert result.returncode == 0 and "sets no keys" not in result.stderr, result.stderr
    # a data section left empty trained on the digits without a word
    assert "notice: data.source is not set: training on the default, sklearn:digits" in result.stderr


def test_only_a_data_section_left_empty_gets_the_notice_of_the_default():
    from nnx_cli.commands.train import _empty_data

    assert _empty_data({"data": None}, []) and _empty_data({"data": {"binarize": 0.5}}, ["data=null"])
    assert not _empty_data({"train": {}}, [])  # no data section: the default, meant
    assert not _empty_data({"data": None}, ["data.source=x/"]) and not _empty_data({}, ["data={source: x/}"])


def test_file_values_override_defaults_and_keep_the_rest(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  batch_size: 32\nsharding:\n  mesh: {data: 2}\n"))
    assert cfg.train.batch_size == 32
    assert cfg.train.log_every == Config().train.log_every
    assert cfg.sharding.mesh == {"data": 2, "model": 1}


def test_overrides_are_dotted_paths_with_yaml_values(tmp_path):
    cfg = load_config(
        write(tmp_path, "train: {steps: 10}"),
        ["train.steps=200", "optimizer.learning_rate=3e-4", "model.hidden_sizes=[64, 32]", "data.binarize=null"],
    )
    assert cfg.train.steps == 200
    assert cfg.optimizer.learning_rate == pytest.approx(3e-4)
    assert cfg.model.options["hidden_sizes"] == [64, 32]
    assert cfg.data.binarize is None


def test_override_inside_a_mapping_keeps_its_other_keys():
    cfg = load_config(None, ["sharding.mesh.data=4"])
    assert cfg.sharding.mesh == {"data": 4, "model": 1}


def test_exponent_without_dot_parses_as_float():
    assert parse_value("1e-3") == pytest.approx(1e-3)
    assert isinstance(parse_value("1e-3"), float)


def test_unknown_key_in_file_names_path_and_suggests_closest(tmp_path):
    with pytest.raises(
        UserError, match=r"unknown config key 'train\.bacth_size' \(did you mean 'train\.batch_size'\?\)"
    ):
        load_config(write(tmp_path, "train:\n  bacth_size: 3\n"))


@pytest.mark.parametrize("where", ["override", "file"])
def test_a_key_put_in_the_wrong_section_names_the_section_that_has_it(tmp_path, where):
    """train.loggers suggested train.log_every, and loggers at the top level listed the sections."""
    said = r"\(did you mean 'logging\.loggers'\? 'loggers' is a key of the 'logging' section\)"
    for wrong, text in [("train.loggers", "train:\n  loggers: [jsonl]\n"), ("loggers", "loggers: [jsonl]\n")]:
        with pytest.raises(UserError, match=rf"unknown config key '{re.escape(wrong)}' {said}"):
            if where == "override":
                load_config(None, [f"{wrong}=[jsonl]"])
            else:
                load_config(write(tmp_path, text))


def test_unknown_override_key_suggests_closest():
    with pytest.raises(
        UserError,
        match=r"override 'train\.setps=3': unknown config key 'train\.setps' \(did you mean 'train\.steps'\?\)",
    ):
        load_config(None, ["train.setps=3"])


def test_unknown_section_suggests_closest():
    with pytest.raises(UserError, match=r"'modle'.*did you mean 'model'"):
        load_config(None, ["modle.name=vae"])


def test_wrong_type_names_key_expected_type_and_value():
    with pytest.raises(UserError, match=r"config key 'train\.batch_size' must be an integer, got 'many' \(str\)"):
        load_config(None, ["train.batch_size=many"])


@pytest.mark.parametrize("key", ["train.batch_size", "train.eval_batch_size"])
def test_a_batch_no_array_can_hold_is_refused_naming_the_key(key):
    """An eval batch of 2**63 - 1 trained the whole run, then ended in numpy's traceback at the final eval."""
    with pytest.raises(UserError, match=rf"config key '{re.escape(key)}' must be below 2\*\*31, got {2**63 - 1}"):
        load_config(None, [f"{key}={2**63 - 1}"])
    load_config(None, [f"{key}={2**31 - 1}"])


def test_wrong_type_inside_a_mapping_names_the_inner_key():
    with pytest.raises(UserError, match=r"config key 'sharding\.mesh\.data' must be an integer, got 'abc'"):
        load_config(None, ["sharding.mesh.data=abc"])


def test_nested_list_types_read_as_english():
    with pytest.raises(UserError, match=r"'sharding\.rules' must be a list of lists or null, got 5"):
        load_config(None, ["sharding.rules=5"])


def test_unknown_key_without_a_close_match_lists_the_valid_ones():
    with pytest.raises(UserError, match=r"unknown config key 'foo'; valid keys: seed, workdir, model"):
        load_config(None, ["foo=1"])


def test_seed_must_fit_the_random_generators():
    for seed in ("-1", str(2**64)):
        with pytest.raises(UserError, match=r"config key 'seed' must be an integer from 0"):
            load_config(None, [f"seed={seed}"])


def test_a_yaml_anchor_that_contains_itself_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="refers to itself"):
        load_config(write(tmp_path, "model: &x {name: vae, nested: *x}\n"))


def test_a_key_given_twice_is_an_error_naming_its_line(tmp_path):
    with pytest.raises(UserError, match=r"line 3.*key 'batch_size' appears twice"):
        load_config(write(tmp_path, "train:\n  batch_size: 32\n  batch_size: 64\n"))


def test_an_unquoted_jinja_template_in_a_file_is_invalid_yaml_naming_its_line(tmp_path):
    with pytest.raises(UserError, match=r"not valid YAML at line 2.*quote text that holds \{\{"):
        load_config(write(tmp_path, "data:\n  chat_template: {{ bos_token }}\n"))


def test_an_override_that_is_not_yaml_stays_text_and_a_key_wanting_more_says_why():
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_config(None, [f"data.chat_template={template}"]).data.chat_template == template
    with pytest.raises(UserError, match=r"'train.steps' must be an integer or null, got '\{\{1\}\}' \(text: not valid"):
        load_config(None, ["train.steps={{1}}"])


def test_non_positive_batch_size_is_rejected():
    with pytest.raises(UserError, match="train.batch_size"):
        load_config(None, ["train.batch_size=0"])


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(UserError, match="must look like KEY=VALUE"):
        load_config(None, ["train.steps"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(UserError, match="nope.yaml.*does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_malformed_yaml_names_file_and_line(tmp_path):
    with pytest.raises(UserError, match=r"run\.yaml.*not valid YAML at line 2"):
        load_config(write(tmp_path, "train:\n  steps: 1: 2\n"))


def test_config_that_is_not_a_mapping_is_rejected(tmp_path):
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_sharding_rule_must_name_a_mesh_axis():
    with pytest.raises(UserError, match=r"sharding\.rules\[0\]"):
        load_config(None, ["sharding.rules=[[batch, dat]]"])


def test_model_and_optimizer_sections_keep_extra_keys_as_options():
    cfg = load_config(None, ["model.latent_size=8", "optimizer.weight_decay=0.1"])
    assert cfg.model.options == {"latent_size": 8}
    assert cfg.optimizer.options == {"weight_decay": 0.1}


def test_resolved_config_round_trips():
    cfg = load_config(
        None,
        [
            "model.latent_size=8",
            "checkpoint.async=false",
            "optimizer.learning_rate={name: cosine_decay, init_value: 0.1}",
        ],
    )
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)
    assert to_dict(cfg)["checkpoint"]["async"] is False


def test_apply_overrides_does_not_mutate_its_input():
    raw = {"train": {"steps": 1}}
    apply_overrides(raw, ["train.steps=2"])
    assert raw == {"train": {"steps": 1}}


def test_every_shipped_config_is_valid():
    from pathlib import Path

    from nnx_cli.config import load_config

    configs = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
    assert len(configs) >= 6
    for path in configs:
        cfg = load_config(path)
        assert cfg.model.name, path
    chat = load_config(Path(configs[0]).parent / "chat_lora.yaml")
    assert (chat.data.format, chat.data.tokenizer, chat.model.options["lora"]["rank"]) == ("chat", "pretrained", 16)


def test_without_an_objective_section_a_run_minimises_the_models_own_loss():
    cfg = load_config(None)
    assert to_dict(cfg)["objective"] == {"name": "sft"}


def test_an_objective_is_completed_with_its_own_defaults():
    cfg = load_config(None, ["objective.name=dpo", "objective.loss=ipo"])
    assert to_dict(cfg)["objective"] == {"name": "dpo", "beta": 0.1, "loss": "ipo"}
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective.name=dop"], r"'objective\.name' must be one of sft, dpo, grpo, got 'dop' .*did you mean 'dpo'"),
        (
            ["objective.name=dpo", "objective.bta=1"],
            r"'objective\.bta' for objective 'dpo' \(did you mean "
            r"'objective\.beta'\?\); it takes beta, loss",
        ),
        (["objective.beta=0.1"], r"unknown config key 'objective\.beta' for objective 'sft'"),
        (["objective.name=dpo", "objective.loss=hinge"], r"'objective\.loss' must be sigmoid or ipo for dpo"),
        (["objective.name=dpo", "objective.beta=0"], r"'objective\.beta' must be a positive number, got 0\.0"),
    ],
    ids=["name", "key", "key-of-another", "loss", "beta"],
)
def test_objective_mistakes_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.learning_rate=.nan", "optimizer.learning_rate"),
        ("optimizer.clip_grad_norm=.nan", "optimizer.clip_grad_norm"),
        ("optimizer.b1=.inf", "optimizer.b1"),  # an optax keyword
        ("model.rope_theta=.nan", "model.rope_theta"),  # a model option
        ("model.lora={rank: 2, alpha: .inf}", "model.lora.alpha"),
        ("objective={name: grpo, reward_weights: [.nan]}", "objective.reward_weights[0]"),
        ("eval.harness.limit=.nan", "eval.harness.limit"),
    ],
)
def test_nan_and_infinity_are_refused_wherever_a_number_goes(override, key):
    """YAML reads .nan and .inf as numbers: range checks such as 'positive' let NaN through, and the run
    failed later as a non-finite loss (exit 1), or a GRPO run completed on NaN rewards (exit 0)."""
    from nnx_cli.experiment import setup

    options = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=8",
               "model.positions=rope", "data.text_key=text", "data.seq_len=16", override]  # fmt: skip
    with pytest.raises(UserError, match=rf"config key '{re.escape(key)}' must be a finite number, got (nan|inf)"):
        setup(load_config(None, options), data=None)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.learning_rate=-1e-3", "'optimizer.learning_rate' must be zero or more (a negative rate climbs"),
        ("optimizer.clip_grad_norm=0", "'optimizer.clip_grad_norm' must be a positive number, or null for no"),
    ],
)
def test_a_learning_rate_below_zero_or_a_clip_norm_of_zero_is_refused(override, message):
    """A negative rate trained uphill without a word (the loss rose to the end, exit 0); a clip norm of 0 scaled
    every update to nothing."""
    with pytest.raises(UserError, match=re.escape(message)):
        load_config(None, [override])


def test_a_model_that_cannot_be_built_names_the_keys_at_fault_without_every_option():
    """The message was one line holding all 40 of the model's resolved options before the reason."""
    from nnx_cli.experiment import setup

    options = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=8",
               "model.max_positions=4", "data.text_key=text", "data.seq_len=16"]  # fmt: skip
    with pytest.raises(UserError) as raised:
        setup(load_config(None, options), data=None)
    assert str(raised.value) == (
        "config section 'model': 'transformer_lm' cannot be built: data.seq_len (16) exceeds the model's 4 learned "
        "positions (model.max_positions); lower data.seq_len"
    )


@pytest.mark.parametrize(
    "keep_best, message",
    [
        ("{metric: nelbo, mode: min, extra: 1}", r"^unknown config key 'checkpoint.keep_best.extra'; keep_best takes "),
        ("{metric: nelbo, mdoe: min}", r"'checkpoint.keep_best.mdoe' \(did you mean 'checkpoint.keep_best.mode'\?\)"),
        ("{metric: 5, mode: min}", r"^config key 'checkpoint.keep_best.metric' must be a string, got 5"),
    ],
)
def test_a_keep_best_key_it_does_not_take_is_called_unknown(keep_best, message):
    """`extra: 1` was said to be a key that "must be a string", as if keep_best took it."""
    with pytest.raises(UserError, match=message):
        load_config(None, [f"checkpoint.keep_best={keep_best}"])


def test_a_mapping_override_without_spaces_after_its_colons_says_how_to_write_it():
    """YAML reads `{metric:accuracy,mode:max}` as two keys without values: the error named a key
    'checkpoint.keep_best.metric:accuracy' that had to be a string."""
    fixed = r"put a space after each ':', e\.g\. checkpoint\.keep_best='\{metric: accuracy, mode: max\}'$"
    with pytest.raises(UserError, match=fixed):
        load_config(None, ["checkpoint.keep_best={metric:accuracy,mode:max}"])
    assert load_config(None, ["checkpoint.keep_best={metric: accuracy, mode: max}"]).checkpoint.keep_best
