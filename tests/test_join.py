"""issue 44: rows joining a running generation between its steps (:mod:`dllm.engine.join`), each decoding as alone."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.engine import join, session

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34], [40, 41]]
LENGTHS = [16, 8, 24, 16]
TEMPERATURES = [1.0, 0.0, 2.5, 1.0]
SEEDS = [5, 6, 7, 5]


def decode_joining(sampler, model, when, temperatures=TEMPERATURES, hyper=None, **kw):
    """PROMPTS decoded by one run that rows join: row 0 starts (on a canvas wide enough for all), rows 1 and 2
    join at step ``when`` (one prepared run), row 3 at the step after row 0 finishes; each row's (generated tokens,
    nfe) by its index in PROMPTS."""

    def prepared(rows):
        return sampler.prepare(
            model,
            [PROMPTS[r] for r in rows],
            max_new_tokens=[LENGTHS[r] for r in rows],
            temperature=[temperatures[r] for r in rows],
            seed=[SEEDS[r] for r in rows],
            **({} if hyper is None else {"hyper_parameters": [hyper[r] for r in rows]}),
            **kw,
        )

    first = prepared([0])
    first = join.widened(first, max(map(len, PROMPTS)), max(map(len, PROMPTS)) + max(LENGTHS) + 8)
    decoding = session.Decoding(first, sampler, count_rows=True)
    ids, out, steps, waiting = [0], {}, 0, [[1, 2], [3]]
    with torch.inference_mode():
        while True:
            running = decoding.step()
            steps += 1
            done = decoding.process.done().nonzero().squeeze(1)
            for r in done.tolist():
                if ids[r] not in out:
                    got = session.result(decoding.run, torch.tensor([r]))
                    out[ids[r]] = (got.sequences[0, got.prompt_width :], int(decoding.row_nfe[r]), got.texts[0])
            if waiting and (steps == when or (waiting == [[3]] and 0 in out)):
                rows = waiting.pop(0)
                keep = decoding.join(prepared(rows))
                ids = [ids[i] for i in keep.tolist()] + rows
            elif not running:
                break
    decoding.end()
    return out


def _temperatures(sampler):
    """Each row's temperature (one for every row where the sampler reads it beyond its scores)."""
    if not sampler.takes_temperature:
        return [0.0] * len(PROMPTS)
    return TEMPERATURES if session.takes_row_temperatures(sampler) else [1.0] * len(PROMPTS)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "fast_dllm_v2"])
@pytest.mark.parametrize("name", dllm.samplers.names())
def test_rows_that_join_a_running_generation_decode_as_alone(family, name, tiny):
    check_joins(family, name, None, tiny)


def check_joins(family, name, cache, tiny):
    """Rows joining a running generation between its steps (two at step 2, one after the first row finished and
    left): each row's tokens, text and forwards are those of generate() of it alone with its length, temperature
    and seed. A sampler or process that cannot take joined rows says why (join.why_not) and refuses them."""
    model, sampler = tiny(family), dllm.samplers.get(name)
    try:
        sampler.check_drives(model)
    except ConfigError:
        return
    kw = dict(block_size=8) if family in ("llada", "dream") else {}
    kw |= dict(eos_early_stop=False, cache=cache)
    temperatures = _temperatures(sampler)
    try:
        run = sampler.prepare(model, [PROMPTS[0]], max_new_tokens=LENGTHS[0], **kw)
    except ConfigError as e:  # (learn2pd without a trained filter for this model; a cache the sampler refuses)
        assert "filter" in str(e) or cache is not None, e
        return
    why = join.why_not(run, sampler)
    if why is not None:
        expected = ("decoding process", "reads the whole span", "state is the batch's", "keeps the batch's state")
        expected += ("cache's state is the batch's",)
        assert any(reason in why for reason in expected), why
        decoding = session.Decoding(run, sampler)
        decoding.step()
        other = sampler.prepare(model, [PROMPTS[1]], max_new_tokens=LENGTHS[1], **kw)
        with pytest.raises(join.Unjoinable, match="cannot join"):
            decoding.join(other)
        return
    out = decode_joining(sampler, model, 2, temperatures=temperatures, **kw)
    for r, prompt in enumerate(PROMPTS):
        alone = sampler.generate(
            model, [prompt], max_new_tokens=LENGTHS[r], temperature=temperatures[r], seed=SEEDS[r], **kw
        )
        generated = alone.sequences[0, alone.prompt_width :]
        tokens, nfe, text = out[r]
        assert torch.equal(tokens[: generated.shape[0]], generated), f"row {r}"
        assert (nfe, text) == (alone.nfe, alone.texts[0]), f"row {r}"


