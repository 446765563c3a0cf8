"""`nnx-eval TARGET --tasks ...` as a user runs it: a LoRA run evaluated directly and as its merged export
against lm-eval's `hf` model, lm-eval's files and the run's records, 8 devices, lm-eval's own command line, and
every mistake named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import assert_user_error, cli, env
from harness_support import TASKS, compare, compare_metrics, copy_tasks, golden, read_samples
from hf_support import fixture

ALL = ",".join(TASKS)
LORA = f"""
model: {{name: transformer_lm, pretrained: {fixture("llama")}, lora: {{rank: 4, alpha: 8}}}}
data: {{source: text.txt, text_key: text, seq_len: 32, eval_split: null}}
optimizer: {{name: sgd, learning_rate: 0.0}}
train: {{batch_size: 2, steps: 1, log_every: 1}}
checkpoint: {{init_from: {fixture("llama_lora")}}}
"""  # the PEFT adapter's values, kept by a step of learning rate 0: what peft merged into the golden's weights


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness_cli")
    copy_tasks(root)
    words = "the river ran past the old mill and the miller's daughter counted the boats".split()
    (root / "text.txt").write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12))
                                             for i in range(100)))  # fmt: skip
    (root / "lora.yaml").write_text(LORA)
    return root


def run(project: Path, *args: str, expect: int = 0, devices: int | None = None) -> subprocess.CompletedProcess:
    result = cli(*args, cwd=project, timeout=300, devices=devices)
    assert result.returncode == expect, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def lora_run(project: Path) -> Path:
    run(project, "nnx-train", "lora.yaml", "--workdir", "lora")
    return project / "lora"


def test_a_lora_run_evaluated_directly_and_its_merged_export_answer_as_lm_evals_hf_model_does(project, lora_run):
    result = run(project, "nnx-eval", "lora", "--tasks", ALL, "--include-path", "tasks", "--output-path", "direct",
                 "--log-samples", "--json")  # fmt: skip
    assert "not a git repository" not in result.stderr  # lm-eval's lookup of the commit, outside a repository
    report = json.loads(result.stdout)
    assert report["step"] == 1 and report["n-shot"] == {"local_choices": 2, "local_until": 0, "local_rolling": 0}
    compare(read_samples(project / "direct"), golden("llama_lora_merged"))
    compare_metrics(report["metrics"], golden("llama_lora_merged"))
    records = [json.loads(line) for line in (lora_run / "evals" / "harness.jsonl").read_text().splitlines()]
    assert [(r["step"], r["task"], r["num_fewshot"]) for r in records] == [
        (1, "local_choices", 2), (1, "local_until", 0), (1, "local_rolling", 0),
    ]  # fmt: skip
    assert records[0]["metrics"]["acc"] == report["metrics"]["local_choices/acc"]

    # The same adapters merged by nnx-export; the results table as lm-eval prints it, and lm-eval's results file.
    run(project, "nnx-export", "lora", "--out", "merged")
    result = run(project, "nnx-eval", "merged", "--tasks", ALL, "--include-path", "tasks", "--output-path",
                 "exported", "--log-samples")  # fmt: skip
    compare(read_samples(project / "exported"), golden("llama_lora_merged"))
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert lines[header].replace(" ", "") == "|Tasks|Version|Filter|n-shot|Metric||Value||Stderr|"
    assert any(line.startswith("|local_choices") and "|acc " in line for line in lines[header:])
    results = json.loads(next((project / "exported").rglob("results_*.json")).read_text())
    assert (
        results["results"]["local_choices"]["acc,none"]
        == golden("llama_lora_merged")["metrics"]["local_choices"]["acc"]
    )


def test_on_eight_devices_the_requests_split_over_the_mesh_and_the_answers_stay_the_same(project):
    result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", ALL, "--include-path", "tasks", "--output-path",
                 "eight", "--log-samples", "--json", "--batch-size", "8", devices=8)  # fmt: skip
    compare(read_samples(project / "eight"), golden("gpt2"))
    compare_metrics(json.loads(result.stdout)["metrics"], golden("gpt2"))


def test_lm_evals_command_line_reads_only_the_include_path_when_it_defines_every_task(project, monkeypatch):
    """`python -m nnx_cli.harness` (its whole run: tests/test_docs_examples.py, the evaluation guide) skips the
    index of lm-eval's own tasks, seconds of YAML, when `--include_path` defines every task of `--tasks`."""
    import lm_eval.tasks
    from lm_eval._cli import HarnessCLI

    from nnx_cli.harness.__main__ import _include_path_defines_all, _index_include_path_only

    def parsed(*args: str):
        monkeypatch.setattr(sys, "argv", ["python -m nnx_cli.harness", *args])
        return HarnessCLI().parse_args()

    local = ["--include_path", str(project / "tasks")]
    assert _include_path_defines_all(parsed("--model", "nnx", "--tasks", "local_choices,local_until", *local))
    assert _include_path_defines_all(parsed("run", "--model", "nnx", "--tasks", "local_rolling", *local))
    assert not _include_path_defines_all(parsed("--model", "nnx", "--tasks", "local_choices,hellaswag", *local))
    assert not _include_path_defines_all(parsed("--model", "nnx", "--tasks", "local_choices"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # put back after the test
    _index_include_path_only()
    assert set(lm_eval.tasks.TaskManager(include_path=str(project / "tasks")).all_tasks) == set(TASKS)


def test_lm_evals_command_line_leaves_the_tasks_of_a_config_file_to_lm_eval(project, monkeypatch):
    """With `--config`, the include path (and the tasks) may be in the file: the early check looked for the
    config's tasks in lm-eval's own alone, and refused them."""
    from lm_eval._cli import HarnessCLI

    from nnx_cli.harness.__main__ import _check

    config = project / "harness_config.yaml"
    config.write_text(f"model: nnx\nmodel_args: {{pretrained: {fixture('gpt2')}}}\ninclude_path: {project / 'tasks'}\n")
    monkeypatch.setattr(sys, "argv", ["python -m nnx_cli.harness", "run", "--config", str(config), "--tasks",
                                      "local_choices"])  # fmt: skip
    _check(HarnessCLI().parse_args())  # no UserError: lm-eval reads the file, then the nnx model checks its args


# Mistakes, named
# --------------------------------------------------------------------------------------------------------------


def test_an_unknown_task_is_exit_2_naming_it_and_the_closest_name(project):
    result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", "local_choicez", "--include-path", "tasks",
                 expect=2)  # fmt: skip
    assert_user_error(result, "unknown task 'local_choicez'", "local_choices")


def test_lm_evals_command_line_with_a_step_the_run_lacks_is_one_line_and_exit_2(project, lora_run):
    """`python -m nnx_cli.harness` ended in a traceback, exit 1, where nnx-eval says one line (evaluation guide)."""
    args = ["--model", "nnx", "--model_args", "pretrained=lora,step=7", "--tasks", "local_choices",
            "--include_path", "tasks"]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "nnx_cli.harness", *args], cwd=project, env=env(project),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "error: --step 7: no such checkpoint in 'lora/checkpoints'; available steps: 1" in result.stderr


