"""List operations over short lists of small numbers (ParallelBench's "waiting line" tasks, numeric items).

Deterministic operations (exact match on the canonical answer): copy, reverse, sort, and edits at a
1-based position (insert, remove, replace). Parallel-sensitive operations, where many answers are
right but the output tokens depend strongly on each other (ParallelBench's finding: decoding them in
parallel yields duplicates and drops): shuffle (any permutation of the input other than the input
order, as ParallelBench's ``list_shuffle_score``) and pick (k distinct items of the input, any order).

Lists hold 3-6 items in [0, MAX_ITEM] written as "3 17 0 8"; completions must be exactly such a list
(single spaces, no leading zeros), trailing whitespace allowed.
"""

from __future__ import annotations

import random

from dllm.tasks.base import Example, Task, format_list, parse_int_list

MAX_ITEM = 39
LENGTHS = (3, 6)


def _items(rng: random.Random, distinct: bool = False, lengths=LENGTHS) -> list[int]:
    n = rng.randint(*lengths)
    if distinct:
        return rng.sample(range(MAX_ITEM + 1), n)
    return [rng.randint(0, MAX_ITEM) for _ in range(n)]


class _Exact(Task):
    """A list operation with exactly one right answer."""

    prompt_text = ""  # format string, ``{items}`` and parameters

    def problem(self, rng: random.Random) -> dict:
        return {"items": _items(rng)}

    def solve(self, items: list[int], **params) -> list[int]:
        raise NotImplementedError

    def draw(self, rng: random.Random) -> Example:
        meta = self.problem(rng)
        answer = format_list(self.solve(**meta))
        params = {k: v for k, v in meta.items() if k != "items"}
        prompt = self.prompt_text.format(items=format_list(meta["items"]), **params) + "\n"
        return Example(task=self.name, prompt=prompt, target=answer, answer=answer, meta=meta)

    def score(self, example: Example, completion: str) -> bool:
        return completion.rstrip() == example.answer

    def texts(self) -> list[str]:
        return [self.prompt_text]


class Copy(_Exact):
    name = "copy"
    description = "repeat the list unchanged"
    prompt_text = "Copy the list: {items}"

    def solve(self, items):
        return list(items)


class Reverse(_Exact):
    name = "reverse"
    description = "reverse the list"
    prompt_text = "Reverse the list: {items}"

    def solve(self, items):
        return items[::-1]


class Sort(_Exact):
    name = "sort"
    description = "sort the list ascending (duplicates kept)"
    prompt_text = "Sort the list: {items}"

    def solve(self, items):
        return sorted(items)


class Insert(_Exact):
    name = "insert"
    description = "insert a value at a 1-based position"
    prompt_text = "Insert {value} at position {position} in the list: {items}"

    def problem(self, rng):
        items = _items(rng)
        return {"items": items, "position": rng.randint(1, len(items) + 1), "value": rng.randint(0, MAX_ITEM)}

    def solve(self, items, position, value):
        return items[: position - 1] + [value] + items[position - 1 :]


class Remove(_Exact):
    name = "remove"
    description = "remove the item at a 1-based position"
    prompt_text = "Remove the item at position {position} from the list: {items}"

    def problem(self, rng):
        items = _items(rng)
        return {"items": items, "position": rng.randint(1, len(items))}

    def solve(self, items, position):
        return items[: position - 1] + items[position:]


class Replace(_Exact):
    name = "replace"
    description = "replace the item at a 1-based position by a different value"
    prompt_text = "Replace the item at position {position} with {value} in the list: {items}"

    def problem(self, rng):
        items = _items(rng)
        position = rng.randint(1, len(items))
        value = rng.choice([v for v in range(MAX_ITEM + 1) if v != items[position - 1]])
        return {"items": items, "position": position, "value": value}

    def solve(self, items, position, value):
        return items[: position - 1] + [value] + items[position:]


class Shuffle(Task):
    name = "shuffle"
    description = "any reordering of a list of distinct items other than the input order (parallel-sensitive)"
    prompt_text = "Shuffle the list: {items}"

    def draw(self, rng: random.Random) -> Example:
        items = _items(rng, distinct=True)
        out = list(items)
        while out == items:
            rng.shuffle(out)
        answer = format_list(out)
        prompt = self.prompt_text.format(items=format_list(items)) + "\n"
        return Example(task=self.name, prompt=prompt, target=answer, answer=answer, meta={"items": items})

    def score(self, example: Example, completion: str) -> bool:
        out, items = parse_int_list(completion), example.meta["items"]
        return out is not None and sorted(out) == sorted(items) and out != list(items)

    def texts(self) -> list[str]:
        return [self.prompt_text]


class Pick(Task):
    name = "pick"
    description = "pick k distinct items of a list of distinct items, any order (parallel-sensitive)"
    prompt_text = "Pick {k} different items from the list: {items}"

    def draw(self, rng: random.Random) -> Example:
        items = _items(rng, distinct=True, lengths=(4, 6))
        k = rng.randint(2, len(items) - 1)
        answer = format_list(rng.sample(items, k))
        prompt = self.prompt_text.format(k=k, items=format_list(items)) + "\n"
        return Example(task=self.name, prompt=prompt, target=answer, answer=answer, meta={"items": items, "k": k})

    def score(self, example: Example, completion: str) -> bool:
        out, items, k = parse_int_list(completion), example.meta["items"], example.meta["k"]
        return out is not None and len(out) == k and len(set(out)) == k and set(out) <= set(items)

    def texts(self) -> list[str]:
        return [self.prompt_text]
