"""Time-boxed CPU variant of ``python -m dllm.bench.cache_scaling`` (the scaling table of scaling.md).

Same model (``dllm.bench.cache_scaling.build_model``: LLaDA-shaped, random weights, seed 0) and prompts
(random ids, ``torch.Generator().manual_seed(0)`` per batch size), but

- each (batch, cache) runs in its own subprocess, so that the process's peak resident set size
  (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is that configuration's peak memory on the CPU;
- the canvas is the full prompt + generation (``--gen``), but a generation is stopped (an exception from
  the per-step callback) once every row has ``--tokens`` committed tokens: seconds per generated token =
  wall time to that point / (batch x tokens). On the CPU a full 256-token generation of every
  configuration does not fit the time box; with ``--tokens`` a multiple of ``--block`` the measured part
  is whole blocks (each with its block-start full forward).
- one warm-up generation stopped at the first commit, then one timed run.

``python eval/results/caches/scaling_run.py --batch 1,8 --tokens 64,32 --json out.jsonl``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's dllm, not an installed one

CACHES = "none,prefix,dual,dkv:cache_reloading_step=8,window,elastic"


class Enough(Exception):
    pass


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--mlp", type=int, default=1536, help="MLP width (LLaDA-8B: 3 x d_model)")
    p.add_argument("--vocab", type=int, default=126464, help="LLaDA's vocabulary size")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--tokens", default="64,32", help="tokens measured per row, one per --batch entry")
    p.add_argument("--caches", default=CACHES)
    p.add_argument("--sampler", default="threshold")
    p.add_argument("--json", default=None, help="append one JSON line per measurement")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "batch/tokens/cache": run in this process
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    return p


def setup(args, batch: int):
    """The model and the prompts of a batch size (identical in every process)."""
    from dllm.bench.cache_scaling import build_model

    model = build_model(args)
    generator = torch.Generator().manual_seed(0)
    for b in [int(x) for x in args.batch.split(",")]:  # same draws as cache_scaling for this batch size
        prompts = torch.randint(5, args.vocab, (b, args.prompt), generator=generator)
        if b == batch:
            return model, prompts
    raise ValueError(batch)


def digest(span: torch.Tensor) -> str:
    return hashlib.sha1(json.dumps(span.tolist()).encode()).hexdigest()[:12]


def run_ours(args, batch: int, tokens: int, spec: str) -> dict:
    import dllm
    from dllm.bench.cache_scaling import make_cache

    model, prompts = setup(args, batch)
    sampler = dllm.samplers.get(args.sampler)
    base_rss = rss_mib()
    seen = {}

    def stop_at(count):
        def callback(info):
            gen = info.tokens[:, -args.gen :]
            done = (gen != model.mask_id).sum(1)
            seen.update(nfe=info.nfe, span=gen[:, :tokens].clone(), done=done.clone())
            if bool((done >= count).all()):
                raise Enough

        return callback

    def once(count):
        started = time.perf_counter()
        try:
            sampler.generate(
                model,
                prompts,
                max_new_tokens=args.gen,
                block_size=args.block,
                eos_early_stop=False,
                cache=make_cache(spec),
                callback=stop_at(count),
            )
        except Enough:
            pass
        return time.perf_counter() - started

    once(1)  # warm-up
    seconds = once(tokens)
    return {
        "impl": "dllm",
        "parameters": sum(p.numel() for p in model.parameters()),
        "cache": spec,
        "sampler": args.sampler,
        "batch": batch,
        "tokens": tokens,
        "nfe": seen["nfe"],
        "seconds": seconds,
        "seconds_per_token": seconds / (batch * tokens),
        "committed_min": int(seen["done"].min()),
        "span_sha1": digest(seen["span"]),
        "base_rss_mib": base_rss,
        "peak_rss_mib": peak_rss_mib(),
    }


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.one:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        batch, tokens, spec = args.one.split("/", 2)
        record = run_ours(args, int(batch), int(tokens), spec)
        record.update(
            threads=torch.get_num_threads(),
            torch=torch.__version__,
            d_model=args.d_model,
            layers=args.layers,
            prompt=args.prompt,
            gen=args.gen,
            block=args.block,
        )
        print(json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
        return 0
    batches = [int(b) for b in args.batch.split(",")]
    counts = [int(t) for t in args.tokens.split(",")]
    for batch, tokens in zip(batches, counts):
        for spec in args.caches.split(","):
            cmd = [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--one",
                f"{batch}/{tokens}/{spec}",
            ]
            subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
