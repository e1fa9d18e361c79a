"""Per-step scoring of logits: one dispatchable seam (:mod:`dllm.kernels.dispatch`) in front of the
backends; ``reference`` defines the semantics in plain PyTorch, the Triton kernels compute the same."""

from dllm.kernels.dispatch import backends, register_backend, resolve, score, select, unregister_backend
from dllm.kernels.reference import STATS, Scores, ScoreSpec

__all__ = [
    "STATS",
    "ScoreSpec",
    "Scores",
    "backends",
    "register_backend",
    "resolve",
    "score",
    "select",
    "unregister_backend",
]
