"""Structured output (:mod:`dllm.constraints`): a constraint's allowed tokens equal brute force on a toy vocabulary,
for any pattern of committed and masked slots, templates with holes included; every sampler writes only text that
matches, on the bundled models and on a model whose logits favour what does not; templates keep their text."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import types
import warnings

import numpy as np
import pytest
import torch

import dllm
from dllm.constraints import Grammar, Hole, Json, JsonSchema, Regex
from dllm.constraints import guard as guard_module
from dllm.constraints.automaton import build, product
from dllm.constraints.guard import HOLE, LITERAL, TAIL, Guard, Layout, RowSets
from dllm.constraints.template import escape, hole_pattern
from dllm.constraints.tokens import Surfaces
from dllm.core.errors import DllmWarning
from dllm.models.tiny import make_tiny_checkpoint

# -- exactness on a toy vocabulary ----------------------------------------------------------------------------------

EOS, MASK = 0, 1
TOY = {2: b"a", 3: b"b", 4: b"ab", 5: b"ba", 6: b"1", 7: b"12", 8: b" ", 9: b"c", 10: b" a"}
ALPHABET = [EOS, *TOY]
REGEXES = ["a+b?", "(ab|ba)*", "[ab]{2,3}", "1|12|c", "a?(1|12)+", " ?a b", "(a|ab)(c|bc)", "c*", "(a| a)+1?"]


def _surfaces(sentencepiece: bool) -> Surfaces:
    """The toy vocabulary; ``sentencepiece``: its decoder drops the space that starts a text."""
    first = {t: text[1:] for t, text in TOY.items() if text.startswith(b" ")} if sentencepiece else {}
    return Surfaces(dict(TOY), first, 11)


def _guard(automaton, layout) -> Guard:
    canvas = types.SimpleNamespace(prompt_width=0, span_end=torch.tensor([len(layout.kinds)]), mask_id=MASK)
    return Guard(automaton, [layout], canvas, [EOS], MASK)


def _written(tokens, layout, surfaces) -> tuple[str, dict[int, str]] | None:
    """The text a full span writes under ``layout`` and each hole's, None where it breaks the layout (a hole's
    content after its filler, a non-EOS after the end of a free text)."""
    out, holes, ended, filler = b"", {}, False, False
    for i, (token, kind) in enumerate(zip(tokens, layout.kinds)):
        piece = surfaces.first.get(token, TOY.get(token)) if i == 0 else TOY.get(token)
        if kind == HOLE:
            holes.setdefault(layout.holes[i], b"")
            if token == EOS:
                filler = True
            elif filler:
                return None
            else:
                out += piece
                holes[layout.holes[i]] += piece
            if layout.ends[i]:
                filler = False
        elif kind in (LITERAL, TAIL):
            out += piece or b""
        elif token == EOS:
            ended = True
        elif ended:
            return None
        else:
            out += piece
    return out.decode(), {h: text.decode() for h, text in holes.items()}


def _brute(span, i, layout, surfaces, valid) -> tuple[set[int], bool]:
    """The tokens masked slot ``i`` (None: none) may take, some filling of the other masked slots making a span
    ``valid(written)`` accepts; and whether any filling does."""
    masked = [j for j, t in enumerate(span) if t is None and j != i]
    allowed, any_valid = set(), False
    for token in ALPHABET if i is not None else [None]:
        for fill in itertools.product(ALPHABET, repeat=len(masked)):
            tokens = list(span)
            if i is not None:
                tokens[i] = token
            for j, f in zip(masked, fill):
                tokens[j] = f
            written = _written(tokens, layout, surfaces)
            if written is not None and valid(*written):
                allowed.add(token)
                any_valid = True
                break
    return allowed, any_valid


def _layouts(rng: random.Random, n: int, template: bool, sentencepiece: bool) -> Layout:
    if not template:
        return Layout.free(n)
    kinds, holes, ends, hole = [], [], [], 0  # holes with literal slots between (first, for SentencePiece)
    if sentencepiece:
        kinds, holes, ends = [LITERAL], [-1], [False]
    while len(kinds) < n:
        width = rng.randint(1, n - len(kinds))
        kinds += [HOLE] * width
        holes += [hole] * width
        ends += [False] * (width - 1) + [True]
        hole += 1
        if len(kinds) < n and rng.random() < 0.5:
            kinds.append(LITERAL)
            holes.append(-1)
            ends.append(False)
    return Layout(kinds[:n], holes[:n], ends[:n], [None] * n)


def _check_against_brute_force(automaton, layout, span, surfaces, valid) -> int:
    guard = _guard(automaton, layout)
    left, right = guard.sets(layout, span)
    checked = 0
    for i, token in enumerate(span):
        if token is None:
            mask = guard.allowed(layout, left, right, i)
            assert {t for t in ALPHABET if mask[t]} == _brute(span, i, layout, surfaces, valid)[0], (
                layout.kinds, span, i,
            )  # fmt: skip
            checked += 1
    completable = _brute(span, None, layout, surfaces, valid)[1]
    assert guard.completable(layout, span) == completable
    # the kept sets of a step: the span less some of its commits, written as changes (after an earlier canvas)
    written = [i for i, (t, kind) in enumerate(zip(span, layout.kinds)) if t is not None and kind != LITERAL]
    changes = {i: span[i] for i in written if (i + len(written)) % 2}
    base = [None if i in changes else t for i, t in enumerate(span)]
    sets = RowSets(guard, layout, [None if kind != LITERAL else t for t, kind in zip(span, layout.kinds)])
    sets.left_at(len(span)), sets.right_at(0)
    sets.update(base)
    assert not changes or sets.fits(changes) == completable
    for i, token in enumerate(span):
        if token is None:
            classes, eos = guard.allowed_classes(layout, *sets.around(i, changes), i)
            mask = classes[guard.class_index[i == 0].numpy()]
            if eos is not None:
                mask[guard.eos_mask] = eos
            assert np.array_equal(mask, guard.allowed(layout, left, right, i))
    return checked


def _span(rng, layout) -> list[int | None]:
    return [rng.choice(list(TOY)) if kind == LITERAL else rng.choice([*ALPHABET, *[None] * 8]) for kind in layout.kinds]


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["bytes", "sentencepiece"])
def test_the_allowed_tokens_equal_brute_force(sentencepiece):
    """Every masked slot's allowed tokens, for random canvases (free, or holes with literal slots between), equal
    those some filling of the other masked slots makes into a text of the language."""
    rng = random.Random(0)
    surfaces = _surfaces(sentencepiece)
    checked = 0
    for regex in REGEXES:
        automaton = build(regex, surfaces, [EOS])
        for _ in range(40):
            layout = _layouts(rng, rng.randint(1, 4), rng.random() < 0.5, sentencepiece)
            valid = lambda text, holes, regex=regex: re.fullmatch(regex, text) is not None  # noqa: E731
            checked += _check_against_brute_force(automaton, layout, _span(rng, layout), surfaces, valid)
    assert checked > 150


def _random_template(rng, layout, tokens, surfaces):
    """(the automaton, a check of a written text and its holes) of a template over ``layout``: its literal slots'
    text (``tokens``), each hole's own random regex or none, and a random regex on the whole text or none."""
    own = {h: rng.choice([None, *REGEXES]) for h in set(layout.holes) - {-1}}
    pattern = ""
    for i, kind in enumerate(layout.kinds):
        if kind == LITERAL:
            pattern += escape((surfaces.first.get(tokens[i], TOY[tokens[i]]) if i == 0 else TOY[tokens[i]]).decode())
        elif layout.starts()[i]:
            h = layout.holes[i]
            pattern += hole_pattern(None if own[h] is None else Regex(own[h]))
    whole = rng.choice([None, *REGEXES])
    automaton = build(pattern, surfaces, [EOS], markers=True)
    if whole is not None:
        automaton = product(automaton, build(whole, surfaces, [EOS]))

    def valid(text, holes):
        if whole is not None and re.fullmatch(whole, text) is None:
            return False
        return all(own[h] is None or re.fullmatch(own[h], holes.get(h, "")) for h in own)

    return automaton, valid


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["bytes", "sentencepiece"])
def test_a_templates_holes_and_text_constraints_equal_brute_force(sentencepiece):
    """A template's automaton (its literal slots' text, each hole's own constraint between markers), alone and
    with a constraint on the whole text: the allowed tokens equal brute force over the holes' and the whole text."""
    rng = random.Random(1)
    surfaces = _surfaces(sentencepiece)
    checked = 0
    for _ in range(250):
        layout = _layouts(rng, rng.randint(2, 4), True, sentencepiece)
        span = _span(rng, layout)
        automaton, valid = _random_template(rng, layout, span, surfaces)
        checked += _check_against_brute_force(automaton, layout, span, surfaces, valid)
    assert checked > 150


