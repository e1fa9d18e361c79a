"""Model adapters: one file per family (declared in :mod:`dllm.models.registry`), shared layers, loading from
the official layout."""

from dllm.models.base import DiffusionLM
from dllm.models.dream import Dream
from dllm.models.layers import KVStore
from dllm.models.llada import LLaDA
from dllm.models.loading import build, load
from dllm.models.saving import save
from dllm.models.sdar import SDAR
from dllm.models.wedlm import WeDLM

__all__ = ["DiffusionLM", "LLaDA", "Dream", "SDAR", "WeDLM", "KVStore", "load", "build", "save"]
