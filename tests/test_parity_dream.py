"""Parity with the official Dream code, recorded on the tiny random Dream checkpoint.

``fixtures/dream_parity.json`` holds outputs of the official ``DreamModel.forward`` (modeling file of the
ZHZisZZ/dllm mirror without its 2-D mask conversion, i.e. the Hub original) and of the official
``diffusion_generate`` (Gen-Verse/dLLM-RL ``generation_utils.py``), run on CPU in float32 with
transformers 5 shims and the mask token's logit set to -inf (ours never proposes it). The weights are
rebuilt here with ``make_tiny_checkpoint(seed=0)``; ``weights_check`` guards that they are the same.

- Logits: the official forward is unshifted, ours aligned: ours[:, i] == official[:, i - 1] (i >= 1),
  ours[:, 0] == official[:, 0]; padded batches use the official bool [B, 1, N, N] mask and
  ``tok_idx = cumsum(mask) - 1`` positions, compared where the source row is a real token.
- Sampler: every ``alg`` at temperature 0 (steps <, =, > max_new_tokens, top_p / top_k, a left-padded
  batch), and with ``temperature > 0`` / ``alg_temp > 0`` / ``alg="origin"`` for one prompt, where the
  official ran with its random draws replaced by dllm's counter-based ones (``dllm.core.rng``; the
  fixture's ``source.random_draws`` says which draw became which): token for token. Recorded cases avoid
  exact confidence ties (ours break them to the left on purpose; ``torch.topk`` does not say how it
  breaks them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm
from dllm.models.tiny import make_tiny_checkpoint

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "dream_parity.json").read_text())
ATOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = FIXTURE["checkpoint"]
    directory = make_tiny_checkpoint(
        tmp_path_factory.mktemp("dream_parity"), ckpt["family"], seed=ckpt["seed"], **ckpt["shape"]
    )
    return dllm.load(directory, device="cpu", dtype=torch.float32)


def test_same_weights_as_recorded(model):
    state = model.state_dict()
    for key, total in FIXTURE["weights_check"].items():
        assert state[key].double().sum().item() == pytest.approx(total, rel=1e-9, abs=1e-9), key


def _compare(ours, recorded, source_real):
    """ours: aligned logits [B, N, V]; recorded: official unshifted logits; compare column i with the
    official column i - 1 (column 0 with itself) wherever that source column is a real token."""
    vocab = FIXTURE["logits"]["vocab_slice"]
    official = torch.tensor(recorded["slice"])
    expected = torch.cat([official[:, :1], official[:, :-1]], 1)
    argmax = torch.tensor(recorded["argmax"])
    argmax = torch.cat([argmax[:, :1], argmax[:, :-1]], 1)
    lse = torch.tensor(recorded["logsumexp"])
    lse = torch.cat([lse[:, :1], lse[:, :-1]], 1)
    src = torch.cat([source_real[:, :1], source_real[:, :-1]], 1)
    torch.testing.assert_close(ours[..., vocab][src], expected[src], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.logsumexp(-1)[src], lse[src], atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1)[src], argmax[src])


def test_logits_no_padding(model):
    rec = FIXTURE["logits"]["full"]
    ids = torch.tensor(rec["ids"])
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        ours = model.logits(ids, positions, attention_mask=None)
    _compare(ours, rec, torch.ones_like(ids, dtype=torch.bool))


def test_logits_left_padded(model):
    rec = FIXTURE["logits"]["padded"]
    ids, valid = torch.tensor(rec["ids"]), torch.tensor(rec["mask"]).bool()
    positions = model.positions(valid)
    assert torch.equal(positions[valid], torch.tensor(rec["tok_idx"])[valid])
    with torch.no_grad():
        ours = model.logits(ids, positions, attention_mask=valid)
    _compare(ours, rec, valid)


def _generate(model, case, ids, mask):
    sampler = dllm.samplers.get(
        "dream", alg=case["alg"], alg_temp=case["alg_temp"], top_p=case["top_p"], top_k=case["top_k"], eps=1e-3
    )
    out = sampler.generate(
        model,
        ids,
        attention_mask=mask,
        steps=case["steps"],
        max_new_tokens=case["max_new_tokens"],
        temperature=case["temperature"],
        seed=case["seed"],
        eos_early_stop=False,
    )
    return out.sequences


@pytest.mark.parametrize("case", FIXTURE["sampler"], ids=[c["name"] for c in FIXTURE["sampler"]])
def test_sampler_matches_official(model, case):
    ids, mask = torch.tensor(case["ids"]), torch.tensor(case["mask"])
    ours = _generate(model, case, ids, mask)
    official = torch.tensor(case["official"])
    assert ours.shape == official.shape
    real = torch.cat([mask.bool(), torch.ones(ids.shape[0], case["max_new_tokens"], dtype=torch.bool)], 1)
    assert ours[real].tolist() == official[real].tolist()


@pytest.mark.parametrize("name", ["entropy_T_algtemp", "margin_T_algtemp_S=G", "origin_T"])
def test_sampling_row_does_not_depend_on_batch_padding(model, name):
    """A sampled prompt gives the same tokens as row 0 of a left-padded batch (same seed): the per-row
    streams, including the alg_temp position draws, never see the padding or the other rows."""
    case = next(c for c in FIXTURE["sampler"] if c["name"] == name)
    ids = torch.tensor(case["ids"])
    other = torch.arange(10, 10 + ids.shape[1] + 2)[None]
    batch = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1), other], 0)
    mask = torch.ones_like(batch)
    mask[0, :2] = 0
    alone = _generate(model, case, ids, torch.ones_like(ids))
    padded = _generate(model, case, batch, mask)
    assert padded[0, 2:].tolist() == alone[0].tolist() == case["official"][0]
