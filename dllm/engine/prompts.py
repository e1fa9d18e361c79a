"""Every accepted prompt form -> left-padded ids [B, P] and attention mask [B, P].

Accepted: a string; a list of strings; chat messages (``[{"role": ..., "content": ...}, ...]``, the
tokenizer's chat template is applied with the generation prompt) or a list of such conversations;
a ``[B, P]`` id tensor (with an optional left-padding ``attention_mask``); a list of id lists.
Text is tokenised without adding special tokens (as the official LLaDA sampler does after applying
the chat template), so the prompt is exactly what was given.
"""

from __future__ import annotations

import warnings

import torch

from dllm.core.errors import ConfigError


def _is_chat(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(m, dict) and "role" in m for m in x)


def _tokenizer(model):
    if model.tokenizer is None:
        raise ConfigError(
            "this model has no tokenizer (no tokenizer files in its directory); pass token ids "
            "(a [B, P] tensor or a list of id lists) instead of text"
        )
    return model.tokenizer


def _texts_to_ids(model, texts: list[str]) -> list[list[int]]:
    tok = _tokenizer(model)
    for i, text in enumerate(texts):
        check_text(text, f"prompt {i}" if len(texts) > 1 else "the prompt")
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def check_text(text: str, what: str) -> None:
    """A lone surrogate (JSON's ``"\\ud800"``, or bytes that are not UTF-8 read with ``surrogateescape``, as
    Python reads a command line's) is not text any tokenizer can take: say where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{what} is not valid Unicode text: character {e.start} is a lone surrogate ({text[e.start]!r}; "
            "in JSON, an unpaired \\ud800-\\udfff escape; on a command line or in a file, bytes that are not "
            "UTF-8). Send UTF-8 text"
        ) from None


def _chat_to_text(model, messages) -> str:
    tok = _tokenizer(model)
    if not any(m.get("content") for m in messages):
        raise ConfigError("empty prompt: the chat messages hold no text (every message's content is empty)")
    if not getattr(tok, "chat_template", None):
        name = model.name_or_path or f"this {model.family} model"
        raise ConfigError(
            f"{name} has no chat template: its tokenizer defines none, so the model was not trained on chat turns "
            "(a base checkpoint, or the bundled tiny models, which know the bench tasks' plain prompts). Pass the "
            "prompt as plain text (dllm generate: without --chat) or token ids instead of chat messages"
        )
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(model, prompt, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask on the model's device."""
    device = model.device
    if isinstance(prompt, torch.Tensor):
        ids = prompt
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ConfigError(f"a prompt tensor must be [B, P] token ids, got shape {tuple(prompt.shape)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ConfigError(f"a prompt tensor must hold integer token ids, not {ids.dtype}")
        if ids.numel() == 0:
            raise ConfigError(
                f"empty prompt: the prompt tensor has shape {tuple(ids.shape)}; pass at least one row of at least "
                "one token id"
            )
        if attention_mask is not None:
            given = torch.as_tensor(attention_mask)
            if tuple(given.shape) not in (tuple(ids.shape), tuple(prompt.shape)):
                raise ConfigError(
                    f"attention_mask has shape {tuple(given.shape)} but the prompt ids have shape "
                    f"{tuple(prompt.shape)}: give one 0/1 entry per prompt id (0 on left padding)"
                )
            if not bool(((given == 0) | (given == 1)).all()):
                raise ConfigError("attention_mask must hold 0 (padding) and 1 (token) only")
        if attention_mask is None and model.pad_id is not None and bool((ids == model.pad_id).any()):
            warnings.warn(
                f"the prompt ids contain the pad token id {model.pad_id} but no attention_mask was given, so those "
                "positions are read as prompt tokens. If the batch is left-padded, pass attention_mask (0 on "
                "padding, 1 on tokens), or pass a list of id lists (dllm pads them itself)",
                UserWarning,
                stacklevel=4,
            )
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).reshape(ids.shape)
        ids, mask = ids.to(device).long(), mask.to(device).long()
    else:
        if attention_mask is not None:
            raise ConfigError("attention_mask is only accepted with a token-id tensor prompt")
        if isinstance(prompt, str):
            rows = _texts_to_ids(model, [prompt])
        elif _is_chat(prompt):
            rows = _texts_to_ids(model, [_chat_to_text(model, prompt)])
        elif isinstance(prompt, (list, tuple)) and len(prompt) == 0:
            raise ConfigError(
                "empty prompt list: pass at least one prompt (a string, chat messages or a list of token ids)"
            )
        elif isinstance(prompt, (list, tuple)):
            if all(isinstance(p, str) for p in prompt):
                rows = _texts_to_ids(model, list(prompt))
            elif all(_is_chat(p) for p in prompt):
                rows = _texts_to_ids(model, [_chat_to_text(model, p) for p in prompt])
            elif all(isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p) for p in prompt):
                rows = [list(p) for p in prompt]
            else:
                raise ConfigError(
                    "a prompt list must hold only strings, only chat conversations, or only lists of token ids"
                )
        else:
            raise ConfigError(
                f"unsupported prompt of type {type(prompt).__name__}: pass a string, a list of strings, chat "
                "messages, a [B, P] token-id tensor or a list of token-id lists"
            )
        if any(len(r) == 0 for r in rows):
            raise ConfigError("empty prompt: every prompt needs at least one token")
        width = max(len(r) for r in rows)
        pad = model.filler_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device)
    validate(model, ids, mask)
    return ids, mask


def validate(model, ids: torch.Tensor, mask: torch.Tensor) -> None:
    if ids.shape[1] == 0 or bool((mask.sum(1) == 0).any()):
        raise ConfigError("empty prompt: every prompt needs at least one token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ConfigError("attention_mask must describe left padding (zeros before ones in every row)")
    if bool(((ids < 0) | (ids >= model.vocab_size)).any()):
        raise ConfigError(f"prompt token ids must lie in [0, {model.vocab_size}) (the model's vocabulary)")
    if bool(((ids == model.mask_id) & mask.bool()).any()):
        raise ConfigError(
            f"the prompt contains the mask token (id {model.mask_id}); infilling inside the prompt is not supported"
        )


def repeats(ids: torch.Tensor, mask: torch.Tensor, groups: list | None = None) -> list[int]:
    """For each row of the left-padded prompts ``ids`` / ``mask`` [B, P]: how many earlier rows hold the
    identical prompt (the same unpadded token ids; with ``groups``, one value per row such as its seed, in the same
    group). A prompt's first occurrence gets 0, as it does alone, so a row keyed by it draws the same random
    numbers in any batch while repeated prompts still differ."""
    seen: dict[tuple, int] = {}
    out = []
    for r, (row, valid) in enumerate(zip(ids.tolist(), mask.bool().tolist())):
        key = (None if groups is None else groups[r], *(t for t, v in zip(row, valid) if v))
        out.append(seen.get(key, 0))
        seen[key] = out[-1] + 1
    return out
