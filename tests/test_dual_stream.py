"""WeDLM's training objective (dual-stream masking): training sees what the streaming decoder sees."""

from __future__ import annotations

import torch

import dllm
from dllm.models.loading import build
from dllm.models.saving import random_init_
from dllm.models.tiny import tiny_config
from dllm.train import RECIPES, TrainConfig, main, train
from dllm.train.dual_stream import draw_masks, dual_stream_logits, dual_stream_loss


def _model():
    model = build(tiny_config("wedlm", 50, kv_heads=4))
    random_init_(model, std=0.3, seed=1)
    return model


def test_masks_are_drawn_per_block_among_response_slots_only():
    g = torch.Generator().manual_seed(0)
    response = torch.zeros(3, 20, dtype=torch.bool)
    response[:, 7:] = True
    blocks = torch.arange(20).expand(3, -1) // 4
    blocks = blocks.masked_fill(torch.arange(20)[None, :] < torch.tensor([[0], [2], [5]]), -1)  # left pads
    response &= blocks >= 0
    for _ in range(20):
        masked, ratio = draw_masks(response, blocks, g)
        assert not bool((masked & ~response).any())
        for row in range(3):
            for b in range(5):
                in_block = (blocks[row] == b) & response[row]
                if in_block.any():
                    p = ratio[row, in_block][0]
                    assert bool((ratio[row, in_block] == p).all())
                    assert int(masked[row, in_block].sum()) == int(torch.round(in_block.sum() * p))


def test_noisy_blocks_see_the_clean_earlier_blocks_and_their_own_observed_tokens_first():
    """Each masked slot's training logits equal the decoder's: a causal forward over the clean tokens before its
    block, then its block reordered (observed tokens first, then masks), at the logical positions."""
    model = _model()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 50, (2, 14), generator=g)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, :3] = False
    positions = model.positions(valid)
    masked = (torch.rand(tokens.shape, generator=g) < 0.5) & valid
    masked[:, :4] = False
    noisy = tokens.masked_fill(masked, model.mask_id)
    with torch.no_grad():
        clean_logits, noisy_logits, order = dual_stream_logits(model, tokens, noisy, masked, positions, valid, 4)
        for row in range(2):
            real = valid[row]
            pos, tok, msk, nz = positions[row][real], tokens[row][real], masked[row][real], noisy[row][real]
            for b in range(int(pos.max()) // 4 + 1):
                cols = (pos // 4 == b).nonzero()[:, 0]
                within = torch.cat([cols[~msk[cols]], cols[msk[cols]]])
                before = (pos < 4 * b).nonzero()[:, 0]
                ids = torch.cat([tok[before], nz[within]])[None]
                expected = model.logits(ids, torch.cat([pos[before], pos[within]])[None])[0, len(before) :]
                # the same slots in the dual-stream output (order maps reordered rows to columns)
                columns = real.nonzero()[:, 0][within]
                rows = torch.stack([(order[row] == c).nonzero()[0, 0] for c in columns])
                torch.testing.assert_close(noisy_logits[row, rows], expected, rtol=1e-5, atol=1e-5)
            # the clean stream is an ordinary causal forward
            causal = model.logits(tok[None], pos[None])[0]
            torch.testing.assert_close(clean_logits[row, real], causal, rtol=1e-5, atol=1e-5)


def test_loss_combines_the_weighted_mask_loss_and_the_ar_loss():
    model = _model()
    tokens = torch.randint(5, 50, (4, 16), generator=torch.Generator().manual_seed(2))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    both = dual_stream_loss(model, tokens, valid, 6, 4, torch.Generator().manual_seed(0))
    mlm = dual_stream_loss(model, tokens, valid, 6, 4, torch.Generator().manual_seed(0), ar_weight=0.0)
    assert both > 0 and mlm > 0 and not torch.isclose(both, mlm)
    both.backward()
    assert model.lm_head.weight.grad is not None


def test_padding_after_a_response_is_neither_context_nor_target():
    """Without EOS padding a row ends at its EOS: what lies after it changes neither loss term."""
    model = _model()
    tokens = torch.randint(5, 50, (3, 16), generator=torch.Generator().manual_seed(4))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[0, 11:], valid[2, 14:] = False, False
    changed = tokens.clone()
    changed[0, 11:], changed[2, 14:] = 7, 8
    for ar_weight in (0.0, 1.0):
        losses = [
            dual_stream_loss(model, t, valid, 6, 4, torch.Generator().manual_seed(0), ar_weight)
            for t in (tokens, changed)
        ]
        torch.testing.assert_close(losses[0], losses[1])
    everything = dual_stream_loss(model, tokens, torch.ones_like(valid), 6, 4, torch.Generator().manual_seed(0))
    assert not torch.isclose(everything, losses[0])


def test_the_recipe_trains_a_loadable_wedlm_from_an_ar_warm_start(tmp_path, monkeypatch):
    """A few steps of ``python -m dllm.train --family wedlm``: next-token steps, then the dual-stream loss;
    the saved checkpoint loads as a WeDLM model and decodes with its streaming sampler."""
    import dllm.train as train_module

    calls = []
    for name in ("next_token_loss", "diffusion_loss"):
        loss = getattr(train_module, name)
        monkeypatch.setattr(train_module, name, lambda *a, _loss=loss, _name=name: calls.append(_name) or _loss(*a))
    shape = dict(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64)
    cfg = TrainConfig(family="wedlm", steps=4, ar_steps=2, batch_size=4, pool=40, eval_n=2, warmup=2, **shape)
    record = train(cfg, tmp_path, log=lambda *_: None)
    assert calls == ["next_token_loss"] * 2 + ["diffusion_loss"] * 2
    assert set(record["evals"][-1]) == {"step", "arith", "listops"}
    model = dllm.load(tmp_path, device="cpu")
    assert model.family == "wedlm" and model.attention == "causal"
    out = dllm.samplers.get("wedlm").generate(model, "1+1=", max_new_tokens=4)
    assert out.nfe >= 2


def test_command_line_has_a_wedlm_recipe(monkeypatch, tmp_path):
    import dllm.train as train_module

    seen = {}
    monkeypatch.setattr(train_module, "train", lambda cfg, out, checkpoint: seen.update(cfg=cfg) or {"evals": []})
    main(["--family", "wedlm", "--out", str(tmp_path)])
    cfg = seen["cfg"]
    assert cfg.family == "wedlm" and cfg.ar_steps > 0 and cfg.block_size == 8
    assert all(getattr(cfg, key) == value for key, value in RECIPES["wedlm"].items())
