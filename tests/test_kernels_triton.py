"""The Triton kernels against the PyTorch reference, on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``; CI has no GPU). Fresh random logits of several vocabularies and dtypes, exact ties,
-inf entries, exclusions, sampling from the same Philox counters as ``dllm.core.rng``.

What may differ (the kernels' docstrings): the last bit of a probability, margin or entropy (one unit in the last
place of bfloat16 / float16 probabilities, a few of float32 ones after a sum over the vocabulary); tokens, argmax,
logit margins and NaN patterns are compared exactly.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from kernel_checks import ALL, assert_same, counters_for, expected, logits_with_edges, selection_inputs

from dllm import samplers
from dllm.core.rng import Counters
from dllm.kernels import selection
from dllm.kernels.reference import ScoreSpec


def _import_interpreted(name="dllm.kernels.triton_score"):
    """The kernel module ``name`` with its kernels built for Triton's interpreter (the variable is read when a
    kernel is decorated, so the module is reloaded if something imported it for a GPU before)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
        if not module.interpreted():
            module = importlib.reload(sys.modules[name])
        return module
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


ts = _import_interpreted()


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """The interpreter also reads the variable while a kernel runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# (vocabulary, logits dtype, ScoreSpec.dtype, rows, tile width, programs per row)
CASES = [
    (7, torch.float32, None, 5, 4, 2),
    (7, torch.bfloat16, None, 5, 8, 1),
    (7, torch.float16, torch.float64, 5, 4, 4),
    (1000, torch.float32, None, 6, 128, 4),
    (1000, torch.bfloat16, None, 6, 256, 2),
    (1000, torch.float16, None, 6, 128, 2),
    (1000, torch.bfloat16, torch.float64, 6, 256, 4),
    (1000, torch.bfloat16, torch.float32, 6, 256, 4),
    (32771, torch.bfloat16, None, 4, 4096, 4),
    (32771, torch.float32, torch.float64, 4, 4096, 2),
    (126464, torch.bfloat16, None, 2, 8192, 4),
    (126464, torch.bfloat16, torch.float64, 2, 8192, 8),
]


@pytest.mark.parametrize("vocab,dtype,spec_dtype,rows,block_v,splits", CASES)
def test_statistics_match_the_reference(vocab, dtype, spec_dtype, rows, block_v, splits, monkeypatch):
    logits = logits_with_edges(rows, vocab, dtype, seed=vocab)
    spec = ScoreSpec(need=ALL, dtype=spec_dtype, exclude=(1, vocab - 2))
    got = ts.score(logits, spec, block_v=block_v, splits=splits)
    want = expected(logits, spec, None, monkeypatch)
    assert_same(got, want, spec_dtype or dtype)
    if rows > 3:  # the all -inf row: token 0, NaN probabilities, as the reference
        assert got.token[-1] == 0 and got.prob[-1].isnan()


@pytest.mark.parametrize(
    "vocab,dtype,spec_dtype,rows,block_v,splits,temperature",
    [
        (7, torch.float32, None, 64, 4, 2, 1.0),
        (1000, torch.bfloat16, torch.float64, 24, 128, 4, 0.7),
        (1000, torch.float16, None, 8, 256, 2, 2.5),
        (32771, torch.bfloat16, None, 3, 4096, 4, 1.0),
        (126464, torch.bfloat16, torch.float64, 2, 8192, 4, 0.5),
    ],
)
def test_sampling_draws_the_reference_tokens_from_the_same_counters(
    vocab, dtype, spec_dtype, rows, block_v, splits, temperature, monkeypatch
):
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 2).to(dtype)
    logits[0, : vocab // 2] = float("-inf")  # never proposed
    counters = counters_for(rows)
    spec = ScoreSpec(need=ALL, temperature=temperature, dtype=spec_dtype, exclude=(3,))
    got = ts.score(logits, spec, counters, block_v=block_v, splits=splits)
    want = expected(logits, spec, counters, monkeypatch)
    assert_same(got, want, spec_dtype or dtype)
    assert got.token[0] >= vocab // 2
    if vocab == 7:  # it samples: at T = 1 over 7 tokens many proposals are not the argmax
        assert (got.token != got.argmax).sum() > 10
    other = counters_for(rows, seed=99)  # other counters, other tokens
    assert not torch.equal(ts.score(logits, spec, other, block_v=block_v, splits=splits).token, got.token) or rows < 8
    if vocab <= 1000 and rows <= 8:  # per-row seeds (a key per row): each row as under its own seed
        seeds = [1234 if r % 2 else 2**40 + 5 for r in range(rows)]
        mixed = counters_for(rows, seed=seeds)
        got = ts.score(logits, spec, mixed, block_v=block_v, splits=splits)
        assert_same(got, expected(logits, spec, mixed, monkeypatch), spec_dtype or dtype)
        alone = {s: ts.score(logits, spec, counters_for(rows, seed=s), block_v=block_v, splits=splits).token
                 for s in set(seeds)}  # fmt: skip
        assert got.token.tolist() == [alone[s][r].item() for r, s in enumerate(seeds)]


# (vocabulary, logits dtype, ScoreSpec.dtype, rows, tile width, programs per row, temper, temperature): tempers
# that round, a float32 subnormal divisor (1e-45), one below float32's range (1e-50: division by 0, the logits
# become +-inf / NaN), one that overflows finite logits (1e-30), one above float32's range (1e39: all logits 0)
TEMPERED = [
    (7, torch.float32, None, 5, 4, 2, 0.37, 0.0),
    (7, torch.float32, None, 5, 4, 2, 1e-30, 1.0),
    (7, torch.float16, torch.float64, 5, 4, 4, 1e-45, 0.0),
    (7, torch.bfloat16, None, 5, 8, 1, 1e-50, 0.7),
    (1000, torch.bfloat16, None, 6, 256, 2, 0.7, 0.9),
    (1000, torch.float16, None, 6, 128, 2, 3.0, 0.0),
    (1000, torch.bfloat16, torch.float64, 6, 256, 4, 1e39, 1.0),
    (1000, torch.float32, torch.float64, 6, 128, 4, 1e-30, 0.0),
    (126464, torch.bfloat16, None, 2, 8192, 4, 0.3, 1.0),
    (126464, torch.bfloat16, torch.float64, 2, 8192, 8, 1.7, 0.0),
]


@pytest.mark.parametrize("vocab,dtype,spec_dtype,rows,block_v,splits,temper,temperature", TEMPERED)
def test_tempered_logits_match_the_reference(
    vocab, dtype, spec_dtype, rows, block_v, splits, temper, temperature, monkeypatch
):
    """``ScoreSpec.temper`` (Dream's / SDAR's division of the logits) is fused: the proposal and the statistics are
    those of the tempered logits as the reference rounds them, the logit margin that of the untempered ones."""
    logits = logits_with_edges(rows, vocab, dtype, seed=vocab + 1)
    counters = counters_for(rows) if temperature > 0 else None
    spec = ScoreSpec(need=ALL, dtype=spec_dtype, exclude=(1,), suppress=(vocab - 2,), temper=temper)
    spec = dataclasses.replace(spec, temperature=temperature)
    assert ts.supports(spec, logits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy warns on x / 0 and overflow
        got = ts.score(logits, spec, counters, block_v=block_v, splits=splits)
    assert_same(got, expected(logits, spec, counters, monkeypatch), spec_dtype or dtype)


def test_tempering_rounds_to_the_logits_dtype_before_the_argmax(monkeypatch):
    """Two bfloat16 logits one unit apart that divide to the same bfloat16 value: the tempered argmax is the lower
    id, not the untempered argmax (the kernel rounds the quotient as the reference does)."""
    logits = torch.full((2, 40), -5.0, dtype=torch.bfloat16)
    logits[:, 2], logits[:, 30] = 1.9765625, 1.984375  # 253 / 128 and 254 / 128
    spec = ScoreSpec(need=ALL, temper=1.98)
    want = expected(logits, spec, None, monkeypatch)
    assert want.token.tolist() == [2, 2] and logits.argmax(-1).tolist() == [30, 30]
    for block_v, splits in [(16, 1), (16, 4)]:
        assert_same(ts.score(logits, spec, block_v=block_v, splits=splits), want, torch.bfloat16)


def test_bfloat16_rounding_is_to_nearest_even_and_keeps_nan():
    """The kernels' by-hand float32 -> bfloat16 rounding equals PyTorch's, and a NaN stays NaN whatever its bits:
    CUDA's NaN 0x7FFFFFFF carried into the sign bit and came out -0.0 (an all -inf row's probabilities on an
    H200, where the reference has NaN)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rounded(x, out, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out + i, ts._round(tl.load(x + i), 1))

    bits = [0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0x3F800000, 0x3F808000, 0x3F818000, 0x7F7FFFFF]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    values = torch.cat([values, torch.tensor([-float("inf"), 0.1, -3.3e38, 1e-40, -0.0, 0.0, 2.5e-3, 65504.7])])
    out = torch.empty_like(values)
    rounded[(1,)](values, out, N=16)
    want = values.to(torch.bfloat16).float()
    assert torch.equal(out.isnan(), values.isnan()) and out[:4].isnan().all()
    number = ~values.isnan()
    assert torch.equal(out[number], want[number]) and torch.equal(out[number].signbit(), want[number].signbit())


