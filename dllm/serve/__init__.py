"""``dllm serve MODEL``: an OpenAI-compatible server whose answers equal offline ``generate``.

    pip install "dllm[serve]"
    dllm serve tiny-llada --sampler threshold          # = python -m dllm.serve tiny-llada --sampler threshold

Starlette on uvicorn, bound to 127.0.0.1:8000 unless ``--host`` / ``--port`` say otherwise. Endpoints:
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (the checkpoint's chat template), ``/health``,
``/metrics`` (Prometheus). The sampler, its hyper-parameters, the cache and the generation settings come from the
command line as in ``dllm generate``; a request may change ``max_tokens``, ``temperature``, ``seed``, ``stop``,
``n``, and dllm's own settings as extra fields of its body (:mod:`dllm.serve.protocol`). ``usage`` adds dllm's
figures to OpenAI's: ``nfe`` and ``tokens_per_forward``.

The guarantee: a request's answer (tokens and NFE) equals ``sampler.generate(model, prompt, ...)`` of its prompt
alone with the same settings and seed, whatever else shares its batch (:mod:`dllm.serve.batcher`). Requests that
wait are decoded together (``--max-batch-size`` sequences, ``--max-wait-ms`` after the first arrives);
``--max-queue`` bounds the waiting requests (past it: 503), ``--max-body-size`` a request's body (past it: 413).
``--api-key`` (or ``DLLM_API_KEY``) requires ``Authorization: Bearer KEY`` (the scheme in any case). Errors are
OpenAI's JSON (400 naming the field, 401, 404 for another model name or path, 405 for another method, 413, 503
when the queue is full or the server is stopping).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from dllm.core import geometry
from dllm.core.errors import ConfigError, DllmError

__all__ = ["create", "run", "running"]


def create(
    model,
    *,
    name: str | None = None,
    sampler: str | None = None,
    hyper_parameters: dict | None = None,
    cache="default",
    generation: dict | None = None,
    seed: int | None = None,
    kernel: str = "auto",
    compile=False,
    static_shapes: bool = False,
    max_batch_size: int = 32,
    max_wait: float = 0.01,
    max_queue: int = 256,
    max_body_size: int = 4 * 2**20,
    api_key: str | None = None,
    mixed_batches: bool = True,
    joins: bool = True,
):
    """The ASGI application serving ``model`` (a loaded model, a bundled name or a directory).

    name: the model name clients send (default: the model's path or bundled name); sampler, hyper_parameters:
    the default sampler (default: the family's reference sampler) and its settings; generation: the default
    ``max_new_tokens``, ``block_size``, ``steps``, ``steps_per_block``, ``temperature``, ``eos_early_stop``;
    seed: the seed of requests that give none (None: fresh numbers per batch); cache, kernel, compile,
    static_shapes: as ``generate()``, for every batch; max_wait in seconds; max_body_size: the largest request body in
    bytes (past it: 413); mixed_batches: requests of different ``max_tokens`` (where their block grids agree) and
    temperatures share a batch (False: only requests of the same ones, as before; the baseline of ``python -m
    dllm.bench.open_loop``); joins: waiting requests join the running rows between steps (continuous batching, where the
    sampler and cache allow it: :mod:`dllm.engine.join`; False, or mixed_batches False: a batch runs to its end
    before the next starts). Bad settings are refused here, before the server starts. ``app.state.batcher`` and
    ``app.state.metrics`` are the running parts.
    """
    try:
        from dllm.serve.app import build_app
    except ImportError as e:
        raise ConfigError(f"dllm serve needs Starlette and uvicorn ({e}): pip install 'dllm[serve]'") from None
    from dllm import samplers
    from dllm.core import params
    from dllm.models import registry
    from dllm.serve.batcher import Batcher
    from dllm.serve.metrics import Metrics
    from dllm.serve.protocol import GENERATION_KEYS, Settings

    if isinstance(model, (str, os.PathLike)):
        from dllm.models.loading import load

        model = load(model)
    if model.tokenizer is None:
        raise ConfigError(f"{model.name_or_path} has no tokenizer: the server takes and answers text; add its files")
    for key, value, accepts in (
        ("max_batch_size", max_batch_size, ">= 1"),
        ("max_queue", max_queue, ">= 1"),
        ("max_body_size", max_body_size, ">= 1"),
    ):
        params.check_value(key, value, int, accepts)
    max_wait = params.check_value("max_wait", max_wait, float, ">= 0")
    generation = dict(generation or {})
    unknown = set(generation) - {*GENERATION_KEYS, "temperature", "eos_early_stop"}
    if unknown:
        raise ConfigError(f"generation settings {sorted(unknown)} are not known; give {', '.join(GENERATION_KEYS)}")
    hyper = dict(hyper_parameters or {})
    if sampler is None:
        declared = registry.of_model(model).reference_sampler
        if declared is None:
            raise ConfigError(f"{model.family} models have no reference sampler: name one (--sampler)")
        sampler, hyper = declared[0], {**declared[1], **hyper}
    sampler = samplers.registry.canonical(sampler)
    settings = Settings(model, name or str(model.name_or_path), sampler, hyper, generation, seed, max_batch_size)
    default, _ = settings.sampler(sampler, hyper)  # refuses bad hyper-parameters now
    sizes = {k: generation.get(k) for k in GENERATION_KEYS}
    geometry.resolve(model, default, 0, **sizes)  # refuses a bad block grid now
    metrics = Metrics()
    options = dict(cache=cache, kernel=kernel, compile=compile, static_shapes=static_shapes)
    batcher = Batcher(
        model,
        options,
        max_batch_size=max_batch_size,
        max_wait=max_wait,
        max_queue=max_queue,
        metrics=metrics,
        mixed_batches=mixed_batches,
        joins=joins,
    )
    app = build_app(settings, batcher, metrics, api_key, max_body_size)
    app.state.batcher, app.state.metrics, app.state.settings = batcher, metrics, settings
    return app


def run(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until Ctrl-C (which lets the running batch end and answers the waiting
    requests 503)."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    settings = app.state.settings
    print(
        f"dllm serve: {settings.name} ({settings.model.family}, sampler {settings.sampler_name}) on "
        f"http://{host}:{port}/v1; Ctrl-C stops",
        file=sys.stderr,
    )
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    server = _server(config)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C it caught once it has shut down
        server.run()  # a port it cannot bind: uvicorn logs why and exits


def _server(config):
    """A uvicorn server whose shutdown (Ctrl-C, SIGTERM, or ``should_exit`` from :func:`running`) first drains the
    batcher: the waiting requests are answered 503 at once and only the running batch is finished, instead of
    uvicorn waiting up to its graceful timeout on requests that would still be decoded one batch after another
    and then cancelling them (HTTP 500)."""
    import uvicorn

    batcher = getattr(config.app.state, "batcher", None)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            if batcher is not None:
                batcher.drain()
            await super().shutdown(sockets)

    return Server(config)


@contextlib.contextmanager
def running(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Serve ``app`` from a background thread for the ``with`` block (tests, notebooks, the serving bench); yields
    its base URL, ``http://HOST:PORT`` (port 0: a free one). Stopped, its batch thread too, when the block ends."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = _server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=timeout))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dllm-serve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise DllmError(f"the server did not start within {timeout:g} s")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
