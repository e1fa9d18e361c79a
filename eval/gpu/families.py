"""The MoE and encoder-decoder families at their published widths on a GPU: LLaDA2-mini and DiffusionGemma.

``python eval/gpu/families.py [--device cuda|cpu] [--small] [--families llada2-mini,diffusion-gemma]
[--batch-sizes 1,8] [--out DIR]``

- **llada2-mini**: LLaDA2.1-mini's published config (research/llada2.md: 20 layers, hidden 2048, 256 experts of
  width 512, 8 per token, one shared, the first layer dense; 16 B parameters) with random bf16 weights
  (``dllm.bench.speed.build_model``: prepared as ``dllm.load`` prepares, the experts stacked for the grouped GEMM),
  its reference sampler ``llada2`` (threshold 0.95, block 32; random weights are never confident, so one token per
  forward), prompt 512, 256 new tokens. Modes: ``eager`` (the per-step loop), ``device`` (``static_shapes=True``:
  the step on the device) and ``captured`` (``compile="reduce-overhead"``, batch 1 only: it compiles for a minute).
- **diffusion-gemma**: DiffusionGemma's published widths (research/diffusion_gemma.md §3: hidden 2816, 16 heads,
  128 experts of width 704, 8 per token, vocabulary 262,144, canvas 256) at **6 of its 30 layers** (one period:
  five sliding-window layers, one full), random weights drawn by transformers' own initialisation, then the same
  tensors loaded into dllm's model (``dllm.models.loading.load_weights``, the published names). transformers'
  ``generate`` and dllm's ``entropy_bound`` on the same prompts: 256 new tokens (one canvas, 48 denoising steps,
  entropy bound 0.1). Each side's draws are its own, so the tokens are not compared; the time per decoder forward is.

Each row: one warm-up generation, then one timed (the device synchronised around it): forwards, ms per forward,
tokens/s (every generated slot), peak GiB, and the weight-read limit of a forward (``dllm.bench.speed.roofline_ms``:
every parameter read once; an MoE forward reads only its chosen experts, so this overstates its floor).
Results: ``families-<device>.md`` / ``.json`` in ``--out`` (default ``$OUT``, else ``eval/results/gpu``).
``--device cpu --small``: scaled-down shapes, the rehearsal.
"""

from __future__ import annotations

import argparse
import functools
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

# LLaDA2.1-mini's config.json (research/llada2.md), through the family's tiny config with these fields replaced
LLADA2_MINI = dict(family="llada2", vocab=157184, layers=20, hidden=2048, heads=16, kv_heads=4, intermediate=5120,
                   theta=600000.0, config=dict(head_dim=128, num_experts=256, num_experts_per_tok=8,
                   moe_intermediate_size=512, n_group=8, topk_group=4, block_size=32))  # fmt: skip
LLADA2_SMALL = dict(family="llada2", vocab=1024, layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128,
                    theta=600000.0, config=dict(block_size=8))  # fmt: skip

# DiffusionGemma's text_config (research/diffusion_gemma.md §3) at 6 of its 30 layers
GEMMA = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
             num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
             num_experts=128, top_k_experts=8, moe_intermediate_size=704, sliding_window=1024, canvas=256)  # fmt: skip
GEMMA_SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, global_head_dim=32, num_global_key_value_heads=1, num_experts=8, top_k_experts=2,
                   moe_intermediate_size=32, sliding_window=16, canvas=16)  # fmt: skip
GEMMA_LAYERS = 6


def timed(fn, cuda: bool) -> tuple[float, object]:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def llada2_rows(model, args, device, batches, modes, cuda, limits) -> list[dict]:
    prompt, generation = (32, 16) if args.small else (speed.PROMPT, speed.GENERATION)
    sampler = dllm.samplers.get("llada2")
    rows = []
    for batch in batches:
        prompts = speed.prompts_of(batch, prompt, model.vocab_size).to(device)
        for mode in modes:
            if mode == "captured" and batch != 1:
                continue
            kw = {"eager": {}, "device": {"static_shapes": True}, "captured": {"compile": "reduce-overhead"}}[mode]
            kw.update(max_new_tokens=generation, eos_early_stop=False)
            run = functools.partial(sampler.generate, model, prompts, **kw)
            with torch.inference_mode():
                warm_s, _ = timed(run, cuda)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                seconds, out = timed(run, cuda)
            roof = speed.roofline_ms(model, batch, model.block_size, limits) if limits else None
            rows.append(row("llada2-mini", "llada2", mode, batch, out.nfe, seconds, batch * generation, cuda, roof,
                            warm_s, on_device=out.step_on_device))  # fmt: skip
            print(line(rows[-1]), flush=True)
    return rows


