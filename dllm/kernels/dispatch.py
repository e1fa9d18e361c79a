"""The dispatchable scoring seam: one :func:`score` with a small registry of backends behind it.

Every backend implements the signature of :func:`dllm.kernels.reference.score`,
``score(logits [N, V], spec: ScoreSpec, counters: Counters | None) -> Scores``, and computes what the
reference computes (what may differ in the last bit is each backend's docstring's to say). Two are built in:

- ``"torch"``: the PyTorch reference, everywhere;
- ``"triton"``: the fused kernels of :mod:`dllm.kernels.triton_score`, imported on first use. It runs on CUDA,
  or on the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` is set. A spec the kernel does not
  fuse (its ``supports(spec, logits)`` is False) is scored by the reference, call by call.

Beside it, :func:`select` dispatches kernel B (the commit of a step: selection and write-back, issue 19 item 3)
through the same registry: a backend may carry a ``selector`` (``"torch"``: :mod:`dllm.kernels.selection`;
``"triton"``: :mod:`dllm.kernels.triton_select`); a backend without one, or whose selector does not support a
rule on the given confidences, commits through the reference.

:func:`resolve` turns a user's choice (``"auto"``, ``"torch"``, ``"triton"``, or a registered name) into a
backend name for a device, with a :class:`~dllm.core.errors.ConfigError` saying what to do when it cannot run
there; ``"auto"`` is Triton on CUDA when it imports, the reference elsewhere. (Design: issue 19 and
research/caches_kernels.md §10; SGLang keeps a PyTorch reference beside each Triton kernel in the same way.)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable

import torch

from dllm.core.errors import ConfigError
from dllm.core.registry import Registry
from dllm.core.rng import Counters
from dllm.kernels import reference, selection
from dllm.kernels.reference import Scores, ScoreSpec
from dllm.kernels.selection import Rule

CHOICES = ("auto", "torch", "triton")  # what generate(kernel=...) accepts besides other registered names


@dataclasses.dataclass(frozen=True)
class Backend:
    """A scorer. score: the reference's signature. supports(spec, logits): whether it handles this call (else
    the reference does). usable(device): None when it can run on ``device``, else the reason and what to do
    (a sentence); auto(device): whether ``"auto"`` picks it there. ``load`` (optional) returns ``(score,
    supports)`` on first use, for backends whose module imports lazily. selector (optional): returns
    ``(select_and_commit, supports)`` on first use, kernel B's (:func:`select`); None: the reference commits."""

    name: str
    score: Callable | None = None
    supports: Callable | None = None
    usable: Callable[[torch.device], str | None] = lambda device: None
    auto: Callable[[torch.device], bool] = lambda device: False
    load: Callable | None = None
    selector: Callable | None = None


BACKENDS = Registry("scoring backend")
_LOADED: dict[str, tuple[Callable, Callable | None]] = {}


