"""What a constraint buys and what it costs: ``python -m dllm.bench.structured``.

1. **Validity and accuracy as parallelism grows.** The bundled models' test prompts of the ``arith`` and ``listops``
   tasks, decoded by the family's reference sampler at k tokens per step (k = 1 ... 32: ``steps`` =
   ``max_new_tokens / k``), greedy and sampled at temperature 2, free and under the task's format as a regex
   (arith: its steps' lines, then ``The answer is N.``; listops: numbers separated by spaces); arith also as a
   template (its lines in one hole with that regex, then ``The answer is`` and a one-number hole), the lines' hole
   of the longest answer's size or of the problem's own. *valid*: the share of texts in the task's format;
   *accuracy*: the task's score.
2. **Cost.** The guard's work per step on a 256-slot canvas with a synthetic 128k-token vocabulary and a JSON
   schema, the canvas decoded 32 slots a block, 4 commits a step in random order, the proposals drawn from random
   logits: the automaton's passes and class masks (host work, Python and NumPy), the vocabulary-wide mask of the
   block's 32 scored columns (each distinct allowed set's bias spread over the vocabulary once, then added to the
   32 x 128k logits in one pass; beside it, one copy of those logits, the memory traffic any such pass costs), and
   the ratio of their sum to the LM head's matrix product over the same columns (hidden 1024, float32), a lower
   bound of a step's forward. Then a context-free constraint (nested lists) on the same canvas and vocabulary:
   llguidance's mask at the frontier per step, and the check of each commit.

Writes a Markdown report (stdout and ``--out``, default ``eval/results/structured.md``). About half an hour on
two CPU cores (``--n`` examples per task, 50); the cost part runs first, on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch

from dllm.constraints import Grammar, Hole, JsonSchema, Regex
from dllm.core.errors import DllmWarning

LINES = r"([0-9]+ [-+*/] [0-9]+ = [0-9]+\n){1,3}"
FORMATS = {"arith": Regex(LINES + r"The answer is [0-9]+\."), "listops": Regex(r"[0-9]+( [0-9]+)*")}
TEMPLATE = [Hole(18, Regex(LINES)), "The answer is", Hole(1, Regex(r" [0-9]+")), "."]
SCHEMA = JsonSchema(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age"],
    }
)


def validity(models: list[str], n: int, parallelism: list[int], temperatures: list[float]) -> list[dict]:
    """One row per model x task x k x {free, constrained, template}: valid share, accuracy, NFE."""
    import dllm
    from dllm import tasks
    from dllm.constraints.template import slots

    rows = []
    for name in models:
        model = dllm.load(name, device="cpu", dtype=torch.float32)
        sampler = dllm.samplers.reference(model.family)
        for task_name, pattern in FORMATS.items():
            task = tasks.get(task_name)
            examples = task.examples("test", n)
            prompts = [e.prompt for e in examples]
            for temperature, k in [(t, k) for t in temperatures for k in parallelism]:
                sampling = {"temperature": temperature, "seed": 0}
                runs = {"free": None, "constrained": None}
                if task_name == "arith":
                    runs |= {"template": TEMPLATE, "sized template": None}
                for run, template in runs.items():
                    texts = [None] * len(examples)
                    for group in _groups(examples, run):  # (a sized template: one per number of steps)
                        if run == "sized template":
                            template = sized_template(len(examples[group[0]].meta["ops"]))
                        extra = {"constraint": pattern} if run == "constrained" else {}
                        length = task.max_new_tokens
                        if template is not None:
                            extra, length = {"template": template}, slots(model.tokenizer, template)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", DllmWarning)
                            out = sampler.generate(
                                model, [prompts[i] for i in group], **_parallel(model, length, k), **extra, **sampling
                            )
                        for i, text in zip(group, out.texts):
                            texts[i] = text
                    valid = sum(pattern.check(t) for t in texts) / len(prompts)
                    accuracy = sum(task.score(e, t) for e, t in zip(examples, texts)) / len(prompts)
                    row = {"model": name, "task": task_name, "T": temperature, "k": k, "run": run}
                    rows.append(row | {"valid": valid, "accuracy": accuracy})
                    said = f"{name} {task_name} T={temperature} k={k} {run}: valid {valid:.0%}, accuracy {accuracy:.0%}"
                    print(" ", said, file=sys.stderr)
    return rows


def sized_template(steps: int) -> list:
    """The arith answer's template for a problem of ``steps`` operations: a hole of 6 tokens per step's line
    (``a op b = c`` and its line break, every number one token), then the answer's."""
    return [Hole(6 * steps, Regex(LINES)), "The answer is", Hole(1, Regex(r" [0-9]+")), "."]


