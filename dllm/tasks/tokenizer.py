"""A small word-level HF tokenizer for the bench tasks: one token per number below 100, exact round trip.

Pre-tokenisation splits text into: a word with an optional leading space (``" apples"``), a number of
one or two digits with an optional leading space (``" 27"``; longer numbers split into two-digit
pieces, ``"1234"`` -> ``"12" "34"``), a punctuation mark with an optional leading space (``" ="``), or a
single whitespace character. Every number the tasks use (below 100) is therefore ONE token, so each
worked arithmetic step is a single fact to recall, as LLaMA-style tokenizers do for small numbers. The
vocabulary is fixed and sorted (special tokens, whitespace, numbers 0-99, ASCII punctuation, then every
word the task generators can emit, bare and space-prefixed), so building it twice gives the same ids.
The decoder concatenates tokens, so ``decode(encode(text)) == text`` for every task text.

Special tokens (same ids as ``dllm.models.tiny``): ``<|endoftext|>`` 0 (EOS and pad),
``<|mdm_mask|>`` 1, ``<|startoftext|>`` 2 (BOS), ``<|eot_id|>`` 3 (end of turn), ``<unk>`` 4.

No chat template: the models trained on these tasks (``dllm.train``, the bundled ones) see each prompt as
plain text, so chat messages (``--chat``) are refused instead of wrapped in turns they never saw. Numbers of
three or more digits (or with a leading zero) split into pieces no task example holds: :func:`split_numbers`
finds them.
"""

from __future__ import annotations

import re
import string
from pathlib import Path

from dllm.models.tiny import SPECIALS

EOS, MASK, BOS, EOT, UNK = range(5)
CHAT_WORDS = ["assistant", "system", "user"]
WHITESPACE = [" ", "\n", "\t"]
MAX_SEQ_LEN = 64  # BOS + prompt + target + EOS of every task example fits (worst case: arith, 62)
PRE_TOKENIZE = r" ?[A-Za-z]+| ?[1-9]?[0-9]| ?[^\sA-Za-z0-9]|\s"
NUMBERS = [str(n) for n in range(100)]


def vocabulary() -> list[str]:
    """The token strings in id order."""
    from dllm.tasks import words

    tokens = list(SPECIALS) + WHITESPACE + [p for n in NUMBERS for p in (n, " " + n)]
    tokens += [p for c in string.punctuation for p in (c, " " + c)]
    tokens += [p for w in sorted(set(words()) | set(CHAT_WORDS)) for p in (w, " " + w)]
    assert len(tokens) == len(set(tokens))
    return tokens


def split_numbers(text: str) -> list[str]:
    """The numbers in ``text`` that are not one token (``"140"``, ``"07"``): the tokenizer splits them into pieces
    (``"14" "0"``) that no task example holds, so a model trained on the tasks reads them wrongly."""
    return [number for number in re.findall(r"\d+", text) if number not in NUMBERS]


def build_tokenizer():
    """The bench tokenizer as a ``transformers.PreTrainedTokenizerFast`` (deterministic; no chat template)."""
    from dllm.models.tiny import word_level_tokenizer

    tokenizer = word_level_tokenizer(vocabulary(), PRE_TOKENIZE)
    tokenizer.chat_template = None  # the tasks' models are trained on plain prompts, never on chat turns
    return tokenizer


def save_tokenizer(directory) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(directory))
    return directory
