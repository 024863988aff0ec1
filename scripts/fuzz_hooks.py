"""Schemathesis hooks for scripts/fuzz_server.sh (loaded by the fuzzer's own venv, SCHEMATHESIS_HOOKS).

One failure is the server's by design, and only that one is dropped: a schema-valid request answered with the 400
whose code is `context_length_exceeded` (the tokenized prompt plus `max_tokens` is over the context, or the prompt
alone is). OpenAI and vLLM answer it the same way, and no JSON Schema can state it: it depends on the prompt's length
in tokens. Any other status, or a 400 with any other code, still fails the run. The CLI prints how many failures
were dropped ("dropped by `filter_failure`").

GET /v1/models/{model_id} is asked for the served model (RESISPEC_FUZZ_MODEL, set by the script) for half of the
drawn ids, so its 200 is fuzzed as well as its 404 (a random id is never the served one).
"""

import os

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


@schemathesis.hook
def map_path_parameters(ctx, path_parameters):
    """The served model's id in place of the drawn one when the drawn one has an even length (deterministic, as
    Hypothesis needs)."""
    model = os.environ.get("RESISPEC_FUZZ_MODEL")
    if model and path_parameters and len(str(path_parameters.get("model_id", "x"))) % 2 == 0:
        path_parameters = {**path_parameters, "model_id": model}
    return path_parameters
