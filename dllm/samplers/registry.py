"""Samplers by name: ``get("threshold", threshold=0.8)``, ``names()``, ``defaults(name)``.

An entry is a sampler, or a part that composes with a base sampler (an exit rule, a logit transform,
anything with ``compose(base)`` and a ``default_base``): ``get("prophet", base="threshold",
threshold=0.9, ...)`` builds the base from the keys that are its hyper-parameters and attaches the part
built from the others. ``register(cls)`` adds an entry to this process; other packages' samplers declared
as ``dllm.samplers`` entry points (:mod:`dllm.core.plugins`) join when the registry is first asked for a name.
"""

from __future__ import annotations

import dataclasses
import difflib

from dllm.core import params, plugins
from dllm.core.errors import ConfigError
from dllm.core.registry import Registry
from dllm.models import registry as families
from dllm.samplers.adablock import AdaBlock
from dllm.samplers.bacd import BACD
from dllm.samplers.base import Sampler
from dllm.samplers.cad import CAD
from dllm.samplers.ccd import CCD
from dllm.samplers.confidence import Factor, LLaDA, Threshold
from dllm.samplers.credit import Credit, CreditFusion
from dllm.samplers.dcd import DCD
from dllm.samplers.diffusion_gemma import EntropyBound
from dllm.samplers.dream import Dream
from dllm.samplers.eb import EB
from dllm.samplers.entropy_threshold import EntropyThreshold
from dllm.samplers.eotp import EoTP
from dllm.samplers.ete import ETE
from dllm.samplers.fast_dllm_v2 import FastDLLMv2
from dllm.samplers.freedave import FreeDave
from dllm.samplers.learn2pd import Learn2PD
from dllm.samplers.llada2 import LLaDA2, LLaDA21
from dllm.samplers.localleap import LocalLeap
from dllm.samplers.prophet import Prophet
from dllm.samplers.s2d2 import S2D2
from dllm.samplers.sched import SchED
from dllm.samplers.sdar import SDAR
from dllm.samplers.wedlm import WeDLM


def _check(cls) -> None:
    """A sampler class, or a part with ``compose(base)``, with the name it is registered under."""
    if not isinstance(cls, type) or (not issubclass(cls, Sampler) and not hasattr(cls, "compose")):
        raise ConfigError(f"{cls!r} is neither a Sampler subclass nor a part with compose(base)")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise ConfigError(
            f"{cls.__name__} has no name to register under: give the class one, name: ClassVar[str] = "
            f"{plugins.suggested_name(cls)!r} (the name dllm.samplers.get and --sampler take)"
        )


SAMPLERS = Registry("sampler", group="dllm.samplers", check=_check)
for _sampler in (
    LLaDA,
    Dream,
    SDAR,
    LLaDA2,
    LLaDA21,
    FastDLLMv2,
    Threshold,
    Factor,
    EB,
    Credit,
    CreditFusion,
    ETE,
    S2D2,
    LocalLeap,
    AdaBlock,
    Prophet,
    SchED,
    WeDLM,
    EntropyBound,
    EntropyThreshold,
    BACD,
    CAD,
    CCD,
    DCD,
    FreeDave,
    Learn2PD,
    EoTP,
):  # the built-in ones
    SAMPLERS.register(_sampler)


def register(cls: type) -> type:
    """Add a sampler class, or a part with ``compose(base)`` (e.g. an exit rule), under ``cls.name`` (in this
    process; a ``dllm.samplers`` entry point makes it visible to every process: :mod:`dllm.core.plugins`)."""
    return SAMPLERS.register(cls)


def reference(family: str, **hyper_parameters) -> Sampler:
    """The reference sampler of a model family (its :attr:`~dllm.models.registry.Family.reference_sampler`, used
    at one token per step as the speed baseline), with ``hyper_parameters`` overriding its settings."""
    declared = families.get(family).reference_sampler
    if declared is None:
        with_one = [name for name, f in families.FAMILIES.items() if f.reference_sampler is not None]
        raise ConfigError(f"no reference sampler for {family!r} models; families with one: {', '.join(with_one)}")
    name, hp = declared
    return get(name, **{**hp, **hyper_parameters})


def names() -> list[str]:
    return SAMPLERS.names()


