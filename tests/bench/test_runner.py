"""The ablation runner (``dllm bench``) on tiny random checkpoints and a fake task registry.

The fake tasks stand in for ``dllm.tasks`` (same interface: ``get``, ``names``,
``Task.examples(split, n, seed)``, ``Task.score(example, completion)``), so these tests depend only on
the runner. Random weights make accuracy meaningless; the scorer is an arbitrary deterministic function
of the completion so that the table holds a mix of right and wrong.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

import dllm
from dllm.bench import records, runner
from dllm.cli import main
from dllm.core.errors import ConfigError
from dllm.core.settings import parse_set
from dllm.samplers.base import Sampler

N, BATCH, G, BLOCK = 6, 4, 8, 4  # 6 examples in batches of 4 and 2


@dataclasses.dataclass(frozen=True)
class FakeExample:
    task: str
    prompt: str
    target: str
    answer: str
    meta: dict = dataclasses.field(default_factory=dict, hash=False)


class FakeTask:
    def __init__(self, name: str):
        self.name = name
        self.description = f"fake task {name}"
        self.calls = []

    def examples(self, split: str, n: int, seed: int = 0):
        self.calls.append((split, n, seed))
        return [
            FakeExample(self.name, f"{self.name}: add {i + seed} and {2 * i + 1}" + "!" * (i % 3) + "\n", "x", "x")
            for i in range(n)
        ]

    def score(self, example, completion: str) -> bool:
        return len(completion) % 2 == 0


def fake_registry():
    tasks = {name: FakeTask(name) for name in ("fake", "fake2")}
    module = types.ModuleType("dllm.tasks")
    module.names = lambda: list(tasks)

    def get(name):
        if name not in tasks:
            raise ConfigError(f"unknown task {name!r}")
        return tasks[name]

    module.get = get
    return module


@pytest.fixture
def fake_tasks(monkeypatch):
    module = fake_registry()
    monkeypatch.setitem(sys.modules, "dllm.tasks", module)
    return module


class CountingGenerate:
    """Wraps ``Sampler.generate`` and counts the calls (warm-up calls included)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = Sampler.generate

        def generate(sampler, *args, **kwargs):
            self.calls += 1
            return original(sampler, *args, **kwargs)

        monkeypatch.setattr(Sampler, "generate", generate)


def config(out, models, **overrides) -> runner.BenchConfig:
    values = dict(
        models=[str(m) for m in models],
        samplers=["llada", "threshold"],
        tasks=["fake", "fake2"],
        n=N,
        seed=3,
        grid={"threshold": [0.5, 0.9], "steps": ["G/2"]},
        max_new_tokens=G,
        block_size=BLOCK,
        batch_size=BATCH,
        out=out,
        progress=False,
    )
    values.update(overrides)
    return runner.BenchConfig(**values)


@pytest.fixture(scope="module")
def sweep(checkpoint_dir, tmp_path_factory):
    """One sweep over a LLaDA and a Dream checkpoint, 2 tasks, llada (steps=G/2) and threshold (0.5, 0.9)."""
    out = tmp_path_factory.mktemp("bench")
    models = [checkpoint_dir("llada"), checkpoint_dir("dream")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "dllm.tasks", fake_registry())
        counter = CountingGenerate(mp)
        cfg = config(out, models)
        result = runner.run(cfg, log=lambda msg: None)
    return types.SimpleNamespace(
        out=out, models=[str(m) for m in models], config=cfg, report=result, calls=counter.calls
    )


def jsonl_files(out) -> list[Path]:
    return records.cell_files(Path(out) / "runs")


def find_cell(out, family: str, sampler: str, task: str = "fake") -> Path:
    for path in jsonl_files(out):
        cell = read(path)[0]["cell"]
        if (cell["family"], cell["sampler"], cell["task"]) == (family, sampler, task):
            return path
    raise AssertionError(f"no {family} {sampler} cell in {out}")


def read(path):
    lines = [json.loads(line) for line in records.read_lines(path)]
    return lines[0], lines[1:]


# -- grid ------------------------------------------------------------------------------------------


def test_expand_grid_is_the_cartesian_product_in_order():
    points = runner.expand_grid({"threshold": [0.8, 0.9], "steps": ["G/2", "G/4", 8]})
    assert len(points) == 6
    assert points[0] == {"threshold": 0.8, "steps": "G/2"}
    assert points[-1] == {"threshold": 0.9, "steps": 8}
    assert runner.expand_grid({}) == [{}]
    assert runner.expand_grid({"threshold": 0.7}) == [{"threshold": 0.7}]
    with pytest.raises(ConfigError, match="no values for 'steps'"):
        runner.expand_grid({"steps": []})


