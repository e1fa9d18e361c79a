"""One validation path for every hyper-parameter (issue 31, items 3, 4, 6; :mod:`dllm.core.params`).

Every numeric and boolean field of every registered sampler, composed part and cache, given a value of the wrong
type, out of its range, NaN, infinite where that means nothing, or an integer beyond 64 bits, is a ConfigError
naming the field when the object is built; whatever is accepted generates valid output on a tiny model (or, where
a composed logit transform overflows the logits' dtype, says so with a NumericalError instead of garbage)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import dllm
from dllm.core.errors import ConfigError, NumericalError

PROMPTS = ["ab", "c d"]
REGISTERED = [("sampler", n) for n in dllm.samplers.names()] + [("cache", n) for n in dllm.caches.names()]


def _registry(kind: str):
    return dllm.samplers.registry.SAMPLERS if kind == "sampler" else dllm.caches.CACHES


def _build(kind: str, name: str, **hp):
    return dllm.samplers.get(name, **hp) if kind == "sampler" else dllm.caches.get(name, **hp)


def _kinds(annotation) -> set:
    """The plain types an annotation is made of (``int | None`` -> {int, NoneType})."""
    args = typing.get_args(annotation)
    return set().union(*map(_kinds, args)) if args else {annotation}


def _numeric_fields(cls) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if _kinds(hints[f.name]) & {int, float, bool}]


FIELDS = [
    (kind, name, field, t) for kind, name in REGISTERED for field, t in _numeric_fields(_registry(kind).get(name))
]


def _always_bad(annotation) -> list:
    """Values that no numeric or boolean field accepts (None where the annotation does not allow it)."""
    kinds = _kinds(annotation)
    if kinds - {type(None)} == {bool}:
        bad = [1, 0, "yes", float("nan")]
    else:
        bad = [float("nan"), 10**30, -(10**30), "abc", True]
        if tuple not in {typing.get_origin(a) for a in (annotation, *typing.get_args(annotation))}:
            bad += [[1], 2**63]
    return bad if type(None) in kinds else [*bad, None]


def test_every_registered_class_declares_numeric_fields():
    """The tests below see every registered sampler, part and cache (a new one joins by registration)."""
    covered = {(kind, name) for kind, name, _, _ in FIELDS}
    assert {("sampler", "s2d2"), ("sampler", "prophet"), ("sampler", "credit_fusion"), ("cache", "window")} <= covered
    assert len(FIELDS) > 80


@pytest.mark.parametrize("kind,name,field,annotation", FIELDS, ids=[f"{n}.{f}" for _, n, f, _ in FIELDS])
def test_values_no_field_accepts_are_config_errors_naming_it(kind, name, field, annotation):
    for value in _always_bad(annotation):
        with pytest.raises(ConfigError, match=rf"\b{field} must be") as error:
            _build(kind, name, **{field: value})
        assert repr(value)[:20] in str(error.value)


def _model_for(obj, tiny):
    """The first tiny model (llada, dream, sdar, llada2, wedlm, diffusion_gemma) that ``obj`` (a sampler or a cache)
    can serve."""
    for family in ("llada", "dream", "sdar", "llada2", "wedlm", "diffusion_gemma"):
        model = tiny(family)
        try:
            obj.check_drives(model) if isinstance(obj, dllm.samplers.Sampler) else obj.check_model(model)
        except ConfigError:
            continue
        return model
    raise AssertionError(f"no tiny model for {obj!r}")


SPECIAL = [float("nan"), float("inf"), float("-inf"), 10**30, -(10**30), 2**63, -(2**63) - 1, "abc", [3], None]
VALUES = st.one_of(
    st.sampled_from([*SPECIAL, True, False, 1e300, -1e300, 1e-300]),
    st.integers(-3, 64),
    st.floats(-4, 4),
    st.floats(allow_nan=False),
)


@settings(max_examples=100, deadline=None)
@given(where=st.sampled_from(FIELDS), value=VALUES, temperature=st.sampled_from([0.0, 1.0]))
@example(where=next(f for f in FIELDS if f[1:3] == ("llada", "cfg_scale")), value=1e300, temperature=0.0)
@example(where=next(f for f in FIELDS if f[1:3] == ("dual", "refresh_steps")), value=10**30, temperature=0.0)
def test_random_hyper_parameters_are_refused_by_name_or_generate_valid_output(where, value, temperature, tiny):
    kind, name, field, _ = where
    try:
        built = _build(kind, name, **{field: value})
    except ConfigError as error:
        assert f"{field} must be" in str(error)
        return
    model = _model_for(built, tiny)
    sampler, cache = (built, "default") if kind == "sampler" else (dllm.samplers.reference(model.family), built)
    lengths = {"max_new_tokens": 8, **({"block_size": 4} if model.attention == "full" else {})}
    temperature = temperature if sampler.takes_temperature else 0.0  # (its own schedule: it samples anyway)
    try:
        out = sampler.generate(model, PROMPTS, cache=cache, temperature=temperature, seed=3, **lengths)
    except NumericalError as error:  # a transform's scale overflowed float32: said, not garbage
        assert "logit transforms" in str(error) and math.isfinite(value) and abs(value) > 1e30
        return
    assert len(out.texts) == len(PROMPTS) and all(isinstance(t, str) for t in out.texts)
    # (WeDLM's engine may propose the mask token and commit it, unless suppress_mask_token: a token, not a slot left
    # undecoded; its stream commits only decoded slots)
    proposes_mask = getattr(sampler, "suppress_mask_token", True) is False
    masked = model.mask_id is not None and (out.sequences[:, out.prompt_width :] == model.mask_id).any()
    assert out.nfe >= 1 and (not masked or proposes_mask)


# -- the issue's commands ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: dllm.caches.get("dual", refresh_steps=10**30), "refresh_steps"),
        (lambda: dllm.samplers.get("credit", credit_alpha=10**30), "credit_alpha"),
        (lambda: dllm.samplers.get("llada", cfg_scale=float("nan")), "cfg_scale"),
        (lambda: dllm.samplers.get("llada", cfg_scale=float("inf")), "cfg_scale"),
        (lambda: dllm.samplers.get("factor", factor=float("nan")), "factor"),
        (lambda: dllm.samplers.get("s2d2", ucb_beta=float("inf")), "ucb_beta"),
        (lambda: dllm.samplers.get("sched", tau_k=float("-inf")), "tau_k"),
        (lambda: dllm.samplers.get("ete", explore_k=2**64), "explore_k"),
    ],
)
def test_the_issues_values_are_config_errors_naming_the_field(build, field):
    with pytest.raises(ConfigError, match=rf"{field} must be .*got"):
        build()


def test_huge_generation_settings_are_config_errors(tiny):
    with pytest.raises(ConfigError, match="steps must be a positive integer or None.*beyond 64 bits"):
        dllm.samplers.get("llada").generate(tiny("llada"), "ab", max_new_tokens=8, block_size=4, steps=2 * 10**30)
    with pytest.raises(ConfigError, match="seed must be an integer or None.*beyond 64 bits"):
        dllm.samplers.get("llada").generate(tiny("llada"), "ab", max_new_tokens=8, seed=10**30, temperature=1.0)


def test_numbers_are_stored_as_given_types():
    """An integer is a number (stored as a float, as the CLI and lm-eval give it), a list a tuple of ids."""
    assert dllm.samplers.get("threshold", threshold=1).threshold == 1.0
    assert isinstance(dllm.samplers.get("credit", credit_alpha=2).credit_alpha, float)
    assert dllm.samplers.get("adablock", delimiter_ids=[5, 6]).delimiter_ids == (5, 6)
    assert dllm.samplers.get("adablock", delimiter_threshold=float("inf")).delimiter_threshold == float("inf")


def test_guidance_that_overflows_the_logits_is_a_numerical_error_not_garbage(tiny):
    """cfg_scale=1e300 is finite, but the guided logits overflow float32: the logits that are scored (after the
    transforms) are checked, as the model's are."""
    with pytest.raises(NumericalError, match=r"logit transforms \(Guidance\)"):
        dllm.samplers.get("llada", cfg_scale=1e300).generate(tiny("llada"), "ab", max_new_tokens=8, block_size=4)


