"""How much of a denoising step is *not* the model: ``python -m dllm.bench.overhead``.

For each model x sampler x batch size it runs one generation and reports
- ``step ms``: wall time per forward step of the loop (tokenisation and decoding excluded);
- ``forward ms``: the part spent inside the model's forward (the body and the LM head);
- ``outside %``: the rest (sampler, scoring, selection, bookkeeping), as a share of the step;
- ``syncs/step``: host synchronisations per step of the denoising loop (``dllm.core.loop.denoise``;
  prompt encoding and decoding excluded): operations that make the CPU wait for the device on CUDA
  (``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero``, boolean-mask indexing, ...), counted by
  intercepting them, so the count is the same on a CPU.

Models: the bundled tiny models (1.9 M parameters: there the forward is so small that the loop dominates)
and ``random-135m``, a randomly initialised LLaDA-architecture model of 135 M parameters with a 32,768-token
vocabulary, for the issue's target (loop + sampler <= 5 % of a step of a >= 100 M model on a CPU). Greedy,
one token per step for the reference samplers; EOS early stop off so every run takes the same steps.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dllm.core.errors import plural

# aten ops after which the host reads device memory (a CUDA stream sync). A Python read of one value
# (bool(t), t.item(), int(t)) shows as _local_scalar_dense, or as is_nonzero / item under inference_mode.
_SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.item",
    "aten.nonzero",
    "aten.equal",
    "aten.masked_select",
    "aten._unique2",
}
_MASK_INDEXED = {"aten.index", "aten.index_put_", "aten.index_put"}  # sync when an index is a bool mask


class SyncCounter(TorchDispatchMode):
    """Counts operations that force a device-to-host synchronisation on CUDA (on any device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _SYNC_OPS:
            self.count += 1
        elif name in _MASK_INDEXED:
            indices = args[1] if len(args) > 1 else ()
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter, original = self, torch.Tensor.tolist

        def tolist(tensor):
            counter.count += 1
            return original(tensor)

        self._tolist = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


@contextlib.contextmanager
def around_forward(model, around, names=("logits", "hidden", "head")):
    """Runs the model's forward entry points ``names`` inside ``around()`` (a context manager), the outermost
    call only: nested entry points count once."""
    depth = [0]
    patched = []
    for name in names:
        if not hasattr(model, name):
            continue
        original = getattr(model, name)

        def wrapped(*args, _original=original, **kwargs):
            if depth[0]:
                return _original(*args, **kwargs)
            depth[0] += 1
            try:
                with around():
                    return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(model, name, wrapped)
        patched.append(name)
    try:
        yield
    finally:
        for name in patched:
            delattr(model, name)


@contextlib.contextmanager
def forward_timer(model):
    """Times the model's forward entry points (nested calls count once); yields a dict with ``seconds``."""
    total = {"seconds": 0.0}

    @contextlib.contextmanager
    def timed():
        start = time.perf_counter()
        try:
            yield
        finally:
            total["seconds"] += time.perf_counter() - start

    with around_forward(model, timed):
        yield total


@contextlib.contextmanager
def forward_events(model):
    """Brackets each of the model's forwards with CUDA events on the current stream (no synchronisation inside
    the run); yields a callable giving their summed device time in seconds, read once the device is
    synchronised. The rest of a generation's device time is the loop's: scoring, selection, bookkeeping, and
    the device waiting for the host."""
    pairs = []

    @contextlib.contextmanager
    def recorded():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            pairs.append((start, end))

    with around_forward(model, recorded):
        yield lambda: sum(start.elapsed_time(end) for start, end in pairs) / 1000


@contextlib.contextmanager
def loop_syncs():
    """Counts the host synchronisations made inside the denoising loop only (``denoise`` as the samplers
    call it); yields the counter."""
    from dllm.samplers import base

    counter, original = SyncCounter(), base.denoise

    def counted(*args, **kwargs):
        with counter:
            return original(*args, **kwargs)

    base.denoise = counted
    try:
        yield counter
    finally:
        base.denoise = original


def random_llada(vocab: int = 32768, hidden: int = 768, layers: int = 12, intermediate: int = 2048):
    """A randomly initialised LLaDA-architecture model (no tokenizer): 135 M parameters by default."""
    from dllm.models.loading import build
    from dllm.models.saving import random_init_
    from dllm.models.tiny import tiny_config

    config = tiny_config(
        "llada", vocab, layers=layers, hidden=hidden, heads=12, kv_heads=12, intermediate=intermediate, max_length=4096
    )
    model = build(config)
    random_init_(model, std=0.02, seed=0)
    return model.eval()


def _workload(name: str, batch: int, seed: int = 0):
    """(model, prompts, generation length, block size) of one benchmark model."""
    import dllm

    if name == "random-135m":
        model = random_llada()
        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(5, model.vocab_size, (batch, 64), generator=g)
        return model, prompts, 32, 8
    from dllm.bench import tasks

    model = dllm.load(name, device="cpu", dtype=torch.float32)
    task = tasks.get("arith")
    prompts = [e.prompt for e in task.examples("test", batch, seed=seed)]
    return model, prompts, task.max_new_tokens, 8


def measure(model, sampler, prompts, max_new_tokens: int, block_size: int) -> dict:
    """One warm-up and one timed generation, then one under the sync counter."""
    kwargs = {"max_new_tokens": max_new_tokens, "eos_early_stop": False}
    if model.attention != "block":
        kwargs["block_size"] = block_size
    with torch.inference_mode():
        sampler.generate(model, prompts, **kwargs)
        steps = []
        with forward_timer(model) as timer:
            start = time.perf_counter()
            out = sampler.generate(model, prompts, callback=lambda info: steps.append(info.iteration), **kwargs)
            seconds = time.perf_counter() - start
        with loop_syncs() as syncs:
            sampler.generate(model, prompts, **kwargs)
    n = len(steps)
    return {
        "steps": n,
        "nfe": out.nfe,
        "step_ms": 1000 * seconds / n,
        "forward_ms": 1000 * timer["seconds"] / n,
        "outside": 1 - timer["seconds"] / seconds,
        "syncs_per_step": syncs.count / n,
    }


def main(argv=None) -> None:
    import dllm

    parser = argparse.ArgumentParser(prog="python -m dllm.bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny-llada,tiny-dream,tiny-sdar,random-135m")
    parser.add_argument("--samplers", default="reference,threshold", help="'reference' = the family's own")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = plural(torch.get_num_threads(), "thread")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {threads}")
    print("| model | sampler | batch | steps | step ms | forward ms | outside % | syncs/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            model, prompts, g, bs = _workload(name, batch)
            for sampler_name in args.samplers.split(","):
                if sampler_name == "reference":
                    sampler = dllm.samplers.reference(model.family)
                else:
                    sampler = dllm.samplers.get(sampler_name)
                r = measure(model, sampler, prompts, g, bs)
                print(
                    f"| {name} | {sampler.name} | {batch} | {r['steps']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} "
                    f"| {100 * r['outside']:.1f} | {r['syncs_per_step']:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
