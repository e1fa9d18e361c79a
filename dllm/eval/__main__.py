"""``python -m dllm.eval ARGS``: lm-eval's command line with the model ``dllm`` registered and the bundled
tasks (``dllm_arith``, ``dllm_listops``, ``dllm_shuffle``, ``dllm_pick``, group ``dllm_bench``,
``dllm_arith_mc``, ``dllm_arith_ppl``) on the task path. Every lm-eval option works as usual; data parallel:
``accelerate launch -m dllm.eval ARGS``.

Task directories: the bundled one, then each directory of ``--include_path`` (several joined with ``:``, as
lm-eval's ``ls`` / ``validate`` help shows; a task of the user's replaces a bundled one of the same name).
lm-eval's ``TaskManager`` is given them as a list, which is what it accepts for several directories (its
``run`` path passes the ``--include_path`` string on as one path). ``ls tasks`` lists the bundled tasks too.
A mistake in the model's settings (``--model_args``) ends in one ``dllm: error:`` line, exit status 2.
"""

from __future__ import annotations

import os
import sys

from dllm.core.errors import ConfigError, DllmError


def main(argv: list[str] | None = None) -> int:
    import dllm.eval

    if dllm.eval.MISSING:
        print(f"dllm: error: {dllm.eval.MISSING}", file=sys.stderr)
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        user_paths = include_paths(args)
        requested = requested_tasks(args)
        bundled = bundled_task_names()
        if not user_paths:  # a dllm_ name can only be bundled: said at once, not after lm-eval indexed its tasks
            check_tasks(sorted(t for t in requested if t.startswith("dllm_")), bundled)
        from lm_eval.__main__ import cli_evaluate

        bundled_only = bool(requested) and requested <= bundled
        use_task_paths([str(dllm.eval.TASKS_DIR), *user_paths], include_defaults=not bundled_only)
        sys.argv = ["lm_eval", *args]
        try:
            cli_evaluate()
        except ValueError as e:  # lm-eval's "Tasks not found: a, b" (a 20-line traceback)
            if not str(e).startswith(NOT_FOUND):
                raise
            check_tasks([t.strip() for t in str(e).removeprefix(NOT_FOUND).split(",")], bundled, found=False)
    except DllmError as e:
        print(f"dllm: error: {e}", file=sys.stderr)
        return 2
    return 0


NOT_FOUND = "Tasks not found:"


def check_tasks(names: list[str], bundled: set[str], found: bool = True) -> None:
    """A ConfigError for the task names not among ``bundled`` (all of ``names`` when lm-eval did not find them),
    with the closest bundled names and where the others are listed."""
    import difflib

    unknown = [n for n in names if n and (not found or n not in bundled)]
    if not unknown:
        return
    close = [c for n in unknown for c in difflib.get_close_matches(n, sorted(bundled), n=2, cutoff=0.8)]
    hint = f"; did you mean {' or '.join(map(repr, dict.fromkeys(close)))}?" if close else "."
    raise ConfigError(
        f"unknown task(s) {', '.join(map(repr, unknown))}{hint} The bundled tasks: {', '.join(sorted(bundled))}; "
        "'dllm eval ls tasks' lists every task, and --include_path DIR adds your own"
    )


def include_paths(args: list[str]) -> list[str]:
    """The directories of ``--include_path`` (split at ``:``), each checked to exist."""
    found = []
    for i, arg in enumerate(args):
        if arg == "--include_path" and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith("--include_path="):
            found.append(arg.partition("=")[2])
    paths = [p for value in found for p in value.split(os.pathsep) if p]
    for path in paths:
        if not os.path.exists(path):
            raise ConfigError(f"--include_path {path}: no such directory (a directory of task YAML files)")
    return paths


def task_paths(given, directories: list[str]) -> list[str]:
    """lm-eval's ``include_path`` (None, a string of ``:``-joined paths, or a list) as a list with
    ``directories`` first (lm-eval lets a later path override an earlier one)."""
    if given is None:
        given = []
    elif isinstance(given, (str, os.PathLike)):
        given = [p for p in str(given).split(os.pathsep) if p]
    out = list(directories)
    for path in map(str, given):
        if path not in out:
            out.append(path)
    return out


def use_task_paths(directories: list[str], include_defaults: bool = True) -> None:
    """Make lm-eval's ``TaskManager`` (in every place that builds one: ``run``, ``ls``, ``validate``) index
    ``directories`` as well as the paths it is given; with ``include_defaults=False`` also skip lm-eval's
    thousands of built-in task files (tens of seconds per process) where its ``TaskManager`` can."""
    import inspect

    import lm_eval.tasks

    base = getattr(lm_eval.tasks.TaskManager, "dllm_base", lm_eval.tasks.TaskManager)
    names = list(inspect.signature(base.__init__).parameters)[1:]

    class WithTaskPaths(base):
        dllm_base = base

        def __init__(self, *args, **kwargs):
            bound = {**dict(zip(names, args)), **kwargs}
            bound["include_path"] = task_paths(bound.get("include_path"), directories)
            if not include_defaults and "include_defaults" in names:
                bound.setdefault("include_defaults", False)
            super().__init__(**bound)

    lm_eval.tasks.TaskManager = WithTaskPaths


def requested_tasks(args: list[str]) -> set[str]:
    for i, arg in enumerate(args):
        if arg == "--tasks" and i + 1 < len(args):
            return {t.strip() for t in args[i + 1].split(",") if t.strip()}
        if arg.startswith("--tasks="):
            return {t.strip() for t in arg.partition("=")[2].split(",") if t.strip()}
    return set()


def bundled_task_names() -> set[str]:
    """Names of the bundled tasks, groups and tags (read from their YAML files)."""
    import re

    import dllm.eval

    names = set()
    for path in dllm.eval.TASKS_DIR.glob("*.yaml"):
        names.update(re.findall(r"^(?:task|group|tag): *([A-Za-z0-9_]+) *$", path.read_text(), flags=re.M))
    return names


if __name__ == "__main__":
    sys.exit(main())
