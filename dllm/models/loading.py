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
from dllm.models.checkpoint import check_tensors, weight_files
from dllm.models.placement import check_max_memory, dispatch, requested_map, resolve_device, torch_device

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
    """A local directory for a bundled short name (``tiny-<family>``, the family's underscores as hyphens or not:
    ``tiny-fast-dllm-v2``), a directory, or a hub id (downloaded once)."""
    name = str(path_or_id)
    if name in BUNDLED:
        return BUNDLED[name]
    if name.startswith("tiny-") and name.replace("_", "-") in BUNDLED and not Path(name).expanduser().exists():
        return BUNDLED[name.replace("_", "-")]
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
    state = {}
    for f in weight_files(directory):
        state.update(checkpoint.read_safetensors(f))
    return state


def load_weights(model: DiffusionLM, state: dict[str, torch.Tensor], where: str) -> None:
    """Assign checkpoint tensors to a model built on the meta device; name every bad key."""
    expected = check_tensors(model, {k: tuple(v.shape) for k, v in state.items()}, where)
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    family = registry.of_model(model)
    if family.head_is_tied(model.config):
        family.tie(model)


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


# -- device maps: a model bigger than one device -----------------------------------------------------------------
# accelerate's strategies (infer_auto_device_map over get_balanced_memory, as transformers' from_pretrained)
def load(
    path_or_id: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    revision: str | None = None,
    device_map: str | dict | int | torch.device | None = None,
    max_memory: dict | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> DiffusionLM:
    """Load a LLaDA, Dream, SDAR or WeDLM checkpoint in its published layout.

    Args:
        path_or_id: a checkpoint directory, a hub id (``"GSAI-ML/LLaDA-8B-Instruct"``) or a bundled name.
        device: where to put the weights (default: ``"cuda"`` when available, else ``"cpu"``).
        dtype: parameter dtype, a ``torch.dtype`` or a name: ``float32`` / ``fp32``, ``bfloat16`` / ``bf16``,
            ``float16`` / ``fp16`` / ``half``, ``auto`` (default: :func:`default_dtype`: on a GPU the checkpoint's
            ``torch_dtype`` or bfloat16, on the CPU float32).
        device_map: instead of ``device``, place a model bigger than one device across several devices and CPU /
            disk offload, with accelerate's big-model utilities as transformers' ``from_pretrained(device_map=)``:
            ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"`` (accelerate's meanings: GPUs
            first, then the CPU, then the disk, within ``max_memory``), or a dict {module name: device} such as
            ``{"model.word_embeddings": 0, "model.layers.0": 0, ..., "lm_head": "cpu"}`` (devices: a GPU index,
            ``"cuda:N"``, ``"cpu"``, ``"mps"``, ``"disk"``; ``""`` is the whole model).
        max_memory: with a device_map strategy, accelerate's {device: size} (``{0: "20GiB", "cpu": "60GiB"}``).
        offload_folder: where the weights mapped to ``"disk"`` are written (required when some are).

    With ``device_map`` the model is built on the meta device, checked against the checkpoint's tensor headers
    and placed (a decoder layer is never split: the classes of ``model.decoder``'s layers are accelerate's
    no-split modules; a tied head stays with its embedding); then its weights are streamed: each tensor is read
    alone from its memory-mapped safetensors file, cast, and put on its device or written to ``offload_folder``,
    so that no device, and no host copy, ever holds the whole model. Not streamed: what the map puts on the CPU is
    kept whole in host memory (and brought to the main GPU for each forward by accelerate's hooks); the disk's
    weights are read back for each forward; without ``device_map`` the whole checkpoint is read into host memory
    first, as always. ``model.device`` is the embedding's execution device (the canvas lives there); each layer's
    K/V stay on its device; logits come back to ``model.device``; ``model.hf_device_map`` is the map used.
    """
    dtype = resolve_dtype(dtype)
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            given = "max_memory" if max_memory is not None else "offload_folder"
            raise ConfigError(
                f"{given} goes with device_map (it sizes or holds a model placed across devices): pass "
                "device_map='auto' too, or leave it out"
            )
        device = resolve_device(device)  # before any file is read: a bad device or dtype fails at once
    else:
        if device is not None:
            raise ConfigError(
                f"device={str(device)!r} and device_map={device_map!r} both say where the model goes: pass one "
                "(device_map='auto' spreads the model over the devices there are; device= puts it whole on one)"
            )
        requested = requested_map(device_map)
        max_memory = check_max_memory(max_memory)
        devices = [] if isinstance(requested, str) else [v for v in requested.values() if v not in ("cpu", "disk")]
        device = torch_device(devices[0]) if devices else resolve_device(None)  # the default dtype's device
    directory = resolve(path_or_id, revision)
    config = read_config(directory)
    family = registry.of_config(config)
    dtype = dtype or default_dtype(config, device)
    with on_meta():
        model = family.build(config)
    if device_map is None:
        load_weights(model, read_state_dict(directory), str(directory))
        model.to(device=device, dtype=dtype)
        model.eval().requires_grad_(False)
        model.prepare()
    else:
        model.to(dtype=dtype)  # on the meta device: what accelerate measures and the weights are cast to
        dispatch(model, directory, requested, max_memory, offload_folder, dtype)
    model.name_or_path = str(path_or_id)
    tokenizer = load_tokenizer(directory)
    model.tokenizer = tokenizer
    if tokenizer is not None:
        if model.mask_id is None and tokenizer.mask_token_id is not None and not model.uniform_state:
            model.mask_id = tokenizer.mask_token_id
        if model.pad_id is None:
            model.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.eos_ids = _eos_ids(model, directory, tokenizer)
    model.max_new_tokens = _generation_config(directory).get("max_new_tokens")
    model.trained_lengths = _trained_lengths(directory)
    return model


def _trained_lengths(directory: Path) -> dict[str, int] | None:
    """``max_prompt`` / ``max_new_tokens`` of the training run recorded in ``training.json`` (dllm.train's record,
    shipped with the bundled models), or None."""
    path = directory / "training.json"
    if not path.is_file():
        return None
    config = checkpoint.read_json_object(path).get("config", {})
    lengths = {key: config.get(key) for key in ("max_prompt", "max_new_tokens")}
    return lengths if all(isinstance(v, int) and v > 0 for v in lengths.values()) else None
