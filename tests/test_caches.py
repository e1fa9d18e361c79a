"""The cache interface: plans (queries, visible keys, write-back, observers), updates, and the errors that
replace silent zeros."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dllm
from dllm.caches.base import Cache, Plan
from dllm.models.layers import KVStore, Observer

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]


class EveryStep(Cache):
    """A full forward that stores every column's K/V at every step, and a record of what it is told."""

    def start(self, run):
        self.committed, self.blocks = 0, 0  # (a test spy: records on itself, the run's state is separate)
        return super().start(run)

    def begin_block(self, step, state, rows):
        self.blocks += int(rows.sum())

    def plan(self, step, state):
        return Plan(refresh=True)

    def update(self, step, state, committed):
        self.committed += int(committed.sum())


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_a_cache_refreshed_every_step_gives_the_no_cache_output(family, tiny):
    model = tiny(family)
    kw = {"max_new_tokens": 16} if family == "sdar" else {"max_new_tokens": 16, "block_size": 8}
    for name in ("threshold", "llada"):
        sampler = dllm.samplers.get(name)
        plain = sampler.generate(model, PROMPTS, cache=None, eos_early_stop=False, **kw)
        cache = EveryStep()
        cached = sampler.generate(model, PROMPTS, cache=cache, eos_early_stop=False, **kw)
        assert torch.equal(cached.sequences, plain.sequences) and cached.nfe == plain.nfe
        masks = int(sampler.prepare(model, PROMPTS, **kw).canvas.masked.sum())
        assert cache.committed == masks  # told every commit, once
        assert cache.blocks == len(PROMPTS) * 2 if family != "sdar" else cache.blocks >= len(PROMPTS) * 4


class SubsetFirst(Cache):
    def plan(self, step, state):
        return Plan(queries=step.of_active(step.window(4)))


def test_attending_to_never_computed_keys_is_an_error(tiny):
    with pytest.raises(dllm.ModelError, match="never computed"):
        dllm.samplers.get("threshold").generate(
            tiny("llada"), PROMPTS, max_new_tokens=8, block_size=4, cache=SubsetFirst()
        )


def _canvas(model):
    tokens = torch.tensor([[0, 0, 10, 11, 12, 1, 1, 1], [20, 21, 22, 23, 1, 1, 1, 1]])
    valid = tokens.new_ones(tokens.shape, dtype=torch.bool)
    valid[0, :2] = False
    return tokens, valid, model.positions(valid)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_visible_keys_act_like_a_key_mask(family, tiny):
    model = tiny(family)
    tokens, valid, pos = _canvas(model)
    keys = valid.clone()
    keys[:, 6:] = False  # hide the last two columns
    with torch.no_grad():
        hidden = model.hidden(tokens, pos, attention_mask=valid, keys=keys)
        expected = model.hidden(tokens, pos, attention_mask=valid & keys)  # hidden columns as if pads
    torch.testing.assert_close(hidden.states[:, :6], expected.states[:, :6], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hidden.states[:, :6], model.hidden(tokens, pos, attention_mask=valid).states[:, :6])


def test_write_back_only_where_the_plan_says(tiny):
    model = tiny("llada")
    tokens, valid, pos = _canvas(model)
    kv = KVStore()
    with torch.no_grad():
        model.hidden(tokens, pos, attention_mask=valid, kv=kv)  # fills every column
        stored = kv.k[0].clone()
        changed = tokens.clone()
        changed[:, 5:] = 7
        queries = torch.tensor([[5, 6, 7], [5, 6, 7]])
        write = torch.tensor([[True, False, False], [True, True, False]])
        model.hidden(changed, pos, attention_mask=valid, queries=queries, kv=kv, write=write)
    written = (kv.k[0] != stored).any(-1).any(1)  # [B, L] columns whose stored keys changed
    assert written.tolist() == [[False] * 5 + [True, False, False], [False] * 5 + [True, True, False]]


class Counting(Observer):
    def __init__(self):
        self.layers, self.attentions = [], []

    def layer(self, index, hidden):
        self.layers.append(index)

    def attention(self, index, q, keys, mask):
        self.attentions.append((index, q.shape[2], keys.shape[2]))


