"""The WeDLM family (causal attention in physical order, explicit positions) and its streaming sampler: exact
cache, ragged batches, errors. Parity with the official code: tests/test_parity_wedlm.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import dllm
from dllm.core.errors import ConfigError, ModelError
from dllm.models.layers import KVStore
from dllm.models.loading import build
from dllm.models.tiny import tiny_config

QWEN3 = {"overrides": {"attention_bias": False, "qk_norm": True}}
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [30]]


def test_both_variants_use_the_official_tensor_names(checkpoint_dir):
    qwen2 = load_file(str(checkpoint_dir("wedlm") / "model.safetensors"))
    qwen3 = load_file(str(checkpoint_dir("wedlm", **QWEN3) / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2 and "model.layers.0.self_attn.q_norm.weight" not in qwen2
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3 and "model.layers.0.self_attn.q_proj.bias" not in qwen3
    assert not any(k.startswith("model.layers.0.self_attn.o_proj.bias") for k in {**qwen2, **qwen3})
    assert "lm_head.weight" in qwen2


def test_null_mask_id_is_the_engine_default_and_must_fit_the_vocabulary():
    model = build({**tiny_config("wedlm", 200), "mask_token_id": None})
    assert model.mask_id == 151665
    with pytest.raises(ModelError, match="outside the vocabulary"):
        model.check_usable()


@pytest.mark.parametrize("variant", [{}, QWEN3])
def test_attention_is_causal_in_column_order_and_a_suffix_forward_is_aligned_bottom_right(variant, tiny):
    model = tiny("wedlm", **variant)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, model.vocab_size, (2, 12), generator=g)
    positions = torch.randperm(12, generator=g).expand(2, -1).contiguous()  # any position ids: order is physical
    with torch.no_grad():
        full = model.logits(tokens, positions)
        changed = tokens.clone()
        changed[:, 8:] = 5
        assert torch.allclose(model.logits(changed, positions)[:, :8], full[:, :8], atol=1e-5)
        assert not torch.allclose(model.logits(changed, positions)[:, 8:], full[:, 8:], atol=1e-3)
        kv = KVStore()
        model.logits(tokens, positions, kv=kv, rows=torch.arange(7).expand(2, -1))
        suffix = model.logits(tokens, positions, kv=kv, rows=torch.arange(7, 12).expand(2, -1))
    assert torch.allclose(suffix, full[:, 7:], atol=1e-5)


def _sampler(**kw):
    return dllm.samplers.get("wedlm", **kw)


@pytest.mark.parametrize("variant", [{}, QWEN3])
def test_the_stream_cache_is_exact(variant, tiny):
    model = tiny("wedlm", **variant)
    for kw in ({}, {"wedlm_entropy_threshold": None, "wedlm_window_size": 4}):
        cached = _sampler(**kw).generate(model, PROMPTS, max_new_tokens=20)
        plain = _sampler(**kw).generate(model, PROMPTS, max_new_tokens=20, cache=None)
        every = _sampler(**kw).generate(
            model, PROMPTS, max_new_tokens=20, cache=dllm.caches.get("stream", recompute=True)
        )
        assert torch.equal(cached.sequences, plain.sequences) and torch.equal(every.sequences, plain.sequences)
        assert cached.nfe == plain.nfe == every.nfe


@pytest.mark.parametrize("temperature,kw", [(0.0, {}), (0.9, {"top_k": 20, "top_p": 0.9}), (1.0, {})])
def test_ragged_batches_are_batch_invariant(temperature, kw, tiny):
    """A prompt alone gives its row of a left-padded batch of mixed lengths, greedy and sampled, though the rows
    commit at different rates and finish at different steps. Sampled draws are keyed by the prompt's occurrence in
    the batch, not by its row, so every row of every rotation is compared."""
    model = tiny("wedlm")
    sampler = _sampler(wedlm_window_size=6, **kw)
    for shift in range(len(PROMPTS)):
        prompts = PROMPTS[shift:] + PROMPTS[:shift]
        batch = sampler.generate(model, prompts, max_new_tokens=24, temperature=temperature, seed=3)
        p = batch.prompt_width
        nfes = []
        for r, prompt in enumerate(prompts):
            alone = sampler.generate(model, [prompt], max_new_tokens=24, temperature=temperature, seed=3)
            assert torch.equal(batch.sequences[r, p:], alone.sequences[0, len(prompt) :]), f"row {r}"
            assert batch.tokens[r] == alone.tokens[0]
            nfes.append(alone.nfe)
        if temperature == 0:
            assert batch.nfe == max(nfes)  # one batched forward per step while any row works


@pytest.mark.parametrize("cache", [None, "stream"])
def test_rows_of_their_own_lengths_end_each_at_its_own(cache):
    """issue 44: ``max_new_tokens`` per prompt on the trained tiny-wedlm (EOS stops, a row reaching its length ends
    there): each row as alone with its length, greedy; the batch takes as many forwards as its slowest row."""
    model, sampler = dllm.load("tiny-wedlm"), _sampler()
    prompts = ["Sort the list: 14 7 9\n", "Reverse the list: 3 17 5\n", "What is 3 + 4?\n"]
    lengths = [24, 3, 12]
    batch = sampler.generate(model, prompts, max_new_tokens=lengths, cache=cache)
    nfes = []
    for r, (prompt, length) in enumerate(zip(prompts, lengths)):
        alone = sampler.generate(model, prompt, max_new_tokens=length, cache=cache)
        generated = alone.sequences[0, alone.prompt_width :]
        assert torch.equal(batch.sequences[r, batch.prompt_width :][:length], generated), f"row {r}"
        assert (batch.texts[r], batch.tokens[r]) == (alone.texts[0], alone.tokens[0])
        nfes.append(alone.nfe)
    assert batch.nfe == max(nfes)


def test_the_callback_is_told_the_slots_each_step_commits(tiny):
    """StepInfo.committed: the canvas slots written at that step; over the run they are exactly the generated
    tokens (up to each row's end), each written once."""
    model = tiny("wedlm")
    masks = []
    out = _sampler(wedlm_window_size=6).generate(
        model, PROMPTS, max_new_tokens=16, callback=lambda info: masks.append(info.committed.clone())
    )
    assert len(masks) == out.nfe
    total = torch.stack(masks).long().sum(0)
    assert int(total.max()) == 1  # each slot written once
    assert total.sum(1).tolist() == [min(n + 1, 16) for n in out.tokens]  # the kept stop token is committed too
    assert not bool(total[:, : out.prompt_width].any())  # never the prompt


def test_sampling_depends_on_the_seed(tiny):
    model = tiny("wedlm")
    a = _sampler().generate(model, PROMPTS, max_new_tokens=16, temperature=1.0, seed=1)
    b = _sampler().generate(model, PROMPTS, max_new_tokens=16, temperature=1.0, seed=2)
    assert not torch.equal(a.sequences, b.sequences)


def test_one_token_per_step_without_a_threshold(tiny):
    model = tiny("wedlm")
    out = _sampler(wedlm_entropy_threshold=None).generate(model, [PROMPTS[0]], max_new_tokens=12, eos_early_stop=False)
    # each forward fills one mask, committed at the next forward at the earliest: at least G + 1 forwards
    assert out.nfe >= 12 + 1
    assert out.tokens[0] <= 12


def test_a_stop_token_is_kept_and_ends_the_row(tiny):
    model = tiny("wedlm")
    plain = _sampler().generate(model, PROMPTS, max_new_tokens=32, eos_early_stop=False)
    stopped = _sampler().generate(model, PROMPTS, max_new_tokens=32)
    p = plain.prompt_width
    eos = torch.tensor(model.eos_ids)
    for r in range(len(PROMPTS)):
        row = plain.sequences[r, p:]
        hits = torch.isin(row, eos).nonzero()
        if hits.numel():
            end = int(hits[0]) + 1  # the stop token is kept, the rest is EOS
            assert torch.equal(stopped.sequences[r, p : p + end], row[:end])
            assert bool((stopped.sequences[r, p + end :] == model.eos_id).all())
        else:
            assert torch.equal(stopped.sequences[r, p:], row)


def test_the_window_stops_at_the_maximum_length(checkpoint_dir):
    """The window is not clipped at max_new_tokens but at the model's maximum length (the engine's KV budget)."""
    model = dllm.load(checkpoint_dir("wedlm", max_length=16), device="cpu", dtype=torch.float32)
    out = _sampler(wedlm_window_size=16).generate(model, [list(range(4, 14))], max_new_tokens=6, eos_early_stop=False)
    assert out.sequences.shape == (1, 16)
    plain = _sampler(wedlm_window_size=16).generate(
        model, [list(range(4, 14))], max_new_tokens=6, eos_early_stop=False, cache=None
    )
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("cache", ["default", None])
def test_a_window_past_the_maximum_length_is_the_window_that_fits(cache, checkpoint_dir):
    """A wedlm_window_size past the model's maximum length decodes as the largest window that fits (the positions
    cap it, as the engine's KV budget does), with buffers and forwards no wider than the canvas and the model's
    length: not sized to the window asked for (10**5 took 41 s for 8 tokens, 10**9 tried to allocate 32 GB)."""
    model = dllm.load(checkpoint_dir("wedlm", max_length=32), device="cpu", dtype=torch.float32)
    prompts, kw = [list(range(4, 14)), [20, 21]], {"max_new_tokens": 8, "eos_early_stop": False, "cache": cache}
    fits = _sampler(wedlm_window_size=model.max_length).generate(model, prompts, **kw)
    huge = _sampler(wedlm_window_size=10**5)
    run = huge.prepare(model, prompts, **kw)
    forward, widths = run.forward, []
    run.forward = lambda tokens, *args, **options: widths.append(tokens.shape[1]) or forward(tokens, *args, **options)
    with torch.inference_mode():
        huge.run(run)
    assert max(widths) <= run.canvas.length + model.max_length, widths
    out = huge.finish(run)
    assert torch.equal(out.sequences, fits.sequences) and out.nfe == fits.nfe


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"wedlm_window_size": 0}, "wedlm_window_size must be a positive integer"),
        ({"wedlm_window_size": -3}, "wedlm_window_size must be a positive integer"),
        ({"wedlm_entropy_threshold": -0.1}, r"wedlm_entropy_threshold must be a number in \[0, inf\] or None"),
        ({"wedlm_pos_penalty_factor": -0.02}, "wedlm_pos_penalty_factor must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
    ],
)
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        _sampler(**kw)


