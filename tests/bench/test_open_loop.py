"""``python -m dllm.bench.open_loop``: its arrivals are a seeded Poisson trace, its client measures each streamed
request from its scheduled arrival."""

from __future__ import annotations

import statistics

import dllm
from dllm.bench.open_loop import percentile, send, trace
from dllm.serve import create, running


def test_the_trace_is_seeded_poisson_with_each_request_its_own_length_and_seed():
    arrivals = trace(rate=20.0, count=400, lengths=[8, 16], sampled=0.5, temperature=1.0, seed=3)
    assert arrivals == trace(rate=20.0, count=400, lengths=[8, 16], sampled=0.5, temperature=1.0, seed=3)
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
    assert all(g > 0 for g in gaps) and 0.04 < statistics.mean(gaps) < 0.06  # 1 / rate on average
    assert [body["seed"] for _, body in arrivals] == list(range(400))
    assert {body["max_tokens"] for _, body in arrivals} == {8, 16}
    assert 150 < sum("temperature" in body for _, body in arrivals) < 250
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0 and percentile([1.0, 2.0], 0.0) == 1.0


def test_each_request_is_sent_at_its_arrival_and_timed_to_its_first_text():
    model = dllm.load("tiny-llada")
    arrivals = trace(rate=50.0, count=3, lengths=[16], sampled=0.0, temperature=1.0, seed=0)
    with running(create(model, name="tiny", sampler="threshold", generation={"block_size": 8})) as url:
        results = send(url, "tiny", arrivals)
    for r in results:
        assert 0 < r["first"] <= r["latency"] and r["tokens"] > 0
