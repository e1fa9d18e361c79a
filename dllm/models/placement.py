"""Where a model's weights go: one device (:func:`resolve_device`), or a device map that spreads a model bigger than
one device over several devices, the CPU and the disk with accelerate's big-model utilities (:func:`dispatch`, what
``dllm.load(..., device_map=...)`` runs): the map requested checked and resolved (a decoder layer never split),
then the weights streamed tensor by tensor to their device or the offload folder and accelerate's hooks attached.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import torch

from dllm.core.errors import CheckpointError, ConfigError
from dllm.models import registry
from dllm.models.base import DiffusionLM
from dllm.models.checkpoint import check_tensors, few, weight_files


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


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICES = "a GPU index (0), 'cuda:N', 'cpu', 'mps' or 'disk'"


def map_device(value, where: str | None = None) -> int | str:
    """A device of a device map in accelerate's spelling, checked to exist: a CUDA index (``0``, ``"cuda:1"`` ->
    1), ``"cpu"``, ``"disk"``, ``"mps"`` (or another torch device's name). ``where``: what the errors call it
    (default ``device_map=VALUE``)."""
    where = where or f"device_map={value!r}"
    if isinstance(value, str) and value.strip().lower() == "disk":
        return "disk"
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise ConfigError(f"{where} is not a device; use {_DEVICES}")
    try:
        device = torch.device(f"cuda:{value}" if isinstance(value, int) else value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{where} is not a device; use {_DEVICES}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            there = (
                f"there are only {count} CUDA device(s) (0 to {count - 1})"
                if count
                else f"this PyTorch ({torch.__version__}) sees no CUDA GPU"
            )
            raise ConfigError(
                f"{where} names CUDA device {index}, but {there}: use a device there is ('cpu', "
                "'disk' or an existing GPU index), or use device_map='auto', which places the model on the devices "
                "there are"
            )
        return index
    if device.type == "meta":
        raise ConfigError(f"{where}: the meta device holds no weights; use {_DEVICES}")
    if device.type == "cpu":
        return "cpu"
    try:
        resolve_device(device)  # mps: usable here
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return str(device)


def torch_device(value: int | str) -> torch.device:
    return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)


def requested_map(device_map) -> str | dict[str, int | str]:
    """``device_map`` as given, checked before the checkpoint is read: a strategy name (:data:`DEVICE_MAPS`), or a
    dict {module name: device} with its devices in accelerate's spelling (:func:`map_device`); a single device
    (``"cpu"``, ``0``, ``"cuda:1"``) means the whole model there (``{"": device}``)."""
    if isinstance(device_map, str) and device_map.strip().lower() in DEVICE_MAPS:
        return device_map.strip().lower()
    if isinstance(device_map, dict):
        if not device_map:
            raise ConfigError("device_map is an empty dict; map module names to devices, or use device_map='auto'")
        named = [k for k in device_map if not isinstance(k, str)]
        if named:
            raise ConfigError(
                f"device_map keys are module names (strings such as 'model.layers.0'), got {named[0]!r}; "
                "the devices are the values"
            )
        return {k: map_device(v, f"device_map[{k!r}] = {v!r}") for k, v in device_map.items()}
    if isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        try:
            return {"": map_device(device_map)}
        except ConfigError:
            if not isinstance(device_map, str) or device_map.strip().lower() in ("cpu", "disk", "mps"):
                raise
            if device_map.strip().lower().startswith("cuda"):
                raise
    raise ConfigError(
        f"device_map={device_map!r} is neither a strategy ({', '.join(repr(m) for m in DEVICE_MAPS)}), a device, "
        "nor a dict {module name: device} (e.g. {'model.layers.0': 0, 'model.layers.1': 'cpu', ...})"
    )


def check_max_memory(max_memory) -> dict[int | str, int] | None:
    """accelerate's ``max_memory``, checked: {device: size}, a device a GPU index (or ``"cuda:N"``), ``"cpu"``,
    ``"mps"`` or ``"disk"``, a size a number of bytes or a string such as ``"20GiB"`` / ``"500MB"``."""
    if max_memory is None:
        return None
    if not isinstance(max_memory, dict) or not max_memory:
        raise ConfigError(
            f"max_memory must be a dict {{device: size}}, e.g. {{0: '20GiB', 'cpu': '60GiB'}}, got {max_memory!r}"
        )
    from accelerate.utils import convert_file_size_to_int

    out = {}
    for key, size in max_memory.items():
        spelled = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        device = map_device(spelled, f"max_memory key {key!r}")  # (a size per device there is)
        try:
            text = size.strip() if isinstance(size, str) else None
            value = size if text is None else int(text) if text.isdigit() else convert_file_size_to_int(text)
        except (ValueError, TypeError):
            value = None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"max_memory[{key!r}] = {size!r} is not a size; use a number of bytes or a string such as '20GiB', "
                "'500MB'"
            )
        out[device] = value
    return out


def _mapped(name: str, device_map: dict) -> int | str | None:
    """The device ``device_map`` gives the module or tensor ``name`` (its own entry or its closest parent's)."""
    while name not in device_map:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return device_map[name]


def _few_names(items, n: int = 6) -> str:
    return few([repr(i) if i else "the whole model ('')" for i in items], n)


def check_device_map(model: DiffusionLM, device_map: dict[str, int | str]) -> None:
    """A clear :class:`ConfigError` for a device map that does not fit ``model``: a key naming no module (or a
    parameter instead of its module), a part of a decoder layer (a layer is never split), a module mapped twice
    (itself and a part of it), tensors left without a device, a tied head away from its embedding."""
    modules = dict(model.named_modules())
    name_of = {id(m): n for n, m in modules.items()}
    layers = [name_of[id(layer)] for layer in model.decoder]
    head = model.output
    parts = [name_of[id(model.embedding)], layers[0], "...", layers[-1], name_of[id(model.final_norm)]]
    parts += [] if head is None else [name_of[id(head)]]
    example = "{" + ", ".join("..." if p == "..." else f"{p!r}: 0" for p in parts) + "}"
    tensors = list(model.state_dict())
    for key in device_map:
        if key == "" or key in modules:
            inside = next((layer for layer in layers if key.startswith(layer + ".")), None)
            if inside is not None:
                raise ConfigError(
                    f"device_map key {key!r} is a part of decoder layer {inside!r} ({type(modules[inside]).__name__}); "
                    f"a decoder layer is never split across devices: map {inside!r} as a whole"
                )
            continue
        if key in tensors:
            hint = f" (a tensor: map its module {key.rpartition('.')[0]!r})"
        else:
            close = difflib.get_close_matches(key, list(modules), n=3)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(
            f"device_map key {key!r} names no module of this {model.family} model{hint}; keys are module names, "
            f"e.g. {example} (print(model) shows them; '' is the whole model)"
        )
    keys = sorted(device_map)
    for outer in keys:
        inner = next((k for k in keys if k != outer and (outer == "" or k.startswith(outer + "."))), None)
        if inner is not None:
            raise ConfigError(
                f"device_map maps {_few_names([outer])} and also {inner!r}, a part of it: map each module once "
                f"(drop {inner!r}, or map the other parts of {_few_names([outer])} one by one)"
            )
    uncovered = list(dict.fromkeys(t.rpartition(".")[0] for t in tensors if _mapped(t, device_map) is None))
    if uncovered:
        raise ConfigError(
            f"device_map gives no device to {_few_names(uncovered)}: map each (or a module holding it), e.g. {example}"
        )
    family = registry.of_model(model)
    if head is not None and family.head_is_tied(model.config):
        head_name, embedding = name_of[id(head)], name_of[id(model.embedding)]
        here, there = _mapped(head_name, device_map), _mapped(embedding, device_map)
        if here != there:
            raise ConfigError(
                f"the LM head {head_name!r} shares its weight with the embedding {embedding!r} (a tied checkpoint), "
                f"but device_map puts them on {here!r} and {there!r}: map both to the same device"
            )


def place(model: DiffusionLM, requested, max_memory, dtype: torch.dtype) -> dict[str, int | str]:
    """The device map of ``model`` (built on the meta device): a strategy resolved by accelerate's
    ``infer_auto_device_map`` (over ``get_balanced_memory`` but for ``"sequential"``) within ``max_memory``,
    never splitting a decoder layer (the classes of ``model.decoder``'s layers), or the explicit dict, checked
    (:func:`check_device_map`)."""
    if isinstance(requested, dict):
        if max_memory is not None:
            raise ConfigError(
                "max_memory sizes the devices for a device_map strategy ('auto', 'balanced', 'balanced_low_0', "
                "'sequential'); an explicit device_map places every module itself: leave max_memory out"
            )
        check_device_map(model, requested)
        return requested
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = sorted({type(layer).__name__ for layer in model.decoder})
    memory = dict(max_memory) if max_memory is not None else None
    try:
        if requested != "sequential":
            low_zero = requested == "balanced_low_0"
            memory = get_balanced_memory(model, memory, no_split, dtype=dtype, low_zero=low_zero)
        device_map = infer_auto_device_map(model, memory, no_split, dtype=dtype)
    except (ValueError, KeyError, RuntimeError) as e:  # accelerate's own complaints about max_memory
        raise ConfigError(
            f"device_map={requested!r} could not place the model within max_memory={max_memory!r} "
            f"({type(e).__name__}: {e})"
        ) from None
    device_map = {k: map_device(v, f"device_map[{k!r}] = {v!r}") for k, v in device_map.items()}
    check_device_map(model, device_map)
    return device_map


def _main_device(model: DiffusionLM, device_map: dict) -> int | str:
    """Where a dispatched model computes what is offloaded to the CPU or disk and where its canvas lives (unless the
    embedding is on another device): the embedding's device, else the map's first device that is not the CPU or
    disk, else the CPU."""
    names = [n for n, _ in model.named_modules()]
    name_of = {id(m): n for n, m in model.named_modules()}
    first = _mapped(name_of[id(model.embedding)], device_map)
    if first not in ("cpu", "disk"):
        return first
    found = (_mapped(n, device_map) for n in names)
    return next((d for d in found if d is not None and d not in ("cpu", "disk")), "cpu")


def _damaged(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} cannot be read as safetensors ({type(error).__name__}: {error}); the file is truncated or corrupt: "
        "download or copy it again"
    )


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the checkpoint's safetensors files, from their headers (no data read)."""
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except Exception as e:  # SafetensorError, OSError: the file is damaged
            raise _damaged(f, e) from None
    return shapes


def _tensors(path: Path, wanted: set[str]):
    """(name, tensor) for each tensor of the safetensors file ``path`` named in ``wanted``, read one at a time from
    the memory-mapped file onto the CPU."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:
        raise _damaged(path, e) from None
    with handle as st:
        for name in [k for k in st.keys() if k in wanted]:
            try:
                tensor = st.get_tensor(name)
            except Exception as e:  # the data past a sound header is damaged
                raise _damaged(path, e) from None
            yield name, tensor


def _stream_weights(model, files, keys, device_map, dtype, offload_folder) -> None:
    """Each checkpoint tensor of ``keys``, read alone from its file, cast to ``dtype`` and put where ``device_map``
    maps it: onto its device, or written to ``offload_folder`` (accelerate's ``.dat`` files and ``index.json``)
    for ``"disk"``, the module staying on the meta device."""
    import inspect

    from accelerate.utils import offload_weight, save_offload_index, set_module_tensor_to_device

    once = {"clear_cache": False} if "clear_cache" in inspect.signature(set_module_tensor_to_device).parameters else {}
    family = registry.of_model(model)
    tied = family.head_is_tied(model.config) and model.output is not None
    embedding = next(n for n, m in model.named_modules() if m is model.embedding) + ".weight"
    wanted, index = set(keys), {}
    for f in files:
        for name, tensor in _tensors(f, wanted):
            tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
            target = _mapped(name, device_map)
            if target == "disk":
                offload_weight(tensor, name, offload_folder, index)
                if tied and name == embedding:  # the head's hook reads its own name
                    offload_weight(tensor, family.tied_head, offload_folder, index)
            else:
                set_module_tensor_to_device(model, name, torch_device(target), value=tensor, **once)
    save_offload_index(index, offload_folder)
    if family.head_is_tied(model.config):
        family.tie(model)


def dispatch(model: DiffusionLM, directory: Path, requested, max_memory, offload_folder, dtype) -> None:
    """Load ``model``'s weights (built on the meta device, in ``dtype``) from ``directory`` according to the device
    map ``requested`` (see :func:`load`), tensor by tensor, and attach accelerate's hooks
    (``dispatch_model``) where the map spans several devices or the disk; the modules that compute somewhere get
    :data:`dllm.models.layers.PLACED`. Sets ``model.hf_device_map`` (as transformers does)."""
    from accelerate import dispatch_model

    from dllm.models.layers import PLACED

    files = weight_files(directory)
    keys = check_tensors(model, _tensor_shapes(files), str(directory))
    device_map = place(model, requested, max_memory, dtype)
    disk = [k for k, v in device_map.items() if v == "disk"]
    if disk and offload_folder is None:
        what = "device_map puts" if isinstance(requested, dict) else f"device_map={requested!r} within max_memory="
        what += "" if isinstance(requested, dict) else f"{max_memory!r} puts"
        raise ConfigError(
            f"{what} {_few_names(disk)} on the disk, which needs a folder for the weights it offloads: pass "
            "offload_folder=DIR (a directory with room for them)"
            + ("" if isinstance(requested, dict) else ", or give the devices more max_memory")
        )
    if offload_folder is not None:
        offload_folder = Path(offload_folder).expanduser()
        try:
            offload_folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"offload_folder {str(offload_folder)!r} cannot be made a directory ({e})") from None
    _stream_weights(model, files, keys, device_map, dtype, offload_folder)
    model.eval().requires_grad_(False)
    main = _main_device(model, device_map)
    dispatch_model(model, device_map, main_device=main, offload_dir=None if not disk else str(offload_folder))
    model.hf_device_map = device_map
    if len(set(device_map.values())) > 1 or disk:  # accelerate's hooks run it: say where each part computes
        name_of = {id(m): n for n, m in model.named_modules()}
        for module in (model.embedding, *model.decoder, model.final_norm, model.output):
            if module is not None:
                target = _mapped(name_of[id(module)], device_map)
                setattr(module, PLACED, torch_device(main if target in ("cpu", "disk") else target))