def test_misuse_is_refused_clearly(tiny):
    wedlm, llada = tiny("wedlm"), tiny("llada")
    with pytest.raises(ConfigError, match="causal-attention models.*llada model has full attention"):
        _sampler().generate(llada, PROMPTS, max_new_tokens=8)
    with pytest.raises(ConfigError, match="sdar model has block attention"):
        _sampler().generate(tiny("sdar"), PROMPTS, max_new_tokens=8)
    for name in ("llada", "threshold", "dream"):
        with pytest.raises(ConfigError, match="causal attention.*dllm.samplers.get\\('wedlm'\\)"):
            dllm.samplers.get(name).generate(wedlm, PROMPTS, max_new_tokens=8, block_size=8)
    with pytest.raises(ConfigError, match="cache='prefix' does not apply"):
        _sampler().generate(wedlm, PROMPTS, max_new_tokens=8, cache="prefix")
    with pytest.raises(ConfigError, match="'stream' cache .* llada model has full attention"):
        dllm.samplers.get("llada").generate(llada, PROMPTS, max_new_tokens=8, block_size=8, cache="stream")
    with pytest.raises(ConfigError, match="takes no steps budget"):
        _sampler().generate(wedlm, PROMPTS, max_new_tokens=8, steps=8)
    with pytest.raises(ConfigError, match="has no blocks"):
        _sampler().generate(wedlm, PROMPTS, max_new_tokens=8, block_size=4)
