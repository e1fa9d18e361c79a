"""The token-level automaton of a regular constraint, and the exact check of a canvas against it.

A regular constraint (a regex; a JSON schema without recursion, as a regex) is compiled by outlines-core into a DFA
over the tokenizer's tokens (``outlines_core.Index``: the transitions of every state by every token whose bytes
keep the text a prefix of the language). :class:`Automaton` keeps it in the form a canvas check needs:

- tokens with the same transitions from every state form a class (a vocabulary of 128k tokens has a few thousand),
  so a transition is ``table[state, class]`` and a slot's allowed tokens are a mask over classes, spread to the
  vocabulary at the end;
- the end of the text: EOS (any of the model's EOS ids) goes from an accepting state to ``DONE``, and from ``DONE``
  only EOS again, so a canvas of fixed length holds a word of the language followed by EOS fill (or exactly fills
  it); every other special token (the mask, BOS, ...) is never allowed.

:class:`dllm.constraints.guard.Guard` checks each row's generated span against it, exact for any pattern of
committed and masked slots, in any commit order: the states reachable from the start reading the span from the
left (a masked slot: any token), the states from which an accepting end is reachable reading it from the right,
and so a masked slot's allowed tokens: those leading from a state reachable on its left to a state completable on
its right (DINGO's dynamic programme, arXiv 2505.23061, over a whole canvas instead of a block after a prefix).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from dllm.core.errors import ConfigError

DEAD = -1
_MOVES_BYTES = 8 << 20  # about the memory an automaton's kept state-set moves may take (:meth:`Automaton._kept`)
MARKER = b"\x01"  # around a template's holes


@dataclasses.dataclass(frozen=True)
class Automaton:
    """A DFA over token classes (see the module docstring). States ``0 .. Q-1`` are outlines-core's (renumbered),
    ``Q`` is ``DONE``; ``classes[token]`` is the token's class, -1 for a token never allowed. ``first_classes`` and
    ``first_successors``: the same at the first slot of a text, where a SentencePiece token writes no leading space
    (the same arrays as ``classes`` / ``successors`` for other tokenizers). A template's automaton reads a marker
    around each hole (``\\x01``, its class ``marker``), so that a hole's own constraint applies to its slots only:
    the guard steps it at the hole's edges."""

    table: np.ndarray  # int32 [Q + 1, C]: the next state, DEAD where none
    classes: np.ndarray  # int32 [V]: the class of each token id, -1: never allowed
    start: int
    accept: np.ndarray  # bool [Q + 1]: accepting states and DONE
    successors: np.ndarray  # bool [Q + 1, Q + 1]: a state reaches another by one allowed token
    first_classes: np.ndarray
    first_successors: np.ndarray
    same: int  # the class of a token that writes nothing (every state stays itself)
    marker: int = -1  # a template's: the class of its hole marker (written by no token), -1: none
    # the state-set moves asked so far (a run's canvases ask for few distinct ones; read-only arrays, :meth:`_kept`)
    _moves: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def states(self) -> int:
        return self.table.shape[0]

    def _class(self, token: int, first: bool) -> int:
        classes = self.first_classes if first else self.classes
        return int(classes[token]) if 0 <= token < classes.shape[0] else -1

    def step(self, states: np.ndarray, token: int | None, first: bool = False) -> np.ndarray:
        """bool [Q + 1]: the states reached from ``states`` by ``token`` (None: by any allowed token); ``first``:
        at the first slot of the text."""
        if token is None:
            successors = self.first_successors if first else self.successors
            return self._kept(("any", first, states.tobytes()), lambda: successors[states].any(0))
        return self.step_class(states, self._class(token, first))

    def step_class(self, states: np.ndarray, c: int) -> np.ndarray:
        return self._kept(("step", states.tobytes(), c), lambda: self._step_class(states, c))

    def _step_class(self, states: np.ndarray, c: int) -> np.ndarray:
        out = np.zeros(self.states, dtype=bool)
        if c < 0:
            return out
        nxt = self.table[states, c]
        out[nxt[nxt != DEAD]] = True
        return out

    def back(self, states: np.ndarray, token: int | None, first: bool = False) -> np.ndarray:
        """bool [Q + 1]: the states from which ``token`` (None: some allowed token) leads into ``states``."""
        if token is None:
            successors = self.first_successors if first else self.successors
            return self._kept(("back any", first, states.tobytes()), lambda: successors[:, states].any(1))
        return self.back_class(states, self._class(token, first))

    def back_class(self, states: np.ndarray, c: int) -> np.ndarray:
        return self._kept(("back", states.tobytes(), c), lambda: self._back_class(states, c))

    def _back_class(self, states: np.ndarray, c: int) -> np.ndarray:
        if c < 0:
            return np.zeros(self.states, dtype=bool)
        nxt = self.table[:, c]
        return (nxt != DEAD) & states[np.maximum(nxt, 0)]

    def allowed(self, left: np.ndarray, right: np.ndarray, first: bool = False) -> np.ndarray:
        """bool [V]: the tokens leading from a state of ``left`` to a state of ``right``."""
        return self.allowed_with_never(left, right)[self.first_classes if first else self.classes]

    def allowed_with_never(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """bool [C + 1]: :meth:`allowed_classes` and a last entry False, which class -1 (never allowed) reads."""
        key = ("allowed+", left.tobytes(), right.tobytes())
        return self._kept(key, lambda: np.append(self.allowed_classes(left, right), False))

    def allowed_classes(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """bool [C]: the token classes leading from a state of ``left`` to a state of ``right``."""
        return self._kept(("allowed", left.tobytes(), right.tobytes()), lambda: self._allowed_classes(left, right))

    def _allowed_classes(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        nxt = self.table[left]  # [|left|, C]
        return ((nxt != DEAD) & right[np.maximum(nxt, 0)]).any(0)

    def _kept(self, key: tuple, compute) -> np.ndarray:
        """``compute()``, kept read-only under ``key`` (until they take about ``_MOVES_BYTES``, then afresh)."""
        out = self._moves.get(key)
        if out is None:
            if len(self._moves) * (3 * max(self.table.shape) + 256) >= _MOVES_BYTES:  # (two sets in a key, one out)
                self._moves.clear()
            out = self._moves[key] = compute()
            out.flags.writeable = False
        return out


def build(regex: str, surfaces, eos_ids, markers: bool = False) -> Automaton:
    """The automaton of ``regex`` over the tokens of ``surfaces`` (:class:`dllm.constraints.tokens.Surfaces`: id ->
    the bytes it writes; the others, specials and the mask, never allowed), EOS any of ``eos_ids``. ``markers``: the
    pattern is a template's, its holes between ``\\x01`` markers (:data:`MARKER`); no token writing that byte is
    allowed."""
    from outlines_core import Index, Vocabulary

    if not eos_ids:
        raise ConfigError(
            "a constraint needs the model's EOS token id (the end of the constrained text): set eos_token_id"
        )
    vocab = surfaces.vocab
    written = dict(surfaces.items)
    written.update({vocab + t: text for t, text in surfaces.first.items()})  # the first slot's own pieces
    if markers:
        written = {t: text for t, text in written.items() if MARKER not in text}
    # The pattern is anchored at its end (without it outlines-core's DFA keeps leftmost-first matches: "1|12" misses
    # "12") and starts with a sentinel byte written by a token of its own (an end-anchored pattern that matches
    # the empty text has no anchored start state there): the start is the state after the sentinel.
    sentinel = 2 * vocab
    written[sentinel] = b"\x00"
    # and one token of each byte (never allowed), so that outlines-core finds a way out of every state of the pattern
    # (it refuses a vocabulary that cannot write some character, as a word-level one cannot write a lone "s")
    for byte in range(256):
        written[sentinel + 1 + byte] = bytes([byte])
    by_bytes: dict[bytes, list[int]] = {}
    for token, text in written.items():
        if text:  # (a token writing nothing cannot move the automaton)
            by_bytes.setdefault(text, []).append(token)
    eos = int(eos_ids[0])
    try:
        index = Index(f"\\x00(?:{regex})$", Vocabulary(eos, by_bytes))
    except (ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(
            f"the constraint's regular expression cannot be compiled by outlines-core ({e}): its syntax is Rust's "
            "regex, without look-around or back-references"
        ) from None
    transitions = index.get_transitions()
    start = transitions[index.get_initial_state()][sentinel]
    order = sorted(state for state in transitions if state != index.get_initial_state() or state == start)
    number = {state: i for i, state in enumerate(order)}
    done = len(order)
    # token classes: tokens with the same next state from every state (two random 64-bit hashes of that row)
    rng = np.random.default_rng(0)
    weights = rng.integers(1, 2**63, size=(2, done), dtype=np.uint64)
    hashes = np.zeros((2, 2 * vocab + 257), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for state in order:
            moves = {t: n for t, n in transitions[state].items() if t != eos and n in number}
            if not moves:
                continue
            tokens = np.fromiter(moves, dtype=np.int64, count=len(moves))
            nexts = np.fromiter((number[n] + 1 for n in moves.values()), dtype=np.uint64, count=len(moves))
            for k in range(2):
                hashes[k, tokens] += nexts * weights[k, number[state]]
    moving = hashes.any(0)
    unique, inverse = np.unique(hashes[:, moving].T, axis=0, return_inverse=True)
    every = np.full(2 * vocab + 257, -1, dtype=np.int32)
    every[np.flatnonzero(moving)] = inverse.reshape(-1)
    representatives = np.zeros(len(unique), dtype=np.int64)
    representatives[inverse.reshape(-1)] = np.flatnonzero(moving)
    eos_class, same = len(unique), len(unique) + 1  # EOS; a token that writes nothing (a state stays itself)
    table = np.full((done + 1, same + 1), DEAD, dtype=np.int32)
    table[:done, same] = np.arange(done)
    for state in order:
        row, moves = number[state], transitions[state]
        for c, token in enumerate(representatives.tolist()):
            nxt = moves.get(token)
            if nxt is not None and nxt in number:
                table[row, c] = number[nxt]
    finals = [number[s] for s in index.get_final_states() if s in number]
    accept = np.zeros(done + 1, dtype=bool)
    accept[finals] = True
    accept[done] = True
    table[finals, eos_class] = done
    table[done, eos_class] = done
    every[[t for t, text in written.items() if not text]] = same
    classes = every[:vocab].copy()
    first_classes = classes.copy()
    variants = np.fromiter(surfaces.first, dtype=np.int64, count=len(surfaces.first))
    first_classes[variants] = every[vocab + variants]
    for token in eos_ids:
        if 0 <= token < vocab:
            classes[token] = first_classes[token] = eos_class
    return Automaton(
        table, classes, number[start], accept, _successors(table, classes), first_classes,
        _successors(table, first_classes), same, int(every[sentinel + 1 + MARKER[0]]) if markers else -1,
    )  # fmt: skip


def _successors(table: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """bool [Q + 1, Q + 1]: the states each state reaches by one token of ``classes`` (those of some token)."""
    used = np.unique(classes[classes >= 0])
    out = np.zeros((table.shape[0], table.shape[0]), dtype=bool)
    for state in range(table.shape[0]):
        nxt = table[state, used]
        out[state, nxt[nxt != DEAD]] = True
    return out


@functools.lru_cache(maxsize=64)
def cached(regex: str, surfaces, eos_ids: tuple[int, ...], markers: bool = False) -> Automaton:
    """:func:`build`, kept per arguments: compiling a schema over a large vocabulary takes seconds."""
    return build(regex, surfaces, eos_ids, markers)


def product(a: Automaton, b: Automaton) -> Automaton:
    """The automaton of the texts both ``a`` and ``b`` accept (a template's and a constraint's), over the pairs of
    their token classes, its states the pairs reachable from the two starts; ``a``'s marker leaves ``b`` where it
    is."""
    pairs = {}
    joint, joint_first = (
        _pair_classes(a.classes, b.classes, pairs),
        _pair_classes(a.first_classes, b.first_classes, pairs),
    )
    index = {(a.start, b.start): 0}
    queue, rows = [(a.start, b.start)], []
    same = pairs.setdefault((a.same, b.same), len(pairs))
    marker = pairs.setdefault((a.marker, b.same), len(pairs)) if a.marker >= 0 else -1  # (b reads no marker)
    pair_list = list(pairs)
    while queue:
        qa, qb = queue.pop(0)
        row = np.full(len(pair_list), DEAD, dtype=np.int32)
        for c, (ca, cb) in enumerate(pair_list):
            na, nb = a.table[qa, ca], b.table[qb, cb]
            if na == DEAD or nb == DEAD:
                continue
            if (na, nb) not in index:
                index[(na, nb)] = len(index)
                queue.append((na, nb))
            row[c] = index[(na, nb)]
        rows.append(row)
    table = np.stack(rows) if rows else np.full((1, len(pair_list)), DEAD, dtype=np.int32)
    accept = np.zeros(len(index), dtype=bool)
    for (qa, qb), state in index.items():
        accept[state] = a.accept[qa] and b.accept[qb]
    return Automaton(
        table, joint, 0, accept, _successors(table, joint), joint_first, _successors(table, joint_first), same, marker
    )


def _pair_classes(ca: np.ndarray, cb: np.ndarray, pairs: dict) -> np.ndarray:
    """int32 [V]: each token's pair of classes numbered in ``pairs`` (shared by the two calls), -1 where either is."""
    out = np.full(ca.shape[0], -1, dtype=np.int32)
    both = (ca >= 0) & (cb >= 0)
    for token in np.flatnonzero(both).tolist():
        key = (int(ca[token]), int(cb[token]))
        out[token] = pairs.setdefault(key, len(pairs))
    return out
