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
import functools

import numpy as np
import torch

from dllm.constraints.automaton import DEAD, Automaton
from dllm.core.errors import ConfigError

FREE, LITERAL, HOLE, TAIL = range(4)
_BIASES = 32  # vocabulary-wide biases a guard keeps (128k float32 ids: 16 MiB)
FILLER, FIXED = -1, -2  # (the best path's labels besides a class: a hole's EOS filler, the slot's own token)


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
        self.automaton, self.layouts, self.surfaces = automaton, layouts, surfaces
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
        self.no_states = np.zeros(automaton.states, dtype=bool)  # (the filler half of a pair outside holes)
        self.no_states.flags.writeable = False
        self._rows: dict[int, RowSets] = {}
        self._indices: dict[tuple, torch.Tensor] = {}
        self._biases: dict[tuple, torch.Tensor] = {}  # (:meth:`_bias`)
        self._fixed: dict[tuple, torch.Tensor] = {}
        self.eos_list = torch.tensor(sorted(e for e in self.eos if e < self.vocab), dtype=torch.long)
        never = automaton.table.shape[1]  # (class -1, never allowed, reads the last entry of a class mask)
        self.class_index = [
            torch.from_numpy(np.where(c < 0, never, c).astype(np.int64)) for c in (classes, automaton.first_classes)
        ]

    # -- one row ------------------------------------------------------------------------------------------------
    def span(self, tokens: torch.Tensor, row: int) -> list[int | None]:
        """Row ``row``'s span (masked slots: None) from the canvas ``tokens`` [B, L]."""
        values = tokens[row, self.start : self.ends[row]].tolist()
        return [None if t == self.mask_id else t for t in values]

    def sets(self, layout: Layout, span: list[int | None]):
        """(left, right): per slot boundary ``i`` (0 .. n) the pairs of state sets (flag 0: writing, flag 1: in a
        hole's filler) reachable before slot ``i`` from the start, and from which slots ``i ..`` end accepted (a
        template's hole markers stepped inside its first and last slots)."""
        starts, n = layout.starts(), len(span)
        left = [self.start_pair()]
        for i in range(n):
            left.append(self.forward(layout, starts, span, i, left[-1]))
        right = [None] * n + [self.accept_pair()]
        for i in range(n - 1, -1, -1):
            right[i] = self.backward(layout, starts, span, i, right[i + 1])
        return left, right

    def start_pair(self) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros(self.automaton.states, dtype=bool)
        l0 = empty.copy()
        l0[self.automaton.start] = True
        return l0, empty

    def accept_pair(self) -> tuple[np.ndarray, np.ndarray]:
        return self.automaton.accept.copy(), np.zeros(self.automaton.states, dtype=bool)

    def forward(self, layout: Layout, starts: list[bool], span: list, i: int, before: tuple) -> tuple:
        """The state pair after slot ``i`` of ``span`` from the pair ``before`` it."""
        a, token, first = self.automaton, span[i], i == 0
        f0, f1 = before
        if layout.kinds[i] != HOLE:
            return a.step(f0, token, first), self.no_states
        empty = np.zeros(a.states, dtype=bool)
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
        return n0, n1

    def backward(self, layout: Layout, starts: list[bool], span: list, i: int, after: tuple) -> tuple:
        """The state pair before slot ``i`` of ``span`` from the pair ``after`` it."""
        a, token, first = self.automaton, span[i], i == 0
        n0, n1 = after
        if layout.kinds[i] != HOLE:
            return a.back(n0, token, first), self.no_states
        empty = np.zeros(a.states, dtype=bool)
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
        return r0, r1

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
        classes, eos = self.allowed_classes(layout, left[i], right[i + 1], i)
        out = classes[self.class_index[i == 0].numpy()]
        if eos is not None:
            out[self.eos_mask] = eos
        return out

    def allowed_classes(self, layout: Layout, before, after, i: int) -> tuple[np.ndarray, bool | None]:
        """(bool [C + 1]: the token classes masked slot ``i`` may take between the state pairs ``before`` and
        ``after`` it, the last entry False (the never allowed tokens); what the EOS tokens may do instead of their
        classes: None as their classes say, True / False)."""
        a = self.automaton
        (l0, l1), (n0, n1) = before, after
        eos = None
        if layout.kinds[i] == HOLE:  # the hole's content (no EOS), or its EOS filler where the filler may go on
            if layout.starts()[i]:
                l0 = self._past_marker(l0)
            if layout.ends[i]:
                n0 = n1 = self._before_marker(n0)
            eos = bool(((l0 | l1) & n1).any())
        return a.allowed_with_never(l0, n0), eos

    def completable(self, layout: Layout, span: list[int | None]) -> bool:
        """Whether the masked slots of ``span`` can be filled so that it ends accepted (the forward pass alone)."""
        starts, pair = layout.starts(), self.start_pair()
        for i in range(len(span)):
            pair = self.forward(layout, starts, span, i, pair)
        return bool((pair[0] & self.automaton.accept).any())

    def row(self, tokens: torch.Tensor, row: int) -> RowSets:
        """Row ``row``'s sets for the canvas ``tokens``, kept from the last call where its span did not change."""
        return self.row_of(row, self.span(tokens, row))

    def fixed(self, tokens: torch.Tensor) -> torch.Tensor:
        """bool [B, L]: the slots a template fixed (its text, the EOS past it), which nothing may rewrite (built
        once per shape and device: the edit and stream processes ask at every step)."""
        return fixed_slots(self.layouts, self.start, tokens, self._fixed)

    # -- the loop's questions -------------------------------------------------------------------------------------
    def check_start(self, tokens: torch.Tensor, blank: bool = False) -> None:
        """A ConfigError before the first forward when some row's span cannot hold a text of the constraint
        (``blank``: every slot but a template's text read as masked)."""
        for row, layout in enumerate(self.layouts):
            span = list(layout.tokens) if blank else self.span(tokens, row)
            if self.completable(layout, span):
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
        tokens at -inf, in place (other columns as they are): the allowed token classes per slot on the host
        (:meth:`plan`), then one add of a 0 / -inf bias over the vocabulary (:meth:`apply`)."""
        return self.apply(logits, *self.plan(rows, columns, tokens))

    def plan(self, rows: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor):
        """The host's part of :meth:`restrict`: (the distinct allowed sets of the constrained columns, each as its
        class mask bool [C + 1], whether it is a text's first slot and what its EOS tokens may do (-1: as their
        class says, 0 / 1: refused / allowed); int [n, K]: each column's set, -1 where it is not constrained)."""
        n, k = columns.shape
        inverse = np.full((n, k), -1, dtype=np.int64)
        distinct: dict[tuple, int] = {}
        sets_of: list[tuple] = []
        for j, row in enumerate(rows.tolist()):
            sets = self.row(tokens, row)
            span = sets.span
            for c, column in enumerate(columns[j].tolist()):
                i = column - self.start
                if not 0 <= i < len(span) or span[i] is not None:
                    continue
                mask, allowed_eos = self.allowed_classes(sets.layout, *sets.around(i), i)
                key = (mask.tobytes(), i == 0, -1 if allowed_eos is None else int(allowed_eos))
                if key not in distinct:
                    distinct[key] = len(sets_of)
                    sets_of.append((mask, *key[1:]))
                inverse[j, c] = distinct[key]
        return sets_of, inverse

    def apply(self, logits: torch.Tensor, distinct: list[tuple], inverse: np.ndarray) -> torch.Tensor:
        """The vocabulary-wide part of :meth:`restrict`, on the logits' device: each distinct set's bias (0 or -inf
        per id, :meth:`_bias`) added to the columns that take it (an unconstrained column is left as it is)."""
        if not distinct:
            return logits
        device, dtype, width = logits.device, logits.dtype, logits.shape[-1]
        biases = [self._bias(mask, first, eos, width, device, dtype) for mask, first, eos in distinct]
        flat, sets = logits.view(-1, width), np.where(inverse < 0, len(distinct), inverse).reshape(-1)
        if _column_at_a_time(device):
            for column, u in enumerate(sets.tolist()):
                if u < len(distinct):
                    flat[column].add_(biases[u])
        else:
            spread = torch.stack([*biases, torch.zeros_like(biases[0])])
            flat.add_(spread.index_select(0, torch.from_numpy(sets).to(device)))
        return logits

    def _bias(self, mask: np.ndarray, first: bool, eos: int, width: int, device, dtype) -> torch.Tensor:
        """[width] 0 where the allowed class set ``mask`` (a text's ``first`` slot or not; the EOS tokens as ``eos``
        says: -1 as their class, 0 / 1 refused / allowed) allows the id, -inf elsewhere (ids past the tokenizer's
        read the never allowed class). The last :data:`_BIASES` are kept: a run's steps ask for few distinct sets."""
        key = (mask.tobytes(), first, eos, width, str(device), dtype)
        bias = self._biases.pop(key, None)
        if bias is None:
            classes = torch.zeros(mask.shape, dtype=dtype).masked_fill_(torch.from_numpy(~mask), float("-inf"))
            bias = classes.to(device).index_select(0, self._index(width, device, first))
            if eos >= 0 and self.eos_list.numel():
                bias[self.eos_list.to(device)] = 0.0 if eos else float("-inf")
            while len(self._biases) >= _BIASES:
                self._biases.pop(next(iter(self._biases)))
        self._biases[key] = bias  # (most recent last)
        return bias

    def _index(self, width: int, device, first: bool) -> torch.Tensor:
        """int64 [width]: each token id's class (``first``: at the first slot of a text), the never allowed class
        for the ids past the tokenizer's vocabulary; kept per (width, device)."""
        key = (width, str(device), first)
        if key not in self._indices:
            index = self.class_index[first]
            never = self.automaton.table.shape[1]
            if width > index.shape[0]:
                index = torch.cat([index, torch.full((width - index.shape[0],), never, dtype=torch.long)])
            self._indices[key] = index[:width].to(device)
        return self._indices[key]

    def best(self, scores: torch.Tensor, rows: torch.Tensor, start: int, tokens: torch.Tensor) -> torch.Tensor:
        """The best canvas under the constraint (the renoise process's argmax canvas): token ids [n, W] maximising
        the sum of ``scores`` [n, W, V] over the canvas columns ``start .. start + W`` of the batch rows ``rows``,
        given the tokens before it in ``tokens``, a template's text in it and after it, and the other slots after it
        left to be written (a Viterbi pass over the automaton's states, a hole's filler states beside them: the
        slots of a template's text keep it, a hole's filler its best EOS; columns past a row's answer take their
        argmax)."""
        out = scores.argmax(-1)
        width = scores.shape[1]
        for j, row in enumerate(rows.tolist()):
            layout = self.layouts[row]
            i0 = start - self.start
            n = min(width, len(layout.kinds) - i0)
            if n <= 0:
                continue
            span = self.span(tokens, row)[:i0] + list(layout.tokens[i0:])  # (from here: the template's text only)
            sets = self.row_of(row, span)
            z = scores[j, :n].double().cpu()
            index = self._index(scores.shape[-1], torch.device("cpu"), False).expand(n, -1).clone()
            if i0 == 0:  # (the text's first slot: its own classes)
                index[0] = self._index(scores.shape[-1], torch.device("cpu"), True)
            out[j, :n] = self._best_row(layout, sets, span, i0, z, index).to(out.device)
        return out

    def _best_row(self, layout: Layout, sets: RowSets, span: list, i0: int, z: torch.Tensor, index: torch.Tensor):
        """Token ids [n] of the best path through slots ``i0 .. i0 + n`` of ``span`` (scores ``z`` [n, V], each id's
        class ``index`` [n, V]). The states are pairs (flag, state), flag 1 in a hole's filler; each slot is one
        layer of moves (a hole's first and last also a marker layer), labelled by the class written (its best
        token), FILLER (the best EOS) or FIXED (the span's token)."""
        a, n = self.automaton, z.shape[0]
        q, classes = a.states, a.table.shape[1]
        src, cls, tgt = self.moves
        eos = self.eos_list[self.eos_list < z.shape[1]]
        text_z = z.clone()
        text_z[:, eos] = float("-inf")  # (a hole's content writes no EOS)
        top = torch.full((n, classes + 1), float("-inf"), dtype=z.dtype).scatter_reduce(1, index, z, "amax")
        text_top = torch.full((n, classes + 1), float("-inf"), dtype=z.dtype).scatter_reduce(1, index, text_z, "amax")
        eos_z = z[:, eos] if eos.numel() else torch.full((n, 1), float("-inf"), dtype=z.dtype)
        eos_best, eos_pick = eos_z.max(1)
        keep = np.arange(q)
        layers, content = [], []
        for k in range(n):
            i = i0 + k
            token, first = span[i], i == 0
            if layout.kinds[i] != HOLE:
                if token is None:
                    layers.append((src, tgt, top[k, cls].numpy(), cls))
                else:
                    layers.append(self._fixed_moves(a._class(token, first)))
                content.append(len(layers) - 1)
                continue
            if sets.starts[i] and a.marker >= 0:  # the marker before a hole (the filler flag: none yet)
                layers.append(self._marker_moves(keep_filler=True))
            if token is None:
                text = (src, tgt, text_top[k, cls].numpy(), cls)
                filler = (np.concatenate([keep, q + keep]), q + np.concatenate([keep, keep]),
                          np.full(2 * q, float(eos_best[k])), np.full(2 * q, FILLER))  # fmt: skip
                layers.append(tuple(np.concatenate(parts) for parts in zip(text, filler)))
            elif token in self.eos:
                layers.append((np.concatenate([keep, q + keep]), q + np.concatenate([keep, keep]),
                               np.zeros(2 * q), np.full(2 * q, FIXED)))  # fmt: skip
            else:
                layers.append(self._fixed_moves(a._class(token, first)))
            content.append(len(layers) - 1)
            if layout.ends[i] and a.marker >= 0:
                layers.append(self._marker_moves(keep_filler=False))
            elif layout.ends[i]:  # (no marker: the filler flag ends with the hole)
                layers.append((np.concatenate([keep, q + keep]), np.concatenate([keep, keep]), np.zeros(2 * q),
                               np.full(2 * q, FIXED)))  # fmt: skip
        (l0, l1), (r0, r1) = sets.left_at(i0), sets.right_at(i0 + n)
        labels = _best_path(np.concatenate([l0, l1]), np.concatenate([r0, r1]), layers)
        path = torch.tensor([labels[layer] for layer in content])
        chosen = z.masked_fill(index != path.clamp(min=0)[:, None], float("-inf")).argmax(-1)  # a class's best token
        if eos.numel():
            chosen = torch.where(path == FILLER, eos[eos_pick], chosen)
        fixed = torch.tensor([t if t is not None else -1 for t in span[i0 : i0 + n]])
        return torch.where(path == FIXED, fixed, chosen)

    @functools.cached_property
    def moves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, class, target) of every move of the automaton (:func:`_table_moves`), built once."""
        return _table_moves(self.automaton.table)

    def _fixed_moves(self, c: int) -> tuple:
        """The moves of a slot holding a token of class ``c`` (outside a hole's filler)."""
        q = self.automaton.states
        nxt = self.automaton.table[:, c] if c >= 0 else np.full(q, DEAD)
        ok = np.flatnonzero(nxt != DEAD)
        return ok, nxt[ok].astype(np.int64), np.zeros(ok.shape[0]), np.full(ok.shape[0], FIXED)

    def _marker_moves(self, keep_filler: bool) -> tuple:
        """A hole marker's moves: each writing state by the marker; the filler states kept as they are (before a
        hole) or stepped by it too (after it, writing again)."""
        q = self.automaton.states
        nxt = self.automaton.table[:, self.automaton.marker]
        ok = np.flatnonzero(nxt != DEAD)
        src, tgt = [ok], [nxt[ok].astype(np.int64)]
        if keep_filler:
            src.append(q + np.arange(q))
            tgt.append(q + np.arange(q))
        else:
            src.append(q + ok)
            tgt.append(nxt[ok].astype(np.int64))
        src, tgt = np.concatenate(src), np.concatenate(tgt)
        return src, tgt, np.zeros(src.shape[0]), np.full(src.shape[0], FIXED)

    def row_of(self, row: int, span: list[int | None]) -> RowSets:
        """Row ``row``'s kept sets for ``span`` (rather than the canvas's)."""
        sets = self._rows.get(row)
        if sets is None:
            sets = self._rows[row] = RowSets(self, self.layouts[row], span)
        else:
            sets.update(span)
        return sets

    def accept(self, tokens, commit, proposals, confidence, must=None, refill=None):
        """The commits of a step that keep every row completable: (commit bool [B, L], proposals [B, L]). ``commit``
        and ``proposals`` as the decision has them, ``confidence`` [B, L] their order; ``must`` bool [B]: rows whose
        rejected commits take, through ``refill(row, column, allowed bool [V])``, the best token that fits."""
        commit = commit.clone()
        proposals = proposals.clone()
        chosen = commit.any(1).tolist()
        for row in range(len(self.layouts)):
            if not chosen[row]:
                continue
            sets = self.row(tokens, row)
            columns = [c for c in commit[row].nonzero().squeeze(1).tolist() if c < self.ends[row]]
            written = {c - self.start: int(proposals[row, c]) for c in columns}
            if not written or sets.fits(written):
                continue  # (the usual case: every commit of the step fits with the others)
            kept: dict[int, int] = {}
            for column in sorted(columns, key=lambda c: -float(confidence[row, c])):
                i = column - self.start
                if sets.fits(kept | {i: written[i]}):
                    kept[i] = written[i]
                elif must is not None and bool(must[row]):
                    before, after = sets.around(i, kept)
                    classes, eos = self.allowed_classes(sets.layout, before, after, i)
                    allowed = classes[self.class_index[i == 0].numpy()]
                    if eos is not None:
                        allowed[self.eos_mask] = eos
                    kept[i] = refill(row, column, torch.from_numpy(allowed))
                    proposals[row, column] = kept[i]
                else:
                    commit[row, column] = False
        return commit, proposals


class RowSets:
    """One row's state pairs (:meth:`Guard.sets`), kept between the guard's calls: a step changes a few slots (its
    commits), so only the left pairs after the first change and the right pairs before the last are computed
    again, and only when asked (a block's step asks for the pairs around the block)."""

    def __init__(self, guard: Guard, layout: Layout, span: list[int | None]):
        self.guard, self.layout, self.starts, self.span = guard, layout, layout.starts(), span
        n = len(span)
        self.left = [guard.start_pair()] + [None] * n
        self.right = [None] * n + [guard.accept_pair()]
        self.valid_left, self.valid_right = 0, n  # left[: valid_left + 1] and right[valid_right :] hold

    def update(self, span: list[int | None]) -> None:
        if span == self.span:
            return
        changed = [i for i, (a, b) in enumerate(zip(span, self.span)) if a != b]
        self.valid_left = min(self.valid_left, changed[0])
        self.valid_right = max(self.valid_right, changed[-1] + 1)
        self.span = span

    def left_at(self, i: int) -> tuple:
        while self.valid_left < i:
            k = self.valid_left
            self.left[k + 1] = self.guard.forward(self.layout, self.starts, self.span, k, self.left[k])
            self.valid_left += 1
        return self.left[i]

    def right_at(self, i: int) -> tuple:
        while self.valid_right > i:
            k = self.valid_right - 1
            self.right[k] = self.guard.backward(self.layout, self.starts, self.span, k, self.right[k + 1])
            self.valid_right -= 1
        return self.right[i]

    def around(self, i: int, changes: dict[int, int] | None = None) -> tuple[tuple, tuple]:
        """The pairs before and after masked slot ``i`` with ``changes`` (slot -> token) written into the span."""
        if not changes:
            return self.left_at(i), self.right_at(i + 1)
        lo, hi = min(min(changes), i), max(max(changes), i)
        trial = with_changes(self.span, changes)
        before = self.left_at(lo)
        for k in range(lo, i):
            before = self.guard.forward(self.layout, self.starts, trial, k, before)
        after = self.right_at(hi + 1)
        for k in range(hi, i, -1):
            after = self.guard.backward(self.layout, self.starts, trial, k, after)
        return before, after

    def fits(self, changes: dict[int, int]) -> bool:
        """Whether the span with ``changes`` (slot -> token) written can still be completed."""
        lo, hi = min(changes), max(changes)
        trial = with_changes(self.span, changes)
        pair = self.left_at(lo)
        for k in range(lo, hi + 1):
            pair = self.guard.forward(self.layout, self.starts, trial, k, pair)
        after = self.right_at(hi + 1)
        return bool((pair[0] & after[0]).any() or (pair[1] & after[1]).any())


def with_changes(span: list, changes: dict[int, int]) -> list:
    """A copy of ``span`` with ``changes`` (slot -> token) written."""
    trial = list(span)
    for i, token in changes.items():
        trial[i] = token
    return trial


def fixed_slots(layouts: list[Layout], start: int, tokens: torch.Tensor, kept: dict) -> torch.Tensor:
    """bool [B, L]: the slots of the canvas ``tokens`` (spans from ``start``) that ``layouts`` fix, built once per
    shape and device into ``kept``."""
    key = (tuple(tokens.shape), str(tokens.device))
    if key not in kept:
        out = torch.zeros(tokens.shape, dtype=torch.bool)
        for row, layout in enumerate(layouts):
            out[row, [start + i for i, t in enumerate(layout.tokens) if t is not None]] = True
        kept[key] = out.to(tokens.device)
    return kept[key]


def _column_at_a_time(device) -> bool:
    """Whether :meth:`Guard.apply` adds the biases a column at a time (on the CPU: one pass over the logits, no [n, V]
    gather to write and read) rather than in one gathered add (on an accelerator: one launch)."""
    return device.type == "cpu"


def _viterbi(table: np.ndarray, left: np.ndarray, right: np.ndarray, best: list[np.ndarray]) -> list[int]:
    """The classes of the highest-scoring path of ``len(best)`` slots from a state of ``left`` to one of ``right``
    (``best[i][c]``: the score of class ``c`` at slot ``i``, -inf where none)."""
    source, through, target = _table_moves(table)
    return _best_path(left, right, [(source, target, slot[through], through) for slot in best])


def _table_moves(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source, class, target) int64 of every move of a transition ``table`` [Q, C] (source-major, then class)."""
    moves = table != DEAD
    source = np.broadcast_to(np.arange(table.shape[0])[:, None], table.shape)[moves]
    through = np.broadcast_to(np.arange(table.shape[1])[None, :], table.shape)[moves]
    return source, through, table[moves].astype(np.int64)


def _best_path(left: np.ndarray, right: np.ndarray, layers: list[tuple]) -> list:
    """The labels of the highest-scoring path through ``layers`` (each the arrays source, target, score, label of
    its moves) from a state of ``left`` to one of ``right`` (ties: the first move listed)."""
    states = left.shape[0]
    score = np.where(left, 0.0, -np.inf)
    back = []
    for source, target, gain, _ in layers:
        value = score[source] + gain
        order = np.lexsort((-value, target))  # by target, its best move first
        best_move = order[np.unique(target[order], return_index=True)[1]]
        score, pick = np.full(states, -np.inf), np.full(states, -1)
        score[target[best_move]], pick[target[best_move]] = value[best_move], best_move
        back.append(pick)
    score = np.where(right, score, -np.inf)
    if not np.isfinite(score).any():
        raise RuntimeError("no text of the constraint fits the canvas (the guard let an uncompletable one through)")
    state, labels = int(score.argmax()), []
    for (source, _, _, label), pick in zip(reversed(layers), reversed(back)):
        move = pick[state]
        labels.append(int(label[move]))
        state = int(source[move])
    return labels[::-1]


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
