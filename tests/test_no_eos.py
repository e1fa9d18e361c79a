"""Checkpoints without an EOS id (none in ``config.json``, ``generation_config.json`` or the tokenizer: base
checkpoints, checkpoints saved without the field) decode to ``max_new_tokens`` with one warning, as
transformers' ``generate`` and the official engines do; an EOS id in ``generation_config.json`` or the tokenizer
is used when ``config.json`` has none. Every family, the lm-eval model and the bench."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from lm_eval.api.instance import Instance

import dllm
from dllm.bench import records, runner
from dllm.core.errors import DllmWarning
from dllm.eval.harness import DllmLM
from dllm.models.tiny import make_tiny_checkpoint

FAMILIES = ["llada", "dream", "sdar", "wedlm"]
PROMPTS = ["ab", "Sort 3 1 2\n"]


def no_eos_checkpoint(directory, family: str):
    """The tiny checkpoint of ``family`` (the weights of the ``checkpoint_dir`` fixture's) with no EOS id anywhere:
    none in config.json, and a tokenizer without an EOS or end-of-turn token (its pad token is ``<unk>``; the
    config's pad id stays)."""
    directory = make_tiny_checkpoint(directory, family, overrides={"eos_token_id": None})
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(eos_token=None, pad_token="<unk>")
    for key in ("extra_special_tokens", "additional_special_tokens"):  # <|eot_id|> (transformers 5 / 4 names)
        if key in config:
            config[key] = []
    path.write_text(json.dumps(config))
    return directory


def _no_eos_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, DllmWarning) and "no EOS token id" in str(w.message)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_without_an_eos_id_decodes_the_whole_span_with_one_warning(family, tmp_path, tiny):
    model = dllm.load(no_eos_checkpoint(tmp_path, family), device="cpu", dtype=torch.float32)
    assert model.eos_ids == ()
    sampler = dllm.samplers.reference(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sampler.generate(model, PROMPTS, max_new_tokens=8)
        sampler.generate(model, PROMPTS[:1], max_new_tokens=8)
    (warning,) = _no_eos_warnings(caught)  # once per model, however many generations
    assert "runs to max_new_tokens" in str(warning.message) and "eos_token_id" in str(warning.message)
    generated = out.sequences[:, out.prompt_width :]
    assert not bool((generated == model.mask_id).any())
    # every slot counts (SDAR decodes whole blocks: at least 8), and the texts are every generated token, uncut
    assert out.tokens == [8, 8] if model.attention != "block" else min(out.tokens) >= 8
    uncut = [
        model.tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(generated.tolist(), out.tokens)
    ]
    assert out.texts == uncut
    # the same weights with an EOS id, decoding the whole span: the same tokens
    with_eos = sampler.generate(tiny(family), PROMPTS, max_new_tokens=8, eos_early_stop=False)
    assert torch.equal(with_eos.sequences, out.sequences)


def test_the_eos_id_comes_from_generation_config_or_the_tokenizer(tmp_path):
    directory = no_eos_checkpoint(tmp_path / "generation", "llada")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 40}))
    model = dllm.load(directory, device="cpu")
    assert model.eos_ids == (40,)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dllm.samplers.get("llada").generate(model, PROMPTS, max_new_tokens=8, eos_early_stop=False)
    assert not _no_eos_warnings(caught)
    for row, text in zip(out.sequences[:, out.prompt_width :].tolist(), out.texts):
        kept = row[: row.index(40)] if 40 in row else row
        assert text == model.tokenizer.decode(kept, skip_special_tokens=True)  # cut at generation_config's EOS
    tokenizer_only = make_tiny_checkpoint(tmp_path / "tokenizer", "llada", overrides={"eos_token_id": None})
    assert 0 in dllm.load(tokenizer_only, device="cpu").eos_ids  # the tokenizer's <|endoftext|>


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_without_an_eos_or_a_pad_id_pads_under_the_attention_mask(family, tmp_path, tiny):
    """Neither id anywhere (some WeDLM configs): one prompt needs no padding; ragged prompts are padded with a
    filler id under the attention mask, and every row decodes as its prompt alone does."""
    directory = no_eos_checkpoint(tmp_path, family)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "pad_token_id": None}))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((directory / "tokenizer_config.json").read_text()), "pad_token": None})
    )
    model = dllm.load(directory, device="cpu", dtype=torch.float32)
    assert model.eos_ids == () and model.pad_id is None
    sampler = dllm.samplers.reference(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DllmWarning)
        out = sampler.generate(model, PROMPTS, max_new_tokens=8)
        alone = [sampler.generate(model, prompt, max_new_tokens=8) for prompt in PROMPTS]
    assert out.sequences[0, 0].item() == model.filler_id  # the short prompt is padded
    for row, one in enumerate(alone):
        mine = one.sequences[0, one.prompt_width :].tolist()  # SDAR's block-aligned spans differ in length
        assert out.sequences[row, out.prompt_width :][: len(mine)].tolist() == mine
        assert out.texts[row] == one.texts[0] and out.tokens[row] == one.tokens[0]


def test_the_lm_eval_model_decodes_a_model_without_an_eos_id(tmp_path):
    lm = DllmLM(pretrained=str(no_eos_checkpoint(tmp_path, "llada")), device="cpu", block_size=8)
    gen = {"until": [], "max_gen_toks": 16}
    texts = lm.generate_until([Instance("generate_until", {}, (p, gen), i) for i, p in enumerate(PROMPTS)])
    for prompt, text in zip(PROMPTS, texts):
        alone = dllm.samplers.reference("llada").generate(lm.model, prompt, max_new_tokens=16, block_size=8)
        assert alone.tokens == [16] and text == alone.texts[0]


def test_the_bench_runs_a_model_without_an_eos_id(tmp_path):
    model = str(no_eos_checkpoint(tmp_path / "model", "llada"))
    config = runner.BenchConfig(
        models=[model], samplers=["llada"], tasks=["arith"], n=2, max_new_tokens=8, batch_size=2, out=tmp_path / "out"
    )
    config.progress = False
    runner.run(config, log=lambda message: None)
    samples = [
        json.loads(line) for f in records.cell_files(tmp_path / "out" / "runs") for line in records.read_lines(f)
    ]
    samples = [s for s in samples if s.get("type") == "sample"]
    assert len(samples) == 2 and all(s["tokens"] == 8 for s in samples)
