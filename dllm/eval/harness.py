"""The lm-evaluation-harness model ``dllm``: any checkpoint dllm loads, any sampler, lm-eval's three requests.

    python -m dllm.eval --model dllm --tasks dllm_arith \\
        --model_args pretrained=tiny-llada,sampler=threshold,threshold=0.9,max_new_tokens=32,block_size=8

``--model_args`` (lm-eval's ``key=value,...``; values are typed by lm-eval, strings parsed like ``dllm
generate --set``):

- ``pretrained`` (checkpoint directory, hub id or bundled name; default ``tiny-llada``), ``dtype`` (``auto``
  = bfloat16 on CUDA, float32 on the CPU), ``device``, ``batch_size`` (prompts per ``generate`` call; lm-eval's
  ``--batch_size`` too; ``auto`` means 16); ``device`` and ``batch_size`` may be given in ``--model_args`` or as
  lm-eval's options, and ``--model_args`` wins when both are; ``device_map`` (instead of ``device``: ``auto``,
  ``balanced``, ``balanced_low_0`` or ``sequential``, a model bigger than one device spread over the GPUs, the CPU
  and the disk, see ``dllm.load``; lm-eval's ``--device`` is then ignored) with ``offload_folder`` (a directory for
  the weights offloaded to the disk);
- ``sampler`` (a name of ``dllm samplers``; default: the model family's reference sampler) and any of its
  hyper-parameters by their names (``threshold=0.9``, ``alg=entropy``, ``base=threshold`` for a part);
- generation: ``max_new_tokens``, ``block_size``, ``steps``, ``steps_per_block``, ``temperature``,
  ``seed`` (default 0), ``cache`` (``default``: the sampler's own; ``none``; or a name looked up with
  ``dllm.caches.get``, its settings as ``cache.KEY=VALUE``), ``kernel`` (the scoring backend: ``auto``, the
  default, ``torch`` or ``triton``; see ``generate(kernel=...)``), ``compile`` (true: the model forward of
  ``generate_until`` through ``torch.compile``, ``reduce-overhead`` for CUDA graphs, or a backend name; the
  likelihood forwards stay eager), ``static_shapes`` (true: see ``generate(static_shapes=...)``);
- likelihood: ``mc_num`` (128), ``mc_batch_size`` (16, or ``mc_num`` when smaller), ``cfg`` (0), ``greedy``
  (true: compute lm-eval's ``is_greedy``, one forward per continuation token; false: report False, faster),
  ``add_bos_token`` (false: contexts are tokenised as given, as ``dllm generate`` does).

``generate_until``: requests with the same generation settings are batched (``batch_size`` prompts, left
padding; longest first) through ``sampler.generate``. ``--gen_kwargs`` / the task's ``generation_kwargs`` map
onto dllm's settings: ``max_gen_toks`` -> ``max_new_tokens`` (rounded up to whole blocks, the text then cut to
``max_gen_toks`` tokens; a ``max_new_tokens`` model arg takes precedence, since a diffusion model's canvas
length is part of its sampler setting), ``temperature`` (``do_sample=false`` means 0), ``until`` (applied to
the decoded text, which is already cut at the first EOS); keys that name a hyper-parameter of the sampler
override it; others are ignored with a warning. Every random draw is keyed by the request (a hash of its
context) instead of its row in the batch, so a request's output does not depend on the batch it lands in
or on how lm-eval split the requests across processes. ``--apply_chat_template`` uses the checkpoint's
chat template (:meth:`DllmLM.apply_chat_template`).

``loglikelihood``: the Monte-Carlo ELBO estimate of :mod:`dllm.eval.likelihood` (LLaDA's estimator; Dream
through its shifted read-out; SDAR block-causal). Contexts and continuations are tokenised as LLaDA's harness
does (``_encode_pair``: trailing spaces of the context move to the continuation; the continuation is the
suffix of the tokenised whole). An empty context becomes the BOS (else EOS) token.

Causal-attention models (WeDLM): ``loglikelihood`` and ``is_greedy`` are exact, not estimated
(:mod:`dllm.eval.causal`: one forward, each token read at a mask after the tokens before it; ``mc_num`` unused).

``loglikelihood_rolling`` (perplexity): the text is cut into lm-eval's rolling windows
(``get_rolling_token_windows`` with a one-token context, ``make_disjoint_window``; the first window is
conditioned on BOS, else EOS) of at most the model's maximum length; each window's tokens are scored by the
same ELBO estimate given the window's context, and the windows' estimates are summed. The result is a
Monte-Carlo estimate of a lower bound of ``log p(text)`` (the ELBO of each window), so the perplexities
lm-eval derives from it are estimates of upper bounds of the model's true perplexity.

Data parallel: under ``accelerate launch`` (``WORLD_SIZE`` > 1) the model goes to this process's device
(``accelerator.device``) and lm-eval gives each process its share of the documents and gathers the results
(``rank``, ``world_size``, ``all_gather``, ``gather_object``, ``barrier``; ``accelerator`` for lm-eval
versions that use it directly).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import zlib
from collections import defaultdict

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from dllm.core.errors import ConfigError
from dllm.core.geometry import DEFAULT_MAX_NEW_TOKENS
from dllm.core.params import Accepts, check_value
from dllm.core.rng import CounterRNG
from dllm.core.settings import parse_value
from dllm.engine import compiled
from dllm.eval.causal import causal_loglikelihood
from dllm.eval.likelihood import check_settings, is_greedy, mc_loglikelihood
from dllm.kernels.dispatch import resolve as resolve_kernel

log = logging.getLogger(__name__)

GENERATION_KEYS = ("max_new_tokens", "block_size", "steps", "steps_per_block")
TEMPERATURE = Accepts(">= 0", note="0: greedy")
# The model's own arguments (the sampler's hyper-parameters are checked by the sampler): their types and accepted
# values (dllm.core.params), checked before the model loads.
ARGUMENTS = {
    **{key: (int | None, ">= 1") for key in GENERATION_KEYS},
    "temperature": (float, TEMPERATURE),
    "seed": (int, None),
    "mc_num": (int, ">= 1"),
    "mc_batch_size": (int | None, Accepts(">= 1", note="None: mc_num, at most 16")),
    "cfg": (float, ">= 0"),
    "greedy": (bool, None),
    "add_bos_token": (bool, None),
    "static_shapes": (bool, None),
}
KNOWN_GEN_KWARGS = {"until", "max_gen_toks", "temperature", "do_sample"}


class RequestRNG(CounterRNG):
    """Counter-based draws keyed by each row's request key (24 bits) instead of its index in the batch."""

    def __init__(self, seed: int, keys: list[int]):
        super().__init__(seed, keys)


