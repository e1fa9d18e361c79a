"""Kernel A: the per-step row statistics of :func:`dllm.kernels.reference.score`, fused in Triton.

One pass over the vocabulary computes, per row of logits [N, V], everything a sampler may ask for: the
argmax (lowest id on ties) and the top-2 logits, an online log-sum-exp of the probability logits (``spec.exclude``
set to -inf, in ``spec.dtype``), their top-2, and at temperature > 0 the Gumbel-max proposal
``argmax(l - T log(-log u))`` with ``u`` drawn inside the kernel from the Philox-4x32-10 counters of
:class:`dllm.core.rng.Counters` (53-bit float64 uniforms, the words and layout of ``dllm.core.rng``; the log-domain
form of LLaDA's ``exp(l) / (-log u) ** T``, ML-GSAI/LLaDA ``generate.py`` ``add_gumbel_noise``), so a fused run
samples the very tokens the reference samples. The vocabulary is split over several programs per row (occupancy
for block-only steps of 32 rows) and a second small kernel merges the partial tuples exactly: max and argmax with
the lowest id on ties, second max with multiplicity, log-sum-exp, the Gumbel winner. Entropy, when asked for, is a
second pass over the vocabulary once the log-sum-exp is known, because the reference's ``-sum p log(p + 1e-10)``
(Dream's ``sample_tokens``) is not a function of one-pass sums; the second pass reproduces it term by term,
rounding each term to the probabilities' dtype as the reference does for bfloat16 / float16 probabilities.

Temper (``ScoreSpec.temper``, Dream's / SDAR's / S2D2's division of the logits by their temperature before the
softmax, Dream ``generation_utils.py`` ``sample_tokens``: ``logits = logits / temperature``) is fused: each logit is
divided as the reference's ``logits / temper`` computes it on that device and rounded to the logits' dtype, and the
proposal (argmax, or the Gumbel keys), the statistics and the exclusions then read the tempered logits, while the
logit margin reads the untempered ones (the reference takes it before the warps). PyTorch divides by a Python float
in float32 (bfloat16 / float16 logits in float32, rounded back): on the CPU by ``float32(temper)``, on CUDA by
multiplying with the float32 reciprocal ``1 / float32(temper)`` (the two differ in the last bit of some quotients);
the kernel does the same per device (the interpreter divides, CUDA multiplies: :func:`_temper`), so the tempered
logits, hence ties created by the rounding, are the reference's of the same device. -inf stays -inf (also for a
temper above float32's range, where the reference masks the NaN of -inf / inf). A temper that overflows the logits
(or divides by a float32 0) gives +-inf / NaN logits as in the reference: the same tokens, NaN statistics.

Design: ``caches_kernels.md`` §10.3 of the project research (the SGLang dLLM post-process kernel's online max /
sum-exp with first-index ties, and its TP-local vocabulary merge, sgl-project/sglang
``python/sglang/srt/dllm/kernels``), extended with the top-2, the exclusions, the temperature and the batch.

Precision: logits are read in their dtype (float32 / bfloat16 / float16) and accumulated in float32, or in float64
when ``spec.dtype`` is float64 (the Fast-dLLM rules); the Gumbel keys are float64 always (the reference's; LLaDA
cites arXiv 2409.02908 for it). Probabilities come out in ``spec.dtype`` (None: the logits' dtype), rounded once
from the accumulator, as PyTorch's softmax rounds them.

What may differ from the reference, and only this: the order of the floating-point reductions (a fused online
sum against PyTorch's softmax, ``libdevice`` against the CPU's ``log``) changes the last bit of a probability,
margin or entropy (for bfloat16 / float16 probabilities: one unit of their last place, when the float32 value lies
next to a rounding boundary); such a difference can flip the decision of a rule on a confidence that equals its
threshold exactly, or the Gumbel winner between two float64 keys equal to the last bit (on CUDA Triton may also
contract a tempered logit's product with the following subtraction into one FMA: a last-bit difference of the
statistics, not of the tempered logits the argmax compares). Probabilities are ``exp((x - max) - log(sum))``, not
``exp(x - lse)``: for huge (tempered) logits ``max + log(sum)`` would round ``log(sum)`` away. Tokens, argmax, the
logit margin and ties between equal logits are exact. Rows whose every logit is -inf give token 0 and NaN
probabilities, as the reference does.

Not fused (:func:`supports` says False; the dispatch keeps the reference): logits of another dtype, a probability
dtype below the logits' precision, excluded or suppressed ids outside ``[0, V)``, a vocabulary below 2, the
sampling warps ``top_k`` and ``top_p`` (on), any other :class:`ScoreSpec` field this module does not know set away
from its default. ``suppress`` (ids never proposed) and ``temper`` are fused.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy
import torch
import triton
import triton.language as tl

from dllm.core.rng import Counters
from dllm.kernels.reference import ENTROPY_EPS, Scores, ScoreSpec

_LOGITS = (torch.float32, torch.bfloat16, torch.float16)
_KNOWN = {"need", "temperature", "dtype", "exclude", "suppress", "temper"}  # the ScoreSpec fields this kernel reads
# sampling warps a ScoreSpec may carry (the dispatch seam's) that are not fused: fine when off; then their settings
# (the fill value of filtered logits, the warps' order) change nothing (``temper`` alone is fused, in any order)
_WARPS_OFF = {
    "top_k": lambda v: not v or v <= 0,
    "top_p": lambda v: v is None or v >= 1.0,
}
_WARP_SETTINGS = {"fill", "order"}
# (one frozen set, built here: torch 2.11's dynamo cannot trace ``set | dict_keys`` inside a compiled step)
_WARP_FIELDS = frozenset(_WARP_SETTINGS | _WARPS_OFF.keys())
# the partial tuple of one (row, vocabulary split), float64 words: raw logits' max, its first index, their second
# max; the probability logits' max and second max, the sum of exp(x - max); the Gumbel key's max, its first index,
# the raw logit there; one spare word (the kernels write the literal 10). With a temper, "raw" is tempered, the second
# max is the untempered logits' one and the spare word their max (the logit margin is taken before the warps)
_FIELDS = 10
_HALF = {torch.bfloat16: 1, torch.float16: 2}  # OUT_KIND codes; 0: the accumulator's dtype


def interpreted() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not isinstance(_row_stats, triton.runtime.JITFunction)


def supports(spec: ScoreSpec, logits: torch.Tensor) -> bool:
    """Whether :func:`score` fuses ``spec`` on ``logits``; False sends the dispatch to the reference."""
    warps_off = all(off(getattr(spec, name, None)) for name, off in _WARPS_OFF.items())
    for field in dataclasses.fields(spec):
        if field.name in _KNOWN or (warps_off and field.name in _WARP_FIELDS):
            continue
        if getattr(spec, field.name) != _default(field):
            return False
    if logits.dtype not in _LOGITS or logits.dim() < 1 or logits.shape[-1] < 2:
        return False
    if not (logits.is_cuda or (interpreted() and logits.device.type == "cpu")):
        return False
    if spec.dtype is not None and spec.dtype not in (logits.dtype, torch.float32, torch.float64):
        return False
    if not math.isfinite(spec.temperature) or spec.temperature < 0:
        return False
    temper = getattr(spec, "temper", 1.0)
    if not (isinstance(temper, (int, float)) and temper > 0):
        return False
    ids = tuple(spec.exclude) + tuple(getattr(spec, "suppress", ()))
    return all(0 <= int(i) < logits.shape[-1] for i in ids)


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def plan(rows: int, vocab: int, block_v: int | None = None, splits: int | None = None) -> tuple[int, int]:
    """(tile width, programs per row): enough programs to fill a large GPU (about 1,024 in flight) while each
    program keeps at least 2 tiles to stream; both powers of two. (A first guess, to be tuned on a GPU with
    ``python -m dllm.bench.kernels --block-v ... --splits ...``.)"""
    for name, value, least in (("block_v", block_v, 2), ("splits", splits, 1)):
        if value is not None and (value < least or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
    block_v = block_v or min(4096, triton.next_power_of_2(vocab))
    tiles = triton.cdiv(vocab, block_v)
    if splits is None:
        splits = 1
        while rows * splits < 1024 and tiles >= 4 * splits and splits < 64:
            splits *= 2
    return block_v, splits


def score(
    logits: torch.Tensor,
    spec: ScoreSpec,
    counters: Counters | None = None,
    *,
    block_v: int | None = None,
    splits: int | None = None,
) -> Scores:
    """Proposed token and the statistics ``spec.need`` of each row of ``logits`` [..., V], as
    :func:`dllm.kernels.reference.score` computes them (see the module docstring for what may differ).

    counters: the Philox counters of the N rows' draws (required at temperature > 0).
    block_v / splits: tile width and programs per row (powers of two; default :func:`plan`).
    """
    if not supports(spec, logits):
        raise ValueError("this ScoreSpec / logits combination is not fused: ask supports() first")
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n, device = flat.shape[0], flat.device
    need, sample = spec.need, spec.temperature > 0
    if sample and counters is None:
        raise ValueError("sampling at temperature > 0 needs the random-number counters")
    acc = torch.float64 if spec.dtype == torch.float64 else torch.float32
    out_dtype = spec.dtype or logits.dtype
    if n == 0:
        return _empty(shape, need, sample, out_dtype, logits.dtype, device)
    block_v, splits = plan(n, vocab, block_v, splits)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block_v) * block_v  # vocabulary columns per program
    warps = 8 if block_v >= 2048 else 4
    exclude = _constant(tuple(spec.exclude) or (-1,), torch.long, device)
    hidden = tuple(getattr(spec, "suppress", ()))  # never proposed: -inf before everything
    suppress = _constant(hidden or (-1,), torch.long, device)
    if sample:
        words = (counters.rows, counters.steps, counters.offsets)
        rows, steps, offsets = (t.to(device, torch.long).contiguous() for t in words)  # may be broadcast views
        stream_word = int(counters.stream) << 24
        if isinstance(counters.key[0], torch.Tensor):  # per-row seeds: each row's key, its 64 bits in an int64
            key = 0
            keys = (counters.key[0].to(device) | (counters.key[1].to(device) << 32)).contiguous()
        else:
            key, keys = counters.key[0] | (counters.key[1] << 32), exclude  # (not read)
    else:
        key, stream_word = 0, 0
        rows = steps = offsets = keys = exclude  # not read
    tempers, factor = _temper(getattr(spec, "temper", 1.0), device)
    consts = _constant((float(spec.temperature), ENTROPY_EPS, factor), torch.float64, device)  # float64 scalars
    parts = torch.empty(n, splits, _FIELDS, dtype=torch.float64, device=device)
    _row_stats[(n, splits)](
        flat,
        flat.stride(0),
        vocab,
        chunk,
        exclude,
        suppress,
        key,
        keys,
        rows,
        steps,
        offsets,
        stream_word,
        consts,
        parts,
        NUM_EXCL=exclude.numel(),
        EXCL=bool(spec.exclude),
        NUM_SUPP=suppress.numel(),
        SUPP=bool(hidden),
        SAMPLE=sample,
        ROW_KEYS=sample and keys is not exclude,
        ACC_F64=acc == torch.float64,
        TEMPER=tempers,
        RAW_KIND=_HALF.get(logits.dtype, 0),
        BLOCK_V=block_v,
        num_warps=warps,
    )
    token = torch.empty(n, dtype=torch.long, device=device)
    stats = {name: torch.empty(n, dtype=out_dtype, device=device) for name in ("prob", "top1", "margin")}
    lmargin = torch.empty(n, dtype=logits.dtype, device=device)
    argmax = torch.empty(n, dtype=torch.long, device=device)
    lse = torch.empty(n, 2, dtype=acc, device=device)  # the probability logits' max and log(sum exp(x - max))
    _merge[(n,)](
        parts,
        exclude,
        token,
        argmax,
        stats["prob"],
        stats["top1"],
        stats["margin"],
        lmargin,
        lse,
        NUM_EXCL=exclude.numel(),
        EXCL=bool(spec.exclude),
        SAMPLE=sample,
        TEMPER=tempers,
        SPLITS=splits,
        ACC_F64=acc == torch.float64,
        OUT_KIND=_HALF.get(out_dtype, 0),
        RAW_KIND=_HALF.get(logits.dtype, 0),
    )
    out = Scores(token=token.reshape(shape))
    if "logit_margin" in need:
        out.logit_margin = lmargin.reshape(shape)
    if "prob" in need:
        out.prob = stats["prob"].reshape(shape)
    if need & {"top1", "argmax"}:
        out.argmax = argmax.reshape(shape)
        out.top1 = stats["top1"].reshape(shape)
    if "margin" in need:
        out.margin = stats["margin"].reshape(shape)
    if "entropy" in need:
        sums = torch.empty(n, splits, dtype=acc, device=device)
        zeroed = _constant(tuple(spec.exclude) + hidden or (-1,), torch.long, device)
        _entropy_terms[(n, splits)](
            flat,
            flat.stride(0),
            vocab,
            chunk,
            zeroed,
            lse,
            sums,
            consts,
            NUM_EXCL=zeroed.numel(),
            EXCL=bool(spec.exclude or hidden),
            ACC_F64=acc == torch.float64,
            OUT_KIND=_HALF.get(out_dtype, 0),
            TEMPER=tempers,
            RAW_KIND=_HALF.get(logits.dtype, 0),
            BLOCK_V=block_v,
            num_warps=warps,
        )
        out.entropy = (-sums.sum(-1).to(out_dtype)).reshape(shape)
    return out


def _temper(temper: float, device: torch.device) -> tuple[int, float]:
    """(TEMPER mode, float32 operand) of the reference's ``logits / temper`` as PyTorch computes it on ``device``.

    PyTorch takes a Python float divisor in float32 (the logits' opmath; bfloat16 / float16 logits are divided
    in float32 and rounded back). On the CPU it divides by ``float32(temper)`` (mode 1); on CUDA it multiplies by
    the float32 reciprocal ``1 / float32(temper)`` (mode 2, ``div_true_kernel_cuda``), which may differ in the last
    bit: each device reproduces its own reference. Mode 0: off (``temper == 1``).
    """
    if temper == 1.0:
        return 0, 1.0
    with numpy.errstate(over="ignore", divide="ignore"):  # on the host: no tensor op, no synchronisation
        divisor = numpy.float32(temper)  # inf above float32's range
        if device.type == "cuda":
            return 2, float(numpy.float32(1.0) / divisor)
    return 1, float(divisor)


_CONSTANTS: dict = {}


def _constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small device tensor of ``values``, made once: a host-to-device copy at every step would synchronise."""
    key = (values, dtype, device)
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        _CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return _CONSTANTS[key]


