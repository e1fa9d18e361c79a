"""LocalLeap and AdaBlock beyond parity: batch invariance (greedy and seeded sampling), reductions to the
threshold rule, per-row adaptive blocks, lengths, and bad hyper-parameters."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

import dllm
from dllm import tasks
from dllm.core.errors import ConfigError
from dllm.samplers.adablock import AdaBlock, default_delimiters

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34]]
OTHERS = [[40] * 12, [50]]  # other batch-mates, of other lengths
LEAP = {"threshold": 0.7, "relaxed_threshold": 0.3, "radius": 2}  # relaxes often on the random models
_BUNDLED = {}


def bundled(name):
    if name not in _BUNDLED:
        _BUNDLED[name] = dllm.load(name, device="cpu", dtype=torch.float32)
    return _BUNDLED[name]


def task_prompts(n=4):
    """Bench prompts of different lengths (left padding differs per row) and answer shapes (arith answers
    hold newlines and a period, listops answers neither)."""
    arith, listops = (tasks.get(t).examples("test", n) for t in ("arith", "listops"))
    return [(arith if i % 2 == 0 else listops)[i].prompt for i in range(n)]


def _row(out, r, n):
    return out.sequences[r, out.prompt_width : out.prompt_width + n]


def _alone_equals_batch(sampler, model, prompts, **kw):
    batch = sampler.generate(model, prompts, eos_early_stop=False, **kw)
    for r, prompt in enumerate(prompts):
        alone = sampler.generate(model, [prompt], eos_early_stop=False, **kw)
        n = alone.sequences.shape[1] - alone.prompt_width
        assert torch.equal(_row(batch, r, n), _row(alone, 0, n)), f"row {r}"
    return batch


def _seeded_rows_ignore_the_batch(sampler, model, prompts, **kw):
    """At temperature > 0 a row's draws are keyed by (seed, row): row 0 alone equals row 0 of the batch, and
    every row equals itself in a batch whose other rows (and padding width) differ."""
    kw = {"temperature": 1.0, "seed": 5, "eos_early_stop": False, **kw}
    batch = sampler.generate(model, prompts, **kw)
    alone = sampler.generate(model, prompts[:1], **kw)
    n = alone.sequences.shape[1] - alone.prompt_width
    assert torch.equal(_row(batch, 0, n), _row(alone, 0, n))
    for r in range(1, len(prompts)):
        others = OTHERS
        if isinstance(prompts[0], str):
            others = [e.prompt for e in tasks.get("pick").examples("test", 2)]
        mixed = [others[i % 2] if i != r else p for i, p in enumerate(prompts)]
        other = sampler.generate(model, mixed, **kw)
        assert torch.equal(_row(other, r, n), _row(batch, r, n)), f"row {r}"
    greedy = sampler.generate(model, prompts, **{**kw, "temperature": 0.0})
    assert not torch.equal(greedy.sequences, batch.sequences)  # the draws did something


# -- LocalLeap ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_localleap_batch_invariance(family, tiny):
    model = tiny(family, std=1.0)
    sampler = dllm.samplers.get("localleap", **LEAP)
    batch = _alone_equals_batch(sampler, model, PROMPTS, max_new_tokens=16, block_size=8)
    plain = dllm.samplers.get("threshold", threshold=LEAP["threshold"]).generate(
        model, PROMPTS, max_new_tokens=16, block_size=8, eos_early_stop=False
    )
    assert batch.nfe < plain.nfe  # the relaxation commits more per step here
    _seeded_rows_ignore_the_batch(sampler, model, PROMPTS, max_new_tokens=16, block_size=8)


@pytest.mark.parametrize("model_name", ["tiny-llada", "tiny-dream"])
def test_localleap_bundled_batch_invariance(model_name):
    model = bundled(model_name)
    sampler = dllm.samplers.get("localleap", threshold=0.9, relaxed_threshold=0.5, radius=4)
    _alone_equals_batch(sampler, model, task_prompts(), block_size=8)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_localleap_without_relaxation_is_threshold(family, temperature, tiny):
    """relaxed_threshold=None (and radius=0) is Fast-dLLM's threshold rule at κ, token for token."""
    model = tiny(family, std=1.0)
    kw = dict(max_new_tokens=16, temperature=temperature, seed=1, eos_early_stop=False)
    if family != "sdar":
        kw["block_size"] = 8
    base = dllm.samplers.get("threshold", threshold=0.7).generate(model, PROMPTS, **kw)
    for hp in ({"relaxed_threshold": None}, {"relaxed_threshold": 0.3, "radius": 0}):
        out = dllm.samplers.get("localleap", threshold=0.7, **hp).generate(model, PROMPTS, **kw)
        assert torch.equal(out.sequences, base.sequences), hp
        assert out.nfe == base.nfe
    relaxed = dllm.samplers.get("localleap", **LEAP).generate(model, PROMPTS, **kw)
    assert relaxed.nfe < base.nfe


