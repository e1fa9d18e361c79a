"""WeDLM (tencent/WeDLM-7B, -8B, their -Instruct): a Qwen2.5 or Qwen3 decoder kept causal, decoding masks.

Liu et al. 2025, "WeDLM: Reconciling Diffusion Language Models with Standard Causal Attention for Fast
Inference", arXiv 2512.22737; code Tencent/WeDLM @0216110 (``hf_compat/{configuration,modeling}_wedlm.py``,
``wedlm/engine``).

Checkpoint: ``config.json`` with ``model_type: "wedlm"``, ``architectures: ["WeDLMForCausalLM"]`` and Qwen2 /
Qwen3 field names; state-dict keys ``model.embed_tokens``, ``model.layers.{i}.{input_layernorm,
self_attn.{q,k,v,o}_proj[, q_norm, k_norm], post_attention_layernorm, mlp.{gate,up,down}_proj}``,
``model.norm``, ``lm_head``. ``attention_bias`` (default true, WeDLM-7B / Qwen2.5) puts biases on q/k/v (never
on o_proj); ``qk_norm`` (default false; true for WeDLM-8B / Qwen3) adds per-head RMSNorms before RoPE.
``mask_token_id`` may be null: the engine then uses 151665 (``model_runner._init_mask_token``), and so do we
(the registry's ``default_mask_id``; the tokenizer's mask token is not consulted, as in the engine).

Attention is plain causal over the *physical* order of the columns with explicit position ids: the
streaming sampler (:mod:`dllm.samplers.wedlm`) places observed tokens before masks ("topological
reordering") while RoPE keeps their logical positions. A query sees every key column at or before its own
column, whatever the number of query rows (the mask is indexed by canvas column, so a forward of the last R
columns against stored keys is aligned bottom-right, as the engine's ``flash_attn_varlen`` call). Logits are
not shifted: row i's hidden state predicts the token of row i (a mask predicts itself), as in the engine.
"""

from __future__ import annotations

from dllm.models.base import DiffusionLM
from dllm.models.qwen_decoder import QwenShape, QwenStyleLM, tiny_qwen_config


class WeDLM(QwenStyleLM, DiffusionLM):
    def __init__(self, config: dict):
        DiffusionLM.__init__(self, config)
        self.read_token_ids(config)
        qkv_bias = bool(config.get("attention_bias", True))
        qk_norm = bool(config.get("qk_norm", False))
        shape = QwenShape.from_config(config, qkv_bias=qkv_bias, o_bias=False, qk_norm=qk_norm, family="WeDLM")
        self.build(shape, self.pad_id)
        self.vocab_size = self.shape.vocab
        self.max_length = int(config.get("max_position_embeddings", 32768))


def tiny_wedlm_config(vocab_size: int, tokens: dict, **shape) -> dict:
    """A small WeDLM config, Qwen2.5-style (q/k/v biases, no q/k norms; set ``attention_bias: false,
    qk_norm: true`` for the Qwen3-style variant)."""
    qwen = tiny_qwen_config(vocab_size, tokens, **shape)
    head_dim = qwen["hidden_size"] // qwen["num_attention_heads"]
    extra = {"head_dim": head_dim, "attention_bias": True, "qk_norm": False}
    return {"model_type": "wedlm", "architectures": ["WeDLMForCausalLM"], **extra, **qwen}
