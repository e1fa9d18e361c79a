"""``history`` and ``callback``: their format and the helpers that read the steps as text (issue 31 item 14)."""

from __future__ import annotations

import pytest

import dllm
from dllm.core.errors import ConfigError

PROMPTS = ["Sort the list: 14 7 9\n", "Reverse the list: 3 17 0 8 5 2\n"]  # two widths: the first is left-padded


@pytest.mark.parametrize(
    "name, sampler",
    [("tiny-llada", "llada"), ("tiny-sdar", "sdar"), ("tiny-wedlm", "wedlm"), ("tiny-llada2", "llada21")],
)
def test_each_step_reads_as_text_in_history_and_callback_alike(name, sampler):
    model = dllm.load(name)
    seen, widths = [], set()

    def watch(info):
        seen.append([info.decode(model, row) for row in range(len(PROMPTS))])
        widths.add(info.prompt_width)

    out = dllm.samplers.get(sampler).generate(model, PROMPTS, max_new_tokens=16, history=True, callback=watch)
    assert widths == {out.prompt_width}
    for row in range(len(PROMPTS)):
        steps = out.decode_history(model, row, mask="?")
        assert len(steps) == len(seen) == len(out.history)
        assert steps[0].count("?") > steps[-1].count("?") == 0  # masks at first, none at the end
        assert steps[-1] == out.texts[row]  # the last entry holds the EOS fill: the text
        # the callback saw the same canvas as history recorded, before any EOS fill of the last step
        assert [s[row] for s in seen][:-1] == out.decode_history(model, row)[:-1]


def test_without_history_decoding_says_what_to_pass():
    model = dllm.load("tiny-llada")
    out = dllm.samplers.get("llada").generate(model, PROMPTS[0], max_new_tokens=8)
    with pytest.raises(ConfigError, match="pass history=True"):
        out.decode_history(model)