def _bad_tasks(project: Path) -> None:
    """Task directories for lm-eval's command line: a YAML that does not parse, one that is no valid task, one
    whose data file is missing."""
    choices = (project / "tasks" / "local_choices.yaml").read_text()
    for folder, name, text in [
        ("cli_broken", "local_broken", "task: local_broken\noutput_type: multiple_choice\n  oops: [\n"),
        ("cli_invalid", "local_invalid", choices.replace("multiple_choice", "multiple_chose")),
        ("cli_nodata", "local_nodata", choices.replace("data/choices.jsonl", "data/no_such_file.jsonl")),
    ]:
        (project / folder).mkdir(exist_ok=True)
        (project / folder / f"{name}.yaml").write_text(text.replace("task: local_choices", f"task: {name}"))


CHOICES = ["--tasks", "local_choices", "--include_path", "tasks"]
GPT2 = f"pretrained={fixture('gpt2')}"


@pytest.mark.parametrize(
    "model_args, options, fragments",
    [
        (f"{GPT2},step=abc", CHOICES, ["--model_args step=abc: step must be a whole number"]),
        ("step=2", CHOICES, ["--model_args needs pretrained=<run dir, model dir or .gguf file>"]),
        (f"{GPT2},max_length=abc", CHOICES, ["--model_args max_length=abc: max_length must be a whole number"]),
        (f"{GPT2},max_gen_toks=abc", CHOICES, ["--model_args max_gen_toks=abc: max_gen_toks must be a whole"]),
        (f"{GPT2},max_length=0", CHOICES, ["--model_args max_length=0: max_length must be 1 or more"]),
        (f"{GPT2},max_length=2", CHOICES, ["--model_args max_length=2: task 'local_choices' scores a continuation"
                                           " of", "give max_length="]),
        (f"{GPT2},batch_size=4", CHOICES, ["--model_args batch_size=4: give it as --batch_size 4"]),
        (GPT2, [*CHOICES, "--batch_size", "0"], ["--batch_size must be at least 1, got 0"]),
        (GPT2, ["--tasks", "local_choicez", "--include_path", "tasks"],
         ["unknown task 'local_choicez' (did you mean 'local_choices'?)"]),
        (GPT2, ["--tasks", "local_broken", "--include_path", "cli_broken"],
         ["unknown task 'local_broken'", "local_broken.yaml", "not valid YAML"]),
        (GPT2, ["--tasks", "local_invalid", "--include_path", "cli_invalid"],
         ["task 'local_invalid'", "local_invalid.yaml", "multiple_chose"]),
        (GPT2, ["--tasks", "local_nodata", "--include_path", "cli_nodata"],
         ["task 'local_nodata'", "local_nodata.yaml", "cannot be read or fetched"]),
    ],
    ids=["step", "no-pretrained", "max_length", "max_gen_toks", "max_length-0", "max_length-short", "batch_size-arg",
         "batch_size-0", "unknown-task", "broken-yaml", "invalid-task", "missing-data"],
)  # fmt: skip
def test_lm_evals_command_line_with_a_bad_model_argument_or_task_is_one_line_and_exit_2(
    project, model_args, options, fragments
):
    """Each ended in a traceback, exit 1 (`int('abc')`, NNXLM without `pretrained`, a continuation longer than
    max_length, lm-eval's `Tasks not found`, a task that cannot be built), or was taken as valid (max_length=0 as
    unset, --batch_size 0); nnx-eval --tasks says one line, exit 2, and so does lm-eval's command line now."""
    _bad_tasks(project)
    args = ["--model", "nnx", "--model_args", model_args, *options, "--limit", "1"]
    result = subprocess.run([sys.executable, "-m", "nnx_cli.harness", *args], cwd=project, env=env(project),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]  # after lm-eval's log lines
    assert last.startswith("error: ") and all(fragment in last for fragment in fragments), last


