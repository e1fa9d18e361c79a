"""Command line: ``dllm generate``, ``dllm serve``, ``dllm samplers`` and ``dllm bench``. Examples::

dllm generate $'Sort the list: 14 7 9\n'            # the bundled tiny-llada: a bench task prompt
dllm generate "What is 7*8?" --model GSAI-ML/LLaDA-8B-Instruct --chat --sampler threshold --set threshold=0.8
dllm generate "What is 7*8?" --sampler llada --cache dkv --set cache_reloading_step=8
dllm generate --prompts prompts.txt --jsonl --batch-size 32   # one prompt per line (or JSON lines); - reads stdin
dllm samplers
dllm caches
dllm bench --samplers llada,threshold --tasks arith --n 50 --set threshold=0.8,0.9
dllm serve tiny-llada --sampler threshold --port 8000   # OpenAI-compatible (dllm.serve)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from dllm.core.commands import exit_status, set_threads
from dllm.core.errors import ConfigError, DllmWarning
from dllm.core.settings import parse_set, parse_settings

DEFAULT_MODEL = "tiny-llada"
# What the bundled tiny models understand: the bench tasks' prompts, each ending with a newline.
BUNDLED_FORMATS = (
    "the bundled tiny models know only the bench tasks' prompts (dllm bench --list-tasks), each ending with a "
    "newline, e.g. $'Sort the list: 14 7 9\\n', $'Reverse the list: 3 17 0 8\\n', $'Pick 2 different items from "
    "the list: 26 22 19 21\\n' or a 2-3 step word problem, $'Ben has 3 apples. He gets 5 more from Ann. He doubles "
    "them. How many apples does Ben have now?\\n' (numbers below 100, the tasks' words)"
)


def warn(message: str) -> None:
    print(f"dllm: warning: {message}", file=sys.stderr)


def split_settings(settings: dict, sampler_keys: set, cache: str | None) -> tuple[dict, dict]:
    """``--set`` keys -> (sampler's, cache's): ``cache.KEY`` always goes to the cache; a plain key goes to the
    cache when it is one of the cache's hyper-parameters and not the sampler's (both: ambiguous)."""
    import dllm

    cache_keys = set(dllm.caches.defaults(cache)) if cache not in (None, "none") else set()
    to_sampler, to_cache = {}, {}
    for key, value in settings.items():
        if key.startswith("cache."):
            if cache in (None, "none"):
                raise ConfigError(f"--set {key}: no cache selected; add --cache NAME")
            to_cache[key.removeprefix("cache.")] = value
        elif key in cache_keys and key in sampler_keys:
            raise ConfigError(
                f"--set {key} is a hyper-parameter of both the sampler and cache {cache!r}: write "
                f"--set cache.{key}=... for the cache's"
            )
        elif key in cache_keys:
            to_cache[key] = value
        else:
            to_sampler[key] = value
    return to_sampler, to_cache


# Generation settings as generate() spells them -> as the command line does.
_CLI_FLAGS = {key: "--" + key.replace("_", "-") for key in ("max_new_tokens", "block_size", "steps_per_block", "steps")}
_CLI_FLAGS.update({"temperature": "--temperature", "seed": "--seed"})
_CLI_FLAGS.update({key: "--" + key.replace("_", "-") for key in ("offload_folder", "max_memory", "device_map")})


def cli_spelling(message: str, command: str) -> str:
    """An error's advice in the spelling of ``dllm COMMAND``: ``pass cache=None`` -> ``pass --cache none``
    (bench: ``--caches recompute``; ``cache='default'``: ``--caches none``), ``Pass block_size=4`` -> ``Pass
    --block-size 4`` (bench: ``--set steps=...`` for the step keys it sweeps), ``eos_early_stop=False`` ->
    ``--no-eos-early-stop``, ``dllm.samplers.get('wedlm')`` -> ``--sampler wedlm`` (bench: ``--samplers``).
    Only advice is translated (a setting after pass / use / e.g. / or / give); the facts a message states keep
    generate()'s names, and library callers see the Python spelling throughout."""
    import re

    # the bench's "none" keeps a sampler's own exact cache (cache='default'); "recompute" is cache=None
    message = re.sub(r"\bcache=None\b", "--caches recompute" if command == "bench" else "--cache none", message)
    message = re.sub(r"\bcache='default'", "--caches none" if command == "bench" else "no --cache", message)
    if command != "bench":
        message = re.sub(r"\beos_early_stop=False\b", "--no-eos-early-stop", message)
    if command == "generate":  # the command line's prompt is text; chat messages are --chat's
        message = message.replace("pass plain text or token ids instead of messages", "leave out --chat")
    samplers = "--samplers" if command == "bench" else "--sampler"
    message = re.sub(r"(?<![=\w.])dllm\.samplers\.get\('(\w+)'\)", rf"{samplers} \1", message)
    kernel = "--set kernel=\\2" if command == "bench" else "--kernel \\2"
    message = re.sub(r"\b(pass|use|or) kernel='(\w+)'", rf"\1 {kernel}", message)
    message = re.sub(r"\b(pass|use|or) device_map='(\w+)'", r"\1 --device-map \2", message)
    keys = "|".join(sorted(_CLI_FLAGS, key=len, reverse=True))

    def flag(m) -> str:
        key, value = m.group(2), m.group(3)
        if command == "bench" and key in ("steps", "steps_per_block"):
            return f"{m.group(1)} --set {key}={value}"
        return f"{m.group(1)} {_CLI_FLAGS[key]} {value}"

    message = re.sub(rf"\b(pass|Pass|use|e\.g\.|or|give|Give) ({keys})=(-?[\w./]*\w)", flag, message)
    # any other hyper-parameter in advice (pass lookahead_blocks=0) is a --set on both commands
    other = r"\b(pass|Pass|use|e\.g\.|or|give|Give) ([a-z][a-z0-9_]*)=(-?[\w.]*\w)(?!\.?[\w(\[])"
    return re.sub(other, r"\1 --set \2=\3", message)