@dataclasses.dataclass(frozen=True)
class _NaNAt(dllm.samplers.Transform):
    """Makes one scored logit NaN (as a guidance scale of NaN did)."""

    def __call__(self, logits, rows, columns, step, state):
        out = logits.clone()
        out[..., 0] = float("nan")
        return out


def test_nan_made_by_a_transform_is_a_numerical_error_not_an_empty_text(tiny):
    sampler = dllm.samplers.get("llada").with_transforms(_NaNAt())
    with pytest.raises(NumericalError, match=r"logit transforms \(_NaNAt\)"):
        sampler.generate(tiny("llada"), "ab", max_new_tokens=8, block_size=4)


def test_finite_transforms_keep_one_read_back_per_step(tiny, monkeypatch):
    """The transformed logits' check is deferred to the step's read-back: a guided greedy run reads back as many
    times as an unguided one."""
    calls = []
    verify = dllm.core.errors.Checks.verify
    monkeypatch.setattr(dllm.core.errors.Checks, "verify", lambda self, values: calls.append(1) or verify(self, values))
    model = tiny("llada")
    plain = dllm.samplers.get("llada").generate(model, "ab", max_new_tokens=8, block_size=4)
    count, calls[:] = len(calls), []
    guided = dllm.samplers.get("llada", cfg_scale=1.0).generate(model, "ab", max_new_tokens=8, block_size=4)
    assert len(calls) == count and guided.nfe == 2 * plain.nfe


