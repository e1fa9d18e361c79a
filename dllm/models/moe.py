"""Mixture-of-experts feed-forward without host reads: one grouped GEMM per projection over the rows sorted by
expert (``torch._grouped_mm``, where this torch has it for the device and dtype), the sorted per-expert loop of
the families (one read of the per-expert counts per layer) beside it as the reference.

The grouped path needs each projection's experts in one ``[E, out, in]`` tensor: DiffusionGemma's published layout
stores them so; LLaDA2's stores one ``nn.Linear`` per expert, which :func:`stack_experts` (called by
:func:`dllm.load` on a model on one device) turns into views of one stacked tensor, the parameters and their
state-dict keys unchanged, no memory added. A model moved or cast afterwards (``model.to``) stacks them again
(:meth:`dllm.models.base.DiffusionLM._apply`).

The grouped path runs without autograd (generation); training takes the sorted one, whose gradients reach every
expert's own parameters.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

_USABLE: dict[tuple[str, torch.dtype], bool] = {}


def grouped_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` in ``dtype`` here (tried once per device type and dtype)."""
    key = (torch.device(device).type, dtype)
    if key not in _USABLE:
        if torch.compiler.is_compiling():  # never tried inside a trace (:meth:`prepare` of a family tries it at load)
            return False
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.ones(4, 8, device=device, dtype=dtype)
                w = torch.ones(2, 8, 8, device=device, dtype=dtype)
                offsets = torch.tensor([1, 4], device=device, dtype=torch.int32)
                ok = bool(torch._grouped_mm(x, w.transpose(1, 2), offs=offsets).eq(8).all())
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                ok = False
        _USABLE[key] = ok
    return _USABLE[key]


def use_grouped(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The grouped path for these rows and expert weights: no autograd, and a ``_grouped_mm`` that runs here (traced
    by torch.compile: in bfloat16 only, the one dtype its shape function takes, whatever the device's kernel does)."""
    if torch.is_grad_enabled() or weight.device != x.device:
        return False
    if torch.compiler.is_compiling() and weight.dtype != torch.bfloat16:
        return False
    return grouped_usable(x.device, weight.dtype)


def grouped(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate, up, down, act) -> torch.Tensor:
    """Σ_j weights[i, j] · down[e](act(gate[e] x[i]) * up[e] x[i]), e = chosen[i, j], for every row i of ``x``
    [n, d]: the (row, slot) pairs sorted by expert, each projection one grouped GEMM over them (``gate`` / ``up``
    [E, f, d], ``down`` [E, d, f], as ``nn.Linear`` weights; ``up`` None: ``gate`` holds gate and up, [E, 2f, d]).
    The per-expert offsets stay on the device: no host read."""
    n, k = chosen.shape
    experts = gate.shape[0]
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    rows = order // k
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offsets = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, rows)
    h = torch._grouped_mm(xs, gate.transpose(1, 2), offs=offsets)
    if up is None:
        g, u = h.chunk(2, dim=-1)
    else:
        g, u = h, torch._grouped_mm(xs, up.transpose(1, 2), offs=offsets)
    out = torch._grouped_mm(act(g) * u, down.transpose(1, 2), offs=offsets)
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, rows, out)


@dataclasses.dataclass
class Stacked:
    """One projection of every expert as views of one ``[E, out, in]`` tensor (see :func:`stack_experts`)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@torch.no_grad()
def stack_experts(experts: nn.ModuleList) -> Stacked | None:
    """Stack the gated-MLP experts' weights (``gate_proj``, ``up_proj``, ``down_proj`` of each) into three
    ``[E, out, in]`` tensors and make every expert's weights views of them (the same parameters, keys and values;
    no memory added once the old storage is freed). None where they cannot be stacked (biases, weights on
    different devices or dtypes, meta tensors, a device map's hooks)."""
    linears = [[getattr(e, name) for e in experts] for name in ("gate_proj", "up_proj", "down_proj")]
    weights = [lin.weight for group in linears for lin in group]
    if any(lin.bias is not None for group in linears for lin in group) or any(w.is_meta for w in weights):
        return None
    if len({(w.device, w.dtype) for w in weights}) != 1 or any(hasattr(e, "_hf_hook") for e in experts):
        return None
    stacked = []
    for group in linears:
        tensor = torch.stack([lin.weight.data for lin in group])
        for e, lin in enumerate(group):
            lin.weight.data = tensor[e]
        stacked.append(tensor)
    return Stacked(*stacked)
