"""FreeDave: free draft-and-verification (Wu et al., "Free Draft-and-Verification: Toward Lossless Parallel Decoding for
Diffusion Large Language Models", arXiv 2510.00294)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler


@dataclasses.dataclass(frozen=True)
class FreeDave(Sampler):
    """FreeDave's lossless static mode (arXiv 2510.00294; cychomatica/FreeDave at 8b48121, ``generation/core.py``:
    ``block_decode_with_full_attention_FreeDave`` and its block-attention twin, ``draft_mode="batch_expanding"``,
    ``confidence_threshold=None``, one token per step).

    Static decoding commits, in each semi-autoregressive block, the single most confident mask per forward. FreeDave
    gets the same tokens with fewer forwards: from the canvas and its predictions it drafts the next ``draft_steps``
    static steps at once (draft ``k``: the ``k + 1`` most confident masks filled), runs one forward over all of them,
    and keeps the longest chain of drafts that the static rule, applied to each draft's own predictions, confirms
    (the official ``draft_verification`` with ``match_rule="subset"``); the last kept draft's predictions serve the
    next step (:mod:`dllm.engine.draft`). Each block starts with one forward over the canvas (the official cache-update
    forward, whose "stale" logits give the first drafts), and a block's last mask is committed from the predictions
    at hand, without a forward. Greedy text equals ``dllm.samplers.get("llada")``'s with one step per token on the
    same blocks (``steps = max_new_tokens``; block-causal models: ``steps_per_block = block_size``; on Dream with
    ``ar_first_token=False``), token for token; each forward commits 1 to ``draft_steps`` tokens. Tokens and forwards
    equal the official loops' on recorded runs (``tests/fixtures/freedave_parity.json``: LLaDA, Dream, SDAR and LLaDA2
    checkpoints, ``early_exit`` on and off).

    draft_steps: drafts per forward (the official scripts: 4 for LLaDA and Dream, 8 for TraDo). ar_first_token: each
    block's first slot is committed from the block's first forward whatever its confidence, and that step's drafts
    add 0 ... ``draft_steps - 1`` slots to it, as the official does on AR-adapted (logit-shift) models; None: on for
    those (Dream), off elsewhere; False on Dream gives plain static decoding. Confidence: the softmax probability of
    the proposal in the logits' dtype (the official ``sample_tokens``). eos_stop: ``generate``'s ``eos_early_stop``
    stops a row once a block it completed is all EOS (the model's first EOS id), the rest of its span filled with
    EOS: the official ``early_exit`` (``"block_of_eos"``); ``"block_with_eos"``: once a completed block holds an EOS,
    as dllm's other samplers (the same text, the next block's forwards saved). Defaults as the scripts: block 32 (the
    loop's), temperature 0. Every masked family (full or block attention). At a temperature the proposals are
    sampled (the official ``multinomial``; here the step's counter-based draws, every draft's from the same step's
    counters) and the output is no longer static decoding's, as in the official code.

    Differences from the official code: batched (the official is batch 1: here each row drafts and verifies on its
    own, the batch expanded by the drafts in one forward; a row starting a block while others draft is refreshed in
    their drafts forward and drafts at the next step); without a K/V cache (the official keeps a prefix or
    dual cache, approximate on full attention, and repeats it per draft; the recorded runs serve its forwards
    exactly); the mask token is never proposed, and exact confidence ties go to the leftmost slot (the official
    ``torch.topk`` leaves them unordered); on Dream, a block whose forced first slot leaves one mask commits it
    (the official leaves that mask in its output); the official's extra ``early_exit`` on a block of pad ids is not
    kept (a pad id that is not an EOS id). Not built (refused by name): the tree-attention draft mode, the threshold
    variant (FreeDave++, not lossless), ``eager_acceptance_mode``.
    """

    name: ClassVar[str] = "freedave"
    process: ClassVar[str] = "draft"
    fixed_steps: ClassVar[bool] = False
    draft_steps: int = hp(4, ">= 1", note="drafts verified per forward")
    ar_first_token: bool | None = hp(
        None, note="a block's first slot from its first forward (None: on AR-adapted families, Dream, as the official)"
    )
    eos_stop: str = hp(
        "block_of_eos",
        choices=("block_of_eos", "block_with_eos"),
        note="eos_early_stop's rule: the official early_exit, or dllm's (the same text, fewer forwards)",
    )
    draft_mode: str = hp("batch_expanding", choices=("batch_expanding", "tree_attention"))
    confidence_threshold: float | None = hp(None, note="None: the lossless static mode (the only one built)")
    eager_acceptance_mode: bool = False

    def check_hyper_parameters(self) -> None:
        if self.draft_mode != "batch_expanding":
            raise ConfigError(
                "freedave: draft_mode must be 'batch_expanding' here: 'tree_attention' (drafts concatenated under a "
                "tree attention mask, the same tokens) is not built"
            )
        if self.confidence_threshold is not None:
            raise ConfigError(
                "freedave: confidence_threshold must be None (the lossless static mode): FreeDave++ over threshold "
                "decoding, not lossless, is not built"
            )
        if self.eager_acceptance_mode:
            raise ConfigError("freedave: eager_acceptance_mode must be False: drafting into later blocks is not built")

    @property
    def stops_at_a_block_of_eos(self) -> bool:
        return self.eos_stop == "block_of_eos"

    def forces_first_token(self, model) -> bool:
        """Whether each block's first slot is committed from the block's first forward (:attr:`ar_first_token`)."""
        return bool(model.shift) if self.ar_first_token is None else self.ar_first_token

    def default_cache(self, model):
        return None  # (block-causal models' exact block cache included: the drafts are whole canvases)

    def check_cache(self, model, cache) -> None:
        if cache is not None:
            raise ConfigError(
                "the 'freedave' sampler drafts whole canvases, without a K/V cache here (its batch_expanding mode "
                "would copy the cache per draft): pass cache=None"
            )

    def check_run(self, run) -> None:
        super().check_run(run)
        if run.guard is not None:
            raise ConfigError(
                "the 'freedave' sampler does not take a constraint or a template yet (the guard may refuse a "
                "verified draft's commits)"
            )

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature)

    def select(self, step, state):
        return step.drafted  # the process's verified drafts (dllm.engine.draft)
