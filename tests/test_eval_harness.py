"""The lm-eval model ``dllm`` in-process: request handling, gen_kwargs mapping, likelihoods, errors."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import dllm
from dllm.core.errors import ConfigError
from dllm.eval import tasks
from dllm.eval.harness import DllmLM, RequestRNG, request_key
from dllm.eval.likelihood import is_greedy, mc_loglikelihood

PROMPTS = [ex.prompt for ex in tasks.examples("shuffle")[:3]] + [ex.prompt for ex in tasks.examples("arith")[:2]]


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def lm():
    return DllmLM(pretrained="tiny-llada", device="cpu", batch_size=2, block_size=8, mc_num=4)


def test_registered_under_dllm():
    assert get_model("dllm") is DllmLM


def test_device_and_batch_size_in_model_args_and_as_lm_eval_options():
    """``--model_args ...,device=cpu,batch_size=4`` (as the README lists them) together with lm-eval's own
    ``--device`` / ``--batch_size`` (always passed): the model args win, nothing is given twice."""
    lm_options = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    made = DllmLM.create_from_arg_string("pretrained=tiny-llada,device=cpu,batch_size=4", lm_options)
    assert made.batch_size == 4 and str(made.model.device) == "cpu"
    made = DllmLM.create_from_arg_obj({"pretrained": "tiny-llada", "device": "cpu"}, {**lm_options, "batch_size": 3})
    assert made.batch_size == 3 and str(made.model.device) == "cpu"


def test_generate_until_equals_the_sampler_prompt_by_prompt(lm):
    """Batched (2 per call, longest first, left padding) = each prompt alone through the sampler."""
    gen = {"until": [], "max_gen_toks": 16, "do_sample": False}
    out = lm.generate_until(requests("generate_until", [(p, gen) for p in PROMPTS]))
    sampler = dllm.samplers.reference("llada")
    for prompt, text in zip(PROMPTS, out):
        alone = sampler.generate(lm.model, prompt, max_new_tokens=16, block_size=8)
        assert text == alone.texts[0]
    assert any(text for text in out)


def test_gen_kwargs_map_onto_generation(lm):
    prompt = PROMPTS[3]  # arith: the worked steps span several lines
    full = lm.generate_until(requests("generate_until", [(prompt, {"until": [], "max_gen_toks": 32})]))[0]
    assert "\n" in full
    cut = lm.generate_until(requests("generate_until", [(prompt, {"until": ["\n"], "max_gen_toks": 32})]))[0]
    assert cut == full.split("\n")[0]
    # 12 tokens: the canvas is rounded up to whole blocks (16) and the text cut to 12 tokens
    short = lm.generate_until(requests("generate_until", [(prompt, {"until": [], "max_gen_toks": 12})]))[0]
    ids = lm.tokenizer(full, add_special_tokens=False)["input_ids"]
    assert short == lm.tokenizer.decode(ids[:12]) or len(ids) <= 12
    # do_sample=False forces temperature 0 whatever temperature says
    greedy = lm.generate_until(
        requests("generate_until", [(prompt, {"until": [], "max_gen_toks": 32, "do_sample": False, "temperature": 1})])
    )[0]
    assert greedy == full


def test_sampling_does_not_depend_on_the_batch():
    """At temperature > 0 a request's draws are keyed by the request, not by its row: the same text alone,
    in a batch of 2 or of 5, in any order."""
    gen = {"until": [], "max_gen_toks": 16, "temperature": 1.0, "do_sample": True}
    texts = {}
    for batch_size, order in ((1, PROMPTS), (2, PROMPTS), (5, PROMPTS[::-1])):
        lm = DllmLM(pretrained="tiny-llada", device="cpu", batch_size=batch_size, block_size=8, seed=3)
        out = lm.generate_until(requests("generate_until", [(p, gen) for p in order]))
        texts[batch_size] = dict(zip(order, out))
    assert texts[1] == texts[2] == texts[5]
    greedy = DllmLM(pretrained="tiny-llada", device="cpu", block_size=8)
    out = greedy.generate_until(requests("generate_until", [(p, {**gen, "do_sample": False}) for p in PROMPTS]))
    assert list(texts[1].values()) != out  # it does sample


def test_sampler_and_hyper_parameters_from_model_args():
    lm = DllmLM(pretrained="tiny-llada", device="cpu", sampler="threshold", threshold=1, block_size=8)
    assert lm.sampler == dllm.samplers.get("threshold", threshold=1.0)
    # a gen_kwargs key that is a hyper-parameter of the sampler overrides it for that request group
    sampler, generation, until, cap = lm._settings({"threshold": 0.5, "max_gen_toks": 16, "top_p": 0.9})
    assert sampler == dllm.samplers.get("threshold", threshold=0.5) and cap == 16 and until == []
    assert generation == {"block_size": 8, "max_new_tokens": 16, "temperature": 0.0}
    with pytest.raises(ConfigError, match="no hyper-parameter 'thresh'"):
        DllmLM(pretrained="tiny-llada", device="cpu", sampler="threshold", thresh=0.9)
    with pytest.raises(ConfigError, match="unknown sampler"):
        DllmLM(pretrained="tiny-llada", device="cpu", sampler="nope")


def test_steps_for_an_adaptive_sampler_are_said_to_be_unused(caplog):
    with caplog.at_level("WARNING", logger="dllm.eval.harness"):
        DllmLM(pretrained="tiny-llada", device="cpu", sampler="threshold", steps=8, block_size=8)
    assert "steps not used: 'threshold' is adaptive" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dllm.eval.harness"):
        DllmLM(pretrained="tiny-llada", device="cpu", sampler="llada", steps=8, block_size=8)
    assert "not used" not in caplog.text  # a fixed schedule uses them


def test_model_arg_max_new_tokens_wins_over_max_gen_toks():
    lm = DllmLM(pretrained="tiny-llada", device="cpu", max_new_tokens=16, block_size=8)
    _, generation, _, cap = lm._settings({"max_gen_toks": 256})
    assert generation["max_new_tokens"] == 16 and cap is None


def test_cache_by_name(monkeypatch):
    assert isinstance(DllmLM(pretrained="tiny-llada", device="cpu", cache="dual").cache, dllm.caches.Dual)
    with pytest.raises(ConfigError, match="unknown cache 'nope'"):
        DllmLM(pretrained="tiny-llada", device="cpu", cache="nope")
    assert DllmLM(pretrained="tiny-llada", device="cpu", cache="none").cache is None
    seen = {}

    def get(name, **settings):
        seen.update(name=name, **settings)
        return None

    monkeypatch.setattr(dllm.caches, "get", get, raising=False)
    DllmLM(pretrained="tiny-llada", device="cpu", cache="dual", **{"cache.every": 4})
    assert seen == {"name": "dual", "every": 4}


def test_loglikelihood_is_the_monte_carlo_estimate(lm):
    ex = tasks.examples("arith")[0]
    context, choices, label = tasks.choices(ex)
    out = lm.loglikelihood(requests("loglikelihood", [(context, c) for c in choices]))
    for (ll, greedy), choice in zip(out, choices):
        ctx, target = lm.encode_pair(context, choice)
        # LLaDA's _encode_pair: the context's trailing newline moves onto the continuation
        assert ctx == lm.encode(context.rstrip()) and lm.tokenizer.decode(target) == "\n" + choice
        assert ll == mc_loglikelihood(lm.model, ctx, target, mc_num=4, batch_size=4, seed=0)
        assert greedy == is_greedy(lm.model, ctx, target)
    assert max(range(4), key=lambda i: out[i][0]) == label  # the trained model knows the answer line
    assert out[label][1] is True


def test_encode_pair_moves_trailing_spaces_and_handles_empty_context(lm):
    ctx, target = lm.encode_pair("Copy the list: 3 1 ", "2")
    assert lm.tokenizer.decode(ctx) == "Copy the list: 3 1" and lm.tokenizer.decode(target) == " 2"
    ctx, target = lm.encode_pair("", "3 1")
    assert ctx == [lm.model.bos_id] and lm.tokenizer.decode(target) == "3 1"


def test_loglikelihood_rolling_sums_window_estimates(lm):
    """A text longer than the model's maximum length is scored in lm-eval's rolling windows, each by the
    Monte-Carlo estimate given its context; the sum over windows is returned."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    text = "".join(ex.prompt for ex in tasks.examples("arith")[:15])
    ids = lm.encode(text)
    assert len(ids) > lm.max_length
    (total,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, lm.model.bos_id, lm.max_length - 1, 1)]
    assert len(windows) > 1 and sum(len(t) for _, t in windows) == len(ids)
    assert all(len(c) + len(t) <= lm.max_length for c, t in windows)
    expected = sum(mc_loglikelihood(lm.model, c, t, mc_num=4, batch_size=4, seed=0) for c, t in windows)
    assert total == pytest.approx(expected) and total < 0