# -- a context-free constraint's witnesses on the toy vocabulary ---------------------------------------------------

GRAMMARS = ['start: s\ns: "a" s "b" | "c"', 'start: s\ns: s s | "a" s "b" | "c" | "1"']  # (a^n c b^n; nested)


def _grammar_guard(source: str, layout: Layout):
    from dllm.constraints.grammar import GrammarGuard, build_ll_tokenizer

    surfaces = _surfaces(False)
    single = {text: t for t, text in TOY.items()}
    encode = lambda text: [single[c.encode()] for c in text]  # noqa: E731
    tokenizer = build_ll_tokenizer(surfaces, [EOS], encode)
    canvas = types.SimpleNamespace(prompt_width=0, span_end=torch.tensor([len(layout.kinds)]), mask_id=MASK)
    return GrammarGuard(Grammar(source).grammar(), tokenizer, canvas, [EOS], MASK, [layout], surfaces)


def _grammar_span(rng, layout) -> list[int | None]:
    """A random span (a free one ends with EOS: its text must then be a word, as a template's)."""
    span = _span(rng, layout)
    if layout.kinds[0] != HOLE and LITERAL not in layout.kinds:
        span[-1] = EOS
    return span


def test_a_grammar_witness_exists_exactly_when_brute_force_finds_a_filling(monkeypatch):
    """With every allowed token tried and no budget, the witness search is exhaustive: it finds a filling of the
    masked slots exactly when one makes the text (a template's, or a free text up to its EOS) a word of the grammar,
    and the filling it gives is one (soundness holds with any budget: every filling it gives is checked)."""
    from dllm.constraints import grammar as grammar_module

    monkeypatch.setattr(grammar_module, "_LOWEST", len(TOY))
    rng, found, missing = random.Random(2), 0, 0
    surfaces = _surfaces(False)
    for source in GRAMMARS:
        check = functools.cache(Grammar(source).check)
        for _ in range(120):
            template = rng.random() < 0.5
            layout = _layouts(rng, rng.randint(2, 5), template, False)
            span = _grammar_span(rng, layout)
            if sum(t is None for t in span) > 3:
                continue
            guard = _grammar_guard(source, layout)
            witness = guard.witness(0, span, budget=(10**6, 0))
            exists = _brute(span, None, layout, surfaces, lambda text, holes, check=check: check(text))[1]
            assert (witness is not None) == exists, (source, layout.kinds, span)
            if witness is not None:
                filled = [witness.get(i, t) for i, t in enumerate(span)]
                assert None not in filled and check(_written(filled, layout, surfaces)[0]), (span, filled)
            found, missing = found + exists, missing + (not exists)
    assert found > 40 and missing > 40


