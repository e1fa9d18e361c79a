"""Serving under open-loop load: ``python -m dllm.bench.open_loop`` (results in ``eval/results/serve-open-loop.md``).

Requests arrive as a Poisson process at each of ``--rates`` (requests per second), whatever the server's progress (open
loop: a server that falls behind builds a queue, as real traffic does; a closed-loop client waits instead). Each request
is a bench-task prompt (arith and listops test examples) with its own ``max_tokens`` drawn from ``--lengths`` and its
own seed, sampled at ``--temperature`` with probability ``--sampled`` (else greedy), streamed. The same arrivals (one
seeded trace per rate) go to ``dllm serve`` three times, each time in a fresh process: with requests joining the running
rows between steps (the default: continuous batching), with ``--no-joins`` (requests of different lengths and
temperatures share a batch, which runs to its end before the next starts) and with ``--no-mixed-batches`` (a batch per
length and temperature, as the server batched before issue 44). Reported per rate: completed requests/s, tokens/s (up to
each EOS), p50 / p99 latency and time to the first streamed text, both from the request's scheduled arrival, the rows
decoded per step and the steps (forwards of the batch) the trace took (the server's ``/metrics``: on a GPU, where a step
of 32 rows costs about one of a single row, the steps are what the time follows).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from dllm.bench.serve import machine, percentile, prompts, start_server


def trace(rate: float, count: int, lengths: list[int], sampled: float, temperature: float, seed: int) -> list:
    """``count`` requests of a Poisson process of ``rate`` per second: (arrival second, body without the model)."""
    rng, texts, at, out = random.Random(seed), prompts(count), 0.0, []
    for i in range(count):
        at += rng.expovariate(rate)
        body = {"prompt": rng.choice(texts), "max_tokens": rng.choice(lengths), "seed": i}
        if rng.random() < sampled:
            body["temperature"] = temperature
        out.append((at, body))
    return out


def send(url: str, name: str, arrivals: list) -> list[dict]:
    """Each request at its arrival second (a thread each, streamed): its latency, time to first text and tokens."""
    import requests

    results: list[dict | None] = [None] * len(arrivals)
    start = time.perf_counter() + 0.2  # (the threads are started before the first arrival)

    def one(i: int, at: float, body: dict) -> None:
        time.sleep(max(0.0, start + at - time.perf_counter()))
        first, tokens = None, 0
        payload = {"model": name, **body, "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(url + "/v1/completions", json=payload, stream=True, timeout=1200) as r:
            r.raise_for_status()
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter() - start - at
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        done = time.perf_counter() - start
        results[i] = {"latency": done - at, "first": done - at if first is None else first, "tokens": tokens}
        results[i]["done"] = done

    threads = [threading.Thread(target=one, args=(i, at, body)) for i, (at, body) in enumerate(arrivals)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def metric(url: str, name: str) -> float:
    import requests

    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


# the servers compared: (the table's name, dllm serve's flags)
MODES = (
    ("rows join between steps", []),
    ("settings mixed, no joins", ["--no-joins"]),
    ("a batch per setting", ["--no-mixed-batches"]),
)


def bench(args, log) -> list[dict]:
    lengths = [int(g) for g in args.lengths.split(",")]
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        arrivals = trace(rate, args.requests, lengths, args.sampled, args.temperature, args.seed)
        for batching, flags in MODES:
            extra = ["--block-size", str(args.block_size), "--max-batch-size", str(args.max_batch_size), *flags]
            process, url = start_server(args.model, args.sampler, args.threads, log, extra)
            try:
                send(url, args.model, arrivals[:2])  # warm-up
                before = {k: metric(url, k) for k in ("dllm_steps_total", "dllm_row_steps_total")}
                results = send(url, args.model, arrivals)
                steps, row_steps = (metric(url, k) - before[k] for k in before)
            finally:
                process.send_signal(2)
                process.wait(60)
            span = max(r["done"] for r in results) - arrivals[0][0]
            latencies, firsts = [r["latency"] for r in results], [r["first"] for r in results]
            row = {
                "rate": rate,
                "batching": batching,
                "requests": len(results),
                "requests_per_s": len(results) / span,
                "tokens_per_s": sum(r["tokens"] for r in results) / span,
                "p50_ms": 1000 * statistics.median(latencies),
                "p99_ms": 1000 * percentile(latencies, 0.99),
                "first_p50_ms": 1000 * statistics.median(firsts),
                "first_p99_ms": 1000 * percentile(firsts, 0.99),
                "rows_per_step": row_steps / max(steps, 1),
                "steps": int(steps),
            }
            rows.append(row)
            log(
                f"{rate:g}/s, {row['batching']}: {row['tokens_per_s']:.0f} tokens/s, p50 {row['p50_ms']:.0f} ms, "
                f"p99 {row['p99_ms']:.0f} ms, {row['rows_per_step']:.1f} rows per step"
            )
    return rows


def markdown(rows: list[dict], args, argv: list[str]) -> str:
    lines = [
        "# Serving under open-loop load: requests joining the running rows, a batch of mixed settings at a time, a "
        "batch per setting",
        "",
        f"`python -m dllm.bench.open_loop {' '.join(argv)}`".replace(" `", "`"),
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        f"Model {args.model}, sampler {args.sampler or 'its family reference'}, blocks of {args.block_size}, "
        f"max_tokens from {args.lengths}, {100 * args.sampled:.0f} % sampled at temperature {args.temperature:g}. "
        + machine("CPU cores (server and clients)"),
        "",
        "| rate /s | batching | requests | requests/s | tokens/s | p50 ms | p99 ms | first text p50 ms | "
        "first text p99 ms | rows per step | steps |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']:g} | {r['batching']} | {r['requests']} | {r['requests_per_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['first_p50_ms']:.0f} | "
            f"{r['first_p99_ms']:.0f} | {r['rows_per_step']:.1f} | {r['steps']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm.bench.open_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llada", help="a bundled name or a directory (tiny-llada)")
    parser.add_argument("--sampler", default=None, help="default: the family's reference sampler")
    parser.add_argument("--rates", default="2,8,32", help="arrival rates, requests per second (2,8,32)")
    parser.add_argument("--requests", type=int, default=96, help="requests per rate (96)")
    parser.add_argument("--lengths", default="8,16,24,32,40", help="the max_tokens drawn from (8,16,24,32,40)")
    parser.add_argument("--block-size", type=int, default=8, help="the server's --block-size (8)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="the server's --max-batch-size (32)")
    parser.add_argument("--sampled", type=float, default=0.5, help="share of sampled requests (0.5)")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled requests (1.0)")
    parser.add_argument("--seed", type=int, default=0, help="of the arrivals and the requests (0)")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads")
    parser.add_argument("--out", default=None, help="write the table to this markdown file")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if min(rates) <= 0 or args.requests < 2 or not 0 <= args.sampled <= 1:
        raise SystemExit("--rates must be positive, --requests at least 2 and --sampled between 0 and 1")
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    table = markdown(bench(args, log), args, argv)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
