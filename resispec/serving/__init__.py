"""Serving and the end-to-end benchmark.

- `create_app(engine, tokenizer, server, decode, max_model_len)`: the OpenAI-compatible FastAPI app over any
  `Engine` (worker.py); `build_app(...)` / `serve(...)` load the configured pair and run it with uvicorn.
- `run_bench(bench, decode, target, draft, world, data, logger, output_dir)`: AR vs every rule x tree (per draft)
  and HF assisted generation; writes report.md, report.json, speedup.png and returns the `BenchRow`s.
- `run_load_test(url, prompts, bench)`: N concurrent streaming clients against a local server.

Imports are lazy so `import resispec.serving` stays light (the config module is imported by every script).
"""

from __future__ import annotations

_EXPORTS = {
    "create_app": "resispec.serving.app",
    "build_app": "resispec.serving.server",
    "build_engine": "resispec.serving.server",
    "serve": "resispec.serving.server",
    "BenchRow": "resispec.serving.bench",
    "bench_pair": "resispec.serving.bench",
    "run_bench": "resispec.serving.bench",
    "write_report": "resispec.serving.bench",
    "LoadTestResult": "resispec.serving.loadtest",
    "run_load_test": "resispec.serving.loadtest",
    "DecoderEngine": "resispec.serving.worker",
    "Engine": "resispec.serving.worker",
    "SamplingParams": "resispec.serving.worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'resispec.serving' has no attribute {name!r}")
