"""One exception family. Every message says what was wrong and what to do instead."""


class DllmError(Exception):
    """Base class of every error raised by dllm."""


class ConfigError(DllmError, ValueError):
    """Invalid arguments: lengths, steps, block sizes, unknown sampler or hyper-parameter."""


class CheckpointError(DllmError):
    """A model directory or hub id that cannot be loaded (missing files, tensors, unknown family)."""


class ModelError(DllmError):
    """A model that cannot be used as asked (no mask token, pad id equal to mask id, too long input)."""


class NumericalError(DllmError):
    """The model produced NaN or infinite logits."""
