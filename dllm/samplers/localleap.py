"""LocalLeap: anchor-centred local relaxed parallel decoding (arXiv 2510.07081).

"Accelerating Diffusion LLM Inference via Local Determinism Propagation": a slot the model is very sure
of (an *anchor*) makes its neighbours reliable at a lower confidence, so they may commit in the same step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.kernels.selection import Rule
from dllm.samplers.confidence import Threshold


@dataclasses.dataclass(frozen=True)
class LocalLeap(Threshold):
    """LocalLeap (arXiv 2510.07081; Klear team, Kuaishou) on fixed semi-autoregressive blocks.

    At each step, among the masked slots of the current block (confidence: float64 softmax probability of
    the proposal, as Fast-dLLM's threshold rule):
    - *anchors* are the slots with confidence >= ``threshold`` (κ); they commit;
    - every masked slot within ``radius`` (W) columns of an anchor (inclusive: ``|i - a| <= W``) commits
      when its confidence is >= ``relaxed_threshold`` (τ); other slots need κ;
    - the most confident slot always commits, so every step makes progress.
    Only this step's masked slots are anchors (never earlier commits or prompt tokens), and a slot admitted
    at τ is not an anchor itself (no chaining). ``relaxed_threshold=None`` is Fast-dLLM's threshold rule at
    κ (``threshold``), as is ``radius=0``. ``steps`` / ``steps_per_block`` are not used, as in the official
    code (its ``main()`` passes ``steps = gen_length // block_length``, which the threshold branch ignores): the
    number of steps depends on the data.

    Defaults are the paper's LLaDA setting, κ 0.9, τ 0.75, W 4, block 32 (the official scripts; the official
    ``generate()``'s own defaults, threshold=None / relaxed_threshold=None, are LLaDA's fixed schedule).
    Official code: the authors' repository is not public; this follows the copy of their ``generate.py`` in
    ZitongWang018/dlm-seq (commit 1e1b143, ``experiments/localleap/generate.py``: ``generate`` with
    ``threshold``, ``relaxed_threshold``, ``radius``, and ``early_stop=False`` as the paper's scripts run it).

    Deliberate differences from the official code: batched with per-row state (the official allocates one
    row); ties in confidence go to the leftmost slot (``torch.topk`` leaves them unspecified); Dream is
    supported through the adapter's aligned logits; ``eos_early_stop`` (on by default) stops a row after a
    block holding EOS, as the official ``early_stop=True`` does; pass ``eos_early_stop=False`` for the
    scripts' behaviour (the text up to the first EOS is the same either way).
    """

    name: ClassVar[str] = "localleap"
    on_device: ClassVar[bool] = True
    threshold: float = hp(
        0.9,
        "[0, 1]",
        note="κ; the official threshold=None is LLaDA's fixed schedule: use the 'llada' sampler for it",
    )
    relaxed_threshold: float | None = hp(0.75, "[0, 1]", note="τ <= threshold; None: the plain threshold rule")
    radius: int = hp(4, ">= 0", note="columns either side of an anchor")

    def check_hyper_parameters(self):
        if self.relaxed_threshold is not None and self.relaxed_threshold > self.threshold:
            raise ConfigError(
                f"relaxed_threshold must lie in [0, threshold={self.threshold}] (relaxed_threshold must be <= "
                "threshold and threshold must be >= relaxed_threshold: it relaxes the threshold near anchors), got "
                f"{self.relaxed_threshold!r}; use relaxed_threshold=None for the plain threshold rule"
            )

    def selection(self, step, state):
        if self.relaxed_threshold is None:
            return Rule("threshold", threshold=self.threshold)
        return Rule("anchored_threshold", threshold=self.threshold, relaxed=self.relaxed_threshold, radius=self.radius)
