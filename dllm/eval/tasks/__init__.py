"""The bench tasks as offline lm-eval tasks (``--tasks dllm_arith`` etc.; ``python -m dllm.eval`` puts this
directory on lm-eval's task path).

Data: ``data/<task>.jsonl`` holds the first ``SIZES[task]`` examples of the task generator's test split
(``dllm.tasks.get(task).examples("test", n, seed=0)``), the very examples ``dllm bench --tasks task
--n k`` runs for any ``k`` up to that size (a longer draw extends a shorter one). ``python -m
dllm.eval.tasks`` rewrites the files; a test checks that they equal the generator's output. lm-eval reads
them through ``custom_dataset`` (:func:`load`), never through the Hub, so the tasks run offline.

Tasks (each YAML beside this file):

- ``dllm_arith``, ``dllm_listops``, ``dllm_shuffle``, ``dllm_pick`` (``generate_until``, group
  ``dllm_bench``): the prompt as context, no stop sequence (the model stops at EOS, as in ``dllm bench``), and
  ``exact_match`` scored by the task's own scorer (:func:`process_results`: arith extracts the answer as
  lm-eval's GSM8K task does; the list tasks compare the list; shuffle and pick accept any valid answer).
- ``dllm_arith_mc`` (``multiple_choice``, scored by ``loglikelihood``): the problem and its worked steps
  as context; four candidate final lines ``The answer is N.``, the right one and three distractors near it,
  drawn per problem from a seeded generator (:func:`choices`); metric ``acc``.
- ``dllm_arith_ppl`` (``loglikelihood_rolling``): the whole problem and solution text; word and byte
  perplexity and bits per byte from the model's likelihood estimate. The bundled models learned responses
  given a prompt, never prompts, so their figures here are poor (tiny-llada: about 11 bits per byte); the
  task exercises the perplexity path offline.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

TASKS_DIR = Path(__file__).parent
DATA_DIR = TASKS_DIR / "data"
SIZES = {"arith": 500, "listops": 500, "shuffle": 200, "pick": 200}
SEED = 0
CHOICES = 4
# lm-eval warns once per task whose data comes from a ``custom_dataset`` function that custom keyword
# arguments can be passed with ``--metadata``; the bundled tasks take none, so the note is dropped for them.
CUSTOM_KWARGS_NOTE = "Custom kwargs can be passed to `--metadata`"


class QuietBundledTasks(logging.Filter):
    """Drops lm-eval's ``--metadata`` note for the bundled tasks (names ``dllm_*``); other tasks keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("dllm_") and CUSTOM_KWARGS_NOTE in message)


def quiet_lm_eval_notes() -> None:
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, QuietBundledTasks) for f in logger.filters):
        logger.addFilter(QuietBundledTasks())


quiet_lm_eval_notes()


def build(directory: Path = DATA_DIR) -> list[Path]:
    """Write ``<task>.jsonl`` for every task of :data:`SIZES` (the test split, seed 0)."""
    from dllm import tasks

    return [tasks.export_jsonl(name, Path(directory) / f"{name}.jsonl", n, SEED) for name, n in SIZES.items()]


def examples(task: str) -> list:
    from dllm import tasks

    return tasks.load_jsonl(DATA_DIR / f"{task}.jsonl")


def choices(example) -> tuple[str, list[str], int]:
    """The multiple-choice form of an arith example: (context, candidate continuations, index of the right
    one). The context is the prompt and every worked step; the candidates are final lines whose numbers are
    the answer and three distinct distractors within 3 of it (in [0, 99]), in an order drawn per problem."""
    from dllm.tasks import problem_key

    *steps, _ = example.target.split("\n")
    context = example.prompt + "".join(s + "\n" for s in steps)
    answer = int(example.answer)
    rng = random.Random(f"dllm.eval/arith_mc/{problem_key(example)}")
    near = [a for a in range(answer - 3, answer + 4) if a != answer and 0 <= a <= 99]
    numbers = [answer, *rng.sample(near, CHOICES - 1)]
    rng.shuffle(numbers)
    return context, [f"The answer is {n}." for n in numbers], numbers.index(answer)


def rows(task: str) -> list[dict]:
    """The documents lm-eval sees for ``task`` (a bench task name, ``arith_mc`` or ``arith_ppl``)."""
    base = "arith" if task in ("arith_mc", "arith_ppl") else task
    out = []
    for i, ex in enumerate(examples(base)):
        row = {"index": i, "task": ex.task, "prompt": ex.prompt, "target": ex.target, "answer": ex.answer}
        row["meta"] = json.dumps(ex.meta, sort_keys=True)  # mixed-type lists: kept as JSON text for Arrow
        if task == "arith_mc":
            row["context"], row["choices"], row["label"] = choices(ex)
        out.append(row)
    return out


def load(task: str, **_) -> dict:
    """lm-eval's ``custom_dataset``: ``{"test": Dataset}`` of ``task`` from the bundled JSONL."""
    import datasets

    return {"test": datasets.Dataset.from_list(rows(task))}


def process_results(doc: dict, results: list[str]) -> dict:
    """``exact_match`` of one generation by the bench task's own scorer."""
    from dllm import tasks
    from dllm.tasks import Example

    example = Example(doc["task"], doc["prompt"], doc["target"], doc["answer"], json.loads(doc["meta"]))
    return {"exact_match": float(tasks.get(doc["task"]).score(example, results[0]))}
