"""A small word-level HF tokenizer for the bench tasks: one token per digit, exact round trip.

Pre-tokenisation splits text into: a word with an optional leading space (``" apples"``), a single
digit (``"7"``; the space before a number is its own token ``" "``), a punctuation mark with an
optional leading space (``" ="``), or a single whitespace character. The vocabulary is fixed and
sorted (special tokens, digits, whitespace, ASCII punctuation, then every word the task generators can
emit, bare and space-prefixed), so building it twice gives the same ids. The decoder concatenates
tokens, so ``decode(encode(text)) == text`` for every task text.

Special tokens (same ids as ``dllm.models.tiny``): ``<|endoftext|>`` 0 (EOS and pad),
``<|mdm_mask|>`` 1, ``<|startoftext|>`` 2 (BOS), ``<|eot_id|>`` 3 (end of turn), ``<unk>`` 4.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|mdm_mask|>", "<|startoftext|>", "<|eot_id|>", "<unk>"]
EOS, MASK, BOS, EOT, UNK = range(5)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|startoftext|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|startoftext|>assistant\n{% endif %}"
)
CHAT_WORDS = ["assistant", "system", "user"]
WHITESPACE = [" ", "\n", "\t"]
MAX_SEQ_LEN = 80  # BOS + prompt + target + EOS of every task example fits (worst case: arith, 79)
PRE_TOKENIZE = r" ?[A-Za-z]+| ?[^\sA-Za-z0-9]|[0-9]|\s"


def vocabulary() -> list[str]:
    """The token strings in id order."""
    from dllm.bench.tasks import words

    tokens = list(SPECIALS) + list(string.digits) + WHITESPACE
    tokens += [p for c in string.punctuation for p in (c, " " + c)]
    tokens += [p for w in sorted(set(words()) | set(CHAT_WORDS)) for p in (w, " " + w)]
    assert len(tokens) == len(set(tokens))
    return tokens


def build_tokenizer():
    """The bench tokenizer as a ``transformers.PreTrainedTokenizerFast`` (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(PRE_TOKENIZE), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mdm_mask|>",
        bos_token="<|startoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|eot_id|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(directory) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (and ``chat_template.jinja``) to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(directory))
    return directory