def test_temper_follows_the_devices_division():
    """On the CPU PyTorch divides by float32(temper); on CUDA it multiplies by its float32 reciprocal."""
    assert ts._temper(1.0, torch.device("cpu")) == (0, 1.0)
    mode, divisor = ts._temper(0.1, torch.device("cpu"))
    assert mode == 1 and divisor == float(torch.tensor(0.1, dtype=torch.float32))
    mode, factor = ts._temper(0.1, torch.device("cuda"))
    assert mode == 2 and factor == float(1 / torch.tensor(0.1, dtype=torch.float32))
    assert ts._temper(1e39, torch.device("cpu"))[1] == float("inf")


def test_counters_may_be_broadcast_views(monkeypatch):
    """A caller may pass expanded (stride 0) counter tensors, as one row's slots share its key and step."""
    logits = torch.randn(6, 90, generator=torch.Generator().manual_seed(2))
    counters = Counters(
        (3, 0), torch.zeros(1, dtype=torch.long).expand(6), torch.tensor([9]).expand(6), torch.arange(6)
    )
    spec = ScoreSpec(need=frozenset({"prob"}), temperature=0.8, dtype=torch.float64)
    got = ts.score(logits, spec, counters, block_v=32, splits=2)
    assert_same(got, expected(logits, spec, counters, monkeypatch), torch.float64)


