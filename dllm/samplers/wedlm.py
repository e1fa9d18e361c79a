"""WeDLM's streaming parallel decoding (Liu et al. 2025, "WeDLM: Reconciling Diffusion Language Models with
Standard Causal Attention for Fast Inference", arXiv 2512.22737, Alg. 1), as its engine runs it: Tencent/WeDLM
@0216110 ``wedlm/engine/wedlm_decoder.py`` (window refill, reordering, commit) and ``wedlm/engine/sampler.py``
(``process_mask_positions``: entropy, position penalty, selection, sampling). Research notes:
research/samplers_b.md §5.2.

Not the HF path ``generate_wedlm`` (``hf_compat/modeling_wedlm.py``), a simplified block-by-block decoder
with a max-probability rule and no cache (Tencent/WeDLM#21).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.caches.stream import StreamPrefix
from dllm.core.errors import ConfigError, DllmError
from dllm.core.loop import Scorer, StepInfo
from dllm.core.params import hp
from dllm.core.rng import Stream
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler


@dataclasses.dataclass(frozen=True)
class WeDLM(Sampler):
    """WeDLM's streaming decoder on a causal-attention model (family ``wedlm``), with its own loop.

    Per row, a window of slots after the committed prefix, each a filled (predicted, not yet committed) token
    or a mask; it starts as ``wedlm_window_size`` masks. One step = one forward:

    1. refill: with m the length of the window's leading run of filled slots, m masks are appended;
    2. the forward computes the window reordered (filled slots first, then masks, each in ascending window
       order) at its logical positions, after the prompt and the committed prefix (their K/V are cached, exact:
       :class:`~dllm.caches.stream.StreamPrefix`); the prompt's prefill folds into the first forward;
    3. the leading filled run is committed in order; a stop token (kept) or reaching ``max_new_tokens`` ends
       the row, and what follows it is discarded;
    4. among the window's masks: adjusted entropy = entropy of the unfiltered logits + ``wedlm_pos_penalty_
       factor`` x (window slot - slot of the first mask); every mask with adjusted entropy strictly below
       ``wedlm_entropy_threshold`` is filled, or else the argmin (the first on ties); None: the argmin only
       (one token per step). The token is the argmax at temperature 0, else a draw after top-k, then top-p,
       then the temperature (the engine's order), from the per-row counter RNG (``Stream.TOKENS``, keyed by
       the row, its step and the slot's offset from the generation start).

    A filled token is committed at the next forward at the earliest, when it joins the leading run; filled
    tokens after a gap stay in the window as context. The window is not clipped at ``max_new_tokens`` (the
    engine's runs past it; what lands there is context, then discarded), only where positions would pass the
    model's maximum length (the engine's KV budget). ``nfe`` counts the engine's decode steps.

    Deliberate differences: a batch is one padded forward with ragged rows (the engine's varlen batch is the
    same computation); sampling draws come from the counter RNG (the engine's ``torch.multinomial``: the same
    law); the stop tokens are the model's EOS ids (``config.json``, ``generation_config.json`` and the tokenizer's
    end tokens; the engine's are the tokenizer's ``eos_token_id`` plus the request's ``stop_token_ids``);
    ``eos_early_stop=False`` ignores the stop tokens (the engine's stop set always holds EOS); the window is
    capped where its positions would pass the model's maximum length (the engine's RoPE table ends there too).
    ``suppress_mask_token`` (ours, default False as in the engine, whose sampler may propose the mask token):
    True sets the mask token's logit to -inf before the proposal (the entropy still reads the unfiltered
    logits). Engine defaults: W = 16, tau = 0.4, lambda = 0.02, top_k 0 (off), top_p 1.0 (off).
    """

    name: ClassVar[str] = "wedlm"
    fixed_steps: ClassVar[bool] = False
    default_block: ClassVar[int | None] = None
    grid_blocks: ClassVar[bool] = False
    causal: ClassVar[bool] = True  # drives causal-attention models, with its own loop

    wedlm_window_size: int = hp(16, ">= 1", note="the engine's default is 16")
    wedlm_entropy_threshold: float | None = hp(
        0.4, "[0, inf]", note="in nats; the engine's default is 0.4; None: one token per step"
    )
    wedlm_pos_penalty_factor: float = hp(0.02, ">= 0", note="the engine's default is 0.02")
    top_k: int = hp(0, ">= 0", note="0: off")
    top_p: float = hp(1.0, "(0, 1]", note="1.0: off")
    suppress_mask_token: bool = False

    # -- checks --------------------------------------------------------------------------------
    def check_model(self, model):
        if model.attention != "causal":
            raise ConfigError(
                f"the {self.name!r} sampler decodes causal-attention models (WeDLM); this {model.family} model has "
                f"{model.attention} attention. Use 'llada', 'threshold' or 'dream' (or 'sdar' on SDAR) instead"
            )

    def default_cache(self, model):
        return StreamPrefix()

    def check_cache(self, model, cache):
        if cache is not None and not isinstance(cache, StreamPrefix):
            raise ConfigError(
                f"the {self.name!r} sampler keeps its own exact cache of the prompt and the committed prefix; "
                f"cache={cache.name!r} does not apply. Use cache='default' (or 'stream'), or cache=None to recompute "
                "the prefix at every step"
            )

    def plan(self, model, prompt_len, max_new_tokens, block_size, steps, steps_per_block):
        if steps is not None or steps_per_block is not None:
            raise ConfigError(
                f"the {self.name!r} sampler streams through a window and takes no steps budget (steps, "
                "steps_per_block); set wedlm_entropy_threshold (None: one token per step) instead"
            )
        if block_size is not None:
            raise ConfigError(
                f"the {self.name!r} sampler has no blocks; its window is wedlm_window_size={self.wedlm_window_size}"
            )
        return super().plan(model, prompt_len, max_new_tokens, None, None, None)

    # -- the loop ------------------------------------------------------------------------------
    def run(self, run) -> None:
        _Stream(self, run).decode()


class _Stream:
    """One generation's streaming state. Per row b (all tensors on the model's device):

    buffer columns: ``[0, P)`` the left-padded prompt, then the committed tokens, then the window reordered;
    ``start[b] = P + committed[b]`` is the window's first column. ``slots`` [B, S] / ``filled`` [B, S] hold
    the window in logical (slot) order, ``width[b]`` slots of it in use."""

    def __init__(self, sampler: WeDLM, run):
        self.sampler, self.run = sampler, run
        canvas, model = run.canvas, run.model
        self.model = model
        b, p = canvas.batch, canvas.prompt_width
        self.g = canvas.length - p
        w = sampler.wedlm_window_size
        device = canvas.tokens.device
        self.device = device
        self.p = p
        # a window holds at most W + m <= 2W slots during a forward, and no slot past the model's maximum length
        # (its positions): the buffers follow the window that can be, not a wedlm_window_size beyond it
        self.s = min(2 * w, model.max_length - int(canvas.prompt_lens.min()))
        length = p + self.g + self.s
        self.tokens = torch.full((b, length), model.mask_id, dtype=torch.long, device=device)
        self.tokens[:, :p] = canvas.tokens[:, :p]
        self.valid = torch.ones((b, length), dtype=torch.bool, device=device)
        self.valid[:, :p] = canvas.valid[:, :p]
        self.positions = torch.zeros((b, length), dtype=torch.long, device=device)
        self.positions[:, :p] = canvas.positions[:, :p]
        self.plen = canvas.prompt_lens.long()
        self.committed = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b, self.s), model.mask_id, dtype=torch.long, device=device)
        self.filled = torch.zeros((b, self.s), dtype=torch.bool, device=device)
        self.budget = model.max_length - self.plen  # positions left after the prompt (the engine's KV budget)
        self.width = torch.minimum(torch.full_like(self.plen, w), self.budget)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.steps = torch.zeros(b, dtype=torch.long, device=device)  # forwards per row (the RNG's step counter)
        self.active = torch.arange(b, device=device)
        self.stop = run.eos if run.eos_early_stop else run.eos[:0]
        self.iteration = 0
        self.hard_cap = self.g * (self.s + 1) + 2
        self.scorer = Scorer(run, sampler, ())  # the LM head and the proposals, on the run's scoring backend
        # the proposal: top-k, then top-p, then the temperature (the engine's order), from the unfiltered logits
        self.spec = ScoreSpec(
            need=frozenset(),
            temperature=run.temperature,
            top_k=sampler.top_k if run.temperature > 0 else None,
            top_p=sampler.top_p if run.temperature > 0 else None,
            order=("top_k", "top_p", "temper"),
            suppress=(model.mask_id,) if sampler.suppress_mask_token else (),
        )

    def decode(self) -> None:
        run = self.run
        if run.cache is not None:
            run.cache_state = run.cache.start(run)
        while self.active.numel():
            self.iteration += 1
            if self.iteration > self.hard_cap:
                raise DllmError("internal error: the wedlm streaming loop exceeded its hard step cap")
            self.step()
        run.checks.now()
        run.cache_state = None  # the cache's per-run state (its K/V store) dies with the run
        canvas = run.canvas  # the span after a row's end (stop token or length): EOS
        if run.model.eos_ids:  # (without one, every row ends at the length: no span is left)
            tail = torch.arange(self.g, device=self.device)[None, :] >= self.committed[:, None]
            canvas.tokens[:, self.p :] = torch.where(tail, run.model.eos_id, canvas.tokens[:, self.p :])
        if run.history:  # that EOS fill belongs to the last step's canvas, as in the shared loop
            run.history[-1] = canvas.tokens.clone()

    def step(self) -> None:
        rows = self.active
        slots, filled, width = self.slots[rows], self.filled[rows], self.width[rows]
        slot = torch.arange(self.s, device=self.device)[None, :]
        in_window = slot < width[:, None]
        # 1. refill: as many masks as the leading filled run is long (within the position budget)
        run_len = (filled & in_window).long().cumprod(1).sum(1)
        start = self.p + self.committed[rows]
        room = self.budget[rows] - self.committed[rows]
        width = torch.minimum(width + run_len, room)
        in_window = slot < width[:, None]
        filled = filled & in_window
        slots = torch.where(in_window & ~filled, self.model.mask_id, slots)
        # 2. reordered window: filled slots first, then masks, each in slot order; out-of-window slots last
        key = (~filled).long() * self.s + slot + (~in_window).long() * 2 * self.s
        order = torch.argsort(key, dim=1)  # reordered row r holds window slot order[r]
        n_filled = filled.sum(1)
        cols = start[:, None] + slot  # reordered row r sits at column start + r
        tokens, positions, valid = self.tokens[rows], self.positions[rows], self.valid[rows]
        write = in_window  # rows r < width (the in-window slots sort first)
        reordered_tokens = slots.gather(1, order)
        reordered_positions = (self.plen[rows] + self.committed[rows])[:, None] + order
        tokens.scatter_(1, cols, torch.where(write, reordered_tokens, tokens.gather(1, cols)))
        positions.scatter_(1, cols, torch.where(write, reordered_positions, positions.gather(1, cols)))
        self.tokens[rows], self.positions[rows] = tokens, positions
        # the forward, and the logits of the window's masks (reordered rows n_filled .. width - 1)
        n_masks = width - n_filled
        k = int(n_masks.max())
        mask_rows = n_filled[:, None] + torch.arange(k, device=self.device)[None, :]
        mask_cols = start[:, None] + mask_rows.minimum(width[:, None] - 1)
        hidden = self._forward(rows, tokens, positions, valid, start, width)
        logits = self.scorer.logits(None, rows, mask_cols, hidden, raw=True)  # the engine may propose the mask id
        self.steps[rows] += 1
        # 3. commit the leading filled run (the first run_len reordered rows, in slot order)
        finished, written = self._commit(rows, slots, run_len)
        # drop the committed slots from the window
        shifted = (slot + run_len[:, None]).clamp(max=self.s - 1)
        beyond = slot + run_len[:, None] >= self.s
        slots = slots.gather(1, shifted).masked_fill(beyond, self.model.mask_id)
        filled = filled.gather(1, shifted) & ~beyond
        width = width - run_len
        # 4. fill masks: the masks' window slots after the shift, in order (as their logits)
        mask_slots = (
            order.gather(1, mask_rows.minimum(torch.as_tensor(self.s - 1, device=self.device))) - run_len[:, None]
        )
        real = torch.arange(k, device=self.device)[None, :] < n_masks[:, None]
        if k:  # (no masks at all: every row's window was filled up to the position limit, and it ends now)
            chosen, proposal = self._choose(rows, logits, mask_slots, real)
            chosen &= ~finished[:, None]
            slots = _scatter(slots, mask_slots, proposal, chosen)
            filled = _scatter(filled, mask_slots, chosen, chosen)
        self.slots[rows], self.filled[rows], self.width[rows] = slots, filled, width
        self._history(rows, finished, written)
        if bool(finished.any()):
            self.done[rows] |= finished
            kept = (~finished).nonzero().squeeze(1)
            self.active = rows.index_select(0, kept)
            if self.run.cache is not None:
                self.run.cache.keep(self.run.cache_state, kept)

    def _forward(self, rows, tokens, positions, valid, start, width):
        """One counted forward of the working rows' windows (with the cache: only the windows, after the first)."""
        run = self.run
        cache = run.cache
        if cache is None:  # the cache-free recompute: prompt, committed prefix and window, every step
            end = int((start + width).max())
            return run.forward(tokens[:, :end], positions[:, :end], valid[:, :end])
        plan = cache.plan_window(run.cache_state, start, width)
        run.refreshes += plan.refresh
        kv = run.cache_state.kv
        return run.forward(tokens, positions, valid, queries=plan.queries, kv=kv, write=plan.write)

    def _commit(self, rows, slots, run_len) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit each row's leading filled run to the canvas; returns (bool [n]: rows that end (stop token,
        length), bool [n, L]: the canvas slots written)."""
        slot = torch.arange(self.s, device=self.device)[None, :]
        committed = self.committed[rows]
        take = slot < run_len[:, None]
        is_stop = torch.isin(slots, self.stop) & take
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, run_len)
        count = torch.minimum(first_stop, self.g - committed)  # the stop token is kept; nothing past the length
        take = slot < count[:, None]
        canvas = self.run.canvas.tokens
        index = self.p + committed[:, None] + slot
        canvas[rows] = _scatter(canvas[rows], index, slots, take)
        written = _scatter(torch.zeros_like(canvas[rows], dtype=torch.bool), index, take, take)
        self.committed[rows] = committed + count
        return is_stop.any(1) | (committed + count >= self.g), written

    def _choose(self, rows, logits, mask_slots, real):
        """The engine's ``process_mask_positions`` on the masks' logits [n, K, V]: which masks to fill (bool [n, K])
        and their tokens [n, K]."""
        sampler, run = self.sampler, self.run
        raw = logits.float()
        # of the unfiltered logits, exact as the engine's (the scoring seam's entropy is Dream's -sum p log(p + 1e-10));
        # no argument check: it reads the logits back to the host at every step
        entropy = torch.distributions.Categorical(logits=raw, validate_args=False).entropy()
        distance = (mask_slots - mask_slots[:, :1]).to(entropy.dtype)
        adjusted = (entropy + distance * sampler.wedlm_pos_penalty_factor).masked_fill(~real, float("inf"))
        best = torch.zeros_like(real).scatter_(1, adjusted.argmin(1, keepdim=True), True)
        if sampler.wedlm_entropy_threshold is None:
            chosen = best
        else:
            below = (adjusted < sampler.wedlm_entropy_threshold) & real
            chosen = torch.where(below.any(1, keepdim=True), below, best)
        counters = None
        if run.temperature > 0:
            offsets = self.committed[rows][:, None] + mask_slots.clamp(min=0)
            counters = run.rng.counters(Stream.TOKENS, rows, self.steps[rows], offsets)
        proposal = self.scorer.score(raw, self.spec, counters).token
        return chosen & real, proposal

    def _history(self, rows, finished, written) -> None:
        run = self.run
        if run.history is not None:
            run.history.append(run.canvas.tokens.clone())
        if run.callback is not None:
            done = self.done.clone()
            done[rows] |= finished
            committed = torch.zeros_like(run.canvas.valid)
            committed[rows] = written
            block = torch.zeros_like(self.done, dtype=torch.long)
            run.callback(
                StepInfo(self.iteration, run.nfe, run.canvas.tokens, committed, block, done, run.canvas.prompt_width)
            )


def _scatter(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``target`` [n, L] with ``values`` written at ``index`` [n, K] where ``where`` [n, K] holds (the others go to a
    spare column, so that an unused index never races a used one in the scatter)."""
    n, length = target.shape
    wide = torch.cat([target, target[:, :1]], 1)
    index = torch.where(where, index, length)
    return wide.scatter_(1, index, values.to(target.dtype))[:, :length]
