"""DiffusionGemma's sampler: entropy-bounded acceptance with renoising (transformers' ``EntropyBoundSampler`` in
``DiffusionGemmaGenerationMixin.generate``; the rule is EB-Sampler's, Ben-Hamu et al., arXiv 2505.24857)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dllm.core.errors import ConfigError
from dllm.core.params import hp
from dllm.samplers.base import Sampler


@dataclasses.dataclass(frozen=True)
class EntropyBound(Sampler):
    """DiffusionGemma's reference sampler: entropy-bounded acceptance with renoising (transformers' ``generate``).

    On the ``renoise`` process (:mod:`dllm.engine.renoise`), each canvas of ``block_size`` (the model's
    ``canvas_length``, 256) starts as uniform random ids; at each of at most ``max_denoising_steps`` decoder
    forwards the logits are divided by a temperature falling linearly from ``t_max`` (first step) towards ``t_min``
    (T = t_min + (t_max - t_min) · remaining / N, never t_min itself), a denoiser canvas is sampled from them, the
    slots of lowest entropy whose entropy sum less the largest stays within ``entropy_bound`` take its tokens and
    every other slot is renoised with fresh uniform ids; the previous step's tempered logits condition the next
    forward (self-conditioning). A row stops denoising once its argmax canvas equals its last
    ``stability_threshold`` ones (0: always stable) and the mean entropy is below ``confidence_threshold``; the
    canvas's tokens are its last argmax canvas. Canvases follow one another until ``max_new_tokens`` (rounded up to
    whole canvases; the answer is the first ``max_new_tokens``) or an EOS.

    Names and defaults: transformers' ``DiffusionGemmaGenerationConfig`` (and the published
    ``generation_config.json``): ``entropy_bound`` 0.1, ``max_denoising_steps`` 48, ``t_min`` 0.4, ``t_max`` 0.8,
    ``stability_threshold`` 1, ``confidence_threshold`` 0.005. The temperatures are the schedule's: ``generate``'s
    ``temperature`` must stay 0 (``takes_temperature`` False), and ``steps`` / ``steps_per_block`` are not used
    (``max_denoising_steps`` bounds a canvas). Random numbers: ``seed`` (dllm's counter-based streams, batch
    invariant), or ``draws=`` to replay another implementation's (:class:`dllm.engine.renoise.Draws`; the tests
    replay transformers' ``generate``).

    Differences from transformers' ``generate`` (token for token equal otherwise, on the same draws): ``nfe`` counts
    batched decoder forwards (transformers counts each row's, in ``tokens_per_forward``); rows that stopped
    denoising or ended are not computed (transformers computes them and keeps their state); the denoiser sample is a
    Gumbel-max draw from dllm's streams (the same law as ``torch.multinomial``, other numbers); entropy ties in the
    acceptance order go to the leftmost slot (a stable sort); ``Generation.texts`` / ``tokens`` stop at
    ``max_new_tokens`` (``sequences`` keeps whole canvases, as transformers returns them);
    ``eos_early_stop=False`` decodes every canvas (transformers always stops a row at a canvas holding EOS); a
    left-padded row's RoPE positions count its real tokens from 0 (transformers counts its pads too, so its padded
    rows differ from their batch-1 runs by rounding; RoPE is relative and the sliding window sees the same real
    tokens, so dllm's rows equal theirs up to rounding and stay batch invariant).
    """

    name: ClassVar[str] = "entropy_bound"
    process: ClassVar[str] = "renoise"
    fixed_steps: ClassVar[bool] = False
    default_block: ClassVar[int | None] = None
    takes_temperature: ClassVar[bool] = False  # t_max -> t_min
    entropy_bound: float = hp(0.1, "(0, inf]", note="nats: the larger, the more slots accepted per forward")
    max_denoising_steps: int = hp(48, ">= 1", note="forwards a canvas takes at most")
    t_min: float = hp(0.4, ">= 0", note="the schedule's last temperature (approached, not reached)")
    t_max: float = hp(0.8, "> 0", note="the first step's temperature")
    stability_threshold: int = hp(1, ">= 0", note="previous argmax canvases that must equal this one (0: off)")
    confidence_threshold: float = hp(0.005, "> 0", note="nats: the mean entropy below which a canvas is confident")

    def check_hyper_parameters(self) -> None:
        if not self.t_max > self.t_min:
            raise ConfigError(
                f"sampler 'entropy_bound': t_max must be greater than t_min and t_min must be less than t_max (the "
                f"temperature falls from t_max towards t_min); got t_max={self.t_max}, t_min={self.t_min}"
            )

    def check_run(self, run) -> None:
        if run.cache is not None:
            raise ConfigError(
                f"the 'entropy_bound' sampler keeps its encoder's K/V itself; a K/V cache of the masked process "
                f"({type(run.cache).__name__}) does not apply: use cache=None (or 'default')"
            )
