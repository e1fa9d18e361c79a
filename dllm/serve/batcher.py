"""Batching: the requests that wait are decoded together, each row exactly as if it were alone.

One thread owns the model and runs one batch at a time; requests that arrive meanwhile wait in a bounded queue
(``max_queue`` requests; past it, 503). When the thread is free it takes the oldest waiting request, waits at most
``max_wait`` seconds (from that request's arrival, or from the end of the last batch if later) for others to
join, and decodes it together with the waiting requests whose settings match it (sampler, generation settings:
:attr:`Job.key`; each row draws from its own request's seed, and decodes its own request's ``max_tokens`` where the
lengths' block grids agree and its own temperature: ``generate(max_new_tokens=[...], temperature=[...])``), oldest
first, up to ``max_batch_size`` sequences.

The guarantee: a request's answer (its tokens and its NFE) is what ``sampler.generate`` gives for its prompt alone,
whatever else shares its batch. It rests on dllm's batch invariance (left padding changes nothing; a row's random
draws are keyed by ``(seed, key, step, column)``, never by its index): the server keys each row as generate()
would alone (``n`` samples of a prompt are its occurrences 0..n-1, as ``generate([prompt] * n, seed=S)``) under
its request's seed (the Philox key of its row: ``generate(seed=[...])``). A request without a seed draws a fresh
one. A row's NFE is the forwards
up to its last commit: what generate() alone makes, since a run ends with its last row's last commit.

Faults: a batch that raises is decoded again one request at a time, so only the request that fails gets the
error. A request whose client went away is dropped from the queue; if it is already decoding, its rows finish
with the batch (the other rows are not disturbed) and the answer is discarded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

import torch

from dllm.core.errors import ConfigError, DllmError, LengthError
from dllm.core.rng import CounterRNG
from dllm.engine.session import PROCESSES, takes_row_temperatures
from dllm.serve.protocol import Answer, ApiError, Choice, Job, Settings, bad

log = logging.getLogger("dllm.serve")


@dataclasses.dataclass(frozen=True)
class Row:
    job: Job
    choice: int
    prompt: list[int]
    key: int  # the row's random-stream key: its occurrence among its request's copies of the prompt


class Batcher:
    """The model's thread and its queue. ``options``: the ``generate()`` arguments every batch shares (cache,
    kernel, compile, static_shapes); mixed_batches False: a batch per ``max_tokens`` and temperature (the
    open-loop bench's baseline)."""

    def __init__(
        self, model, options: dict, *, max_batch_size: int, max_wait: float, max_queue: int, metrics, mixed_batches=True
    ):
        self.model, self.options, self.metrics, self.mixed_batches = model, dict(options), metrics, mixed_batches
        self.max_batch_size, self.max_wait, self.max_queue = max_batch_size, max_wait, max_queue
        self.queue: list[Job] = []
        self.running = 0  # rows of the batch decoding now
        self.peak = 0  # the most requests that ever waited at once (at most max_queue)
        self.stopping = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- the handlers' side (event loop thread) ---------------------------------------------------------------

    def check(self, job: Job) -> None:
        """Refuse what generate() would refuse, before the request queues: the same checks (lengths, block grid,
        steps, cache and sampler fit), without a forward."""
        try:
            geometry = job.sampler.prepare(self.model, job.prompts, **self._arguments(job, seed=0)).geometry
        except LengthError as e:
            raise bad(str(e), "messages" if job.kind == "chat" else "prompt", "context_length_exceeded") from None
        except ConfigError as e:
            raise Settings.refusal(job, e) from None
        # Requests of other lengths share its batch (generate(max_new_tokens=[...])) when each decodes the same block
        # grid alone, unless the sampler's rule reads the length or a template sets it; requests of other
        # temperatures (generate(temperature=[...])) unless the sampler reads it beyond its scores
        job.length = geometry.max_new_tokens
        mixed, template = self.mixed_batches, job.generation.get("template") is not None
        length = geometry.grid if mixed and job.sampler.per_row_lengths and not template else job.length
        temperature = None if mixed and takes_row_temperatures(job.sampler) else job.generation.get("temperature", 0.0)
        job.key = json.dumps([job.key, length, temperature])

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.stopping:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if len(self.queue) >= self.max_queue:
                self.metrics.rejected()
                raise ApiError(
                    503,
                    f"the queue is full ({self.max_queue} requests wait; dllm serve --max-queue): retry later",
                    code="queue_full",
                )
            self.queue.append(job)
            self.peak = max(self.peak, len(self.queue))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the request if it still waits (its rows finish with their batch if not)."""
        job.cancelled = True
        with self._cond:
            if job in self.queue:
                self.queue.remove(job)
                self._cond.notify()

    @property
    def depth(self) -> int:
        return len(self.queue)

    # -- the model's thread -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dllm-serve-batches", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Refuse new requests and answer the waiting ones 503 now; the running batch goes on to its end, and then
        the thread ends. Thread-safe: the server calls it as the shutdown begins (Ctrl-C), before uvicorn waits
        for the open connections, so that no waiting request is decoded or left to time out."""
        with self._cond:
            self.stopping = True
            waiting, self.queue = self.queue, []
            self._cond.notify_all()
        for job in waiting:
            job.deliver(("error", ApiError(503, "the server is shutting down", code="shutting_down")))

    def stop(self, timeout: float | None = None) -> None:
        """:meth:`drain`, then wait for the running batch to end (at most ``timeout`` s)."""
        self.drain()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            if batch:
                self._run(batch)

    def _take(self) -> list[Job] | None:
        """The next batch (empty: its first request went away while it waited; None: stopping)."""
        free = time.perf_counter()
        with self._cond:
            while not self.queue and not self.stopping:
                self._cond.wait()
            if self.stopping:
                return None
            first = self.queue[0]
            # max_wait counts from when the model is free too: the clients of the batch that just ended can join
            # the requests that waited for it, instead of those leaving alone and the batches staying split.
            deadline = max(first.arrived, free) + self.max_wait
            while not self.stopping:
                rows = sum(job.rows for job in self.queue if job.key == first.key)
                left = deadline - time.perf_counter()
                if rows >= self.max_batch_size or left <= 0:
                    break
                self._cond.wait(left)
                if first not in self.queue:
                    return []
            batch, rows = [], 0
            for job in self.queue:
                if job.key == first.key and rows + job.rows <= self.max_batch_size:
                    batch.append(job)
                    rows += job.rows
            for job in batch:
                self.queue.remove(job)
            self.running = rows
            return batch

    def _run(self, batch: list[Job]) -> None:
        try:
            self._decode(batch)
        except Exception as error:  # noqa: BLE001 - a request's fault must not end the server
            if len(batch) > 1:  # find the request that fails: each alone (the others' answers are the same)
                for job in batch:
                    self._run([job])
                return
            job = batch[0]
            if isinstance(error, DllmError):
                answer = bad(str(error))
            else:
                log.exception("request %s failed", job.id)
                answer = ApiError(500, f"internal error: {type(error).__name__}: {error}")
            job.deliver(("error", answer))
        finally:
            self.running = 0

    def _arguments(self, job: Job, seed, callback=None) -> dict:
        return {**job.generation, **self.options, "seed": seed, "callback": callback}

    def _decode(self, batch: list[Job]) -> None:
        started = time.perf_counter()
        rows = [Row(job, i * job.n + j, p, j) for job in batch for i, p in enumerate(job.prompts) for j in range(job.n)]
        first = batch[0]
        fresh = {id(job): int.from_bytes(os.urandom(7), "little") for job in batch if job.seed is None}
        seed = [fresh.get(id(row.job), row.job.seed) for row in rows]  # (no seed asked: fresh numbers)
        keys = [row.key for row in rows]
        streamed = [r for r, row in enumerate(rows) if row.job.stream]
        last = torch.zeros(len(rows), dtype=torch.long, device=self.model.device)  # forwards to each row's last commit
        spans: list[int] = []

        rewrites = PROCESSES.get(first.sampler.process).rewrites_current_block

        working = torch.ones(len(rows), dtype=torch.bool, device=self.model.device)  # rows decoding at the next step
        row_steps, steps = torch.zeros((), dtype=torch.long, device=self.model.device), 0

        def on_step(info):
            nonlocal last, working, row_steps, steps
            last = torch.where(info.committed.any(1), info.nfe, last)
            row_steps, steps = row_steps + working.sum(), steps + 1  # (on the device: read once, at the end)
            working = ~info.done
            if streamed:
                final = spans
                if rewrites:  # edits may still change the current block: stream the blocks before it
                    start = (canvas.first_block + info.block * canvas.block_size - info.prompt_width).clamp(min=0)
                    final = torch.where(info.done, canvas.length, start)[streamed].tolist()
                final = [min(a, b) for a, b in zip(final, spans)]
                self._stream(info, [rows[r] for r in streamed], info.tokens[streamed, info.prompt_width :], final)

        arguments = self._arguments(first, seed, on_step)
        if len({row.job.length for row in rows}) > 1:  # each row its own request's length
            arguments["max_new_tokens"] = [row.job.length for row in rows]
        temperatures = [row.job.generation.get("temperature", 0.0) for row in rows]
        if len(set(temperatures)) > 1:  # and temperature
            arguments["temperature"] = temperatures
        run = first.sampler.prepare(self.model, [row.prompt for row in rows], **arguments)
        run.rng = CounterRNG(seed, keys)
        canvas = run.canvas
        answer = canvas.valid[:, canvas.prompt_width :].sum(1)  # each row's answer columns: its span, or
        if run.answer_width is not None:  # the first max_new_tokens of it (a block-aligned span's tail dropped)
            answer = answer.clamp(max=run.answer_width)
        spans[:] = answer[streamed].tolist() if streamed else []
        with torch.inference_mode():
            first.sampler.run(run)
        out = first.sampler.finish(run)
        nfe = [n or out.nfe for n in last.tolist()]
        generated = out.sequences[:, out.prompt_width :].tolist()
        lengths = answer.tolist()
        eos = set(self.model.eos_ids)
        answers: dict[int, list] = {id(job): [] for job in batch}
        for r, row in enumerate(rows):
            ended = any(t in eos for t in generated[r][: lengths[r]])
            text, stopped = cut(out.texts[r], row.job.stop)
            reason = "stop" if ended or stopped else "length"
            answers[id(row.job)].append((row.choice, Choice(text, reason, int(out.tokens[r])), nfe[r]))
        seconds, tokens = time.perf_counter() - started, out.total_tokens
        row_steps = int(row_steps)
        self.metrics.batch(len(batch), len(rows), tokens, out.nfe, seconds, steps, row_steps)  # before any answer: a
        for job in batch:  # client that reads /metrics right after its answer sees its batch counted
            done = sorted(answers[id(job)], key=lambda item: item[0])
            answer = Answer([c for _, c, _ in done], sum(len(p) for p in job.prompts), max(n for _, _, n in done))
            if not job.cancelled:
                job.deliver(("done", answer))
        log.info(
            "batch: %d request%s, %d sequence%s, %d tokens, NFE %d, %.1f rows per step, %.2f s, %.1f tokens/s",
            len(batch), "" if len(batch) == 1 else "s", len(rows), "" if len(rows) == 1 else "s",
            tokens, out.nfe, row_steps / max(steps, 1), seconds, tokens / seconds if seconds > 0 else 0.0,
        )  # fmt: skip

    def _stream(self, info, rows: list[Row], spans_tokens: torch.Tensor, spans: list[int]) -> None:
        """Send each streamed row the text its final prefix adds: its committed tokens within ``spans`` (a masked
        process never changes them; the edit process's are final before the current block)."""
        eos, mask = set(self.model.eos_ids), self.model.mask_id
        for row, tokens, length in zip(rows, spans_tokens.tolist(), spans):
            if row.job.cancelled:
                continue
            ids = []
            for t in tokens[:length]:
                if t == mask or t in eos:
                    break
                ids.append(t)
            text = self.model.tokenizer.decode(ids, skip_special_tokens=True)
            shown, stopped = cut(text, row.job.stop)
            if not stopped and row.job.stop:  # a stop string may be starting at the end: hold it back
                shown = shown[: len(shown) - (max(len(s) for s in row.job.stop) - 1)]
            shown = shown.rstrip("\ufffd")  # an incomplete character
            sent = row.job.sent.get(row.choice, "")
            if len(shown) > len(sent) and shown.startswith(sent):
                row.job.sent[row.choice] = shown
                row.job.deliver(("delta", row.choice, shown[len(sent) :]))


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to its first stop string (OpenAI's ``stop``), and whether one was found."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)
