"""Errors the command-line tools turn into exit codes.

Everything a user can get wrong (a config file, an override, a path, a name)
raises :class:`UserError`; the entry points print its one-line message and exit
with status 2, never a traceback. A run that starts and then fails (for example
a non-finite loss) raises :class:`RunError` and exits with status 1.
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

EXIT_USER_ERROR = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Bad input: a config key, a value, a path or a name. Exit status 2."""


class RunError(Exception):
    """A run that started but could not finish. Exit status 1."""


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`" (did you mean 'train.steps'?)"` for the closest choice, or `""` if none is close.

    >>> did_you_mean("setps", ["steps", "epochs"], prefix="train.")
    " (did you mean 'train.steps'?)"
    """
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix + match[0]!r}?)" if match else ""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message: third-party errors can run to pages."""
    return (str(error).strip().splitlines() or [""])[0]


def report_errors(fn: F) -> F:
    """Run an entry point, turning our errors into a message and an exit status."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None
        except RunError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_RUN_FAILED) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_INTERRUPTED) from None
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            print(f"error: {out_of_memory_message(e)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_RUN_FAILED) from None

    return wrapper  # type: ignore[return-value]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA running out of device memory (at compile or at run time)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def out_of_memory_message(error: BaseException) -> str:
    """One line: what XLA could not allocate, and the knobs that need less memory."""
    import re

    found = re.search(r"allocating (\d+) bytes", str(error))
    needed = f"could not allocate {int(found.group(1)) / 2**30:.1f} GiB" if found else first_line(error)
    return (
        f"out of device memory ({needed}); need less per device: lower train.batch_size (train.grad_accum_steps "
        "keeps the global batch), recompute activations with model.remat=full (language models), or split the "
        "model over more devices with sharding.mesh"
    )


def run_app(app: Any) -> None:
    """Run a Typer app; a usage error (unknown option, bad option value, missing
    argument) is one `error:` line and exit 2 like every other bad input."""
    from typer import Abort

    try:
        from typer._click.exceptions import ClickException  # newer Typer vendors Click
    except ImportError:
        from click.exceptions import ClickException

    try:
        code = app(standalone_mode=False)
    except ClickException as e:
        name = e.ctx.command_path if getattr(e, "ctx", None) is not None else "the command"
        print(f"error: {e.format_message()} (see {name} --help)", file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
    except Abort:
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    raise SystemExit(code if isinstance(code, int) else 0)
