"""Benchmarks the field quotes: EleutherAI's lm-evaluation-harness tasks on nnx models.

`nnx-eval TARGET --tasks hellaswag,arc_easy` and `eval.harness` during
training both come here. The pieces:

- :mod:`nnx_cli.harness.engine`: batched, bucketed log-likelihoods and
  greedy generation with the jitted model (no lm-eval needed);
- :mod:`nnx_cli.harness.backend`: `NNXLM`, lm-eval's model API over the
  engine, registered with lm-eval as `nnx`;
- :mod:`nnx_cli.harness.target`: a run or a Hugging Face model loaded onto
  its mesh;
- this module: tasks loaded with every mistake named, the evaluation run,
  its metrics flattened for the loggers, and `evals/harness.jsonl` records.

lm-eval is optional (`pip install 'nnx[eval]'`): without it these functions
are a UserError saying what to install::

    tasks = load_tasks(["arc_easy", "my_task"], include_path="my_tasks/")
    results = evaluate(NNXLM("runs/my_run"), tasks, limit=100)
    print(results_table(results))
    flat_metrics(results)        # {"arc_easy/acc": 0.61, "arc_easy/acc_norm": 0.58, "my_task/exact_match": 0.2}
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nnx_cli.errors import UserError, check_can_create, did_you_mean

__all__ = [
    "RECORDS",
    "Tasks",
    "evaluate",
    "flat_metrics",
    "load_tasks",
    "quiet",
    "read_records",
    "require_lm_eval",
    "results_table",
    "save_outputs",
    "tracker",
    "write_records",
]

PACKAGE = "lm-eval"
RECORDS = Path("evals") / "harness.jsonl"  # in a run's work dir: one line per task evaluated at a step


def require_lm_eval(what: str = "the harness") -> None:
    """A UserError naming the package to install when lm-eval is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            f"{what} runs EleutherAI's lm-evaluation-harness, which is not installed: pip install 'nnx[eval]' "
            f"(or pip install {PACKAGE})"
        ) from None


@dataclasses.dataclass
class Tasks:
    """Tasks loaded once and evaluated any number of times: lm-eval's Task and Group objects, and their manager."""

    names: list[str]
    objects: list[Any]
    manager: Any


def load_tasks(names: Sequence[str], include_path: str | Path | None = None) -> Tasks:
    """lm-eval tasks or groups by name (or a task YAML's path), with their data loaded.

    `include_path` is a directory of the user's own task YAMLs. An unknown
    name, a YAML that does not parse or describes no valid task, and data
    that cannot be read or fetched (offline, and not in the `datasets`
    cache) are UserErrors naming the task and the file.
    """
    require_lm_eval()
    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise UserError("--tasks names no task: give lm-eval task or group names, comma-separated")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {str(include_path)!r} is not a directory of task YAMLs")
    manager = _manager(names, include_path)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            raise UserError(_unknown(name, manager.all_tasks, include_path))
    objects = []
    for name in names:
        objects.extend(_build(manager, name))
    return Tasks(names, objects, manager)


@contextlib.contextmanager
def as_config_keys() -> Iterator[None]:
    """The UserErrors of this module name nnx-eval's options; in a training run they are `eval.harness` keys."""
    try:
        yield
    except UserError as e:
        message = str(e)
        for flag, key in (("--tasks", "tasks"), ("--include-path", "include_path"), ("--num-fewshot", "num_fewshot"),
                          ("--apply-chat-template", "apply_chat_template"), ("--limit", "limit")):  # fmt: skip
            given = re.match(rf"{flag} ([^:\s]+):", message)  # `--num-fewshot 10: ...`
            if given:
                message = f"config key 'eval.harness.{key}' ({given.group(1)}){message[len(given.group(0)) - 1 :]}"
            elif message.startswith(flag):
                message = f"config key 'eval.harness.{key}'{message[len(flag) :]}"
            message = message.replace(flag, f"eval.harness.{key}")
        raise UserError(message) from None


def check_fewshot(tasks: Tasks, num_fewshot: int | None) -> None:
    """A UserError when a task has fewer examples to show than `num_fewshot`: the few-shot context of its first
    document is built as lm-eval builds it (found at the first evaluation, it ended a training run there)."""
    if not num_fewshot:
        return
    for task in tasks.objects:
        if not hasattr(task, "fewshot_context") or not hasattr(task, "eval_docs"):
            continue  # a group: its tasks are checked when evaluated
        try:
            first = next(iter(task.eval_docs), None)
            if first is not None:
                task.fewshot_context(first, num_fewshot)
        except ValueError as e:
            if "Sample larger than population" in str(e):
                name = getattr(task, "task_name", None) or getattr(getattr(task, "config", None), "task", "?")
                raise UserError(
                    f"--num-fewshot {num_fewshot}: task {name!r} has fewer examples to show than that; lower "
                    "--num-fewshot (or give the task a larger fewshot_split)"
                ) from None
        except Exception:  # anything else is the evaluation's to report, as before
            continue