def test_a_grammar_accepts_commits_right_of_the_frontier_that_a_witness_proves():
    """Commits past masked slots are accepted when a filling of the slots between proves them (a^n c b^n: 'c' two
    slots on needs 'a' 'a' before it), wait when none does; a row whose commits all wait writes its frontier with
    the witness's token."""
    a, b, c = 2, 3, 9
    guard = _grammar_guard(GRAMMARS[0], Layout.free(6))
    tokens = torch.full((1, 6), MASK)

    def accept(proposed: dict[int, int], refill=lambda row, column, allowed: int(allowed.nonzero()[0])):
        commit, proposals = torch.zeros((1, 6), dtype=torch.bool), tokens.clone()
        for i, t in proposed.items():
            commit[0, i], proposals[0, i] = True, t
        confidence = torch.arange(6, 0, -1, dtype=torch.float)[None]  # (left first)
        commit, proposals = guard.accept(tokens, commit, proposals, confidence, None, refill)
        return {i: int(proposals[0, i]) for i in commit[0].nonzero().squeeze(1).tolist()}

    assert accept({0: a, 2: c, 3: b}) == {0: a, 2: c, 3: b}  # (proved by 'a' at slot 1)
    assert guard.witnesses[0] == {1: a}
    assert accept({0: c, 3: a}) == {0: c}  # (after 'c' only 'b': 'a' waits)
    tokens[0, 0], tokens[0, 2] = a, c
    assert accept({4: a}) == {1: a}  # (nothing fits: the frontier, with the witness's token)
    assert accept({3: b, 4: b}) == {3: b, 4: b}


@pytest.mark.parametrize("column_at_a_time", [True, False])
def test_restrict_sets_exactly_the_disallowed_tokens_to_minus_infinity(column_at_a_time, monkeypatch):
    """Guard.restrict over a batch of rows (a hole's slots where its EOS filler may go on, a text's first slot of a
    SentencePiece vocabulary, repeated allowed sets): each masked column's logits are -inf exactly where
    :meth:`Guard.allowed` (equal to brute force above) refuses, ids past the tokenizer's vocabulary included; every
    other column and every allowed logit is untouched. Both ways of adding the biases (the CPU's and an
    accelerator's), and again from the biases the guard kept."""
    monkeypatch.setattr(guard_module, "_column_at_a_time", lambda device: column_at_a_time)
    automaton = build("[ab][ab ]*1?", _surfaces(True), [EOS])
    ends = [False, False, False, True, False, True]
    hole = Layout([LITERAL, HOLE, HOLE, HOLE, LITERAL, HOLE], [-1, 0, 0, 0, -1, 1], ends, [None] * 6)
    layouts = [hole, hole, Layout.free(6)]
    canvas = types.SimpleNamespace(prompt_width=1, span_end=torch.tensor([7, 7, 7]), mask_id=MASK)
    guard = Guard(automaton, layouts, canvas, [EOS], MASK)
    spans = [[10, 2, None, None, 8, None], [10, None, None, None, 8, None], [None, 2, None, None, EOS, None]]
    tokens = torch.tensor([[5] + [MASK if t is None else t for t in span] for span in spans])
    rows, columns = torch.tensor([2, 0, 1]), torch.tensor([[0, 1, 2, 3, 6], [1, 2, 4, 5, 6], [6, 5, 4, 3, 2]])
    logits = torch.randn(3, 5, 14)
    out = guard.restrict(logits.clone(), rows, columns, tokens)
    assert torch.equal(guard.restrict(logits.clone(), rows, columns, tokens), out)
    for j, row in enumerate(rows.tolist()):
        left, right = guard.sets(layouts[row], spans[row])
        for c, column in enumerate(columns[j].tolist()):
            i = column - 1
            if i < 0 or spans[row][i] is not None:
                assert torch.equal(out[j, c], logits[j, c])
                continue
            allowed = torch.zeros(14, dtype=torch.bool)
            allowed[:11] = torch.from_numpy(guard.allowed(layouts[row], left, right, i))
            assert (
                torch.equal(out[j, c][allowed], logits[j, c][allowed]) and (out[j, c][~allowed] == float("-inf")).all()
            )


