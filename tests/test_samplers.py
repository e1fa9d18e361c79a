"""Invariants of every sampler on every family, batch invariance, EOS early stop, seeds, accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dllm
from dllm.core.errors import ConfigError
from dllm.engine.generation import count_generated
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
    if family in ("sdar", "llada2", "fast_dllm_v2", "diffusion_gemma"):  # their own blocks (diffusion_gemma: canvases)
        return {"max_new_tokens": 16}
    return {"max_new_tokens": 16, "block_size": 8}


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
def test_batch_invariance(family, name, hp, tiny, batch_invariant):
    """Greedy output of a prompt is the same alone and inside a left-padded batch of mixed lengths."""
    batch_invariant(dllm.samplers.get(name, **hp), tiny(family), PROMPTS, **_lengths(family), eos_early_stop=False)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "diffusion_gemma", "fast_dllm_v2"])
@pytest.mark.parametrize("name", dllm.samplers.names())
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_sampler_is_batch_invariant_greedy_and_sampled(family, name, temperature, tiny, batch_invariant):
    """Every sampler, each prompt at several indices of a padded batch (and twice in one batch), greedy and
    sampled: its tokens are those it gets alone. Random draws are keyed by the prompt's occurrence among
    identical prompts of the batch, not by the row's index, so a repeated prompt still samples differently.
    (A sampler whose schedule sets its temperatures, DiffusionGemma's, samples at generate's temperature 0.)"""
    model, sampler = tiny(family), dllm.samplers.get(name)
    try:
        sampler.check_drives(model)
    except ConfigError:  # a sampler that cannot drive this family (e.g. sdar on full attention)
        return
    if not sampler.takes_temperature:
        if temperature > 0:
            return  # (the case at temperature 0 samples)
    kw = dict(**_lengths(family), eos_early_stop=False, temperature=temperature, seed=5, cache=None)
    batch_invariant(sampler, model, PROMPTS, orders=[[0, 1, 2], [2, 0, 1], [1, 2, 0]], **kw)
    twice = sampler.generate(model, [PROMPTS[1], PROMPTS[0], PROMPTS[1]], **kw)
    alone = sampler.generate(model, [PROMPTS[1]], **kw)
    assert torch.equal(twice.sequences[0, twice.prompt_width :], alone.sequences[0, alone.prompt_width :])
    samples = temperature > 0 or not sampler.takes_temperature
    if samples and name not in ("sdar", "s2d2"):  # (tiny SDAR samples near-deterministically)
        assert not torch.equal(twice.sequences[0], twice.sequences[2]), "a repeated prompt samples anew"


def decode_counting_rows(sampler, run) -> tuple:
    """The finished ``run`` decoded step by step with each row's forwards counted (``Decoding.row_nfe``: what the
    server answers as a request's ``usage.nfe``): (its Generation, each row's forwards)."""
    with torch.inference_mode():
        row_nfe = dllm.engine.session.decode(run, sampler, count_rows=True)
    return sampler.finish(run), row_nfe.tolist()


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "fast_dllm_v2", "wedlm", "diffusion_gemma"])
@pytest.mark.parametrize("name", dllm.samplers.names())
def test_every_sampler_decodes_rows_of_their_own_lengths_as_alone(family, name, tiny):
    """issue 44: ``max_new_tokens`` as a list, one per prompt: each row's tokens (sampled where the sampler takes a
    temperature), text, token count and own forwards are those it gets alone with its length; a sampler whose rule
    reads the length as one number refuses the list by name. Then also the temperatures, one per prompt (greedy, and two
    sampled): each row as alone with its length and temperature, or a refusal by name."""
    model, sampler = tiny(family), dllm.samplers.get(name)
    try:
        sampler.check_drives(model)
    except ConfigError:
        return
    grid = family in ("llada", "dream")  # blocks on the span's grid (the others' are their own, or a window)
    lengths = [16, 8, 24] if grid else [16, 6, 21]
    kw = dict(block_size=8) if grid else {}
    kw |= dict(eos_early_stop=False, temperature=1.0 if sampler.takes_temperature else 0.0, seed=5, cache=None)
    try:
        batch, row_nfe = decode_counting_rows(sampler, sampler.prepare(model, PROMPTS, max_new_tokens=lengths, **kw))
    except ConfigError as e:
        assert not sampler.per_row_lengths and "reads the generation length as one number" in str(e)
        return
    assert sampler.per_row_lengths
    for row, (prompt, length) in enumerate(zip(PROMPTS, lengths)):
        alone = sampler.generate(model, [prompt], max_new_tokens=length, **kw)
        generated = alone.sequences[0, alone.prompt_width :]
        got = batch.sequences[row, batch.prompt_width : batch.prompt_width + generated.shape[0]]
        assert torch.equal(got, generated), f"row {row} (max_new_tokens={length})"
        assert (batch.texts[row], batch.tokens[row]) == (alone.texts[0], alone.tokens[0])
        assert row_nfe[row] == alone.nfe, f"row {row}: its own forwards (the server's usage.nfe)"
    if not sampler.takes_temperature:
        return
    temperatures = [1.0, 0.0, 2.5]
    try:
        batch = sampler.generate(model, PROMPTS, max_new_tokens=lengths, **{**kw, "temperature": temperatures})
    except ConfigError as e:
        assert not sampler.per_row_temperatures or sampler.process in ("stream", "draft"), e
        assert "reads the temperature beyond its scores" in str(e)
        return
    for row, (prompt, length, t) in enumerate(zip(PROMPTS, lengths, temperatures)):
        alone = sampler.generate(model, [prompt], max_new_tokens=length, **{**kw, "temperature": t})
        generated = alone.sequences[0, alone.prompt_width :]
        got = batch.sequences[row, batch.prompt_width : batch.prompt_width + generated.shape[0]]
        assert torch.equal(got, generated), f"row {row} (temperature={t})"


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "diffusion_gemma"])
@pytest.mark.parametrize("name", dllm.samplers.names())
@settings(max_examples=3, deadline=None)
@given(temperature=st.floats(1e-8, 1e8), seed=st.integers(0, 2**31))
@example(temperature=1e6, seed=5)
@example(temperature=1e-6, seed=5)
@example(temperature=1e300, seed=5)
def test_every_finite_temperature_gives_valid_output(family, name, tiny, temperature, seed):
    """Any finite temperature, tiny or huge: no mask token is ever proposed, every sampler ends (the official
    ``exp(l) / (-log u) ** T`` underflows to 0 / 0 at T = 1e6 and may pick the mask column)."""
    model, sampler = tiny(family), dllm.samplers.get(name)
    try:
        out = sampler.generate(model, PROMPTS[:2], **_lengths(family), temperature=temperature, seed=seed, cache=None)
    except ConfigError as error:  # only a sampler that cannot drive this model, or takes no temperature, refuses
        if not sampler.takes_temperature and "temperature" in str(error):
            return
        with pytest.raises(ConfigError):
            sampler.check_drives(model)
        return
    assert not (out.sequences == model.mask_id).any()
    assert out.nfe <= 2 * 16 * (2 if name == "s2d2" else 1)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, True, "1"])
def test_temperature_must_be_a_finite_number(bad, tiny):
    with pytest.raises(ConfigError, match="temperature must be a finite number >= 0"):
        dllm.samplers.get("llada").generate(tiny("llada"), "a", max_new_tokens=4, temperature=bad)


def test_temperature_transform_keeps_minus_inf_when_it_overflows_the_dtype():
    logits = torch.tensor([[0.5, float("-inf"), -2.0]], dtype=torch.float32)
    out = dllm.samplers.transforms.Temperature(1e300)(logits, None, None, None, None)  # inf in float32
    assert out[0, 1] == float("-inf") and torch.isfinite(out[0, [0, 2]]).all()


@pytest.mark.parametrize("alg_temp", [-1.0, float("nan"), -1e-9, float("inf")])
def test_dream_refuses_a_negative_alg_temp_when_built(alg_temp):
    with pytest.raises(ConfigError, match="alg_temp must be a finite number >= 0"):
        dllm.samplers.get("dream", alg_temp=alg_temp)


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus", "topk_margin"])
@pytest.mark.parametrize("alg_temp", [1e-300, 1e-6, 1e300])
def test_dream_alg_temp_tiny_or_huge_gives_valid_output(alg, alg_temp, tiny):
    """Position weights that underflow to 0 (tiny alg_temp) or a softmax that is NaN (alg_temp beyond float32)
    still rank every committable column above the others: each step commits its quota."""
    model = tiny("dream")
    out = dllm.samplers.get("dream", alg=alg, alg_temp=alg_temp).generate(model, PROMPTS, max_new_tokens=8, seed=1)
    assert not (out.sequences == model.mask_id).any()


def test_seeded_sampling_is_repeatable_and_per_row(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("llada")
    a = sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, temperature=1.0, seed=7)
    b = sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, temperature=1.0, seed=7)
    c = sampler.generate(model, PROMPTS, max_new_tokens=16, block_size=8, temperature=1.0, seed=8)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)
    # a prompt draws the same numbers at any index of any batch
    for r, prompt in enumerate(PROMPTS):
        alone = sampler.generate(model, [prompt], max_new_tokens=16, block_size=8, temperature=1.0, seed=7)
        assert torch.equal(alone.sequences[0, len(prompt) :], a.sequences[r, a.prompt_width :])


@pytest.mark.parametrize(
    "family,name,hp",
    [("llada", "llada", {"remasking": "random"}), ("dream", "dream", {"alg": "origin"}), ("sdar", "s2d2", {}),
     ("llada", "threshold", {}), ("diffusion_gemma", "entropy_bound", {})],
)  # fmt: skip
def test_a_seed_per_prompt_samples_each_row_as_alone_with_its_seed(family, name, hp, tiny):
    """``seed=[...]``: one seed per prompt (the server's rows of different requests in one batch); each row draws
    as its prompt alone with its seed, whichever stream it draws from (tokens, order, reveal, acceptance, noise);
    a prompt repeated with the same seed samples anew, with another seed as that seed alone."""
    model, sampler = tiny(family), dllm.samplers.get(name, **hp)
    temperature = 1.0 if sampler.takes_temperature else 0.0
    kw = dict(**_lengths(family), eos_early_stop=False, temperature=temperature)
    prompts, seeds = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1]], [5, 9, 5, 2**40 + 1]
    mixed = sampler.generate(model, prompts, seed=seeds, **kw)
    for row, (prompt, seed) in enumerate(zip(prompts, seeds)):
        alone = sampler.generate(model, [prompt] * (1 + (row == 2)), seed=seed, **kw)  # (row 2: its 2nd occurrence)
        generated = alone.sequences[-1, alone.prompt_width :]
        got = mixed.sequences[row, mixed.prompt_width : mixed.prompt_width + generated.shape[0]]
        assert torch.equal(got, generated), (row, seed)
    with pytest.raises(ConfigError, match="one integer \\(or None\\) per prompt: 4 prompts"):
        sampler.generate(model, prompts, seed=[1, 2], **kw)


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


@pytest.mark.parametrize("name", dllm.samplers.names())
def test_the_last_history_entry_is_the_returned_canvas(name, tiny, monkeypatch):
    """With the EOS fill of rows that stop early (after the last forward too), every sampler's history ends
    on the canvas it returns (a padded batch of three rows)."""
    family = {"sdar": "sdar", "s2d2": "sdar", "wedlm": "wedlm", "llada2": "llada2", "llada21": "llada2"}
    family = {**family, "entropy_bound": "diffusion_gemma", "fast_dllm_v2": "fast_dllm_v2"}.get(name, "llada")
    model = tiny(family)
    monkeypatch.setattr(model, "head", _force_eos_at(model, 7 + 1))
    lengths = {"max_new_tokens": 16} if family == "wedlm" else _lengths(family)  # wedlm streams: no blocks
    out = dllm.samplers.get(name).generate(model, PROMPTS, **lengths, history=True, cache=None)
    assert (out.sequences[:, out.prompt_width :] == model.eos_id).any()
    assert model.mask_id is None or not (out.sequences == model.mask_id).any()
    assert torch.equal(out.history[-1], out.sequences)


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
    # the answer is the first max_new_tokens: the block's tail past them is decoded, not counted
    assert out.tokens == [count_generated(out.sequences[:, : 5 + 6], 5, model.eos_ids, model.mask_id).item()]


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "wedlm"])
def test_texts_and_token_counts_hold_at_most_max_new_tokens(family, tiny):
    """issue 39 item 9: tiny-sdar answered '3 17 9' (3 tokens) to max_new_tokens=2 where LLaDA2 cut its block tail;
    every family answers within max_new_tokens, whatever its blocks (``sequences`` keeps whole blocks)."""
    model = tiny(family)
    sampler = dllm.samplers.reference(family)
    prompts = [[10, 11, 12, 13, 14], [20, 21]]  # rows whose blocks end at different columns
    for new in (1, 2, 3, 5):
        out = sampler.generate(model, prompts, max_new_tokens=new, eos_early_stop=False)
        for row, (tokens, text) in enumerate(zip(out.tokens, out.texts)):
            answer = out.sequences[row, out.prompt_width : out.prompt_width + new]
            assert tokens == count_generated(answer[None], 0, model.eos_ids, model.mask_id).item() <= new
            assert text == model.tokenizer.decode(answer.tolist()[:tokens], skip_special_tokens=True)


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


@pytest.mark.parametrize("family", ["llada", "sdar", "llada2", "wedlm", "diffusion_gemma"])
def test_every_sampler_stops_each_row_by_its_own_eos_rule(family):
    """issue 44: ``eos_early_stop`` as a list, one per prompt: each row's canvas, text and token count are those it
    gets alone with its rule (on the bundled models, which end their answers with EOS); a sampler or process that
    reads one rule for the batch refuses the list by name."""
    model = dllm.load(f"tiny-{family.replace('_', '-')}")
    from dllm.tasks import get as task

    prompts = [e.prompt for e in task("arith").examples("test", 3)]
    rules = [True, False, True]
    for name in dllm.samplers.names():
        sampler = dllm.samplers.get(name)
        try:
            sampler.check_drives(model)
            alone = [  # (a setting it refuses whatever the rule: skipped)
                sampler.generate(model, [prompt], eos_early_stop=rule, max_new_tokens=32, seed=3)
                for prompt, rule in zip(prompts, rules)
            ]
        except ConfigError:
            continue
        try:
            run = sampler.prepare(model, prompts, eos_early_stop=rules, max_new_tokens=32, seed=3)
        except ConfigError as e:
            assert not dllm.engine.session.takes_row_eos(sampler) and "one rule for the batch" in str(e), (name, e)
            continue
        assert dllm.engine.session.takes_row_eos(sampler), name
        batch, row_nfe = decode_counting_rows(sampler, run)
        for row, one in enumerate(alone):
            got = batch.sequences[row, batch.prompt_width :]
            expected = one.sequences[0, one.prompt_width :]
            assert torch.equal(got[: expected.shape[0]], expected), (name, row)
            assert (batch.texts[row], batch.tokens[row]) == (one.texts[0], one.tokens[0]), (name, row)
            assert row_nfe[row] == one.nfe, (name, row)  # (a rule's stop saves forwards)


ROW_HYPER = [("threshold", "threshold", [0.9, 0.3, 0.99]), ("factor", "factor", [1.0, 3.0, 0.2])]


@pytest.mark.parametrize(
    "family,name,field,values",
    [(family, *case) for family in ("llada", "sdar") for case in ROW_HYPER]
    + [
        ("fast_dllm_v2", "fast_dllm_v2", "threshold", [0.9, 0.3, 0.99]),
        ("llada2", "llada2", "threshold", [0.95, 0.5, 1.0]),
    ],
)
def test_rows_of_their_own_hyper_parameters_decode_as_alone(family, name, field, values, tiny):
    """issue 44: ``hyper_parameters=[...]``, one dict per prompt of the sampler's per-row fields: each row (greedy and
    sampled) is what the sampler with its values gives alone; the selection rule reads them as a tensor [B]."""
    model, temperatures = tiny(family), [0.0, 1.0, 0.0]
    kw = dict(**_lengths(family), eos_early_stop=False, seed=[1, 2, 3], cache=None)
    batch = dllm.samplers.get(name).generate(
        model, PROMPTS, hyper_parameters=[{field: v} for v in values], temperature=temperatures, **kw
    )
    for row, (prompt, value, t) in enumerate(zip(PROMPTS, values, temperatures)):
        alone = dllm.samplers.get(name, **{field: value}).generate(
            model, [prompt], temperature=t, **{**kw, "seed": row + 1}
        )
        generated = alone.sequences[0, alone.prompt_width :]  # (SDAR: each row's span to its own block end)
        assert torch.equal(batch.sequences[row, batch.prompt_width :][: generated.shape[0]], generated), row


def test_hyper_parameters_per_row_refuse_what_the_rule_reads_as_one(tiny):
    model = tiny("llada")
    for name, values, message in (
        ("llada", [{"remasking": "random"}], "reads \\['remasking'\\] as one value for the batch"),
        ("threshold", [{"threshold": 2}], "threshold must be a number in \\[0, 1\\]"),
        ("threshold", [{"threshold": 0.5}] * 2, "one dict per prompt \\(1 prompts\\)"),
        ("threshold", {"threshold": 0.5}, "one dict per prompt"),
    ):
        with pytest.raises(ConfigError, match=message):
            dllm.samplers.get(name).generate(model, [PROMPTS[0]], max_new_tokens=8, hyper_parameters=values)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shifted_models_first_prompt_column_reads_itself_under_left_padding(temperature, batch_invariant):
    """Fast-dLLM v2 reads a column's logits from the column before, and its first block starts inside the prompt:
    the first prompt column's logits (which Learn2PD's filter reads) come from that column itself, as without left
    padding, never from the pad before it. Learn2PD on the bundled model, with its trained filter, is then the same
    alone and in a padded batch (it was not, sampled)."""
    model = dllm.load("tiny-fast-dllm-v2")
    kw = dict(max_new_tokens=16, eos_early_stop=False, temperature=temperature, seed=5, cache=None)
    batch_invariant(dllm.samplers.get("learn2pd"), model, PROMPTS, orders=[[0, 1, 2], [1, 2, 0]], **kw)