def _empty(shape, need, sample, out_dtype, logits_dtype, device) -> Scores:
    def empty(dtype):
        return torch.empty(shape, dtype=dtype, device=device)

    out = Scores(token=empty(torch.long))
    out.logit_margin = empty(logits_dtype) if "logit_margin" in need else None
    out.prob = empty(out_dtype) if "prob" in need else None
    if need & {"top1", "argmax"}:
        out.argmax, out.top1 = empty(torch.long), empty(out_dtype)
    out.margin = empty(out_dtype) if "margin" in need else None
    out.entropy = empty(out_dtype) if "entropy" in need else None
    return out


@triton.jit
def _excluded(idx, exclude, NUM_EXCL: tl.constexpr):
    hit = idx < 0  # all False, shaped like idx
    for e in tl.static_range(NUM_EXCL):
        hit = hit | (idx == tl.load(exclude + e))
    return hit


@triton.jit
def _first_max(values, idx, valid):
    """Max of a tile, its lowest index among the valid lanes, and the max of the others (with multiplicity)."""
    top = tl.max(values, 0)
    at = tl.min(tl.where(valid & (values == top), idx, 2**62), 0)
    second = tl.max(tl.where(idx == at, float("-inf"), values), 0)
    return top, at, second


@triton.jit
def _merge_top2(m1, i1, m2, t1, ti, t2):
    """Merge a running (max, index, second) with a later tile's: ties keep the earlier index."""
    later = t1 > m1
    second = tl.maximum(tl.minimum(m1, t1), tl.maximum(m2, t2))
    return tl.maximum(m1, t1), tl.where(later, ti, i1), second


