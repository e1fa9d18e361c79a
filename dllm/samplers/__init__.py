"""Samplers: each a frozen dataclass of its hyper-parameters sharing one denoising loop."""

from dllm.samplers.base import Sampler
from dllm.samplers.confidence import Factor, LLaDA, Threshold
from dllm.samplers.dream import Dream
from dllm.samplers.registry import defaults, get, names, reference
from dllm.samplers.sdar import SDAR

__all__ = ["Sampler", "LLaDA", "Dream", "SDAR", "Threshold", "Factor", "get", "names", "defaults", "reference"]
