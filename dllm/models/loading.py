"""``dllm.load``: a checkpoint directory (or hub id) in the official layout -> a ready DiffusionLM.

The family comes from ``config.json``'s ``model_type``; weights from ``model.safetensors`` or a sharded
``model.safetensors.index.json``; the tokenizer from the same directory, without remote code.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch

from dllm.core.errors import CheckpointError, ConfigError
from dllm.models import checkpoint, registry
from dllm.models.base import DiffusionLM

# The bundled tiny models (trained by dllm.train), by short name: dllm/models/bundled/<name>/.
BUNDLED: dict[str, Path] = {
    d.name: d for d in sorted((Path(__file__).parent / "bundled").glob("*")) if (d / "config.json").is_file()
}
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
# End-of-turn tokens that end a generation like EOS does, when the tokenizer has them.
_END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")


def family_of(config: dict) -> type[DiffusionLM]:
    """The adapter class ``config.json`` selects (its family's declaration: :mod:`dllm.models.registry`)."""
    return registry.of_config(config).adapter


def resolve(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local directory for a bundled short name, a directory, or a hub id (downloaded once)."""
    name = str(path_or_id)
    if name in BUNDLED:
        return BUNDLED[name]
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{name} is a file; dllm.load takes a checkpoint directory holding config.json")
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        raise CheckpointError(
            f"{name!r} is neither a checkpoint directory, a hub id like 'GSAI-ML/LLaDA-8B-Instruct', nor a bundled "
            f"model (bundled here: {', '.join(sorted(BUNDLED)) or 'none'})"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, allow_patterns=_HUB_FILES))
    except Exception as e:  # offline, unknown repo, no permission
        raise CheckpointError(
            f"could not fetch {name!r} from the Hugging Face Hub ({type(e).__name__}: {e}). If you are offline, "
            "download the checkpoint elsewhere and pass its local directory"
        ) from None


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json; is it a checkpoint directory?")
    return checkpoint.read_config(path)


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = checkpoint.read_json_object(index).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shard files listed in {index.name} are missing: {missing}")
        state = {}
        for shard in shards:
            state.update(checkpoint.read_safetensors(directory / shard))
        return state
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")
    state = {}
    for f in files:
        state.update(checkpoint.read_safetensors(f))
    return state


def load_weights(model: DiffusionLM, state: dict[str, torch.Tensor], where: str) -> None:
    """Assign checkpoint tensors to a model built on the meta device; name every bad key."""
    expected = {k: v for k, v in model.state_dict().items()}
    family = registry.of_model(model)
    tied = family.head_is_tied(model.config)
    if tied:  # tied head: checkpoints may or may not store it
        state = {k: v for k, v in state.items() if k != family.tied_head}
        expected.pop(family.tied_head, None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if not k.endswith("rotary_emb.inv_freq"))
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_few(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {_few(mismatched)}")
    if problems:
        raise CheckpointError(f"{where} does not match its config.json ({model.family}): " + "; ".join(problems))
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    if tied:
        family.tie(model)


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def load_tokenizer(directory: Path):
    """The checkpoint's tokenizer without remote code; ``tokenizer.json`` when the config names a custom class.
    A ``tokenizer.json`` saved by ``PreTrainedTokenizerFast`` (the bundled models', LLaDA's) loads through that
    class, as AutoTokenizer would load it, without importing AutoTokenizer's table of every model (seconds)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    try:
        named = checkpoint.read_json_object(directory / "tokenizer_config.json").get("tokenizer_class")
    except CheckpointError:  # none, or unreadable: AutoTokenizer and the fallback below decide
        named = None
    fast = named in ("PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # AutoTokenizer warns about our (unregistered) model types
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if fast and (directory / "tokenizer.json").is_file():
                return PreTrainedTokenizerFast.from_pretrained(str(directory))
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except Exception:
        pass
    finally:
        hf_logging.set_verbosity(verbosity)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    extra = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = directory / name
        if f.is_file():
            for key, value in checkpoint.read_json_object(f).items():
                if key.endswith("_token") and value is not None:
                    extra[key] = value["content"] if isinstance(value, dict) else value
                elif key == "chat_template":
                    extra[key] = value
    template = directory / "chat_template.jinja"
    if "chat_template" not in extra and template.is_file():
        extra["chat_template"] = template.read_text()
    try:
        return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **extra)
    except Exception as e:  # the tokenizers library's parse errors
        raise checkpoint.tokenizer_error(directory, e) from None


def _generation_config(directory: Path) -> dict:
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    return checkpoint.read_json_object(path)


def _eos_ids(model: DiffusionLM, directory: Path, tokenizer) -> tuple[int, ...]:
    ids = list(model.eos_ids)
    eos = _generation_config(directory).get("eos_token_id")
    ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        ids += [vocab[t] for t in _END_OF_TURN if t in vocab and t in tokenizer.all_special_tokens]
    return tuple(dict.fromkeys(i for i in ids if i != model.mask_id))


# dtype names a user may type (case-insensitive, with or without "torch."): torch's and the usual short ones.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "single": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A parameter dtype from a torch dtype or a name (``"bf16"``, ``"float16"``, ``"torch.float32"``, ``"half"``);
    None or ``"auto"``: the device's default (decided by :func:`load`)."""
    accepted = "float32 (fp32, float), bfloat16 (bf16), float16 (fp16, half), float64 (fp64, double) or auto"
    if dtype is None:
        return None
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key == "auto":
            return None
        if key not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use {accepted}")
        return DTYPES[key]
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype or a name, got {dtype!r}; use {accepted}")
    if not dtype.is_floating_point:
        raise ConfigError(f"model weights need a floating-point dtype, got {dtype}; use {accepted}")
    return dtype


def default_dtype(config: dict, device: torch.device) -> torch.dtype:
    """The parameter dtype when none is asked for: float32 on the CPU; on a GPU the checkpoint's own
    (``torch_dtype``, or ``dtype`` as transformers 5 writes it) when it names float16, bfloat16 or float32,
    else bfloat16 (the published LLaDA, Dream and SDAR checkpoints are bfloat16)."""
    if device.type == "cpu":
        return torch.float32
    named = config.get("torch_dtype") or config.get("dtype")
    if isinstance(named, str) and named.removeprefix("torch.") in ("float16", "bfloat16", "float32"):
        return DTYPES[named.removeprefix("torch.")]
    return torch.bfloat16


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load on (default: ``cuda`` when available, else ``cpu``), checked to exist here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {str(device)!r}; use e.g. 'cpu', 'cuda', 'cuda:1' or 'mps'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this PyTorch ({torch.__version__}) is a CPU-only build"
                if torch.version.cuda is None
                else f"this PyTorch (CUDA {torch.version.cuda}) sees no CUDA GPU"
            )
            raise ConfigError(
                f"device {str(device)!r} was asked for, but {why}. Use --device cpu (device='cpu'), or install a "
                "CUDA build of PyTorch (https://pytorch.org/get-started/locally/) on a machine with an NVIDIA GPU"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {str(device)!r}: there are only {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
    elif device.type == "mps" and not (
        getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    ):
        raise ConfigError(f"device {str(device)!r} was asked for, but this PyTorch has no usable MPS backend; use cpu")
    return device


def build(config: dict) -> DiffusionLM:
    """A model with random weights from a config dict (tests, training)."""
    return registry.of_config(config).build(config)


@contextlib.contextmanager
def on_meta():
    """Build modules on the meta device without initialising their parameters (``torch.nn.init`` a no-op
    inside): there is nothing to fill, and torch's meta random fills go through its reference implementations,
    which import ``torch._dynamo`` (seconds, the larger part of a first small load)."""
    import torch.nn.init as init

    names = [n for n in vars(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    for n in names:
        setattr(init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    revision: str | None = None,
) -> DiffusionLM:
    """Load a LLaDA, Dream, SDAR or WeDLM checkpoint in its published layout.

    Args:
        path_or_id: a checkpoint directory, a hub id (``"GSAI-ML/LLaDA-8B-Instruct"``) or a bundled name.
        device: where to put the weights (default: ``"cuda"`` when available, else ``"cpu"``).
        dtype: parameter dtype, a ``torch.dtype`` or a name: ``float32`` / ``fp32``, ``bfloat16`` / ``bf16``,
            ``float16`` / ``fp16`` / ``half``, ``auto`` (default: :func:`default_dtype`: on a GPU the checkpoint's
            ``torch_dtype`` or bfloat16, on the CPU float32).
    """
    device = resolve_device(device)  # before any file is read: a bad device or dtype fails at once
    dtype = resolve_dtype(dtype)
    directory = resolve(path_or_id, revision)
    config = read_config(directory)
    family = registry.of_config(config)
    dtype = dtype or default_dtype(config, device)
    with on_meta():
        model = family.build(config)
    load_weights(model, read_state_dict(directory), str(directory))
    model.to(device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    model.name_or_path = str(path_or_id)
    tokenizer = load_tokenizer(directory)
    model.tokenizer = tokenizer
    if tokenizer is not None:
        if model.mask_id is None and tokenizer.mask_token_id is not None:
            model.mask_id = tokenizer.mask_token_id
        if model.pad_id is None:
            model.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.eos_ids = _eos_ids(model, directory, tokenizer)
    model.max_new_tokens = _generation_config(directory).get("max_new_tokens")
    return model
