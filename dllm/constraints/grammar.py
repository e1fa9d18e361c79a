"""A context-free constraint's check of a run (:class:`GrammarGuard`): llguidance's exact matcher over each row's
committed prefix.

A regular constraint is checked exactly anywhere in the canvas (:mod:`dllm.constraints.guard`); whether a canvas
with holes can still be completed to a word of a context-free language has no fast exact answer (Mündler et al.,
arXiv 2508.10111, intersect a grammar with the holes' regular language at every commit). dllm keeps the sound
part of it, cheaply: each row's committed tokens are always a prefix of its span that llguidance's matcher
(`llguidance <https://github.com/guidance-ai/llguidance>`_, MIT; the engine behind vLLM's and SGLang's structured
output) has consumed, so every committed text is a prefix of a word of the grammar.

- The first masked slot of a row (its frontier) takes exactly the tokens the matcher allows there (EOS when the
  text so far is a word of the grammar); the other masked slots are scored freely.
- A step's commits are accepted from the frontier on, left to right, as long as they are contiguous and the
  matcher consumes them; the others wait, masked, until the slots before them are written (the sampler's order
  and confidence still choose them; its parallelism is kept where it commits runs). A row whose commits all wait
  writes its frontier instead, with the best token allowed there (the progress guarantee); a row that must
  commit its slots (a block's last step, an exit rule) writes them left to right, each the best allowed.
- After EOS, only EOS. A row that runs out of slots before its text is a word of the grammar ends with a valid
  prefix and ``finish_reasons[i] == "length"``.
- The renoise process (DiffusionGemma) writes no masks: each step's argmax canvas is chosen left to right, each
  slot the best token the matcher allows after the canvases before and the slots before it (:meth:`GrammarGuard.best`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from dllm.core.errors import ConfigError

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


class GrammarGuard:
    """The guard of a run under a context-free constraint (see the module docstring): ``grammar`` (llguidance's
    grammar text), one matcher per row of ``canvas``, each row's answer its first ``lengths[row]`` slots."""

    def __init__(self, grammar: str, tokenizer, canvas, eos_ids, mask_id: int, lengths: list[int]):
        import llguidance

        self.mask_id, self.start = mask_id, canvas.prompt_width
        self.eos = set(int(e) for e in eos_ids)
        self.vocab = tokenizer.vocab_size
        self.ends = [self.start + n for n in lengths]
        self.matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in lengths]
        if self.matchers and self.matchers[0].is_error():
            raise ConfigError(f"the grammar does not compile: {self.matchers[0].get_error()}")
        self.read: list[list[int]] = [[] for _ in lengths]  # the tokens of each row's prefix its matcher has read
        self._pending = [0] * len(lengths)  # the tokens of this step's commits it read on top (rolled back after)

    # -- one row ----------------------------------------------------------------------------------------------
    def _sync(self, tokens: torch.Tensor, row: int) -> tuple[list[int], int, bool]:
        """(row ``row``'s span, its frontier: the first masked slot, whether its prefix holds EOS), the matcher
        moved to the prefix (up to its EOS)."""
        span = tokens[row, self.start : self.ends[row]].tolist()
        frontier = span.index(self.mask_id) if self.mask_id in span else len(span)
        read, ended = self._readable(span[:frontier])
        if not self._move_to(row, read):
            raise RuntimeError(f"row {row}: the matcher refuses a committed token ({self.matchers[row].get_error()})")
        return span, frontier, ended

    def _readable(self, prefix: list[int]) -> tuple[list[int], bool]:
        """The part of ``prefix`` the matcher reads (up to its first EOS), and whether it holds an EOS."""
        ended = next((i for i, t in enumerate(prefix) if t in self.eos), None)
        return (prefix, False) if ended is None else (prefix[:ended], True)

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

    def _frontier(self, row: int, ended: bool) -> np.ndarray:
        """bool [V]: the tokens row ``row``'s frontier may take."""
        if ended:
            allowed = np.zeros(self.vocab, dtype=bool)
        else:
            bits = np.frombuffer(self.matchers[row].compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        allowed[[e for e in self.eos if e < self.vocab]] = ended or self.matchers[row].is_accepting()
        return allowed

    def best(self, scores: torch.Tensor, rows: torch.Tensor, start: int, tokens: torch.Tensor) -> torch.Tensor:
        """The renoise process's argmax canvas under the grammar: token ids [n, W] for the canvas columns ``start ..
        start + W`` of the batch rows ``rows``, each slot left to right the highest-scoring token (``scores`` [n, W, V])
        the matcher allows after the canvases before it in ``tokens`` and the slots before it (EOS once the text is a
        word, then only EOS). Greedy, not the best canvas: whether a later slot can still complete the text has no
        fast answer for a context-free language, so a row may run out of slots (``finish_reasons`` "length")."""
        out = scores.argmax(-1)
        for j, row in enumerate(rows.tolist()):
            n = min(scores.shape[1], self.ends[row] - start)
            if n <= 0:
                continue
            read, ended = self._readable(tokens[row, self.start : start].tolist())
            if not self._move_to(row, read):
                raise RuntimeError(f"row {row}: the matcher refuses a token of an earlier canvas")
            matcher, taken, chosen = self.matchers[row], 0, []
            for k in range(n):
                allowed = torch.from_numpy(self._frontier(row, ended)).to(scores.device)
                token = int(scores[j, k, : self.vocab].masked_fill(~allowed, float("-inf")).argmax())
                if not ended and token not in self.eos:
                    matcher.consume_tokens([token])
                    taken += 1
                ended = ended or token in self.eos
                chosen.append(token)
            if taken:  # (back to the canvases before: this one is a draft until the canvas settles)
                matcher.rollback(taken)
            out[j, :n] = torch.tensor(chosen, device=out.device)
        return out

    def fixed(self, tokens: torch.Tensor) -> torch.Tensor:
        """bool [B, L]: the slots nothing may rewrite (none: a grammar has no template)."""
        return torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)

    # -- the loop's questions -----------------------------------------------------------------------------------
    def check_start(self, tokens: torch.Tensor, blank: bool = False) -> None:
        """A ConfigError before the first forward when the tokenizer cannot start a text of the grammar (``blank``:
        the span is not written yet, as the renoise process's noise)."""
        for row in range(len(self.matchers)):
            frontier, ended = (0, False) if blank else self._sync(tokens, row)[1:]
            if frontier == 0 and not self._frontier(row, ended).any():
                raise ConfigError(
                    "this model's tokenizer cannot write any text of the grammar (no token starts one): check the "
                    "grammar against the tokenizer's vocabulary"
                )

    def restrict(self, logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor):
        """``logits`` [n, K, V] with each row's frontier (and every masked slot after an EOS) restricted to its
        allowed tokens, in place."""
        for j, row in enumerate(rows.tolist()):
            span, frontier, ended = self._sync(tokens, row)
            allowed = None
            for c, column in enumerate(columns[j].tolist()):
                i = column - self.start
                if not 0 <= i < len(span) or span[i] != self.mask_id or (i != frontier and not ended):
                    continue
                if allowed is None:
                    allowed = torch.from_numpy(self._frontier(row, ended)).to(logits.device)
                logits[j, c, : self.vocab].masked_fill_(~allowed, float("-inf"))
                logits[j, c, self.vocab :] = float("-inf")
        return logits

    def accept(self, tokens, commit, proposals, confidence, must=None, refill=None):
        """The commits of a step that keep every row's prefix a prefix of the grammar: (commit, proposals), as
        :meth:`dllm.constraints.guard.Guard.accept` (``confidence`` unused: the order is the canvas's). Edits of
        decoded slots (the edit process) are kept together when the prefix they make is read, else dropped."""
        commit, proposals = commit.clone(), proposals.clone()
        for row in commit.any(1).nonzero().squeeze(1).tolist():
            span, frontier, ended = self._sync(tokens, row)
            end = self.ends[row]
            columns = [c for c in commit[row].nonzero().squeeze(1).tolist() if c < end]
            edits = [c for c in columns if c < self.start + frontier]
            taken, at, matcher = [], self.start + frontier, self.matchers[row]
            if edits:
                prefix = list(span[:frontier])
                for c in edits:
                    prefix[c - self.start] = int(proposals[row, c])
                read, now_ended = self._readable(prefix)
                after_eos = prefix[len(read) :]
                if all(t in self.eos for t in after_eos) and self._move_to(row, read):
                    if not now_ended or matcher.is_accepting():
                        taken, ended = list(edits), now_ended
                    else:
                        self._sync(tokens, row)  # (back to the canvas's prefix)
            forced = must is not None and bool(must[row])
            filled = False
            for column in (c for c in columns if c >= self.start + frontier):
                if column != at:
                    break  # (a commit past a masked slot waits)
                token = int(proposals[row, column])
                if not self._take(row, token, ended):
                    if not forced:
                        break
                    token = refill(row, column, torch.from_numpy(self._frontier(row, ended)))
                    self._take(row, token, ended)
                proposals[row, column] = token
                ended = ended or token in self.eos
                taken.append(column)
                filled, at = True, at + 1
            if not filled and at < end and any(c >= self.start + frontier for c in columns):
                token = refill(row, at, torch.from_numpy(self._frontier(row, ended)))  # the progress guarantee:
                if token is not None:  # every commit waits, so the frontier instead (None: it is not scored)
                    self._take(row, token, ended)
                    proposals[row, at] = token
                    taken.append(at)
            if self._pending[row]:  # (the canvas, once the loop writes it, is read at the next sync)
                matcher.rollback(self._pending[row])
                self._pending[row] = 0
            kept = torch.zeros_like(commit[row])
            kept[taken] = True
            commit[row] = torch.where(torch.arange(commit.shape[1], device=commit.device) < end, kept, commit[row])
        return commit, proposals

    def _take(self, row: int, token: int, ended: bool) -> bool:
        """Whether row ``row``'s matcher takes ``token`` next (read if so; after an EOS only EOS is taken)."""
        if ended or token in self.eos:
            return token in self.eos and (ended or self.matchers[row].is_accepting())
        if self.matchers[row].try_consume_tokens([token]) != 1:
            return False
        self._pending[row] += 1
        return True
