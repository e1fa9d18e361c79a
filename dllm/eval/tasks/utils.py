"""Hooks the task YAMLs of this directory name (``!function utils.load`` ...); see ``dllm.eval.tasks``."""

from dllm.eval.tasks import load, process_results

__all__ = ["load", "process_results"]
