"""The Monte-Carlo likelihood of ``dllm.eval`` against LLaDA's official estimator, and its exact cases.

``tests/fixtures/llada_loglikelihood.json`` was recorded by running the official function
``get_log_likelihood(model, prompt, answer, mc_num, batch_size, cfg_scale, mask_id)`` of ML-GSAI/LLaDA
``get_log_likelihood.py`` (commit in the fixture's ``meta``; unmodified, imported from a copy outside the
repository) on ``make_tiny_checkpoint(dir, "llada", seed=0, std=0.5)`` loaded by ``dllm.load`` in float32 on
the CPU and wrapped so that ``model(x).logits`` returns dllm's logits and ``model.device`` is the CPU.
Prompts and answers are random ids (>= 5, no special tokens) drawn from ``torch.Generator().manual_seed(123)``;
before each call the harness ran ``torch.manual_seed(case["seed"])``. The official function draws its masks
from torch's global generator (``torch.randint`` for k, ``torch.randperm`` per row); dllm draws the same
calls in the same order from a CPU generator seeded with the same seed, so the masks are identical and the
estimates agree to float rounding. Six cases: with and without CFG (0.5, 2.0), a one-token answer, batch
sizes 2 to 16 with 1 to 4 iterations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.eval.likelihood import forward_process, is_greedy, mc_loglikelihood
from dllm.models.tiny import make_tiny_checkpoint

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "llada_loglikelihood.json").read_text())


@pytest.fixture(scope="module")
def official_model(tmp_path_factory):
    spec = FIXTURE["meta"]["checkpoint"]
    root = tmp_path_factory.mktemp("llada_ll")
    d = make_tiny_checkpoint(root / "plain", spec["family"], seed=spec["seed"], std=spec["std"])
    return dllm.load(d, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_matches_official_get_log_likelihood(official_model, name):
    case = FIXTURE["cases"][name]
    assert official_model.mask_id == FIXTURE["meta"]["mask_id"]
    ll = mc_loglikelihood(
        official_model,
        case["prompt"],
        case["answer"],
        mc_num=case["mc_num"],
        batch_size=case["batch_size"],
        cfg=case["cfg_scale"],
        seed=case["seed"],
    )
    assert ll == pytest.approx(case["loglikelihood"], rel=1e-5, abs=1e-4)


def test_draws_follow_the_global_generator_order():
    """Our generator reproduces torch.manual_seed + the official calls (randint, then randperm per row)."""
    torch.manual_seed(7)
    t, b = 9, 4
    k = torch.randint(1, t + 1, ())
    perms = [torch.randperm(t) for _ in range(b)]
    is_mask, ratio = forward_process(3, t, b, torch.Generator().manual_seed(7))
    x = ((torch.round(torch.linspace(float(k), k + (b - 1) * (t / b), steps=b)).long() - 1) % t) + 1
    expected = torch.stack([(torch.arange(t) < x[i])[perms[i]] for i in range(b)])
    assert torch.equal(is_mask[:, 3:], expected) and not is_mask[:, :3].any()
    assert torch.equal(ratio, x / t)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "fast_dllm_v2"])
def test_one_token_estimate_is_the_exact_conditional(tiny, family):
    """With one target token every sample masks exactly it (p_mask = 1): the estimate is the exact log-prob of
    the token at a masked slot after the prefix (Dream through its shifted read-out, SDAR block-causal)."""
    model = tiny(family)
    prefix, target = [7, 9, 11, 5, 8], [13]
    ll = mc_loglikelihood(model, prefix, target, mc_num=4, batch_size=2, seed=3)
    tokens = torch.tensor([prefix + [model.mask_id]])
    logits = model.logits(tokens, torch.arange(tokens.shape[1])[None])
    exact = torch.log_softmax(logits[0, -1].float(), -1)[target[0]].item()
    assert ll == pytest.approx(exact, rel=1e-5, abs=1e-5)  # (float32 rounding of two forwards: relative)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "fast_dllm_v2"])
def test_estimate_is_reproducible_and_order_free(tiny, family):
    model = tiny(family)
    a = mc_loglikelihood(model, [7, 9, 11], [13, 6, 8, 10, 12], mc_num=8, batch_size=4, seed=5)
    mc_loglikelihood(model, [5], [6, 7], mc_num=4, batch_size=4, seed=5)  # another request in between
    b = mc_loglikelihood(model, [7, 9, 11], [13, 6, 8, 10, 12], mc_num=8, batch_size=4, seed=5)
    c = mc_loglikelihood(model, [7, 9, 11], [13, 6, 8, 10, 12], mc_num=8, batch_size=4, seed=6)
    assert a == b and a != c and a < 0


@pytest.mark.parametrize("family,offset", [("sdar", -1), ("fast_dllm_v2", -1), ("fast_dllm_v2", 0)])
def test_sdar_blocks_see_clean_earlier_blocks(tiny, family, offset):
    """SDAR: a masked token of a later block is predicted from the clean earlier blocks, so with the target's
    first block fully known to the model the one-token case of the second block matches the plain forward
    (Fast-dLLM v2, shifted: also a block's first token, read from the clean previous block's last output)."""
    model = tiny(family)
    bs = model.block_size
    prefix = list(range(5, 5 + 2 * bs + offset))
    ll = mc_loglikelihood(model, prefix, [13], mc_num=2, batch_size=2, seed=0)
    tokens = torch.tensor([prefix + [model.mask_id]])
    exact = torch.log_softmax(model.logits(tokens, torch.arange(tokens.shape[1])[None])[0, -1], -1)[13].item()
    assert ll == pytest.approx(exact, abs=1e-5)


def test_settings_are_checked(tiny):
    model = tiny("llada")
    with pytest.raises(ConfigError, match="multiple of mc_batch_size"):
        mc_loglikelihood(model, [5], [6], mc_num=6, batch_size=4)
    with pytest.raises(ConfigError, match="cfg"):
        mc_loglikelihood(tiny("sdar"), [5], [6], mc_num=2, batch_size=2, cfg=1.0)
    with pytest.raises(ConfigError, match="empty"):
        mc_loglikelihood(model, [5], [], mc_num=2, batch_size=2)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "fast_dllm_v2"])
def test_is_greedy_accepts_the_greedy_reconstruction_only(tiny, family):
    """The reconstruction the check itself decodes is greedy; changing one of its tokens is not."""
    model = tiny(family)
    prefix, t = [7, 9, 11, 5], 6
    seq = torch.tensor([prefix + [model.mask_id] * t])
    positions = torch.arange(seq.shape[1])[None]
    for _ in range(t):  # decode greedily, one most-confident token per forward, in the earliest masked block
        masked = seq[0] == model.mask_id
        if model.attention == "block":
            masked &= torch.arange(seq.shape[1]) // model.block_size == int(masked.nonzero()[0]) // model.block_size
        cols = masked.nonzero()[:, 0]
        conf, tok = torch.softmax(model.logits(seq, positions)[0, cols], -1).max(-1)
        seq[0, cols[conf.argmax()]] = tok[conf.argmax()]
    target = seq[0, len(prefix) :].tolist()
    assert is_greedy(model, prefix, target)
    wrong = list(target)
    wrong[-1] = 5 if wrong[-1] != 5 else 6
    assert not is_greedy(model, prefix, wrong)
