"""Model adapters: official layout loading, forward contract (aligned logits, padding, K/V subsets)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dllm
from dllm.models.layers import KVStore, Observer, RMSNorm
from dllm.models.loading import build
from dllm.models.saving import random_init_
from dllm.models.tiny import make_tiny_checkpoint, tiny_config

FAMILIES = ["llada", "dream", "sdar"]

# Tensor counts of a 2-layer model in the official layouts (research/models.md §2.4, §3.3, §4.3).
OFFICIAL_TENSORS = {"llada": 21, "dream": 27, "sdar": 25}
OFFICIAL_KEYS = {
    "llada": [
        "model.transformer.wte.weight",
        "model.transformer.blocks.0.ff_proj.weight",
        "model.transformer.blocks.1.attn_out.weight",
        "model.transformer.ff_out.weight",
    ],
    "dream": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "lm_head.weight"],
    "sdar": ["model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight", "model.norm.weight"],
}


def _canvas(model, lengths, width, seed=0):
    """Left-padded random tokens (no mask ids) + masks after the prompt."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    tokens = torch.randint(4, model.vocab_size, (b, width), generator=g)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, width - n :] = True
    tokens[~valid] = model.pad_id
    tokens[:, -3:] = model.mask_id
    return tokens, valid


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_uses_official_layout(family, checkpoint_dir):
    directory = checkpoint_dir(family)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == {"llada": "llada", "dream": "Dream", "sdar": "sdar"}[family]
    state = load_file(str(directory / "model.safetensors"))
    assert len(state) == OFFICIAL_TENSORS[family]
    assert set(OFFICIAL_KEYS[family]) <= set(state)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_detects_family_and_tokens(family, tiny):
    model = tiny(family)
    assert model.family == family
    assert (model.mask_id, model.eos_ids[0], model.pad_id) == (1, 0, 0)
    assert 3 in model.eos_ids  # end-of-turn from the tokenizer's special tokens
    assert model.tokenizer.decode(model.tokenizer("12+35=")["input_ids"]) == "12+35="


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_loads_the_same_weights(family, tmp_path, tiny):
    model = tiny(family)
    dllm.models.save(model, tmp_path, max_shard_tensors=5)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    again = dllm.load(tmp_path, device="cpu")
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_subset_forward_with_kv_equals_full_forward(family, contiguous, tiny):
    model = tiny(family)
    tokens, valid = _canvas(model, [9, 14, 12], 16)
    pos = model.positions(valid)
    full = model.logits(tokens, pos, attention_mask=valid)
    kv = KVStore()
    filled = model.logits(tokens, pos, attention_mask=valid, kv=kv)
    torch.testing.assert_close(filled, full, rtol=0, atol=0)
    rows = torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15], [4, 5, 6, 7]])
    if not contiguous:
        rows = torch.tensor([[15, 3, 9, 10], [2, 7, 13, 14], [0, 6, 11, 12]])
    sub = model.logits(tokens, pos, attention_mask=valid, kv=kv, rows=rows)
    torch.testing.assert_close(
        sub, full.gather(1, rows[..., None].expand(-1, -1, full.shape[-1])), rtol=1e-5, atol=1e-5
    )


