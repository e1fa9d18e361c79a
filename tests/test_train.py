"""The training objective and script: what training sees must be what decoding sees."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dllm
from dllm.core.errors import ConfigError
from dllm.models.loading import build
from dllm.models.saving import random_init_
from dllm.models.tiny import tiny_config
from dllm.train import (
    MIXTURE,
    RECIPES,
    Data,
    TrainConfig,
    block_diffusion_logits,
    causal_outputs,
    diffusion_loss,
    main,
    next_token_loss,
    noise,
    train,
)


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2"])
def test_block_diffusion_training_sees_clean_earlier_blocks(family):
    """Each noisy block's training logits equal decoding's: clean earlier blocks, the noisy block itself (Fast-dLLM
    v2, shifted: a block's first column from the clean previous block's last output, as its decoding reads it)."""
    model = build(tiny_config(family, 50, block_size=4))
    random_init_(model, std=0.3, seed=1)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(5, 50, (2, 16), generator=g)
    noisy = clean.masked_fill(torch.rand(clean.shape, generator=g) < 0.5, model.mask_id)
    valid = torch.ones_like(clean, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded row
    positions = model.positions(valid)
    block = positions // model.block_size  # blocks follow positions, not columns (row 1 is padded)
    for start in (0, 3):  # from column 3: row 1's blocks are whole, row 0's first block is cut (not checked)
        trained = block_diffusion_logits(model, noisy, clean, positions, valid, start)
        assert trained.shape[1] == 16 - start
        for row in range(2):
            for b in block[row][valid[row]].unique().tolist():
                cols = (block[row] == b) & valid[row]
                if cols[:start].any():
                    continue
                view = clean[row : row + 1].clone()
                view[0, cols] = noisy[row, cols]
                decoded = model.logits(view, positions[row : row + 1], attention_mask=valid[row : row + 1])
                got = trained[row, cols[start:]]
                torch.testing.assert_close(got, decoded[0, cols], rtol=1e-5, atol=1e-5)


def test_block_diffusion_loss_leaves_out_only_whole_prompt_blocks(monkeypatch):
    """The SDAR loss computes the noisy half from the first block holding a response slot: the same loss as
    the whole noisy half, whatever the rows' padding."""
    import dllm.train as train_module

    model = build(tiny_config("sdar", 50, block_size=4))
    random_init_(model, std=0.3, seed=2)
    tokens = torch.randint(5, 50, (3, 17))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, :2], valid[2, :5] = False, False  # rows whose response starts at different block offsets
    cfg = TrainConfig(family="sdar", eps=0.999)  # t near 1: every response slot is masked and counts
    cut = diffusion_loss(model, tokens, valid, 9, cfg, torch.Generator().manual_seed(0))
    whole = train_module.block_diffusion_logits
    monkeypatch.setattr(
        train_module, "block_diffusion_logits", lambda m, n, c, p, v, start: whole(m, n, c, p, v)[:, start:]
    )
    full = diffusion_loss(model, tokens, valid, 9, cfg, torch.Generator().manual_seed(0))
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-6)


def test_complementary_masks_mask_every_response_slot_exactly_once():
    """Fast-dLLM v2's complementary masking: a row's second copy is masked exactly where its first is not (within the
    response), at the complementary noise level."""
    response = torch.zeros(6, 12, dtype=torch.bool)
    response[:, 5:] = True
    response[2, 5:7] = False  # (a padded response slot is never masked)
    cfg = TrainConfig(family="fast_dllm_v2", complementary=True)
    masked, t = noise(response, cfg, torch.Generator().manual_seed(0))
    assert masked.shape == (12, 12) and t.shape == (12, 1)
    assert torch.equal(masked[:6] ^ masked[6:], response) and not (masked[:6] & masked[6:]).any()
    torch.testing.assert_close(t[:6] + t[6:], torch.ones(6, 1))
    single, _ = noise(response, dataclasses.replace(cfg, complementary=False), torch.Generator().manual_seed(0))
    assert torch.equal(single, masked[:6])  # the first copy is the plain draw


