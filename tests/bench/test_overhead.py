"""``python -m dllm.bench.overhead``: its options and its progress (issue 31 items 8 and 12)."""

from __future__ import annotations

import pytest

from dllm.bench import overhead


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--models", "bogus"], "--models: 'bogus' is neither a checkpoint directory"),
        (["--samplers", "treshold"], "--samplers: unknown sampler 'treshold'; available: llada"),
        (["--batch-sizes", "1,0"], "--batch-sizes takes positive integers"),
    ],
)
def test_bad_options_are_one_line_before_anything_runs(argv, said, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(overhead, "_workload", never)
    assert overhead.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m dllm.bench.overhead: error: ") and said in err and len(err.splitlines()) == 1


def test_the_default_is_the_quick_bundled_models_with_a_progress_bar(checkpoint_dir, monkeypatch, capsys):
    """The 135 M model (minutes per run) is not in the default; the runs are counted on stderr, and a model whose
    runs take long is announced with their expected duration."""
    assert overhead.command_line().get_default("models") == "tiny-llada,tiny-dream,tiny-sdar"
    monkeypatch.setattr(overhead, "SAY_AFTER", 0.0)
    argv = ["--models", str(checkpoint_dir("llada")), "--samplers", "reference,threshold", "--batch-sizes", "1"]
    assert overhead.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count(f"| {checkpoint_dir('llada')} |") == 2
    assert "2/2" in err and "run" in err  # the bar
    assert f"{checkpoint_dir('llada')} at batch 1: about " in err