def test_chat_template(lm, tiny, monkeypatch):
    chat = [{"role": "user", "content": "Copy the list: 3 1 2"}]
    assert lm.chat_template() is None and lm.tokenizer_name == "tiny-llada"  # trained on plain prompts only
    with pytest.raises(ConfigError, match="tiny-llada has no chat template; run without --apply_chat_template"):
        lm.apply_chat_template(chat)
    model = tiny("llada")  # a checkpoint with a chat template
    monkeypatch.setattr(dllm, "load", lambda *a, **k: model)
    chatty = DllmLM(pretrained="llada", device="cpu")
    text = chatty.apply_chat_template(chat)
    assert text == chatty.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("assistant\n") and chatty.chat_template()


@pytest.mark.parametrize("family", ["dream", "sdar", "llada2", "fast_dllm_v2"])
def test_other_families(tiny, family, monkeypatch):
    """Dream, SDAR, LLaDA2 and Fast-dLLM v2 checkpoints go through the same requests (their reference samplers,
    their likelihoods: LLaDA2's and Fast-dLLM v2's block-wise, as SDAR's)."""
    model = tiny(family)
    monkeypatch.setattr(dllm, "load", lambda *a, **k: model)
    lm = DllmLM(pretrained=family, device="cpu", mc_num=2, greedy=False, max_new_tokens=8)
    assert lm.sampler_name == dllm.samplers.reference(family).name and lm.sampler == dllm.samplers.reference(family)
    (text,) = lm.generate_until(requests("generate_until", [("abc", {"until": []})]))
    assert isinstance(text, str)
    ((ll, greedy),) = lm.loglikelihood(requests("loglikelihood", [("abc", "de")]))
    assert ll < 0 and greedy is False
    ctx, target = lm.encode_pair("abc", "de")
    assert ll == mc_loglikelihood(model, ctx, target, mc_num=2, batch_size=2, seed=0)


