"""Shared transformer pieces: RMSNorm, rotary embedding, attention with a K/V store, gated MLP.

Precision rules follow the official modeling code of each family:
- RMSNorm normalises in float32 and casts back before multiplying by the weight (LLaDA, Qwen2, Qwen3).
- Rotary: LLaDA rotates q/k in float32 (``rope_full_precision``); Qwen-style models (Dream, SDAR) cast
  cos/sin to the activation dtype and rotate in that dtype. Both agree exactly in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dllm.core.plan import Observer
from dllm.models.kv import KVStore

try:  # optional fast path on CUDA; PyTorch SDPA is the default backend
    from flash_attn import flash_attn_func as _flash_attn_func
except Exception:  # pragma: no cover - flash-attn is a GPU-only optional extra
    _flash_attn_func = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [B, 1, T, head_dim] in float32 for integer ``positions`` [B, T] (NeoX halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(q, k, cos, sin, full_precision: bool):
    """Rotate q and k ([B, H, T, D]). ``full_precision``: rotate in float32 (LLaDA), else in q's dtype."""
    dtype = q.dtype
    if full_precision:
        q, k = q.float(), k.float()
    else:
        cos, sin = cos.to(dtype), sin.to(dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q.to(dtype), k.to(dtype)


@dataclass
class ForwardContext:
    """What every attention layer of one forward needs: which columns, which keys, which store."""

    queries: torch.Tensor | None  # [B, R] column index of each query row, None = all columns
    length: int  # canvas length L (number of key columns)
    mask: torch.Tensor | None  # bool [B, 1, R, L] (True = attend) or None = attend to everything
    kv: KVStore | None
    write: bool | torch.Tensor = True  # store the fresh K/V of the queries: all, none, or bool [B, R]
    observer: Observer | None = None
    # bool [B, L] (full forwards only): columns whose stored K/V and input this layer uses unchanged (a row that
    # has not reached its first refreshed layer, :meth:`dllm.models.base.DiffusionLM.hidden`'s ``row_start``)
    reuse: torch.Tensor | None = None
    # this context on other devices (:meth:`on`), made once per device and forward
    placed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def on(self, device: torch.device, home: torch.device) -> ForwardContext:
        """This context for a layer computing on ``device`` while the canvas is on ``home`` (a model whose layers
        a device map spread over devices, :func:`dllm.load`'s ``device_map``): its queries, mask, ``write`` and
        ``reuse`` on ``device``, copied once per device and forward (``reuse``, which changes per layer, each
        time); the K/V store as it is (each layer's buffers live on the layer's device); the observer sees the
        layer's tensors on ``home``, as on a model on one device. Itself when ``device`` is ``home``."""
        if device == home:
            return self
        placed = self.placed.get(device)
        if placed is None:
            observer = None if self.observer is None else _Homed(self.observer, home)
            queries, mask, write = (_moved(t, device) for t in (self.queries, self.mask, self.write))
            placed = self.placed[device] = ForwardContext(queries, self.length, mask, self.kv, write, observer)
        placed.reuse = _moved(self.reuse, device)
        return placed


def _moved(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


class _Homed(Observer):
    """An observer that receives a placed layer's tensors on the canvas's device (:meth:`ForwardContext.on`)."""

    def __init__(self, observer: Observer, home: torch.device):
        self.observer, self.home = observer, home

    def layer(self, index, hidden):
        self.observer.layer(index, hidden.to(self.home))

    def attention(self, index, q, keys, mask):
        self.observer.attention(index, q.to(self.home), keys.to(self.home), _moved(mask, self.home))


# The attribute :func:`dllm.load` sets on the modules a device map placed (the embedding, each decoder layer, the
# final norm, the LM head): the device the module computes on, where its weights live or are brought for each
# forward (CPU and disk offload, accelerate's hooks). Absent: a model on one device.
PLACED = "dllm_execution_device"


def execution_device(module: nn.Module) -> torch.device | None:
    """The device ``module`` computes on when a device map placed it (:data:`PLACED`); None on a model on one
    device (it computes where its weights are)."""
    return getattr(module, PLACED, None)


def with_weights(module: nn.Module, fn, *args):
    """``fn(*args)`` reading ``module``'s weights outside its own forward (a tied LM head reads the embedding
    matrix): where accelerate's hooks offload them (a device map's CPU or disk offload), they are brought to the
    module's execution device for the call and offloaded after it, as for the module's forward, and the tensors
    among ``args`` moved there; without hooks, ``fn(*args)``."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return fn(*args)
    args, _ = hook.pre_forward(module, *args)
    return hook.post_forward(module, fn(*args))


def attend(layer: int, q, k, v, ctx: ForwardContext) -> torch.Tensor:
    """Attention of query rows q [B, H, R, D] against the canvas keys; returns [B, R, H*D].

    k, v [B, H_kv, R, D] are the fresh keys/values of the query rows. Without ``queries`` they are the
    whole canvas. With ``queries`` the other columns come from the K/V store: the fresh rows are written
    into the store in place and attended there; the rows ``write`` does not keep get their stored values
    back after the attention (no copy of the store).
    """
    restore = None
    if ctx.kv is not None:
        if ctx.queries is None:
            if ctx.reuse is not None:  # these columns keep their stored K/V at this layer
                reuse = ctx.reuse[:, None, :, None]
                k, v = torch.where(reuse, ctx.kv.k[layer], k), torch.where(reuse, ctx.kv.v[layer], v)
            keys, values = k, v
            if ctx.write is True:
                ctx.kv.put(layer, k, v)
            elif ctx.write is not False:
                raise ValueError("a full forward writes all columns or none; pass write=True or False")
        else:
            stored_k, stored_v = ctx.kv.buffers(layer, k, v, ctx.length)
            index = ctx.queries[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            if ctx.write is not True:  # the stored values of the rows not kept, put back after the attention
                restore = (index, stored_k.gather(2, index), stored_v.gather(2, index))
            keys, values = stored_k.scatter_(2, index, k), stored_v.scatter_(2, index, v)
    else:
        if ctx.queries is not None:
            raise ValueError("a forward over a subset of columns needs a KVStore holding the other columns")
        keys, values = k, v
    if ctx.observer is not None:
        ctx.observer.attention(layer, q, keys, ctx.mask)

    if _flash_attn_func is not None and ctx.mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = _flash_attn_func(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), causal=False)
        out = out.flatten(2)
    else:
        # (a branch, not enable_gqa=<comparison>: under torch.compile's symbolic shapes that is a SymBool)
        if q.shape[1] != keys.shape[1]:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=ctx.mask)
        out = out.transpose(1, 2).flatten(2)
    if restore is not None:
        index, old_k, old_v = restore
        if ctx.write is not False:
            keep = ctx.write[:, None, :, None]
            old_k, old_v = torch.where(keep, k, old_k), torch.where(keep, v, old_v)
        keys.scatter_(2, index, old_k)
        values.scatter_(2, index, old_v)
    return out


def run_layers(
    layers, x: torch.Tensor, cos, sin, ctx: ForwardContext, start: int = 0, stop: int | None = None, hold=None
) -> torch.Tensor:
    """The decoder stack every family shares (its layers ``start`` to ``stop``, default all; ``x`` is the input
    of layer ``start``), with the observer's per-layer hook; a store that keeps inputs
    (:class:`~dllm.models.kv.KVStore`) receives each layer's input for the columns whose K/V it stores.

    hold: (held bool [B, L], row_start [B]) for a full forward from stored inputs: below its ``row_start`` a
    row's held columns keep their stored K/V and inputs (as if only its other columns were computed)."""
    stop = len(layers) if stop is None else stop
    keeps = ctx.kv is not None and ctx.kv.keeps_inputs
    home, rope = cos.device, {}  # cos / sin come from the canvas's positions: on its device
    for i in range(start, stop):
        layer, here, c, s = layers[i], ctx, cos, sin
        if hold is not None:
            ctx.reuse = hold[0] & (i < hold[1])[:, None]
        device = execution_device(layer)
        if device is not None:  # placed by a device map: the layer's inputs on its device
            x = x.to(device)
            if device not in rope:
                rope[device] = (cos.to(device), sin.to(device))
            c, s = rope[device]
            here = ctx.on(device, home)
        if here.observer is not None:
            here.observer.layer(i, x)
        if keeps:
            here.kv.put_input(i, x, here.queries, here.write, here.length)
        x = layer(x, c, s, i, here)
        if hold is not None and i + 1 < len(layers):  # the held columns' input of the next layer, as stored
            stored = ctx.kv.inputs[i + 1]
            x = torch.where(here.reuse[..., None].to(stored.device), stored, x.to(stored.device))
    ctx.reuse = None
    return x


@dataclass
class Fused:
    """Linear projections of one input (q, k and v; gate and up) whose weights (and biases) are views of one tensor,
    so that a forward runs them as one matrix product (:func:`fuse`, :func:`project`). A model moved or cast
    afterwards fuses again (:meth:`dllm.models.base.DiffusionLM._apply`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]


@torch.no_grad()
def fuse(*linears: nn.Linear) -> Fused | None:
    """Make the weights (and biases) of ``linears`` views of one concatenated tensor: the parameters, their
    state-dict keys and values unchanged, no memory added once the old storage is freed. None where they cannot
    be (different devices or dtypes, some with a bias and some without, meta tensors, a device map's hooks)."""
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears]
    if any(w.is_meta for w in weights) or len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1:
        return None
    if len({b is None for b in biases}) != 1 or any(hasattr(lin, "_hf_hook") for lin in linears):
        return None
    sizes = tuple(w.shape[0] for w in weights)
    weight = torch.cat([w.data for w in weights])
    bias = None if biases[0] is None else torch.cat([b.data for b in biases])
    for lin, w, b in zip(linears, weight.split(sizes), bias.split(sizes) if bias is not None else [None] * len(sizes)):
        lin.weight.data = w
        if b is not None:
            lin.bias.data = b
    return Fused(weight, bias, sizes)


def project(x: torch.Tensor, linears, fused: Fused | None) -> tuple[torch.Tensor, ...]:
    """Each of ``linears`` applied to ``x``: one matrix product over their fused weights where no gradient is taken
    (the gradient reaches each projection's own parameters), else one product each."""
    if fused is not None and not torch.is_grad_enabled():
        return F.linear(x, fused.weight, fused.bias).split(fused.sizes, dim=-1)
    return tuple(lin(x) for lin in linears)


def gated_mlp(x, gate: nn.Linear, up: nn.Linear, down: nn.Linear, act=F.silu, fused: Fused | None = None):
    g, u = project(x, (gate, up), fused)
    return down(act(g) * u)


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` without biases: the gated MLP of the Qwen, LLaDA2 and Gemma
    layouts (SwiGLU by default; Gemma's is GELU-tanh), under their shared module names."""

    def __init__(self, hidden: int, intermediate: int, act=F.silu):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fused: Fused | None = None  # gate and up as one product (dllm.load: :meth:`fuse`)

    def fuse(self) -> None:
        self.fused = fuse(self.gate_proj, self.up_proj)

    def forward(self, x):
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.act, self.fused)