def test_a_join_that_does_not_fit_changes_nothing(tiny):
    """A prompt wider than the running canvas, another block grid or a state that does not join: refused by name,
    and the running rows decode on as before."""
    model, sampler = tiny("llada"), dllm.samplers.get("threshold")
    kw = dict(block_size=8, eos_early_stop=False, cache=None, max_new_tokens=16)
    alone = sampler.generate(model, [PROMPTS[2]], **kw)
    decoding = session.Decoding(sampler.prepare(model, [PROMPTS[2]], **kw), sampler, count_rows=True)
    decoding.step()
    for other, match in (
        (sampler.prepare(model, [PROMPTS[1]], **kw), "a prompt of 7 columns"),
        (sampler.prepare(model, [PROMPTS[0]], **{**kw, "max_new_tokens": 24}), "a span of 24 columns"),
        (sampler.prepare(model, [PROMPTS[0]], **{**kw, "block_size": 4}), "another block grid"),
        (sampler.prepare(model, [PROMPTS[0]], **{**kw, "cache": "dual"}), "another cache"),
    ):
        with pytest.raises(join.Unjoinable, match=match):
            decoding.join(other)
        assert join.fits(decoding.run, other, sampler) is not None
    with torch.inference_mode():
        while decoding.step():
            pass
    decoding.end()
    out = session.result(decoding.run)
    assert torch.equal(out.sequences, alone.sequences) and int(decoding.row_nfe[0]) == alone.nfe


@pytest.mark.parametrize("cache", ["prefix", "dual", "dkv", "window", "subblock", "elastic", "block"])
@pytest.mark.parametrize("family,name", [("llada", "threshold"), ("llada", "llada"), ("dream", "dream"),
                                         ("sdar", "sdar"), ("llada2", "llada2"), ("llada", "prophet")])  # fmt: skip
def test_rows_join_a_running_generation_with_its_cache(family, name, cache, tiny):
    """The same with a cache: its per-row state joins, and its store keeps the running rows and takes the new ones
    (their first forward refreshes them); a cache whose state is the batch's refuses the rows by name."""
    try:
        dllm.caches.get(cache).check_model(tiny(family))
    except ConfigError:
        return
    check_joins(family, name, dllm.caches.get(cache), tiny)


@pytest.mark.parametrize("cache", ["dual", "dkv"])
def test_rows_left_out_of_a_join_leave_the_store(cache, tiny):
    """A join that keeps some running rows only (rows that finished inside the last step are still in the store):
    the store moves the kept rows' K/V to the front and the new rows after them, each row decoding as alone."""
    model, sampler = tiny("llada"), dllm.samplers.get("threshold", threshold=0.99)
    kw = dict(block_size=8, eos_early_stop=False, cache=dllm.caches.get(cache), max_new_tokens=16, seed=[5, 6])
    decoding = session.Decoding(sampler.prepare(model, PROMPTS[1:3], **kw), sampler, capacity=4)
    with torch.inference_mode():
        for _ in range(3):
            decoding.step()
        store = decoding.run.cache_state.kv
        assert store.filled.shape[0] == 2 and bool(store.filled[1].any())
        kept = store.k[0][1].clone()
        join.join(decoding.process, sampler.prepare(model, [PROMPTS[0]], **{**kw, "seed": [7]}), torch.tensor([1]))
        assert store.filled.shape[0] == 2 and not bool(store.filled[1].any())  # (the spare rows: no new buffer)
        assert torch.equal(store.k[0][0], kept)
        while decoding.step():
            pass
    decoding.end()
    out = session.result(decoding.run)
    for row, (prompt, seed) in enumerate(((PROMPTS[2], 6), (PROMPTS[0], 7))):
        alone = sampler.generate(model, [prompt], **{**kw, "seed": seed})
        assert out.texts[row] == alone.texts[0]
        assert torch.equal(out.sequences[row, -16:], alone.sequences[0, -16:]), row


