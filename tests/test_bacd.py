"""The ``bacd`` sampler (TDAR's bounded adaptive confidence decoding, arXiv 2602.09555): parity with the official
rule and its properties.

Parity fixture ``tests/fixtures/bacd_parity.json`` (its ``source`` names what ran). Recipe, outside the repo (the
official code lives only under /tmp, never here): copy LuLuLuyi/TDAR ``third_party/lmdeploy-0.10.2/lmdeploy/pytorch/
strategies/dllm/unmasking.py`` with ``lmdeploy.pytorch.consts`` (DLLM_MASKED 0, UNMASKED 1, CACHED 2) and
``lmdeploy.pytorch.config`` (``UnmaskingStrategy``) stubbed, and build ``UnmaskingProcessor`` on a config with
``block_length`` and the two bounds; then
- ``rules``: 3 block rows of 8 slots over 16 ids, some slots decoded, logits ``randn x U(0, 6)`` rounded to 3
  decimals drawn at each step, the proposals their argmax, bounds (0.6, 0.9), (0.3, 0.5), (0, 1), (0.2, 0.2): one
  processor per case called at every step until every block is full (its history carried between steps); recorded
  each step's logits, masks and commits;
- ``generations``: the rule per block of ``make_tiny_checkpoint(DIR, family, std=s)``'s greedy proposals (the model
  loaded in dllm, one forward of the canvas per step, the mask token's logit at -inf as every loop of this package
  has it), LLaDA and Dream in blocks of 8, 4 or 16, s in (0.5, 1, 2), three prompts,
  bounds (0.6, 0.9) (official), (0.3, 0.5), (0.05, 0.2), (0.9, 0.99); recorded the sequence and the forwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.samplers.bacd import BACD, History, bounded_adaptive

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "bacd_parity.json").read_text())


@pytest.mark.parametrize("case", FIXTURE["rules"], ids=lambda c: f"bounds{c['lower']:g}-{c['upper']:g}")
def test_each_step_commits_what_the_official_rule_commits(case):
    history = History(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long))
    for step in case["steps"]:
        logits = torch.tensor(step["logits"]).view(3, 8, -1)
        conf = torch.softmax(logits, -1).max(-1).values  # (the argmax proposal's probability)
        masked = torch.tensor(step["masked"])
        commit = bounded_adaptive(conf, masked, history.total, history.count, case["lower"], case["upper"])
        history.add(conf, commit)
        assert commit.tolist() == step["committed"]


def test_the_rule_fixture_covers_the_first_step_the_history_and_the_fallback():
    steps = [s for case in FIXTURE["rules"] for s in case["steps"]]
    assert any(sum(map(sum, s["committed"])) >= 6 for s in steps)  # (parallel commits)
    assert sum(len(case["steps"]) >= 4 for case in FIXTURE["rules"]) >= 6  # (the history's mean decides)
    one_each = [s for s in steps if all(sum(row) <= 1 for row in s["committed"])]
    assert len(one_each) >= 10  # (the threshold above every mask: the most confident alone)


def _case_id(c):
    shape = f"P{len(c['prompt'])}-G{c['max_new_tokens']}-B{c['block_size']}"
    return f"{c['family']}-std{c['std']}-{shape}-{c['lower']}-{c['upper']}"


@pytest.mark.parametrize("case", FIXTURE["generations"], ids=_case_id)
def test_generation_matches_the_official_rule(matches_recording, case):
    matches_recording(BACD(confidence_lower_threshold=case["lower"], confidence_upper_threshold=case["upper"]), case)


def test_the_generation_fixture_commits_in_parallel_and_one_by_one():
    cases = FIXTURE["generations"]
    assert any(c["nfe"] <= c["max_new_tokens"] // 4 for c in cases)
    assert any(c["nfe"] == c["max_new_tokens"] for c in cases)
    assert {c["family"] for c in cases} == {"llada", "dream"}


def test_a_new_block_starts_with_an_empty_history(tiny):
    """The history is the block's: a second block's first step sets its threshold from its own best mask."""
    seen = []

    class Watch(BACD):
        def select(self, step, state):
            seen.append((step.start.tolist(), state.count.tolist()))
            return super().select(step, state)

    Watch().generate(tiny("llada"), torch.tensor([[10, 11, 12]]), max_new_tokens=16, block_size=8, eos_early_stop=False)
    assert len({tuple(start) for start, _ in seen}) == 2  # (two blocks)
    for i, (start, count) in enumerate(seen):
        if i == 0 or start != seen[i - 1][0]:
            assert count == [0]  # (a block's first step: no history)
        else:
            assert count[0] > 0


def test_the_bounds_are_checked():
    assert dllm.samplers.defaults("bacd") == {"confidence_upper_threshold": 0.9, "confidence_lower_threshold": 0.6}
    with pytest.raises(ConfigError, match="confidence_lower_threshold must be at most confidence_upper_threshold"):
        BACD(confidence_lower_threshold=0.95)
    with pytest.raises(ConfigError, match="confidence_upper_threshold"):
        BACD(confidence_upper_threshold=1.5)
