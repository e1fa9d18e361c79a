"""The dispatchable scoring seam (dllm.kernels.dispatch): the registry, resolve, per-call fallback, the loop's use
of the run's backend, generate(kernel=...), and the LM head running only inside the seam."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import dllm
from dllm.core.rng import CounterRNG, Stream
from dllm.kernels import dispatch, reference, selection
from dllm.kernels.reference import STATS, ScoreSpec
from dllm.samplers.transforms import Transform

PROMPTS = ["hello there", "a b c d e f g"]


@pytest.fixture
def fake(monkeypatch, registries):
    """A backend "fake" that scores with the reference and records its calls; ``fake.supports`` decides which
    specs it takes (default: all)."""
    monkeypatch.setattr(dispatch, "_LOADED", dict(dispatch._LOADED))

    class Fake:
        def __init__(self):
            self.calls, self.loads = [], 0

        def supports(self, spec, logits):
            return True

        def load(self):
            self.loads += 1
            return self.score, lambda spec, logits: self.supports(spec, logits)

        def score(self, logits, spec, counters):
            assert logits.dim() == 2, "backends get [N, V] logits"
            self.calls.append(spec)
            return reference.score(logits, spec, counters)

    backend = Fake()
    dispatch.register_backend("fake", load=backend.load, auto=lambda device: True)
    return backend


def _logits(n=12, v=40, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_registry_and_resolve(fake):
    assert {"torch", "triton", "fake"} <= set(dllm.kernels.backends())
    assert dllm.kernels.resolve("torch", "cpu") == "torch"
    assert dllm.kernels.resolve("fake", "cpu") == "fake"
    assert dllm.kernels.resolve("auto", "cpu") == "fake"  # a backend that claims the device for "auto"
    dllm.kernels.unregister_backend("fake")
    assert dllm.kernels.resolve("auto", "cpu") == "torch"  # the reference everywhere else
    with pytest.raises(dllm.ConfigError, match="kernel must be one of 'auto', 'torch', 'triton'.*got 'cuda'"):
        dllm.kernels.resolve("cuda", "cpu")
    with pytest.raises(dllm.ConfigError, match="already registered"):
        dllm.kernels.register_backend("torch", reference.score)
    with pytest.raises(dllm.ConfigError, match="cannot be removed"):
        dllm.kernels.unregister_backend("torch")
    with pytest.raises(dllm.ConfigError, match="other than 'auto'"):
        dllm.kernels.register_backend("auto", reference.score)


def test_the_backend_loads_on_first_use_and_falls_back_per_call(fake):
    assert fake.loads == 0  # registering imports nothing
    fake.supports = lambda spec, logits: spec.temperature == 0
    logits = _logits()
    counters = CounterRNG(3).counters(Stream.TOKENS, torch.arange(12), torch.zeros(12), torch.zeros(12, 1))
    greedy, sampled = ScoreSpec(need=frozenset(STATS)), ScoreSpec(need=frozenset(STATS), temperature=0.8)
    for spec in (greedy, sampled):
        out = dllm.kernels.score(logits, spec, counters, backend="fake")
        want = reference.score(logits, spec, counters)
        for name in ("token", *STATS):
            assert torch.equal(getattr(out, name), getattr(want, name))
    assert fake.loads == 1 and fake.calls == [greedy]  # the sampled spec went to the reference
    assert dispatch.chosen(sampled, logits, "fake") == "torch" and dispatch.chosen(greedy, logits, "fake") == "fake"


def test_triton_is_chosen_only_where_it_can_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "_triton_imports", lambda: False)
    with pytest.raises(dllm.ConfigError, match="triton package does not import.*kernel='torch'"):
        dllm.kernels.resolve("triton", "cpu")
    assert dllm.kernels.resolve("auto", "cuda") == "torch"  # auto never fails: the reference
    monkeypatch.setattr(dispatch, "_triton_imports", lambda: True)
    monkeypatch.setattr(dispatch, "TRITON_MODULE", "dllm.kernels.no_such_module")
    with pytest.raises(dllm.ConfigError, match="no Triton scoring kernels"):
        dllm.kernels.resolve("triton", "cuda")
    # a module that exists (its functions are loaded when the backend is resolved: never inside a compiled step)
    monkeypatch.setattr(dispatch, "_LOADED", {})
    monkeypatch.setattr(dispatch, "TRITON_MODULE", "dllm.kernels.reference")
    monkeypatch.setattr(dispatch, "TRITON_SELECT_MODULE", "dllm.kernels.no_such_module")
    monkeypatch.setattr(dllm.kernels.reference, "supports", lambda spec, logits: True, raising=False)
    assert dllm.kernels.resolve("triton", "cuda") == "triton"
    assert dispatch._LOADED["triton"] == (dllm.kernels.reference.score, dllm.kernels.reference.supports)
    assert dllm.kernels.resolve("auto", "cuda") == "triton"
    assert dllm.kernels.resolve("auto", "cpu") == "torch"
    with pytest.raises(dllm.ConfigError, match="on the CPU only through Triton's interpreter.*TRITON_INTERPRET=1"):
        dllm.kernels.resolve("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dllm.kernels.resolve("triton", "cpu") == "triton"
    assert dllm.kernels.resolve("auto", "cpu") == "torch"  # the interpreter only when asked for


def test_generate_scores_with_the_chosen_backend(fake, tiny):
    model = tiny("llada")
    sampler = dllm.samplers.get("threshold")
    kw = dict(max_new_tokens=16, block_size=8, temperature=0.7, seed=1)
    ref = sampler.generate(model, PROMPTS, kernel="torch", **kw)
    assert ref.kernel == "torch" and set(ref.kernel_calls) == {"torch"} and "kernel torch" in ref.summary()
    out = sampler.generate(model, PROMPTS, kernel="fake", **kw)
    assert torch.equal(out.sequences, ref.sequences) and out.nfe == ref.nfe
    assert out.kernel == "fake" and out.kernel_calls == {"fake": len(fake.calls)} and fake.calls
    assert all(spec.temperature == 0.7 for spec in fake.calls)  # the counters come with it, not draws
    fake.supports = lambda spec, logits: False
    out = sampler.generate(model, PROMPTS, kernel="fake", **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.kernel == "fake" and set(out.kernel_calls) == {"torch"}
    assert "kernel fake (torch for" in out.summary()
    auto = sampler.generate(model, PROMPTS, **kw)  # default "auto": the fake claims every device
    assert auto.kernel == "fake"


@pytest.mark.parametrize("kernel", ["cuda", "", None, 1])
def test_a_bad_kernel_is_refused_before_any_forward(kernel, tiny, monkeypatch):
    model = tiny("llada")
    monkeypatch.setattr(model, "hidden", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(dllm.ConfigError, match="kernel must be one of 'auto', 'torch', 'triton'"):
        dllm.samplers.get("llada").generate(model, "hi", max_new_tokens=8, block_size=8, kernel=kernel)


def test_triton_on_the_cpu_without_the_interpreter_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(dllm.ConfigError, match="kernel='triton' cannot score on cpu.*kernel='torch'"):
        dllm.samplers.get("llada").generate(tiny("llada"), "hi", max_new_tokens=8, block_size=8, kernel="triton")


CASES = [
    ("llada", "llada", {"cfg_scale": 1.0}),  # guidance's unconditional pass
    ("llada", "adablock", {}),  # the look-ahead that sizes blocks
    ("sdar", "s2d2", {}),  # the verifier
    ("llada", "prophet", {}),  # an exit that fills from the kept hidden states
    ("wedlm", "wedlm", {"top_k": 5}),  # a sampler with a loop of its own
]


@pytest.mark.parametrize("family,name,hp", CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_lm_head_runs_only_inside_the_seam(family, name, hp, temperature, tiny, monkeypatch):
    """Every logit of a generation comes from ``Scorer.logits`` (dllm.engine.loop): no sampler or transform
    calls the model's head by itself."""
    model = tiny(family)
    head, callers = model.head, []

    def spy(*args, **kwargs):
        frame = inspect.stack()[1]
        callers.append((frame.function, frame.filename.replace("\\", "/").rsplit("dllm/", 1)[-1]))
        return head(*args, **kwargs)

    monkeypatch.setattr(model, "head", spy)
    kw = {"llada": {"block_size": 8}}.get(family, {})
    dllm.samplers.get(name, **hp).generate(model, PROMPTS, max_new_tokens=16, temperature=temperature, seed=0, **kw)
    assert callers and set(callers) == {("logits", "engine/loop.py")}