def register_backend(
    name: str, score=None, *, supports=None, usable=None, auto=None, load=None, selector=None, replace: bool = False
) -> None:
    """Register a scoring backend under ``name`` (see :class:`Backend`; ``score`` or ``load`` is required).
    ``replace=True`` overrides an existing registration (tests register fakes)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ConfigError(f"a scoring backend needs a name other than 'auto', got {name!r}")
    if score is None and load is None:
        raise ConfigError(f"scoring backend {name!r}: give its score function (or a load function returning it)")
    fields = {"usable": usable, "auto": auto}
    backend = Backend(
        name, score, supports, load=load, selector=selector, **{k: v for k, v in fields.items() if v is not None}
    )
    BACKENDS.register(backend, replace=replace)
    _LOADED.pop(name, None)
    _LOADED.pop(("select", name), None)


def unregister_backend(name: str) -> None:
    """Remove a registered backend (the built-in ``"torch"`` stays)."""
    if name == "torch":
        raise ConfigError("the reference backend 'torch' cannot be removed")
    BACKENDS.remove(name)
    _LOADED.pop(name, None)
    _LOADED.pop(("select", name), None)


def backends() -> tuple[str, ...]:
    """The registered backend names."""
    return tuple(BACKENDS.names())


def resolve(kernel: str, device) -> str:
    """The backend that scores on ``device`` for the choice ``kernel`` ("auto", "torch", "triton", or another
    registered name); a ConfigError naming the choice and what to do when it cannot run there."""
    if not isinstance(kernel, str) or (kernel != "auto" and kernel not in BACKENDS):
        known = ", ".join(repr(k) for k in ("auto", *BACKENDS))
        raise ConfigError(f"kernel must be one of {known}, got {kernel!r}")
    device = torch.device(device)
    if kernel == "auto":
        for backend in BACKENDS.values():
            if backend.name != "torch" and backend.auto(device) and backend.usable(device) is None:
                return _loaded(backend.name)
        return "torch"
    reason = BACKENDS.get(kernel).usable(device)
    if reason is not None:
        raise ConfigError(f"kernel={kernel!r} cannot score on {device}: {reason}")
    return _loaded(kernel)


def _loaded(name: str) -> str:
    """``name`` with its functions loaded now, before a run: a compiled step calls them, and dynamo cannot trace
    the import a first call would make (seen on an H200 with torch 2.11)."""
    _functions(name)
    _selector(name)
    return name


def chosen(spec: ScoreSpec, logits: torch.Tensor, backend: str = "torch") -> str:
    """The backend that scores this call: ``backend``, or ``"torch"`` when ``backend`` does not support
    ``spec`` on these logits."""
    if backend == "torch":
        return backend
    score_fn, supports = _functions(backend)
    return backend if supports is None or supports(spec, logits) else "torch"


def score(logits: torch.Tensor, spec: ScoreSpec, counters: Counters | None = None, backend: str = "torch") -> Scores:
    """:func:`dllm.kernels.reference.score` of ``logits`` [N, V] by ``backend`` (a name :func:`resolve`
    returned), falling back to the reference when the backend does not support ``spec``."""
    name = chosen(spec, logits, backend)
    return _functions(name)[0](logits, spec, counters)


def chosen_selector(rule: Rule, confidence: torch.Tensor, backend: str = "torch") -> str:
    """The backend whose selector commits this call: ``backend``, or ``"torch"`` when it has no selector or its
    selector does not support ``rule`` on ``confidence``."""
    if backend == "torch":
        return backend
    fn, supports = _selector(backend)
    return backend if fn is not None and (supports is None or supports(rule, confidence)) else "torch"


def select(
    rule: Rule,
    confidence: torch.Tensor,
    committable: torch.Tensor,
    proposals: torch.Tensor,
    tokens: torch.Tensor,
    quota: torch.Tensor | None = None,
    finish: torch.Tensor | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel B by ``backend``: :func:`dllm.kernels.selection.select_and_commit` (the slots ``rule`` commits
    among ``committable`` [B, L] by ``confidence`` [B, L], their ``proposals`` written into ``tokens`` in place;
    returns (commit bool [B, L], per-row counts [B]) with no host synchronisation), falling back to the
    reference for a rule the backend does not fuse."""
    name = chosen_selector(rule, confidence, backend)
    return _selector(name)[0](rule, confidence, committable, proposals, tokens, quota, finish)


def _selector(name: str) -> tuple[Callable | None, Callable | None]:
    key = ("select", name)
    if key not in _LOADED:
        selector = BACKENDS.get(name).selector
        _LOADED[key] = selector() if selector is not None else (None, None)
    return _LOADED[key]


def _functions(name: str) -> tuple[Callable, Callable | None]:
    if name not in _LOADED:
        backend = BACKENDS.get(name)
        _LOADED[name] = backend.load() if backend.load is not None else (backend.score, backend.supports)
    return _LOADED[name]


# -- the built-in backends -----------------------------------------------------------------------------
TRITON_MODULE = "dllm.kernels.triton_score"
TRITON_SELECT_MODULE = "dllm.kernels.triton_select"


def _triton_imports() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken installation
        return False
    return True


def _triton_usable(device: torch.device) -> str | None:
    if not _triton_imports():
        return "the triton package does not import; install it (pip install triton) or use kernel='torch'"
    if importlib.util.find_spec(TRITON_MODULE) is None:
        return "this dllm has no Triton scoring kernels (dllm/kernels/triton_score.py); use kernel='torch'"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels run through Triton's (slow) interpreter
        return None
    return (
        "the Triton kernels run on CUDA devices; on the CPU only through Triton's interpreter (set the "
        "environment variable TRITON_INTERPRET=1 before starting Python, slow, for tests); or use kernel='torch'"
    )


def _load_triton():
    """The kernels' score and supports; built for Triton's interpreter when ``TRITON_INTERPRET=1`` (Triton reads
    the variable when a kernel is decorated, so a module imported before it was set is reloaded; Triton's own
    library must have been imported with it set too: set it before starting Python)."""
    module = _triton_module(TRITON_MODULE)
    return module.score, module.supports


def _load_triton_select():
    """Kernel B's select_and_commit and supports (None, None when this dllm has no such module), loaded as
    :func:`_load_triton` loads kernel A."""
    if importlib.util.find_spec(TRITON_SELECT_MODULE) is None:
        return None, None
    module = _triton_module(TRITON_SELECT_MODULE)
    return module.select_and_commit, module.supports


def _triton_module(name: str):
    module = importlib.import_module(name)
    interpreted = getattr(module, "interpreted", None)
    if os.environ.get("TRITON_INTERPRET") == "1" and interpreted is not None and not interpreted():
        module = importlib.reload(module)
    return module


register_backend("torch", reference.score, selector=lambda: (selection.select_and_commit, None))
register_backend(
    "triton",
    load=_load_triton,
    selector=_load_triton_select,
    usable=_triton_usable,
    auto=lambda device: device.type == "cuda",
)
