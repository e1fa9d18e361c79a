"""transformers-style ``generate()`` arguments, for code ported from ``model.generate(...)``.

The ones with a meaning here are translated; the others are refused with the dllm equivalent:

- ``do_sample=False``: greedy, i.e. ``temperature=0`` (the default); with a ``temperature > 0`` it is a
  contradiction and refused (transformers would ignore the temperature with a warning).
- ``do_sample=True``: sampling; with the default ``temperature=0`` it samples at transformers' default
  temperature 1.0, otherwise at the given one.
- ``max_length``: prompt plus generation, as in transformers: ``max_new_tokens = max_length - P`` with
  ``P`` the (left-padded) prompt width. Giving both is refused.
- ``num_beams=1`` is accepted (no beams); more beams are refused: diffusion sampling fills every position
  in parallel and keeps no beam of alternatives.
- Sampler hyper-parameters (``top_k``, ``top_p``, ...) belong to the sampler: ``dllm.samplers.get("dream",
  top_k=50)``. Anything else is refused with the list of accepted arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from dllm.core.errors import ConfigError

# What to do instead, for transformers arguments that have no direct translation.
HINTS = {
    "num_return_sequences": "pass the prompt several times in a list, with temperature > 0 and a seed (each row "
    "draws its own random numbers)",
    "use_cache": "choose a cache with cache= ('default', None or a cache object from dllm.caches)",
    "pad_token_id": "set model.pad_id",
    "eos_token_id": "set model.eos_ids",
    "generation_config": "pass its values as generate() arguments and sampler hyper-parameters",
    "input_ids": "pass the ids as the prompt (a [B, P] tensor, with attention_mask for left padding)",
    "min_new_tokens": "a diffusion sampler fills all max_new_tokens positions; EOS ends the text",
    "min_length": "a diffusion sampler fills all max_new_tokens positions; EOS ends the text",
}


def translate(extra: dict, temperature, max_new_tokens) -> tuple[float, int | None]:
    """``(temperature, max_length)`` after applying ``extra`` (transformers-style keyword arguments that
    ``generate`` does not take by name); raises :class:`ConfigError` for the ones without a meaning here."""
    extra = dict(extra)
    max_length = extra.pop("max_length", None)
    if "do_sample" in extra:
        do_sample = extra.pop("do_sample")
        if not isinstance(do_sample, bool):
            raise ConfigError(f"do_sample must be True or False, got {do_sample!r}")
        if do_sample and temperature == 0:
            temperature = 1.0  # transformers' default sampling temperature
        elif not do_sample and temperature != 0:
            raise ConfigError(
                f"do_sample=False (greedy) contradicts temperature={temperature}: dllm is greedy at temperature=0 "
                "and samples at temperature > 0; pass only temperature"
            )
    if "num_beams" in extra:
        beams = extra.pop("num_beams")
        if beams != 1:
            raise ConfigError(
                f"num_beams={beams!r}: beam search has no meaning for diffusion sampling (every position is decoded "
                "in parallel, no beam of alternatives is kept); leave num_beams out"
            )
    if max_length is not None:
        if max_new_tokens is not None:
            raise ConfigError("give max_new_tokens or max_length (prompt + generation), not both")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ConfigError(f"max_length must be a positive integer, got {max_length!r}")
    if extra:
        raise ConfigError(_unknown(sorted(extra)))
    return temperature, max_length


def _unknown(keys: list[str]) -> str:
    notes = []
    for key in keys:
        owners = _samplers.owners(key)
        if owners:
            notes.append(
                f"{key!r} is a hyper-parameter of sampler {', '.join(owners)}: "
                f"dllm.samplers.get({owners[0]!r}, {key}=...)"
            )
        elif key in HINTS:
            notes.append(f"{key!r}: {HINTS[key]}")
        else:
            notes.append(f"{key!r} is not an argument of generate()")
    return "; ".join(notes) + f". generate() takes: {accepted()}"


def accepted() -> str:
    """The keyword arguments of ``Sampler.generate`` (read from its signature, so the list cannot fall behind)."""
    parameters = inspect.signature(_samplers.generate).parameters.values() if _samplers.generate else ()
    keywords = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
    return f"{', '.join(keywords)} (and transformers' do_sample, max_length, num_beams=1)"


@dataclasses.dataclass
class _Samplers:
    """What the advice names, given by :mod:`dllm.samplers` when it loads (it sits above this module):
    ``generate``, the ``Sampler.generate`` whose keyword arguments are listed; ``owners(key)``, the samplers
    having a hyper-parameter ``key``."""

    generate: Callable | None = None
    owners: Callable[[str], list[str]] = lambda key: []


_samplers = _Samplers()


def advise(generate: Callable, owners: Callable[[str], list[str]]) -> None:
    """Name ``generate``'s keyword arguments and the samplers ``owners(key)`` in the advice on refused arguments."""
    _samplers.generate, _samplers.owners = generate, owners
