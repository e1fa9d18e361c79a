import dataclasses
import re

import pytest

from dllm import tasks
from dllm.core.errors import ConfigError
from dllm.tasks import Example, extract_answer, parse_int_list, problem_key, split_of

ALL = tasks.names()
SUBTASKS = ["copy", "reverse", "sort", "insert", "remove", "replace", "shuffle", "pick"]


def _alter(answer: str, i: int, delta: int) -> str:
    items = answer.split(" ")
    items[i] = str(int(items[i]) + delta)
    return " ".join(items)


def test_names_and_registry():
    assert {"arith", "listops", "parallel", *SUBTASKS} <= set(ALL)
    for name in ALL:
        task = tasks.get(name)
        assert task.name == name and task.description
    with pytest.raises(ConfigError, match="unknown task"):
        tasks.get("gsm8k")
    with pytest.raises(ConfigError, match="split"):
        tasks.get("arith").examples("valid", 3)


@pytest.mark.parametrize("name", ALL)
def test_generators_are_deterministic_per_seed(name):
    task = tasks.get(name)
    a = task.examples("train", 30, seed=3)
    assert a == task.examples("train", 30, seed=3)
    assert task.examples("train", 10, seed=3) == a[:10]  # a longer request extends a shorter one
    assert a != task.examples("train", 30, seed=4)
    assert task.examples("test", 30, seed=3) != a
    for ex in a:
        assert ex.prompt.endswith("\n") and "\n" not in ex.prompt[:-1]
        assert ex.target and not ex.target[0].isspace() and ex.target == ex.target.strip()
        assert ex.task in SUBTASKS + ["arith"]


@pytest.mark.parametrize("name", ALL)
def test_splits_are_disjoint(name):
    task = tasks.get(name)
    train = {problem_key(e) for e in task.examples("train", 400)}
    test = [problem_key(e) for e in task.examples("test", 150)]
    assert len(set(test)) == len(test)  # test problems are distinct
    assert not train & set(test)
    assert all(split_of(k) == "train" for k in train) and all(split_of(k) == "test" for k in test)


def test_mixture_and_subtask_agree_on_splits():
    mixed_test = {problem_key(e) for e in tasks.get("listops").examples("test", 300)}
    for sub in ("reverse", "insert"):
        assert not mixed_test & {problem_key(e) for e in tasks.get(sub).examples("train", 400)}
    assert {e.task for e in tasks.get("listops").examples("train", 200)} == set(SUBTASKS[:6])
    assert {e.task for e in tasks.get("parallel").examples("train", 50)} == {"shuffle", "pick"}


def test_split_ignores_surface_wording():
    ex = tasks.get("arith").examples("train", 1)[0]
    reworded = dataclasses.replace(ex, prompt=ex.prompt.replace(" has ", " owns "))
    assert problem_key(reworded) == problem_key(ex)
    other = dataclasses.replace(ex, meta={**ex.meta, "start": ex.meta["start"] + 1})
    assert problem_key(other) != problem_key(ex)
    assert len({split_of(f"arith|{i}") for i in range(40)}) == 2


@pytest.mark.parametrize("name", ALL)
def test_reference_target_and_answer_score(name):
    task = tasks.get(name)
    for ex in task.examples("train", 100) + task.examples("test", 100):
        assert task.score(ex, ex.target)
        assert task.score(ex, ex.target + " \n")  # trailing whitespace is tolerated
        assert tasks.get(ex.task).score(ex, ex.target)
        if ex.task != "arith":
            assert ex.target == ex.answer
            assert not task.score(ex, " " + ex.target)  # leading whitespace is not
            assert not task.score(ex, ex.target + ".")
            assert not task.score(ex, ex.target.replace(" ", "  ", 1))


def test_mixture_rejects_foreign_examples():
    ex = tasks.get("shuffle").examples("test", 1)[0]
    with pytest.raises(ConfigError, match="not part of mixture"):
        tasks.get("listops").score(ex, ex.target)


# --- arithmetic -------------------------------------------------------------------------------


def test_arith_targets_are_correct_one_operation_steps():
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
    for ex in tasks.get("arith").examples("train", 300) + tasks.get("arith").examples("test", 100):
        *steps, last = ex.target.split("\n")
        assert 2 <= len(steps) <= 3 and len(steps) == len(ex.meta["ops"])
        value = ex.meta["start"]
        assert ex.prompt.split(" ")[2] == str(value)  # "Name has N items."
        for line, (op, n) in zip(steps, ex.meta["ops"]):
            a, sym, b, eq, c = line.split(" ")
            assert (int(a), sym, int(b), eq) == (value, op, n, "=")
            assert ops[op](value, n) == int(c) and 1 <= int(c) <= 30
            value = int(c)
        assert last == f"The answer is {value}." and ex.answer == str(value)
        assert len(re.findall(r"\.", ex.prompt)) == len(steps) + 1 and ex.prompt.rstrip().endswith("now?")


def test_arith_scorer_accepts_right_rejects_near_misses():
    task = tasks.get("arith")
    for ex in task.examples("test", 50):
        n = int(ex.answer)
        assert task.score(ex, f"The answer is {n}.")
        assert task.score(ex, f"The answer is {n}")
        assert task.score(ex, ex.target.rsplit("\n", 1)[0])  # no final line: fall back to the last number
        for wrong in (n - 1, n + 1, 10 * n):
            assert not task.score(ex, ex.target.replace(f"The answer is {n}.", f"The answer is {wrong}."))
            assert not task.score(ex, ex.target.rsplit("\n", 1)[0] + f"\n{n} + 0 = {wrong}")
        assert not task.score(ex, f"The answer is {n + 1}. The answer is {n}.")  # the first strict match counts
        assert not task.score(ex, "")
        assert not task.score(ex, "The answer is")


