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
    if _include_path_defines_all(args):
        _index_include_path_only()
    report_errors(parser.execute)(args)  # a bad target (no such run or step) is one line and exit 2, as in nnx-eval


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


if __name__ == "__main__":
    main()
