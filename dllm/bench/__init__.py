"""Benchmarks on the bundled tiny models and published shapes: the ablation runner behind ``dllm bench`` (its
records, report and plots), speed, kernel, loop-overhead and cache-scaling benchmarks. The tasks they run are
:mod:`dllm.tasks`; the tiny models are trained by :mod:`dllm.train`."""
