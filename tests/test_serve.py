"""``dllm serve``: the real server on a local port, driven by the real ``openai`` client, lm-eval's
``local-completions`` model and plain HTTP. Every answer is compared with ``sampler.generate`` of its prompt alone."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

import dllm
from dllm.constraints import Grammar, Json, JsonSchema, Regex
from dllm.serve import create, running
from dllm.serve.batcher import Batcher
from dllm.tasks import get as task

ROOT = Path(__file__).parents[1]
PROMPTS = [e.prompt for e in task("arith").examples("test", 20)] + [
    e.prompt for e in task("listops").examples("test", 20)
]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt itself: what the model knows


@pytest.fixture(scope="module")
def model():
    model = dllm.load("tiny-llada")
    model.tokenizer.chat_template = TEMPLATE  # so that /v1/chat/completions has a template to apply
    return model


@pytest.fixture(scope="module")
def server(model):
    app = create(model, name="tiny-llada", sampler="threshold", max_batch_size=8, max_wait=0.05)
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline(model, prompt, sampler="threshold", n=1, seed=None, **settings):
    """What generate() gives for ``prompt`` alone (``n`` copies: the request's n samples)."""
    out = dllm.samplers.get(sampler).generate(model, [prompt] * n if n > 1 else prompt, seed=seed, **settings)
    return out.texts, out.nfe


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


def test_completions_equal_generate_alone(server, client, model):
    for prompt in PROMPTS[:3] + PROMPTS[-2:]:
        r = client.completions.create(model="tiny-llada", prompt=prompt, max_tokens=32)
        texts, nfe = offline(model, prompt, max_new_tokens=32)
        assert r.choices[0].text == texts[0]
        assert r.usage.nfe == nfe and r.usage.completion_tokens == len(model.tokenizer(texts[0])["input_ids"])
        assert r.choices[0].finish_reason == "stop"
    # dllm's own settings in the body; n samples with a seed are generate([prompt] * n, seed=...)
    r = client.completions.create(
        model="tiny-llada", prompt=PROMPTS[5], max_tokens=16, n=3, temperature=3.0, seed=7,
        extra_body={"sampler": "llada", "steps": 8, "block_size": 8},
    )  # fmt: skip
    texts, nfe = offline(
        model, PROMPTS[5], "llada", n=3, seed=7, max_new_tokens=16, steps=8, block_size=8, temperature=3.0
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == texts and r.usage.nfe == nfe
    assert len(set(texts)) > 1  # distinct samples: the comparison can tell rows apart


def test_streaming_sends_committed_text_that_adds_up_to_the_answer(server, client, model):
    prompt = PROMPTS[1]
    chunks = list(
        client.completions.create(
            model="tiny-llada", prompt=prompt, stream=True, stream_options={"include_usage": True},
            extra_body={"sampler": "llada"},
        )
    )  # fmt: skip
    texts, nfe = offline(model, prompt, "llada")
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(pieces) == texts[0] and len(pieces) > 1  # as it is committed, not all at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.nfe == nfe and not chunks[-1].choices
    # chat: the template applied, streamed and not
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model="tiny-llada", messages=messages, stop=["\n"])
    streamed = client.chat.completions.create(model="tiny-llada", messages=messages, stream=True, stop=["\n"])
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    expected = offline(model, messages)[0][0].split("\n")[0]
    assert whole.choices[0].message.content == text == expected and whole.choices[0].message.role == "assistant"


def test_32_clients_at_once_each_get_their_offline_answer(model):
    """Different prompts, lengths, samplers, temperatures, seeds and n at once, with bad requests among them: every
    good one equals generate() alone, every bad one gets its error, nothing is lost."""
    rng = random.Random(0)
    app = create(model, name="tiny-llada", sampler="threshold", max_batch_size=8, max_wait=0.05)
    requests = []
    for i in range(32):
        body = {"model": "tiny-llada", "prompt": PROMPTS[i], "max_tokens": rng.choice([8, 16, 32])}
        if rng.random() < 0.5:
            body |= {"sampler": "llada", "block_size": 8, "steps": body["max_tokens"] // 2}
        if rng.random() < 0.4:
            body |= {"temperature": 2.5, "seed": rng.choice([1, 2]), "n": rng.choice([1, 2])}
        requests.append(body)
    broken = [
        ({"model": "tiny-llada", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny-llada", "prompt": "x", "sampler": "treshold"}, 400, "did you mean 'threshold'"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "tiny-llada"),
        ({"model": "tiny-llada", "prompt": "x", "n": 9}, 400, "--max-batch-size"),
    ]
    with running(app) as url:
        with ThreadPoolExecutor(36) as pool:
            answers = list(pool.map(lambda b: post(url, "/v1/completions", b), requests + [b for b, _, _ in broken]))
    for body, r in zip(requests, answers):
        settings = {k: body[k] for k in ("block_size", "steps", "temperature") if k in body}
        texts, nfe = offline(
            model, body["prompt"], body.get("sampler", "threshold"), body.get("n", 1), body.get("seed"),
            max_new_tokens=body["max_tokens"], **settings,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == texts and r.json()["usage"]["nfe"] == nfe
    for (_, status, words), r in zip(broken, answers[len(requests) :]):
        assert r.status_code == status and words in r.json()["error"]["message"]
    assert app.state.batcher.peak > 1  # requests did wait and share batches


def test_requests_that_differ_only_in_their_seeds_share_one_batch(model):
    """8 sampled requests at once, each its own seed (two of them the same prompt and seed, one with n=2, one with
    no seed): one batch, each answer equal to generate() alone with its seed (the unseeded one: valid and its own)."""
    app = create(model, name="tiny-llada", sampler="threshold", max_batch_size=16, max_wait=1.0)
    bodies = [{"model": "tiny-llada", "prompt": PROMPTS[i % 5], "max_tokens": 16, "temperature": 2.0, "seed": 10 + i}
              for i in range(6)]  # fmt: skip
    bodies += [bodies[0] | {"n": 2}, {k: v for k, v in bodies[1].items() if k != "seed"}]
    with running(app) as url:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(url, "/v1/completions", b), bodies))
    totals = app.state.metrics.totals
    assert totals["batches"] == 1 and totals["sequences"] == 9
    assert 1 < totals["row_steps"] / totals["steps"] <= 9  # (/metrics: the rows decoded per step)
    assert f"dllm_row_steps_total {totals['row_steps']}" in app.state.metrics.render(0, 0)
    for body, r in zip(bodies[:-1], answers):
        texts, nfe = offline(model, body["prompt"], "threshold", body.get("n", 1), body["seed"], max_new_tokens=16,
                             temperature=2.0)  # fmt: skip
        assert [c["text"] for c in r.json()["choices"]] == texts and r.json()["usage"]["nfe"] == nfe
    assert answers[-1].status_code == 200 and answers[-1].json()["choices"][0]["text"]


@pytest.mark.parametrize("mixed_batches", [True, False])
def test_requests_of_different_lengths_and_temperatures_share_one_batch(model, mixed_batches):
    """issue 44: 32 clients at once, each its own max_tokens, temperature (greedy or sampled) and seed, where their
    block grids agree (threshold's blocks of 8 here): one batch, each answer (text, NFE) equal to generate() alone
    with its settings; a length whose grid differs (12: blocks of 12 by default) decodes in a batch of its own.
    ``mixed_batches=False`` (the open-loop bench's baseline): a batch per length and temperature, the same answers."""
    app = create(
        model, name="tiny-llada", sampler="threshold", max_batch_size=32, max_wait=1.0, mixed_batches=mixed_batches
    )
    bodies = [{"model": "tiny-llada", "prompt": PROMPTS[i], "max_tokens": 8 * (1 + i % 4), "block_size": 8,
               "temperature": [0.0, 0.7, 2.0][i % 3], "seed": i} for i in range(32)]  # fmt: skip
    odd = {"model": "tiny-llada", "prompt": PROMPTS[7], "max_tokens": 12, "temperature": 2.0, "seed": 1}
    with running(app) as url:
        with ThreadPoolExecutor(len(bodies) + 1) as pool:
            answers = list(pool.map(lambda b: post(url, "/v1/completions", b), bodies + [odd]))
    totals = app.state.metrics.totals
    settings = len({(b["max_tokens"], b["temperature"]) for b in bodies})
    assert totals["batches"] == (2 if mixed_batches else settings + 1) and totals["sequences"] == 33
    for body, r in zip(bodies + [odd], answers):
        settings = {k: body[k] for k in ("block_size", "temperature", "seed") if k in body}
        texts, nfe = offline(model, body["prompt"], max_new_tokens=body["max_tokens"], **settings)
        assert [c["text"] for c in r.json()["choices"]] == texts and r.json()["usage"]["nfe"] == nfe


def test_bad_requests_get_openai_errors(server):
    url = server[0]
    cases = [
        ({"model": "tiny-llada", "prompt": "x", "max_tokens": 0}, "max_tokens", None),
        ({"model": "tiny-llada", "prompt": "x", "temprature": 1}, "temprature", None),
        ({"model": "tiny-llada", "prompt": "x", "top_p": 0.5}, "top_p", None),
        ({"model": "tiny-llada", "prompt": "x", "threshold": 2}, "threshold", None),
        ({"model": "tiny-llada", "prompt": PROMPTS[0] * 40}, "prompt", "context_length_exceeded"),
        ({"model": "tiny-llada", "prompt": "x", "block_size": 5}, "block_size", None),
        ({"model": "tiny-llada", "prompt": []}, "prompt", None),
        ({"prompt": "x"}, "model", None),
        # generate()'s refusals name the field the client sent, as the client spelt it
        ({"model": "tiny-llada", "prompt": "x", "steps": 10**9, "sampler": "llada"}, "steps", None),
        ({"model": "tiny-llada", "prompt": "x", "steps": 7, "block_size": 8, "sampler": "llada"}, "steps", None),
        (
            {"model": "tiny-llada", "prompt": "x", "max_tokens": 12, "block_size": 8, "sampler": "llada"},
            "max_tokens",
            None,
        ),
    ]
    for body, param, code in cases:
        r = post(url, "/v1/completions", body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error", (body, r.text)
        assert (error["param"], error["code"]) == (param, code), (body, error)
    assert (
        "max_tokens=32 is not a multiple of block_size=5"
        in post(url, "/v1/completions", cases[5][0]).json()["error"]["message"]
    )
    assert (
        post(url, "/v1/completions", cases[8][0])
        .json()["error"]["message"]
        .startswith("steps=1000000000 (1,000,000,000 per block) is more than a block's schedule can hold")
    )
    r = requests.post(url + "/v1/completions", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert requests.get(url + "/v1/nothing", timeout=10).status_code == 404
    # the server is unharmed
    assert post(url, "/v1/completions", {"model": "tiny-llada", "prompt": PROMPTS[0]}).status_code == 200


def test_hostile_bodies_get_a_clear_4xx_in_openais_format(model):
    """issue 39 item 4: what a fuzzer sent that answered 500, each now a 4xx naming what was wrong."""
    app = create(model, name="tiny-llada", max_body_size=50_000)
    completions = "/v1/completions"
    cases = [
        ("POST", completions, '{"model": "tiny-llada", "prompt": "\\ud800 x\\n"}', 400, "lone surrogate", "prompt"),
        (
            "POST",
            completions,
            '{"model": "tiny-llada", "prompt": ["ok\\n", "\\udfff"]}',
            400,
            "prompt[1]: the prompt",
            "prompt",
        ),
        ("POST", completions, "[" * 20_000 + "]" * 20_000, 400, "nested too deeply", None),
        ("POST", completions, '{"model": "tiny-llada", "prompt": "' + "a" * 60_000 + '"}', 413, "50000 bytes", None),
        ("POST", completions, '{"model": "\\ud800", "prompt": "x"}', 404, "does not exist", "model"),
        ("GET", completions, None, 405, "GET /v1/completions: method not allowed; use POST", None),
        ("GET", "/v1/chat/completions", None, 405, "use POST", None),
    ]
    with running(app) as url:
        for method, path, data, status, words, param in cases:
            r = requests.request(method, url + path, data=data, timeout=30)
            error = r.json()["error"]
            assert r.status_code == status and words in error["message"] and error["param"] == param, (data, r.text)
            assert r.headers["content-type"] == "application/json"
        chunks = (b"a" * 1000 for _ in range(60))  # a chunked body declares no length: counted as it comes
        assert requests.post(url + completions, data=chunks, timeout=30).status_code == 413
        assert requests.get(url + completions, timeout=30).headers["allow"] == "POST"
        assert post(url, completions, {"model": "tiny-llada", "prompt": PROMPTS[0]}).status_code == 200  # unharmed


def test_api_key_and_models(model):
    app = create(model, name="mine", api_key="sesame")
    with running(app) as url:
        assert requests.get(url + "/health", timeout=10).status_code == 200  # open: for load balancers
        refused = requests.get(url + "/v1/models", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        listed = openai.OpenAI(base_url=url + "/v1", api_key="sesame").models.list()
        assert [m.id for m in listed.data] == ["mine"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        for header, status in (("bearer sesame", 200), ("BEARER  sesame", 200), ("Basic sesame", 401), ("sesame", 401)):
            assert requests.get(url + "/v1/models", headers={"Authorization": header}, timeout=10).status_code == status


def test_a_full_queue_answers_503_and_the_others_are_served(model):
    app = create(model, name="tiny-llada", sampler="llada", max_batch_size=1, max_wait=0, max_queue=2)
    body = {"model": "tiny-llada", "max_tokens": 64, "block_size": 8}
    with running(app) as url:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: (p, post(url, "/v1/completions", body | {"prompt": p})), PROMPTS[:8]))
    served = [(p, r) for p, r in answers if r.status_code == 200]
    refused = [r for _, r in answers if r.status_code != 200]
    assert refused and all(r.status_code == 503 and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert app.state.batcher.peak <= 2 and served
    for prompt, r in served:
        assert r.json()["choices"][0]["text"] == offline(model, prompt, "llada", max_new_tokens=64, block_size=8)[0][0]


def test_a_client_that_leaves_frees_its_place_and_the_others_go_on(model, monkeypatch):
    decode, release = Batcher._decode, threading.Event()

    def held(
        self, batch, *rest
    ):  # the first request holds the model until the others have left, however fast it decodes
        release.wait(30)
        decode(self, batch, *rest)

    monkeypatch.setattr(Batcher, "_decode", held)
    app = create(model, name="tiny-llada", sampler="llada", max_batch_size=1, max_wait=0)
    request = {"model": "tiny-llada", "prompt": PROMPTS[0], "max_tokens": 64, "block_size": 32}
    with running(app) as url, ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, "/v1/completions", request)
        while app.state.batcher.running == 0:  # the first request holds the model
            time.sleep(0.01)
        with pytest.raises(requests.exceptions.ReadTimeout):  # a client that gives up while it waits in the queue
            post(url, "/v1/completions", request | {"prompt": PROMPTS[1]}, timeout=0.3)
        streamed = requests.post(url + "/v1/completions", json=request | {"stream": True}, stream=True, timeout=30)
        streamed.close()  # and one that leaves a stream before its first chunk
        deadline = time.monotonic() + 10
        while app.state.batcher.depth and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.state.batcher.depth == 0 and app.state.batcher.running == 1  # freed while the first decodes
        release.set()
        assert (
            first.result().json()["choices"][0]["text"]
            == offline(model, PROMPTS[0], "llada", max_new_tokens=64, block_size=32)[0][0]
        )
        assert post(url, "/v1/completions", {"model": "tiny-llada", "prompt": PROMPTS[2]}).status_code == 200
        figures = requests.get(url + "/metrics", timeout=10).text
    assert "dllm_sequences_total 2\n" in figures  # the two that left were never decoded


def test_a_failing_request_does_not_take_down_its_batch(model, monkeypatch):
    decode = Batcher._decode

    def failing(self, batch, *rest):  # a fault that only one request's rows trigger
        if any(job.prompts[0] == model.tokenizer(PROMPTS[3])["input_ids"] for job in batch):
            raise RuntimeError("boom")
        decode(self, batch, *rest)

    monkeypatch.setattr(Batcher, "_decode", failing)
    app = create(model, name="tiny-llada", sampler="threshold", max_batch_size=8, max_wait=0.2)
    with running(app) as url, ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda p: post(url, "/v1/completions", {"model": "tiny-llada", "prompt": p}), PROMPTS[:4])
        )
    assert answers[3].status_code == 500 and "boom" in answers[3].json()["error"]["message"]
    for prompt, r in zip(PROMPTS[:3], answers):
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(model, prompt)[0][0]
    assert app.state.batcher.peak >= 2  # they did share a batch first


def test_metrics_in_prometheus_format(server):
    url = server[0]
    post(url, "/v1/completions", {"model": "tiny-llada", "prompt": PROMPTS[0]})
    post(url, "/v1/completions", {"model": "nope", "prompt": PROMPTS[0]})
    text = requests.get(url + "/metrics", timeout=10).text
    assert 'dllm_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'dllm_requests_total{endpoint="/v1/completions",status="404"}' in text
    count = float(text.split("dllm_request_latency_seconds_count ")[1].split()[0])
    inf = float(text.split('dllm_request_latency_seconds_bucket{le="+Inf"} ')[1].split()[0])
    assert count == inf >= 1 and "dllm_queue_depth 0" in text and "# TYPE dllm_generated_tokens_total counter" in text


def test_lm_eval_local_completions_scores_as_dllm_eval(server):
    """lm-eval's own API model against the server scores the bundled task exactly as the in-process dllm model
    with the same sampler, sample by sample."""
    import lm_eval
    import lm_eval.models.openai_completions  # noqa: F401 - registers "local-completions"
    from lm_eval.tasks import TaskManager

    import dllm.eval
    import dllm.eval.harness  # noqa: F401 - registers lm-eval's model "dllm"

    tasks = TaskManager(include_path=str(dllm.eval.TASKS_DIR), include_defaults=False)
    common = dict(tasks=["dllm_arith"], limit=16, log_samples=True, task_manager=tasks, bootstrap_iters=0)
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny-llada,base_url={server[0]}/v1/completions,tokenizer_backend=None,"
        "tokenized_requests=False,num_concurrent=4",
        **common,
    )
    local = lm_eval.simple_evaluate(model="dllm", model_args="pretrained=tiny-llada,sampler=threshold", **common)
    responses = [[s["filtered_resps"] for s in r["samples"]["dllm_arith"]] for r in (served, local)]
    assert responses[0] == responses[1]
    assert served["results"]["dllm_arith"]["exact_match,none"] == local["results"]["dllm_arith"]["exact_match,none"]


def test_dllm_serve_from_the_command_line_stops_cleanly_on_ctrl_c(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dllm.serve", "tiny-sdar", "--port", str(port), "--api-key", "k"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.2)
        body = {"model": "tiny-sdar", "prompt": PROMPTS[0]}
        r = post(f"http://127.0.0.1:{port}", "/v1/completions", body, headers={"Authorization": "Bearer k"})
        expected = dllm.samplers.reference("sdar").generate(dllm.load("tiny-sdar"), PROMPTS[0]).texts[0]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "batch: 1 request, 1 sequence" in output and "Finished server process" in output


def _serve(arguments: list[str]):
    """``python -m dllm.serve ARGUMENTS`` in a process of its own on a free port, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dllm.serve", *arguments, "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the server did not come up: {process.communicate()[0]}")
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return process, f"http://127.0.0.1:{port}"
        except requests.ConnectionError:
            time.sleep(0.2)


def test_ctrl_c_under_load_ends_the_running_batch_and_answers_the_waiting_503(model):
    """33 sampled requests, each its own seed: one decodes, 32 wait. Ctrl-C: the waiting ones get 503 in OpenAI's
    JSON at once, the running one its answer, and the server exits after that batch, decoding nothing more."""
    process, url = _serve(["tiny-llada", "--sampler", "llada", "--max-batch-size", "1"])
    body = {"model": "tiny-llada", "max_tokens": 64, "block_size": 8, "temperature": 1.0, "eos_early_stop": False}
    bodies = [body | {"prompt": PROMPTS[i % len(PROMPTS)], "seed": i} for i in range(33)]
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = [pool.submit(post, url, "/v1/completions", b) for b in bodies]
            deadline = time.monotonic() + 60
            while requests.get(url + "/health", timeout=5).json()["queue"] < 30:
                assert time.monotonic() < deadline, "the requests did not queue"
                time.sleep(0.02)
            process.send_signal(signal.SIGINT)
            interrupted = time.monotonic()
            output, _ = process.communicate(timeout=60)
            exited = time.monotonic() - interrupted
            answers = [a.result() for a in answers]
    finally:
        process.kill()
    assert process.returncode == 0, output
    ok = [(b, r) for b, r in zip(bodies, answers) if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert len(refused) >= 30 and all(
        r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" for r in refused
    ), {r.status_code: r.text for r in refused}
    decoded = [float(line.split(", ")[-2].removesuffix(" s")) for line in output.splitlines() if "batch: " in line]
    assert 1 <= len(ok) == len(decoded), output  # only the batches that answered were decoded
    assert exited < decoded[-1] + 10, (exited, output)  # not one batch after another, nor uvicorn's 30 s timeout
    for b, r in ok:
        expected = offline(model, b["prompt"], "llada", seed=b["seed"], max_new_tokens=64, block_size=8,
                           temperature=1.0, eos_early_stop=False)  # fmt: skip
        assert r.json()["choices"][0]["text"] == expected[0][0]
    assert "Traceback" not in output


def test_llada21_streams_only_final_blocks_and_answers_its_first_max_tokens(tmp_path):
    """LLaDA2.1 rewrites decoded tokens of its current block: the stream sends a block's text once the row has left
    it, so the pieces still add up to the answer (which is the first max_tokens of the span, as generate's), and its
    NFE is generate's."""
    from dllm.models.tiny import make_tiny_checkpoint

    model = dllm.load(make_tiny_checkpoint(tmp_path, "llada2", seed=0, std=0.5), device="cpu")
    settings = {"threshold": 0.5, "editing_threshold": 0.0}
    app = create(model, name="tiny", sampler="llada21", hyper_parameters=settings, max_batch_size=4, max_wait=0.05)
    sampler = dllm.samplers.get("llada21", **settings)
    edits, canvas = [], []

    def count(info):  # slots rewritten after they were decoded
        if canvas:
            edits.append(int((info.committed & (canvas[-1] != model.mask_id)).sum()))
        canvas.append(info.tokens.clone())

    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in ("1+2=", "abcdef"):
            out = sampler.generate(model, prompt, max_new_tokens=13, block_size=8, callback=count)
            expected = out.texts[0]
            body = {"block_size": 8}
            whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=13, extra_body=body)
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=13, stream=True, extra_body=body)
            pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
            assert whole.choices[0].text == "".join(pieces) == expected and len(expected) <= 13
            assert whole.usage.nfe == out.nfe  # (its last forwards may edit, or find nothing to edit: counted)
    assert sum(edits) > 0


@pytest.mark.parametrize(
    "name,sampler",
    [("tiny-llada21", "llada21"), ("tiny-llada", "freedave"), ("tiny-diffusion-gemma", "entropy_bound"),
     ("tiny-wedlm", "wedlm")],
)  # fmt: skip
def test_each_request_in_a_batch_is_answered_its_own_nfe(name, sampler):
    """Requests of their own lengths and seeds decoded in one batch to its end (``--no-joins``; the renoise and
    stream processes take no joined rows anyway) by each process but the masked one: each answer's NFE is the
    forwards its prompt takes alone (``Decoding.row_nfe``), not the batch's count at its last commit (LLaDA2.1's
    last forward may find nothing to edit; FreeDave's drafts forward is not a row's whose block has one mask left;
    DiffusionGemma's row ends at its own last canvas)."""
    model = dllm.load(name)
    grid = {"block_size": 8} if name == "tiny-llada" else {}
    temperature = 0.0 if sampler == "entropy_bound" else 1.0  # (DiffusionGemma's schedule sets its temperatures)
    bodies = [{"model": name, "prompt": PROMPTS[i], "max_tokens": [16, 8, 24, 16][i], "seed": i,
               "temperature": temperature, **grid} for i in range(4)]  # fmt: skip
    app = create(model, name=name, sampler=sampler, max_batch_size=4, max_wait=2.0, joins=False)
    with running(app) as url, ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(url, "/v1/completions", b), bodies))
    assert app.state.metrics.totals["batches"] == 1
    for body, r in zip(bodies, answers):
        texts, nfe = offline(
            model, body["prompt"], sampler, max_new_tokens=body["max_tokens"], seed=body["seed"],
            temperature=temperature, **grid,
        )  # fmt: skip
        assert [c["text"] for c in r.json()["choices"]] == texts and r.json()["usage"]["nfe"] == nfe, body


