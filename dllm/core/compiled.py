"""``generate(compile=...)``: the model forward (:meth:`~dllm.models.base.DiffusionLM.hidden`, the decoder body
every counted forward runs) through ``torch.compile``.

One compiled function per model and backend, kept on the model, so later generations reuse the compiled
graphs. ``dynamic=True``: a cached step's query width, the batch (rows leave it) and the canvas width change
between forwards, and one symbolic-shape graph serves them instead of a recompilation per shape. Each forward
is one graph (no graph break): one for full forwards and one per kind of cached forward (queries with or
without a key set, ``write`` all or per column), and the K/V store is allocated at its final size before the
first forward, so a later generation, whatever its batch or lengths, compiles nothing new.

Not yet a CUDA-graph capture (``mode="reduce-overhead"``): the host still decides each step's shapes (one
read-back per step: the plan's query width, rows leaving the batch), the cache plan, scoring and selection run
eager, and the store is compacted when rows finish. Capture needs static-shape steps: a fixed query width per
phase (a block for dual / prefix, the window for Window / Elastic, padded with masked-out columns), rows kept
in place with a done flag instead of compaction, the plan computed on the device, and the scoring seam and
selection inside the captured region. Compiled forwards give the same tokens and forwards as eager ones up to
floating-point rounding of the fused kernels (tested exactly with the ``aot_eager`` backend, which traces the
same graphs without generating kernels; inductor on the bundled models gave the same tokens too).
"""

from __future__ import annotations

import torch

from dllm.core.errors import ConfigError


def check(compile) -> str | None:
    """The backend a ``compile=`` argument asks for: None (eager), ``"inductor"`` (True) or a backend name."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile in torch._dynamo.list_backends(exclude_tags=()):
        return compile
    raise ConfigError(
        f"compile must be True, False or a torch.compile backend name "
        f"({', '.join(torch._dynamo.list_backends())}), got {compile!r}"
    )


def hidden(model, backend: str | None):
    """``model.hidden``, compiled with ``backend`` (None: as it is)."""
    if backend is None:
        return model.hidden
    compiled = model.__dict__.setdefault("_dllm_compiled", {})
    if backend not in compiled:
        compiled[backend] = torch.compile(model.hidden, dynamic=True, backend=backend)
    return compiled[backend]
