"""The official Fast-dLLM dual cache beside ours, on the same random weights and prompts.

``python eval/gpu/official_fastdllm.py [--device cuda|cpu] [--small] [--batch 1] [--official DIR] [--out DIR]``

Builds the random LLaDA-8B-shaped model and the prompts of ``python -m dllm.bench.speed`` (bf16; prompt 512,
generation 256, block 32; ``--small``: its CPU smoke-test shape and lengths), then times on them
NVlabs/Fast-dLLM's ``generate_with_dual_cache`` (``llada/generate.py``: threshold 0.9, temperature 0; it is
batch-1, so a batch runs row by row) and ``dllm``'s ``threshold`` sampler with the ``dual`` cache
(``dllm.bench.speed.measure``). Each: one warm-up (one block, at the timed run's shapes), one timed run, the
device synchronised around it. Reported: forwards, ms per forward, tokens/s, total ms; whether the generated
tokens are equal and the first generated column where they differ (random weights give near-flat
distributions: a bf16 rounding difference may flip a token, so this is reported, not asserted); the max
|logit difference| of the two models on the first forward's canvas (prompt + masks). The official model is
built from our model's state dict in memory: its parameters are our tensors (no copy, no random init).

The official code is never committed here. It is read at run time from ``.official/fast-dllm-llada`` (git-ignored),
the ``llada/`` folder of NVlabs/Fast-dLLM with its commit in ``COMMIT``::

    git clone https://github.com/NVlabs/Fast-dLLM /tmp/Fast-dLLM && mkdir -p .official/fast-dllm-llada
    git -C /tmp/Fast-dLLM archive HEAD llada | tar -x --strip-components=1 -C .official/fast-dllm-llada
    git -C /tmp/Fast-dLLM rev-parse HEAD > .official/fast-dllm-llada/COMMIT

It was written for transformers 4.x and runs unchanged under 5.x with the adjustments of ``official_model``.
Results: ``official-fastdllm-<device>[-small][-b<batch>].md`` / ``.json`` in ``--out`` (default ``$OUT``, else
``eval/results/gpu``). Without CUDA, ``--device cuda`` says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's dllm, wherever this is run from

import transformers  # noqa: E402

import dllm  # noqa: E402
from dllm.bench import speed  # noqa: E402

START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


def sdp_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()


def official_model(folder: Path, model):
    """(``generate_with_dual_cache``, the official ``LLaDAModelLM`` holding ``model``'s tensors).

    Adjustments, none in the official files: ``LLaDAModelLM.__init__`` builds its ``LLaDAModel`` with
    ``init_device="cpu"`` (8B float32 parameters allocated and initialised on the host), so the ``LLaDAModel``
    is built here on the meta device and handed over (``model=``), then the weights assigned; transformers 5's
    ``PretrainedConfig`` no longer keeps ``use_cache``, which the official forward reads when not passed.
    ``flash_attention`` stays False (the config default: no flash-attn package), so attention is its
    ``torch.compile``-d ``F.scaled_dot_product_attention`` without a mask; should compiling fail on a machine, it
    runs eagerly (the same call) rather than end the run (dynamo logs the error)."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    sys.path.insert(0, str(folder))  # generate.py imports ``model.modeling_llada``
    generate = importlib.import_module("generate")
    modeling = importlib.import_module("model.modeling_llada")
    config = modeling.LLaDAConfig(**model.config)
    config.use_cache = False
    inner = modeling.create_model_config_from_pretrained_config(config)
    inner.init_device = "meta"
    official = modeling.LLaDAModelLM(config, model=modeling.LLaDAModel(inner, init_params=False))
    official.load_state_dict(model.state_dict(), strict=True, assign=True)
    return generate.generate_with_dual_cache, official.eval()


def official_run(generate, official, prompts, sync, **kwargs):
    """The official generation of ``prompts``, row by row (it is batch-1), the device synchronised around it:
    (sequences, seconds, forwards counted by a hook on the model, forwards it returned)."""
    count = [0]
    hook = official.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        runs = [generate(official, row[None], temperature=0.0, **kwargs) for row in prompts]
        sync()
        seconds = time.perf_counter() - start
    hook.remove()
    return torch.cat([x for x, _ in runs]), seconds, count[0], sum(n for _, n in runs)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first column (over all rows) where ``a`` and ``b`` differ; None if equal."""
    columns = (a != b).any(0).nonzero()
    return int(columns[0]) if len(columns) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="dllm.bench.speed's CPU smoke-test shape and lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--official", type=Path, default=ROOT / ".official" / "fast-dllm-llada")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / speed.RESULTS))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("official_fastdllm: no CUDA GPU here, nothing measured (`--device cpu --small`: the rehearsal).")
        return 0
    if not (args.official / "generate.py").exists():
        raise SystemExit(f"no official code at {args.official}: see this script's docstring")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    shape = (speed.SMALL if args.small else speed.SHAPES)["llada-8b"]
    run = speed.SMALL_RUN if args.small else dict(prompt=speed.PROMPT, generation=speed.GENERATION, block=speed.BLOCK)
    prompt_len, generation, block = run["prompt"], run["generation"], run["block"]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    commit = (args.official / "COMMIT").read_text().strip() if (args.official / "COMMIT").exists() else "unknown"
    log(f"device {name}; torch {torch.__version__}, transformers {transformers.__version__}; official {commit}")

    model = speed.build_model(shape, device, torch.bfloat16)
    prompts = speed.prompts_of(args.batch, prompt_len, model.vocab_size).to(device)
    sampler = dllm.samplers.get("threshold")
    threshold, mask_id = sampler.threshold, model.mask_id  # 0.9; the shape's config mask id (not 126336)
    canvas = torch.cat([prompts, torch.full((args.batch, generation), mask_id, device=device)], 1)
    with torch.inference_mode():
        ours = model(canvas)  # the first forward's logits
    ours_sdp = sdp_flags()
    generate, official = official_model(args.official, model)
    official_sdp = sdp_flags()  # LLaDAModel.__init__ enables flash and disables memory-efficient SDPA, globally
    with torch.inference_mode():
        theirs = official(canvas, use_cache=False).logits  # (compiles its attention for the full canvas)
    diff = (ours.float() - theirs.float()).abs().max().item()
    argmax = int((ours.argmax(-1) != theirs.argmax(-1))[:, prompt_len:].sum())
    del ours, theirs
    log(f"models built; SDPA flash / mem-efficient: official {official_sdp}, ours {ours_sdp}; mask id {mask_id}")
    log(f"first forward: max |logit diff| {diff:.3g}, argmax differs at {argmax} of {generation} masked columns")

    kwargs = dict(steps=generation, gen_length=generation, block_length=block, threshold=threshold, mask_id=mask_id)
    # warm-up: one block at the timed run's shapes (a canvas of prompt + generation, block-wide forwards)
    warm = speed.prompts_of(1, prompt_len + generation - block, model.vocab_size).to(device)
    official_run(generate, official, warm, sync, **{**kwargs, "steps": block, "gen_length": block})
    log("official warm-up done")
    official_tokens, seconds, forwards, nfe = official_run(generate, official, prompts, sync, **kwargs)
    official_tokens = official_tokens[:, prompt_len:]
    a = {"forwards": forwards, "nfe_returned": nfe, "ms_per_forward": 1000 * seconds / forwards}
    a |= {"tokens_per_s": args.batch * generation / seconds, "ms_total": 1000 * seconds}
    log(f"official: {a}")

    torch.backends.cuda.enable_flash_sdp(ours_sdp[0])  # ours runs as in dllm.bench.speed
    torch.backends.cuda.enable_mem_efficient_sdp(ours_sdp[1])
    b = speed.measure(model, "threshold", "dual", prompts, generation, block)
    b["ms_total"] = b["ms_per_forward"] * b["forwards"]
    log(f"dllm: {b}")
    with torch.inference_mode():  # the tokens: the timed generation again (deterministic)
        out = sampler.generate(
            model, prompts, cache=dllm.caches.get("dual"), max_new_tokens=generation, block_size=block,
            eos_early_stop=False,
        )  # fmt: skip
    first = first_difference(official_tokens, out.sequences[:, prompt_len:])
    same = "yes" if first is None else f"no (first difference at generated column {first})"
    log(f"same tokens: {same}; forwards official {a['forwards']}, dllm {b['forwards']} (this run {out.nfe})")

    lines = ["| | forwards | ms / forward | tokens/s | ms total |", "|---|---:|---:|---:|---:|"]
    labels = (f"official Fast-dLLM `generate_with_dual_cache` ({commit[:7]})", "dllm threshold + dual")
    for label, r in zip(labels, (a, b)):
        lines.append(
            f"| {label} | {r['forwards']} | {r['ms_per_forward']:.2f} | {r['tokens_per_s']:.1f} | {r['ms_total']:.0f} |"
        )
    lines += ["", f"Same tokens: {same}.", f"First forward (prompt + masks): max |logit difference| {diff:.3g}; "
              f"argmax differs at {argmax} of {generation} masked columns."]  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() + ("-small" if args.small else "")
    slug += f"-b{args.batch}" if args.batch != 1 else ""
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Official Fast-dLLM dual cache vs dllm on {name}\n\n"
        f"`python eval/gpu/official_fastdllm.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
        f"LLaDA-8B shape{' (small)' if args.small else ''}, random bf16 weights; prompt {prompt_len}, generation "
        f"{generation}, block {block}, batch {args.batch}; threshold {threshold}, temperature 0. torch "
        f"{torch.__version__}, transformers {transformers.__version__}, NVlabs/Fast-dLLM {commit}.\n\n"
    )
    (folder / f"official-fastdllm-{slug}.md").write_text(header + text + "\n")
    payload = dict(device=name, torch=torch.__version__, transformers=transformers.__version__, official_commit=commit)
    payload |= dict(shape=shape, prompt=prompt_len, generation=generation, block=block, batch=args.batch)
    payload |= dict(threshold=threshold, mask_id=mask_id, sdp_official=official_sdp, sdp_ours=ours_sdp)
    payload |= dict(official=a, dllm=b, same_tokens=first is None, first_difference=first)
    payload |= dict(max_logit_diff=diff, argmax_differs=argmax)
    (folder / f"official-fastdllm-{slug}.json").write_text(json.dumps(payload, indent=1) + "\n")
    log(f"wrote {folder / f'official-fastdllm-{slug}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
