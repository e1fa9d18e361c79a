"""The task interface: seeded example generators with disjoint train/test splits and exact scorers.

A task draws a *problem* (its canonical parameters, stored in ``Example.meta``) plus a surface form
(prompt text, reference completion). The split of a problem is a pure function of its canonical key
(``problem_key``), so train and test never share a problem however many examples are drawn, and a
problem lands in the same split in a sub-task (``reverse``) and in a mixture that contains it
(``listops``).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field

from dllm.core.errors import ConfigError

SPLITS = ("train", "test")
TEST_MODULUS = 4  # one canonical problem in four belongs to the test split

_INT_LIST = re.compile(r"(?:0|[1-9][0-9]*)(?: (?:0|[1-9][0-9]*))*")


@dataclass(frozen=True)
class Example:
    """One problem. ``prompt`` + ``target`` is the training text; ``answer`` is what scoring checks."""

    task: str  # name of the (sub-)task that drew it; ``get(task).score`` scores it
    prompt: str  # plain text given to the model, ends with a newline
    target: str  # full reference completion (worked steps + final line for arithmetic)
    answer: str  # canonical answer ("42", "3 1 2"); for shuffle/pick one valid answer among many
    meta: dict = field(default_factory=dict, hash=False)  # canonical problem parameters (JSON-serialisable)

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "prompt": self.prompt,
            "target": self.target,
            "answer": self.answer,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Example:
        return cls(task=d["task"], prompt=d["prompt"], target=d["target"], answer=d["answer"], meta=d.get("meta", {}))


def problem_key(example: Example) -> str:
    """Canonical identity of the problem behind an example (surface wording and reference choice excluded)."""
    return example.task + "|" + json.dumps(example.meta, sort_keys=True, separators=(",", ":"))


def split_of(key: str) -> str:
    """``"test"`` for one key in ``TEST_MODULUS`` (by SHA-256), else ``"train"``."""
    digest = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16)
    return "test" if digest % TEST_MODULUS == 0 else "train"


def parse_int_list(text: str) -> list[int] | None:
    """Integers separated by single spaces (no leading zeros), trailing whitespace allowed; else None."""
    text = text.rstrip()
    if not _INT_LIST.fullmatch(text):
        return None
    return [int(t) for t in text.split(" ")]


def format_list(items) -> str:
    return " ".join(str(int(x)) for x in items)


class Task:
    """Base class. Subclasses implement ``draw(rng) -> Example`` (any split) and ``score``."""

    name: str = ""
    description: str = ""
    max_new_tokens: int = 16  # generation length that holds every target + EOS with the bench tokenizer

    def draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def score(self, example: Example, completion: str) -> bool:
        raise NotImplementedError

    def texts(self) -> list[str]:
        """Every fixed string the generator can emit besides digits (for building the tokenizer vocabulary)."""
        return []

    def size(self, split: str) -> int | None:
        """How many distinct problems ``split`` holds: the most test examples :meth:`examples` can give.
        None: more than any run asks for (the list tasks have billions)."""
        return None

    def examples(self, split: str, n: int, seed: int = 0) -> list[Example]:
        """``n`` examples of ``split``, deterministic in ``(name, split, seed)``.

        A longer request extends a shorter one (same prefix). Test examples are distinct problems;
        train examples may repeat a problem (with other wording), so any ``n`` can be drawn.
        """
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        if n < 0:
            raise ConfigError(f"n must be >= 0, got {n}")
        rng = random.Random(f"dllm.bench/{self.name}/{split}/{seed}")
        out: list[Example] = []
        seen: set[str] = set()
        size = self.size(split) if split == "test" else None
        if size is not None and n > size:
            raise ConfigError(f"task {self.name!r} has {size} distinct {split} problems; ask for at most {size}")
        budget = 1000 + 100 * n
        while len(out) < n:
            budget -= 1
            if budget < 0:
                raise ConfigError(
                    f"task {self.name!r} gave only {len(out)} distinct {split} problems in {1000 + 100 * n} draws "
                    f"(its rarest problems are seldom drawn); ask for at most {len(out)} examples"
                )
            ex = self.draw(rng)
            key = problem_key(ex)
            if split_of(key) != split:
                continue
            if split == "test":
                if key in seen:
                    continue
                seen.add(key)
            out.append(ex)
        return out

    def __repr__(self) -> str:
        return f"<Task {self.name}: {self.description}>"


class Mixture(Task):
    """Uniform mixture of sub-tasks; each example keeps its sub-task's name (per-op breakdowns for free)."""

    def __init__(self, name: str, description: str, parts: list[Task]):
        self.name = name
        self.description = description
        self.parts = {p.name: p for p in parts}

    def draw(self, rng: random.Random) -> Example:
        return rng.choice(list(self.parts.values())).draw(rng)

    def score(self, example: Example, completion: str) -> bool:
        part = self.parts.get(example.task)
        if part is None:
            raise ConfigError(f"example of task {example.task!r} is not part of mixture {self.name!r}")
        return part.score(example, completion)

    def texts(self) -> list[str]:
        return [t for p in self.parts.values() for t in p.texts()]

    def size(self, split: str) -> int | None:
        sizes = [p.size(split) for p in self.parts.values()]
        return None if None in sizes else sum(sizes)
