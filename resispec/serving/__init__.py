"""The OpenAI-compatible server (F4: imports decoding, data, models, verify and the ground floor; nothing in the
library imports it but the benchmark).

- app.py: `create_app(engine, tokenizer, server, decode, max_model_len)`, the FastAPI app over any `Engine`;
  openapi.py its OpenAPI document; protocol.py the request/response models; text.py the text <-> ids helpers;
- worker.py: `Engine`, `DecoderEngine`, `SamplingParams`; scheduler.py the continuous-batching scheduler and
  policy.py its per-step speculation policy (cost models, the choice, the cost table); metrics.py, logprobs.py;
- server.py: `build_app(...)` / `serve(...)` load the configured pair and run it with uvicorn; config.py `ServerConfig`.

The measuring code (speed, load, vLLM peer) is `resispec.benchmark`; vLLM's process is `resispec.vllm_venv`.
"""
