"""Templates with holes (``generate(template=[text, Hole(8), text, ...])``): their layout over the generated span
and the pattern of their filled text, and the guard of a run (:func:`guard_for`)."""

from __future__ import annotations

import re

from dllm.constraints import Constraint, Hole, Regex
from dllm.constraints.automaton import MARKER, cached, product
from dllm.constraints.guard import HOLE, LITERAL, TAIL, Guard, Layout
from dllm.constraints.tokens import Surfaces, surfaces
from dllm.core.errors import ConfigError

ANY = r"[^\x01]*"  # a hole without a constraint: any text (no token writes the marker)


def check_template(template) -> list | None:
    """``generate``'s ``template=``: a list of texts and :class:`~dllm.constraints.Hole` with at least one hole."""
    if template is None:
        return None
    if not isinstance(template, (list, tuple)) or not all(isinstance(p, (str, Hole)) for p in template):
        raise ConfigError(
            f"template must be a list of texts and holes (dllm.Hole(max_tokens)), e.g. ['The answer is ', "
            f"dllm.Hole(4), '.'], got {template!r}"
        )
    if not any(isinstance(p, Hole) for p in template):
        raise ConfigError("a template needs at least one dllm.Hole(max_tokens): the slots the model fills")
    return list(template)


HOLE_SYNTAX = re.compile(r"\{\{(?P<size>[^}:]*)(?::(?P<regex>.*?))?\}\}(?!\})", re.DOTALL)


def parse_template(text: str) -> list:
    """A template written as one text (the CLI's ``--template``): ``{{N}}`` is a hole of at most N tokens,
    ``{{N:REGEX}}`` one whose text matches REGEX (the last ``}}`` of a run of braces closes it); the rest is the
    fixed text. E.g. ``"The answer is{{3: [0-9]+}}."``."""
    pieces, at = [], 0
    for match in HOLE_SYNTAX.finditer(text):
        size = match["size"].strip()
        if not size.isdigit() or int(size) < 1:
            raise ConfigError(
                f"template {text!r}: {match[0]!r} is not a hole: write {{{{N}}}} (a hole of at most N tokens) or "
                "{{N:REGEX}} (its text matching REGEX)"
            )
        if match.start() > at:
            pieces.append(text[at : match.start()])
        regex = match["regex"]
        pieces.append(Hole(int(size), None if regex is None else Regex(regex)))
        at = match.end()
    if "{{" in text[at:] or any("{{" in p for p in pieces if isinstance(p, str)):
        raise ConfigError(
            f"template {text!r}: a '{{{{' that opens no hole: close it with '}}}}' ({{{{N}}}} or {{{{N:REGEX}}}})"
        )
    if at < len(text):
        pieces.append(text[at:])
    return check_template(pieces)


def escape(text: str) -> str:
    """``text`` as a pattern matching exactly it, in both outlines-core's syntax (Rust's ``regex``) and Python's:
    ASCII other than letters and digits as ``\\xHH``, the rest as it is (no other character is special)."""
    return "".join(c if not c.isascii() or c.isalnum() else f"\\x{ord(c):02x}" for c in text)


def hole_pattern(constraint: Constraint | None) -> str:
    """A hole's part of the template's pattern: its constraint (any text without one) between markers."""
    inner = ANY if constraint is None else f"(?:{constraint.regex()})"
    return f"\\x01{inner}\\x01"


def layout(tokenizer, template: list, written: Surfaces) -> tuple[Layout, str]:
    """The template's layout (its text's tokens, each hole's slots) and the pattern of its filled text (a text piece
    as its tokens write it, ``written``: the tokenizer's :class:`~dllm.constraints.tokens.Surfaces`)."""
    kinds, holes, ends, tokens, pattern = [], [], [], [], []
    hole = 0
    for piece in template:
        if isinstance(piece, str):
            if MARKER.decode() in piece:
                raise ConfigError(f"the template's text {piece!r} holds the control character \\x01: leave it out")
            ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            unknown = [t for t in ids if t not in written.items]
            if unknown:
                pieces = tokenizer.convert_ids_to_tokens(unknown)
                raise ConfigError(
                    f"the template's text {piece!r} holds pieces this tokenizer cannot write (unknown or special "
                    f"tokens: {pieces}): a model can neither read nor write them; rephrase it"
                )
            text = b"".join(written.first.get(t, written.items[t]) if not kinds and i == 0 else written.items[t]
                            for i, t in enumerate(ids))  # fmt: skip
            kinds += [LITERAL] * len(ids)
            holes += [-1] * len(ids)
            ends += [False] * len(ids)
            tokens += ids
            pattern.append(escape(text.decode("utf-8", errors="replace")))
        else:
            if not kinds and written.first:
                raise ConfigError(
                    "this tokenizer drops the space that starts a text, so the text of a hole at the start of a "
                    "template is not what its tokens write: start the template with text (e.g. the prompt's last word)"
                )
            kinds += [HOLE] * piece.max_tokens
            holes += [hole] * piece.max_tokens
            ends += [False] * (piece.max_tokens - 1) + [True]
            tokens += [None] * piece.max_tokens
            pattern.append(hole_pattern(piece.constraint))
            hole += 1
    return Layout(kinds, holes, ends, tokens), "".join(pattern)


