import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dllm import tasks
from dllm.tasks.tokenizer import MAX_SEQ_LEN, SPECIALS, build_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def samples():
    return {
        name: tasks.get(name).examples("train", 300) + tasks.get(name).examples("test", 100) for name in tasks.names()
    }


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _batch(tok, texts):
    return tok(texts, add_special_tokens=False)["input_ids"]


def test_round_trip_of_every_task_text(tok, samples):
    for examples in samples.values():
        prompts, targets = [ex.prompt for ex in examples], [ex.target for ex in examples]
        both = [p + t for p, t in zip(prompts, targets)]
        p_ids, t_ids, ids = _batch(tok, prompts), _batch(tok, targets), _batch(tok, both)
        for texts, rows in ((prompts, p_ids), (targets, t_ids), (both, ids)):
            assert all(tok.unk_token_id not in r for r in rows)
            assert tok.batch_decode(rows) == texts
        # tokenising prompt and target apart gives the same ids as together (clean training boundary)
        assert [p + t for p, t in zip(p_ids, t_ids)] == ids


def test_numbers_below_100_are_single_tokens(tok):
    for n in range(100):
        assert len(_ids(tok, str(n))) == 1 and len(_ids(tok, f" {n}")) == 1
    ids = _ids(tok, "He has 1234 apples, 07 of them")
    assert tok.convert_ids_to_tokens(ids) == ["He", " has", " 12", "34", " apples", ",", " 0", "7", " of", " them"]
    assert tok.decode(ids) == "He has 1234 apples, 07 of them"
    pieces = ["3", " +", " 4", " =", " 7"]
    assert _ids(tok, "3 + 4 = 7") == [i for p in pieces for i in _ids(tok, p)]


def test_special_tokens(tok):
    ids = [tok.convert_tokens_to_ids(s) for s in SPECIALS]
    assert ids == [0, 1, 2, 3, 4]
    for s, i in zip(SPECIALS, ids):
        assert _ids(tok, s) == [i]
        assert _ids(tok, "Sort" + s + "3") == _ids(tok, "Sort") + [i] + _ids(tok, "3")
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == tok.pad_token_id == 0
    assert tok.mask_token == "<|mdm_mask|>" and tok.bos_token == "<|startoftext|>"
    assert tok.convert_ids_to_tokens(3) == "<|eot_id|>"
    assert tok.decode([1, 2, 3, 0], skip_special_tokens=True) == ""
    assert tok.unk_token_id == 4 and _ids(tok, "Quux") == [4]  # unknown words are not silently split


def test_small_deterministic_vocabulary(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert 100 < len(tok) < 512
    assert build_tokenizer().backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_length_budget(tok, samples):
    """BOS + prompt + target + EOS fits MAX_SEQ_LEN; targets + EOS fit each task's max_new_tokens."""
    stats = {}
    for name, examples in samples.items():
        task = tasks.get(name)
        prompts = [len(r) for r in _batch(tok, [ex.prompt for ex in examples])]
        targets = [len(r) + 1 for r in _batch(tok, [ex.target for ex in examples])]
        assert max(p + t + 1 for p, t in zip(prompts, targets)) <= MAX_SEQ_LEN
        assert max(targets) <= task.max_new_tokens
        stats[name] = max(p + t for p, t in zip(prompts, targets))
    assert stats["arith"] > 60  # the budget is not vacuous: arithmetic uses most of it


def test_auto_tokenizer_loads_saved_directory(tmp_path, tok, samples):
    directory = save_tokenizer(tmp_path / "tok")
    assert (directory / "tokenizer.json").is_file() and (directory / "tokenizer_config.json").is_file()
    loaded = AutoTokenizer.from_pretrained(str(directory))
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.mask_token_id, loaded.bos_token_id) == (0, 0, 1, 2)
    for ex in samples["arith"][:20] + samples["listops"][:20]:
        text = ex.prompt + ex.target
        assert _ids(loaded, text) == _ids(tok, text) and loaded.decode(_ids(loaded, text)) == text
    assert not loaded.chat_template  # the tasks' models are trained on plain prompts, never on chat turns
    save_tokenizer(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "tokenizer.json").read_text()) == json.loads(
        (directory / "tokenizer.json").read_text()
    )