def test_localleap_relaxes_only_near_anchors():
    """One step's selection on chosen confidences: anchors >= κ, their ±W neighbours (inclusive) at >= τ."""
    sampler = dllm.samplers.get("localleap", threshold=0.9, relaxed_threshold=0.5, radius=2)
    prob = torch.tensor([[0.1, 0.6, 0.6, 0.95, 0.6, 0.6, 0.6, 0.6, 0.89, 0.2]], dtype=torch.float64)
    committable = torch.ones_like(prob, dtype=torch.bool)
    committable[0, 2] = False  # not masked: never committed, never an anchor
    allowed = committable

    class Step:
        scores = type("S", (), {"prob": prob})
        quota = None

        @property
        def committable(self):
            return allowed

        def among_committable(self, values, fill=float("-inf")):
            return values.masked_fill(~committable, fill)

    got = sampler.select(Step(), None)[0].nonzero().squeeze(1).tolist()
    assert got == [1, 3, 4, 5]  # 6 and 7 lie 3 and 4 columns from the anchor; 8 (0.89) is not an anchor
    prob[0, 3] = 0.5  # no anchor: the plain rule at κ, the best slot always
    assert sampler.select(Step(), None)[0].nonzero().squeeze(1).tolist() == [8]


# -- AdaBlock -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recording(AdaBlock):
    """AdaBlock that logs each row's block bounds after each step's decision (into ``Recording.states``)."""

    name: ClassVar[str] = "adablock_recording"
    states: ClassVar[list] = []

    def init_state(self, run):
        state = super().init_state(run)
        state.log = []
        Recording.states.append(state)
        return state

    def select(self, step, state):
        first = step.step == 0
        out = super().select(step, state)
        state.log.append((first & ~step.done, step.start - step.canvas.prompt_width, step.end - step.start))
        return out


def _blocks(sampler, model, prompts, **kw):
    """The generation and each row's list of (start offset, block length)."""
    out = sampler.generate(model, prompts, **{"eos_early_stop": False, **kw})
    rows = [[] for _ in prompts]
    for first, start, length in Recording.states.pop().log:
        for r in first.nonzero().squeeze(1).tolist():
            rows[r].append((int(start[r]), int(length[r])))
    return out, rows


@pytest.mark.parametrize("model_name", ["tiny-llada", "tiny-dream"])
def test_adablock_rows_size_their_own_blocks(model_name):
    """In a left-padded batch each row ends its blocks at its own delimiters, exactly as alone; every block
    that is not the fallback size ends with a delimiter (inclusive) within the look-ahead window."""
    model = bundled(model_name)
    prompts = task_prompts()
    sampler = Recording(threshold=0.9, delimiter_threshold=0.3)
    kw = dict(max_new_tokens=32, block_size=16)
    batch, rows = _blocks(sampler, model, prompts, **kw)
    assert len({tuple(r) for r in rows}) > 1, "rows should get different block ends"
    delims = set(default_delimiters(model.tokenizer))
    assert delims == {6, 234}
    adapted = 0
    for r, prompt in enumerate(prompts):
        alone, (blocks,) = _blocks(sampler, model, [prompt], **kw)
        assert blocks == rows[r]
        assert torch.equal(_row(batch, r, 32), _row(alone, 0, 32))
        assert [s for s, _ in blocks] == [0] + [s + n for s, n in blocks[:-1]]  # contiguous
        assert sum(n for _, n in blocks) == 32
        for start, n in blocks:
            if n != min(16, 32 - start):
                adapted += 1
                assert n <= int(0.25 * 32)
                assert int(_row(batch, r, 32)[start + n - 1]) in delims
    assert adapted > 0


