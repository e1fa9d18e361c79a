"""DiffusionGemma's uniform-state training: what the canvases see in training is what they see in decoding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import dllm
from dllm.core.errors import ConfigError
from dllm.models.diffusion_gemma import DiffusionGemma, Norm
from dllm.models.loading import build
from dllm.models.saving import random_init_
from dllm.models.tiny import tiny_config
from dllm.train import RECIPES, Data, TrainConfig, diffusion_loss, main, train, unit_weights
from dllm.train.uniform_state import uniform_state_loss


def _model(width: int = 4, window: int = 3, seed: int = 1) -> DiffusionGemma:
    """A random DiffusionGemma whose sliding window (3) is shorter than the prompt and whose encoder and decoder layer
    scalars differ, so that both show in the comparison with decoding."""
    config = tiny_config("diffusion_gemma", 50, layers=4, hidden=32, heads=4, kv_heads=2, block_size=width)
    config["text_config"]["sliding_window"] = window
    model = build(config)
    random_init_(model, std=0.3, seed=seed)
    with torch.no_grad():
        for i, layer in enumerate(model.decoder):
            layer.layer_scalar.fill_(0.5 + 0.25 * i)
            model.model.encoder.language_model.layers[i].layer_scalar.fill_(1.5 - 0.25 * i)
    return model.eval()


def test_every_canvas_sees_in_training_what_it_sees_in_decoding():
    """The one-forward training logits of every canvas equal decoding's: the encoder run over the prompt and then over
    each finished canvas (its K/V, the sliding layers' last window - 1 of them), the decoder over the noisy canvas with
    its self-conditioning input; left-padded rows included."""
    model = _model()
    g = torch.Generator().manual_seed(0)
    b, prompt, span, width = 3, 9, 12, 4
    clean = torch.randint(0, 50, (b, prompt + span), generator=g)
    valid = torch.ones_like(clean, dtype=torch.bool)
    valid[0, :3], valid[2, :1] = False, False
    noisy = torch.randint(0, 50, (b, span), generator=g)
    conditioning = torch.randn(b, span, 32, generator=g)
    with torch.no_grad():
        trained = model.canvases_logits(clean, noisy, valid, prompt, conditioning)
        encoded = model.encode(clean[:, :prompt], valid[:, :prompt], model.new_encoded(b, "cpu"))
        positions = model.positions(valid)
        for start in range(prompt, prompt + span, width):
            canvas = slice(start - prompt, start - prompt + width)
            where = positions[:, start : start + width]
            states = model.hidden(noisy[:, canvas], where, encoded=encoded, conditioning=conditioning[:, canvas]).states
            torch.testing.assert_close(trained[:, canvas], model.project(states), rtol=1e-5, atol=1e-5)
            encoded = model.encode(clean[:, start : start + width], valid[:, start : start + width], encoded)
        unconditioned = model.canvases_logits(clean, noisy, valid, prompt)
        first = model.hidden(noisy[:, :width], positions[:, prompt : prompt + width], encoded=model.encode(
            clean[:, :prompt], valid[:, :prompt], model.new_encoded(b, "cpu"))).states  # fmt: skip
        torch.testing.assert_close(unconditioned[:, :width], model.project(first), rtol=1e-5, atol=1e-5)


class _Recorder:
    """Wraps ``canvases_logits`` and keeps each call's arguments."""

    def __init__(self, model):
        self.calls, self.inner = [], model.canvases_logits
        model.canvases_logits = self

    def __call__(self, clean, noisy, valid, start, conditioning=None):
        self.calls.append((clean, noisy, valid, start, conditioning, torch.is_grad_enabled()))
        return self.inner(clean, noisy, valid, start, conditioning)


def test_canvases_are_noised_to_uniform_ids_and_every_slot_is_predicted():
    """Each canvas's slots are replaced by uniform ids at its own level (at eps near 1, all of them: about 1 / V equal
    their clean token by chance); the prompt is never noised; the loss is the mean cross-entropy of every response
    slot (not only the replaced ones) against its clean token; the prompt is context."""
    model = _model(seed=2)
    recorder = _Recorder(model)
    tokens = torch.randint(0, 50, (64, 8 + 16), generator=torch.Generator().manual_seed(3))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    cfg = TrainConfig(family="diffusion_gemma", block_size=4, eps=0.999)
    loss = uniform_state_loss(model, tokens, valid, 8, cfg, torch.Generator().manual_seed(0))
    clean, noisy, *_ = recorder.calls[-1]
    assert torch.equal(clean, tokens) and noisy.shape == (64, 16)
    same = (noisy == tokens[:, 8:]).float().mean().item()
    assert same < 0.05 and int(noisy.min()) >= 0 and int(noisy.max()) < 50
    logits = recorder.inner(clean, noisy, valid, 8, recorder.calls[-1][4])
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 50), tokens[:, 8:].reshape(-1)))

    cfg = dataclasses.replace(cfg, eps=1e-3)  # levels spread over (0, 1): per canvas, not per row
    uniform_state_loss(model, tokens, valid, 8, cfg, torch.Generator().manual_seed(0))
    kept = (recorder.calls[-1][1] == tokens[:, 8:]).view(64, 4, 4).float().mean(-1)  # [row, canvas]
    assert kept.std().item() > 0.2 and (kept[:, 0] - kept[:, 1]).abs().max().item() >= 0.5
    changed = tokens.clone()
    changed[:, :8] = (changed[:, :8] + 1) % 50
    assert diffusion_loss(model, changed, valid, 8, cfg, torch.Generator().manual_seed(0)).item() != pytest.approx(
        diffusion_loss(model, tokens, valid, 8, cfg, torch.Generator().manual_seed(0)).item()
    )