def _manager(names: list[str], include_path: str | Path | None) -> Any:
    """A TaskManager that knows every name: the include path alone when it defines them all (indexing lm-eval's
    own thousands of tasks takes seconds), else lm-eval's tasks and the include path."""
    import logging

    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    local = check_names(names, include_path)
    if local is not None:
        return local
    return TaskManager(include_path=str(include_path) if include_path is not None else None)


def check_names(names: Sequence[str], include_path: str | Path | None) -> Any:
    """The checks of task names that need no index of lm-eval's own tasks: a UserError for a name the include
    path's YAMLs mean to define in a file that does not parse, and for a name no task YAML contains at all.
    Returns the include path's own TaskManager when it defines every name, else None (lm-eval's index decides)."""
    from lm_eval.tasks import TaskManager

    missing = list(names)
    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        missing = [name for name in names if name not in set(local.all_tasks)]
        if not missing:
            return local
        for name in missing:  # meant to be defined there, in a file that does not parse: no need to look further
            broken = _broken_yaml(name, include_path)
            if broken:
                raise UserError(f"--tasks: unknown task {name!r}{did_you_mean(name, local.all_tasks)}; {broken}")
    _named_somewhere([n for n in missing if not n.endswith((".yaml", ".yml"))], include_path)
    return None


def _named_somewhere(names: list[str], include_path: str | Path | None) -> None:
    """A UserError for the first of `names` that no task YAML (lm-eval's or the include path's) contains at all.

    Every task, group and tag name lm-eval knows is written in one of those files, so such a name is unknown
    for certain: reading their text takes about half a second, where indexing them takes seven (two cores).
    The suggestion comes from their top-level `task:`, `group:` and `tag:` lines."""
    if not names:
        return
    import lm_eval.tasks

    roots = [Path(lm_eval.tasks.__file__).parent, *([Path(include_path)] if include_path is not None else [])]
    texts = [path.read_text(errors="replace") for root in roots for path in sorted(root.rglob("*.yaml"))]
    for name in names:
        if not any(name in text for text in texts):
            written = {m for text in texts for m in _NAME_LINE.findall(text)}
            raise UserError(_unknown(name, sorted(written), include_path))


_NAME_LINE = re.compile(r"""^(?:task|group|tag):[ \t]*["']?([^\s"'#\[\]{},]+)""", re.MULTILINE)


def _broken_yaml(name: str, include_path: str | Path | None) -> str | None:
    """`<path> mentions it but is not valid YAML: <why>` for a YAML of the include path that mentions `name`
    and does not parse; None when there is none."""
    for path, problem in _unreadable_yamls(include_path):
        if name in path.read_text(errors="replace"):
            return f"{path} mentions it but is not valid YAML: {problem}"
    return None


def _unknown(name: str, known: Sequence[str], include_path: str | Path | None) -> str:
    """The message for a task name nothing defines, naming a YAML of the include path that may have meant to."""
    message = f"--tasks: unknown task {name!r}{did_you_mean(name, known)}"
    broken = _broken_yaml(name, include_path)
    if broken:
        return f"{message}; {broken}"
    where = f", nor does any YAML in --include-path {str(include_path)!r}" if include_path is not None else ""
    return f"{message}: no lm-eval task, group or tag has that name{where} (`lm-eval ls tasks` lists them)"


def _unreadable_yamls(include_path: str | Path | None) -> list[tuple[Path, str]]:
    """The YAML files under `include_path` that do not parse, with the parser's complaint."""
    import yaml

    if include_path is None:
        return []

    class Loader(yaml.SafeLoader):  # lm-eval's `!function` tags are fine here: only the syntax is checked
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    bad = []
    for path in sorted(Path(include_path).rglob("*.y*ml")):
        try:
            yaml.load(path.read_text(errors="replace"), Loader=Loader)  # a SafeLoader
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            bad.append((path, f"{getattr(e, 'problem', None) or e}{where}"))
    return bad


