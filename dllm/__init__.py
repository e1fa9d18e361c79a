"""dllm: fast, correct sampling from diffusion language models.

import dllm
model = dllm.load("GSAI-ML/LLaDA-8B-Instruct")        # or a local checkpoint directory
out = dllm.samplers.get("llada").generate(model, "What is 7*8?", max_new_tokens=64, block_size=32)
out.texts, out.nfe, out.tokens_per_forward
"""

from dllm import caches, samplers
from dllm.core.errors import CheckpointError, ConfigError, DllmError, ModelError, NumericalError
from dllm.core.generation import Generation, count_generated
from dllm.models import load

__version__ = "0.1.0"

__all__ = [
    "load",
    "samplers",
    "caches",
    "Generation",
    "count_generated",
    "DllmError",
    "ConfigError",
    "CheckpointError",
    "ModelError",
    "NumericalError",
]
