"""``python -m dllm.bench.speed``: the GPU benchmark's CPU-side behaviour (no GPU at test time)."""

from __future__ import annotations

import json

import pytest
import torch

from dllm.bench import speed
from dllm.models.loading import build


def test_without_a_gpu_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert speed.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_the_shapes_are_the_published_models():
    """LLaDA-8B has 8.02 B parameters, Dream-7B (Qwen2.5-7B) 7.62 B (counted on the meta device)."""
    counts = {}
    for name, shape in speed.SHAPES.items():
        with torch.device("meta"):
            model = build(speed.config_of(shape))
        counts[name] = sum(p.numel() for p in model.parameters()) / 1e9
    assert round(counts["llada-8b"], 2) == 8.02 and round(counts["dream-7b"], 2) == 7.62


def test_roofline_is_the_weight_read_below_the_knee_and_compute_above():
    model = speed.build_model(speed.SMALL["llada-8b"], torch.device("cpu"), torch.bfloat16)
    assert speed.device_limits("NVIDIA H100 80GB HBM3", None, None) == (3.35e12, 989e12)
    assert speed.device_limits("NVIDIA H200", None, None)[0] == 4.8e12
    assert speed.device_limits("Some GPU", None, None) is None
    embedding = model.embedding.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    head = model.output.weight.numel()
    limits = (1e9, 1e12)
    assert speed.roofline_ms(model, 1, 1, limits) == 1000 * (total - embedding) * 2 / 1e9  # bf16 weights read
    big = speed.roofline_ms(model, 1000, 1000, limits)
    assert big == 1000 * 2 * (total - embedding - head) * 1e6 / 1e12  # matrix products of 1e6 tokens


def test_cpu_small_smoke_run_writes_the_table(tmp_path, capsys):
    argv = ["--device", "cpu", "--small", "--batch-sizes", "1", "--caches", "none,dual", "--bandwidth", "1e11"]
    assert speed.main(argv + ["--flops", "1e12", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "speed-cpu-small-b1-none-dual.md").read_text()
    assert "| llada-8b | fixed-4 | dual | 1 |" in table and "| dream-7b | roofline | full canvas, TPF 4 | 1 |" in table
    rows = json.loads((tmp_path / "speed-cpu-small-b1-none-dual.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # shapes x settings x caches
    g = speed.SMALL_RUN["generation"]
    for row in rows:
        assert row["tokens_per_forward"] == (4.0 if row["setting"] == "fixed-4" else 1.0)  # random weights
        assert row["forwards"] == g // row["tokens_per_forward"] and row["tokens_per_s"] > 0
        assert row["peak_gib"] is None
        assert 0 < row["model_share"] < 1  # the forwards' share of the wall time (here: host time)


def test_export_writes_the_same_weights_and_prompts_for_the_official_code(tmp_path, capsys):
    """``--export DIR``: the benchmark's random model in the published layout (read back unchanged) and its
    prompts, so the official Fast-dLLM code runs on the same weights and tokens."""
    import dllm

    assert speed.main(["--small", "--shapes", "llada-8b", "--batch-sizes", "2", "--export", str(tmp_path)]) == 0
    built = speed.build_model(speed.SMALL["llada-8b"], torch.device("cpu"), torch.bfloat16)
    loaded = dllm.load(str(tmp_path / "llada-8b"), device="cpu", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "llada-8b" / "config.json").read_text())["model_type"] == "llada"
    for name, tensor in built.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    prompts = torch.load(tmp_path / "prompts-llada-8b-b2.pt")
    assert prompts.shape == (2, speed.SMALL_RUN["prompt"])
    assert torch.equal(prompts, speed.prompts_of(2, speed.SMALL_RUN["prompt"], built.vocab_size))


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--device", "cpu"], "--device cpu without --small builds the full LLaDA-8B / Dream-7B shapes"),
        (["--caches", "bogus"], "--caches: unknown 'bogus'; choose from none, prefix, dual"),
        (["--batch-sizes", "0"], "--batch-sizes takes positive integers"),
        (["--settings", "fixed-8"], "--settings: unknown 'fixed-8'; choose from threshold, fixed-4"),
        (["--shapes", "llada-7b"], "--shapes: unknown 'llada-7b'"),
    ],
)
def test_bad_options_are_one_line_before_any_model_is_built(argv, said, monkeypatch, capsys):
    """issue 31 items 8 and 12: the full 8B shape on the CPU (16 GB, no output for minutes) is refused with the
    --small advice; an unknown cache, setting or shape and a batch size of 0 name the option, in one line."""

    def never(*args, **kwargs):
        raise AssertionError("a model was built before the options were checked")

    monkeypatch.setattr(speed, "build_model", never)
    assert speed.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m dllm.bench.speed: error: ") and said in err and len(err.splitlines()) == 1
