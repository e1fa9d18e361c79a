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
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        user_paths = include_paths(args)
        requested = requested_tasks(args)
        bundled_only = bool(requested) and requested <= bundled_task_names()
        use_task_paths([str(dllm.eval.TASKS_DIR), *user_paths], include_defaults=not bundled_only)
        sys.argv = ["lm_eval", *args]
        cli_evaluate()
    except DllmError as e:
        print(f"dllm: error: {e}", file=sys.stderr)
        return 2
    return 0


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
