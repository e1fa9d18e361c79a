"""lm-eval and dllm bench from the command line, offline: one process and two data-parallel processes.

Each run is a subprocess with the Hugging Face Hub and datasets switched offline (``HF_HUB_OFFLINE``,
``HF_DATASETS_OFFLINE``) and an empty ``HF_HOME``, so the bundled tasks and model are all it can use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dllm.bench import runner
from dllm.bench.records import cell_files, read_lines

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 8
TASKS = ["arith", "shuffle", "pick"]
# LLaDA's sampler at 8 steps: 4 tokens per step on arith (32 tokens), 2 on the list tasks (16): not perfect
MODEL_ARGS = "pretrained=tiny-llada,sampler=llada,steps=8,block_size=8,mc_num=4,greedy=false"
LAUNCH = ["-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu", "--num_machines", "1"]
LAUNCH += ["--mixed_precision", "no", "--dynamo_backend", "no"]


def run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf-home"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run([sys.executable, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def lm_eval(tmp: Path, launch: list[str]) -> dict:
    out = tmp / "out"
    tasks = ",".join([f"dllm_{t}" for t in TASKS] + ["dllm_arith_mc"])
    args = ["-m", "dllm.eval", "--model", "dllm", "--model_args", MODEL_ARGS, "--tasks", tasks, "--device", "cpu"]
    args += ["--limit", str(LIMIT), "--batch_size", "4", "--log_samples", "--output_path", str(out)]
    run([*launch, *args], tmp)
    (results,) = out.rglob("results_*.json")
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[path.name.split("_20")[0].removeprefix("samples_")] = sorted(rows, key=lambda r: r["doc_id"])
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return lm_eval(tmp_path_factory.mktemp("lm_eval_1"), [])


def test_lm_eval_generation_equals_dllm_bench(single, tmp_path):
    """lm-eval's exact match on the bundled generation tasks equals dllm bench's accuracy on the same
    examples with the same sampler and settings, sample by sample."""
    config = runner.BenchConfig(
        samplers=["llada"], tasks=TASKS, n=LIMIT, grid={"steps": [8]}, out=tmp_path, progress=False
    )
    runner.run(config, log=lambda msg: None)
    records = [json.loads(line) for path in cell_files(tmp_path / "runs") for line in read_lines(path)]
    accuracies = []
    for task in TASKS:
        bench = sorted(
            (r for r in records if r["type"] == "sample" and r["task"] == task and r["settings"]["steps"] == 8),
            key=lambda r: r["index"],
        )
        rows = single["samples"][f"dllm_{task}"]
        assert [r["doc_id"] for r in rows] == [r["index"] for r in bench] == list(range(LIMIT))
        assert [r["filtered_resps"][0] for r in rows] == [r["completion"] for r in bench]
        assert [r["exact_match"] for r in rows] == [float(r["correct"]) for r in bench]
        accuracy = sum(r["correct"] for r in bench) / LIMIT
        assert single["results"][f"dllm_{task}"]["exact_match,none"] == pytest.approx(accuracy)
        accuracies.append(accuracy)
    assert min(accuracies) < 1  # a setting that gets some wrong, so the comparison can tell


def test_lm_eval_multiple_choice_picks_the_highest_estimate(single):
    """dllm_arith_mc: lm-eval's accuracy is the share of problems whose right line has the highest of the four
    Monte-Carlo estimates, which are dllm's own (same seed: same masks)."""
    from dllm.eval import tasks
    from dllm.eval.harness import DllmLM
    from dllm.eval.likelihood import mc_loglikelihood

    lm = DllmLM(pretrained="tiny-llada", device="cpu", mc_num=4, greedy=False)
    rows = single["samples"]["dllm_arith_mc"]
    correct = []
    for row, doc in zip(rows, tasks.rows("arith_mc")):
        lls = [float(resp[0][0]) for resp in row["resps"]]
        ours = [
            mc_loglikelihood(lm.model, *lm.encode_pair(doc["context"], c), mc_num=4, batch_size=4)
            for c in doc["choices"]
        ]
        assert lls == pytest.approx(ours, rel=1e-5)
        correct.append(max(range(4), key=lambda i: lls[i]) == doc["label"])
    assert single["results"]["dllm_arith_mc"]["acc,none"] == pytest.approx(sum(correct) / LIMIT)