def unknown_pieces(model, text: str) -> list[str]:
    """The parts of ``text`` the model's tokenizer maps to its unknown token (``<unk>``)."""
    tok = model.tokenizer
    if tok is None or tok.unk_token_id is None:
        return []
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = enc["offset_mapping"]
    except (NotImplementedError, ValueError, KeyError, TypeError):  # a slow tokenizer: no offsets
        enc, spans = tok(text, add_special_tokens=False), None
    ids = enc["input_ids"]
    if spans is None:
        return ["<unk>"] * ids.count(tok.unk_token_id)
    return [text[a:b] for i, (a, b) in zip(ids, spans) if i == tok.unk_token_id]


def read_prompts(source: str) -> list:
    """``--prompts FILE`` (``-``: stdin): JSON lines or text, never a mix. JSON lines when the file is named
    ``*.jsonl``, a line starts with ``{`` or every line is JSON: then each line must be a JSON string or an object
    whose ``prompt`` is a string or chat messages, and a line that is not is an error naming it. Otherwise one
    prompt per line, each ending with its line break (the bundled models' prompts end with one). Blank lines are
    skipped either way."""
    from dllm.engine.prompts import check_text

    try:
        text = sys.stdin.read() if source == "-" else open(source, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {source}: cannot be read ({type(e).__name__}: {e})") from None
    lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts {source}: no prompt in it (one per line, or JSON lines)")
    json_lines = (
        source.endswith(".jsonl")
        or any(line.lstrip().startswith("{") for _, line in lines)
        or all(_parses(line) for _, line in lines)
    )
    if json_lines:
        prompts = [json_prompt(line, f"--prompts {source} line {n}") for n, line in lines]
    else:
        prompts = [line + "\n" for _, line in lines]
    for (n, _), prompt in zip(lines, prompts):
        for text in [prompt] if isinstance(prompt, str) else [m.get("content") or "" for m in prompt]:
            check_text(text, f"--prompts {source} line {n}")
    return prompts


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def json_prompt(line: str, where: str):
    """A JSON-lines prompt: a JSON string, or ``{"prompt": text or chat messages, ...}``; anything else is a
    ConfigError saying what ``where`` (the file and line) holds."""
    shape = 'a JSON string or {"prompt": text or chat messages} (JSON lines: every line one)'
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{where} is not JSON ({e}); each line must be {shape}") from None
    if isinstance(value, dict):
        if "prompt" not in value:
            raise ConfigError(f'{where}: the object has no "prompt" field; each line must be {shape}')
        value = value["prompt"]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        if all(isinstance(m.get("content"), str | None) for m in value):
            return value
    raise ConfigError(
        f"{where}: the prompt {json.dumps(value)[:60]} is neither text nor chat messages; each line must be {shape}"
    )


def _generate(args) -> int:
    import dllm
    from dllm.engine.prompts import check_text
    from dllm.models.loading import BUNDLED
    from dllm.tasks.tokenizer import split_numbers

    if args.prompt is not None and args.prompts is not None:
        raise ConfigError("give a PROMPT or --prompts FILE, not both")
    if args.prompt is None and args.prompts is None:
        raise ConfigError("give a PROMPT or --prompts FILE (one prompt per line, or JSON lines; - reads stdin)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.prompts is None:
        check_text(args.prompt, "PROMPT")
    prompts = [args.prompt] if args.prompts is None else read_prompts(args.prompts)
    set_threads(args.threads)
    model = dllm.load(args.model, dtype=args.dtype, **placement(args))
    if model.tokenizer is None:
        raise ConfigError(
            f"{args.model} has no tokenizer (no tokenizer files in its directory) and dllm generate takes text: add "
            "the checkpoint's tokenizer files, or pass token ids to sampler.generate from Python"
        )
    sampler, _, cache = choose(args, model)
    bundled = args.model in BUNDLED
    formats_shown = False
    unknown = [piece for p in prompts if isinstance(p, str) for piece in unknown_pieces(model, p)]
    if unknown:
        shown = ", ".join(repr(p) for p in list(dict.fromkeys(unknown))[:8])
        warn(
            f"{len(unknown)} piece(s) of the prompt{'s' if len(prompts) > 1 else ''} are unknown to this model's "
            f"tokenizer and become {model.tokenizer.unk_token}: {shown}" + (f"; {BUNDLED_FORMATS}" if bundled else "")
        )
        formats_shown = bundled
    split = [n for p in prompts if isinstance(p, str) for n in split_numbers(p)] if bundled else []
    if split:  # e.g. 140 -> "14" "0": pieces no task example holds
        warn(
            f"{', '.join(dict.fromkeys(split))}: the bundled models' tokenizer splits numbers of three or more digits "
            "(or with a leading zero) into pieces the tasks never use, so the answer will be wrong; the tasks' "
            "numbers are 0 to 99"
        )
    if args.seed is not None and args.temperature == 0 and sampler.takes_temperature:  # (its own schedule samples)
        warn(
            f"--seed {args.seed} has no effect at --temperature 0 (greedy decoding draws no random numbers); give "
            "--temperature > 0 to sample"
        )
    label = sampler.name if args.cache in (None, "none") else f"{sampler.name} + cache {args.cache}"
    structure = structured_output(args)
    empty, shape = 0, None
    for first in range(0, len(prompts), args.batch_size):
        batch = prompts[first : first + args.batch_size]
        chat = [[{"role": "user", "content": p}] if args.chat and isinstance(p, str) else p for p in batch]
        out = sampler.generate(
            model,
            chat[0] if len(chat) == 1 else chat,
            seed=args.seed,
            cache=cache,
            kernel=args.kernel,
            compile=args.compile,
            static_shapes=args.static_shapes,
            **{k: v for k, v in generation_settings(args).items() if k != "eos_early_stop" or v is not None},
            **structure,
        )
        fills = out.fills or [None] * len(batch)
        for prompt, text, tokens, holes in zip(batch, out.texts, out.tokens, fills):
            if args.jsonl:
                line = {"prompt": prompt, "text": text, "tokens": int(tokens), "nfe": out.nfe}
                print(json.dumps(line if holes is None else line | {"fills": holes}))
            else:
                print(text)
            empty += not text.strip()
        shape = shape or schedule(args, sampler, out.geometry)  # said once
        rows = f"{first + 1}-{first + len(batch)}" if len(batch) > 1 else f"{first + 1}"
        which = f" prompt{'s' if len(batch) > 1 else ''} {rows} of {len(prompts)} |" if len(prompts) > 1 else ""
        print(f"[{model.family} | {label}]{which} {out.summary()} | {shape}", file=sys.stderr)
    if empty:
        if bundled:
            newline = args.chat or all(not isinstance(p, str) or p.endswith("\n") for p in prompts)
            hints = [] if newline else ["the prompt does not end with a newline"]
            hints += [] if formats_shown else [BUNDLED_FORMATS]
        else:
            hints = ["check that the prompt is in the format the model was trained on"]
            if not args.chat and getattr(model.tokenizer, "chat_template", None):
                hints.append("an instruction-tuned model needs --chat (its chat template)")
        what = "the model generated no text" if len(prompts) == 1 else f"{empty} of {len(prompts)} texts are empty"
        warn("; ".join([f"{what} (the first token was EOS)", *hints]))
    return 0


def structured_output(args) -> dict:
    """``generate``'s ``constraint=`` and ``template=`` from ``--regex``, ``--json-schema``, ``--grammar`` and
    ``--template``."""
    from pathlib import Path

    from dllm.constraints import Grammar, JsonSchema, Regex
    from dllm.constraints.template import parse_template

    out = {}
    if args.grammar is not None:
        path = Path(args.grammar)
        if not path.is_file():
            raise ConfigError(f"--grammar {args.grammar}: no such file (a Lark grammar, its rules from 'start')")
        out["constraint"] = Grammar(path.read_text(encoding="utf-8"))
    if args.regex is not None:
        out["constraint"] = Regex(args.regex)
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{"):
            path = Path(schema)
            if not path.is_file():
                raise ConfigError(
                    f"--json-schema {schema}: neither a file nor a JSON schema (JSON text starting with {{)"
                )
            schema = path.read_text(encoding="utf-8")
        out["constraint"] = JsonSchema(schema)
    if args.template is not None:
        out["template"] = parse_template(args.template)
    return out


def placement(args) -> dict:
    """``dllm.load``'s placement arguments from ``--device`` or ``--device-map`` (with ``--max-memory``,
    ``--offload-folder``); ``--max-memory 0=20GiB,cpu=60GiB`` becomes ``{0: "20GiB", "cpu": "60GiB"}``."""
    memory = None
    if args.max_memory is not None:
        memory = {}
        for item in args.max_memory.split(","):
            device, sep, size = item.partition("=")
            if not sep or not device.strip() or not size.strip():
                raise ConfigError(
                    f"--max-memory {args.max_memory!r}: give DEVICE=SIZE pairs separated by commas, e.g. "
                    "--max-memory 0=20GiB,1=20GiB,cpu=60GiB"
                )
            device = device.strip()
            memory[int(device) if device.isdigit() else device] = size.strip()
    given = {"device_map": args.device_map, "max_memory": memory, "offload_folder": args.offload_folder}
    return {"device": args.device, **{k: v for k, v in given.items() if v is not None}}


def generation_settings(args) -> dict:
    """The generation options of :func:`decoding_options` as ``generate()`` names them (None: not given)."""
    keys = ("max_new_tokens", "block_size", "steps", "steps_per_block", "temperature", "eos_early_stop")
    return {key: getattr(args, key) for key in keys}


def choose(args, model) -> tuple:
    """The sampler (``--sampler``, else the family's reference), its ``--set`` hyper-parameters and the cache
    (``--cache`` with its ``--set`` keys) of ``dllm generate`` and ``dllm serve``."""
    import dllm

    name = args.sampler or (dllm.models.registry.of_model(model).reference_sampler or (None,))[0]
    settings = parse_settings(args.set)
    base = settings.get("base") if isinstance(settings.get("base"), str) else None
    keys = set(dllm.samplers.defaults(name, base)) if name in dllm.samplers.names() else set()
    settings, cache_settings = split_settings(settings, keys, args.cache)
    if args.sampler is None:  # the model family's own reference sampler
        sampler = dllm.samplers.reference(model.family, **settings)
    else:
        sampler = dllm.samplers.get(args.sampler, **settings)
    cache = "default" if args.cache is None else dllm.caches.get(args.cache, **cache_settings)
    return sampler, settings, cache


def _serve(args) -> int:
    import os

    import dllm
    from dllm.serve import create, run

    set_threads(args.threads)
    model = dllm.load(args.model, dtype=args.dtype, **placement(args))
    _, settings, cache = choose(args, model)  # refuses bad settings before the server starts
    api_key = args.api_key or os.environ.get("DLLM_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        warn(f"--host {args.host} opens the server to other machines without an API key; add --api-key KEY")
    app = create(
        model,
        name=args.served_model_name or args.model,
        sampler=args.sampler,
        hyper_parameters=settings,
        cache=cache,
        generation=generation_settings(args),
        seed=args.seed,
        kernel=args.kernel,
        compile=args.compile,
        static_shapes=args.static_shapes,
        max_batch_size=args.max_batch_size,
        max_wait=args.max_wait_ms / 1000,
        max_queue=args.max_queue,
        max_body_size=args.max_body_size,
        api_key=api_key,
        mixed_batches=args.mixed_batches,
        joins=args.joins,
    )
    run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def schedule(args, sampler, geometry) -> str:
    """The generation's shape as the figures line ends (:meth:`~dllm.core.geometry.Geometry.describe`), with a
    warning where steps were given but not used as written (an adaptive sampler; more steps than tokens)."""
    given = [f"--{k.replace('_', '-')}" for k in ("steps", "steps_per_block") if getattr(args, k) is not None]
    if geometry.adaptive and given and sampler.process == "renoise":
        warn(
            f"{' / '.join(given)} not used: {sampler.name!r} refines each canvas until it is stable and confident, "
            f"in at most max_denoising_steps forwards (--set max_denoising_steps=N)"
        )
    elif geometry.adaptive and given and not sampler.reads_steps:
        warn(
            f"{' / '.join(given)} not used: {sampler.name!r} is adaptive (the data decides how many tokens each "
            "step commits), as in its official code"
        )
    spb, bs = geometry.steps_per_block, geometry.block_size
    if not geometry.adaptive and spb > bs:
        asked = f"--steps {args.steps}" if args.steps is not None else f"--steps-per-block {spb}"
        warn(
            f"{asked} gives {spb} steps per block of {bs} tokens, more steps than tokens: a step with no token to "
            f"commit is skipped (no forward), so at most {bs} steps run per block"
        )
    return geometry.describe()


def _samplers(args) -> int:
    import dllm

    names = dllm.samplers.names()
    width = max(map(len, names)) + 1
    for name in names:
        cls = dllm.samplers.registry.SAMPLERS.get(name)
        summary = docstring_summary(cls)
        if getattr(cls, "experimental", False):  # a reconstruction without official code (e.g. ete)
            summary = f"[experimental] {summary}"
        lines = [
            summary,
            ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)) or "(no hyper-parameters)",
        ]
        if dllm.samplers.registry.is_part(name):
            lines.append(f"base={cls.default_base!r} (any sampler, with its hyper-parameters: --set base=threshold)")
        print(columns(name, lines, width))
    return 0


def docstring_summary(obj) -> str:
    """The first paragraph of ``obj``'s docstring as one line of plain text (reST's ``code`` and :role:`target`
    markup removed): the whole summary, never cut mid-sentence."""
    import re

    paragraph = " ".join(((obj.__doc__ or "").strip().split("\n\n") or [""])[0].split())
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", paragraph).replace("``", "")


def columns(name: str, lines: list[str], width: int) -> str:
    """``name`` in a column of ``width`` and ``lines`` beside it, each wrapped to the terminal (at least 60
    columns for the text) and indented under one another."""
    import shutil
    import textwrap

    text = max(60, shutil.get_terminal_size((120, 24)).columns - width - 1)
    wrapped = [part for line in lines for part in textwrap.wrap(line, text, break_on_hyphens=False) or [""]]
    return "\n".join(f"{name if i == 0 else '':{width}s}{part}" for i, part in enumerate(wrapped))


def _caches(args) -> int:
    import dllm

    names = dllm.caches.names()
    width = max(map(len, names)) + 1
    for name in names:
        fields = ", ".join(f"{k}={v!r}" for k, v in dllm.caches.defaults(name).items())
        print(
            columns(name, [docstring_summary(dllm.caches.CACHES.get(name)), fields or "(no hyper-parameters)"], width)
        )
    return 0


_BENCH_OPTIONS = (
    "models",
    "samplers",
    "tasks",
    "caches",
    "n",
    "seed",
    "max_new_tokens",
    "block_size",
    "temperature",
    "batch_size",
    "out",
    "device",
    "dtype",
)


def _launch(processes: int, argv: list[str]) -> int:
    """Run ``dllm ARGV`` in ``processes`` data-parallel processes with ``accelerate launch`` (one per GPU on
    CUDA; gloo processes on the CPU otherwise)."""
    import subprocess

    import torch

    if processes < 1:
        raise ConfigError(f"--processes must be a positive integer, got {processes}")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes)]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if not torch.cuda.is_available():
        launch.append("--cpu")
    return subprocess.call([*launch, "-m", "dllm", *argv])


