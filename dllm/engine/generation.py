"""The result of a generation, and the one function that counts generated tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def count_generated(
    sequences: torch.Tensor,
    prompt_width: int,
    eos_ids,
    mask_id: int | None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Generated tokens per row [B]: the span after the prompt up to (excluding) the first EOS, never
    counting pads or masks. Every figure of dllm (tokens/forward, tokens/s, benchmarks, lm-eval) uses it."""
    gen = sequences[:, prompt_width:]
    real = torch.ones_like(gen, dtype=torch.bool) if valid is None else valid[:, prompt_width:].clone()
    is_eos = torch.isin(gen, torch.tensor(list(eos_ids), device=gen.device, dtype=gen.dtype))
    before_eos = is_eos.long().cumsum(1) == 0
    counted = real & before_eos
    if mask_id is not None:
        counted &= gen != mask_id
    return counted.sum(1)


def decode_span(model, tokens: torch.Tensor, start: int = 0, mask: str = "_") -> str:
    """One canvas row (``tokens`` [L], a step of ``Generation.history`` or a callback's ``StepInfo.tokens``) from
    column ``start`` on as text: each slot still masked shows as ``mask``, special tokens (EOS and its fill,
    padding) are left out, so the steps of a generation read as the answer appearing."""
    from dllm.core.errors import ConfigError

    if model.tokenizer is None:
        raise ConfigError("this model has no tokenizer to decode with: read the token ids of the canvas instead")
    pieces, words = [], []
    for token in [*tokens[start:].tolist(), None]:
        if token is not None and token != model.mask_id:
            words.append(token)
            continue
        if words:
            pieces.append(model.tokenizer.decode(words, skip_special_tokens=True))
            words = []
        if token is not None:
            pieces.append(mask)
    return "".join(pieces)


@dataclass
class Generation:
    """What ``sampler.generate`` returns.

    sequences: ``[B, P+G]`` prompt (left-padded) followed by the generated span, as the official samplers
        return it (for SDAR the span runs to the end of the last block, as in the official sampler).
    texts: the generated part of each row decoded and cut at the first EOS (None without a tokenizer).
    nfe: model forward evaluations (every forward, including cache refreshes and CFG's unconditional pass);
        a batched forward counts once, whatever the number of rows in it.
    tokens: generated tokens per row, counted by :func:`count_generated`.
    tokens_per_forward: tokens of one sequence per forward, ``mean(tokens) / nfe`` (at batch 1 simply
        ``tokens / nfe``), the figure the papers report and the one ``dllm bench`` reports, so it does not
        grow with the batch size. ``total_tokens / nfe`` is the batch's.
    tokens_per_second: all rows' tokens per wall second, ``total_tokens / seconds`` (throughput).
    seconds: wall time of the generation (tokenisation, loop, decoding; not model loading).
    history: with ``history=True``, the canvas ``[B, P+G]`` after every step (one tensor per step, laid out as
        ``sequences``, masks where nothing is decoded yet); the last one is ``sequences`` (with the EOS fill of
        rows that stopped early). :meth:`decode_history` reads a row's steps as text (``docs/steps.md``).
    kernel: the scoring backend of the run (``generate(kernel=...)`` resolved: "torch" or "triton");
        kernel_calls: the scorings each backend ran (a kernel hands the specs it does not fuse to "torch");
        select_calls: the steps each backend committed through kernel B (samplers whose rule it fuses; empty
        for the others, which commit through their own ``select``).
    geometry: the generation's :class:`~dllm.core.geometry.Geometry` (its length, block grid and steps), as
        resolved from the arguments (``geometry.describe()`` is the figures line's account of it).
    finish_reasons: per row, ``"stop"`` when its answer holds an EOS (its text ended; a template's always),
        ``"length"`` when it ran to ``max_new_tokens`` without one (under a ``Grammar``: its text may be an
        unfinished prefix of a word of the grammar).
    fills: with ``template=``, each row's holes' texts (the model's tokens of each hole, without the EOS filler);
        ``texts`` then holds the filled template and ``tokens`` the tokens the model wrote in the holes.
    arness: per row, the share of its masks filled left to right (at its leftmost mask, or running on from it in
        the same step: :mod:`dllm.engine.order`); 1 for a left-to-right order; None for a row that filled none, and
        for every row of a process without masks (DiffusionGemma's renoise).
    step_on_device: with ``static_shapes=True``, whether each step ran on the device with one status read
        (:mod:`dllm.engine.device`; under ``compile="reduce-overhead"``, as one CUDA graph); why_not_on_device:
        otherwise, why not (the part that decides or plans on the host); None without static shapes.
    """

    sequences: torch.Tensor
    texts: list[str] | None
    nfe: int
    tokens: list[int]
    seconds: float
    prompt_width: int
    history: list[torch.Tensor] | None = field(default=None, repr=False)
    kernel: str = "torch"
    kernel_calls: dict[str, int] = field(default_factory=dict)
    select_calls: dict[str, int] = field(default_factory=dict)
    geometry: object = field(default=None, repr=False)
    step_on_device: bool = False
    why_not_on_device: str | None = None
    fills: list[list[str]] | None = None
    finish_reasons: list[str] | None = None
    arness: list[float | None] | None = None

    def decode_history(self, model, row: int = 0, mask: str = "_") -> list[str]:
        """Row ``row``'s generated span after every step, as text (:func:`decode_span`: masks as ``mask``)."""
        if self.history is None:
            from dllm.core.errors import ConfigError

            raise ConfigError("this generation kept no history: pass history=True to generate()")
        return [decode_span(model, canvas[row], self.prompt_width, mask) for canvas in self.history]

    @property
    def total_tokens(self) -> int:
        return int(sum(self.tokens))

    @property
    def tokens_per_forward(self) -> float:
        return self.total_tokens / (len(self.tokens) * self.nfe) if self.nfe and self.tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def scorer(self) -> str:
        """Which scorer ran, in words: the backend, and how many scorings fell back to another."""
        other = {k: n for k, n in self.kernel_calls.items() if k != self.kernel}
        if not other:
            return self.kernel
        total = sum(self.kernel_calls.values())
        fallback = ", ".join(f"{k} for {n} of {total} scorings" for k, n in other.items())
        return f"{self.kernel} ({fallback}: specs it does not fuse)"

    def summary(self) -> str:
        return (
            f"NFE {self.nfe} | tokens {self.total_tokens} | tokens/forward {self.tokens_per_forward:.2f} | "
            f"tokens/s {self.tokens_per_second:.1f} | {self.seconds:.2f} s | kernel {self.scorer}"
        )
