"""``generate(compile=...)``: the model forward through ``torch.compile`` gives the tokens and forwards of eager
execution. The ``aot_eager`` backend traces the same graphs as inductor (dynamo, symbolic shapes, AOT
autograd) without generating kernels, so the test stays cheap on a CPU (inductor's first compile there takes
about a minute)."""

from __future__ import annotations

import pytest
import torch

import dllm

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
PAIRS = [("threshold", "dual"), ("llada", "dkv"), ("threshold", "window"), ("llada", None)]


def test_compiled_forwards_equal_eager_in_tokens_and_forwards(tiny):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for family, pairs in (("llada", PAIRS), ("dream", PAIRS[:1])):
        model = tiny(family)
        for sampler_name, cache in pairs:
            sampler = dllm.samplers.get(sampler_name)
            kw = {"max_new_tokens": 16, "block_size": 8, "eos_early_stop": False, "cache": cache}
            if cache == "dkv":
                kw["cache"] = dllm.caches.get("dkv", cache_reloading_step=4)
            eager = sampler.generate(model, PROMPTS, **kw)
            compiled = sampler.generate(model, PROMPTS, compile="aot_eager", **kw)
            assert torch.equal(compiled.sequences, eager.sequences), (family, sampler_name, cache)
            assert compiled.nfe == eager.nfe
    assert set(model._dllm_compiled) == {"aot_eager"}  # one compiled forward per model and backend, reused
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the forwards did run compiled
    assert not torch._dynamo.utils.counters["graph_break"]  # each forward is one graph
    # The K/V store is allocated before the first forward and shapes are symbolic: a later generation (another
    # batch size) compiles nothing new.
    torch._dynamo.utils.counters.clear()
    dllm.samplers.get("threshold").generate(model, PROMPTS[:1], compile="aot_eager", cache="dual", max_new_tokens=16)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compile_must_be_a_flag_or_a_backend(tiny):
    with pytest.raises(dllm.ConfigError, match="compile must be True, False or a torch.compile backend"):
        dllm.samplers.get("threshold").generate(tiny("llada"), PROMPTS, max_new_tokens=8, compile="fast")


def test_the_cli_and_lm_eval_pass_compile_through(checkpoint_dir, monkeypatch, capsys):
    """``dllm generate --compile`` and lm-eval's ``compile=`` reach the run (the compile itself is stubbed)."""
    from dllm.cli import main
    from dllm.core import compiled
    from dllm.eval.harness import DllmLM

    asked = []

    def hidden(model, backend):
        asked.append(backend)
        return model.hidden

    monkeypatch.setattr(compiled, "hidden", hidden)
    assert main(["generate", "1 2", "--model", str(checkpoint_dir("llada")), "--max-new-tokens", "8", "--compile"]) == 0
    assert asked == ["inductor"]
    lm = DllmLM(pretrained="tiny-llada", device="cpu", block_size=8, max_new_tokens=8, compile="aot_eager")
    lm._generate_batch(lm.sampler, {"max_new_tokens": 8, "block_size": 8}, [[10, 11, 12]], [0])
    assert asked == ["inductor", "aot_eager"]
    with pytest.raises(dllm.ConfigError, match="compile must be"):
        DllmLM(pretrained="tiny-llada", device="cpu", compile="fast")