def _without_processes(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            out.append(arg)
    return out


def _bench(args) -> int:
    import os

    from dllm.bench import runner

    set_threads(args.threads)

    if args.processes is not None and args.processes != 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _launch(args.processes, _without_processes(args.argv))
    if args.list_tasks:
        tasks = runner.task_module()
        for name in tasks.names():
            print(f"{name:10s} {getattr(tasks.get(name), 'description', '')}")
        return 0
    values = runner.load_yaml(args.config) if args.config else {}
    grid = values.pop("set", None) or values.pop("grid", None) or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"{args.config}: 'set' must map keys to values, e.g. set: {{threshold: [0.8, 0.9]}}")
    grid = {**grid, **parse_set(args.set)}  # a key given on the command line replaces the file's
    values.update({key: getattr(args, key) for key in _BENCH_OPTIONS if getattr(args, key) is not None})
    if args.no_progress:
        values["progress"] = False
    config = runner.BenchConfig.from_mapping({**values, "grid": grid}, where=args.config or "dllm bench")
    args.resume = (
        f"the finished cells and batches are kept in {runner.runs_dir(config.out)}: resume with the same command"
    )
    report = runner.run(config, log=lambda message: print(cli_spelling(message, "bench"), file=sys.stderr))
    if report is None:  # a data-parallel run's process other than the first: process 0 reports
        return 0
    print(report.table, end="")
    print(f"dllm bench: wrote {', '.join(str(f) for f in report.files)}", file=sys.stderr)
    return 0


