"""What serving costs: ``python -m dllm.bench.serve`` (results in ``eval/results/serve.md``).

For each model it starts ``dllm serve`` in its own process (``--max-batch-size 32``, ``--max-wait-ms 10``) and
drives it with 1, 8 and 32 concurrent clients (threads, each sending its next request when the last is answered)
over the same bench-task prompts (arith and listops test examples), then reports requests/s, tokens/s and the
p50 / p99 latency, beside ``sampler.generate`` of the same prompts offline in batches of the same size (in this
process, the server stopped). ``server / offline`` is the share of the offline batched tokens/s the server
delivers; ``equal`` counts the answers identical to their offline text (the server's guarantee: all of them).
Greedy, the family's reference sampler unless ``--sampler``; tokens are counted up to each EOS, as everywhere.
``--temperature T`` samples, every request with the same seed (``--seeds shared``) or each its own
(``--seeds per-request``: request i seed i; offline, ``generate(seed=[...])`` of each batch).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dllm.core.errors import ConfigError


def prompts(count: int) -> list[str]:
    from dllm.tasks import get

    per_task = -(-count // 2)
    pool = [e.prompt for name in ("arith", "listops") for e in get(name).examples("test", per_task)]
    return pool[:count]


def offline(model, sampler, texts: list[str], batch: int, seeds=None, **kw) -> tuple[float, list[str], int]:
    """Seconds, texts and tokens of ``texts`` through ``generate`` in batches of ``batch`` (``seeds``: text i's)."""
    out_texts, tokens, started = [], 0, time.perf_counter()
    for first in range(0, len(texts), batch):
        seed = None if seeds is None else seeds[first : first + batch]
        out = sampler.generate(model, texts[first : first + batch], seed=seed, **kw)
        out_texts += out.texts
        tokens += out.total_tokens
    return time.perf_counter() - started, out_texts, tokens


def drive(url: str, name: str, texts: list[str], clients: int, extra: dict, seeds=None) -> tuple[float, list, list]:
    """``clients`` threads sending ``texts`` one request at a time (``seeds``: text i's): (seconds, latencies,
    answers in order)."""
    import requests

    answers, latencies, lock, index = [None] * len(texts), [], threading.Lock(), iter(range(len(texts)))

    def client():
        session = requests.Session()
        while True:
            with lock:
                i = next(index, None)
            if i is None:
                return
            sent = time.perf_counter()
            body = {"model": name, "prompt": texts[i], **extra, **({} if seeds is None else {"seed": seeds[i]})}
            r = session.post(url + "/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            with lock:
                latencies.append(time.perf_counter() - sent)
            answers[i] = r.json()

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return time.perf_counter() - started, latencies, answers


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank at or above it)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def machine(cores: str = "CPU cores") -> str:
    """The results' machine line: processor, cores, torch, CUDA device or CPU."""
    device = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} {cores}, torch {torch.__version__}, "
        f"{device}."
    )


def start_server(model: str, sampler: str | None, threads: int | None, log, extra=()) -> tuple[subprocess.Popen, str]:
    """``dllm serve MODEL`` in its own process on a free port (``extra``: more of its options), once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "dllm.serve", model, "--port", str(port), "--log-level", "warning"]
    command += ["--sampler", sampler] if sampler else []
    command += ["--threads", str(threads)] if threads else []
    command += list(extra)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    import requests

    while True:
        if process.poll() is not None:
            raise ConfigError(f"dllm serve {model} ended at start-up: {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise ConfigError(f"dllm serve {model} did not answer /health within 300 s")
        try:
            requests.get(url + "/health", timeout=1)
            return process, url
        except requests.ConnectionError:
            time.sleep(0.2)


def bench_model(
    name: str, sampler_name: str | None, levels: list[int], count: int, threads, log, temperature=0.0, seeds="shared"
) -> list[dict]:
    import dllm

    model = dllm.load(name)
    sampler = dllm.samplers.get(sampler_name) if sampler_name else dllm.samplers.reference(model.family)
    texts = prompts(max(count, max(levels)))
    sampled = temperature > 0
    seed_of = None if not sampled else list(range(len(texts))) if seeds == "per-request" else [0] * len(texts)
    kw, extra = ({"temperature": temperature}, {"temperature": temperature}) if sampled else ({}, {})
    offline(model, sampler, texts[:2], 2, None if seed_of is None else seed_of[:2], **kw)  # warm-up
    rows = []
    for clients in levels:
        seconds, expected, tokens = offline(model, sampler, texts, clients, seed_of, **kw)
        rows.append({"model": name, "sampler": sampler.name, "clients": clients, "offline_tps": tokens / seconds})
        rows[-1] |= {"expected": expected, "seeds": "-" if not sampled else f"T={temperature:g}, {seeds}"}
    process, url = start_server(name, sampler_name, threads, log)
    try:
        drive(url, name, texts[:2], 2, extra, seed_of)  # warm-up
        for row in rows:
            seconds, latencies, answers = drive(url, name, texts, row["clients"], extra, seed_of)
            tokens = sum(a["usage"]["completion_tokens"] for a in answers)
            row |= {
                "requests_per_s": len(texts) / seconds,
                "tokens_per_s": tokens / seconds,
                "p50_ms": 1000 * statistics.median(latencies),
                "p99_ms": 1000 * percentile(latencies, 0.99),
                "equal": sum(a["choices"][0]["text"] == e for a, e in zip(answers, row.pop("expected"))),
                "requests": len(texts),
            }
            log(
                f"{name} {row['clients']:>2} clients: {row['tokens_per_s']:.0f} tokens/s served, "
                f"{row['offline_tps']:.0f} offline, {row['equal']}/{len(texts)} equal"
            )
    finally:
        process.send_signal(2)  # Ctrl-C: the server's clean shutdown
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
    return rows


def markdown(rows: list[dict], argv: list[str]) -> str:
    lines = [
        "# Serving: `dllm serve` against offline `generate`",
        "",
        f"`python -m dllm.bench.serve {' '.join(argv)}`".replace("  ", " ").replace(" `", "`"),
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        machine(),
        "",
        "| model | sampler | sampling | clients | requests | requests/s | tokens/s | p50 ms | p99 ms | "
        "offline tokens/s | server / offline | equal |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['sampler']} | {r.get('seeds', '-')} | {r['clients']} | {r['requests']} | "
            f"{r['requests_per_s']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['offline_tps']:.0f} | "
            f"{100 * r['tokens_per_s'] / r['offline_tps']:.0f} % | {r['equal']}/{r['requests']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm.bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny-llada,tiny-sdar", help="bundled names or directories")
    parser.add_argument("--sampler", default=None, help="default: each family's reference sampler")
    parser.add_argument("--clients", default="1,8,32", help="concurrency levels")
    parser.add_argument("--requests", type=int, default=64, help="requests per level (at least the clients)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    parser.add_argument("--seeds", choices=["shared", "per-request"], default="shared",
                        help="sampled requests' seeds: one for all, or each its own (shared)")  # fmt: skip
    parser.add_argument("--out", default=None, help="write the table to this markdown file")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.clients.split(",")]
    if min(levels) < 1 or args.requests < 1:
        raise SystemExit("--clients and --requests must be positive")
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    rows = [
        row
        for name in args.models.split(",")
        for row in bench_model(
            name, args.sampler, levels, args.requests, args.threads, log, args.temperature, args.seeds
        )
    ]
    table = markdown(rows, argv)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