def test_extract_answer_follows_lm_eval_gsm8k():
    assert extract_answer("3 + 4 = 7\nThe answer is 7.") == "7"
    assert extract_answer("The answer is 1,234.") == "1234"
    assert extract_answer("The answer is -5.") == "-5"
    assert extract_answer("3 + 4 = 7\nso 7 apples") == "7"
    assert extract_answer("costs $12.") == "12"
    assert extract_answer("3 + 4 = 7", strict=True) is None
    assert extract_answer("no numbers here") is None


# --- list operations --------------------------------------------------------------------------


def _solve(ex: Example) -> list[int]:
    m, items = ex.meta, list(ex.meta["items"])
    if ex.task == "copy":
        return items
    if ex.task == "reverse":
        return list(reversed(items))
    if ex.task == "sort":
        return sorted(items)
    i = m.get("position", 1) - 1
    if ex.task == "insert":
        items.insert(i, m["value"])
    elif ex.task == "remove":
        del items[i]
    elif ex.task == "replace":
        assert items[i] != m["value"]
        items[i] = m["value"]
    return items


def test_listops_answers_are_right_and_inputs_small():
    for ex in tasks.get("listops").examples("test", 300):
        assert parse_int_list(ex.answer) == _solve(ex)
        assert 3 <= len(ex.meta["items"]) <= 6 and all(0 <= x <= 39 for x in ex.meta["items"])
        assert ex.prompt.endswith(": " + " ".join(map(str, ex.meta["items"])) + "\n")
        if "position" in ex.meta:
            assert f"position {ex.meta['position']}" in ex.prompt


def test_listops_scorer_rejects_near_misses():
    task = tasks.get("listops")
    checked = 0
    for ex in task.examples("test", 200):
        ans = ex.answer.split(" ")
        assert not task.score(ex, _alter(ex.answer, 0, 1))  # off-by-one item
        assert not task.score(ex, ex.answer + " " + ans[-1])  # duplicated item
        assert not task.score(ex, " ".join(ans[1:]))  # dropped item
        swaps = [i for i in range(len(ans) - 1) if ans[i] != ans[i + 1]]
        if swaps:  # a swapped pair
            i = swaps[0]
            swapped = ans[:i] + [ans[i + 1], ans[i]] + ans[i + 2 :]
            assert not task.score(ex, " ".join(swapped))
            checked += ex.task in ("sort", "reverse")
        assert not task.score(ex, ex.prompt + ex.answer)
    assert checked > 20


def test_shuffle_scorer():
    task = tasks.get("shuffle")
    for ex in task.examples("test", 100):
        items = ex.meta["items"]
        assert len(set(items)) == len(items) and 3 <= len(items) <= 6
        out = parse_int_list(ex.answer)
        assert sorted(out) == sorted(items) and out != items
        rotated = items[1:] + items[:1]
        assert task.score(ex, " ".join(map(str, rotated)))  # another valid permutation
        assert task.score(ex, " ".join(map(str, reversed(items))))
        assert not task.score(ex, " ".join(map(str, items)))  # the input order is not a shuffle
        dup = out[:-1] + [out[0]]
        assert not task.score(ex, " ".join(map(str, dup)))  # a duplicated item (and a dropped one)
        assert not task.score(ex, " ".join(map(str, out[:-1])))  # a dropped item
        assert not task.score(ex, " ".join(map(str, out + [out[0]])))  # an extra duplicate
        assert not task.score(ex, " ".join(map(str, rotated)).replace(" ", ", "))  # wrong format


def test_pick_scorer():
    task = tasks.get("pick")
    for ex in task.examples("test", 100):
        items, k = ex.meta["items"], ex.meta["k"]
        assert len(set(items)) == len(items) and 2 <= k < len(items)
        assert f"Pick {k} " in ex.prompt
        out = parse_int_list(ex.answer)
        assert len(set(out)) == k and set(out) <= set(items)
        assert task.score(ex, " ".join(map(str, items[:k])))  # any k distinct items
        assert task.score(ex, " ".join(map(str, reversed(items[-k:]))))  # in any order
        assert not task.score(ex, " ".join(map(str, [items[0]] * 2 + items[1 : k - 1])))  # not distinct
        assert not task.score(ex, " ".join(map(str, items[: k - 1])))  # too few
        assert not task.score(ex, " ".join(map(str, items[: k + 1])))  # too many
        outside = next(v for v in range(40) if v not in items)
        assert not task.score(ex, " ".join(map(str, items[: k - 1] + [outside])))  # not from the list


def test_parse_int_list():
    assert parse_int_list("3 17 0\n") == [3, 17, 0]
    for bad in ("", " 3 1", "3  1", "3,1", "03 1", "3 1 x", "-1 2"):
        assert parse_int_list(bad) is None


# --- export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arith", "listops", "parallel"])
def test_jsonl_export_round_trips(name, tmp_path):
    path = tasks.export_jsonl(name, tmp_path / "sub" / f"{name}.jsonl", n=25, seed=7)
    loaded = tasks.load_jsonl(path)
    assert loaded == tasks.get(name).examples("test", 25, seed=7)
    assert len(path.read_text().splitlines()) == 25
    task = tasks.get(name)
    assert all(task.score(ex, ex.target) for ex in loaded)
    train = tasks.load_jsonl(tasks.export_jsonl(task, tmp_path / "train.jsonl", n=5, split="train"))
    assert train == task.examples("train", 5)
