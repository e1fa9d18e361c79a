"""K/V cache schemes. A cache decides which canvas columns a forward computes; it never decides
which tokens to commit. With its refresh forced every step, any cache gives the no-cache output."""

from dllm.caches.base import Cache
from dllm.caches.block import BlockCausal

__all__ = ["Cache", "BlockCausal"]
