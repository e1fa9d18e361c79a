"""The fused scoring kernel against the PyTorch reference chain: ``python -m dllm.bench.kernels``.

At LLaDA's vocabulary (126,464) with bfloat16 logits, for 32, 256, 1,024 and 4,096 rows and for the shapes of
batched dual-cache steps (batch x block of 32 columns), and for three score specs (the Fast-dLLM threshold
rules' float64 probability, LLaDA sampling at temperature 1 with float64 Gumbel noise, every statistic), it
prints per case:

- ``triton ms`` / ``torch ms``: the fused kernels (:mod:`dllm.kernels.triton_score`) and the reference chain that
  computes the same (:func:`dllm.kernels.reference.score`, with the uniform draws materialised from the same
  counters where the reference takes draws), median of ``triton.testing.do_bench`` (L2 flushed between runs);
- ``GB/s`` and ``% peak``: the logits bytes the kernels must read (twice with entropy: its second pass) per
  second, against the device's HBM bandwidth (from its memory clock and bus width, else a table of known cards);
- ``speedup``: torch ms / triton ms; ``same tokens``: whether both proposed the same tokens; ``syncs``: host
  synchronisations of one fused call (``dllm.bench.overhead.SyncCounter``; the goal is 0);
- ``head ms``: the LM head projection of the same rows (hidden 4,096, LLaDA-8B's), for item 4 of issue 19: fusing
  the head into the kernel saves at most the logits' write and read, worth it only where scoring is a large share.

Then kernel B (:mod:`dllm.kernels.triton_select`) against its reference (:mod:`dllm.kernels.selection`) for each
fused rule on batched canvases: time, speedup, whether both commit the same slots, host synchronisations.

Goals (issue 19, on an H100): >= 70 % of HBM bandwidth from 256 rows up, >= 5x the reference chain. Without a
CUDA device it says so and exits 0 (the kernels' correctness is tested through Triton's interpreter).
"""

from __future__ import annotations

import argparse
import inspect

import torch

VOCAB = 126464  # LLaDA-8B
HIDDEN = 4096  # LLaDA-8B
ROWS = (32, 256, 1024, 4096)
DUAL = ((16, 32), (64, 32))  # (batch, block): a batched dual-cache step scores the block's columns
_PEAK_TB_S = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6}


def specs():
    """(name, ScoreSpec) of the measured cases."""
    from dllm.kernels.reference import STATS, ScoreSpec

    return (
        ("prob f64, greedy (threshold)", ScoreSpec(need=frozenset({"prob"}), dtype=torch.float64)),
        ("prob f64, T=1 (LLaDA)", ScoreSpec(need=frozenset({"prob"}), temperature=1.0, dtype=torch.float64)),
        ("every statistic, greedy", ScoreSpec(need=frozenset(STATS))),
    )


def peak_bandwidth(device) -> float | None:
    """The device's HBM bandwidth in bytes/s (memory clock x bus width x 2), or from a table by name."""
    props = torch.cuda.get_device_properties(device)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and width:
        return 2 * clock * 1e3 * width / 8
    for name, tb in _PEAK_TB_S.items():
        if name in props.name:
            return tb * 1e12
    return None


def reference_chain(logits, spec, counters):
    """The reference scoring as the loop runs it (draws materialised from the counters where it takes draws)."""
    from dllm.kernels import reference

    if "counters" in inspect.signature(reference.score).parameters:
        return reference.score(logits, spec, counters)
    uniform = None
    if spec.temperature > 0:
        uniform = counters.uniform(logits.shape[-1]).reshape(logits.shape)
    return reference.score(logits, spec, uniform)


def shapes(rows=ROWS, dual=DUAL):
    """(label, logits shape) of the measured cases."""
    out = [(f"{n} rows", (n,)) for n in rows]
    out += [(f"dual-cache step {b}x{k}", (b, k)) for b, k in dual]
    return out


def measure(label, shape, name, spec, vocab, block_v=None, splits=None, head=True, device="cuda") -> dict:
    import triton.testing

    from dllm.bench.overhead import SyncCounter
    from dllm.core.rng import CounterRNG, Stream
    from dllm.kernels import triton_score

    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(*shape, vocab, device=device, generator=g) * 4).to(torch.bfloat16)
    n = logits.numel() // vocab
    rows = torch.arange(shape[0], device=device)
    offsets = torch.arange(shape[1] if len(shape) > 1 else 1, device=device).expand(shape[0], -1)
    counters = CounterRNG(1234).counters(Stream.TOKENS, rows, torch.zeros_like(rows), offsets)

    def fused():
        return triton_score.score(logits, spec, counters, block_v=block_v, splits=splits)

    def chain():
        return reference_chain(logits, spec, counters)

    same = bool(torch.equal(fused().token.reshape(-1), chain().token.reshape(-1)))
    with SyncCounter() as syncs:
        fused()
    t_fused = triton.testing.do_bench(fused, warmup=10, rep=100, return_mode="median")
    t_ref = triton.testing.do_bench(chain, warmup=3, rep=200, return_mode="median")
    passes = 2 if "entropy" in spec.need else 1
    bytes_read = logits.numel() * logits.element_size() * passes
    t_head = None
    if head:
        hidden = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16, generator=g)
        weight = torch.randn(vocab, HIDDEN, device=device, dtype=torch.bfloat16, generator=g)
        t_head = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=5, rep=50, return_mode="median")
    return {
        "shape": label,
        "spec": name,
        "rows": n,
        "triton_ms": t_fused,
        "torch_ms": t_ref,
        "gb_s": bytes_read / t_fused / 1e6,
        "same": same,
        "syncs": syncs.count,
        "head_ms": t_head,
    }


