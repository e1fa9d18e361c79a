"""``dllm.load(..., device_map=...)``: a model placed by accelerate across devices and CPU / disk offload.

No GPU here: the maps use the CPU and the disk, so accelerate's machinery is really engaged (weights streamed to the
offload folder, the disk's modules on the meta device, hooks bringing their weights in for each forward), and every
family's greedy tokens and forwards must equal the model loaded whole, with and without a K/V cache. A new family
joins by registration (``registry.names()``)."""

from __future__ import annotations

import pytest
import torch

import dllm
from dllm.core.errors import ConfigError
from dllm.models import registry
from dllm.models.layers import PLACED, ForwardContext

FAMILIES = registry.names()
PROMPTS = ["Sort the list: 3 1 2\n", "Reverse the list: 1 2\n"]  # two widths: left padding, a mask


@pytest.fixture(scope="module")
def checkpoint(checkpoint_dir):
    """conftest's tiny checkpoint of a family, with config overrides as keywords."""
    return lambda family, **overrides: checkpoint_dir(family, **({"overrides": overrides} if overrides else {}))


def names(model) -> dict:
    """The module names of the parts a device map places."""
    name_of = {id(m): n for n, m in model.named_modules()}
    out = {"embedding": name_of[id(model.embedding)], "norm": name_of[id(model.final_norm)]}
    out["layers"] = [name_of[id(layer)] for layer in model.decoder]
    out["head"] = None if model.output is None else name_of[id(model.output)]
    return out


def split_map(model, head: str = "disk") -> dict:
    """The embedding on the CPU, the layers alternately on the CPU and the disk (the last on the disk), the final
    norm on the disk, the head on ``head``."""
    parts = names(model)
    device_map = {parts["embedding"]: "cpu"}
    last = len(parts["layers"]) - 1
    device_map.update({name: "disk" if (last - i) % 2 == 0 else "cpu" for i, name in enumerate(parts["layers"])})
    device_map[parts["norm"]] = "disk"
    if parts["head"] is not None:
        device_map[parts["head"]] = head
    for name, module in model.named_modules():  # a family's other parts (DiffusionGemma's self-conditioning block)
        covered = any(name == k or name.startswith(k + ".") or k.startswith(name + ".") for k in device_map)
        if not covered and next(module.parameters(recurse=False), None) is not None:
            device_map[name] = "cpu"
    return device_map


def caches(family: str) -> list:
    """No cache, and the family's own (the block cache of a block-causal model, the stream's of a causal one) or
    the dual cache of a full-attention model; an encoder-decoder model keeps its encoder's K/V itself: no cache."""
    attention = registry.get(family).adapter.attention
    return [None] if attention.process == "renoise" else [None, attention.default_cache or "dual"]


def generate(model, cache, prompts=PROMPTS, name=None, **hyper_parameters):
    family = registry.of_model(model)
    name, reference = (name, {}) if name is not None else family.reference_sampler
    sampler = dllm.samplers.get(name, **{**reference, **hyper_parameters})
    blocks = {} if family.adapter.attention.process == "stream" else {"block_size": 4}
    out = sampler.generate(model, prompts, max_new_tokens=8, cache=cache, seed=0, **blocks)  # (DiffusionGemma samples)
    return out.sequences.tolist(), out.nfe


def assert_offloaded(model, device_map: dict, folder) -> None:
    """The disk's modules hold no weights (meta device, brought in by accelerate's hooks from ``folder``); the
    CPU's hold theirs; so a forward that ignored the hooks would fail, and the equalities below could."""
    assert model.hf_device_map == device_map
    for name, module in model.named_modules():
        mapped = next((device_map[k] for k in device_map if name == k or name.startswith(k + ".") or k == ""), None)
        for tensor in module.parameters(recurse=False):
            assert tensor.device.type == ("meta" if mapped == "disk" else "cpu"), name
        if mapped == "disk" and next(module.parameters(recurse=False), None) is not None:
            assert hasattr(module, "_hf_hook"), name
    assert (folder / "index.json").is_file()
    assert model.device == torch.device("cpu")  # the canvas's: the embedding's execution device


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_map_with_disk_offload_equals_whole_model(family, checkpoint, tmp_path):
    directory = checkpoint(family)
    whole = dllm.load(directory, device="cpu")
    device_map = split_map(whole)
    placed = dllm.load(directory, device_map=device_map, offload_folder=tmp_path)
    assert_offloaded(placed, device_map, tmp_path)
    assert {getattr(layer, PLACED) for layer in placed.decoder} == {torch.device("cpu")}
    for cache in caches(family):
        assert generate(placed, cache) == generate(whole, cache), cache


