"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`create_app(engine, tokenizer, server, decode, max_model_len)` wires an Engine (see worker.py) behind one
decoding worker thread. Model loading lives in `resispec.serving.server`.

Every client input gets a 2xx or a 4xx with an OpenAI error body, and the connection stays usable: request bodies
over `server.max_body_bytes` get a 413 before they are read; prompts are tokenised off the event loop; anything
that still fails before the response starts is a 500 with `Connection: close` (never a reset connection).
A temperature below `GREEDY_BELOW_TEMPERATURE` (1e-5, vLLM's threshold) decodes greedily.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from resispec.decoding.config import DecodeConfig
from resispec.sampling import GREEDY_BELOW_TEMPERATURE
from resispec.serving.config import ServerConfig
from resispec.serving.logprobs import TokenText, chat_logprobs, completion_logprobs, scoring_model
from resispec.serving.metrics import ServerMetrics
from resispec.serving.openapi import error_param, openapi_builder, responses
from resispec.serving.protocol import (
    UNSUPPORTED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidUnicode,
    SamplingFields,
    error_body,
    new_id,
    now,
    usage,
)
from resispec.serving.text import TextAssembler, decode_ids, encode_chat, encode_text
from resispec.serving.worker import (
    DecodeWorker,
    Engine,
    Job,
    QueueFullError,
    RequestTooLargeError,
    SamplingParams,
)

log = logging.getLogger(__name__)
API_KEY_ENV = "RESISPEC_API_KEY"
# top_p below this keeps only the most likely token, exactly like any smaller top_p (for vocabularies < 10^6), and
# stays above float32's resolution in the top-p cut
MIN_TOP_P = 1e-6
RETRY_AFTER_S = "1"
# A prompt longer than this many characters per context token is first tokenised on a prefix of that length: when
# the prefix alone is over the context (plus a margin for the cut), the prompt is rejected without tokenising the rest
# (a megabyte prompt costs milliseconds, not seconds of CPU).
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_MARGIN_TOKENS = 64


@dataclass
class _Result:
    """What a finished (or cancelled) generation produced."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    chunks: list[str] = field(default_factory=list)


def _key_bytes(key: str, encoding: str) -> bytes:
    return key.encode(encoding, "surrogateescape" if encoding == "utf-8" else "replace")


class _ErrorJSON(JSONResponse):
    """Error bodies render ASCII-only: any message (even one quoting odd input) encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(exc: APIError) -> JSONResponse:
    return _ErrorJSON(exc.body(), status_code=exc.status, headers=exc.headers)


class _Server:
    """Per-app state and the request flow shared by both endpoints."""

    def __init__(
        self, engine: Engine, tokenizer, server: ServerConfig, decode: DecodeConfig, max_model_len: int
    ) -> None:
        self.tokenizer, self.cfg, self.decode, self.max_model_len = tokenizer, server, decode, max_model_len
        key = server.api_key or os.environ.get(API_KEY_ENV) or None
        # compared as bytes: a non-ASCII key works when the client sends its UTF-8 bytes
        self.api_key = None if key is None else _key_bytes(key, "utf-8")
        self.metrics = ServerMetrics(server.model_name)
        self.worker = DecodeWorker(engine, max_queue=server.max_queue, metrics=self.metrics)
        self.vocab_size = len(tokenizer)
        self.token_text = TokenText(tokenizer)
        self.can_score = scoring_model(engine) is not None
        eos = getattr(engine, "eos_token_id", None)
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
        self.created = now()
        self.chat_template_kwargs: dict = {}  # data.chat_template_kwargs (e.g. Qwen3's enable_thinking)

    # ------------------------------------------------------------------ checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")  # decoded as latin-1: any byte is one character
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            _key_bytes(token.strip(), "latin-1"), self.api_key
        ):
            raise APIError(
                401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    def check_model(self, model: str) -> None:
        if model != self.cfg.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.cfg.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_common(self, req: SamplingFields) -> None:
        self.check_model(req.model)
        for name, (neutral, message) in UNSUPPORTED.items():
            if name in type(req).model_fields and not neutral(getattr(req, name)):
                raise APIError(400, message, param=name)
        stops = req.stop_list()
        # as given: empty strings (which stop_list drops) count too, as the schema's maxItems counts them
        given = 1 if isinstance(req.stop, str) else len(req.stop or [])
        if given > self.cfg.max_stop_strings:
            raise APIError(
                400, f"At most {self.cfg.max_stop_strings} stop strings are supported.", param="stop"
            )
        if any(len(s) > self.cfg.max_stop_length for s in stops):
            raise APIError(
                400, f"Stop strings may have at most {self.cfg.max_stop_length} characters.", param="stop"
            )
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true.", param="stream_options")

    def params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        num_prompt: int,
        max_tokens_param: str = "max_tokens",
        logprobs: int | None = None,
        echo: bool = False,
    ) -> SamplingParams:
        """The request's decode settings; context-length checks as vLLM does them."""
        if logprobs is not None and not self.can_score:
            raise APIError(400, "This engine cannot report log-probs.", param="logprobs")
        if num_prompt == 0:
            raise APIError(400, "The prompt is empty.", param="prompt")
        room = self.max_model_len - num_prompt
        if room <= 0 and not (echo and max_tokens == 0):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens.",
                param="prompt" if max_tokens_param == "max_tokens" else "messages",
                code="context_length_exceeded",
            )
        if max_tokens == 0 and not echo:
            raise APIError(
                400, f"{max_tokens_param} must be at least 1 (0 only with echo).", param=max_tokens_param
            )
        if max_tokens is None:
            max_tokens = min(self.cfg.max_tokens_default, room)
        elif max_tokens > max(room, 0):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion).",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        d = self.decode
        temperature = d.temperature if req.temperature is None else req.temperature
        top_k = d.top_k if req.top_k is None else req.top_k
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
            top_p=max(d.top_p if req.top_p is None else req.top_p, MIN_TOP_P),
            top_k=max(top_k, 0),  # -1 (vLLM's "off") = 0
            stop=req.stop_list(),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            echo=echo,
        )

    def _check_length(self, text: str, param: str) -> None:
        """Reject a text whose prefix alone is over the context (see PREFIX_CHARS_PER_TOKEN)."""
        cut = PREFIX_CHARS_PER_TOKEN * self.max_model_len
        if len(text) <= cut:
            return
        num = len(encode_text(self.tokenizer, text[:cut])) - PREFIX_MARGIN_TOKENS
        if num > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has more than {num} tokens.",
                param=param,
                code="context_length_exceeded",
            )

    def _encode_text(self, text: str) -> list[int]:
        try:
            self._check_length(text, "prompt")
            return encode_text(self.tokenizer, text)
        except APIError:
            raise
        except Exception as exc:  # the tokenizer refused the text
            raise APIError(400, f"The prompt could not be tokenised: {exc}", param="prompt") from exc

    def _encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        try:
            self._check_length("\n".join(text for _, text in messages), "messages")
            return encode_chat(self.tokenizer, messages, self.chat_template_kwargs)
        except APIError:
            raise
        except Exception as exc:  # e.g. a chat template that rejects the role order
            raise APIError(400, f"The messages could not be rendered: {exc}", param="messages") from exc

    async def completion_prompt(self, req: CompletionRequest) -> tuple[list[int], str]:
        """(prompt ids, prompt text for echo). Tokenisation runs in a thread: the event loop keeps serving."""
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"Batched prompts ({len(prompt)}) are not supported; send one per request.",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await asyncio.to_thread(self._encode_text, prompt), prompt
        ids = list(prompt)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"Prompt token ids must be in [0, {self.vocab_size}).", param="prompt")
        return ids, decode_ids(self.tokenizer, ids) if req.echo else ""

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        return await asyncio.to_thread(self._encode_chat, [(m.role, m.text()) for m in req.messages])

    # ------------------------------------------------------------------ generation
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        try:
            return self.worker.submit(prompt_ids, params)
        except QueueFullError as exc:
            raise APIError(
                503,
                str(exc),
                type="service_unavailable_error",
                code="queue_full",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from exc
        except RequestTooLargeError as exc:
            raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from exc

    async def run(self, job: Job, stop: list[str]) -> AsyncIterator[tuple[str, int]]:
        """(text delta, tokens in the step) for each decode step, then ("", 0) with the held-back tail; records
        metrics. On exit (end, error, or the consumer going away) the job is cancelled, which frees the worker
        within one decode step."""
        m, name = self.metrics, self.cfg.model_name
        assembler = TextAssembler(self.tokenizer, stop)
        job.result = res = _Result()
        last, failed = None, False
        try:
            async for chunk in job.chunks():
                t = time.perf_counter()
                if last is None:
                    m.ttft.labels(name).observe(t - job.submitted)
                else:
                    m.observe_chunk(t - last, len(chunk))
                last = t
                res.num_tokens += len(chunk)
                yield assembler.add(chunk), len(chunk)
                if assembler.stopped:
                    break
            if job.cancelled.is_set() and not assembler.stopped:
                return  # cancelled from outside (client gone): an abort, no text owed
            tail = assembler.finish()
            if tail:
                yield tail, 0
            p = job.params
            on_eos = bool(assembler.ids) and not p.ignore_eos and assembler.ids[-1] in self.eos_ids
            at_limit = res.num_tokens >= p.max_new_tokens
            res.finish_reason = "stop" if assembler.stopped or on_eos or not at_limit else "length"
            res.text = assembler.text
        except Exception:
            failed = True
            raise
        finally:
            job.cancel()
            if failed:
                m.request_errors.labels(name).inc()
            else:
                m.request_success.labels(name, res.finish_reason or "abort").inc()
            m.prompt_tokens.labels(name).inc(len(job.prompt_ids))
            m.generation_tokens.labels(name).inc(res.num_tokens)
            m.e2e.labels(name).observe(time.perf_counter() - job.submitted)

    async def collect(self, request: Request, job: Job, stop: list[str]) -> _Result:
        """Run a non-streamed generation; a client that disconnects meanwhile cancels it. A generation error
        is a 500 with an error body (the connection stays usable)."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            async with aclosing(self.run(job, stop)) as deltas:
                async for _ in deltas:
                    pass
        except Exception as exc:
            log.exception("generation failed")
            raise APIError(500, f"Internal error: {exc}", type="internal_error") from exc
        finally:
            watcher.cancel()
        return job.result


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_error(exc: Exception) -> str:
    log.exception("generation failed")
    return _sse(error_body(f"Internal error: {exc}", type="internal_error"))


class _CancellingStream(StreamingResponse):
    """SSE response that cancels its generation however the response ends (client gone, error, done)."""

    def __init__(self, content, job: Job) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.cancel()
            await self.body_iterator.aclose()  # runs the generator's cleanup now (metrics), not at GC time


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a chunked body passes the limit; FastAPI re-raises HTTP exceptions from body
    parsing, so it reaches the HTTP error handler as a 413 that closes the connection (the rest is unread)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"The request body is larger than {limit} bytes.", headers={"Connection": "close"}
        )


class _Guard:
    """The outermost layer (pure ASGI). A body over `max_body` bytes gets a 413 at once (by Content-Length, or as
    soon as a chunked body passes the limit); an exception that escapes before the response starts becomes a 500
    with an error body and `Connection: close`, so the client's next request opens a fresh connection instead of
    failing on a reset one."""

    def __init__(self, app, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._error(send, 413 if length.isdigit() else 400)
            return
        received, started = 0, False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _BodyTooLarge(self.max_body)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception as exc:
            too_large = isinstance(exc, _BodyTooLarge)
            if not too_large:
                log.exception("request failed")
            if started:
                raise  # mid-response: the server closes the connection, the only honest end
            await self._error(send, 413 if too_large else 500, exc)

    async def _error(self, send, status: int, exc: Exception | None = None) -> None:
        if status == 413:
            err = APIError(
                413, f"The request body is larger than {self.max_body} bytes.", code="body_too_large"
            )
        elif status == 400:
            err = APIError(400, "Invalid Content-Length header.")
        else:
            err = APIError(500, f"Internal error: {exc}", type="internal_error")
        body = _ErrorJSON(err.body()).body
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _validation_response(st: _Server, request: Request, exc: RequestValidationError) -> JSONResponse:
    """A request body that does not validate -> 400 with an OpenAI error (its `param`, the first error's message,
    and how many more there are); a missing or wrong key still gets its 401 first."""
    try:
        st.check_auth(request)  # the body is parsed before dependencies run: a missing key still wins
    except APIError as err:
        return _error_response(err)
    errors = exc.errors()
    first = errors[0] if errors else {}
    cause = first.get("ctx", {}).get("error")
    if first.get("type") == "json_invalid":
        msg, param = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    elif isinstance(cause, InvalidUnicode):
        msg, param = str(cause), cause.param
    else:
        param = error_param(first.get("loc", ()), (CompletionRequest, ChatCompletionRequest))
        msg = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more errors)"
    return _error_response(APIError(400, msg, param=param, code=first.get("type")))


def create_app(
    engine: Engine,
    tokenizer,
    server: ServerConfig | None = None,
    decode: DecodeConfig | None = None,
    max_model_len: int = 2048,
    chat_template_kwargs: dict | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`. The worker thread starts now and stops at app shutdown.
    chat_template_kwargs: extra chat-template variables for /v1/chat/completions (data.chat_template_kwargs)."""
    st = _Server(engine, tokenizer, server or ServerConfig(), decode or DecodeConfig(), max_model_len)
    st.chat_template_kwargs = dict(chat_template_kwargs or {})

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        st.worker.close()

    app = FastAPI(title="resispec", version="0.1.0", lifespan=lifespan)
    app.state.server = st
    app.add_middleware(_Guard, max_body=st.cfg.max_body_bytes)
    app.openapi = openapi_builder(app, st)
    # auth runs as a dependency, i.e. before the body is validated: no key -> 401 even for a bad body
    auth = [Depends(st.check_auth)]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(st, request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "body_too_large" if exc.status_code == 413 else str(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return _error_response(err)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {
            "id": st.cfg.model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "resispec",
            "max_model_len": st.max_model_len,
        }

    @app.get("/v1/models", dependencies=auth, responses=responses(401))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=responses(401, 404))
    async def model(model_id: str) -> dict:
        st.check_model(model_id)
        return model_card()

    generation_errors = responses(400, 401, 404, 413, 500, 503, stream=True)

    @app.post("/v1/completions", dependencies=auth, responses=generation_errors)
    async def completions(req: CompletionRequest, request: Request):
        return await _completions(st, req, request)

    @app.post("/v1/chat/completions", dependencies=auth, responses=generation_errors)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await _chat_completions(st, req, request)

    return app


def _reply(rid: str, kind: str, created: int, model: str, **choice) -> dict:
    """An OpenAI response or stream chunk of one choice (index 0, its fields in `choice`'s order)."""
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [{"index": 0, **choice}],
    }


def _sse_stream(
    st: _Server,
    req: CompletionRequest | ChatCompletionRequest,
    job: Job,
    stop: list[str],
    prompt_len: int,
    empty: Callable[[str | None], dict],
    piece: Callable[[str, int], dict | None],
    opening: Callable[[], dict] | None = None,
    lazy_opening: bool = True,
) -> StreamingResponse:
    """The SSE response of one streamed choice, for both endpoints: `opening` (the echo, the chat role) first, at
    once or (`lazy_opening`) with the first delta; a chunk per delta that `piece` makes one of; `empty(finish)`, the
    chunk with no text, closing with the finish reason; the usage chunk when asked (stream_options.include_usage),
    and `[DONE]`. An error after the stream has started is reported in-band."""
    with_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        extra = {"usage": None} if with_usage else {}
        opened = opening is None
        try:
            if not opened and not lazy_opening:
                opened = True
                yield _sse({**opening(), **extra})
            async with aclosing(st.run(job, stop)) as deltas:
                async for delta, num_tokens in deltas:
                    if not opened:
                        opened = True
                        yield _sse({**opening(), **extra})
                    out = piece(delta, num_tokens)
                    if out is not None:
                        yield _sse({**out, **extra})
            if not opened:
                yield _sse({**opening(), **extra})
            yield _sse({**empty(job.result.finish_reason), **extra})
            if with_usage:
                yield _sse(
                    {
                        **empty(None),
                        "choices": [],
                        "usage": usage(prompt_len, job.result.num_tokens, job.stats),
                    }
                )
        except Exception as exc:  # the stream has started: report in-band
            yield _sse_error(exc)
        yield "data: [DONE]\n\n"

    return _CancellingStream(events(), job)


async def _completions(st: _Server, req: CompletionRequest, request: Request):
    """POST /v1/completions: one completion, whole or streamed (SSE); echo and log-probs as OpenAI's legacy API."""
    st.check_common(req)
    prompt_ids, prompt_text = await st.completion_prompt(req)
    params = st.params(req, req.max_tokens, len(prompt_ids), logprobs=req.logprobs, echo=req.echo)
    rid, created, model = new_id("cmpl"), now(), st.cfg.model_name
    job = st.submit(prompt_ids, params)
    echo = prompt_text if req.echo else ""
    scored = 0  # emitted tokens whose log-probs are sent
    offset = len(echo)  # text offset of the next scored token

    def logprobs(num_tokens: int, prompt: bool = False) -> dict | None:
        nonlocal scored, offset
        if req.logprobs is None:
            return None
        entries = list(job.prompt_logprobs or []) if prompt else []
        start = 0 if prompt else offset
        entries += job.logprobs[scored : scored + num_tokens]
        scored += num_tokens
        out = completion_logprobs(entries, st.token_text, start)
        if not prompt:
            offset += sum(len(t) for t in out["tokens"])
        return out

    def body(text: str, finish: str | None, lp: dict | None = None) -> dict:
        return _reply(rid, "text_completion", created, model, text=text, logprobs=lp, finish_reason=finish)

    if not req.stream:
        res = await st.collect(request, job, params.stop)
        return {
            **body(echo + res.text, res.finish_reason, logprobs(res.num_tokens, prompt=req.echo)),
            "usage": usage(len(prompt_ids), res.num_tokens, job.stats),
        }
    echo_chunk = (lambda: body(echo, None, logprobs(0, prompt=True))) if req.echo else None

    def piece(delta: str, num_tokens: int) -> dict | None:
        if delta or (num_tokens and req.logprobs is not None):
            return body(delta, None, logprobs(num_tokens))
        return None

    # the prompt's log-probs exist once the worker has started the job: the echo goes with the first delta
    return _sse_stream(
        st, req, job, params.stop, len(prompt_ids), lambda f: body("", f), piece, echo_chunk, True
    )


async def _chat_completions(st: _Server, req: ChatCompletionRequest, request: Request):
    """POST /v1/chat/completions: one chat reply, whole or streamed (SSE), with OpenAI's chat log-probs."""
    st.check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    prompt_ids = await st.chat_prompt(req)
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    params = st.params(req, max_tokens, len(prompt_ids), max_param, logprobs=num_top)
    rid, created, model = new_id("chatcmpl"), now(), st.cfg.model_name
    job = st.submit(prompt_ids, params)
    scored = 0

    def logprobs(num_tokens: int) -> dict | None:
        nonlocal scored
        if num_top is None:
            return None
        entries = job.logprobs[scored : scored + num_tokens]
        scored += num_tokens
        return chat_logprobs(entries, st.token_text)

    def chunk(delta: dict, finish: str | None, lp: dict | None = None) -> dict:
        return _reply(
            rid, "chat.completion.chunk", created, model, delta=delta, logprobs=lp, finish_reason=finish
        )

    if not req.stream:
        res = await st.collect(request, job, params.stop)
        message = {"role": "assistant", "content": res.text}
        lp = logprobs(res.num_tokens)
        return {
            **_reply(
                rid,
                "chat.completion",
                created,
                model,
                message=message,
                logprobs=lp,
                finish_reason=res.finish_reason,
            ),
            "usage": usage(len(prompt_ids), res.num_tokens, job.stats),
        }

    def piece(delta: str, num_tokens: int) -> dict | None:
        if delta or (num_tokens and num_top is not None):
            return chunk({"content": delta}, None, logprobs(num_tokens))
        return None

    def role() -> dict:
        return chunk({"role": "assistant", "content": ""}, None)

    return _sse_stream(st, req, job, params.stop, len(prompt_ids), lambda f: chunk({}, f), piece, role, False)
