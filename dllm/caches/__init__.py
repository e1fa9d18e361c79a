"""K/V cache schemes. A cache decides which canvas columns a forward computes; it never decides
which tokens to commit. With its refresh forced every step, any cache gives the no-cache output."""

from dllm.caches.base import Cache
from dllm.caches.block import BlockCausal
from dllm.caches.elastic import Elastic
from dllm.caches.window import Window

CACHES: dict[str, type] = {cls.name: cls for cls in (Window, Elastic)}

__all__ = ["CACHES", "Cache", "BlockCausal", "Elastic", "Window"]
