"""How much of a denoising step is *not* the model: ``python -m dllm.bench.overhead``.

For each model x sampler x batch size it runs one generation and reports
- ``step ms``: wall time per forward step of the loop (tokenisation and decoding excluded);
- ``forward ms``: the part spent inside the model's forward (the body and the LM head);
- ``outside %``: the rest (sampler, scoring, selection, bookkeeping), as a share of the step;
- ``syncs/step``: host synchronisations per step of the decoding process (``dllm.engine.session.decode``;
  prompt encoding and decoding excluded): operations that make the CPU wait for the device on CUDA
  (``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero``, boolean-mask indexing, ...), counted by
  intercepting them (:class:`dllm.core.reads.HostReads`), so the count is the same on a CPU.

``--static-shapes`` measures the static-shape path, whose steps run on the device with one status read each
(:mod:`dllm.engine.device`) where the sampler and cache allow it.

Models: the bundled tiny models (1.9 M parameters: there the forward is so small that the loop dominates;
the default, about a minute in all) and ``random-135m``, a randomly initialised LLaDA-architecture model of
135 M parameters with a 32,768-token vocabulary, for the issue's target (loop + sampler <= 5 % of a step of a
>= 100 M model on a CPU): ``--models tiny-llada,tiny-dream,tiny-sdar,random-135m`` (as in
``eval/results/overhead.md``; at batch 16 each of its runs takes minutes on two CPU cores). A progress bar
counts the runs, and a model whose runs take long is announced with their expected duration, from the time of
its first (untimed warm-up) generation. Greedy, one token per step for the reference samplers; EOS early stop
off so every run takes the same steps.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time

import torch

from dllm.core.errors import ConfigError, plural
from dllm.core.reads import HostReads

SyncCounter = HostReads  # (the name this module gave it first)


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
    """Counts the host synchronisations made while a run is decoded only (:func:`dllm.engine.session.decode`: the
    steps of its decoding process); yields the counter."""
    from dllm.engine import session

    counter, original = HostReads(), session.decode

    def counted(*args, **kwargs):
        with counter:
            return original(*args, **kwargs)

    session.decode = counted
    try:
        yield counter
    finally:
        session.decode = original


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
    from dllm import tasks

    model = dllm.load(name, device="cpu", dtype=torch.float32)
    task = tasks.get("arith")
    prompts = [e.prompt for e in task.examples("test", batch, seed=seed)]
    return model, prompts, task.max_new_tokens, 8


def measure(
    model, sampler, prompts, max_new_tokens: int, block_size: int, warmed=lambda seconds: None, static=False
) -> dict:
    """One warm-up and one timed generation, then one under the sync counter; ``warmed(seconds)`` is told the
    warm-up's wall time (the expected duration of what follows). static: ``static_shapes=True``."""
    kwargs = {"max_new_tokens": max_new_tokens, "eos_early_stop": False, "static_shapes": static}
    if not model.attention.block_causal:  # (a block-causal model keeps its own)
        kwargs["block_size"] = block_size
    with torch.inference_mode():
        start = time.perf_counter()
        sampler.generate(model, prompts, **kwargs)
        warmed(time.perf_counter() - start)
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


QUICK = ("tiny-llada", "tiny-dream", "tiny-sdar")  # the default: about a minute on two CPU cores
RANDOM = "random-135m"
SAY_AFTER = 30.0  # seconds: a model's runs expected to take longer are announced with their duration


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dllm.bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(QUICK),
        help=f"bundled models, checkpoint directories or {RANDOM} (135 M parameters: minutes per run at batch 16 "
        f"on a CPU); default {','.join(QUICK)}",
    )
    parser.add_argument("--samplers", default="reference,threshold", help="'reference' = the family's own")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument(
        "--static-shapes", action="store_true", help="the static-shape path (its steps on the device, one read each)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> int:
    from dllm.core.commands import exit_status

    parser = command_line()
    args = parser.parse_args(argv)
    return exit_status(parser.prog, lambda: run(args))


def check_options(args) -> tuple[list[str], list[str], tuple[int, ...]]:
    """(models, samplers, batch sizes), each checked before anything runs: ConfigErrors naming the option."""
    from dllm.core.errors import DllmError
    from dllm.core.settings import option_list, option_sizes
    from dllm.models.loading import resolve
    from dllm.samplers.registry import canonical

    models = option_list("--models", args.models)
    for name in models:
        if name != RANDOM:
            try:
                resolve(name)
            except DllmError as e:
                raise ConfigError(f"--models: {e}; or {RANDOM} (a random 135 M-parameter LLaDA)") from None
    try:
        samplers = [s if s == "reference" else canonical(s) for s in option_list("--samplers", args.samplers)]
    except ConfigError as e:
        raise ConfigError(f"--samplers: {e}; or reference (each model family's own)") from None
    return models, samplers, option_sizes("--batch-sizes", args.batch_sizes)


def run(args) -> int:
    import sys

    from tqdm.auto import tqdm

    import dllm
    from dllm.core.commands import set_threads

    models, sampler_names, batches = check_options(args)
    set_threads(args.threads)
    threads = plural(torch.get_num_threads(), "thread")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {threads}")
    print("| model | sampler | batch | steps | step ms | forward ms | outside % | syncs/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    runs = len(models) * len(batches) * len(sampler_names)
    bar = tqdm(total=runs, unit="run", desc="dllm.bench.overhead", file=sys.stderr, disable=args.no_progress)
    with bar:
        for name in models:
            for batch in batches:
                model, prompts, g, bs = _workload(name, batch)

                def announce(seconds: float, name=name, batch=batch) -> None:
                    # a run is three generations, the warm-up one of them; the samplers cost alike at most
                    expected = 3 * seconds * len(sampler_names)
                    if expected > SAY_AFTER:
                        bar.write(f"{name} at batch {batch}: about {duration(expected)} for its runs", file=sys.stderr)

                for i, sampler_name in enumerate(sampler_names):
                    bar.set_postfix_str(f"{name} {sampler_name} batch {batch}")
                    if sampler_name == "reference":
                        sampler = dllm.samplers.reference(model.family)
                    else:
                        sampler = dllm.samplers.get(sampler_name)
                    warmed = announce if i == 0 else lambda seconds: None
                    r = measure(model, sampler, prompts, g, bs, warmed=warmed, static=args.static_shapes)
                    row = (
                        f"| {name} | {sampler.name} | {batch} | {r['steps']} | {r['step_ms']:.1f} "
                        f"| {r['forward_ms']:.1f} | {100 * r['outside']:.1f} | {r['syncs_per_step']:.1f} |"
                    )
                    bar.write(row, file=sys.stdout)
                    bar.update()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
