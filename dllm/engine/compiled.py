"""``generate(compile=...)``: the model forward (:meth:`~dllm.models.base.DiffusionLM.hidden`, the decoder body
every counted forward runs) through ``torch.compile``.

``compile=True`` (inductor) or a backend name; ``compile="reduce-overhead"`` (torch's name for CUDA graphs):
inductor with ``mode="reduce-overhead"``, ``dynamic=False``, and ``static_shapes`` forced on. One compiled function
per model, setting and shape mode, kept on the model, so later generations reuse the compiled graphs.

Dynamic shapes (the default path): ``dynamic=True``; a cached step's query width, the batch (rows leave it) and
the canvas width change between forwards, and one symbolic-shape graph serves them instead of a recompilation
per shape. Each forward is one graph (no graph break): one for full forwards and one per kind of cached forward
(queries with or without a key set, ``write`` all or per column), and the K/V store is allocated at its final
size before the first forward, so a later generation, whatever its batch or lengths, compiles nothing new.

Static shapes (``static_shapes=True``, :mod:`dllm.engine.static`): every forward of a run has the whole batch and
the cached forwards a bucketed query width, so the forward is compiled with ``dynamic=False``: one graph per
(forward kind, bucket width) for a given batch and canvas, few (a generation of the same shapes compiles
nothing; tested with ``torch._dynamo.utils.counters``).

Dynamo's recompile limit (per function: 8 graphs, shared by every model, since the graphs take the weights as
inputs) is raised to :data:`RECOMPILE_LIMIT` when a forward is compiled: past it, dynamo runs the forward eager
with one warning, which made the forwards of a long sweep (or of many bucket widths) silently eager.

With static shapes the scoring seam's torch path (:func:`dllm.kernels.reference.score`, what
:func:`dllm.kernels.dispatch.score` runs for the ``"torch"`` backend) is compiled the same way (:func:`score`: one
graph per scoring shape and spec, no graph break); the Triton backend's kernels are not.

Capture (``"reduce-overhead"``), what is done: static-shape steps (rows in place, the store never compacted,
bucketed widths); the forward and the torch scoring compiled by inductor in that mode; the K/V store's buffers
(and ``filled``, and Elastic's kept inputs) marked as static addresses (``torch._dynamo.mark_static_address``,
unguarded) when the store is allocated, so that cudagraph trees accept the forward's in-place writes into them
instead of copying them in and out; ``torch.compiler.cudagraph_mark_step_begin()`` before each step's forward
(the loop reads nothing of the last step's outputs). A finished run leaves its store's buffers on the model and
the next run of the same batch and canvas takes them (:func:`take_store`), so that it replays the recorded graphs
at their recorded addresses instead of recording them again. The device step's own state (the canvas, the loop's
per-row counters, the forward count) is kept at fixed addresses the same way (:func:`take_state`).

On a GPU ``eval/gpu/test_cuda.py`` checks it (the eager tokens and forwards; a first generation that records
its graphs, a second that records none; no cudagraph skipped); its figures are in ``eval/results/gpu``.

Not verified: that nothing keeps a captured output past the next step (cudagraph trees overwrite it).
Elastic-Cache's probe keeps tensors computed inside the forward, and its forwards have per-step shapes anyway, so
it is no capture candidate. Still outside the captured region: the cache plan (one read-back per step: the plan's
width), the scoring and selection kernels, Python, and the forwards a sampler runs besides the loop's.

Compiled forwards give the same tokens and forwards as eager ones up to floating-point rounding of the fused
kernels (tested exactly with the ``aot_eager`` backend, which traces the same graphs without generating kernels;
inductor on the bundled models gave the same tokens too).
"""

from __future__ import annotations

import torch

from dllm.core.errors import ConfigError

CAPTURE = "reduce-overhead"  # compile= value: inductor with CUDA graphs (torch.compile's mode name)
RECOMPILE_LIMIT = 64  # dynamo's recompile limit, raised to this when a forward is compiled (torch's default: 8)