@triton.jit
def _row_stats(
    logits,
    stride,
    V,
    CHUNK,
    exclude,
    suppress,
    key,
    keys,  # (ROW_KEYS: each row's key, int64 [N], for per-row seeds; else ``key`` for all)
    rows,
    steps,
    offsets,
    stream_word,  # (not "stream": inductor's wrapper of a user Triton kernel has its own, torch 2.11 on an H200)
    consts,
    parts,
    NUM_EXCL: tl.constexpr,
    EXCL: tl.constexpr,
    NUM_SUPP: tl.constexpr,
    SUPP: tl.constexpr,
    SAMPLE: tl.constexpr,
    ROW_KEYS: tl.constexpr,
    ACC_F64: tl.constexpr,
    TEMPER: tl.constexpr,
    RAW_KIND: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One (row, vocabulary split): the partial tuple (see ``_FIELDS``) of its columns ``[lo, hi)``."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    acc_t = tl.float64 if ACC_F64 else tl.float32
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    base = logits + row.to(tl.int64) * stride
    ninf = float("-inf")
    m1 = tl.full((), ninf, tl.float32)  # raw logits: max, its first index, second max
    i1 = lo.to(tl.int64)
    m2 = tl.full((), ninf, tl.float32)
    x1 = tl.full((), ninf, acc_t)  # probability logits (exclusions at -inf, accumulator dtype)
    xi = lo.to(tl.int64)
    x2 = tl.full((), ninf, acc_t)
    s = tl.zeros((), acc_t)  # sum of exp(x - x1)
    gk = tl.full((), ninf, tl.float64)  # Gumbel key: max, its first index, the raw logit there
    gi = lo.to(tl.int64)
    gl = tl.full((), ninf, tl.float32)
    q1 = tl.full((), ninf, tl.float32)  # with TEMPER: the untempered logits' max and second max (logit margin)
    q2 = tl.full((), ninf, tl.float32)
    if TEMPER != 0:
        factor = tl.load(consts + 2).to(tl.float32)
    if SAMPLE:
        c1 = (tl.load(offsets + row) & 0xFFFFFFFF).to(tl.uint32)
        c2 = (tl.load(steps + row) & 0xFFFFFFFF).to(tl.uint32)
        c3 = ((tl.load(rows + row) + stream_word) & 0xFFFFFFFF).to(tl.uint32)
        temperature = tl.load(consts)
        if ROW_KEYS:
            seed = tl.load(keys + row).to(tl.uint64, bitcast=True)
        else:
            seed = key
    for start in range(lo, hi, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        valid = idx < hi
        raw = tl.load(base + idx, mask=valid, other=ninf).to(tl.float32)
        idx = idx.to(tl.int64)
        if SUPP:
            raw = tl.where(_excluded(idx, suppress, NUM_SUPP), ninf, raw)
        if TEMPER != 0:  # the logit margin is taken before the warps; everything else after
            r1, _, r2 = _first_max(raw, idx, valid)
            q1, q2 = tl.maximum(q1, r1), tl.maximum(tl.minimum(q1, r1), tl.maximum(q2, r2))
            raw = _tempered(raw, factor, TEMPER, RAW_KIND)
        t1, ti, t2 = _first_max(raw, idx, valid)
        m1, i1, m2 = _merge_top2(m1, i1, m2, t1, ti, t2)
        if EXCL:
            x = tl.where(_excluded(idx, exclude, NUM_EXCL), ninf, raw.to(acc_t))
            u1, ui, u2 = _first_max(x, idx, valid)
        else:
            x = raw.to(acc_t)
            u1, ui, u2 = t1.to(acc_t), ti, t2.to(acc_t)
        new = tl.maximum(x1, u1)
        shift = tl.where(new == ninf, 0.0, new)
        s = s * tl.exp(x1 - shift) + tl.sum(tl.exp(x - shift), 0)
        x1, xi, x2 = _merge_top2(x1, xi, x2, u1, ui, u2)
        if SAMPLE:
            # one Philox call per pair of ids (start is even): words 0/1 for the even id, 2/3 for the odd one
            pairs = (start // 2 + tl.arange(0, BLOCK_V // 2)).to(tl.uint32)
            z = tl.zeros([BLOCK_V // 2], tl.uint32)
            w0, w1, w2, w3 = tl.philox(seed, pairs, z + c1, z + c2, z + c3)
            high = tl.reshape(tl.join(w0, w2), [BLOCK_V])
            low = tl.reshape(tl.join(w1, w3), [BLOCK_V])
            bits = (high >> 5).to(tl.uint64) * 67108864 + (low >> 6).to(tl.uint64)
            u = bits.to(tl.float64) * (1.0 / 9007199254740992.0)
            keys = tl.where(valid, raw.to(tl.float64) - temperature * tl.log(-tl.log(u)), ninf)
            k1, kidx, _ = _first_max(keys, idx, valid)
            kl = tl.max(tl.where(idx == kidx, raw, ninf), 0)
            later = k1 > gk
            gk = tl.maximum(gk, k1)
            gi = tl.where(later, kidx, gi)
            gl = tl.where(later, kl, gl)
    out = parts + (row.to(tl.int64) * tl.num_programs(1) + split) * 10
    tl.store(out + 0, m1.to(tl.float64))
    tl.store(out + 1, i1.to(tl.float64))
    if TEMPER != 0:  # the second max serves the logit margin only: the untempered one, with its max in word 9
        tl.store(out + 2, q2.to(tl.float64))
        tl.store(out + 9, q1.to(tl.float64))
    else:
        tl.store(out + 2, m2.to(tl.float64))
    tl.store(out + 3, x1.to(tl.float64))
    tl.store(out + 4, x2.to(tl.float64))
    tl.store(out + 5, s.to(tl.float64))
    tl.store(out + 6, gk)
    tl.store(out + 7, gi.to(tl.float64))
    tl.store(out + 8, gl.to(tl.float64))


@triton.jit
def _tempered(raw, factor, TEMPER: tl.constexpr, RAW_KIND: tl.constexpr):
    """float32 logits divided by the temper as the reference does (see :func:`_temper`), rounded to the logits'
    dtype; -inf stays -inf (also where the divisor is inf, as the reference keeps it)."""
    if TEMPER == 1:
        scaled = tl.math.div_rn(raw, factor)
    else:
        scaled = raw * factor
    return tl.where(raw == float("-inf"), float("-inf"), _round(scaled, RAW_KIND))


@triton.jit
def _round(value, KIND: tl.constexpr):
    """``value`` rounded to the output dtype (KIND 1: bfloat16, 2: float16, 0: unchanged), as float32."""
    if KIND == 1:  # round to nearest even by hand: Triton's interpreter truncates float32 -> bfloat16
        value = value.to(tl.float32)
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # NaN stays NaN: the carry would turn CUDA's NaN (0x7FFFFFFF) into -0.0
        return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))
    elif KIND == 2:
        return value.to(tl.float16).to(tl.float32)
    else:
        return value


@triton.jit
def _merge(
    parts,
    exclude,
    token,
    argmax,
    prob,
    top1,
    margin,
    lmargin,
    lse_out,
    NUM_EXCL: tl.constexpr,
    EXCL: tl.constexpr,
    SAMPLE: tl.constexpr,
    TEMPER: tl.constexpr,
    SPLITS: tl.constexpr,
    ACC_F64: tl.constexpr,
    OUT_KIND: tl.constexpr,
    RAW_KIND: tl.constexpr,
):
    """One row: merge its SPLITS partial tuples exactly and write the statistics."""
    row = tl.program_id(0)
    acc_t = tl.float64 if ACC_F64 else tl.float32
    ninf = float("-inf")
    r = tl.arange(0, SPLITS)
    p = parts + row.to(tl.int64) * SPLITS * 10 + r * 10
    m1 = tl.load(p + 0)
    i1 = tl.load(p + 1).to(tl.int64)
    m2 = tl.load(p + 2)
    x1 = tl.load(p + 3)
    x2 = tl.load(p + 4)
    s = tl.load(p + 5)
    everywhere = r >= 0
    top, at, second = _first_max(m1, i1, everywhere)
    second = tl.maximum(second, tl.max(m2, 0))
    xt = tl.max(x1, 0)
    xs = tl.max(x2, 0)
    xtop_at = tl.min(tl.where(x1 == xt, r, SPLITS), 0)
    xsecond = tl.maximum(tl.max(tl.where(r == xtop_at, ninf, x1), 0), xs)
    shift = tl.where(xt == ninf, 0.0, xt)
    total = tl.sum(s * tl.exp(x1 - shift), 0)
    # p = exp((x - max) - log(sum)), not exp(x - lse): lse = max + log(sum) would absorb log(sum) where the logits
    # are huge (tempered by a tiny temper), where the reference's softmax still divides by the sum
    shift = shift.to(acc_t)
    log_sum = tl.log(total).to(acc_t)
    tl.store(lse_out + row * 2, shift)
    tl.store(lse_out + row * 2 + 1, log_sum)
    if SAMPLE:
        gk = tl.load(p + 6)
        gi = tl.load(p + 7).to(tl.int64)
        gl = tl.load(p + 8)
        _, tok, _ = _first_max(gk, gi, everywhere)
        tok_logit = tl.max(tl.where(gi == tok, gl, ninf), 0)
    else:
        tok = at
        tok_logit = top
    tl.store(token + row, tok)
    tl.store(argmax + row, at)
    if EXCL:
        tok_logit = tl.where(_excluded(tok, exclude, NUM_EXCL), ninf, tok_logit)
        top = tl.where(_excluded(at, exclude, NUM_EXCL), ninf, tl.max(m1, 0))
    else:
        top = tl.max(m1, 0)
    tl.store(prob + row, _round(tl.exp((tok_logit.to(acc_t) - shift) - log_sum), OUT_KIND))
    tl.store(top1 + row, _round(tl.exp((top.to(acc_t) - shift) - log_sum), OUT_KIND))
    p1 = _round(tl.exp((xt.to(acc_t) - shift) - log_sum), OUT_KIND)
    p2 = _round(tl.exp((xsecond.to(acc_t) - shift) - log_sum), OUT_KIND)
    tl.store(margin + row, _round(p1 - p2, OUT_KIND))
    raw_top = tl.max(m1, 0).to(tl.float32)
    if TEMPER != 0:  # the untempered top-2 (words 9 and 2), with multiplicity across the splits
        q1 = tl.load(p + 9)
        raw_top = tl.max(q1, 0)
        q_at = tl.min(tl.where(q1 == raw_top, r, SPLITS), 0)
        second = tl.maximum(tl.max(tl.where(r == q_at, ninf, q1), 0), tl.max(m2, 0))
        raw_top = raw_top.to(tl.float32)
    tl.store(lmargin + row, _round(raw_top - second.to(tl.float32), RAW_KIND))


@triton.jit
def _entropy_terms(
    logits,
    stride,
    V,
    CHUNK,
    exclude,
    lse_in,
    sums,
    consts,
    NUM_EXCL: tl.constexpr,
    EXCL: tl.constexpr,
    ACC_F64: tl.constexpr,
    OUT_KIND: tl.constexpr,
    TEMPER: tl.constexpr,
    RAW_KIND: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One (row, split): the sum of ``p log(p + eps)`` over its columns, each term as the reference rounds it."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    acc_t = tl.float64 if ACC_F64 else tl.float32
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    base = logits + row.to(tl.int64) * stride
    shift = tl.load(lse_in + row * 2)
    log_sum = tl.load(lse_in + row * 2 + 1)
    eps = tl.load(consts + 1).to(acc_t)
    total = tl.zeros([BLOCK_V], acc_t)
    for start in range(lo, hi, BLOCK_V):
        idx = start + tl.arange(0, BLOCK_V)
        valid = idx < hi
        x = tl.load(base + idx, mask=valid, other=float("-inf"))
        if TEMPER != 0:
            x = _tempered(x.to(tl.float32), tl.load(consts + 2).to(tl.float32), TEMPER, RAW_KIND)
        x = x.to(acc_t)
        if EXCL:
            x = tl.where(_excluded(idx.to(tl.int64), exclude, NUM_EXCL), float("-inf"), x)
        p = _round(tl.exp((x - shift) - log_sum), OUT_KIND)
        term = _round(p * _round(tl.log(_round(p + eps, OUT_KIND)), OUT_KIND), OUT_KIND)
        total += tl.where(valid, term, 0.0)
    tl.store(sums + row.to(tl.int64) * tl.num_programs(1) + split, tl.sum(total, 0))