def is_part(name: str) -> bool:
    """Whether ``name`` composes with a base sampler (``base=`` selects it)."""
    return not issubclass(_cls(name), Sampler)


def _fields(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def defaults(name: str, base: str | None = None) -> dict:
    """Every hyper-parameter ``name`` accepts with its default; for a part, ``base`` (default: its
    ``default_base``) and that base's hyper-parameters too."""
    cls = _cls(name)
    if issubclass(cls, Sampler):
        return _fields(cls)
    base = base or cls.default_base
    if isinstance(base, str) and base.lower() in {n.lower() for n in SAMPLERS}:
        base = canonical(base)
    if not isinstance(base, str) or base not in SAMPLERS or is_part(base):
        raise ConfigError(
            f"base must name a sampler ({', '.join(n for n in SAMPLERS if not is_part(n))}), got {base!r}"
        )
    return {**_fields(cls), "base": base, **defaults(base)}


def canonical(name: str) -> str:
    """The registered spelling of sampler ``name`` (names are case-insensitive): ``"Threshold"`` ->
    ``"threshold"``. Unknown names raise :class:`ConfigError` with the closest registered ones."""
    if not isinstance(name, str):
        raise ConfigError(f"a sampler name must be a string, got {name!r}; available: {', '.join(SAMPLERS)}")
    if name in SAMPLERS:
        return name
    folded = {n.lower(): n for n in SAMPLERS}
    key = name.strip().lower()
    if key in folded:
        return folded[key]
    close = difflib.get_close_matches(key, list(folded), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(folded[c]) for c in close)}?" if close else ""
    missing = plugins.failures("dllm.samplers")
    raise ConfigError(f"unknown sampler {name!r}; available: {', '.join(SAMPLERS)}{hint}{missing}")


def _cls(name: str) -> type:
    return SAMPLERS.get(canonical(name))


def get(name: str, **hyper_parameters) -> Sampler:
    """The sampler registered as ``name`` (case-insensitive) with the given hyper-parameters.

    ``get("threshold", threshold=0.8)`` is ``Threshold(threshold=0.8)``. Every keyword must be a
    hyper-parameter of that sampler (``defaults(name)`` lists them with their defaults) and of the type
    its field has; generation settings (steps, max_new_tokens, block_size, temperature, seed) go to
    ``generate()`` instead. For a part that composes with a base (an exit rule), ``base=`` names the base
    sampler (or passes a built one) and the base's hyper-parameters may be given alongside the part's.

    Raises :class:`~dllm.core.errors.ConfigError` for an unknown name (with the closest names), an
    unknown hyper-parameter (with the valid ones), or a value of the wrong type or range.
    """
    name = canonical(name)
    cls = SAMPLERS.get(name)
    if not issubclass(cls, Sampler):
        return _composed(name, cls, hyper_parameters)
    advice = ". Generation settings (steps, max_new_tokens, block_size, temperature, seed) go to generate()"
    params.check_known(f"sampler {name!r}", hyper_parameters, _fields(cls), advice)
    return cls(**hyper_parameters)  # each field's type and range are checked as it is built (dllm.core.params)


def _composed(name: str, cls: type, hyper_parameters: dict) -> Sampler:
    hp = dict(hyper_parameters)
    base = hp.pop("base", cls.default_base)
    own = _fields(cls)
    part = cls(**{k: v for k, v in hp.items() if k in own})
    rest = {k: v for k, v in hp.items() if k not in own}
    if isinstance(base, Sampler):
        if rest:
            raise ConfigError(
                f"{name!r}: {', '.join(map(repr, sorted(rest)))} are not its hyper-parameters "
                f"({', '.join(sorted(own)) or 'none'}); set the base sampler's on the base itself"
            )
        return part.compose(base)
    valid = defaults(name, base)  # checks the base's name
    shared = sorted(set(own) & set(defaults(base)) & set(hp))
    if shared:
        raise ConfigError(
            f"{name!r} and its base {base!r} both have {', '.join(map(repr, shared))}: build the base first and "
            f"pass it as base=dllm.samplers.get({base!r}, ...)"
        )
    params.check_known(f"{name!r} over base {base!r}", rest, valid)
    return part.compose(get(base, **rest))