# -- every sampler, on the bundled models -----------------------------------------------------------------------------

PROMPTS = [
    "Sort the list: 14 7 9\n",
    "Reverse the list: 3 17 0 8\n",
    "Ben has 3 apples. He gets 5 more from Ann. He doubles them. How many apples does Ben have now?\n",
]
NUMBERS = Regex(r"[0-9]+( [0-9]+)*")
ANSWER = JsonSchema({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})
TEMPLATE = ["The answer is", Hole(2, Regex(r" [0-9]+")), ".", Hole(3)]
LENGTH = 24  # (max_new_tokens)
SUM = Grammar('start: sum\nsum: NUM | "(" sum ")" | sum " + " sum\nNUM: /[0-9]+/')  # (context-free: parentheses)
SUM_TEMPLATE = ["The answer is (", Hole(3), " + ", Hole(3), ")"]  # (a word of SUM_GRAMMAR_TEMPLATE, filled)
SAMPLERS = {
    "llada": ["llada", "threshold", "factor", "eb", "localleap", "credit", "adablock", "ete", "prophet", "sched"],
    "dream": ["dream", "threshold", "sched"],
    "sdar": ["sdar", "threshold", "s2d2"],
    "llada2": ["llada2", "threshold", "llada21"],
    "wedlm": ["wedlm"],
    "fast_dllm_v2": ["fast_dllm_v2"],
}
SETTINGS = {"prophet": {"answer_offset": 0}, "sched": {"tau_high": 3.0, "tau_low": 1.0}}
CELLS = [(family, name) for family, names in SAMPLERS.items() for name in names]


@functools.cache
def _model(family):
    return dllm.load(f"tiny-{family}", device="cpu", dtype=torch.float32)


def _sampler(family, name):
    if name == family:
        return dllm.samplers.reference(family)
    return dllm.samplers.get(name, **SETTINGS.get(name, {}))


def _generate(model, sampler, prompts, **kw):
    blocks = not model.attention.block_causal and sampler.window is None  # (a stream sampler has a window)
    kw = {"max_new_tokens": LENGTH, **({"block_size": 8} if blocks else {}), **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DllmWarning)
        return sampler.generate(model, prompts, **kw)


@pytest.mark.parametrize("family,name", CELLS)
def test_every_sampler_writes_only_valid_text(family, name):
    """A regex, a JSON schema, a grammar and a template, greedy and sampled: every row matches (the grammar's: or
    ends "length" with a prefix of a word; the template's text byte-identical), and a row's output is the same
    alone as in the batch."""
    model, sampler = _model(family), _sampler(family, name)
    for temperature in (0.0, 1.0):
        kw = {"temperature": temperature, "seed": 3}
        for constraint in (NUMBERS, ANSWER, SUM):
            out = _generate(model, sampler, PROMPTS, constraint=constraint, **kw)
            _assert_valid(model, constraint, out)
            alone = _generate(model, sampler, PROMPTS[1], constraint=constraint, **kw)
            assert alone.texts[0] == out.texts[1] and alone.finish_reasons[0] == out.finish_reasons[1]
        out = _generate(model, sampler, PROMPTS, template=TEMPLATE, max_new_tokens=None, **kw)
        for text, fills in zip(out.texts, out.fills):
            assert text == f"The answer is{fills[0]}.{fills[1]}" and re.fullmatch(r" [0-9]+", fills[0]), out.texts
        _assert_sum_template(_generate(model, sampler, PROMPTS, constraint=SUM_GRAMMAR_TEMPLATE, **_SUM_KW, **kw))


SUM_GRAMMAR_TEMPLATE = Grammar('start: "The answer is " sum\n' + SUM.source.split("\n", 1)[1])
_SUM_KW = {"template": SUM_TEMPLATE, "max_new_tokens": None}


def _assert_sum_template(out):
    """A grammar and a template together: the template's text kept, its holes filled so that the whole text is a
    word of the grammar (never "length": the run starts with a witness and keeps one)."""
    for text, fills in zip(out.texts, out.fills):
        assert text == "The answer is ({} + {})".format(*fills), out.texts
        assert SUM_GRAMMAR_TEMPLATE.check(text), out.texts