def check(compile) -> str | None:
    """What a ``compile=`` argument asks for: None (eager), ``"inductor"`` (True), :data:`CAPTURE`
    (``"reduce-overhead"``) or a ``torch.compile`` backend name."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and (compile == CAPTURE or compile in torch._dynamo.list_backends(exclude_tags=())):
        return compile
    raise ConfigError(
        f"compile must be True, False, {CAPTURE!r} (inductor with CUDA graphs) or a torch.compile backend name "
        f"({', '.join(torch._dynamo.list_backends())}), got {compile!r}"
    )


def captures(compile: str | None) -> bool:
    """Whether a checked ``compile`` value captures CUDA graphs (and so forces static shapes)."""
    return compile == CAPTURE


def hidden(model, compile: str | None, static: bool = False):
    """``model.hidden``, compiled as ``compile`` (a :func:`check` value; None: as it is) asks, with
    ``dynamic=False`` for static shapes."""
    if compile is None:
        return model.hidden
    compiled = model.__dict__.setdefault("_dllm_compiled", {})
    key = (compile, static or captures(compile))
    if key not in compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if captures(compile):
            compiled[key] = torch.compile(model.hidden, backend="inductor", mode=CAPTURE, dynamic=False)
        else:
            compiled[key] = torch.compile(model.hidden, backend=compile, dynamic=not static)
    return compiled[key]


_SCORES: dict = {}  # compile value -> the compiled reference scoring


def score(compile: str | None, static: bool = False):
    """:func:`dllm.kernels.reference.score` (the scoring seam's torch path) compiled as ``compile`` asks, with
    ``dynamic=False``, for static shapes (and so for :data:`CAPTURE`); None otherwise (the seam runs eager)."""
    if compile is None or not (static or captures(compile)):
        return None
    if compile not in _SCORES:
        from dllm.kernels import reference

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if captures(compile):
            _SCORES[compile] = torch.compile(reference.score, backend="inductor", mode=CAPTURE, dynamic=False)
        else:
            _SCORES[compile] = torch.compile(reference.score, backend=compile, dynamic=False)
    return _SCORES[compile]


def mark_static(kv) -> None:
    """Mark the K/V store's buffers as static addresses for CUDA-graph capture (unguarded: a new address
    re-records instead of recompiling)."""
    for store in (kv.k, kv.v, kv.inputs):
        for tensor in store.values():
            torch._dynamo.mark_static_address(tensor)
    if kv.filled is not None:
        torch._dynamo.mark_static_address(kv.filled)


def take_store(kv, model, batch: int, length: int) -> None:
    """Give a captured run's K/V store ``kv`` its buffers: those a finished captured run of the same layout left
    on ``model`` (:func:`return_store`), with ``filled`` cleared, else new ones marked static. A recorded CUDA
    graph replays on the addresses it was recorded with: a store at new addresses would make every graph of the
    run record again (and past cudagraph trees' re-record limit, run eager). A run takes the buffers it finds,
    so two runs at once never share them (the second allocates its own)."""
    held = model.__dict__.setdefault("_dllm_capture_stores", {}).pop((batch, length, kv.keeps_inputs), None)
    if held is None:
        kv.allocate(model, batch, length)
        mark_static(kv)
        return
    kv.k, kv.v, kv.inputs, kv.filled = held
    kv.filled.zero_()  # nothing written yet (the model reads only filled columns)


def take_state(model, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The captured device step's state (the tensors a step writes in place: :meth:`dllm.engine.device.DeviceSteps.
    state`) at the addresses a finished captured run of the same shapes left on ``model`` (:func:`return_state`),
    holding ``tensors``' values; else ``tensors`` themselves, marked static. As for the K/V store: a graph recorded
    on a state at other addresses would record again (seen on an H200: every second generation recorded its graphs
    again)."""
    held = model.__dict__.setdefault("_dllm_capture_states", {}).pop(_layout(tensors), None)
    if held is None:
        for tensor in tensors:
            torch._dynamo.mark_static_address(tensor)
        return tensors
    for buffer, tensor in zip(held, tensors):
        buffer.copy_(tensor)
    return held


def return_state(model, tensors: list[torch.Tensor]) -> None:
    """Leave a finished captured run's state buffers on ``model`` for the next run of the same shapes (the run
    keeps copies: its output must not change when the buffers are written again)."""
    model.__dict__.setdefault("_dllm_capture_states", {})[_layout(tensors)] = tensors


def _layout(tensors: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def return_store(kv, model) -> None:
    """Leave a finished captured run's buffers on ``model`` for the next run of the same layout (one set per
    layout: the memory of one store, which the captured graphs' pool holds anyway)."""
    batch, length = kv.filled.shape
    model.__dict__.setdefault("_dllm_capture_stores", {})[(batch, length, kv.keeps_inputs)] = (
        kv.k, kv.v, kv.inputs, kv.filled,
    )  # fmt: skip
