"""Kernel B: selection and write-back on the device, fused in Triton (issue 19, item 3).

One program per canvas row computes which committable slots a :class:`~dllm.kernels.selection.Rule` commits
(the semantics of :func:`dllm.kernels.selection.select`, the PyTorch reference), writes the proposals of those
slots into the canvas in place and the number written into a per-row device buffer: no ``.item()``, no host
synchronisation, fixed shapes (safe inside a CUDA graph). Design: ``caches_kernels.md`` §10.3-10.4 of the
project research (SGLang's dLLM post-process kernel commits above a threshold and forces the best slot with a
device counter, one block at a time; this one takes a batch and the rules of the samplers).

How: the confidences are read as float64 (exact for every float dtype) and compared exactly, with the thresholds
rounded as PyTorch rounds a Python scalar compared with a tensor (to the confidences' dtype; the anchored
threshold's per-slot thresholds through a float32 tensor, as the reference). The fixed-schedule top-k finds the k-th
largest value by bisection over the order-preserving integer image of the float64 bits (64 counting passes, no
sort) and takes ties leftmost with a prefix sum, as ``top_k_per_row``'s stable sort does; the factor rule's
first failing rank is found by bisection too (the test ``c(i) >= 1 - f / (i + 1)`` is monotone in the rank);
the anchored threshold's dilation reads the row shifted by each offset within the radius.

Results are exactly the reference's (there is no floating-point reduction). Not fused (:func:`supports` is
False; use the reference): the factor rule on confidences other than float64 (its thresholds would be rounded
in their dtype), NaN confidences (PyTorch's sort order for NaN is not reproduced), rows longer than 16,384.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dllm.kernels.selection import RULES, Rule

_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MAX_L = 16384
_CONSTANTS: dict = {}


def interpreted() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1`` at import and now)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not isinstance(_select, triton.runtime.JITFunction)


def supports(rule: Rule, confidence: torch.Tensor) -> bool:
    """Whether :func:`select_and_commit` fuses ``rule`` on ``confidence`` [B, L]."""
    if confidence.dim() != 2 or confidence.dtype not in _FLOATS or confidence.shape[1] > _MAX_L:
        return False
    if not (confidence.is_cuda or (interpreted() and confidence.device.type == "cpu")):
        return False
    if isinstance(rule.threshold, torch.Tensor) or isinstance(rule.factor, torch.Tensor):  # (each row's: not fused)
        return False
    return rule.kind != "factor" or confidence.dtype == torch.float64


def select_and_commit(
    rule: Rule,
    confidence: torch.Tensor,
    committable: torch.Tensor,
    proposals: torch.Tensor,
    tokens: torch.Tensor,
    quota: torch.Tensor | None = None,
    finish: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Commit the slots ``rule`` selects: ``proposals`` [B, L] written into ``tokens`` [B, L] in place where
    committed. Returns (commit bool [B, L], counts [B]), as :func:`dllm.kernels.selection.select_and_commit`.

    confidence [B, L]; committable bool [B, L]; quota [B] (``top_k``); finish bool [B]: rows that commit every
    committable slot."""
    if not supports(rule, confidence):
        raise ValueError("this rule / confidence combination is not fused: ask supports() first")
    if (rule.kind == "top_k" or rule.quota_floor) and quota is None:
        raise ValueError("the top_k rule (and quota_floor) needs the per-row quota")
    b, length = confidence.shape
    device = confidence.device
    confidence, committable = confidence.contiguous(), committable.contiguous()
    proposals = proposals.contiguous()
    commit = torch.empty(b, length, dtype=torch.bool, device=device)
    counts = torch.empty(b, dtype=torch.long, device=device)
    if b == 0 or length == 0:
        return commit, counts.zero_()
    dtype = confidence.dtype
    kappa = _rounded(rule.threshold, dtype)  # a Python scalar compared with a tensor: rounded to its dtype
    need = (_rounded(rule.relaxed, torch.float32), _rounded(rule.threshold, torch.float32))  # anchored_threshold's
    consts = _constant((kappa, *need, float(rule.factor)), device)
    block = triton.next_power_of_2(length)
    _select[(b,)](
        confidence,
        committable,
        proposals,
        tokens,
        tokens.stride(0),
        tokens.stride(1),
        quota if quota is not None else counts,
        finish if finish is not None else committable,
        commit,
        counts,
        consts,
        length,
        min(int(rule.radius), length),  # a wider radius reaches no further column
        KIND=RULES.index(rule.kind),
        STRICT=bool(rule.strict),
        STRICT_PREFIX=bool(rule.strict_prefix),
        FLOOR=bool(rule.quota_floor) and rule.kind == "threshold",
        HAS_FINISH=finish is not None,
        BLOCK_L=block,
        LOG_L=block.bit_length(),
    )
    return commit, counts


@functools.lru_cache(maxsize=256)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (on the host, once per value)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def _constant(values: tuple, device: torch.device) -> torch.Tensor:
    """A small float64 device tensor of ``values``, made once (a host-to-device copy per step would synchronise)."""
    key = (values, device)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        _CONSTANTS[key] = torch.tensor(values, dtype=torch.float64, device=device)
    return _CONSTANTS[key]


