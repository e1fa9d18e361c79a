"""Write a model in its family's official checkpoint layout (config.json + safetensors [+ tokenizer])."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save(model, directory, *, tokenizer=None, max_shard_tensors: int | None = None, dtype=None) -> Path:
    """Save ``model`` so that the official loaders and :func:`dllm.load` read it unchanged.

    max_shard_tensors: split the weights over several ``model-XXXXX-of-YYYYY.safetensors`` files with a
        ``model.safetensors.index.json`` (the layout of the large published checkpoints).
    dtype: store the tensors in this dtype (e.g. torch.float16 for small bundled models).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    from dllm.models import registry

    state = {k: _own(v.detach().to("cpu").contiguous()) for k, v in model.state_dict().items()}
    family = registry.of_model(model)
    if family.head_is_tied(model.config):
        state.pop(family.tied_head, None)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    (directory / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
    keys = sorted(state)
    if max_shard_tensors is None or len(keys) <= max_shard_tensors:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        groups = [keys[i : i + max_shard_tensors] for i in range(0, len(keys), max_shard_tensors)]
        weight_map = {}
        for n, group in enumerate(groups, 1):
            name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
            save_file({k: state[k] for k in group}, str(directory / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in group})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory


def random_init_(model, std: float = 0.02, seed: int = 0, ones=None) -> None:
    """Deterministic random weights, normal(0, std), drawn in parameter order; the parameters ``ones``
    (a predicate on the parameter name; default: every RMSNorm scale) are set to 1 instead."""
    from dllm.models.layers import RMSNorm

    params = dict(model.named_parameters())
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    ones = ones or (lambda name: id(params[name]) in norms)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params.items():
            if ones(name):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _own(tensor):
    """``tensor``, copied when it is a view of a larger tensor (a projection fused or an expert stacked at load,
    :meth:`dllm.models.base.DiffusionLM.prepare`), which safetensors refuses to write as it shares memory."""
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor
