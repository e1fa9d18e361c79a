"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): a Qwen2.5 decoder with causality removed.

Checkpoint: ``config.json`` with ``model_type: "Dream"`` and Qwen2 field names; keys
``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}``, ``o_proj.weight``,
``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head`` (research/models.md §3.3).

Dream is trained to predict token i from the output at position i-1 (inherited from its AR init,
DreamLM/Dream issue #31). This adapter hides that shift: ``logits(...)[:, i]`` predicts column i, and
column 0 reuses its own output, exactly like ``cat([logits[:, :1], logits[:, :-1]])`` in the official
``generation_utils.py``.
"""

from __future__ import annotations

from dllm.models.base import DiffusionLM
from dllm.models.qwen_decoder import QwenShape, QwenStyleLM


class Dream(QwenStyleLM, DiffusionLM):
    shift = 1  # the logits of column i are read from the hidden state of column i - 1 (column 0: its own)

    def __init__(self, config: dict):
        DiffusionLM.__init__(self, config)
        self.read_token_ids(config)
        self.build(
            QwenShape.from_config(config, qkv_bias=True, o_bias=False, qk_norm=False, family="Dream"), self.pad_id
        )
        self.vocab_size = self.shape.vocab
        self.max_length = int(config.get("max_position_embeddings", 32768))
