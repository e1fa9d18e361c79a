"""The model families, declared in one place.

A :class:`Family` says everything the rest of the package needs to know about a family: the ``model_type``
values of its ``config.json``, its adapter class, its attention kind (``"full"``: bidirectional, ``"block"``:
block-causal, ``"causal"``: left-to-right), its weight-tying rule, a small config with its official field
names (tiny test checkpoints, training) and its loading quirks (a default mask token id). The loader
(:mod:`dllm.models.loading`), the writer (:mod:`dllm.models.saving`) and the tiny checkpoints
(:mod:`dllm.models.tiny`) read these declarations instead of branching on family names, so a new family is
one adapter module plus one :func:`register` call here, or, from another package, a ``dllm.families`` entry point
naming its :class:`Family` (:mod:`dllm.core.plugins`), which joins when the registry is first asked for a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dllm.core import plugins
from dllm.core.errors import CheckpointError, ConfigError
from dllm.core.registry import Registry
from dllm.models.attention import KINDS, Attention
from dllm.models.base import DiffusionLM


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    name: the short name (``model.family``, ``--family``).
    model_types: ``config.json`` ``model_type`` values that select it (matched case-insensitively; the first
        is the one a new checkpoint is written with).
    adapter: the :class:`~dllm.models.base.DiffusionLM` subclass built from the config.
    attention: the attention kind (:mod:`dllm.models.attention`), or its name ``"full"``, ``"block"``,
        ``"causal"`` (set on the adapter as ``attention``).
    tiny_config: ``tiny_config(vocab_size, tokens, *, layers, hidden, heads, kv_heads, block_size, max_length,
        intermediate) -> dict``: a small config with the official field names; ``tokens`` holds the special
        token ids (mask, eos, pad, bos) in the official field names.
    tied_head: the state-dict key of the LM head that a tied checkpoint may omit (the head then is the
        embedding matrix), or None when the adapter builds no head module for a tied config (LLaDA).
    ties: whether a config ties the head to the embedding.
    default_mask_id: the mask token id when the config's ``mask_token_id`` is null (WeDLM's engine: 151665).
    published_mask_id: the mask token id of the released checkpoints (named in error messages).
    reference_sampler: ``(sampler name, hyper-parameters)`` of the family's own sampler at one token per step,
        the baseline speedups are measured against (:func:`dllm.samplers.reference`); None: the family has none.
    ignored: checkpoint key prefixes whose tensors the adapter leaves unread (a key of the model itself never is).
    tiny_init: what a tiny random checkpoint's weights need after their random draw (:mod:`dllm.models.tiny`), or None.
    """

    name: str
    model_types: tuple[str, ...]
    adapter: type[DiffusionLM]
    attention: str | Attention
    tiny_config: Callable[..., dict]
    tied_head: str | None = "lm_head.weight"
    ties: Callable[[dict], bool] = lambda config: bool(config.get("tie_word_embeddings", False))
    default_mask_id: int | None = None
    published_mask_id: int | None = None
    reference_sampler: tuple[str, dict] | None = dataclasses.field(default=None, hash=False)  # (a dict: unhashable)
    ignored: tuple[str, ...] = ()  # checkpoint key prefixes the adapter does not load (DiffusionGemma's vision tower)
    tiny_init: Callable[[DiffusionLM], None] | None = dataclasses.field(default=None, hash=False)

    def build(self, config: dict) -> DiffusionLM:
        """The adapter on ``config`` (random weights), with the family's loading quirks applied."""
        model = self.adapter(config)
        if model.mask_id is None and self.default_mask_id is not None:
            model.mask_id = self.default_mask_id
        return model

    def head_is_tied(self, config: dict) -> bool:
        """Whether the checkpoint's LM head tensor (``tied_head``) is the embedding matrix."""
        return self.tied_head is not None and self.ties(config)

    def tie(self, model: DiffusionLM) -> None:
        """Make the LM head share the embedding matrix (after loading, and at build time)."""
        if self.head_is_tied(model.config):
            model.output.weight = model.embedding.weight


class _Families(Registry):
    """The families by name; registering one also declares its name and attention kind on its adapter class."""

    def register(self, family: Family, *, replace: bool = True) -> Family:
        if not isinstance(family, Family):
            raise ConfigError(f"{family!r} is not a dllm.models.registry.Family")
        kind = family.attention if isinstance(family.attention, Attention) else KINDS.get(family.attention)
        if kind is None:
            raise ConfigError(
                f"family {family.name!r}: attention must be an attention kind (dllm.models.attention: "
                f"{', '.join(KINDS)}), got {family.attention!r}"
            )
        taken = {t.lower(): f.name for f in self._entries.values() for t in f.model_types if f.name != family.name}
        clash = [t for t in family.model_types if t.lower() in taken]
        if clash:
            owner = taken[clash[0].lower()]
            raise ConfigError(f"family {family.name!r}: model_type {clash[0]!r} already selects family {owner!r}")
        super().register(family, replace=replace)
        family.adapter.family = family.name
        family.adapter.attention = kind
        DiffusionLM.published_mask_ids[family.name] = (family.adapter.__name__, family.published_mask_id)
        return family


FAMILIES = _Families("model family", group="dllm.families")


def register(family: Family) -> Family:
    """Add ``family``; its adapter class gets ``family`` and ``attention`` from the declaration."""
    return FAMILIES.register(family)