def test_lm_eval_two_processes_equal_one(single, tmp_path):
    """accelerate launch (two gloo processes on the CPU): every sample's record equals the one-process run's."""
    pair = lm_eval(tmp_path, LAUNCH)
    assert pair["samples"].keys() == single["samples"].keys()
    for task, rows in single["samples"].items():
        other = pair["samples"][task]
        assert [r["doc_id"] for r in other] == [r["doc_id"] for r in rows]
        for a, b in zip(rows, other):
            assert a["filtered_resps"] == b["filtered_resps"] and a["resps"] == b["resps"]
    for task, metrics in single["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert pair["results"][task][key] == pytest.approx(value), (task, key)


def test_bench_processes_equal_one_process(tmp_path):
    """dllm bench --processes 2 (accelerate launch, gloo): the JSONL records equal a one-process run's except
    for the wall times; the cells' batches, seeds and resumable layout are the same. Three batches of 4: the
    second round has a batch for process 0 only."""
    args = ["--samplers", "llada", "--set", "steps=8", "--tasks", "pick", "--n", "12", "--batch-size", "4"]
    run(["-m", "dllm", "bench", *args, "--out", str(tmp_path / "two"), "--no-progress", "--processes", "2"], tmp_path)
    config = runner.BenchConfig(
        samplers=["llada"],
        tasks=["pick"],
        n=12,
        batch_size=4,
        grid={"steps": [8]},
        out=tmp_path / "one",
        progress=False,
    )
    runner.run(config, log=lambda msg: None)

    def records(out: Path) -> dict:
        found = {}
        for path in cell_files(out / "runs"):
            rows = [json.loads(line) for line in read_lines(path)]
            found[path.name] = [{k: v for k, v in r.items() if k != "seconds"} for r in rows if r["type"] == "sample"]
        return found

    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) == 2  # llada at 8 steps and its reference
    assert one == two
    assert all(len(rows) == 12 for rows in one.values())
    assert (tmp_path / "two" / "summary.md").is_file()


def test_a_finished_cells_records_are_one_gzip_member(tmp_path):
    """A finished cell's file is rewritten as one gzip member (a member per batch compresses ten times worse), with
    every line kept; the sweep run again still finds the cell finished."""
    import zlib

    config = runner.BenchConfig(
        samplers=["llada"], tasks=["pick"], n=4, batch_size=1, grid={"steps": [8]}, out=tmp_path, progress=False
    )
    runner.run(config, log=lambda msg: None)
    paths = cell_files(tmp_path / "runs")
    assert len(paths) == 2 and all(p.name.endswith(".jsonl.gz") for p in paths)
    for path in paths:
        decoder = zlib.decompressobj(wbits=31)
        text = decoder.decompress(path.read_bytes())
        assert decoder.eof and decoder.unused_data == b""  # (one member, nothing after it)
        assert len(text.decode().splitlines()) == 5 == len(list(read_lines(path)))  # (the header and 4 samples)
    said = []
    runner.run(config, log=said.append)
    assert any("2 of 2 cells already finished" in line for line in said)


USER_TASK = """task: my_sort
dataset_path: json
dataset_name: null
custom_dataset: !function my_utils.load
output_type: generate_until
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: []
  max_gen_toks: 8
process_results: !function my_utils.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
USER_UTILS = """import datasets

ROWS = [{"prompt": "Sort the list: 3 1\\n", "answer": "1 3"}, {"prompt": "Sort the list: 9 4 7\\n", "answer": "4 7 9"}]


def load(**_):
    return {"test": datasets.Dataset.from_list(ROWS)}


def process_results(doc, results):
    return {"exact_match": float(results[0].strip() == doc["answer"])}
"""


def test_lm_eval_with_a_task_directory_of_the_users_own(tmp_path):
    """``--include_path DIR``: the user's tasks and the bundled ones in one run (lm-eval 0.4.13's run path takes
    the option as one path, so joining the two directories with ':' found neither); ``device`` and
    ``batch_size`` in ``--model_args`` as the README lists them."""
    mine = tmp_path / "my tasks"
    mine.mkdir()
    (mine / "my_sort.yaml").write_text(USER_TASK)
    (mine / "my_utils.py").write_text(USER_UTILS)
    out = tmp_path / "out"
    args = ["-m", "dllm.eval", "--model", "dllm", "--tasks", "my_sort,dllm_pick", "--include_path", str(mine)]
    args += ["--model_args", "pretrained=tiny-llada,device=cpu,batch_size=2,block_size=8", "--limit", "2"]
    done = run([*args, "--output_path", str(out)], tmp_path)
    (results,) = out.rglob("results_*.json")
    results = json.loads(results.read_text())["results"]
    assert set(results) == {"my_sort", "dllm_pick"}
    assert "Custom kwargs" in done.stderr  # lm-eval's note stays for the user's own task ...
    assert "dllm_pick: Custom kwargs" not in done.stderr  # ... and is dropped for the bundled ones