def test_editing_objective_replaces_visible_slots_and_trains_every_visible_slot(monkeypatch):
    """LLaDA2.1's token-to-token objective: about edit_ratio of the visible response slots get a random token other than
    the mask (never a masked or prompt slot), and the loss adds the cross-entropy of every visible response slot
    against its clean token (the replaced ones and the kept ones) to the mask-to-token loss."""
    import dllm.train as train_module
    from dllm.train import edits

    visible = torch.zeros(64, 40, dtype=torch.bool)
    visible[:, 8:] = True
    cfg = TrainConfig(family="llada2", edit_ratio=0.25)
    edited, replacements = edits(visible, 1, 50, cfg, torch.Generator().manual_seed(0))
    assert not (edited & ~visible).any() and abs(edited[visible].float().mean().item() - 0.25) < 0.02
    assert int(replacements.min()) >= 0 and int(replacements.max()) < 50 and not (replacements == 1).any()
    assert edits(visible, 1, 50, dataclasses.replace(cfg, edit_ratio=0.0), torch.Generator()) == (None, None)

    model = build(tiny_config("llada2", 50, block_size=4))
    random_init_(model, std=0.3, seed=5)
    tokens = torch.randint(5, 50, (3, 16))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    seen = []
    whole = train_module.block_diffusion_logits
    monkeypatch.setattr(train_module, "block_diffusion_logits", lambda m, n, *a: seen.append(n) or whole(m, n, *a))
    loss = diffusion_loss(model, tokens, valid, 8, cfg, torch.Generator().manual_seed(1))
    noisy = seen[0]
    replaced = (noisy != tokens) & (noisy != model.mask_id)
    assert replaced[:, 8:].any() and not replaced[:, :8].any() and not (noisy[:, :8] == model.mask_id).any()
    plain = diffusion_loss(model, tokens, valid, 8, dataclasses.replace(cfg, edit_ratio=0.0), torch.Generator())
    assert loss.item() > 0 and plain.item() > 0 and loss.item() != plain.item()


def test_loss_is_positive_and_reads_the_prompt_as_context():
    model = build(tiny_config("llada", 50))
    random_init_(model, std=0.3)
    cfg = TrainConfig(max_prompt=4, max_new_tokens=4)
    tokens = torch.randint(5, 50, (3, 8))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    loss = diffusion_loss(model, tokens, valid, 4, cfg, torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, :4] = 7  # the prompt is never a target, but it is context
    other = diffusion_loss(model, changed, valid, 4, cfg, torch.Generator().manual_seed(0))
    assert loss.item() > 0 and other.item() != loss.item()


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_without_eos_padding_a_response_ends_at_its_eos(family):
    """``eos_padding=False``: the columns after each response's EOS are not valid, and neither loss reads them."""
    from dllm.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = TrainConfig(family=family, pool=50, eos_padding=False)
    tokens, valid, p = Data(cfg, tokenizer).batch(8)
    padded, _, _ = Data(dataclasses.replace(cfg, eos_padding=True), tokenizer).batch(8)
    torch.testing.assert_close(tokens, padded)  # the same draws; only what counts differs
    ends = (tokens[:, p:] == tokenizer.eos_token_id).long().argmax(1)  # each response's EOS
    after = torch.arange(tokens.shape[1] - p)[None, :] > ends[:, None]
    assert after.any() and torch.equal(valid[:, p:], ~after) and bool(valid[:, :p].any(1).all())
    model = build(tiny_config(family, len(tokenizer)))
    random_init_(model, std=0.3)
    changed = tokens.clone()
    changed[:, p:][after] = 9
    for loss in (
        lambda t: diffusion_loss(model, t, valid, p, cfg, torch.Generator().manual_seed(0)),
        lambda t: next_token_loss(model, t, valid, p),
    ):
        torch.testing.assert_close(loss(tokens), loss(changed))


