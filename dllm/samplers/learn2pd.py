"""Learn2PD ("Learning to Parallel Decode", arXiv 2509.25188), as its released code: LLaDA's schedule plus the
commits a small trained filter accepts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import torch

from dllm.core.errors import CheckpointError, ConfigError
from dllm.core.params import hp
from dllm.kernels.reference import ScoreSpec, top_k_per_row
from dllm.samplers.base import Sampler
from dllm.samplers.confidence import Schedule

FILTER_FILE = "learn2pd_filter.safetensors"  # a checkpoint directory's own filter (the bundled models ship one)


class Filter(torch.nn.Module):
    """The filter f_θ: a block's confidences [..., n] in, one accept logit per slot out. The official definition
    (``model/small_model.py``, ``LogisticRegression(input_dim=32)``) and weights are not published; the paper
    describes a ~2K-parameter two-layer network, which this is: Linear(n, n), ReLU, Linear(n, n) (2,112 parameters
    at n = 32)."""

    def __init__(self, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.hidden = torch.nn.Linear(block_size, block_size)
        self.out = torch.nn.Linear(block_size, block_size)

    def forward(self, confidence: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(confidence)))

    def save(self, path, **metadata) -> None:
        """Write the filter as safetensors, its block size and ``metadata`` (how it was trained) in the header."""
        from safetensors.torch import save_file

        info = {"block_size": str(self.block_size), **{k: json.dumps(v) for k, v in metadata.items()}}
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path), info)

    @classmethod
    def load(cls, path) -> Filter:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(
                f"no Learn2PD filter file at {path}: train one with `python -m dllm.train.learn2pd --model MODEL "
                "--out FILE` and pass learn2pd's filter=FILE"
            )
        try:
            with safe_open(str(path), "pt") as f:
                block_size = int((f.metadata() or {})["block_size"])
                state = {name: f.get_tensor(name) for name in f.keys()}
            module = cls(block_size)
            module.load_state_dict(state)
        except Exception as e:  # not safetensors, no block size, other shapes
            raise CheckpointError(f"{path} is not a Learn2PD filter file ({type(e).__name__}: {e})") from None
        return module.eval().requires_grad_(False)


def filter_path(model) -> Path | None:
    """The filter file a model's checkpoint directory holds (bundled or local), or None."""
    from dllm.models.loading import BUNDLED

    name = getattr(model, "name_or_path", None)
    if name is None:
        return None
    directory = BUNDLED.get(name) or Path(name).expanduser()
    path = Path(directory) / FILTER_FILE
    return path if path.is_file() else None


@dataclasses.dataclass(frozen=True)
class Learn2PD(Sampler):
    """Learn2PD (arXiv 2509.25188): LLaDA's reference schedule, plus every mask of the block that a small trained
    filter accepts from the block's confidences.

    Each step: the proposals' probabilities over the current block's ``block_size`` slots (decoded ones too: the
    model's probability of its argmax there) go through the filter; the masks whose ``sigmoid(logit)`` exceeds
    ``accept_thres`` are committed, and with them the step's LLaDA quota of most confident masks (the schedule of
    ``steps``; the official scripts: ``steps`` = the generation length, one a step). A block ends once it holds no
    mask, so the filter's commits save forwards.

    The filter: ``filter`` names a file (:class:`Filter`, written by ``python -m dllm.train.learn2pd``); None takes
    the model's own (a bundled model ships one, trained by that recipe on its training tasks). Its block size must
    be the generation's.

    Official code reproduced: ims-kdks/Learning-to-Parallel-Decoding ``llada/generate.py``,
    ``generate_learn2parallel`` (its ``L2P`` method). Defaults: its ``eval_llada.sh``: ``accept_thres`` 0.96,
    block 32, ``steps`` = the generation length. The training recipe is its ``generate_training_data.py`` and
    ``train.ipynb`` (:mod:`dllm.train.learn2pd`).

    Differences: batched (the official is batch 1); exact confidence ties in the quota's top-k go to the leftmost
    slot (``torch.topk``'s order is unspecified); where a step's quota exceeds the block's masks left (``steps``
    below the generation length, after the filter's commits) the official top-k also takes slots at -inf, masks
    after the block among them, and here only the block's masks; the filter's definition is ours (see
    :class:`Filter`); any masked family, with no cache or the caches that compute the whole block (``prefix``,
    ``dual``; ``block`` on block-causal models), since the filter reads every slot of it. EoTP (its ``L2P+EoT``) is
    the ``eotp`` exit rule over this sampler (:class:`~dllm.samplers.eotp.EoTP`).
    """

    name: ClassVar[str] = "learn2pd"
    fixed_steps: ClassVar[bool] = False
    reads_steps: ClassVar[bool] = True  # the LLaDA quota of each step
    accept_thres: float = hp(0.96, "[0, 1]")
    filter: str | None = hp(None, note="a filter file; None: the model's own")

    def check_cache(self, model, cache):
        if cache is not None and cache.process == "masked" and cache.name not in ("prefix", "dual", "block"):
            raise ConfigError(
                f"learn2pd's filter reads every slot of the block, decoded ones too, which the {cache.name!r} cache "
                "does not compute: use the 'prefix' or 'dual' cache (on block-causal models 'block') or none"
            )

    def init_state(self, run):
        path = Path(self.filter) if self.filter is not None else filter_path(run.model)
        if path is None:
            raise ConfigError(
                f"learn2pd needs a trained filter and {run.model.name_or_path!r} has none: train one with "
                "`python -m dllm.train.learn2pd --model MODEL --out FILE` and pass filter=FILE"
            )
        module = Filter.load(path)
        if module.block_size != run.canvas.block_size:
            raise ConfigError(
                f"this Learn2PD filter ({path}) reads blocks of {module.block_size} slots; the generation's blocks "
                f"have {run.canvas.block_size}: pass block_size={module.block_size}, or train a filter for this size"
            )
        b = run.canvas.batch
        counts = torch.zeros(b, run.steps_per_block, dtype=torch.long, device=run.canvas.tokens.device)
        return FilterState(schedule=Schedule(counts), filter=module.to(run.model.device))

    def begin_block(self, step, state, rows):
        state.schedule.begin(step, rows)

    def score_spec(self, run):
        return ScoreSpec(need=frozenset({"prob"}), temperature=run.temperature)

    def select(self, step, state):
        prob, committable = step.scores.prob, step.committable
        columns = step.window(step.canvas.block_size)
        confidence = prob.gather(1, columns).to(torch.float32)
        accept = torch.sigmoid(state.filter(confidence)) > self.accept_thres
        accepted = torch.zeros_like(committable).scatter_(1, columns, accept) & committable
        quota = state.schedule.quota(step)
        return accepted | top_k_per_row(step.among_committable(prob), quota)


@dataclasses.dataclass
class FilterState:
    schedule: Schedule  # LLaDA's quota of each step of the block
    filter: Filter  # f_θ, on the model's device