def _assert_valid(model, constraint, out):
    """Every text matches ``constraint``; a grammar's may instead end "length", its tokens a prefix of a word."""
    for row, (text, reason) in enumerate(zip(out.texts, out.finish_reasons)):
        if constraint.check(text):
            continue
        assert not constraint.regular and reason == "length", (constraint, row, out.texts, out.finish_reasons)
        import llguidance

        from dllm.constraints.grammar import ll_tokenizer
        from dllm.constraints.tokens import surfaces

        matcher = llguidance.LLMatcher(ll_tokenizer(model.tokenizer, surfaces(model.tokenizer), model.eos_ids),
                                       constraint.grammar())  # fmt: skip
        span = out.sequences[row, out.prompt_width : out.prompt_width + LENGTH].tolist()
        written = list(itertools.takewhile(lambda t: t not in model.eos_ids, span))
        assert matcher.try_consume_tokens(written) == len(written), (row, text)


def _adversary(model, favoured: list[int]):
    """``model`` whose logits favour ``favoured`` tokens by a wide margin at every slot (ids that break the
    constraint: the guard must keep them out)."""
    head = model.head

    def biased(hidden, columns, **kw):
        logits = head(hidden, columns, **kw)
        bonus = torch.zeros(logits.shape[-1], dtype=logits.dtype)
        bonus[favoured] = 50.0
        return logits + bonus

    return biased


ADVERSARIAL = [("llada", "llada"), ("llada", "threshold"), ("dream", "dream"), ("sdar", "sdar"), ("wedlm", "wedlm")]


@pytest.mark.parametrize("family,name", ADVERSARIAL)
def test_logits_that_favour_invalid_tokens_still_give_valid_text(family, name, monkeypatch):
    model, sampler = _model(family), _sampler(family, name)
    tokenizer = model.tokenizer
    favoured = [model.eos_ids[0], *tokenizer(" apples The", add_special_tokens=False)["input_ids"]]
    monkeypatch.setattr(model, "head", _adversary(model, favoured))
    for constraint in (NUMBERS, ANSWER, SUM):
        for temperature in (0.0, 1.0):
            out = _generate(model, sampler, PROMPTS, constraint=constraint, temperature=temperature, seed=0)
            _assert_valid(model, constraint, out)
    _assert_sum_template(_generate(model, sampler, PROMPTS, constraint=SUM_GRAMMAR_TEMPLATE, **_SUM_KW))


def test_a_template_keeps_its_text_and_fills_its_holes():
    model, sampler = _model("llada"), dllm.samplers.get("llada")
    # (holes the size of the model's own answer: a model trained with EOS only past its answer, as LLaDA, rarely
    # writes the EOS filler of a longer hole in the middle of its text)
    template = ["12 - 4 =", Hole(1), "\n", Hole(5), "\nThe answer is", Hole(2, Regex(r" [0-9]+")), "."]
    prompt = "Ann has 12 pens. She gives 4 to Eva. She doubles them. How many pens does Ann have now?\n"
    out = _generate(model, sampler, prompt, template=template, max_new_tokens=None)
    (text,), (fills,) = out.texts, out.fills
    assert text == f"12 - 4 ={fills[0]}\n{fills[1]}\nThe answer is{fills[2]}."
    assert fills == [" 8", "8 * 2 = 16", " 16"]  # what the model solves, in its holes
    ids = lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert len(ids(fills[1])) <= 5 and out.tokens[0] == sum(len(ids(f)) for f in fills)
    free = _generate(model, sampler, prompt, max_new_tokens=32)
    assert "The answer is 16." in free.texts[0]  # (the same answer without the template)
    # under a grammar (context-free: the holes proved by witnesses), the model's own first line where it fits
    grammar = Grammar('start: sum " = " NUM\nsum: NUM | "(" sum ")" | sum " + " sum | sum " - " sum\nNUM: /[0-9]+/')
    prompt = "Ben has 3 apples. He gets 5 more from Ann. How many apples does Ben have now?\n"
    out = _generate(model, sampler, prompt, template=[Hole(4), " =", Hole(2)], constraint=grammar, max_new_tokens=None)
    free = _generate(model, sampler, prompt, max_new_tokens=16)
    assert out.texts == ["3 + 5 = 8"] and free.texts[0].startswith("3 + 5 = 8\n")