def _groups(examples, run: str) -> list[list[int]]:
    if run != "sized template":
        return [list(range(len(examples)))]
    groups: dict[int, list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault(len(example.meta["ops"]), []).append(i)
    return list(groups.values())


def _parallel(model, length: int, k: int) -> dict:
    """``generate``'s settings for ``length`` tokens at ``k`` tokens per step: one block of ``length`` for a
    bidirectional model, the model's own blocks for a block-causal one."""
    if model.attention.block_causal:
        return {"max_new_tokens": length, "steps_per_block": max(1, model.block_size // k)}
    return {"max_new_tokens": length, "block_size": length, "steps": max(1, -(-length // k))}


def synthetic_surfaces(vocab: int, seed: int = 0):
    """A byte-level vocabulary of ``vocab`` tokens (1-6 bytes of a JSON-ish alphabet; every single byte of it a token
    too), the last id EOS."""
    from dllm.constraints.tokens import Surfaces

    rng = random.Random(seed)
    alphabet = b'abcdefghijklmnopqrstuvwxyz0123456789 {}[]":,.-_\n'
    items = {t: bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for t in range(vocab - 2)}
    items.update({i: bytes([c]) for i, c in enumerate(alphabet)})
    return Surfaces(items, {}, vocab)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cost(vocab: int, canvas_length: int, block: int, per_step: int, hidden: int, repeats: int, device="cpu") -> dict:
    """Median milliseconds per step of the guard's parts, and the LM head's product over the scored columns, the
    logits on ``device`` (each part timed to its end on the device)."""
    from dllm.constraints.automaton import build
    from dllm.constraints.guard import Guard, Layout

    device = torch.device(device)
    surfaces = synthetic_surfaces(vocab)
    eos, mask = vocab - 1, vocab
    started = time.perf_counter()
    automaton = build(SCHEMA.regex(), surfaces, [eos])
    built = time.perf_counter() - started
    canvas = types.SimpleNamespace(prompt_width=0, span_end=torch.tensor([canvas_length]), mask_id=mask)
    guard = Guard(automaton, [Layout.free(canvas_length)], canvas, [eos], mask)
    generator = torch.Generator().manual_seed(0)
    order = random.Random(0)
    host, vocab_pass, accept, copy = [], [], [], []
    tokens = torch.full((1, canvas_length), mask)
    rows = torch.tensor([0])
    for start in range(0, canvas_length, block):
        while bool((tokens[0, start : start + block] == mask).any()):
            columns = (tokens[0, start : start + block] == mask).nonzero().squeeze(1)[None] + start
            logits = torch.randn(1, columns.shape[1], vocab + 1, generator=generator).to(device)
            _synchronize(device)
            t0 = time.perf_counter()
            logits.clone()
            _synchronize(device)
            copy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            timed = _Timed(guard)
            restricted = timed.restrict(logits, rows, columns, tokens)
            _synchronize(device)
            t1 = time.perf_counter()
            proposals = restricted.argmax(-1)[0].cpu()
            chosen = order.sample(range(columns.shape[1]), min(per_step, columns.shape[1]))
            commit = torch.zeros_like(tokens, dtype=torch.bool)
            written = tokens.clone()
            for j in chosen:
                commit[0, columns[0, j]], written[0, columns[0, j]] = True, proposals[j]
            must = torch.tensor([True])
            t2 = time.perf_counter()
            commit, written = guard.accept(tokens, commit, written, torch.rand(1, canvas_length), must, _first_allowed)
            t3 = time.perf_counter()
            tokens = torch.where(commit, written, tokens)
            host.append(timed.host)
            vocab_pass.append((t1 - t0) - timed.host)
            accept.append(t3 - t2)
    text = bytes(b for t in tokens[0].tolist() if t != eos for b in surfaces.items[t]).decode()
    assert SCHEMA.check(text), text  # (the guard's own check: what it decoded is valid)
    head = torch.randn(vocab, hidden, device=device)
    states = torch.randn(block, hidden, device=device)
    matmul = []
    for _ in range(repeats):
        _synchronize(device)
        t0 = time.perf_counter()
        states @ head.T
        _synchronize(device)
        matmul.append(time.perf_counter() - t0)
    ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    return {
        "build_s": built,
        "states": automaton.states,
        "classes": automaton.table.shape[1],
        "steps": len(host),
        "host_ms": ms(host),
        "vocab_ms": ms(vocab_pass),
        "accept_ms": ms(accept),
        "copy_ms": ms(copy),
        "head_ms": ms(matmul),
    }


class _Timed:
    """``guard.restrict`` with the time of its host part (the automaton's passes and class masks: ``plan``) apart
    from the vocabulary-wide fill (``apply``)."""

    def __init__(self, guard):
        self.guard, self.host = guard, 0.0

    def restrict(self, logits, rows, columns, tokens):
        started = time.perf_counter()
        plan = self.guard.plan(rows, columns, tokens)
        self.host = time.perf_counter() - started
        return self.guard.apply(logits, *plan)


NESTED = Grammar('start: value\nvalue: list | NUM\nlist: "[" (value ("," value)*)? "]"\nNUM: /[0-9]+/')


def grammar_cost(vocab: int, canvas_length: int, block: int, per_step: int, device="cpu") -> dict:
    """Milliseconds of a context-free constraint (nested lists, :data:`NESTED`) over the same canvas: the frontier's
    mask per step and the check per commit (median and 99th percentile), with the forwards (steps) it takes. The
    logits stand for a model that knows a text of the grammar and is wrong at one slot in ten: random, plus a wide
    margin for the text's token (for a random bracket, comma or digit at the wrong slots); a step commits
    ``per_step`` slots of its block, the first masked one among them, so most commits lie right of the frontier and
    are proved by a witness."""
    from dllm.constraints.grammar import GrammarGuard, build_ll_tokenizer
    from dllm.constraints.guard import Layout

    surfaces = synthetic_surfaces(vocab)
    eos, mask = vocab - 1, vocab
    single = {text: t for t, text in surfaces.items.items() if len(text) == 1}
    encode = lambda text: [single[bytes([b])] for b in text.encode()]  # noqa: E731
    tokenizer = build_ll_tokenizer(surfaces, [eos], encode)
    canvas = types.SimpleNamespace(prompt_width=0, span_end=torch.tensor([canvas_length]), mask_id=mask)
    guard = GrammarGuard(NESTED.grammar(), tokenizer, canvas, [eos], mask, [Layout.free(canvas_length)])
    generator, order = torch.Generator().manual_seed(0), random.Random(0)
    known = encode(_nested_list(order, canvas_length - 8))
    known += [eos] * (canvas_length - len(known))
    alphabet = encode("[],0123456789")
    favoured = torch.tensor([t if order.random() < 0.9 else order.choice(alphabet) for t in known])
    tokens, rows = torch.full((1, canvas_length), mask), torch.tensor([0])
    masks, checks = [], []
    for start in range(0, canvas_length, block):
        while bool((tokens[0, start : start + block] == mask).any()):
            columns = (tokens[0, start : start + block] == mask).nonzero().squeeze(1)[None] + start
            logits = torch.randn(1, columns.shape[1], vocab + 1, generator=generator)
            logits[0, torch.arange(columns.shape[1]), favoured[columns[0]]] += 12.0
            logits = logits.to(device)
            _synchronize(torch.device(device))
            t0 = time.perf_counter()
            logits = guard.restrict(logits, rows, columns, tokens)
            _synchronize(torch.device(device))
            t1 = time.perf_counter()
            proposals = logits.argmax(-1)[0].cpu()
            chosen = {0, *order.sample(range(columns.shape[1]), min(per_step, columns.shape[1]))}
            commit, written = torch.zeros_like(tokens, dtype=torch.bool), tokens.clone()
            for j in chosen:
                commit[0, columns[0, j]], written[0, columns[0, j]] = True, proposals[j]
            t2 = time.perf_counter()
            commit, written = guard.accept(tokens, commit, written, None, None, _first_allowed)
            t3 = time.perf_counter()
            tokens = torch.where(commit, written, tokens)
            masks.append(t1 - t0)
            checks.append((t3 - t2) / len(chosen))
    ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    p99 = 1e3 * sorted(checks)[min(len(checks) - 1, int(0.99 * len(checks)))]
    return {"steps": len(masks), "mask_ms": ms(masks), "check_ms": ms(checks), "check_p99_ms": p99}


def _nested_list(rng: random.Random, length: int) -> str:
    """A random nested list of about ``length`` characters (a few more at most), a word of :data:`NESTED`."""
    text, depth = "[", 1
    while len(text) + depth < length:
        step = rng.random()
        if step < 0.25 and len(text) + depth + 2 < length:
            text += "[" if text[-1] in "[," else ",["
            depth += 1
        elif step < 0.4 and depth > 1 and text[-1] not in "[,":
            text, depth = text + "]", depth - 1
        else:
            text += str(rng.randint(0, 99)) if text[-1] in "[," else ","
    text = text.rstrip(",")
    return text + "]" * depth


def _first_allowed(row, column, allowed):
    return int(allowed.nonzero()[0])


def reading(rows: list[dict]) -> list[str]:
    """What the validity table says, in numbers taken from it."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["model"], r["task"], r["T"], r["k"]), {})[r["run"]] = r
    free = min(cells.values(), key=lambda runs: runs["free"]["valid"])["free"]
    worse = [(key, runs) for key, runs in cells.items() if runs["constrained"]["accuracy"] < runs["free"]["accuracy"]]
    sized = [runs for runs in cells.values() if "sized template" in runs]

    def gap(greedy: bool) -> str:
        gaps = [
            runs["sized template"]["accuracy"] - runs["free"]["accuracy"]
            for runs in sized
            if (runs["free"]["T"] == 0) == greedy
        ]
        return f"{100 * min(gaps):+.0f} to {100 * max(gaps):+.0f} points" if gaps else "no cell"

    fixed = max(runs["free"]["accuracy"] - runs["template"]["accuracy"] for runs in sized) if sized else 0
    valid = all(runs[run]["valid"] == 1 for runs in cells.values() for run in runs if run != "free")
    out = [
        f"**Reading.** Free decoding loses its format as sampling and parallelism grow (down to "
        f"{free['valid']:.0%} valid: {free['model']} {free['task']}, T={free['T']:g}, k={free['k']}); under the "
        f"constraint {'every text is valid in every cell' if valid else 'some text is NOT valid'}. Its accuracy is at "
        f"least the free one's in {len(cells) - len(worse)} of {len(cells)} cells"
    ]
    if worse:
        shown = ", ".join(
            f"{m} {t} T={T:g} k={k}: {r['constrained']['accuracy']:.0%} vs {r['free']['accuracy']:.0%}"
            for (m, t, T, k), r in worse
        )
        out[0] += f" (below it in {shown})"
    out[0] += "."
    if sized:
        out.append(
            f"A template whose lines' hole fits the problem answers as free decoding does, give or take: its accuracy "
            f"minus the free one's is {gap(True)} greedy, {gap(False)} sampled. One hole of the longest answer's "
            f"size loses up to {100 * fixed:.0f} points: these models, trained with EOS only after the answer, rarely "
            "write a hole's EOS filler in the middle of their text."
        )
    return out


def _device_name(device: str) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def report(rows: list[dict], costs: dict, grammar: dict, args) -> str:
    lines = [
        "# Structured output: what a constraint buys and what it costs",
        "",
        f"`python -m dllm.bench.structured --n {args.n}` on {torch.get_num_threads()} CPU thread(s), torch "
        f"{torch.__version__}. T: the temperature (0: greedy; else seed 0); k: tokens per step (`steps = "
        "max_new_tokens / k`; SDAR: `steps_per_block = block_size / k`, at least 1).",
        "",
        "## Validity and accuracy",
        "",
        "*template*: its lines in one hole of 18 tokens (the longest answer's), then `The answer is` and a "
        "one-number hole; *sized template*: the lines' hole sized to the problem's steps (6 tokens a line).",
        "",
        "| model | task | T | k | free: valid | free: accuracy | regex: valid | regex: accuracy | template: valid | "
        "template: accuracy | sized template: valid | sized template: accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    table: dict = {}
    for r in rows:
        table.setdefault((r["model"], r["task"], r["T"], r["k"]), {})[r["run"]] = r
    for (model, task, temperature, k), runs in table.items():
        cells = []
        for run in ("free", "constrained", "template", "sized template"):
            r = runs.get(run)
            cells += [f"{r['valid']:.0%}", f"{r['accuracy']:.0%}"] if r else ["", ""]
        lines.append(f"| {model} | {task} | {temperature:g} | {k} | " + " | ".join(cells) + " |")
    if rows:
        lines += ["", *reading(rows)]
    else:  # --cost-only
        lines = lines[:2] + [
            f"`python -m dllm.bench.structured --cost-only --device {args.device}`: the cost part alone, the logits "
            f"on {_device_name(args.device)}, torch {torch.__version__}."
        ]
    c, g = costs, grammar
    total = c["host_ms"] + c["vocab_ms"] + c["accept_ms"]
    lines += [
        "",
        "## Cost per step",
        "",
        f"A {args.canvas}-slot canvas, a synthetic {args.vocab:,}-token vocabulary, the JSON schema of three fields "
        f"(automaton: {c['states']} states, {c['classes']} token classes, built in {c['build_s']:.1f} s, cached "
        f"after), {c['steps']} steps of 32-slot blocks with 4 commits each; medians:",
        "",
        "| part | ms per step |",
        "|---|---|",
        f"| the automaton's passes and class masks (host) | {c['host_ms']:.2f} |",
        f"| the vocabulary-wide mask of the 32 scored columns | {c['vocab_ms']:.2f} |",
        f"| accepting the step's commits | {c['accept_ms']:.2f} |",
        f"| **the constraint in all** | **{total:.2f}** |",
        f"| the LM head's product alone over the same columns (hidden {args.hidden}) | {c['head_ms']:.2f} |",
        "",
        f"The constraint costs {total / c['head_ms']:.0%} of the LM head's product alone (a lower bound of a "
        "step's forward); its vocabulary-wide part is one memory pass over the scored logits, on the logits' "
        f"device (a plain copy of those logits takes {c['copy_ms']:.2f} ms here: the pass reads and writes them).",
        "",
        f"A context-free constraint (nested lists, `{NESTED.source!r}`) over the same canvas and vocabulary, "
        f"{g['steps']} steps: the frontier's mask (llguidance) {g['mask_ms']:.2f} ms per step, the check of a "
        f"commit {g['check_ms']:.3f} ms (median; 99th percentile {g['check_p99_ms']:.3f} ms), a witness proving the "
        "commits right of the frontier (logits of a model that knows a text of the grammar, wrong at one slot in "
        "ten).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-llada,tiny-sdar", help="bundled models (tiny-llada,tiny-sdar)")
    parser.add_argument("--n", type=int, default=50, help="test examples per task (50)")
    parser.add_argument("--parallelism", default="1,2,4,8,16,32", help="tokens per step (1,2,4,8,16,32)")
    parser.add_argument("--temperatures", default="0,2", help="greedy and sampled at these temperatures (0,2)")
    parser.add_argument("--vocab", type=int, default=128_000, help="the cost part's vocabulary (128000)")
    parser.add_argument("--canvas", type=int, default=256, help="the cost part's canvas length (256)")
    parser.add_argument("--hidden", type=int, default=1024, help="the LM head's hidden size it is compared with")
    parser.add_argument("--out", default="eval/results/structured.md", help="the report (eval/results/structured.md)")
    parser.add_argument("--device", default="cpu", help="the cost part's logits and LM head here (cpu; cuda)")
    parser.add_argument("--cost-only", action="store_true", help="the cost part alone (the GPU check's)")
    args = parser.parse_args(argv)
    parallelism = [int(k) for k in args.parallelism.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    costs = cost(args.vocab, args.canvas, 32, 4, args.hidden, repeats=5, device=args.device)  # (first: quiet machine)
    grammar = grammar_cost(args.vocab, args.canvas, 32, 4, device=args.device)
    rows = [] if args.cost_only else validity(args.models.split(","), args.n, parallelism, temperatures)
    text = report(rows, costs, grammar, args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
