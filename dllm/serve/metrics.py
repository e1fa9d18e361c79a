"""The server's figures, in Prometheus' text format (``GET /metrics``).

Counters: requests by endpoint and status, batches, sequences, generated tokens, forwards, decoding seconds (so
``rate(dllm_generated_tokens_total[1m])`` is tokens/s); gauges: the queue depth, the sequences decoding now, the
last batch's tokens/s; a histogram of request latencies (arrival to answer).
"""

from __future__ import annotations

import threading
from collections import Counter

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.totals = Counter()  # batches, sequences, tokens, forwards, seconds, rejected
        self.last_tokens_per_second = 0.0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def latency_of(self, seconds: float) -> None:
        """An answered request's seconds from arrival to its last byte."""
        with self._lock:
            self.latency[sum(seconds > b for b in LATENCY_BUCKETS)] += 1
            self.latency_sum += seconds

    def batch(
        self, requests: int, sequences: int, tokens: int, forwards: int, seconds: float, steps=0, row_steps=0
    ) -> None:
        with self._lock:
            self.totals.update(batches=1, sequences=sequences, tokens=tokens, forwards=forwards, seconds=seconds)
            self.totals.update(steps=steps, row_steps=row_steps)
            self.last_tokens_per_second = tokens / seconds if seconds > 0 else 0.0

    def add(self, tokens_per_second: float | None = None, **counts) -> None:
        """Counts of a batch that rows join, as they come (batches, sequences, tokens, forwards, seconds, steps,
        row_steps); ``tokens_per_second``: the batch's, once it ends."""
        with self._lock:
            self.totals.update(counts)
            if tokens_per_second is not None:
                self.last_tokens_per_second = tokens_per_second

    def rejected(self) -> None:
        with self._lock:
            self.totals["rejected"] += 1

    def render(self, queue_depth: int, running: int) -> str:
        with self._lock:
            lines = [
                "# HELP dllm_requests_total Requests answered, by endpoint and HTTP status.",
                "# TYPE dllm_requests_total counter",
                *(
                    f'dllm_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())
                ),
            ]
            for name, key, kind, what in (
                ("dllm_batches_total", "batches", "counter", "Batches decoded."),
                ("dllm_sequences_total", "sequences", "counter", "Sequences (rows) decoded."),
                ("dllm_generated_tokens_total", "tokens", "counter", "Tokens generated (up to each EOS)."),
                ("dllm_forwards_total", "forwards", "counter", "Model forwards (NFE) of all batches."),
                ("dllm_steps_total", "steps", "counter", "Decoding steps of all batches."),
                (
                    "dllm_row_steps_total",
                    "row_steps",
                    "counter",
                    "Rows decoded at each step, summed (over dllm_steps_total: the rows per step).",
                ),
                ("dllm_decoding_seconds_total", "seconds", "counter", "Seconds spent decoding batches."),
                ("dllm_rejected_total", "rejected", "counter", "Requests refused because the queue was full."),
            ):
                lines += [f"# HELP {name} {what}", f"# TYPE {name} {kind}", f"{name} {self.totals[key]:g}"]
            lines += [
                "# HELP dllm_queue_depth Requests waiting for a batch.",
                "# TYPE dllm_queue_depth gauge",
                f"dllm_queue_depth {queue_depth}",
                "# HELP dllm_running_sequences Sequences in the batch decoding now.",
                "# TYPE dllm_running_sequences gauge",
                f"dllm_running_sequences {running}",
                "# HELP dllm_tokens_per_second Tokens per second of the last batch.",
                "# TYPE dllm_tokens_per_second gauge",
                f"dllm_tokens_per_second {self.last_tokens_per_second:.3f}",
                "# HELP dllm_request_latency_seconds Seconds from a request's arrival to its answer.",
                "# TYPE dllm_request_latency_seconds histogram",
            ]
            cumulative = 0
            for bound, count in zip((*LATENCY_BUCKETS, "+Inf"), self.latency):
                cumulative += count
                lines.append(f'dllm_request_latency_seconds_bucket{{le="{bound}"}} {cumulative}')
            lines += [
                f"dllm_request_latency_seconds_sum {self.latency_sum:.6f}",
                f"dllm_request_latency_seconds_count {cumulative}",
            ]
        return "\n".join(lines) + "\n"
