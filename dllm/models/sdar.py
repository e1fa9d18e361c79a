"""SDAR (JetLM/SDAR-{1.7B,4B,8B}-Chat, TraDo): a Qwen3 decoder with block-causal attention.

Checkpoint: ``config.json`` with ``model_type: "sdar"``, Qwen3 field names (explicit ``head_dim``,
``attention_bias``) and the training ``block_size``; keys as Qwen3 with per-head ``q_norm``/``k_norm``
applied before RoPE (research/models.md §4.3). Attention is bidirectional inside a block of
``block_size`` positions and causal across blocks; blocks are counted from position 0, the first prompt
token. Logits are not shifted. Because attention is causal across blocks, the K/V of finished blocks
never change: the SDAR sampler computes only the current block against a K/V store (exact).
"""

from __future__ import annotations

from dllm.core.errors import CheckpointError
from dllm.models.base import DiffusionLM
from dllm.models.qwen_decoder import QwenShape, QwenStyleLM


class SDAR(QwenStyleLM, DiffusionLM):
    def __init__(self, config: dict):
        DiffusionLM.__init__(self, config)
        self.read_token_ids(config)
        qkv_bias = bool(config.get("attention_bias", False))
        self.build(
            QwenShape.from_config(config, qkv_bias=qkv_bias, o_bias=qkv_bias, qk_norm=True, family="SDAR"), self.pad_id
        )
        self.vocab_size = self.shape.vocab
        self.max_length = int(config.get("max_position_embeddings", 32768))
        self.block_size = int(config.get("block_size", 4))
        if self.block_size < 1:
            raise CheckpointError(f"SDAR block_size must be >= 1, got {self.block_size}")
