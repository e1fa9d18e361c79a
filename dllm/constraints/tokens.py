"""What each token writes: the bytes a constraint's automaton reads (:func:`surfaces`).

A constrained text is the concatenation of its tokens' bytes, so the tokenizer must decode that way: byte-level
BPE (GPT-2, Qwen, LLaMA-3 style: each character of a token string stands for one byte), SentencePiece-style
pieces (``▁`` for a space, ``<0x0A>`` for a byte; a LLaMA-2-style decoder drops the space that starts the text,
so the first slot of a span reads each token without it; Gemma's keeps it), or tokens that are their own text
(the bundled word-level tokenizer).
:func:`surfaces` checks it on sample texts and refuses a tokenizer that decodes otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

from dllm.core.errors import ConfigError

SAMPLES = ("Hello world", "a, b. c!", " two  spaces", "x = 1 + 22\nnext line", '{"key": [1, 2.5, true]}', "é ü 中")
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)  # (hashed by identity: one per tokenizer, a key of the automaton cache)
class Surfaces:
    """items: token id -> the bytes it writes (specials left out: never allowed but as EOS); first: the bytes of the
    tokens that write differently at the start of a text (a SentencePiece decoder drops the leading space)."""

    items: dict[int, bytes]
    first: dict[int, bytes]
    vocab: int


def surfaces(tokenizer) -> Surfaces:
    """The bytes of every token of ``tokenizer`` (a transformers tokenizer), computed once per tokenizer."""
    if tokenizer in _CACHE:
        return _CACHE[tokenizer]
    special = set(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    kind = _decoder_kind(tokenizer)
    items, first = {}, {}
    for token, piece in enumerate(pieces):
        if token in special or piece is None:
            continue
        text = _bytes(piece, kind)
        if text is None:
            continue
        items[token] = text
        if kind == "sentencepiece" and text.startswith(b" "):
            first[token] = text[1:]
    if first and _keeps_leading_space(tokenizer, next(iter(first))):
        first = {}  # (Gemma's decoder writes "▁" as a space wherever it is)
    result = Surfaces(items, first, vocab)
    _verify(tokenizer, result)
    _CACHE[tokenizer] = result
    return result


def _decoder_kind(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = repr(getattr(backend, "decoder", None)) if backend is not None else ""
    if "ByteLevel" in described:
        return "bytelevel"
    if "Metaspace" in described or "▁" in described:
        return "sentencepiece"
    return "plain"


def _keeps_leading_space(tokenizer, token: int) -> bool:
    """Whether the decoder writes the space of a token that starts a text (``token``: one whose piece starts with
    ``▁``)."""
    return tokenizer.decode([token], skip_special_tokens=True, clean_up_tokenization_spaces=False).startswith(" ")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the characters of byte-level token strings back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _bytes(piece: str, kind: str) -> bytes | None:
    if kind == "bytelevel":
        table = _byte_decoder()
        if not all(c in table for c in piece):
            return None  # (an added token that is not byte-level: left out)
        return bytes(table[c] for c in piece)
    if kind == "sentencepiece":
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode("utf-8")
    return piece.encode("utf-8")


def _verify(tokenizer, result: Surfaces) -> None:
    for text in SAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if any(token not in result.items for token in ids):
            continue  # (a text the tokenizer cannot write without unknown pieces: the bundled models')
        written = b"".join(
            result.first.get(t, result.items[t]) if i == 0 else result.items[t] for i, t in enumerate(ids)
        )
        decoded = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if written != decoded.encode("utf-8"):
            raise ConfigError(
                f"constraints need a tokenizer that decodes a text as its tokens' bytes one after another; "
                f"{type(tokenizer).__name__} decodes {ids} as {decoded!r}, its tokens write {written!r}"
            )
