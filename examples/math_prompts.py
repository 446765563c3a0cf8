"""A small local dataset of arithmetic questions for GRPO, and a reward module of one's own beside it.

    python examples/math_prompts.py data/math      # data/math/train.jsonl (200 prompts), test.jsonl (40), my_rewards.py
    nnx-train configs/grpo_lora.yaml                # rewards: math_answer (built in) and my_rewards.short

Each row is a chat prompt and the answer a reward checks it against, in the form `data.format: prompt` reads:
the prompt a user turn, every other column (`answer` here) handed to the reward functions by name::

    {"prompt": [{"role": "user", "content": "What is 17 plus 25? ..."}], "answer": "42"}

The test split asks about pairs of numbers the training split never shows. The reward module is written to the
current directory (`--rewards` moves it), where `nnx-train` imports `my_rewards.short` from: a reward is any
function `(prompts, completions, **columns) -> one float (or None) per completion`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REWARDS = '''"""Rewards of one's own for GRPO (configs/grpo_lora.yaml), imported from the current directory."""


def short(prompts, completions, **columns):
    """1.0 for an answer said in at most 12 words, falling to 0.0 at 60: the question asks for a short answer."""
    return [min(1.0, max(0.0, (60 - len(c.split())) / 48)) for c in completions]


def correct(prompts, completions, answer, **columns):
    """1.0 when the completion's last number is the answer, else 0.0 (math_answer, built in, also reads
    \\\\boxed{...}, fractions and "the answer is")."""
    last = [next((w.strip(".,!") for w in reversed(c.split()) if w.strip(".,!").lstrip("-").isdigit()), None)
            for c in completions]  # fmt: skip
    return [1.0 if x == a else 0.0 for x, a in zip(last, answer)]
'''
OPERATIONS = [("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b)]


def question(a: int, b: int, rng: random.Random) -> dict:
    word, fn = rng.choice(OPERATIONS)
    text = f"What is {a} {word} {b}? Think briefly, then give the final answer as a number."
    return {"prompt": [{"role": "user", "content": text}], "answer": str(fn(a, b))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="data/math", help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--rewards", type=Path, default=Path("my_rewards.py"), help="where the reward module goes")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    pairs = rng.sample([(a, b) for a in range(2, 50) for b in range(2, 20)], 240)
    train = [question(a, b, rng) for a, b in pairs[:200]]
    test = [question(a, b, rng) for a, b in pairs[200:]]
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args.rewards.write_text(REWARDS)
    print(f"wrote {out}/train.jsonl ({len(train)} prompts), {out}/test.jsonl ({len(test)}) and {args.rewards}")
    return {"train": train, "test": test, "rewards": args.rewards}


if __name__ == "__main__":
    main()
