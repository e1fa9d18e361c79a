"""The family registry: one declaration per family drives loading, saving and the tiny checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import dllm
from dllm.models import registry
from dllm.models.dream import Dream
from dllm.models.tiny import make_tiny_checkpoint, tiny_config


def test_every_family_is_declared_with_its_attention_kind():
    kinds = {name: registry.get(name).attention for name in registry.names()}
    assert kinds == {
        "llada": "full", "dream": "full", "sdar": "block", "llada2": "block", "wedlm": "causal",
        "fast_dllm_v2": "block", "diffusion_gemma": "encoder_decoder",
    }  # fmt: skip
    for name in registry.names():
        family = registry.get(name)
        assert family.adapter.family == name and family.adapter.attention == family.attention
        config = tiny_config(name, 40)
        assert registry.of_config(config) is family
        assert config["model_type"] == family.model_types[0]


def test_model_types_match_case_insensitively_and_unknown_ones_are_named():
    assert registry.of_config({"model_type": "dream"}).name == "dream"
    assert registry.of_config({"model_type": "WeDLM"}).name == "wedlm"
    with pytest.raises(dllm.CheckpointError, match="model_type='gpt2'.*'wedlm'"):
        registry.of_config({"model_type": "gpt2"})
    with pytest.raises(dllm.ConfigError, match="unknown model family 'gpt2'"):
        tiny_config("gpt2", 40)


def test_a_new_family_is_one_registration(registries, tmp_path):
    """A family registered here is built, saved, loaded and sampled without touching the loader."""

    class Toy(Dream):
        pass

    def toy_config(vocab_size, tokens, **shape):
        return {**registry.get("dream").tiny_config(vocab_size, tokens, **shape), "model_type": "toy"}

    registry.register(registry.Family("toy", ("toy",), Toy, "full", toy_config))
    directory = make_tiny_checkpoint(tmp_path, "toy")
    model = dllm.load(directory, device="cpu", dtype=torch.float32)
    assert isinstance(model, Toy) and model.family == "toy"
    out = dllm.samplers.get("llada").generate(model, [[5, 6, 7]], max_new_tokens=4, block_size=4)
    assert out.sequences.shape == (1, 7)
    with pytest.raises(dllm.ConfigError, match="model_type 'TOY' already selects family 'toy'"):
        registry.register(registry.Family("toy2", ("TOY",), Toy, "full", toy_config))


def test_tied_head_is_omitted_on_save_and_shared_on_load(tmp_path):
    directory = make_tiny_checkpoint(tmp_path, "wedlm", overrides={"tie_word_embeddings": True})
    assert "lm_head.weight" not in load_file(str(directory / "model.safetensors"))
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is True
    model = dllm.load(directory, device="cpu", dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_mask_id_names_every_family_published_id():
    from dllm.models.loading import build

    model = build({**tiny_config("dream", 40), "mask_token_id": None})
    with pytest.raises(dllm.ModelError, match="LLaDA 126336, Dream 151666, SDAR 151669, LLaDA2 156895, WeDLM 151665"):
        model.check_usable()


def test_a_family_declares_an_attention_kind_whose_behaviour_the_package_asks():
    """The kind is the string the config and the messages name, and the strategy everything outside the model
    asks (the mask, the decoding process, the canvas alignment, the default cache)."""
    from dllm.models import attention

    sdar, wedlm, llada = (registry.get(name).adapter.attention for name in ("sdar", "wedlm", "llada"))
    assert isinstance(sdar, attention.BlockCausal) and sdar.block_causal and sdar.default_cache == "block"
    assert wedlm.process == "stream" and wedlm.exact_likelihood and llada.process == "masked"
    first, generated = sdar.span(torch.tensor([5, 8]), 8, 6, 4)  # positions 5.. / 8..: blocks [4, 8) / [8, 12)
    assert first.tolist() == [7, 8] and generated.tolist() == [7, 8]  # spans to the blocks holding 5+6-1, 8+6-1
    with pytest.raises(dllm.ConfigError, match="attention must be an attention kind"):
        registry.register(registry.Family("odd", ("odd",), Dream, "sideways", lambda *a, **k: {}))


def test_the_registry_helper_names_what_it_holds_and_what_was_meant():
    from dllm.core.registry import Registry

    parts = Registry("widget", hint="; see dllm widgets")

    class Gear:
        name = "gear"

    class Nameless:
        name = ""

    assert parts.register(Gear) is Gear and parts.get("gear") is Gear and parts.names() == ["gear"]
    with pytest.raises(dllm.ConfigError, match=r"unknown widget 'gaer' \(did you mean 'gear'\?\); known: gear; see"):
        parts.get("gaer")
    with pytest.raises(dllm.ConfigError, match="has no name to register under.*'nameless'"):
        parts.register(Nameless)
    other = type("Gear2", (), {"name": "gear"})
    with pytest.raises(dllm.ConfigError, match="already registered"):
        parts.register(other, replace=False)
    assert parts.register(other) is other and "gear" in parts and len(parts) == 1


def test_every_registry_is_the_one_helper_and_suggests_close_names():
    from dllm.core.registry import Registry
    from dllm.kernels.dispatch import BACKENDS

    for parts in (dllm.samplers.registry.SAMPLERS, dllm.caches.CACHES, registry.FAMILIES, BACKENDS):
        assert isinstance(parts, Registry)
    with pytest.raises(dllm.ConfigError, match="unknown cache 'dul'; available: .*did you mean 'dual'"):
        dllm.caches.get("dul")
    with pytest.raises(dllm.ConfigError, match="unknown model family 'lada'.*did you mean 'llada'"):
        registry.get("lada")
    with pytest.raises(dllm.ConfigError, match="unknown scoring backend 'trition'.*did you mean 'triton'"):
        dllm.kernels.dispatch.score(torch.zeros(1, 4), None, backend="trition")


def test_the_reference_sampler_is_the_familys(registries):
    """A family declares the sampler speedups are measured against; one without it has none."""
    assert registry.get("sdar").reference_sampler == ("sdar", {"remasking_strategy": "low_confidence_static"})
    assert dllm.samplers.reference("sdar", confidence_threshold=0.5) == dllm.samplers.get(
        "sdar", remasking_strategy="low_confidence_static", confidence_threshold=0.5
    )
    dream = registry.get("dream")
    toy = dataclasses.replace(dream, name="toy", model_types=("toy",), adapter=type("Toy", (Dream,), {}))
    registry.register(dataclasses.replace(toy, reference_sampler=("threshold", {})))
    assert dllm.samplers.reference("toy") == dllm.samplers.get("threshold")
    registry.register(dataclasses.replace(toy, name="toy2", model_types=("toy2",), reference_sampler=None))
    with pytest.raises(dllm.ConfigError, match="no reference sampler for 'toy2' models"):
        dllm.samplers.reference("toy2")
