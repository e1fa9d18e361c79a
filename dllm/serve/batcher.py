"""Batching: the requests that wait are decoded together, each row exactly as if it were alone.

One thread owns the model and runs one batch at a time; requests that arrive meanwhile wait in a bounded queue
(``max_queue`` requests; past it, 503). When the thread is free it takes the oldest waiting request, waits at most
``max_wait`` seconds (from that request's arrival, or from the end of the last batch if later) for others to
join, and decodes it together with the waiting requests whose settings match it (sampler, generation settings:
:attr:`Job.key`; each row draws from its own request's seed, and decodes its own request's ``max_tokens`` where the
lengths' block grids agree and its own temperature: ``generate(max_new_tokens=[...], temperature=[...])``), oldest
first, up to ``max_batch_size`` sequences. While it decodes, the requests that arrive with its settings join its rows
between two steps (continuous batching: :mod:`dllm.engine.join`, where the sampler and cache allow it), up to
``max_batch_size`` rows, and each request is answered as soon as its own rows are done; a request of other settings
(or one that does not fit the running canvas) keeps its place, and once it has waited ``max_wait`` no other joins: it
goes next when the running rows are done. ``joins=False`` (``--no-joins``): a batch runs to its end.

The guarantee: a request's answer (its tokens and its NFE) is what ``sampler.generate`` gives for its prompt alone,
whatever else shares its batch. It rests on dllm's batch invariance (left padding changes nothing; a row's random
draws are keyed by ``(seed, key, step, column)``, never by its index): the server keys each row as generate()
would alone (``n`` samples of a prompt are its occurrences 0..n-1, as ``generate([prompt] * n, seed=S)``) under
its request's seed (the Philox key of its row: ``generate(seed=[...])``). A request without a seed draws a fresh
one. A row's NFE is the forwards it takes alone (``Decoding.row_nfe``: the steps it works in, and of a sampler's own
forwards those that serve it), what generate() alone makes.

Faults: a batch that raises is decoded again one request at a time, so only the request that fails gets the
error. A request whose client went away is dropped from the queue; if it is already decoding, its rows finish
with the batch (the other rows are not disturbed) and the answer is discarded.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time

import torch

from dllm.core.errors import ConfigError, DllmError, LengthError
from dllm.core.rng import CounterRNG
from dllm.engine import session
from dllm.engine.join import fits, widened
from dllm.engine.join import why_not as why_not_joined
from dllm.engine.session import PROCESSES, Decoding, takes_row_eos, takes_row_temperatures
from dllm.serve.protocol import Answer, ApiError, Choice, Job, Settings, bad

log = logging.getLogger("dllm.serve")
SEEN = 64  # the latest requests of a setting whose widest prompt and longest length size a batch that rows may join


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
        self,
        model,
        options: dict,
        *,
        max_batch_size: int,
        max_wait: float,
        max_queue: int,
        metrics,
        mixed_batches=True,
        joins=True,
    ):
        self.model, self.options, self.metrics, self.mixed_batches = model, dict(options), metrics, mixed_batches
        self.joins = joins and mixed_batches
        self.seen: dict[str, collections.deque] = {}  # settings -> (prompt tokens, length) of their latest requests
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
        # temperatures (generate(temperature=[...])) unless the sampler reads it beyond its scores; of other EOS rules
        # (generate(eos_early_stop=[...])) unless the sampler or its process reads one for the batch; of other values
        # of the sampler's per-row hyper-parameters (generate(hyper_parameters=[...]): threshold's threshold)
        job.length = geometry.max_new_tokens
        mixed, template = self.mixed_batches, job.generation.get("template") is not None
        length = geometry.grid if mixed and job.sampler.per_row_lengths and not template else job.length
        temperature = None if mixed and takes_row_temperatures(job.sampler) else job.generation.get("temperature", 0.0)
        eos = None if mixed and takes_row_eos(job.sampler) else job.generation.get("eos_early_stop")
        key = job.row_key if mixed and job.row_hyper and not template else job.key  # (each row its thresholds)
        job.key = json.dumps([key, length, temperature, eos])

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
            self.seen.setdefault(job.key, collections.deque(maxlen=SEEN)).append(
                (max(len(p) for p in job.prompts), job.length or 0)
            )
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

    def _run(self, batch: list[Job], joins: bool = True) -> None:
        try:
            self._decode(batch, joins)
        except Exception as error:  # noqa: BLE001 - a request's fault must not end the server
            if len(batch) > 1:  # find the request that fails: each alone (the others' answers are the same)
                for job in batch:
                    self._run([job], joins=False)
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

    def _arguments(self, job: Job, seed) -> dict:
        return {**job.generation, **self.options, "seed": seed}

    def _rows(self, batch: list[Job]) -> tuple[list[Row], list[int]]:
        """The batch's rows (each request's prompts, ``n`` times each) and each row's seed (fresh numbers for a request
        that asks none)."""
        rows = [Row(job, i * job.n + j, p, j) for job in batch for i, p in enumerate(job.prompts) for j in range(job.n)]
        fresh = {id(job): int.from_bytes(os.urandom(7), "little") for job in batch if job.seed is None}
        return rows, [fresh.get(id(row.job), row.job.seed) for row in rows]

    def _prepare(self, batch: list[Job], rows: list[Row], seed: list[int], sampler=None):
        """The run of ``rows`` by ``sampler`` (default: the first request's): each row its request's length,
        temperature, EOS rule, per-row hyper-parameters, seed and key."""
        first = batch[0]
        sampler = sampler or first.sampler
        arguments = self._arguments(first, seed)
        if len({row.job.length for row in rows}) > 1:  # each row its own request's length
            arguments["max_new_tokens"] = [row.job.length for row in rows]
        temperatures = [row.job.generation.get("temperature", 0.0) for row in rows]
        if len(set(temperatures)) > 1:  # and temperature
            arguments["temperature"] = temperatures
        stops = [row.job.generation.get("eos_early_stop") for row in rows]
        if len(set(stops)) > 1:  # and EOS rule (None: the sampler's own)
            arguments["eos_early_stop"] = stops
        own = {f: getattr(sampler, f) for f in getattr(sampler, "per_row_fields", ())}
        if any(row.job.row_hyper != own for row in rows):  # and hyper-parameters (threshold's, ...)
            arguments["hyper_parameters"] = [row.job.row_hyper for row in rows]
        run = sampler.prepare(self.model, [row.prompt for row in rows], **arguments)
        run.rng = CounterRNG(seed, [row.key for row in rows])
        return run

    @staticmethod
    def _answer_columns(run) -> torch.Tensor:
        """[B] each row's answer columns: its span, or the first max_new_tokens of it (a block-aligned span's tail
        dropped)."""
        canvas = run.canvas
        answer = canvas.valid[:, canvas.prompt_width :].sum(1)
        return answer if run.answer_width is None else answer.clamp(max=run.answer_width)

    def _decode(self, batch: list[Job], joins: bool = True) -> None:
        started = time.perf_counter()
        rows, seed = self._rows(batch)
        first = batch[0]
        run = self._prepare(batch, rows, seed)  # (prepared once, whichever way it decodes)
        if joins and self.joins and why_not_joined(run, first.sampler) is None:
            return self._decode_joining(batch, rows, run, started)
        canvas = run.canvas
        streamed = [r for r, row in enumerate(rows) if row.job.stream]
        spans: list[int] = []

        rewrites = PROCESSES.get(first.sampler.process).rewrites_current_block

        working = torch.ones(len(rows), dtype=torch.bool, device=self.model.device)  # rows decoding at the next step
        row_steps, steps = torch.zeros((), dtype=torch.long, device=self.model.device), 0

        def on_step(info):
            nonlocal working, row_steps, steps
            row_steps, steps = row_steps + working.sum(), steps + 1  # (on the device: read once, at the end)
            working = ~info.done
            if streamed:
                final = _final(canvas, streamed, info.block, info.done, spans) if rewrites else spans
                self._stream([rows[r] for r in streamed], info.tokens[streamed, info.prompt_width :], final)

        run.callback = on_step
        answer = self._answer_columns(run)
        spans[:] = answer[streamed].tolist() if streamed else []
        with torch.inference_mode():  # (each row's NFE: the forwards it takes alone)
            nfe = session.decode(run, first.sampler, count_rows=True).tolist()
        out = first.sampler.finish(run)
        answers: dict[int, list] = {id(job): [] for job in batch}
        for r, (row, choice) in enumerate(zip(rows, self._choices(out, rows, answer.tolist()))):
            answers[id(row.job)].append((row.choice, choice, nfe[r]))
        seconds, tokens = time.perf_counter() - started, out.total_tokens
        self.metrics.batch(len(batch), len(rows), tokens, out.nfe, seconds, steps, int(row_steps))  # before any
        for job in batch:  # answer: a client that reads /metrics right after its answer sees its batch counted
            self._answer(job, answers[id(job)])
        self._log(len(batch), len(rows), tokens, out.nfe, steps, int(row_steps), seconds)

    def _choices(self, out, rows: list[Row], lengths: list[int]) -> list[Choice]:
        """Each row's :class:`Choice` from the generation ``out`` of those rows (their answer columns ``lengths``)."""
        generated = out.sequences[:, out.prompt_width :].tolist()
        eos, choices = set(self.model.eos_ids), []
        for r, row in enumerate(rows):
            ended = any(t in eos for t in generated[r][: lengths[r]])
            text, stopped = cut(out.texts[r], row.job.stop)
            choices.append(Choice(text, "stop" if ended or stopped else "length", int(out.tokens[r])))
        return choices

    @staticmethod
    def _answer(job: Job, done: list) -> None:
        """Deliver a request's answer from its rows' (choice, Choice, nfe), unless its client went away."""
        done = sorted(done, key=lambda item: item[0])
        answer = Answer([c for _, c, _ in done], sum(len(p) for p in job.prompts), max(n for _, _, n in done))
        if not job.cancelled:
            job.deliver(("done", answer))

    @staticmethod
    def _log(requests, sequences, tokens, nfe, steps, row_steps, seconds) -> None:
        log.info(
            "batch: %d request%s, %d sequence%s, %d tokens, NFE %d, %.1f rows per step, %.2f s, %.1f tokens/s",
            requests, "" if requests == 1 else "s", sequences, "" if sequences == 1 else "s",
            tokens, nfe, row_steps / max(steps, 1), seconds, tokens / seconds if seconds > 0 else 0.0,
        )  # fmt: skip

    def _decode_joining(self, batch: list[Job], rows: list[Row], run, started: float) -> None:
        """Decode ``run`` (of ``rows``) step by step: after each step the finished rows' requests are answered, and
        waiting requests of the same settings join the running rows (:meth:`_joining`), up to ``max_batch_size``
        rows, until no row works and none waits. Each row's answer, its NFE included (``Decoding.row_nfe``: the
        forwards it takes alone), is what generate() of its prompt alone gives."""
        first = batch[0]
        key, sampler, jobs = first.key, first.sampler, list(batch)
        rewrites = PROCESSES.get(sampler.process).rewrites_current_block
        run = widened(run, *self._room(run, key))  # room for the prompts and lengths of the rows that will join
        decoding = Decoding(run, sampler, count_rows=True, capacity=self.max_batch_size)
        answers: dict[int, list] = {id(job): [] for job in batch}
        left = {id(job): job.rows for job in batch}  # rows of each request still decoding
        spans = self._answer_columns(run).tolist()
        answered = [False] * len(rows)
        steps = row_steps = tokens = 0
        self.metrics.add(batches=1)  # (its other counts as they come: a client that reads /metrics after its
        try:  # answer sees its rows counted)
            with torch.inference_mode():
                while True:
                    working, forwards, clock = len(rows) - sum(answered), decoding.run.nfe, time.perf_counter()
                    running = decoding.step()
                    if running:
                        steps, row_steps = steps + 1, row_steps + working
                        self.metrics.add(steps=1, row_steps=working, forwards=decoding.run.nfe - forwards)
                    self.metrics.add(seconds=time.perf_counter() - clock)
                    done = decoding.process.done().tolist()
                    finished = [r for r, d in enumerate(done) if d and not answered[r]]
                    if finished:
                        out = session.result(decoding.run, torch.tensor(finished))
                        nfe = decoding.row_nfe.index_select(0, torch.tensor(finished, device=decoding.row_nfe.device))
                        choices = self._choices(out, [rows[r] for r in finished], [spans[r] for r in finished])
                        for r, choice, n in zip(finished, choices, nfe.tolist()):
                            answered[r], job = True, rows[r].job
                            answers[id(job)].append((rows[r].choice, choice, n))
                            tokens += choice.tokens
                            left[id(job)] -= 1
                            if left[id(job)] == 0:
                                done_rows = answers.pop(id(job))
                                self.metrics.add(sequences=job.rows, tokens=sum(c.tokens for _, c, _ in done_rows))
                                self._answer(job, done_rows)
                    streamed = [r for r, row in enumerate(rows) if row.job.stream and not answered[r]]
                    if streamed:
                        canvas, final = decoding.run.canvas, [spans[r] for r in streamed]
                        if rewrites:
                            process = decoding.process
                            final = _final(canvas, streamed, process.blocks(), process.done(), final)
                        tokens_now = canvas.tokens[streamed, canvas.prompt_width :]
                        self._stream([rows[r] for r in streamed], tokens_now, final)
                    joining = self._joining(key, len(rows) - sum(answered))
                    for job in joining:
                        jobs.append(job)
                        answers[id(job)], left[id(job)] = [], job.rows
                        new_rows, seed = self._rows([job])
                        new = self._prepare([job], new_rows, seed, sampler=sampler)
                        if all(answered):  # no row works: the new rows start the canvas, with room for others
                            new = widened(new, *self._room(new, key))
                        elif fits(decoding.run, new, sampler) is not None:  # next once the running rows are done
                            jobs.pop()
                            del answers[id(job)], left[id(job)]
                            self._requeue(joining[joining.index(job) :])
                            joining = joining[: joining.index(job)]
                            break
                        keep = decoding.join(new).tolist()
                        rows = [rows[i] for i in keep] + new_rows
                        spans = [spans[i] for i in keep] + self._answer_columns(decoding.run).tolist()[len(keep) :]
                        answered = [answered[i] for i in keep] + [False] * len(new_rows)
                    with self._cond:
                        self.running = len(rows) - sum(answered)
                    if not running and not joining:
                        break
            decoding.end()
        except Exception:  # the unanswered requests again, each alone and without joins (the faulty one fails alone)
            for job in jobs:
                if id(job) in answers:
                    self._run([job], joins=False)
            return
        seconds = time.perf_counter() - started
        self.metrics.add(tokens_per_second=tokens / seconds if seconds > 0 else 0.0)
        self._log(len(jobs), sum(job.rows for job in jobs), tokens, decoding.run.nfe, steps, row_steps, seconds)

    def _room(self, run, key: str) -> tuple[int, int]:
        """The canvas a batch that rows may join starts on (prompt columns, columns): wide enough for the widest prompt
        and the longest length of the latest requests of its settings (``SEEN``), so that the requests that come next
        are likely to fit, and no wider (padding costs compute where a batch costs by the row, on a CPU)."""
        canvas = run.canvas
        with self._cond:
            seen = list(self.seen.get(key, ()))
        prompt = max([canvas.prompt_width, *(p for p, _ in seen)])
        longest = max((g for _, g in seen), default=0) + canvas.block_size * run.geometry.aligned  # (block alignment)
        return prompt, prompt + max(canvas.length - canvas.prompt_width, longest)

    def _requeue(self, jobs: list[Job]) -> None:
        """Put ``jobs`` back in the queue, in the order of arrival (they did not fit the running canvas)."""
        with self._cond:
            self.queue = sorted(self.queue + [job for job in jobs if not job.cancelled], key=lambda job: job.arrived)

    def _joining(self, key: str, working: int) -> list[Job]:
        """The waiting requests that join the running rows now, oldest first: those of the running settings
        (``key``), up to ``max_batch_size`` rows. A request of other settings keeps its place; once it has waited
        ``max_wait``, the joining ends until the running rows are done and it goes next (no request waits behind
        newer ones for longer than the running rows take)."""
        joining, now = [], time.perf_counter()
        with self._cond:
            for job in self.queue:
                if job.key != key:
                    if now - job.arrived >= self.max_wait:
                        break
                    continue
                if working + job.rows > self.max_batch_size:
                    break
                joining.append(job)
                working += job.rows
            for job in joining:
                self.queue.remove(job)
        return joining

    def _stream(self, rows: list[Row], spans_tokens: torch.Tensor, spans: list[int]) -> None:
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


def _final(canvas, rows: list[int], blocks: torch.Tensor, done: torch.Tensor, spans: list[int]) -> list[int]:
    """Of ``rows``, whose process rewrites their current block (LLaDA2.1's edits, DiffusionGemma's canvas being
    denoised), the generated columns no later step changes: the blocks before the current one, or every one once the
    row is done; at most ``spans`` (of those rows). ``blocks``, ``done``: [B] every row's."""
    start = (canvas.first_block + blocks * canvas.block_size - canvas.prompt_width).clamp(min=0)
    final = torch.where(done, canvas.length, start)[rows].tolist()
    return [min(a, b) for a, b in zip(final, spans)]


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to its first stop string (OpenAI's ``stop``), and whether one was found."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)