def names() -> list[str]:
    return FAMILIES.names()


def get(name: str) -> Family:
    """The family called ``name`` (``"llada"``, ``"dream"``, ``"sdar"``, ``"llada2"``, ``"wedlm"``,
    ``"fast_dllm_v2"``, ``"diffusion_gemma"``)."""
    return FAMILIES.get(name)


def of_model(model: DiffusionLM) -> Family:
    return get(model.family)


def of_config(config: dict) -> Family:
    """The family a ``config.json`` selects by its ``model_type``."""
    model_type = str(config.get("model_type", "")).lower()
    for family in FAMILIES.values():
        if model_type in (t.lower() for t in family.model_types):
            return family
    published = ", ".join(repr(f.model_types[0]) for f in FAMILIES.values())
    raise CheckpointError(
        f"config.json has model_type={config.get('model_type')!r}; dllm supports {sorted(FAMILIES)} "
        f"({published} as in the published checkpoints){plugins.failures('dllm.families')}"
    )


def _register_builtin() -> None:
    from dllm.models.diffusion_gemma import DiffusionGemma, settle_tiny_weights, tiny_diffusion_gemma_config
    from dllm.models.dream import Dream
    from dllm.models.fast_dllm_v2 import MASK_ID as FAST_DLLM_V2_MASK_ID
    from dllm.models.fast_dllm_v2 import FastDLLMv2, tiny_fast_dllm_v2_config
    from dllm.models.llada import LLaDA, tiny_llada_config
    from dllm.models.llada2 import MASK_ID, LLaDA2, tiny_llada2_config
    from dllm.models.qwen_decoder import tiny_qwen_config
    from dllm.models.sdar import SDAR
    from dllm.models.wedlm import WeDLM, tiny_wedlm_config

    register(
        Family(
            "llada",
            ("llada",),
            LLaDA,
            "full",
            tiny_llada_config,
            tied_head=None,  # a tied LLaDA has no ff_out module: the head is the embedding (``project``)
            ties=lambda config: bool(config.get("weight_tying", False)),
            published_mask_id=126336,
            reference_sampler=("llada", {}),
        )
    )

    def tiny_dream_config(vocab_size, tokens, **shape):
        return {"model_type": "Dream", "architectures": ["DreamModel"], **tiny_qwen_config(vocab_size, tokens, **shape)}

    def tiny_sdar_config(vocab_size, tokens, *, block_size=4, **shape):
        qwen = tiny_qwen_config(vocab_size, tokens, **shape)
        extra = {"head_dim": qwen["hidden_size"] // qwen["num_attention_heads"], "attention_bias": False}
        return {"model_type": "sdar", "architectures": ["SDARForCausalLM"], **extra, "block_size": block_size, **qwen}

    register(
        Family(
            "dream",
            ("Dream",),
            Dream,
            "full",
            tiny_dream_config,
            published_mask_id=151666,
            reference_sampler=("dream", {}),
        )
    )
    register(
        Family(
            "sdar",
            ("sdar",),
            SDAR,
            "block",
            tiny_sdar_config,
            published_mask_id=151669,
            # the static strategy commits exactly one token per step (the default dynamic one may commit several)
            reference_sampler=("sdar", {"remasking_strategy": "low_confidence_static"}),
        )
    )
    register(
        Family(
            "llada2",
            ("llada2_moe",),
            LLaDA2,
            "block",
            tiny_llada2_config,
            default_mask_id=MASK_ID,  # the published config.json names no mask id; the official generate's default
            published_mask_id=MASK_ID,
            # no threshold reached (confidences are at most 1): the schedule's n_i tokens per step, one when
            # steps_per_block = block_size
            reference_sampler=("llada2", {"threshold": 1.0}),
        )
    )
    register(
        Family(
            "wedlm",
            ("wedlm",),
            WeDLM,
            "causal",
            tiny_wedlm_config,
            default_mask_id=151665,
            published_mask_id=151665,
            reference_sampler=("wedlm", {"wedlm_entropy_threshold": None}),  # the argmin only: one token per step
        )
    )
    register(
        Family(
            "fast_dllm_v2",
            ("Fast_dLLM_Qwen",),
            FastDLLMv2,
            "block",
            tiny_fast_dllm_v2_config,
            default_mask_id=FAST_DLLM_V2_MASK_ID,  # the published config.json names none; the official code's default
            published_mask_id=FAST_DLLM_V2_MASK_ID,
            # threshold 1: only the most confident slot of the sub-block, one token per step (the published evals')
            reference_sampler=("fast_dllm_v2", {"threshold": 1.0}),
        )
    )
    register(
        Family(
            "diffusion_gemma",
            ("diffusion_gemma",),
            DiffusionGemma,
            "encoder_decoder",
            tiny_diffusion_gemma_config,
            tied_head=None,  # a tied model has no lm_head module: the head is the embedding (``project``)
            # the vision tower (dllm decodes text); the encoder's text weights and a tied head, the decoder's own
            ignored=(
                "model.encoder.vision_tower.",
                "model.encoder.embed_vision.",
                "model.encoder.language_model.",
                "lm_head.",
            ),  # fmt: skip
            reference_sampler=("entropy_bound", {}),
            tiny_init=settle_tiny_weights,
        )
    )


_register_builtin()