@dataclasses.dataclass(frozen=True)
class _Chain(Transform):
    """The old way: the spec's suppression and warps run as a transform at the end of the chain."""

    spec: ScoreSpec

    def __call__(self, logits, rows, columns, step, state):
        return reference.warp(reference.suppress(logits, self.spec.suppress), self.spec)


WARPED = [
    ("llada", "llada", {"logits_eos_inf": True, "cfg_scale": 0.5}),
    ("llada", "dream", {"top_p": 0.8, "top_k": 6}),
    ("dream", "dream", {"alg": "maskgit_plus", "top_p": 0.9}),
    ("dream", "dream", {"alg": "topk_margin", "top_k": 4}),
    ("sdar", "sdar", {"top_k": 5, "top_p": 0.7}),
]


@pytest.mark.parametrize("family,name,hp", WARPED)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_spec_fields_equal_the_transform_chain_end_to_end(family, name, hp, temperature, tiny, monkeypatch):
    """A sampler whose spec carries temperature / top-k / top-p / suppressed ids generates exactly what it
    generates with them run as a logit transform after its others (how they ran before the seam)."""
    model = tiny(family)
    sampler = dllm.samplers.get(name, **hp)
    kw = {} if family == "sdar" else {"block_size": 8}
    kw.update(max_new_tokens=16, temperature=temperature, seed=2)
    want = sampler.generate(model, PROMPTS, **kw)
    cls = type(sampler)
    spec_of, transforms_of = cls.score_spec, cls.transforms
    plain = dict(temper=1.0, top_k=None, top_p=None, suppress=())
    spec = spec_of(sampler, sampler.prepare(model, PROMPTS, **kw))
    assert spec != dataclasses.replace(spec, **plain)  # something to move
    monkeypatch.setattr(cls, "score_spec", lambda self, run: dataclasses.replace(spec_of(self, run), **plain))
    monkeypatch.setattr(cls, "transforms", lambda self, run: (*transforms_of(self, run), _Chain(spec_of(self, run))))
    out = sampler.generate(model, PROMPTS, **kw)
    assert torch.equal(out.sequences, want.sequences) and out.nfe == want.nfe


