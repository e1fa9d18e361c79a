"""``generate(compile=...)``: the model forward through ``torch.compile`` gives the tokens and forwards of eager
execution. The ``aot_eager`` backend traces the same graphs as inductor (dynamo, symbolic shapes, AOT
autograd) without generating kernels, so the test stays cheap on a CPU (inductor's first compile there takes
about ten seconds a graph).

Coverage (one CPU core): with static shapes, every sampler x cache the matrix runs, except Elastic-Cache, whose
probe (an observer inside the forward, with shapes of its own at every step) compiles a graph at most forwards:
one sampler on LLaDA for it (about 15 s); with dynamic shapes (the whole matrix takes about 70 s, Elastic-Cache
40 s more a generation) every cache but Elastic-Cache and every family, with a fixed-schedule and an adaptive
sampler. ``fail_on_recompile_limit_hit``: a forward that would silently fall back to eager fails instead.
"""

from __future__ import annotations

import pytest
import torch
from test_cache_matrix import FAMILIES, KW, MATRIX, _generate, _sampler, refused

import dllm
from dllm.engine import static

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
PAIRS = [("threshold", "dual"), ("llada", "dkv"), ("threshold", "window"), ("llada", "none")]
# LLaDA2's forward (a mixture of experts, dense when compiled) takes several times the others' to trace: its own
# decoders and the adaptive threshold sampler over two caches (with dynamic shapes: threshold over its block cache);
# the other samplers and caches are compiled on the other families. Fast-dLLM v2 is SDAR's block-causal forward with
# Dream's shifted read-out, each compiled with every sampler above: its own sampler, threshold and llada over its
# block caches and the dual cache
OWN = {
    "llada2": {"samplers": ("llada2", "llada21", "threshold"), "caches": ("block", "dual"), "dynamic": ("block",)},
    "fast_dllm_v2": {
        "samplers": ("fast_dllm_v2", "threshold", "llada"),
        "caches": ("block", "subblock", "dual"),
        "dynamic": ("block", "subblock"),
    },
}
counters = torch._dynamo.utils.counters


