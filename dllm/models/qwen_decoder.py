"""The Qwen2 / Qwen3 decoder body shared by Dream (Qwen2.5, q/k/v biases) and SDAR (Qwen3, q/k norms).

State-dict keys as in the published checkpoints: ``model.embed_tokens``, ``model.layers.{i}.
{input_layernorm, self_attn.{q,k,v,o}_proj[, q_norm, k_norm], post_attention_layernorm,
mlp.{gate,up,down}_proj}``, ``model.norm``, ``lm_head``. RoPE in the activation dtype (cos/sin cast
first), RMSNorm in float32. Causality is the family's business (attention mask built by the adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dllm.core.errors import CheckpointError
from dllm.models.layers import Fused, GatedMLP, RMSNorm, apply_rope, attend, fuse, project


@dataclass(frozen=True)
class QwenShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    theta: float
    qkv_bias: bool
    o_bias: bool  # Qwen3 / SDAR: o_proj has a bias iff attention_bias; Qwen2 / Dream: never
    qk_norm: bool
    tie: bool

    @classmethod
    def from_config(cls, config: dict, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, family: str) -> QwenShape:
        if config.get("rope_scaling"):
            raise CheckpointError(f"{family}: rope_scaling={config['rope_scaling']!r} is not supported")
        if config.get("use_sliding_window"):
            raise CheckpointError(f"{family}: use_sliding_window=true is not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{family}: hidden_act={config['hidden_act']!r} is not supported (use 'silu')")
        try:
            hidden, heads = config["hidden_size"], config["num_attention_heads"]
            return cls(
                hidden=hidden,
                intermediate=config["intermediate_size"],
                layers=config["num_hidden_layers"],
                heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or hidden // heads,
                vocab=config["vocab_size"],
                eps=config.get("rms_norm_eps", 1e-6),
                theta=float(config.get("rope_theta", 10000.0)),
                qkv_bias=qkv_bias,
                o_bias=o_bias,
                qk_norm=qk_norm,
                tie=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CheckpointError(f"{family} config.json lacks required field {e.args[0]!r}") from None


class Attention(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.eps)
            self.k_norm = RMSNorm(s.head_dim, s.eps)
        self.fused: Fused | None = None  # q, k and v as one product (dllm.load: :meth:`fuse`)

    def fuse(self) -> None:
        self.fused = fuse(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, layer, ctx):
        b, t, _ = x.shape
        s = self.s
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), self.fused)
        q = q.view(b, t, s.heads, s.head_dim)
        k = k.view(b, t, s.kv_heads, s.head_dim)
        v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, full_precision=False)
        return self.o_proj(attend(layer, q, k, v, ctx))


class DecoderLayer(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = GatedMLP(s.hidden, s.intermediate)

    def forward(self, x, cos, sin, layer, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, s: QwenShape, pad_id: int | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden, padding_idx=pad_id)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)


class QwenStyleLM(nn.Module):
    """``model`` (Body) + ``lm_head``; mixed into the Dream and SDAR adapters."""

    def build(self, s: QwenShape, pad_id: int | None) -> None:
        self.shape = s
        self.model = Body(s, pad_id)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    # the parts of the shared decoder (DiffusionLM.hidden / head)
    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

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
    def rope_theta(self) -> float:
        return self.shape.theta


def tiny_qwen_config(vocab_size: int, tokens: dict, *, layers, hidden, heads, kv_heads, intermediate, max_length, **_):
    """The Qwen2 / Qwen3 fields of a small config (:func:`dllm.models.tiny.tiny_config`); families add theirs."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_length,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "use_cache": False,
        **tokens,
    }