def test_exact_ties_go_to_the_lowest_id_in_any_tiling(monkeypatch):
    logits = torch.zeros(4, 300)
    logits[0, [17, 130, 299]] = 2.0  # max tied across tiles and programs
    logits[1, [250, 251]] = 1.0  # tied late in the row
    logits[2] = 1.0  # everything tied: token 0, margins 0
    logits[3, [5, 6]] = 3.0  # two tied, the rest lower: margin 0
    spec = ScoreSpec(need=ALL)
    want = expected(logits, spec, None, monkeypatch)
    for block_v, splits in [(16, 1), (16, 8), (64, 4), (512, 1)]:
        got = ts.score(logits, spec, block_v=block_v, splits=splits)
        assert_same(got, want, torch.float32)
    assert want.token.tolist() == [17, 250, 0, 5] and (want.logit_margin == 0).all()


def test_excluded_and_suppressed_ids(monkeypatch):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(5))
    logits[:3, 7] = 10.0  # the argmax is excluded: proposed, with probability 0
    spec = ScoreSpec(need=ALL, exclude=(7, 8), dtype=torch.float64)
    got = ts.score(logits, spec, block_v=16, splits=2)
    assert_same(got, expected(logits, spec, None, monkeypatch), torch.float64)
    assert (got.token[:3] == 7).all() and (got.prob[:3] == 0).all()
    if "suppress" in {f.name for f in dataclasses.fields(ScoreSpec)}:  # the seam's never-proposed ids
        spec = ScoreSpec(need=ALL, suppress=(7,), exclude=(8,))
        got = ts.score(logits, spec, block_v=16, splits=2)
        assert_same(got, expected(logits, spec, None, monkeypatch), torch.float32)
        assert (got.token != 7).all()


def test_leading_dimensions_and_empty_input(monkeypatch):
    logits = torch.randn(3, 4, 40)
    counters = counters_for(12)
    spec = ScoreSpec(need=frozenset({"prob", "entropy"}), temperature=1.0)
    got = ts.score(logits, spec, counters, block_v=16)
    want = expected(logits.reshape(12, 40), spec, counters, monkeypatch)
    assert got.token.shape == (3, 4) and torch.equal(got.token.reshape(-1), want.token)
    empty = ts.score(torch.randn(0, 40), ScoreSpec(need=ALL))
    assert empty.token.shape == (0,) and empty.entropy.shape == (0,)
    assert got.top1 is None and got.margin is None and got.logit_margin is None  # only what is asked


