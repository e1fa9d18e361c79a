"""Train a Learn2PD filter (:class:`dllm.samplers.learn2pd.Filter`) for a model, as the paper's recipe
(ims-kdks/Learning-to-Parallel-Decoding ``generate_training_data.py`` and ``train.ipynb``):

1. for each training prompt, decode it with the family's reference sampler at one token a step (no EOS stop, every
   block): the reference answer y;
2. decode it again "extremely greedy": at each step of a block, one forward, then every slot of the block whose
   argmax equals y is written (a block whose argmax did not change since the last step is set to y); each step
   records the block's confidences (the probability of each slot's argmax, decoded slots too) and which slots'
   argmax equals y: the filter's inputs and targets;
3. train the filter on them, 80 / 10 / 10 split, BCE with logits, AdamW (lr 3e-3), full batch, 40,000 epochs.

    python -m dllm.train.learn2pd --model tiny-llada --block-size 8 --out FILE
    python -m dllm.train.learn2pd --model tiny-llada --block-size 8 --bundle   # into the bundled model's directory

The prompts are the bench tasks' training split (never their test split, which the bench scores), at each task's
generation length. The official data is FLAN's prompts on LLaDA-8B-Instruct (minutes on a GPU); on a bundled tiny
model, 100 prompts per task, it runs in 3-7 minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

TASKS = ("arith", "listops", "shuffle", "pick")


@dataclass
class Records:
    confidence: torch.Tensor  # float32 [N, block]: each recorded step's block confidences
    correct: torch.Tensor  # float32 [N, block]: whether each slot's argmax is the reference's token


@torch.no_grad()
def oracle_records(model, prompt: torch.Tensor, max_new_tokens: int, block_size: int) -> Records:
    """The records of one prompt (long [P]): the reference decode, then the extremely greedy one (see above)."""
    import dllm

    ids = prompt[None].to(model.device)
    sampler = dllm.samplers.reference(model.family)
    # one token a step: a block-causal model's steps are per block
    steps = {"steps_per_block": block_size} if model.attention.block_causal else {"steps": max_new_tokens}
    kw = {"max_new_tokens": max_new_tokens, "block_size": block_size, "eos_early_stop": False, **steps}
    first = int(sampler.prepare(model, ids, **kw).canvas.first_block[0])  # the blocks the sampler decodes
    y = sampler.generate(model, ids, **kw).sequences[0].to(model.device)
    p = ids.shape[1]
    x = torch.cat([ids[0], torch.full((y.shape[0] - p,), model.mask_id, device=model.device)])[None]
    confidences, corrects = [], []
    for start in range(first, y.shape[0], block_size):
        block = slice(start, start + block_size)
        previous = None
        for _ in range(4 * block_size + 4):  # (each step writes a slot or sets the block: a cap, never reached)
            if not (x[0, block] == model.mask_id).any():
                break
            logits = model(x)[0].float()
            logits[:, model.mask_id] = float("-inf")
            probs = logits.softmax(-1)
            confidence, token = probs.max(-1)
            correct = token[block] == y[block]
            confidences.append(confidence[block])
            corrects.append(correct.float())
            if previous is not None and torch.equal(token[block], previous):
                x[0, block] = y[block]
                continue
            x[0, block] = torch.where(correct, token[block], x[0, block])
            previous = token[block]
    return Records(torch.stack(confidences).cpu(), torch.stack(corrects).cpu())


def records_for(model, block_size: int, n: int, seed: int = 0, tasks=TASKS, progress: bool = False) -> Records:
    """The records of ``n`` training prompts of each of ``tasks`` (the bench tasks' training split)."""
    from dllm import tasks as task_registry
    from dllm.engine.prompts import encode

    out = []
    examples = [(task, ex) for task in tasks for ex in task_registry.get(task).examples("train", n, seed=seed)]
    for i, (task, ex) in enumerate(examples):
        ids, _ = encode(model, ex.prompt)
        out.append(oracle_records(model, ids[0], task_registry.get(task).max_new_tokens, block_size))
        if progress and (i + 1) % 50 == 0:
            print(f"learn2pd: {i + 1} / {len(examples)} prompts decoded", file=sys.stderr)
    return Records(torch.cat([r.confidence for r in out]), torch.cat([r.correct for r in out]))


def train_filter(records: Records, epochs: int = 40_000, lr: float = 3e-3, seed: int = 0, progress: bool = False):
    """The filter trained on ``records`` (80 / 10 / 10 split, BCE with logits, AdamW, full batch) and its metrics on
    the held-out tenth: the loss and, accepting at sigmoid > 0.9 (the notebook's check), the share of accepted slots
    whose argmax is wrong (false positives) and the share of right ones accepted."""
    from dllm.samplers.learn2pd import Filter

    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(records.confidence.shape[0], generator=generator)
    x, y = records.confidence[order], records.correct[order]
    n = x.shape[0]
    train, val = int(n * 0.8), int(n * 0.8) + int(n * 0.1)
    torch.manual_seed(seed)
    module = Filter(x.shape[1])
    loss_fn = torch.nn.BCEWithLogitsLoss()
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
    for epoch in range(epochs):
        optimizer.zero_grad()
        loss = loss_fn(module(x[:train]), y[:train])
        loss.backward()
        optimizer.step()
        if progress and epoch % 5000 == 0:
            print(f"learn2pd: epoch {epoch}: loss {loss.item():.4f}", file=sys.stderr)
    module.eval().requires_grad_(False)
    with torch.no_grad():
        logits = module(x[val:])
        accepted = torch.sigmoid(logits) > 0.9
        right = y[val:] > 0.5
        metrics = {
            "train_loss": round(loss.item(), 5),
            "test_loss": round(loss_fn(logits, y[val:]).item(), 5),
            "test_false_positive": round((accepted & ~right).sum().item() / max(accepted.sum().item(), 1), 5),
            "test_recall": round((accepted & right).sum().item() / max(right.sum().item(), 1), 5),
            "records": n,
        }
    return module, metrics


def main(argv=None) -> int:
    import dllm
    from dllm.core.commands import exit_status
    from dllm.samplers.learn2pd import FILTER_FILE

    parser = argparse.ArgumentParser(prog="python -m dllm.train.learn2pd", description="Train a Learn2PD filter")
    parser.add_argument("--model", required=True, help="a bundled model name or a checkpoint directory")
    parser.add_argument("--block-size", type=int, required=True, help="the block size the filter reads (and decodes)")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="the filter file to write")
    out.add_argument("--bundle", action="store_true", help=f"write {FILTER_FILE} into the model's directory")
    parser.add_argument("--n", type=int, default=100, help="training prompts per task (default 100)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--epochs", type=int, default=40_000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def run():
        from dllm.models.loading import resolve

        model = dllm.load(args.model, device="cpu", dtype=torch.float32)
        tasks = tuple(t for t in args.tasks.split(",") if t)
        records = records_for(model, args.block_size, args.n, args.seed, tasks, progress=True)
        module, metrics = train_filter(records, args.epochs, args.lr, args.seed, progress=True)
        path = resolve(args.model) / FILTER_FILE if args.bundle else args.out
        recipe = {"model": args.model, "tasks": list(tasks), "n": args.n, "epochs": args.epochs, "lr": args.lr,
                  "seed": args.seed}  # fmt: skip
        module.save(path, recipe=recipe, metrics=metrics)
        print(json.dumps({"filter": str(path), **metrics}))
        return 0

    return exit_status("python -m dllm.train.learn2pd", run)


if __name__ == "__main__":
    sys.exit(main())
