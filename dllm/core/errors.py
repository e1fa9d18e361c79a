"""One exception family. Every message says what was wrong and what to do instead."""


def plural(n, word: str) -> str:
    """``"1 block"``, ``"3 blocks"``: a count and its noun, for messages."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class DllmError(Exception):
    """Base class of every error raised by dllm."""


class ConfigError(DllmError, ValueError):
    """Invalid arguments: lengths, steps, block sizes, unknown sampler or hyper-parameter."""


class LengthError(ConfigError):
    """A prompt and its generation longer than the model's maximum length (the server answers it as OpenAI's
    ``context_length_exceeded``)."""


class CheckpointError(DllmError):
    """A model directory or hub id that cannot be loaded (missing files, tensors, unknown family)."""


class ModelError(DllmError):
    """A model that cannot be used as asked (no mask token, pad id equal to mask id, too long input)."""


class NumericalError(DllmError):
    """The model produced NaN or infinite logits."""


class DllmWarning(UserWarning):
    """A setting that runs but probably does not do what was meant (the command line prints it as
    ``dllm: warning: ...``)."""


class Checks:
    """Checks computed on the device and read back later, in one host synchronisation with the loop's
    other flags, instead of one synchronisation each: ``add(bad, error)`` records a bool tensor that must
    be False; ``verify(values)`` raises the first error whose flag was read back True."""

    def __init__(self):
        self.pending: list[tuple[object, DllmError]] = []

    def add(self, bad, error: DllmError) -> None:
        self.pending.append((bad, error))

    def flags(self) -> list:
        return [bad for bad, _ in self.pending]

    def verify(self, values: list) -> None:
        errors = [error for (_, error), bad in zip(self.pending, values) if bad]
        self.pending.clear()
        if errors:
            raise errors[0]

    def now(self) -> None:
        """Read back and verify everything pending (one synchronisation)."""
        import torch

        if self.pending:
            self.verify(torch.stack([torch.as_tensor(f).reshape(()) for f in self.flags()]).tolist())


def require(bad, error: DllmError, checks: Checks | None = None) -> None:
    """Raise ``error`` if the bool tensor ``bad`` is True: now (one synchronisation), or at the next
    read-back of ``checks`` when given."""
    if checks is not None:
        checks.add(bad, error)
    elif bool(bad):
        raise error
