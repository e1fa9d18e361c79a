"""The bundled lm-eval task data and the ``python -m dllm.eval`` argument helpers (no lm-eval needed)."""

from __future__ import annotations

import json

import pytest

from dllm.bench import tasks as bench_tasks
from dllm.eval import TASKS_DIR, tasks
from dllm.eval.__main__ import bundled_task_names, requested_tasks, with_task_path


@pytest.mark.parametrize("name", sorted(tasks.SIZES))
def test_bundled_data_is_the_generators_test_split(tmp_path, name):
    """The committed JSONL equals a fresh export of the task's test split (seed 0), i.e. dllm bench's examples."""
    (path,) = [p for p in tasks.build(tmp_path) if p.stem == name]
    assert path.read_text() == (tasks.DATA_DIR / f"{name}.jsonl").read_text()
    assert tasks.examples(name) == bench_tasks.get(name).examples("test", tasks.SIZES[name], tasks.SEED)


def test_multiple_choice_form():
    rows = tasks.rows("arith_mc")
    assert len(rows) == tasks.SIZES["arith"]
    for row in rows:
        choices, label = row["choices"], row["label"]
        assert len(set(choices)) == 4 and choices[label] == f"The answer is {row['answer']}."
        assert row["context"].startswith(row["prompt"]) and row["context"].endswith("\n")
        assert row["context"] + choices[label] == row["prompt"] + row["target"]
    assert {row["label"] for row in rows} == {0, 1, 2, 3}  # the right answer is not always in one place


def test_documents_score_with_the_tasks_own_scorer():
    row = tasks.rows("shuffle")[0]
    items = json.loads(row["meta"])["items"]
    assert tasks.process_results(row, [" ".join(map(str, items[::-1]))]) == {"exact_match": 1.0}
    assert tasks.process_results(row, [" ".join(map(str, items))]) == {"exact_match": 0.0}  # not shuffled
    row = tasks.rows("arith")[0]
    assert tasks.process_results(row, [f"... The answer is {row['answer']}."]) == {"exact_match": 1.0}


def test_command_line_helpers():
    assert with_task_path(["--tasks", "dllm_arith"], "/t") == ["--tasks", "dllm_arith", "--include_path", "/t"]
    assert with_task_path(["--include_path", "/mine"], "/t") == ["--include_path", "/mine:/t"]
    assert with_task_path(["--include_path=/mine"], "/t") == ["--include_path=/mine:/t"]
    assert with_task_path(["--help"], "/t") == ["--help"]
    assert requested_tasks(["--model", "dllm", "--tasks", "dllm_arith,dllm_pick"]) == {"dllm_arith", "dllm_pick"}
    names = bundled_task_names()
    assert {"dllm_arith", "dllm_listops", "dllm_shuffle", "dllm_pick", "dllm_arith_mc", "dllm_bench"} <= names
    assert len(list(TASKS_DIR.glob("*.yaml"))) == 7


def test_dllm_eval_subcommand_forwards_to_lm_eval(monkeypatch):
    """``dllm eval ARGS`` is ``python -m dllm.eval ARGS`` with ``--model dllm`` unless another model is named."""
    import dllm.eval.__main__ as entry
    from dllm import cli

    seen = []
    monkeypatch.setattr(entry, "main", lambda args: seen.append(args) or 0)
    assert cli.main(["eval", "--model_args", "pretrained=tiny-llada", "--tasks", "dllm_arith"]) == 0
    assert cli.main(["eval", "--model", "hf", "--tasks", "x"]) == 0
    assert seen == [
        ["--model", "dllm", "--model_args", "pretrained=tiny-llada", "--tasks", "dllm_arith"],
        ["--model", "hf", "--tasks", "x"],
    ]
