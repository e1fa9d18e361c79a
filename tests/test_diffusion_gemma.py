"""DiffusionGemma against transformers' own modeling and generate (``models/diffusion_gemma``, transformers >= 5.11):
the logits of tiny random checkpoints in the published layout, and ``generate`` token for token with transformers'
random draws replayed through ``draws=`` (research/diffusion_gemma.md §4, §6)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

import dllm
from dllm.core.errors import CheckpointError, ConfigError
from dllm.engine.renoise import entropy, entropy_accepted

V, L, W = 101, 8, 8  # vocabulary, canvas, sliding window of the tiny checkpoints


def _reference(seed=0, layers=3, std=0.3, eos=(1, 5), self_conditioning=1e-3):
    """A tiny random transformers DiffusionGemma: sliding layers and a full one (K = V, proportional RoPE), MoE, the
    encoder's layer_scalar apart from the decoder's. ``self_conditioning`` scales the self-conditioning block's
    output: at 1 the steps amplify rounding differences until tokens differ (research notes §9), so the comparisons
    run on contracting models."""
    types = ["sliding_attention" if (i + 1) % 3 and i < layers - 1 else "full_attention" for i in range(layers)]
    text = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, layer_types=types,
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, sliding_window=W, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    vision = dict(
        model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=L, eos_token_id=list(eos))
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" not in name:
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") or "layernorm" in name else noise * std)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(1, generator=g))
        model.model.decoder.self_conditioning.down_proj.weight.mul_(self_conditioning)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(**reference)`` -> (the transformers model, its save_pretrained directory)."""
    made = {}

    def get(**kw):
        key = repr(sorted(kw.items()))
        if key not in made:
            model = _reference(**kw)
            path = tmp_path_factory.mktemp("diffusion_gemma")
            model.save_pretrained(path)
            made[key] = model, path
        return made[key]

    return get


def _prompts(seed, b, p, padded):
    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(3, V, (b, p), generator=g)
    mask = torch.ones(b, p, dtype=torch.long)
    for row, pads in padded.items():
        mask[row, :pads] = 0
        ids[row, :pads] = 0
    return ids, mask


# -- the modeling --------------------------------------------------------------------------------------------------


def _reference_logits(hf, ids, mask, canvas, conditioning):
    from transformers import DynamicCache

    b, p = ids.shape
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    positions = torch.arange(p)[None]
    masks = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=torch.empty(b, p, 0), attention_mask=mask.bool(), cache=cache,
        position_ids=positions,
    )  # fmt: skip
    hf.model.encoder(input_ids=ids, attention_mask=masks, cache=cache, position_ids=positions)
    decoder_mask = hf.model.decoder.create_diffusion_decoder_attention_mask(
        config=hf.config, inputs_embeds=canvas[..., None], cache=cache,
        decoder_attention_mask=torch.nn.functional.pad(mask.bool(), (0, L), value=True),
    )  # fmt: skip
    out = hf(
        decoder_input_ids=canvas, self_conditioning_logits=conditioning, decoder_attention_mask=decoder_mask,
        cache=cache, decoder_position_ids=torch.arange(p, p + L)[None],
    )  # fmt: skip
    return out.logits


def _logits(model, ids, mask, canvas, conditioning):
    encoded = model.encode(ids, mask.bool(), model.new_encoded(ids.shape[0], "cpu"))
    valid = torch.cat([mask.bool(), torch.ones_like(canvas, dtype=torch.bool)], 1)
    positions = model.positions(valid)[:, ids.shape[1] :]  # a row's real tokens counted from 0
    soft = None if conditioning is None else model.soft_embedding(conditioning)
    hidden = model.hidden(canvas, positions, encoded=encoded, conditioning=soft)
    return model.head(hidden, torch.arange(L).expand(ids.shape[0], -1))