def _build(manager: Any, name: str) -> list[Any]:
    """The Task or Group objects `name` stands for (a tag stands for several tasks), data loaded."""
    with building(manager, name):
        loaded = manager.load([name])
    if name in loaded["groups"]:
        return [loaded["groups"][name]]
    return list(loaded["tasks"].values())


@contextlib.contextmanager
def building(manager: Any, name: str, yaml_path: str | Path | None = None) -> Iterator[None]:
    """Whatever fails while task `name` is built (its YAML and its data are user input) as a UserError naming the
    task and its YAML (`yaml_path`, else where `manager`'s index has it)."""
    if yaml_path is None:
        entry = manager.task_index.get(name)
        yaml_path = getattr(entry, "yaml_path", None) if entry is not None else None
    where = f" ({yaml_path})" if yaml_path else ""
    try:
        yield
    except UserError:
        raise
    except (OSError, ConnectionError) as e:
        raise UserError(_no_data(name, where, e)) from None
    except Exception as e:  # a task's YAML and data are user input: whatever fails in them is named, not raised
        if type(e).__module__.startswith(("datasets", "huggingface_hub", "fsspec", "requests")):
            raise UserError(_no_data(name, where, e)) from None
        raise UserError(f"--tasks: task {name!r}{where} cannot be built: {type(e).__name__}: {e}") from None


def _no_data(name: str, where: str, error: BaseException) -> str:
    return (
        f"--tasks: task {name!r}{where} needs data that cannot be read or fetched ({type(error).__name__}: "
        f"{' '.join(str(error).split())}); without network, download it into the datasets cache on a machine "
        "that has one, or write a task YAML over local files (dataset_path: json, dataset_kwargs.data_files) and "
        "pass its directory with --include-path"
    )


def evaluate(
    lm: Any,
    tasks: Tasks,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    log_samples: bool = False,
    apply_chat_template: bool = False,
    bootstrap_iters: int = 100000,
    model_args: str | None = None,
    tracker: Any = None,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `lm` on `tasks`: its results dict (`results`, `versions`, `n-shot`,
    `higher_is_better`, `configs`, `config`, and `samples` with `log_samples`). `tracker` (see :func:`tracker`)
    records the run's settings for the results files."""
    import logging

    from jinja2 import TemplateError
    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if limit is not None and (limit <= 0 or (isinstance(limit, float) and limit >= 1.0 and not limit.is_integer())):
        raise UserError(f"--limit must be a number of examples (>= 1) or a fraction in (0, 1), got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be 0 or more, got {num_fewshot}")
    try:
        with _git_hash_quietly():
            results = simple_evaluate(
                model=lm, model_args=model_args, tasks=list(tasks.objects), task_manager=tasks.manager,
                num_fewshot=num_fewshot, limit=limit, log_samples=log_samples, apply_chat_template=apply_chat_template,
                fewshot_as_multiturn=apply_chat_template, bootstrap_iters=bootstrap_iters, evaluation_tracker=tracker,
            )  # fmt: skip
    except TemplateError as e:
        raise UserError(f"--tasks: a task's prompt template failed on a document: {e}") from None
    except ValueError as e:
        if "Sample larger than population" not in str(e):
            raise
        raise UserError(  # lm-eval draws the examples from the task's few-shot split (or its training documents)
            f"--num-fewshot {num_fewshot}: a task has fewer examples to show than that; lower --num-fewshot (or give "
            "the task a larger fewshot_split)"
        ) from None
    assert results is not None  # one process: rank 0
    for task, metrics in results.get("results", {}).items():
        if not _task_metrics(metrics, False) and task not in results.get("groups", {}):
            raise UserError(
                f"--tasks: task {task!r} scored nothing: no metric of its metric_list is one lm-eval knows (its "
                "warning above names it); fix the task's YAML"
            )
    return results


@contextlib.contextmanager
def _git_hash_quietly() -> Iterator[None]:
    """lm-eval records the git commit of the directory it runs in by running `git describe`, whose error outside a
    repository ("fatal: not a git repository") reached the terminal as though the evaluation had failed. The same
    lookup, its error output discarded, while `simple_evaluate` runs."""
    import subprocess

    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def commit() -> str | None:
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    loud = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = commit
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = loud


def tracker(output_path: str | Path | None) -> Any:
    """lm-eval's EvaluationTracker writing under `output_path` (None: nothing written, None returned)."""
    if output_path is None:
        return None
    from lm_eval.loggers import EvaluationTracker

    path = Path(output_path)
    if path.exists() and not path.is_dir() and path.suffix != ".json":
        raise UserError(f"--output-path {str(path)!r} is a file; give a directory (or a .json file name)")
    if not path.exists():  # lm-eval's tracker only warns where it cannot write, after the whole evaluation
        check_can_create(path, "--output-path")
    return EvaluationTracker(output_path=str(path))


def save_outputs(tracker: Any, results: dict[str, Any], log_samples: bool) -> None:
    """lm-eval's results file (and with `log_samples` one samples file per task), as its command line writes
    them; the samples are taken out of `results`."""
    samples = results.pop("samples", None) if log_samples else None
    try:
        tracker.save_results_aggregated(results=results, samples=samples)
        if samples is not None:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    except OSError as e:
        raise UserError(f"--output-path: cannot write the results ({e.strerror or e})") from None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Nothing written to stderr meanwhile: lm-eval's progress bars and notes, and what the `git` it runs to
    record a commit says outside a repository."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(io.StringIO()):
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def results_table(results: dict[str, Any]) -> str:
    """The results as lm-eval's command line prints them (a Markdown table, then one of the groups)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def flat_metrics(results: dict[str, Any], stderr: bool = False) -> dict[str, float]:
    """`{"<task>/<metric>": value}` for every task and group (a filter other than `none` stays as lm-eval writes
    it: `gsm8k/exact_match,strict-match`); the standard errors only with `stderr`; values that are not numbers
    (`N/A`) left out."""
    flat = {}
    for task, metrics in _tasks_and_groups(results).items():
        for key, value in _task_metrics(metrics, stderr).items():
            flat[f"{task}/{key}"] = value
    return flat


def _tasks_and_groups(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task's and group's metrics, once (lm-eval lists groups among the results too)."""
    return {**results.get("results", {}), **results.get("groups", {})}


def _task_metrics(metrics: dict[str, Any], stderr: bool) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        name, _, filt = key.partition(",")
        if not filt or (name.endswith("_stderr") and not stderr):
            continue  # `alias`, `name`, `sample_len`: not metrics
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name if filt == "none" else key] = float(value)
    return out


