"""The command line as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dllm
from dllm.cli import docstring_summary, main
from dllm.core.settings import parse_settings


def test_generate_prints_text_and_figures(checkpoint_dir, capsys):
    assert (
        main(
            [
                "generate",
                "12+35=",
                "--model",
                str(checkpoint_dir("llada")),
                "--max-new-tokens",
                "16",
                "--block-size",
                "8",
                "--sampler",
                "threshold",
                "--set",
                "threshold=0.8",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out.strip()
    assert "NFE" in err and "tokens/forward" in err and "tokens/s" in err


def test_generate_uses_the_model_family_reference_sampler_by_default(checkpoint_dir, capsys):
    # one token per step (Dream's official time grid commits nothing at its first step and two at its last; SDAR's
    # blocks hold a ninth slot past the 8 answered tokens, decoded as the official code does)
    for family, figure in (("llada", "NFE 8 |"), ("dream", "NFE 7 |"), ("sdar", "NFE 9 | tokens 8 |")):
        assert main(["generate", "1 2", "--model", str(checkpoint_dir(family)), "--max-new-tokens", "8"]) == 0
        err = capsys.readouterr().err
        assert err.startswith(f"[{family} | {family}] NFE") and figure in err
    args = ["generate", "1 2", "--model", str(checkpoint_dir("sdar")), "--max-new-tokens", "8"]
    assert main([*args, "--set", "remasking_strategy=low_confidence_dynamic", "--set", "confidence_threshold=0.0"]) == 0
    assert "tokens/forward 1.00 |" not in capsys.readouterr().err  # settings apply: all tokens above 0 at once
    assert main([*args, "--set", "bogus=1"]) == 2
    # a local LLaDA2 directory: its reference (one token per step) and LLaDA2.1's editing at another block size
    args = ["generate", "1 2", "--model", str(checkpoint_dir("llada2")), "--max-new-tokens", "8"]
    assert main(args) == 0 and "[llada2 | llada2] NFE" in capsys.readouterr().err
    assert main([*args, "--sampler", "llada21", "--set", "editing_threshold=0.0", "--block-size", "8"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("[llada2 | llada21] NFE") and "block_size 8" in err
    # a local DiffusionGemma directory: entropy_bound, its canvases (block_size 4) rounded up; a seed, no warning
    args = ["generate", "1 2", "--model", str(checkpoint_dir("diffusion_gemma")), "--max-new-tokens", "6"]
    assert main([*args, "--set", "max_denoising_steps=3", "--seed", "2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("[diffusion_gemma | entropy_bound] NFE 6 |") and "block_size 4" in err
    assert "has no effect" not in err
    assert main([*args, "--temperature", "0.5"]) == 2 and "temperatures are its own schedule" in capsys.readouterr().err
    assert main([*args, "--set", "max_denoising_steps=2", "--steps", "8"]) == 0
    assert "at most max_denoising_steps forwards (--set max_denoising_steps=N)" in capsys.readouterr().err


def test_generate_reports_bad_input_without_a_traceback(checkpoint_dir, capsys):
    assert (
        main(["generate", "x", "--model", str(checkpoint_dir("llada")), "--max-new-tokens", "10", "--block-size", "4"])
        == 2
    )
    assert "not a multiple of block_size" in capsys.readouterr().err


def test_samplers_lists_defaults(capsys):
    assert main(["samplers"]) == 0
    out = capsys.readouterr().out
    assert "threshold=0.9" in out and "remasking_strategy='low_confidence_dynamic'" in out


@pytest.mark.parametrize("command", ["samplers", "caches"])
def test_the_listings_keep_their_columns_and_whole_summaries(command, capsys, monkeypatch):
    """issue 39 item 8: descriptions were cut mid-sentence, and names longer than ten characters (credit_fusion,
    entropy_bound) pushed their text out of the column."""
    monkeypatch.setenv("COLUMNS", "100")
    registry = dllm.samplers.registry.SAMPLERS if command == "samplers" else dllm.caches.CACHES
    names = dllm.samplers.names() if command == "samplers" else dllm.caches.names()
    assert main([command]) == 0
    lines = capsys.readouterr().out.splitlines()
    column = max(map(len, names)) + 1
    entries, name = {}, None
    for line in lines:
        assert len(line) <= 100 and line[column - 1] == " " and line[column] != " ", line
        name = line[:column].strip() or name
        entries.setdefault(name, []).append(line[column:])
    assert list(entries) == names
    for name, text in entries.items():
        summary = " ".join(text).removeprefix("[experimental] ")
        first = " ".join((registry.get(name).__doc__ or "").strip().split("\n\n")[0].split())
        assert summary.startswith(docstring_summary(registry.get(name))) and first.endswith("."), name
        assert len(first) <= 300, f"{name}: the docstring's first paragraph is its summary: keep it short"


def test_set_values_are_typed():
    assert parse_settings(["threshold=0.8", "alg=entropy", "top_k=5", "logits_eos_inf=true", "alg_temp=None"]) == {
        "threshold": 0.8,
        "alg": "entropy",
        "top_k": 5,
        "logits_eos_inf": True,
        "alg_temp": None,
    }


def test_module_entry_point(checkpoint_dir):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dllm",
            "generate",
            "hi",
            "--model",
            str(checkpoint_dir("sdar")),
            "--sampler",
            "sdar",
            "--max-new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "NFE" in run.stderr


def test_generate_and_samplers_with_a_part_over_a_base(checkpoint_dir, capsys, exit_at):
    args = ["generate", "ab", "--model", str(checkpoint_dir("llada")), "--max-new-tokens", "8", "--block-size", "4"]
    assert main([*args, "--sampler", "exit_at", "--set", "base=threshold", "--set", "threshold=0.8"]) == 0
    assert "[llada | exit_at(threshold)] NFE 2 " in capsys.readouterr().err
    assert main([*args, "--sampler", "exit_at", "--set", "threshold=0.8"]) == 2  # the default base has no threshold
    assert "'exit_at' over base 'llada' has no hyper-parameter 'threshold'" in capsys.readouterr().err
    assert main(["samplers"]) == 0
    assert "exit_at" in (listing := capsys.readouterr().out) and "base='llada' (any sampler" in listing


def test_generate_with_a_cache_routes_its_settings(checkpoint_dir, capsys, monkeypatch):
    args = ["generate", "ab", "--model", str(checkpoint_dir("llada")), "--max-new-tokens", "8", "--block-size", "4"]
    seen = []
    original = dllm.caches.get
    monkeypatch.setattr(dllm.caches, "get", lambda name, **hp: seen.append((name, hp)) or original(name, **hp))
    assert main([*args, "--sampler", "llada", "--cache", "dkv", "--set", "cache_reloading_step=2"]) == 0
    assert "[llada | llada + cache dkv] NFE" in capsys.readouterr().err
    assert seen[-1] == ("dkv", {"cache_reloading_step": 2})
    assert main([*args, "--sampler", "threshold", "--cache", "dual", "--set", "cache.refresh_steps=2"]) == 0
    assert seen[-1] == ("dual", {"refresh_steps": 2})
    assert main([*args, "--cache", "dkv", "--set", "bogus=1"]) == 2  # neither the sampler's nor the cache's
    assert "has no hyper-parameter 'bogus'" in capsys.readouterr().err
    assert main([*args, "--set", "cache.refresh_steps=1"]) == 2
    assert "no cache selected" in capsys.readouterr().err
    assert main([*args, "--cache", "nope"]) == 2
    assert "unknown cache 'nope'" in capsys.readouterr().err


def test_a_key_of_both_the_sampler_and_the_cache_is_ambiguous():
    from dllm.cli import split_settings

    with pytest.raises(dllm.ConfigError, match="both the sampler and cache 'dual'.*cache.refresh_steps"):
        split_settings({"refresh_steps": 1}, {"refresh_steps", "threshold"}, "dual")
    assert split_settings({"cache.refresh_steps": 1, "threshold": 0.5}, {"refresh_steps", "threshold"}, "dual") == (
        {"threshold": 0.5},
        {"refresh_steps": 1},
    )


def test_caches_lists_every_cache_with_its_defaults(capsys):
    assert main(["caches"]) == 0
    printed = capsys.readouterr().out
    for name in dllm.caches.names():
        assert f"{name} " in printed
    assert "cache_reloading_step=1" in printed and "refresh_prompt=False" in printed


def test_generate_chooses_the_kernel_and_prints_which_ran(checkpoint_dir, capsys, monkeypatch):
    args = ["generate", "1 2", "--model", str(checkpoint_dir("llada")), "--max-new-tokens", "8"]
    assert main([*args, "--kernel", "torch"]) == 0
    assert "| kernel torch" in capsys.readouterr().err
    assert main(args) == 0  # auto: the reference on the CPU
    assert "| kernel torch" in capsys.readouterr().err
    assert main([*args, "--kernel", "fast"]) == 2
    assert "kernel must be one of 'auto', 'torch', 'triton'" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main([*args, "--kernel", "triton"]) == 2
    assert "kernel='triton' cannot score on cpu" in capsys.readouterr().err


def test_start_up_imports_only_what_it_needs():
    """issue 31 item 16: ``dllm --help`` and ``import dllm`` import no torch (seconds); a bundled model loads without
    importing ``torch._dynamo`` (meta-device initialisation used to) or AutoTokenizer's table of every model."""
    code = """if True:
        import sys
        from dllm.cli import docstring_summary, main
        try:
            main(["--help"])
        except SystemExit:
            pass
        print("torch" in sys.modules, file=sys.stderr)
        import dllm
        dllm.load("tiny-llada")
        auto = "transformers.models.auto.tokenization_auto"
        print("torch._dynamo" in sys.modules, auto in sys.modules, file=sys.stderr)
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage: dllm" in run.stdout and "WeDLM" in run.stdout
    assert run.stderr.split() == ["False", "False", "False"]


def test_the_sampler_option_names_each_familys_reference_sampler_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in dllm.models.registry.names():
        sampler = dllm.models.registry.get(name).reference_sampler[0]
        assert (sampler if sampler == name else f"{sampler} for {name}") in text.split("reference sampler: ")[1]


def test_help_and_package_description_name_every_model_family(capsys):
    """issue 31 item 14: ``dllm --help``, pyproject.toml's description and the README's first line omitted WeDLM."""
    import re
    from pathlib import Path

    from dllm.models import registry

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit):
        main(["--help"])
    texts = {
        "dllm --help": capsys.readouterr().out,
        "pyproject.toml": re.search(r'^description = "(.*)"$', (root / "pyproject.toml").read_text(), re.M)[1],
        "README.md": (root / "README.md").read_text().split("\n\n")[1],
    }
    prose = {"FastDLLMv2": "Fast-dLLM v2"}  # an adapter whose class name is not how the text writes it
    for family in registry.FAMILIES.values():
        name = prose.get(family.adapter.__name__, family.adapter.__name__)
        for where, text in texts.items():
            assert name in " ".join(text.split()), (where, name)


def test_ctrl_c_in_generate_is_one_line(checkpoint_dir, capsys, monkeypatch):
    """issue 31 item 12: Ctrl-C (e.g. while ``--compile`` compiles) ends in ``dllm: interrupted``, exit status 130."""
    from dllm.samplers.base import Sampler

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Sampler, "generate", interrupted)
    assert main(["generate", "1 2", "--model", str(checkpoint_dir("llada")), "--compile", "eager"]) == 130
    assert capsys.readouterr().err == "dllm: interrupted\n"


LISTS = ["Sort the list: 14 7 9", "Reverse the list: 3 17 0 8", "Pick 2 different items from the list: 26 22 19 21"]


def test_many_prompts_from_a_file_or_stdin_in_batches(tmp_path, capsys, monkeypatch):
    """issue 31 item 15: --prompts FILE (one per line, each ending with its line break as the bundled models'
    prompts do; blank lines skipped) or stdin, --batch-size at a time: the texts of single runs, in order."""
    import io
    import json

    alone = []
    for prompt in LISTS:
        assert main(["generate", prompt + "\n"]) == 0
        alone.append(capsys.readouterr().out)
    path = tmp_path / "prompts.txt"
    path.write_text(f"{LISTS[0]}\n\n{LISTS[1]}\r\n{LISTS[2]}")  # a blank line, a CRLF, no final line break
    assert main(["generate", "--prompts", str(path), "--batch-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(alone)
    assert "prompts 1-2 of 3 | NFE" in err and "prompt 3 of 3 | NFE" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(path.read_text()))
    assert main(["generate", "--prompts", "-", "--jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == [p + "\n" for p in LISTS]
    assert [r["text"] + "\n" for r in rows] == alone and all(r["tokens"] > 0 and r["nfe"] > 0 for r in rows)


def test_json_lines_prompts_and_refusals(tmp_path, capsys):
    """JSON lines: a JSON string or {"prompt": text or chat messages}, used exactly (no line break added)."""
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": LISTS[0] + "\n", "id": 7}) + "\n" + json.dumps(LISTS[1] + "\n") + "\n")
    assert main(["generate", "--prompts", str(path), "--jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == [LISTS[0] + "\n", LISTS[1] + "\n"] and rows[0]["text"] == "7 9 14"
    assert main(["generate", "x", "--prompts", str(path)]) == 2
    assert "give a PROMPT or --prompts FILE, not both" in capsys.readouterr().err
    assert main(["generate"]) == 2
    assert "give a PROMPT or --prompts FILE (" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert main(["generate", "--prompts", str(tmp_path / "blank.txt")]) == 2
    assert "no prompt in it" in capsys.readouterr().err
    assert main(["generate", "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert main(["generate", LISTS[0] + "\n", "--batch-size", "0"]) == 2
    assert "--batch-size must be a positive integer" in capsys.readouterr().err


def test_a_bad_json_line_is_an_error_naming_it_not_text(tmp_path, capsys):
    """issue 39 item 5: a file is JSON lines or text; in JSON lines a line that is not a JSON prompt is an error
    naming the line, never a reason to read the whole file as text prompts."""
    import json

    good = json.dumps({"prompt": LISTS[0] + "\n"})
    cases = {
        "trailing comma": (f"{good}\n{good},\n", "line 2 is not JSON"),
        "a number": (f"{good}\n\n" + json.dumps({"prompt": 5}) + "\n", "line 3: the prompt 5 is neither text"),
        "no prompt field": (json.dumps({"text": "x"}) + "\n", 'line 1: the object has no "prompt" field'),
        "a list of numbers": (f"{good}\n[1, 2]\n", "line 2: the prompt [1, 2] is neither text nor chat"),
    }
    for name, (text, words) in cases.items():
        path = tmp_path / f"{name}.txt"  # not named .jsonl: the lines themselves make it JSON lines
        path.write_text(text)
        assert main(["generate", "--prompts", str(path)]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"dllm: error: --prompts {path} ") and words in err, (name, err)
        assert err.count("\n") == 1
    named = tmp_path / "prompts.jsonl"
    named.write_text(LISTS[0] + "\n")  # a .jsonl file is JSON lines whatever its lines hold
    assert main(["generate", "--prompts", str(named)]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text(f'{LISTS[0]}\n"{LISTS[1]}" twice\n')  # a text line may start with a quote
    assert main(["generate", "--prompts", str(text), "--jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == [LISTS[0] + "\n", f'"{LISTS[1]}" twice\n']


def test_text_that_is_not_unicode_is_one_error_line(tmp_path, capsys, monkeypatch):
    """issue 39 item 4: a lone surrogate (bytes that are not UTF-8 on the command line; an unpaired escape in JSON
    lines) is refused before the model loads, naming where it is."""
    import io

    monkeypatch.setattr("dllm.load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", "\udcff x\n"]) == 2  # what Python makes of argv bytes that are not UTF-8
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: PROMPT is not valid Unicode text: character 0 is a lone surrogate")
    assert err.count("\n") == 1
    monkeypatch.setattr("sys.stdin", io.StringIO('"ok\\n"\n"\\ud800 x\\n"\n'))
    assert main(["generate", "--prompts", "-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: --prompts - line 2 is not valid Unicode text") and err.count("\n") == 1
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": [{"role": "user", "content": "\\udc00"}]}\n'))
    assert main(["generate", "--prompts", "-", "--chat"]) == 2
    assert "line 1 is not valid Unicode text" in capsys.readouterr().err


def test_threads_sets_torchs_cpu_threads(monkeypatch, capsys):
    import torch

    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    assert main(["generate", LISTS[0] + "\n", "--threads", "1"]) == 0
    assert asked == [1]
    assert main(["generate", LISTS[0] + "\n", "--threads", "0"]) == 2
    assert "--threads must be a positive integer" in capsys.readouterr().err


def test_readme_set_up_says_the_python_version_and_the_venv_step():
    """issue 31 item 15: the set-up named neither the Python version nor the virtual environment it expects."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    minimum = re.search(r'^requires-python = ">=([0-9.]+)"$', (root / "pyproject.toml").read_text(), re.M)[1]
    set_up = (root / "README.md").read_text().partition("## Set-up")[2].partition("\n## ")[0]
    assert f"Python {minimum} or newer" in set_up and "python3 -m venv .venv" in set_up
