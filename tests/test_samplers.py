"""Invariants of every sampler on every family, batch invariance, EOS early stop, seeds, accounting."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.generation import count_generated
from dllm.samplers.confidence import num_transfer_tokens

CASES = [
    ("llada", "llada", {}),
    ("llada", "llada", {"remasking": "random"}),
    ("llada", "llada", {"cfg_scale": 1.0}),
    ("llada", "threshold", {"threshold": 0.5}),
    ("llada", "factor", {}),
    ("llada", "dream", {}),
    ("dream", "dream", {}),
    ("dream", "dream", {"alg": "origin"}),
    ("dream", "dream", {"alg": "topk_margin", "top_p": 0.9}),
    ("dream", "dream", {"alg": "maskgit_plus", "alg_temp": 0.5}),
    ("dream", "llada", {}),
    ("dream", "threshold", {}),
    ("sdar", "sdar", {}),
    ("sdar", "sdar", {"remasking_strategy": "low_confidence_static"}),
    ("sdar", "sdar", {"remasking_strategy": "sequential"}),
    ("sdar", "threshold", {}),
    ("sdar", "llada", {}),
    ("sdar", "factor", {}),
]
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]


def _lengths(family):
    return {"max_new_tokens": 16} if family == "sdar" else {"max_new_tokens": 16, "block_size": 8}


def _block_of(family, model, prompt_lens, width, col, row):
    """Index of the decoding block holding canvas column ``col`` of ``row``."""
    if family == "sdar":
        pad = width - prompt_lens[row]
        return (col - pad) // model.block_size - prompt_lens[row] // model.block_size
    return (col - width) // 8


@pytest.mark.parametrize("family,name,hp", CASES)
def test_commit_invariants(family, name, hp, tiny):
    model = tiny(family)
    sampler = dllm.samplers.get(name, **hp)
    steps = []
    out = sampler.generate(
        model,
        PROMPTS,
        **_lengths(family),
        eos_early_stop=False,
        seed=3,
        history=True,
        callback=lambda info: steps.append((info.committed.clone(), info.block.clone())),
    )
    lens = [len(p) for p in PROMPTS]
    width = out.prompt_width
    previous = out.history[0].clone()
    previous[steps[0][0]] = model.mask_id  # the canvas before the first commit
    assert len(out.history) == len(steps) == out.nfe // (2 if hp.get("cfg_scale") else 1)
    for (committed, block), now in zip(steps, out.history, strict=True):
        assert committed.sum() >= 1, "every forward commits at least one token"
        assert bool((previous[committed] == model.mask_id).all()), "commits only into masked slots"
        assert torch.equal(now[~committed], previous[~committed]), "committed tokens never change"
        for row, col in committed.nonzero().tolist():
            assert _block_of(family, model, lens, width, col, row) == int(block[row]), "commit outside the block"
        if not sampler.fixed_steps:
            working = (previous == model.mask_id).any(1)
            assert bool(committed[working].any(1).all()), "adaptive samplers commit in every working row"
        previous = now
    assert not bool((out.sequences == model.mask_id).any())
    assert (out.sequences[:, :width] == out.history[0][:, :width]).all()


# Cases whose order is random (origin, random remasking, alg_temp) are covered by the seed test instead.
GREEDY = [c for c in CASES if not ({"remasking", "alg_temp"} & set(c[2]) or c[2].get("alg") == "origin")]


@pytest.mark.parametrize("family,name,hp", GREEDY)
def test_batch_invariance(family, name, hp, tiny):
    """Greedy output of a prompt is the same alone and inside a left-padded batch of mixed lengths."""
    model = tiny(family)
    sampler = dllm.samplers.get(name, **hp)
    batch = sampler.generate(model, PROMPTS, **_lengths(family), eos_early_stop=False)
    for r, prompt in enumerate(PROMPTS):
        alone = sampler.generate(model, [prompt], **_lengths(family), eos_early_stop=False)
        generated = alone.sequences[0, len(prompt) :]
        got = batch.sequences[r, batch.prompt_width : batch.prompt_width + generated.shape[0]]
        assert torch.equal(got, generated), f"row {r}"


def test_seeded_sampling_is_repeatable_and_per_row(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("llada")
    a = sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, temperature=1.0, seed=7)
    b = sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, temperature=1.0, seed=7)
    c = sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, temperature=1.0, seed=8)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)
    # row 0 draws from the stream of (seed, 0) whatever the rest of the batch holds
    alone = sampler.generate(model, [PROMPTS[0]], max_new_tokens=16, block_size=8, temperature=1.0, seed=7)
    assert torch.equal(alone.sequences[0, 3:], a.sequences[0, a.prompt_width :])


def _force_eos_at(model, column):
    """Make ``column`` of every row predict EOS with certainty (a stand-in for a model that stops): the LM
    head's logits of that column get +100 on EOS."""
    original = model.head

    def head(hidden, columns, **kw):
        out = original(hidden, columns, **kw).clone()
        out[..., model.eos_id] += 100.0 * (columns == column).to(out.dtype)
        return out

    return head


