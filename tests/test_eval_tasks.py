"""The bundled lm-eval task data and the ``python -m dllm.eval`` argument helpers (no lm-eval needed)."""

from __future__ import annotations

import json

import pytest

from dllm import tasks as bench_tasks
from dllm.core.errors import ConfigError
from dllm.eval import TASKS_DIR, tasks
from dllm.eval.__main__ import bundled_task_names, include_paths, requested_tasks, task_paths


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


def test_command_line_helpers(tmp_path):
    assert task_paths(None, ["/t"]) == ["/t"]
    # lm-eval's run path passes --include_path on as one string: every directory becomes a list entry
    assert task_paths("/mine:/more", ["/t"]) == ["/t", "/mine", "/more"]
    assert task_paths(["/mine"], ["/t"]) == ["/t", "/mine"]
    assert include_paths(["--include_path", str(tmp_path), "--tasks", "x"]) == [str(tmp_path)]
    assert include_paths([f"--include_path={tmp_path}:{tmp_path}"]) == [str(tmp_path)] * 2
    with pytest.raises(ConfigError, match="no-such-dir: no such directory"):
        include_paths(["--include_path", str(tmp_path / "no-such-dir")])
    assert requested_tasks(["--model", "dllm", "--tasks", "dllm_arith,dllm_pick"]) == {"dllm_arith", "dllm_pick"}
    names = bundled_task_names()
    assert {"dllm_arith", "dllm_listops", "dllm_shuffle", "dllm_pick", "dllm_arith_mc", "dllm_bench"} <= names
    assert len(list(TASKS_DIR.glob("*.yaml"))) == 7


def test_ls_tasks_lists_the_bundled_tasks(lm_eval_state, capsys):
    """``dllm eval ls tasks`` is lm-eval's ``ls`` (no ``--model`` put in front), with the bundled tasks in it."""
    from dllm import cli

    assert cli.main(["eval", "ls", "tasks"]) == 0
    listed = capsys.readouterr().out
    assert "dllm_arith_ppl" in listed and "dllm_pick" in listed and "hellaswag" in listed


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("sampler=nope", "unknown sampler 'nope'"),
        ("cache=nope", "unknown cache 'nope'"),
        ("max_new_tokens=0", "max_new_tokens must be a positive integer or None, got 0"),
        ("dtype=float13", "unknown dtype 'float13'"),
        ("pretrained=/no/such/checkpoint", "is neither a checkpoint directory"),
        ("seed=abc", "seed must be an integer (default 0), got 'abc' (str)"),
        ("temperature=nan", "temperature must be a finite number >= 0"),
    ],
)
def test_dllm_eval_mistakes_are_one_error_line(lm_eval_state, capsys, model_args, message):
    from dllm import cli

    args = ["eval", "--model_args", f"pretrained=tiny-llada,{model_args}", "--tasks", "dllm_pick", "--limit", "1"]
    assert cli.main([*args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("dllm: error:")]
    assert message in line


def test_bundled_tasks_do_not_print_lm_evals_metadata_note():
    """lm-eval warns for every task with a ``custom_dataset`` that kwargs can go to ``--metadata``; the
    bundled tasks take none, so the note is dropped for them (and kept for a user's task)."""
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("lm_eval.api.task")
    logger.addHandler(handler)
    note = "Custom kwargs can be passed to `--metadata` in console (as json string) or to the TaskManager."
    try:
        logger.warning(f"dllm_pick: {note}")
        logger.warning(f"my_task: {note}")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage().split(":")[0] for r in seen] == ["my_task"]


def test_perplexity_task_names_its_aggregations():
    """Every metric of ``dllm_arith_ppl`` names its aggregation and direction (else lm-eval warns six times)."""
    text = (TASKS_DIR / "dllm_arith_ppl.yaml").read_text()
    assert text.count("aggregation:") == text.count("- metric:") == text.count("higher_is_better: false") == 3


def test_dllm_eval_subcommand_forwards_to_lm_eval(monkeypatch):
    """``dllm eval ARGS`` is ``python -m dllm.eval ARGS`` with ``--model dllm`` unless another model is named."""
    import dllm.eval.__main__ as entry
    from dllm import cli

    seen = []
    monkeypatch.setattr(entry, "main", lambda args: seen.append(args) or 0)
    assert cli.main(["eval", "--model_args", "pretrained=tiny-llada", "--tasks", "dllm_arith"]) == 0
    assert cli.main(["eval", "--model", "hf", "--tasks", "x"]) == 0
    assert cli.main(["eval", "ls", "tasks"]) == 0
    assert cli.main(["eval", "run", "--tasks", "x"]) == 0
    assert seen == [
        ["--model", "dllm", "--model_args", "pretrained=tiny-llada", "--tasks", "dllm_arith"],
        ["--model", "hf", "--tasks", "x"],
        ["ls", "tasks"],
        ["run", "--model", "dllm", "--tasks", "x"],
    ]


def test_an_unknown_task_is_one_error_line(monkeypatch, capsys):
    """issue 31 item 12: ``dllm eval --tasks dllm_nonexist`` printed lm-eval's 20-line ValueError. A ``dllm_`` name
    is checked against the bundled tasks at once; another name lm-eval does not find ends in the same line."""
    import lm_eval.__main__
    import lm_eval.tasks

    import dllm.eval.__main__ as entry

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # main wraps it: undone after
    args = ["--model", "dllm", "--model_args", "pretrained=tiny-llada", "--tasks"]
    assert entry.main([*args, "dllm_arithm,dllm_pick"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("dllm: error: unknown task(s) 'dllm_arithm'; did you mean 'dllm_arith'") and err.count("\n") == 1
    )

    def not_found():
        raise ValueError("Tasks not found: my_task, other")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", not_found)
    assert entry.main([*args, "my_task,other"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: unknown task(s) 'my_task', 'other'. The bundled tasks: dllm_arith")
    assert "'dllm eval ls tasks' lists every task" in err and err.count("\n") == 1
