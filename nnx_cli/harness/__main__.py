"""`python -m nnx_cli.harness [lm-eval arguments]`: lm-eval's own command line, with nnx's model registered.

lm-eval 0.4 finds models only in its own registry (no plug-in discovery), so
`lm_eval --model nnx` works from Python code that imported
`nnx_cli.harness.backend`, and from the command line through this module,
which takes every argument lm-eval's command line takes::

    python -m nnx_cli.harness --model nnx --model_args pretrained=runs/my_run,step=400 \\
        --tasks hellaswag --batch_size 32 --output_path results

When `--include_path` defines every task `--tasks` names, lm-eval's own task
index (thousands of YAML files, about 7 s on two cores) is not read, as
`nnx-eval --include-path` does not read it.
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    from nnx_cli.errors import UserError, report_errors
    from nnx_cli.harness import require_lm_eval

    try:
        require_lm_eval("python -m nnx_cli.harness")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import nnx_cli.harness.backend  # noqa: F401  (registers the `nnx` model)

    setup_logging()  # what lm-eval's cli_evaluate does, with the arguments read here first
    parser = HarnessCLI()
    args = parser.parse_args()
    report_errors(_check)(args)  # bad model arguments and task names: one line and exit 2, before any loading
    if _include_path_defines_all(args):
        _index_include_path_only()
    _name_task_errors()
    report_errors(parser.execute)(args)  # a bad target (no such run or step) is one line and exit 2, as in nnx-eval


def _check(args: Any) -> None:
    """For a `run` of the `nnx` model: its model arguments and `--batch_size` (as NNXLM reads them), and the task
    names that need no index of lm-eval's own tasks (as `nnx-eval --tasks` checks them), with nnx-eval's
    messages."""
    from pathlib import Path

    from nnx_cli.errors import UserError
    from nnx_cli.harness import check_names
    from nnx_cli.harness.backend import check_batch_size, check_model_args

    if getattr(args, "command", None) != "run":
        return
    if getattr(args, "model", None) == "nnx" and getattr(args, "config", None) is None:  # else NNXLM checks them
        model_args = dict(getattr(args, "model_args", None) or {})
        check_model_args(model_args)
        if "batch_size" in model_args:  # lm-eval passes its --batch_size (default 1) too: a TypeError
            size = model_args["batch_size"]
            raise UserError(f"--model_args batch_size={size}: give it as --batch_size {size}")
        check_batch_size(getattr(args, "batch_size", None))
    if getattr(args, "config", None) is not None:  # its include_path and tasks may come from the file: lm-eval's
        return
    include_path = getattr(args, "include_path", None)
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include_path {str(include_path)!r} is not a directory of task YAMLs")
    names = [n.strip() for n in getattr(args, "tasks", None) or [] if n and n.strip()]
    if not names:
        raise UserError("--tasks names no task: give lm-eval task or group names, comma-separated")
    if len(names) == 1 and Path(names[0]).is_dir():
        return  # lm-eval's directory of task YAMLs
    plain = [n for n in names if not n.endswith((".yaml", ".yml")) and not any(c in n for c in "*?[")]
    if plain:  # a pattern (`mmlu_*`) and a YAML file are lm-eval's to match
        check_names(plain, include_path)


def _include_path_defines_all(args: Any) -> bool:
    """True for a `run` whose `--tasks` are all names the `--include_path` directory alone defines."""
    from lm_eval.tasks import TaskManager

    include_path = getattr(args, "include_path", None)
    names = [n for n in getattr(args, "tasks", None) or [] if n]
    if getattr(args, "command", None) != "run" or include_path is None or not names:
        return False
    if any(n.endswith((".yaml", ".yml")) for n in names):
        return False
    local = set(TaskManager(include_path=include_path, include_defaults=False).all_tasks)
    return all(n in local for n in names)


def _index_include_path_only() -> None:
    """lm-eval's run builds its TaskManager by name from `lm_eval.tasks`: one that leaves out lm-eval's own tasks."""
    import lm_eval.tasks

    class IncludePathOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("include_defaults", False)
            super().__init__(*args, **kwargs)

    lm_eval.tasks.TaskManager = IncludePathOnly


def _name_task_errors() -> None:
    """lm-eval's task loading with nnx-eval's messages: a name that matches no task, and a task that cannot be
    built (a YAML that describes no valid task, data that cannot be read or fetched), are UserErrors naming the
    task and its file, not tracebacks."""
    import lm_eval.tasks
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from nnx_cli.errors import UserError
    from nnx_cli.harness import _unknown, building

    process_tasks = EvaluatorConfig.process_tasks

    def checked_process_tasks(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return process_tasks(self, *args, **kwargs)
        except ValueError as e:
            if not str(e).startswith("Tasks not found: "):
                raise
            name = str(e).removeprefix("Tasks not found: ").split(", ")[0]
            known = lm_eval.tasks.TaskManager(include_path=self.include_path).all_tasks
            raise UserError(_unknown(name, known, self.include_path)) from None

    EvaluatorConfig.process_tasks = checked_process_tasks

    class NamingErrors(lm_eval.tasks.TaskManager):
        def _load_spec(self, spec: Any) -> Any:
            if isinstance(spec, str):
                name, yaml_path = spec, None
            elif isinstance(spec, dict):
                name, yaml_path = str(spec.get("task") or spec.get("group") or "?"), None
            else:
                return super()._load_spec(spec)
            with building(self, name, yaml_path):
                return super()._load_spec(spec)

    lm_eval.tasks.TaskManager = NamingErrors


if __name__ == "__main__":
    main()
