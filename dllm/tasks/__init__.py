"""Synthetic tasks with checkable answers: ``get("arith").examples("test", 100)``, ``task.score(ex, text)``.

Tasks: ``arith`` (GSM8K-shaped word problems); ``listops`` = uniform mixture of ``copy``, ``reverse``,
``sort``, ``insert``, ``remove``, ``replace``; ``parallel`` = uniform mixture of the parallel-sensitive
``shuffle`` and ``pick``. Every prompt ends with a newline; train on ``prompt + target + EOS``.
Examples drawn from a mixture carry their sub-task's name in ``Example.task``. The tasks are found by name in
one :class:`~dllm.core.registry.Registry` (``TASKS``); the bundled models' tokenizer is built from their words
(:mod:`dllm.tasks.tokenizer`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dllm.core.registry import Registry
from dllm.tasks.arith import Arith, extract_answer
from dllm.tasks.base import Example, Mixture, Task, parse_int_list, problem_key, split_of
from dllm.tasks.lists import Copy, Insert, Pick, Remove, Replace, Reverse, Shuffle, Sort

__all__ = [
    "Example",
    "Task",
    "get",
    "names",
    "export_jsonl",
    "load_jsonl",
    "extract_answer",
    "parse_int_list",
    "problem_key",
    "split_of",
    "words",
]

_LIST_OPS = [Copy(), Reverse(), Sort(), Insert(), Remove(), Replace()]
_PARALLEL = [Shuffle(), Pick()]
TASKS = Registry("task", hint=" (dllm bench --list-tasks describes them)")
for _task in [
    Arith(),
    Mixture("listops", "uniform mixture of copy, reverse, sort, insert, remove, replace", _LIST_OPS),
    *_LIST_OPS,
    Mixture("parallel", "uniform mixture of the parallel-sensitive shuffle and pick", _PARALLEL),
    *_PARALLEL,
]:
    TASKS.register(_task)


def names() -> list[str]:
    return TASKS.names()


def get(name: str) -> Task:
    """The task called ``name``; a :class:`~dllm.core.errors.ConfigError` naming the known ones otherwise."""
    return TASKS.get(name)


def export_jsonl(task: Task | str, path, n: int, seed: int = 0, split: str = "test") -> Path:
    """Write ``n`` examples of ``split`` as JSON lines (task, prompt, target, answer, meta); returns the path.

    For lm-eval: ``doc_to_text: "{{prompt}}"``, ``doc_to_target: "{{target}}"``; score with this module.
    """
    task = get(task) if isinstance(task, str) else task
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ex in task.examples(split, n, seed):
            f.write(json.dumps(ex.to_dict(), ensure_ascii=False) + "\n")
    return path


def load_jsonl(path) -> list[Example]:
    with Path(path).open(encoding="utf-8") as f:
        return [Example.from_dict(json.loads(line)) for line in f if line.strip()]


def words() -> list[str]:
    """Every word (run of letters) any task can emit, sorted: the tokenizer's word vocabulary."""
    found = set()
    for _, task in TASKS.items():
        for text in task.texts():
            found.update(re.findall(r"[A-Za-z]+", re.sub(r"\{[^}]*\}", " ", text)))
    return sorted(found)