def slots(tokenizer, template: list) -> int:
    """The slots ``template`` takes: its text's tokens and its holes."""
    return len(layout(tokenizer, template, surfaces(tokenizer))[0].kinds)


def guard_for(model, canvas, constraint: Constraint | None, template: list | None, answer_width=None) -> Guard:
    """The guard of a run of ``model`` over ``canvas``: the automaton of ``constraint`` (and of the template's filled
    text), each row's layout (the template, then EOS to the end of its answer: its span, or its first
    ``answer_width`` slots where a block tail is decoded past it)."""
    if model.tokenizer is None:
        raise ConfigError("a constraint or a template needs the model's tokenizer (the bytes each token writes)")
    written = surfaces(model.tokenizer)
    eos = tuple(int(e) for e in model.eos_ids)
    automaton = None
    lengths = (canvas.span_end - canvas.prompt_width).tolist()
    if answer_width is not None:  # (each row's own, a tensor, where the rows' max_new_tokens differ)
        widths = [answer_width] * len(lengths) if isinstance(answer_width, int) else answer_width.tolist()
        lengths = [min(n, w) for n, w in zip(lengths, widths)]
    if constraint is not None and not constraint.regular:  # a context-free one: llguidance's matcher, witnesses
        from dllm.constraints.grammar import GrammarGuard, ll_tokenizer

        if not eos:
            raise ConfigError("a Grammar needs the model's EOS token id (the end of the text): set eos_token_id")
        tokenizer = ll_tokenizer(model.tokenizer, written, eos)
        if template is not None:
            if any(isinstance(p, Hole) and p.constraint is not None for p in template):
                raise ConfigError(
                    "a template's holes take no constraint of their own under a Grammar: write what they hold in "
                    "the grammar, or use a Regex or JsonSchema constraint"
                )
            base, _ = layout(model.tokenizer, template, written)
            layouts = [base.extended(n, eos[0]) for n in lengths]
        else:
            layouts = [Layout.free(n) for n in lengths]
        return GrammarGuard(constraint.grammar(), tokenizer, canvas, eos, canvas.mask_id, layouts, written)
    if template is not None:
        base, pattern = layout(model.tokenizer, template, written)
        automaton = cached(pattern, written, eos, markers=True)
        layouts = [base.extended(n, eos[0]) for n in lengths]
    else:
        layouts = [Layout.free(n) for n in lengths]
    if constraint is not None:
        own = cached(constraint.regex(), written, eos)
        automaton = own if automaton is None else product(automaton, own)
    return Guard(automaton, layouts, canvas, eos, canvas.mask_id, written)


def filled(guard: Guard, tokens) -> tuple[list[str], list[list[str]], list[int]]:
    """Per row of the canvas ``tokens``: the filled template's text, each hole's text (as the tokens write them: the
    text the automaton read), and the tokens the holes hold (their EOS filler and the slots past the template left
    out)."""
    written, texts, fills, counts = guard.surfaces, [], [], []
    for row, layout in enumerate(guard.layouts):
        span = guard.span(tokens, row)
        text, holes = [], {}
        for i, (kind, hole, token) in enumerate(zip(layout.kinds, layout.holes, span)):
            if kind == TAIL or token is None or token in guard.eos:
                continue
            piece = written.first.get(token, written.items.get(token, b"")) if i == 0 else written.items.get(token, b"")
            text.append(piece)
            if kind == HOLE:
                holes.setdefault(hole, []).append(piece)
        texts.append(_utf8(text))
        fills.append([_utf8(holes.get(h, [])) for h in range(max(layout.holes) + 1)])
        counts.append(sum(len(pieces) for pieces in holes.values()))
    return texts, fills, counts


def _utf8(pieces: list[bytes]) -> str:
    return b"".join(pieces).decode("utf-8", errors="replace")
