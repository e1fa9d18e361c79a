"""The rough edges a new user hit trying the README (issue 14, section 3): each input below used to end in
a traceback, a silent no-op or a misleading message; each now ends in a clear error or a warning."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import dllm
from dllm import tasks as bench_tasks
from dllm.bench import runner
from dllm.bench.records import cell_files, read_lines
from dllm.cli import main
from dllm.core.errors import ConfigError, DllmWarning
from dllm.models import loading
from dllm.tasks import arith

# -- 1. typed hyper-parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,hp,wanted",
    [
        (
            "threshold",
            {"threshold": "abc"},
            r"threshold must be a number in \[0, 1\] \(default 0.9\), got 'abc' \(str\)",
        ),
        ("dream", {"top_k": 1.5}, "top_k must be an integer >= 0 or None"),
        ("dream", {"alg_temp": "warm"}, "alg_temp must be a finite number >= 0 or None"),
        ("llada", {"logits_eos_inf": "yes"}, "logits_eos_inf must be True or False"),
        ("sdar", {"remasking_strategy": 3}, "remasking_strategy must be one of 'low_confidence_dynamic'"),
        ("factor", {"strict_prefix": 1}, "strict_prefix must be True or False"),
    ],
)
def test_a_wrong_typed_hyper_parameter_names_the_key_and_its_type(name, hp, wanted):
    with pytest.raises(ConfigError, match=wanted):
        dllm.samplers.get(name, **hp)


def test_well_typed_values_still_pass():
    assert dllm.samplers.get("threshold", threshold=1).threshold == 1  # an integer is a number
    assert dllm.samplers.get("dream", top_k=None, top_p=0.9, alg_temp=None).top_p == 0.9


def test_cli_set_with_a_wrong_type_is_an_error_not_a_traceback(capsys):
    args = ["generate", "Sort the list: 3 1\n", "--sampler", "threshold", "--set", "threshold=abc"]
    assert main(args) == 2
    assert "threshold must be a number in [0, 1] (default 0.9), got 'abc' (str)" in capsys.readouterr().err
    assert main(["bench", "--samplers", "threshold", "--set", "threshold=abc", "--n", "2", "--no-progress"]) == 2
    assert "threshold must be a number" in capsys.readouterr().err
    assert main(["bench", "--samplers", "llada", "--set", "temperature=hot", "--n", "2", "--no-progress"]) == 2
    assert "temperature must be a number >= 0" in capsys.readouterr().err


def test_a_part_over_a_base_checks_both_types(exit_at):
    with pytest.raises(ConfigError, match="'exit_at': at must be an integer"):
        dllm.samplers.get("exit_at", at="two")
    with pytest.raises(ConfigError, match="'threshold': threshold must be a number"):
        dllm.samplers.get("exit_at", base="threshold", threshold="high")


# -- 2. dtypes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp32", torch.float32),
        ("float", torch.float32),
        ("torch.float32", torch.float32),
    ],
)
def test_dtype_aliases(name, dtype):
    assert loading.resolve_dtype(name) == dtype


def test_the_default_dtype_on_a_gpu_is_the_checkpoints_else_bfloat16():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert loading.default_dtype({}, cuda) == torch.bfloat16
    assert loading.default_dtype({"torch_dtype": "float16"}, cuda) == torch.float16
    assert loading.default_dtype({"dtype": "float32"}, cuda) == torch.float32  # transformers 5's field name
    assert loading.default_dtype({"torch_dtype": "int8"}, cuda) == torch.bfloat16  # not a weight dtype: ours
    assert loading.default_dtype({"torch_dtype": "bfloat16"}, cpu) == torch.float32


def test_bad_dtypes_name_the_accepted_ones(checkpoint_dir):
    for bad in ("int8", "fp8", "None"):
        with pytest.raises(ConfigError, match=rf"unknown dtype '{bad}'; use float32 \(fp32, float\), bfloat16"):
            dllm.load(checkpoint_dir("llada"), device="cpu", dtype=bad)
    with pytest.raises(ConfigError, match="floating-point dtype, got torch.int8"):
        dllm.load(checkpoint_dir("llada"), device="cpu", dtype=torch.int8)
    model = dllm.load(checkpoint_dir("llada"), device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert dllm.load(checkpoint_dir("llada"), device="cpu", dtype="auto").dtype == torch.float32


# -- 3. devices -------------------------------------------------------------------------------------


def test_cuda_without_cuda_is_a_clear_error(checkpoint_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device 'cuda' was asked for, but this PyTorch .* Use --device cpu"):
        dllm.load(checkpoint_dir("llada"), device="cuda")
    assert main(["generate", "Sort the list: 3 1\n", "--device", "cuda"]) == 2
    assert "device 'cuda' was asked for" in capsys.readouterr().err
    assert main(["bench", "--device", "cuda:1", "--n", "2", "--no-progress"]) == 2  # before any cell runs
    assert "device 'cuda:1' was asked for" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown device 'gpu'; use e.g. 'cpu', 'cuda'"):
        dllm.load(checkpoint_dir("llada"), device="gpu")


# -- 4. bench --n beyond a task's problems ----------------------------------------------------------


def test_arith_problem_count_is_the_enumerated_one():
    assert arith.count_problems() == arith.SIZES
    assert bench_tasks.get("arith").size("test") == arith.SIZES["test"]
    assert bench_tasks.get("listops").size("test") is None  # billions of lists


def test_bench_n_beyond_the_test_split_fails_up_front_with_the_maximum(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("no example is drawn and no model is loaded before the check")

    monkeypatch.setattr(bench_tasks.Task, "examples", refuse)
    monkeypatch.setattr(dllm, "load", refuse)
    assert main(["bench", "--n", "100000", "--tasks", "arith,listops", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"task 'arith' has {arith.SIZES['test']} test problems" in err and f"--n {arith.SIZES['test']}" in err
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=f"ask for at most {arith.SIZES['test']}"):  # the API says it too, at once
        bench_tasks.get("arith").examples("test", arith.SIZES["test"] + 1)


# -- 6. steps with adaptive samplers ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["threshold", "factor", "localleap", "credit", "ete", "adablock"])
def test_adaptive_samplers_ignore_steps(name, tiny):
    """steps / steps_per_block mean nothing to an adaptive sampler, as in the official code (LocalLeap's main()
    passes steps = G // block, one per block): the same tokens and forwards with any value, even one that
    does not divide the blocks; only a value that is not a positive integer is refused."""
    model, sampler = tiny("llada"), dllm.samplers.get(name, **{"threshold": 1.0} if name == "threshold" else {})
    free = sampler.generate(model, "a", max_new_tokens=16, block_size=8)
    assert free.nfe > 2  # so that a cap of one step per block would have changed it
    for given in ({"steps": 2}, {"steps": 3}, {"steps": 16}, {"steps_per_block": 1}):
        out = sampler.generate(model, "a", max_new_tokens=16, block_size=8, **given)
        assert out.sequences.equal(free.sequences) and out.nfe == free.nfe, given
    for bad in ({"steps": 0}, {"steps": True}, {"steps_per_block": 2.0}):
        with pytest.raises(ConfigError, match="must be a positive integer"):
            sampler.generate(model, "a", max_new_tokens=16, block_size=8, **bad)


def test_adaptive_base_under_a_part_ignores_steps_too(tiny, exit_at):
    sampler = dllm.samplers.get("exit_at", base="threshold", threshold=1.0, at=5)
    free = sampler.generate(tiny("llada"), "a", max_new_tokens=8)
    out = sampler.generate(tiny("llada"), "a", max_new_tokens=8, steps=2)
    assert out.sequences.equal(free.sequences) and out.nfe == free.nfe == 6


def test_cli_generate_and_bench_agree_on_steps_for_adaptive_samplers(capsys, tmp_path):
    prompt = "Sort the list: 3 1\n"
    assert main(["generate", prompt, "--sampler", "threshold", "--block-size", "8"]) == 0
    free = capsys.readouterr()
    assert "not used" not in free.err
    assert main(["generate", prompt, "--sampler", "threshold", "--steps", "3", "--block-size", "8"]) == 0
    given = capsys.readouterr()
    assert given.out == free.out and "--steps not used: 'threshold' is adaptive" in given.err

    def figures(err):  # the summary line up to the timings
        return [line.split(" | tokens/s")[0] for line in err.splitlines() if line.startswith("[")]

    assert figures(given.err) == figures(free.err) and "NFE" in figures(free.err)[0]
    out = tmp_path / "b"
    argv = ["bench", "--samplers", "threshold", "--tasks", "listops", "--set", "steps=G/8,G/2", "--n", "2"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    assert "steps not used by 'threshold'" in capsys.readouterr().err
    records = [json.loads(line) for f in cell_files(out / "runs") for line in list(read_lines(f))[1:]]
    cells = {r["cell_id"] for r in records if "-threshold-" in r["cell_id"]}  # (the reference llada: one per token)
    assert len(cells) == 1  # one cell, not one per swept value that changes nothing


def test_bench_steps_apply_to_every_sampler_of_a_mixed_sweep():
    runner.validate(runner.BenchConfig(samplers=["llada", "threshold"], grid={"steps": ["G/2"]}))
    runner.validate(runner.BenchConfig(samplers=["threshold", "factor"], grid={"steps_per_block": [2]}))


# -- 8. sampler names -------------------------------------------------------------------------------


def test_sampler_names_are_case_insensitive_with_a_did_you_mean():
    assert dllm.samplers.get("Threshold", threshold=0.5) == dllm.samplers.get("threshold", threshold=0.5)
    assert dllm.samplers.get("LLaDA").name == "llada"
    with pytest.raises(ConfigError, match="unknown sampler 'treshold'.*did you mean 'threshold'"):
        dllm.samplers.get("treshold")
    with pytest.raises(ConfigError, match="unknown sampler 'zzz'; available: llada"):
        dllm.samplers.get("zzz")
    assert dllm.samplers.get.__doc__ and "hyper-parameter" in dllm.samplers.get.__doc__
    cfg = runner.BenchConfig(samplers=["LLaDA", "Threshold"])
    runner.validate(cfg)
    assert cfg.samplers == ["llada", "threshold"]  # one spelling in cell names and files


# -- 9. a sweep with nothing to run -----------------------------------------------------------------


def test_bench_with_only_incompatible_samplers_is_an_error(tmp_path, capsys):
    assert main(["bench", "--samplers", "sdar", "--n", "2", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nothing to run" in err and "needs a block-causal model" in err
    assert not (tmp_path / "summary.md").exists()


# -- warnings are not errors ------------------------------------------------------------------------


def test_no_warning_for_a_plain_generation(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dllm.samplers.get("llada").generate(tiny("llada"), [[5, 6]], max_new_tokens=8, block_size=8)


# -- 5. prompts the bundled models do not understand -------------------------------------------------


def test_generate_warns_on_unknown_prompt_pieces_and_empty_output(capsys):
    assert main(["generate", "What is 7*8?"]) == 0  # the README's old example on the bundled tiny-llada
    err = capsys.readouterr().err
    assert "piece(s) of the prompt are unknown to this model's tokenizer and become <unk>: 'What'" in err
    assert "the model generated no text" in err and "Sort the list: 14 7 9" in err
    assert main(["generate", "Sort the list: 14 7 9"]) == 0  # known words, but no trailing newline
    err = capsys.readouterr().err
    assert "generated no text" in err and "does not end with a newline" in err and "unknown" not in err
    assert main(["generate", "Привет\n", "--model", "tiny-sdar"]) == 0
    assert "6 piece(s) of the prompt are unknown" in capsys.readouterr().err


def test_task_prompts_give_task_answers_without_warnings(capsys):
    assert main(["generate", "Sort the list: 14 7 9\n"]) == 0
    out, err = capsys.readouterr()
    assert out == "7 9 14\n" and "warning" not in err


# -- 7. block size and tokens per forward -----------------------------------------------------------


def test_generate_prints_its_block_size_and_steps(capsys):
    prompt = "Sort the list: 14 7 9\n"
    assert main(["generate", prompt]) == 0
    assert capsys.readouterr().err.rstrip().endswith("| max_new_tokens 32, block_size 32, steps 32")
    assert main(["generate", prompt, "--block-size", "8", "--steps", "16"]) == 0
    assert "| max_new_tokens 32, block_size 8, steps 16" in capsys.readouterr().err
    assert main(["generate", prompt, "--sampler", "threshold"]) == 0
    assert "block_size 32, steps adaptive" in capsys.readouterr().err
    assert main(["generate", prompt, "--model", "tiny-sdar"]) == 0
    assert "block_size 4, steps_per_block 4" in capsys.readouterr().err


def test_tokens_per_forward_is_per_sequence_as_in_bench(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("threshold", threshold=0.5)
    alone = sampler.generate(model, [[5, 6, 7]], max_new_tokens=16, block_size=8)
    batch = sampler.generate(model, [[5, 6, 7]] * 3, max_new_tokens=16, block_size=8)
    assert batch.nfe == alone.nfe and batch.tokens == alone.tokens * 3
    assert batch.tokens_per_forward == pytest.approx(alone.tokens_per_forward)  # not 3x
    mixed = sampler.generate(model, [[5, 6, 7], [8], [9, 10]], max_new_tokens=16, block_size=8)
    # the bench's definition: every sample carries its batch's NFE, tokens/forward = sum(tokens) / sum(nfe)
    assert mixed.tokens_per_forward == pytest.approx(sum(mixed.tokens) / (3 * mixed.nfe))


# -- 8. help and version ----------------------------------------------------------------------------


def test_help_documents_every_generate_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text.replace("tiny- ", "tiny-")  # (argparse may wrap a line after a name's hyphen)
    for needle in (
        "text to continue",  # the prompt
        "32 for the bundled models",  # --max-new-tokens
        "0 = greedy",  # --temperature
        "seed of the random numbers",  # --seed
        "cpu, cuda, cuda:N or mps",  # --device
        "bf16",  # --dtype
        # bundled models
        "tiny-diffusion-gemma, tiny-dream, tiny-fast-dllm-v2, tiny-llada, tiny-llada2, tiny-llada21, tiny-sdar",
        "llada, dream, sdar, llada2, llada21, fast_dllm_v2, threshold, factor",  # samplers
    ):
        assert needle in text, needle
    assert "default 128" not in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"dllm {dllm.__version__} (torch {torch.__version__}")


# -- 10. transformers habits ------------------------------------------------------------------------


def test_ids_without_attention_mask_that_hold_the_pad_id_warn(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("llada")
    padded = torch.tensor([[model.pad_id, model.pad_id, 5, 6], [7, 8, 9, 10]])
    with pytest.warns(UserWarning, match=f"contain the pad token id {model.pad_id} but no attention_mask"):
        sampler.generate(model, padded, max_new_tokens=8, block_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.generate(model, padded, attention_mask=(padded != model.pad_id).long(), max_new_tokens=8, block_size=8)
        sampler.generate(model, [[5, 6], [7, 8, 9, 10]], max_new_tokens=8, block_size=8)


def test_transformers_generate_arguments_are_mapped_or_refused(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("llada")
    prompt, lengths = [[5, 6, 7]], {"block_size": 8}
    greedy = sampler.generate(model, prompt, max_new_tokens=8, **lengths)
    assert torch.equal(
        sampler.generate(model, prompt, max_new_tokens=8, do_sample=False, **lengths).sequences, greedy.sequences
    )
    sampled = sampler.generate(model, prompt, max_new_tokens=8, temperature=1.0, seed=4, **lengths)
    same = sampler.generate(model, prompt, max_new_tokens=8, do_sample=True, seed=4, **lengths)  # T = 1.0
    assert torch.equal(same.sequences, sampled.sequences)
    by_length = sampler.generate(model, prompt, max_length=3 + 8, num_beams=1, **lengths)
    assert torch.equal(by_length.sequences, greedy.sequences)  # max_length counts the prompt
    refused = [
        ({"num_beams": 4}, "beam search has no meaning"),
        ({"do_sample": False, "temperature": 0.7}, "do_sample=False .* contradicts temperature=0.7"),
        ({"max_length": 11, "max_new_tokens": 8}, "not both"),
        ({"max_length": 2}, "leaves no room after the 3-token prompt"),
        (
            {"top_k": 50},
            r"'top_k' is a hyper-parameter of sampler dream, sdar[a-z0-9_, ]*: dllm.samplers.get\('dream', top_k=...\)",
        ),
        ({"num_return_sequences": 2}, "pass the prompt several times"),
        ({"bogus": 1}, "'bogus' is not an argument of generate\\(\\). generate\\(\\) takes: steps"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ConfigError, match=message):
            sampler.generate(model, prompt, **{"block_size": 8, **kwargs})


def test_numbers_the_bundled_tokenizer_splits_are_warned_about(capsys):
    """`140 700 9` sorted as `2 2 9 12 14` without a word: the tasks' numbers are 0-99, one token each."""
    from dllm.tasks.tokenizer import split_numbers

    assert split_numbers("Sort the list: 140 700 9 07 99 0\n") == ["140", "700", "07"]
    assert main(["generate", "Sort the list: 140 700 9\n", "--max-new-tokens", "8", "--block-size", "8"]) == 0
    err = capsys.readouterr().err
    assert "dllm: warning: 140, 700: the bundled models' tokenizer splits numbers" in err


def test_lengths_past_a_bundled_models_training_are_warned_about(capsys):
    """issue 39 item 6: tiny-llada answered `9 14 14` at 64 new tokens (`38 38 14` at 256) without a word: its
    training.json says it saw prompts and answer spans of at most 40 tokens."""
    model = dllm.load("tiny-llada")
    assert model.trained_lengths == {"max_prompt": 40, "max_new_tokens": 40}
    sort = "Sort the list: 14 7 9\n"
    with pytest.warns(DllmWarning, match=r"never trained on max_new_tokens=64 \(.*at most 40.*use max_new_tok"):
        dllm.samplers.get("llada").generate(model, sort, max_new_tokens=64, block_size=8)
    long = "Sort the list: " + " ".join(["5"] * 45) + "\n"
    with pytest.warns(DllmWarning, match=r"never trained on a prompt of \d+ tokens \(trained on at most 40\)"):
        dllm.samplers.get("sdar").generate(dllm.load("tiny-sdar"), long, max_new_tokens=8)
    with warnings.catch_warnings():  # within its training, and a block-causal model's answer past 40: no warning
        warnings.simplefilter("error")
        dllm.samplers.get("llada").generate(model, sort, max_new_tokens=40, block_size=8)
        dllm.samplers.get("sdar").generate(dllm.load("tiny-sdar"), sort, max_new_tokens=64)
    assert main(["generate", sort, "--max-new-tokens", "64", "--block-size", "8"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("dllm: warning: tiny-llada was never trained on max_new_tokens=64")
    assert "use --max-new-tokens 40 or less" in err  # the advice in the command line's spelling


def test_train_on_a_missing_gpu_says_what_to_do(tmp_path, monkeypatch, capsys):
    from dllm import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.main(["--out", str(tmp_path), "--device", "cuda", "--steps", "1"]) == 2
    assert "python -m dllm.train: error: device 'cuda' was asked for" in capsys.readouterr().err
