"""CCD: coherent decoding over the trajectory (Chen et al., "Beyond Confidence: Adaptive and Coherent Decoding for
Diffusion Language Models", arXiv 2512.02044), as its released code."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.params import hp
from dllm.kernels.reference import ranks_per_row
from dllm.samplers.base import Sampler
from dllm.samplers.dream import Dream

ALGORITHMS = ("maskgit_plus", "topk_margin", "entropy")
WARM_UP_STEPS = 5  # the official warm_up_steps: plain steps, the buffer prepared at the last two
LATE_STAGE_DENOMINATOR = 10  # the buffer shrinks back once at most a tenth of the generation is masked


@dataclasses.dataclass(frozen=True)
class CCD(Sampler):
    """CCD (arXiv 2512.02044) as its released code: commit the most confident masks, unless the step's most
    confident ones were also in the verification buffer and enough of them kept their argmax since the last step;
    then commit those coherent ones (CCD-DS, ``seek_mode``) or the first ``k`` of them.

    Each step, k = a block's length // ``steps_per_block`` (the official ``int(gen_len / steps)``: one block), the
    steps counted over the whole generation as the official counts them:

    - the buffer size grows by one a step from the fifth (1 before), up to ``k + int(k * expand_ratio)``; once at most
      10 % of the generation is masked it restarts from 1 (and the same step's growth makes it 2);
    - steps 0-4 and the last scheduled one: the k most confident masks of the block (by ``alg``'s confidence,
      Dream's); steps 3 and 4 fill the buffer with the masks ranked k .. k + size - 1;
    - later steps: if one of the k most confident masks is in the buffer, the coherent masks are those among the
      ``size`` most confident that are in the buffer and whose argmax equals the last step's; at least k of them are
      committed (all: ``seek_mode``, the driver's CCD-DS; else the first k), fewer fall back to the k most
      confident. The next buffer is the ``size`` most confident masks left (without those committed).

    Official code reproduced: tonyckc/CCD-DLM-code ``model.py``, ``ExtendedDreamModel._sample_inference_lookahead``
    (``step_alloc_type="uniform"``), its driver's settings (``inference_optimization_release.py``: Dream-v0-Instruct-7B,
    ``alg="entropy"``, temperature 0, ``steps`` = the generation length, ``seek_mode=True``, ``expand_ratio=4.0``).
    The paper describes averaging the predictions of the last d steps over the top-V tokens; the released code
    checks two steps' argmax, which is what runs here.

    Differences: batched and on any masked family (the official is Dream at batch 1, one block; here each row has its
    own buffer, counts and late stage; with blocks the rule runs within the current block, its counters and buffer
    carried over: a new block's first step finds the buffer empty, falls back and fills it);
    a row never commits a slot that is not masked (the official top-k can take decoded slots once fewer than k masks
    are left in seek mode, writing the mask token back into them); k is at least 1, and a block is decoded to its
    end even when ``k * steps`` falls short of it (the official loop stops after ``steps`` forwards, masks left);
    exact confidence ties go to the leftmost slot (``torch.topk`` leaves them unordered).
    """

    name: ClassVar[str] = "ccd"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    reads_steps: ClassVar[bool] = True  # k = a block's length // its steps
    default_block: ClassVar[int | None] = None  # one block, as the official
    alg: str = hp("entropy", choices=ALGORITHMS, note="the confidence: Dream's alg (the driver's: entropy)")
    seek_mode: bool = hp(True, note="True: CCD-DS, every coherent mask; False: k of them (CCD)")
    expand_ratio: float = hp(4.0, ">= 0", note="the buffer's largest size is k + int(k * expand_ratio)")
    top_p: float | None = hp(None, "(0, 1]")
    top_k: int | None = hp(None, ">= 0", note="0 or None: off")

    def init_state(self, run):
        b, length = run.canvas.tokens.shape
        device = run.canvas.tokens.device
        return CoherenceState(
            size=torch.ones(b, dtype=torch.long, device=device),
            buffer=torch.zeros(b, length, dtype=torch.bool, device=device),
            previous=torch.zeros(b, length, dtype=torch.long, device=device),
        )

    def score_spec(self, run):
        spec = Dream.score_spec(self, run)  # (Dream's confidences: the official's sample_tokens)
        return dataclasses.replace(spec, need=spec.need | {"argmax"})

    def select(self, step, state):
        scores, committable = step.scores, step.committable
        confidence = {"maskgit_plus": "prob", "topk_margin": "margin"}.get(self.alg)
        confidence = getattr(scores, confidence) if confidence else -scores.entropy
        confidence = step.among_committable(confidence)
        run = step.run
        commit, state.size, state.buffer = coherent_step(
            confidence,
            committable,
            scores.argmax,
            state,
            step.t,  # (the official's step counter, masks and length are the whole generation's)
            per_step(step),
            step.masked.sum(1),
            run.answer_width,  # max_new_tokens (each row's own where the rows' differ)
            step.canvas.blocks * run.steps_per_block,
            self.expand_ratio,
            self.seek_mode,
        )
        state.previous = scores.argmax
        return commit


def per_step(step) -> torch.Tensor:
    """long [B]: k, the masks a step commits at least (the current block's length // its steps, at least 1)."""
    return ((step.end - step.start) // step.run.steps_per_block).clamp(min=1)


def coherent_step(confidence, committable, argmax, state, i, k, masks, length, steps, expand_ratio, seek_mode):
    """One step of CCD's rule for every row: (the slots to commit, the buffer's size, the next buffer).

    confidence: [B, L], -inf where not ``committable`` (bool [B, L]: the masks the step may commit); argmax: long
    [B, L] this step's; ``state``'s ``buffer`` (bool [B, L]), ``size`` [B] and ``previous`` (the last step's
    argmax); i: [B] the steps taken; k: [B] the masks a step commits at least; masks: [B] the masks left in the
    generation; length: its length (an int, or [B] each row's); steps: [B] the steps scheduled. No host
    synchronisation."""
    rank = ranks_per_row(confidence)
    late = masks * LATE_STAGE_DENOMINATOR <= length  # (masks <= length / 10, in integers)
    largest = k + (k.double() * expand_ratio).long()
    grown = torch.minimum(torch.where(late, 1, state.size) + 1, largest)
    size = torch.where(i < WARM_UP_STEPS - 1, 1, grown)
    top = committable & (rank < k[:, None])
    coherent = committable & state.buffer & (rank < size[:, None]) & (argmax == state.previous)
    passed = coherent.sum(1)
    checking = (i >= WARM_UP_STEPS) & (i < steps - 1)
    use = checking & (top & state.buffer).any(1) & (passed >= k)
    chosen = coherent
    if not seek_mode:  # the first k coherent ones, by confidence
        chosen = coherent & (ranks_per_row(confidence.masked_fill(~coherent, float("-inf"))) < k[:, None])
    commit = torch.where(use[:, None], chosen, top)
    after_top = committable & (rank >= k[:, None]) & (rank < (k + size)[:, None])
    rest = committable & ~chosen
    after_coherent = rest & (ranks_per_row(confidence.masked_fill(~rest, float("-inf"))) < size[:, None])
    refill = checking | (i == WARM_UP_STEPS - 1) | (i == WARM_UP_STEPS - 2)
    buffer = torch.where(refill[:, None], torch.where(use[:, None], after_coherent, after_top), state.buffer)
    return commit, size, buffer


@dataclasses.dataclass
class CoherenceState:
    size: torch.Tensor  # long [B]: the verification buffer's size
    buffer: torch.Tensor  # bool [B, L]: the verification buffer's slots
    previous: torch.Tensor  # long [B, L]: the last step's argmax
