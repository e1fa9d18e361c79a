"""Shared fixtures: tiny random checkpoints of every family, written in the official layout and loaded
through ``dllm.load`` exactly like a downloaded checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from typing import ClassVar

import pytest
import torch

import dllm
from dllm.models.tiny import make_tiny_checkpoint
from dllm.samplers.learn2pd import FILTER_FILE

FAMILIES = ["llada", "dream", "sdar", "llada2"]  # the masked-diffusion families (WeDLM, causal: tests/test_wedlm*.py)


def _import_triton_for_its_interpreter() -> None:
    """CI has no GPU: the Triton kernels run through Triton's interpreter (``TRITON_INTERPRET=1``). Triton builds
    its own jit'd library for the interpreter only when the variable is set as triton is first imported (torch
    may import it during any test), so it is imported here, before any test, with the variable set. The kernels'
    tests set the variable themselves while they run."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:  # without triton, kernel="triton" is refused with a ConfigError (tested)
        pass
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_for_its_interpreter()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Every test uses tiny models: one intra-op thread is faster than a pool (and immune to a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# the blocks a tiny checkpoint's Learn2PD filter reads: the tests' block size on full attention, the trained one (4)
# on block-causal models
LEARN2PD_BLOCKS = {"llada": 8, "dream": 8, "sdar": 4, "llada2": 4, "fast_dllm_v2": 4}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Directory of a tiny random checkpoint per family (session-wide, read-only by convention)."""
    cache = {}

    def make(family: str, **shape):
        key = (family, repr(sorted(shape.items())))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **shape)
            if family in LEARN2PD_BLOCKS:  # a filter beside the weights, as the bundled models ship one
                block = shape.get("block_size", LEARN2PD_BLOCKS[family])
                shutil.copy(_confidence_filter(block), os.path.join(cache[key], FILTER_FILE))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny(checkpoint_dir):
    """``tiny(family)`` -> a loaded float32 model on the CPU."""
    models = {}

    def get(family: str, **shape):
        key = (family, repr(sorted(shape.items())))
        if key not in models:
            models[key] = dllm.load(checkpoint_dir(family, **shape), device="cpu", dtype=torch.float32)
        return models[key]

    return get


@pytest.fixture(scope="session")
def float64_models(checkpoint_dir):
    """``float64_models(name)``: a bundled ``"tiny-<family>"`` model or a random ``"<family>:<std>"`` checkpoint,
    loaded in float64 (the parity fixtures recorded there: no confidence ties at 1.0)."""

    @functools.cache
    def get(name: str):
        if name.startswith("tiny-"):
            return dllm.load(name, device="cpu", dtype=torch.float64)
        family, std = name.split(":")
        return dllm.load(checkpoint_dir(family, std=float(std)), device="cpu", dtype=torch.float64)

    return get


@dataclasses.dataclass(frozen=True)
class ExitAt(dllm.samplers.ExitRule):
    """Finishes every row at its step ``at`` (0-based): the simplest exit rule."""

    name: ClassVar[str] = "exit_at"
    at: int = 1

    def check(self, step, state, decision):
        return step.t == self.at


@pytest.fixture
def registries(monkeypatch):
    """What a test registers (samplers, caches, model families, kernel backends, decoding processes) is dropped
    after it."""
    from dllm.engine.session import PROCESSES
    from dllm.kernels.dispatch import BACKENDS
    from dllm.models.registry import FAMILIES

    for registry in (dllm.samplers.registry.SAMPLERS, dllm.caches.CACHES, FAMILIES, BACKENDS, PROCESSES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
    return monkeypatch


@pytest.fixture
def exit_at(registries):
    """``ExitAt`` registered as sampler ``exit_at`` (composes with any base) for one test."""
    dllm.samplers.register(ExitAt)
    return ExitAt


_FILTERS: dict[int, str] = {}


@pytest.fixture(scope="session")
def confidence_filter():
    """``confidence_filter(block_size)`` -> the path of a hand-set Learn2PD filter file (:func:`_confidence_filter`)."""
    return _confidence_filter


def _confidence_filter(block_size: int) -> str:
    """A Learn2PD filter file for blocks of ``block_size`` that accepts exactly the slots whose confidence exceeds
    about 0.53 at ``accept_thres`` 0.96 (set by hand, not trained): for the tests of properties that hold whatever the
    filter (the cache matrix, batch invariance) on checkpoints that ship none."""
    if block_size not in _FILTERS:
        import tempfile

        from dllm.samplers.learn2pd import Filter

        module = Filter(block_size)
        with torch.no_grad():
            eye = torch.eye(block_size)
            module.hidden.weight.copy_(20 * eye)
            module.hidden.bias.fill_(-10.0)  # relu(20 c - 10): above 0 once c > 0.5
            module.out.weight.copy_(10 * eye)
            module.out.bias.fill_(-3.0)
        path = os.path.join(tempfile.mkdtemp(prefix="dllm-filter-"), f"filter{block_size}.safetensors")
        module.save(path)
        _FILTERS[block_size] = path
    return _FILTERS[block_size]


@pytest.fixture(scope="session")
def batch_invariant():
    """``batch_invariant(sampler, model, prompts, orders=None, **generate_kw)``: asserts batch invariance (see
    :func:`assert_batch_invariant`) and returns the batch of the first order."""
    return assert_batch_invariant


def assert_batch_invariant(sampler, model, prompts, orders=None, **kw):
    """Each prompt alone equals its row in a left-padded batch of all of them, for the prompts in each order of
    ``orders`` (lists of indices into ``prompts``; default: as given and reversed), so each prompt sits at
    several indices; greedy or sampled (``temperature``, ``seed`` in ``kw``). Compares the generated span of
    the prompt alone with the same columns of its row, and its ARness. Returns the batch of the first order."""
    alone = [sampler.generate(model, [p], **kw) for p in prompts]
    first = None
    for order in orders or [list(range(len(prompts))), list(range(len(prompts)))[::-1]]:
        batch = sampler.generate(model, [prompts[i] for i in order], **kw)
        first = first or batch
        for row, i in enumerate(order):
            generated = alone[i].sequences[0, alone[i].prompt_width :]
            got = batch.sequences[row, batch.prompt_width : batch.prompt_width + generated.shape[0]]
            assert torch.equal(got, generated), f"prompt {i} at row {row} of order {order}"
            assert batch.arness[row] == alone[i].arness[0], f"ARness of prompt {i} at row {row} of order {order}"
    return first


@pytest.fixture
def matches_recording(tiny):
    """``matches_recording(sampler, case)``: asserts that ``sampler`` on the tiny checkpoint of a recorded parity
    case (its ``family``, LLaDA when it names none, and ``std``; batch 1, its prompt, ``max_new_tokens``, and its
    ``block_size`` and ``steps`` where it names them; EOS early stop off, as the official loops decode every block)
    gives the recorded sequence and forwards."""

    def check(sampler, case):
        out = sampler.generate(
            tiny(case.get("family", "llada"), std=case["std"]),
            torch.tensor([case["prompt"]]),
            max_new_tokens=case["max_new_tokens"],
            eos_early_stop=False,
            **{key: case[key] for key in ("block_size", "steps") if key in case},
        )
        assert out.sequences[0].tolist() == case["sequence"]
        assert out.nfe == case["nfe"]

    return check


@pytest.fixture
def lm_eval_state(monkeypatch):
    """``python -m dllm.eval`` (or ``dllm eval``) run in the test's process replaces ``lm_eval.tasks.TaskManager``
    and ``sys.argv``: put them back after."""
    import sys

    import lm_eval.tasks as lm_tasks
    import lm_eval.utils

    monkeypatch.setattr(lm_tasks, "TaskManager", lm_tasks.TaskManager)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    # lm-eval's logging set-up would bind a handler to this test's captured stderr, closed after it
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", True, raising=False)