def test_what_cannot_be_met_is_a_clear_error_before_the_first_forward(monkeypatch):
    model, sampler = _model("llada"), dllm.samplers.get("threshold")
    monkeypatch.setattr(model, "hidden", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(dllm.ConfigError, match="no text of the constraint .* fits in the 8 generated slots"):
        _generate(model, sampler, PROMPTS[0], constraint=Regex(r"(7 ){9}"), max_new_tokens=8)
    with pytest.raises(dllm.ConfigError, match="tokenizer cannot write any text of the constraint"):
        _generate(model, sampler, PROMPTS[0], constraint=Regex(r"zqxj"))
    with pytest.raises(dllm.ConfigError, match="template takes 13 slots .* max_new_tokens=8"):
        _generate(model, sampler, PROMPTS[0], template=["The answer is", Hole(10)], max_new_tokens=8)
    with pytest.raises(dllm.ConfigError, match="holds pieces this tokenizer cannot write \\(unknown or special tokens"):
        _generate(model, sampler, PROMPTS[0], template=["Zebra crossing", Hole(2)], max_new_tokens=None)
    with pytest.raises(dllm.ConfigError, match="constraint must be a dllm.constraints constraint"):
        _generate(model, sampler, PROMPTS[0], constraint=r"[0-9]+")
    with pytest.raises(dllm.ConfigError, match="a template needs at least one dllm.Hole"):
        _generate(model, sampler, PROMPTS[0], template=["just text"])
    with pytest.raises(dllm.ConfigError, match="Hole.max_tokens must be a positive integer"):
        Hole(0)
    with pytest.raises(dllm.ConfigError, match="is not a regular expression"):
        Regex("(unclosed")
    with pytest.raises(dllm.ConfigError, match="cannot be compiled by outlines-core .* without look-around"):
        _generate(model, sampler, PROMPTS[0], constraint=Regex("(?=7)7"))
    with pytest.raises(dllm.ConfigError, match="the schema is not JSON"):
        JsonSchema("{not json")
    with pytest.raises(dllm.ConfigError, match='llguidance cannot compile it: .*unknown name: "sums"'):
        Grammar("start: sums")
    with pytest.raises(dllm.ConfigError, match="holes take no constraint of their own under a Grammar"):
        _generate(model, sampler, PROMPTS[0], constraint=SUM, template=TEMPLATE, max_new_tokens=None)
    with pytest.raises(dllm.ConfigError, match="no filling of the template's holes makes its text a word of the gr"):
        _generate(model, sampler, PROMPTS[0], constraint=SUM, template=["(", Hole(3), ") )"], max_new_tokens=None)

    assert Json().check('{"a": [1, {"b": null}]}') and not Json().check("[1]")


def test_the_cli_takes_a_regex_a_json_schema_and_a_template(capsys, tmp_path):
    from dllm.cli import main

    prompt = "Ben has 3 apples. He gets 5 more from Ann. He doubles them. How many apples does Ben have now?\n"
    template = "3 + 5 ={{1}}\n{{5}}\nThe answer is{{2: [0-9]+}}."
    assert main(["generate", prompt, "--template", template, "--jsonl"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["text"] == "3 + 5 ={}\n{}\nThe answer is{}.".format(*line["fills"])
    assert line["fills"] == [" 8", "8 * 2 = 16", " 16"]  # (as generate(template=[...]) solves it)
    schema, prompts = tmp_path / "schema.json", tmp_path / "prompts.txt"
    schema.write_text(ANSWER.schema)
    prompts.write_text("".join(PROMPTS))
    args = ["generate", "--prompts", str(prompts), "--sampler", "threshold", "--max-new-tokens", "24", "--jsonl"]
    grammar = tmp_path / "sum.lark"
    grammar.write_text(SUM.source)
    cases = {"--regex": NUMBERS, "--json-schema": ANSWER, "--grammar": SUM}
    for given in (["--regex", NUMBERS.pattern], ["--json-schema", str(schema)], ["--json-schema", ANSWER.schema],
                  ["--grammar", str(grammar)]):  # fmt: skip
        assert main([*args, "--block-size", "8", *given]) == 0
        texts = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
        constraint = cases[given[0]]
        assert texts == _generate(_model("llada"), dllm.samplers.get("threshold"), PROMPTS, constraint=constraint).texts
        assert all(constraint.check(t) for t in texts) or not constraint.regular
    for bad, said in [
        (["--template", "The answer is {{x}}."], "'{{x}}' is not a hole"),
        (["--template", "no holes"], "needs at least one dllm.Hole"),
        (["--json-schema", "missing.json"], "neither a file nor a JSON schema"),
        (["--regex", "(unclosed"], "is not a regular expression"),
        (["--grammar", "missing.lark"], "--grammar missing.lark: no such file"),
    ]:
        assert main(["generate", prompt, *bad]) == 2
        assert said in capsys.readouterr().err


def test_the_bench_reports_validity_accuracy_and_cost(tmp_path, capsys):
    from dllm.bench import structured

    out = tmp_path / "structured.md"
    args = ["--models", "tiny-llada", "--n", "4", "--parallelism", "1,8", "--temperatures", "0,2", "--vocab", "3000"]
    assert structured.main([*args, "--canvas", "64", "--hidden", "64", "--out", str(out)]) == 0
    report = out.read_text()
    assert report.count("| tiny-llada | arith |") == 4 and report.count("| tiny-llada | listops |") == 4
    assert "under the constraint every text is valid in every cell" in report
    assert "| **the constraint in all** |" in report and "the check of a commit" in report


def test_the_bench_cost_part_runs_alone_on_a_named_device(tmp_path):
    """``--cost-only`` (the GPU check's step): the cost section alone, the device named, no validity table."""
    from dllm.bench import structured

    out = tmp_path / "structured.md"
    args = ["--cost-only", "--device", "cpu", "--vocab", "3000", "--canvas", "64", "--hidden", "64"]
    assert structured.main([*args, "--out", str(out)]) == 0
    report = out.read_text()
    assert "| **the constraint in all** |" in report and "the logits on the CPU" in report
    assert "| model | task |" not in report


def test_the_best_canvas_search_equals_brute_force():
    """The renoise process's constrained argmax: the Viterbi pass finds the highest-scoring path between two state
    sets, equal to enumerating every path of a random automaton (or says there is none)."""
    from dllm.constraints.automaton import DEAD
    from dllm.constraints.guard import _viterbi

    rng = np.random.default_rng(0)
    for _ in range(200):
        states, classes, n = (int(x) for x in (rng.integers(2, 5), rng.integers(2, 4), rng.integers(1, 4)))
        table = rng.integers(-1, states, size=(states, classes))
        table[table < 0] = DEAD
        left, right = rng.random(states) < 0.5, rng.random(states) < 0.5
        best = [np.where(rng.random(classes) < 0.8, rng.normal(size=classes), -np.inf) for _ in range(n)]

        def value(path, table=table, left=left, right=right, best=best):
            values = []
            for state in np.nonzero(left)[0]:
                total = 0.0
                for i, c in enumerate(path):
                    state = table[state, c]
                    if state == DEAD:
                        break
                    total += best[i][c]
                else:
                    values.append(total if right[state] else -np.inf)
            return max(values, default=-np.inf)

        top = max(value(path) for path in itertools.product(range(classes), repeat=n))
        if np.isfinite(top):
            assert value(_viterbi(table, left, right, best)) == pytest.approx(top)
        else:
            with pytest.raises(RuntimeError, match="no text of the constraint fits"):
                _viterbi(table, left, right, best)


def test_the_best_canvas_is_the_highest_scoring_valid_one_after_the_committed_canvases():
    """Guard.best on the toy vocabulary: the canvas after some committed slots is the highest-scoring completion
    (brute force over every filling), whatever ids past the tokenizer's vocabulary score."""
    rng = random.Random(2)
    surfaces = _surfaces(False)
    for _ in range(60):
        regex = rng.choice(REGEXES)
        automaton = build(regex, surfaces, [EOS])
        n, before = rng.randint(2, 4), rng.randint(0, 2)
        layout = Layout.free(before + n + rng.randint(0, 1))
        guard = _guard(automaton, layout)
        prefix = [rng.choice(ALPHABET) for _ in range(before)]
        tokens = torch.tensor([prefix + [MASK] * (len(layout.kinds) - before)])
        if not guard.completable(layout, [*prefix, *[None] * (len(layout.kinds) - before)]):
            continue
        scores = torch.randn(1, n, 14, dtype=torch.float64)
        scores[..., 11:] = 100.0  # (ids no token writes: never chosen)
        got = guard.best(scores, torch.tensor([0]), before, tokens)[0].tolist()

        def total(fill, prefix=prefix, scores=scores):
            return sum(float(scores[0, i, t]) for i, t in enumerate(fill))

        tail = len(layout.kinds) - before - n
        fits = [
            fill for fill in itertools.product(ALPHABET, repeat=n)
            if _brute([*prefix, *fill, *[None] * tail], None, layout, surfaces,
                      lambda text, holes, regex=regex: re.fullmatch(regex, text) is not None)[1]
        ]  # fmt: skip
        assert max(total(f) for f in fits) == pytest.approx(total(got)) and tuple(got) in fits


def test_the_best_canvas_keeps_a_templates_text_and_is_the_highest_scoring_filling():
    """Guard.best under a template (its automaton with hole markers, holes' own constraints, a constraint on the
    whole text): the canvas keeps the template's text and is the highest-scoring valid filling of its holes, EOS
    filler included (brute force), after committed slots."""
    rng = random.Random(3)
    surfaces = _surfaces(False)
    checked = 0
    for _ in range(400):
        size = rng.randint(2, 4)
        base = _layouts(rng, size, True, False)
        literal = [rng.choice(list(TOY)) if kind == LITERAL else None for kind in base.kinds]
        layout = Layout(base.kinds, base.holes, base.ends, literal)
        automaton, valid = _random_template(rng, layout, literal, surfaces)
        before = rng.randint(0, size - 1)
        n = rng.randint(1, size - before)
        prefix = [t if t is not None else rng.choice(ALPHABET) for t in literal[:before]]
        rest = literal[before + n :]
        if not _brute([*prefix, *literal[before:]], None, layout, surfaces, valid)[1]:
            continue
        guard = _guard(automaton, layout)
        tokens = torch.tensor([prefix + [t if t is not None else MASK for t in literal[before:]]])
        scores = torch.randn(1, n, 14, dtype=torch.float64)
        scores[..., 11:] = 100.0  # (ids no token writes: never chosen)
        got = guard.best(scores, torch.tensor([0]), before, tokens)[0].tolist()
        free = [k for k in range(n) if literal[before + k] is None]
        fits = []
        for fill in itertools.product(ALPHABET, repeat=len(free)):
            canvas = list(literal[before : before + n])
            for k, t in zip(free, fill):
                canvas[k] = t
            if _brute([*prefix, *canvas, *rest], None, layout, surfaces, valid)[1]:
                fits.append(tuple(canvas))

        def total(canvas, scores=scores):
            return sum(float(scores[0, k, t]) for k, t in enumerate(canvas))

        assert tuple(got) in fits, (layout, prefix, got)
        assert total(got) == pytest.approx(max(total(f) for f in fits))
        checked += 1
    assert checked > 30


def test_the_renoise_process_writes_the_best_canvas_the_constraint_allows(tmp_path):
    """DiffusionGemma (a random tiny checkpoint): each step's argmax canvas is the best one the constraint allows,
    so the output matches it, over one canvas or several; a row alone equals it in the batch; a grammar's left to
    right; a template too."""
    from dllm.engine.renoise import Renoising

    model = dllm.load(make_tiny_checkpoint(tmp_path / "gemma", "diffusion_gemma"))
    sampler = dllm.samplers.reference("diffusion_gemma")
    prompts = ["1 2 3", "4 5", "a b"]
    for constraint, length in ((NUMBERS, 12), (Regex(r"(ab|ba)+ [0-9]"), 24)):
        for seed in (1, 2):  # (its temperatures are its own schedule: it samples)
            kw = {"max_new_tokens": length, "seed": seed, "constraint": constraint}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DllmWarning)
                out = sampler.generate(model, prompts, **kw)
                alone = sampler.generate(model, prompts[2], **kw)
            assert all(constraint.check(text) for text in out.texts), out.texts
            assert alone.texts[0] == out.texts[2]
    for seed in (1, 2):  # a grammar: each step's argmax canvas a prefix of a word, left to right
        kw = {"max_new_tokens": LENGTH, "seed": seed, "constraint": SUM}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DllmWarning)
            out = sampler.generate(model, prompts, **kw)
            alone = sampler.generate(model, prompts[2], **kw)
        _assert_valid(model, SUM, out)
        assert any(SUM.check(text) for text in out.texts) and all(text for text in out.texts)
        assert (alone.texts[0], alone.finish_reasons[0]) == (out.texts[2], out.finish_reasons[2])
    # a template: its text in every canvas the decoder reads (never renoised), its holes filled under their own and
    # the whole text's constraints, over its own length and over several canvases; a row alone equals it in the batch
    template = ["The answer is", Hole(3, Regex(r" [0-9]+")), ". So", Hole(4), "."]
    literal, at = {}, 0
    for piece in template:
        if isinstance(piece, str):
            for t in model.tokenizer(piece, add_special_tokens=False)["input_ids"]:
                literal[at], at = t, at + 1
        else:
            at += piece.max_tokens
    inputs = []
    step = Renoising.take_step

    def take_step(self, iteration):  # (the canvas the next forward reads)
        out = step(self, iteration)
        inputs.append((self.block * self.length, self.x.clone()))
        return out

    for length in (None, 40):
        kw = {"max_new_tokens": length, "seed": 3, "template": template, "constraint": Regex(r"[^x]*")}
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
            warnings.simplefilter("ignore", DllmWarning)
            patch.setattr(Renoising, "take_step", take_step)
            out = sampler.generate(model, prompts, **kw)
            alone = sampler.generate(model, prompts[1], **kw)
        for text, fills in zip(out.texts, out.fills):
            assert text == f"The answer is{fills[0]}. So{fills[1]}.", text
            assert re.fullmatch(r" [0-9]+", fills[0]), fills
        assert (alone.texts[0], alone.fills[0]) == (out.texts[1], out.fills[1])
    assert {offset for offset, _ in inputs} == set(range(0, 40, model.block_size))  # (every canvas)
    for length in (None, 40):  # a grammar with a template: every canvas keeps a witness, so the text is a word
        kw = {"max_new_tokens": length, "seed": 3, "template": SUM_TEMPLATE, "constraint": SUM_GRAMMAR_TEMPLATE}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DllmWarning)
            out = sampler.generate(model, prompts, **kw)
            alone = sampler.generate(model, prompts[1], **kw)
        _assert_sum_template(out)
        assert (alone.texts[0], alone.fills[0]) == (out.texts[1], out.fills[1])
    for offset, x in inputs:
        for i, t in literal.items():
            if offset <= i < offset + x.shape[1]:
                assert (x[:, i - offset] == t).all()
