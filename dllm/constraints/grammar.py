"""A context-free constraint's check of a run (:class:`GrammarGuard`): llguidance's exact matcher over each row's
committed prefix, and a *witness* for everything committed further right.

A regular constraint is checked exactly anywhere in the canvas (:mod:`dllm.constraints.guard`); whether a canvas
with holes can still be completed to a word of a context-free language has no fast exact answer (Mündler et al.,
arXiv 2508.10111, intersect a grammar with the holes' regular language at every commit). dllm keeps the sound
part of it: a commit is accepted only with a proof that the canvas can still be completed, a *witness* (a
filling of the masked slots up to the last committed one that `llguidance
<https://github.com/guidance-ai/llguidance>`_'s matcher reads, MIT; the engine behind vLLM's and SGLang's
structured output). With a template, the witness fills every hole and the whole text is a word of the grammar.

- The witness is found by a depth-first search over the masked slots from the row's first masked slot (its
  frontier), each slot trying the model's best tokens there first, then the last witness's token, a hole's EOS
  filler (or the end of a free text), and the lowest ids the matcher allows; it gives up after a budget of moves
  of the matcher (:data:`PROOF` for a commit, which may wait; :data:`SEARCH` where one must be found): sound, not
  complete.
- The frontier takes exactly the tokens the matcher allows after the committed prefix (EOS when the text so far is
  a word of the grammar; in a hole, its EOS filler); every masked slot after an EOS (of a free text, or in a hole
  after its filler) takes only EOS; the other masked slots are scored freely.
- A step's commits are accepted together when one witness proves them all (the usual case), else one by one in
  confidence order, each proved with those before it; the others wait, masked. A row whose commits all wait
  writes its frontier instead, with the witness's token there (the progress guarantee); a row that must commit its
  slots (a block's last step, an exit rule) writes each that fails with the witness's token.
- Without a template, the text may run out of slots before it is a word of the grammar: the row ends with a valid
  prefix and ``finish_reasons[i] == "length"``. A template's text always ends a word: the run starts only with a
  witness for its holes (else a ConfigError before the first forward).
- The renoise process (DiffusionGemma) writes no masks: each step's argmax canvas is the first witness of the
  search with the step's scores as the model's best tokens (:meth:`GrammarGuard.best`): greedy, each slot the
  best-scoring token that keeps a witness.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from dllm.constraints.guard import FREE, HOLE, TAIL, Layout, fixed_slots, with_changes
from dllm.core.errors import ConfigError

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SEARCH, PROOF = (512, 16), (64, 4)  # a witness search's moves of the matcher: (at first, per slot it fills), where
# one must be found (the start, a forced slot, the progress guarantee, the renoise canvas) and where a commit may wait
_BITMASK_MOVES = 8  # (a vocabulary bitmask of the allowed tokens counts as many moves)
_LOWEST = 4  # the lowest allowed ids a search tries last at a slot


def ll_tokenizer(tokenizer, surfaces, eos_ids):
    """llguidance's tokenizer of ``tokenizer`` from the bytes each token writes (``surfaces``), built once."""
    if surfaces.first:
        raise ConfigError(
            "a Grammar needs a tokenizer whose tokens write the same bytes wherever they are; this one drops the "
            "space that starts a text (LLaMA-2-style SentencePiece): use a Regex or JsonSchema constraint"
        )
    if tokenizer not in _TOKENIZERS:
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        _TOKENIZERS[tokenizer] = build_ll_tokenizer(surfaces, eos_ids, encode)
    return _TOKENIZERS[tokenizer]


