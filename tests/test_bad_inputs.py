"""Inputs a fuzzer and a new user tried (issue 18): sizes far beyond the model are clipped to what they can
reach, and malformed arguments are ``ConfigError``s naming the argument, raised before any forward."""

from __future__ import annotations

import pytest
import torch

import dllm

# -- sizes beyond the vocabulary / canvas: clipped, the same output as the largest size that matters --------


def _same(a, b):
    assert a.sequences.equal(b.sequences) and a.nfe == b.nfe


@pytest.mark.parametrize(
    "name,huge,enough",
    [
        ("credit", {"credit_top_k": 10**9}, {"credit_top_k": None}),  # K >= vocabulary: the full credit
        ("localleap", {"radius": 10**9}, {"radius": 16}),  # a radius past the canvas
        ("ete", {"lookahead_blocks": 10**6}, {"lookahead_blocks": 2}),  # look-ahead blocks past the canvas
        # the largest 64-bit integers (larger ones are refused by name: tests/test_hyper_parameters.py)
        ("ete", {"lookahead_blocks": 2**63 - 1}, {"lookahead_blocks": 2}),
        ("localleap", {"radius": 2**63 - 1}, {"radius": 16}),
        ("prophet", {"answer_offset": 2**63 - 1}, {"answer_offset": 64}),  # an answer region past the canvas
        ("prophet", {"answer_start_pos": 2**63 - 1}, {"answer_start_pos": 64}),
    ],
)
def test_huge_sizes_are_clipped_to_the_vocabulary_or_canvas(name, huge, enough, tiny):
    model = tiny("llada")
    kw = {"max_new_tokens": 16, "block_size": 4, "temperature": 1.0, "seed": 2}
    _same(
        dllm.samplers.get(name, **huge).generate(model, "ab", **kw),
        dllm.samplers.get(name, **enough).generate(model, "ab", **kw),
    )


def test_an_adaptive_block_size_beyond_the_span_is_one_block(tiny):
    model, sampler = tiny("llada"), dllm.samplers.get("adablock", delimiter_ids=[5])
    _same(
        sampler.generate(model, "ab", max_new_tokens=8, block_size=10**9),
        sampler.generate(model, "ab", max_new_tokens=8, block_size=8),
    )


# -- malformed arguments: a ConfigError naming the argument, before any forward -------------------------------


@pytest.fixture
def no_forward(monkeypatch):
    """Fails the test if a model forward runs (every check below comes first)."""

    def forward(*args, **kwargs):
        raise AssertionError("a forward ran before the argument was checked")

    monkeypatch.setattr(dllm.engine.run.Run, "forward", forward)