def test_the_observer_sees_every_layer_of_a_forward(tiny):
    model = tiny("dream")
    tokens, valid, pos = _canvas(model)
    observer = Counting()
    kv = KVStore()
    with torch.no_grad():
        model.hidden(tokens, pos, attention_mask=valid, kv=kv, observer=observer)
        model.hidden(
            tokens, pos, attention_mask=valid, kv=kv, queries=torch.tensor([[4, 5], [4, 5]]), observer=observer
        )
    n = len(model.decoder)
    assert observer.layers == list(range(n)) * 2
    assert observer.attentions == [(i, 8, 8) for i in range(n)] + [(i, 2, 8) for i in range(n)]


def test_logits_of_a_column_whose_source_was_not_computed_are_an_error(tiny):
    model = tiny("dream")  # column i's logits come from column i - 1
    tokens, valid, pos = _canvas(model)
    kv = KVStore()
    with torch.no_grad():
        model.hidden(tokens, pos, attention_mask=valid, kv=kv)
        hidden = model.hidden(tokens, pos, attention_mask=valid, kv=kv, queries=torch.tensor([[5, 6], [5, 6]]))
        model.head(hidden, torch.tensor([[6], [6]]))  # source 5 was computed
        with pytest.raises(dllm.ModelError, match="did not compute"):
            model.head(hidden, torch.tensor([[5], [5]]))  # source 4 was not


def test_caches_by_name_and_their_errors(tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("threshold")
    kw = {"max_new_tokens": 8, "block_size": 4}
    by_name = sampler.generate(model, PROMPTS, cache="dual", **kw)
    by_object = sampler.generate(model, PROMPTS, cache=dllm.caches.get("dual"), **kw)
    assert torch.equal(by_name.sequences, by_object.sequences)
    assert torch.equal(
        sampler.generate(model, PROMPTS, cache="none", **kw).sequences,
        sampler.generate(model, PROMPTS, cache=None, **kw).sequences,
    )
    assert set(dllm.caches.names()) >= {"prefix", "dual", "dkv", "block"}
    assert dllm.caches.defaults("dkv") == {"cache_reloading_step": 1, "refresh_prompt": False}
    with pytest.raises(dllm.ConfigError, match="unknown cache 'nope'; available: prefix, dual, dkv"):
        sampler.generate(model, PROMPTS, cache="nope", **kw)
    with pytest.raises(dllm.ConfigError, match="no hyper-parameter 'window'; valid: cache_reloading_step"):
        dllm.caches.get("dkv", window=3)
    with pytest.raises(dllm.ConfigError, match="cache_reloading_step must be a positive integer"):
        dllm.caches.get("dkv", cache_reloading_step=0)
    with pytest.raises(dllm.ConfigError, match="refresh_steps must be an integer >= 0"):
        dllm.caches.get("dual", refresh_steps=-1)
    with pytest.raises(dllm.ConfigError, match="cache must be a name"):
        sampler.generate(model, PROMPTS, cache=3, **kw)
    with pytest.raises(dllm.ConfigError, match="block-causal"):
        sampler.generate(model, PROMPTS, cache="block", **kw)
    with pytest.raises(dllm.ConfigError, match="cannot be combined with a K/V cache"):
        dllm.samplers.get("llada", cfg_scale=1.0).generate(model, PROMPTS, cache="prefix", **kw)


def test_the_store_keeps_rows_in_place():
    """Rows leaving the batch: the kept rows move to the front of the same buffers (no new allocation)."""
    kv = KVStore()
    k = torch.arange(4 * 2 * 3 * 1, dtype=torch.float32).reshape(4, 2, 3, 1)
    kv.put(0, k.clone(), -k.clone())
    kv.filled = torch.tensor([[True, False, False], [False, True, False], [True, True, False], [False, False, True]])
    pointer = kv.k[0].untyped_storage().data_ptr()
    kv.keep(torch.tensor([1, 3]))
    assert torch.equal(kv.k[0], k[[1, 3]]) and torch.equal(kv.v[0], -k[[1, 3]])
    assert kv.filled.tolist() == [[False, True, False], [False, False, True]]
    assert kv.k[0].untyped_storage().data_ptr() == pointer
    kv.put(0, torch.ones(2, 2, 3, 1), torch.ones(2, 2, 3, 1))  # a later full forward writes in place
    assert kv.k[0].untyped_storage().data_ptr() == pointer and bool((kv.k[0] == 1).all())


def test_a_scratch_store_copies_some_rows_and_leading_columns():
    """A forward of a sampler's own (S2D2's verifier) extends a copy of the store's rows and leading columns with
    blank columns; the store itself is left as it was."""
    kv = KVStore()
    k = torch.arange(3 * 2 * 4 * 1, dtype=torch.float32).reshape(3, 2, 4, 1)
    kv.put(0, k.clone(), -k.clone())
    kv.filled = torch.tensor([[True, True, False, False], [True, False, True, False], [True, True, True, True]])
    out = kv.scratch(torch.tensor([2, 0]), 3, 2)
    assert out.k[0].shape == (2, 2, 5, 1) and len(out) == 1
    assert torch.equal(out.k[0][:, :, :3], k[[2, 0], :, :3]) and torch.equal(out.v[0][:, :, :3], -k[[2, 0], :, :3])
    assert not out.k[0][:, :, 3:].any() and not out.v[0][:, :, 3:].any()
    assert out.filled.tolist() == [[True, True, True, False, False], [True, True, False, False, False]]
    out.k[0].fill_(7)
    assert torch.equal(kv.k[0], k) and kv.filled.shape == (3, 4)


def _tensors(obj) -> list[str]:
    """Names of the attributes of ``obj`` (one level into containers) that hold tensors."""
    found = []
    for key, value in vars(obj).items():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) or hasattr(v, "kv") for v in values):
            found.append(key)
    return found


