"""The Elastic-Cache reconstruction (experimental) through the public API: gamma = 0 is the no-cache output,
the drift trigger refreshes, cached steps commit only in the sliding window, per-row state (batch
invariance), accounting, bad settings."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.caches import Elastic

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
SAMPLERS = [("llada", {}), ("threshold", {}), ("dream", {}), ("dream", {"alg": "origin"})]
IDS = ["llada", "threshold", "dream", "dream-origin"]
G = 16


def _generate(model, name, hp, prompts, cache, **kw):
    sampler = dllm.samplers.get(name, **hp)
    kw = {"max_new_tokens": G, "block_size": G, "eos_early_stop": False, **kw}
    run = sampler.prepare(model, prompts, cache=cache, **kw)
    with torch.inference_mode():
        sampler.run(run)
    return sampler.finish(run), run


class Spy(Elastic):
    """Records, per forward, which rows refreshed and the layer that triggered each row's next refresh."""

    def start(self, run):
        state = super().start(run)
        object.__setattr__(self, "refreshed", [])
        object.__setattr__(self, "triggers", [])
        return state

    def plan(self, step, state):
        plan = super().plan(step, state)
        self.refreshed.append(state.planned_full.clone() | (plan.queries is None))
        return plan

    def update(self, step, state, committed):
        super().update(step, state, committed)
        self.triggers.append(state.trigger.clone())


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name,hp", SAMPLERS, ids=IDS)
def test_gamma_zero_is_the_no_cache_output(family, name, hp, tiny):
    model = tiny(family)
    for block in (G, 8):
        plain, _ = _generate(model, name, hp, PROMPTS, None, block_size=block, seed=1)
        cached, run = _generate(model, name, hp, PROMPTS, Elastic(gamma=0, window=2), block_size=block, seed=1)
        assert torch.equal(cached.sequences, plain.sequences)
        assert cached.nfe == plain.nfe == run.refreshes


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name,hp", SAMPLERS, ids=IDS)
def test_cached_steps_commit_only_in_the_sliding_window(family, name, hp, tiny):
    model = tiny(family)
    window = 3
    cache = Spy(gamma=0.3, window=window)
    seen = []
    out, run = _generate(model, name, hp, PROMPTS, cache, seed=2, callback=lambda info: seen.append(info))
    assert not (out.sequences == model.mask_id).any()
    assert len(cache.refreshed) == run.nfe and run.refreshes >= 1
    assert sum(int((~r).sum()) for r in cache.refreshed) > run.nfe // 2  # many row-steps reuse the cache
    assert run.refreshes == sum(bool(r.any()) for r in cache.refreshed)
    for info, refreshed in zip(seen, cache.refreshed, strict=True):
        before = (info.tokens == model.mask_id) | info.committed
        rank = before.long().cumsum(1) - 1
        width = info.committed.sum(1).clamp(min=window)  # the window grows to a fixed schedule's quota
        outside = info.committed & ~(before & (rank < width[:, None]))
        assert not (outside & ~refreshed[:, None]).any()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_drift_trigger_decides_the_refreshes(family, tiny):
    """gamma = 1 never refreshes after the first forward (the drift is at most 1); a small gamma refreshes
    often, each refresh following a step whose drift passed gamma at some layer."""
    model = tiny(family)
    _, never = _generate(model, "llada", {}, PROMPTS, Elastic(gamma=1.0, window=2))
    assert never.refreshes == 1 and never.nfe == G
    cache = Spy(gamma=0.01, window=2)
    _, often = _generate(model, "llada", {}, PROMPTS, cache)
    assert often.refreshes > 2
    layers = len(model.decoder)
    for refreshed, trigger in zip(cache.refreshed[1:], cache.triggers[:-1]):
        assert torch.equal(refreshed, trigger >= 0)  # a row refreshes right after its drift passed gamma
        assert bool((trigger < layers).all())


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name,hp", SAMPLERS, ids=IDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_prompt_alone_equals_its_row_in_a_mixed_length_batch(family, name, hp, temperature, tiny):
    model = tiny(family)
    cache = Elastic(gamma=0.05, window=2)
    for r, prompt in enumerate(PROMPTS[:2]):
        batch = [prompt] + [p for p in PROMPTS if p is not prompt]  # row 0: its random streams are (seed, 0)
        kw = {"max_new_tokens": 16, "block_size": 8, "temperature": temperature, "seed": 5}
        together, _ = _generate(model, name, hp, batch, cache, **kw)
        alone, _ = _generate(model, name, hp, [prompt], cache, **kw)
        width = together.prompt_width
        assert torch.equal(together.sequences[0, width:], alone.sequences[0, len(prompt) :]), f"prompt {r}"


