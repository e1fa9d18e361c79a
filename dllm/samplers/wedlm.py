"""WeDLM's streaming parallel decoding (Liu et al. 2025, "WeDLM: Reconciling Diffusion Language Models with
Standard Causal Attention for Fast Inference", arXiv 2512.22737, Alg. 1), as its engine runs it: Tencent/WeDLM
@0216110 ``wedlm/engine/wedlm_decoder.py`` (window refill, reordering, commit) and ``wedlm/engine/sampler.py``
(``process_mask_positions``: entropy, position penalty, selection, sampling). The window's mechanics are the
stream process's (:mod:`dllm.engine.stream`); this module is the policy: which masks to fill, and the proposal.
Research notes: research/samplers_b.md §5.2.

Not the HF path ``generate_wedlm`` (``hf_compat/modeling_wedlm.py``), a simplified block-by-block decoder
with a max-probability rule and no cache (Tencent/WeDLM#21).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec
from dllm.samplers.base import Sampler


@dataclasses.dataclass(frozen=True)
class WeDLM(Sampler):
    """WeDLM's streaming decoder on a causal-attention model (family ``wedlm``): the policy of the stream
    decoding process (:mod:`dllm.engine.stream`), which runs the window.

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
    process: ClassVar[str] = "stream"  # drives causal-attention models through the stream process

    wedlm_window_size: int = hp(16, ">= 1", note="the engine's default is 16")
    wedlm_entropy_threshold: float | None = hp(
        0.4, "[0, inf]", note="in nats; the engine's default is 0.4; None: one token per step"
    )
    wedlm_pos_penalty_factor: float = hp(0.02, ">= 0", note="the engine's default is 0.02")
    top_k: int = hp(0, ">= 0", note="0: off")
    top_p: float = hp(1.0, "(0, 1]", note="1.0: off")
    suppress_mask_token: bool = False

    @property
    def window(self) -> int:
        """The stream process's window (:mod:`dllm.engine.stream`)."""
        return self.wedlm_window_size

    def check_cache(self, model, cache):
        if cache is not None and cache.process != self.process:
            raise ConfigError(
                f"the {self.name!r} sampler keeps its own exact cache of the prompt and the committed prefix; "
                f"cache={cache.name!r} does not apply. Use cache='default' (or 'stream'), or cache=None to recompute "
                "the prefix at every step"
            )

    # -- policy ----------------------------------------------------------------------------------
    def score_spec(self, run) -> ScoreSpec:
        """The proposal: top-k, then top-p, then the temperature (the engine's order), from the unfiltered logits."""
        return ScoreSpec(
            need=frozenset(),
            temperature=run.temperature,
            top_k=self.top_k if run.temperature > 0 else None,
            top_p=self.top_p if run.temperature > 0 else None,
            order=("top_k", "top_p", "temper"),
            suppress=(run.model.mask_id,) if self.suppress_mask_token else (),
        )

    def select(self, step, state) -> torch.Tensor:
        """The engine's ``process_mask_positions``: which of the window's masks to fill (bool [n, K]) from their raw
        logits (:class:`dllm.engine.stream.StreamStep`)."""
        # the entropy of the unfiltered logits, exact as the engine's (the scoring seam's is Dream's
        # -sum p log(p + 1e-10)); no argument check: it reads the logits back to the host at every step
        entropy = torch.distributions.Categorical(logits=step.logits, validate_args=False).entropy()
        distance = (step.slots - step.slots[:, :1]).to(entropy.dtype)
        adjusted = (entropy + distance * self.wedlm_pos_penalty_factor).masked_fill(~step.real, float("inf"))
        best = torch.zeros_like(step.real).scatter_(1, adjusted.argmin(1, keepdim=True), True)
        if self.wedlm_entropy_threshold is None:
            return best
        below = (adjusted < self.wedlm_entropy_threshold) & step.real
        return torch.where(below.any(1, keepdim=True), below, best)
