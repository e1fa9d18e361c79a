"""Where a decoding step's time goes at the 8B shape: the model against the loop, eager and with CUDA graphs.

``python eval/gpu/profile_step.py [--device cuda|cpu] [--small] [--batch 1] [--cache dual] [--modes eager,captured]
[--out DIR]``

The random LLaDA-8B-shaped model and prompts of ``python -m dllm.bench.speed`` (bf16, prompt 512, block 32; two
blocks are generated: 64 forwards), Fast-dLLM's threshold rule with ``--cache``. For each mode (``eager``: the
per-step loop; ``device``: ``static_shapes=True``, each step on the device with one status read,
``dllm/engine/device.py``; ``captured``: ``compile="reduce-overhead"``, the whole device step one CUDA graph, after
a warm-up generation that compiles and records), one generation with CUDA events around the model's parts: the
decoder body (``Run.hidden``) and the LM head of the scored columns. Printed per forward: wall ms, the device ms
of the body and of the head, and the rest (the loop: scoring, selection, the cache's plan and bookkeeping, and
the device waiting for the host); a captured step is one graph, whose parts are not timed apart (wall ms only).
Eager and device: the device operations (kernels, copies, fills) one block launches, per forward and per layer.
Then, eager, one block under ``torch.profiler``: the kernels with the most device time and the host operations with
the most host time (``profile-<mode>.txt`` in ``--out``). The weight-read limit of a block-32 step is
``dllm.bench.speed.roofline_ms``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dllm  # noqa: E402
from dllm.bench import speed  # noqa: E402
from dllm.bench.overhead import around_forward  # noqa: E402


class Timer:
    """Device time (CUDA events; on the CPU, host time) of the calls made inside :meth:`part`, per part."""

    def __init__(self, cuda: bool):
        self.cuda, self.pairs = cuda, {}

    @contextlib.contextmanager
    def part(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                end.record()
            else:
                end = time.perf_counter()
            self.pairs.setdefault(name, []).append((start, end))

    def seconds(self, name: str) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.pairs.get(name, ())) / 1000
        return sum(b - a for a, b in self.pairs.get(name, ()))


def generate(model, prompts, cache, block, mode, timer=None, tokens=None):
    """One threshold generation of ``tokens`` (default two blocks); ``timer``: its parts timed."""
    sampler = dllm.samplers.get("threshold")
    kw = dict(max_new_tokens=tokens or 2 * block, block_size=block, eos_early_stop=False, cache=cache)
    kw.update({"eager": {}, "device": {"static_shapes": True}, "captured": {"compile": "reduce-overhead"}}[mode])
    run = sampler.prepare(model, prompts, **kw)
    if timer is not None and mode != "captured":  # (a captured step is one graph: its parts are not timed apart)
        hidden = run.hidden

        def timed(*args, **kwargs):
            with timer.part("body"):
                return hidden(*args, **kwargs)

        run.hidden = timed
    with torch.inference_mode():
        sampler.run(run)
    return sampler.finish(run)


def kernels_per_forward(model, prompts, cache, block, mode, sync) -> float | None:
    """The device kernels one block's generation launches, per forward (None without CUDA)."""
    if not torch.cuda.is_available() or prompts.device.type != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = generate(model, prompts, cache, block, mode, tokens=block)
        sync()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernels / out.nfe


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", default="dual")
    parser.add_argument("--modes", default="eager,device,captured")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / speed.RESULTS))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_step: no CUDA GPU here (`--device cpu --small`: the rehearsal).")
        return 0
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    shape = (speed.SMALL if args.small else speed.SHAPES)["llada-8b"]
    prompt, block = (speed.SMALL_RUN["prompt"], speed.SMALL_RUN["block"]) if args.small else (speed.PROMPT, speed.BLOCK)
    model = speed.build_model(shape, device, torch.bfloat16)
    layers = shape["layers"]
    prompts = speed.prompts_of(args.batch, prompt, model.vocab_size).to(device)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    limits = speed.device_limits(name, None, None)
    roof = speed.roofline_ms(model, args.batch, block, limits) if limits else None
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{name}; torch {torch.__version__}; batch {args.batch}, cache {args.cache}; weight-read limit {roof} ms")
    print("| mode | forwards | wall ms / forward | body ms | head ms | loop ms (rest) | loop % |", flush=True)
    rows = []
    for mode in args.modes.split(","):
        start = time.perf_counter()
        generate(model, prompts, args.cache, block, mode)  # warm-up (captured: compiles and records)
        sync()
        warm = time.perf_counter() - start
        timer = Timer(cuda)
        parts = contextlib.nullcontext()
        if mode != "captured":  # the scorer's LM head
            parts = around_forward(model, lambda timer=timer: timer.part("head"), names=("head",))
        with parts:
            sync()
            start = time.perf_counter()
            out = generate(model, prompts, args.cache, block, mode, timer)
            sync()
            wall = time.perf_counter() - start
        n = out.nfe
        body, head = timer.seconds("body") / n * 1000, timer.seconds("head") / n * 1000
        per = wall / n * 1000
        row = dict(mode=mode, forwards=n, wall_ms=per, body_ms=body, head_ms=head, loop_ms=per - body - head)
        row.update(warm_up_s=warm, on_device=out.step_on_device)
        if mode == "captured":
            row.update(body_ms=None, head_ms=None, loop_ms=None)
        rows.append(row)
        cells = [f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("body_ms", "head_ms", "loop_ms")]
        share = f"{100 * row['loop_ms'] / per:.1f}" if row["loop_ms"] is not None else "-"
        print(f"| {mode} | {n} | {per:.2f} | {' | '.join(cells)} | {share} |", flush=True)
        if mode != "captured":  # kernels launched per forward (the whole step: body, head and loop)
            row["kernels_per_forward"] = kernels_per_forward(model, prompts, args.cache, block, mode, sync)
            row["kernels_per_layer"] = row["kernels_per_forward"] and row["kernels_per_forward"] / layers
            print(f"{mode}: {row['kernels_per_forward']} kernels per forward ({layers} layers)", flush=True)
        if mode == "eager":  # which kernels and host operations
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if cuda else []
            with torch.profiler.profile(activities=activities) as prof:
                generate(model, prompts, args.cache, block, mode, tokens=block)
                sync()
            averages = prof.key_averages()
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            text = averages.table(sort_by=sort, row_limit=25, max_name_column_width=70)
            text += "\n\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
            (folder / f"profile-{mode}.txt").write_text(text)
            print(averages.table(sort_by=sort, row_limit=12, max_name_column_width=50), flush=True)
    payload = dict(device=name, torch=torch.__version__, batch=args.batch, cache=args.cache, roofline_ms=roof)
    (folder / f"profile-step-b{args.batch}.json").write_text(json.dumps(dict(payload, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