@pytest.mark.parametrize(
    "hp", [{"gamma": -0.1}, {"gamma": 1.5}, {"gamma": "0.1"}, {"gamma": True}, {"window": 0}, {"window": 2.5}]
)
def test_bad_settings_are_config_errors(hp):
    with pytest.raises(dllm.ConfigError, match="cache 'elastic'"):
        Elastic(**hp)


def test_flagged_experimental_with_the_paper_defaults():
    assert Elastic.experimental and "EXPERIMENTAL" in Elastic.__doc__
    assert (Elastic().gamma, Elastic().window) == (0.1, 16)
    assert dllm.caches.CACHES.get("elastic") is Elastic


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_an_exit_rule_finishes_rows_at_a_cached_step(family, tiny, exit_at):
    model = tiny(family)
    sampler = dllm.samplers.get("exit_at", base="threshold", at=2)
    kw = {"max_new_tokens": G, "block_size": G, "eos_early_stop": False}
    plain = sampler.generate(model, PROMPTS, cache=None, **kw)
    every = sampler.generate(model, PROMPTS, cache=Elastic(gamma=0), **kw)
    assert torch.equal(every.sequences, plain.sequences) and every.nfe == plain.nfe == 3
    cached = sampler.generate(model, PROMPTS, cache=Elastic(gamma=1.0, window=2), **kw)  # steps 1, 2 cached
    assert not (cached.sequences == model.mask_id).any() and cached.nfe == plain.nfe + 1


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_refresh_recomputes_from_the_first_drifting_layer(family, tiny, monkeypatch):
    """A depth-aware refresh starting at layer l > 0 equals a reference built by hand from the store as it was:
    below l only the queries are computed (against the stored K/V, which the other columns keep), and from l on
    every column is recomputed from the stored layer-l inputs with the queries' fresh rows written in. It
    differs from the all-layer refresh (a plain full forward) only through those layers below l."""
    from dllm.models.layers import ForwardContext, KVStore, Observer, rope_cos_sin

    model = tiny(family, layers=4)
    original, seen = model.hidden, {}

    def spy(tokens, positions, **kw):
        if kw.get("row_start") is None or kw["start_layer"] == 0 or seen:
            return original(tokens, positions, **kw)
        kv = kw["kv"]
        seen["before"] = {name: {i: t.clone() for i, t in getattr(kv, name).items()} for name in ("k", "v", "inputs")}
        seen["call"] = (tokens.clone(), positions.clone(), kw["attention_mask"], kw["queries"], kw["start_layer"])
        seen["out"] = original(tokens, positions, **kw)
        seen["after"] = {name: {i: t.clone() for i, t in getattr(kv, name).items()} for name in ("k", "v")}
        return seen["out"]

    monkeypatch.setattr(model, "hidden", spy)
    _generate(model, "llada", {}, PROMPTS[1:2], Elastic(gamma=0.01, window=2))
    assert seen, "no refresh started above layer 0"
    tokens, positions, valid, queries, start = seen["call"]

    class Inputs(Observer):
        def layer(self, index, hidden):
            if index == start:
                self.fresh = hidden

    store, inputs = KVStore(), Inputs()  # below l: the queries only, against the store as it was
    store.k, store.v = ({i: t.clone() for i, t in seen["before"][name].items()} for name in ("k", "v"))
    store.filled = torch.ones(tokens.shape, dtype=torch.bool)
    original(tokens, positions, attention_mask=valid, queries=queries, kv=store, observer=inputs)
    x = seen["before"]["inputs"][start].clone()  # from l: every column, from the stored inputs
    x.scatter_(1, queries[..., None].expand(-1, -1, x.shape[-1]), inputs.fresh)
    cos, sin = rope_cos_sin(positions, model.head_dim, model.rope_theta)
    ctx = ForwardContext(None, tokens.shape[1], model.attention_mask(positions, valid, None), None)
    for i in range(start, len(model.decoder)):
        x = model.decoder[i](x, cos, sin, i, ctx)
    reference = model.final_norm(x)
    torch.testing.assert_close(seen["out"].states, reference, rtol=1e-6, atol=1e-6)
    for i in range(start):  # the layers below l: the other columns keep their stored K/V
        torch.testing.assert_close(seen["after"]["k"][i], store.k[i], rtol=1e-6, atol=1e-6)
    everything = original(tokens, positions, attention_mask=valid).states  # the all-layer refresh
    assert not torch.allclose(seen["out"].states, everything, atol=1e-4)
