"""A small preference dataset for DPO, written locally: short, direct answers preferred to padded ones.

    python examples/preferences.py data/prefs        # data/prefs/train.jsonl (160 pairs), test.jsonl (40)
    nnx-train configs/dpo_lora.yaml                  # reads data/prefs

Each row is a pair in TRL's conversational form: the prompt is a user turn, `chosen` and `rejected` are the
assistant's turn. The chosen answer says the fact in one sentence; the rejected one says the same fact wrapped
in filler. The test split asks about facts the training split never shows, so a model that learnt the
preference (and not the facts) prefers the short answers there too.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Chile", "Santiago"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Ghana", "Accra"), ("Cuba", "Havana"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Iran", "Tehran"),
            ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Hungary", "Budapest"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki")]  # fmt: skip
COLOURS = [("the sky on a clear day", "blue"), ("fresh grass", "green"), ("a ripe banana", "yellow"),
           ("snow", "white"), ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"),
           ("a lemon", "yellow"), ("a raven", "black"), ("milk", "white")]  # fmt: skip
FILLERS = [
    "What a wonderful question, and one that many people ask! Let me think about it carefully before I answer. {}"
    " I hope this helps, and please let me know if there is anything else at all you would like to know!",
    "Great question! There are many ways to look at this, and it is worth taking a moment to consider them. "
    "After all that, the answer is simple: {} Feel free to ask me more questions any time.",
    "Thank you so much for asking. As an assistant I always try to be as thorough as possible, so here is my "
    "detailed answer. {} That is the answer, in short, though I could say much more about it.",
]


def facts() -> list[tuple[str, str]]:
    out = []
    for country, capital in CAPITALS:
        out.append((f"What is the capital of {country}?", f"The capital of {country} is {capital}."))
    for thing, colour in COLOURS:
        out.append((f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {colour}."))
    for a, b in [(2, 3), (4, 5), (7, 6), (9, 8), (12, 5), (15, 15), (21, 13), (30, 12), (8, 8), (11, 19)]:
        out.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    for a, b in [(3, 4), (6, 7), (9, 9), (5, 8), (12, 3), (7, 7), (4, 11), (8, 6), (2, 13), (10, 10)]:
        out.append((f"What is {a} times {b}?", f"{a} times {b} is {a * b}."))
    return out


def pair(question: str, answer: str, rng: random.Random) -> dict:
    user = [{"role": "user", "content": question}]
    return {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": rng.choice(FILLERS).format(answer)}],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="data/prefs", help="directory for train.jsonl and test.jsonl")
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    all_facts = facts()
    rng.shuffle(all_facts)
    held_out, seen = all_facts[:10], all_facts[10:]
    train = [pair(q, a, rng) for q, a in seen for _ in range(4)]  # each fact with several fillers
    test = [pair(q, a, rng) for q, a in held_out for _ in range(4)]
    rng.shuffle(train)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}/train.jsonl ({len(train)} pairs) and {out}/test.jsonl ({len(test)} pairs)")
    return {"train": train, "test": test}


if __name__ == "__main__":
    main()
