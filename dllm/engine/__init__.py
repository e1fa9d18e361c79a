"""The engine: one generation session (:mod:`dllm.engine.session`) running a decoding process
(:mod:`dllm.engine.process`: the masked loop, :mod:`dllm.engine.loop`; WeDLM's window, :mod:`dllm.engine.stream`) over
a canvas, with static shapes and compilation, ending in a :class:`~dllm.engine.generation.Generation`."""
