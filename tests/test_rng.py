"""Counter-based random numbers: Philox-4x32-10 itself, and draws that depend only on their keys."""

from __future__ import annotations

import pytest
import torch

from dllm.core.rng import CounterRNG, Stream, philox

# Random123's known-answer vectors for philox4x32-10 (counter words, key words -> output words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox(tuple(torch.tensor(c) for c in counter), key)
    assert tuple(int(w) for w in out) == expected


def _draw(rng, rows, steps, offsets, **kw):
    return rng.uniform(Stream.TOKENS, torch.tensor(rows), torch.tensor(steps), torch.tensor(offsets), **kw)


def test_a_draw_depends_only_on_its_keys():
    rng = CounterRNG(7)
    together = _draw(rng, [0, 1, 2], [5, 5, 9], [[0, 1, 2]] * 3, vocab=11)
    alone = _draw(rng, [1], [5], [[1, 2]], vocab=11)
    assert torch.equal(together[1, 1:], alone[0])  # no other row, column or earlier draw matters
    assert not torch.equal(together[0], together[1])  # rows differ
    assert not torch.equal(_draw(rng, [0], [6], [[0, 1, 2]], vocab=11)[0], together[0])  # steps differ
    other = CounterRNG(8)
    assert not torch.equal(_draw(other, [0], [5], [[0, 1, 2]], vocab=11)[0], together[0])  # seeds differ
    streams = [rng.uniform(s, torch.tensor([0]), torch.tensor([0]), torch.tensor([[0, 1, 2]])) for s in Stream]
    assert len({tuple(s.flatten().tolist()) for s in streams}) == len(Stream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draws_are_uniform_in_the_unit_interval(dtype):
    u = _draw(CounterRNG(0), [3], [1], [list(range(20_000))], vocab=5, dtype=dtype).flatten()
    assert u.dtype == dtype and bool(((u >= 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u.double(), bins=10, min=0, max=1)
    assert bool((counts - u.numel() / 10).abs().max() < 5 * (u.numel() / 10) ** 0.5)  # ~ chi-square sized
    assert u.unique().numel() > 0.99 * u.numel()


def test_global_seed_is_followed_when_none_is_given():
    torch.manual_seed(3)
    a = CounterRNG(None).seed
    torch.manual_seed(3)
    assert CounterRNG(None).seed == a


def test_counters_materialise_the_same_draws_as_uniform():
    rng = CounterRNG(11, keys=[5, 9, 13])
    rows, steps = torch.tensor([2, 0]), torch.tensor([3, 8])
    offsets = torch.tensor([[0, 4, 7], [1, 2, 3]])
    expected = rng.uniform(Stream.TOKENS, rows, steps, offsets, vocab=9)
    counters = rng.counters(Stream.TOKENS, rows, steps, offsets)
    assert counters.rows.tolist() == [13, 13, 13, 5, 5, 5]  # row keys, not batch indices
    assert torch.equal(counters.uniform(9), expected.reshape(6, 9))
    # one batch row: expanding it gives stride-0 views; a kernel reading the counters by pointer needs them dense
    one = CounterRNG(11).counters(Stream.TOKENS, torch.tensor([1]), torch.tensor([3]), torch.arange(4)[None])
    for words in (one.rows, one.steps, one.offsets):
        assert words.is_contiguous() and words.stride() == (1,)
    assert one.rows.tolist() == [1] * 4 and one.steps.tolist() == [3] * 4


def test_row_keys_replace_row_indices():
    keyed = CounterRNG(3, keys=[4, 4])
    plain = CounterRNG(3)
    offsets = torch.tensor([[0, 1]])
    a = keyed.uniform(Stream.ORDER, torch.tensor([1]), torch.tensor([2]), offsets)
    b = plain.uniform(Stream.ORDER, torch.tensor([4]), torch.tensor([2]), offsets)
    assert torch.equal(a, b)


def test_per_row_seeds_draw_as_each_seed_alone():
    """Seeds per row (a list): each row draws what one seed for the whole batch draws for it, from counters too;
    None entries take fresh seeds (torch's global generator); seeds past 32 bits use both key words."""
    seeds = [7, 2**40 + 3, 7]
    rng = CounterRNG(seeds, keys=[0, 0, 1])
    rows, steps, offsets = torch.tensor([2, 0, 1]), torch.tensor([4, 4, 9]), torch.tensor([[0, 3], [1, 2], [5, 6]])
    got = rng.uniform(Stream.TOKENS, rows, steps, offsets, vocab=7)
    for j, row in enumerate(rows.tolist()):
        alone = CounterRNG(seeds[row], keys=[0, 0, 1]).uniform(Stream.TOKENS, rows[j : j + 1], steps[j : j + 1],
                                                              offsets[j : j + 1], vocab=7)  # fmt: skip
        assert torch.equal(got[j], alone[0])
    assert not torch.equal(got[1], CounterRNG(3, keys=[0, 0, 1]).uniform(Stream.TOKENS, rows[1:2], steps[1:2],
                                                                        offsets[1:2], vocab=7)[0])  # fmt: skip
    assert torch.equal(rng.counters(Stream.TOKENS, rows, steps, offsets).uniform(7), got.reshape(6, 7))
    flat = rng.uniform(Stream.ORDER, rows, steps, offsets)  # (no vocabulary: one draw a slot)
    assert torch.equal(
        flat[0], CounterRNG(7, keys=[0, 0, 1]).uniform(Stream.ORDER, rows[:1], steps[:1], offsets[:1])[0]
    )
    torch.manual_seed(5)
    fresh = CounterRNG([None, 4]).seed
    torch.manual_seed(5)
    assert CounterRNG([None, 4]).seed == fresh and fresh[1] == 4
