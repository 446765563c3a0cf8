"""Reward functions for `grpo`: the user's own, imported by name, and three built in; how they are called and checked.

A reward function scores completions (spec posttrain.md)::

    def correct(prompts, completions, answer, **columns) -> list[float | None]:
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

`prompts[i]` is the prompt of `completions[i]` (its text, or its list of
messages for chat prompts), `completions[i]` the decoded text without the
prompt and without the end token, and every other column of the prompt rows
comes by name as a list aligned with them (`answer` above). It returns one
float per completion, or None where it has no opinion (left out of that
function's mean, and a completion that every function leaves out gets no
advantage).

`objective.rewards` names them: `module.function` (or `module:function`) is
imported from the current directory first, like every other plug-in; a
built-in reward is its name, or a mapping with its options::

    rewards: [my_rewards.correct, {name: regex, pattern: '^\\d+$'}, {name: math_answer, column: solution}]

- `exact_match` (`column`, default `answer`): 1.0 when the completion, stripped, is the column's text.
- `regex` (`pattern`): 1.0 when `re.search(pattern, completion)` finds it.
- `math_answer` (`column`, default `answer`): 1.0 when the completion's final answer (the last `\\boxed{...}`,
  else the number or text after the last `####`, "answer is" or "answer:", else the last number) equals the
  column's, compared as numbers when both read as numbers (`1,000`, `0.5`, `\\frac{1}{2}`, `50%`), else as
  text without spaces and `$`.

Each is logged as `reward/NAME`: a function's own name, a built-in's name, or the `label` a mapping gives.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from nnx_cli.config.objective import FLOAT32_MAX
from nnx_cli.errors import UserError, did_you_mean, first_line

_KEY = "objective.rewards"


# Built-in rewards
# ------------------------------------------------------------------------------


def _text(completion: Any) -> str:
    """A completion's text: itself, or the content of its last message."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_match(column: str = "answer") -> Callable[..., list[float | None]]:
    """1.0 where the completion, stripped, is the text of `column` (stripped), else 0.0; None without a value."""

    def score(prompts: list, completions: list, **columns: Any) -> list[float | None]:
        references = _column(columns, column, "exact_match")
        return [
            None if r is None else float(_text(c).strip() == str(r).strip()) for c, r in zip(completions, references)
        ]

    return score


