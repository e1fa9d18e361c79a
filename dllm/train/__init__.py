"""Train the tiny bundled models with each family's real objective; save them in the official layout.

    python -m dllm.train --family llada --out dllm/models/bundled/tiny-llada
    python -m dllm.train --family dream --out ...        # shifted prediction, AR warm start
    python -m dllm.train --family sdar --out ...         # block-causal, block size 4
    python -m dllm.train --family fast_dllm_v2 --out ... # block-causal and shifted, from tiny-dream's weights
    python -m dllm.train --family llada21 --out ...      # LLaDA2.1's editing objective, from tiny-llada2's weights
    python -m dllm.train --family diffusion_gemma --out ...  # uniform-state canvases, self-conditioning

Objective (masked diffusion, LLaDA GUIDELINES.md / SDAR training code): each training text is a prompt
followed by a response of G slots (the reference completion, then EOS up to the end, as LLaDA's SFT data
is EOS-padded, so that fixed-length generation learns to stop; G is drawn per batch up to
the task's generation length, so that shorter generation lengths work too). Per row a noise level
t ~ U(eps, 1); each response slot is masked with probability t; the loss is the cross-entropy on the
masked slots weighted by 1/t, summed and divided by the number of response slots.
- LLaDA: bidirectional attention, slot i predicted at position i.
- Dream: the same through the Dream adapter, whose aligned logits read the network's output at i-1
  (the shifted, AR-style prediction Dream is trained with), after ``ar_steps`` of causal next-token
  training with the same read-out (Dream-v0 is adapted from the autoregressive Qwen2.5).
- SDAR: block-causal attention; the noisy sequence is concatenated with the clean one and each noisy
  block attends to itself and to the clean earlier blocks (BD3-LM's training mask), so training sees
  exactly what decoding sees: clean finished blocks and a partly masked current block.
- Fast-dLLM v2: SDAR's block diffusion read out with Dream's shift (a block's first column from the clean
  previous block's last output, as its decoding reads it), each batch with its complementary masks as well (every
  response slot is masked in one of the two copies, the paper's complementary masking), started from an AR-adapted
  model's weights, ``init_from`` tiny-dream (Fast-dLLM v2 adapts Qwen2.5-Instruct: same Qwen2 layers, same shift).
- LLaDA2.1 (``--family llada21``, a recipe of the llada2 family): SDAR's block diffusion (mask-to-token) plus
  token-to-token editing, a share ``edit_ratio`` of the visible response slots replaced by random tokens and every
  visible response slot trained to its clean token (the LLaDA2.1 report's random-corruption T2T training).
- WeDLM: causal attention; after ``ar_steps`` of next-token training (WeDLM starts from Qwen2.5 / Qwen3),
  WeDLM's dual-stream masking with intra-block reordering and its auxiliary AR loss
  (:mod:`dllm.train.dual_stream`): ``python -m dllm.train --family wedlm --out ...``.
- DiffusionGemma: no mask token; uniform-state block diffusion over its canvases (each canvas's slots replaced by
  uniform ids at its own level, every slot predicted, the encoder's clean context, self-conditioning on a first pass
  half the time): :mod:`dllm.train.uniform_state`.
The forwards these objectives read (block diffusion, causal next-token) are the models' own
(:mod:`dllm.models.training`), shared with the likelihood estimators of :mod:`dllm.eval`.
Each family's steps, learning rate and warm-up (Dream's also its AR warm start) are its ``RECIPES``
entry (so the commands above reproduce the bundled models; any option overrides). Everything (data, init,
noise) comes from one seed. The config, the loss curve and the metrics are written next to the weights in
``training.json`` (+ ``loss.png``).
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
from dllm.models.loading import build
from dllm.models.saving import random_init_, save
from dllm.models.tiny import tiny_config
from dllm.models.training import block_diffusion_logits, causal_outputs, next_token_cross_entropy
from dllm.tasks.arith import Arith
from dllm.train.dual_stream import dual_stream_loss
from dllm.train.levels import noise_levels
from dllm.train.uniform_state import uniform_state_loss

MIXTURE = {"arith": 0.45, "listops": 0.25, "shuffle": 0.15, "pick": 0.15}
# Per-family settings of the bundled models (the command line's defaults for --family F). The full-attention
# models learn to place copied items far more slowly than block-causal SDAR, which can copy what followed the
# last clean token; SDAR's step costs about twice theirs (its clean copy of the sequence). Measured: SDAR with
# 8,000 steps and arith / listops / shuffle / pick at 0.4 / 0.4 / 0.1 / 0.1 solved 95 % of the list operations
# but 68 % of the arithmetic (exact facts come last), 48 % of pick and 16 % of shuffle (n = 200 each, one token
# per step; it repeats items), hence more steps and a larger share for the tasks it had not learned.
# Dream with LLaDA's recipe (no warm start) solved 92 % of arith but 14 % of the list operations (it copied
# items from the wrong positions). With an autoregressive warm start (Dream itself starts from an AR model) the
# list operations, at 0 % after it, pass 60 % 1,000 diffusion steps later. Measured on one GPU, 500
# held-out problems each: 16,000 steps of which 4,000 AR: arith 88 %, listops 100 % (the same with batch 192
# instead of 48: 100 % and 100 %, but 5 h on a CPU); 20,000 steps of which 3,000 AR (the recipe, about 75 min
# on two CPU cores): 97 % and 100 %.
RECIPES = {
    "llada": {"steps": 16000, "lr": 1e-3, "warmup": 500},
    "dream": {"steps": 20000, "lr": 1e-3, "warmup": 500, "ar_steps": 3000},
    "sdar": {"steps": 12000, "lr": 2e-3, "warmup": 200},
    # LLaDA2: SDAR's objective (block diffusion with the clean prefix, LLaDA2.0's eq. 7) and SDAR's recipe (the
    # bundled tiny-llada2: about 155 min on two CPU cores; held-out, n = 64, it trails SDAR early, arith / listops
    # at 44 / 55 % at step 5,000 against SDAR's 72 / 83 %, and passes the bar by step 9,000). The experts' selection
    # bias stays at its initial zeros (the official training balances the load by updating it; not done here)
    "llada2": {"steps": 12000, "lr": 2e-3, "warmup": 200},
    # the bundled tiny-wedlm (two CPU threads, about 60 min: 0.14 s/step autoregressive, 0.28 s/step dual-stream,
    # whose sequence is twice as long). With the default mixture (11,000 steps, 3,000 AR) it solved arith but only
    # 35 % of the list operations (copying a list in order under causal attention: 5 % at step 4,500, 38 % at
    # 10,000); twice their share passes 95 % by step 4,500 (held-out, n = 64). With the EOS padding learned, the
    # 16-slot window filled that padding first and answered shuffle and pick with nothing (7.5 % and 5.5 %); ending
    # each response at its EOS (as a packed row ends a sample) gives 77.5 % and 100 %
    "wedlm": {
        "steps": 12000,
        "lr": 2e-3,
        "warmup": 300,
        "ar_steps": 2000,
        "block_size": 8,
        "mixture": {"arith": 0.25, "listops": 0.5, "shuffle": 0.125, "pick": 0.125},
        "eos_padding": False,
    },
    # the bundled tiny-llada21: tiny-llada2 trained on with LLaDA2.1's objective, mask-to-token plus token-to-token
    # (a tenth of the visible response slots replaced by random tokens, every visible slot trained to its clean
    # token), so that llada21's editing is measured on a model that learnt to edit: `--family llada21` (a recipe of
    # the llada2 family)
    "llada21": {
        "family": "llada2",
        "steps": 1200,
        "lr": 5e-4,
        "warmup": 100,
        "edit_ratio": 0.1,
        "init_from": "tiny-llada2",
        "eval_every": 400,
    },
    # the bundled tiny-fast-dllm-v2: tiny-dream's weights (its Qwen2 layers and shifted read-out) adapted to
    # block-causal attention over blocks of 8 (the sampler's default sub-block, 8, is the whole block: pass
    # small_block_size=4 for two sub-blocks), as Fast-dLLM v2 adapts Qwen2.5 with ~1B tokens
    "fast_dllm_v2": {
        "steps": 600,
        "lr": 5e-4,
        "warmup": 100,
        "block_size": 8,
        "complementary": True,
        "init_from": "tiny-dream",
        "eval_every": 200,
    },
    # the bundled tiny-diffusion-gemma: uniform-state block diffusion over canvases of 8 (dllm.train.uniform_state), its
    # sliding layers' window 4 canvases as the published model's (1024 : 256). With the tiny config's window of 8 (the
    # decoder's sliding layers see 7 encoded columns), 2,000 steps solved 42 % of arith and none of listops: copying
    # a list in order, or the previous line's number, rested on the two full-attention layers alone. 8,000 steps
    # (62 min on two CPU cores) solved 62 % of listops, held out and still rising; the run trained on to 20,000 from
    # its checkpoint (--steps 20000: a warm restart, restart_at 8,000; 118 min more), listops past 95 % by step 16,000
    "diffusion_gemma": {
        "steps": 20000,
        "restart_at": 8000,
        "lr": 2e-3,
        "warmup": 200,
        "block_size": 8,
        "sliding_window": 32,
        "eval_every": 1000,
    },
}


@dataclasses.dataclass
class TrainConfig:
    family: str = "llada"
    hidden: int = 192
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    block_size: int = 4  # SDAR's attention blocks; WeDLM's training blocks (dual-stream masking)
    max_prompt: int = 40
    max_new_tokens: int = 40
    steps: int = 4000
    batch_size: int = 48
    lr: float = 2e-3
    min_lr: float = 5e-5
    warmup: int = 200
    weight_decay: float = 0.01
    eps: float = 1e-3
    ar_steps: int = 0  # Dream, WeDLM: first train this many steps as a causal next-token LM (their AR init)
    mixture: dict = dataclasses.field(default_factory=lambda: dict(MIXTURE))
    # responses padded with EOS up to a random length, the padding learned (LLaDA's SFT); False: one EOS ends each
    # response and the rest is padding, neither attended nor scored (as packed rows end a sample: WeDLM's SFT)
    eos_padding: bool = True
    # each batch also with the complementary masks (Fast-dLLM v2): every response slot is masked in one of the copies
    complementary: bool = False
    # start from this model's weights (a bundled name or a checkpoint directory of the same shape), not random ones
    init_from: str | None = None
    # LLaDA2.1's token-to-token objective: this share of the visible response slots replaced by random tokens, and
    # every visible response slot trained to its clean token, beside mask-to-token (0: off)
    edit_ratio: float = 0.0
    # DiffusionGemma's sliding window (0: the tiny config's, 8); its published ratio to the canvas is 1024 : 256
    sliding_window: int = 0
    pool: int = 20000  # training examples drawn per task
    # a warm restart: the learning rate first decays as in a run of this many steps, then jumps to the cosine that
    # ends at ``steps`` and follows it (what resuming a finished run with a larger --steps does; 0: none)
    restart_at: int = 0
    eval_every: int = 500
    eval_n: int = 64
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"  # "cuda" trains in minutes; data and noise are drawn on the CPU either way

    def __post_init__(self):
        check_settings(dataclasses.asdict(self))


# The least value of each integer setting, and the open / closed range of each number (a CLI typo such as --steps 0
# used to save an untrained model and exit 0).
LEAST = {"warmup": 0, "ar_steps": 0, "seed": 0, "threads": 1, "sliding_window": 0, "restart_at": 0}
LEAST.update(dict.fromkeys(("hidden", "layers", "heads", "kv_heads", "intermediate", "block_size", "max_prompt"), 1))
LEAST.update(dict.fromkeys(("max_new_tokens", "steps", "batch_size", "pool", "eval_every", "eval_n"), 1))
RANGES = {"lr": (0.0, False), "min_lr": (0.0, True), "weight_decay": (0.0, True), "eps": (0.0, False)}
RANGES["edit_ratio"] = (0.0, True)
# Settings that may change when a run resumes from its checkpoint: the training up to the checkpoint is the same.
# A larger --steps trains on (the cosine schedule then decays to the new last step; a finished run's is recorded as
# restart_at, so that its config trains the same model from scratch).
RESUMABLE = ("steps", "eval_every", "eval_n", "threads", "device")


def check_settings(values: dict, spell=lambda name: name) -> None:
    """Every training setting in range, named as ``spell(name)`` (the command line: its flag), or a ConfigError."""
    families = [name for name, recipe in RECIPES.items() if "family" not in recipe]
    if values.get("family") not in families:
        others = ", ".join(name for name in RECIPES if name not in families)
        raise ConfigError(
            f"{spell('family')} must be one of {', '.join(families)} (on the command line also a recipe: {others}), "
            f"got {values.get('family')!r}"
        )
    for name, least in LEAST.items():
        value = values.get(name)
        if name == "threads" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{spell(name)} must be an integer >= {least}, got {value!r}")
    for name, (low, closed) in RANGES.items():
        value = values.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < low or (value == low and not closed):
            bound = ">=" if closed else ">"
            raise ConfigError(f"{spell(name)} must be a finite number {bound} {low:g}, got {value!r}")
    if values["restart_at"] and not values["warmup"] < values["restart_at"] < values["steps"]:
        raise ConfigError(
            f"{spell('restart_at')} (the step of a warm restart) must lie after the warm-up ({values['warmup']}) and "
            f"before the last step ({values['steps']}), or be 0 for none; got {values['restart_at']}"
        )
    if values["edit_ratio"] >= 1:
        raise ConfigError(f"{spell('edit_ratio')} (the share of visible slots replaced) must lie below 1")
    if values["sliding_window"] and values["family"] != "diffusion_gemma":
        raise ConfigError(f"{spell('sliding_window')} is DiffusionGemma's; {values['family']} has no sliding window")
    if values["family"] == "diffusion_gemma" and (values["complementary"] or values["edit_ratio"]):
        masked = spell("complementary") if values["complementary"] else spell("edit_ratio")
        raise ConfigError(
            f"{masked} is a masked-diffusion option; diffusion_gemma trains a uniform-state objective (no mask): "
            "leave it out"
        )
    if values["eps"] >= 1:
        raise ConfigError(f"{spell('eps')} (the least noise level) must lie below 1, got {values['eps']!r}")
    if values["ar_steps"] and values["ar_steps"] >= values["steps"]:
        raise ConfigError(
            f"{spell('ar_steps')}={values['ar_steps']} leaves no diffusion training in {spell('steps')}="
            f"{values['steps']}: the autoregressive warm start is the first part of the steps"
        )


class Data:
    """Tokenised training pool: left-padded prompts + EOS-padded responses, sampled by task mixture."""

    def __init__(self, cfg: TrainConfig, tokenizer, multiple: int = 1):
        from dllm import tasks

        self.cfg, self.eos = cfg, tokenizer.eos_token_id
        self.multiple = multiple  # responses a whole number of this many columns (DiffusionGemma's canvases)
        self.rng = random.Random(cfg.seed)
        self.pools, self.weights, self.skipped = {}, {}, 0
        self.lengths = {name: tasks.get(name).max_new_tokens for name in cfg.mixture}
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

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """tokens [n, P+G], valid [n, P+G] and P: ``n`` examples of one task (drawn by mixture weight),
        prompts left-padded with EOS to the longest (P), responses EOS-padded to a random length G between
        the longest target and the task's generation length, so that generation learns to stop anywhere
        (without ``eos_padding``, the columns after each response's EOS are not ``valid``)."""
        cfg = self.cfg
        name = self.rng.choices(list(self.pools), weights=list(self.weights.values()))[0]
        rows = [self.rng.choice(self.pools[name]) for _ in range(n)]
        p = max(len(prompt) for prompt, _ in rows)
        longest = max(len(target) for _, target in rows)
        g = self.rng.randint(longest, max(longest, min(cfg.max_new_tokens, self.lengths[name])))
        g = -(-g // self.multiple) * self.multiple
        tokens = torch.full((n, p + g), self.eos, dtype=torch.long)
        valid = torch.ones_like(tokens, dtype=torch.bool)
        for i, (prompt, target) in enumerate(rows):
            tokens[i, p - len(prompt) : p] = torch.tensor(prompt)
            tokens[i, p : p + len(target)] = torch.tensor(target)
            valid[i, : p - len(prompt)] = False
            if not cfg.eos_padding:
                valid[i, p + len(target) :] = False
        return tokens, valid, p


def unit_weights(model):
    """The parameters a fresh model starts at 1 (``random_init_``'s ``ones``): None (the RMSNorm scales), except for
    DiffusionGemma, whose norms, router and layer scales are its own (``starts_at_one``)."""
    from dllm.models.diffusion_gemma import DiffusionGemma, starts_at_one

    return starts_at_one(model) if isinstance(model, DiffusionGemma) else None


def next_token_loss(model, tokens, valid, prompt_len: int) -> torch.Tensor:
    """Causal language-model loss on the response: the AR warm start of Dream (Dream-v0 is adapted from the
    autoregressive Qwen2.5). The output at column i-1 predicts column i, the same read-out as Dream's shifted
    diffusion prediction, so the weights carry over to the diffusion phase."""
    return next_token_cross_entropy(causal_outputs(model, tokens, valid), tokens, valid, prompt_len)


def noise(response: torch.Tensor, cfg: TrainConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked [n, L], t [n, 1]): each row's noise level t ~ U(eps, 1), stratified over the batch, and its
    ``response`` slots masked with probability t. With ``cfg.complementary`` (Fast-dLLM v2), 2n rows: the n rows
    again with the complementary masks (each response slot masked in exactly one of a row's two copies, level 1 - t)."""
    t = noise_levels(response.shape[0], cfg.eps, generator)[:, None]
    masked = response & (torch.rand(response.shape, generator=generator) < t)
    if not cfg.complementary:
        return masked, t
    return torch.cat([masked, response & ~masked]), torch.cat([t, (1 - t).clamp(min=cfg.eps)])


def diffusion_loss(model, tokens, valid, prompt_len: int, cfg: TrainConfig, generator: torch.Generator):
    """Masked-diffusion loss of one batch; the response is everything after ``prompt_len``.

    The noise levels of the batch are stratified (one per slice of [0, 1), in random order: MDLM's
    low-discrepancy sampler), which keeps t ~ U(eps, 1) per row and lowers the loss's variance. Models decoded by
    a stream (WeDLM) train with the objective that matches it, :func:`dllm.train.dual_stream.dual_stream_loss`."""
    if model.uniform_state:
        return uniform_state_loss(model, tokens, valid, prompt_len, cfg, generator)
    if model.attention.process == "stream":
        return dual_stream_loss(model, tokens, valid, prompt_len, cfg.block_size, generator)
    n, length = tokens.shape
    response = torch.zeros(n, length, dtype=torch.bool)
    response[:, prompt_len:] = True
    response &= valid.cpu()
    masked, t = noise(response, cfg, generator)
    if cfg.complementary:
        tokens, valid, response = tokens.repeat(2, 1), valid.repeat(2, 1), response.repeat(2, 1)
    edited, replacements = edits(response & ~masked, model.mask_id, model.vocab_size, cfg, generator)
    # the noise is drawn on the CPU (the same on every device), then follows the tokens
    t, masked = t.to(tokens.device), masked.to(tokens.device)
    noisy = tokens.masked_fill(masked, model.mask_id)
    if edited is not None:
        noisy = torch.where(edited.to(tokens.device), replacements.to(tokens.device), noisy)
    visible = (response.to(tokens.device) & ~masked) if edited is not None else None
    positions = model.positions(valid)
    if model.attention.block_causal:
        # the noisy half starts at the earliest block that holds a response slot (whole prompt blocks are clean)
        start = prompt_len - int((positions[:, prompt_len] % model.block_size).max())
        logits = block_diffusion_logits(model, noisy, tokens, positions, valid, start)
        masked = masked[:, start:]
        tokens = tokens[:, start:]
        visible = None if visible is None else visible[:, start:]
    else:
        logits = model.logits(noisy, positions, attention_mask=None if bool(valid.all()) else valid)
    ce = F.cross_entropy(logits[masked].float(), tokens[masked], reduction="none")
    weights = (1 / t).expand_as(masked)[masked]
    loss = (ce * weights).sum()
    if visible is not None:  # token-to-token: every visible response slot to its clean token, the replaced ones too
        loss = loss + F.cross_entropy(logits[visible].float(), tokens[visible], reduction="sum")
    return loss / response.sum()


def edits(visible: torch.Tensor, mask_id: int, vocab: int, cfg: TrainConfig, generator: torch.Generator):
    """LLaDA2.1's token-to-token corruption (arXiv 2602.08676): (edited bool [n, L], replacements long [n, L]), each
    ``visible`` (unmasked response) slot replaced with probability ``cfg.edit_ratio`` by a uniformly drawn token
    other than the mask; (None, None) when ``edit_ratio`` is 0 (nothing drawn: the other recipes' noise is
    unchanged)."""
    if not cfg.edit_ratio:
        return None, None
    edited = visible & (torch.rand(visible.shape, generator=generator) < cfg.edit_ratio)
    replacements = torch.randint(0, vocab - 1, visible.shape, generator=generator)
    return edited, replacements + (replacements >= mask_id).long()


def reference_generate(model, prompts: list[str], max_new_tokens: int):
    """The family's reference sampler at one token per step, with the bench runner's defaults (the quality
    bar's setting)."""
    from dllm import samplers
    from dllm.bench.runner import BenchConfig, resolve_generation

    sampler = samplers.reference(model.family)
    values = {"max_new_tokens": max_new_tokens, "block_size": BenchConfig.block_size, "temperature": 0.0}
    return sampler.generate(model, prompts, **resolve_generation(model, sampler, values))


def evaluate(model, task_names, n: int, seed: int = 0, batch_size: int = 32) -> dict:
    """Exact-match accuracy per task on ``n`` held-out examples with the reference sampler at each task's
    own generation length."""
    from dllm import tasks

    model.eval()
    scores = {}
    for name in task_names:
        task = tasks.get(name)
        examples = task.examples("test", n, seed=seed)
        correct = 0
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            out = reference_generate(model, [e.prompt for e in chunk], task.max_new_tokens)
            correct += sum(tasks.get(e.task).score(e, text) for e, text in zip(chunk, out.texts, strict=True))
        scores[name] = correct / len(examples)
    return scores


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at ``steps``; with ``restart_at``, first to ``min_lr`` at
    that step, then on the cosine that ends at ``steps`` (a warm restart)."""
    if step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    last = cfg.restart_at if step <= cfg.restart_at else cfg.steps
    progress = (step - cfg.warmup) / max(1, last - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig, out: Path, checkpoint: Path | None = None, log=print) -> dict:
    """Train, evaluate every ``eval_every`` steps and save the model (fp16, official layout) with
    ``training.json`` and ``loss.png`` at each evaluation. With ``checkpoint``, the full state (weights,
    optimiser, data and noise streams) is written there at each evaluation and training resumes from it
    when it exists, giving the same result as an uninterrupted run."""
    from dllm.models.placement import resolve_device
    from dllm.tasks.tokenizer import build_tokenizer

    resolve_device(cfg.device)  # a missing GPU fails here, with what to do, not deep inside torch
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.ar_steps and cfg.family not in ("dream", "wedlm"):
        raise ConfigError(f"--ar-steps is for Dream's shifted prediction and WeDLM; {cfg.family} has no AR read-out")
    if cfg.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: several times faster, ample for training
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
    if cfg.sliding_window:
        config["text_config"]["sliding_window"] = cfg.sliding_window
    model = build(config)
    random_init_(model, std=0.02, seed=cfg.seed, ones=unit_weights(model))
    if cfg.init_from:
        _warm_start(model, cfg.init_from, log)
    model.tokenizer = tokenizer
    model.eos_ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    params = sum(p.numel() for p in model.parameters())
    model.to(cfg.device)
    data = Data(cfg, tokenizer, multiple=model.block_size if model.uniform_state else 1)
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
    state = {"step": 0, "curve": [], "evals": [], "seconds": 0.0, "running": None}
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False, map_location=cfg.device)
        finished, grows = saved["state"]["step"] == saved["config"]["steps"], cfg.steps > saved["config"]["steps"]
        restart = saved["config"].get("restart_at", 0)
        if finished and grows:
            if restart:
                raise ConfigError(
                    f"checkpoint {checkpoint} finished a run that already restarted at step {restart}; a run restarts "
                    "once (its config reproduces it): train on under another --checkpoint with --init-from"
                )
            # a finished run trained on: a warm restart at its last step, recorded so that the config reproduces it
            restart = saved["config"]["steps"]
        # the restart is the checkpoint's (the same command resumes a restarted run); another one is refused below
        cfg = dataclasses.replace(cfg, restart_at=cfg.restart_at or restart)
        now = dataclasses.asdict(cfg)
        other = {k: v for k, v in saved["config"].items() if k not in RESUMABLE and now.get(k) != v}
        other.pop("restart_at", None)
        if now["restart_at"] != restart:
            other["restart_at"] = restart
        if other:
            changed = ", ".join(f"{k} {v!r} (now {now.get(k)!r})" for k, v in other.items())
            raise ConfigError(
                f"checkpoint {checkpoint} was written with another training config: {changed}; give the same "
                "settings (only steps, eval_every, eval_n, threads and device may change), or remove it"
            )
        if cfg.steps < saved["state"]["step"]:
            raise ConfigError(
                f"checkpoint {checkpoint} is at step {saved['state']['step']}, past steps={cfg.steps}: give as many "
                "steps or more"
            )
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"].cpu())
        data.rng.setstate(saved["data_rng"])
        state = saved["state"]
        more = saved["config"]["steps"] != cfg.steps
        log(
            f"resumed from {checkpoint} at step {state['step']}"
            + (f"; training on to step {cfg.steps} (the learning rate now decays to it)" if more else "")
            + (f", a warm restart (recorded as restart_at={cfg.restart_at})" if finished and grows else "")
        )
    start = time.time() - state["seconds"]
    for step in range(state["step"] + 1, cfg.steps + 1):
        lr = learning_rate(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        tokens, valid, prompt_len = data.batch(cfg.batch_size)
        tokens, valid = tokens.to(cfg.device), valid.to(cfg.device)
        if step <= cfg.ar_steps:
            loss = next_token_loss(model, tokens, valid, prompt_len)
        else:
            loss = diffusion_loss(model, tokens, valid, prompt_len, cfg, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = state["running"]
        state["running"] = running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        state["step"], state["seconds"] = step, round(time.time() - start, 1)
        if step % 50 == 0 or step == 1 or step == cfg.steps:  # the last step too: a short run has a curve
            state["curve"].append({"step": step, "loss": round(running, 4), "lr": lr, "seconds": state["seconds"]})
            log(f"step {step}/{cfg.steps} loss {running:.4f} lr {lr:.2e} {state['seconds']:.0f}s")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            scores = evaluate(model, ["arith", "listops"], cfg.eval_n, seed=cfg.seed)
            state["evals"].append({"step": step, **scores})
            log(f"step {step}: held-out accuracy {scores}")
            _save(model, tokenizer, cfg, params, state, out)
            if checkpoint is not None:
                payload = {
                    "config": dataclasses.asdict(cfg),
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": generator.get_state(),
                    "data_rng": data.rng.getstate(),
                    "state": state,
                }
                checkpoint.parent.mkdir(parents=True, exist_ok=True)
                torch.save(payload, checkpoint.with_suffix(".tmp"))
                checkpoint.with_suffix(".tmp").replace(checkpoint)  # never a half-written checkpoint
    model.eval()
    return _save(model, tokenizer, cfg, params, state, out)


def _warm_start(model, source: str, log) -> None:
    """Copy the weights of the model ``source`` (a bundled name or a checkpoint directory) into ``model``: every
    tensor, each of the same shape (another family of the same layers: Dream's for Fast-dLLM v2)."""
    from dllm.models.loading import load

    donor = load(source, device="cpu", dtype=torch.float32).state_dict()
    own = model.state_dict()
    wrong = [k for k in own if k not in donor or donor[k].shape != own[k].shape]
    if wrong or set(donor) - set(own):
        raise ConfigError(
            f"--init-from {source}: its weights do not fit this model ({len(wrong)} tensors missing or of another "
            f"shape, e.g. {(wrong or sorted(set(donor) - set(own)))[0]!r}); give a model of the same family layers "
            "and sizes (--hidden, --layers, --heads, --kv-heads, --intermediate)"
        )
    model.load_state_dict(donor)
    log(f"started from the weights of {source}")


def _save(model, tokenizer, cfg: TrainConfig, params: int, state: dict, out: Path) -> dict:
    record = {
        "family": cfg.family,
        "config": dataclasses.asdict(cfg),
        "parameters": params,
        "steps_done": state["step"],
        "seconds": state["seconds"],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loss_curve": state["curve"],
        "evals": state["evals"],
    }
    save(model, out, tokenizer=tokenizer, dtype=torch.float16)
    # the default generation length of `dllm generate`: the arithmetic task's (the longest answers)
    generation = {"max_new_tokens": Arith.max_new_tokens, "eos_token_id": list(model.eos_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    _plot(state["curve"], out / "loss.png", f"{Path(out).resolve().name} ({cfg.family}, {state['step']} steps)")
    return record


def loss_figure(curve, title: str):
    """The smoothed loss against the step (markers on every point when there are few, so that a short run's
    one or two points show), titled with the output directory's name and the family."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3), layout="tight")
    ax = fig.subplots()
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], marker="o" if len(curve) < 20 else None)
    ax.set(xlabel="step", ylabel="loss (smoothed)", title=title, yscale="log")
    return fig


def _plot(curve, path: Path, title: str) -> None:
    try:
        fig = loss_figure(curve, title)
    except ImportError:  # plots are a convenience; the numbers are in training.json
        return
    fig.savefig(path, dpi=100)


def _format_mixture(mixture: dict) -> str:
    return ",".join(f"{name}={share:g}" for name, share in mixture.items())


def _parse_mixture(text: str) -> dict:
    """``arith=0.45,listops=0.25`` -> {"arith": 0.45, "listops": 0.25} (shares are relative weights)."""
    from dllm import tasks

    mixture = {}
    for item in text.split(","):
        name, _, share = item.partition("=")
        name = name.strip()
        try:
            mixture[name] = float(share)
        except ValueError:
            raise ConfigError(
                f"--mixture wants task=share pairs like {_format_mixture(MIXTURE)}; got {item!r}"
            ) from None
        if name not in tasks.names():
            raise ConfigError(f"--mixture: unknown task {name!r}; tasks: {', '.join(tasks.names())}")
        if not mixture[name] > 0 or not math.isfinite(mixture[name]):
            raise ConfigError(f"--mixture: the share of {name!r} must be a positive number, got {share}")
    return mixture


def main(argv=None) -> int:
    from dllm.core.commands import exit_status

    parser = argparse.ArgumentParser(prog="python -m dllm.train", description="Train a tiny bundled diffusion model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", default=None, help="resumable training state (written at each eval)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "mixture":
            special = ", ".join(f"{o}: {_format_mixture(r['mixture'])}" for o, r in RECIPES.items() if "mixture" in r)
            default = _format_mixture(MIXTURE) + (f" ({special})" if special else "")
            parser.add_argument("--mixture", default=None, help=f"task shares, default: {default}")
            continue
        kind = str if f.name == "init_from" else type(f.default) if f.default is not None else int
        owners = [family for family, recipe in RECIPES.items() if f.name in recipe]
        if f.name == "family":
            variants = ", ".join(f"{name}: {r['family']}'s" for name, r in RECIPES.items() if "family" in r)
            text = f"a family, or one of its other recipes ({variants}); default: {f.default}"
            parser.add_argument("--family", default=None, help=text)
            continue
        if len(owners) == len(RECIPES):
            default = "the family's recipe"
        elif owners:
            default = f"{f.default} ({', '.join(f'{o}: {RECIPES[o][f.name]}' for o in owners)})"
        else:
            default = f.default
        flag, text = "--" + f.name.replace("_", "-"), f"default: {default}"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, type=kind, default=None, help=text)
    args = vars(parser.parse_args(argv))
    out = Path(args.pop("out"))
    checkpoint = args.pop("checkpoint")

    def resume() -> str:
        if checkpoint:
            return f"resume with the same command: it goes on from {checkpoint}, written at each evaluation"
        return f"the model of the last evaluation is in {out}; with --checkpoint FILE a run can be resumed"

    return exit_status(parser.prog, lambda: run(args, out, checkpoint), resume=resume)


def run(args: dict, out: Path, checkpoint: str | None) -> int:
    if args["mixture"] is not None:
        args["mixture"] = _parse_mixture(args["mixture"])
    recipe = args["family"] or TrainConfig.family  # a family, or a recipe naming its family (llada21: llada2)
    values = {**dataclasses.asdict(TrainConfig()), **RECIPES.get(recipe, {})}
    args["family"] = values["family"] if "family" in RECIPES.get(recipe, {}) else args["family"]
    values.update({k: v for k, v in args.items() if v is not None})
    own = RECIPES.get(recipe, {})
    if own.get("restart_at") and args.get("restart_at") is None and values["steps"] != own["steps"]:
        values["restart_at"] = 0  # a recipe's warm restart belongs to its own steps: another --steps has none
    check_settings(values, spell=lambda name: "--" + name.replace("_", "-"))  # in the command line's words
    record = train(TrainConfig(**values), out, Path(checkpoint) if checkpoint else None)
    print(json.dumps(record["evals"][-1] if record["evals"] else {}))
    return 0
