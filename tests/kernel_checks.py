"""What the kernel tests share: inputs with edge cases, the reference a kernel must equal, and the comparison
(tokens exactly, statistics to their last bits). ``tests/test_kernels_triton.py`` runs the kernels through
Triton's interpreter on the CPU; ``eval/gpu/test_cuda.py`` runs them compiled on a GPU with the same checks."""

from __future__ import annotations

import inspect

import torch

from dllm.core.rng import CounterRNG, Stream
from dllm.kernels import reference
from dllm.kernels.reference import STATS


def _log_domain_gumbel(logits, temperature, uniform):
    """The proposal the kernel draws: ``argmax(l - T log(-log u))`` in float64 (the log-domain form of the
    reference's ``exp(l) / (-log u) ** T``; the argmax is the same but at last-bit ties)."""
    if temperature == 0:
        return logits.argmax(-1)
    return (logits.to(torch.float64) - temperature * torch.log(-torch.log(uniform))).argmax(-1)


def expected(logits, spec, counters, monkeypatch):
    """``reference.score`` with the log-domain Gumbel-max, whichever of its signatures (uniform draws, or the
    counters) this checkout has."""
    monkeypatch.setattr(reference, "gumbel_argmax", _log_domain_gumbel)
    if "counters" in inspect.signature(reference.score).parameters:
        return reference.score(logits, spec, counters)
    uniform = None if counters is None else counters.uniform(logits.shape[-1]).reshape(logits.shape)
    return reference.score(logits, spec, uniform)


def counters_for(n, seed=1234, step=3, device="cpu"):
    """Philox counters of ``n`` rows (one slot each), as the loop keys them."""
    rng = CounterRNG(seed)
    rows = torch.arange(n, device=device)
    offsets = torch.arange(n, device=device)[:, None] * 5 + 2
    return rng.counters(Stream.TOKENS, rows, torch.full((n,), step, device=device), offsets)


def logits_with_edges(n, vocab, dtype, seed=0, scale=3.0, device="cpu"):
    """Random logits; row 0 has exact ties (small integers), row 1 some -inf entries, row 2 a tie for the max
    beyond the first tile, the last row (when n > 3) only -inf. Drawn on the CPU, then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * scale
    x[0] = torch.randint(-3, 3, (vocab,), generator=g).float()
    if n > 1:
        x[1, torch.randint(0, vocab, (vocab // 3 + 1,), generator=g)] = float("-inf")
    if n > 2:
        x[2, vocab // 2] = x[2, vocab - 1] = x[2].max() + 1
    if n > 3:
        x[-1] = float("-inf")
    return x.to(dtype).to(device)


def ulp(dtype):
    return torch.finfo(dtype).eps


def assert_same(got, want, out_dtype, tol=None):
    """Tokens exactly; each statistic to the last bits of ``out_dtype`` (``tol``: relative), NaN where NaN."""
    assert torch.equal(got.token, want.token), (got.token, want.token)
    for name in STATS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        if name in ("argmax", "logit_margin"):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0)), name
            continue
        assert torch.equal(a.isnan(), b.isnan()), (name, a, b)
        a, b = a.double().nan_to_num(0), b.double().nan_to_num(0)
        rel = tol or {torch.float64: 1e-12, torch.float32: 2e-6}.get(out_dtype, ulp(out_dtype))
        scale = b.abs()
        if name == "margin":  # a difference of two probabilities: their last bits
            scale = torch.maximum(scale, want.top1.double().nan_to_num(0) if want.top1 is not None else 1.0)
        bound = rel * scale + (1e-7 if out_dtype != torch.float64 else 1e-15)
        if name == "entropy" and out_dtype == torch.float32:  # a float32 sum over the vocabulary
            bound = bound + 1e-5 * scale
        assert ((a - b).abs() <= bound).all(), (name, (a - b).abs().max())


ALL = frozenset(STATS)


def selection_inputs(b=12, length=40, dtype=torch.float64, seed=0, levels=None, device="cpu"):
    """Confidences (``levels``: quantised to so many values, for exact ties), committable slots (the last row
    none), proposals, a canvas and a quota; drawn on the CPU, then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    confidence = torch.rand(b, length, generator=g, dtype=torch.float64)
    if levels:
        confidence = (confidence * levels).floor() / levels
    confidence = confidence.to(dtype)
    committable = torch.rand(b, length, generator=g) < 0.6
    committable[-1] = False
    proposals = torch.randint(0, 1000, (b, length), generator=g)
    tokens = torch.full((b, length), -7)
    quota = torch.minimum(torch.randint(0, 6, (b,), generator=g), committable.sum(1))
    return tuple(t.to(device) for t in (confidence, committable, proposals, tokens, quota))
