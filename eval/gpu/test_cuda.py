"""Correctness on CUDA, step 1 of the prepared device check (``eval/gpu/check.sh``; run it alone with
``python -m pytest -v eval/gpu/test_cuda.py``).

CI has no GPU: there the Triton kernels run through Triton's interpreter and ``compile="reduce-overhead"`` runs
inductor without CUDA graphs. This file asks the same questions of the compiled kernels and of captured graphs:

- kernel A (:mod:`dllm.kernels.triton_score`, the kernel's own tiling plan) equals the PyTorch reference on the
  same device at the published vocabularies (LLaDA 126,464; Dream 152,064), bfloat16 and float32 logits, greedy
  and sampled from the same counters (``tests/kernel_checks.py``: tokens exactly, statistics to their last bits);
- kernel B (:mod:`dllm.kernels.triton_select`) commits what :mod:`dllm.kernels.selection` commits on
  canvases of real width;
- each family's reference sampler (and Fast-dLLM's threshold rule with the dual cache) on a tiny random model
  gives the same tokens and forwards with ``kernel="triton"`` as with ``kernel="torch"``, in float32 and
  bfloat16, greedy and sampled;
- ``compile="reduce-overhead"`` gives the eager tokens and forwards for ``threshold`` + ``dual`` and ``llada``
  without a cache, records CUDA graphs in its first generation, skips none, and a second generation records
  none.

Without a GPU it runs the same code on the CPU (the kernels through the interpreter: set ``TRITON_INTERPRET=1``)
at fewer rows, which is how the script was rehearsed; the CUDA-graph counts are then zero and not asserted.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from kernel_checks import ALL, assert_same, counters_for, expected, logits_with_edges, selection_inputs  # noqa: E402

import dllm  # noqa: E402
from dllm.kernels import selection, triton_score, triton_select  # noqa: E402
from dllm.kernels.reference import ScoreSpec  # noqa: E402
from dllm.kernels.selection import Rule  # noqa: E402
from dllm.models.tiny import make_tiny_checkpoint  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
ROWS = 64 if GPU else 3  # rows of logits per kernel A case
CANVAS = (64, 1024) if GPU else (4, 96)  # batch x length of kernel B's cases
VOCABS = (126464, 152064)  # LLaDA-8B, Dream-7B
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]


def test_the_device_is_what_the_check_reports():
    if GPU:
        assert not triton_score.interpreted() and not triton_select.interpreted()
    print(DEVICE, torch.cuda.get_device_name() if GPU else "", torch.__version__)


# (logits dtype, ScoreSpec.dtype, temper): Fast-dLLM's float64 probabilities over bfloat16 logits, the logits'
# own dtype, Dream's / SDAR's tempered logits
KERNEL_A = [(torch.bfloat16, None, 1.0), (torch.bfloat16, torch.float64, 1.0), (torch.float32, None, 1.0)]
KERNEL_A += [(torch.bfloat16, None, 0.7)]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype,spec_dtype,temper", KERNEL_A, ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kernel_a_equals_the_reference(vocab, dtype, spec_dtype, temper, temperature, monkeypatch):
    logits = logits_with_edges(ROWS, vocab, dtype, seed=vocab + int(10 * temperature), device=DEVICE)
    counters = counters_for(ROWS, device=DEVICE) if temperature > 0 else None
    spec = ScoreSpec(need=ALL, temperature=temperature, dtype=spec_dtype, exclude=(1, vocab - 2), temper=temper)
    assert triton_score.supports(spec, logits)
    got = triton_score.score(logits, spec, counters)
    # float32 probabilities: PyTorch's softmax on the CPU sums the 126,464 terms with a relative error up to 3e-5
    # (against float64; the kernel's: 2e-7), far above the last bits that smaller vocabularies are held to
    tol = 1e-4 if (spec_dtype or dtype) == torch.float32 else None
    assert_same(got, expected(logits, spec, counters, monkeypatch), spec_dtype or dtype, tol)
    if temperature > 0 and GPU:  # it samples: many proposals are not the argmax
        assert (got.token != got.argmax).sum() > ROWS // 4
    if temperature > 0:  # a seed per row (the server's batches): each row's key read by the kernel
        mixed = counters_for(ROWS, seed=[7 + (r % 3) * 2**40 for r in range(ROWS)], device=DEVICE)
        got = triton_score.score(logits, spec, mixed)
        assert_same(got, expected(logits, spec, mixed, monkeypatch), spec_dtype or dtype, tol)


RULES = [Rule("top_k"), Rule("threshold", threshold=0.9), Rule("factor", factor=1.0)]
RULES += [Rule("anchored_threshold", threshold=0.9, relaxed=0.5, radius=2), Rule("threshold", 0.5, strict=True)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.kind)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_b_commits_what_the_reference_commits(rule, dtype):
    if not triton_select.supports(rule, torch.zeros(1, 1, dtype=dtype, device=DEVICE)):
        assert rule.kind == "factor" and dtype != torch.float64  # its thresholds would round in that dtype
        return
    for seed, levels in [(0, None), (1, 4), (2, 16)]:
        confidence, committable, proposals, tokens, quota = selection_inputs(
            *CANVAS, dtype=dtype, seed=seed, levels=levels, device=DEVICE
        )
        finish = torch.zeros(confidence.shape[0], dtype=torch.bool, device=DEVICE)
        finish[2] = True
        want_tokens = tokens.clone()
        want = selection.select_and_commit(rule, confidence, committable, proposals, want_tokens, quota, finish)
        got = triton_select.select_and_commit(rule, confidence, committable, proposals, tokens, quota, finish)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(tokens, want_tokens)


_MODELS: dict = {}


def tiny(family: str, dtype: torch.dtype, tmp_path_factory) -> dllm.models.base.DiffusionLM:
    """A tiny random checkpoint of ``family`` loaded on the device in ``dtype`` (the parity fixtures' weights)."""
    if (family, dtype) not in _MODELS:
        directory = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
        _MODELS[family, dtype] = dllm.load(directory, device=DEVICE, dtype=dtype)
    return _MODELS[family, dtype]


GENERATIONS = [("llada", "llada", None), ("dream", "dream", None), ("sdar", "sdar", "default")]
GENERATIONS += [("wedlm", "wedlm", "default"), ("llada", "threshold", "dual")]


@pytest.mark.parametrize("family,sampler,cache", GENERATIONS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_generation_with_the_kernels_equals_the_reference(
    family, sampler, cache, dtype, temperature, tmp_path_factory
):
    model = tiny(family, dtype, tmp_path_factory)
    kw = dict(max_new_tokens=16, temperature=temperature, seed=0, eos_early_stop=False, cache=cache)
    kw.update({"sdar": {"block_size": 4}, "wedlm": {}}.get(family, {"block_size": 8}))  # SDAR's trained block
    fused = dllm.samplers.get(sampler).generate(model, PROMPTS, kernel="triton", **kw)
    plain = dllm.samplers.get(sampler).generate(model, PROMPTS, kernel="torch", **kw)
    assert fused.kernel == "triton" and plain.kernel == "torch"
    assert torch.equal(fused.sequences, plain.sequences) and fused.nfe == plain.nfe


class Recordings:
    """Counts CUDA-graph recordings (``capture_begin``) while it is entered."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.original = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(graph, *args, **kwargs):
            self.count += 1
            return self.original(graph, *args, **kwargs)

        torch.cuda.CUDAGraph.capture_begin = capture_begin
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.capture_begin = self.original


@pytest.mark.parametrize("sampler,cache,kernel", [("threshold", "dual", "auto"), ("llada", None, "auto")], ids=str)
def test_reduce_overhead_equals_eager_and_a_second_generation_records_nothing(sampler, cache, kernel, tmp_path_factory):
    counters = torch._dynamo.utils.counters
    torch._logging.set_logs(perf_hints=True)  # cudagraph trees say why they skip a graph
    model = tiny("llada", torch.float32, tmp_path_factory)
    kw = dict(max_new_tokens=16, block_size=8, eos_early_stop=False, cache=cache, kernel=kernel)
    eager = dllm.samplers.get(sampler).generate(model, PROMPTS, **kw)
    skips = counters["inductor"]["cudagraph_skips"]
    with Recordings() as first:
        out = dllm.samplers.get(sampler).generate(model, PROMPTS, compile="reduce-overhead", **kw)
    with Recordings() as second:
        again = dllm.samplers.get(sampler).generate(model, PROMPTS, compile="reduce-overhead", **kw)
    print(f"recordings: first generation {first.count}, second {second.count}; skips {counters['inductor']}")
    assert torch.equal(out.sequences, eager.sequences) and out.nfe == eager.nfe
    assert torch.equal(again.sequences, eager.sequences) and again.nfe == eager.nfe
    if GPU:  # (on the CPU inductor skips every graph: CPU tensors)
        assert counters["inductor"]["cudagraph_skips"] == skips  # the reasons: the captured log (perf hints)
        assert first.count > 0
    assert second.count == 0


@pytest.mark.parametrize(
    "family,sampler,cache", [("llada", "threshold", "dual"), ("llada", "llada", None), ("sdar", "sdar", "block")]
)
def test_the_device_step_reads_nothing_back_and_equals_eager(family, sampler, cache, tmp_path_factory):
    """The static-shape step on the device (:mod:`dllm.engine.device`): the eager tokens and forwards; no
    synchronisation inside a step (``torch.cuda.set_sync_debug_mode("error")`` around each step's launch: a read
    would raise); at most one host read per forward, marginally (``dllm.core.reads.HostReads``); with
    ``compile="reduce-overhead"`` the same again, and a second generation records no graph."""
    from dllm.core.reads import HostReads
    from dllm.engine import device

    # float32: inductor's fused bfloat16 arithmetic rounds otherwise than eager's op by op, and a tiny random model's
    # near-uniform logits turn that into other tokens (run 6: the captured bfloat16 tokens differed); float32 keeps
    # the comparison about the step's logic
    model = tiny(family, torch.float32, tmp_path_factory)
    kw = dict(eos_early_stop=False, cache=cache, **({} if model.attention.block_causal else {"block_size": 8}))
    s = dllm.samplers.get(sampler)
    eager = s.generate(model, PROMPTS, max_new_tokens=32, **kw)
    original = device.DeviceSteps.take_step

    def strict(self):
        if GPU:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self)
        finally:
            if GPU:
                torch.cuda.set_sync_debug_mode("default")

    device.DeviceSteps.take_step = strict
    try:
        with HostReads() as short_reads:
            short = s.generate(model, PROMPTS, max_new_tokens=8, static_shapes=True, **kw)
        with HostReads() as reads:
            out = s.generate(model, PROMPTS, max_new_tokens=32, static_shapes=True, **kw)
    finally:
        device.DeviceSteps.take_step = original
    print(f"reads: {short_reads.count} for {short.nfe} forwards, {reads.count} for {out.nfe}; {reads.where}")
    assert out.step_on_device and torch.equal(out.sequences, eager.sequences) and out.nfe == eager.nfe
    assert reads.count - short_reads.count <= out.nfe - short.nfe
    with Recordings() as first:
        captured = s.generate(model, PROMPTS, max_new_tokens=32, compile="reduce-overhead", **kw)
    with Recordings() as second:
        s.generate(model, PROMPTS, max_new_tokens=32, compile="reduce-overhead", **kw)
    print(f"recordings of the captured step: first generation {first.count}, second {second.count}")
    assert torch.equal(captured.sequences, eager.sequences) and captured.nfe == eager.nfe
    assert second.count == 0


# -- since run 3: the fused forward, the grouped experts, the constraints' masks ------------------------------------


def fused_attributes(model) -> list[tuple]:
    """(module, attribute, value) of every fused projection (:class:`dllm.models.layers.Fused`) in ``model``."""
    from dllm.models.layers import Fused

    return [(m, k, v) for m in model.modules() for k, v in vars(m).items() if isinstance(v, Fused)]


class Separate:
    """While entered, ``model`` runs its separate products: every fused projection undone (``fused = None``) and
    the experts without the grouped GEMM (:func:`dllm.models.moe.use_grouped` False)."""

    def __init__(self, model, monkeypatch):
        self.model, self.monkeypatch = model, monkeypatch

    def __enter__(self):
        from dllm.models import moe

        self.fused = fused_attributes(self.model)
        for m, name, _ in self.fused:
            setattr(m, name, None)
        self.monkeypatch.setattr(moe, "use_grouped", lambda *args: False)
        return self

    def __exit__(self, *exc):
        for m, name, fused in self.fused:
            setattr(m, name, fused)
        self.monkeypatch.undo()


@pytest.mark.parametrize("family", ["llada", "dream", "llada2", "diffusion_gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_forward_and_the_grouped_experts_give_the_separate_products_tokens(
    family, dtype, tmp_path_factory, monkeypatch
):
    """The projections fused at load (q/k/v, gate/up) and the MoE families' grouped GEMM against the same model's
    separate products, greedy: the same tokens and forwards in float32 (bfloat16: printed, rounding may flip a
    near-tie); on CUDA the grouped GEMM runs (``torch._grouped_mm``), counted."""
    from dllm.models import moe

    model = tiny(family, dtype, tmp_path_factory)
    sampler = dllm.samplers.reference(model.family)
    kw = dict(max_new_tokens=16, eos_early_stop=False, **({} if model.attention.block_causal else {"block_size": 8}))
    if family == "diffusion_gemma":
        kw = dict(max_new_tokens=2 * model.block_size, seed=0)
    calls = []
    grouped = moe.grouped
    monkeypatch.setattr(moe, "grouped", lambda *a: calls.append(1) or grouped(*a))
    fused = sampler.generate(model, PROMPTS, **kw)
    assert fused_attributes(model)
    if GPU and family in ("llada2", "diffusion_gemma"):
        assert calls, "the grouped GEMM did not run on CUDA"
    with Separate(model, monkeypatch):
        separate = sampler.generate(model, PROMPTS, **kw)
    same = torch.equal(fused.sequences, separate.sequences)
    print(f"{family} {dtype}: grouped GEMM calls {len(calls)}; same tokens {same}; nfe {fused.nfe} / {separate.nfe}")
    if dtype == torch.float32:
        assert same and fused.nfe == separate.nfe


def test_the_constraints_masks_on_cuda_equal_the_cpus(tmp_path_factory):
    """``Guard.restrict`` over the same logits on the device and on the CPU: the same -inf entries, bit for bit (a
    JSON schema over the bundled tokenizer, 32 columns of a 64-slot canvas with some slots committed)."""
    import types

    from dllm.constraints import JsonSchema
    from dllm.constraints.automaton import build
    from dllm.constraints.guard import Guard, Layout
    from dllm.constraints.tokens import surfaces

    model = dllm.load("tiny-llada", device="cpu", dtype=torch.float32)
    schema = JsonSchema({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
    vocab, eos, mask = model.vocab_size, model.eos_ids[0], model.mask_id
    automaton = build(schema.regex(), surfaces(model.tokenizer), list(model.eos_ids))
    canvas = types.SimpleNamespace(prompt_width=0, span_end=torch.tensor([64, 64]), mask_id=mask)
    guard = Guard(automaton, [Layout.free(64)] * 2, canvas, list(model.eos_ids), mask)
    tokens = torch.full((2, 64), mask)
    tokens[0, :3] = torch.tensor(model.tokenizer('{"a', add_special_tokens=False)["input_ids"][:3])
    tokens[1, 40:] = eos
    rows, columns = torch.tensor([0, 1]), torch.arange(32).expand(2, -1) + torch.tensor([[0], [8]])
    logits = torch.randn(2, 32, vocab, generator=torch.Generator().manual_seed(0))
    want = guard.restrict(logits.clone(), rows, columns, tokens)
    got = guard.restrict(logits.to(DEVICE), rows, columns, tokens)
    assert got.device.type == DEVICE.type and torch.equal(got.cpu(), want)
    assert bool(torch.isinf(want).any()) and bool(torch.isfinite(want).any())


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_a_constrained_generation_on_cuda_is_valid_and_equals_the_cpus(family):
    """The bundled model on the device and on the CPU, float32, greedy: a JSON schema and a template with holes;
    every text valid, the same texts on both."""
    from dllm.constraints import Hole, JsonSchema, Regex

    schema = JsonSchema({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
    template = ["The answer is", Hole(2, Regex(r" [0-9]+")), ".", Hole(3)]
    prompts = ["Sort the list: 14 7 9\n", "Ben has 3 apples. He gets 5 more. How many apples does Ben have now?\n"]
    outs = {}
    for where in ("cpu", DEVICE.type):
        model = dllm.load(f"tiny-{family}", device=where, dtype=torch.float32)
        sampler = dllm.samplers.reference(model.family)
        kw = {} if model.attention.block_causal else {"block_size": 8}
        outs[where] = (sampler.generate(model, prompts, max_new_tokens=24, constraint=schema, **kw),
                       sampler.generate(model, prompts, template=template, **kw))  # fmt: skip
    (json_cpu, template_cpu), (json_dev, template_dev) = outs["cpu"], outs[DEVICE.type]
    print(json_dev.texts, template_dev.texts)
    assert all(schema.check(text) for text in json_dev.texts)
    assert all(re.fullmatch(r"The answer is [0-9]+\..*", text, re.S) for text in template_dev.texts)
    assert json_dev.texts == json_cpu.texts and template_dev.texts == template_cpu.texts


# -- since run 3 (issue 44): rows joining a running generation, per-row thresholds ----------------------------------


@pytest.mark.parametrize(
    "family,sampler,cache",
    [("llada", "threshold", "dual"), ("llada", "llada", None), ("sdar", "sdar", "block"), ("llada2", "llada2", None),
     ("llada2", "llada21", "block"), ("llada", "freedave", None), ("llada", "credit", "dual"),
     ("sdar", "s2d2", "block")],
)  # fmt: skip
def test_rows_that_join_a_running_generation_on_cuda_decode_as_alone(family, sampler, cache, tmp_path_factory):
    """``tests/test_join.py``'s check on the device, float32: rows join at step 2 and after the first row finished
    (the K/V store takes them in its spare rows, every per-row state joins: LLaDA2.1's open blocks, FreeDave's
    carried predictions, CreditDecoding's credit, S2D2's verifier state); each row's tokens, text and forwards equal
    ``generate`` of it alone."""
    from test_join import check_joins

    check_joins(family, sampler, cache and dllm.caches.get(cache), lambda f: tiny(f, torch.float32, tmp_path_factory))


@pytest.mark.parametrize("cache", [None, "dual"])
def test_rows_of_their_own_thresholds_join_on_cuda_as_alone(cache):
    """Per-row thresholds (``hyper_parameters=[...]``: selection's rule over a tensor of thresholds, which the fused
    selector declines) on the bundled model on the device, rows joining: each row as the sampler with its value
    alone."""
    import test_join

    model, sampler = dllm.load("tiny-llada", device=DEVICE, dtype=torch.float32), dllm.samplers.get("threshold")
    thresholds = [1.0, 0.3, 0.99, 0.6]
    kw = dict(block_size=8, eos_early_stop=False, cache=cache)
    out = test_join.decode_joining(sampler, model, 1, hyper=[{"threshold": t} for t in thresholds], **kw)
    for r, (prompt, threshold) in enumerate(zip(test_join.PROMPTS, thresholds)):
        alone = dllm.samplers.get("threshold", threshold=threshold).generate(
            model, [prompt], max_new_tokens=test_join.LENGTHS[r], temperature=test_join.TEMPERATURES[r],
            seed=test_join.SEEDS[r], **kw,
        )  # fmt: skip
        tokens, nfe, text = out[r]
        assert torch.equal(tokens[: test_join.LENGTHS[r]], alone.sequences[0, alone.prompt_width :]), r
        assert (nfe, text) == (alone.nfe, alone.texts[0]), r