def test_diffusion_gemma_streams_only_finished_canvases_and_answers_as_generate(tmp_path):
    """DiffusionGemma's canvas being denoised shows drafts: the stream sends a canvas's text once the row has left it
    (or settled), so the pieces add up to the answer, generate's with the same seed (its first max_tokens)."""
    from dllm.models.tiny import make_tiny_checkpoint

    model = dllm.load(make_tiny_checkpoint(tmp_path, "diffusion_gemma", seed=0, std=0.5), device="cpu")
    settings = {"max_denoising_steps": 3}
    app = create(model, name="tiny", sampler="entropy_bound", hyper_parameters=settings, max_batch_size=4,
                 max_wait=0.05)  # fmt: skip
    sampler = dllm.samplers.get("entropy_bound", **settings)
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in ("1+2=", "abcdef"):
            expected = sampler.generate(model, prompt, max_new_tokens=10, seed=3).texts[0]
            whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, seed=3)
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, seed=3, stream=True)
            pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
            assert whole.choices[0].text == "".join(pieces) == expected and len(expected) <= 10
            assert len(pieces) > 1  # canvas by canvas, not all at the end
        r = post(url, "/v1/completions", {"model": "tiny", "prompt": "1+2=", "temperature": 0.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text  # (its own schedule)


GRAMMAR = 'start: NUM (" " NUM)*\nNUM: /[0-9]+/'


def test_structured_output_equals_generate_with_the_constraint(server, client, model):
    """OpenAI's response_format and vLLM's structured_outputs answer what generate() with the same constraint
    answers, valid; dllm's template fills its holes; what is not supported is a 400 naming its field."""
    url, _ = server
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    prompt, settings = PROMPTS[0], {"max_new_tokens": 24, "block_size": 8}
    r = client.chat.completions.create(
        model="tiny-llada",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"block_size": 8},
    )
    texts, _ = offline(model, prompt, constraint=JsonSchema(schema), **settings)
    assert r.choices[0].message.content == texts[0] and JsonSchema(schema).check(texts[0])
    numbers = Regex(r"[0-9]+( [0-9]+)*")
    for body, constraint in [
        ({"structured_outputs": {"regex": numbers.pattern}}, numbers),
        ({"response_format": {"type": "json_object"}}, Json()),
        ({"structured_outputs": {"choice": ["7 9 14", "14 9 7"]}}, Regex("7 9 14|14 9 7")),
        ({"structured_outputs": {"grammar": GRAMMAR}}, Grammar(GRAMMAR)),
    ]:
        request = {"model": "tiny-llada", "prompt": PROMPTS[1], "max_tokens": 24, "block_size": 8, **body}
        text = post(url, "/v1/completions", request).json()["choices"][0]["text"]
        assert text == offline(model, PROMPTS[1], constraint=constraint, **settings)[0][0] and constraint.check(text)
    request = {"model": "tiny-llada", "prompt": PROMPTS[0], "template": "The answer is{{3: [0-9]+}}."}
    text = post(url, "/v1/completions", request).json()["choices"][0]["text"]
    assert re.fullmatch(r"The answer is [0-9]+\.", text)
    for body, field in [
        ({"structured_outputs": {"structural_tag": {"format": {}}}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "zqxj"}}, "structured_outputs"),  # no text of the tokenizer's tokens
        ({"template": "The answer is {{x}}."}, "template"),
        ({"template": "The answer is{{3}}.", "stream": True}, "template"),
    ]:
        r = post(url, "/v1/completions", {"model": "tiny-llada", "prompt": PROMPTS[0], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.json())


@pytest.mark.parametrize("name,sampler,cache", [("tiny-llada", "threshold", None), ("tiny-sdar", "sdar", "block")])
def test_requests_join_the_running_rows_between_steps(model, monkeypatch, name, sampler, cache):
    """issue 44: requests that arrive while a batch decodes join its rows at the next step (each its own prompt,
    length, temperature, EOS rule and seed), and leave when done: one run for all of them, each answer (text, NFE)
    equal to generate() alone. A request of another block grid waits for the running rows to end (its own run);
    ``--no-joins``: a batch runs to its end, the same answers. SDAR with its block cache: the store takes the rows."""
    model = model if name == "tiny-llada" else dllm.load(name)
    step = dllm.engine.session.Decoding.step

    def slow(self):  # a step as long as a big model's, so that the requests below arrive mid-run
        time.sleep(0.03)
        return step(self)

    monkeypatch.setattr(dllm.engine.session.Decoding, "step", slow)
    grid = {"block_size": 8} if name == "tiny-llada" else {}
    bodies = [{"model": name, "prompt": PROMPTS[i], "max_tokens": 8 * (1 + i % 5), "eos_early_stop": i % 4 > 0,
               "temperature": [0.0, 0.7, 2.0][i % 3], "seed": i, **grid} for i in range(12)]  # fmt: skip
    bodies[0]["max_tokens"] = 40  # the first request runs longest: every other arrives while it decodes
    odd = {"model": name, "prompt": PROMPTS[7], "max_tokens": 12, "temperature": 2.0, "seed": 1, "steps_per_block": 2}
    for joins in (True, False) if cache is None else (True,):
        app = create(model, name=name, sampler=sampler, cache=cache, max_batch_size=8, max_wait=0, joins=joins)
        with running(app) as url, ThreadPoolExecutor(len(bodies) + 1) as pool:

            def send(i):
                time.sleep(0.1 * (i > 0) + 0.02 * i)  # the first, then the others one by one while it decodes
                return post(url, "/v1/completions", bodies[i] if i < len(bodies) else odd)

            answers = list(pool.map(send, range(len(bodies) + 1)))
        totals = app.state.metrics.totals
        assert totals["sequences"] == len(bodies) + 1
        if joins:  # every request of the running grid in one run (at most 8 rows at once); the odd one alone
            assert totals["batches"] == 2 and totals["row_steps"] / totals["steps"] > 2
        else:
            assert totals["batches"] > 3
        for body, r in zip(bodies + [odd], answers):
            keys = ("block_size", "temperature", "seed", "steps_per_block", "eos_early_stop")
            settings = {k: body[k] for k in keys if k in body}
            texts, nfe = offline(
                model, body["prompt"], sampler, max_new_tokens=body["max_tokens"], cache=cache, **settings
            )
            assert [c["text"] for c in r.json()["choices"]] == texts and r.json()["usage"]["nfe"] == nfe, body


def test_requests_of_their_own_thresholds_share_one_batch(model):
    """issue 44: requests that differ in the sampler's per-row hyper-parameters (threshold's threshold) share a batch,
    each answer (text, NFE) what the sampler with its value gives alone; another hyper-parameter keys the batch."""
    app = create(model, name="tiny-llada", sampler="threshold", max_batch_size=16, max_wait=1.0)
    bodies = [{"model": "tiny-llada", "prompt": PROMPTS[i], "max_tokens": 16, "block_size": 8,
               "threshold": [0.9, 0.5, 0.99, 1.0][i % 4], "seed": i} for i in range(8)]  # fmt: skip
    with running(app) as url, ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(url, "/v1/completions", b), bodies))
    assert app.state.metrics.totals["batches"] == 1
    for body, r in zip(bodies, answers):
        out = dllm.samplers.get("threshold", threshold=body["threshold"]).generate(
            model, body["prompt"], max_new_tokens=16, block_size=8, seed=body["seed"]
        )
        assert r.json()["choices"][0]["text"] == out.texts[0] and r.json()["usage"]["nfe"] == out.nfe, body
