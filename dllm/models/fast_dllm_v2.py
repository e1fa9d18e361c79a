"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, _1.5B): Qwen2.5 made a block-diffusion model.

Wu et al. 2025, "Fast-dLLM v2: Efficient Block-Diffusion LLM", arXiv 2509.26328; code NVlabs/Fast-dLLM ``v2/``.

Checkpoint: ``config.json`` with ``model_type: "Fast_dLLM_Qwen"`` (``Fast_dLLM_QwenForCausalLM``), Qwen2 field
names and ``bd_size`` (the training block, 32); keys ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v}_proj.
{weight,bias}``, ``o_proj.weight``, ``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``: Qwen2.5's, q/k/v
biased. The config names no mask token: the official code's default, 151665 (``|<MASK>|``), is used (the registry's
``default_mask_id``).

Attention is block-causal over blocks of ``bd_size`` positions counted from position 0, the first prompt token
(the official ``eval_block_diff_mask``: a query sees every key of its own block or an earlier one), so the prompt's
tail shares the first generation block and finished blocks' K/V never change. Like Dream (its Qwen2.5 AR start),
the token of position i is read from the output at position i - 1 (``cat([logits[:, :1], logits[:, :-1]])`` in the
official samplers); this adapter hides the shift, so ``logits(...)[:, i]`` predicts column i. A block's first
position therefore reads the previous block's last output: the official sampler decodes it from the forward that
completes the previous block (``fast_dllm_v2``, :mod:`dllm.samplers.fast_dllm_v2`).
"""

from __future__ import annotations

from dllm.core.errors import CheckpointError
from dllm.models.base import DiffusionLM
from dllm.models.qwen_decoder import QwenShape, QwenStyleLM, tiny_qwen_config

MASK_ID = 151665  # ``mask_id`` of the official forward and samplers; the tokenizer's ``|<MASK>|``


class FastDLLMv2(QwenStyleLM, DiffusionLM):
    shift = 1  # the logits of column i are read from the hidden state of column i - 1 (column 0: its own)

    def __init__(self, config: dict):
        DiffusionLM.__init__(self, config)
        self.read_token_ids(config)
        shape = QwenShape.from_config(config, qkv_bias=True, o_bias=False, qk_norm=False, family="Fast-dLLM v2")
        self.build(shape, self.pad_id)
        self.vocab_size = self.shape.vocab
        self.max_length = int(config.get("max_position_embeddings", 32768))
        self.block_size = int(config.get("bd_size", 32))
        if self.block_size < 1:
            raise CheckpointError(f"Fast-dLLM v2 bd_size must be >= 1, got {self.block_size}")


def tiny_fast_dllm_v2_config(vocab_size: int, tokens: dict, *, block_size: int = 4, **shape) -> dict:
    """A small Fast-dLLM v2 config in the published layout (``bd_size`` the block); ``mask_token_id`` is ours (the
    published config has none, the tiny tokenizer's mask is not 151665)."""
    qwen = tiny_qwen_config(vocab_size, tokens, **shape)
    published = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": block_size}
    return {**published, "max_window_layers": qwen["num_hidden_layers"], **qwen}