BAD = [
    ({"prompt": torch.zeros(0, 4, dtype=torch.long)}, "empty prompt: the prompt tensor has shape \\(0, 4\\)"),
    ({"prompt": torch.zeros(2, 0, dtype=torch.long)}, "empty prompt"),
    ({"prompt": []}, "empty prompt list"),
    ({"prompt": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)}, "attention_mask has shape"),
    ({"prompt": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(3, 2)}, "attention_mask has shape"),
    ({"prompt": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.full((1, 3), 2)}, "0 \\(padding\\)"),
    ({"callback": 5}, "callback must be a function"),
    ({"temperature": True}, "temperature must be a finite number"),
    ({"seed": True}, "seed must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be a positive integer"),
    ({"steps": True}, "steps must be a positive integer"),
    ({"steps_per_block": True}, "steps_per_block must be a positive integer"),
    ({"block_size": True}, "block_size must be a positive integer"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"eos_early_stop": "yes"}, "eos_early_stop must be True or False"),
    ({"history": 1}, "history must be True or False"),
    ({"max_new_tokens": [8, 8]}, "one length per prompt: 1 prompts, got 2 lengths"),
    ({"max_new_tokens": [0]}, "max_new_tokens\\[0\\] must be a positive integer"),
    ({"max_new_tokens": [8], "max_length": 20}, "give max_new_tokens or max_length .*, not both"),
    ({"temperature": [1.0, 0.5]}, "one temperature per prompt: 1 prompts, got 2"),
    ({"temperature": [1.0, -1.0]}, "temperature\\[1\\] must be a finite number >= 0"),
    ({"temperature": []}, "one temperature per prompt, got an empty list"),
    ({"eos_early_stop": [True, False]}, "one value per prompt: 1 prompts, got 2"),
    ({"eos_early_stop": ["yes"]}, "eos_early_stop\\[0\\] must be True or False"),
    ({"eos_early_stop": []}, "one value per prompt, got an empty list"),
]


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("given,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_malformed_arguments_are_config_errors_before_any_forward(family, given, message, tiny, no_forward):
    given = dict(given)
    prompt = given.pop("prompt", "ab")
    for name in ("llada", "threshold"):
        with pytest.raises(dllm.ConfigError, match=message):
            dllm.samplers.get(name).generate(tiny(family), prompt, **{"max_new_tokens": 8, **given})


def test_rows_of_lengths_whose_blocks_differ_are_refused_with_what_would_work(tiny, no_forward):
    """A ``steps`` total splits differently over rows of other lengths (8 steps: 8 per block of a 8-token row, 4 of
    a 16-token one), and so would default blocks as wide as each span; an adaptive sampler ignores steps."""
    model, two = tiny("llada"), ["ab", "cd"]
    with pytest.raises(dllm.ConfigError, match="max_new_tokens=8 gives block_size 8, steps_per_block 8, and 16 gives"):
        dllm.samplers.get("llada").generate(model, two, max_new_tokens=[8, 16], block_size=8, steps=8)
    with pytest.raises(dllm.ConfigError, match="Give block_size and steps_per_block"):
        dllm.samplers.get("threshold").generate(model, two, max_new_tokens=[8, 16])
    with pytest.raises(dllm.ConfigError, match="'adablock' sampler's rule reads the generation length as one number"):
        dllm.samplers.get("adablock").generate(model, two, max_new_tokens=[8, 16], block_size=8)
    with pytest.raises(dllm.ConfigError, match="'s2d2' sampler reads the temperature beyond its scores"):
        dllm.samplers.get("s2d2").generate(tiny("sdar"), two, temperature=[0.0, 1.0])
    with pytest.raises(dllm.ConfigError, match="max_new_tokens as a list .* and template"):
        dllm.samplers.get("llada").generate(model, two, max_new_tokens=[8, 16], template=["a", dllm.Hole(2)])


def test_a_model_name_is_loaded_for_the_user(checkpoint_dir):
    sampler = dllm.samplers.get("llada")
    out = sampler.generate("tiny-llada", "1+1=", max_new_tokens=4, block_size=4)
    assert out.texts is not None and out.nfe == 4
    directory = checkpoint_dir("llada")
    assert sampler.generate(str(directory), [[5, 6]], max_new_tokens=4).nfe == 4  # a checkpoint directory too
    with pytest.raises(dllm.ConfigError, match=r"load it once with model = dllm.load\('no/such-model'\)"):
        sampler.generate("no/such-model", "a")
    with pytest.raises(dllm.ConfigError, match="model must be a model loaded with dllm.load"):
        sampler.generate(42, "a")


def test_a_sampler_that_sets_the_eos_rule_refuses_one_per_row(tiny, no_forward):
    """LLaDA2's samplers (their own eos_early_stop hyper-parameter is the official rule) and the processes that read
    one rule for the batch (WeDLM's stream) refuse rows of different ones by name; one value for all is accepted."""
    for family, name in (("llada2", "llada2"), ("wedlm", "wedlm")):
        with pytest.raises(dllm.ConfigError, match="reads eos_early_stop as one rule for the batch"):
            dllm.samplers.get(name).generate(tiny(family), ["ab", "cd"], max_new_tokens=8, eos_early_stop=[True, False])
