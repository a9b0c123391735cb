"""Write ``examples/data/instructions.jsonl``: short synthetic instruction/response pairs.

    python examples/data/make_data.py            # rewrites instructions.jsonl next to this script

Every row is generated here from templates and small word lists written for this repository
(no third-party text); the output is released under CC0 1.0 (see ``examples/data/README.md``).

The tasks are chosen so that a tiny model visibly learns within a minute of CPU training:
most of each response repeats words of its instruction in a fixed template, and the rest is a
small lookup (one-digit sums, the next weekday or month, an opposite) or a simple pattern
(counting, repeating a word).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
OPPOSITES = [
    ("hot", "cold"),
    ("big", "small"),
    ("fast", "slow"),
    ("up", "down"),
    ("day", "night"),
    ("open", "closed"),
    ("light", "dark"),
    ("early", "late"),
    ("full", "empty"),
    ("hard", "soft"),
    ("old", "new"),
    ("wet", "dry"),
    ("high", "low"),
    ("near", "far"),
    ("loud", "quiet"),
    ("thick", "thin"),
    ("strong", "weak"),
    ("rich", "poor"),
    ("happy", "sad"),
    ("first", "last"),
]
WORDS = [
    "apple",
    "river",
    "cloud",
    "stone",
    "tiger",
    "lemon",
    "robot",
    "piano",
    "candle",
    "forest",
    "rocket",
    "garden",
    "silver",
    "window",
    "pencil",
    "orange",
    "castle",
    "bridge",
    "mango",
    "violet",
    "planet",
    "basket",
    "dragon",
    "button",
    "ladder",
    "marble",
    "needle",
    "parrot",
    "saddle",
    "tunnel",
]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def sums() -> list[dict]:
    return [
        {"instruction": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
        for a in range(10)
        for b in range(10)
    ]


def counting() -> list[dict]:
    rows = []
    for start in range(1, 31):
        for length in (3, 4, 5, 6):
            end = start + length - 1
            rows.append(
                {
                    "instruction": f"Count from {start} to {end}.",
                    "response": ", ".join(str(n) for n in range(start, end + 1)) + ".",
                }
            )
    return rows


def repeats() -> list[dict]:
    rows = []
    for word in WORDS:
        for times in (2, 3, 4):
            rows.append(
                {"instruction": f"Say {word} {NUMBER_WORDS[times]} times.", "response": " ".join([word] * times) + "."}
            )
    return rows


def calendar() -> list[dict]:
    rows = []
    for names, kind in ((DAYS, "day"), (MONTHS, "month")):
        for i, name in enumerate(names):
            after, before = names[(i + 1) % len(names)], names[i - 1]
            rows.append(
                {"instruction": f"Which {kind} comes after {name}?", "response": f"The {kind} after {name} is {after}."}
            )
            rows.append(
                {
                    "instruction": f"Which {kind} comes before {name}?",
                    "response": f"The {kind} before {name} is {before}.",
                }
            )
    return rows


def opposites() -> list[dict]:
    rows = []
    for a, b in OPPOSITES:
        for x, y in ((a, b), (b, a)):
            rows.append({"instruction": f"What is the opposite of {x}?", "response": f"The opposite of {x} is {y}."})
    return rows


def first_letters() -> list[dict]:
    rows = []
    for word in WORDS:
        rows.append(
            {
                "instruction": f"What is the first letter of {word}?",
                "response": f"The first letter of {word} is {word[0]}.",
            }
        )
    return rows


TASKS = (sums, counting, repeats, calendar, opposites, first_letters)


def generate(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = [row for task in TASKS for row in task()]
    rng.shuffle(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "instructions.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = generate(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
