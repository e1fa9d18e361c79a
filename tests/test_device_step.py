"""The step on the device (:mod:`dllm.engine.device`): on the static-shape path a step reads nothing back but its
status, once. Held on the CPU by counting the host's reads (:class:`dllm.core.reads.HostReads`): at most one read
per forward, marginally over a longer generation, for every bundled family's reference sampler and the fused
rules, every cache it runs with, greedy and sampled, rows of different prompt lengths; the tokens and forwards of
the default path; the whole step compiled with ``fullgraph=True``; a step run once every row is done a no-op."""

from __future__ import annotations

import functools

import pytest
import torch

import dllm
from dllm.core.reads import HostReads
from dllm.engine import session
from dllm.engine.loop import Masked
from dllm.models.kv import KVStore

PROMPTS = [
    "Sort the list: 14 7 9\n",
    "Ben has 3 apples. He gets 5 more from Ann. He doubles them. How many apples does Ben have now?\n",
]
SAMPLERS = {  # family -> the samplers to hold to one read per forward, with the caches they run with
    "llada": (("llada", "threshold", "factor", "localleap", "eb"), (None, "prefix", "dual")),
    "dream": (("dream", "threshold", "eb", "ccd"), (None, "prefix", "dual")),
    "sdar": (("sdar", "threshold", "factor"), (None, "block")),
    "llada2": (("llada2", "threshold", "localleap"), (None, "block")),
    "fast_dllm_v2": (("fast_dllm_v2", "threshold"), (None, "block", "subblock")),
}
CELLS = [
    (family, name, cache, temperature)
    for family, (names, caches) in SAMPLERS.items()
    for name in names
    for cache in caches
    for temperature in (0.0, 1.0)
]


@functools.cache
def _model(family):
    return dllm.load(f"tiny-{family}", device="cpu", dtype=torch.float32)


def _sampler(family, name):
    return dllm.samplers.reference(family) if name == family else dllm.samplers.get(name)


def _lengths(model):
    return {} if model.attention.block_causal else {"block_size": 8}


def _generate(model, sampler, cache, new, **kw):
    kw = {**_lengths(model), "max_new_tokens": new, "eos_early_stop": False, "cache": cache, **kw}
    if "compile" in kw:  # (torch.compile runs under no dispatch mode)
        return sampler.generate(model, PROMPTS, **kw), None
    with HostReads() as reads:
        out = sampler.generate(model, PROMPTS, **kw)
    return out, reads


@pytest.mark.parametrize("family,name,cache,temperature", CELLS)
def test_at_most_one_read_per_forward_and_the_default_output(family, name, cache, temperature):
    model, sampler = _model(family), _sampler(family, name)
    sampled = {"temperature": temperature, "seed": 5} if temperature else {}
    default, _ = _generate(model, sampler, cache, 24, **sampled)
    short, short_reads = _generate(model, sampler, cache, 8, static_shapes=True, **sampled)
    long, long_reads = _generate(model, sampler, cache, 24, static_shapes=True, **sampled)
    assert long.step_on_device and long.why_not_on_device is None
    assert torch.equal(long.sequences, default.sequences) and long.nfe == default.nfe
    assert long.nfe > short.nfe
    more = {kind: n - short_reads.where.get(kind, 0) for kind, n in long_reads.where.items()}
    assert long_reads.count - short_reads.count <= long.nfe - short.nfe, more  # the status read, once a step
    assert long_reads.copies == short_reads.copies, long_reads.copied  # nothing copied from the host in a step


EXITS = [  # exit rules that exit, over bases and caches of their own
    ("llada", "prophet", {"base": "llada", "answer_offset": 0}, "dual"),
    ("llada", "prophet", {"base": "threshold", "answer_offset": 2}, None),
    ("dream", "sched", {"base": "dream", "tau_high": 3.0, "tau_low": 1.0}, "prefix"),
    ("sdar", "sched", {"base": "sdar", "tau_high": 3.0, "tau_low": 1.0}, "block"),
]


@pytest.mark.parametrize("family,name,settings,cache", EXITS)
def test_exit_rules_finish_rows_on_the_device(family, name, settings, cache):
    """A row an exit rule finishes is filled from the step's own forward, predicated (no branch on the answer)."""
    model, sampler = _model(family), dllm.samplers.get(name, **settings)
    default, _ = _generate(model, sampler, cache, 24)
    short, short_reads = _generate(model, sampler, cache, 8, static_shapes=True)
    long, long_reads = _generate(model, sampler, cache, 24, static_shapes=True)
    assert long.step_on_device and torch.equal(long.sequences, default.sequences) and long.nfe == default.nfe
    assert long.nfe < _generate(model, dllm.samplers.get(settings["base"]), cache, 24)[0].nfe  # the rule exited
    assert long_reads.count - short_reads.count <= long.nfe - short.nfe
    assert long_reads.copies == short_reads.copies, long_reads.copied


@pytest.mark.parametrize(
    "family,name,settings,cache,why",
    [
        ("llada", "threshold", {}, "dkv", "the 'dkv' cache plans its forwards on the host"),
        ("llada", "llada", {"cfg_scale": 1.0}, None, "Guidance keeps state or runs forwards of its own"),
        ("llada", "credit", {}, None, "'credit' sampler decides on the host"),
        ("llada", "adablock", {}, None, "'adablock' sampler decides on the host"),
        ("dream", "dream", {"alg": "origin"}, None, "alg='origin' looks for its next revealing step"),
        ("llada2", "llada21", {}, "block", "the 'edit' decoding process runs its steps on the host"),
    ],
)
def test_what_cannot_run_on_the_device_says_why_and_gives_the_default_output(family, name, settings, cache, why):
    model, sampler = _model(family), dllm.samplers.get(name, **settings)
    default, _ = _generate(model, sampler, cache, 8, seed=0)  # (Dream's origin draws its coins at temperature 0)
    static, _ = _generate(model, sampler, cache, 8, static_shapes=True, seed=0)
    assert not static.step_on_device and why in static.why_not_on_device
    assert torch.equal(static.sequences, default.sequences) and static.nfe == default.nfe
    assert not default.step_on_device and default.why_not_on_device is None  # not asked for