def test_supports_only_what_it_fuses():
    logits = torch.randn(2, 10)
    assert ts.supports(ScoreSpec(need=ALL, temperature=0.5, exclude=(9,)), logits)
    assert ts.supports(ScoreSpec(dtype=torch.float64), logits.bfloat16())

    @dataclasses.dataclass(frozen=True)
    class Wider(ScoreSpec):  # a field the kernel does not know (e.g. top-k): off is fine, on is not
        top_k_like: int | None = None

    assert ts.supports(Wider(), logits) and not ts.supports(Wider(top_k_like=5), logits)

    @dataclasses.dataclass(frozen=True)
    class Warped(ScoreSpec):  # the dispatch seam's sampling warps: top-k / top-p are not fused (temper is)
        temper: float = 1.0
        top_k: int | None = None
        top_p: float | None = None
        fill: float = float("-inf")
        order: tuple = ("temper", "top_k", "top_p")

    assert ts.supports(Warped(fill=-3e38, order=("temper", "top_p", "top_k"), top_k=0, top_p=1.0), logits)
    for on in ({"top_k": 5}, {"top_p": 0.9}, {"temper": 0.7, "top_k": 5}):
        assert not ts.supports(Warped(**on), logits)
    assert ts.supports(Warped(temper=0.7, order=("top_p", "temper", "top_k")), logits)
    assert ts.supports(ScoreSpec(temper=1e-30, order=("top_k", "top_p", "temper")), logits)
    assert not ts.supports(ScoreSpec(), logits.double())
    assert not ts.supports(ScoreSpec(dtype=torch.bfloat16), logits)  # would round the logits themselves
    assert not ts.supports(ScoreSpec(exclude=(10,)), logits) and not ts.supports(ScoreSpec(exclude=(-1,)), logits)
    assert not ts.supports(ScoreSpec(), torch.randn(2, 1))
    with pytest.raises(ValueError, match="counters"):
        ts.score(logits, ScoreSpec(temperature=1.0))


def test_plan_fills_the_device_without_tiny_programs():
    assert ts.plan(32, 126464) == (4096, 8)  # 31 tiles: 256 programs of about 4 tiles
    assert ts.plan(4096, 126464) == (4096, 1)
    assert ts.plan(1, 126464, block_v=1024) == (1024, 32)  # 124 tiles: 32 programs of about 4
    assert ts.plan(3, 7) == (8, 1)
    for bad in ({"block_v": 48}, {"block_v": 1}, {"splits": 3}, {"splits": 0}):
        with pytest.raises(ValueError, match="power of two"):
            ts.plan(3, 700, **bad)


def test_a_fused_call_adds_no_host_synchronisation():
    from dllm.bench.overhead import SyncCounter

    logits, counters = torch.randn(8, 300), counters_for(8)
    for temper in (1.0, 0.7):
        spec = ScoreSpec(need=ALL, temperature=1.0, dtype=torch.float64, exclude=(4,), temper=temper)
        ts.score(logits, spec, counters, block_v=64)  # the small constant tensors are made on the first call
        with SyncCounter() as syncs:
            ts.score(logits, spec, counters, block_v=64)
        assert syncs.count == 0


def test_benchmark_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    from dllm.bench import kernels as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    labels = [label for label, _ in bench.shapes()]
    assert labels[:4] == ["32 rows", "256 rows", "1024 rows", "4096 rows"] and "dual-cache" in labels[-1]
    assert bench.VOCAB == 126464


# -- kernel B: selection and write-back ------------------------------------------------------------------------
tsel = _import_interpreted("dllm.kernels.triton_select")


def _step(confidence, committable, quota=None):
    """What the samplers' ``select`` reads of a step."""
    return SimpleNamespace(
        scores=SimpleNamespace(prob=confidence),
        committable=committable,
        quota=quota,
        among_committable=lambda values, fill=float("-inf"): values.masked_fill(~committable, fill),
    )


RULE_CASES = [
    (selection.Rule("top_k"), samplers.LLaDA()),
    (selection.Rule("threshold", threshold=0.7), samplers.Threshold(threshold=0.7)),
    (selection.Rule("threshold", threshold=1.0), samplers.Threshold(threshold=1.0)),
    (selection.Rule("factor", factor=1.0), samplers.Factor(factor=1.0)),
    (selection.Rule("factor", factor=2.5, strict_prefix=True), samplers.Factor(factor=2.5, strict_prefix=True)),
    (selection.Rule("anchored_threshold", threshold=0.9, relaxed=0.5, radius=2), samplers.LocalLeap(0.9, 0.5, 2)),
    (selection.Rule("anchored_threshold", threshold=0.8, relaxed=0.8, radius=0), samplers.LocalLeap(0.8, 0.8, 0)),
    (selection.Rule("threshold", threshold=0.6, strict=True, quota_floor=True), samplers.LLaDA2(threshold=0.6)),
]


