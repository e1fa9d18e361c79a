"""What every command line of the package shares (``dllm``, ``python -m dllm.train``, ``python -m dllm.bench.*``):
one error line instead of a traceback, and torch's CPU threads."""

from __future__ import annotations

import sys
from collections.abc import Callable

from dllm.core.errors import ConfigError, DllmError


def exit_status(prog: str, body, spell: Callable[[str], str] | None = None, resume=lambda: None) -> int:
    """``body()``'s exit status: a dllm error ends in one ``PROG: error:`` line (status 2; its advice rewritten by
    ``spell``, e.g. in the spelling of ``dllm COMMAND``), Ctrl-C in one ``PROG: interrupted`` line (status 130, as
    the shell's for SIGINT) followed by ``resume()``'s advice when it has one (e.g. "resume with the same
    command"), never a traceback."""
    try:
        return body() or 0
    except DllmError as e:
        print(f"{prog}: error: {spell(str(e)) if spell else e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        advice = resume()
        print(f"{prog}: interrupted" + (f"; {advice}" if advice else ""), file=sys.stderr)
        return 130


def set_threads(threads: int | None) -> None:
    """``--threads N``: torch's intra-op threads on the CPU (default: torch's choice, one per core)."""
    if threads is None:
        return
    if threads < 1:
        raise ConfigError(f"--threads must be a positive integer, got {threads}")
    import torch

    torch.set_num_threads(threads)
