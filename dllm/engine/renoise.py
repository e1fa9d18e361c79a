"""The renoise decoding process (DESIGN §3): canvases of uniform noise refined in place by a decoder over an
encoder's K/V, accepted by an entropy bound, the rest renoised, with an adaptive stop (DiffusionGemma; transformers'
``DiffusionGemmaGenerationMixin.generate``, research/diffusion_gemma.md §4). The sampler
(:class:`dllm.samplers.diffusion_gemma.EntropyBound`) gives the hyper-parameters; the session drives it step by step.

Per canvas b (``block_size`` = the canvas length L, ``ceil(max_new_tokens / L)`` canvases):

1. the encoder extends its K/V (:meth:`~dllm.models.diffusion_gemma.DiffusionGemma.encode`) over the prompt (b = 0)
   or the previous canvas — not a counted forward (transformers counts decoder forwards only);
2. the canvas x starts as uniform random ids; the self-conditioning input S is none;
3. steps s = 1 .. N (N = ``max_denoising_steps``), one counted decoder forward of the rows still denoising:
   z = logits / T with T = t_min + (t_max - t_min) (N - s + 1) / N; the denoiser canvas y ~ softmax(z) per slot;
   the argmax canvas a = argmax z; the accepted slots: the lowest entropies H(softmax z) whose sum less the largest
   is within ``entropy_bound`` (at least one); x = y there, fresh uniform ids elsewhere; S = z (kept as its soft
   embedding, [L, d] instead of [L, V]); a row stops denoising once a equals its last ``stability_threshold``
   argmax canvases and mean H < ``confidence_threshold``;
4. the canvas's tokens are each row's last argmax canvas; a row holding an EOS in it ends there (the slots after
   its first EOS become pads; with ``eos_early_stop=False`` rows go on to the last canvas), and ended rows are not
   run again.

The canvas shows each step's argmax canvas (the draft transformers' streamer shows) in the columns of the canvas
being denoised, so ``history`` and the callback see it refine. Random numbers: ``seed`` (counter-based, keyed by the
row's prompt, the step and the slot's offset from the generation start: batch invariant) or ``draws``, an object that
replays another implementation's (:class:`Draws`).

Under a regular constraint (``run.guard``) each step's argmax canvas is the best one the constraint allows given the
canvases before it (a Viterbi pass over its automaton: :meth:`dllm.constraints.guard.Guard.best`), so the output,
the last argmax canvases, matches it; the denoiser's samples in between are not constrained. Under a ``Grammar`` it is
chosen left to right, each slot the best token the grammar allows after the slots before it
(:meth:`dllm.constraints.grammar.GrammarGuard.best`). A template's text (and the EOS past it) stays in its slots of
every canvas, the decoder's input included: never renoised, and left out of the entropy bound and of the mean entropy
of the stop (it is certain); its holes are filled by that best canvas.

Guarantees: a canvas takes at most N forwards, a run at most ``canvases x N`` (the session's hard cap above it);
rows that stopped denoising or ended are not computed; ``nfe`` counts batched decoder forwards; a step reads back
once (which rows still denoise, and the deferred checks: NaN or infinite logits are an error, not tokens).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from dllm.core.errors import ConfigError, NumericalError
from dllm.core.rng import Stream
from dllm.engine.process import Process
from dllm.kernels.dispatch import chosen, score
from dllm.kernels.reference import ScoreSpec

_NOT_FINITE = (
    "the model produced NaN or infinite logits; check the checkpoint weights and dtype (float16 overflows on some "
    "models: try bfloat16 or float32)"
)


class Draws(Protocol):
    """Every random number of a renoise run, from elsewhere (``generate(draws=...)``): the way to reproduce another
    implementation's run token for token (the tests feed transformers' draws). ``rows``: each row's index in the call's
    batch; ``blocks``: its 0-based canvas; ``steps``: the step (int64 tensors [n])."""

    def tokens(self, rows: torch.Tensor, blocks: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """LongTensor [n, L]: step 0, a canvas's initial ids; step s >= 1, the ids replacing the slots not accepted
        at the canvas's s-th forward."""

    def sample(
        self, probs: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """LongTensor [n, L]: the denoiser canvas of the s-th forward, given ``probs`` [n, L, V] float32 (the softmax
        of the temperature-scaled logits)."""


def entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy (nats, float32) of softmax(z) over the last axis, as ``Categorical(logits=z).entropy()``."""
    logp = torch.log_softmax(z.float(), dim=-1)
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


def entropy_accepted(h: torch.Tensor, bound: float) -> torch.Tensor:
    """bool [n, L]: the slots the entropy bound accepts: by ascending entropy ``h`` [n, L] (ties to the leftmost), each
    whose running sum less its own entropy is ``<= bound`` (the lowest always: the bound is > 0), computed as
    transformers' ``EntropyBoundSampler.accept_canvas`` (inclusive cumsum less the slot: not the masked families'
    :func:`dllm.samplers.eb.entropy_bounded`, whose exclusive cumsum rounds differently at the bound)."""
    ordered, order = torch.sort(h, dim=-1, stable=True)
    within = ordered.cumsum(-1) - ordered <= bound
    return torch.zeros_like(within).scatter(-1, order, within)


class Renoising(Process):
    """The renoise process (see the module docstring)."""

    name: ClassVar[str] = "renoise"
    allocates_store: ClassVar[bool] = False
    rewrites_current_block: ClassVar[bool] = True  # the canvas being denoised shows drafts

    def __init__(self, run, sampler):
        super().__init__(run, sampler)
        canvas, model = run.canvas, run.model
        self.model, self.canvas = model, canvas
        self.length = canvas.block_size
        self.canvases = (canvas.length - canvas.prompt_width) // self.length
        self.steps = sampler.max_denoising_steps
        self.hard_cap = self.canvases * self.steps + 1
        b, device = canvas.batch, canvas.tokens.device
        self.rows = torch.arange(b, device=device)
        self.ended = torch.zeros(b, dtype=torch.bool, device=device)  # rows whose generation is over
        self.settled = torch.ones(b, dtype=torch.bool, device=device)  # rows done denoising the current canvas
        self.block, self.step = -1, 0
        self.working: list[int] = []  # the rows still denoising the current canvas (read back at each step)
        self.encoded = model.new_encoded(b, device)
        self.vocab = model.vocab_size

    # -- the session's questions -----------------------------------------------------------------------------------
    def next_step(self) -> bool:
        """One read-back: which rows still denoise, with the deferred checks (NaN logits, ...)."""
        if self.block >= 0:
            checks, b = self.run.checks, self.canvas.batch
            flags = [self.settled, *(torch.as_tensor(f).reshape(1) for f in checks.flags())]
            values = torch.cat(flags).tolist()
            checks.verify(values[b:])
            self.working = [row for row in range(b) if not values[row]]
            if self.working and self.step < self.steps:
                return True
            self._end_canvas()
            if self.block + 1 == self.canvases or bool(self.ended.all()):
                return False
        self._begin_canvas()
        return True

    def blocks(self) -> torch.Tensor:
        return torch.full_like(self.rows, max(self.block, 0))

    def done(self) -> torch.Tensor:
        return self.ended | self.settled

    # -- a canvas --------------------------------------------------------------------------------------------------
    def _columns(self) -> slice:
        start = self.canvas.prompt_width + self.block * self.length
        return slice(start, start + self.length)

    def _begin_canvas(self) -> None:
        canvas = self.canvas
        if self.block < 0:  # the prompt
            new = slice(0, canvas.prompt_width)
        else:
            new = self._columns()
        self.encoded = self.model.encode(canvas.tokens[:, new], canvas.valid[:, new], self.encoded)
        self.block += 1
        self.step = 0
        # a row whose own length ends before this canvas is over, as it is alone (its own last canvas was the last)
        self.ended |= canvas.span_end <= self._columns().start
        b = canvas.batch
        self.x = self._noise(self.rows, 0)
        self.argmax = self.x.clone()
        self.conditioning = None
        k = self.sampler.stability_threshold
        self.history = torch.full((k, b, self.length), -1, dtype=torch.long, device=self.x.device)
        self.settled = self.ended.clone()
        self.working = [row for row, ended in enumerate(self.ended.tolist()) if not ended]
        self.positions = canvas.positions[:, self._columns()]
        self.fixed = None  # a template's text (and the EOS past it) in this canvas: kept, never renoised
        if self.run.template is not None:
            self.fixed = self.run.guard.fixed(canvas.tokens)[:, self._columns()]
            self.x = self._keep_fixed(self.x, self.rows)

    def take_step(self, iteration: int) -> torch.Tensor:
        run, sampler, canvas = self.run, self.sampler, self.canvas
        self.step += 1
        s, n = self.step, self.steps
        temperature = sampler.t_min + (sampler.t_max - sampler.t_min) * (n - s + 1) / n
        rows = torch.tensor(self.working, dtype=torch.long, device=canvas.tokens.device)
        whole = rows.shape[0] == canvas.batch
        pick = (lambda t: t) if whole else (lambda t: t.index_select(0, rows))  # noqa: E731
        conditioning = None if self.conditioning is None else pick(self.conditioning)
        encoded = self.encoded if whole else self.encoded.select(rows)
        span = self._columns()
        columns = torch.arange(span.start, span.stop, device=rows.device).expand(rows.shape[0], -1)
        hidden = run.forward(
            pick(self.x), pick(self.positions), encoded=encoded, conditioning=conditioning, columns=columns,
            width=canvas.length,
        )  # fmt: skip
        z = self.model.head(hidden, columns, checks=run.checks) / temperature
        run.checks.add(~torch.isfinite(z).all(), NumericalError(_NOT_FINITE))  # (read back at the next step)
        h = entropy(z)
        y = self._sample(z, rows)
        argmax = z.argmax(-1)
        if run.guard is not None:  # the argmax canvas: the best one the constraint allows (the output is the last)
            argmax = run.guard.best(z, rows, span.start, canvas.tokens).to(argmax.device)
        free = None if self.fixed is None else ~pick(self.fixed)
        if free is not None:  # (a template's text: certain, so it takes no part in the bound or the mean)
            h = h * free
        accepted = entropy_accepted(h, sampler.entropy_bound)
        x = self._keep_fixed(torch.where(accepted, y, self._noise(rows, s)), rows)
        stable = torch.ones_like(rows, dtype=torch.bool)
        if sampler.stability_threshold:
            history = pick(self.history.transpose(0, 1)).transpose(0, 1)
            stable = (history == argmax[None]).all(-1).all(0)
            history = torch.cat([history[1:], argmax[None]], 0)
            self.history[:, rows] = history
        mean = h.mean(-1) if free is None else h.sum(-1) / free.sum(-1).clamp(min=1)
        confident = mean < sampler.confidence_threshold
        self.x[rows] = x
        self.argmax[rows] = argmax
        soft = self.model.soft_embedding(z)  # the next step's self-conditioning input
        if self.conditioning is None:
            self.conditioning = soft.new_zeros(canvas.batch, *soft.shape[1:])
        self.conditioning[rows] = soft
        self.settled[rows] = stable & confident
        written = torch.zeros_like(canvas.tokens, dtype=torch.bool)
        written[rows, span] = True
        canvas.tokens[:, span] = torch.where(written[:, span], self.argmax, canvas.tokens[:, span])
        return written

    def _end_canvas(self) -> None:
        """The canvas's tokens are the last argmax canvases; rows with an EOS in it end, the slots after their first
        EOS becoming pads (with ``eos_early_stop``; without it, rows go on to the last canvas)."""
        canvas, run = self.canvas, self.run
        columns = self._columns()
        working = ~self.ended
        new = canvas.tokens[:, columns]
        new = torch.where(working[:, None], self.argmax, new)
        if run.eos_early_stop and run.eos.numel():
            is_eos = torch.isin(new, run.eos)
            ending = working & is_eos.any(1)
            seen = is_eos.long().cumsum(1)
            after = (seen > 0) & ~((seen == 1) & is_eos)
            pad = self.model.pad_id
            if pad is not None:
                new = torch.where(ending[:, None] & after, pad, new)
            self.ended |= ending
        canvas.tokens[:, columns] = new
        self.settled = torch.ones_like(self.settled)

    def _keep_fixed(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``x`` [n, L] of ``rows`` with the template's text (and the EOS past it) in its slots."""
        if self.fixed is None:
            return x
        span = self._columns()
        return torch.where(self.fixed[rows], self.canvas.tokens[rows, span], x)

    # -- random numbers --------------------------------------------------------------------------------------------
    def _keys(self, rows: torch.Tensor, step: int):
        n = rows.shape[0]
        blocks = torch.full((n,), self.block, dtype=torch.long, device=rows.device)
        steps = torch.full((n,), step, dtype=torch.long, device=rows.device)
        return blocks, steps

    def _offsets(self, rows: torch.Tensor) -> torch.Tensor:
        """Each slot's offset from the generation start [n, L]."""
        start = self.block * self.length
        return torch.arange(start, start + self.length, device=rows.device).expand(rows.shape[0], -1)

    def _noise(self, rows: torch.Tensor, step: int) -> torch.Tensor:
        """Uniform ids [n, L] for ``rows``: a canvas's initial ones (step 0) or the renoise of step ``step``."""
        draws = self.run.draws
        if draws is not None:
            return self._checked(draws.tokens(rows, *self._keys(rows, step)), rows, "tokens")
        _, steps = self._keys(rows, step)
        u = self.run.rng.uniform(Stream.NOISE, rows, steps, self._offsets(rows))
        return (u * self.vocab).long().clamp(max=self.vocab - 1)

    def _sample(self, z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The denoiser canvas [n, L]: one draw per slot from softmax(z)."""
        run = self.run
        if run.draws is not None:
            probs = torch.softmax(z, dim=-1, dtype=torch.float32)
            return self._checked(run.draws.sample(probs, rows, *self._keys(rows, self.step)), rows, "sample")
        _, steps = self._keys(rows, self.step)
        counters = run.rng.counters(Stream.TOKENS, rows, steps, self._offsets(rows))
        spec = ScoreSpec(need=frozenset(), temperature=1.0)
        flat = z.reshape(-1, z.shape[-1])
        backend = chosen(spec, flat, run.kernel)
        run.kernel_calls[backend] = run.kernel_calls.get(backend, 0) + 1
        return score(flat, spec, counters, backend).token.reshape(z.shape[:-1])

    def _checked(self, ids, rows: torch.Tensor, what: str) -> torch.Tensor:
        shape = (rows.shape[0], self.length)
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != shape or ids.dtype != torch.long:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ConfigError(
                f"draws.{what} must return a LongTensor of shape {shape} (rows, canvas length); got {got}"
            )
        if bool(((ids < 0) | (ids >= self.vocab)).any()):
            raise ConfigError(f"draws.{what} returned token ids outside the vocabulary [0, {self.vocab})")
        return ids.to(rows.device)
