"""The server's OpenAPI document: FastAPI's schema without its 422 (validation errors are answered with 400), with
this server's own limits written into the request schemas (`document_limits`), the error statuses each route sends
(`responses`), and the OpenAI `param` of a pydantic error location (`error_param`).

`st` below is the app's server state (app.py): `cfg` (ServerConfig), `max_model_len`, `vocab_size`, `tokenizer`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from resispec.serving.protocol import NEUTRAL_SCHEMAS, SEED_MAX, SEED_MIN, ErrorResponse
from resispec.serving.text import encode_text


def error_param(loc: tuple, models: tuple[type, ...]) -> str | None:
    """A pydantic error location -> an OpenAI `param` ("messages[0].role"), without pydantic's union tags
    ("prompt.str", "stop.list[str]")."""
    names = {name for model in models for name in field_names(model)}
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:
            out += f".{part}" if out else part
    return out or None


def field_names(model: type) -> set[str]:
    names: set[str] = set()
    for name, f in getattr(model, "model_fields", {}).items():
        names.add(name)
        for arg in type_args(f.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                names |= field_names(arg)
    return names


def type_args(tp) -> list:
    args = list(typing.get_args(tp))
    return [tp] + [a for arg in args for a in type_args(arg)]


ERROR_STATUSES = {
    400: "Invalid request (OpenAI error body).",
    401: "Missing or wrong API key.",
    404: "Unknown model.",
    413: "Request body too large.",
    500: "Generation failed (OpenAI error body).",
    503: "The request queue is full; retry after `Retry-After` seconds.",
}


def responses(*statuses: int, stream: bool = False) -> dict[int | str, dict]:
    """OpenAPI `responses` for a route: the error statuses it sends (each with the error body), and for the
    generation endpoints the SSE stream."""
    out: dict[int | str, dict] = {
        s: {"model": ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses
    }
    if 503 in out:
        out[503]["headers"] = {"Retry-After": {"schema": {"type": "string"}}}
    if stream:
        out[200] = {
            "description": "The completion (JSON), or with `stream: true` server-sent events, each line "
            "`data: <chunk JSON>`, ending with `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    return out


BOUND_NAMES = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def document_limits(schemas: dict, st) -> None:
    """Write this server's own limits into the request schemas, so a client (or a schema-driven fuzzer) can read
    what is accepted: the one model id, the neutral values of unsupported fields, stop-string bounds, exact
    integer bounds (pydantic spells them as floats, and 2^63 - 1 does not survive that)."""
    stop = {"type": "string", "maxLength": st.cfg.max_stop_length}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [st.cfg.model_name], "title": "Model"}
        props["seed"] = {
            "anyOf": [{"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}, {"type": "null"}]
        }
        props["stop"] = {
            "anyOf": [
                stop,
                {"type": "array", "items": stop, "maxItems": st.cfg.max_stop_strings},
                {"type": "null"},
            ]
        }
        for field_name, neutral in NEUTRAL_SCHEMAS.items():
            if field_name in props:
                props[field_name] = neutral
        for field_schema in props.values():
            for sub in field_schema.get("anyOf", [field_schema]):
                # pydantic leaves the bounds of an annotated int (`Int`) under its own names (ge, le, ...),
                # which JSON Schema ignores: spell them as JSON Schema's
                for ours, theirs in BOUND_NAMES.items():
                    if ours in sub:
                        sub[theirs] = sub.pop(ours)
                for bound in ("minimum", "maximum"):
                    if sub.get("type") == "integer" and isinstance(sub.get(bound), float):
                        sub[bound] = int(sub[bound])
    # at most the context less one prompt token (a longer prompt leaves less room: then a 400, as vLLM answers)
    most = st.max_model_len - 1
    schemas["CompletionRequest"]["properties"]["max_tokens"] = {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": most}, {"type": "null"}]
    }
    chat = schemas["ChatCompletionRequest"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):  # 0 is for echo, which chat has not
        chat[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": most}, {"type": "null"}]}
    # the rules that tie two fields (OpenAI's, answered with a 400), in JSON Schema's if / then
    for name, rules in (
        (
            "CompletionRequest",
            [("stream_options", {"type": "object"}, "stream"), ("max_tokens", {"const": 0}, "echo")],
        ),
        (
            "ChatCompletionRequest",
            [
                ("stream_options", {"type": "object"}, "stream"),
                ("top_logprobs", {"type": "integer"}, "logprobs"),
            ],
        ),
    ):
        schemas[name]["allOf"] = [
            {
                "if": {"properties": {field: value}, "required": [field]},
                "then": {"properties": {needs: {"const": True}}, "required": [needs]},
            }
            for field, value, needs in rules
        ]
    token_id = {"type": "integer", "minimum": 0, "maximum": st.vocab_size - 1}
    # an empty string is a prompt when the tokenizer adds a BOS token to it (as vLLM accepts it), else a 400
    empty_text = 0 if encode_text(st.tokenizer, "") else 1
    schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"] = [
        {"type": "string", "minLength": empty_text},
        {"type": "array", "items": token_id, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": empty_text}, "minItems": 1, "maxItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": token_id, "minItems": 1},
            "minItems": 1,
            "maxItems": 1,
        },
    ]


def openapi_builder(app: FastAPI, st) -> Callable[[], dict]:
    """The schema FastAPI builds, without its 422 (this server answers validation errors with 400), with this
    server's limits written in."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            document_limits(schemas, st)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