def test_set_values_are_typed_lists():
    grid = parse_set(["threshold=0.8,0.9", "steps=G/2,16", "alg=entropy", "x=[1,2],3", "threshold=1"])
    assert grid == {"threshold": [0.8, 0.9, 1], "steps": ["G/2", 16], "alg": ["entropy"], "x": [[1, 2], 3]}
    with pytest.raises(ConfigError, match="key=value"):
        parse_set(["threshold"])


def test_yaml_config_keys(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(
        "models: [a, b]\nsamplers: llada,threshold\ntasks: [fake]\nn: 5\nseed: 1\n"
        "set:\n  threshold: [0.8, 0.9]\n  steps: G/2\ncaches: [none]\n"
    )
    cfg = runner.BenchConfig.from_mapping(runner.load_yaml(path))
    assert cfg.models == ["a", "b"] and cfg.samplers == ["llada", "threshold"] and cfg.n == 5 and cfg.seed == 1
    assert cfg.grid == {"threshold": [0.8, 0.9], "steps": ["G/2"]} and cfg.caches == ["none"]
    with pytest.raises(ConfigError, match="unknown key.*'sampler'.*valid keys: .*samplers"):
        runner.BenchConfig.from_mapping({"sampler": "llada"})


# -- planning --------------------------------------------------------------------------------------


def test_steps_fractions_resolve_per_model_family(checkpoint_dir, fake_tasks):
    llada = runner.model_facts(str(checkpoint_dir("llada")))
    sdar = runner.model_facts(str(checkpoint_dir("sdar")))  # block size 4
    assert llada.device.type == "meta"  # planning reads no weights
    cfg = config("unused", [], samplers=["llada", "threshold"], tasks=["fake"], grid={"steps": ["G/2", "G/4", 8]})
    logged = []
    cells = runner.plan_model(cfg, "llada", llada, log=logged.append)
    steps = sorted(c.generation["steps"] for c in cells if c.sampler == "llada")
    assert steps == [2, 4, 8]  # G/4, G/2, and 8 = G (the one-token-per-step reference, not added twice)
    assert [c.reference for c in cells if c.sampler == "llada" and c.generation["steps"] == G] == [True]
    threshold = [c for c in cells if c.sampler == "threshold"]
    # adaptive: steps are not used (as the official code), so the swept values make one cell, and the log says so
    assert [c.generation["steps"] for c in threshold] == [None] and "steps" not in threshold[0].grid
    assert [m for m in logged if "not used by" in m] == [
        "dllm bench: steps not used by 'threshold' (adaptive: the data decides its steps); one cell for every "
        "swept value"
    ]
    assert all(c.generation["block_size"] == BLOCK for c in cells)

    cfg = config("unused", [], samplers=["sdar"], tasks=["fake"], grid={"steps": ["G/2", "G/4"]})
    cells = runner.plan_model(cfg, "sdar", sdar, log=lambda m: None)
    assert sorted((c.generation["steps_per_block"], c.reference) for c in cells) == [(1, False), (2, False), (4, True)]
    assert all(c.generation["block_size"] is None and c.generation["steps"] is None for c in cells)

    with pytest.raises(ConfigError, match="not divisible by 3"):
        runner.plan_model(config("unused", [], grid={"steps": ["G/3"]}), "llada", llada, log=lambda m: None)
    with pytest.raises(ConfigError, match="integer or 'G'"):
        runner.plan_model(config("unused", [], grid={"steps": ["H/2"]}), "llada", llada, log=lambda m: None)


def test_set_compile_true_reaches_generate_and_the_reference(checkpoint_dir, fake_tasks):
    llada = runner.model_facts(str(checkpoint_dir("llada")))
    cfg = config("unused", [], samplers=["threshold"], tasks=["fake"], grid={"compile": [True]})
    cells = runner.plan_model(cfg, "llada", llada, log=lambda m: None)
    assert len(cells) == 2 and all(c.generation["compile"] is True for c in cells)  # the cell + its reference
    plain = runner.plan_model(config("unused", [], samplers=["threshold"], tasks=["fake"]), "llada", llada, log=print)
    assert all("compile" not in c.generation for c in plain)  # cells without it keep their ids
    with pytest.raises(ConfigError, match="compile must be"):
        runner.plan_model(config("unused", [], tasks=["fake"], grid={"compile": ["fast"]}), "llada", llada, log=print)
    grid = {"compile": ["reduce-overhead"], "static_shapes": [True]}
    cfg = config("unused", [], samplers=["threshold"], tasks=["fake"], grid=grid)
    cells = runner.plan_model(cfg, "llada", llada, log=lambda m: None)
    assert len(cells) == 2 and all(c.generation["compile"] == "reduce-overhead" for c in cells)
    assert all(c.generation["static_shapes"] is True for c in cells)
    assert all("static_shapes" not in c.generation for c in plain)
    with pytest.raises(ConfigError, match="static_shapes must be true or false"):
        grid = {"static_shapes": ["yes"]}
        runner.plan_model(config("unused", [], tasks=["fake"], grid=grid), "llada", llada, log=print)


def test_reference_is_added_per_model_and_incompatible_samplers_are_skipped(checkpoint_dir, fake_tasks):
    llada = runner.model_facts(str(checkpoint_dir("llada")))
    messages = []
    cfg = config("unused", [], samplers=["threshold", "sdar"], grid={"threshold": [0.7, 0.8]})
    cells = runner.plan_model(cfg, "m", llada, log=messages.append)
    assert any("skipping sampler 'sdar'" in m and "block-causal" in m for m in messages)
    refs = [c for c in cells if c.reference]
    assert [(c.sampler, c.task, c.generation["steps"]) for c in refs] == [("llada", "fake", G), ("llada", "fake2", G)]
    assert len(cells) == 2 * 2 + 2
    assert len({c.id for c in cells}) == len(cells)
    # threshold=1 and threshold=1.0 are one cell
    cfg = config("unused", [], samplers=["threshold"], tasks=["fake"], grid={"threshold": [1, 1.0]})
    assert len(runner.plan_model(cfg, "m", llada, log=messages.append)) == 2  # the cell + its reference


def test_bad_keys_give_clear_errors(fake_tasks):
    with pytest.raises(ConfigError, match=r"'bogus'.*valid keys: generation max_new_tokens.*threshold threshold"):
        runner.validate(config("unused", [], grid={"bogus": [1]}))
    with pytest.raises(ConfigError, match="belongs to sampler .*threshold"):
        runner.validate(config("unused", [], samplers=["llada"], grid={"threshold": [0.8]}))
    with pytest.raises(ConfigError, match="unknown task.*'nope'.*available: fake, fake2"):
        runner.validate(config("unused", [], tasks=["nope"]))
    with pytest.raises(ConfigError, match="unknown sampler 'nope'"):
        runner.validate(config("unused", [], samplers=["nope"]))
    with pytest.raises(ConfigError, match="unknown cache.*'nope'.*available: none, recompute, prefix, dual, dkv"):
        runner.validate(config("unused", [], caches=["nope"]))
    with pytest.raises(ConfigError, match="no sampler of this sweep"):  # a cache's key needs that cache
        runner.validate(config("unused", [], caches=["dual"], grid={"cache_reloading_step": [2]}))
    with pytest.raises(ConfigError, match="not both"):
        runner.validate(config("unused", [], grid={"steps": [4], "steps_per_block": [2]}))


# -- a run -----------------------------------------------------------------------------------------


def test_run_writes_jsonl_summary_and_plots(sweep):
    files = jsonl_files(sweep.out)
    assert all(f.name.endswith(".jsonl.gz") for f in files)  # compressed records
    assert not list((sweep.out / "runs").glob("*.jsonl"))
    # per model and task: the auto reference, llada G/2, threshold 0.5 and 0.9
    assert len(files) == 2 * 2 * 4
    assert sweep.calls == len(files) * 2 + 2  # two batches per cell, one warm-up per model
    for path in files:
        header, samples = read(path)
        assert header["type"] == "header" and header["n"] == N and header["seed"] == 3 and header["batch_size"] == BATCH
        env = header["environment"]
        assert env["dllm"] == dllm.__version__ and env["torch"] == torch.__version__
        assert env["device"] == "cpu" and env["threads"] == torch.get_num_threads()
        assert len(samples) == N and [s["index"] for s in samples] == list(range(N))
        for s in samples:
            assert {"task", "model", "sampler", "settings", "correct", "nfe", "tokens", "seconds"} <= set(s)
            assert s["settings"]["max_new_tokens"] == G and s["task"] == header["cell"]["task"]
    for name in ("summary.md", "summary.json", "accuracy_vs_nfe.png", "accuracy_vs_tokens_per_s.png"):
        assert (sweep.out / name).is_file()
    for name in ("accuracy_vs_nfe.png", "accuracy_vs_tokens_per_s.png"):
        assert (sweep.out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (sweep.out / "summary.md").read_text()
    assert "batch size 4" in table and "count_generated" in table and "environment: dllm" in table


def test_records_are_the_generation_figures_of_their_batch(sweep):
    """nfe per sample = its batch's nfe, tokens = that row's count, seconds = batch seconds / batch size."""
    path = find_cell(sweep.out, "llada", "threshold")
    header, samples = read(path)
    cell = header["cell"]
    model = dllm.load(cell["model"], device="cpu", dtype=torch.float32)
    prompts = fake_registry().get(cell["task"]).examples("test", N, 3)
    sampler = dllm.samplers.get(cell["sampler"], **cell["hp"])
    for start in (0, BATCH):
        batch = samples[start : start + BATCH]
        out = sampler.generate(
            model, [e.prompt for e in prompts[start : start + BATCH]], seed=3 + start, **cell["generation"]
        )
        assert [s["nfe"] for s in batch] == [out.nfe] * len(batch)
        assert [s["tokens"] for s in batch] == out.tokens
        assert [s["completion"] for s in batch] == out.texts
        assert len({s["seconds"] for s in batch}) == 1 and batch[0]["batch_size"] == len(batch)


def parse_table(text: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def number(text: str) -> float | None:
    return None if text == "—" else float(text.rstrip("×"))


def test_summary_table_matches_its_jsonl(sweep):
    """Recompute every figure from the JSONL files, independently of dllm.bench.report, and compare."""
    cells = []
    for path in jsonl_files(sweep.out):
        header, samples = read(path)
        c = header["cell"]
        nfe, tokens, seconds = (sum(s[k] for s in samples) for k in ("nfe", "tokens", "seconds"))
        cells.append(
            {
                "cell": c,
                "accuracy": 100 * sum(s["correct"] for s in samples) / len(samples),
                "nfe": nfe / len(samples),
                "tpf": tokens / nfe,
                "tps": tokens / seconds,
                "sec": seconds / len(samples),
            }
        )
    rows = parse_table((sweep.out / "summary.md").read_text())
    assert len(rows) == len(cells)
    key = lambda row: (row["task"], Path(row["model"]).name, row["sampler"].removesuffix(" (ref)"))  # noqa: E731
    for c in cells:
        ref = next(
            r
            for r in cells
            if r["cell"]["reference"]
            and r["cell"]["model"] == c["cell"]["model"]
            and r["cell"]["task"] == c["cell"]["task"]
        )
        candidates = [
            row
            for row in rows
            if key(row) == (c["cell"]["task"], Path(c["cell"]["model"]).name, c["cell"]["sampler"])
            and (row["sampler"].endswith("(ref)") == c["cell"]["reference"])
            and abs(number(row["mean NFE"]) - c["nfe"]) <= 0.051
            and abs(number(row["tokens/forward"]) - c["tpf"]) <= 0.0051
            and abs(number(row["accuracy (%)"]) - c["accuracy"]) <= 0.051
            and abs(number(row["tokens/s"]) - c["tps"]) <= 0.051
            and abs(number(row["speedup (NFE)"]) - ref["nfe"] / c["nfe"]) <= 0.0051
            and abs(number(row["speedup (wall)"]) - ref["sec"] / c["sec"]) <= 0.0051
        ]
        assert candidates, f"no table row matches {c}"
    # and summary.json holds the same rows at full precision
    data = json.loads((sweep.out / "summary.json").read_text())
    assert sorted(round(r["mean_nfe"], 9) for r in data) == sorted(round(c["nfe"], 9) for c in cells)


def test_speedups_are_against_the_reference_of_the_same_model_and_task(sweep):
    rows = sweep.report.rows
    by_id = {row["cell_id"]: row for row in rows}
    refs = [row for row in rows if row["reference"]]
    assert sorted((r["sampler"], Path(r["model"]).name, r["task"]) for r in refs) == sorted(
        (s, Path(m).name, t)
        for s, m in (("llada", sweep.models[0]), ("dream", sweep.models[1]))
        for t in ("fake", "fake2")
    )
    for row in rows:
        ref = by_id[row["reference_cell"]]
        assert ref["reference"] and ref["model"] == row["model"] and ref["task"] == row["task"]
        assert ref["generation"]["steps"] == G  # one token per step
        assert row["speedup_nfe"] == pytest.approx(ref["mean_nfe"] / row["mean_nfe"])
        assert row["speedup_wall"] == pytest.approx(ref["mean_seconds"] / row["mean_seconds"])
        if row["reference"]:
            assert row["speedup_nfe"] == 1.0 and row["speedup_wall"] == 1.0
        if row["sampler"] == "llada" and not row["reference"]:  # steps = G/2: two tokens per step
            assert row["generation"]["steps"] == G // 2 and row["mean_nfe"] <= G // 2


def test_rerun_skips_finished_cells_and_resumes_a_partial_one(sweep, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(sweep.out, out)
    monkeypatch.setitem(sys.modules, "dllm.tasks", fake_registry())
    (out / "summary.md").unlink()
    counter = CountingGenerate(monkeypatch)
    messages = []
    cfg = dataclasses.replace(sweep.config, out=out)
    runner.run(cfg, log=messages.append)
    assert counter.calls == 0  # nothing loaded, nothing generated
    assert any("16 of 16 cells already finished" in m for m in messages)
    assert (out / "summary.md").read_text() == (sweep.out / "summary.md").read_text()

    # cut a cell after its first batch, plus a torn line and a torn gzip member: only its second batch runs again
    path = find_cell(out, "llada", "threshold")
    lines = list(records.read_lines(path))
    torn_member = gzip.compress(lines[2 + BATCH].encode())[:15]
    path.write_bytes(gzip.compress(("".join(lines[: 1 + BATCH]) + lines[1 + BATCH][:20]).encode()) + torn_member)
    runner.run(cfg, log=messages.append)
    assert counter.calls == 1 + 1  # the warm-up of the one model with pending cells, the remaining batch
    header, samples = read(path)
    _, original = read(sweep.out / "runs" / path.name)
    assert [s["index"] for s in samples] == list(range(N))
    strip = lambda s: {k: v for k, v in s.items() if k != "seconds"}  # noqa: E731
    assert [strip(s) for s in samples] == [strip(s) for s in original]  # greedy: the same records


def test_a_rerun_with_another_n_or_batch_size_keeps_the_cells_apart(checkpoint_dir, fake_tasks, tmp_path, monkeypatch):
    """Cells are keyed by every setting that changes them: a rerun with another --n keeps both runs' cells, each
    labelled with its n (the plots had two unlabelled references per task); one with another --batch-size (each
    sample's NFE is its batch's) measures the cells again instead of counting the old ones as finished."""
    from dllm.bench import report

    counter = CountingGenerate(monkeypatch)
    cfg = config(tmp_path, [checkpoint_dir("llada")], samplers=["llada"], tasks=["fake"], grid={}, n=2, batch_size=2)
    runner.run(cfg, log=lambda msg: None)
    rows = runner.run(dataclasses.replace(cfg, n=4), log=lambda msg: None).rows
    assert sorted(row["n"] for row in rows if row["reference"]) == [2, 4]
    texts = [text for *_, text, _ in report.point_labels(rows, "mean_nfe")]  # apart, or one label at one place
    assert all(t.startswith("n=") for t in texts) and sorted(re.findall(r"\d+", " ".join(texts))) == ["2", "4"]
    calls = counter.calls
    messages = []
    rows = runner.run(dataclasses.replace(cfg, batch_size=1), log=messages.append).rows
    assert counter.calls > calls and any("another batch size" in m for m in messages)
    assert sorted((row["n"], row["batch_size"]) for row in rows) == [(2, 1), (4, 2)]
    assert [label for label in report.labels(report.collect(tmp_path)[0]) if "batch_size" in label]


def test_plain_jsonl_of_an_older_run_is_read_and_resumed(sweep, tmp_path, monkeypatch):
    """Record files of versions before compression (``runs/*.jsonl``) count as finished cells and resume."""
    out = tmp_path / "out"
    shutil.copytree(sweep.out, out)
    for path in jsonl_files(out):
        plain = path.with_name(records.cell_id(path) + ".jsonl")
        plain.write_text("".join(records.read_lines(path)))
        path.unlink()
    monkeypatch.setitem(sys.modules, "dllm.tasks", fake_registry())
    (out / "summary.md").unlink()
    counter = CountingGenerate(monkeypatch)
    cfg = dataclasses.replace(sweep.config, out=out)
    runner.run(cfg, log=lambda msg: None)
    assert counter.calls == 0
    assert (out / "summary.md").read_text() == (sweep.out / "summary.md").read_text()
    path = find_cell(out, "llada", "threshold")
    assert path.name.endswith(".jsonl")
    path.write_text("".join(path.read_text().splitlines(keepends=True)[: 1 + BATCH]))  # cut after one batch
    runner.run(cfg, log=lambda msg: None)
    assert counter.calls == 1 + 1  # resumed in place: the warm-up and the second batch
    assert len(read(path)[1]) == N and not path.with_name(path.name + ".gz").exists()


def test_cli_bench_with_a_yaml_grid(checkpoint_dir, fake_tasks, tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        f"models: [{checkpoint_dir('llada')}]\nsamplers: [threshold]\ntasks: [fake]\nn: 2\nseed: 0\n"
        "set:\n  threshold: [0.6, 0.95]\ncaches: [none]\nbatch_size: 2\nmax_new_tokens: 8\nblock_size: 4\n"
    )
    out = tmp_path / "out"
    assert main(["bench", "--config", str(grid), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| fake |" in printed and "llada (ref)" in printed and "threshold=0.6" in printed
    assert len(jsonl_files(out)) == 3  # two thresholds + the reference
    # a command-line --set replaces the file's grid key
    assert main(["bench", "--config", str(grid), "--out", str(out), "--no-progress", "--set", "threshold=0.7"]) == 0
    assert len(jsonl_files(out)) == 4
    assert re.search(r"4 cells", (out / "summary.md").read_text())


def test_kernel_is_a_grid_key_passed_to_generate(checkpoint_dir, fake_tasks, tmp_path, capsys):
    llada = runner.model_facts(str(checkpoint_dir("llada")))
    cfg = config("unused", [], samplers=["threshold"], tasks=["fake"], grid={"kernel": ["torch", "auto"]})
    cells = runner.plan_model(cfg, "m", llada, log=lambda m: None)
    assert sorted(c.generation.get("kernel", "-") for c in cells) == ["-", "auto", "torch"]  # "-": the reference
    plain = runner.plan_model(config("unused", [], samplers=["threshold"], tasks=["fake"], grid={}), "m", llada)
    assert all("kernel" not in c.generation for c in plain)  # not swept: cell ids as before
    with pytest.raises(ConfigError, match="kernel must be one of auto, torch, triton.*got 'fast'"):
        runner.plan_model(config("unused", [], grid={"kernel": ["fast"]}), "m", llada, log=lambda m: None)
    out = tmp_path / "out"
    args = ["bench", "--models", str(checkpoint_dir("llada")), "--samplers", "threshold", "--tasks", "fake"]
    args += ["--n", "2", "--max-new-tokens", "8", "--block-size", "4", "--out", str(out), "--no-progress"]
    assert main([*args, "--set", "kernel=torch"]) == 0
    records = [read(path) for path in jsonl_files(out)]
    swept = [samples for header, samples in records if header["cell"]["generation"].get("kernel") == "torch"]
    assert len(swept) == 1 and all(s["kernel"] == "torch" for s in swept[0])
    assert "kernel=torch" in (out / "summary.md").read_text()


def test_cli_bench_lists_tasks_and_reports_errors(fake_tasks, capsys):
    assert main(["bench", "--list-tasks"]) == 0
    assert "fake2" in capsys.readouterr().out
    assert main(["bench", "--samplers", "llada", "--tasks", "fake", "--set", "bogus=1,2"]) == 2
    err = capsys.readouterr().err
    assert "dllm: error:" in err and "'bogus'" in err and "valid keys" in err


def test_a_part_sweeps_its_bases_and_their_settings(checkpoint_dir, fake_tasks, exit_at):
    from dllm import samplers

    llada = runner.model_facts(str(checkpoint_dir("llada")))
    grid = {"base": ["llada", "threshold"], "threshold": [0.7, 0.8], "at": [1], "steps": ["G/2"]}
    cfg = config("unused", [], samplers=["exit_at"], tasks=["fake"], grid=grid)
    runner.validate(cfg)
    cells = [c for c in runner.plan_model(cfg, "m", llada, log=lambda m: None) if not c.reference]
    hps = sorted((c.hp["base"], c.hp.get("threshold"), c.generation["steps"]) for c in cells)
    assert hps == [("llada", None, G // 2), ("threshold", 0.7, None), ("threshold", 0.8, None)]  # adaptive: unused
    for cell in cells:  # a cell's record rebuilds its sampler
        assert samplers.get(cell.sampler, **cell.hp).settings() == cell.hp
    with pytest.raises(ConfigError, match="no sampler of this sweep"):
        runner.validate(config("unused", [], samplers=["exit_at"], grid={"factor": [1.0]}))


def test_caches_cross_the_samplers_and_sweep_their_own_keys(checkpoint_dir, fake_tasks, tmp_path, capsys):
    """--caches crosses every sampler; a --set key of a cache sweeps only that cache's cells; a cache a model
    cannot use is skipped with a message; the report's labels name the cache and its non-default settings."""
    llada = runner.model_facts(str(checkpoint_dir("llada")))
    grid = {"threshold": [0.8], "cache_reloading_step": [2, 4]}
    cfg = config("unused", [], samplers=["llada", "threshold"], tasks=["fake"], caches=["none", "dual", "dkv", "block"])
    cfg.grid = grid
    runner.validate(cfg)
    messages = []
    cells = runner.plan_model(cfg, "m", llada, log=messages.append)  # llada without a cache is the reference
    got = sorted((c.sampler, c.cache, c.cache_hp.get("cache_reloading_step")) for c in cells)
    crossed = [("none", None), ("dual", None), ("dkv", 2), ("dkv", 4)]
    assert got == sorted((s, cache, r) for s in ("llada", "threshold") for cache, r in crossed)
    assert len({c.id for c in cells}) == len(cells)
    assert any("cache 'block'" in m and "block-causal" in m for m in messages)
    out = tmp_path / "out"
    args = ["bench", "--models", str(checkpoint_dir("llada")), "--samplers", "threshold", "--tasks", "fake"]
    args += ["--caches", "none,dkv", "--set", "cache_reloading_step=2", "--n", "2", "--batch-size", "2"]
    args += ["--max-new-tokens", "8", "--block-size", "4", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "cache=dkv(cache_reloading_step=2)" in printed
    samples = [read(path)[1] for path in jsonl_files(out)]
    assert {s[0]["cache"] for s in samples} == {"none", "dkv"}


def test_cache_refusals_need_no_run_and_skip_only_their_cell(checkpoint_dir, fake_tasks):
    """issue 18 items 6 and 12: the bench asks ``Sampler.check_cache(model, cache)`` (no stand-in run): s2d2 with
    the block cache on SDAR is planned; a cell whose sampler refuses the model's default cache (LLaDA's
    classifier-free guidance under SDAR's block cache) is skipped with a note and the sweep goes on."""
    sdar = runner.model_facts("tiny-sdar")
    messages = []
    cfg = config("unused", [], samplers=["s2d2"], tasks=["fake"], caches=["block"], grid={})
    cells = runner.plan_model(cfg, "tiny-sdar", sdar, log=messages.append)
    assert [(c.sampler, c.cache) for c in cells if not c.reference] == [("s2d2", "block")]
    cfg = config("unused", [], samplers=["llada", "threshold"], tasks=["fake"], grid={"cfg_scale": [1.0]})
    cells = runner.plan_model(cfg, "tiny-sdar", sdar, log=messages.append)
    assert [c.sampler for c in cells if not c.reference] == ["threshold"]
    assert any("skipping llada with cache 'none'" in m and "classifier-free guidance" in m for m in messages)


def test_nothing_to_run_says_why(checkpoint_dir, fake_tasks, tmp_path):
    """``--caches block`` on a full-attention model: the error names each refusal (it used to end in ': ');
    ``--samplers prophet --caches dual`` (refused before) is planned."""
    cfg = config(tmp_path, [checkpoint_dir("llada")], caches=["block"], grid={})
    with pytest.raises(ConfigError, match=r"with its cache\(s\) \(block\): llada with cache 'block'.*block-causal"):
        runner.run(cfg, log=lambda m: None)
    llada = runner.model_facts(str(checkpoint_dir("llada")))
    cfg = config("unused", [], samplers=["prophet"], tasks=["fake"], caches=["dual"], grid={})
    cells = runner.plan_model(cfg, "m", llada, log=lambda m: None)
    assert [(c.sampler, c.cache) for c in cells if not c.reference] == [("prophet", "dual")]


def test_recompute_runs_without_any_cache_and_matches_the_exact_default(
    checkpoint_dir, fake_tasks, tmp_path, monkeypatch
):
    """``--caches none,recompute`` on SDAR: "none" keeps the sampler's exact block cache, "recompute" passes
    ``cache=None`` (every forward recomputes every column); an exact cache gives the same completions."""
    asked = []
    original = Sampler.generate

    def generate(sampler, *args, **kwargs):
        asked.append(kwargs.get("cache"))
        return original(sampler, *args, **kwargs)

    monkeypatch.setattr(Sampler, "generate", generate)
    out = tmp_path / "out"
    args = ["bench", "--models", str(checkpoint_dir("sdar")), "--samplers", "sdar", "--tasks", "fake"]
    args += ["--caches", "none,recompute", "--n", "2", "--batch-size", "2", "--max-new-tokens", "8", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    assert "default" in asked and None in asked
    samples = {
        read(path)[1][0]["cache"]: read(path)[1] for path in jsonl_files(out) if not read(path)[0]["cell"]["reference"]
    }
    assert set(samples) == {"none", "recompute"}
    assert [s["completion"] for s in samples["none"]] == [s["completion"] for s in samples["recompute"]]


def test_a_grid_mixing_families_skips_the_impossible_cells(checkpoint_dir, fake_tasks, tmp_path, capsys):
    """issue 31 items 7 and 14: ``threshold`` on a WeDLM model (causal attention) and ``wedlm`` on LLaDA are
    skipped, each with one note in the command line's spelling (``--samplers wedlm``, not the API's
    ``dllm.samplers.get('wedlm')``; a cache refusal met at every task said once), from a command-line grid and a
    YAML grid alike; the other cells run and the summary is written."""
    models = f"{checkpoint_dir('llada')},{checkpoint_dir('wedlm')}"
    options = dict(samplers="threshold,wedlm", tasks="fake,fake2", caches="none,dual", n="2")
    options.update({"batch-size": "2", "max-new-tokens": "8", "block-size": "4"})
    args = [item for key, value in options.items() for item in (f"--{key}", value)]
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"models: [{models}]\n" + "".join(f"{k.replace('-', '_')}: {v}\n" for k, v in options.items()))
    for out, command in (("cli", ["--models", models, *args]), ("yaml", ["--config", str(grid)])):
        assert main(["bench", *command, "--out", str(tmp_path / out), "--no-progress"]) == 0
        captured = capsys.readouterr()
        notes = [line for line in captured.err.splitlines() if "skipping" in line]
        assert len(notes) == len(set(notes)) == 3, notes  # wedlm on llada, threshold on wedlm, wedlm + dual
        assert any("skipping sampler 'threshold'" in n and "use --samplers wedlm" in n.lower() for n in notes)
        assert any("skipping wedlm with cache 'dual'" in n and "--caches none" in n for n in notes)
        assert not any("dllm.samplers" in n or "cache='default'" in n or "cache=None" in n for n in notes)
        cells = {(read(p)[0]["cell"]["family"], read(p)[0]["cell"]["sampler"]) for p in jsonl_files(tmp_path / out)}
        assert cells == {("llada", "llada"), ("llada", "threshold"), ("wedlm", "wedlm")}
        assert "| fake |" in captured.out


def test_ctrl_c_is_one_line_and_the_same_command_resumes(checkpoint_dir, fake_tasks, tmp_path, capsys, monkeypatch):
    """issue 31 item 12: Ctrl-C in ``dllm bench`` is one line (exit status 130) that says the finished work is kept
    and how to resume; the same command then runs only what was left."""
    counter = CountingGenerate(monkeypatch)
    original = Sampler.generate

    def interrupted(sampler, *args, **kwargs):
        if counter.calls == 3:  # after the warm-up and the first cell's two batches: Ctrl-C
            raise KeyboardInterrupt
        return original(sampler, *args, **kwargs)

    monkeypatch.setattr(Sampler, "generate", interrupted)
    out = tmp_path / "out"
    args = ["bench", "--models", str(checkpoint_dir("llada")), "--samplers", "threshold", "--tasks", "fake"]
    args += ["--n", "4", "--batch-size", "2", "--max-new-tokens", "8", "--block-size", "4", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"dllm: interrupted; the finished cells and batches are kept in {out / 'runs'}: resume with the same command"
    )
    assert "Traceback" not in err
    monkeypatch.setattr(Sampler, "generate", original)
    counter = CountingGenerate(monkeypatch)
    assert main([*args, "--no-progress"]) == 0
    assert "1 of 2 cells already finished" in capsys.readouterr().err
    assert counter.calls == 1 + 2  # the warm-up and the second cell's two batches
