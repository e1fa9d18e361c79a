"""EoTP: end-of-text prediction (Learn2PD, arXiv 2509.25188), as its released code: an exit rule that cuts a row's
answer after the end of text the model predicts, so the slots after it are never decoded."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.samplers.compose import ExitRule


@dataclasses.dataclass(frozen=True)
class EoTP(ExitRule):
    """EoTP (Learn2PD's end-of-text prediction): cut each row's answer after the end of text the model predicts.

    After each step's commit, a row's answer ends

    - (``committed_first``) just after the first slot the step committed with an EOS, else
    - just after the masked slot (masked when the step began, anywhere in the answer) whose EOS proposal is the most
      confident,

    and the slots after that leave the canvas (they are never decoded, and no forward attends to them). The slot
    itself may still be masked: it is decoded as any other, and the text ends with it (its finish reason is "stop"
    when that slot is an EOS, "length" otherwise).

    Official code reproduced: ims-kdks/Learning-to-Parallel-Decoding ``llada/generate.py``: over ``learn2pd``,
    ``generate_l2p_eot`` (its ``L2P+EoT`` method: ``committed_first=True``, the default); over ``llada``,
    ``generate_predict_eot`` (its ``EoT`` method: ``committed_first=False``). Its scripts run 256 tokens in blocks of
    32 at one step per token.

    Differences: any base sampler and masked family; batched (the official is batch 1); the EOS tokens are the model's
    (the official's is LLaDA's 126081); ``committed_first`` reads the slots the step committed, which over
    ``learn2pd`` are the filter's and the schedule's (the official reads the filter's only: a step whose schedule
    alone commits an EOS takes the second rule there); after a cut inside the current block, ``learn2pd``'s filter
    still reads the block's slots, the cut ones as they are (the official filter then gets fewer inputs than its size
    and fails); exact confidence ties go to the leftmost slot, as ``torch.argmax``'s. With a cache, every masked slot
    of the answer is computed at each forward (the rule reads their proposals), as for every exit rule.
    """

    name: ClassVar[str] = "eotp"
    needs: ClassVar[frozenset] = frozenset({"prob"})
    default_base: ClassVar[str] = "learn2pd"
    committed_first: bool = hp(True, note="the step's first committed EOS ends the answer first (False: EoT alone)")

    def check_run(self, run) -> None:
        super().check_run(run)
        if not run.model.eos_ids:
            raise ConfigError("eotp cuts the answer at a predicted EOS, and this model declares no EOS token")

    def observe(self, step, state):
        """Every column of the answer (the EOS proposals of its masked slots)."""
        canvas = step.canvas
        columns = torch.arange(canvas.prompt_width, canvas.length, device=canvas.tokens.device)
        return columns.expand(canvas.batch, -1)

    def check(self, step, state, decision):
        return torch.zeros_like(step.done)  # it never finishes a row: it cuts it (cut)

    def cut(self, step, state, committed):
        canvas, columns = step.canvas, step.columns
        span = (columns >= canvas.prompt_width) & (columns < canvas.span_end[:, None]) & step.scored
        eos = torch.isin(step.scores.token, step.run.eos) & span
        ended = committed & torch.isin(step.tokens, step.run.eos) & span  # (as written: a sampler may override)
        first = ended.long().argmax(1)
        confidence = step.scores.prob.masked_fill(~(eos & (step.masked | committed)), float("-inf"))
        best = confidence.argmax(1)
        predicted = torch.isfinite(confidence.amax(1))
        end = torch.where(predicted, best + 1, canvas.span_end)
        if self.committed_first:
            end = torch.where(ended.any(1), first + 1, end)
        return end
