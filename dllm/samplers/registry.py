"""Samplers by name: ``get("threshold", threshold=0.8)``, ``names()``, ``defaults(name)``."""

from __future__ import annotations

import dataclasses

from dllm.core.errors import ConfigError
from dllm.samplers.base import Sampler
from dllm.samplers.confidence import Factor, LLaDA, Threshold
from dllm.samplers.dream import Dream
from dllm.samplers.sdar import SDAR

SAMPLERS: dict[str, type[Sampler]] = {cls.name: cls for cls in (LLaDA, Dream, SDAR, Threshold, Factor)}


# Each family's own sampler at one token per step: the baseline speedups are measured against.
# (SDAR's default dynamic strategy may commit several tokens per step; static commits exactly one.)
REFERENCE = {
    "llada": ("llada", {}),
    "dream": ("dream", {}),
    "sdar": ("sdar", {"remasking_strategy": "low_confidence_static"}),
}


def reference(family: str, **hyper_parameters) -> Sampler:
    """The reference sampler of a model family (used at one token per step as the speed baseline), with
    ``hyper_parameters`` overriding its settings."""
    if family not in REFERENCE:
        raise ConfigError(f"no reference sampler for {family!r} models; known families: {', '.join(REFERENCE)}")
    name, hp = REFERENCE[family]
    return get(name, **{**hp, **hyper_parameters})


def names() -> list[str]:
    return list(SAMPLERS)


def defaults(name: str) -> dict:
    cls = _cls(name)
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _cls(name: str) -> type[Sampler]:
    if name not in SAMPLERS:
        raise ConfigError(f"unknown sampler {name!r}; available: {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def get(name: str, **hyper_parameters) -> Sampler:
    cls = _cls(name)
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(hyper_parameters) - valid)
    if unknown:
        raise ConfigError(
            f"sampler {name!r} has no hyper-parameter {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(sorted(valid)) or '(none)'}. Generation settings (steps, max_new_tokens, block_size, "
            "temperature, seed) go to generate()"
        )
    return cls(**hyper_parameters)