def test_generate_errors_list_every_argument(tiny):
    with pytest.raises(ConfigError, match="generate\\(\\) takes: .*kernel, compile, static_shapes") as error:
        dllm.samplers.get("llada").generate(tiny("llada"), "ab", max_new_tokens=8, bogus=1)
    assert "callback" in str(error.value)


# -- the lm-eval model ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,field",
    [
        ({"seed": None}, "seed must be an integer"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"seed": 1.7}, "seed must be an integer"),  # not cut to 1
        ({"temperature": None}, "temperature must be a finite number >= 0"),
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"cfg": None}, "cfg must be a finite number >= 0"),
        ({"cfg": float("inf")}, "cfg must be a finite number >= 0"),
        ({"greedy": "maybe"}, "greedy must be True or False"),
        ({"mc_num": 2**64}, "mc_num must be a positive integer"),
        ({"steps": 2 * 10**30}, "steps must be a positive integer"),
    ],
)
def test_the_lm_eval_models_arguments_are_config_errors_when_built(given, field, monkeypatch):
    pytest.importorskip("lm_eval")
    from dllm.eval.harness import DllmLM

    monkeypatch.setattr(dllm, "load", lambda *a, **k: pytest.fail("checked after loading the model"))
    with pytest.raises(ConfigError, match=field):
        DllmLM(pretrained="tiny-llada", device="cpu", **given)


def test_a_malformed_range_fails_where_it_is_declared():
    with pytest.raises(ValueError, match="malformed range"):
        dllm.core.params.hp(1, "0..1")


@pytest.mark.parametrize("value", [torch.tensor(1.0), "1", b"1"])
def test_a_tensor_or_text_is_not_a_number(value):
    with pytest.raises(ConfigError, match="threshold must be a number"):
        dllm.samplers.get("threshold", threshold=value)


def test_the_likelihood_estimate_refuses_a_nan_guidance_scale(tiny):
    from dllm.eval.likelihood import mc_loglikelihood

    with pytest.raises(ConfigError, match="cfg must be a finite number >= 0"):
        mc_loglikelihood(tiny("llada"), [5, 6], [7], mc_num=2, batch_size=2, cfg=float("nan"))


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: dllm.samplers.get("localleap", threshold=0.1), "threshold"),
        (lambda: dllm.samplers.get("localleap", relaxed_threshold=0.95), "relaxed_threshold"),
        (lambda: dllm.caches.get("window", window_tokens=1), "window_tokens"),
        (lambda: dllm.caches.get("window", active_tokens=100), "active_tokens"),
        (lambda: dllm.samplers.get("s2d2", ucb_entropy_bins=10**6), "ucb_entropy_bins"),
    ],
)
def test_a_refusal_across_fields_names_the_field_that_was_set(build, field):
    """One field set against the others' defaults (what the random test above draws): the refusal says what that
    field must be, whichever side of the cross-field rule it is on."""
    with pytest.raises(ConfigError, match=rf"\b{field} must be"):
        build()