SELECT_SHAPES = ((16, 1024), (64, 1024), (256, 512))  # (batch, canvas length)


def selection_rules():
    from dllm.kernels.selection import Rule

    return (
        Rule("top_k"),
        Rule("threshold", 0.9),
        Rule("factor", factor=1.0),
        Rule("anchored_threshold", 0.9, relaxed=0.75),
    )


def measure_selection(batch: int, length: int, rule, block: int = 32, device="cuda") -> dict:
    """Kernel B against :func:`dllm.kernels.selection.select_and_commit` on one step's tensors."""
    import triton.testing

    from dllm.bench.overhead import SyncCounter
    from dllm.kernels import selection, triton_select

    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    confidence = torch.rand(batch, length, device=device, dtype=torch.float64, generator=g)
    columns = torch.arange(length, device=device)
    start = torch.randint(0, length - block, (batch, 1), device=device, generator=g)
    committable = (columns >= start) & (columns < start + block)
    committable &= torch.rand(batch, length, device=device, generator=g) < 0.6
    proposals = torch.randint(0, VOCAB, (batch, length), device=device, generator=g)
    tokens = torch.zeros(batch, length, dtype=torch.long, device=device)
    quota = torch.minimum(committable.sum(1), torch.full_like(committable.sum(1), 2))
    args = (rule, confidence, committable, proposals)

    def fused():
        return triton_select.select_and_commit(*args, tokens, quota)

    def chain():
        return selection.select_and_commit(*args, tokens, quota)

    same = bool(torch.equal(fused()[0], chain()[0]))
    with SyncCounter() as syncs:
        fused()
    return {
        "triton_ms": triton.testing.do_bench(fused, warmup=10, rep=50, return_mode="median"),
        "torch_ms": triton.testing.do_bench(chain, warmup=10, rep=50, return_mode="median"),
        "same": same,
        "syncs": syncs.count,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dllm.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--dual", default=",".join(f"{b}x{k}" for b, k in DUAL), help="batch x block shapes")
    parser.add_argument("--block-v", type=int, default=None, help="tile width (default: the kernel's plan)")
    parser.add_argument("--splits", type=int, default=None, help="programs per row (default: the kernel's plan)")
    parser.add_argument("--no-head", action="store_true", help="skip timing the LM head projection")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "no CUDA device: the Triton kernels run on a GPU, so nothing is measured here (their correctness is "
            "tested on the CPU through Triton's interpreter: tests/test_kernels_triton.py). Run this on a GPU."
        )
        return 0
    import triton

    device = torch.cuda.current_device()
    peak = peak_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    bandwidth = "n/a" if peak is None else f"{peak / 1e12:.2f} TB/s"
    print(f"{name}; HBM peak {bandwidth}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"vocabulary {args.vocab}, bfloat16 logits\n")
    print("| shape | rows | spec | triton ms | GB/s | % peak | torch ms | speedup | same tokens | syncs | head ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|")
    rows = tuple(int(r) for r in args.rows.split(",") if r)
    dual = tuple(tuple(int(v) for v in s.split("x")) for s in args.dual.split(",") if s)
    for label, shape in shapes(rows, dual):
        head = not args.no_head
        for spec_name, spec in specs():
            r = measure(label, shape, spec_name, spec, args.vocab, args.block_v, args.splits, head=head)
            head = False  # the head's time does not depend on the spec
            torch.cuda.empty_cache()
            pct = "n/a" if peak is None else f"{100 * r['gb_s'] * 1e9 / peak:.0f}"
            t_head = "" if r["head_ms"] is None else f"{r['head_ms']:.3f}"
            print(
                f"| {r['shape']} | {r['rows']} | {r['spec']} | {r['triton_ms']:.3f} | {r['gb_s']:.0f} | {pct} "
                f"| {r['torch_ms']:.3f} | {r['torch_ms'] / r['triton_ms']:.1f}x | {'yes' if r['same'] else 'NO'} "
                f"| {r['syncs']} | {t_head} |",
                flush=True,
            )
    print("\nkernel B: selection and write-back (float64 confidences, a block of 32 committable columns per row)\n")
    print("| canvas | rule | triton ms | torch ms | speedup | same commits | syncs |")
    print("|---|---|---:|---:|---:|---|---:|")
    for batch, length in SELECT_SHAPES:
        for rule in selection_rules():
            r = measure_selection(batch, length, rule)
            print(
                f"| {batch} x {length} | {rule.kind} | {r['triton_ms']:.4f} | {r['torch_ms']:.4f} "
                f"| {r['torch_ms'] / r['triton_ms']:.1f}x | {'yes' if r['same'] else 'NO'} | {r['syncs']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