def build_ll_tokenizer(surfaces, eos_ids, encode):
    """llguidance's tokenizer over ``surfaces`` (token id -> bytes; the others special), ``encode`` text -> ids."""
    import llguidance

    wrapper = llguidance.TokenizerWrapper.__new__(llguidance.TokenizerWrapper)  # (its fields, not a model's)
    wrapper.eos_token_id, wrapper.bos_token_id = int(eos_ids[0]), None
    wrapper.tokens = [surfaces.items.get(i, b"") for i in range(surfaces.vocab)]
    wrapper.special_token_ids = [i for i in range(surfaces.vocab) if i not in surfaces.items]
    wrapper.is_tokenizer_wrapper, wrapper._accepts_bytes, wrapper._gtokenizer = True, False, encode
    return llguidance.LLTokenizer(wrapper, n_vocab=surfaces.vocab, eos_token=[int(e) for e in eos_ids])


class _Spent(Exception):
    """A witness search ran out of its budget."""


class GrammarGuard:
    """The guard of a run under a context-free constraint (see the module docstring): ``grammar`` (llguidance's
    grammar text), one matcher per row of ``canvas``, each row's span laid out by its ``layouts`` entry (a
    template's, or :meth:`Layout.free`)."""

    def __init__(self, grammar: str, tokenizer, canvas, eos_ids, mask_id: int, layouts: list[Layout], surfaces=None):
        import llguidance

        self.mask_id, self.start, self.surfaces = mask_id, canvas.prompt_width, surfaces
        self.eos = set(int(e) for e in eos_ids)
        self.filler = int(eos_ids[0])
        self.vocab = tokenizer.vocab_size
        self.layouts = layouts
        self.ends = [self.start + len(layout.kinds) for layout in layouts]
        self.templated = [any(kind != FREE for kind in layout.kinds) for layout in layouts]
        self.text_ends = [layout.kinds.index(TAIL) if TAIL in layout.kinds else len(layout.kinds) for layout in layouts]
        self.matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in layouts]
        if self.matchers and self.matchers[0].is_error():
            raise ConfigError(f"the grammar does not compile: {self.matchers[0].get_error()}")
        self.read: list[list[int]] = [[] for _ in layouts]  # the tokens each row's matcher has read
        self.witnesses: list[dict[int, int]] = [{} for _ in layouts]  # each row's last witness: slot -> token
        self.hints: list[dict[int, torch.Tensor]] = [{} for _ in layouts]  # this step's scores: slot -> [V]
        self._fixed: dict[tuple, torch.Tensor] = {}
        self.eos_only = np.zeros(self.vocab, dtype=bool)  # (a masked slot after an EOS)
        self.eos_only[[e for e in self.eos if e < self.vocab]] = True
        self._budget, self._read = 0, 0  # (a witness search's moves left, tokens it has the matcher read)
        self._hinted: dict[tuple[int, int], tuple | None] = {}  # (:meth:`_hint`)

    def span(self, tokens: torch.Tensor, row: int) -> list[int | None]:
        """Row ``row``'s span (masked slots: None) from the canvas ``tokens`` [B, L]."""
        values = tokens[row, self.start : self.ends[row]].tolist()
        return [None if t == self.mask_id else t for t in values]

    def fixed(self, tokens: torch.Tensor) -> torch.Tensor:
        """bool [B, L]: the slots a template fixed (its text, the EOS past it), which nothing may rewrite."""
        return fixed_slots(self.layouts, self.start, tokens, self._fixed)

    # -- reading a row ------------------------------------------------------------------------------------------
    def _prefix(self, row: int, span: list, stop: int) -> tuple[list[int], bool, int] | None:
        """What the matcher reads of the committed slots ``0 .. stop`` of ``span``: (the tokens, whether a free text
        ended (an EOS), the hole whose EOS filler has begun (-1: none)); None where they break the layout (a token
        after the end of the text, content after a hole's filler)."""
        layout, read, ended, filler = self.layouts[row], [], False, -1
        for i in range(stop):
            token, kind = span[i], layout.kinds[i]
            if kind == TAIL or ended or (kind == HOLE and filler == layout.holes[i]):
                if token not in self.eos:
                    return None
            elif token in self.eos:
                if kind == FREE:
                    ended = True
                elif kind == HOLE:
                    filler = layout.holes[i]
                else:
                    return None
            else:
                read.append(token)
        return read, ended, filler

    def _step(self, row: int, i: int, token: int, ended: bool, filler: int) -> tuple[bool, int, int] | None:
        """Slot ``i`` of row ``row`` written with ``token`` after the state (``ended``, ``filler``): (the state after,
        tokens the matcher read: 0 or 1), None where the layout or the grammar refuses it."""
        layout, kind = self.layouts[row], self.layouts[row].kinds[i]
        if kind == TAIL or ended or (kind == HOLE and filler == layout.holes[i]):
            return (ended, filler, 0) if token in self.eos else None
        if not 0 <= token < self.vocab:  # (the mask id, ids past the tokenizer's: never text)
            return None
        if token in self.eos:
            if kind == FREE:
                return (True, filler, 0) if self.matchers[row].is_accepting() else None
            return (ended, layout.holes[i], 0) if kind == HOLE else None
        if self.matchers[row].try_consume_tokens([token]) != 1:
            return None
        self._read += 1
        return ended, filler, 1

    def _back(self, row: int, count: int) -> None:
        """Roll row ``row``'s matcher back ``count`` tokens of a search."""
        if count:
            self.matchers[row].rollback(count)
            self._read -= count

    def _move_to(self, row: int, read: list[int]) -> bool:
        """Move row ``row``'s matcher from what it read to ``read`` (rolling back to their common prefix); False,
        and the matcher where it was, when it refuses a token of ``read``."""
        matcher, before = self.matchers[row], self.read[row]
        common = 0
        for a, b in zip(before, read):
            if a != b:
                break
            common += 1
        if common < len(before):
            matcher.rollback(len(before) - common)
        taken = matcher.try_consume_tokens(read[common:]) if len(read) > common else 0
        if taken == len(read) - common:
            self.read[row] = list(read)
            return True
        matcher.rollback(taken)
        matcher.consume_tokens(before[common:])
        return False

    def _sync(self, row: int, span: list) -> tuple[int, bool, int]:
        """(``span``'s frontier: its first masked slot, the state there), row ``row``'s matcher moved to its prefix."""
        frontier = span.index(None) if None in span else len(span)
        prefix = self._prefix(row, span, frontier)
        if prefix is None or not self._move_to(row, prefix[0]):
            raise RuntimeError(f"row {row}: the matcher refuses a committed token ({self.matchers[row].get_error()})")
        return frontier, prefix[1], prefix[2]

    def _allowed(self, row: int, i: int, ended: bool, filler: int) -> np.ndarray:
        """bool [V]: the tokens masked slot ``i`` may take right after the matcher's prefix (the frontier)."""
        layout = self.layouts[row]
        only_eos = ended or layout.kinds[i] == TAIL or (layout.kinds[i] == HOLE and filler == layout.holes[i])
        if only_eos:
            allowed = np.zeros(self.vocab, dtype=bool)
        else:
            bits = np.frombuffer(self.matchers[row].compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        eos = only_eos or layout.kinds[i] == HOLE or self.matchers[row].is_accepting()
        allowed[[e for e in self.eos if e < self.vocab]] = eos
        return allowed

    # -- the witness ------------------------------------------------------------------------------------------------
    def witness(self, row: int, span: list, end: int = 0, budget: tuple[int, int] = SEARCH) -> dict[int, int] | None:
        """A filling of the masked slots of ``span`` (row ``row``'s, None masked) from its frontier up to its last
        committed slot (at least up to ``end``; with a template, to its end) that the grammar reads (a template's
        text then a word of it): slot -> token; None where the search finds none within its budget. The matcher is
        left at the frontier."""
        n = len(span)
        frontier = span.index(None) if None in span else n
        prefix = self._prefix(row, span, frontier)
        if prefix is None or not self._move_to(row, prefix[0]):
            return None
        matcher = self.matchers[row]
        _, ended, filler = prefix
        if ended and not matcher.is_accepting():
            return None
        if self.templated[row]:
            stop = self.text_ends[row]
        else:
            last = max((i for i in range(frontier, n) if span[i] is not None), default=frontier - 1)
            stop = min(n, max(last + 1, end))
        self._budget, self._read = budget[0] + budget[1] * max(0, stop - frontier), 0
        frames = []  # per masked slot on the path: [slot, the state before it, its candidates, its token, tokens read]
        try:
            at = self._through(row, span, frontier, stop, ended, filler)
            if at is None:
                return None
            i, ended, filler, _ = at
            while True:
                if i >= stop and self._complete(row, ended):
                    return {frame[0]: frame[3] for frame in frames}
                if i < stop:
                    frames.append([i, (ended, filler), self._candidates(row, i, ended, filler), None, 0])
                moved = False
                while frames and not moved:  # the next candidate of the deepest slot, backtracking as they run out
                    frame = frames[-1]
                    self._back(row, frame[4])
                    frame[4] = 0
                    for token in frame[2]:
                        self._spend(1)
                        state = self._step(row, frame[0], token, *frame[1])
                        if state is None:
                            continue
                        at = self._through(row, span, frame[0] + 1, stop, state[0], state[1])
                        if at is None:
                            self._back(row, state[2])
                            continue
                        i, ended, filler, after = at
                        frame[3], frame[4] = token, state[2] + after
                        moved = True
                        break
                    else:
                        frames.pop()
                if not moved:
                    return None
        except _Spent:
            return None
        finally:
            self._back(row, self._read)

    def _through(self, row: int, span: list, i: int, stop: int, ended: bool, filler: int):
        """Read the committed slots of ``span`` from ``i`` to its next masked slot before ``stop``: (that slot, the
        state there, tokens read), None (nothing left read) where one is refused."""
        read = 0
        while i < stop and span[i] is not None:
            self._spend(1)
            state = self._step(row, i, span[i], ended, filler)
            if state is None:
                self._back(row, read)
                return None
            ended, filler, read = state[0], state[1], read + state[2]
            i += 1
        return i, ended, filler, read

    def _complete(self, row: int, ended: bool) -> bool:
        """Whether a witness may end here: a free text always (it may go on, or end "length"), a template's text
        when it is a word of the grammar."""
        return not self.templated[row] or ended or self.matchers[row].is_accepting()

    def _spend(self, moves: int) -> None:
        self._budget -= moves
        if self._budget < 0:
            raise _Spent

    def _candidates(self, row: int, i: int, ended: bool, filler: int):
        """The tokens a search tries at masked slot ``i`` (with the matcher at the state before it), in order: the
        model's best (this step's scores), the best-scoring one the matcher allows, the last witness's, EOS (a
        hole's filler, the end of a free text), the lowest allowed ids (each a bitmask of the vocabulary: only
        where the first fail)."""
        layout = self.layouts[row]
        if ended or layout.kinds[i] == TAIL or (layout.kinds[i] == HOLE and filler == layout.holes[i]):
            yield self.filler
            return
        hint = self._hint(row, i)
        tried = set()
        if hint is not None:
            for token in hint[1]:
                tried.add(token)
                yield token
        allowed = None
        if hint is not None:
            self._spend(_BITMASK_MOVES)
            allowed = np.flatnonzero(self._allowed(row, i, ended, filler))
            if allowed.size:
                best = int(allowed[hint[0][allowed].argmax()])
                if best not in tried:
                    tried.add(best)
                    yield best
        for token in (self.witnesses[row].get(i), self.filler):
            if token is not None and token not in tried:
                tried.add(token)
                yield token
        if allowed is None:
            self._spend(_BITMASK_MOVES)
            allowed = np.flatnonzero(self._allowed(row, i, ended, filler))
        yield from [t for t in allowed[: _LOWEST + len(tried)].tolist() if t not in tried][:_LOWEST]

    def _hint(self, row: int, i: int) -> tuple[np.ndarray, list[int]] | None:
        """Slot ``i``'s scores this step (float [V] on the host) and its best token, made once (None: not scored)."""
        key = (row, i)
        if key not in self._hinted:
            scores = self.hints[row].get(i)
            if scores is None:
                self._hinted[key] = None
            else:
                values = scores[: self.vocab].float().cpu().numpy()
                self._hinted[key] = values, [int(values.argmax())]
        return self._hinted[key]

    # -- the loop's questions -----------------------------------------------------------------------------------
    def check_start(self, tokens: torch.Tensor, blank: bool = False) -> None:
        """A ConfigError before the first forward when no text of the grammar can start (``blank``: the span is not
        written yet, as the renoise process's noise), or no filling of a template's holes was found that makes its
        text a word of the grammar."""
        for row, layout in enumerate(self.layouts):
            span = list(layout.tokens) if blank else self.span(tokens, row)
            if self.templated[row]:
                found = self.witness(row, span)
                if found is None:
                    raise ConfigError(
                        f"no filling of the template's holes makes its text a word of the grammar (none found by a "
                        f"search of {SEARCH[0] + SEARCH[1] * len(layout.kinds)} steps): check the template's text "
                        "against the grammar, or give its holes more tokens"
                    )
                self.witnesses[row] = found
                continue
            frontier, ended, filler = (0, False, -1) if blank else self._sync(row, span)
            if frontier == 0 and not self._allowed(row, 0, ended, filler).any():
                raise ConfigError(
                    "this model's tokenizer cannot write any text of the grammar (no token starts one): check the "
                    "grammar against the tokenizer's vocabulary"
                )

    def restrict(self, logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor):
        """``logits`` [n, K, V] with each row's frontier restricted to its allowed tokens, and every masked slot after
        an EOS to EOS, in place; the scores kept as the witness search's hints."""
        for j, row in enumerate(rows.tolist()):
            span = self.span(tokens, row)
            frontier, ended, filler = self._sync(row, span)
            hints, after_eos = {}, None
            for c, column in enumerate(columns[j].tolist()):
                i = column - self.start
                if not 0 <= i < len(span) or span[i] is not None:
                    continue
                hints[i] = logits[j, c]
                if i != frontier and after_eos is None:
                    after_eos = self._after_eos(self.layouts[row], span)
                if i == frontier:
                    allowed = self._allowed(row, i, ended, filler)
                elif after_eos[i]:
                    allowed = self.eos_only
                else:
                    continue
                logits[j, c, : self.vocab].masked_fill_(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
                logits[j, c, self.vocab :] = float("-inf")
            self.hints[row] = hints
        self._hinted.clear()
        return logits

    def _after_eos(self, layout: Layout, span: list) -> list[bool]:
        """Per slot: whether an EOS before it leaves it only EOS (a free text's end, its hole's filler)."""
        out, ended, filler = [], False, -1
        for kind, hole, token in zip(layout.kinds, layout.holes, span):
            out.append(ended if kind == FREE else kind == HOLE and filler == hole)
            if token in self.eos:
                ended, filler = ended or kind == FREE, hole if kind == HOLE else filler
        return out

    def accept(self, tokens, commit, proposals, confidence, must=None, refill=None):
        """The commits of a step that keep a witness for every row: (commit, proposals), as
        :meth:`dllm.constraints.guard.Guard.accept` (edits of decoded slots, the edit process's, included)."""
        commit, proposals = commit.clone(), proposals.clone()
        for row in commit.any(1).nonzero().squeeze(1).tolist():
            span, end = self.span(tokens, row), self.ends[row]
            columns = [c for c in commit[row].nonzero().squeeze(1).tolist() if c < end]
            written = {c - self.start: int(proposals[row, c]) for c in columns}
            if not written:
                continue
            found = self.witness(row, with_changes(span, written), budget=PROOF)
            if found is not None:  # (the usual case: every commit of the step proved together)
                self.witnesses[row] = found
                continue
            forced = must is not None and bool(must[row])
            kept: dict[int, int] = {}
            order = sorted(columns, key=lambda c: -float(confidence[row, c])) if confidence is not None else columns
            for column in order:
                i = column - self.start
                found = self.witness(row, with_changes(span, kept | {i: written[i]}), budget=PROOF)
                if found is not None:
                    kept[i], self.witnesses[row] = written[i], found
                    continue
                commit[row, column] = False
                if forced:  # the witness's token there (a witness reaching this slot)
                    token = self._witness_token(row, with_changes(span, kept), i)
                    if token is not None and refill is not None:
                        token = self._refill(refill, row, column, token)
                    if token is not None:
                        kept[i], proposals[row, column], commit[row, column] = token, token, True
            frontier = span.index(None) if None in span else len(span)
            proposed = any(span[i] is None for i in written)  # (the progress guarantee: every commit waits, so the
            if not kept and not forced and proposed and frontier < len(span) and refill is not None:  # frontier)
                token = self._witness_token(row, span, frontier)
                if token is not None and self._refill(refill, row, self.start + frontier, token) is not None:
                    commit[row, self.start + frontier], proposals[row, self.start + frontier] = True, token
        return commit, proposals

    def _witness_token(self, row: int, span: list, i: int) -> int | None:
        """The token masked slot ``i`` of ``span`` takes in a witness (a new one, found with the model's best tokens
        first; else the row's last one where it still proves the span; None: none), the row's witness now that
        one."""
        found = self.witness(row, span, end=i + 1)
        if found is None:
            witness = self.witnesses[row]
            kept = i in witness and all(span[k] is None for k in witness)
            if not kept or self.witness(row, with_changes(span, witness)) is None:
                return None
            found = witness
        self.witnesses[row] = found
        return found.get(i)

    def _refill(self, refill, row: int, column: int, token: int) -> int | None:
        """The loop's ``refill`` of slot ``column`` allowed ``token`` alone (None: the slot is not scored); this step's
        hints kept (its scoring restricts, and so replaces them, for that slot alone)."""
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        allowed[token] = True
        hints = self.hints[row]
        try:
            return refill(row, column, allowed)
        finally:
            if self.hints[row] is not hints:
                self.hints[row] = hints
                self._hinted.clear()

    def best(self, scores: torch.Tensor, rows: torch.Tensor, start: int, tokens: torch.Tensor) -> torch.Tensor:
        """The renoise process's argmax canvas under the grammar: token ids [n, W] for the canvas columns ``start ..
        start + W`` of the batch rows ``rows``, the first witness the search finds with ``scores`` [n, W, V] as the
        model's best tokens (each slot left to right the best-scoring token that keeps one), after the canvases
        before it in ``tokens`` and with a template's text. Greedy, not the best canvas; without a template a row
        may run out of slots (``finish_reasons`` "length")."""
        out = scores.argmax(-1)
        for j, row in enumerate(rows.tolist()):
            layout = self.layouts[row]
            i0 = start - self.start
            n = min(scores.shape[1], len(layout.kinds) - i0)
            if n <= 0:
                continue
            span = self.span(tokens, row)[:i0] + list(layout.tokens[i0:])  # (from here: the template's text only)
            self.hints[row] = {i0 + k: scores[j, k] for k in range(n)}
            self._hinted.clear()
            found = self.witness(row, span, end=i0 + n)
            if found is None:
                raise RuntimeError(f"row {row}: no canvas keeps a witness (the guard let an uncompletable one through)")
            self.witnesses[row] = found
            chosen = [found.get(i0 + k, span[i0 + k]) for k in range(n)]
            out[j, :n] = torch.tensor([self.filler if t is None else t for t in chosen], device=out.device)
        return out