class _Inputs(Observer):
    """Records each layer's input hidden states."""

    def __init__(self):
        self.seen = {}

    def layer(self, index, hidden):
        self.seen[index] = hidden.clone()


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_started_at_a_layer_equals_the_full_forward_from_there(family, tiny):
    """A store that keeps inputs (KVStore(inputs=True)) lets a forward start at layer l from them: every layer's
    input from l on and the final states equal the full forward's, exactly (float32; same shapes)."""
    model = tiny(family, layers=4)
    tokens, valid = _canvas(model, [9, 14, 12], 16)
    pos = model.positions(valid)
    full, kv = _Inputs(), KVStore(inputs=True)
    states = model.hidden(tokens, pos, attention_mask=valid, kv=kv, observer=full).states
    plain = KVStore()
    model.hidden(tokens, pos, attention_mask=valid, kv=plain)
    assert set(kv.inputs) == {0, 1, 2, 3} and plain.inputs == {}  # kept only when asked for
    for start in (1, 2, 3):
        part = _Inputs()
        out = model.hidden(tokens, pos, attention_mask=valid, kv=kv, observer=part, start_layer=start)
        assert set(part.seen) == set(range(start, 4))
        for layer in part.seen:
            assert torch.equal(part.seen[layer], full.seen[layer])
        assert out.columns is None and torch.equal(out.states, states)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_started_at_a_layer_recomputes_its_queries_below_it(family, tiny):
    """With queries, the layers below l compute them (their fresh inputs of l are written in): with every
    column as a query, the result is the full forward of the changed canvas."""
    model = tiny(family, layers=4)
    tokens, valid = _canvas(model, [9, 14, 12], 16)
    pos = model.positions(valid)
    kv = KVStore(inputs=True)
    model.hidden(tokens, pos, attention_mask=valid, kv=kv)
    changed = tokens.clone()
    changed[:, 10:13] = torch.tensor([5, 6, 7])
    every = torch.arange(16).expand(3, -1)
    out = model.hidden(changed, pos, attention_mask=valid, kv=kv, queries=every, start_layer=2)
    expected = model.hidden(changed, pos, attention_mask=valid).states
    torch.testing.assert_close(out.states, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(dllm.ModelError, match="keeps inputs"):
        model.hidden(changed, pos, attention_mask=valid, kv=KVStore(), start_layer=2)


def test_block_causal_subset_forward_sees_fresh_tokens_of_its_rows(tiny):
    """On a block-causal model, recomputing the last block after a token change in it is exact: no
    earlier column attends to it. (On full attention every column's K/V would be stale: caches approximate.)"""
    model = tiny("sdar")
    tokens, valid = _canvas(model, [16], 16)
    pos = model.positions(valid)
    kv = KVStore()
    model.logits(tokens, pos, kv=kv)
    changed = tokens.clone()
    changed[0, 13] = 7  # inside the recomputed rows
    rows = torch.arange(12, 16)[None]
    sub = model.logits(changed, pos, kv=kv, rows=rows)
    full = model.logits(changed, pos)
    torch.testing.assert_close(sub, full[:, 12:16], rtol=1e-5, atol=1e-5)


def test_dream_hides_its_one_position_shift(tiny):
    model = tiny("dream")
    tokens, valid = _canvas(model, [12], 12)
    pos = model.positions(valid)
    aligned = model.logits(tokens, pos)
    raw = model.project(model.hidden(tokens, pos).states)  # the network's own, unshifted read-out
    torch.testing.assert_close(aligned[:, 1:], raw[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(aligned[:, 0], raw[:, 0], rtol=0, atol=0)


def test_sdar_attention_is_block_causal(tiny):
    model = tiny("sdar")  # block size 4
    tokens, valid = _canvas(model, [12], 12)
    pos = model.positions(valid)
    base = model.logits(tokens, pos)
    later = tokens.clone()
    later[0, 9] = 5  # block 2
    out = model.logits(later, pos)
    torch.testing.assert_close(out[:, :8], base[:, :8], rtol=0, atol=0)  # blocks 0-1 cannot see block 2
    assert not torch.allclose(out[:, 8], base[:, 8])  # same block sees it


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_full_attention_is_bidirectional(family, tiny):
    model = tiny(family)
    tokens, valid = _canvas(model, [12], 12)
    pos = model.positions(valid)
    later = tokens.clone()
    later[0, 11] = 5
    assert not torch.allclose(model.logits(later, pos)[:, 2], model.logits(tokens, pos)[:, 2])


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_does_not_change_real_rows(family, tiny):
    """A padded row's real tokens get the same logits as the same tokens unpadded. For LLaDA the official
    positions shift with padding, so equality holds up to rounding (RoPE is relative). The first real column
    is skipped: Dream predicts it from the column before it, a pad (it is a prompt token, never predicted)."""
    model = tiny(family)
    tokens, valid = _canvas(model, [10, 14], 14)
    alone = model.logits(tokens[:1, 4:], model.positions(valid[:1, 4:]))
    batch = model.logits(tokens, model.positions(valid), attention_mask=valid)
    torch.testing.assert_close(batch[:1, 5:], alone[:, 1:], rtol=1e-4, atol=1e-4)


def test_llada_positions_are_columns_as_in_the_official_code(tiny):
    valid = torch.tensor([[False, False, True, True]])
    assert tiny("llada").positions(valid).tolist() == [[0, 1, 2, 3]]
    assert tiny("dream").positions(valid).tolist() == [[0, 0, 0, 1]]


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_load(family, checkpoint_dir):
    model = dllm.load(checkpoint_dir(family), device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    out = dllm.samplers.get("threshold").generate(
        model, "ab", max_new_tokens=4, block_size=4 if family == "sdar" else 2
    )
    assert out.sequences.shape[0] == 1


def test_tokenizer_falls_back_to_tokenizer_json(tmp_path):
    directory = make_tiny_checkpoint(tmp_path, "llada")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "LLaDACustomTokenizer"  # a remote-code class we must not need
    config_file.write_text(json.dumps(config))
    model = dllm.load(directory, device="cpu")
    assert model.tokenizer is not None
    assert model.tokenizer.decode(model.tokenizer("7*8")["input_ids"]) == "7*8"
    assert model.mask_id == 1


def test_generation_config_sets_the_default_length_and_end_tokens(tmp_path):
    directory = make_tiny_checkpoint(tmp_path, "llada")
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 8, "eos_token_id": [7, 9]}))
    model = dllm.load(directory, device="cpu")
    assert model.max_new_tokens == 8 and {7, 9} <= set(model.eos_ids)
    sampler = dllm.samplers.get("llada")
    assert sampler.generate(model, "ab", block_size=8, eos_early_stop=False).sequences.shape[1] == 2 + 8
    assert sampler.generate(model, "ab", max_new_tokens=4, block_size=4).sequences.shape[1] == 2 + 4
    (directory / "generation_config.json").write_text("{not json")
    with pytest.raises(dllm.CheckpointError, match="generation_config.json is not valid JSON"):
        dllm.load(directory)


def test_missing_and_mismatched_tensors_are_named(tmp_path):
    directory = make_tiny_checkpoint(tmp_path, "dream")
    state = load_file(str(directory / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.norm.weight"] = torch.ones(3)
    state["model.extra.weight"] = torch.ones(2)
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(dllm.CheckpointError) as err:
        dllm.load(directory)
    message = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert "model.norm.weight" in message and "(3,)" in message
    assert "model.extra.weight" in message


def test_unknown_family_and_missing_config(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "a", "llada")
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "gpt2"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(dllm.CheckpointError, match="model_type='gpt2'"):
        dllm.load(directory)
    (tmp_path / "empty").mkdir()
    with pytest.raises(dllm.CheckpointError, match="no config.json"):
        dllm.load(tmp_path / "empty")


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(dllm.CheckpointError, match="could not fetch"):
        dllm.load("no-such-org/no-such-model-for-dllm-tests")
    with pytest.raises(dllm.CheckpointError, match="neither a checkpoint directory, a hub id"):
        dllm.load("not/a/hub/id")


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_random_init_sets_every_norm_scale_to_one(family):
    """A norm scale drawn like a weight (~0.02) shrinks the logits 50x and stalls training (LLaDA's ``ln_f``)."""
    model = build(tiny_config(family, 40, layers=2))
    random_init_(model, std=0.02)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    assert len(norms) == 2 * 2 + 1 + (2 * 2 if family == "sdar" else 0)  # per layer, final (+ SDAR's q/k norms)
    for name, p in model.named_parameters():
        if id(p) in norms:
            assert torch.all(p == 1), name
        else:
            assert 0.01 < p.std().item() < 0.04, name


@pytest.mark.parametrize("cache", [None, "dual"])
def test_unpadded_full_attention_forwards_give_sdpa_no_mask(cache, tiny, monkeypatch):
    """Where no mask is needed (full attention, no pads, every key visible) SDPA gets none, so its flash /
    memory-efficient kernels (and flash-attn, when installed) can run; a padded batch still gets its mask."""
    from dllm.models import layers

    masks = []
    original = layers.F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", sdpa)
    sampler = dllm.samplers.get("threshold")
    sampler.generate(tiny("llada"), [[10, 11, 12], [20, 21, 22]], max_new_tokens=8, block_size=4, cache=cache)
    assert masks and all(m is None for m in masks)
    masks.clear()
    sampler.generate(tiny("llada"), [[10, 11, 12], [20, 21]], max_new_tokens=8, block_size=4, cache=cache)
    assert all(m is not None for m in masks)