def test_a_name_no_task_yaml_contains_is_unknown_without_indexing_lm_evals_tasks(monkeypatch):
    """A misspelt name is reported from a read of the YAMLs' text, closest name included, and lm-eval's own index
    (seconds of parsing) is never built; a name they contain is looked up in the index as before."""
    import lm_eval.tasks

    from nnx_cli.errors import UserError
    from nnx_cli.harness import _named_somewhere, load_tasks

    _named_somewhere(["hellaswag", "arc_easy", "mmlu", "leaderboard"], None)  # real tasks, groups: the index decides
    built = []
    real = lm_eval.tasks.TaskManager

    class Counting(real):  # records the index asked for, and builds an empty one (lm-eval's whole: 7 s)
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("include_defaults", True))
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counting)
    with pytest.raises(UserError, match=r"unknown task 'hellaswagg' \(did you mean 'hellaswag'\?\)"):
        load_tasks(["hellaswagg"])
    assert built == []
    with pytest.raises(UserError, match="unknown task 'output_type'"):  # in every task's YAML, but no task's name
        load_tasks(["output_type"])
    assert built == [True]


def test_a_task_yaml_that_does_not_parse_is_exit_2_naming_the_file(project):
    (project / "broken").mkdir()
    (project / "broken" / "local_broken.yaml").write_text(
        "task: local_broken\noutput_type: multiple_choice\n  oops: [\n"
    )
    result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", "local_broken", "--include-path", "broken",
                 expect=2)  # fmt: skip
    assert_user_error(result, "unknown task 'local_broken'", "local_broken.yaml", "not valid YAML")


def test_a_task_that_is_no_valid_task_is_exit_2_naming_it_and_its_file(project):
    (project / "invalid").mkdir()
    text = (project / "tasks" / "local_choices.yaml").read_text().replace("local_choices", "local_invalid")
    (project / "invalid" / "local_invalid.yaml").write_text(text.replace("multiple_choice", "multiple_chose"))
    result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", "local_invalid", "--include-path", "invalid",
                 expect=2)  # fmt: skip
    assert_user_error(result, "task 'local_invalid'", "local_invalid.yaml", "multiple_chose")


def test_a_task_whose_data_cannot_be_fetched_offline_is_exit_2_naming_it(project):
    (project / "hub").mkdir()
    text = (project / "tasks" / "local_choices.yaml").read_text().replace("local_choices", "hub_choices")
    text = text.replace("dataset_path: json", "dataset_path: nnx-tests/no-such-dataset")
    (project / "hub" / "hub_choices.yaml").write_text(text)
    result = cli("nnx-eval", fixture("gpt2"), "--tasks", "hub_choices", "--include-path", "hub", cwd=project,
                 extra_env={"HF_DATASETS_OFFLINE": "1"}, timeout=300)  # fmt: skip
    assert_user_error(result, "task 'hub_choices'", "hub_choices.yaml", "cannot be read or fetched")


def test_without_lm_eval_the_harness_is_exit_2_naming_the_package(project):
    script = ("import sys; sys.modules['lm_eval'] = None; from nnx_cli.commands.eval import main; "
              f"sys.argv = ['nnx-eval', {str(fixture('gpt2'))!r}, '--tasks', 'hellaswag']; main()")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], cwd=project, env=env(project), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert_user_error(result, "pip install 'nnx[eval]'", "lm-eval")


def test_settings_the_tasks_or_the_model_cannot_meet_are_exit_2_not_a_traceback_nor_an_empty_success(project):
    """Each ended in lm-eval's or our traceback (more few-shot examples than the task has, a generation as long
    as the model's context), or in exit 0 with nothing scored or nothing saved (a misspelt metric, an output
    path under a file: lm-eval only warned)."""
    (project / "odd").mkdir()
    tasks = project / "tasks"
    until = (tasks / "local_until.yaml").read_text().replace("local_until", "local_long")
    (project / "odd" / "local_long.yaml").write_text(until.replace("max_gen_toks: 24", "max_gen_toks: 64"))
    choices = (tasks / "local_choices.yaml").read_text().replace("local_choices", "local_misspelt")
    misspelt = choices.replace("metric: acc_norm", "metric: acc_nrom").replace("metric: acc\n", "metric: acc_\n")
    (project / "odd" / "local_misspelt.yaml").write_text(misspelt)
    shutil.copy(tasks / "local_choices.yaml", project / "odd")
    (project / "a_file").write_text("")
    cases = [
        (["local_choices", "--num-fewshot", "40"], ["--num-fewshot 40", "fewer examples"]),
        (["local_long"], ["task 'local_long' generates up to 64 tokens", "context of 64", "max_gen_toks"]),
        (["local_misspelt"], ["task 'local_misspelt' scored nothing", "metric_list"]),
        (["local_choices", "--output-path", "a_file/results"], ["--output-path", "a_file is a file"]),
    ]
    for tasks_and_options, fragments in cases:
        result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", *tasks_and_options, "--include-path", "odd",
                     "--limit", "2", expect=2)  # fmt: skip
        last = result.stderr.strip().splitlines()[-1]  # after lm-eval's progress
        assert "Traceback" not in result.stderr and last.startswith("error: "), result.stderr[-2000:]
        assert all(fragment in last for fragment in fragments), last


def test_harness_options_without_tasks_and_samples_without_an_output_path_are_user_errors(project):
    assert_user_error(run(project, "nnx-eval", fixture("gpt2"), "--limit", "3", expect=2), "--limit", "--tasks")
    result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", "local_choices", "--include-path", "tasks",
                 "--log-samples", expect=2)  # fmt: skip
    assert_user_error(result, "--log-samples", "--output-path")
    for limit in ("1.5", "0"):  # 1.5 ran one example a task, 0 none (eval.harness.limit refused both)
        result = run(project, "nnx-eval", fixture("gpt2"), "--tasks", "local_choices", "--include-path", "tasks",
                     "--limit", limit, expect=2)  # fmt: skip
        assert_user_error(result, f"--limit must be a number of examples or a fraction in (0, 1), got {limit}")


