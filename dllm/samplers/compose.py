"""Composition, not copies: exit rules and logit transforms attach to any base sampler.

``Prophet`` over ``llada``, ``threshold``, ``factor`` or ``localleap`` is one exit rule on four bases,
not four samplers. An :class:`ExitRule` observes the columns it needs (they are scored with the base's
columns), reads the statistics it asks for, and finishes rows: the loop then fills every still-masked slot
of those rows with this step's proposals (with exit rules the loop sets ``step.may_finish`` and a cache's
plan computes the masked span at every forward). Each part keeps its own typed state.

``base.with_exit(rule)`` / ``base.with_transforms(t)`` build a :class:`Composed` sampler; the registry
does the same for ``dllm.samplers.get("prophet", base="threshold", threshold=0.9)``.
"""

from __future__ import annotations

import dataclasses
import types
from typing import ClassVar

import torch

from dllm.core import params
from dllm.core.errors import ConfigError
from dllm.samplers.base import Sampler


@dataclasses.dataclass(frozen=True)
class ExitRule(params.HyperParameters):
    """Decides at each step which rows are finished (hyper-parameters as frozen dataclass fields, checked when
    it is built: :mod:`dllm.core.params`).

    needs: the statistics :meth:`check` reads from ``step.scores`` (see :data:`dllm.kernels.reference.STATS`).
    default_base: the base sampler the registry composes it with when none is given.
    every_step: over a fixed-schedule base, check at every scheduled step, including steps that commit
        nothing, each with its forward (a block then lasts all its steps), as the official loops of Prophet
        and SchED do; False lets the loop skip such steps.
    reads_decoded: :meth:`check` reads the statistics of observed columns that are already decoded (or in
        the prompt), so a cached forward computes every observed column, not only the masked ones.
    fill: what a finished row's remaining masks get: ``"proposal"`` (this step's proposals, sampled at
        temperature > 0) or ``"argmax"`` (this step's most likely tokens at any temperature).
    """

    name: ClassVar[str] = ""
    noun: ClassVar[str] = "sampler"  # exit rules are composed by name through dllm.samplers.get
    needs: ClassVar[frozenset] = frozenset()
    default_base: ClassVar[str] = "llada"
    every_step: ClassVar[bool] = False
    fill: ClassVar[str] = "proposal"
    reads_decoded: ClassVar[bool] = False
    on_device: ClassVar[bool] = False  # as Sampler.on_device (declared by the class itself)

    @property
    def active(self) -> bool:
        """Whether this rule takes part in a run; False (a rule that can never finish a row and does nothing else,
        e.g. Prophet without an answer region) leaves the run to the base sampler alone: its tokens, forwards and
        commit path."""
        return True

    def init_state(self, run):
        return None

    def begin_block(self, step, state, rows: torch.Tensor) -> None:
        pass

    def observe(self, step, state) -> torch.Tensor | None:
        """Columns [B, K] this rule reads, scored along with the base's (None: none)."""
        return None

    def check(self, step, state, decision) -> torch.Tensor:
        """bool [B]: rows to finish at this step (after the base's ``decision``)."""
        raise NotImplementedError

    def cut(self, step, state, committed) -> torch.Tensor | None:
        """long [B]: after this step's commit (``committed``, bool [B, L]), where each row's span now ends (its text
        cannot go past it: the columns after leave the canvas), or the row's span end to keep it; None (the
        default): no cut (EoTP's end-of-text prediction cuts)."""
        return None

    def check_cache(self, model, cache) -> None:
        """Raise when this rule cannot run on ``model`` with ``cache`` (None: none), e.g. a cache that does not
        compute the columns it reads (see :meth:`Sampler.check_cache`)."""

    def check_run(self, run) -> None:
        """Raise when this rule cannot run as prepared; by default :meth:`check_cache` of the run's cache."""
        self.check_cache(run.model, run.cache)

    def compose(self, base: Sampler) -> Sampler:
        return base.with_exit(self) if isinstance(base, Sampler) else Composed(base, exits=(self,))

    def settings(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Composed(Sampler):
    """A base sampler with exit rules and extra logit transforms: its decisions, schedule, blocks and
    statistics are the base's; the rules and transforms each keep their own state.

    Every hook and fact a :class:`Sampler` declares is the base's, forwarded without being listed here (see
    :data:`NOT_FORWARDED`), so a new hook needs no edit here; written out below are only what the composition
    combines (the exit rules, the transforms, the checks, the settings) and its name."""

    base: Sampler
    exits: tuple = ()
    extra: tuple = ()

    def check_hyper_parameters(self):
        from dllm.samplers.transforms import Transform

        if not isinstance(self.base, Sampler):
            raise ConfigError(f"the base must be a sampler (e.g. dllm.samplers.get('threshold')), got {self.base!r}")
        bad = [r for r in self.exits if not isinstance(r, ExitRule)] + [
            t for t in self.extra if not isinstance(t, Transform)
        ]
        if bad:
            raise ConfigError(
                f"{bad[0]!r} is not an exit rule (dllm.samplers.ExitRule) or a logit transform "
                "(dllm.samplers.Transform); get a registered one by name with dllm.samplers.get(name, base=...)"
            )

    @property
    def name(self) -> str:  # e.g. "prophet(threshold)"
        parts = [getattr(p, "name", "") or type(p).__name__ for p in (*self.exits, *self.extra)]
        return f"{'+'.join(parts)}({self.base.name})" if parts else self.base.name

    @property
    def exit_rules(self) -> tuple:
        return (*self.base.exit_rules, *self.exits)

    def transforms(self, run):
        return (*self.base.transforms(run), *self.extra)

    def check_cache(self, model, cache):
        self.base.check_cache(model, cache)
        for rule in self.exits:
            rule.check_cache(model, cache)

    def check_run(self, run):
        self.base.check_run(run)
        for rule in self.exits:
            rule.check_run(run)

    def with_exit(self, *rules):
        return dataclasses.replace(self, exits=(*self.exits, *rules))

    def with_transforms(self, *transforms):
        return dataclasses.replace(self, extra=(*self.extra, *transforms))

    def settings(self) -> dict:
        out = {"base": self.base.name, **self.base.settings()}
        for part in (*self.exits, *self.extra):
            if dataclasses.is_dataclass(part):
                out.update(dataclasses.asdict(part))
        return out


# What a composed sampler does not take from its base: running as a whole (the shared loop must call the
# composed hooks, so generate / prepare / run / finish / check_drives run on the composition itself) and its noun.
NOT_FORWARDED = frozenset({"generate", "prepare", "run", "finish", "check_drives", "noun"})


def _forwarded(name: str, declared):
    """The base's ``name``: a method calling the base's, or (a fact such as ``fixed_steps``, a property) a
    property reading the base's."""
    if not isinstance(declared, types.FunctionType):
        return property(lambda self: getattr(self.base, name), doc=f"The base sampler's ``{name}``.")

    def hook(self, *args, **kwargs):
        return getattr(self.base, name)(*args, **kwargs)

    hook.__name__, hook.__qualname__, hook.__doc__ = name, f"Composed.{name}", f"The base sampler's ``{name}``."
    return hook


for _name, _declared in vars(Sampler).items():
    if not _name.startswith("_") and _name not in vars(Composed) and _name not in NOT_FORWARDED:
        setattr(Composed, _name, _forwarded(_name, _declared))

Sampler._composition = Composed  # what Sampler.with_exit / with_transforms build
