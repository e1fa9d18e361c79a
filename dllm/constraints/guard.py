"""A run's constraint, checked against its canvas at every step (:class:`Guard`), and the layout of a template.

Each row's generated span is a sequence of slots, committed or masked. The guard knows where a template puts
its pieces (:class:`Layout`): its fixed text (committed from the start), its holes (a hole's slots hold the model's
tokens, then EOS filler to the hole's end: the filler writes nothing) and, past the template, EOS. Without a
template every slot is free: the text, then EOS to the end of the span.

For a row it computes, left to right, the automaton's states reachable before each slot and, right to left, the
states from which the rest of the span can end accepted (:meth:`Guard.sets`); a masked slot may take exactly the
tokens leading from the one to the other. The loop asks it for those masks on the slots it scores (:meth:`restrict`:
the model's proposals are then always allowed) and to accept a step's commits (:meth:`accept`): all of them when
they are completable together, else one by one in confidence order, each checked against those before it (a
commit that no longer fits stays masked, or, where the step must commit a slot, takes the best token that fits).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dllm.constraints.automaton import DEAD, Automaton
from dllm.core.errors import ConfigError

FREE, LITERAL, HOLE, TAIL = range(4)


@dataclasses.dataclass
class Layout:
    """The template's pieces over a span of ``len(kinds)`` slots: per slot its kind (``FREE``, ``LITERAL``, ``HOLE``,
    ``TAIL``), the hole it belongs to (-1: none), whether it is its hole's last slot, and the token a literal or the
    tail writes (None: masked at the start)."""

    kinds: list[int]
    holes: list[int]
    ends: list[bool]
    tokens: list[int | None]

    def starts(self) -> list[bool]:
        """Per slot: whether it is its hole's first."""
        pairs = enumerate(zip(self.kinds, self.holes))
        return [k == HOLE and (i == 0 or self.holes[i - 1] != h) for i, (k, h) in pairs]

    @classmethod
    def free(cls, length: int) -> Layout:
        return cls([FREE] * length, [-1] * length, [False] * length, [None] * length)

    def extended(self, length: int, eos: int) -> Layout:
        """This layout over a span of ``length`` slots: the slots past the template are EOS (``TAIL``)."""
        extra = length - len(self.kinds)
        if extra < 0:
            raise ConfigError(f"the template needs {len(self.kinds)} slots; the generation has {length}")
        return Layout(
            self.kinds + [TAIL] * extra, self.holes + [-1] * extra, self.ends + [False] * extra,
            self.tokens + [eos] * extra,
        )  # fmt: skip


