"""K/V cache schemes. A cache decides which canvas columns a forward computes; it never decides
which tokens to commit. With its refresh forced every step, any cache gives the no-cache output.

By name: ``get("dual")``, ``get("dkv", cache_reloading_step=8)``, ``names()``; ``register(cls)`` adds one to this
process; other packages' caches declared as ``dllm.caches`` entry points (:mod:`dllm.core.plugins`) join when the
registry is first asked for a name.
"""

from __future__ import annotations

import dataclasses
import difflib

from dllm.caches.base import Cache, CacheState, Plan
from dllm.caches.block import BlockCausal
from dllm.caches.dkv import DKV
from dllm.caches.dual import Dual
from dllm.caches.elastic import Elastic
from dllm.caches.prefix import Prefix
from dllm.caches.stream import StreamPrefix
from dllm.caches.subblock import SubBlock
from dllm.caches.window import Window
from dllm.core import params, plugins
from dllm.core.errors import ConfigError
from dllm.core.registry import Registry

NONE = "none"  # the name of "no cache" (every forward computes every column)


def _check(cls) -> None:
    """A Cache subclass with the name it is registered under."""
    if not isinstance(cls, type) or not issubclass(cls, Cache):
        raise ConfigError(f"{cls!r} is not a subclass of dllm.caches.Cache")
    if not isinstance(cls.name, str) or not cls.name or cls.name == NONE:
        raise ConfigError(
            f"{cls.__name__} has no name to register under: give the class one, name: ClassVar[str] = "
            f"{plugins.suggested_name(cls)!r} (the name dllm.caches.get and --cache take; not {NONE!r})"
        )


CACHES = Registry("cache", group="dllm.caches", check=_check)
for _cache in (Prefix, Dual, DKV, Window, Elastic, BlockCausal, SubBlock, StreamPrefix):
    CACHES.register(_cache)


def register(cls: type) -> type:
    """Add a cache class under ``cls.name`` (in this process; a ``dllm.caches`` entry point makes it visible to
    every process: :mod:`dllm.core.plugins`)."""
    return CACHES.register(cls)


def names() -> list[str]:
    return CACHES.names()


def defaults(name: str) -> dict:
    """Every hyper-parameter of cache ``name`` with its default."""
    cls = _cls(name)
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else {}


def _cls(name: str) -> type:
    if name not in CACHES:
        close = difflib.get_close_matches(str(name), CACHES.names(), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(
            f"unknown cache {name!r}; available: {', '.join(CACHES)} (or {NONE!r} for no cache){hint}"
            + plugins.failures("dllm.caches")
        )
    return CACHES.get(name)


def get(name: str, **hyper_parameters) -> Cache | None:
    """A new cache ``name`` with ``hyper_parameters`` (``"none"``: None, no cache)."""
    if name == NONE:
        if hyper_parameters:
            raise ConfigError(f"cache {NONE!r} takes no hyper-parameters, got {', '.join(sorted(hyper_parameters))}")
        return None
    cls = _cls(name)
    params.check_known(f"cache {name!r}", hyper_parameters, defaults(name))
    return cls(**hyper_parameters)


def resolve(cache, default):
    """A ``generate(cache=...)`` argument as a cache object or None: ``"default"`` -> ``default()``, a name ->
    :func:`get`, an object as is."""
    if isinstance(cache, str):
        return default() if cache == "default" else get(cache)
    if cache is not None and not isinstance(cache, Cache):
        raise ConfigError(
            f"cache must be a name ({', '.join(CACHES)}, {NONE!r}, 'default'), a dllm.caches.Cache or None, "
            f"got {cache!r}"
        )
    return cache


__all__ = [
    "Cache",
    "Plan",
    "CacheState",
    "BlockCausal",
    "StreamPrefix",
    "Prefix",
    "Dual",
    "DKV",
    "Window",
    "Elastic",
    "CACHES",
    "get",
    "names",
    "defaults",
    "register",
]


def require_needed(cache, reader: str, model) -> None:
    """Raise :class:`~dllm.core.errors.ConfigError` when ``cache`` (None: no cache, always fine) does not compute
    the columns ``reader`` (what reads them, e.g. "prophet reads its answer region's logits at every step")
    needs (:attr:`Cache.computes_needed`); the advice names the caches that do and serve ``model``."""
    if cache is None or cache.computes_needed:
        return

    def serves(cls) -> bool:
        try:
            cls().check_model(model)
        except ConfigError:
            return False
        return True

    usable = ", ".join(repr(name) for name, cls in CACHES.items() if cls.computes_needed and serves(cls))
    raise ConfigError(
        f"{reader}, which the {cache.name!r} cache does not compute: it computes its own window of masks and "
        f"commits only there. Use the {usable} cache or none"
    )