@pytest.mark.parametrize("prompt_width", [5, 13])  # within and past the sliding window
@pytest.mark.parametrize("form", ["save_pretrained", "hub"])
def test_logits_match_transformers(saved, prompt_width, form, tmp_path):
    """Encoder then decoder, with and without self-conditioning, a left-padded row; both config.json forms (the one
    save_pretrained writes, with per_layer_config, and the Hub's, with global_head_dim and
    num_global_key_value_heads)."""
    hf, path = saved(self_conditioning=1.0, std=1.0)
    if form == "hub":
        config = json.loads((path / "config.json").read_text())
        text = config["text_config"]
        assert text.pop("per_layer_config") == {"2": {"head_dim": 16, "num_key_value_heads": 1}}
        text.update(global_head_dim=16, num_global_key_value_heads=1)
        hub = tmp_path / "hub"
        hub.mkdir()
        (hub / "config.json").write_text(json.dumps(config))
        (hub / "model.safetensors").symlink_to(path / "model.safetensors")
        path = hub
    model = dllm.load(path, device="cpu")
    ids, mask = _prompts(0, 2, prompt_width, {1: 2})
    canvas = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
    conditioning = torch.randn(2, L, V, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        for c in (None, conditioning):
            want = _reference_logits(hf, ids, mask, canvas, c)
            got = _logits(model, ids, mask, canvas, c)
            # positions: transformers numbers a padded row's columns from its pads, dllm its real tokens (RoPE is
            # relative: the same up to rounding)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-5), (got - want).abs().max()


def test_the_checkpoint_loads_without_the_vision_tower_and_the_encoders_tied_copies(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = saved()
    state = load_file(path / "model.safetensors")
    assert any(k.startswith("model.encoder.vision_tower.") for k in state)  # what dllm ignores is there
    tied = state["model.decoder.layers.0.mlp.up_proj.weight"]
    state["model.encoder.language_model.layers.0.mlp.up_proj.weight"] = tied.clone()  # a stored tied copy
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    model = dllm.load(tmp_path, device="cpu")
    scalars = [layer.layer_scalar.item() for layer in model.model.encoder.language_model.layers]
    assert scalars == [state[f"model.encoder.language_model.layers.{i}.layer_scalar"].item() for i in range(3)]
    assert scalars != [layer.layer_scalar.item() for layer in model.decoder]  # each mode its own
    del state["model.decoder.layers.1.router.scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors model\.decoder\.layers\.1\.router\.scale"):
        dllm.load(tmp_path, device="cpu")


def test_a_bidirectional_encoder_config_is_refused_by_name(saved, tmp_path):
    _, path = saved()
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "all"
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="use_bidirectional_attention='all'"):
        dllm.load(tmp_path, device="cpu")


# -- generate against transformers' generate -----------------------------------------------------------------------


class _Recorded:
    """transformers' draws, in order, recorded around its generate: per canvas a randint (the initial canvas), then
    per step a multinomial (the denoiser canvas, and the probabilities it drew from) and a randint (the renoise
    ids). Replayed as dllm's ``draws``: each (row, canvas, step) gets exactly transformers' numbers."""

    def __init__(self, b):
        self.b, self.calls = b, []
        self.initial, self.sampled, self.probs, self.noise = {}, {}, {}, {}
        self.prob_error = 0.0

    def __enter__(self):
        self.randint, self.multinomial = torch.randint, torch.multinomial

        def randint(*args, **kw):
            out = self.randint(*args, **kw)
            self.calls.append(("randint", out.clone(), None))
            return out

        def multinomial(probs, *args, **kw):
            out = self.multinomial(probs, *args, **kw)
            self.calls.append(("multinomial", out.clone(), probs.clone()))
            return out

        torch.randint, torch.multinomial = randint, multinomial
        return self

    def __exit__(self, *error):
        torch.randint, torch.multinomial = self.randint, self.multinomial
        block = step = -1
        before = None  # the kind of the previous draw: a randint after a randint (or first) starts a canvas
        for kind, out, probs in self.calls:
            if kind == "randint" and before in (None, "randint"):
                block, step = block + 1, 0
                self.initial[block] = out
            elif kind == "multinomial":
                step += 1
                self.sampled[block, step] = out.view(self.b, L)
                self.probs[block, step] = probs.view(self.b, L, -1)
            else:
                self.noise[block, step] = out
            before = kind

    def tokens(self, rows, blocks, steps):
        block, step = int(blocks[0]), int(steps[0])
        assert bool((blocks == block).all() and (steps == step).all())
        return (self.initial[block] if step == 0 else self.noise[block, step])[rows]

    def sample(self, probs, rows, blocks, steps):
        block, step = int(blocks[0]), int(steps[0])
        self.prob_error = max(self.prob_error, (probs - self.probs[block, step][rows]).abs().max().item())
        return self.sampled[block, step][rows]


def _count_forwards(hf):
    """Wrap transformers' denoising step and canvas end: the batched decoder forwards in which some row was counted
    (not finished denoising, not finished), transformers' per-row accounting batched."""
    counted, state = [], {"ended": None}
    step, finalize = hf._denoising_step, hf._finalize_canvas

    def denoising_step(**kw):
        ended = state["ended"] if state["ended"] is not None else torch.zeros_like(kw["finished_denoising"])
        counted.append(~(kw["finished_denoising"] | ended))
        return step(**kw)

    def finalize_canvas(**kw):
        out = finalize(**kw)
        state["ended"] = out[1].clone()
        return out

    hf._denoising_step, hf._finalize_canvas = denoising_step, finalize_canvas
    return counted


CASES = {
    # name: (reference model, batch, prompt width, padded rows, max_new_tokens, transformers' generation arguments)
    "one canvas": (dict(seed=0), 1, 5, {}, 8, {}),
    "three canvases, a length not a multiple": (dict(seed=1), 2, 5, {1: 2}, 20, dict(max_denoising_steps=6)),
    "prompts past the sliding window": (dict(seed=2), 3, 13, {1: 2, 2: 6}, 16, dict(max_denoising_steps=5)),
    "stable at once (stability_threshold 0)": (dict(seed=12, std=1.0), 3, 9, {1: 2}, 24,
                                               dict(confidence_threshold=4.0, stability_threshold=0)),
    "stable and confident": (dict(seed=21, std=1.0, layers=2, eos=(1,)), 3, 9, {1: 2}, 24,
                             dict(confidence_threshold=4.0, sampler_config=100.0, t_min=0.05, t_max=0.1)),
    "stable over two steps": (dict(seed=22, std=1.0, layers=2, eos=(1,)), 3, 9, {1: 2}, 24,
                              dict(confidence_threshold=4.0, stability_threshold=2, sampler_config=100.0, t_min=0.05,
                                   t_max=0.1)),
    "EOS in different canvases": (dict(seed=7, eos=(1, 25, 33)), 3, 9, {1: 2}, 24,
                                  dict(confidence_threshold=3.5, sampler_config=1.0, max_denoising_steps=12)),
    "rows ending at different steps and canvases": (dict(seed=20, std=1.0, layers=2, eos=(1, 25, 33)), 3, 9,
                                                     {1: 2, 2: 4}, 24, dict(confidence_threshold=4.0,
                                                     sampler_config=100.0, t_min=0.05, t_max=0.1)),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_generate_matches_transformers_token_for_token(case, saved):
    reference, b, p, padded, max_new_tokens, arguments = CASES[case]
    hf, path = saved(**reference)
    model = dllm.load(path, device="cpu")
    ids, mask = _prompts(reference["seed"], b, p, padded)
    eos = list(reference.get("eos", (1, 5)))
    hf_arguments = dict(arguments)
    if "sampler_config" in hf_arguments:
        hf_arguments["sampler_config"] = EntropyBoundSamplerConfig(float(hf_arguments["sampler_config"]))
    counted = _count_forwards(hf)
    torch.manual_seed(reference["seed"])
    with _Recorded(b) as draws, torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
                           **hf_arguments)  # fmt: skip
    fields = {("entropy_bound" if k == "sampler_config" else k): v for k, v in arguments.items()}
    sampler = dllm.samplers.get("entropy_bound", **fields)
    got = sampler.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens, draws=draws)
    width = want.sequences.shape[1]
    assert torch.equal(got.sequences[:, :width], want.sequences)
    assert bool((got.sequences[:, width:] == 0).all())  # canvases transformers did not run: every row had ended
    assert draws.prob_error < 1e-4  # the decoder's probabilities at every step
    assert got.nfe == sum(bool(c.any()) for c in counted)
    # transformers' per-row account: tokens (pads excluded) over the row's forwards
    per_row = torch.stack(counted).sum(0)
    real = (want.sequences[:, p:] != 0).sum(1)
    assert torch.allclose(want.tokens_per_forward, real / per_row)


