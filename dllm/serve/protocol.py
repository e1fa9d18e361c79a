"""The OpenAI request bodies the server takes, checked field by field, and the bodies it answers with.

A ``/v1/completions`` or ``/v1/chat/completions`` body becomes a :class:`Job`: its prompts as token ids, the
sampler, the generation settings, the seed, the stop strings. What a field may hold:

- OpenAI's: ``model`` (required: the served name), ``prompt`` (a string, a list of strings, a list of token ids
  or a list of such lists) or ``messages`` (chat; each ``content`` a string or a list of text parts),
  ``max_tokens`` (``max_completion_tokens`` in chat: the generation length ``max_new_tokens``), ``temperature``
  (0: greedy), ``seed``, ``stop`` (a string or a list), ``n``, ``stream``, ``stream_options.include_usage``;
  ``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and change nothing; the others
  (``top_p``, ``logprobs``, ``echo``, penalties, ...) only at the value that changes nothing, unless the
  sampler has a hyper-parameter of that name, which then takes it;
- dllm's own, as extra fields of the body: ``sampler``, ``steps``, ``steps_per_block``, ``block_size``,
  ``eos_early_stop`` and any hyper-parameter of the sampler by its name (``threshold``, ``alg``, ...).
- structured output (:mod:`dllm.constraints`): OpenAI's ``response_format`` (``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"schema": ...}}``), vLLM's ``structured_outputs`` (one of ``regex``,
  ``json``, ``choice``, ``json_object``, ``grammar`` in Lark's syntax; ``structural_tag`` is a 400),
  and dllm's ``template`` (the text with holes, as ``dllm generate --template``: ``"The answer is{{3: [0-9]+}}."``;
  not with ``stream``).

Anything else is a 400 naming the field. Defaults are the server's command line (``dllm serve --help``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import time
import uuid

from dllm.core import params
from dllm.core.errors import ConfigError

GENERATION_KEYS = ("max_new_tokens", "block_size", "steps", "steps_per_block")
DLLM_FIELDS = {"sampler", "steps", "steps_per_block", "block_size", "eos_early_stop", "template", "structured_outputs"}
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "seed", "stop", "n", "stream", "stream_options", "response_format"
}  # fmt: skip
KIND_FIELDS = {"completion": {"prompt"}, "chat": {"messages", "max_completion_tokens"}}
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier"}  # bookkeeping: no effect on the answer
# OpenAI fields dllm's samplers do not implement: accepted at the values that change nothing.
NEUTRAL = {
    "top_p": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (False, None),
    "best_of": (1, None),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
}
MAX_STOP = 16


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "server_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(eq=False)
class Job:
    """One request: what it asks, decoded, and the channel its answer goes back through.

    prompts: the token ids of each prompt (one for chat); each is decoded ``n`` times (choices ``i * n + j``);
    key: the settings that must be equal for jobs to share a batch (sampler, generation; each row keeps its own
    seed, and its own length and temperature where the sampler allows them: :meth:`Batcher.check` completes the
    key); length: its max_new_tokens, resolved (:meth:`Batcher.check`)."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]
    n: int
    sampler: object
    generation: dict  # max_new_tokens, block_size, steps, steps_per_block, temperature, eos_early_stop
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    key: str
    fields: frozenset = frozenset()  # the body's fields, so that an error can name the one the client sent
    length: int | None = None
    row_hyper: dict = dataclasses.field(default_factory=dict)  # its sampler's per-row hyper-parameters' values
    row_key: str = ""  # the key without them: the batch key where rows may have their own (Batcher.check)
    id: str = dataclasses.field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    sent: dict = dataclasses.field(default_factory=dict)  # choice -> text already streamed
    events: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.events = loop, asyncio.Queue()

    def deliver(self, event: tuple) -> None:
        """Hand ``event`` to the request's handler (from the batch thread: thread-safe)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclasses.dataclass
class Choice:
    """One finished choice: its text (cut at EOS, then at the first stop string), why it ended, its tokens."""

    text: str
    finish_reason: str
    tokens: int


@dataclasses.dataclass
class Answer:
    choices: list[Choice]
    prompt_tokens: int
    nfe: int  # forwards of the request's rows: what generate() of its prompts alone makes

    def usage(self) -> dict:
        completion = sum(c.tokens for c in self.choices)
        per_row = completion / len(self.choices) if self.choices else 0.0
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "nfe": self.nfe,
            "tokens_per_forward": round(per_row / self.nfe, 4) if self.nfe else 0.0,
        }


class Settings:
    """The server's defaults (its command line) and how a request body turns into a :class:`Job`."""

    def __init__(self, model, name, sampler_name, hyper_parameters: dict, generation: dict, seed, max_batch_size):
        self.model, self.name = model, name
        self.sampler_name, self.hyper_parameters = sampler_name, dict(hyper_parameters)
        self.generation = dict(generation)  # GENERATION_KEYS, temperature, eos_early_stop (None: unset)
        self.seed = seed
        self.max_batch_size = max_batch_size
        self._samplers: dict[str, object] = {}

    def sampler(self, name: str, hyper_parameters: dict):
        """The sampler ``name`` with ``hyper_parameters`` (built once per distinct setting)."""
        from dllm import samplers

        key = json.dumps([name, hyper_parameters], sort_keys=True, default=repr)
        if key not in self._samplers:
            if len(self._samplers) > 256:  # many distinct settings: forget the oldest
                self._samplers.pop(next(iter(self._samplers)))
            self._samplers[key] = samplers.get(name, **hyper_parameters)
        return self._samplers[key], key

    def parse(self, body, kind: str) -> Job:
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is None:
            raise bad("model is required: the served model's name (GET /v1/models lists it)", "model")
        if model != self.name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist on this server; it serves {self.name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        sampler_name = self._sampler_name(body.get("sampler"))
        hyper_keys = self._hyper_keys(sampler_name, body)
        known = COMMON_FIELDS | KIND_FIELDS[kind] | DLLM_FIELDS | IGNORED_FIELDS | set(NEUTRAL) | hyper_keys
        for field in body:
            if field not in known:
                close = difflib.get_close_matches(field, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise bad(
                    f"unknown field {field!r}{hint} (OpenAI's fields, dllm's sampler, steps, steps_per_block, "
                    f"block_size, eos_early_stop, and the hyper-parameters of the sampler {sampler_name!r}: "
                    f"{', '.join(sorted(hyper_keys)) or 'none'})",
                    field,
                )
        for field, neutral in NEUTRAL.items():
            if field in body and field not in hyper_keys and not any(_same(body[field], v) for v in neutral):
                raise bad(
                    f"{field}={body[field]!r} is not supported by the {sampler_name!r} sampler; leave it out (or "
                    f"give {neutral[0]!r})",
                    field,
                )
        hyper = dict(self.hyper_parameters) if sampler_name == self.sampler_name else {}
        hyper.update({k: body[k] for k in hyper_keys if k in body})
        try:
            sampler, sampler_key = self.sampler(sampler_name, hyper)
        except ConfigError as e:
            raise bad(str(e), _named(str(e), hyper_keys & set(body)) or "sampler") from None
        generation = self._generation(body, kind)
        seed = _checked("seed", body.get("seed", self.seed), int | None)
        n = _checked("n", body.get("n", 1), int, ">= 1")
        prompts = self._prompts(body, kind)
        if n * len(prompts) > self.max_batch_size:
            raise bad(
                f"{len(prompts)} prompt(s) x n={n} is {n * len(prompts)} sequences, more than this server's batch of "
                f"{self.max_batch_size} (dllm serve --max-batch-size); send fewer",
                "n",
            )
        stream = _checked("stream", body.get("stream"), bool | None) or False
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad('stream_options must be {"include_usage": true or false}', "stream_options")
        include_usage = _checked("stream_options.include_usage", options.get("include_usage", False), bool)
        stop = _stop(body.get("stop"))
        generation.update(_structure(body, stream))
        # (constraints: their repr; the length, the temperature and the EOS rule join the key, or not: Batcher.check)
        shared = {k: v for k, v in generation.items() if k not in ("max_new_tokens", "temperature", "eos_early_stop")}
        key = json.dumps([sampler_key, shared], sort_keys=True, default=repr)
        fields = frozenset(body)
        job = Job(kind, model, prompts, n, sampler, generation, seed, stop, stream, include_usage, key, fields)
        # the hyper-parameters each row may have its own of (generate(hyper_parameters=[...])), and the key without
        # them (Batcher.check chooses)
        per_row = getattr(sampler, "per_row_fields", ())
        job.row_hyper = {f: getattr(sampler, f) for f in per_row}
        shared_hyper = {k: v for k, v in hyper.items() if k not in per_row}
        job.row_key = json.dumps([[sampler_name, shared_hyper], shared], sort_keys=True, default=repr)
        return job

    @staticmethod
    def refusal(job: Job, error: ConfigError) -> ApiError:
        """generate()'s refusal of a job's settings as the client wrote them: ``max_new_tokens`` is the body's
        ``max_tokens`` (``max_completion_tokens``), and ``param`` the field it sent that the message names."""
        length = "max_completion_tokens" if "max_completion_tokens" in job.fields else "max_tokens"
        message = str(error).replace("max_new_tokens", length)
        sent = {field for field in job.fields if field in (*GENERATION_KEYS, length, "temperature", "eos_early_stop")}
        structured = [f for f in ("template", "response_format", "structured_outputs") if f in job.fields]
        if structured and ("constraint" in message or "template" in message):  # (what cannot be met)
            return bad(message, structured[-1] if "template" in message else structured[0])
        return bad(message, _named(message, sent))

    def _sampler_name(self, name) -> str:
        from dllm.samplers.registry import canonical

        if name is None:
            return self.sampler_name
        try:
            return canonical(name)
        except ConfigError as e:
            raise bad(str(e), "sampler") from None

    def _hyper_keys(self, sampler_name: str, body: dict) -> set:
        from dllm import samplers

        base = body.get("base") if isinstance(body.get("base"), str) else self.hyper_parameters.get("base")
        try:
            return set(samplers.defaults(sampler_name, base if isinstance(base, str) else None))
        except ConfigError as e:
            raise bad(str(e), "base") from None

    def _generation(self, body: dict, kind: str) -> dict:
        length = body.get("max_tokens")
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            length = body["max_completion_tokens"]
        named = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else None
        generation = dict(self.generation)
        if length is not None:
            generation["max_new_tokens"] = _checked(named or "max_tokens", length, int, ">= 1")
        for key in ("block_size", "steps", "steps_per_block"):
            if body.get(key) is not None:
                generation[key] = _checked(key, body[key], int, ">= 1")
        if body.get("temperature") is not None:
            generation["temperature"] = _checked("temperature", body["temperature"], float, ">= 0")
        if "eos_early_stop" in body:
            generation["eos_early_stop"] = _checked("eos_early_stop", body["eos_early_stop"], bool)
        return {k: v for k, v in generation.items() if v is not None}

    def _prompts(self, body: dict, kind: str) -> list[list[int]]:
        from dllm.engine import prompts as encoding

        field = "prompt" if kind == "completion" else "messages"
        if field not in body:
            raise bad(f"{field} is required", field)
        given = body[field]
        try:
            if kind == "chat":
                return [_ids(encoding.encode(self.model, _messages(given)))]
            if isinstance(given, str):
                return [_ids(encoding.encode(self.model, given))]
            if isinstance(given, list) and given and all(isinstance(t, int) and not isinstance(t, bool) for t in given):
                return [_ids(encoding.encode(self.model, [given]))]
            if isinstance(given, list) and given and all(isinstance(p, (str, list)) for p in given):
                out = []
                for i, p in enumerate(given):
                    try:
                        out.append(_ids(encoding.encode(self.model, p if isinstance(p, str) else [p])))
                    except ConfigError as e:
                        raise ConfigError(f"prompt[{i}]: {e}") from None
                return out
        except ConfigError as e:
            raise bad(str(e), field) from None
        raise bad(
            f"{field} must be a string, a list of strings, a list of token ids or a list of such lists, got "
            f"{json.dumps(given)[:80]}",
            field,
        )


STRUCTURED_OUTPUTS = ("regex", "json", "choice", "json_object", "grammar")  # vLLM's keys dllm implements


def _structure(body: dict, stream: bool) -> dict:
    """``generate``'s ``constraint=`` and ``template=`` from the body's ``response_format``, ``structured_outputs``
    and ``template``."""
    from dllm.constraints.template import parse_template

    formats = [f for f in ("response_format", "structured_outputs") if body.get(f) not in (None, {"type": "text"})]
    if len(formats) > 1:
        raise bad("give response_format or structured_outputs, not both", "structured_outputs")
    out, field = {}, None
    try:
        if formats == ["response_format"]:
            field = "response_format"
            out["constraint"] = _response_format(body[field])
        elif formats == ["structured_outputs"]:
            field = "structured_outputs"
            out["constraint"] = _structured_outputs(body[field])
        if body.get("template") is not None:
            field = "template"
            if not isinstance(body[field], str):
                raise bad('template must be a string with holes, e.g. "The answer is{{3: [0-9]+}}."', field)
            if stream:
                raise bad("template with stream is not supported: a hole's filler would cut the stream", field)
            out["template"] = parse_template(body[field])
    except ConfigError as e:
        raise bad(str(e), field) from None
    return out


def _response_format(given):
    """OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}``."""
    from dllm.constraints import Json, JsonSchema

    kind = given.get("type") if isinstance(given, dict) else None
    spec = given.get("json_schema") if kind == "json_schema" else None
    if kind == "json_object":
        return Json()
    if kind == "json_schema" and isinstance(spec, dict):
        return Json() if spec.get("schema") is None else JsonSchema(spec["schema"])
    raise bad(
        f'response_format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", '
        f'"json_schema": {{"name": ..., "schema": {{...}}}}}}, got {json.dumps(given)[:80]}',
        "response_format",
    )


def _structured_outputs(given):
    """vLLM's ``structured_outputs``: one of ``regex``, ``json`` (a schema), ``choice`` (texts), ``json_object``."""
    from dllm.constraints import Grammar, Json, JsonSchema, Regex
    from dllm.constraints.template import escape

    asked = [k for k, v in given.items() if v not in (None, False)] if isinstance(given, dict) else []
    if len(asked) != 1:
        raise bad(
            f"structured_outputs must be an object with one of {', '.join(STRUCTURED_OUTPUTS)}, got "
            f"{json.dumps(given)[:80]}",
            "structured_outputs",
        )
    kind, value = asked[0], given[asked[0]]
    if kind == "regex":
        return Regex(value)
    if kind == "json":
        return JsonSchema(value)
    if kind == "json_object":
        return Json()
    if kind == "grammar":
        return Grammar(value)
    if kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
        return Regex("|".join(f"(?:{escape(c)})" for c in value))
    if kind == "choice":
        raise bad("structured_outputs.choice must be a non-empty list of non-empty strings", "structured_outputs")
    raise bad(
        f"structured_outputs.{kind} is not supported; dllm takes {', '.join(STRUCTURED_OUTPUTS)} (grammar: Lark's "
        "syntax)",
        "structured_outputs",
    )


def _ids(encoded) -> list[int]:
    ids, mask = encoded
    return ids[0][mask[0].bool()].tolist()


def _messages(given) -> list[dict]:
    if not isinstance(given, list) or not given:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(given):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role and a content", "messages")
        content = m.get("content")
        if isinstance(content, list):  # text parts
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content or ""})
    return out


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    return [s for s in stops if s]


