"""ARness (:mod:`dllm.engine.order`): the share of a row's filled masks filled left to right."""

from __future__ import annotations

import types

import pytest
import torch

import dllm
from dllm.engine.order import Order

M = 99


def test_a_fill_counts_at_the_leftmost_mask_or_running_on_from_it_in_the_same_step():
    canvas = types.SimpleNamespace(tokens=torch.tensor([[1, 1, M, M, M, M], [1, 1, M, M, M, M], [1, 1, 1, 1, 1, 1]]))
    canvas.batch, canvas.length = 3, 6
    order = Order(canvas, M)
    steps = [  # per step, the columns each row fills
        ([2, 3], [3], []),  # row 0: the leftmost and the next (2 of 2); row 1: past a mask (0 of 1)
        ([5], [2, 5], []),  # row 0: past column 4 (0 of 1); row 1: the leftmost, then past column 4 (1 of 2)
        ([4], [4], []),  # both: the last mask (1 of 1)
    ]
    for step in steps:
        masked = order.before()
        for row, columns in enumerate(step):
            canvas.tokens[row, columns] = 7
        order.after(masked)
    assert order.arness() == [3 / 4, 2 / 4, None]


def _arness_from_history(out, mask_id):
    """Each row's ARness recomputed from the canvases after every step (the prompt's canvas first)."""
    canvases = [out.history[0].new_full(out.history[0].shape, 0)] + list(out.history)
    first = canvases[1].clone()
    canvases[0] = torch.where(torch.arange(first.shape[1]) >= out.prompt_width, mask_id, first)
    shares = []
    for row in range(first.shape[0]):
        filled = in_order = 0
        for before, after in zip(canvases, canvases[1:]):
            masked = [c for c in range(before.shape[1]) if before[row, c] == mask_id]
            for c in masked:
                if after[row, c] != mask_id:
                    filled += 1
                    in_order += all(after[row, d] != mask_id for d in masked if d < c)
        shares.append(in_order / filled if filled else None)
    return shares


@pytest.mark.parametrize("name", ["llada", "threshold", "eb"])
def test_generation_reports_each_rows_arness_of_its_steps(name):
    model = dllm.load("tiny-llada")
    prompts = ["Sort the list: 14 7 9\n", "Reverse the list: 3 17 0 8\n"]
    out = dllm.samplers.get(name).generate(
        model, prompts, max_new_tokens=16, block_size=8, history=True, eos_early_stop=False
    )
    assert out.arness == pytest.approx(_arness_from_history(out, model.mask_id))
    assert all(0 < a <= 1 for a in out.arness)


def test_a_process_without_masks_reports_none(tmp_path):
    from dllm.models.tiny import make_tiny_checkpoint

    model = dllm.load(make_tiny_checkpoint(tmp_path / "gemma", "diffusion_gemma"))
    out = dllm.samplers.reference("diffusion_gemma").generate(model, ["1 2", "3"], max_new_tokens=4, seed=0)
    assert out.arness == [None, None]