def test_the_reference_cases_cover_what_they_claim(saved):
    """The cases above stop early, end rows at different canvases and steps, and fill a whole canvas: checked on
    the reference's own runs, so a change of its tiny models cannot hollow them out."""
    seen = {}
    for case in ("stable and confident", "EOS in different canvases", "rows ending at different steps and canvases"):
        reference, b, p, padded, max_new_tokens, arguments = CASES[case]
        hf, _ = saved(**reference)
        ids, mask = _prompts(reference["seed"], b, p, padded)
        arguments = dict(arguments)
        if "sampler_config" in arguments:
            arguments["sampler_config"] = EntropyBoundSamplerConfig(float(arguments["sampler_config"]))
        counted = _count_forwards(hf)
        torch.manual_seed(reference["seed"])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0,
                              eos_token_id=list(reference.get("eos", (1, 5))), **arguments)  # fmt: skip
        seen[case] = (torch.stack(counted), out.sequences[:, p:])
    forwards, _ = seen["stable and confident"]
    assert forwards.shape[0] < 3 * 48 and len(set(forwards.sum(0).tolist())) > 1  # early, rows at different steps
    _, tokens = seen["EOS in different canvases"]
    assert len({int((row != 0).sum()) for row in tokens}) > 1  # rows end at different lengths
    forwards, _ = seen["rows ending at different steps and canvases"]
    assert len(set(forwards.sum(0).tolist())) > 1


