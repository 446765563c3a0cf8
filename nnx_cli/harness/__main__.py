"""`python -m nnx_cli.harness [lm-eval arguments]`: lm-eval's own command line, with nnx's model registered.

lm-eval 0.4 finds models only in its own registry (no plug-in discovery), so
`lm_eval --model nnx` works from Python code that imported
`nnx_cli.harness.backend`, and from the command line through this module,
which takes every argument lm-eval's command line takes::

    python -m nnx_cli.harness --model nnx --model_args pretrained=runs/my_run,step=400 \\
        --tasks hellaswag --batch_size 32 --output_path results
"""

from __future__ import annotations

import sys


def main() -> None:
    from nnx_cli.errors import UserError
    from nnx_cli.harness import require_lm_eval

    try:
        require_lm_eval("python -m nnx_cli.harness")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from lm_eval.__main__ import cli_evaluate

    import nnx_cli.harness.backend  # noqa: F401  (registers the `nnx` model)

    cli_evaluate()


if __name__ == "__main__":
    main()
