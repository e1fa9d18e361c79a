"""Named parts of one kind, found by name: the one registry every registry of the package is.

``Registry("sampler", group="dllm.samplers", check=...)``: ``register(obj)`` adds a part under its name (``obj.name``
unless the registry says otherwise), ``get(name)`` returns it or raises a :class:`~dllm.core.errors.ConfigError`
that lists the known names and the closest ones, ``names()`` lists them in registration order. With an
entry-point ``group``, other packages' parts join the first time the registry is asked for a name
(:mod:`dllm.core.plugins`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any

from dllm.core import plugins
from dllm.core.errors import ConfigError


class Registry:
    """Parts of one kind by name. what: the kind, as error messages say it ("sampler", "cache", "task");
    group: the entry-point group of other packages' parts (None: none); check(obj): raises a ConfigError when
    ``obj`` is not a part of this kind; name_of(obj): its name (default ``obj.name``); hint: what the
    unknown-name error adds (e.g. where to see the parts)."""

    def __init__(
        self,
        what: str,
        *,
        group: str | None = None,
        check: Callable[[Any], None] | None = None,
        name_of: Callable[[Any], str] = lambda obj: obj.name,
        hint: str = "",
    ):
        self.what, self.group, self.hint = what, group, hint
        self._check, self._name_of = check, name_of
        self._entries: dict[str, Any] = {}

    def register(self, obj, *, replace: bool = True):
        """Add ``obj`` under its name (replacing an entry of that name unless ``replace=False``); returns it, so
        that ``register`` can decorate a class."""
        if self._check is not None:
            self._check(obj)
        name = self._name_of(obj)
        if not isinstance(name, str) or not name:
            suggested = plugins.suggested_name(obj if isinstance(obj, type) else type(obj))
            raise ConfigError(
                f"{getattr(obj, '__name__', obj)!r} has no name to register under: give it one, "
                f"name: ClassVar[str] = {suggested!r}"
            )
        if not replace and self._entries.get(name, obj) is not obj:
            raise ConfigError(f"a {self.what} {name!r} is already registered; pass replace=True to override it")
        self._entries[name] = obj
        return obj

    def discover(self) -> None:
        """Other packages' parts of this kind (once per process)."""
        if self.group is not None:
            plugins.load(self.group, self._entries, self.register)

    def get(self, name: str):
        self.discover()
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), self._entries, n=3)
            maybe = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            failed = plugins.failures(self.group) if self.group else ""
            raise ConfigError(
                f"unknown {self.what} {name!r}{maybe}; known: {', '.join(self._entries)}{self.hint}{failed}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        self.discover()
        return list(self._entries)

    def items(self) -> list[tuple[str, Any]]:
        self.discover()
        return list(self._entries.items())

    def values(self) -> list:
        self.discover()
        return list(self._entries.values())

    def remove(self, name: str):
        """Drop the entry ``name`` (a no-op when there is none); returns it, or None."""
        return self._entries.pop(name, None)

    def __contains__(self, name) -> bool:
        self.discover()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())