@pytest.mark.parametrize("family,name,cache", [("llada", "threshold", "dual"), ("llada2", "llada2", "block")])
def test_the_step_function_compiles_whole(family, name, cache):
    """The step function (forward, scoring, decision, commit, bookkeeping, the next step's preparation and status)
    compiled with ``fullgraph=True`` (a graph break is an error: a read would be one) by ``aot_eager``, scalar
    outputs and data-dependent shapes not captured: the default path's tokens and forwards; a second generation of
    the same shapes compiles nothing."""
    model, sampler = _model(family), _sampler(family, name)
    default, _ = _generate(model, sampler, cache, 16)
    strict = torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False)

    def compiled_step(process):
        process.device.step = torch.compile(process.device._step, backend="aot_eager", fullgraph=True, dynamic=False)

    with strict:
        run, _ = _decoded(model, sampler, cache, 16, compiled_step)
        out = session.result(run)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        again = session.result(_decoded(model, sampler, cache, 16, compiled_step)[0])
    assert torch.equal(out.sequences, default.sequences) and out.nfe == default.nfe
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs and torch.equal(
        again.sequences, out.sequences
    )


def _decoded(model, sampler, cache, new=16, adapt=lambda process: None):
    """A static-shape run decoded to its end by hand (as :func:`dllm.engine.session.decode`), its process kept;
    ``adapt(process)`` first."""
    kw = {**_lengths(model), "max_new_tokens": new, "eos_early_stop": False}
    run = sampler.prepare(model, PROMPTS, cache=cache, static_shapes=True, **kw)
    process = Masked(run, sampler)
    adapt(process)
    if run.cache is not None:
        run.cache_state = run.cache.start(run)
        run.cache_state.kv.allocate(model, run.canvas.batch, run.canvas.length)
    with torch.inference_mode():
        while process.next_step():
            process.take_step(0)
    run.checks.now()
    return run, process


def _state(run, process) -> list[torch.Tensor]:
    step, device = process.step, process.device
    tensors = [run.canvas.tokens, step.start, step.end, step.block, step.step, step.t, step.done, device.nfe]
    if run.cache_state is not None:
        kv: KVStore = run.cache_state.kv
        tensors += [*kv.k.values(), *kv.v.values(), kv.filled]
        tensors += [t for t in vars(run.cache_state).values() if isinstance(t, torch.Tensor)]
    return [t.clone() for t in tensors]


@pytest.mark.parametrize(
    "family,name,cache", [("llada", "llada", "dual"), ("llada", "eb", None), ("sdar", "sdar", "block")]
)
def test_a_step_once_every_row_is_done_changes_nothing(family, name, cache):
    model, sampler = _model(family), _sampler(family, name)
    run, process = _decoded(model, sampler, cache)
    assert bool(process.step.done.all())
    before = _state(run, process)
    with torch.inference_mode():
        for width in (8, run.canvas.length) if cache else (None,):
            commit, status, _ = process.device.step(width, False)
            assert not bool(commit.any()) and bool(status[0])  # nothing written, every row still done
    after = _state(run, process)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


CAPTURED = [  # a reference sampler per family with a cache, the fused rules, exit rules
    ("llada", "threshold", {}, "dual"),
    ("llada", "llada", {}, None),
    ("dream", "eb", {}, "prefix"),
    ("sdar", "sdar", {}, "block"),
    ("llada2", "localleap", {}, "block"),
    ("llada", "prophet", {"base": "llada", "answer_offset": 0}, "dual"),
    ("sdar", "sched", {"base": "sdar", "tau_high": 3.0, "tau_low": 1.0}, "block"),
]


@pytest.mark.parametrize("family,name,settings,cache", CAPTURED)
def test_a_captured_step_reads_every_tensor_at_a_static_address(family, name, settings, cache, monkeypatch):
    """compile="reduce-overhead": every tensor the compiled step reads is at a static address (a model weight, the
    K/V store, or a carried tensor's fixed buffer), in a first run and in a second one of the same shapes. On an
    H200, cudagraph trees gave up on a step that wrote the prefix cache's flags in place (inputs not marked
    static) and failed on a schedule's quota that the last replay had produced. The graphs run as traced here
    (no inductor): the default path's tokens and forwards."""
    from dllm.engine.device import DeviceSteps

    unfixed = []

    def record(graph, inputs):
        names = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
        unfixed.extend(
            name for name, t in zip(names, inputs)
            if isinstance(t, torch.Tensor) and getattr(t, "_dynamo_static_input_type", None) is None
        )  # fmt: skip
        return graph.forward

    monkeypatch.setattr(DeviceSteps, "compiled_step", lambda self: torch.compile(self._step, backend=record))
    torch._dynamo.reset()
    model = _model(family)
    sampler = dllm.samplers.get(name, **settings) if settings else _sampler(family, name)
    default, _ = _generate(model, sampler, cache, 16)
    for _ in range(2):
        out, _ = _generate(model, sampler, cache, 16, compile="reduce-overhead")
        assert out.step_on_device and torch.equal(out.sequences, default.sequences) and out.nfe == default.nfe
    assert not unfixed