@triton.jit
def _count_at_least(values, valid, bound):
    return tl.sum((valid & (values >= bound)).to(tl.int64), 0)


@triton.jit
def _top_k_leftmost(among, idx, valid, k, BLOCK_L: tl.constexpr):
    """bool [BLOCK_L]: the k largest of ``among`` (float64), ties to the lowest index."""
    bits = (among + 0.0).to(tl.int64, bitcast=True)  # + 0.0 makes -0.0 equal to 0.0
    signed = tl.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)  # order-preserving
    key = signed.to(tl.uint64, bitcast=True) ^ 0x8000000000000000  # order-preserving, unsigned
    lo = tl.zeros((), tl.uint64)  # invariant: at least k keys >= lo (k <= the valid lanes)
    hi = tl.full((), 0xFFFFFFFFFFFFFFFF, tl.uint64)
    for _ in tl.static_range(64):
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)
        enough = tl.sum((valid & (key >= mid)).to(tl.int64), 0) >= k
        lo = tl.where(enough & (gap > 0), mid, lo)
        hi = tl.where(enough | (gap == 0), hi, mid - 1)
    above = valid & (key > lo)
    tied = valid & (key == lo)
    room = k - tl.sum(above.to(tl.int64), 0)
    order = tl.cumsum(tied.to(tl.int64), 0)
    return (above | (tied & (order <= room))) & (k > 0)


@triton.jit
def _select(
    confidence,
    committable,
    proposals,
    tokens,
    tok_stride0,
    tok_stride1,
    quota,
    finish,
    commit_out,
    counts,
    consts,
    L,
    radius,
    KIND: tl.constexpr,
    STRICT: tl.constexpr,
    STRICT_PREFIX: tl.constexpr,
    FLOOR: tl.constexpr,
    HAS_FINISH: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LOG_L: tl.constexpr,
):
    """One canvas row: select (KIND: 0 top_k, 1 threshold, 2 factor, 3 anchored_threshold), write back, count."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_L)
    valid = idx < L
    base = row * L
    ninf = float("-inf")
    conf = tl.load(confidence + base + idx, mask=valid, other=ninf).to(tl.float64)
    mask = tl.load(committable + base + idx, mask=valid, other=0) != 0
    among = tl.where(mask, conf, ninf)
    kappa = tl.load(consts)  # the threshold in the confidences' dtype
    if KIND == 0:
        chosen = _top_k_leftmost(among, idx, valid, tl.load(quota + row), BLOCK_L)
    elif KIND == 2:
        factor = tl.load(consts + 3)
        n = tl.sum(mask.to(tl.int64), 0)
        lo = tl.full((), 1, tl.int64)  # first failing rank in [lo, hi]; rank 0 never fails
        hi = n
        for _ in tl.static_range(LOG_L + 1):
            mid = (lo + hi) // 2
            need = 1.0 - factor / (mid + 2).to(tl.float64)
            fails = (mid < n) & (_count_at_least(among, valid, need) <= mid)
            go = lo < hi
            hi = tl.where(go & fails, mid, hi)
            lo = tl.where(go & ~fails, mid + 1, lo)
        first_fail = tl.where(n == 0, 0, lo)
        k = tl.maximum(first_fail, 1)
        if not STRICT_PREFIX:
            k = tl.where(first_fail == n - 1, n, k)
        chosen = _top_k_leftmost(among, idx, valid, k, BLOCK_L)
    else:
        if FLOOR:  # the quota's most confident (LLaDA2's hybrid acceptance), not only the best
            best = _top_k_leftmost(among, idx, valid, tl.load(quota + row), BLOCK_L)
        else:
            top = tl.max(among, 0)
            best = idx == tl.min(tl.where(valid & (among == top), idx, BLOCK_L), 0)
        if KIND == 1:
            need = tl.zeros([BLOCK_L], tl.float64) + kappa
        else:  # anchored_threshold: anchors at kappa; their neighbours need the relaxed threshold (float32 values)
            near = idx < 0
            for d in range(-radius, radius + 1):
                j = idx + d
                inside = (j >= 0) & (j < L)
                cj = tl.load(confidence + base + j, mask=inside, other=ninf).to(tl.float64)
                mj = tl.load(committable + base + j, mask=inside, other=0) != 0
                near = near | (inside & mj & (cj >= kappa))
            need = tl.where(near, tl.load(consts + 1), tl.load(consts + 2))
        if STRICT:
            passed = among > need
        else:
            passed = among >= need
        chosen = passed | best
    chosen = (chosen & mask & valid) != 0  # != 0: the interpreter may hold a combined mask as int32
    if HAS_FINISH:
        chosen = (chosen | (mask & valid & (tl.load(finish + row) != 0))) != 0
    tl.store(commit_out + base + idx, chosen, mask=valid)
    new = tl.load(proposals + base + idx, mask=valid & chosen)
    tl.store(tokens + row * tok_stride0 + idx * tok_stride1, new, mask=valid & chosen)
    tl.store(counts + row, tl.sum(chosen.to(tl.int64), 0))
