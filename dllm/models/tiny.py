"""Tiny random checkpoints in each family's official layout, with a small character-level tokenizer.

They exercise exactly the loading and sampling code paths of the real checkpoints, offline:
``python -m dllm.models.tiny DIR --family llada`` writes one.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

from dllm.models import registry
from dllm.models.loading import build
from dllm.models.saving import random_init_, save

SPECIALS = ["<|endoftext|>", "<|mdm_mask|>", "<|startoftext|>", "<|eot_id|>", "<unk>"]
EOS, MASK, BOS, EOT = 0, 1, 2, 3
# Each turn opens with <|startoftext|> (the BOS token), so the first turn's is the conversation's BOS: one
# BOS, not a {{ bos_token }} in front of it as well.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|startoftext|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|startoftext|>assistant\n{% endif %}"
)


def word_level_tokenizer(vocab: list[str], pre_tokenize: str):
    """A ``transformers`` fast tokenizer over a fixed vocabulary (``SPECIALS`` first), pieces split off by the
    regex ``pre_tokenize`` and concatenated back on decoding, with our special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(pre_tokenize), behavior="isolated")
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


def char_tokenizer():
    """One token per printable ASCII character."""
    return word_level_tokenizer(SPECIALS + list(string.printable[:95]) + ["\n"], ".")


def tiny_config(
    family: str,
    vocab_size: int,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    block_size: int = 4,
    max_length: int = 512,
    intermediate: int | None = None,
) -> dict:
    """A small config with the official field names of ``family`` (any registered family: "llada", "dream",
    "sdar", "wedlm"; :mod:`dllm.models.registry`)."""
    intermediate = intermediate or 2 * hidden
    tokens = {"mask_token_id": MASK, "eos_token_id": EOS, "pad_token_id": EOS, "bos_token_id": BOS}
    declared = registry.get(family)  # a ConfigError (a ValueError) naming the known families
    shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, max_length=max_length)
    return declared.tiny_config(vocab_size, tokens, block_size=block_size, intermediate=intermediate, **shape)


def make_tiny_checkpoint(
    directory, family: str = "llada", seed: int = 0, std: float = 0.5, overrides: dict | None = None, **shape
) -> Path:
    """Write a tiny random checkpoint of ``family`` with the character tokenizer to ``directory``.

    ``std`` is large so that random logits are peaked and greedy decoding has no near-ties. Every tensor
    but those named ``*norm.weight`` is random (LLaDA's final ``ln_f`` too): the parity fixtures in
    ``tests/fixtures`` were recorded with exactly these weights. ``overrides``: config fields replacing the tiny
    config's (e.g. WeDLM's Qwen3-style variant, ``{"attention_bias": False, "qk_norm": True}``).
    """
    tokenizer = char_tokenizer()
    model = build({**tiny_config(family, len(tokenizer), **shape), **(overrides or {})})
    random_init_(model, std=std, seed=seed, ones=lambda name: name.endswith("norm.weight"))
    declared = registry.get(family)
    if declared.tiny_init is not None:
        declared.tiny_init(model)
    return save(model, directory, tokenizer=tokenizer)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--family", default="llada", choices=registry.names())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.directory, args.family, args.seed))


if __name__ == "__main__":
    main()
