"""``python -m dllm.eval ARGS``: lm-eval's command line with the model ``dllm`` registered and the bundled
tasks (``dllm_arith``, ``dllm_listops``, ``dllm_shuffle``, ``dllm_pick``, group ``dllm_bench``,
``dllm_arith_mc``, ``dllm_arith_ppl``) on the task path. Every lm-eval option works as usual; data parallel:
``accelerate launch -m dllm.eval ARGS``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import dllm.eval

    if dllm.eval.MISSING:
        print(f"dllm: error: {dllm.eval.MISSING}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    args = with_task_path(args, str(dllm.eval.TASKS_DIR))
    if requested_tasks(args) and requested_tasks(args) <= bundled_task_names():
        skip_builtin_task_index()
    sys.argv = ["lm_eval", *args]
    cli_evaluate()
    return 0


def with_task_path(args: list[str], directory: str) -> list[str]:
    """``args`` with ``directory`` added to ``--include_path`` (the user's paths kept first)."""
    for i, arg in enumerate(args):
        if arg == "--include_path" and i + 1 < len(args):
            return [*args[: i + 1], f"{args[i + 1]}:{directory}", *args[i + 2 :]]
        if arg.startswith("--include_path="):
            return [*args[:i], f"{arg}:{directory}", *args[i + 1 :]]
    if any(a in ("-h", "--help") for a in args) or not args or args[0] in ("ls", "validate"):
        return args
    return [*args, "--include_path", directory]


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


def skip_builtin_task_index() -> None:
    """When only bundled tasks are asked for, do not index lm-eval's thousands of built-in task files (tens of
    seconds per process); lm-eval versions without ``TaskManager(include_defaults=...)`` index them."""
    import inspect

    import lm_eval.tasks

    base = lm_eval.tasks.TaskManager
    if "include_defaults" not in inspect.signature(base.__init__).parameters:
        return

    class BundledOnly(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("include_defaults", False)
            super().__init__(*args, **kwargs)

    lm_eval.tasks.TaskManager = BundledOnly


if __name__ == "__main__":
    sys.exit(main())
