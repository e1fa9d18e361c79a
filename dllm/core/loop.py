"""The shared denoising driver (DESIGN §3): every sampler runs through ``denoise``.

Each row walks through its blocks on its own: a row whose block is complete moves to its next block
(or stops early at EOS) while the others go on, and rows that are done cost no more forwards. One
iteration is: the sampler's per-row quota (fixed-schedule samplers) -> one forward over the rows that
still work -> proposals for the masked slots of the current block -> the sampler's selection ->
commit. Guarantees: only masked slots of the current block are written, committed tokens never change,
adaptive samplers commit at least one token per row per forward, fixed-schedule samplers finish each
block within ``steps_per_block`` steps, and a hard iteration cap turns any bug into an error, not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm.core.canvas import Canvas
from dllm.core.errors import DllmError, NumericalError
from dllm.core.rng import RowRNG


@dataclass
class StepContext:
    """What a sampler may read while choosing what to commit."""

    model: object
    canvas: Canvas
    temperature: float
    rng: RowRNG
    steps_per_block: int | None
    block: torch.Tensor  # [B] current block index of each row
    step: torch.Tensor  # [B] step index inside the current block
    candidates: torch.Tensor  # [B, L] bool: masked slots of the current block (rows at work only)
    state: dict  # the sampler's per-row state (tensors indexed by row)


@dataclass
class StepInfo:
    """Passed to the per-step callback after each commit."""

    iteration: int
    nfe: int
    tokens: torch.Tensor  # [B, L] canvas after the commit
    committed: torch.Tensor  # [B, L] bool: slots written at this step
    block: torch.Tensor
    done: torch.Tensor  # [B] bool


def denoise(
    model,
    canvas: Canvas,
    sampler,
    *,
    steps_per_block: int | None,
    temperature: float,
    rng: RowRNG,
    eos_early_stop: bool,
    cache=None,
    history: list | None = None,
    callback: Callable[[StepInfo], None] | None = None,
) -> int:
    """Fill every masked slot of ``canvas`` in place; returns the number of model forwards."""
    b, length = canvas.batch, canvas.length
    device = canvas.tokens.device
    block = torch.zeros(b, dtype=torch.long, device=device)
    step = torch.zeros(b, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cols = torch.arange(length, device=device)
    eos = torch.tensor(list(model.eos_ids), device=device, dtype=torch.long)
    fixed = sampler.fixed_steps
    per_block_cap = steps_per_block if fixed else canvas.block_size
    hard_cap = int(canvas.num_blocks.max()) * (per_block_cap + 1) + 1
    ctx = StepContext(model, canvas, temperature, rng, steps_per_block, block, step, None, {})
    if cache is not None:
        cache.begin(canvas)
    working = ~done  # rows included in the last forward (for cache compaction)
    nfe = iteration = 0
    starting = torch.ones(b, dtype=torch.bool, device=device)
    while True:
        candidates = canvas.masked & canvas.in_block(block) & ~done[:, None]
        complete = ~done & ~candidates.any(1)
        while bool(complete.any()):  # settle rows whose block is finished
            if eos_early_stop:
                _, end = canvas.block_bounds(block)
                decoded = (cols >= canvas.prompt_width) & (cols < end[:, None])
                hit = complete & (torch.isin(canvas.tokens, eos) & decoded).any(1)
                if bool(hit.any()):
                    rest = canvas.masked & hit[:, None]
                    canvas.tokens[rest] = model.eos_id
                    done |= hit
                    complete &= ~hit
            block += complete.long()
            step[complete] = 0
            done |= complete & (block >= canvas.num_blocks)
            starting |= complete & ~done
            candidates = canvas.masked & canvas.in_block(block) & ~done[:, None]
            complete = ~done & ~candidates.any(1)
        if bool(done.all()):
            break
        if fixed and bool(((step >= steps_per_block) & ~done).any()):
            raise DllmError("internal error: a block still holds masks after its last scheduled step")
        ctx.candidates = candidates
        if bool(starting.any()):
            sampler.begin_block(ctx, starting)
            if cache is not None:
                cache.new_block(starting)
            starting = torch.zeros_like(starting)
        iteration += 1
        if iteration > hard_cap:
            raise DllmError("internal error: the denoising loop exceeded its hard step cap")

        quota = sampler.quota(ctx)
        if quota is not None:
            quota = torch.minimum(quota, candidates.sum(1)) * (~done)
            ctx.state["quota"] = quota
            if bool((quota == 0).all()):  # nothing scheduled for this step: skip the forward
                step += (~done).long()
                continue

        act = (~done).nonzero().squeeze(1)
        if cache is not None and not torch.equal(working, ~done):
            cache.keep((~done)[working])
        working = ~done
        rows = cache.plan(canvas, block, act) if cache is not None else None
        logits, forwards = sampler.logits(model, canvas, act, rows, None if cache is None else cache.kv)
        nfe += forwards

        cand_logits = _gather_candidates(logits, candidates[act], rows, length)
        if not bool(torch.isfinite(cand_logits).all()):
            raise NumericalError(
                "the model produced NaN or infinite logits; check the checkpoint weights and dtype "
                "(float16 overflows on some models: try bfloat16 or float32)"
            )
        cand_logits[:, model.mask_id] = float("-inf")  # the mask token is never a valid output
        row_of = candidates.nonzero()[:, 0]
        token, confidence = sampler.propose(cand_logits, row_of, ctx)
        proposed = canvas.tokens.clone()
        proposed[candidates] = token
        conf = torch.full((b, length), float("-inf"), dtype=confidence.dtype, device=device)
        conf[candidates] = confidence
        fill = sampler.select(ctx, conf, proposed) & candidates
        if not fixed:  # progress guarantee: at least one commit per working row
            idle = candidates.any(1) & ~fill.any(1)
            if bool(idle.any()):
                best = conf.masked_fill(~candidates, float("-inf")).argmax(1)
                fill[idle.nonzero().squeeze(1), best[idle]] = True
        canvas.tokens[fill] = proposed[fill]
        step += (~done).long()
        if history is not None:
            history.append(canvas.tokens.clone())
        if callback is not None:
            callback(StepInfo(iteration, nfe, canvas.tokens, fill, block.clone(), done.clone()))
    return nfe


def _gather_candidates(logits, candidates, rows, length) -> torch.Tensor:
    """Logits [N, V] of the candidate slots, in row-major order of ``candidates`` [n, L] (a copy: the
    samplers may edit it in place)."""
    if rows is None:
        return logits[candidates]
    n, r = rows.shape
    where = torch.full((n, length), -1, dtype=torch.long, device=rows.device)
    where.scatter_(1, rows, torch.arange(r, device=rows.device).expand(n, -1).contiguous())
    i, c = candidates.nonzero(as_tuple=True)
    j = where[i, c]
    if bool((j < 0).any()):
        raise DllmError("internal error: the cache plan did not compute every candidate slot")
    return logits[i, j]
