"""Dream's reference sampler: ``diffusion_generate`` of the Dream HF ``generation_utils.py``
(Ye et al. 2025, "Dream 7B", arXiv 2508.15487)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.params import hp
from dllm.core.rng import Stream
from dllm.kernels.reference import ScoreSpec, gumbel_top_k, top_k_per_row
from dllm.kernels.selection import Rule
from dllm.samplers.base import Sampler

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
_HORIZON = 1 << 18  # the most slots (rows x steps, x columns for "origin") idle_steps looks at in one span
_BIG = 1e300  # scaled confidences are clipped to +-_BIG so that their log-softmax has no inf - inf


@dataclasses.dataclass(frozen=True)
class Dream(Sampler):
    """Dream's reference sampler, ``diffusion_generate`` of its HF ``generation_utils.py``.

    Time grid ``t = linspace(1, eps, steps + 1)``; at step i with t = t_i, s = t_{i+1} a fraction
    ``1 - s/t`` of the remaining masks is committed (all at the last step).

    alg: ``"origin"`` commits each mask independently with probability 1 - s/t (random order);
        ``"maskgit_plus"`` / ``"topk_margin"`` / ``"entropy"`` commit the ``int(masks * (1 - s/t))``
        most confident (probability, top-1 minus top-2 probability, negative entropy).
    alg_temp: > 0 samples the positions from ``softmax(confidence / alg_temp)`` instead of top-k.
    top_p, top_k: filters applied after the temperature, before the softmax (the confidences come
        from the filtered distribution, as in the official ``sample_tokens``).
    eps: the time grid's end point (1e-3).
    Defaults: ``alg="entropy"``, ``alg_temp=0`` as in Dream's evaluation (``eval/eval.py``); the
    official ``DreamGenerationConfig`` default is ``"origin"``, which its README says may degrade quality.
    The whole generation is one block by default, as in the official sampler. The official code counts
    masks as the batch average; here each row uses its own count, which is the same for the equal-length
    spans of a batch and keeps rows independent.
    """

    name: ClassVar[str] = "dream"
    on_device: ClassVar[bool] = True
    default_block: ClassVar[int | None] = None
    alg: str = hp("entropy", choices=ALGORITHMS)
    alg_temp: float | None = hp(
        0.0,
        ">= 0",
        note="0 or None: the most confident positions; > 0: positions sampled from softmax(confidence / alg_temp)",
    )
    eps: float = hp(1e-3, "(0, 1)")
    top_p: float | None = hp(None, "(0, 1]")
    top_k: int | None = hp(None, ">= 0", note="0 or None: off")

    def init_state(self, run):
        """The schedule: 1 - s/t at each step of a block (float32, as the official linspace), 1 at the last."""
        steps = run.steps_per_block
        grid = torch.linspace(1, self.eps, steps + 1, device=run.canvas.tokens.device)
        fraction = 1 - grid[1:] / grid[:-1]
        fraction[-1] = 1.0
        return _Schedule(fraction)

    def quota(self, step, state):
        fraction = state.fraction[step.step.clamp(max=step.run.steps_per_block - 1)]
        if self.alg == "origin":
            # Each mask is committed with probability 1 - s/t, drawn before the forward so that a step that
            # reveals nothing costs no forward (the official one still runs it; no output changes).
            coin = step.uniform(Stream.REVEAL, torch.float32)
            state.chosen = step.committable & (coin < fraction[:, None])
            return state.chosen.sum(1)
        return (step.committable.sum(1).to(torch.float32) * fraction).long()  # int(masks * (1 - s/t)); all at the end

    def why_not_on_device(self, run):
        if self.alg == "origin":
            return "Dream's alg='origin' looks for its next revealing step span by span, reading each back"
        return None

    def idle_steps(self, step, state):
        """The steps from this one on whose :meth:`quota` is 0, found by looking at the next steps of the block
        together, in spans that double (the coins too, for ``"origin"``): with ``steps`` far above the generation
        length most steps commit nothing, and the loop takes them at once."""
        steps, (b, length) = step.run.steps_per_block, step.tokens.shape
        origin = self.alg == "origin"
        largest = max(1, _HORIZON // (b * (length if origin else 1)))  # bounded memory per span
        # the rest of the block at once (no read-back), or for "origin", whose coins cost more, spans that double
        first, span = 0, min(steps, 16 if origin else largest)
        while True:
            busy = self._busy(step, state, first + torch.arange(span, device=step.step.device))  # [B, span]
            found = busy.any(1)
            idle = torch.where(found, first + busy.long().argmax(1), first + span)
            if first + span >= steps or bool((found & ~step.done).any()):  # (a read-back per span looked past)
                return idle
            first, span = first + span, min(2 * span, largest)

    def _busy(self, step, state, ahead):
        """bool [B, K]: whether :meth:`quota` is above 0 at each of the steps ``ahead`` [K] after this one, nothing
        being committed meanwhile."""
        steps, (b, length) = step.run.steps_per_block, step.tokens.shape
        fraction = state.fraction[(step.step[:, None] + ahead).clamp(max=steps - 1)]  # [B, K]
        if self.alg != "origin":
            return (step.committable.sum(1, keepdim=True).to(torch.float32) * fraction).long() > 0
        k = ahead.shape[0]  # the coins quota would draw at each of these steps: [B, K, L]
        rows = torch.arange(b, device=ahead.device).repeat_interleave(k)
        offsets = (step.columns - step.canvas.prompt_width).expand(b * k, length)
        t = (step.t[:, None] + ahead).reshape(-1)
        coins = step.run.rng.uniform(Stream.REVEAL, rows, t, offsets, dtype=torch.float32).view(b, k, length)
        return (step.committable[:, None, :] & (coins < fraction[..., None])).any(-1)

    def score_spec(self, run):
        need = {"maskgit_plus": "prob", "topk_margin": "margin", "entropy": "entropy"}.get(self.alg)
        # temperature, top-p, top-k (filled with the dtype's minimum), then the tempered, filtered distribution
        # is sampled as is: Gumbel-max at temperature 1
        return ScoreSpec(
            need=frozenset({need} if need else ()),
            temperature=1.0 if run.temperature > 0 else 0.0,
            temper=run.temperature if run.temperature > 0 else 1.0,
            top_p=self.top_p,
            top_k=self.top_k,
            fill=torch.finfo(run.model.dtype).min,
            order=("temper", "top_p", "top_k"),
        )

    def selection(self, step, state):
        # maskgit_plus without alg_temp: the top-k of the probabilities
        return Rule("top_k") if self.alg == "maskgit_plus" and not self.alg_temp else None

    def select(self, step, state):
        if self.alg == "origin":
            return state.chosen
        confidence = {"maskgit_plus": "prob", "topk_margin": "margin"}.get(self.alg)
        confidence = getattr(step.scores, confidence) if confidence else -step.scores.entropy
        confidence = step.among_committable(confidence)
        if not self.alg_temp:
            return top_k_per_row(confidence, step.quota)
        # positions drawn without replacement from softmax(confidence / alg_temp) over the row's own columns
        weights = torch.softmax(confidence / self.alg_temp, dim=-1)
        # where a weight underflows to 0 (a small alg_temp) or a row's softmax is NaN (alg_temp past the float
        # range), the exact log-weight in float64 instead, so that a committable column still outranks the others
        scaled = (
            (confidence.double() / self.alg_temp).clamp(-_BIG, _BIG).masked_fill(confidence == -torch.inf, -torch.inf)
        )
        exact = torch.log_softmax(scaled, dim=-1)
        usable = (weights > 0) & ~weights.isnan().any(-1, keepdim=True)
        return gumbel_top_k(torch.where(usable, weights.log().double(), exact), step.quota, step.uniform(Stream.ORDER))


@dataclasses.dataclass
class _Schedule:
    fraction: torch.Tensor  # float32 [steps_per_block]: the share 1 - s/t of the masks committed at each step
    chosen: torch.Tensor | None = None  # bool [B, L]: the masks "origin" reveals at this step
