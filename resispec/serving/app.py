"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`create_app(engine, tokenizer, server, decode, max_model_len)` wires an Engine (see worker.py) behind one
decoding worker thread. Model loading lives in `resispec.serving.server`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from resispec.decoding.config import DecodeConfig
from resispec.serving.config import ServerConfig
from resispec.serving.metrics import ServerMetrics
from resispec.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    new_id,
    now,
    usage,
)
from resispec.serving.text import TextAssembler, encode_chat, encode_text
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


@dataclass
class _Result:
    """What a finished (or cancelled) generation produced."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    chunks: list[str] = field(default_factory=list)


class _Server:
    """Per-app state and the request flow shared by both endpoints."""

    def __init__(
        self, engine: Engine, tokenizer, server: ServerConfig, decode: DecodeConfig, max_model_len: int
    ) -> None:
        self.tokenizer, self.cfg, self.decode, self.max_model_len = tokenizer, server, decode, max_model_len
        self.api_key = server.api_key or os.environ.get(API_KEY_ENV) or None
        self.metrics = ServerMetrics(server.model_name)
        self.worker = DecodeWorker(engine, max_queue=server.max_queue, metrics=self.metrics)
        self.vocab_size = len(tokenizer)
        eos = getattr(engine, "eos_token_id", None)
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
        self.created = now()

    # ------------------------------------------------------------------ checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.api_key):
            raise APIError(
                401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    def check_common(self, req: SamplingFields) -> None:
        if req.model != self.cfg.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist; this server serves `{self.cfg.model_name}`.",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise APIError(400, "Only n=1 is supported.", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise APIError(
                    400, f"{name} is not supported (the output follows the target exactly).", param=name
                )
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported.", param="logit_bias")

    def params(self, req: SamplingFields, max_tokens: int | None, num_prompt: int) -> SamplingParams:
        """The request's decode settings; context-length checks as vLLM does them."""
        if num_prompt == 0:
            raise APIError(400, "The prompt is empty.", param="prompt")
        room = self.max_model_len - num_prompt
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens.",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(self.cfg.max_tokens_default, room)
        elif max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        d = self.decode
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            stop=req.stop_list(),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
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
            return encode_text(self.tokenizer, prompt)
        ids = list(prompt)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"Prompt token ids must be in [0, {self.vocab_size}).", param="prompt")
        return ids

    # ------------------------------------------------------------------ generation
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        try:
            return self.worker.submit(prompt_ids, params)
        except QueueFullError as exc:
            raise APIError(503, str(exc), type="service_unavailable_error", code="queue_full") from exc
        except RequestTooLargeError as exc:
            raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from exc

    async def run(self, job: Job, stop: list[str]) -> AsyncIterator[str]:
        """Text deltas of one generation; records latency metrics. On exit (end, error, or the consumer going
        away) the job is cancelled, which frees the worker within one decode step."""
        m, name = self.metrics, self.cfg.model_name
        assembler = TextAssembler(self.tokenizer, stop)
        job.result = res = _Result()
        last = None
        try:
            async for chunk in job.chunks():
                t = time.perf_counter()
                if last is None:
                    m.ttft.labels(name).observe(t - job.submitted)
                else:
                    m.observe_chunk(t - last, len(chunk))
                last = t
                res.num_tokens += len(chunk)
                delta = assembler.add(chunk)
                if delta:
                    yield delta
                if assembler.stopped:
                    break
            if job.cancelled.is_set() and not assembler.stopped:
                return  # cancelled from outside (client gone): an abort, no text owed
            tail = assembler.finish()
            if tail:
                yield tail
            p = job.params
            on_eos = bool(assembler.ids) and not p.ignore_eos and assembler.ids[-1] in self.eos_ids
            at_limit = res.num_tokens >= p.max_new_tokens
            res.finish_reason = "stop" if assembler.stopped or on_eos or not at_limit else "length"
            res.text = assembler.text
        finally:
            job.cancel()
            m.request_success.labels(name, res.finish_reason or "abort").inc()
            m.prompt_tokens.labels(name).inc(len(job.prompt_ids))
            m.generation_tokens.labels(name).inc(res.num_tokens)
            m.e2e.labels(name).observe(time.perf_counter() - job.submitted)

    async def collect(self, request: Request, job: Job, stop: list[str]) -> _Result:
        """Run a non-streamed generation; a client that disconnects meanwhile cancels it."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            async with aclosing(self.run(job, stop)) as deltas:
                async for _ in deltas:
                    pass
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


def create_app(
    engine: Engine,
    tokenizer,
    server: ServerConfig | None = None,
    decode: DecodeConfig | None = None,
    max_model_len: int = 2048,
) -> FastAPI:
    """The FastAPI app serving `engine`. The worker thread starts now and stops at app shutdown."""
    st = _Server(engine, tokenizer, server or ServerConfig(), decode or DecodeConfig(), max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        st.worker.close()

    app = FastAPI(title="resispec", version="0.1.0", lifespan=lifespan)
    app.state.server = st
    # auth runs as a dependency, i.e. before the body is validated: no key -> 401 even for a bad body
    auth = [Depends(st.check_auth)]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg, param = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        else:
            param = ".".join(loc) or None
            msg = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
            if len(errors) > 1:
                msg += f" (and {len(errors) - 1} more errors)"
        return JSONResponse(error_body(msg, param=param, code=first.get("type")), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"Internal error: {exc}", type="internal_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": st.cfg.model_name,
                    "object": "model",
                    "created": st.created,
                    "owned_by": "resispec",
                    "max_model_len": st.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, request: Request):
        st.check_common(req)
        if req.echo or req.logprobs is not None:
            raise APIError(
                400, "echo and logprobs are not supported.", param="echo" if req.echo else "logprobs"
            )
        prompt_ids = st.completion_prompt(req)
        params = st.params(req, req.max_tokens, len(prompt_ids))
        rid, created, model = new_id("cmpl"), now(), st.cfg.model_name
        job = st.submit(prompt_ids, params)

        def body(text: str, finish: str | None) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }

        if not req.stream:
            res = await st.collect(request, job, params.stop)
            return {**body(res.text, res.finish_reason), "usage": usage(len(prompt_ids), res.num_tokens)}
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            extra = {"usage": None} if with_usage else {}
            try:
                async with aclosing(st.run(job, params.stop)) as deltas:
                    async for delta in deltas:
                        yield _sse({**body(delta, None), **extra})
                yield _sse({**body("", job.result.finish_reason), **extra})
                if with_usage:
                    yield _sse(
                        {
                            **body("", None),
                            "choices": [],
                            "usage": usage(len(prompt_ids), job.result.num_tokens),
                        }
                    )
            except Exception as exc:  # the stream has started: report in-band
                log.exception("generation failed")
                yield _sse(error_body(f"Internal error: {exc}", type="internal_error"))
            yield "data: [DONE]\n\n"

        return _CancellingStream(events(), job)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        st.check_common(req)
        if req.logprobs:
            raise APIError(400, "logprobs are not supported.", param="logprobs")
        prompt_ids = encode_chat(st.tokenizer, [(m.role, m.text()) for m in req.messages])
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = st.params(req, max_tokens, len(prompt_ids))
        rid, created, model = new_id("chatcmpl"), now(), st.cfg.model_name
        job = st.submit(prompt_ids, params)

        def chunk(delta: dict, finish: str | None) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        if not req.stream:
            res = await st.collect(request, job, params.stop)
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": res.text},
                        "logprobs": None,
                        "finish_reason": res.finish_reason,
                    }
                ],
                "usage": usage(len(prompt_ids), res.num_tokens),
            }
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            extra = {"usage": None} if with_usage else {}
            try:
                yield _sse({**chunk({"role": "assistant", "content": ""}, None), **extra})
                async with aclosing(st.run(job, params.stop)) as deltas:
                    async for delta in deltas:
                        yield _sse({**chunk({"content": delta}, None), **extra})
                yield _sse({**chunk({}, job.result.finish_reason), **extra})
                if with_usage:
                    yield _sse(
                        {
                            **chunk({}, None),
                            "choices": [],
                            "usage": usage(len(prompt_ids), job.result.num_tokens),
                        }
                    )
            except Exception as exc:
                log.exception("generation failed")
                yield _sse(error_body(f"Internal error: {exc}", type="internal_error"))
            yield "data: [DONE]\n\n"

        return _CancellingStream(events(), job)

    return app
