"""GPU speed against the physical limit: ``python -m dllm.bench.speed``.

LLaDA-8B-shaped and Dream-7B-shaped models with random weights in bfloat16 (the published shapes, built on
the device directly, nothing downloaded), prompt 512, generation 256, block 32, batch 1 / 8 / 32, under no
cache and the prefix, dual, dKV and window caches, for two settings:

- ``threshold``: Fast-dLLM's confidence threshold (0.9). Random weights are never confident, so it commits one
  token per forward (the progress rule): tokens/s is then the forward rate.
- ``fixed-4``: LLaDA's fixed schedule (low-confidence remasking) with ``steps = G / 4``: four tokens per forward,
  so tokens/s reflects parallel decoding.

Reported per row: ms per forward (wall time of the generation / forwards), tokens/s (every generated slot of
every row per second: random weights may emit EOS anywhere, so the up-to-EOS count of ``Generation.tokens``
would understate the work), tokens per forward (per sequence), ``in model %`` (the share of the generation's
wall time spent in the model's forwards: on a GPU their device time between CUDA events, on the CPU their host
time; the rest is the loop's: scoring, selection, bookkeeping, and the device waiting for the host; ``-`` for a
compiled forward, which the timer does not see), peak GPU memory (weights included). Beside
them, the roofline of the same shape and batch (``research/caches_kernels.md`` §12): a forward costs at least
``max(weight bytes / HBM bandwidth, 2 x body parameters x query tokens / peak bf16 FLOP/s)``; the rows give it
for a full-canvas forward (no cache) and a block-wide forward (a dual-cache step), and the tokens/s bound
``batch x TPF / that time``. Device figures are the vendors' datasheet values (dense bf16, HBM); an unknown
GPU needs ``--bandwidth`` and ``--flops``.

Results go to ``eval/results/gpu/speed-<device>[-<shape>][-b<batches>].md`` (and ``.json``) when run on a GPU.
On an H100 one shape and batch size fits a 10-minute job (batch 32 without a cache is the longest: ~250
full-canvas forwards of 32 x 768 tokens), e.g. ``--shapes llada-8b --batch-sizes 32``. Without one the
benchmark says so and exits 0; ``--device cpu --small`` runs scaled-down shapes in a few seconds (a smoke test
of the same code path).

The official Fast-dLLM dual cache on the same weights and tokens (its code is never committed here):
``eval/gpu/official_fastdllm.py`` builds the official model from this benchmark's weights in memory and times
both; the prepared GPU check, ``eval/gpu/check.sh``, runs it. ``--export DIR`` instead writes each shape's random
model in the published checkpoint layout (``DIR/<shape>``, which the official modeling code loads) and the
prompts of each batch size (``DIR/prompts-<shape>-b<batch>.pt``, token ids), then exits, for timing the official
code elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch

from dllm.bench.overhead import forward_events, forward_timer
from dllm.core.errors import ConfigError
from dllm.core.settings import option_list, option_sizes

RESULTS = Path("eval/results/gpu")
PROMPT, GENERATION, BLOCK, BATCHES = 512, 256, 32, (1, 8, 32)
CACHES = ("none", "prefix", "dual", "dkv", "window")
SETTINGS = ("threshold", "fixed-4")

# The published shapes: LLaDA-8B (GSAI-ML/LLaDA-8B-Instruct config.json) and Dream-7B (Dream-org/Dream-v0-
# Instruct-7B, a Qwen2.5-7B body). ``small``: the same families scaled down for the CPU smoke test.
SHAPES = {
    "llada-8b": dict(family="llada", vocab=126464, layers=32, hidden=4096, heads=32, kv_heads=32,
                     intermediate=12288, theta=500000.0),
    "dream-7b": dict(family="dream", vocab=152064, layers=28, hidden=3584, heads=28, kv_heads=4,
                     intermediate=18944, theta=1000000.0),
}  # fmt: skip
SMALL = {
    "llada-8b": dict(family="llada", vocab=1024, layers=2, hidden=64, heads=4, kv_heads=4, intermediate=128,
                     theta=500000.0),
    "dream-7b": dict(family="dream", vocab=1024, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                     theta=1000000.0),
}  # fmt: skip
SMALL_RUN = dict(prompt=32, generation=16, block=8, batches=(1, 2))

# Datasheet figures: HBM bandwidth (bytes/s) and dense bf16 peak (FLOP/s), matched on the device name.
DEVICES = [
    (r"H200", 4.8e12, 989e12),
    (r"H100.*PCIe", 2.0e12, 756e12),
    (r"H100", 3.35e12, 989e12),
    (r"A100.*80GB", 2.04e12, 312e12),
    (r"A100", 1.56e12, 312e12),
    (r"L40S", 0.864e12, 362e12),
]
# dKV-Cache's README reloading steps (8 for LLaDA, 4 for Dream's cache_steps)
DKV_STEP = {"llada": 8, "dream": 4}


@dataclasses.dataclass
class Row:
    shape: str
    setting: str
    cache: str
    batch: int
    forwards: int
    ms_per_forward: float
    tokens_per_s: float
    tokens_per_forward: float
    peak_gib: float | None
    model_share: float | None = None


def config_of(shape: dict) -> dict:
    """The official config (field names of the family) of ``shape``: the tiny-config machinery, real sizes."""
    from dllm.models.tiny import tiny_config

    config = tiny_config(
        shape["family"],
        shape["vocab"],
        layers=shape["layers"],
        hidden=shape["hidden"],
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        intermediate=shape["intermediate"],
        max_length=4096,
    )
    if shape.get("theta") is not None:
        config["rope_theta"] = shape["theta"]
    for key, value in shape.get("config", {}).items():  # a family's own published fields (nested dicts merged)
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    return config


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight model of ``shape``, allocated on ``device`` in ``dtype`` directly (built on the meta
    device: no full-precision copy on the host); normal(0, 0.02) weights, RMSNorm scales 1."""
    from dllm.models.layers import RMSNorm
    from dllm.models.loading import build, on_meta

    config = config_of(shape)
    with on_meta():
        model = build(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in norms:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    model = model.eval().requires_grad_(False)
    model.prepare()
    return model


def device_limits(name: str, bandwidth: float | None, flops: float | None) -> tuple[float, float] | None:
    """(HBM bytes/s, bf16 FLOP/s) of the device ``name`` (overrides win); None when unknown."""
    for pattern, bw, fl in DEVICES:
        if re.search(pattern, name):
            return bandwidth or bw, flops or fl
    return (bandwidth, flops) if bandwidth and flops else None


def roofline_ms(model, batch: int, query_tokens: int, limits: tuple[float, float]) -> float:
    """The least time of one forward: the weights read once (the embedding excluded: only its rows are
    gathered) or the body's matrix products over ``batch x query_tokens`` tokens, whichever is longer."""
    bandwidth, flops = limits
    embedding = model.embedding.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    tied = model.output is None
    weights = (total - (0 if tied else embedding)) * model.dtype.itemsize
    body = total - embedding - (0 if tied else model.output.weight.numel())
    return 1000 * max(weights / bandwidth, 2 * body * batch * query_tokens / flops)


def _sampler(setting: str, generation: int):
    import dllm

    if setting == "threshold":
        return dllm.samplers.get("threshold"), {}
    if setting == "fixed-4":
        return dllm.samplers.get("llada"), {"steps": generation // 4}
    raise ConfigError(f"--settings: unknown {setting!r}; choose from {', '.join(SETTINGS)}")


def _cache(name: str, family: str):
    import dllm

    return dllm.caches.get(name, **({"cache_reloading_step": DKV_STEP[family]} if name == "dkv" else {}))


def measure(model, setting, cache, prompts, generation: int, block: int, compile_model: bool | str = False) -> dict:
    """One warm-up generation (one block; compiled: the whole generation, so that the timed run compiles
    nothing), then one timed generation (the device synchronised around it)."""
    sampler, extra = _sampler(setting, generation)
    kwargs = {"max_new_tokens": generation, "block_size": block, "eos_early_stop": False, **extra}
    warm = {**kwargs, "max_new_tokens": block, **_sampler(setting, block)[1]}  # one block
    if compile_model:  # the warm-up compiles every shape the timed run meets: the same generation
        kwargs["compile"] = compile_model  # True, or a generate(compile=) value such as "reduce-overhead"
        warm = kwargs
    cuda = prompts.device.type == "cuda"
    with torch.inference_mode():
        sampler.generate(model, prompts, cache=_cache(cache, model.family), **warm)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with (forward_events if cuda else forward_timer)(model) as in_model:
            start = time.perf_counter()
            out = sampler.generate(model, prompts, cache=_cache(cache, model.family), **kwargs)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        model_seconds = in_model() if cuda else in_model["seconds"]
    batch = prompts.shape[0]
    return {
        "forwards": out.nfe,
        "ms_per_forward": 1000 * seconds / out.nfe,
        "tokens_per_s": batch * generation / seconds,
        "tokens_per_forward": generation / out.nfe,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        # a compiled forward runs the function compiled before the timer wrapped the model: not seen
        "model_share": None if compile_model else model_seconds / seconds,
    }


def table(rows: list[Row], roof: list[tuple]) -> str:
    lines = [
        "| shape | setting | cache | batch | forwards | ms / forward | tokens/s | tokens / forward | in model % "
        "| peak GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peak = "-" if r.peak_gib is None else f"{r.peak_gib:.1f}"
        share = "-" if r.model_share is None else f"{100 * r.model_share:.1f}"
        lines.append(
            f"| {r.shape} | {r.setting} | {r.cache} | {r.batch} | {r.forwards} | {r.ms_per_forward:.2f} "
            f"| {r.tokens_per_s:.1f} | {r.tokens_per_forward:.2f} | {share} | {peak} |"
        )
    for shape, what, batch, ms, tpf in roof:
        lines.append(
            f"| {shape} | roofline | {what} | {batch} | | {ms:.2f} | {batch * tpf / ms * 1000:.1f} | {tpf} | | |"
        )
    return "\n".join(lines)


def prompts_of(batch: int, length: int, vocab: int) -> torch.Tensor:
    """The benchmark's prompts at ``batch``: random token ids (fixed seed per batch size) on the CPU."""
    g = torch.Generator(device="cpu").manual_seed(batch)
    return torch.randint(5, vocab, (batch, length), generator=g)


def export(args) -> int:
    """``--export DIR``: each shape's random model (bfloat16, the published layout) and each batch size's prompts,
    for the official code to run on the same weights and tokens."""
    from dllm.models.saving import save

    shapes = SMALL if args.small else SHAPES
    prompt = SMALL_RUN["prompt"] if args.small else PROMPT
    batches = option_sizes("--batch-sizes", args.batch_sizes) if args.batch_sizes else (
        SMALL_RUN["batches"] if args.small else BATCHES)  # fmt: skip
    folder = Path(args.export)
    for shape_name in option_list("--shapes", args.shapes, list(shapes)):
        model = build_model(shapes[shape_name], torch.device("cpu"), torch.bfloat16)
        save(model, folder / shape_name, max_shard_tensors=64)
        for batch in batches:
            torch.save(prompts_of(batch, prompt, model.vocab_size), folder / f"prompts-{shape_name}-b{batch}.pt")
        print(f"wrote {folder / shape_name} and its prompts (batch {', '.join(map(str, batches))})")
        del model
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm.bench.speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --small: the smoke test)")
    parser.add_argument("--small", action="store_true", help="scaled-down shapes, prompt 32, generation 16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--batch-sizes", default=None, help="default 1,8,32 (--small: 1,2)")
    parser.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        metavar="MODE",
        help="generate(compile=): alone True (inductor); reduce-overhead: CUDA graphs (static shapes)",
    )
    parser.add_argument("--bandwidth", type=float, default=None, help="HBM bytes/s (unknown GPUs)")
    parser.add_argument("--flops", type=float, default=None, help="dense bf16 FLOP/s (unknown GPUs)")
    parser.add_argument("--out", default=None, help=f"results folder (default on a GPU: {RESULTS})")
    parser.add_argument(
        "--export",
        default=None,
        metavar="DIR",
        help="write the random models (published checkpoint layout) and prompts to DIR for the official code, "
        "then exit",
    )
    args = parser.parse_args(argv)
    from dllm.core.commands import exit_status

    return exit_status(parser.prog, lambda: run(args, argv))


def check_options(args) -> None:
    """Every option's value, before a model is built (minutes for the full shapes): ConfigErrors naming it."""
    import dllm

    option_list("--shapes", args.shapes, list(SMALL if args.small else SHAPES))
    option_list("--caches", args.caches, ["none", *dllm.caches.names()])
    option_list("--settings", args.settings, list(SETTINGS))
    if args.batch_sizes is not None:
        option_sizes("--batch-sizes", args.batch_sizes)
    if not args.small and not args.export and torch.device(args.device).type != "cuda":
        raise ConfigError(
            f"--device {args.device} without --small builds the full LLaDA-8B / Dream-7B shapes there (16 GB of "
            "weights each, hours per row): add --small for the CPU smoke test, or run it on a GPU"
        )


def run(args, argv=None) -> int:
    check_options(args)
    if args.export:
        return export(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "dllm.bench.speed: no CUDA GPU here, nothing measured. Run it on a GPU machine, or "
            "`python -m dllm.bench.speed --device cpu --small` for the CPU smoke test."
        )
        return 0
    device = torch.device(args.device)
    shapes = SMALL if args.small else SHAPES
    prompt, generation, block = (SMALL_RUN["prompt"], SMALL_RUN["generation"], SMALL_RUN["block"]) if args.small else (
        PROMPT, GENERATION, BLOCK)  # fmt: skip
    batches = SMALL_RUN["batches"] if args.small else BATCHES
    if args.batch_sizes:
        batches = option_sizes("--batch-sizes", args.batch_sizes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    limits = device_limits(name, args.bandwidth, args.flops)  # (the CPU: only when both are given)
    print(f"device: {name}; torch {torch.__version__}; prompt {prompt}, generation {generation}, block {block}")
    rows, roof = [], []
    for shape_name in option_list("--shapes", args.shapes, list(shapes)):
        model = build_model(shapes[shape_name], device, torch.bfloat16)
        for batch in batches:
            prompts = prompts_of(batch, prompt, model.vocab_size).to(device)
            for setting in option_list("--settings", args.settings):
                for cache in option_list("--caches", args.caches):
                    r = measure(model, setting, cache, prompts, generation, block, args.compile)
                    rows.append(Row(shape_name, setting, cache, batch, **r))
                    print(table(rows[-1:], []).splitlines()[-1], file=sys.stderr, flush=True)
            if limits is not None:
                for what, width in (("full canvas", prompt + generation), (f"block-{block} step", block)):
                    ms = roofline_ms(model, batch, width, limits)
                    roof += [(shape_name, f"{what}, TPF {tpf}", batch, ms, tpf) for tpf in (1, 4)]
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = table(rows, roof)
    print(text)
    out = args.out or (str(RESULTS) if device.type == "cuda" else None)
    if out:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() + ("-small" if args.small else "")
        if args.shapes != ",".join(SHAPES):
            slug += "-" + args.shapes.replace(",", "-")
        if args.batch_sizes:
            slug += "-b" + args.batch_sizes.replace(",", "-")
        for given, default in ((args.caches, CACHES), (args.settings, SETTINGS)):  # a subset: its own file
            if given != ",".join(default):
                slug += "-" + given.replace(",", "-")
        if args.compile:
            slug += "-compiled" + ("" if args.compile is True else f"-{args.compile}")
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        header = f"# dllm.bench.speed on {name}\n\n`python -m dllm.bench.speed {' '.join(argv or sys.argv[1:])}`\n\n"
        (folder / f"speed-{slug}.md").write_text(header + text + "\n")
        payload = {"device": name, "torch": torch.__version__, "rows": [dataclasses.asdict(r) for r in rows]}
        payload["roofline"] = [dict(zip(("shape", "what", "batch", "ms", "tpf"), r)) for r in roof]
        (folder / f"speed-{slug}.json").write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {folder / f'speed-{slug}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