def test_eos_early_stop_saves_forwards_and_keeps_the_text(tiny, monkeypatch):
    model = tiny("llada")
    prompt = [[10, 11, 12, 13]]
    monkeypatch.setattr(model, "head", _force_eos_at(model, 4 + 5))  # generated slot 5: block 1 of 4
    sampler = dllm.samplers.get("llada")
    full = sampler.generate(model, prompt, max_new_tokens=16, block_size=4, eos_early_stop=False)
    early = sampler.generate(model, prompt, max_new_tokens=16, block_size=4)
    assert full.nfe == 16 and early.nfe == 8
    assert early.texts == full.texts and early.tokens == full.tokens == [5]
    assert bool((early.sequences[0, 4 + 8 :] == model.eos_id).all())
    assert torch.equal(early.sequences[0, : 4 + 8], full.sequences[0, : 4 + 8])


def test_steps_schedule_and_nfe(tiny):
    model = tiny("llada")
    out = dllm.samplers.get("llada").generate(
        model, "ab", max_new_tokens=16, block_size=8, steps=8, eos_early_stop=False
    )
    assert out.nfe == 8
    assert out.tokens_per_forward == pytest.approx(out.total_tokens / 8)
    per_block = dllm.samplers.get("llada").generate(
        model, "ab", max_new_tokens=16, block_size=8, steps_per_block=4, eos_early_stop=False
    )
    assert torch.equal(per_block.sequences, out.sequences)


def test_dream_first_step_quirk(tiny):
    """With steps == masks, Dream's first step commits int(0.999...) = 0 tokens and its last step 2 (parity with
    the official sampler); the empty step costs no forward here."""
    model = tiny("dream")
    out = dllm.samplers.get("dream").generate(
        model, "ab", max_new_tokens=8, steps=8, eos_early_stop=False, history=True
    )
    assert out.nfe == 7
    counts = [int((h == model.mask_id).sum()) for h in out.history]
    assert counts == [7, 6, 5, 4, 3, 2, 0]


def test_schedules_sum_to_the_block():
    masks = torch.tensor([32, 7, 0, 5])
    schedule = num_transfer_tokens(masks, 6)
    assert schedule.sum(1).tolist() == masks.tolist()
    assert schedule[1].tolist() == [2, 1, 1, 1, 1, 1]  # remainder goes to the first steps
    assert (schedule.max(1).values - schedule.min(1).values <= 1).all()


def test_sdar_sequences_end_on_the_block_grid(tiny):
    model = tiny("sdar")  # block size 4
    out = dllm.samplers.get("sdar").generate(model, [[10, 11, 12, 13, 14]], max_new_tokens=6, eos_early_stop=False)
    assert out.sequences.shape == (1, 12)  # ceil((5 + 6) / 4) * 4, as the official sampler returns
    assert out.tokens == [count_generated(out.sequences, 5, model.eos_ids, model.mask_id).item()]


def test_sdar_block_cache_matches_no_cache(tiny):
    model = tiny("sdar")
    for name in ["sdar", "threshold", "llada"]:
        sampler = dllm.samplers.get(name)
        cached = sampler.generate(model, PROMPTS, max_new_tokens=16, eos_early_stop=False)
        plain = sampler.generate(model, PROMPTS, max_new_tokens=16, eos_early_stop=False, cache=None)
        assert torch.equal(cached.sequences, plain.sequences), name
        assert cached.nfe == plain.nfe


@pytest.mark.parametrize(
    "prompt",
    [
        "hello",
        ["hello", "a longer prompt"],
        [{"role": "user", "content": "hi"}],
        [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo!"}]],
        torch.tensor([[40, 41, 42]]),
        [[40, 41], [42]],
    ],
)
def test_prompt_forms(prompt, tiny):
    model = tiny("llada")
    out = dllm.samplers.get("threshold").generate(model, prompt, max_new_tokens=8, block_size=8)
    rows = 1 if isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], dict)) else len(prompt)
    assert out.sequences.shape[0] == len(out.texts) == rows


def test_chat_template_is_applied(tiny):
    model = tiny("llada")
    out = dllm.samplers.get("threshold").generate(
        model, [{"role": "user", "content": "hi"}], max_new_tokens=8, block_size=8
    )
    prompt = model.tokenizer.decode(out.sequences[0, : out.prompt_width])
    assert prompt.endswith("assistant\n") and "hi" in prompt


def test_texts_are_cut_at_eos_and_counted_once(tiny, monkeypatch):
    model = tiny("dream")
    monkeypatch.setattr(model, "head", _force_eos_at(model, 3 + 2))
    out = dllm.samplers.get("dream").generate(model, [[10, 11, 12]], max_new_tokens=8, eos_early_stop=False)
    assert out.tokens == [2]
    assert out.texts[0] == model.tokenizer.decode(out.sequences[0, 3:5])