def test_half_the_rows_are_self_conditioned_on_a_first_pass_without_gradient():
    """About half the rows first run without gradient; the second pass conditions those rows on the soft embedding of
    that first prediction divided by a temperature in [t_min, t_max] and the others on nothing (zeros, a canvas's first
    step); only the second pass is differentiated."""
    model = _model(seed=4)
    recorder = _Recorder(model)
    tokens = torch.randint(0, 50, (40, 8 + 8), generator=torch.Generator().manual_seed(5))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    cfg = TrainConfig(family="diffusion_gemma", block_size=4)
    loss = uniform_state_loss(model, tokens, valid, 8, cfg, torch.Generator().manual_seed(0))
    (c1, n1, _, _, none, grad1), (_, n2, _, _, conditioning, grad2) = recorder.calls
    assert none is None and not grad1 and grad2 and loss.requires_grad
    rows = conditioning.abs().sum((1, 2)) > 0
    assert 10 <= int(rows.sum()) <= 30 and c1.shape[0] == int(rows.sum())
    assert torch.equal(n1, n2[rows])  # the same noisy canvases
    with torch.no_grad():
        first = recorder.inner(c1, n1, valid[rows], 8)
    grid = torch.stack([(model.soft_embedding(first / t) - conditioning[rows]).abs().amax((1, 2)) for t in
                        torch.linspace(0.4, 0.8, 801).tolist()])  # fmt: skip
    assert grid.amin(0).max().item() < 5e-3  # each row within rounding of its own temperature in the range
    raw = (model.soft_embedding(first) - conditioning[rows]).abs().amax((1, 2))
    assert raw.min().item() > 0.05  # tempered, not raw
    loss.backward()
    assert model.model.decoder.self_conditioning.down_proj.weight.grad.abs().sum() > 0


def test_responses_are_whole_canvases():
    """Training batches end on a canvas boundary (the response rounded up with EOS padding), and a response that does
    not is refused by name."""
    from dllm.tasks.tokenizer import build_tokenizer

    cfg = TrainConfig(family="diffusion_gemma", block_size=8, pool=50)
    data = Data(cfg, build_tokenizer(), multiple=8)
    for _ in range(20):
        tokens, valid, prompt = data.batch(4)
        assert (tokens.shape[1] - prompt) % 8 == 0
    model = _model(width=4)
    tokens = torch.randint(0, 50, (2, 14))
    with pytest.raises(ConfigError, match="whole number of canvases of 4"):
        uniform_state_loss(model, tokens, torch.ones_like(tokens, dtype=torch.bool), 8, cfg, torch.Generator())


def test_a_fresh_model_starts_with_unit_scales():
    """From scratch, DiffusionGemma's own RMSNorms, router scales and layer scalars start at 1, the rest random (random
    norms would scale every stream at random); other families keep ``random_init_``'s default."""
    model = build(tiny_config("diffusion_gemma", 50, layers=2, hidden=32, heads=2, kv_heads=2))
    random_init_(model, std=0.02, seed=0, ones=unit_weights(model))
    for name, p in model.named_parameters():
        one = name.endswith(("router.scale", "per_expert_scale", "layer_scalar")) or "norm" in name
        assert bool((p == 1).all()) == one, name
    assert any(isinstance(m, Norm) for m in model.modules())
    assert unit_weights(build(tiny_config("llada", 50))) is None


def test_diffusion_gemma_trains_from_the_command_line_to_a_loadable_model(tmp_path, capsys):
    """``python -m dllm.train --family diffusion_gemma`` trains the uniform-state objective with its recipe's canvases
    and sliding window and saves a checkpoint in the published layout that entropy_bound decodes; the masked
    objectives' options are refused by name, and the sliding window on another family."""
    flags = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--intermediate", "64"]
    flags += ["--steps", "3", "--batch-size", "4", "--pool", "40", "--eval-n", "2", "--warmup", "1"]
    assert main(["--family", "diffusion_gemma", "--out", str(tmp_path / "m"), *flags]) == 0
    capsys.readouterr()
    model = dllm.load(tmp_path / "m", device="cpu")
    assert model.family == "diffusion_gemma" and model.block_size == 8 and model.mask_id is None
    assert model.shape.window == RECIPES["diffusion_gemma"]["sliding_window"] == 32  # the recipe's window
    out = dllm.samplers.get("entropy_bound", max_denoising_steps=2).generate(model, ["1 + 2 ="], max_new_tokens=8)
    assert 1 <= out.nfe <= 2 and 1 <= len(out.tokens) <= 8  # one canvas of 8, at most 2 forwards
    for option in (["--complementary"], ["--edit-ratio", "0.1"]):
        assert main(["--family", "diffusion_gemma", "--out", str(tmp_path / "x"), *flags, *option]) == 2
        assert "uniform-state objective (no mask)" in capsys.readouterr().err
    assert main(["--family", "llada", "--out", str(tmp_path / "y"), *flags, "--sliding-window", "8"]) == 2
    assert "--sliding-window is DiffusionGemma's; llada has no sliding window" in capsys.readouterr().err


def test_uniform_state_training_is_reproducible(tmp_path):
    cfg = TrainConfig(family="diffusion_gemma", steps=3, batch_size=4, pool=40, eval_n=2, warmup=1, block_size=4,
                      hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64)  # fmt: skip
    a = train(cfg, tmp_path / "a", log=lambda *_: None)
    b = train(cfg, tmp_path / "b", log=lambda *_: None)
    assert [c["loss"] for c in a["loss_curve"]] == [c["loss"] for c in b["loss_curve"]]