# every built-in cache with settings that make most forwards cached (block: SDAR only)
BUILT_IN = [("prefix", {}), ("dual", {}), ("dkv", {"cache_reloading_step": 4}), ("window", {"active_tokens": 4})]
BUILT_IN += [("elastic", {"window": 4}), ("block", {})]


@pytest.mark.parametrize("name,hp", BUILT_IN, ids=[n for n, _ in BUILT_IN])
def test_a_cache_object_holds_no_tensors_after_generate_and_serves_two_generations(name, hp, tiny):
    """Built like a sampler: the cache object is its hyper-parameters; the K/V store and counters live on the
    run (``run.cache_state``) and die with it. One object serves two generations (two models, two batch
    sizes) with the outputs of fresh objects."""
    cache = dllm.caches.get(name, **hp)
    assert dataclasses.is_dataclass(cache) and cache.__dataclass_params__.frozen
    families = ["sdar", "sdar"] if name == "block" else ["llada", "dream"]  # one block-causal tiny family
    sampler = dllm.samplers.get("threshold")
    kw = {"max_new_tokens": 16, "eos_early_stop": False}
    for family, prompts in zip(families, (PROMPTS, PROMPTS + [[30, 31], [40, 41, 42, 43]])):
        model = tiny(family)
        kw["block_size"] = 4 if family == "sdar" else 8
        shared = sampler.generate(model, prompts, cache=cache, **kw)
        assert _tensors(cache) == [], f"{name} keeps {_tensors(cache)} after generate"
        fresh = sampler.generate(model, prompts, cache=dllm.caches.get(name, **hp), **kw)
        assert torch.equal(shared.sequences, fresh.sequences) and shared.nfe == fresh.nfe


def test_the_stream_cache_holds_no_tensors_after_its_own_loop(tiny):
    """WeDLM's streaming sampler runs its own loop: its stream cache's state lives on the run there too."""
    model, cache = tiny("wedlm"), dllm.caches.get("stream")
    sampler = dllm.samplers.get("wedlm")
    for prompts in (PROMPTS, PROMPTS + [[30, 31]]):
        shared = sampler.generate(model, prompts, max_new_tokens=12, cache=cache)
        assert _tensors(cache) == []
        fresh = sampler.generate(model, prompts, max_new_tokens=12, cache=dllm.caches.get("stream"))
        assert torch.equal(shared.sequences, fresh.sequences) and shared.nfe == fresh.nfe


def test_the_run_drops_the_cache_state_when_it_ends(tiny):
    sampler = dllm.samplers.get("threshold")
    run = sampler.prepare(tiny("llada"), PROMPTS, cache="dual", max_new_tokens=16, block_size=8)
    seen = []
    original = run.forward

    def forward(*args, **options):
        seen.append(run.cache_state.kv)
        return original(*args, **options)

    run.forward = forward
    with torch.inference_mode():
        sampler.run(run)
    assert len(seen[0]) > 0 and all(kv is seen[0] for kv in seen)  # one store for the whole run
    assert run.cache_state is None