def gemma_config(small: bool):
    """The Hub form of the config (``global_head_dim``, ``num_global_key_value_heads``), 6 layers, a tiny vision
    tower (not used by text generation)."""
    g = dict(GEMMA_SMALL if small else GEMMA)
    canvas = g.pop("canvas")
    types = ["sliding_attention"] * (GEMMA_LAYERS - 1) + ["full_attention"]
    text = dict(model_type="diffusion_gemma_text", num_hidden_layers=GEMMA_LAYERS, layer_types=types,
                max_position_embeddings=4096, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh", pad_token_id=0, eos_token_id=1, bos_token_id=2,
                tie_word_embeddings=True, **g)  # fmt: skip
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)  # fmt: skip
    return dict(model_type="diffusion_gemma", architectures=["DiffusionGemmaForBlockDiffusion"], canvas_length=canvas,
                eos_token_id=[1, 106], tie_word_embeddings=True, text_config=text, vision_config=vision)  # fmt: skip


def gemma_rows(args, device, batches, cuda, limits) -> list[dict]:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from dllm.models.loading import build, load_weights, on_meta

    config = gemma_config(args.small)
    hub = DiffusionGemmaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            hf = DiffusionGemmaForBlockDiffusion(hub).eval().requires_grad_(False)
        finally:
            torch.set_default_dtype(default)
    with on_meta():
        model = build(config)
    load_weights(model, {k: v for k, v in hf.state_dict().items() if "vision" not in k}, "transformers' model")
    model.to(device=device, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    model.prepare()
    with torch.inference_mode():  # the same function: the first decoder forward's logits of both
        try:
            diff = first_logit_difference(hf, model, device)
        except Exception as error:  # (transformers' internal mask helpers change between versions)
            print(f"diffusion-gemma: the logits were not compared: {error!r}", flush=True)
            diff = (None, None)
    print(f"diffusion-gemma: first forward's logits, max |difference| {diff[0]} of max |logit| {diff[1]}", flush=True)
    canvas = config["canvas_length"]
    prompt, generation = (32, canvas) if args.small else (speed.PROMPT, canvas)
    sampler = dllm.samplers.get("entropy_bound")
    forwards = []
    hook = hf.model.decoder.register_forward_hook(lambda *a: forwards.append(1))
    rows = []
    for batch in batches:
        prompts = speed.prompts_of(batch, prompt, config["text_config"]["vocab_size"]).to(device)
        mask = torch.ones_like(prompts)
        runs = {
            "transformers": functools.partial(
                hf.generate, prompts, attention_mask=mask, max_new_tokens=generation, pad_token_id=0
            ),  # fmt: skip
            "dllm": functools.partial(
                sampler.generate, model, prompts, max_new_tokens=generation, eos_early_stop=False, seed=0
            ),  # fmt: skip
        }
        for side, fn in runs.items():
            with torch.inference_mode():
                warm_s, _ = timed(fn, cuda)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                forwards.clear()
                seconds, out = timed(fn, cuda)
            nfe = len(forwards) if side == "transformers" else out.nfe
            roof = speed.roofline_ms(model, batch, canvas, limits) if limits else None
            rows.append(row(f"diffusion-gemma-{GEMMA_LAYERS}l", side, "eager", batch, nfe, seconds,
                            batch * generation, cuda, roof, warm_s))  # fmt: skip
            print(line(rows[-1]), flush=True)
    hook.remove()
    rows[0]["first_logit_difference"], rows[0]["first_logit_max"] = diff
    return rows


def first_logit_difference(hf, model, device) -> tuple[float, float]:
    """(max |difference|, max |logit|) of the two models' logits over a canvas of random ids after a random prompt,
    without self-conditioning (transformers' forward, as ``tests/test_diffusion_gemma.py`` drives it)."""
    from transformers import DynamicCache

    vocab, length = model.vocab_size, model.block_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, 16), generator=g).to(device)
    canvas = torch.randint(3, vocab, (1, length), generator=g).to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    positions = torch.arange(16, device=device)[None]
    masks = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=torch.empty(1, 16, 0, device=device), attention_mask=mask, cache=cache,
        position_ids=positions,
    )  # fmt: skip
    hf.model.encoder(input_ids=ids, attention_mask=masks, cache=cache, position_ids=positions)
    decoder_mask = hf.model.decoder.create_diffusion_decoder_attention_mask(
        config=hf.config, inputs_embeds=canvas[..., None], cache=cache,
        decoder_attention_mask=torch.nn.functional.pad(mask, (0, length), value=True),
    )  # fmt: skip
    want = hf(decoder_input_ids=canvas, self_conditioning_logits=None, decoder_attention_mask=decoder_mask,
              cache=cache, decoder_position_ids=torch.arange(16, 16 + length, device=device)[None]).logits  # fmt: skip
    encoded = model.encode(ids, mask, model.new_encoded(1, device))
    positions = model.positions(torch.ones(1, 16 + length, dtype=torch.bool, device=device))[:, 16:]
    hidden = model.hidden(canvas, positions, encoded=encoded, conditioning=None)
    got = model.head(hidden, torch.arange(length, device=device)[None])
    return float((got.float() - want.float()).abs().max()), float(want.float().abs().max())