def _family_of(name):
    own = {"sdar": "sdar", "s2d2": "sdar", "dream": "dream", "wedlm": "wedlm", "llada2": "llada2", "llada21": "llada2"}
    return {**own, "entropy_bound": "diffusion_gemma", "fast_dllm_v2": "fast_dllm_v2"}.get(name, "llada")


@pytest.mark.parametrize("name", dllm.samplers.names())
def test_every_sampler_scores_the_same_with_the_triton_kernels(name, tiny, monkeypatch):
    """``kernel="triton"`` (Triton's interpreter on the CPU) generates what ``kernel="torch"`` generates, greedy
    and sampled (the kernel draws from the same counters); specs it does not fuse go to the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_LOADED", {})  # load the kernels for the interpreter
    family = _family_of(name)
    model = tiny(family)
    kw = {"block_size": 8} if family in ("llada", "dream") else {}
    hp = {"max_denoising_steps": 4} if name == "entropy_bound" else {}  # (48 forwards a canvas by default)
    fused = 0
    for temperature in (0.0, 0.8) if dllm.samplers.get(name).takes_temperature else (0.0,):  # (else: it samples)
        args = dict(max_new_tokens=16, temperature=temperature, seed=3, **kw)
        want = dllm.samplers.get(name, **hp).generate(model, PROMPTS, kernel="torch", **args)
        out = dllm.samplers.get(name, **hp).generate(model, PROMPTS, kernel="triton", **args)
        assert torch.equal(out.sequences, want.sequences) and out.nfe == want.nfe, temperature
        assert out.kernel == "triton" and sum(out.kernel_calls.values()) == sum(want.kernel_calls.values())
        fused += out.kernel_calls.get("triton", 0)
        # kernel B: the samplers whose rule it fuses commit through it at every step, the others not at all
        assert set(want.select_calls) <= {"torch"} and out.select_calls == _fused(want.select_calls, "triton")
        assert bool(out.select_calls) == (name in FUSED_RULES), out.select_calls
    assert fused > 0  # the kernel ran (greedy specs without warps are fused)


# the samplers whose rule kernel B fuses (credit_fusion: the threshold sampler with a logit transform; prophet
# without an answer region, its default: llada alone)
FUSED_RULES = ("llada", "threshold", "factor", "localleap", "credit_fusion", "prophet", "llada2")  # default settings


def _fused(calls, backend):
    return {backend: sum(calls.values())} if calls else {}


class _Recorder:
    """A selector for the fake backend: the reference's select_and_commit, recording each call's rule."""

    def __init__(self):
        self.rules = []

    def load(self):
        return self.select, None

    def select(self, rule, *args):
        self.rules.append(rule)
        return selection.select_and_commit(rule, *args)


_RULE_CASES = [
    ("llada", {}, "top_k"),
    ("llada", {"float64_confidence": True, "confidence_eos_eot_inf": True}, "top_k"),
    ("llada", {"remasking": "random"}, None),
    ("threshold", {"threshold": 0.6}, "threshold"),
    ("factor", {"factor": 2.0}, "factor"),
    ("factor", {"factor": 2.0, "strict_prefix": True}, "factor"),
    ("localleap", {"threshold": 0.7, "relaxed_threshold": 0.3, "radius": 2}, "anchored_threshold"),
    ("localleap", {"threshold": 0.7, "relaxed_threshold": None}, "threshold"),
    ("credit_fusion", {}, "threshold"),
    ("credit", {}, None),  # its own rule (a bar below the best confidence)
    ("adablock", {}, None),  # its own select (block sizing) first
    ("prophet", {"answer_offset": 2}, None),  # exit rules decide with the select
    ("ete", {}, None),
    ("sdar", {"remasking_strategy": "low_confidence_static"}, "top_k"),
    ("sdar", {}, None),
    ("dream", {"alg": "maskgit_plus"}, "top_k"),
    ("dream", {"alg": "maskgit_plus", "alg_temp": 0.5}, None),
    ("dream", {}, None),
]


@pytest.mark.parametrize(
    "name, hp, kind, cache",
    [
        (*case, cache)
        for case in _RULE_CASES
        for cache in (("default", "dual") if _family_of(case[0]) == "llada" else ("default",))
    ],
)
def test_the_fused_rules_commit_through_the_selection_dispatch(name, hp, kind, cache, tiny, fake, monkeypatch):
    """A sampler whose ``select`` is one of kernel B's rules commits through :func:`dllm.kernels.dispatch.select`
    (here a fake backend's selector that records the rule), at every step, with exactly the commits, history and
    callbacks of its own ``select`` (the path with ``kernel_rule`` returning None: ``select``, by default the same
    rule applied by the reference); the others never do."""
    recorder = _Recorder()
    dispatch.register_backend("fake", reference.score, selector=recorder.load, replace=True)
    family = _family_of(name)
    model = tiny(family)
    sampler = dllm.samplers.get(name, **hp)
    kw = {"block_size": 8} if family in ("llada", "dream") else {}
    if cache != "default":
        kw["cache"] = cache
    runs = {}
    for path in ("fused", "select"):
        if path == "select":
            monkeypatch.setattr(type(sampler), "kernel_rule", lambda self, step, state: None)
        commits = []
        record = lambda info, commits=commits: commits.append(info.committed.clone())  # noqa: E731
        out = sampler.generate(
            model,
            PROMPTS,
            max_new_tokens=16,
            temperature=0.8,
            seed=5,
            kernel="fake",
            history=True,
            callback=record,
            **kw,
        )
        runs[path] = out, commits
    (fused, fused_commits), (own, own_commits) = runs["fused"], runs["select"]
    assert torch.equal(fused.sequences, own.sequences) and fused.nfe == own.nfe
    assert all(torch.equal(a, b) for a, b in zip(fused.history, own.history, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fused_commits, own_commits, strict=True))
    assert own.select_calls == {}
    if kind is None:
        assert fused.select_calls == {} and recorder.rules == []
    else:
        assert fused.select_calls == {"fake": len(fused_commits)} and len(recorder.rules) == len(fused_commits)
        assert {rule.kind for rule in recorder.rules} == {kind}


def test_the_selection_dispatch_falls_back_to_the_reference(fake, monkeypatch):
    """A backend without a selector, or a rule its selector does not fuse, commits through the reference."""
    from dllm.kernels.selection import Rule

    confidence = torch.rand(3, 10, generator=torch.Generator().manual_seed(0))
    committable = confidence > 0.2
    proposals = torch.arange(30).reshape(3, 10)
    rule = Rule("threshold", threshold=0.5)
    assert dispatch.chosen_selector(rule, confidence, "fake") == "torch"  # the fake has no selector
    tokens = torch.full((3, 10), -1)
    commit, counts = dllm.kernels.select(rule, confidence, committable, proposals, tokens, backend="fake")
    want = selection.select(rule, confidence, committable)
    assert torch.equal(commit, want) and torch.equal(counts, want.sum(1))
    assert torch.equal(tokens, torch.where(want, proposals, -1))
    recorder = _Recorder()
    never = lambda rule, confidence: False  # noqa: E731
    dispatch.register_backend("fake", reference.score, selector=lambda: (recorder.select, never), replace=True)
    assert dispatch.chosen_selector(rule, confidence, "fake") == "torch"
    dllm.kernels.select(rule, confidence, committable, proposals, tokens.clone(), backend="fake")
    assert recorder.rules == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_LOADED", {})
    factor = Rule("factor", factor=1.0)
    assert dispatch.chosen_selector(factor, confidence.double(), "triton") == "triton"
    assert dispatch.chosen_selector(factor, confidence, "triton") == "torch"  # float32: not fused


@pytest.mark.parametrize("name, hp, kind", [case for case in _RULE_CASES if case[2] is not None and case[1]])
def test_the_fused_rules_of_other_settings_equal_the_reference_with_triton(name, hp, kind, tiny, monkeypatch):
    """The settings of :data:`_RULE_CASES` with a fused rule beyond the samplers' defaults (which the every-sampler
    test covers): ``kernel="triton"`` commits through kernel B and generates what ``kernel="torch"`` generates."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_LOADED", {})  # load the kernels for the interpreter
    family = _family_of(name)
    kw = {"block_size": 8} if family in ("llada", "dream") else {}
    args = dict(max_new_tokens=16, temperature=0.8, seed=7, **kw)
    want = dllm.samplers.get(name, **hp).generate(tiny(family), PROMPTS, kernel="torch", **args)
    out = dllm.samplers.get(name, **hp).generate(tiny(family), PROMPTS, kernel="triton", **args)
    assert torch.equal(out.sequences, want.sequences) and out.nfe == want.nfe
    assert set(want.select_calls) == {"torch"} and out.select_calls == _fused(want.select_calls, "triton")


@pytest.mark.parametrize("name", ["dream", "sdar", "s2d2"])
def test_tempered_samplers_run_the_fused_kernel_at_temperature_above_0(name, tiny, monkeypatch):
    """Dream, SDAR and S2D2 divide the logits by their temperature (``ScoreSpec.temper``): kernel A fuses it, so
    at temperature > 0 every scoring runs the kernel (none falls back to the reference) and the tokens are those
    of ``kernel="torch"``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_LOADED", {})  # load the kernels for the interpreter
    family = _family_of(name)
    model = tiny(family)
    kw = {"block_size": 8} if family == "dream" else {}
    for temperature in (0.8, 0.05):
        args = dict(max_new_tokens=16, temperature=temperature, seed=4, **kw)
        want = dllm.samplers.get(name).generate(model, PROMPTS, kernel="torch", **args)
        out = dllm.samplers.get(name).generate(model, PROMPTS, kernel="triton", **args)
        assert torch.equal(out.sequences, want.sequences) and out.nfe == want.nfe, temperature
        assert set(out.kernel_calls) == {"triton"}, out.scorer
        assert sum(out.kernel_calls.values()) == sum(want.kernel_calls.values())
