"""Hyper-parameters: each one's type and accepted values declared once, checked in one place.

Samplers, their composed parts (exit rules, logit transforms) and caches are frozen dataclasses of their
hyper-parameters. A field's annotation is its type; :func:`hp` adds what it accepts, next to its default::

    threshold: float = hp(0.9, "[0, 1]")
    refresh_steps: int = hp(0, ">= 0", note="0: refresh only at a block's start")
    alg: str = hp("entropy", choices=ALGORITHMS)

:class:`HyperParameters`, the base of those classes, runs :func:`check` on every field when one is built, then
the class's own ``check_hyper_parameters`` (constraints across fields); :func:`check_value` checks one value
(the arguments of ``generate()`` and of the lm-eval model). A value is refused with a
:class:`~dllm.core.errors.ConfigError` naming the field, the value and what is accepted; accepted are:

- ``bool``: True or False (not 0 / 1);
- ``int``: an integral number, not a bool, within int64 (torch's index type: a larger one would fail deep
  inside torch) and the declared range;
- ``float``: a real number (an integer too), not a bool, never NaN, finite unless the declared range is closed
  at infinity (``"[0, inf]"``: inf has a meaning there), within the declared range;
- ``X | None``: None or an X; ``tuple[X, ...]``: a list or tuple (stored as a tuple) of X, each in the range;
- ``str`` with ``choices``: one of them.
Other annotations (dicts, objects) are left to the class's own checks.

Ranges: an interval ``"[a, b]"`` / ``"(a, b]"`` / ``"[a, b)"`` / ``"(a, b)"`` (``inf`` allowed as an end) or one
bound ``">= a"``, ``"> a"``, ``"<= b"``, ``"< b"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
import types
import typing

from dllm.core.errors import ConfigError

INT64 = (-(2**63), 2**63 - 1)
_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\]\s)]+)\s*([\])])$")
_BOUND = re.compile(r"^(>=|>|<=|<)\s*(\S+)$")
_UNBOUNDED = (-math.inf, False, math.inf, False)  # (low, low_closed, high, high_closed) without a range


@dataclasses.dataclass(frozen=True)
class Accepts:
    """What one hyper-parameter accepts beyond its type: a range (``"[0, 1]"``, ``">= 1"``), choices, and a
    note on its meaning for the error message."""

    range: str | None = None
    choices: tuple | None = None
    note: str = ""

    def __post_init__(self):
        if self.range is not None:
            _bounds(self.range)  # a malformed range fails where it is declared


def hp(default=dataclasses.MISSING, range: str | None = None, *, choices=None, note: str = ""):
    """A dataclass field with ``default`` (none: a required field) that accepts ``range`` / ``choices`` (see the
    module docstring); ``note`` says what values mean, in the error message."""
    accepts = Accepts(range, tuple(choices) if choices is not None else None, note)
    return dataclasses.field(default=default, metadata={"accepts": accepts})


_ANY = Accepts()  # a field declared without hp(): its type alone


def same_as(cls: type, name: str):
    """The field ``name`` of the dataclass ``cls`` declared again (default and accepted values), for a class that
    has the same hyper-parameter."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=field.default, metadata=field.metadata)


class HyperParameters:
    """Base of the dataclasses of hyper-parameters (samplers, composed parts, caches): once built, every field
    is checked (:func:`check`), then the class's own :meth:`check_hyper_parameters`. ``noun`` names the owner
    in messages (``sampler 'threshold': ...``)."""

    noun: typing.ClassVar[str] = ""

    def __post_init__(self):
        check(self, self.noun)
        self.check_hyper_parameters()

    def check_hyper_parameters(self) -> None:
        """Raise a ConfigError for what the fields' declarations cannot say: constraints across fields,
        normalisations (each field's type and range were checked before)."""


@functools.cache
def _bounds(text: str) -> tuple:
    """``(low, low_closed, high, high_closed)`` of a range; an absent end is infinite and open."""
    inf = math.inf
    match = _INTERVAL.match(text.strip())
    if match:
        left, low, high, right = match.groups()
        return _number(low), left == "[", _number(high), right == "]"
    match = _BOUND.match(text.strip())
    if not match:
        raise ValueError(f"malformed range {text!r}: use e.g. '[0, 1]', '(0, inf]' or '>= 1'")
    op, value = match.group(1), _number(match.group(2))
    if op.startswith(">"):
        return value, op == ">=", inf, False
    return -inf, False, value, op == "<="


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text)


@functools.cache
def _hints(cls: type) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: that field is left to the class
        return {}


def check(obj, noun: str = "") -> None:
    """Check every field of the dataclass ``obj`` against its annotation and :func:`hp` declaration, storing
    what :func:`check_value` returns (numbers for float fields as floats, lists for tuple fields as tuples).
    ``noun`` names the owner in messages (``"sampler"``: ``sampler 'threshold': ...``)."""
    cls = type(obj)
    name = getattr(obj, "name", "") if isinstance(getattr(cls, "name", ""), str) else ""  # not a property
    owner = f"{noun} {name!r}" if noun and name else cls.__name__
    hints = _hints(cls)
    for field in dataclasses.fields(obj):
        kind = hints.get(field.name)
        if not field.init or kind is None:
            continue
        value = getattr(obj, field.name)
        accepts = field.metadata.get("accepts", _ANY)
        checked = check_value(field.name, value, kind, accepts, owner=owner, default=field.default)
        if checked is not value:
            object.__setattr__(obj, field.name, checked)


