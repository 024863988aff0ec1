"""Schemathesis hooks for scripts/fuzz_server.sh (loaded by the fuzzer's own venv, SCHEMATHESIS_HOOKS).

One failure is the server's by design, and only that one is dropped: a schema-valid request answered with the 400
whose code is `context_length_exceeded` (the tokenized prompt plus `max_tokens` is over the context, or the prompt
alone is). OpenAI and vLLM answer it the same way, and no JSON Schema can state it: it depends on the prompt's length
in tokens. Any other status, or a 400 with any other code, still fails the run. The CLI prints how many failures
were dropped ("dropped by `filter_failure`").
"""

import schemathesis

BY_DESIGN = "context_length_exceeded"


@schemathesis.hook
def filter_failure(ctx, failure, case, response) -> bool:
    """True keeps the failure: everything except a schema-valid request rejected for its length."""
    if failure.code != "ST202" or response.status_code != 400:
        return True
    try:
        return response.json()["error"]["code"] != BY_DESIGN
    except (ValueError, KeyError, TypeError):  # not this server's error body: keep it
        return True