def test_dream_warm_start_is_causal_next_token_prediction():
    """--ar-steps: column i's output sees columns <= i only (padded rows too), and the loss is the
    cross-entropy of each response token given the output one column before it (Dream's read-out)."""
    model = build(tiny_config("dream", 50))
    random_init_(model, std=0.3, seed=3)
    tokens = torch.randint(5, 50, (2, 10))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, :2] = False  # a left-padded row
    out = causal_outputs(model, tokens, valid)
    torch.testing.assert_close(causal_outputs(model, tokens[:1], valid[:1]), out[:1])  # an unpadded batch alone
    for col in (3, 7):
        changed = tokens.clone()
        changed[:, col] = torch.where(tokens[:, col] == 9, 10, 9)
        other = causal_outputs(model, changed, valid)
        torch.testing.assert_close(other[:, :col], out[:, :col])
        assert not torch.allclose(other[:, col], out[:, col])
    loss = next_token_loss(model, tokens, valid, 6)
    by_hand = sum(F.cross_entropy(out[:, i - 1], tokens[:, i]) for i in range(6, 10)) / 4
    torch.testing.assert_close(loss, by_hand)
    with pytest.raises(ConfigError, match="ar-steps"):
        train(_tiny_run("llada", ar_steps=2), Path("unused"), log=lambda *_: None)


def test_dream_training_with_a_warm_start_switches_objective(tmp_path, monkeypatch):
    """The first ar_steps steps train the next-token loss, the rest the diffusion loss."""
    import dllm.train as train_module

    calls = []
    for name in ("next_token_loss", "diffusion_loss"):
        loss = getattr(train_module, name)
        monkeypatch.setattr(train_module, name, lambda *a, _loss=loss, _name=name: calls.append(_name) or _loss(*a))
    record = train(_tiny_run("dream", ar_steps=2, eval_every=6), tmp_path, log=lambda *_: None)
    assert calls == ["next_token_loss"] * 2 + ["diffusion_loss"] * 4
    assert record["config"]["ar_steps"] == 2


def test_fast_dllm_v2_starts_from_dreams_weights_and_refuses_other_shapes(tmp_path):
    """--init-from: every weight of a same-shaped model of another family (Dream's Qwen2 layers for Fast-dLLM v2);
    a model of another shape is a ConfigError naming the sizes to give."""
    from dllm.models.tiny import make_tiny_checkpoint
    from dllm.train import _warm_start

    donor = make_tiny_checkpoint(tmp_path / "dream", "dream", seed=4)
    model = build(tiny_config("fast_dllm_v2", len(dllm.load(donor).tokenizer), block_size=8))
    said = []
    _warm_start(model, str(donor), said.append)
    weights = dllm.load(donor, dtype=torch.float32).state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items()) and said
    other = build(tiny_config("fast_dllm_v2", len(dllm.load(donor).tokenizer), hidden=32))
    with pytest.raises(ConfigError, match="same family layers and sizes"):
        _warm_start(other, str(donor), said.append)


def _tiny_run(family: str, **overrides) -> TrainConfig:
    """A 6-step training run of a one-layer model: seconds on the CPU."""
    shape = dict(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64)
    return TrainConfig(family=family, steps=6, batch_size=4, pool=40, eval_n=2, warmup=2, **shape, **overrides)


def test_training_script_writes_a_loadable_official_checkpoint(tmp_path):
    cfg = _tiny_run("dream", eval_every=6, max_prompt=40, max_new_tokens=40)
    record = train(cfg, tmp_path, log=lambda *_: None)
    assert record["loss_curve"][0]["step"] == 1 and set(record["evals"][-1]) == {"step", "arith", "listops"}
    saved = json.loads((tmp_path / "training.json").read_text())
    assert saved["config"]["seed"] == 0 and saved["parameters"] == record["parameters"]
    model = dllm.load(tmp_path, device="cpu")
    assert model.family == "dream" and model.tokenizer is not None
    again = train(cfg, tmp_path / "again", log=lambda *_: None)
    losses = [c["loss"] for c in record["loss_curve"]]
    assert [c["loss"] for c in again["loss_curve"]] == losses, "training is reproducible from its seed"


