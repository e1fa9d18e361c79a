"""Train the tiny bundled models with each family's real objective; save them in the official layout.

    python -m dllm.bench.train --family llada --out dllm/models/bundled/tiny-llada
    python -m dllm.bench.train --family dream --out ...        # same objective, shifted prediction
    python -m dllm.bench.train --family sdar --out ...         # block-causal, block size 4

Objective (masked diffusion, LLaDA GUIDELINES.md / SDAR training code): each training text is a prompt
followed by a response of ``max_new_tokens`` slots (the reference completion, then EOS up to the end, as
LLaDA's SFT data is EOS-padded, so that fixed-length generation learns to stop). Per row a noise level
t ~ U(eps, 1); each response slot is masked with probability t; the loss is the cross-entropy on the
masked slots weighted by 1/t, summed and divided by the number of response slots.
- LLaDA: bidirectional attention, slot i predicted at position i.
- Dream: the same through the Dream adapter, whose aligned logits read the network's output at i-1
  (the shifted, AR-style prediction Dream is trained with).
- SDAR: block-causal attention; the noisy sequence is concatenated with the clean one and each noisy
  block attends to itself and to the clean earlier blocks (BD3-LM's training mask), so training sees
  exactly what decoding sees: clean finished blocks and a partly masked current block.
Everything (data, init, noise) comes from one seed. The config, the loss curve and the metrics are
written next to the weights in ``training.json`` (+ ``loss.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dllm.core.errors import ConfigError
from dllm.models.layers import ForwardContext
from dllm.models.loading import build
from dllm.models.saving import random_init_, save
from dllm.models.tiny import tiny_config

MIXTURE = {"arith": 0.45, "listops": 0.35, "shuffle": 0.1, "pick": 0.1}


@dataclasses.dataclass
class TrainConfig:
    family: str = "llada"
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 768
    block_size: int = 4  # SDAR only
    max_prompt: int = 48
    max_new_tokens: int = 64
    steps: int = 4000
    batch_size: int = 64
    lr: float = 1e-3
    min_lr: float = 5e-5
    warmup: int = 200
    weight_decay: float = 0.01
    eps: float = 1e-3
    mixture: dict = dataclasses.field(default_factory=lambda: dict(MIXTURE))
    pool: int = 20000  # training examples drawn per task
    eval_every: int = 500
    eval_n: int = 64
    seed: int = 0
    threads: int | None = None


class Data:
    """Tokenised training pool: left-padded prompts + EOS-padded responses, sampled by task mixture."""

    def __init__(self, cfg: TrainConfig, tokenizer):
        from dllm.bench import tasks

        self.cfg, self.eos = cfg, tokenizer.eos_token_id
        self.rng = random.Random(cfg.seed)
        self.pools, self.weights, self.skipped = {}, {}, 0
        for name, weight in cfg.mixture.items():
            rows = []
            for ex in tasks.get(name).examples("train", cfg.pool, seed=cfg.seed):
                prompt = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
                target = tokenizer(ex.target, add_special_tokens=False)["input_ids"] + [self.eos]
                if len(prompt) > cfg.max_prompt or len(target) > cfg.max_new_tokens:
                    self.skipped += 1
                    continue
                rows.append((prompt, target))
            if not rows:
                raise ConfigError(f"task {name!r} has no example within max_prompt / max_new_tokens")
            self.pools[name], self.weights[name] = rows, weight

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [n, P+G] (prompts left-padded with EOS), valid [n, P+G]."""
        cfg = self.cfg
        names = self.rng.choices(list(self.pools), weights=list(self.weights.values()), k=n)
        tokens = torch.full((n, cfg.max_prompt + cfg.max_new_tokens), self.eos, dtype=torch.long)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        for i, name in enumerate(names):
            prompt, target = self.rng.choice(self.pools[name])
            start = cfg.max_prompt - len(prompt)
            tokens[i, start : cfg.max_prompt] = torch.tensor(prompt)
            tokens[i, cfg.max_prompt : cfg.max_prompt + len(target)] = torch.tensor(target)
            valid[i, :start] = False
        return tokens, valid


def block_diffusion_logits(model, noisy, clean, positions, valid) -> torch.Tensor:
    """Logits of the noisy half of ``[noisy ; clean]`` under BD3-LM's mask (SDAR training)."""
    n, length = noisy.shape
    block = positions // model.block_size
    q_block = torch.cat([block, block], 1)[:, :, None]
    k_block = torch.cat([block, block], 1)[:, None, :]
    q_noisy = (torch.arange(2 * length) < length)[None, :, None]
    k_noisy = (torch.arange(2 * length) < length)[None, None, :]
    allowed = (q_noisy & k_noisy & (k_block == q_block)) | (q_noisy & ~k_noisy & (k_block < q_block))
    allowed |= ~q_noisy & ~k_noisy & (k_block <= q_block)
    allowed &= torch.cat([valid, valid], 1)[:, None, :]
    allowed |= torch.eye(2 * length, dtype=torch.bool)[None]  # pad rows attend to themselves
    ctx = ForwardContext(rows=None, length=2 * length, mask=allowed[:, None], kv=None, write=False)
    ids = torch.cat([noisy, clean], 1)
    return model._forward(ids, torch.cat([positions, positions], 1), ctx)[:, :length]


