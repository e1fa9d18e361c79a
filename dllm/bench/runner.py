"""The ablation runner behind ``dllm bench``: models × samplers × hyper-parameters × caches × tasks.

A *cell* is one (model, sampler, its hyper-parameters, generation settings, cache, task). It runs the
task's ``n`` test examples in batches and writes ``runs/<cell-id>.jsonl.gz`` (gzip-compressed JSON lines; a
``runs/<cell-id>.jsonl`` of an older run is read and resumed as well, :mod:`dllm.bench.records`) under the
output directory:
a header line (the cell, seeds, batch size, environment record), then one line per sample (``task``,
``model``, ``sampler``, ``settings``, ``correct``, ``nfe``, ``tokens``, ``seconds``, ...). A finished
cell is skipped when the sweep is run again, a cell cut short resumes at its first unfinished batch,
and every run rewrites ``summary.md`` and the plots from all the record files (:mod:`dllm.bench.report`).

Accounting: the figures come from the :class:`~dllm.engine.generation.Generation` of each batched
``generate`` call (``nfe``; ``tokens`` counted by :func:`~dllm.engine.generation.count_generated`;
``seconds``). The runner only spreads a batch's figures over its rows: a sample's ``nfe`` is its
batch's (a batched forward counts once for every row in it), its ``tokens`` are its own, its
``seconds`` the batch's wall time divided by the batch size.

Data parallel: under ``accelerate launch --num_processes N -m dllm bench ...`` (or ``dllm bench --processes
N``, which runs that command) every process loads the model on its own device and the batches of a cell are
dealt out in rounds of N (batch ``k`` of a round to process ``k``); process 0 gathers each round and writes
its samples in order, so the JSONL files hold the same batches, seeds and records as a single-process run
(only the wall times differ), and a cell cut short resumes the same way.

Speedups are measured against the one-token-per-step reference sampler of the model's family (``llada``
for LLaDA, ``dream`` for Dream, ``sdar`` for SDAR) run in the same sweep with the same task, generation
length, block size and temperature; the runner adds that cell when the sweep lacks it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from dllm.bench.report import GENERATION_KEYS, short_name  # GENERATION_KEYS go to generate(); other keys: hyper
from dllm.core import geometry
from dllm.core.errors import ConfigError

STEP_KEYS = ("steps", "steps_per_block")
# The one-token-per-step reference sampler of each model family.
# "none": no approximate cache; the sampler's default still applies (SDAR's exact block K/V reuse, WeDLM's
# stream of the committed prefix). "recompute": no cache at all (generate(cache=None)), every forward recomputes
# every column: what those exact caches save. Every other name is a cache of dllm.caches; a --set key that is
# one of its hyper-parameters is swept for the cells of that cache.
NO_CACHE = "none"
RECOMPUTE = "recompute"
NOT_CACHES = (NO_CACHE, RECOMPUTE)
SPLIT = "test"
FORMAT = 1  # version of the JSONL layout


@dataclasses.dataclass
class BenchConfig:
    """One sweep. ``grid`` maps a setting to the values to sweep (the cartesian product is taken per
    sampler, over the keys that sampler has); ``max_new_tokens`` / ``block_size`` / ``temperature`` are
    the values used when the grid does not sweep them."""

    models: list[str] = dataclasses.field(default_factory=lambda: ["tiny-llada"])
    samplers: list[str] = dataclasses.field(default_factory=lambda: ["llada", "threshold"])
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["arith"])
    n: int = 100
    seed: int = 0
    grid: dict[str, list] = dataclasses.field(default_factory=dict)
    caches: list[str] = dataclasses.field(default_factory=lambda: ["none"])
    max_new_tokens: int | None = None  # None: each task's own length (fits its answers + EOS)
    block_size: int = 8
    temperature: float = 0.0
    batch_size: int = 16
    out: str | Path = "bench-out"
    device: str | None = None
    dtype: str | None = None
    progress: bool = True

    @classmethod
    def from_mapping(cls, values: dict, where: str = "config") -> BenchConfig:
        """Build from a dict (a YAML file's contents): list-valued keys accept lists or comma-separated
        strings; ``set`` (alias ``grid``) maps keys to a value or a list of values."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = dict(values)
        if "set" in values:
            if "grid" in values:
                raise ConfigError(f"{where}: give the grid as 'set' or as 'grid', not both")
            values["grid"] = values.pop("set")
        unknown = sorted(set(values) - fields)
        if unknown:
            valid = sorted((fields - {"grid"}) | {"set"})
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}"
            )
        for key in ("models", "samplers", "tasks", "caches"):
            if key in values:
                values[key] = as_list(values[key], key)
        if "grid" in values:
            grid = values["grid"] or {}
            if not isinstance(grid, dict):
                raise ConfigError(f"{where}: 'set' must map keys to values, e.g. set: {{threshold: [0.8, 0.9]}}")
            values["grid"] = {str(k): list(v) if isinstance(v, (list, tuple)) else [v] for k, v in grid.items()}
        return cls(**values)


