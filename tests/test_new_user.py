"""What tripped a new user (issue 18, item 12): corrupt checkpoints, CLI mistakes and advice, help texts,
plurals, EOS early stop, plots of a cache sweep, the chat BOS, Prophet without an answer region, the training
script with few steps. Each ends in a clear error, a warning or the right output."""

from __future__ import annotations

import json
import shutil

import pytest

import dllm
from dllm.core.errors import CheckpointError
from dllm.models.loading import BUNDLED

# -- corrupt checkpoints: the file and the field are named ---------------------------------------------


@pytest.fixture
def bundled_copy(tmp_path):
    """A writable copy of the bundled tiny-llada checkpoint."""
    directory = tmp_path / "ckpt"
    shutil.copytree(BUNDLED["tiny-llada"], directory)
    return directory


def edit_config(directory, change) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: [c], r"config.json must hold a JSON object .*got a list"),
        (lambda c: {**c, "n_layers": "four"}, r"config.json: bad field n_layers='four' \(a positive integer\)"),
        (lambda c: {**c, "n_heads": None}, r"config.json: bad field n_heads=None \(a positive integer\)"),
        (lambda c: {**c, "d_model": 0, "rope_theta": "big"}, r"bad fields d_model=0 .*; rope_theta='big'"),
        (lambda c: {**c, "eos_token_id": [0, "x"]}, r"eos_token_id=\[0, 'x'\] \(a token id"),
    ],
)
def test_corrupt_config_names_the_file_and_the_field(bundled_copy, change, message):
    edit_config(bundled_copy, change)
    with pytest.raises(CheckpointError, match=message):
        dllm.load(bundled_copy)


def test_null_where_the_official_code_takes_a_default_is_fine(bundled_copy):
    edit_config(bundled_copy, lambda c: {**c, "n_kv_heads": None, "mlp_hidden_size": 512})
    assert dllm.load(bundled_copy).family == "llada"


def test_truncated_weights_name_the_file(bundled_copy):
    weights = bundled_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read as safetensors .*truncated"):
        dllm.load(bundled_copy)


def test_broken_tokenizer_names_the_file(bundled_copy):
    tokenizer = bundled_copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:500])
    with pytest.raises(CheckpointError, match=r"tokenizer.json cannot be read as a tokenizer"):
        dllm.load(bundled_copy)


def test_generation_config_that_is_not_an_object(bundled_copy):
    (bundled_copy / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"generation_config.json must hold a JSON object"):
        dllm.load(bundled_copy)


def test_corrupt_checkpoint_is_one_error_line_in_the_cli(bundled_copy, capsys):
    from dllm.cli import main

    edit_config(bundled_copy, lambda c: {**c, "n_layers": "four"})
    assert main(["generate", "Sort the list: 3 1\n", "--model", str(bundled_copy)]) == 2
    assert "dllm: error:" in capsys.readouterr().err
