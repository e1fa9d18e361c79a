"""What tripped a new user (issue 18, item 12): corrupt checkpoints, CLI mistakes and advice, help texts,
plurals, EOS early stop, plots of a cache sweep, the chat BOS, Prophet without an answer region, the training
script with few steps. Each ends in a clear error, a warning or the right output."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

import dllm
from dllm.bench import report
from dllm.cli import cli_spelling, main
from dllm.core.errors import CheckpointError, ConfigError, DllmWarning, plural
from dllm.core.settings import parse_value
from dllm.models.loading import BUNDLED

# One summary row as dllm.bench.report.summarize writes it (figures made up).
ROW = {
    "task": "pick",
    "model": "tiny-llada",
    "model_name": "tiny-llada",
    "sampler": "threshold",
    "label": "defaults",
    "reference": False,
    "cache": "none",
    "hp": {},
    "generation": {},
    "n": 2,
    "accuracy": 0.5,
    "mean_nfe": 3.0,
    "tokens_per_forward": 1.0,
    "tokens_per_second": 10.0,
    "mean_seconds": 0.1,
    "speedup_nfe": None,
    "speedup_wall": None,
    "note": None,
    "batch_size": 1,
    "environment": None,
}

# -- corrupt checkpoints: the file and the field are named ---------------------------------------------


@pytest.fixture
def bundled_copy(tmp_path):
    """A writable copy of the bundled tiny-llada checkpoint."""
    directory = tmp_path / "ckpt"
    shutil.copytree(BUNDLED["tiny-llada"], directory)
    return directory


def edit_config(directory, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: [c], r"config.json must hold a JSON object .*got a list"),
        (lambda c: {**c, "n_layers": "four"}, r"config.json: bad field n_layers='four' \(a positive integer\)"),
        (lambda c: {**c, "n_heads": None}, r"config.json: bad field n_heads=None \(a positive integer\)"),
        (lambda c: {**c, "d_model": 0, "rope_theta": "big"}, r"bad fields d_model=0 .*; rope_theta='big'"),
        (lambda c: {**c, "eos_token_id": [0, "x"]}, r"eos_token_id=\[0, 'x'\] \(a token id"),
    ],
)
def test_corrupt_config_names_the_file_and_the_field(bundled_copy, change, message):
    edit_config(bundled_copy, change)
    with pytest.raises(CheckpointError, match=message):
        dllm.load(bundled_copy)


def test_null_where_the_official_code_takes_a_default_is_fine(bundled_copy):
    edit_config(bundled_copy, lambda c: {**c, "n_kv_heads": None, "mlp_hidden_size": 512})
    assert dllm.load(bundled_copy).family == "llada"


def test_truncated_weights_name_the_file(bundled_copy):
    weights = bundled_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read as safetensors .*truncated"):
        dllm.load(bundled_copy)


def test_broken_tokenizer_names_the_file(bundled_copy):
    tokenizer = bundled_copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:500])
    with pytest.raises(CheckpointError, match=r"tokenizer.json cannot be read as a tokenizer"):
        dllm.load(bundled_copy)


def test_generation_config_that_is_not_an_object(bundled_copy):
    (bundled_copy / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"generation_config.json must hold a JSON object"):
        dllm.load(bundled_copy)


def test_corrupt_checkpoint_is_one_error_line_in_the_cli(bundled_copy, capsys):
    from dllm.cli import main

    edit_config(bundled_copy, lambda c: {**c, "n_layers": "four"})
    assert main(["generate", "Sort the list: 3 1\n", "--model", str(bundled_copy)]) == 2
    assert "dllm: error:" in capsys.readouterr().err


# -- the command line ----------------------------------------------------------------------------------

SORT = "Sort the list: 14 7 9\n"


def test_set_takes_inf_as_the_readme_writes_it(capsys):
    assert parse_value("inf") == parse_value("Infinity") == parse_value("INF") == float("inf")
    assert parse_value("-inf") == float("-inf") and parse_value("info") == "info"
    assert main(["generate", SORT, "--sampler", "adablock", "--set", "delimiter_threshold=inf"]) == 0
    assert capsys.readouterr().out.strip() == "7 9 14"


def test_cli_advice_is_in_cli_spelling(capsys):
    assert main(["generate", SORT, "--model", "tiny-sdar", "--block-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("Pass --block-size 4")
    assert main(["generate", SORT, "--set", "cfg_scale=1.0", "--cache", "dual"]) == 2
    err = capsys.readouterr().err
    assert "--cache none" in err and "cache=None" not in err
    message = "pass cache=None; max_new_tokens=20 is not a multiple of block_size=8; use e.g. max_new_tokens=24"
    assert cli_spelling(message, "generate") == (
        "pass --cache none; max_new_tokens=20 is not a multiple of block_size=8; use e.g. --max-new-tokens 24"
    )
    assert cli_spelling("use steps=G/2 or cache=None", "bench") == "use --set steps=G/2 or --caches recompute"
    assert cli_spelling("Use cache='default' or cache=None", "bench") == "Use --caches none or --caches recompute"
    assert main(["generate", SORT, "--kernel", "triton"]) == 2  # no GPU, no interpreter: the CPU refuses it
    err = capsys.readouterr().err
    assert "--kernel torch" in err and "kernel='torch'" not in err
    # library callers keep Python's spelling: only the command line translates
    with pytest.raises(ConfigError, match=r"Pass block_size=4"):
        dllm.samplers.get("sdar").generate(dllm.load("tiny-sdar"), SORT, block_size=8)


def test_help_texts(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "keeps its trained block size" not in text and "(tiny-sdar: 4)" in text and "another is refused" in text
    assert "--eos-early-stop, --no-eos-early-stop" in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: none, which keeps a sampler's own exact cache" in text and "recompute: no cache at all" in text


def test_counts_of_one_are_singular(capsys):
    args = ["generate", SORT, "--steps", "3", "--steps-per-block", "2", "--max-new-tokens", "8", "--block-size", "8"]
    assert main(args) == 2
    assert "disagree: with 1 block, steps" in capsys.readouterr().err
    assert plural(1, "thread") == "1 thread" and plural(4, "thread") == "4 threads"
    env = {"dllm": "x", "torch": "y", "device": "cpu", "device_name": "z", "dtype": "float32", "threads": 1}
    assert "float32, 1 thread," in report.markdown([{**ROW, "environment": env}])
    assert "1 thread," in report.hardware([{**ROW, "environment": env}]) + ","


def test_eos_early_stop_from_the_command_line(capsys):
    args = ["generate", SORT, "--steps", "16", "--block-size", "8"]
    assert main(args) == 0
    early = capsys.readouterr()
    assert main([*args, "--no-eos-early-stop"]) == 0
    full = capsys.readouterr()
    assert early.out == full.out  # the same text up to the first EOS
    assert "NFE 4 |" in early.err and "NFE 16 |" in full.err  # four blocks of four steps, or the first only
    assert main([*args, "--eos-early-stop"]) == 0
    assert "NFE 4 |" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_bench_out_is_checked_before_the_model_loads(tmp_path, monkeypatch, capsys, where):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    out = taken if where == "file" else taken / "results"

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(dllm, "load", no_load)
    args = ["bench", "--samplers", "threshold", "--tasks", "pick", "--n", "2", "--no-progress", "--out", str(out)]
    assert main(args) == 2
    assert f"--out {out}: {taken} is a file" in capsys.readouterr().err


# -- chat (its BOS; none on the bundled models; an empty chat), Prophet without an answer region ----------------


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "wedlm"])
def test_chat_writes_one_bos(tiny, family):
    model = tiny(family)  # a tiny checkpoint's tokenizer has dllm.models.tiny's chat template
    out = dllm.samplers.reference(model.family).generate(model, [{"role": "user", "content": SORT}], max_new_tokens=8)
    ids = out.sequences[0, : out.prompt_width].tolist()
    assert ids.count(model.bos_id) == 2 and ids[0] == model.bos_id  # the conversation's, the assistant turn's
    assert ids[1] != model.bos_id


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_chat_on_a_bundled_model_is_refused_as_outside_its_training(name, capsys):
    """The bundled models were trained on plain prompts: chat turns gave wrong answers silently ('7077 14',
    '7 answer' for 'Sort the list: 14 7 9'), so they have no chat template and chat messages are refused."""
    model = dllm.load(name)
    assert not model.tokenizer.chat_template and not (BUNDLED[name] / "chat_template.jinja").exists()
    sampler = dllm.samplers.reference(model.family)
    with pytest.raises(ConfigError, match=f"{name} has no chat template.*not trained on chat turns"):
        sampler.generate(model, [{"role": "user", "content": SORT}], max_new_tokens=8)
    assert main(["generate", SORT, "--chat", "--model", name]) == 2
    err = capsys.readouterr().err
    assert "dllm: error:" in err and "without --chat" in err


def test_an_empty_chat_prompt_is_refused_as_an_empty_prompt(tiny, capsys):
    """`dllm generate "" --chat` printed output where `dllm generate ""` is refused."""
    model = tiny("llada")
    for messages in ([{"role": "user", "content": ""}], [{"role": "system", "content": ""}, {"role": "user"}]):
        with pytest.raises(ConfigError, match="empty prompt: the chat messages hold no text"):
            dllm.samplers.get("llada").generate(model, messages, max_new_tokens=8)
    assert main(["generate", "", "--chat"]) == 2
    assert "dllm: error: empty prompt" in capsys.readouterr().err


def test_prophet_without_an_answer_region_warns_that_it_never_exits(capsys):
    model = dllm.load("tiny-llada")
    with pytest.warns(DllmWarning, match="never exits early"):
        dllm.samplers.get("prophet").generate(model, SORT, max_new_tokens=8)
    with pytest.warns(DllmWarning, match="analyze_gap=False never exits"):
        dllm.samplers.get("prophet", answer_offset=0, analyze_gap=False).generate(model, SORT, max_new_tokens=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dllm.samplers.get("prophet", answer_offset=0).generate(model, SORT, max_new_tokens=8)
    assert main(["generate", SORT, "--sampler", "prophet", "--max-new-tokens", "8"]) == 0
    assert "dllm: warning: prophet with no answer region" in capsys.readouterr().err


# -- advice in the command line's words (issue 31 item 14) ------------------------------------------------


def test_advice_fits_the_command_line_and_the_model(bundled_copy, capsys):
    # --block-size 100000 advised --max-new-tokens 100000, past the bundled models' 320 tokens
    assert main(["generate", SORT, "--block-size", "100000"]) == 2
    err = capsys.readouterr().err
    assert "use e.g. --block-size 32, a divisor of 32" in err and "--max-new-tokens 100000" not in err
    assert main(["generate", SORT, "--block-size", "12"]) == 2
    assert "use e.g. --max-new-tokens 36 or --block-size 8, a divisor of 32" in capsys.readouterr().err
    # the prophet + window refusal advised WeDLM's stream cache on a LLaDA model; on SDAR its block cache is advice
    assert main(["generate", SORT, "--sampler", "prophet", "--cache", "window"]) == 2
    err = capsys.readouterr().err
    assert "Use the 'prefix', 'dual', 'dkv' cache or none" in err and "stream" not in err
    assert main(["generate", SORT, "--model", "tiny-sdar", "--sampler", "sched", "--cache", "window"]) == 2
    assert "'dkv', 'block', 'subblock' cache or none" in capsys.readouterr().err
    # a model without a tokenizer: the command line cannot "pass token ids"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bundled_copy / name).unlink()
    assert main(["generate", SORT, "--model", str(bundled_copy)]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "dllm generate takes text" in err and "pass token ids (" not in err
    message = "the tokenizer has no chat template; pass plain text or token ids instead of messages"
    assert cli_spelling(message, "generate") == "the tokenizer has no chat template; leave out --chat"


def test_settings_that_do_nothing_are_said(capsys):
    """--steps beyond the tokens ran at NFE 32 while the line said "steps 1000"; --seed at temperature 0 was ignored
    silently; WeDLM's line said block_size 32 (it decodes in a window)."""
    assert main(["generate", SORT, "--steps", "64", "--block-size", "8", "--seed", "3"]) == 0
    err = capsys.readouterr().err
    assert "--steps 64 gives 16 steps per block of 8 tokens, more steps than tokens" in err
    assert "--seed 3 has no effect at --temperature 0" in err
    assert main(["generate", SORT, "--seed", "3", "--temperature", "1.0"]) == 0
    assert "--seed" not in capsys.readouterr().err
    assert main(["generate", SORT, "--model", "tiny-wedlm"]) == 0
    err = capsys.readouterr().err
    assert "max_new_tokens 32, window 16, steps adaptive" in err and "block_size" not in err


def test_bench_notes_and_advice_name_settings_as_the_command_line_does():
    """issue 31 item 14: any hyper-parameter in advice is a --set (the bench's ete note said lookahead_blocks=0); the
    classifier-free guidance refusal speaks of a block cache only on a block-causal model."""
    note = "ete's cross-block decoding (lookahead_blocks=1) ...: pass lookahead_blocks=0 (exploration still applies)"
    assert cli_spelling(note, "bench").endswith("pass --set lookahead_blocks=0 (exploration still applies)")
    assert cli_spelling("pass threshold=0.8.", "generate") == "pass --set threshold=0.8."
    assert cli_spelling("pass base=dllm.samplers.get('x')", "generate") == "pass base=dllm.samplers.get('x')"
    guided = dllm.samplers.get("llada", cfg_scale=1.0)
    with pytest.raises(ConfigError) as refused:
        guided.check_cache(dllm.load("tiny-llada"), dllm.caches.get("dual"))
    assert "block-causal" not in str(refused.value)
    with pytest.raises(ConfigError, match="this block-causal model uses an exact block cache by default"):
        guided.check_cache(dllm.load("tiny-sdar"), dllm.caches.get("block"))