# During training
# --------------------------------------------------------------------------------------------------------------

TUNE = f"""
model: {{name: transformer_lm, pretrained: {fixture("llama")}}}
data: {{source: text.txt, text_key: text, seq_len: 32, eval_split: null}}
optimizer: {{name: adam, learning_rate: 1.0e-3}}
train: {{batch_size: 2, steps: 4, log_every: 2}}
eval: {{harness: {{tasks: [local_choices, local_rolling], every_steps: 2, limit: 4, include_path: tasks}}}}
"""


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["eval.harness.tasks=[local_choicez]"],
            [
                "config key 'eval.harness.tasks': unknown task 'local_choicez'",
                "nor does any YAML in eval.harness.include_path 'tasks'",
            ],
        ),
        (  # the next two were found at the first harness eval, once trained to it, naming nnx-eval's flags
            ["eval.harness.num_fewshot=40"],
            ["config key 'eval.harness.num_fewshot' (40): task 'local_choices' has fewer examples to show than that"],
        ),
        (
            [f"model.pretrained={fixture('gpt2')}", "eval.harness.apply_chat_template=true"],
            ["config key 'eval.harness.apply_chat_template' needs a chat template, and the model has none"],
        ),
    ],
    ids=["unknown-task", "too-many-shots", "no-chat-template"],
)
def test_harness_settings_a_run_cannot_meet_are_named_by_their_config_key_before_it_starts(
    project, overrides, fragments
):
    (project / "tune.yaml").write_text(TUNE)
    result = cli("nnx-train", "tune.yaml", *overrides, "--workdir", "tune-refused", cwd=project)
    last = result.stderr.strip().splitlines()[-1]  # after the datasets library's lines, when it first builds a task's
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith("error: ") and all(fragment in last for fragment in fragments), last
    assert not (project / "tune-refused").exists()


def test_a_run_logs_harness_metrics_as_it_trains_and_nnx_eval_of_its_checkpoint_agrees(project):
    (project / "tune.yaml").write_text(TUNE)
    run(project, "nnx-train", "tune.yaml", "--workdir", "tune")
    lines = [json.loads(line) for line in (project / "tune" / "metrics.jsonl").read_text().splitlines()]
    logged = {line["step"]: line["metrics"] for line in lines if line["split"] == "harness"}
    assert sorted(logged) == [2, 4] and logged[2] != logged[4]
    assert set(logged[4]) == {"local_choices/acc", "local_choices/acc_norm", "local_rolling/word_perplexity",
                              "local_rolling/byte_perplexity", "local_rolling/bits_per_byte"}  # fmt: skip
    result = run(project, "nnx-eval", "tune", "--tasks", "local_choices,local_rolling", "--include-path", "tasks",
                 "--limit", "4", "--json")  # fmt: skip
    evaluated = json.loads(result.stdout)["metrics"]
    for name, value in logged[4].items():
        assert abs(evaluated[name] - value) <= 1e-5 * abs(value), name
    run(project, "nnx-plot", "tune", "--metric", "local_rolling/bits_per_byte", "--out", "tune.png")
    assert (project / "tune.png").stat().st_size > 0


def test_a_harness_task_that_cannot_be_loaded_stops_the_run_before_the_work_dir_is_touched(project):
    (project / "bad_tasks").mkdir()  # local_choices as it is, local_rolling's YAML broken
    (project / "bad_tasks" / "local_choices.yaml").write_text((project / "tasks" / "local_choices.yaml").read_text())
    (project / "bad_tasks" / "local_rolling.yaml").write_text("task: local_rolling\n  oops: [\n")
    (project / "bad_tune.yaml").write_text(TUNE.replace("include_path: tasks", "include_path: bad_tasks"))
    result = run(project, "nnx-train", "bad_tune.yaml", "--workdir", "bad_tune", expect=2)
    assert_user_error(result, "unknown task 'local_rolling'", "local_rolling.yaml", "not valid YAML")
    assert not (project / "bad_tune" / "config.yaml").exists()
