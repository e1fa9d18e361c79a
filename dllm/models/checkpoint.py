"""Reading a checkpoint's files with errors that name the file and the field: ``config.json`` and the other
JSON files, the safetensors weights and the tokenizer.

A corrupt checkpoint (a truncated ``model.safetensors``, a ``config.json`` that is a list, ``"n_layers":
"four"``, ``"n_heads": null``, a broken ``tokenizer.json``) ends in a :class:`CheckpointError` saying which
file and which field is wrong, instead of the raw ``SafetensorError`` / ``AttributeError`` / ``TypeError`` the
reading code would raise deep inside.

The field checks cover the size fields the families read (LLaDA's official ``config.json`` names and the Qwen
names Dream and SDAR use) and the special token ids; a field that is absent is left to the family (it knows
its defaults and its required fields). Fields whose ``null`` means "use the default" in the official code
(``n_kv_heads``, ``head_dim``, ...) may be null. The weight files (:func:`weight_files`, single or sharded) are
checked against the model built from the config (:func:`check_tensors`: every missing, unexpected or mis-shaped
tensor named).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dllm.core.errors import CheckpointError
from dllm.models import registry
from dllm.models.base import DiffusionLM

# Size fields: positive integers. LLaDA's names, then Dream's / SDAR's (Qwen2 / Qwen3) names.
SIZES = (
    "d_model",
    "n_heads",
    "n_kv_heads",
    "n_layers",
    "mlp_hidden_size",
    "embedding_size",
    "max_sequence_length",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "block_size",
)
# Positive finite numbers.
NUMBERS = ("mlp_ratio", "rope_theta", "rms_norm_eps")
# Null means "the default" (the official code's ``or`` fallbacks).
NULLABLE = {"n_kv_heads", "mlp_hidden_size", "embedding_size", "num_key_value_heads", "head_dim"}
# Token ids: a non-negative integer or null; ``eos_token_id`` may also be a list of them.
TOKEN_IDS = ("mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id")


def read_json_object(path: Path) -> dict:
    """The JSON object (a mapping) in ``path``; a clear error when it is not valid JSON or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f'{path} must hold a JSON object ({{"field": value, ...}}), got a {type(value).__name__}; '
            "is it the checkpoint's config?"
        )
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: dict, path: Path) -> dict:
    """``config`` (read from ``path``) with every size, number and token-id field it has checked for type."""
    problems = []
    for key in SIZES:
        if key not in config or (config[key] is None and key in NULLABLE):
            continue
        value = config[key]
        if not _is_int(value) or value < 1:
            problems.append(f"{key}={value!r} (a positive integer)")
    for key in NUMBERS:
        value = config.get(key)
        if key in config and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0
        ):
            problems.append(f"{key}={value!r} (a positive number)")
    for key in TOKEN_IDS:
        value = config.get(key)
        ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
        if any(v is not None and (not _is_int(v) or v < 0) for v in ids):
            problems.append(f"{key}={value!r} (a token id: an integer >= 0, or null)")
    if problems:
        raise CheckpointError(f"{path}: bad field{'s' * (len(problems) > 1)} " + "; ".join(problems))
    return config


def read_config(path: Path) -> dict:
    """``config.json``: a JSON object whose size, number and token-id fields have the right types."""
    return check_config(read_json_object(path), path)


def read_safetensors(path: Path) -> dict:
    """The tensors of one safetensors file; a truncated or corrupt file is named with what to do."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors' SafetensorError, OSError; the file is damaged either way
        raise CheckpointError(
            f"{path} cannot be read as safetensors ({type(e).__name__}: {e}); the file is truncated or corrupt: "
            "download or copy it again"
        ) from None


def tokenizer_error(directory: Path, error: Exception) -> CheckpointError:
    """The error for a tokenizer that exists but cannot be built (a broken ``tokenizer.json``)."""
    return CheckpointError(
        f"{Path(directory) / 'tokenizer.json'} cannot be read as a tokenizer ({type(error).__name__}: {error}); "
        "the file is truncated or corrupt: download or copy it again"
    )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a single-file or sharded checkpoint (the shards its index lists): ``model.safetensors``
    where it exists (other safetensors files beside it, e.g. a Learn2PD filter, are not weights), else every one."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shard files listed in {index.name} are missing: {missing}")
        return [directory / shard for shard in shards]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")
    return files


def check_tensors(model: DiffusionLM, shapes: dict[str, tuple[int, ...]], where: str) -> list[str]:
    """The checkpoint tensor names to load into ``model`` (every one of its state-dict keys but a tied head),
    given the checkpoint's tensor ``shapes`` by name; a :class:`CheckpointError` naming every missing,
    unexpected or mis-shaped tensor."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    family = registry.of_model(model)
    if family.head_is_tied(model.config):  # tied head: checkpoints may or may not store it
        shapes = {k: v for k, v in shapes.items() if k != family.tied_head}
        expected.pop(family.tied_head, None)
    shapes = {k: v for k, v in shapes.items() if k in expected or not k.startswith(family.ignored)}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(k for k in set(shapes) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    mismatched = [
        f"{k}: checkpoint {shapes[k]} vs config {v}" for k, v in expected.items() if k in shapes and shapes[k] != v
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {few(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {few(mismatched)}")
    if problems:
        raise CheckpointError(f"{where} does not match its config.json ({model.family}): " + "; ".join(problems))
    return list(expected)


def few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")
