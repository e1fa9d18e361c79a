"""dllm: fast, correct sampling from diffusion language models.

import dllm
model = dllm.load("GSAI-ML/LLaDA-8B-Instruct")        # or a local checkpoint directory
out = dllm.samplers.get("llada").generate(model, "What is 7*8?", max_new_tokens=64, block_size=32)
out.texts, out.nfe, out.tokens_per_forward
"""

from __future__ import annotations

import importlib

from dllm.core.errors import CheckpointError, ConfigError, DllmError, ModelError, NumericalError

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that ``import dllm`` and ``dllm --help`` do not import torch (seconds).
_LAZY = {
    "load": ("dllm.models", "load"),
    "samplers": ("dllm.samplers", None),
    "caches": ("dllm.caches", None),
    "constraints": ("dllm.constraints", None),
    "Hole": ("dllm.constraints", "Hole"),
    "Generation": ("dllm.engine.generation", "Generation"),
    "count_generated": ("dllm.engine.generation", "count_generated"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'dllm' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "load",
    "samplers",
    "caches",
    "constraints",
    "Hole",
    "Generation",
    "count_generated",
    "DllmError",
    "ConfigError",
    "CheckpointError",
    "ModelError",
    "NumericalError",
]
