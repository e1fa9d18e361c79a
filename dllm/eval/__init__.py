"""lm-evaluation-harness integration: the model ``dllm`` and the bench tasks as offline lm-eval tasks.

Importing this package registers the lm-eval model ``dllm`` (:class:`dllm.eval.harness.DllmLM`). lm-eval
(0.4.9 to 0.4.13, checked) discovers models only among its own modules, so the command line is
``python -m dllm.eval`` (lm-eval's own command line with ``dllm`` registered and :data:`TASKS_DIR` on its
task path; ``accelerate launch -m dllm.eval ...`` for data parallel), or ``lm_eval ... --include_path``
from Python code that imported ``dllm.eval``. From Python::

    import lm_eval, dllm.eval
    lm_eval.simple_evaluate(model="dllm", model_args="pretrained=tiny-llada", tasks=["dllm_arith"],
                            task_manager=lm_eval.tasks.TaskManager(include_path=str(dllm.eval.TASKS_DIR)))

:mod:`dllm.eval.likelihood` (the Monte-Carlo likelihood) needs only torch.
"""

from __future__ import annotations

from dllm.eval.tasks import TASKS_DIR

try:
    from dllm.eval.harness import DllmLM
except ModuleNotFoundError as e:  # lm-eval not installed: the likelihood functions still work
    if e.name is None or not e.name.startswith("lm_eval"):
        raise
    DllmLM = None
    MISSING = "dllm.eval needs lm-evaluation-harness: pip install 'dllm[eval]' (or pip install lm-eval)"
else:
    MISSING = None

__all__ = ["DllmLM", "TASKS_DIR"]