def check_known(owner: str, given, valid, advice: str = "") -> None:
    """Refuse the names in ``given`` that are not in ``valid`` (hyper-parameters of a registered part): a
    ConfigError naming ``owner``, the unknown names and the valid ones, then ``advice``."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ConfigError(
            f"{owner} has no hyper-parameter {', '.join(map(repr, unknown))}; valid: "
            f"{', '.join(sorted(valid)) or '(none)'}{advice}"
        )


def check_value(key: str, value, kind, accepts: Accepts | str | None = None, *, owner: str = "", default=None):
    """``value`` of the setting ``key`` checked against the type ``kind`` and ``accepts`` (an :class:`Accepts`,
    or a range string). Returns it as stored: a number for a float type as a Python float, a list for a tuple
    type as a tuple. Raises a ConfigError naming ``key`` (after ``owner``), the value, what is accepted, and
    the default (unless None or missing)."""
    if not isinstance(accepts, Accepts):
        accepts = Accepts(accepts) if accepts is not None else _ANY
    verdict, stored = _fit(kind, value, accepts)
    if verdict in (True, None):
        return stored
    details = "; ".join(d for d in (accepts.note, _default(default)) if d)
    why = f" ({type(value).__name__})" if verdict == "type" else ""
    if _too_wide(value):
        why = ", an integer beyond 64 bits (torch's integers end at 2**63 - 1)"
    raise ConfigError(
        f"{owner + ': ' if owner else ''}{key} must be {describe(kind, accepts)}{f' ({details})' if details else ''}, "
        f"got {value!r}{why}"
    )


def _too_wide(value) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(_integer(v) and not INT64[0] <= v <= INT64[1] for v in values)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _default(default) -> str:
    if default is None or default is dataclasses.MISSING:
        return ""
    return f"default {default!r}"


def _fit(kind, value, accepts: Accepts) -> tuple:
    """``(verdict, stored)``: verdict True (fits), ``"type"`` or ``"range"`` (why not), or None (an annotation
    not checked here); ``stored`` is the value to keep."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None
        fits = [_fit(k, value, accepts) for k in args if k is not type(None)]
        for fit in fits:
            if fit[0] is True:
                return fit
        verdicts = [v for v, _ in fits]
        return ("range" if "range" in verdicts else None if None in verdicts else "type"), value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return "type", value
        fits = [_fit(args[0], v, accepts) for v in value]
        bad = [v for v, _ in fits if v is not True]
        return (bad[0] if bad else True), tuple(stored for _, stored in fits)
    if origin is typing.Literal:
        return (True if value in args else "range"), value
    if kind is bool:
        return (True if isinstance(value, bool) else "type"), value
    if kind is int:
        if not _integer(value):
            return "type", value
        return (True if INT64[0] <= value <= INT64[1] and _in_range(value, accepts) else "range"), value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return "type", value
        if _integer(value) and not INT64[0] <= value <= INT64[1]:
            return "range", value
        number = float(value)
        return (True if not math.isnan(number) and _in_range(number, accepts, finite=True) else "range"), number
    if kind is str:
        if not isinstance(value, str):
            return "type", value
        return (True if accepts.choices is None or value in accepts.choices else "range"), value
    return None, value


def _in_range(value, accepts: Accepts, finite: bool = False) -> bool:
    low, low_closed, high, high_closed = _bounds(accepts.range) if accepts.range else _UNBOUNDED
    if finite and math.isinf(value):  # infinity only where the range is closed at it
        return (value == high and high_closed) or (value == low and low_closed)
    above = value >= low if low_closed else value > low
    below = value <= high if high_closed else value < high
    return above and below


def describe(kind, accepts: Accepts, plural: bool = False) -> str:
    """What a setting accepts, in words: ``"a number in [0, 1]"``, ``"a positive integer or None"``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        words = [describe(k, accepts, plural) for k in args if k is not type(None)]
        return " or ".join(words + (["None"] if type(None) in args else []))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {describe(args[0], accepts, plural=True)}"
    if origin is typing.Literal:
        return f"one of {', '.join(map(repr, args))}"
    if kind is bool:
        return "True or False"
    if kind is str:
        if accepts.choices is not None:
            return f"one of {', '.join(map(repr, accepts.choices))}"
        return "strings" if plural else "a string"
    if kind is int:
        if accepts.range and accepts.range.replace(" ", "") == ">=1":
            return "positive integers" if plural else "a positive integer"
        noun = "integers" if plural else "an integer"
        return f"{noun} {_range_words(accepts.range)}" if accepts.range else noun
    if kind is float:
        if accepts.range and _INTERVAL.match(accepts.range.strip()):
            return f"{'numbers' if plural else 'a number'} in {accepts.range}"
        noun = "finite numbers" if plural else "a finite number"
        return f"{noun} {accepts.range}" if accepts.range else noun
    return getattr(kind, "__name__", str(kind))


def _range_words(text: str) -> str:
    return text if text.strip()[0] in "<>" else f"in {text}"