DEVICE_HELP = "cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)"
THREADS_HELP = "torch's CPU threads (default: torch's choice, one per core)"
DTYPE_HELP = "float32 (fp32), bfloat16 (bf16), float16 (fp16, half) or auto (default: bfloat16 on CUDA, float32 on CPU)"


def version() -> str:
    import torch

    import dllm

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    return f"dllm {dllm.__version__} (torch {torch.__version__}, {cuda})"


class VersionAction(argparse.Action):
    """``--version``: torch's version and build are read (torch imported) only when it is asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())  # on stdout, as argparse's own version action
        parser.exit()


def references() -> str:
    """Each model family's reference sampler, from the family registry (``llada``, ``llada2 -> llada2``, ...)."""
    from dllm.models import registry

    families = [registry.get(name) for name in registry.names()]
    pairs = [(f.name, f.reference_sampler[0]) for f in families if f.reference_sampler]
    return ", ".join(sampler if family == sampler else f"{sampler} for {family}" for family, sampler in pairs)


def decoding_options(p: argparse.ArgumentParser, samplers: str = "...", defaults: str = "...") -> None:
    """The options of ``dllm generate`` and ``dllm serve`` alike: the sampler, its settings, the cache, the device."""
    p.add_argument(
        "--sampler",
        default=None,
        help=f"{samplers} (case-insensitive; default: the model family's reference sampler: {defaults})",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="total denoising steps, split evenly over the blocks (LLaDA / Dream meaning; default: one token per "
        "step); fixed-schedule samplers only",
    )
    p.add_argument(
        "--steps-per-block", type=int, default=None, help="denoising steps per block (SDAR meaning); instead of --steps"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to generate (default: the checkpoint's generation_config.json max_new_tokens, 32 for the "
        "bundled models, else 128)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="semi-autoregressive block size of full-attention models (default: 32 when it divides "
        "--max-new-tokens, else one block; dllm bench uses 8). SDAR (block-causal) models decode in the block "
        "size they were trained with (tiny-sdar: 4): leave it out, or give exactly that size; another is refused",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples, repeatably with --seed"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the random numbers at temperature > 0 (default: drawn from torch's global generator)",
    )
    p.add_argument(
        "--kernel",
        default="auto",
        help="scoring backend: auto (default: the fused Triton kernels on CUDA when triton imports, else the "
        "PyTorch reference), torch or triton; the figures printed after the text say which ran",
    )
    p.add_argument(
        "--eos-early-stop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="end a row once a finished block holds EOS, filling the rest with EOS at no further forwards (on by "
        "default, as the official samplers' early stop; the NFE can then be below --steps; off by default for "
        "llada21, whose official rule decodes every block); "
        "--no-eos-early-stop decodes the whole span (the text up to the first EOS is the same)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        metavar="MODE",
        help="run the model forward through torch.compile (same tokens and forwards; the first call compiles): "
        "alone inductor; reduce-overhead: inductor capturing CUDA graphs (turns --static-shapes on); or a "
        "torch.compile backend name",
    )
    p.add_argument(
        "--static-shapes",
        action="store_true",
        help="keep every forward's shapes fixed within a block (finished rows stay in the batch, query widths "
        "bucketed), so that a compiled forward is captured once per shape; same tokens and forwards",
    )
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument(
        "--device-map",
        default=None,
        metavar="MAP",
        help="instead of --device, spread a model bigger than one device over the GPUs, the CPU and the disk "
        "(accelerate's strategies): auto, balanced, balanced_low_0 or sequential",
    )
    p.add_argument(
        "--max-memory",
        default=None,
        metavar="DEVICE=SIZE,...",
        help="with --device-map: the memory each device may hold, e.g. 0=20GiB,1=20GiB,cpu=60GiB",
    )
    p.add_argument(
        "--offload-folder",
        default=None,
        metavar="DIR",
        help="with --device-map: a directory for the weights offloaded to the disk (needed when some are)",
    )
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument(
        "--cache",
        default=None,
        help="K/V cache: prefix, dual, dkv, ... or none (default: the sampler's own, exact block reuse for SDAR)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sampler or cache hyper-parameter, repeatable (--set threshold=0.8 --set alg=entropy); values are "
        "JSON (numbers, true/false, null) or strings; cache.KEY=VALUE: the cache's when both have KEY",
    )


def build_parser(detailed: bool = True) -> argparse.ArgumentParser:
    """The ``dllm`` parser. ``detailed=False`` leaves the bundled model and sampler names out of the commands'
    help (they import torch, seconds): ``dllm --help`` shows none of them."""
    if detailed:
        from dllm.models.loading import BUNDLED
        from dllm.samplers import names

        bundled, samplers, defaults = ", ".join(BUNDLED) or "none", ", ".join(names()), references()
    else:
        bundled = samplers = defaults = "..."
    parser = argparse.ArgumentParser(
        prog="dllm",
        description=(
            "Fast, correct sampling from diffusion LMs (LLaDA, Dream, SDAR, LLaDA2, WeDLM, Fast-dLLM v2, "
            "DiffusionGemma)."
        ),
        epilog="Run 'dllm COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action=VersionAction, help="show dllm's and torch's versions (CUDA or CPU build)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate a continuation of PROMPT",
        description="Generate a continuation of PROMPT, print it on stdout and the run's figures (NFE, tokens, "
        "tokens/forward, tokens/s, the generation length, block size and steps) on stderr.",
        epilog=f"Bundled models: {bundled}; {BUNDLED_FORMATS}. Samplers: {samplers} ('dllm samplers' "
        "lists their hyper-parameters). Example: dllm generate $'Sort the list: 14 7 9\\n' --sampler threshold "
        "--set threshold=0.8",
    )
    gen.add_argument(
        "prompt",
        nargs="?",
        help="text to continue, used exactly as given (no chat template unless --chat); in bash, $'...\\n' "
        "writes a newline. Or --prompts FILE",
    )
    gen.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="many prompts, from FILE (- reads stdin): one per line, each ending with its line break (as the bundled "
        'models\' prompts do), blank lines skipped; or JSON lines, each a JSON string or {"prompt": text or chat '
        "messages} (a FILE named *.jsonl, with a line starting with {, or whose every line is JSON; a line that is "
        "not a JSON prompt is then an error). Generated --batch-size at a time; one text per prompt, in order "
        "(--jsonl for one line each)",
    )
    gen.add_argument("--batch-size", type=int, default=16, help="prompts per generate call with --prompts (default 16)")
    gen.add_argument(
        "--jsonl",
        action="store_true",
        help='print one JSON line per prompt: {"prompt", "text", "tokens", "nfe"} (nfe: its batch\'s forwards)',
    )
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"bundled name ({bundled}), checkpoint directory or Hugging Face hub id (default {DEFAULT_MODEL})",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap PROMPT as a user message in the checkpoint's chat template (instruction-tuned checkpoints; the "
        "bundled models have none: they were trained on plain prompts)",
    )
    structured = gen.add_argument_group(
        "structured output", "what the text may be, checked at every step whatever the sampler"
    )
    given = structured.add_mutually_exclusive_group()
    given.add_argument("--regex", default=None, metavar="PATTERN", help="the text fully matches PATTERN")
    given.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|JSON",
        help="the text is JSON valid against this schema (a file, or the schema's JSON text; '{\"type\": "
        '"object"}\' for any object)',
    )
    given.add_argument(
        "--grammar",
        default=None,
        metavar="FILE",
        help="the text is a word of this Lark grammar (context-free; a row that runs out of tokens first ends "
        "with a prefix of one)",
    )
    structured.add_argument(
        "--template",
        default=None,
        metavar="TEXT",
        help="the generated text is TEXT with its holes filled: {{N}} a hole of at most N tokens, {{N:REGEX}} one "
        "matching REGEX, e.g. 'The answer is{{3: [0-9]+}}.' (--max-new-tokens defaults to its length)",
    )
    decoding_options(gen, samplers, defaults)
    gen.set_defaults(run=_generate)

    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions); needs dllm[serve]",
        description="Serve MODEL behind OpenAI's API: a request's answer equals 'dllm generate' of its prompt alone "
        "with the same settings, whatever it is batched with. The sampler and generation options are the defaults "
        "of every request; a request may change max_tokens, temperature, seed, stop, n and dllm's own settings "
        "(sampler, steps, block_size, threshold, ...) as extra fields of its body.",
        epilog="Example: dllm serve tiny-llada --sampler threshold, then curl http://127.0.0.1:8000/v1/completions "
        '-H "Content-Type: application/json" -d \'{"model": "tiny-llada", "prompt": "Sort the list: 14 7 9\\n"}\'',
    )
    srv.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"bundled name ({bundled}), checkpoint directory or hub id (default {DEFAULT_MODEL})",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    srv.add_argument(
        "--api-key", default=None, help="require Authorization: Bearer KEY (default: $DLLM_API_KEY, else none)"
    )
    srv.add_argument("--max-batch-size", type=int, default=32, help="sequences decoded together at most (32)")
    srv.add_argument(
        "--max-wait-ms",
        type=float,
        default=10.0,
        help="how long a batch waits for requests to join it, from its first request's arrival or the end of the "
        "batch before (10 ms)",
    )
    srv.add_argument("--max-queue", type=int, default=256, help="requests that may wait; past it, 503 (256)")
    srv.add_argument(
        "--max-body-size",
        type=int,
        default=4 * 2**20,
        metavar="BYTES",
        help="the largest request body accepted; past it, 413 (default 4 MiB: about a million tokens of text)",
    )
    srv.add_argument(
        "--no-mixed-batches",
        dest="mixed_batches",
        action="store_false",
        help="decode requests of different max_tokens or temperatures in separate batches (by default they share one "
        "where their blocks agree) and without joins; the open-loop bench's baseline",
    )
    srv.add_argument(
        "--no-joins",
        dest="joins",
        action="store_false",
        help="a batch runs to its end before the next starts (by default waiting requests join the running rows "
        "between steps, where the sampler and cache allow it)",
    )
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(info)")
    decoding_options(srv, samplers, defaults)
    srv.set_defaults(run=_serve)

    sub.add_parser(
        "eval",
        help="lm-evaluation-harness with the model dllm and the bundled tasks: dllm eval --model_args "
        "pretrained=tiny-llada,sampler=threshold --tasks dllm_bench (every lm_eval option; = python -m dllm.eval; "
        "--include_path DIR adds your own tasks; dllm eval ls tasks lists them all)",
        add_help=False,
    )

    lst = sub.add_parser("samplers", help="list samplers and their default hyper-parameters")
    lst.set_defaults(run=_samplers)

    caches = sub.add_parser("caches", help="list K/V caches and their default hyper-parameters")
    caches.set_defaults(run=_caches)

    bench = sub.add_parser(
        "bench",
        help="ablation sweep: models x samplers x settings x tasks -> JSONL, summary table, plots",
        description="Run every cell of models x samplers x --set grid x caches x tasks on the tasks' test "
        "examples; write one gzip-compressed JSONL per cell under OUT/runs (finished cells are skipped on a "
        "rerun), OUT/summary.md and accuracy-vs-NFE / accuracy-vs-tokens/s plots. Options given here override "
        "the --config file.",
    )
    bench.add_argument("--config", default=None, metavar="YAML", help="sweep file (keys as the options; set: grid)")
    bench.add_argument(
        "--models", default=None, help=f"comma-separated bundled names ({bundled}) or checkpoint dirs (tiny-llada)"
    )
    bench.add_argument("--samplers", default=None, help=f"comma-separated sampler names: {samplers} (llada,threshold)")
    bench.add_argument("--tasks", default=None, help="comma-separated task names (arith); see --list-tasks")
    bench.add_argument(
        "--caches",
        default=None,
        help="comma-separated caches crossed with the samplers, e.g. none,prefix,dual,dkv (default: none, which "
        "keeps a sampler's own exact cache such as SDAR's block K/V; recompute: no cache at all; 'dllm caches' "
        "lists them)",
    )
    bench.add_argument("--n", type=int, default=None, help="test examples per cell (100; arith has 19548)")
    bench.add_argument("--seed", type=int, default=None, help="seed of the examples and of sampling (0)")
    bench.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (each task's own)")
    bench.add_argument("--block-size", type=int, default=None, help="block size of full-attention models (8)")
    bench.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    bench.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (16)")
    bench.add_argument("--out", default=None, help="output directory (bench-out)")
    bench.add_argument("--device", default=None, help=DEVICE_HELP)
    bench.add_argument("--dtype", default=None, help=DTYPE_HELP)
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=V1[,V2...]",
        help="values to sweep: a sampler hyper-parameter or steps (int or G/k), steps_per_block, block_size, "
        "max_new_tokens, temperature",
    )
    bench.add_argument("--list-tasks", action="store_true", help="list the task names and exit")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    bench.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="data parallel: run in N processes (accelerate launch; one per GPU, or gloo on the CPU), same records",
    )
    bench.set_defaults(run=_bench)
    return parser


