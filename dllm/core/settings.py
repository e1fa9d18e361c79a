"""Settings as a person writes them: ``--set key=value`` items, sweep grids, comma-separated option values.

Every command line of the package (``dllm generate`` / ``bench``, ``python -m dllm.bench.*``) and the lm-eval
model's ``model_args`` read values the same way, through :func:`parse_value`; the errors name the option given.
"""

from __future__ import annotations

import json

from dllm.core.errors import ConfigError

INFINITIES = {"inf": float("inf"), "+inf": float("inf"), "infinity": float("inf"), "+infinity": float("inf")}
INFINITIES.update({"-inf": float("-inf"), "-infinity": float("-inf")})


def parse_value(text: str):
    """``--set`` values: JSON (numbers, true/false/null, lists), Python's True/False/None, ``inf`` / ``-inf``
    (any case, as Python's ``float`` takes them), else a string."""
    named = {"True": True, "False": False, "None": None}
    if text in named:
        return named[text]
    if text.strip().lower() in INFINITIES:
        return INFINITIES[text.strip().lower()]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_settings(items: list[str]) -> dict:
    """``--set key=value`` items -> ``{key: value}`` (a repeated key: the last value)."""
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        settings[key.strip()] = parse_value(value.strip())
    return settings


def parse_set(items: list[str]) -> dict[str, list]:
    """``--set key=v1,v2`` items -> ``{key: [v1, v2]}``; values typed like ``dllm generate --set``.
    Commas inside brackets do not split (``key=[1,2]`` is one list value); a repeated key adds values."""
    grid: dict[str, list] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects key=value[,value...], got {item!r}")
        parts, depth, current = [], 0, ""
        for ch in text:
            depth += ch in "[{"
            depth -= ch in "]}"
            if ch == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += ch
        parts.append(current)
        if any(not p.strip() for p in parts):
            raise ConfigError(f"--set {item!r} has an empty value")
        grid.setdefault(key, []).extend(parse_value(p.strip()) for p in parts)
    return grid


def option_list(option: str, text: str, choices=None) -> list[str]:
    """A comma-separated option value as a list (``--caches none,dual``), each item one of ``choices`` when
    given; a :class:`ConfigError` naming the option otherwise."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{option} is empty; give one or more values separated by commas")
    unknown = [item for item in items if choices is not None and item not in choices]
    if unknown:
        raise ConfigError(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}")
    return items


def option_sizes(option: str, text: str) -> tuple[int, ...]:
    """A comma-separated option value of positive integers (``--batch-sizes 1,8``)."""
    items = option_list(option, text)
    if not all(item.isdigit() and int(item) > 0 for item in items):
        raise ConfigError(f"{option} takes positive integers separated by commas (e.g. 1,8), got {text!r}")
    return tuple(int(item) for item in items)
