"""OpenAI request shapes (pydantic) and the OpenAI-style error body.

Types are strict, like the OpenAI API: `max_tokens: true`, `temperature: "0.5"` or `stream: "yes"` are a 400, never
coerced. Fields this server does not know are ignored (as vLLM does), so the official `openai` client works
unchanged; fields OpenAI has and we cannot honour (n > 1, best_of > 1, suffix, tools, response_format, penalties,
logit_bias, batched prompts) are accepted only at their neutral values and otherwise rejected with a 400, never
silently ignored (`UNSUPPORTED`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# seeds are signed 64-bit integers (as vLLM and torch take them)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# the most alternatives `logprobs` / `top_logprobs` may ask for (vLLM's default max_logprobs, OpenAI's limit)
MAX_LOGPROBS = 20
# top_k beyond this is "no top-k" anyway (no vocabulary is this large); bounded so it fits every integer type
MAX_TOP_K = 2**31 - 1

_STRICT = ConfigDict(extra="ignore", strict=True)


def _integral(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer; so do we. Anything else (true, "3", 3.5) stays for strict validation."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# an integer as JSON Schema means it: 3 or 3.0, never true or "3"
Int = Annotated[int, BeforeValidator(_integral)]


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    """The error body's schema (documented in /openapi.json for every 4xx/5xx)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _bad_string(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) in `value` that is not valid Unicode (a lone UTF-16
    surrogate such as "\\ud800", which JSON can escape but no tokenizer can encode; "" for the top level), else
    None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if _bad_string(k, path) is not None:
                return path
            if (sub := _bad_string(v, f"{path}.{k}" if path else str(k))) is not None:
                return sub
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (sub := _bad_string(v, f"{path}[{i}]")) is not None:
                return sub
    return None


# the request fields whose text the server uses (a lone surrogate in an ignored field is as harmless as the field)
_TEXT_FIELDS = ("model", "prompt", "messages", "stop", "user", "suffix")


def _bad_text(data: Any) -> str | None:
    """`_bad_string` over the text fields of a request body (token-id prompts are skipped: no text, and a string
    hidden among the ids fails validation anyway; walking two million ids would cost seconds)."""
    if not isinstance(data, dict):
        return None
    for key in _TEXT_FIELDS:
        value = data.get(key)
        if key == "prompt" and isinstance(value, list) and value and not isinstance(value[0], str):
            continue
        if (bad := _bad_string(value, key)) is not None:
            return bad
    return None


class InvalidUnicode(ValueError):
    def __init__(self, path: str) -> None:
        super().__init__(
            f"{path or 'body'}: a string is not valid Unicode (it contains a lone UTF-16 surrogate)."
        )
        self.param = path or None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share. Ranges follow OpenAI's API reference."""

    model_config = _STRICT
    model: str
    max_tokens: Int | None = Field(default=None, ge=0)  # 0 only with echo (scoring the prompt)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Int | None = Field(default=None, ge=-1, le=MAX_TOP_K)  # vLLM's extra field; 0 or -1 = off
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: Int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extra field: generate max_tokens tokens even past EOS
    user: str | None = None
    # accepted only at their neutral values: the output is exactly the target's (sampled) distribution
    presence_penalty: float = Field(default=0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # OpenAI fields we cannot honour: declared loosely so any value validates, then rejected unless neutral
    best_of: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (bad := _bad_text(data)) is not None:
            raise InvalidUnicode(bad)
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


def _neutral(*schemas: dict) -> dict:
    return {"anyOf": [*schemas, {"type": "null"}], "description": "Not supported: only the neutral value."}


# The JSON schema /openapi.json gives each unsupported field: exactly the values that are accepted.
NEUTRAL_SCHEMAS: dict[str, dict] = {
    "n": {"type": "integer", "enum": [1], "default": 1, "description": "Only 1."},
    "best_of": _neutral({"type": "integer", "enum": [1]}),
    "suffix": _neutral({"type": "string", "enum": [""]}),
    "presence_penalty": {"type": "number", "enum": [0], "default": 0, "description": "Only 0."},
    "frequency_penalty": {"type": "number", "enum": [0], "default": 0, "description": "Only 0."},
    "logit_bias": _neutral({"type": "object", "maxProperties": 0}),
    "tools": _neutral({"type": "array", "maxItems": 0}),
    "functions": _neutral({"type": "array", "maxItems": 0}),
    "tool_choice": _neutral({"type": "string", "enum": ["none"]}),
    "function_call": _neutral({"type": "string", "enum": ["none"]}),
    "response_format": _neutral(
        {
            "type": "object",
            "properties": {"type": {"type": "string", "enum": ["text"]}},
            "required": ["type"],
            "additionalProperties": False,
        }
    ),
}

# field -> (is the value neutral?, what to say): exactly the values NEUTRAL_SCHEMAS accepts ("" is not an empty
# list). Checked by the app after validation, in this order.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v == 1, "Only n=1 is supported."),
    "best_of": (lambda v: v is None or v == 1, "Only best_of=1 is supported."),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported."),
    "presence_penalty": (
        lambda v: v == 0,
        "presence_penalty is not supported (the output follows the target).",
    ),
    "frequency_penalty": (
        lambda v: v == 0,
        "frequency_penalty is not supported (the output follows the target).",
    ),
    "logit_bias": (lambda v: v is None or v == {}, "logit_bias is not supported."),
    "tools": (lambda v: v is None or v == [], "tools (function calling) are not supported."),
    "tool_choice": (lambda v: v in (None, "none"), "tool_choice is not supported."),
    "functions": (lambda v: v is None or v == [], "functions (function calling) are not supported."),
    "function_call": (lambda v: v in (None, "none"), "function_call is not supported."),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        'response_format is not supported (only {"type": "text"}).',
    ),
}


class CompletionRequest(SamplingFields):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: Any = None


class ChatContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, stats=None) -> dict:
    """OpenAI's usage object; with the request's DecodeStats from a server with a prefix cache, also
    prompt_tokens_details.cached_tokens (the prompt tokens whose K/V was reused, as OpenAI and vLLM report it)."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    cached = getattr(stats, "cached_prompt_tokens", 0)
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out
