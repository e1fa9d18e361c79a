"""Structured output: what a generation may write (a constraint), and templates with holes.

``sampler.generate(model, prompt, constraint=C)``: each row's text (before its first EOS) matches ``C``, whatever the
sampler, its parallelism or the commit order. ``template=[text, Hole(8), text, ...]``: the generated span is the
template, its text fixed and each hole filled with at most its ``max_tokens`` tokens (the rest of its slots hold
the model's EOS filler, left out of the text); a hole may carry a constraint of its own, and ``constraint=`` the
whole filled text.

Regular constraints are compiled by outlines-core into an automaton over the tokenizer's tokens
(:mod:`dllm.constraints.automaton`) and checked exactly against the whole canvas at every step
(:mod:`dllm.constraints.guard`): a masked slot may take a token only if the slots on its left and right can still
be completed; several commits of one step are accepted in confidence order, each checked against those before it.

- :class:`Regex`: a regular expression (outlines-core's syntax, Rust's ``regex``), matched as ``re.fullmatch``;
- :class:`JsonSchema`: a JSON schema (a dict or its JSON text), through outlines-core's regex of the schema
  (recursive schemas are unrolled to a fixed depth);
- :class:`Json`: any JSON object (outlines-core's regex of ``{"type": "object"}``, nested to a fixed depth);
- :class:`Grammar`: a context-free grammar in Lark's syntax, compiled by llguidance and checked soundly: a commit,
  anywhere in the canvas, is accepted with a witness that the canvas can still be completed
  (:mod:`dllm.constraints.grammar`); with a template, its whole text a word.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import ClassVar

from dllm.core.errors import ConfigError

__all__ = ["Constraint", "Grammar", "Hole", "Json", "JsonSchema", "Regex"]


class Constraint:
    """A language the generated text must belong to: :meth:`regex` (the pattern the automaton is built from) and
    :meth:`check` (the text validated by an independent implementation); ``regular``: whether it is a regular
    language (checked exactly anywhere in the canvas), else context-free (:class:`Grammar`)."""

    regular: ClassVar[bool] = True

    def regex(self) -> str:
        raise NotImplementedError

    def check(self, text: str) -> bool:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Regex(Constraint):
    """The text fully matches ``pattern`` (``re.fullmatch``). The pattern is compiled by outlines-core (Rust's regex
    syntax: no look-around, no back-references)."""

    pattern: str

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ConfigError(f"Regex needs a non-empty pattern string, got {self.pattern!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"Regex({self.pattern!r}) is not a regular expression: {e}") from None

    def regex(self) -> str:
        return self.pattern

    def check(self, text: str) -> bool:
        return re.fullmatch(self.pattern, text) is not None


@dataclasses.dataclass(frozen=True)
class JsonSchema(Constraint):
    """The text is JSON valid against ``schema`` (a dict, or its JSON text; checked with ``jsonschema``).
    ``whitespace``: the regex of the whitespace allowed between tokens of the JSON (outlines-core's default: at most
    one space)."""

    schema: dict | str
    whitespace: str | None = None

    def __post_init__(self):
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConfigError(f"JsonSchema: the schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"JsonSchema needs a schema object (a dict or its JSON text), got {self.schema!r}")
        object.__setattr__(self, "schema", json.dumps(schema, sort_keys=True))  # hashable, one spelling

    @property
    def document(self) -> dict:
        return json.loads(self.schema)

    def regex(self) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        try:
            if self.whitespace is None:
                return build_regex_from_schema(self.schema)
            return build_regex_from_schema(self.schema, self.whitespace)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConfigError(
                f"JsonSchema: outlines-core cannot turn this schema into a regular expression: {e}"
            ) from None

    def check(self, text: str) -> bool:
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), self.document)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True


@dataclasses.dataclass(frozen=True)
class Json(JsonSchema):
    """Any JSON object (the schema ``{"type": "object"}``; nested objects and arrays to outlines-core's fixed depth)."""

    schema: dict | str = dataclasses.field(default_factory=lambda: {"type": "object"})


@dataclasses.dataclass(frozen=True)
class Grammar(Constraint):
    """The text is a word of the context-free grammar ``source``, in Lark's syntax (its ``start`` rule; checked
    with ``lark``'s Earley parser). llguidance compiles it; the guard accepts a commit only with a witness that the
    canvas can still be completed (:mod:`dllm.constraints.grammar`), and a row that runs out of slots first ends
    with ``finish_reasons[i] == "length"`` (with a template: never, its text always a word)."""

    source: str
    regular: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError(f"Grammar needs the text of a Lark grammar, got {self.source!r}")
        import lark
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ConfigError(f"Grammar: llguidance cannot compile it: {error}")
        try:
            lark.Lark(self.source, parser="earley")
        except lark.exceptions.LarkError as e:
            raise ConfigError(f"Grammar: lark cannot read it: {e}") from None

    def grammar(self) -> str:
        """llguidance's grammar text."""
        import llguidance

        return llguidance.LLMatcher.grammar_from_lark(self.source)

    def regex(self) -> str:
        raise ConfigError("a Grammar is context-free: it has no regular expression")

    def check(self, text: str) -> bool:
        import lark

        try:
            _lark_parser(self.source).parse(text)
        except lark.exceptions.LarkError:
            return False
        return True


@functools.lru_cache(maxsize=16)
def _lark_parser(source: str):
    """lark's Earley parser of the grammar ``source``, built once."""
    import lark

    return lark.Lark(source, parser="earley")


@dataclasses.dataclass(frozen=True)
class Hole:
    """A hole of a template (``generate(template=[...])``): at most ``max_tokens`` tokens of the model's own, matching
    ``constraint`` when given; the hole's other slots hold the EOS filler, left out of the text."""

    max_tokens: int
    constraint: Constraint | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"Hole.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ConfigError(
                f"Hole.constraint must be a constraint (dllm.constraints.Regex, JsonSchema, Json), got "
                f"{self.constraint!r}"
            )


def check_constraint(constraint) -> Constraint | None:
    """``generate``'s ``constraint=``, checked."""
    if constraint is None or isinstance(constraint, Constraint):
        return constraint
    raise ConfigError(
        f"constraint must be a dllm.constraints constraint (Regex(pattern), JsonSchema(schema), Json()), got "
        f"{constraint!r}"
    )