class Guard:
    """The constraint of one run (see the module docstring): ``automaton`` over the canvas spans of ``canvas`` (rows
    of a :class:`~dllm.engine.canvas.Canvas`), laid out by ``layout`` (one per row: their spans may differ in
    length; a block tail decoded past the answer is not checked), ``eos_ids`` the EOS tokens (the filler and the
    end), ``surfaces`` what each token writes (:class:`~dllm.constraints.tokens.Surfaces`)."""

    def __init__(self, automaton: Automaton, layouts: list[Layout], canvas, eos_ids, mask_id: int, surfaces=None):
        self.automaton, self.layouts, self.canvas, self.surfaces = automaton, layouts, canvas, surfaces
        self.ends = [canvas.prompt_width + len(layout.kinds) for layout in layouts]  # (a block tail past: free)
        self.eos = set(int(e) for e in eos_ids)
        self.mask_id = mask_id
        self.start = canvas.prompt_width
        classes = automaton.classes
        eos_classes = {int(classes[e]) for e in self.eos if 0 <= e < classes.shape[0]}
        self.text_successors = _successors_without(automaton, eos_classes)  # (a hole's content: no EOS)
        self.first_text_successors = _successors_without(automaton, eos_classes, first=True)
        self.vocab = classes.shape[0]
        self.eos_mask = np.zeros(self.vocab, dtype=bool)
        self.eos_mask[[e for e in self.eos if e < self.vocab]] = True

    # -- one row ------------------------------------------------------------------------------------------------
    def span(self, tokens: torch.Tensor, row: int) -> list[int | None]:
        """Row ``row``'s span (masked slots: None) from the canvas ``tokens`` [B, L]."""
        values = tokens[row, self.start : self.ends[row]].tolist()
        return [None if t == self.mask_id else t for t in values]

    def sets(self, layout: Layout, span: list[int | None]):
        """(left, right): per slot boundary ``i`` (0 .. n) the pairs of state sets (flag 0: writing, flag 1: in a
        hole's filler) reachable before slot ``i`` from the start, and from which slots ``i ..`` end accepted (a
        template's hole markers stepped inside its first and last slots)."""
        a, n = self.automaton, len(span)
        empty = np.zeros(a.states, dtype=bool)
        starts = layout.starts()
        l0 = empty.copy()
        l0[a.start] = True
        left = [(l0, empty)]
        for i, token in enumerate(span):
            f0, f1 = left[-1]
            first = i == 0
            if layout.kinds[i] == HOLE:
                if starts[i]:
                    f0 = self._past_marker(f0)
                if token is None:
                    successors = self.first_text_successors if first else self.text_successors
                    n0, n1 = successors[f0].any(0), f0 | f1
                elif token in self.eos:
                    n0, n1 = empty, f0 | f1
                else:
                    n0, n1 = a.step(f0, token, first), empty
                if layout.ends[i]:
                    n0, n1 = self._past_marker(n0 | n1), empty
            else:
                n0, n1 = a.step(f0, token, first), empty
            left.append((n0, n1))
        right = [(a.accept.copy(), empty)]
        for i in range(n - 1, -1, -1):
            token, first = span[i], i == 0
            n0, n1 = right[-1]
            if layout.kinds[i] == HOLE:
                if layout.ends[i]:
                    n0 = n1 = self._before_marker(n0)
                if token is None:
                    successors = self.first_text_successors if first else self.text_successors
                    r0, r1 = successors[:, n0].any(1) | n1, n1
                elif token in self.eos:
                    r0, r1 = n1, n1
                else:
                    r0, r1 = a.back(n0, token, first), empty
                if starts[i]:
                    r0, r1 = self._before_marker(r0), empty
            else:
                r0, r1 = a.back(n0, token, first), empty
            right.append((r0, r1))
        right.reverse()
        return left, right

    def _past_marker(self, states: np.ndarray) -> np.ndarray:
        """The states after a hole marker (the same without one)."""
        a = self.automaton
        return states if a.marker < 0 else a.step_class(states, a.marker)

    def _before_marker(self, states: np.ndarray) -> np.ndarray:
        """The states before a hole marker that leads into ``states``."""
        a = self.automaton
        return states if a.marker < 0 else a.back_class(states, a.marker)

    def allowed(self, layout: Layout, left, right, i: int) -> np.ndarray:
        """bool [V]: the tokens masked slot ``i`` may take, from the sets of :meth:`sets`."""
        a, first = self.automaton, i == 0
        (l0, l1), (n0, n1) = left[i], right[i + 1]
        if layout.kinds[i] != HOLE:
            return a.allowed(l0, n0, first)
        if layout.starts()[i]:
            l0 = self._past_marker(l0)
        if layout.ends[i]:
            n0 = n1 = self._before_marker(n0)
        content = a.allowed(l0, n0, first) & ~self.eos_mask
        if ((l0 | l1) & n1).any():
            content = content | self.eos_mask
        return content

    def completable(self, layout: Layout, span: list[int | None]) -> bool:
        left, right = self.sets(layout, span)
        l0, l1 = left[0]
        r0, r1 = right[0]
        return bool((l0 & r0).any() or (l1 & r1).any())

    # -- the loop's questions -------------------------------------------------------------------------------------
    def check_start(self, tokens: torch.Tensor) -> None:
        """A ConfigError before the first forward when some row's span cannot hold a text of the constraint."""
        for row, layout in enumerate(self.layouts):
            if self.completable(layout, self.span(tokens, row)):
                continue
            a = self.automaton
            reached, frontier = np.zeros(a.states, dtype=bool), np.zeros(a.states, dtype=bool)
            frontier[a.start] = True
            while frontier.any():  # every state some text reaches
                reached |= frontier
                frontier = (a.successors[frontier].any(0) | self._past_marker(frontier)) & ~reached
            if not (reached & a.accept).any():
                raise ConfigError(
                    "this model's tokenizer cannot write any text of the constraint (no sequence of its tokens "
                    "matches it, whatever the length): check the pattern against the tokenizer's vocabulary"
                )
            raise ConfigError(
                f"no text of the constraint (and template) fits in the {len(layout.kinds)} generated slots of row "
                f"{row}: give more max_new_tokens (or longer holes), or a constraint with shorter texts"
            )

    def restrict(self, logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor):
        """``logits`` [n, K, V] of ``columns`` [n, K] of the batch rows ``rows`` with every masked slot's disallowed
        tokens at -inf (other columns as they are)."""
        masks = torch.ones(logits.shape, dtype=torch.bool)
        for k, row in enumerate(rows.tolist()):
            layout, span = self.layouts[row], self.span(tokens, row)
            left = right = None
            for j, column in enumerate(columns[k].tolist()):
                i = column - self.start
                if not 0 <= i < len(span) or span[i] is not None:
                    continue
                if left is None:
                    left, right = self.sets(layout, span)
                masks[k, j, : self.vocab] = torch.from_numpy(self.allowed(layout, left, right, i))
        return logits.masked_fill(~masks.to(logits.device), float("-inf"))

    def accept(self, tokens, commit, proposals, confidence, must=None, refill=None):
        """The commits of a step that keep every row completable: (commit bool [B, L], proposals [B, L]). ``commit``
        and ``proposals`` as the decision has them, ``confidence`` [B, L] their order; ``must`` bool [B]: rows whose
        rejected commits take, through ``refill(row, column, allowed bool [V])``, the best token that fits."""
        commit = commit.clone()
        proposals = proposals.clone()
        chosen = commit.any(1).tolist()
        for row, layout in enumerate(self.layouts):
            if not chosen[row]:
                continue
            span = self.span(tokens, row)
            columns = [c for c in commit[row].nonzero().squeeze(1).tolist() if c < self.ends[row]]
            written = [proposals[row, c].item() for c in columns]
            trial = list(span)
            for column, token in zip(columns, written):
                trial[column - self.start] = token
            if self.completable(layout, trial):
                continue  # (the usual case: every commit of the step fits with the others)
            order = sorted(zip(columns, written), key=lambda item: -float(confidence[row, item[0]]))
            for column, token in order:
                i = column - self.start
                span[i] = token
                if self.completable(layout, span):
                    continue
                span[i] = None
                if must is not None and bool(must[row]):
                    left, right = self.sets(layout, span)
                    span[i] = refill(row, column, torch.from_numpy(self.allowed(layout, left, right, i)))
                    proposals[row, column] = span[i]
                else:
                    commit[row, column] = False
        return commit, proposals


def _successors_without(automaton: Automaton, excluded: set[int], first: bool = False) -> np.ndarray:
    """bool [Q + 1, Q + 1]: one token of a class not in ``excluded`` (and used by some token) leads from a state to
    another."""
    classes = automaton.first_classes if first else automaton.classes
    used = [c for c in np.unique(classes[classes >= 0]).tolist() if c not in excluded]
    out = np.zeros((automaton.states, automaton.states), dtype=bool)
    for state in range(automaton.states):
        nxt = automaton.table[state, used]
        out[state, nxt[nxt != DEAD]] = True
    return out