def as_list(value, key: str) -> list[str]:
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [str(v).strip() for v in value]
    else:
        raise ConfigError(f"{key} must be a list or a comma-separated string, got {value!r}")
    items = [v for v in items if v]
    if not items:
        raise ConfigError(f"{key} is empty")
    return list(dict.fromkeys(items))


def load_yaml(path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping (models:, samplers:, tasks:, n:, seed:, set:, caches:)")
    return data


def check_out(out) -> None:
    """The output directory (and its ``runs/``) can be created and written: checked before any model loads."""
    out = Path(out)
    for path in (out / "runs", out):
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--out {out}: {path} is a file, not a directory; give a directory (new or a bench's)")
    for parent in (out, *out.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out {out}: {parent} is a file, so no directory can be made under it")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"--out {out}: {parent} is not writable; give a directory you can write to")
            return


def expand_grid(grid: dict[str, list]) -> list[dict]:
    """Cartesian product of ``{key: [values]}`` as a list of ``{key: value}`` (key and value order kept)."""
    keys = list(grid)
    values = []
    for key in keys:
        v = grid[key]
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        if not v:
            raise ConfigError(f"the grid gives no values for {key!r}")
        values.append(v)
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


# -- validation ------------------------------------------------------------------------------------


def validate(config: BenchConfig) -> None:
    """Every check that needs no model: samplers, tasks, caches, grid keys, sizes."""
    from dllm import samplers
    from dllm.models import loading

    # unknown sampler -> ConfigError listing the available ones; names are case-insensitive
    config.samplers = list(dict.fromkeys(samplers.registry.canonical(name) for name in config.samplers))
    loading.resolve_device(config.device)  # a missing GPU or a bad dtype fails before anything runs
    loading.resolve_dtype(config.dtype)
    known = task_names()
    unknown = [t for t in config.tasks if t not in known]
    if unknown:
        raise ConfigError(f"unknown task(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}")
    from dllm import caches

    bad = [c for c in config.caches if c not in NOT_CACHES and c not in caches.names()]
    if bad:
        raise ConfigError(
            f"unknown cache(s) {', '.join(map(repr, bad))}; available: {', '.join(NOT_CACHES)}, "
            f"{', '.join(caches.names())}"
        )
    for key in ("n", "batch_size", "max_new_tokens", "block_size"):
        value = getattr(config, key)
        if key == "max_new_tokens" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if not isinstance(config.seed, int) or isinstance(config.seed, bool):
        raise ConfigError(f"seed must be an integer, got {config.seed!r}")
    check_out(config.out)
    for name in config.tasks:
        task = task_module().get(name)
        size = task.size(SPLIT) if hasattr(task, "size") else None
        if size is not None and config.n > size:
            raise ConfigError(
                f"task {name!r} has {size} {SPLIT} problems, fewer than n={config.n}: use --n {size} or less"
            )
    check_grid_keys(config.samplers, config.grid, config.caches)
    if all(k in config.grid for k in STEP_KEYS):
        raise ConfigError("sweep steps or steps_per_block, not both (steps = steps_per_block * blocks)")


def sampler_keys(name: str, grid: dict) -> set[str]:
    """The grid keys sampler ``name`` takes: its hyper-parameters; for a part over a base (an exit rule),
    ``base`` and the hyper-parameters of every base the grid names (or of its default base)."""
    from dllm import samplers

    if not samplers.registry.is_part(name):
        return set(samplers.defaults(name))
    bases = grid.get("base") or [None]
    return set().union(*(samplers.defaults(name, base) for base in bases))


def cache_keys(name: str) -> set[str]:
    """The hyper-parameters of cache ``name`` ("none", "recompute": none)."""
    from dllm import caches

    return set() if name in NOT_CACHES else set(caches.defaults(name))


def check_grid_keys(sampler_names: list[str], grid: dict, cache_names: list[str] = (NO_CACHE,)) -> None:
    """Every grid key is a generation setting or a hyper-parameter of at least one sampler or cache of the
    sweep, and never of both a sampler and a cache (the key would be ambiguous)."""
    from dllm import samplers

    fields = {name: sampler_keys(name, grid) for name in sampler_names}
    cached = {name: cache_keys(name) for name in cache_names}
    valid = set(GENERATION_KEYS).union(*fields.values())
    for key in grid:
        owners = [name for name, keys in cached.items() if key in keys]
        if owners and key in valid:
            raise ConfigError(
                f"--set {key} is a hyper-parameter of cache {owners[0]!r} and of a sampler or generate(): rename "
                "one or sweep it in separate runs"
            )
        if key in valid or owners:
            continue
        owners = [name for name in samplers.names() if key in sampler_keys(name, {})]
        hint = f" ({key!r} belongs to sampler {', '.join(owners)}: add it to the samplers)" if owners else ""
        raise ConfigError(
            f"no sampler of this sweep ({', '.join(sampler_names)}) has a setting {key!r}{hint}; valid keys: "
            f"generation {', '.join(GENERATION_KEYS)}; "
            + "; ".join(f"{name} {', '.join(sorted(f)) or '(none)'}" for name, f in fields.items())
        )


def task_module():
    """``dllm.tasks``, imported on first use."""
    import importlib

    return importlib.import_module("dllm.tasks")


def task_names() -> list[str]:
    return list(task_module().names())


# -- cells -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    model: str
    family: str
    task: str
    sampler: str
    hp: dict  # every hyper-parameter of the sampler (defaults included)
    generation: dict  # keyword arguments of generate(): max_new_tokens, block_size, steps, steps_per_block, ...
    cache: str
    n: int
    seed: int
    grid: dict = dataclasses.field(default_factory=dict)  # the swept values as given (e.g. steps="G/2")
    reference: bool = False
    cache_hp: dict = dataclasses.field(default_factory=dict)  # the cache's hyper-parameters (defaults included)

    def identity(self) -> dict:
        """What makes two cells the same measurement (and names its file)."""
        return {
            "model": self.model,
            "task": self.task,
            "sampler": self.sampler,
            "hp": self.hp,
            "generation": self.generation,
            "cache": self.cache,
            **({"cache_hp": self.cache_hp} if self.cache_hp else {}),
            "n": self.n,
            "seed": self.seed,
        }

    @property
    def id(self) -> str:
        digest = hashlib.sha1(canonical(self.identity()).encode()).hexdigest()[:10]
        return f"{slug(self.task)}-{slug(short_name(self.model))}-{slug(self.sampler)}-{digest}"

    def describe(self) -> dict:
        return {**self.identity(), "family": self.family, "grid": self.grid, "reference": self.reference}


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text).strip("_") or "x"


def resolve_fraction(value, whole: int, letter: str, key: str) -> int:
    """An integer, or ``"G"`` / ``"G/k"`` (``letter`` = G: max_new_tokens, B: block size) -> an integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = re.fullmatch(rf"\s*{letter}\s*(?:/\s*([0-9]+)\s*)?", value)
        if m:
            k = int(m.group(1) or 1)
            if k < 1 or whole % k:
                raise ConfigError(f"{key}={value!r}: {letter}={whole} is not divisible by {k}")
            return whole // k
    meaning = "max_new_tokens" if letter == "G" else "the block size"
    raise ConfigError(f"{key} must be an integer or {letter!r} / '{letter}/k' (a fraction of {meaning}), got {value!r}")


def resolve_generation(model, sampler, values: dict) -> dict:
    """Grid values (``steps`` may be ``"G/2"``) -> the exact generate() keyword arguments of one cell.

    Full-attention models get ``block_size`` and total ``steps`` (one token per step when not swept);
    block-causal models (SDAR) keep their own block size (``block_size=None``) and get ``steps_per_block``
    (a swept ``steps`` is turned into the same number of tokens per step). Samplers whose number of steps
    is data-dependent (``fixed_steps = False``, e.g. ``threshold``) get neither: they do not use steps.
    """
    g = values["max_new_tokens"]
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {g!r}")
    temperature = values["temperature"]
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise ConfigError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    steps = spb = None
    if sampler.process == "stream":  # WeDLM's streaming decoder: a window, no blocks
        bs = block_size = None
    elif model.attention.block_causal:  # its own block size, aligned to its positions
        bs, block_size = model.block_size, None
    else:
        bs = block_size = values["block_size"]
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise ConfigError(f"block_size must be a positive integer, got {bs!r}")
        if g % bs and sampler.grid_blocks:  # adaptive-block samplers take any block_size
            raise ConfigError(f"max_new_tokens={g} is not a multiple of block_size={bs}")
    if sampler.fixed_steps:
        if values.get("steps_per_block") is not None:
            spb = resolve_fraction(values["steps_per_block"], bs, "B", "steps_per_block")
        elif values.get("steps") is not None:
            total = resolve_fraction(values["steps"], g, "G", "steps")
            if model.attention.block_causal:
                spb, rest = divmod(total * bs, g)
                if rest or spb < 1:
                    raise ConfigError(
                        f"steps={values['steps']!r} ({total}) for max_new_tokens={g} is not a whole number of "
                        f"steps per block of this {model.family} model's {bs} positions; give steps_per_block"
                    )
            else:
                steps = total
        elif model.attention.block_causal:
            spb = bs
        else:
            steps = g
        if not model.attention.block_causal and spb is not None:
            steps, spb = spb * (g // bs), None
    generation = {
        "max_new_tokens": g,
        "block_size": block_size,
        "steps": steps,
        "steps_per_block": spb,
        "temperature": float(temperature),
    }
    if values.get("kernel") is not None:  # the scoring backend, only when swept (cells keep their ids otherwise)
        from dllm.kernels import backends

        kernel = values["kernel"]
        if kernel not in ("auto", *backends()):  # the device is checked when the cell runs (generate)
            raise ConfigError(f"kernel must be one of {', '.join(('auto', *backends()))}, got {kernel!r}")
        generation["kernel"] = kernel
    if values.get("compile"):  # torch.compile of the model forward (only when asked: cells without it keep their ids)
        from dllm.engine import compiled

        compiled.check(values["compile"])
        generation["compile"] = values["compile"]
    if values.get("static_shapes") is not None and values["static_shapes"] is not False:  # (only when asked)
        if values["static_shapes"] is not True:
            raise ConfigError(f"static_shapes must be true or false, got {values['static_shapes']!r}")
        generation["static_shapes"] = True
    geometry.resolve(model, sampler, 0, g, block_size, steps, spb)  # refused now, as generate would (no prompt yet)
    return generation


def typed_hp(name: str, hp: dict) -> dict:
    """Only the keys sampler ``name`` takes (over the point's ``base``, for a part), with integers given for
    float hyper-parameters as floats, so ``threshold=1`` and ``1.0`` are one cell."""
    from dllm import samplers

    defaults = samplers.defaults(name, hp.get("base")) if samplers.registry.is_part(name) else samplers.defaults(name)
    return {
        k: float(v) if isinstance(defaults.get(k), float) and isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in hp.items()
        if k in defaults
    }


def plan_model(config: BenchConfig, name: str, model, log: Callable[[str], None] = print) -> list[Cell]:
    """The cells of one model (``model`` may live on the meta device: only its facts are read)."""
    from dllm import samplers, tasks
    from dllm.models import registry as families

    base = {"block_size": config.block_size}
    base["temperature"] = config.temperature
    cells: dict[str, Cell] = {}
    unused_steps: set[str] = set()
    said: set[str] = set()

    def note(message: str) -> None:  # a refusal met at every task or grid point is said once
        if message not in said:
            said.add(message)
            log(message)

    def add(cell: Cell) -> None:
        if cell.id in cells:
            cells[cell.id].reference |= cell.reference
            cells[cell.id].grid = cells[cell.id].grid or cell.grid
        else:
            cells[cell.id] = cell

    for sampler_name in config.samplers:
        fields = sampler_keys(sampler_name, config.grid)
        try:
            samplers.get(sampler_name).check_drives(model)
        except ConfigError as e:
            note(f"dllm bench: skipping sampler {sampler_name!r} on {name}: {e}")
            continue
        keys = [k for k in config.grid if k in fields or k in GENERATION_KEYS]
        for point in expand_grid({k: config.grid[k] for k in keys}):
            hp = typed_hp(sampler_name, {k: v for k, v in point.items() if k in fields})
            sampler = samplers.get(sampler_name, **hp)
            if not sampler.fixed_steps:  # adaptive: steps are not used, so a swept value makes no cell of its own
                swept = [k for k in STEP_KEYS if k in point]
                if swept and sampler.name not in unused_steps:
                    unused_steps.add(sampler.name)
                    note(
                        f"dllm bench: {'/'.join(swept)} not used by {sampler.name!r} (adaptive: the data decides its "
                        "steps); one cell for every swept value"
                    )
                point = {k: v for k, v in point.items() if k not in STEP_KEYS}
            for task in config.tasks:
                g = config.max_new_tokens or tasks.get(task).max_new_tokens
                generation = resolve_generation(
                    model,
                    sampler,
                    {**base, "max_new_tokens": g, **{k: v for k, v in point.items() if k in GENERATION_KEYS}},
                )
                for cache in config.caches:
                    keys = [k for k in config.grid if k in cache_keys(cache)]
                    for cache_point in expand_grid({k: config.grid[k] for k in keys}):
                        cache_hp = cache_settings(cache, cache_point)
                        why = refusal(model, sampler, cache, cache_hp)
                        if why:
                            note(f"dllm bench: skipping {sampler_name} with cache {cache!r} on {name}: {why}")
                            continue
                        add(
                            Cell(
                                name,
                                model.family,
                                task,
                                sampler_name,
                                sampler.settings(),
                                generation,
                                cache,
                                config.n,
                                config.seed,
                                grid={**point, **cache_point},
                                cache_hp=cache_hp,
                            )
                        )
    if not cells:
        note(f"dllm bench: no sampler of this sweep can run {name}; skipping it")
        return []
    # one reference per (task, generation length, block size, temperature) the sweep measures
    if families.of_model(model).reference_sampler is None:
        note(f"dllm bench: no reference sampler for {model.family} models ({name}); speedups will be missing")
        return list(cells.values())
    ref_sampler = samplers.reference(model.family)
    ref_name = ref_sampler.name
    for cell in list(cells.values()):
        g = cell.generation
        values = {"max_new_tokens": g["max_new_tokens"], "block_size": g["block_size"], "temperature": g["temperature"]}
        values["compile"] = g.get("compile", False)  # the reference runs as its cell does
        values["static_shapes"] = g.get("static_shapes", False)
        generation = resolve_generation(model, ref_sampler, values)
        add(
            Cell(
                name,
                model.family,
                cell.task,
                ref_name,
                ref_sampler.settings(),
                generation,
                "none",
                config.n,
                config.seed,
                reference=True,
            )
        )
    return list(cells.values())


def cache_settings(name: str, point: dict) -> dict:
    """Every hyper-parameter of cache ``name`` (defaults included) with the grid point's values."""
    from dllm import caches

    return {} if name in NOT_CACHES else caches.get(name, **point).settings()


def make_cache(name: str, hp: dict):
    """The ``generate(cache=...)`` argument of a cell: "default" for "none" (the sampler's own exact scheme), None
    for "recompute"."""
    from dllm import caches

    if name == RECOMPUTE:
        return None
    return "default" if name == NO_CACHE else caches.get(name, **hp)


def refusal(model, sampler, cache: str, hp: dict) -> str | None:
    """Why ``sampler`` cannot run with ``cache`` on ``model``: the questions ``prepare`` asks, in its order, of
    the sampler (``Sampler.check_cache``) and of the cache (``Cache.check_model``), which need no prompt. "none"
    is the sampler's own default (a block cache on block-causal models)."""
    obj = sampler.default_cache(model) if cache == NO_CACHE else make_cache(cache, hp)
    try:
        sampler.check_cache(model, obj)
        if obj is not None:
            obj.check_model(model)
    except ConfigError as e:
        return str(e)
    return None


def model_facts(name: str):
    """The model built on the meta device from its config.json: family, attention, block size, lengths,
    without reading weights (so that a sweep whose cells are all finished loads nothing)."""
    from dllm.models import loading

    config = loading.read_config(loading.resolve(name))
    with loading.on_meta():
        return loading.family_of(config)(config)


# -- files -----------------------------------------------------------------------------------------


def environment(model) -> dict:
    """What the wall-time figures depend on."""
    import dllm

    device = model.device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = cpu_name()
    return {
        "dllm": dllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runs_dir(out) -> Path:
    return Path(out) / "runs"


def cell_path(out, cell: Cell) -> Path:
    from dllm.bench import records

    return records.cell_file(runs_dir(out), cell.id)


def cell_status(path: Path, cell: Cell, batch_size: int, env: dict | None) -> tuple[str, list[dict]]:
    """("done" | "partial" | "new", the samples worth keeping) for the file of ``cell``.

    A finished file counts only when it was measured with the same batch size (each sample's NFE is its batch's
    and the sampling seeds follow the batches) and, when known, on the same device and dtype: a rerun with
    another ``--batch-size`` / ``--device`` / ``--dtype`` measures the cell again instead of mixing the two. A
    partial file is kept only when it was measured the same way (same cell, batch size and, when known,
    environment); only whole batches are kept so that a resumed cell batches exactly as a fresh one."""
    from dllm.bench.report import read_cell_file

    if not path.is_file():
        return "new", []
    header, samples = read_cell_file(path)
    identity = cell.identity()
    if header is None or canonical({k: header.get("cell", {}).get(k) for k in identity}) != canonical(identity):
        return "new", []
    if header.get("batch_size") != batch_size:
        return "new", []
    if env is not None and any((header.get("environment") or {}).get(k) != env.get(k) for k in ("device", "dtype")):
        return "new", []
    if len(samples) >= cell.n:
        return "done", samples[: cell.n]
    if env is not None and header.get("environment") != env:
        return "new", []
    keep = len(samples) - len(samples) % batch_size
    return ("partial" if keep else "new"), samples[:keep]


def write_header(path: Path, cell: Cell, config: BenchConfig, env: dict, samples: list[dict]) -> None:
    import datetime

    header = {
        "type": "header",
        "format": FORMAT,
        "cell_id": cell.id,
        "cell": cell.describe(),
        "split": SPLIT,
        "n": cell.n,
        "seed": cell.seed,
        "batch_size": config.batch_size,
        "environment": env,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    from dllm.bench import records

    path.parent.mkdir(parents=True, exist_ok=True)
    with records.open_records(path, "w") as f:
        for record in [header, *samples]:
            f.write(json.dumps(record, default=str) + "\n")


# -- processes -------------------------------------------------------------------------------------


class Processes:
    """This process's place in a data-parallel run (``accelerate launch`` sets ``WORLD_SIZE``); one process
    otherwise. ``gather`` and ``broadcast`` go through accelerate (gloo on the CPU, NCCL on GPUs)."""

    def __init__(self):
        self.state = None
        self.rank, self.world = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState

            self.state = PartialState()
            self.rank, self.world = self.state.process_index, self.state.num_processes

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, requested):
        """Each process's own device: ``accelerate``'s unless the CPU is asked for."""
        if self.state is None or requested == "cpu":
            return requested
        return str(self.state.device)

    def gather(self, obj) -> list:
        """Every process's ``obj``, in rank order, on every process."""
        if self.state is None:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def broadcast(self, obj):
        """Process 0's ``obj`` on every process."""
        if self.state is None:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj])[0]

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


# -- running ---------------------------------------------------------------------------------------


def run(config: BenchConfig, log: Callable[[str], None] | None = None):
    """Run every unfinished cell of ``config``, then rewrite the report from all JSONL files.

    Returns the :class:`dllm.bench.report.Report` (rows of the summary table and the files written); in a
    data-parallel run, on process 0 only (None on the others).
    """
    from dllm.bench import report

    procs = Processes()
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if not procs.main:
        log = lambda msg: None  # noqa: E731
    validate(config)
    out = Path(config.out)
    planned: list[tuple[str, list[Cell]]] = []
    notes: list[str] = []  # why samplers or models were left out: logged, or the error when nothing is left
    for name in config.models:
        planned.append((name, plan_model(config, name, model_facts(name), notes.append)))
    if not any(cells for _, cells in planned):
        why = [n.removeprefix("dllm bench: skipping ") for n in notes if n.startswith("dllm bench: skipping ")]
        raise ConfigError(
            f"nothing to run: no sampler of this sweep ({', '.join(config.samplers)}) can run its model(s) "
            f"({', '.join(config.models)}) with its cache(s) ({', '.join(config.caches)}): " + "; ".join(why)
        )
    for note in notes:
        log(note)
    pending = {
        name: [c for c in cells if cell_status(cell_path(out, c), c, config.batch_size, None)[0] != "done"]
        for name, cells in planned
    }
    pending = procs.broadcast(pending)  # process 0's view of the files
    total_cells = sum(len(cells) for _, cells in planned)
    todo = sum(len(c) for c in pending.values())
    if total_cells > todo:
        done = total_cells - todo
        log(f"dllm bench: {done} of {total_cells} cells already finished in {runs_dir(out)}; skipping them")
    if todo:
        run_pending(config, pending, log, procs)
    procs.barrier()
    return report.write_report(out) if procs.main else None


def run_pending(config: BenchConfig, pending: dict[str, list[Cell]], log, procs: Processes | None = None) -> None:
    from tqdm.auto import tqdm

    import dllm

    procs = procs or Processes()
    tasks = task_module()
    examples: dict[str, list] = {}
    bar = tqdm(
        total=sum(len(c) for c in pending.values()) * config.n,
        unit="sample",
        desc="dllm bench",
        disable=not config.progress or not procs.main,
        dynamic_ncols=True,
    )
    try:
        for name, cells in pending.items():
            if not cells:
                continue
            model = dllm.load(name, device=procs.device(config.device), dtype=config.dtype)  # once per model
            env = procs.broadcast(environment(model))  # process 0's: the header's and the resume check's
            for cell in cells:
                if cell.task not in examples:
                    examples[cell.task] = tasks.get(cell.task).examples(SPLIT, config.n, config.seed)
                    if len(examples[cell.task]) < config.n:
                        raise ConfigError(
                            f"task {cell.task!r} gave {len(examples[cell.task])} {SPLIT} examples, fewer than "
                            f"n={config.n}; lower n"
                        )
            warm_up(model, cells[0], examples[cells[0].task])
            for cell in cells:
                task = tasks.get(cell.task)
                bar.set_postfix_str(f"{cell.task} {short_name(name)} {cell.sampler}", refresh=False)
                run_cell(cell, model, task, examples[cell.task], config, env, bar, log, procs)
            del model
    finally:
        bar.close()


def warm_up(model, cell: Cell, examples: list) -> None:
    """One untimed generation, so that the first cell measured does not pay for lazy initialisation
    (kernels, allocator, tokenizer caches) in its wall time."""
    from dllm import samplers

    sampler = samplers.get(cell.sampler, **cell.hp)
    cache = make_cache(cell.cache, cell.cache_hp)
    sampler.generate(model, [examples[0].prompt], seed=cell.seed, cache=cache, **cell.generation)


def run_cell(
    cell: Cell, model, task, examples: list, config: BenchConfig, env: dict, bar, log, procs: Processes | None = None
) -> None:
    from dllm import samplers
    from dllm.bench import records

    procs = procs or Processes()
    path = cell_path(config.out, cell)
    status, kept = procs.broadcast(cell_status(path, cell, config.batch_size, env) if procs.main else None)
    if status == "done":
        bar.update(cell.n)
        return
    if status == "new" and path.is_file():
        log(f"dllm bench: {path.name} was measured with another batch size or environment; running it again")
    if procs.main:
        write_header(path, cell, config, env, kept)  # rewrites a partial file without a torn last line
    if kept:
        log(f"dllm bench: resuming {cell.id} at sample {len(kept)}")
        bar.update(len(kept))
    sampler = samplers.get(cell.sampler, **cell.hp)
    starts = list(range(len(kept), cell.n, config.batch_size))
    for first in range(0, len(starts), procs.world):  # a round: one batch per process
        mine = starts[first + procs.rank] if first + procs.rank < len(starts) else None
        lines = [] if mine is None else sample_lines(cell, sampler, model, task, examples, mine, config.batch_size)
        rounds = procs.gather(lines)
        if procs.main:
            with records.open_records(path, "a") as f:
                f.write("".join(line for lines in rounds for line in lines))
        bar.update(sum(len(lines) for lines in rounds))
    if procs.main:
        records.compact(path)  # (finished: one gzip member instead of one per batch)


def sample_lines(cell: Cell, sampler, model, task, examples: list, start: int, batch_size: int) -> list[str]:
    """The JSONL lines of the batch of ``cell`` that starts at example ``start``."""
    batch = examples[start : start + batch_size]
    seed = cell.seed + start
    out = sampler.generate(
        model,
        [ex.prompt for ex in batch],
        seed=seed,
        cache=make_cache(cell.cache, cell.cache_hp),  # "none": the sampler's own exact scheme only (SDAR block K/V)
        **cell.generation,
    )
    if out.texts is None:
        raise ConfigError(f"{cell.model} has no tokenizer: benchmark tasks need text completions")
    settings = {**cell.hp, **cell.generation}
    lines = []
    for i, (ex, text) in enumerate(zip(batch, out.texts)):
        record = {
            "type": "sample",
            "cell_id": cell.id,
            "index": start + i,
            "task": cell.task,
            "example_task": ex.task,
            "model": cell.model,
            "sampler": cell.sampler,
            "settings": settings,
            "cache": cell.cache,
            "cache_hp": cell.cache_hp,
            "reference": cell.reference,
            "correct": bool(task.score(ex, text)),
            "nfe": out.nfe,
            "kernel": out.scorer,
            "tokens": int(out.tokens[i]),
            "arness": out.arness[i],
            "seconds": out.seconds / len(batch),
            "batch_size": len(batch),
            "seed": seed,
            "answer": ex.answer,
            "completion": text,
        }
        lines.append(json.dumps(record, default=str) + "\n")
    return lines