def test_the_store_extends_into_its_spare_rows_or_new_buffers(tiny):
    """KVStore.extend: rows after the kept ones, unwritten; in the buffers' spare rows where allocate() left some,
    else in new buffers that keep what the store holds."""
    from dllm.models.kv import KVStore

    model = tiny("llada")
    for capacity in (None, 3):
        store = KVStore().allocate(model, 2, 5, capacity)
        for layer in store.k:
            store.k[layer].copy_(torch.arange(2, dtype=store.k[layer].dtype)[:, None, None, None])
        store.filled.fill_(True)
        store.keep(torch.tensor([1]))
        store.extend(2)
        assert store.filled.tolist() == [[True] * 5, [False] * 5, [False] * 5]
        assert all(bool((t[0] == 1).all()) and t.shape[0] == 3 for t in store.k.values())


@pytest.mark.parametrize("cache", [None, "dual"])
def test_rows_of_their_own_thresholds_join_as_alone(cache):
    """Rows of their own per-row hyper-parameters (threshold's threshold) join a running generation: each decodes as
    the sampler with its value does alone (the trained model: its confidences reach the thresholds)."""
    model, sampler = dllm.load("tiny-llada"), dllm.samplers.get("threshold")
    thresholds = [1.0, 0.3, 0.99, 0.6]  # (the first row, one token per step, runs longest)
    kw = dict(block_size=8, eos_early_stop=False, cache=cache)
    out = decode_joining(sampler, model, 1, hyper=[{"threshold": t} for t in thresholds], **kw)
    for r, (prompt, threshold) in enumerate(zip(PROMPTS, thresholds)):
        alone = dllm.samplers.get("threshold", threshold=threshold).generate(
            model, [prompt], max_new_tokens=LENGTHS[r], temperature=TEMPERATURES[r], seed=SEEDS[r], **kw
        )
        tokens, nfe, text = out[r]
        assert torch.equal(tokens[: LENGTHS[r]], alone.sequences[0, alone.prompt_width :]), r
        assert (nfe, text) == (alone.nfe, alone.texts[0]), r


@pytest.mark.parametrize("cache", [None, "block"])
def test_llada21_rows_join_while_the_running_rows_edit(cache, tmp_path, monkeypatch):
    """LLaDA2.1's edit process takes joined rows: each row's own blocks kept open for edits (``keep_open``, its
    mask-free forwards and last edit) join with it, so every row, edits included, decodes as alone (S mode, which
    edits whatever it is confident of: a random model of wide logits edits many slots)."""
    from dllm.engine.edit import Editing
    from dllm.models.tiny import make_tiny_checkpoint

    model = dllm.load(make_tiny_checkpoint(tmp_path, "llada2", seed=0, std=0.5), device="cpu")
    sampler = dllm.samplers.get("llada21", threshold=0.5, editing_threshold=0.0)
    edits = []
    commit = Editing.commit_decision

    def counted(self):
        written = commit(self)
        edits.append(int(self.edited.sum()))
        return written

    monkeypatch.setattr(Editing, "commit_decision", counted)
    kw = dict(eos_early_stop=False, cache=cache)
    out = decode_joining(sampler, model, 2, **kw)
    assert sum(edits) > 0
    for r, prompt in enumerate(PROMPTS):
        alone = sampler.generate(
            model, [prompt], max_new_tokens=LENGTHS[r], temperature=TEMPERATURES[r], seed=SEEDS[r], **kw
        )
        generated, (tokens, nfe, text) = alone.sequences[0, alone.prompt_width :], out[r]
        assert torch.equal(tokens[: generated.shape[0]], generated), r  # (its span starts on the block grid)
        assert (nfe, text) == (alone.nfe, alone.texts[0]), r