def row(shape, side, mode, batch, nfe, seconds, tokens, cuda, roof, warm_s, on_device=None) -> dict:
    return dict(shape=shape, sampler=side, mode=mode, batch=batch, forwards=nfe, ms_per_forward=1000 * seconds / nfe,
                tokens_per_s=tokens / seconds, peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                roofline_ms=roof, warm_up_s=warm_s, on_device=on_device)  # fmt: skip


HEADER = "| shape | sampler | mode | batch | forwards | ms / forward | tokens/s | weight-read limit ms | peak GiB |"


def line(r: dict) -> str:
    roof = "-" if r["roofline_ms"] is None else f"{r['roofline_ms']:.2f}"
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    return (f"| {r['shape']} | {r['sampler']} | {r['mode']} | {r['batch']} | {r['forwards']} "
            f"| {r['ms_per_forward']:.2f} | {r['tokens_per_s']:.1f} | {roof} | {peak} |")  # fmt: skip


def write(rows: list[dict], name: str, args) -> None:
    """The table and the rows so far (a later step's time limit leaves what was measured)."""
    text = "\n".join([HEADER, "|---" * 9 + "|", *map(line, rows)])
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    slug = name.replace(" ", "-").lower() + ("-small" if args.small else "")
    (folder / f"families-{slug}.md").write_text(f"# eval/gpu/families.py on {name}\n\n{text}\n")
    payload = dict(device=name, torch=torch.__version__, rows=rows)
    (folder / f"families-{slug}.json").write_text(json.dumps(payload, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--families", default="llada2-mini,diffusion-gemma")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--modes", default="eager,device,captured", help="LLaDA2-mini's modes")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / speed.RESULTS))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("families: no CUDA GPU here (`--device cpu --small`: the rehearsal).")
        return 0
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    limits = speed.device_limits(name, None, None)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{name}; torch {torch.__version__}; batches {batches}\n{HEADER}\n" + "|---" * 9 + "|", flush=True)
    families = args.families.split(",")
    rows: list[dict] = []
    llada2 = None
    if "llada2-mini" in families:  # eager and on the device first, the minute of compiling last
        llada2 = speed.build_model(LLADA2_SMALL if args.small else LLADA2_MINI, device, torch.bfloat16)
        modes = [m for m in ("eager", "device") if m in args.modes.split(",")]
        rows += llada2_rows(llada2, args, device, batches, modes, cuda, limits)
        write(rows, name, args)
    if "diffusion-gemma" in families:
        rows += gemma_rows(args, device, batches, cuda, limits)
        write(rows, name, args)
        if cuda:
            torch.cuda.empty_cache()
    if llada2 is not None and "captured" in args.modes.split(","):
        rows += llada2_rows(llada2, args, device, batches, ("captured",), cuda, limits)
        write(rows, name, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