def request_key(text: str) -> int:
    return zlib.crc32(text.encode("utf-8")) & 0xFFFFFF


def _value(v):
    """A model-arg value as dllm's --set parses it (lm-eval leaves some values as strings)."""
    if isinstance(v, str):
        return parse_value(v)
    return v


def build_cache(name, settings: dict):
    """``cache=NAME`` -> ``"default"``, None, or ``dllm.caches.get(NAME, **settings)``."""
    if name in (None, "default"):
        if settings:
            raise ConfigError(f"cache settings {sorted(settings)} need a cache name: add cache=NAME")
        return "default"
    if name == "none":
        return None
    import dllm.caches

    get = getattr(dllm.caches, "get", None)
    if get is None:
        raise ConfigError(
            f"cache={name!r}: this version of dllm has no cache registry (dllm.caches.get); use cache=default "
            "(the sampler's own exact scheme) or cache=none"
        )
    return get(name, **settings)


@register_model("dllm")
class DllmLM(LM):
    """lm-eval model ``dllm`` (see the module docstring for every argument)."""

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> DllmLM:
        """lm-eval's constructor path: ``--model_args`` plus its own ``--batch_size`` / ``--max_batch_size`` /
        ``--device``. lm-eval's base class passes both and fails on a key given twice (``device=cpu`` in
        ``--model_args``); here a key of ``--model_args`` wins over lm-eval's option."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if arg_dict.get("device_map") is not None:  # the map places the model: lm-eval's default --device does not
            extra.pop("device", None)
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DllmLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def __init__(
        self,
        pretrained: str = "tiny-llada",
        sampler: str | None = None,
        dtype: str | None = None,
        device: str | None = None,
        device_map: str | None = None,
        offload_folder: str | None = None,
        batch_size: int | str = 16,
        max_batch_size: int | None = None,
        max_new_tokens: int | None = None,
        block_size: int | None = None,
        steps: int | None = None,
        steps_per_block: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        cache: str | None = "default",
        mc_num: int = 128,
        mc_batch_size: int | None = None,
        cfg: float = 0.0,
        greedy: bool = True,
        add_bos_token: bool = False,
        kernel: str = "auto",
        compile: bool | str = False,
        static_shapes: bool = False,
        **hyper_parameters,
    ):
        super().__init__()
        import dllm

        given = dict(
            max_new_tokens=max_new_tokens,
            block_size=block_size,
            steps=steps,
            steps_per_block=steps_per_block,
            temperature=temperature,
            seed=seed,
            mc_num=mc_num,
            mc_batch_size=mc_batch_size,
            cfg=cfg,
            greedy=greedy,
            add_bos_token=add_bos_token,
            static_shapes=static_shapes,
        )
        defaults = inspect.signature(DllmLM.__init__).parameters
        args = {k: check_value(k, _value(v), *ARGUMENTS[k], default=defaults[k].default) for k, v in given.items()}
        self.accelerator = None
        device_map, offload_folder = _value(device_map), _value(offload_folder)
        if device_map is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "device_map spreads one model over the devices, and data parallel (accelerate launch) puts a whole "
                "model on each process's device: use one or the other"
            )
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import accelerate

            self.accelerator = accelerate.Accelerator(cpu=device == "cpu")
            self._rank = self.accelerator.process_index
            self._world_size = self.accelerator.num_processes
            device = self.accelerator.device
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("dllm: device %r is not available (lm-eval's default is cuda); using the cpu", str(device))
            device = "cpu"
        dtype = None if dtype in (None, "auto") else dtype
        offload_folder = None if offload_folder is None else str(offload_folder)
        placement = {"device": device, "device_map": device_map, "offload_folder": offload_folder}
        self.model = dllm.load(str(pretrained), dtype=dtype, **placement)
        self._device = self.model.device
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise ConfigError(f"{pretrained} has no tokenizer: lm-eval passes text")

        self.batch_size = self._batch_size(_value(batch_size))
        settings = {k: _value(v) for k, v in hyper_parameters.items()}
        cache_settings = {k.removeprefix("cache."): v for k, v in settings.items() if k.startswith("cache.")}
        hp = {k: v for k, v in settings.items() if not k.startswith("cache.")}
        self.cache = build_cache(_value(cache), cache_settings)
        if sampler is None:  # the family's reference sampler with its reference settings, as dllm generate
            sampler, reference = dllm.models.registry.of_model(self.model).reference_sampler or (None, {})
            hp = {**reference, **hp}
        self.sampler_name = sampler
        self.hp = self._typed(self.sampler_name, hp)
        self.sampler = self._sampler({})
        self.sampler.check_drives(self.model)
        self.generation = {k: args[k] for k in GENERATION_KEYS}
        unused = [k for k in ("steps", "steps_per_block") if self.generation[k] is not None]
        if unused and not self.sampler.fixed_steps:  # said once, not silent (the official code ignores them too)
            log.warning(
                "dllm: %s not used: %r is adaptive (the data decides how many tokens each step commits), as in its "
                "official code",
                " / ".join(unused),
                self.sampler_name,
            )
        self.temperature, self.seed, self.cfg = args["temperature"], args["seed"], args["cfg"]
        self.mc_num = args["mc_num"]
        self.mc_batch_size = args["mc_batch_size"] or min(self.mc_num, 16)
        check_settings(self.model, self.mc_num, self.mc_batch_size, self.cfg)
        self.greedy, self.add_bos_token = args["greedy"], args["add_bos_token"]
        self.kernel = resolve_kernel(_value(kernel), self.model.device)  # refused here, before any request
        log.info("dllm: scoring with kernel %r", self.kernel)
        self.compile = compiled.check(_value(compile))
        self.static_shapes = args["static_shapes"]
        self._warned: set[str] = set()

    # -- set-up helpers ---------------------------------------------------------------------------
    @staticmethod
    def _batch_size(value) -> int:
        if isinstance(value, str) and value.startswith("auto"):
            return 16
        return check_value(
            "batch_size", int(value) if isinstance(value, str) and value.isdigit() else value, int, ">= 1"
        )

    @staticmethod
    def _typed(name: str, hp: dict) -> dict:
        """Integers given for float hyper-parameters become floats (``threshold=1`` is ``threshold=1.0``)."""
        from dllm import samplers

        base = hp.get("base")
        defaults = samplers.defaults(name, base) if samplers.registry.is_part(name) else samplers.defaults(name)
        return {
            k: float(v) if isinstance(defaults.get(k), float) and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in hp.items()
        }

    def _sampler(self, overrides: dict):
        from dllm import samplers

        return samplers.get(self.sampler_name, **{**self.hp, **self._typed(self.sampler_name, overrides)})

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning(message)

    # -- lm-eval's properties ---------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return self.model.max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template (rendered as text; ``generate_until`` tokenises it as given)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{self.model.name_or_path} has no chat template; run without --apply_chat_template")
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # -- distributed (lm-eval calls these when world_size > 1) ------------------------------------
    def all_gather(self, tensor):
        return self.accelerator.gather(tensor) if self.accelerator is not None else tensor

    def gather_object(self, obj, dst=0):
        if self.accelerator is None:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    # -- tokenisation -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.add_bos_token and self.model.bos_id is not None:
            ids = [self.model.bos_id, *ids]
        return ids

    def prefix_token(self) -> int:
        return self.model.bos_id if self.model.bos_id is not None else self.model.eos_id

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """LLaDA's ``_encode_pair``: trailing spaces of the context go to the continuation; the continuation's
        ids are the tokenised whole after the tokenised context."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context) if context else []
        target = whole[len(ctx) :]
        if not ctx:
            ctx = [self.prefix_token()]
        return ctx, target

    # -- requests ---------------------------------------------------------------------------------
    def _progress(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, disable=self.rank != 0)

    def _score(self, context: list[int], target: list[int]) -> float:
        if self.model.uniform_state:
            raise ConfigError(
                f"{self.model.family} defines no log-likelihood: it is a uniform-state model (no mask token, so no "
                "masked-diffusion estimate), and neither transformers' nor the published code gives one; evaluate it "
                "on generation tasks (generate_until: gsm8k, the bundled arith, ...)"
            )
        limit = self.max_length
        if len(target) > limit - 1:
            raise ConfigError(
                f"a continuation of {len(target)} tokens does not fit the model's maximum length of {limit}"
            )
        context = context[-(limit - len(target)) :]
        if self.model.attention.exact_likelihood:  # exact (dllm.eval.causal), no Monte-Carlo estimate
            return causal_loglikelihood(self.model, context, target)[0]
        return mc_loglikelihood(
            self.model, context, target, mc_num=self.mc_num, batch_size=self.mc_batch_size, cfg=self.cfg, seed=self.seed
        )

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out, memo = [], {}
        bar = self._progress(len(requests), "dllm loglikelihood")
        for req in requests:
            key = tuple(req.args)
            if key not in memo:
                context, target = self.encode_pair(*req.args)
                if not target:
                    raise ConfigError(f"the continuation {req.args[1]!r} has no tokens")
                ll = self._score(context, target)
                fitted = context[-(self.max_length - len(target)) :]
                if self.model.attention.exact_likelihood:
                    greedy = self.greedy and causal_loglikelihood(self.model, fitted, target)[1]
                else:
                    greedy = self.greedy and is_greedy(self.model, fitted, target)
                memo[key] = (ll, bool(greedy))
                self.cache_hook.add_partial("loglikelihood", req.args, memo[key])
            out.append(memo[key])
            bar.update(1)
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        bar = self._progress(len(requests), "dllm loglikelihood_rolling")
        for req in requests:
            (text,) = req.args
            tokens = self.encode(text)
            windows = get_rolling_token_windows(tokens, self.prefix_token(), self.max_length - 1, 1)
            total = sum(self._score(*make_disjoint_window(w)) for w in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
            bar.update(1)
        bar.close()
        return out

    def _settings(self, gen_kwargs: dict):
        """(sampler, generate() keyword arguments, stop strings, token cap) for one gen_kwargs group."""
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        max_gen = gen_kwargs.pop("max_gen_toks", None)
        temperature = gen_kwargs.pop("temperature", self.temperature)
        if gen_kwargs.pop("do_sample", None) is False:
            temperature = 0.0
        fields = set(dataclasses.asdict(self.sampler)) | set(self.hp)
        overrides = {k: _value(v) for k, v in gen_kwargs.items() if k in fields}
        ignored = sorted(set(gen_kwargs) - set(overrides))
        if ignored:
            self._warn_once(f"dllm: ignoring generation arguments {ignored} (not settings of {self.sampler_name!r})")
        sampler = self._sampler(overrides) if overrides else self.sampler
        generation = {k: v for k, v in self.generation.items() if v is not None}
        cap = None
        if "max_new_tokens" not in generation and max_gen is not None:
            cap = check_value("max_gen_toks", _value(max_gen), int, ">= 1")
            block = None if self.model.attention.block_causal else generation.get("block_size")
            generation["max_new_tokens"] = -(-cap // block) * block if block else cap  # whole blocks
        generation["temperature"] = check_value("temperature", _value(temperature), float, TEMPERATURE)
        return sampler, generation, list(until), cap

    def _fit(self, ids: list[int], generation: dict) -> list[int]:
        """The prompt cut from the left so that it and the generation fit the model (lm-eval's convention)."""
        g = generation.get("max_new_tokens") or self.model.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        room = self.max_length - g - self.model.attention.extra_columns(self.model.block_size)
        if len(ids) <= room or room < 1:  # room < 1: the sampler explains that the generation is too long
            return ids
        self._warn_once(f"dllm: prompts longer than {room} tokens are cut from the left to fit the model")
        return ids[-room:]

    def _generate_batch(self, sampler, generation: dict, prompts: list[list[int]], keys: list[int]) -> list[list[int]]:
        options = dict(
            seed=self.seed, cache=self.cache, kernel=self.kernel, compile=self.compile, static_shapes=self.static_shapes
        )
        run = sampler.prepare(self.model, prompts, **options, **generation)
        run.rng = RequestRNG(self.seed, keys)
        with torch.inference_mode():
            sampler.run(run)
        out = sampler.finish(run)
        end = None if run.answer_width is None else out.prompt_width + run.answer_width  # (a decoded tail dropped)
        return out.sequences[:, out.prompt_width : end].tolist()

    def _decode(self, ids: list[int], cap: int | None) -> str:
        eos = set(self.model.eos_ids)
        kept = []
        for t in ids[:cap] if cap else ids:
            if t in eos:
                break
            kept.append(t)
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        bar = self._progress(len(requests), "dllm generate_until")
        for indices in groups.values():
            sampler, generation, until, cap = self._settings(requests[indices[0]].args[1])
            encoded = {i: self._fit(self.encode(requests[i].args[0]), generation) for i in indices}
            order = sorted(indices, key=lambda i: -len(encoded[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                keys = [request_key(requests[i].args[0]) for i in chunk]
                spans = self._generate_batch(sampler, generation, [encoded[i] for i in chunk], keys)
                for i, ids in zip(chunk, spans):
                    text = self._decode(ids, cap)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return results