def _equal_compiled(model, cells, **kw):
    """Each (sampler, cache) of ``cells`` compiled (``aot_eager``) gives the eager tokens and forwards."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for name, cache in cells:
            sampler = _sampler(name)
            eager = _generate(sampler, model, PROMPTS, cache)
            out = _generate(sampler, model, PROMPTS, cache, compile="aot_eager", **kw)
            assert torch.equal(out.sequences, eager.sequences), (model.family, name, cache)
            assert out.nfe == eager.nfe, (model.family, name, cache)
    assert counters["stats"]["unique_graphs"] > 0  # the forwards did run compiled
    assert not counters["graph_break"]  # each forward is one graph


@pytest.mark.parametrize("family", FAMILIES)
def test_static_compiled_forwards_equal_eager_for_every_sampler_and_cache(family, tiny):
    torch._dynamo.reset()
    counters.clear()
    cells = [(s, c) for f, s, c in MATRIX if f == family and refused(s, c, f) is None and c != "elastic"]
    if family in OWN:
        cells = [(s, c) for s, c in cells if s in OWN[family]["samplers"] and c in OWN[family]["caches"]]
    _equal_compiled(tiny(family), cells, static_shapes=True)
    if family == "llada":  # Elastic-Cache: one sampler (a graph at most forwards)
        _equal_compiled(tiny(family), [("threshold", "elastic")], static_shapes=True)


def test_compiled_forwards_equal_eager_in_tokens_and_forwards(tiny):
    torch._dynamo.reset()
    counters.clear()
    kw = {**KW, "cache": "dual"}
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for family, pairs in (("llada", PAIRS), ("dream", PAIRS[:1])):
            _equal_compiled(tiny(family), pairs)
        model = tiny("dream")
        assert set(model._dllm_compiled) >= {("aot_eager", False)}  # one compiled forward per model and setting
        # The K/V store is allocated before the first forward and shapes are symbolic: the same generation again
        # (a new store, new checks) compiles nothing new. (Another batch size did, until the recompile limit was
        # raised, only because dynamo had hit its limit of 8 graphs and run the forward eager: a batch of one
        # without pads has no attention mask, and the full forward's graph specialises the store's batch size.)
        sampler = dllm.samplers.get("threshold")
        sampler.generate(model, PROMPTS, compile="aot_eager", **kw)
        counters.clear()
        sampler.generate(model, PROMPTS, compile="aot_eager", **kw)
    assert not counters["stats"]["unique_graphs"]


def test_static_compiled_forwards_equal_eager_when_rows_finish_early():
    """On the bundled model, where rows finish at different steps (they stay in the compiled forward)."""
    from test_static_shapes import MIXED, _bundled

    torch._dynamo.reset()
    model, sampler = _bundled("llada"), dllm.samplers.get("threshold")
    kw = {"max_new_tokens": 32, "block_size": 8, "cache": "dual"}
    eager = sampler.generate(model, MIXED, **kw)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = sampler.generate(model, MIXED, compile="aot_eager", static_shapes=True, **kw)
    assert torch.equal(out.sequences, eager.sequences) and out.nfe == eager.nfe
    assert (out.sequences == model.eos_id).any(1).all()  # (each row ended with EOS)


@pytest.mark.parametrize("family", FAMILIES)
def test_dynamic_compiled_forwards_equal_eager_for_every_cache(family, tiny):
    """The caches and families the test above does not compile with dynamic shapes (the adaptive threshold sampler)."""
    torch._dynamo.reset()
    counters.clear()
    covered = {("llada", c) for _, c in PAIRS} | {("dream", "dual")}
    caches = [c for c in dllm.caches.names() if c != "elastic" and (family, c) not in covered]
    if family in OWN:
        caches = [c for c in caches if c in OWN[family]["dynamic"]]
    _equal_compiled(tiny(family), [("threshold", c) for c in caches if refused("threshold", c, family) is None])


@pytest.mark.parametrize("cache", ["dkv"])
def test_a_static_run_compiles_a_graph_per_width_and_kind_and_a_second_run_nothing(cache, tiny):
    """The per-step static loop (a cache that plans on the host: the device step's own compile is
    tests/test_device_step.py's), dynamic=False: at most one graph per (forward kind, bucketed width), and one per
    shape of the scoring seam's torch path (compiled with it); the same generation again (a new K/V store, new
    checks) compiles nothing."""
    torch._dynamo.reset()
    counters.clear()
    model, sampler = tiny("llada"), dllm.samplers.get("threshold")
    widths, kinds, scored = set(), set(), set()

    def generate():
        run = sampler.prepare(model, PROMPTS, cache=cache, compile="aot_eager", static_shapes=True, **KW)
        original, score = run.forward, run.score

        def scoring(logits, spec, counters):
            scored.add(tuple(logits.shape))
            return score(logits, spec, counters)

        run.score = scoring

        def forward(tokens, positions, attention_mask=None, **options):
            queries = options.get("queries")
            widths.add(None if queries is None else queries.shape[1])
            kinds.add((queries is None, options.get("keys") is None, isinstance(options.get("write"), torch.Tensor)))
            return original(tokens, positions, attention_mask, **options)

        run.forward = forward
        with torch.inference_mode():
            sampler.run(run)
        return sampler.finish(run)

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = generate()
        graphs = counters["stats"]["unique_graphs"]
        assert 0 < graphs <= len(widths) * len(kinds) + len(scored)
        assert all(w is None or w == static.bucket(w, out.sequences.shape[1]) for w in widths)
        counters.clear()
        again = generate()
    assert torch.equal(again.sequences, out.sequences)
    assert not counters["stats"]["unique_graphs"]


def test_reduce_overhead_compiles_with_inductor_static_shapes_and_a_static_store(tiny):
    """compile="reduce-overhead": the device step compiled whole by inductor (CUDA graphs on a GPU; ignored for CPU
    tensors), static shapes turned on, the K/V store's buffers marked as static addresses. On the CPU it runs and
    gives the eager tokens and forwards. A second run of the same batch and canvas writes into the first run's store
    (the addresses its CUDA graphs were recorded with), and so does its device step's state (canvas, per-row
    state, forward count), which the finished run left on the model while its output kept a copy."""
    torch._dynamo.reset()
    model, sampler = tiny("llada"), dllm.samplers.get("threshold")
    kw = {**KW, "cache": "dual"}
    eager = sampler.generate(model, PROMPTS, **kw)

    def captured():
        out = sampler.generate(model, PROMPTS, compile="reduce-overhead", **kw)
        assert out.step_on_device
        ((key, (k, v, inputs, filled)),) = model._dllm_capture_stores.items()  # left for the next run
        assert key == (len(PROMPTS), out.sequences.shape[1], False)
        assert {getattr(t, "_dynamo_static_input_type", None) for t in (k[0], v[0], filled)} == {"unguarded"}
        ((_, state),) = model._dllm_capture_states.items()
        assert {getattr(t, "_dynamo_static_input_type", None) for t in state} == {"unguarded"}
        storage = out.sequences.untyped_storage().data_ptr()
        assert storage not in {t.untyped_storage().data_ptr() for t in state}  # the output is the run's own
        return out, (k[0].data_ptr(), v[len(v) - 1].data_ptr(), filled.data_ptr(), *(t.data_ptr() for t in state))

    out, first = captured()
    assert torch.equal(out.sequences, eager.sequences) and out.nfe == eager.nfe
    again, second = captured()
    assert second == first and torch.equal(again.sequences, out.sequences) and again.nfe == out.nfe


def test_compile_must_be_a_flag_a_mode_or_a_backend(tiny):
    with pytest.raises(dllm.ConfigError, match="compile must be True, False, 'reduce-overhead' .* or a torch.compile"):
        dllm.samplers.get("threshold").generate(tiny("llada"), PROMPTS, max_new_tokens=8, compile="fast")
    with pytest.raises(dllm.ConfigError, match="which compile='reduce-overhead' turns on"):
        dllm.samplers.get("wedlm").prepare(tiny("wedlm"), PROMPTS, max_new_tokens=8, compile="reduce-overhead")


def test_the_cli_and_lm_eval_pass_compile_through(checkpoint_dir, monkeypatch, capsys):
    """``dllm generate --compile`` and lm-eval's ``compile=`` reach the run (the compile itself is stubbed)."""
    from dllm.cli import main
    from dllm.engine import compiled
    from dllm.eval.harness import DllmLM

    asked = []

    def hidden(model, backend, static=False):
        asked.append((backend, static))
        return model.hidden

    monkeypatch.setattr(compiled, "hidden", hidden)
    base = ["generate", "1 2", "--model", str(checkpoint_dir("llada")), "--max-new-tokens", "8"]
    assert main([*base, "--compile"]) == 0
    assert main([*base, "--compile", "reduce-overhead"]) == 0
    assert main([*base, "--compile", "aot_eager", "--static-shapes"]) == 0
    assert asked == [("inductor", False), ("reduce-overhead", True), ("aot_eager", True)]
    assert main([*base, "--compile", "fast"]) != 0  # the ConfigError, reported
    lm = DllmLM(pretrained="tiny-llada", device="cpu", block_size=8, max_new_tokens=8, compile="aot_eager")
    lm._generate_batch(lm.sampler, {"max_new_tokens": 8, "block_size": 8}, [[10, 11, 12]], [0])
    lm = DllmLM(pretrained="tiny-llada", device="cpu", block_size=8, max_new_tokens=8, static_shapes="true")
    lm._generate_batch(lm.sampler, {"max_new_tokens": 8, "block_size": 8}, [[10, 11, 12]], [0])
    assert asked[3:] == [("aot_eager", False), (None, True)]
    with pytest.raises(dllm.ConfigError, match="compile must be"):
        DllmLM(pretrained="tiny-llada", device="cpu", compile="fast")
    with pytest.raises(dllm.ConfigError, match="static_shapes must be True or False"):
        DllmLM(pretrained="tiny-llada", device="cpu", static_shapes="maybe")