def main(argv=None) -> int:
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["eval"]:  # lm-eval parses its own options
        from dllm.eval.__main__ import main as evaluate

        rest = (sys.argv[1:] if argv is None else list(argv))[1:]
        has_model = any(a == "--model" or a.startswith("--model=") for a in rest)
        if has_model or "-h" in rest or "--help" in rest or rest[:1] in (["ls"], ["validate"]):
            return evaluate(rest)  # lm-eval's ls / validate take no model
        if rest[:1] == ["run"]:
            return evaluate(["run", "--model", "dllm", *rest[1:]])
        return evaluate(["--model", "dllm", *rest])
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(detailed=any(not a.startswith("-") for a in argv)).parse_args(argv)  # a command: its names
    args.argv = argv
    args.resume = None  # what a Ctrl-C leaves to resume, said on the "interrupted" line (dllm bench sets it)

    def run() -> int:
        with warnings.catch_warnings():
            show = warnings.showwarning
            warnings.showwarning = lambda message, category, *rest, **kw: (
                warn(cli_spelling(str(message), args.command))
                if issubclass(category, DllmWarning)
                else show(message, category, *rest, **kw)
            )
            return args.run(args)

    return exit_status("dllm", run, lambda message: cli_spelling(message, args.command), resume=lambda: args.resume)


if __name__ == "__main__":
    sys.exit(main())