@pytest.mark.parametrize("family,strategy", [(f, "auto") for f in FAMILIES] + [("llada", "sequential")])
def test_strategy_within_small_max_memory_offloads_and_equals(family, strategy, checkpoint, tmp_path):
    from accelerate.utils import compute_module_sizes

    directory = checkpoint(family)
    whole = dllm.load(directory, device="cpu")
    sizes = compute_module_sizes(whole)
    memory = {"cpu": sizes[""] // 2}  # less than the model: accelerate must put some of it on the disk
    placed = dllm.load(directory, device_map=strategy, max_memory=memory, offload_folder=tmp_path)
    assert "disk" in placed.hf_device_map.values()
    assert any(p.device.type == "meta" for p in placed.parameters())
    assert any(hasattr(module, "_hf_hook") for module in placed.modules())
    assert not any(key.startswith(layer + ".") for key in placed.hf_device_map for layer in names(whole)["layers"])
    for cache in caches(family):
        assert generate(placed, cache) == generate(whole, cache), cache


def test_a_whole_model_map_is_a_plain_load(checkpoint):
    """What fits on one device is loaded there, without hooks (every strategy; a single device)."""
    directory = checkpoint("llada")
    expected = generate(dllm.load(directory, device="cpu"), None)
    for device_map in ("auto", "balanced", "balanced_low_0", "sequential", "cpu", {"": "cpu"}):
        placed = dllm.load(directory, device_map=device_map)
        assert set(placed.hf_device_map.values()) == {"cpu"}
        assert not any(hasattr(m, "_hf_hook") or hasattr(m, PLACED) for m in placed.modules())
        assert all(p.device.type == "cpu" for p in placed.parameters())
    assert generate(placed, None) == expected


def test_damaged_weights_are_named(checkpoint, tmp_path):
    import shutil

    directory = tmp_path / "damaged"
    shutil.copytree(checkpoint("sdar"), directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(dllm.CheckpointError, match="model.safetensors cannot be read as safetensors"):
        dllm.load(directory, device_map="auto")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tied_head_stays_tied(family, checkpoint, tmp_path):
    """LLaDA's tied head is the embedding matrix itself (brought in from the disk for the head too); Dream's
    ``lm_head`` shares the embedding's weight and goes with it."""
    tie = {"weight_tying": True} if family == "llada" else {"tie_word_embeddings": True}
    directory = checkpoint(family, **tie)
    whole = dllm.load(directory, device="cpu")
    parts = names(whole)
    for where in ("disk", "cpu"):
        device_map = {**split_map(whole, head=where), parts["embedding"]: where}
        placed = dllm.load(directory, device_map=device_map, offload_folder=tmp_path / where)
        if placed.output is not None:
            assert placed.output.weight is placed.embedding.weight
        assert (placed.embedding.weight.device.type == "meta") == (where == "disk")
        for cache in caches(family):
            assert generate(placed, cache) == generate(whole, cache), (where, cache)
    if parts["head"] is not None:
        with pytest.raises(ConfigError, match="shares its weight with the embedding"):
            dllm.load(directory, device_map=split_map(whole), offload_folder=tmp_path)  # embedding cpu, head disk


@pytest.mark.parametrize(
    "family,cache,sampler",
    [("llada", "dual", None), ("llada", "elastic", "threshold"), ("dream", "prefix", None), ("sdar", "block", None)],
)
def test_layers_on_another_device(family, cache, sampler, checkpoint, monkeypatch):
    """Layers computing on a device other than the canvas's: the forward context (queries, mask, write, reuse),
    cos / sin and the layer's input move there, the layer's K/V are kept there, the observer sees the canvas's
    device. Without a second device here, ``cpu:0`` is a device that is not the canvas's ``cpu`` (the copies are
    real calls, free on the CPU): the placed path runs, and must give the same tokens and forwards."""
    directory = checkpoint(family)
    whole = dllm.load(directory, device="cpu")
    placed = dllm.load(directory, device="cpu")
    for i, layer in enumerate(placed.decoder):
        if i % 2:
            setattr(layer, PLACED, torch.device("cpu", 0))
    assert placed.layer_device(1) == torch.device("cpu", 0) and placed.device == torch.device("cpu")
    moved = []
    on = ForwardContext.on
    monkeypatch.setattr(ForwardContext, "on", lambda ctx, device, home: moved.append(device) or on(ctx, device, home))
    hyper_parameters = {"threshold": 0.5} if sampler == "threshold" else {}
    assert generate(placed, cache, name=sampler, **hyper_parameters) == generate(
        whole, cache, name=sampler, **hyper_parameters
    )
    assert moved and set(moved) == {torch.device("cpu", 0)}


def test_cli_generate_with_device_map(checkpoint, tmp_path, capsys):
    from dllm.cli import main

    directory = str(checkpoint("llada"))
    common = ["generate", PROMPTS[0], "--model", directory, "--max-new-tokens", "8", "--block-size", "4"]
    assert main([*common, "--device", "cpu"]) == 0
    whole = capsys.readouterr().out
    placed = ["--device-map", "sequential", "--max-memory", "cpu=100000", "--offload-folder", str(tmp_path)]
    assert main([*common, *placed]) == 0
    assert capsys.readouterr().out == whole
    assert (tmp_path / "index.json").is_file()
    assert main([*common, "--device-map", "sequential", "--max-memory", "cpu=100000"]) != 0
    assert "--offload-folder DIR" in capsys.readouterr().err


def test_harness_takes_device_map(checkpoint):
    pytest.importorskip("lm_eval")
    from dllm.eval.harness import DllmLM

    directory = checkpoint("llada")
    lm = DllmLM.create_from_arg_string(f"pretrained={directory},device_map=auto", {"device": "cuda"})
    assert set(lm.model.hf_device_map.values()) == {"cpu"}  # lm-eval's default --device gave way to the map
    with pytest.raises(ConfigError, match="both say where the model goes"):
        DllmLM.create_from_arg_string(f"pretrained={directory},device_map=auto,device=cpu")


LAYOUT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu"}
LAYOUT["lm_head"] = "cpu"


@pytest.mark.parametrize(
    "arguments,match",
    [
        (dict(device="cpu", device_map="auto"), "both say where the model goes"),
        (dict(device_map="fastest"), "neither a strategy"),
        (dict(device_map={**LAYOUT, "model.layer.1": "cpu"}), r"names no module .*did you mean 'model.layers.1'"),
        (dict(device_map={**LAYOUT, "lm_head.weight": "cpu"}), "a tensor: map its module 'lm_head'"),
        (dict(device_map={**LAYOUT, "model.layers.0": 7}), "names CUDA device 7"),
        (dict(device_map={**LAYOUT, "model.layers.0": "cuda:7"}), "names CUDA device 7"),
        (dict(device_map={**LAYOUT, "model.layers.0": "gpu"}), "'gpu' is not a device"),
        (dict(device_map=LAYOUT), "on the disk, which needs a folder .* pass offload_folder=DIR"),
        (dict(device_map="sequential", max_memory={"cpu": 1000}), "on the disk, .* pass offload_folder=DIR"),
        (dict(device_map={k: v for k, v in LAYOUT.items() if k != "model.norm"}), "gives no device to 'model.norm'"),
        (dict(device_map={**LAYOUT, "model.layers.0.mlp": "cpu"}), "part of decoder layer 'model.layers.0'"),
        (dict(device_map={**LAYOUT, "model": "cpu"}), "maps 'model' and also"),
        (dict(device_map={}), "empty dict"),
        (dict(device_map="auto", max_memory={"cpu": "lots"}), "not a size"),
        (dict(device_map="auto", max_memory={"gpu": "1GB"}), "max_memory key 'gpu' is not a device"),
        (dict(device_map="auto", max_memory={7: "1GB"}), "names CUDA device 7"),
        (dict(device_map=LAYOUT, max_memory={"cpu": "1GB"}), "leave max_memory out"),
        (dict(max_memory={"cpu": "1GB"}), "max_memory goes with device_map"),
        (dict(offload_folder="off"), "offload_folder goes with device_map"),
    ],
)
def test_bad_placement_is_a_clear_error(arguments, match, checkpoint, tmp_path):
    if "offload_folder" in arguments:
        arguments = {**arguments, "offload_folder": tmp_path / arguments["offload_folder"]}
    with pytest.raises(ConfigError, match=match):
        dllm.load(checkpoint("dream"), **arguments)
    assert not any(tmp_path.iterdir())  # refused before anything was written
