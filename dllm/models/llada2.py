"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-mini, -flash): a mixture-of-experts decoder with
block-causal attention (Bie et al. 2025, "LLaDA2.0: Scaling Up Diffusion Language Models to 100B", arXiv
2512.15745; LLaDA2.1, arXiv 2602.08676). The published modeling is Hugging Face remote code
(``modeling_llada2_moe.py``, Ling-2.0 / BailingMoeV2 lineage); this is our own implementation of its layout
(research/llada2.md §1–§3).

Checkpoint: ``config.json`` with ``model_type: "llada2_moe"``; keys ``model.word_embeddings``,
``model.layers.{i}.{input_layernorm, attention.{query_key_value, query_layernorm, key_layernorm, dense},
post_attention_layernorm, mlp.*}``, ``model.norm``, ``lm_head``. The first ``first_k_dense_replace`` layers have a
dense SwiGLU ``mlp.{gate,up,down}_proj``; the others a mixture of experts: router ``mlp.gate.weight`` and
``mlp.gate.expert_bias``, experts ``mlp.experts.{e}.{gate,up,down}_proj``, shared experts
``mlp.shared_experts.{gate,up,down}_proj``. The config names no mask and no EOS id: mask 156895 and EOS 156892
(its ``pad_token_id``), as the official ``generate`` defaults.

Attention: one fused ``query_key_value`` projection split as (heads, kv heads, kv heads); per-head RMSNorms on q
and k before a partial rotary embedding (the first ``partial_rotary_factor × head_dim`` channels, NeoX halves);
block-causal over blocks counted from position 0, the block size being the decoder's ``block_length`` (32 by
default), not fixed by training. Logits are not shifted.

Routing (computed in float32, as ``router_dtype: "fp32"``): sigmoid scores; experts chosen with
``scores + expert_bias`` among the ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two
best biased scores); weights = the unbiased scores of the chosen experts, renormalised when
``num_experts_per_tok > 1``, times ``routed_scaling_factor``. The official code reads neither ``score_function``,
``norm_topk_prob`` nor ``moe_router_enable_expert_bias`` (always sigmoid, bias and renormalisation), and neither
do we. ``sliding_window`` only reaches flash-attention in the official file, which its generate does not use.