@pytest.mark.parametrize("rule,sampler", RULE_CASES, ids=lambda x: repr(x)[:60])
@pytest.mark.parametrize("levels", [None, 8])
def test_selection_reference_is_what_the_samplers_select(rule, sampler, levels):
    confidence, committable, _, _, quota = selection_inputs(levels=levels)
    want = sampler.select(_step(confidence, committable, quota), None) & committable
    assert torch.equal(selection.select(rule, confidence, committable, quota), want)


@pytest.mark.parametrize("rule", [r for r, _ in RULE_CASES] + [selection.Rule("threshold", 0.5, strict=True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_selection_kernel_commits_what_the_reference_commits(rule, dtype):
    if not tsel.supports(rule, torch.zeros(1, 1, dtype=dtype)):
        assert rule.kind == "factor" and dtype != torch.float64  # its thresholds would round in that dtype
        return
    for seed, levels in [(0, None), (1, 4), (2, 16)]:
        confidence, committable, proposals, tokens, quota = selection_inputs(dtype=dtype, seed=seed, levels=levels)
        finish = torch.zeros(confidence.shape[0], dtype=torch.bool)
        finish[2] = True
        want_tokens = tokens.clone()
        want = selection.select_and_commit(rule, confidence, committable, proposals, want_tokens, quota, finish)
        got = tsel.select_and_commit(rule, confidence, committable, proposals, tokens, quota, finish)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(tokens, want_tokens)
        assert got[1][-1] == 0 and got[1][2] == committable[2].sum()  # no candidates; a finishing row


@pytest.mark.parametrize("kind,field,values", [("threshold", "threshold", [0.9, 0.2, 1.0, 0.5, 0.0, 0.7]),
                                               ("factor", "factor", [1.0, 0.1, 4.0, 2.5, 1.0, 0.5])])  # fmt: skip
def test_a_rule_of_per_row_values_selects_each_row_as_its_own_value_does(kind, field, values):
    """Rows of their own thresholds (factors): each row's commit is the scalar rule's on that row; the fused selector
    declines the tensor (the dispatch falls back to this reference)."""
    confidence, committable, _, _, quota = selection_inputs(levels=8)
    per_row = torch.tensor((values * 4)[: confidence.shape[0]], dtype=torch.float64)
    got = selection.select(selection.Rule(kind, **{field: per_row}), confidence, committable, quota)
    for row, value in enumerate(per_row.tolist()):
        one = selection.select(selection.Rule(kind, **{field: value}), confidence, committable, quota)
        assert torch.equal(got[row], one[row]), row
    assert not tsel.supports(selection.Rule(kind, **{field: per_row}), confidence)


def test_selection_kernel_at_threshold_edges_and_wide_rows():
    rule = selection.Rule("threshold", threshold=0.9)
    confidence = torch.tensor([[0.9, 0.89999999, 0.95, 0.95], [0.1, 0.2, 0.2, 0.05]], dtype=torch.float64)
    committable = torch.ones_like(confidence, dtype=torch.bool)
    proposals, tokens = torch.arange(8).reshape(2, 4), torch.zeros(2, 4, dtype=torch.long)
    commit, counts = tsel.select_and_commit(rule, confidence, committable, proposals, tokens)
    assert commit.tolist() == [[True, False, True, True], [False, True, False, False]]  # >= 0.9; else the best
    assert counts.tolist() == [3, 1] and tokens.tolist() == [[0, 0, 2, 3], [0, 5, 0, 0]]
    confidence, committable, proposals, tokens, quota = selection_inputs(b=3, length=700, seed=3, levels=50)
    quota = committable.sum(1) // 3
    want = selection.select(selection.Rule("top_k"), confidence, committable, quota)
    got, _ = tsel.select_and_commit(selection.Rule("top_k"), confidence, committable, proposals, tokens, quota)
    assert torch.equal(got, want)


def test_benchmark_measures_what_it_says_through_the_interpreter(monkeypatch):
    """The benchmark's measuring code on the CPU (timing faked: Triton's timer needs CUDA), small shapes."""
    import triton.testing

    from dllm.bench import kernels as bench

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() and 1.0)
    for spec_name, spec in bench.specs():
        r = bench.measure("2x3", (2, 3), spec_name, spec, vocab=300, block_v=64, head=False, device="cpu")
        assert r["same"] and r["syncs"] == 0 and r["rows"] == 6 and r["gb_s"] > 0
    for rule in bench.selection_rules():
        r = bench.measure_selection(3, 64, rule, block=8, device="cpu")
        assert r["same"] and r["syncs"] == 0
