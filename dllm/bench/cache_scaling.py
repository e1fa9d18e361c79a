"""Seconds per generated token of each cache on a LLaDA-shaped model with random weights.

``python -m dllm.bench.cache_scaling --d-model 1024 --layers 8 --prompt 512 --gen 256 --batch 1,8``

For every (batch size, cache) it builds the canvas from random prompt tokens, runs one untimed generation
(warm-up), then ``--repeats`` timed ones, and reports the median seconds per generated token (wall time of
``generate`` / (batch x gen), the whole span decoded: no EOS stop), the forwards (NFE), and on CUDA the
peak memory allocated during the timed runs. Random weights make the threshold sampler commit about one
token per step, so every cache runs the same number of forwards and the figures compare the forwards'
cost. Writes a Markdown table (stdout and ``--out``) and one JSON line per measurement (``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build_model(args):
    from dllm.models.loading import build
    from dllm.models.saving import random_init_
    from dllm.models.tiny import tiny_config

    config = tiny_config(
        "llada",
        args.vocab,
        layers=args.layers,
        hidden=args.d_model,
        heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        max_length=args.prompt + args.gen,
        intermediate=args.mlp,
    )
    model = build(config)
    random_init_(model, std=args.std, seed=0, ones=lambda name: name.endswith("norm.weight"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    return model.to(device=args.device, dtype=dtype).eval()


def make_cache(spec: str):
    """``name`` or ``name:key=value:key=value`` ("none": no cache)."""
    import dllm
    from dllm.core.settings import parse_value

    name, *items = spec.split(":")
    hp = {k: parse_value(v) for k, _, v in (item.partition("=") for item in items)}
    return dllm.caches.get(name, **hp)


def measure(model, sampler, prompts, cache_spec: str, args) -> dict:
    def once():
        cache = make_cache(cache_spec)
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = sampler.generate(
            model, prompts, max_new_tokens=args.gen, block_size=args.block, eos_early_stop=False, cache=cache
        )
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, out

    once()  # warm-up
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, nfe = [], None
    for _ in range(args.repeats):
        seconds, out = once()
        times.append(seconds)
        nfe = out.nfe
    batch = prompts.shape[0]
    record = {
        "cache": cache_spec,
        "batch": batch,
        "prompt": args.prompt,
        "gen": args.gen,
        "block": args.block,
        "sampler": sampler.name,
        "nfe": nfe,
        "seconds": statistics.median(times),
        "seconds_per_token": statistics.median(times) / (batch * args.gen),
    }
    if args.device == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (LLaDA-8B has no GQA)")
    parser.add_argument("--mlp", type=int, default=None, help="MLP width (default 2 x d-model)")
    parser.add_argument("--vocab", type=int, default=126464, help="LLaDA's vocabulary size")
    parser.add_argument("--std", type=float, default=0.02, help="weight init std")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument(
        "--caches", default="none,prefix,dual,dkv:cache_reloading_step=8", help="names, with :key=value settings"
    )
    parser.add_argument("--sampler", default="threshold")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--json", default=None, help="append one JSON line per measurement here")
    args = parser.parse_args(argv)

    import dllm

    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    sampler = dllm.samplers.get(args.sampler)
    generator = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    head = (
        f"LLaDA-shaped random model: {params / 1e6:.1f} M parameters (d_model {args.d_model}, {args.layers} layers, "
        f"{args.heads} heads), {model.dtype}, {device_name}; prompt {args.prompt}, generation {args.gen}, block "
        f"{args.block}, sampler {args.sampler}, median of {args.repeats}\n\n"
        "| batch | cache | NFE | s / generated token | speedup vs none | peak memory (GiB) |\n"
        "|---|---|---|---|---|---|\n"
    )
    lines = [head]
    print(head, end="", flush=True)
    for batch in [int(b) for b in args.batch.split(",")]:
        low = 5  # above the special ids of the tiny tokenizer layout
        prompts = torch.randint(low, args.vocab, (batch, args.prompt), generator=generator).to(args.device)
        baseline = None
        for spec in args.caches.split(","):
            record = measure(model, sampler, prompts, spec, args)  # "none": no cache
            if spec == "none":
                baseline = record["seconds_per_token"]
            record["parameters"] = params
            record["device"] = device_name
            speedup = f"{baseline / record['seconds_per_token']:.2f}x" if baseline else ""
            memory = f"{record['peak_memory_gib']:.2f}" if "peak_memory_gib" in record else "n/a"
            per_token = f"{record['seconds_per_token']:.5f}"
            line = f"| {batch} | {spec} | {record['nfe']} | {per_token} | {speedup} | {memory} |\n"
            lines.append(line)
            print(line, end="", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