Experts: tokens are sorted by expert and each projection is one grouped GEMM over them (:func:`dllm.models.moe.grouped`:
no host read; the experts' weights stacked at load, :meth:`LLaDA2.prepare`) where this torch has one for the device
and dtype and no gradient is taken; otherwise each expert that received some runs one matmul over its rows
(:func:`moe_sorted`; one host read of the per-expert counts per layer), with :func:`moe_reference` beside it (a loop
over every (token, expert) pair, for the tests). A compiled forward without the grouped GEMM takes :func:`moe_dense`
(every expert on every row, weighted by its routing weight, zero off-route: no host read, so no graph break; the
same sums up to rounding, at ``num_experts / num_experts_per_tok`` times the expert FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm.core.errors import CheckpointError
from dllm.models import moe
from dllm.models.base import DiffusionLM
from dllm.models.layers import GatedMLP, RMSNorm, apply_rope, attend

MASK_ID = 156895  # <|mask|>: the official generate's default mask_id (the config has none)
EOS_ID = 156892  # <|endoftext|>, also the pad id: the official generate's default eos_id
BLOCK_LENGTH = 32  # the official generate's default block_length (SGLang's table too)


@dataclass(frozen=True)
class LLaDA2Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    vocab: int
    eps: float
    theta: float
    qkv_bias: bool
    bias: bool
    qk_norm: bool
    experts: int
    top_k: int
    shared: int
    moe_intermediate: int
    first_dense: int
    n_group: int
    topk_group: int
    scaling: float
    tie: bool

    @classmethod
    def from_config(cls, config: dict) -> LLaDA2Shape:
        if config.get("rope_scaling"):
            raise CheckpointError(f"LLaDA2: rope_scaling={config['rope_scaling']!r} is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"LLaDA2: hidden_act={config['hidden_act']!r} is not supported (use 'silu')")
        try:
            hidden, heads = config["hidden_size"], config["num_attention_heads"]
            head_dim = config.get("head_dim") or hidden // heads
            experts = int(config.get("num_experts", 16))
            shape = cls(
                hidden=hidden,
                intermediate=config["intermediate_size"],
                layers=config["num_hidden_layers"],
                heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,  # 0: one K/V head per head (the 2.1 file)
                head_dim=head_dim,
                rotary_dim=int(head_dim * float(config.get("partial_rotary_factor", 0.5))),
                vocab=config["vocab_size"],
                eps=float(config.get("rms_norm_eps", 1e-5)),
                theta=float(config.get("rope_theta", 10000.0)),
                qkv_bias=bool(config.get("use_qkv_bias", False)),
                bias=bool(config.get("use_bias", True)),
                qk_norm=bool(config.get("use_qk_norm", True)),
                experts=experts,
                top_k=int(config.get("num_experts_per_tok", 2)),
                shared=int(config.get("num_shared_experts") or 0),
                moe_intermediate=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
                first_dense=int(config.get("first_k_dense_replace", 0)),
                n_group=int(config.get("n_group") or 1),
                topk_group=int(config.get("topk_group") or 1),
                scaling=float(config.get("routed_scaling_factor", 2.5)),
                tie=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CheckpointError(f"LLaDA2 config.json lacks required field {e.args[0]!r}") from None
        shape.check()
        return shape

    def check(self) -> None:
        def refuse(message):
            raise CheckpointError(f"LLaDA2 config.json: {message}")

        if self.heads % self.kv_heads:
            refuse(f"num_attention_heads={self.heads} is not a multiple of num_key_value_heads={self.kv_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            refuse(
                f"partial_rotary_factor gives {self.rotary_dim} rotary channels of {self.head_dim}; need an even "
                "number in (0, head_dim]"
            )
        if self.first_dense < self.layers:  # some layer is a mixture of experts
            if self.experts % self.n_group:
                refuse(f"num_experts={self.experts} is not a multiple of n_group={self.n_group}")
            if self.experts // self.n_group < 2:
                refuse(f"n_group={self.n_group} leaves fewer than 2 experts per group (a group scores its best two)")
            if not 1 <= self.topk_group <= self.n_group:
                refuse(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            if not 1 <= self.top_k <= self.topk_group * self.experts // self.n_group:
                refuse(f"num_experts_per_tok={self.top_k} must be in [1, the experts of topk_group groups]")


class Attention(nn.Module):
    def __init__(self, s: LLaDA2Shape):
        super().__init__()
        self.s = s
        self.query_key_value = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=s.qkv_bias)
        if s.qk_norm:
            self.query_layernorm = RMSNorm(s.head_dim, s.eps)
            self.key_layernorm = RMSNorm(s.head_dim, s.eps)
        self.dense = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.bias)

    def forward(self, x, cos, sin, layer, ctx):
        b, t, _ = x.shape
        s = self.s
        qkv = self.query_key_value(x).view(b, t, s.heads + 2 * s.kv_heads, s.head_dim)
        q, k, v = qkv.split([s.heads, s.kv_heads, s.kv_heads], dim=2)
        if s.qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        r = s.rotary_dim
        q_rot, k_rot = apply_rope(q[..., :r], k[..., :r], cos, sin, full_precision=False)
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
        return self.dense(attend(layer, q, k, v.contiguous(), ctx))


class Router(nn.Module):
    """``mlp.gate``: the routing logits' weight [E, d] and the selection bias [E] (updated by load balancing in
    training, not by gradients: a parameter here so that it is initialised, saved and loaded like the weights)."""

    def __init__(self, s: LLaDA2Shape):
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.empty(s.experts, s.hidden))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # as nn.Linear's
        self.expert_bias = nn.Parameter(torch.zeros(s.experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [n, k], weights [n, k] float32) of the rows ``x`` [n, d]."""
        s = self.s
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores + self.expert_bias.float()
        groups = biased.view(-1, s.n_group, s.experts // s.n_group).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(groups).scatter_(1, groups.topk(s.topk_group, dim=-1).indices, 1.0).bool()
        kept = kept[:, :, None].expand(-1, -1, s.experts // s.n_group).reshape(-1, s.experts)
        experts = biased.masked_fill(~kept, float("-inf")).topk(s.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if s.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * s.scaling


class MoE(nn.Module):
    def __init__(self, s: LLaDA2Shape):
        super().__init__()
        self.gate = Router(s)
        self.experts = nn.ModuleList(GatedMLP(s.hidden, s.moe_intermediate) for _ in range(s.experts))
        self.shared_experts = GatedMLP(s.hidden, s.moe_intermediate * s.shared) if s.shared else None
        self.stacked: moe.Stacked | None = None  # the experts' weights as views of stacked tensors (dllm.load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        weights = weights.to(x.dtype)
        stacked = self.stacked
        if stacked is not None and moe.use_grouped(flat, stacked.gate):
            out = moe.grouped(flat, experts, weights, stacked.gate, stacked.up, stacked.down, self.experts[0].act)
        else:
            route = moe_dense if torch.compiler.is_compiling() else moe_sorted
            out = route(self.experts, flat, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


def moe_sorted(experts: nn.ModuleList, x, chosen, weights) -> torch.Tensor:
    """Σ_j weights[i, j] · experts[chosen[i, j]](x[i]) for every row i of ``x`` [n, d]: the (row, slot) pairs sorted
    by expert, one matmul per expert over its contiguous rows, the outputs added back to their rows."""
    n, k = chosen.shape
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    rows = order // k
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the one host read of the layer
    parts, start = [], 0
    for expert, count in zip(experts, counts):
        if count:
            parts.append(expert(x.index_select(0, rows[start : start + count])))
        start += count
    if not parts:  # no row (an empty forward)
        return torch.zeros_like(x)
    out = torch.cat(parts) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, rows, out)


def moe_dense(experts: nn.ModuleList, x, chosen, weights) -> torch.Tensor:
    """:func:`moe_sorted`'s sum with every expert run on every row (no host read: the compiled forward's path)."""
    dense = torch.zeros(x.shape[0], len(experts), dtype=x.dtype, device=x.device).scatter_(1, chosen, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        out = out + dense[:, e, None] * expert(x)
    return out


def moe_reference(experts: nn.ModuleList, x, chosen, weights) -> torch.Tensor:
    """The definition, one (row, slot) at a time (tests only)."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            out[i] += weights[i, j] * experts[int(chosen[i, j])](x[i : i + 1])[0]
    return out


class DecoderLayer(nn.Module):
    def __init__(self, s: LLaDA2Shape, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.attention = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = GatedMLP(s.hidden, s.intermediate) if index < s.first_dense else MoE(s)

    def forward(self, x, cos, sin, layer, ctx):
        x = x + self.attention(self.input_layernorm(x), cos, sin, layer, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, s: LLaDA2Shape):
        super().__init__()
        self.word_embeddings = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)


class LLaDA2(DiffusionLM):
    # the block size is the decoder's block_length (LLaDA2.0's paper compares 16, 32 and 64), not fixed by training
    free_block_size = True

    def __init__(self, config: dict):
        super().__init__(config)
        s = self.shape = LLaDA2Shape.from_config(config)
        self.model = Body(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tie:
            self.lm_head.weight = self.model.word_embeddings.weight
        self.read_token_ids(config)
        if not self.eos_ids and self.pad_id is not None:  # the published configs: EOS is the pad token
            self.eos_ids = (self.pad_id,)
        self.vocab_size = s.vocab
        self.max_length = int(config.get("max_position_embeddings", 16384))
        # not a published field: the published configs have none, and the official generate defaults to 32
        self.block_size = int(config.get("block_size") or BLOCK_LENGTH)

    def kv_layout(self) -> tuple[int, int, int]:
        return self.shape.layers, self.shape.kv_heads, self.shape.head_dim

    def prepare(self) -> None:
        """The fused projections (:meth:`DiffusionLM.prepare`: the dense layers' gate and up; q, k and v are fused in
        the published layout), and each mixture-of-experts layer's expert weights stacked into views
        (:func:`dllm.models.moe.stack_experts`), for the grouped GEMM."""
        super().prepare()
        for layer in self.decoder:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stacked = moe.stack_experts(layer.mlp.experts)
                for expert in layer.mlp.experts:  # (their own fused gate and up: stale views, holding memory)
                    expert.fused = None
                if layer.mlp.stacked is not None:
                    moe.grouped_usable(layer.mlp.stacked.gate.device, layer.mlp.stacked.gate.dtype)

    # the parts of the shared decoder (DiffusionLM.hidden / head)
    @property
    def embedding(self) -> nn.Embedding:
        return self.model.word_embeddings

    @property
    def decoder(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def final_norm(self) -> RMSNorm:
        return self.model.norm

    @property
    def output(self) -> nn.Linear:
        return self.lm_head

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.shape.rotary_dim

    @property
    def rope_theta(self) -> float:
        return self.shape.theta


def tiny_llada2_config(vocab_size, tokens, *, layers, hidden, heads, kv_heads, intermediate, max_length, **shape):
    """A small LLaDA2 config with the published field names (:func:`dllm.models.tiny.tiny_config`): 8 experts in 4
    groups, 2 per token from the 2 best groups, one shared expert, the first layer dense; ``block_size`` (not a
    published field) is the default decoding block."""
    return {
        "model_type": "llada2_moe",
        "architectures": ["LLaDA2MoeModelLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": max(8, intermediate // 4),
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": max_length,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "tie_word_embeddings": False,
        "use_cache": False,
        "block_size": shape.get("block_size", 4),
        **tokens,
    }