def write_records(workdir: Path, step: int | None, results: dict[str, Any], *, limit: int | float | None = None,
                  target: str | None = None) -> Path:  # fmt: skip
    """Append one line per task (and group) to `<workdir>/evals/harness.jsonl`: `{"step", "task", "version",
    "num_fewshot", "limit", "metrics", "higher_is_better", "target", "time"}`, what `nnx-plot` draws against
    the step."""
    path = workdir / RECORDS
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for task, metrics in _tasks_and_groups(results).items():
        record = {
            "step": step,
            "task": task,
            "version": results.get("versions", {}).get(task),
            "num_fewshot": results.get("n-shot", {}).get(task),
            "limit": limit,
            "metrics": {k: (v if math.isfinite(v) else None) for k, v in _task_metrics(metrics, True).items()},
            "higher_is_better": results.get("higher_is_better", {}).get(task, {}),
            "target": target,
            "time": time.time(),
        }
        lines.append(json.dumps(record, default=str) + "\n")
    with path.open("a") as f:
        f.write("".join(lines))
    return path


def read_records(workdir: Path) -> list[dict[str, Any]]:
    """The records of `<workdir>/evals/harness.jsonl` as metric records `{"step", "split": "harness", "metrics":
    {"<task>/<metric>": value}}`, the newest record of a task at a step (and few-shot count) winning; [] when
    there are none."""
    path = workdir / RECORDS
    if not path.is_file():
        return []
    newest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():  # bytes not UTF-8 (a damaged block): no JSON
        try:
            record = json.loads(line)
            key = (record["step"], record["task"], record.get("num_fewshot"))
            metrics = dict(record["metrics"])
            hash(key)  # a list where a name or count belongs (a hand edit)
        except (ValueError, KeyError, TypeError):
            continue  # a torn line
        if isinstance(record["step"], int) and isinstance(record["task"], str):
            newest[key] = {"step": record["step"], "task": record["task"], "metrics": metrics}
    by_step: dict[int, dict[str, Any]] = {}
    for record in newest.values():
        merged = by_step.setdefault(record["step"], {})
        merged.update({f"{record['task']}/{k}": v for k, v in record["metrics"].items() if not k.endswith("_stderr")
                       and not k.partition(",")[0].endswith("_stderr")})  # fmt: skip
    return [{"step": step, "split": "harness", "metrics": metrics} for step, metrics in sorted(by_step.items())]