@pytest.mark.parametrize("model_name", ["tiny-llada", "tiny-dream"])
def test_adablock_seeded_rows_ignore_the_batch(model_name):
    _seeded_rows_ignore_the_batch(
        dllm.samplers.get("adablock", delimiter_threshold=0.3),
        bundled(model_name),
        task_prompts(3),
        block_size=8,
        temperature=3.0,  # the trained models are sure of themselves: at 1.0 samples are the greedy tokens
    )


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_adablock_random_model_batch_invariance(family, tiny):
    model = tiny(family, std=1.0)
    ids = [54, 7, 62, 30]  # tokens these random models often propose
    sampler = dllm.samplers.get("adablock", threshold=0.7, delimiter_ids=ids, delimiter_threshold=0.05)
    fixed = dllm.samplers.get("adablock", threshold=0.7, delimiter_ids=ids, delimiter_threshold=float("inf"))
    kw = dict(max_new_tokens=20, block_size=6)  # 20 is not a multiple of 6
    out = _alone_equals_batch(sampler, model, PROMPTS, **kw)
    assert not torch.equal(out.sequences, fixed.generate(model, PROMPTS, eos_early_stop=False, **kw).sequences)
    _seeded_rows_ignore_the_batch(sampler, model, PROMPTS, **kw)


@pytest.mark.parametrize("model_name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_adablock_with_infinite_delimiter_threshold_is_threshold(model_name, temperature):
    """δ = inf keeps the block_size grid: Fast-dLLM's threshold rule on fixed blocks, token for token."""
    model = bundled(model_name)
    kw = dict(max_new_tokens=32, block_size=8, temperature=temperature, seed=2, eos_early_stop=False)
    base = dllm.samplers.get("threshold", threshold=0.8).generate(model, task_prompts(), **kw)
    out = dllm.samplers.get("adablock", threshold=0.8, delimiter_threshold=float("inf")).generate(
        model, task_prompts(), **kw
    )
    assert torch.equal(out.sequences, base.sequences) and out.nfe == base.nfe
    grid = [(s, 8) for s in range(0, 32, 8)]
    _, rows = _blocks(Recording(threshold=0.8, delimiter_threshold=float("inf")), model, task_prompts(), **kw)
    assert all(r == grid for r in rows)
    _, rows = _blocks(Recording(threshold=0.8, delimiter_threshold=0.0), model, task_prompts(), **kw)
    assert any(r != grid for r in rows)  # δ matters on these prompts


def test_adablock_lengths(tiny):
    model = bundled("tiny-llada")
    prompt = task_prompts(1)
    # max_new_tokens need not fit the initial block size; threshold's grid check stays. Adaptive: steps are not
    # used (the official code takes them and ignores them), whatever their value
    out = dllm.samplers.get("adablock").generate(model, prompt, max_new_tokens=30, block_size=7)
    for steps in (30, 13, 1):
        again = dllm.samplers.get("adablock").generate(model, prompt, max_new_tokens=30, block_size=7, steps=steps)
        assert again.sequences.equal(out.sequences) and again.nfe == out.nfe
    assert out.sequences.shape[1] - out.prompt_width == 30 and not (out.sequences == model.mask_id).any()
    with pytest.raises(ConfigError, match="multiple of block_size"):
        dllm.samplers.get("threshold").generate(model, prompt, max_new_tokens=30, block_size=7)
    # a block size beyond the span: one block (unless a delimiter ends it earlier)
    dllm.samplers.get("adablock").generate(model, prompt, max_new_tokens=8, block_size=64)
    assert dllm.samplers.get("adablock").with_exit().grid_blocks is False


def test_default_delimiters(tiny, monkeypatch):
    assert default_delimiters(bundled("tiny-llada").tokenizer) == (6, 234)
    assert default_delimiters(None) == ()
    model = tiny("llada")
    monkeypatch.setattr(model, "tokenizer", None)
    with pytest.raises(ConfigError, match="delimiter_ids"):
        dllm.samplers.get("adablock").generate(model, [[10, 11]], max_new_tokens=8)
    dllm.samplers.get("adablock", delimiter_ids=[7]).generate(model, [[10, 11]], max_new_tokens=8)


# -- bad hyper-parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,hp,key",
    [
        ("localleap", {"threshold": 1.5}, "threshold"),
        ("localleap", {"threshold": None}, "threshold must be a number in .*use the 'llada' sampler"),
        ("localleap", {"relaxed_threshold": 0.95}, "relaxed_threshold"),
        ("localleap", {"relaxed_threshold": -0.1}, "relaxed_threshold"),
        ("localleap", {"relaxed_threshold": "0.5"}, "relaxed_threshold"),
        ("localleap", {"radius": -1}, "radius"),
        ("localleap", {"radius": 1.5}, "radius"),
        ("adablock", {"threshold": -0.2}, "threshold"),
        ("adablock", {"threshold": None}, "threshold"),
        ("adablock", {"delimiter_ids": []}, "delimiter_ids"),
        ("adablock", {"delimiter_ids": "\n"}, "delimiter_ids"),
        ("adablock", {"delimiter_ids": [6, -1]}, "delimiter_ids"),
        ("adablock", {"delimiter_ids": [6.0]}, "delimiter_ids"),
        ("adablock", {"delimiter_ids": 6}, "delimiter_ids"),
        ("adablock", {"delimiter_threshold": -0.1}, "delimiter_threshold"),
        ("adablock", {"delimiter_threshold": float("nan")}, "delimiter_threshold"),
        ("adablock", {"delimiter_threshold": None}, "delimiter_threshold"),
        ("adablock", {"radius": 4}, "radius"),
    ],
)
def test_bad_hyper_parameters(name, hp, key):
    with pytest.raises(ConfigError, match=key):
        dllm.samplers.get(name, **hp)