# -- dllm's own draws ----------------------------------------------------------------------------------------------


def _process(model, seed, sampler=None):
    from dllm.engine.renoise import Renoising

    sampler = sampler or dllm.samplers.get("entropy_bound")
    run = sampler.prepare(model, [[5, 6, 7]], max_new_tokens=2 * L, seed=seed)
    process = Renoising(run, sampler)
    process.block, process.step = 1, 3
    return process


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of Pearson's chi-square (expected counts >= 5), by the Wilson-Hilferty approximation."""
    keep = expected >= 5
    statistic = float((((counts - expected) ** 2) / expected)[keep].sum())
    k = int(keep.sum()) - 1
    z = ((statistic / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_dllm_draws_follow_the_references_law(saved):
    """With ``seed``, the initial and renoise ids are uniform over the vocabulary and the denoiser canvas is a draw
    from softmax(z) (transformers: ``randint`` and ``torch.multinomial``): Pearson's test over 300 seeds, each seed
    8 slots; and the streams differ between steps, canvases and seeds."""
    _, path = saved()
    model = dllm.load(path, device="cpu")
    z = torch.randn(1, L, V, generator=torch.Generator().manual_seed(0)) * 2
    probs = torch.softmax(z, -1)[0]
    rows = torch.zeros(1, dtype=torch.long)
    noise, samples = torch.zeros(V), torch.zeros(L, V)
    for seed in range(300):
        process = _process(model, seed)
        noise += torch.bincount(process._noise(rows, 2)[0], minlength=V)
        samples[torch.arange(L), process._sample(z, rows)[0]] += 1
    assert _chi_square_p(noise, torch.full((V,), 300 * L / V)) > 1e-3
    assert _chi_square_p(samples.flatten(), (probs * 300).flatten()) > 1e-3
    process = _process(model, 0)
    first = process._noise(rows, 2)
    assert not torch.equal(first, process._noise(rows, 3)) and not torch.equal(first, process._noise(rows, 0))
    process.block = 0
    assert not torch.equal(first, process._noise(rows, 2))
    assert not torch.equal(first, _process(model, 1)._noise(rows, 2))


def test_the_acceptance_and_entropy_are_transformers(saved):
    """The entropy bound on random entropies (ties included) and the entropy of tempered logits, against
    transformers' EntropyBoundSampler and Categorical."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSampler

    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 16, V, generator=g) * 3
    z[0, :, 5:] = float("-inf")  # a support smaller than the vocabulary
    want = torch.distributions.Categorical(logits=z).entropy()
    assert torch.allclose(entropy(z), want, atol=1e-6)
    for bound in (1e-3, 0.1, 1.0, 5.0):
        reference = EntropyBoundSampler(EntropyBoundSamplerConfig(bound), 16, V, 48)
        h = torch.rand(4, 16, generator=g).round(decimals=1)  # ties
        logits = torch.log_softmax(torch.randn(4, 16, V, generator=g), -1)
        reference.accept_canvas(torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16, dtype=torch.long), logits, 1)
        h = torch.distributions.Categorical(logits=logits).entropy()
        assert torch.equal(entropy_accepted(h, bound), reference.accepted_token_mask)
        assert bool(entropy_accepted(h, bound).any(1).all())  # the lowest always


# -- bad input -----------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_what_to_do(tiny):
    model = tiny("diffusion_gemma")
    sampler = dllm.samplers.get("entropy_bound")
    with pytest.raises(ConfigError, match="temperature"):
        sampler.generate(model, "ab", max_new_tokens=8, temperature=1.0)
    with pytest.raises(ConfigError, match="keeps its encoder's K/V itself"):
        sampler.generate(model, "ab", max_new_tokens=8, cache="dual")
    with pytest.raises(ConfigError, match="t_max must be greater than t_min"):
        dllm.samplers.get("entropy_bound", t_min=0.9)
    with pytest.raises(ConfigError, match="decodes encoder_decoder-attention models"):
        sampler.generate(tiny("llada"), "ab", max_new_tokens=8)
    with pytest.raises(ConfigError, match="decodes full-attention models|decodes full or block"):
        dllm.samplers.get("threshold").generate(model, "ab", max_new_tokens=8)
    with pytest.raises(ConfigError, match="draws= replays"):
        dllm.samplers.get("llada").generate(tiny("llada"), "ab", max_new_tokens=4, draws=object())
    with pytest.raises(ConfigError, match="draws must have tokens"):
        sampler.generate(model, "ab", max_new_tokens=8, draws=object())

    class Short:
        def tokens(self, rows, blocks, steps):
            return torch.zeros(rows.shape[0], 3, dtype=torch.long)

        def sample(self, probs, rows, blocks, steps):
            return probs.argmax(-1)

    with pytest.raises(ConfigError, match=r"draws\.tokens must return a LongTensor of shape \(1, 4\)"):
        sampler.generate(model, "ab", max_new_tokens=8, draws=Short())


def test_nan_logits_are_an_error_not_garbage(tiny, monkeypatch):
    from dllm.core.errors import NumericalError

    model = tiny("diffusion_gemma")

    def head(hidden, columns, **kw):
        return torch.full((*columns.shape, model.vocab_size), float("nan"))

    monkeypatch.setattr(model, "head", head)
    with pytest.raises(NumericalError, match="NaN or infinite logits"):
        dllm.samplers.get("entropy_bound").generate(model, "ab", max_new_tokens=8, seed=0)


def test_eos_ends_a_row_and_eos_early_stop_false_decodes_every_canvas(tiny, monkeypatch):
    model = tiny("diffusion_gemma")
    original = model.head

    def head(hidden, columns, **kw):  # the second canvas's first slot is EOS with certainty
        out = original(hidden, columns, **kw).clone()
        out[..., model.eos_id] += 1000.0 * (columns == 3 + model.block_size).to(out.dtype)
        return out

    monkeypatch.setattr(model, "head", head)
    sampler = dllm.samplers.get("entropy_bound", max_denoising_steps=4)
    early = sampler.generate(model, [[5, 6, 7]], max_new_tokens=4 * model.block_size, seed=1)
    full = sampler.generate(model, [[5, 6, 7]], max_new_tokens=4 * model.block_size, seed=1, eos_early_stop=False)
    assert early.nfe == 2 * 4 and full.nfe == 4 * 4
    assert early.tokens == full.tokens == [model.block_size] and early.texts == full.texts
    assert bool((early.sequences[0, 3 + model.block_size + 1 :] == model.pad_id).all())


def test_the_compiled_decoder_step_equals_eager(tiny):
    """``compile=`` runs the decoder (every counted forward) through torch.compile: the same tokens and forwards (the
    ``aot_eager`` backend traces the graphs without generating kernels); the experts take their dense form, without
    a host read, so a forward is one graph."""
    from torch._dynamo.utils import counters

    model = tiny("diffusion_gemma")
    sampler = dllm.samplers.get("entropy_bound", max_denoising_steps=2)
    kw = dict(max_new_tokens=model.block_size, seed=4)
    eager = sampler.generate(model, ["ab", "cdef"], **kw)
    torch._dynamo.reset()
    counters.clear()
    compiled = sampler.generate(model, ["ab", "cdef"], compile="aot_eager", **kw)
    assert torch.equal(compiled.sequences, eager.sequences) and compiled.nfe == eager.nfe
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2  # a canvas's first step (no self-conditioning) and the others
