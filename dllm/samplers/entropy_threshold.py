"""dParallel's entropy-threshold decoding (Chen, Fang, Ma, Wang; "dParallel: Learnable Parallel Decoding for dLLMs",
arXiv 2509.26488, ICLR 2026)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler

THRESHOLDS = {"dream": 0.45}  # the family's evaluation script's threshold; the others take LLaDA's
LLADA_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class EntropyThreshold(Sampler):
    """dParallel's entropy threshold (arXiv 2509.26488): each step commits the block's lowest-entropy mask and
    every other mask whose entropy is under ``threshold``.

    The rule the dParallel checkpoints (``Zigeng/dParallel-LLaDA-8B-instruct``, ``Zigeng/dParallel_Dream_7B_Instruct``:
    the LLaDA and Dream families load them) are evaluated with, in semi-autoregressive blocks, each decoded until
    full; it runs as well on the base models and on every masked family.

    Official code reproduced (czg1225/dParallel): LLaDA ``LLaDA/generate.py``, ``generate`` with ``threshold`` set
    (``get_transfer_index_entropy``: the entropy ``-sum p log(p + 1e-12)`` of the float64 softmax of the logits,
    a slot past the lowest committed unless its entropy is above the threshold: ``<=``); Dream
    ``Dream/eval_instruct/model/generation_utils_semiar.py``, ``_sample`` with ``alg="entropy_threshold"`` (the
    entropy in the logits' dtype, a slot committed when its entropy is below the threshold: ``<``). ``threshold``
    None takes the family's script's: Dream 0.45 (``Dream/eval_instruct/eval.sh``), LLaDA 0.5 (``LLaDA/eval.sh``,
    and the other families). Their defaults: block 32 (the loop's), generation 256; temperature 0. At a temperature
    the proposal is sampled from ``softmax(logits / T)`` (LLaDA: its Gumbel-max; Dream: ``multinomial``, the same
    distribution) and the entropy stays that of the untempered logits, as in both. The number of steps depends on
    the data: ``steps`` / ``steps_per_block`` are not used (the official code asserts they divide into blocks).

    Differences: batched and without a host read-back (the official loops are batch 1: Dream's counts the whole
    batch's masks); the entropy is the scoring seam's ``-sum p log(p + 1e-10)`` (the official 1e-12 and 1e-8 move it
    by under ``V * 1e-8`` nats); exact entropy ties go to the leftmost slot (``torch.topk`` leaves them unordered);
    the mask token is never proposed (the official argmax may propose it); ``generate``'s ``eos_early_stop`` stops a
    row after the block holding its EOS, at no change to its text (the official loops decode every block).
    """

    name: ClassVar[str] = "entropy_threshold"
    on_device: ClassVar[bool] = True
    fixed_steps: ClassVar[bool] = False
    threshold: float | None = hp(
        None, ">= 0", note="nats; None: the family's (Dream 0.45, others 0.5); 0: one token per step"
    )

    def resolved(self, family: str) -> tuple[float, bool]:
        """(the threshold, whether a slot must be strictly under it) for a model of ``family``."""
        threshold = THRESHOLDS.get(family, LLADA_THRESHOLD) if self.threshold is None else self.threshold
        return threshold, family == "dream"

    def score_spec(self, run):
        dtype = None if run.model.family == "dream" else torch.float64  # (as each official loop computes it)
        return ScoreSpec(need=frozenset({"entropy"}), temperature=run.temperature, dtype=dtype)

    def select(self, step, state):
        threshold, strict = self.resolved(step.run.model.family)
        return entropy_threshold(step.scores.entropy, step.committable, threshold, strict)


def entropy_threshold(entropy: torch.Tensor, committable: torch.Tensor, threshold: float, strict: bool = False):
    """bool [B, L]: the candidates (``committable`` [B, L]) of lowest ``entropy`` [B, L] (the leftmost of ties) and
    every candidate at most ``threshold`` (``strict``: under it). No host synchronisation."""
    lowest = entropy.masked_fill(~committable, float("inf")).argmin(1)
    first = torch.arange(entropy.shape[1], device=entropy.device) == lowest[:, None]
    under = entropy < threshold if strict else entropy <= threshold
    return committable & (under | first)
