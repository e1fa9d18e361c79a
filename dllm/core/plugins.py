"""Samplers, caches and model families from other packages, found through Python entry points.

``register(cls)`` adds a sampler or a cache to the process that calls it; the command line, ``dllm bench``, the
lm-eval model (``python -m dllm.eval``) and ``accelerate launch`` workers are other processes. A package makes
its parts visible to every process by declaring them as entry points, one group per registry, each entry named
as the part is (its ``name``)::

    [project.entry-points."dllm.samplers"]
    margin_threshold = "my_package.samplers:MarginThreshold"   # a Sampler, or a part with compose(base)
    [project.entry-points."dllm.caches"]
    block_only = "my_package.caches:BlockOnly"                 # a Cache subclass with a name
    [project.entry-points."dllm.families"]
    my_family = "my_package.model:FAMILY"                      # a dllm.models.registry.Family

Each registry loads its group the first time it is asked for a name (``get``, ``names``, ``dllm.load``), once
per process. A part that fails to import or does not fit its registry is left out with a
:class:`~dllm.core.errors.DllmWarning` naming the package that declares it (a broken package does not stop the
others), and asking for it by name raises an error that says why it is missing.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable

from dllm.core.errors import ConfigError, DllmWarning

GROUPS = ("dllm.samplers", "dllm.caches", "dllm.families")
_loaded: set[str] = set()  # groups loaded (or being loaded: a plugin may ask the registry while it imports)
_failed: dict[str, list[str]] = {}  # group -> why each of its entry points that did not load did not


def suggested_name(cls: type) -> str:
    """A registry name for a class that has none: ``MarginThreshold`` -> ``margin_threshold``."""
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(cls.__name__))


def _distribution(entry: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return f"package {dist.name} {dist.version}" if dist is not None else "an unknown package"


def _add(entry: importlib.metadata.EntryPoint, registry: dict, register: Callable) -> None:
    try:
        obj = entry.load()
    except Exception as e:
        raise ConfigError(f"failed to import: {type(e).__name__}: {e}") from e
    name = getattr(obj, "name", None)
    if name != entry.name:
        raise ConfigError(
            f"it loads {obj!r}, whose name is {name!r}: an entry point is named as the part it registers (the "
            "name the command line takes)"
        )
    if registry.get(name, obj) is not obj:
        raise ConfigError(f"it would replace {registry[name]!r}, registered as {name!r}; rename it")
    register(obj)


def load(group: str, registry: dict, register: Callable) -> None:
    """Register every entry point of ``group`` (once per process) with ``register``; ``registry`` maps the names
    registered so far to their objects (a plugin may not replace another part under the same name)."""
    if group in _loaded:
        return
    _loaded.add(group)
    for entry in importlib.metadata.entry_points(group=group):
        try:
            _add(entry, registry, register)
        except ConfigError as e:
            why = f"the {group} entry point {entry.name!r} of {_distribution(entry)} ({entry.value}): {e}"
            _failed.setdefault(group, []).append(why)
            warnings.warn(f"{why}. Left out; fix or uninstall that package", DllmWarning, stacklevel=2)


def failures(group: str) -> str:
    """For an unknown-name error: the entry points of ``group`` that did not load and why ('' when none)."""
    return "".join(f"; not loaded: {why}" for why in _failed.get(group, []))