def diffusion_loss(model, tokens, valid, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    n = tokens.shape[0]
    response = torch.zeros_like(valid)
    response[:, cfg.max_prompt :] = True
    t = cfg.eps + (1 - cfg.eps) * torch.rand(n, 1, generator=generator)
    masked = response & (torch.rand(tokens.shape, generator=generator) < t)
    noisy = tokens.masked_fill(masked, model.mask_id)
    positions = model.positions(valid)
    if model.attention == "block":
        logits = block_diffusion_logits(model, noisy, tokens, positions, valid)
    else:
        logits = model.logits(noisy, positions, attention_mask=None if bool(valid.all()) else valid)
    ce = F.cross_entropy(logits[masked].float(), tokens[masked], reduction="none")
    weights = (1 / t).expand_as(masked)[masked]
    return (ce * weights).sum() / (n * cfg.max_new_tokens)


def reference_generate(model, prompts: list[str], max_new_tokens: int):
    """The family's reference sampler at one token per step (the quality bar's setting)."""
    from dllm import samplers

    if model.attention == "block":
        sampler = samplers.get("sdar", remasking_strategy="low_confidence_static")
        return sampler.generate(model, prompts, max_new_tokens=max_new_tokens, steps_per_block=model.block_size)
    name = "dream" if model.family == "dream" else "llada"
    return samplers.get(name).generate(
        model, prompts, max_new_tokens=max_new_tokens, block_size=max_new_tokens, steps=max_new_tokens
    )


def evaluate(model, task_names, n: int, max_new_tokens: int, seed: int = 0, batch_size: int = 32) -> dict:
    """Exact-match accuracy per task on ``n`` held-out examples with the reference sampler."""
    from dllm.bench import tasks

    model.eval()
    scores = {}
    for name in task_names:
        task = tasks.get(name)
        examples = task.examples("test", n, seed=seed)
        correct = 0
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            out = reference_generate(model, [e.prompt for e in chunk], max_new_tokens)
            correct += sum(tasks.get(e.task).score(e, text) for e, text in zip(chunk, out.texts, strict=True))
        scores[name] = correct / len(examples)
    return scores


def train(cfg: TrainConfig, out: Path, log=print) -> dict:
    from dllm.bench.tokenizer import build_tokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    config = tiny_config(
        cfg.family,
        len(tokenizer),
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        block_size=cfg.block_size,
        max_length=4 * (cfg.max_prompt + cfg.max_new_tokens),
        intermediate=cfg.intermediate,
    )
    model = build(config)
    random_init_(model, std=0.02, seed=cfg.seed)
    model.tokenizer = tokenizer
    model.eos_ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    params = sum(p.numel() for p in model.parameters())
    data = Data(cfg, tokenizer)
    log(
        f"{cfg.family}: {params / 1e6:.2f} M parameters; pool {sum(map(len, data.pools.values()))} examples "
        f"({data.skipped} too long, skipped)"
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    curve, evals, start = [], [], time.time()
    running = None
    for step in range(1, cfg.steps + 1):
        lr = (
            cfg.lr * step / cfg.warmup
            if step <= cfg.warmup
            else cfg.min_lr
            + 0.5
            * (cfg.lr - cfg.min_lr)
            * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        tokens, valid = data.batch(cfg.batch_size)
        loss = diffusion_loss(model, tokens, valid, cfg, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0 or step == 1:
            curve.append({"step": step, "loss": round(running, 4), "lr": lr, "seconds": round(time.time() - start, 1)})
            log(f"step {step}/{cfg.steps} loss {running:.4f} lr {lr:.2e} {time.time() - start:.0f}s")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            scores = evaluate(model, ["arith", "listops"], cfg.eval_n, cfg.max_new_tokens, seed=cfg.seed)
            evals.append({"step": step, **scores})
            log(f"step {step}: held-out accuracy {scores}")
    model.eval()
    record = {
        "family": cfg.family,
        "config": dataclasses.asdict(cfg),
        "parameters": params,
        "seconds": round(time.time() - start, 1),
        "torch": torch.__version__,
        "loss_curve": curve,
        "evals": evals,
    }
    save(model, out, tokenizer=tokenizer, dtype=torch.float16)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(curve, out / "loss.png", cfg.family)
    return record


def _plot(curve, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are a convenience; the numbers are in training.json
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve])
    ax.set(xlabel="step", ylabel="loss (smoothed)", title=f"tiny-{title}", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Train a tiny bundled diffusion model")
    parser.add_argument("--out", required=True)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "mixture":
            continue
        kind = type(f.default) if f.default is not None else int
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = vars(parser.parse_args(argv))
    out = Path(args.pop("out"))
    cfg = TrainConfig(**args)
    if cfg.family not in ("llada", "dream", "sdar"):
        raise SystemExit(f"--family must be llada, dream or sdar, got {cfg.family!r}")
    record = train(cfg, out)
    print(json.dumps(record["evals"][-1] if record["evals"] else {}))


if __name__ == "__main__":
    main()
