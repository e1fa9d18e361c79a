"""``python -m dllm.eval.tasks``: rewrite the bundled task data from the task generators."""

from dllm.eval.tasks import build

for path in build():
    print(path)