def test_adablock_refuses_block_models_and_windowed_caches(tiny):
    """Block-causal models keep their trained blocks; a cache computing only its own window of masks would not
    compute the look-ahead window (the prefix, dual and dKV caches do: tests/test_cache_matrix.py)."""
    with pytest.raises(ConfigError, match="block_size"):
        dllm.samplers.get("adablock").generate(tiny("sdar"), [[10, 11]], max_new_tokens=8)
    with pytest.raises(ConfigError, match="look-ahead window.*'window' cache does not compute"):
        dllm.samplers.get("adablock").generate(tiny("llada"), [[10, 11]], max_new_tokens=8, cache="window")
    out = dllm.samplers.get("adablock").generate(tiny("llada"), [[10, 11]], max_new_tokens=8, cache="dual")
    assert not bool((out.sequences == tiny("llada").mask_id).any())


def test_registered_with_official_names():
    assert {"localleap", "adablock"} <= set(dllm.samplers.names())
    assert dllm.samplers.defaults("localleap") == {"threshold": 0.9, "relaxed_threshold": 0.75, "radius": 4}
    assert dllm.samplers.defaults("adablock") == {"threshold": 0.9, "delimiter_ids": None, "delimiter_threshold": 0.3}
    assert dllm.samplers.get("adablock", delimiter_ids=[6, 234]).delimiter_ids == (6, 234)


def test_bench_accepts_adaptive_blocks():
    from dllm.bench.runner import resolve_generation

    model = bundled("tiny-llada")
    values = {"max_new_tokens": 30, "block_size": 7, "temperature": 0.0}
    assert resolve_generation(model, dllm.samplers.get("adablock"), values)["block_size"] == 7
    with pytest.raises(ConfigError, match="multiple"):
        resolve_generation(model, dllm.samplers.get("threshold"), values)
