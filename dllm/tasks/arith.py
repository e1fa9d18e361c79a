"""Multi-step arithmetic word problems in GSM8K's shape, small enough for a tiny model to learn.

Prompt: a short story, one sentence per operation, and a question::

    Tom has 5 apples. He buys 3 more. He gives half of them to Ann. How many apples does Tom have now?

Target: one worked step per line, each ONE small operation, then the final line::

    5 + 3 = 8
    8 / 2 = 4
    The answer is 4.

Numbers stay small (start 2-15, add/subtract 1-9, double, triple, halve; every value 1-30), so each
step is a fact from a table of a few hundred entries. The canonical problem (``meta``) is the start
value and the operations; names, items and verbs are surface wording and do not define the split.
Answer extraction follows lm-eval's GSM8K chain-of-thought task: the number after "The answer is",
else the last number in the completion; "," "$" and a trailing "." are ignored.
"""

from __future__ import annotations

import random
import re

from dllm.tasks.base import SPLITS, Example, Task, problem_key, split_of

NAMES = [
    ("Tom", "He"),
    ("Ann", "She"),
    ("Sam", "He"),
    ("Mia", "She"),
    ("Ben", "He"),
    ("Lily", "She"),
    ("Max", "He"),
    ("Zoe", "She"),
    ("Leo", "He"),
    ("Eva", "She"),
]
ITEMS = ["apples", "pens", "coins", "books", "cards", "eggs", "stickers", "marbles", "cookies", "shells"]
START = "{name} has {n} {items}."
QUESTION = "How many {items} does {name} have now?"
VERBS = {
    "+": ["{P} buys {n} more.", "{P} finds {n} more.", "{P} gets {n} more from {other}."],
    "-": ["{P} gives {n} to {other}.", "{P} loses {n}.", "{P} sells {n}."],
    "*2": ["{P} doubles them."],
    "*3": ["{P} triples them."],
    "/2": ["{P} gives half of them to {other}."],
}
ANSWER_LINE = "The answer is {n}."

MAX_VALUE = 30  # every intermediate value and the answer lie in [1, MAX_VALUE]
START_RANGE = (2, 15)
STEP_RANGE = (1, 9)  # added / subtracted amounts
OPS_RANGE = (2, 3)  # operations per problem

_STRICT = re.compile(r"The answer is (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def _normalize(s: str) -> str:
    s = s.replace(",", "").replace("$", "")
    return re.sub(r"\.$", "", s).strip()


def extract_answer(completion: str, strict: bool = False) -> str | None:
    """lm-eval GSM8K-style extraction: first "The answer is N", else (unless strict) the last number."""
    m = _STRICT.search(completion)
    if m:
        return _normalize(m.group(1))
    if strict:
        return None
    matches = _FLEXIBLE.findall(completion)
    if not matches:
        return None
    return _normalize(next(g for g in matches[-1] if g))


def apply(op: str, x: int, n: int) -> int:
    if op == "+":
        return x + n
    if op == "-":
        return x - n
    if op == "*":
        return x * n
    if op == "/":
        assert x % n == 0
        return x // n
    raise ValueError(f"unknown operation {op!r}")


def _legal_ops(x: int) -> list[tuple[str, list[int]]]:
    """(operation, allowed operands) possible from value ``x`` keeping every value in [1, MAX_VALUE]."""
    lo, hi = STEP_RANGE
    ops = []
    if x + lo <= MAX_VALUE:
        ops.append(("+", list(range(lo, min(hi, MAX_VALUE - x) + 1))))
    if x - lo >= 1:
        ops.append(("-", list(range(lo, min(hi, x - 1) + 1))))
    mults = [m for m in (2, 3) if x * m <= MAX_VALUE]
    if mults:
        ops.append(("*", mults))
    if x % 2 == 0:
        ops.append(("/", [2]))
    return ops


class Arith(Task):
    name = "arith"
    max_new_tokens = 32
    description = "2-3 step arithmetic word problems (GSM8K shape: story, one operation per line, 'The answer is N.')"

    def draw(self, rng: random.Random) -> Example:
        x = rng.randint(*START_RANGE)
        start = x
        steps = []
        for _ in range(rng.randint(*OPS_RANGE)):
            op, operands = rng.choice(_legal_ops(x))
            n = rng.choice(operands)
            steps.append([op, n])
            x = apply(op, x, n)
        (name, pronoun), items = rng.choice(NAMES), rng.choice(ITEMS)
        other = rng.choice([nm for nm, _ in NAMES if nm != name])
        sentences = [START.format(name=name, n=start, items=items)]
        lines = []
        value = start
        for op, n in steps:
            verb_key = op if op in "+-" else f"{op}{n}"
            sentences.append(rng.choice(VERBS[verb_key]).format(P=pronoun, n=n, other=other))
            new = apply(op, value, n)
            lines.append(f"{value} {op} {n} = {new}")
            value = new
        sentences.append(QUESTION.format(items=items, name=name))
        lines.append(ANSWER_LINE.format(n=value))
        return Example(
            task=self.name,
            prompt=" ".join(sentences) + "\n",
            target="\n".join(lines),
            answer=str(value),
            meta={"start": start, "ops": steps},
        )

    def score(self, example: Example, completion: str) -> bool:
        return extract_answer(completion) == example.answer

    def size(self, split: str) -> int:
        """Distinct problems (start value and operations; the wording is not part of a problem) in ``split``:
        ``SIZES``, which ``count_problems()`` recomputes (a test keeps them equal)."""
        return SIZES[split]

    def texts(self) -> list[str]:
        verbs = [v for vs in VERBS.values() for v in vs]
        return [START, QUESTION, ANSWER_LINE, *verbs, *ITEMS] + [w for pair in NAMES for w in pair]


# Distinct problems per split, as count_problems() finds them (kept as constants: counting takes seconds).
SIZES = {"train": 58928, "test": 19548}


def count_problems() -> dict[str, int]:
    """Every problem ``Arith.draw`` can produce (about 78,000), counted per split."""
    counts = dict.fromkeys(SPLITS, 0)

    def walk(start: int, x: int, steps: list, left: int):
        if left == 0:
            counts[split_of(problem_key(Example("arith", "", "", "", {"start": start, "ops": steps})))] += 1
            return
        for op, operands in _legal_ops(x):
            for n in operands:
                walk(start, apply(op, x, n), [*steps, [op, n]], left - 1)

    for start in range(START_RANGE[0], START_RANGE[1] + 1):
        for count in range(OPS_RANGE[0], OPS_RANGE[1] + 1):
            walk(start, start, [], count)
    return counts
