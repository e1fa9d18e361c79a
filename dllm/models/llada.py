"""LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct, LLaDA-1.5): our implementation of the official layout.

Checkpoint: ``config.json`` with ``model_type: "llada"`` and the ``ModelConfig`` field names
(``d_model``, ``n_heads``, ``n_kv_heads``, ``n_layers``, ``mlp_hidden_size``, ``rope_theta``, ...);
state-dict keys ``model.transformer.{wte, blocks.{i}.{attn_norm, q_proj, k_proj, v_proj, attn_out,
ff_norm, ff_proj (gate), up_proj, ff_out}, ln_f, ff_out}`` (research/models.md §2.3-2.4).

Architecture ("llama" block): pre-norm RMSNorm, RoPE rotated in float32 (``rope_full_precision``),
bidirectional attention with a key-padding mask, SiLU-gated MLP whose gate is ``ff_proj``, untied
``ff_out`` head. Logits are not shifted. Positions are the column indices 0..L-1, as in the official
code, which has no position-id argument (left pads shift the real tokens' absolute positions; RoPE is
relative and pads are masked, so attention between real tokens is unchanged).
"""

from __future__ import annotations

import torch
from torch import nn

from dllm.core.errors import CheckpointError
from dllm.models.base import DiffusionLM
from dllm.models.layers import Fused, RMSNorm, apply_rope, attend, fuse, gated_mlp, project

# Architecture switches of the official ModelConfig that released checkpoints leave at these values.
_REQUIRED = {
    "block_type": "llama",
    "rope": True,
    "alibi": False,
    "layer_norm_type": "rms",
    "attention_layer_norm": False,
    "scale_logits": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "block_group_size": 1,
}
_ACTIVATIONS = ("silu", "swiglu")


class LLaDABlock(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, hidden, eps):
        super().__init__()
        hd = d_model // n_heads
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hd
        self.attn_norm = RMSNorm(d_model, eps)
        self.ff_norm = RMSNorm(d_model, eps)
        self.q_proj = nn.Linear(d_model, n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * hd, bias=False)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)
        self.ff_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.ff_out = nn.Linear(hidden, d_model, bias=False)
        self.qkv: Fused | None = None  # q, k and v as one product, and gate (ff_proj) and up (dllm.load: fuse)
        self.gate_up: Fused | None = None

    def fuse(self) -> None:
        self.qkv = fuse(self.q_proj, self.k_proj, self.v_proj)
        self.gate_up = fuse(self.ff_proj, self.up_proj)

    def forward(self, x, cos, sin, layer, ctx):
        b, t, _ = x.shape
        q, k, v = project(self.attn_norm(x), (self.q_proj, self.k_proj, self.v_proj), self.qkv)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin, full_precision=True)
        x = x + self.attn_out(attend(layer, q, k, v, ctx))
        return x + gated_mlp(self.ff_norm(x), self.ff_proj, self.up_proj, self.ff_out, fused=self.gate_up)


class _Transformer(nn.Module):
    """Holds the ``transformer`` ModuleDict so that state-dict keys read ``model.transformer.*``."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        self.transformer = nn.ModuleDict(modules)


class LLaDA(DiffusionLM):
    def __init__(self, config: dict):
        super().__init__(config)
        for key, want in _REQUIRED.items():
            got = config.get(key, want)
            if got != want:
                raise CheckpointError(
                    f"LLaDA config field {key}={got!r} is not supported (released models use {want!r})"
                )
        if config.get("activation_type", "silu") not in _ACTIVATIONS:
            raise CheckpointError(f"LLaDA activation_type {config['activation_type']!r} is not supported (use 'silu')")
        try:
            d, nh, nl = config["d_model"], config["n_heads"], config["n_layers"]
        except KeyError as e:
            raise CheckpointError(f"LLaDA config.json lacks required field {e.args[0]!r}") from None
        nkv = 1 if config.get("multi_query_attention") else (config.get("n_kv_heads") or nh)
        hidden = config.get("mlp_hidden_size") or int(config.get("mlp_ratio", 4) * d)
        vocab = config.get("embedding_size") or config["vocab_size"]
        eps = config.get("rms_norm_eps", 1e-5)
        self.rope_theta = float(config.get("rope_theta", 10000.0))
        self.head_dim = d // nh
        modules = {
            "wte": nn.Embedding(vocab, d),
            "blocks": nn.ModuleList(LLaDABlock(d, nh, nkv, hidden, eps) for _ in range(nl)),
            "ln_f": RMSNorm(d, eps),
        }
        self.weight_tying = bool(config.get("weight_tying", False))
        if not self.weight_tying:
            modules["ff_out"] = nn.Linear(d, vocab, bias=False)
        self.model = _Transformer(modules)
        self.vocab_size = vocab
        self.max_length = int(config.get("max_sequence_length", 4096))
        self.read_token_ids(config)

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        # Official LLaDA numbers columns 0..L-1 whatever the padding (it takes no position ids).
        return torch.arange(valid.shape[1], device=valid.device).expand(valid.shape[0], -1)

    # the parts of the shared decoder (DiffusionLM.hidden / head)
    @property
    def embedding(self) -> nn.Embedding:
        return self.model.transformer.wte

    @property
    def decoder(self) -> nn.ModuleList:
        return self.model.transformer.blocks

    @property
    def final_norm(self) -> RMSNorm:
        return self.model.transformer.ln_f

    @property
    def output(self) -> nn.Linear | None:
        return None if self.weight_tying else self.model.transformer.ff_out


def tiny_llada_config(vocab_size: int, tokens: dict, *, layers, hidden, heads, kv_heads, intermediate, max_length, **_):
    """A small LLaDA config with the official ``ModelConfig`` field names (:func:`dllm.models.tiny.tiny_config`)."""
    return {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "d_model": hidden,
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "n_layers": layers,
        "mlp_hidden_size": intermediate,
        "mlp_ratio": intermediate // hidden,
        "vocab_size": vocab_size,
        "embedding_size": vocab_size,
        "max_sequence_length": max_length,
        "rope": True,
        "rope_theta": 10000.0,
        "rope_full_precision": True,
        "rms_norm_eps": 1e-5,
        "block_type": "llama",
        "block_group_size": 1,
        "layer_norm_type": "rms",
        "activation_type": "silu",
        "alibi": False,
        "attention_layer_norm": False,
        "scale_logits": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "bias_for_layer_norm": False,
        "weight_tying": False,
        "attention_dropout": 0.0,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "use_cache": False,
        **tokens,
    }