def _checked(key: str, value, kind, accepts=None):
    try:
        return params.check_value(key, value, kind, accepts)
    except ConfigError as e:
        raise bad(str(e), key) from None


def _same(value, neutral) -> bool:
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _named(message: str, fields: set) -> str | None:
    """The field of ``fields`` that ``message`` names first (None: none)."""
    at = {f: [i for i in (message.find(p) for p in (repr(f), f"{f}=", f" {f} ")) if i >= 0] for f in fields}
    return min((f for f in sorted(fields) if at[f]), key=lambda f: min(at[f]), default=None)


# -- answers ----------------------------------------------------------------------------------------------------


def completion_body(job: Job, answer: Answer) -> dict:
    if job.kind == "chat":
        choices = [
            {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
            for i, c in enumerate(answer.choices)
        ]
        return _envelope(job, "chat.completion", choices) | {"usage": answer.usage()}
    choices = [
        {"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
        for i, c in enumerate(answer.choices)
    ]
    return _envelope(job, "text_completion", choices) | {"usage": answer.usage()}


def chunk(job: Job, index: int, text: str | None = None, finish_reason: str | None = None, role: bool = False):
    """One streamed chunk of choice ``index``: new ``text``, or its ``finish_reason``."""
    if job.kind == "chat":
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
        return _envelope(job, "chat.completion.chunk", [choice])
    choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    return _envelope(job, "text_completion", [choice])


def usage_chunk(job: Job, answer: Answer) -> dict:
    kind = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return _envelope(job, kind, []) | {"usage": answer.usage()}


def _envelope(job: Job, kind: str, choices: list) -> dict:
    prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
    return {
        "id": prefix + job.id.removeprefix("cmpl-"),
        "object": kind,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