def test_diffusion_gemma_generates_as_its_sampler_and_defines_no_likelihood(tiny, monkeypatch):
    """DiffusionGemma through lm-eval: generation is its entropy_bound sampler's (a fixed seed: the canvases start as
    noise), whole answers batched as alone; a log-likelihood request is refused, saying why and what to run."""
    model = tiny("diffusion_gemma")
    monkeypatch.setattr(dllm, "load", lambda *a, **k: model)
    lm = DllmLM(pretrained="diffusion_gemma", device="cpu", batch_size=2, max_new_tokens=6, max_denoising_steps=3)
    assert lm.sampler == dllm.samplers.get("entropy_bound", max_denoising_steps=3)
    prompts = ["abc", "de", "fghi"]
    out = lm.generate_until(requests("generate_until", [(p, {"until": []}) for p in prompts]))
    for prompt, text in zip(prompts, out):  # each alone, its draws keyed by its request as lm-eval's are
        run = lm.sampler.prepare(model, prompt, max_new_tokens=6, seed=lm.seed)
        run.rng = RequestRNG(lm.seed, [request_key(prompt)])
        lm.sampler.run(run)
        alone = lm.sampler.finish(run)
        assert text == alone.texts[0] and len(text) <= 6  # the first max_new_tokens of two canvases of 4
    with pytest.raises(ConfigError, match="defines no log-likelihood.*generate_until"):
        lm.loglikelihood(requests("loglikelihood", [("abc", "de")]))


def test_bad_likelihood_settings():
    with pytest.raises(ConfigError, match="mc_batch_size"):
        DllmLM(pretrained="tiny-llada", device="cpu", mc_num=20, mc_batch_size=8)
    with pytest.raises(ConfigError, match="mc_num"):
        DllmLM(pretrained="tiny-llada", device="cpu", mc_num=0)


def test_falls_back_to_the_cpu_when_cuda_is_missing(monkeypatch):
    """lm-eval passes device=cuda unless told otherwise; without CUDA the model goes to the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lm = DllmLM(pretrained="tiny-llada", device="cuda")
    assert lm.device.type == "cpu"


def test_long_prompts_are_cut_from_the_left(lm):
    long = "".join(ex.prompt for ex in tasks.examples("arith")[:20]) + PROMPTS[0]
    ids = lm.encode(long)
    assert len(ids) + 16 > lm.max_length
    (text,) = lm.generate_until(requests("generate_until", [(long, {"until": [], "max_gen_toks": 16})]))
    kept = ids[-(lm.max_length - 16) :]
    alone = dllm.samplers.reference("llada").generate(lm.model, [kept], max_new_tokens=16, block_size=8)
    assert text == alone.texts[0]


def test_kernel_from_model_args(monkeypatch):
    """``--model_args kernel=...`` reaches every generate() call; a bad one is refused before any request."""
    lm = DllmLM(pretrained="tiny-llada", device="cpu", block_size=8, kernel="torch")
    assert lm.kernel == "torch"
    seen = []
    cls = type(lm.sampler)
    prepare = cls.prepare
    monkeypatch.setattr(cls, "prepare", lambda s, *a, **kw: seen.append(kw["kernel"]) or prepare(s, *a, **kw))
    lm.generate_until(requests("generate_until", [(PROMPTS[0], {"until": [], "max_gen_toks": 8})]))
    assert seen == ["torch"]
    assert DllmLM(pretrained="tiny-llada", device="cpu").kernel == "torch"  # auto on the CPU: the reference
    with pytest.raises(ConfigError, match="kernel must be one of 'auto', 'torch', 'triton'.*got 'fast'"):
        DllmLM(pretrained="tiny-llada", device="cpu", kernel="fast")