def test_interrupted_training_resumes_to_the_same_model(tmp_path):
    cfg = _tiny_run("llada", eval_every=3)
    whole = train(cfg, tmp_path / "whole", log=lambda *_: None)

    def crash_at_the_last_eval(message):
        if message.startswith("step 6:"):
            raise KeyboardInterrupt

    checkpoint = tmp_path / "state.pt"
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "resumed", checkpoint, log=crash_at_the_last_eval)
    assert torch.load(checkpoint, weights_only=False)["state"]["step"] == 3
    resumed = train(cfg, tmp_path / "resumed", checkpoint, log=lambda *_: None)
    curve = [(c["step"], c["loss"]) for c in whole["loss_curve"]]
    assert [(c["step"], c["loss"]) for c in resumed["loss_curve"]] == curve and resumed["evals"] == whole["evals"]
    a, b = dllm.load(tmp_path / "whole"), dllm.load(tmp_path / "resumed")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    with pytest.raises(ConfigError, match="another training config"):
        train(dataclasses.replace(cfg, lr=1e-2), tmp_path / "other", checkpoint, log=lambda *_: None)


def test_command_line_trains_with_the_family_recipe_unless_overridden(monkeypatch, tmp_path, capsys):
    import dllm.train as train_module

    seen = []
    monkeypatch.setattr(train_module, "train", lambda cfg, out, checkpoint: seen.append(cfg) or {"evals": []})
    main(["--family", "sdar", "--out", str(tmp_path), "--lr", "0.01"])
    main(["--family", "llada", "--out", str(tmp_path)])
    assert (seen[0].family, seen[0].steps, seen[0].warmup, seen[0].lr) == ("sdar", RECIPES["sdar"]["steps"], 200, 0.01)
    assert (seen[1].steps, seen[1].lr) == (RECIPES["llada"]["steps"], RECIPES["llada"]["lr"])
    assert main(["--family", "gpt", "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert (
        "--family must be one of llada, dream, sdar, llada2, wedlm, fast_dllm_v2, diffusion_gemma (on the command line "
        "also a recipe:" in said
    )
    assert "llada21), got 'gpt'" in said
    main(["--family", "dream", "--out", str(tmp_path), "--mixture", "arith=1,listops=3"])
    assert (seen[2].steps, seen[2].ar_steps) == (RECIPES["dream"]["steps"], RECIPES["dream"]["ar_steps"])
    assert seen[2].mixture == {"arith": 1.0, "listops": 3.0}
    # a recipe's own mixture (WeDLM's, heavier on the list operations) is its default; --mixture still overrides it
    main(["--family", "wedlm", "--out", str(tmp_path)])
    main(["--family", "wedlm", "--out", str(tmp_path), "--mixture", "pick=1"])
    assert seen[1].mixture == MIXTURE and seen[3].mixture == RECIPES["wedlm"]["mixture"] != MIXTURE
    assert seen[4].mixture == {"pick": 1.0}
    main(["--family", "llada", "--out", str(tmp_path), "--no-eos-padding"])
    assert seen[1].eos_padding and not seen[5].eos_padding
    main(["--family", "llada21", "--out", str(tmp_path)])  # a recipe of another family: LLaDA2.1's, of llada2
    assert (seen[6].family, seen[6].edit_ratio, seen[6].init_from) == ("llada2", 0.1, "tiny-llada2")
    for bad, message in [("arith", "task=share pairs"), ("sums=1", "unknown task 'sums'"), ("arith=0", "positive")]:
        assert main(["--out", str(tmp_path), "--mixture", bad]) == 2
        assert message in capsys.readouterr().err


def test_a_short_run_plots_its_loss_under_its_own_name(tmp_path):
    """``python -m dllm.train`` with few steps: the curve has the last step too (a line, not a lone
    invisible point), drawn with markers, and the title names the output directory, not a bundled model."""
    from dllm.train import loss_figure

    cfg = dataclasses.replace(_tiny_run("llada", eval_every=3), steps=3)
    record = train(cfg, tmp_path / "my-run", log=lambda *_: None)
    assert [c["step"] for c in record["loss_curve"]] == [1, 3]
    (ax,) = loss_figure(record["loss_curve"], "my-run (llada, 3 steps)").axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1, 3] and line.get_marker() == "o"
    assert ax.get_title() == "my-run (llada, 3 steps)"
    assert (tmp_path / "my-run" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_saved_plot_is_titled_with_the_output_directory(tmp_path, monkeypatch):
    import dllm.train as train_module

    titles = []
    monkeypatch.setattr(train_module, "_plot", lambda curve, path, title: titles.append(title))
    train(dataclasses.replace(_tiny_run("sdar", eval_every=2), steps=2), tmp_path / "mine", log=lambda *_: None)
    assert set(titles) == {"mine (sdar, 2 steps)"}  # at the evaluation and at the end


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--steps", "-3"], "--steps must be an integer >= 1, got -3"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--eps", "1"], "--eps (the least noise level) must lie below 1"),
        (["--steps", "100", "--restart-at", "100"], "--restart-at (the step of a warm restart) must lie after"),
        (["--family", "dream", "--steps", "100"], "--ar-steps=3000 leaves no diffusion training in --steps=100"),
    ],
)
def test_settings_out_of_range_are_refused_before_training(flags, said, tmp_path, monkeypatch, capsys):
    """issue 31 item 12: ``--steps 0`` (or -3) saved an untrained model and exited 0. Every setting is checked, in
    the command line's words there and in the field's name from Python."""
    import dllm.train as train_module

    monkeypatch.setattr(train_module, "train", lambda *args: pytest.fail("trained with a setting out of range"))
    assert main(["--out", str(tmp_path / "model"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m dllm.train: error: {err.partition('error: ')[2]}" and said in err
    assert not (tmp_path / "model").exists()
    with pytest.raises(ConfigError, match="steps must be an integer >= 1, got 0"):
        TrainConfig(steps=0)


def test_a_checkpoint_resumes_with_more_steps(tmp_path):
    """issue 31 item 12: a finished run's checkpoint trains on when --steps grows (other settings stay as written);
    fewer steps than it holds, or another setting, are refused with what to do."""
    cfg = dataclasses.replace(_tiny_run("llada", eval_every=3), steps=3)
    checkpoint = tmp_path / "state.pt"
    train(cfg, tmp_path / "model", checkpoint, log=lambda *_: None)
    said = []
    record = train(dataclasses.replace(cfg, steps=6), tmp_path / "model", checkpoint, log=said.append)
    resumed = f"resumed from {checkpoint} at step 3; training on to step 6 (the learning rate now decays to it)"
    assert resumed + ", a warm restart (recorded as restart_at=3)" in said
    assert record["steps_done"] == 6 and [e["step"] for e in record["evals"]] == [3, 6]
    assert torch.load(checkpoint, weights_only=False)["state"]["step"] == 6
    # recorded as a warm restart at step 3, so that its config trains the same model from scratch
    assert record["config"]["restart_at"] == 3
    whole = train(dataclasses.replace(cfg, steps=6, restart_at=3), tmp_path / "whole", log=lambda *_: None)
    curve = [(c["step"], c["loss"], c["lr"]) for c in whole["loss_curve"]]  # the resumed one also logged step 3
    assert set(curve) <= {(c["step"], c["loss"], c["lr"]) for c in record["loss_curve"]}
    assert whole["evals"] == record["evals"]
    a, b = dllm.load(tmp_path / "whole"), dllm.load(tmp_path / "model")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ConfigError, match="already restarted at step 3; a run restarts once"):
        train(dataclasses.replace(cfg, steps=8), tmp_path / "model", checkpoint, log=lambda *_: None)
    with pytest.raises(ConfigError, match="is at step 6, past steps=5: give as many steps or more"):
        train(dataclasses.replace(cfg, steps=5), tmp_path / "model", checkpoint, log=lambda *_: None)
    with pytest.raises(ConfigError, match=r"another training config: lr 0.002 \(now 0.01\)"):
        train(dataclasses.replace(cfg, steps=6, lr=1e-2), tmp_path / "model", checkpoint, log=lambda *_: None)


def test_ctrl_c_is_one_line_that_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """issue 31 item 12: Ctrl-C in ``python -m dllm.train`` ends in one line, exit status 130."""
    import dllm.train as train_module

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train", interrupted)
    assert main(["--out", str(tmp_path), "--checkpoint", str(tmp_path / "state.pt")]) == 130
    assert capsys.readouterr().err == (
        f"python -m dllm.train: interrupted; resume with the same command: it goes on from "
        f"{tmp_path / 'state.pt'}, written at each evaluation\n"
    )
    assert main(["--out", str(tmp_path)]) == 130
    assert "with --checkpoint FILE a run can be resumed" in capsys.readouterr().err