def regex(pattern: str) -> Callable[..., list[float | None]]:
    """1.0 where `re.search(pattern, completion)` finds a match, else 0.0."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"regex pattern {pattern!r} does not compile: {e}") from None  # named with its entry

    def score(prompts: list, completions: list, **columns: Any) -> list[float | None]:
        return [float(compiled.search(_text(c)) is not None) for c in completions]

    return score


def math_answer(column: str = "answer") -> Callable[..., list[float | None]]:
    """1.0 where the completion's final answer equals the one in `column` (see :func:`final_answer` and
    :func:`same_answer`), else 0.0; None without a value."""

    def score(prompts: list, completions: list, **columns: Any) -> list[float | None]:
        references = _column(columns, column, "math_answer")
        return [
            None if r is None else float(same_answer(final_answer(_text(c)), final_answer(str(r))))
            for c, r in zip(completions, references)
        ]

    return score


def _column(columns: dict[str, Any], name: str, reward: str) -> list[Any]:
    if name not in columns:
        raise ValueError(
            f"the prompt rows have no column {name!r} to compare with{did_you_mean(name, list(columns))}; columns: "
            f"{', '.join(columns) or 'none'} (set {{name: {reward}, column: ...}})"
        )
    return columns[name]


BUILT_IN: dict[str, Callable[..., Callable[..., list[float | None]]]] = {
    "exact_match": exact_match,
    "regex": regex,
    "math_answer": math_answer,
}


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MARKER = re.compile(r"####|answer\s+is\b|answer\s*:", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+%?")


def final_answer(text: str) -> str:
    """The final answer a solution gives: its last `\\boxed{...}`, else what follows the last of its `####`,
    "answer is" and "answer:" (in any case; a number there is the answer, whatever words follow it), else its
    last number, else the whole text::

        final_answer("so x = \\\\boxed{\\\\frac{1}{2}}.")      # '\\\\frac{1}{2}'
        final_answer("She pays 3 * 4 = 12 dollars. #### 12")  # '12'
        final_answer("The answer is: **12** apples.")         # '12'
        final_answer("I count 7 apples and 5 pears")           # '5'
    """
    boxed = list(_BOXED.finditer(text))
    if boxed:
        start = boxed[-1].end()
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        return text[start : i - 1] if depth == 0 else text[start:]
    markers = list(_MARKER.finditer(text))
    if markers:
        rest = text[markers[-1].end() :].lstrip(" \t:*_$").split("\n", 1)[0]
        number = _NUMBER.match(rest)
        return number.group().rstrip(",") if number else rest.strip().rstrip(".").strip(" *_")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def _as_number(text: str) -> Fraction | None:
    """`text` as an exact number when it reads as one: `1,000`, `-2.5`, `3/4`, `\\frac{3}{4}`, `50%`, `$12`."""
    t = re.sub(r"\\(?:text|mathrm|textbf)\s*\{([^{}]*)\}", r"\1", text)
    t = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", t)
    t = t.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "").replace(" ", "")
    t = t.replace("\\left", "").replace("\\right", "").rstrip(".")
    percent = t.endswith("%") or t.endswith("\\%")
    t = t.removesuffix("\\%").removesuffix("%")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    parts = re.fullmatch(r"\(?(-?[\d.]+)\)?(?:/\(?(-?[\d.]+)\)?)?", t)
    if parts is None:
        return None
    try:
        value = Fraction(parts[1]) / (Fraction(parts[2]) if parts[2] else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def same_answer(a: str, b: str) -> bool:
    """Whether two final answers agree: as numbers when both read as numbers, else as text without spaces, `$`
    and a trailing period, case ignored."""
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return x == y

    def plain(t: str) -> str:
        return re.sub(r"\s+|\\?\$", "", t).rstrip(".").lower()

    return plain(a) == plain(b)


# Loading and calling
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reward:
    """A loaded reward function: `name` (as logged, `reward/NAME`), what the config called it, and the function."""

    name: str
    source: str
    fn: Callable[..., Any]
    reads: tuple[str, ...] = ()
    """The columns it cannot do without: a built-in's `column`, a function's parameters without a default."""
    takes: frozenset[str] | None = None
    """The keyword arguments it accepts; None: any (`**columns`, or a signature that cannot be read)."""


def load(entries: Sequence[str | dict[str, Any]]) -> list[Reward]:
    """The reward functions `objective.rewards` names, imported and checked; a UserError naming the entry
    otherwise. Two rewards logged under one name are an error too (a mapping's `label` tells them apart)."""
    out = [_load_one(entry, i) for i, entry in enumerate(entries)]
    names = [r.name for r in out]
    for name in names:
        if names.count(name) > 1:
            raise UserError(
                f"config key {_KEY!r}: two rewards are logged as reward/{name}; give a mapping a label, e.g. "
                f"{{name: regex, pattern: ..., label: {name}_2}}"
            )
    return out


def _load_one(entry: str | dict[str, Any], index: int) -> Reward:
    where = f"{_KEY}[{index}]"
    options: dict[str, Any] = {}
    label = None
    if isinstance(entry, dict):
        options = dict(entry)
        name = options.pop("name", None)
        label = options.pop("label", None)
        if not isinstance(name, str):
            raise UserError(f"config key {where!r}: a reward mapping needs a name, e.g. {{name: regex, pattern: ...}}")
        if label is not None and not isinstance(label, str):
            raise UserError(f"config key '{where}.label' must be a string, got {label!r}")
    else:
        name = entry
    if name in BUILT_IN:
        factory = BUILT_IN[name]
        parameters = inspect.signature(factory).parameters
        known = list(parameters)
        for key in options:
            if key not in known:
                raise UserError(
                    f"unknown config key '{where}.{key}' for the built-in reward {name}"
                    f"{did_you_mean(key, known, where + '.')}; it takes {', '.join(known)}, and label"
                )
        try:
            fn = factory(**options)
        except (TypeError, ValueError) as e:
            raise UserError(f"config key {where!r}: built-in reward {name}: {e}") from None
        column = options.get("column", parameters["column"].default) if "column" in parameters else None
        if "column" in parameters and not isinstance(column, str):  # it failed at the first step, named the reward
            raise UserError(
                f"config key '{where}.column' must be the name of a column of the prompt rows, got {column!r}"
            )
        return Reward(label or name, name, fn, reads=(column,) if isinstance(column, str) else ())
    if options:
        raise UserError(
            f"config key {where!r}: options ({', '.join(options)}) are for the built-in rewards "
            f"({', '.join(BUILT_IN)}); {name!r} takes none"
        )
    reference = _reference(name, where)
    from nnx_cli.registry import load_reference

    fn = load_reference(reference, where, shown=name)
    if not callable(fn):
        raise UserError(f"config key {where!r}: {name!r} is a {type(fn).__name__}, not a function")
    return Reward(label or reference.rpartition(":")[2].rpartition(".")[2], name, fn, *_parameters(fn, name, where))


def _parameters(fn: Callable[..., Any], name: str, where: str) -> tuple[tuple[str, ...], frozenset[str] | None]:
    """`(reads, takes)` of a user's function: what :func:`check_columns` checks the prompt rows against."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or an object whose signature Python cannot read: checked when called
        return (), None
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:  # it failed at the first step, after the model had loaded
        raise UserError(
            f"config key {where!r}: reward function {name!r} takes {', '.join(positional)} by position only (before "
            "a /); every reward is called with prompts, completions and the prompt rows' columns by name"
        )
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    reads = tuple(p.name for p in named if p.default is p.empty and p.name not in ("prompts", "completions"))
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return reads, None
    return reads, frozenset(p.name for p in named)


def check_columns(rewards: Sequence[Reward], columns: Sequence[str], source: str) -> None:
    """Whether each reward can be called with the prompt rows' `columns` (every column but the prompt, by name,
    beside `prompts` and `completions`): a column it reads that the rows lack, or a column it takes no parameter
    for, is a UserError naming the reward before the run starts (it was found at the first step, after the model
    had loaded)."""
    passed = ["prompts", "completions", *columns]
    listed = ", ".join(columns) or "none besides the prompt"
    clash = [name for name in columns if name in ("prompts", "completions")]
    if clash:  # every reward failed at the first step: "got multiple values for keyword argument"
        raise UserError(
            f"the prompt rows of {source!r} have a column {clash[0]!r}, the name of what every reward function is "
            "given besides the columns; rename that column"
        )
    for index, reward in enumerate(rewards):
        where = f"{_KEY}[{index}]"
        for name in reward.reads:
            if name not in columns:
                fix = f" (set {{name: {reward.source}, column: ...}})" if reward.source in BUILT_IN else ""
                raise UserError(
                    f"config key {where!r}: reward {reward.source!r} reads a column {name!r} that the prompt rows of "
                    f"{source!r} lack{did_you_mean(name, columns)}; their columns: {listed}{fix}"
                )
        unexpected = [name for name in passed if reward.takes is not None and name not in reward.takes]
        if unexpected:
            raise UserError(
                f"config key {where!r}: reward function {reward.source!r} has no parameter {unexpected[0]!r}, and "
                f"every reward is called with prompts, completions and each column of the prompt rows by name "
                f"({listed}); add **columns to its parameters"
            )


def _reference(name: str, where: str) -> str:
    """`module.function` or `module:function` as `module:function`."""
    if ":" in name:
        return name
    module, dot, attr = name.rpartition(".")
    if not dot or not module or not attr:
        raise UserError(
            f"config key {where!r}: unknown reward {name!r}{did_you_mean(name, list(BUILT_IN))}; built in: "
            f"{', '.join(BUILT_IN)}, or module.function for your own (imported from the current directory)"
        )
    return f"{module}:{attr}"


def score(rewards: Sequence[Reward], prompts: list[Any], completions: list[str], columns: dict[str, list[Any]],
          when: str) -> np.ndarray:  # fmt: skip
    """Each function's rewards of the completions, float32 `[N, F]`, NaN where it returned None.

    A function that raises, or returns anything but one number or None per completion, is a UserError naming
    it, what it did and `when` (e.g. "at step 12")."""
    out = np.full((len(completions), len(rewards)), np.nan, np.float32)
    for j, reward in enumerate(rewards):
        try:
            values = reward.fn(prompts=prompts, completions=completions, **columns)
        except UserError:
            raise
        except SystemExit as e:  # it ended the run with its own code and no word, the step's checkpoint unsaved
            raise UserError(
                f"reward function {reward.source!r} called sys.exit({e.code!r}) {when} (scoring {len(completions)} "
                "completions); a reward function returns its scores, or raises to stop the run"
            ) from None
        except Exception as e:
            raise UserError(
                f"reward function {reward.source!r} raised {type(e).__name__}: {first_line(e)} {when} (scoring "
                f"{len(completions)} completions)"
            ) from None
        try:
            count = len(values)
        except TypeError:
            count = None
        if count != len(completions) or isinstance(values, (str, bytes, dict)):
            counted = count is not None and not isinstance(values, (str, bytes))
            got = f"{count} value{'s' * (count != 1)}" if counted else repr(values)[:60]
            raise UserError(
                f"reward function {reward.source!r} returned {got} for {len(completions)} completions {when}; it "
                "must return a list of one number (or None) per completion"
            )
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or not _is_number(value):
                raise UserError(
                    f"reward function {reward.source!r} returned {value!r} ({type(value).__name__}) for completion "
                    f"{i} {when}; it must return a number (or None) per completion"
                )
            try:
                number, shown = float(value), None
            except OverflowError:  # an int (or Fraction) past any float: an OverflowError traceback
                number, shown = math.inf, f"{str(value)[:12]}... ({len(str(value))} digits)"
            if not abs(number) <= FLOAT32_MAX:  # NaN is not None: a 0 / 0 would silently leave every completion
                raise UserError(  # unscored; and beyond float32's range a reward became inf in the advantages
                    f"reward function {reward.source!r} returned {shown or number} for completion {i} {when}; a reward "
                    "must be a finite number within float32's range (about 3.4e38), or None to leave that completion "
                    "unscored"
                )
            out[i, j] = number
    return out


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except OverflowError:  # an int (or Fraction) past any float: a number, out of range
        return True
    except (TypeError, ValueError):
        return False
    return np.ndim(value) == 0
