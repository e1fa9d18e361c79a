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

import torch

from dllm.models.base import DiffusionLM
from dllm.models.qwen_decoder import QwenShape, QwenStyleLM


class Dream(QwenStyleLM, DiffusionLM):
    family = "dream"
    attention = "full"

    def __init__(self, config: dict):
        DiffusionLM.__init__(self, config)
        self.read_token_ids(config)
        self.build(
            QwenShape.from_config(config, qkv_bias=True, o_bias=False, qk_norm=False, family="Dream"), self.pad_id
        )
        self.vocab_size = self.shape.vocab
        self.max_length = int(config.get("max_position_embeddings", 32768))

    def _forward(self, ids, pos, ctx):
        return self.decode(ids, pos, ctx)

    def logits(self, tokens, positions, *, attention_mask=None, kv=None, rows=None, write=True):
        if rows is None:
            out = self._rows_forward(tokens, positions, attention_mask, kv, None, write)
            return torch.cat([out[:, :1], out[:, :-1]], dim=1)
        # Column i is predicted by the output at column i-1, and the rows' own K/V must be fresh too,
        # so the query rows are rows-1 followed by the rows (one extra row when they are contiguous).
        shifted = (rows - 1).clamp(min=0)
        contiguous = rows.shape[1] == 1 or bool((rows[:, 1:] - rows[:, :-1] == 1).all())
        queries = torch.cat([shifted[:, :1], rows], 1) if contiguous else torch.cat([shifted, rows], 1)
        out = self._rows_forward(tokens, positions, attention_mask, kv, queries, write)
        return out[:, : rows.shape[1]]
